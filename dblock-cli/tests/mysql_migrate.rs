//! `dblock migrate` on MySQL / MariaDB (`MYSQL_URL`), as real processes: the seeds'
//! experiment with its no-lock control, and the refusal after a crash between a
//! migration's DDL and its bookkeeping.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::Duration;

use dblock::sqlx::{self, MySqlPool};
use dblock_testkit::migrations::MigrationDir;
use dblock_testkit::{MyDb, eventually, exit_code as code, one_line_error};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

fn dir_arg(d: &MigrationDir) -> &str {
    d.path().to_str().unwrap()
}

fn applied(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("applied  "))
        .map(|l| l.split_whitespace().next().unwrap_or_default().to_string())
        .collect()
}

/// Six subsystems' start-up DDL in MySQL's dialect, each logging its file name to
/// `migration_log` so that a migration applied twice shows.
fn mysql_seed_set() -> Vec<(String, String)> {
    [
        "cron_state",
        "job_queue",
        "rate_limit",
        "session_store",
        "audit",
        "outbox",
    ]
    .iter()
    .enumerate()
    .map(|(i, sub)| {
        let file = format!("{:04}_{sub}.sql", i + 1);
        let sql = format!(
            "CREATE TABLE IF NOT EXISTS {sub} (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 k VARCHAR(64) NOT NULL, v TEXT, KEY {sub}_k (k)) ENGINE=InnoDB;\n\
                 ALTER TABLE {sub} COMMENT = 'owned by {sub}';\n\
                 INSERT INTO migration_log (file) VALUES ('{file}');\n"
        );
        (file, sql)
    })
    .collect()
}

async fn pool(db: &MyDb) -> MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(10)
        .connect(&db.url)
        .await
        .unwrap()
}

async fn log_count(p: &MySqlPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM migration_log")
        .fetch_one(p)
        .await
        .unwrap()
}

async fn done_versions(p: &MySqlPool) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT version FROM dblock_migrations WHERE state = 'done' ORDER BY version",
    )
    .fetch_all(p)
    .await
    .unwrap()
}

/// `n` `dblock migrate` processes at once; every migration they report, sorted. Fails
/// on any non-zero exit.
async fn processes_at_once(n: usize, url: &str, d: &MigrationDir) -> Vec<String> {
    let state = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    for _ in 0..n {
        children.push(
            dblock_testkit::dblock_command(DBLOCK, state.path())
                .args(["migrate", "--db", url, dir_arg(d)])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
    }
    let mut all = Vec::new();
    for c in children {
        let out = tokio::time::timeout(Duration::from_secs(60), c.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(code(&out), 0, "a process failed: {out:?}");
        all.extend(applied(&out));
    }
    all.sort();
    all
}

/// The same work without the lock: `n` sessions at once each read what is applied,
/// then apply what they think is pending and record it. Returns (failed runners,
/// migration_log rows).
async fn unlocked_runners_at_once(
    n: usize,
    p: &MySqlPool,
    files: &[(String, String)],
) -> (usize, i64) {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS control_migrations (version BIGINT PRIMARY KEY) ENGINE=InnoDB",
    )
    .execute(p)
    .await
    .unwrap();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let (p, files, barrier) = (p.clone(), files.to_vec(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = p.acquire().await.unwrap();
            barrier.wait().await;
            let done: Vec<i64> = sqlx::query_scalar("SELECT version FROM control_migrations")
                .fetch_all(&mut *conn)
                .await?;
            for (i, (_, sql)) in files.iter().enumerate() {
                let v = i as i64 + 1;
                if done.contains(&v) {
                    continue;
                }
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
                    .execute(&mut *conn)
                    .await?;
                sqlx::query("INSERT INTO control_migrations (version) VALUES (?)")
                    .bind(v)
                    .execute(&mut *conn)
                    .await?;
            }
            Ok::<(), sqlx::Error>(())
        }));
    }
    let mut failed = 0;
    for t in tasks {
        if t.await.unwrap().is_err() {
            failed += 1;
        }
    }
    (failed, log_count(p).await)
}

/// The seeds' experiment on MariaDB: eight `dblock migrate` processes at once on an
/// empty database, and again on a populated one (tables present, bookkeeping gone):
/// no failure, each migration applied once. The control without the lock fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_migrating_at_once_apply_each_migration_exactly_once() {
    let files = mysql_seed_set();
    let d = MigrationDir::new(&files);
    let mut expected: Vec<String> = files.iter().map(|(f, _)| f.clone()).collect();
    expected.sort();

    let db = MyDb::new("mig_procs").await;
    let p = pool(&db).await;
    sqlx::raw_sql("CREATE TABLE migration_log (file VARCHAR(64) NOT NULL) ENGINE=InnoDB")
        .execute(&p)
        .await
        .unwrap();
    let applied = processes_at_once(8, &db.url, &d).await;
    assert_eq!(applied, expected, "empty database: each exactly once");
    assert_eq!(done_versions(&p).await, [1, 2, 3, 4, 5, 6]);
    assert_eq!(log_count(&p).await, 6);
    // Populated: every table in place, the bookkeeping gone.
    sqlx::raw_sql("DROP TABLE dblock_migrations")
        .execute(&p)
        .await
        .unwrap();
    let applied = processes_at_once(8, &db.url, &d).await;
    assert_eq!(applied, expected, "populated database: each exactly once");
    assert_eq!(log_count(&p).await, 12);
    // And a third time, nothing to do.
    assert!(processes_at_once(8, &db.url, &d).await.is_empty());

    // The control, on a database of its own: without the lock, runners collide.
    let control = MyDb::new("mig_control").await;
    let cp = pool(&control).await;
    sqlx::raw_sql("CREATE TABLE migration_log (file VARCHAR(64) NOT NULL) ENGINE=InnoDB")
        .execute(&cp)
        .await
        .unwrap();
    let (failed, logged) = unlocked_runners_at_once(8, &cp, &files).await;
    eprintln!("without the lock: {failed} of 8 runners failed, {logged} log rows for 6 migrations");
    assert!(
        failed > 0 || logged > 6,
        "the control must race: {failed} failed, {logged} rows"
    );
}

/// A runner killed between a migration's DDL and its bookkeeping: the next run refuses,
/// naming the file and the way out; after following it, the run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_migration_is_refused_until_resolved() {
    let db = MyDb::new("mig_crash").await;
    let p = pool(&db).await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INT);"),
        (
            "0002_slow.sql",
            "CREATE TABLE slow (x INT);\nDO SLEEP(30);\nCREATE TABLE after_slow (x INT);\n",
        ),
    ]);
    let state = tempfile::tempdir().unwrap();
    let mut child = dblock_testkit::dblock_command(DBLOCK, state.path())
        .args(["migrate", "--db", &db.url, dir_arg(&d)])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let sleeping = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE DB = DATABASE() AND INFO LIKE 'DO SLEEP(30)%'",
        )
        .fetch_one(&p)
        .await
        .unwrap();
        n > 0
    };
    assert!(
        eventually(10, &mut || sleeping()).await,
        "reached the slow migration"
    );
    child.start_kill().unwrap(); // SIGKILL, between CREATE TABLE slow and its bookkeeping
    child.wait().await.unwrap();

    let run = || async {
        let state = tempfile::tempdir().unwrap();
        dblock_testkit::dblock_command(DBLOCK, state.path())
            .args(["migrate", "--db", &db.url, dir_arg(&d)])
            .output()
            .await
            .unwrap()
    };
    let out = run().await;
    assert_eq!(code(&out), 65, "{out:?}");
    let err = one_line_error(&out);
    assert!(err.contains("0002_slow.sql"), "{err}");
    assert!(err.contains("never recorded as done"), "{err}");
    assert!(err.contains("docs/mysql.md"), "{err}");
    // Refused again: never run twice silently.
    assert_eq!(code(&run().await), 65);
    // The documented way out: finish or undo by hand, then delete (or mark done).
    sqlx::raw_sql("DROP TABLE slow; DELETE FROM dblock_migrations WHERE version = 2")
        .execute(&p)
        .await
        .unwrap();
    d.write(
        "0002_slow.sql",
        "CREATE TABLE slow (x INT);\nCREATE TABLE after_slow (x INT);\n",
    );
    let out = run().await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(applied(&out), ["0002_slow.sql"]);
    assert_eq!(done_versions(&p).await, [1, 2]);
}

/// `migrate baseline --to V` records the migrations up to V as done without running
/// them (a database migrated by another tool); the next run applies only the rest.
/// Without `--to` (MySQL has no sqlx history dblock reads) and for `revert` (DDL commits
/// as it goes: no safe rollback of a half-run down migration), a usage error that says
/// why, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn baseline_records_without_running_and_revert_is_refused() {
    let db = MyDb::new("mig_baseline").await;
    let p = pool(&db).await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INT);"),
        ("0002_b.sql", "CREATE TABLE b (x INT);"),
        ("0003_c.sql", "CREATE TABLE c (x INT);"),
    ]);
    let state = tempfile::tempdir().unwrap();
    let migrate = |args: &'static [&'static str]| {
        let mut c = dblock_testkit::dblock_command(DBLOCK, state.path());
        c.arg("migrate")
            .args(args)
            .args(["--db", &db.url, dir_arg(&d)]);
        c
    };
    let out = migrate(&["baseline"]).output().await.unwrap();
    assert_eq!(code(&out), 64, "{out:?}");
    assert!(one_line_error(&out).contains("--to"), "{out:?}");
    let out = migrate(&["baseline", "--to", "2"]).output().await.unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(done_versions(&p).await, [1, 2]);
    let tables: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME IN ('a', 'b', 'c')",
    )
    .fetch_one(&p)
    .await
    .unwrap();
    assert_eq!(tables, 0, "baseline runs nothing");
    let out = migrate(&[]).output().await.unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(applied(&out), ["0003_c.sql"]);
    assert_eq!(done_versions(&p).await, [1, 2, 3]);
    let out = migrate(&["revert"]).output().await.unwrap();
    assert_eq!(code(&out), 64, "{out:?}");
    assert!(
        one_line_error(&out).contains("not available on MySQL"),
        "{out:?}"
    );
    assert_eq!(done_versions(&p).await, [1, 2, 3], "nothing reverted");
}
