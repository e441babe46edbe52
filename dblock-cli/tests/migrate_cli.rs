//! `dblock migrate` as written in the issue, run as real processes:
//!
//! ```text
//! dblock migrate [--db URL] DIR            apply what is pending
//! dblock migrate [--db URL] DIR --dry-run  list what would run, change nothing
//! dblock migrate status [--db URL] DIR     applied, pending, edited, unknown
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::{Duration, Instant};

use dblock_testkit::migrations::{MigrationDir, seed_set};
use dblock_testkit::{PgSchema, SqliteDb, eventually, exit_code as code, one_line_error};
use tokio::process::Command;

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// `dblock` with a clean environment: no URL variables, state under `state`.
fn dblock(state: &std::path::Path) -> Command {
    dblock_testkit::dblock_command(DBLOCK, state)
}

async fn migrate(url: &str, args: &[&str]) -> Output {
    let state = tempfile::tempdir().unwrap();
    let mut full = vec!["migrate", "--db", url];
    full.extend_from_slice(args);
    dblock(state.path()).args(&full).output().await.unwrap()
}

async fn status(url: &str, dir: &MigrationDir) -> Output {
    let state = tempfile::tempdir().unwrap();
    dblock(state.path())
        .args([
            "migrate",
            "status",
            "--db",
            url,
            dir.path().to_str().unwrap(),
        ])
        .output()
        .await
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The migrations an invocation reported applying, by file name.
fn applied(out: &Output) -> Vec<String> {
    stdout(out)
        .lines()
        .filter_map(|l| l.strip_prefix("applied  "))
        .map(|l| l.split_whitespace().next().unwrap_or_default().to_string())
        .collect()
}

fn dir_arg(d: &MigrationDir) -> &str {
    d.path().to_str().unwrap()
}

async fn applies_and_reports_each_migration(url: &str) {
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INTEGER);"),
        ("0002_b.sql", "CREATE TABLE b (x INTEGER);"),
    ]);
    let out = migrate(url, &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (line, file) in lines.iter().zip(["0001_a.sql", "0002_b.sql"]) {
        // One line per migration applied, with its time.
        assert!(
            line.starts_with(&format!("applied  {file}  (")) && line.ends_with(" ms)"),
            "{line:?}"
        );
    }
    assert_eq!(lines[2], "2 applied, 0 already applied");
    let out = migrate(url, &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 0, "nothing to do is success: {out:?}");
    assert_eq!(stdout(&out).trim(), "nothing to do: 2 already applied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_applies_reports_each_migration_and_exits_0() {
    let s = PgSchema::own_database("cli_mig").await;
    applies_and_reports_each_migration(&s.url).await;
    assert_eq!(s.applied_versions().await, [1, 2]);
    let db = SqliteDb::new();
    applies_and_reports_each_migration(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_migration_set_exits_65_naming_the_file() {
    let db = SqliteDb::new();
    for (files, names) in [
        (
            vec![("0001_a.sql", ""), ("create_b.sql", "")],
            "create_b.sql",
        ),
        (vec![("0001_a.sql", ""), ("0002-b.sql", "")], "0002-b.sql"),
        (vec![("0001_a.sql", ""), ("1_b.sql", "")], "0001_a.sql and "),
        (
            vec![("0001_a.sql", "-- dblock:no-transactions\nSELECT 1;")],
            "0001_a.sql: unknown header",
        ),
        (
            vec![("0001_a.sql", "CREATE TABLE a (x INTEGER); COMMIT;")],
            "0001_a.sql: statement 2 is COMMIT",
        ),
    ] {
        let d = MigrationDir::new(&files);
        let out = migrate(&db.url, &[dir_arg(&d)]).await;
        assert_eq!(code(&out), 65, "{files:?}: {out:?}");
        let err = one_line_error(&out);
        assert!(err.contains(names), "{names}: {err}");
    }
    // A directory that is not there is a bad set too, reported before connecting.
    let out = migrate(
        "postgres://postgres@127.0.0.1:1/nowhere",
        &["/nonexistent/migrations"],
    )
    .await;
    assert_eq!(code(&out), 65, "{out:?}");
    assert!(one_line_error(&out).contains("/nonexistent/migrations"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edited_and_unknown_migrations_exit_65_and_ignore_missing_proceeds() {
    let s = PgSchema::own_database("cli_mig_edit").await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x int);"),
        ("0002_b.sql", "CREATE TABLE b (x int);"),
    ]);
    assert_eq!(code(&migrate(&s.url, &[dir_arg(&d)]).await), 0);

    d.write("0001_a.sql", "CREATE TABLE a (x bigint);");
    let out = migrate(&s.url, &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 65, "{out:?}");
    let err = one_line_error(&out);
    assert!(
        err.contains("0001_a.sql: changed since it was applied"),
        "{err}"
    );
    let out = status(&s.url, &d).await;
    assert_eq!(code(&out), 65, "a run would refuse: {out:?}");
    assert!(
        stdout(&out)
            .lines()
            .any(|l| l.starts_with("edited   0001_a.sql")),
        "{}",
        stdout(&out)
    );
    d.write("0001_a.sql", "CREATE TABLE a (x int);");

    d.remove("0002_b.sql");
    d.write("0003_c.sql", "CREATE TABLE c (x int);");
    let out = migrate(&s.url, &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 65, "{out:?}");
    assert!(one_line_error(&out).contains("2 (b)"));
    assert!(!s.has_relation("c").await);
    let out = migrate(&s.url, &["--ignore-missing", dir_arg(&d)]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(applied(&out), ["0003_c.sql"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_migration_or_an_unreachable_database_exits_69() {
    let s = PgSchema::own_database("cli_mig_fail").await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x int);"),
        ("0002_bad.sql", "CREATE TABLE bad (x int);\nSELECT 1/0;"),
    ]);
    let out = migrate(&s.url, &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 69, "{out:?}");
    assert_eq!(
        applied(&out),
        ["0001_a.sql"],
        "what was applied is reported"
    );
    let err = one_line_error(&out);
    assert!(
        err.contains("migration ") && err.contains("0002_bad.sql failed") && err.contains("22012"),
        "{err}"
    );
    assert!(!s.has_relation("bad").await);
    assert!(s.migration_lock_of_sessions().await.is_empty());

    let out = migrate("postgres://postgres@127.0.0.1:1/nowhere", &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 69, "{out:?}");
    assert!(one_line_error(&out).contains("cannot connect"));
    let out = migrate("mysql://x", &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 64, "a bad URL is a usage error: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_lists_what_would_run_and_changes_nothing_and_status_shows_each_state() {
    let s = PgSchema::own_database("cli_mig_dry").await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x int);"),
        (
            "0002_i.sql",
            "-- dblock:no-transaction\nCREATE INDEX i ON a (x);",
        ),
    ]);
    let out = migrate(&s.url, &[dir_arg(&d), "--dry-run"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(
        stdout(&out),
        "pending  0001_a.sql\npending  0002_i.sql  (no transaction)\n\
         2 pending (1 outside a transaction), 0 already applied (dry run: nothing changed)\n"
    );
    assert!(!s.has_relation("a").await);
    assert!(
        !s.has_relation("dblock_migrations").await,
        "a dry run creates nothing"
    );

    let out = status(&s.url, &d).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(
        stdout(&out),
        "pending  0001_a.sql\npending  0002_i.sql  (no transaction)\n\
         0 applied, 2 pending, 0 edited, 0 unknown\n"
    );
    assert_eq!(code(&migrate(&s.url, &[dir_arg(&d)]).await), 0);
    d.write("0003_b.sql", "CREATE TABLE b (x int);");
    let out = status(&s.url, &d).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("applied  0001_a.sql  20"), "{text}");
    assert!(lines[0].ends_with(" ms"), "{text}");
    assert!(lines[1].starts_with("applied  0002_i.sql  20"), "{text}");
    assert_eq!(lines[2], "pending  0003_b.sql");
    assert_eq!(lines[3], "2 applied, 1 pending, 0 edited, 0 unknown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_falls_back_to_the_environment() {
    let db = SqliteDb::new();
    let d = MigrationDir::new(&[("0001_a.sql", "CREATE TABLE a (x INTEGER);")]);
    let state = tempfile::tempdir().unwrap();
    let out = dblock(state.path())
        .env("DBLOCK_DATABASE_URL", &db.url)
        .args(["migrate", dir_arg(&d)])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(applied(&out), ["0001_a.sql"]);
    // Applied to that file: the second run there has nothing to do.
    let out = migrate(&db.url, &[dir_arg(&d)]).await;
    assert_eq!(stdout(&out).trim(), "nothing to do: 1 already applied");
    // And with no variables at all, the embedded default under XDG_STATE_HOME.
    let out = dblock(state.path())
        .args(["migrate", dir_arg(&d)])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(state.path().join("dblock/locks.db").exists());
}

/// `n` processes start `dblock migrate` at the same moment; returns every migration
/// they report applying, and fails on any non-zero exit.
async fn processes_at_once(n: usize, url: &str, d: &MigrationDir) -> Vec<String> {
    let state = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    for _ in 0..n {
        children.push(
            dblock(state.path())
                .args(["migrate", "--db", url, dir_arg(d)])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
    }
    let mut all = Vec::new();
    for c in children {
        let out = c.wait_with_output().await.unwrap();
        assert_eq!(code(&out), 0, "a process failed: {out:?}");
        all.extend(applied(&out));
    }
    all.sort();
    all
}

/// The seed's experiment across OS processes: eight `dblock migrate` at once, from an
/// empty schema and again with every table in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_migrating_at_once_apply_each_migration_exactly_once() {
    let s = PgSchema::own_database("cli_mig_procs").await;
    let files = seed_set();
    let d = MigrationDir::new(&files);
    let mut expected: Vec<String> = files.iter().map(|(f, _)| f.clone()).collect();
    expected.sort();
    for round in 0..3 {
        if round < 2 {
            s.empty().await;
        } else {
            s.admin()
                .batch_execute(&format!("DROP TABLE \"{}\".dblock_migrations", s.name))
                .await
                .unwrap();
        }
        let applied = processes_at_once(8, &s.url, &d).await;
        assert_eq!(applied, expected, "round {round}: each exactly once");
        assert_eq!(s.applied_versions().await, [1, 2, 3, 4, 5, 6]);
    }
    assert_eq!(
        s.count("migration_log").await,
        6 * 2,
        "empty, then existing"
    );

    // The embedded default's runner, across processes too.
    let db = SqliteDb::new();
    let files: Vec<(String, String)> = (1..=6)
        .map(|i| {
            (
                format!("{i:04}_m{i}.sql"),
                format!("CREATE TABLE t{i} (x INTEGER); CREATE INDEX t{i}_x ON t{i} (x);"),
            )
        })
        .collect();
    let d = MigrationDir::new(&files);
    let applied = processes_at_once(8, &db.url, &d).await;
    assert_eq!(applied.len(), 6, "{applied:?}");
}

/// A runner killed with SIGKILL in the middle of a migration: the server rolls the
/// migration back and, told to check for a vanished client, frees the lock within about
/// a second rather than when the migration's statement would have ended (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_mid_migration_leaves_nothing_half_applied() {
    let s = PgSchema::own_database("cli_mig_kill").await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x int);"),
        (
            "0002_slow.sql",
            "CREATE TABLE slow (x int);\nINSERT INTO slow VALUES (1);\nSELECT pg_sleep(30);\n",
        ),
    ]);
    let state = tempfile::tempdir().unwrap();
    let mut child = dblock(state.path())
        .args(["migrate", "--db", &s.url, dir_arg(&d)])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let sleeping = || async {
        let n: i64 = s
            .admin()
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND state = 'active' AND query LIKE '%pg_sleep(30)%'",
                &[&s.app],
            )
            .await
            .unwrap()
            .get(0);
        n > 0
    };
    assert!(
        eventually(10, &mut || sleeping()).await,
        "the runner reached the slow migration"
    );
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    let killed = Instant::now();

    d.write(
        "0002_slow.sql",
        "CREATE TABLE slow (x int);\nINSERT INTO slow VALUES (1);\n",
    );
    let out = migrate(&s.url, &[dir_arg(&d)]).await;
    let took = killed.elapsed();
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(applied(&out), ["0002_slow.sql"]);
    eprintln!("the next run completed {took:?} after the SIGKILL");
    assert!(
        took < Duration::from_secs(10),
        "the killed runner's lock outlived it: {took:?}"
    );
    assert_eq!(s.count("slow").await, 1, "applied once, not half twice");
    assert_eq!(s.applied_versions().await, [1, 2]);
    assert!(s.migration_lock_of_sessions().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_a_runner_killed_mid_migration_leaves_nothing_half_applied() {
    let db = SqliteDb::new();
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INTEGER);"),
        (
            // Seconds of work after a write, in one transaction.
            "0002_slow.sql",
            "CREATE TABLE slow (x INTEGER);\nINSERT INTO slow VALUES (1);\n\
             WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 300000000) \
             SELECT count(*) FROM c;\n",
        ),
    ]);
    let state = tempfile::tempdir().unwrap();
    let mut child = dblock(state.path())
        .args(["migrate", "--db", &db.url, dir_arg(&d)])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The first migration's line arrives when it is committed; the slow one runs next.
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(child.stdout.take().unwrap()));
    let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await;
    assert!(
        matches!(&first, Ok(Ok(Some(l))) if l.starts_with("applied  0001_a.sql")),
        "{first:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();

    d.write(
        "0002_slow.sql",
        "CREATE TABLE slow (x INTEGER);\nINSERT INTO slow VALUES (1);\n",
    );
    let t = Instant::now();
    let out = migrate(&db.url, &[dir_arg(&d)]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(applied(&out), ["0002_slow.sql"]);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}
