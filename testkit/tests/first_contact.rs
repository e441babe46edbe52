//! No first-contact failure: any number of processes using a feature at once on a
//! database (or file) dblock has never seen get the feature's documented answer, never
//! an error from dblock's own set-up (its fencing table) — and on PostgreSQL not even
//! while a user's migration holds the migration lock throughout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;

use dblock_testkit::{MyDb, PgDatabase, SqliteDb, hold_migration_lock};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");
const PROCESSES: usize = 8;
const TRIALS: usize = 5;
const FEATURES: [&str; 7] = [
    "fenced", "try", "wait", "limit2", "lock-all", "status", "leader",
];

/// Runs `feature` in [`PROCESSES`] worker processes on `url`, all started at once (each
/// opens its handle, then all are told to go); their answers.
async fn at_once(url: &str, feature: &str) -> Vec<String> {
    let mut children = Vec::new();
    for i in 0..PROCESSES {
        let mut c = Command::new(WORKER)
            .args(["first-contact", url, feature, &i.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the worker opened its handle within 60 s")
            .unwrap();
        assert_eq!(ready.as_deref(), Some("ready"), "{feature}: {ready:?}");
        children.push((c, lines));
    }
    for (c, _) in &mut children {
        c.stdin.as_mut().unwrap().write_all(b"go\n").await.unwrap();
    }
    let mut answers = Vec::new();
    for (_, lines) in &mut children {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the worker answered within 60 s")
            .unwrap()
            .unwrap_or_else(|| "no answer (the worker died)".into());
        answers.push(line);
    }
    // Every answer in before any worker ends (a semaphore's holders hold till then).
    drop(children);
    answers
}

/// Every answer is the feature's documented one: `ok …`, and for a limit-2 semaphore at
/// most two slots.
fn check(backend: &str, trial: usize, feature: &str, answers: &[String]) {
    let errors: Vec<&String> = answers.iter().filter(|a| !a.starts_with("ok ")).collect();
    assert!(
        errors.is_empty(),
        "{backend}, trial {trial}, {feature}: {} of {PROCESSES} failed: {errors:?}",
        errors.len()
    );
    match feature {
        "fenced" | "try" => assert!(
            answers.iter().all(|a| a.starts_with("ok held")),
            "{backend} {feature}: distinct names are all free: {answers:?}"
        ),
        "limit2" => {
            let slots = answers.iter().filter(|a| a.starts_with("ok slot")).count();
            assert!(
                (1..=2).contains(&slots),
                "{backend}: {slots} slots of 2: {answers:?}"
            );
        }
        _ => {}
    }
}

/// PostgreSQL: a fresh database per trial and feature, in every other trial with a
/// session holding the migration lock all the while (a user's `dblock migrate` running
/// for minutes).
/// Before, a fenced try on a fresh database failed with "timed out waiting for the
/// migration lock" — at once when a migration ran, and often without one, racing the
/// other processes creating the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_at_once_on_a_fresh_postgres_database_get_their_answers() {
    for trial in 0..TRIALS {
        for feature in FEATURES {
            let db = PgDatabase::new(&format!("first_{trial}")).await;
            // Every other trial with a migration running all the while; the others race
            // only each other.
            let migrating = match trial % 2 {
                0 => Some(hold_migration_lock(&db.url).await),
                _ => None,
            };
            let answers = at_once(&db.url, feature).await;
            check("postgres", trial, feature, &answers);
            drop(migrating);
        }
    }
}

/// MySQL/MariaDB: a database of its own per trial and feature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_at_once_on_a_fresh_mysql_database_get_their_answers() {
    for trial in 0..TRIALS {
        for feature in FEATURES {
            let db = MyDb::new(&format!("first_{trial}")).await;
            let answers = at_once(&db.url, feature).await;
            check("mysql", trial, feature, &answers);
        }
    }
}

/// The embedded backend: a file that does not exist yet, per trial and feature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_at_once_on_a_fresh_sqlite_file_get_their_answers() {
    for trial in 0..TRIALS {
        for feature in FEATURES {
            let db = SqliteDb::new();
            assert!(!db.path.exists());
            let answers = at_once(&db.url, feature).await;
            check("sqlite", trial, feature, &answers);
        }
    }
}
