//! No first-contact failure from the command line: eight `dblock` processes started at
//! once on a database dblock has never seen, five fresh databases per backend, every
//! one of them answered as documented — on PostgreSQL while a user's migration holds
//! the migration lock throughout.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::Duration;

use dblock_testkit::{MyDb, PgDatabase, SqliteDb, exit_code as code, hold_migration_lock};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");
const PROCESSES: usize = 8;
const TRIALS: usize = 5;

/// `dblock ARGS(i)` in [`PROCESSES`] processes started together; their outputs.
async fn at_once(state: &std::path::Path, args: impl Fn(usize) -> Vec<String>) -> Vec<Output> {
    let children: Vec<_> = (0..PROCESSES)
        .map(|i| {
            dblock_testkit::dblock_command(DBLOCK, state)
                .env("DBLOCK_NO_DEFAULT_NOTICE", "1")
                .args(args(i))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut outs = Vec::new();
    for c in children {
        let out = tokio::time::timeout(Duration::from_secs(60), c.wait_with_output())
            .await
            .expect("dblock ended within 60 s")
            .unwrap();
        outs.push(out);
    }
    outs
}

async fn one_trial(backend: &str, url: &str, state: &std::path::Path) {
    // Distinct names, --no-wait: every one runs. (Before, on PostgreSQL: exit 69 "timed
    // out waiting for the migration lock (dblock creates its fencing table under it)".)
    let outs = at_once(state, |i| {
        [
            "run",
            "--db",
            url,
            "--no-wait",
            &format!("own-{i}"),
            "--",
            "true",
        ]
        .map(String::from)
        .to_vec()
    })
    .await;
    for o in &outs {
        assert_eq!(code(o), 0, "{backend}: run --no-wait: {o:?}");
    }
    // A limit-2 semaphore: at most two run at once (each counting the markers of those
    // running, its own included), the others are told all slots are held.
    let inside = tempfile::tempdir().unwrap();
    let section = format!(
        "touch {d}/$$; ls {d} | wc -l >> {d}.counts; sleep 0.3; rm {d}/$$",
        d = inside.path().display()
    );
    let outs = at_once(state, |_| {
        [
            "run",
            "--db",
            url,
            "--no-wait",
            "--limit",
            "2",
            "exports",
            "--",
            "sh",
            "-c",
            &section,
        ]
        .map(String::from)
        .to_vec()
    })
    .await;
    let ran = outs.iter().filter(|o| code(o) == 0).count();
    for o in &outs {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            code(o) == 0 || (code(o) == 75 && err.contains("all 2 slots held")),
            "{backend}: run --limit 2: {o:?}"
        );
    }
    assert!(ran >= 1, "{backend}: one ran at least");
    let counts = std::fs::read_to_string(format!("{}.counts", inside.path().display())).unwrap();
    let most = counts
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .max();
    assert!(
        most.is_some_and(|m| m <= 2),
        "{backend}: at most 2 at once: {counts:?}"
    );
    let _ = std::fs::remove_file(format!("{}.counts", inside.path().display()));
    // Status, and a waiting fenced run of one name each.
    let outs = at_once(state, |i| match i % 2 {
        0 => ["status", "--db", url].map(String::from).to_vec(),
        _ => ["run", "--db", url, "one", "--", "true"]
            .map(String::from)
            .to_vec(),
    })
    .await;
    for o in &outs {
        assert_eq!(code(o), 0, "{backend}: status / run: {o:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_dblock_processes_on_a_fresh_postgres_database_never_fail_in_set_up() {
    let state = tempfile::tempdir().unwrap();
    for trial in 0..TRIALS {
        let db = PgDatabase::new("first_cli").await;
        // Every other trial with a migration running all the while; the others race
        // only each other.
        let migrating = match trial % 2 {
            0 => Some(hold_migration_lock(&db.url).await),
            _ => None,
        };
        one_trial("postgres", &db.url, state.path()).await;
        drop(migrating);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_dblock_processes_on_a_fresh_mysql_database_never_fail_in_set_up() {
    let state = tempfile::tempdir().unwrap();
    for _ in 0..TRIALS {
        let db = MyDb::new("first_cli").await;
        one_trial("mysql", &db.url, state.path()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_dblock_processes_on_a_fresh_sqlite_file_never_fail_in_set_up() {
    let state = tempfile::tempdir().unwrap();
    for _ in 0..TRIALS {
        let db = SqliteDb::new();
        one_trial("sqlite", &db.url, state.path()).await;
    }
}
