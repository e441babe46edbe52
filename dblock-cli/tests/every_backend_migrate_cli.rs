//! `dblock migrate` as real processes on every backend, from one source
//! (`every_backend!`, each test with a database of its own): a runner SIGKILLed part way
//! through a no-transaction migration is explained on the next run (what ran, what to
//! do) and `migrate status` exits 65 meanwhile; `status` marks no-transaction files as
//! the dry run does.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::Duration;

use dblock_testkit::migrations::{MigrationDir, with_a_slow_no_transaction_migration};
use dblock_testkit::{TestDb, eventually, exit_code as code};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// `dblock migrate ARGS… --db URL DIR`, with a clean environment.
async fn migrate(db: &TestDb, d: &MigrationDir, args: &[&str]) -> Output {
    let state = tempfile::tempdir().unwrap();
    let run = dblock_testkit::dblock_command(DBLOCK, state.path())
        .arg("migrate")
        .args(args)
        .args(["--db", db.url(), d.path().to_str().unwrap()])
        .output();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("dblock migrate hung")
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// The runner is SIGKILLed while statement 2 of 3 of a no-transaction migration runs.
/// On the old code the next run on PostgreSQL and SQLite ran statement 1 again and
/// failed saying "none of it was applied" (it was), and `status` said "pending" with
/// exit 0 on PostgreSQL and MySQL although a run would fail or refuse.
async fn a_killed_no_transaction_migration_is_explained_and_status_exits_65(db: &TestDb) {
    let d = MigrationDir::new(&with_a_slow_no_transaction_migration(db));
    let state = tempfile::tempdir().unwrap();
    let mut child = dblock_testkit::dblock_command(DBLOCK, state.path())
        .args(["migrate", "--db", db.url(), d.path().to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Statement 1 has run; give statement 2 a moment to be under way.
    assert!(
        eventually(20, &mut || db.has_table("first_done")).await,
        "the runner reached the no-transaction migration"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();

    // Once the server (or the kernel) has let the killed runner's lock go, `status`
    // says what a run would do: refuse.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let out = loop {
        let out = migrate(db, &d, &["status"]).await;
        if code(&out) == 65 || tokio::time::Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let refused = code(&out) == 65;
    assert!(
        refused,
        "status must exit 65 when a run would refuse: {out:?}"
    );
    let text = stdout(&out);
    assert!(
        text.lines()
            .any(|l| l.starts_with("interrupted  0002_slow.sql")),
        "{text}"
    );
    let what_ran = match db.transactional_ddl() {
        true => "Statement 1 of 3 completed; statement 2",
        false => "part of it may be applied",
    };
    assert!(stderr(&out).contains(what_ran), "{}", stderr(&out));

    // The run refuses, explains, and changes nothing.
    let out = migrate(db, &d, &[]).await;
    assert_eq!(code(&out), 65, "{out:?}");
    let err = stderr(&out);
    for part in [
        "0002_slow.sql: was started at",
        what_ran,
        "UPDATE dblock_migrations SET state = 'done' WHERE version = 2",
        "DELETE FROM dblock_migrations WHERE version = 2",
    ] {
        assert!(err.contains(part), "{part}: {err}");
    }
    assert!(!db.has_table("never_ran").await && !db.has_table("after").await);

    // The documented way out: undo what ran, forget the row; the next run applies it.
    db.exec("DROP TABLE first_done; DELETE FROM dblock_migrations WHERE version = 2")
        .await;
    d.write(
        "0002_slow.sql",
        "-- dblock:no-transaction\nCREATE TABLE first_done (x INT);\n\
         CREATE TABLE never_ran (x INT);\n",
    );
    let out = migrate(db, &d, &[]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(db.done_versions().await, [1, 2, 3]);
    assert_eq!(code(&migrate(db, &d, &["status"]).await), 0);
}

async fn status_marks_no_transaction_files_as_the_dry_run_does(db: &TestDb) {
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INT);"),
        (
            "0002_b.sql",
            "-- dblock:no-transaction\nCREATE TABLE b (x INT);",
        ),
        ("0003_c.sql", "-- no-transaction\nCREATE TABLE c (x INT);"),
    ]);
    let dry = migrate(db, &d, &["--dry-run"]).await;
    let status = migrate(db, &d, &["status"]).await;
    assert_eq!((code(&dry), code(&status)), (0, 0), "{dry:?} {status:?}");
    let marked = |out: &Output| -> Vec<String> {
        stdout(out)
            .lines()
            .filter(|l| l.starts_with("pending"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(
        marked(&status),
        [
            "pending  0001_a.sql",
            "pending  0002_b.sql  (no transaction)",
            "pending  0003_c.sql  (no transaction)"
        ]
    );
    assert_eq!(marked(&status), marked(&dry));
}

dblock_testkit::every_backend!(
    own_database: a_killed_no_transaction_migration_is_explained_and_status_exits_65,
    status_marks_no_transaction_files_as_the_dry_run_does,
);
