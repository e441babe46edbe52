//! The migration runner's guarantees on every backend — PostgreSQL, MySQL/MariaDB and the
//! embedded SQLite file — from this one source (`every_backend!`): concurrent runners
//! apply each migration once (with the control that races without the lock), a failing
//! migration stops the run and frees the lock, an interrupted one is refused with what
//! ran until someone decides, edited and unknown migrations are refused, status and dry
//! runs change nothing, sqlx's history is adopted (and kept, as sqlx writes it, until
//! turned off), baselines record without running, and reverts run where DDL is
//! transactional. Each test has a database of its own: the
//! migration lock is database-wide. A backend's own traps stay in its own file
//! (`migrations.rs`, `adoption.rs` for PostgreSQL; `dblock-cli/tests/mysql_migrate.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use dblock::Error;
use dblock::migrate::{SqlxHistory, State};
use dblock_testkit::adoption::sqlx_migrate_on;
use dblock_testkit::beside::sqlx_expects;
use dblock_testkit::migrations::{MigrationDir, with_a_slow_no_transaction_migration};
use dblock_testkit::testdb::within;
use dblock_testkit::{TestDb, eventually};
use tokio::sync::Barrier;

const RUNNERS: usize = 8;

fn versions(report: &dblock::migrate::Report) -> Vec<i64> {
    report.applied.iter().map(|a| a.version).collect()
}

/// Six migrations that fail if applied twice (a table created without `IF NOT EXISTS`),
/// each logging its file name.
fn six() -> Vec<(String, String)> {
    (1..=6)
        .map(|i| {
            (
                format!("{i:04}_m{i}.sql"),
                format!(
                    "CREATE TABLE t{i} (x INT);\nCREATE INDEX t{i}_x ON t{i} (x);\n\
                     INSERT INTO log (f) VALUES ('{i}');\n"
                ),
            )
        })
        .collect()
}

/// The no-lock control: `RUNNERS` sessions at once each read what is applied, then
/// apply what they think is pending and record it. Returns (failed runners, log rows).
async fn unlocked_runners_at_once(db: &TestDb, files: &[(String, String)]) -> (usize, i64) {
    db.exec("CREATE TABLE control_applied (version INT)").await;
    let barrier = Arc::new(Barrier::new(RUNNERS));
    let mut failed = 0;
    let runs = (0..RUNNERS).map(|_| {
        let barrier = barrier.clone();
        async move {
            barrier.wait().await;
            let done = db.scalars("SELECT version FROM control_applied").await;
            for (i, (_, sql)) in files.iter().enumerate() {
                if done.contains(&(i as i64 + 1)) {
                    continue;
                }
                db.try_exec(sql).await?;
                db.try_exec(&format!("INSERT INTO control_applied VALUES ({})", i + 1))
                    .await?;
            }
            Ok::<(), String>(())
        }
    });
    for r in futures_util::future::join_all(runs).await {
        failed += usize::from(r.is_err());
    }
    (failed, db.scalar("SELECT count(*) FROM log").await)
}

async fn eight_runners_at_once_apply_each_migration_exactly_once(db: &TestDb) {
    db.exec("CREATE TABLE log (f VARCHAR(16))").await;
    let d = MigrationDir::new(&six());
    let set = Arc::new(d.set());
    let barrier = Arc::new(Barrier::new(RUNNERS));
    let mut tasks = Vec::new();
    for _ in 0..RUNNERS {
        // A handle each: connections (or open file descriptions) of their own.
        let (locks, set, barrier) = (db.locks().await, set.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            set.run(&locks).await
        }));
    }
    let mut applied = Vec::new();
    for t in tasks {
        match within(120, "a runner", t).await.unwrap() {
            Ok(report) => applied.extend(versions(&report)),
            Err(e) => panic!("a runner failed: {e}"),
        }
    }
    applied.sort();
    assert_eq!(applied, [1, 2, 3, 4, 5, 6], "each exactly once");
    assert_eq!(db.done_versions().await, [1, 2, 3, 4, 5, 6]);
    assert_eq!(db.scalar("SELECT count(*) FROM log").await, 6);

    // The control, on tables of its own: without the lock, the same work collides.
    let files: Vec<(String, String)> = six()
        .into_iter()
        .map(|(f, sql)| (f, sql.replace(" t", " c")))
        .collect();
    db.exec("DELETE FROM log").await;
    let (failed, logged) = unlocked_runners_at_once(db, &files).await;
    eprintln!("without the lock: {failed} of {RUNNERS} runners failed, {logged} log rows for 6");
    assert!(
        failed > 0 || logged > 6,
        "the control must race: {failed} failed, {logged} rows"
    );
}

async fn a_failing_migration_stops_the_run_names_it_and_frees_the_lock(db: &TestDb) {
    let locks = db.locks().await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INT);"),
        (
            "0002_half.sql",
            "CREATE TABLE half (x INT);\nINSERT INTO half VALUES (1);\nINSERT INTO nowhere VALUES (1);\n",
        ),
        ("0003_c.sql", "CREATE TABLE c (x INT);"),
    ]);
    let err = d.set().run(&locks).await.unwrap_err();
    assert!(
        matches!(
            &err,
            Error::MigrationFailed {
                version: 2,
                statement: None,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("0002_half.sql"), "{err}");
    if let TestDb::Postgres(_) = db {
        assert_eq!(
            err.sqlstate(),
            Some("42P01"),
            "the server's error is the source"
        );
    }
    assert!(db.has_table("a").await);
    assert!(!db.has_table("c").await, "the run stopped at the failure");
    assert_eq!(db.done_versions().await, [1]);
    if let TestDb::Postgres(s) = db {
        // Released before run() returned, not eventually; no transaction left open.
        assert!(s.migration_lock_of_sessions().await.is_empty());
        assert!(
            s.sessions()
                .await
                .iter()
                .all(|(_, st)| st != "idle in transaction")
        );
    }
    d.write(
        "0002_half.sql",
        "CREATE TABLE half (x INT);\nINSERT INTO half VALUES (1);\n",
    );
    // Another handle: the lock is free at once.
    let other = db.locks().await;
    if db.transactional_ddl() {
        assert!(!db.has_table("half").await, "rolled back whole");
    } else {
        // MySQL committed the CREATE TABLE: the row stays started and the next run
        // refuses until someone has looked.
        assert!(db.has_table("half").await);
        let e = within(10, "a refused run", d.set().run(&other))
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::MigrationInterrupted { version: 2, .. }),
            "{e:?}"
        );
        db.exec("DROP TABLE half; DELETE FROM dblock_migrations WHERE version = 2")
            .await;
    }
    let report = within(10, "the next run", d.set().run(&other))
        .await
        .unwrap();
    assert_eq!(versions(&report), [2, 3]);
    assert_eq!(db.scalar("SELECT count(*) FROM half").await, 1);
    assert_eq!(db.done_versions().await, [1, 2, 3]);
}

/// A run ended part way through a no-transaction migration (its future dropped, as when
/// the task is aborted; `dblock-cli`'s tests SIGKILL the process): while the run holds
/// the lock the migration shows as being applied; once it has gone, as interrupted,
/// with what ran. Every run, dry run and baseline refuses, naming the way out, until
/// someone records the decision.
async fn an_interrupted_migration_is_refused_with_what_ran_until_someone_decides(db: &TestDb) {
    let locks = db.locks().await;
    let d = MigrationDir::new(&with_a_slow_no_transaction_migration(db));
    let set = Arc::new(d.set());
    let run = {
        let (set, locks) = (set.clone(), locks.clone());
        tokio::spawn(async move { set.run(&locks).await })
    };
    let by_statement = db.transactional_ddl();
    let status = || async { set.runner(&locks).status().await.unwrap() };
    let reached = eventually(20, &mut || async {
        let st = status().await;
        let e = &st.entries[1];
        e.state == State::Applying && (!by_statement || e.progress == Some((1, 3)))
    })
    .await;
    assert!(
        reached,
        "the slow statement was reached: {:?}",
        status().await
    );
    assert!(
        !status().await.would_refuse(),
        "being applied is not a refusal"
    );
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());

    let interrupted = eventually(20, &mut || async {
        status().await.entries[1].state == State::Interrupted
    })
    .await;
    assert!(interrupted, "{:?}", status().await);
    let st = status().await;
    assert!(st.would_refuse());
    let why = st.interrupted.clone().unwrap();
    let what_ran = match by_statement {
        true => "Statement 1 of 3 completed; statement 2",
        false => "part of it may be applied",
    };
    assert!(why.contains(what_ran), "{why}");
    assert!(
        why.contains("UPDATE dblock_migrations SET state = 'done' WHERE version = 2"),
        "{why}"
    );
    for e in [
        set.run(&locks).await.unwrap_err(),
        set.runner(&locks).dry_run().await.unwrap_err(),
        set.runner(&locks).baseline(Some(3)).await.unwrap_err(),
    ] {
        assert!(
            matches!(e, Error::MigrationInterrupted { version: 2, .. }),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with(&format!("{}: was started at", set.get(2).unwrap().file()))
        );
        assert!(e.to_string().contains(what_ran), "{e}");
    }
    assert!(db.has_table("first_done").await, "statement 1 ran");
    assert!(!db.has_table("never_ran").await && !db.has_table("after").await);

    // The operator finished it by hand and records it as done: the run goes on.
    db.exec("CREATE TABLE never_ran (x INT); UPDATE dblock_migrations SET state = 'done' WHERE version = 2")
        .await;
    let report = within(20, "the run after the decision", set.run(&locks))
        .await
        .unwrap();
    assert_eq!(versions(&report), [3]);
    assert_eq!(db.done_versions().await, [1, 2, 3]);
    assert!(!status().await.would_refuse());
}

/// A statement of a no-transaction migration fails where the run sees it: the error
/// names the statement and what stays applied. Where statements are sent one by one,
/// the started row goes with the failure, and the fixed file runs; on MySQL (the file
/// sent whole) the row stays started and the next run refuses.
async fn a_failing_statement_outside_a_transaction_names_what_stays_applied(db: &TestDb) {
    let locks = db.locks().await;
    let d = MigrationDir::new(&[
        ("0001_t.sql", "CREATE TABLE t (x INT);"),
        (
            "0002_idx.sql",
            "-- dblock:no-transaction\nCREATE INDEX t_x ON t (x);\n\
             CREATE INDEX t_y ON t (y);\nCREATE INDEX t_z ON t (x);\n",
        ),
    ]);
    let err = d.set().run(&locks).await.unwrap_err();
    let rows_of_2 = "SELECT count(*) FROM dblock_migrations WHERE version = 2";
    if !db.transactional_ddl() {
        assert!(
            matches!(
                &err,
                Error::MigrationFailed {
                    version: 2,
                    statement: None,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(db.scalar(rows_of_2).await, 1, "the started row stays");
        let e = d.set().run(&locks).await.unwrap_err();
        assert!(
            matches!(e, Error::MigrationInterrupted { version: 2, .. }),
            "{e:?}"
        );
        return;
    }
    assert!(
        matches!(
            &err,
            Error::MigrationFailed {
                version: 2,
                statement: Some((2, 3)),
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("0002_idx.sql failed at statement 2 of 3")
            && msg.contains("statement 1 stays applied"),
        "{msg}"
    );
    assert_eq!(
        db.scalar(rows_of_2).await,
        0,
        "the started row went with the failure"
    );
    // Fixed, and written to be re-run, it runs.
    d.write(
        "0002_idx.sql",
        "-- dblock:no-transaction\nDROP INDEX IF EXISTS t_x;\nCREATE INDEX t_x ON t (x);\n\
         CREATE INDEX t_z ON t (x);\n",
    );
    let report = d.set().run(&locks).await.unwrap();
    assert_eq!(versions(&report), [2]);
    assert!(report.applied[0].no_transaction);

    // A file that leaves a transaction open is refused, and what it did rolled back.
    d.write(
        "0003_open.sql",
        "-- dblock:no-transaction\nBEGIN;\nCREATE TABLE never (x INT);\n",
    );
    let err = d.set().run(&locks).await.unwrap_err().to_string();
    assert!(err.contains("left a transaction open"), "{err}");
    assert!(!db.has_table("never").await);
    assert_eq!(db.done_versions().await, [1, 2]);
    assert_eq!(
        db.scalar("SELECT count(*) FROM dblock_migrations").await,
        2,
        "no started row left"
    );
}

async fn edited_and_unknown_migrations_are_refused_naming_them(db: &TestDb) {
    let locks = db.locks().await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INT);"),
        ("0002_b.sql", "CREATE TABLE b (x INT);"),
        ("0003_c.sql", "CREATE TABLE c (x INT);"),
    ]);
    d.set().run(&locks).await.unwrap();
    d.write("0002_b.sql", "CREATE TABLE b (x INT, y INT);");
    d.write("0004_d.sql", "CREATE TABLE d (x INT);");
    let err = d.set().run(&locks).await.unwrap_err();
    assert!(err.is_bad_migration_set());
    match &err {
        Error::MigrationEdited { file, version, .. } => {
            assert_eq!(*version, 2);
            assert!(file.ends_with("0002_b.sql"), "{file}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!db.has_table("d").await, "nothing applied after a refusal");
    d.write("0002_b.sql", "CREATE TABLE b (x INT);");
    d.remove("0003_c.sql");
    let err = d.set().run(&locks).await.unwrap_err();
    assert!(
        matches!(&err, Error::UnknownMigrations { missing } if missing == &["3 (c)".to_string()]),
        "{err:?}"
    );
    assert!(!db.has_table("d").await);
    let set = d.set();
    let report = set.runner(&locks).ignore_missing(true).run().await.unwrap();
    assert_eq!(versions(&report), [4]);
    assert_eq!(db.done_versions().await, [1, 2, 3, 4]);
}

async fn status_and_dry_run_read_without_changing_anything(db: &TestDb) {
    let locks = db.locks().await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INT);"),
        (
            "0002_b.sql",
            "-- dblock:no-transaction\nCREATE TABLE b (x INT);",
        ),
    ]);
    let set = d.set();
    let pending = set.runner(&locks).dry_run().await.unwrap();
    assert_eq!(
        pending.iter().map(|m| m.version()).collect::<Vec<_>>(),
        [1, 2]
    );
    let st = set.runner(&locks).status().await.unwrap();
    assert_eq!(st.count(State::Pending), 2);
    assert_eq!(
        st.entries
            .iter()
            .map(|e| e.no_transaction)
            .collect::<Vec<_>>(),
        [false, true],
        "no-transaction files are marked as the dry run marks them"
    );
    assert!(!db.has_table("dblock_migrations").await, "no table created");
    assert!(!db.has_table("a").await);

    set.run(&locks).await.unwrap();
    d.write("0001_a.sql", "CREATE TABLE a (x BIGINT);");
    d.remove("0002_b.sql");
    d.write("0003_c.sql", "CREATE TABLE c (x INT);");
    let set = d.set();
    let st = set.runner(&locks).status().await.unwrap();
    let states: Vec<_> = st.entries.iter().map(|e| (e.version, e.state)).collect();
    assert_eq!(
        states,
        [(1, State::Edited), (2, State::Unknown), (3, State::Pending)]
    );
    assert!(st.would_refuse());
    assert!(st.entries[0].applied_at.as_deref().unwrap().ends_with('Z'));
    assert!(matches!(
        set.runner(&locks).dry_run().await,
        Err(Error::MigrationEdited { .. })
    ));
}

/// What sqlx's own migrator applied is adopted — recorded, not run again — and a file
/// edited since is named, with nothing changed.
async fn sqlxs_history_is_adopted_and_an_edited_file_named(db: &TestDb) {
    let a =
        "CREATE TABLE a (x INT); CREATE TABLE log (f VARCHAR(8)); INSERT INTO log VALUES ('a');";
    let d = MigrationDir::new(&[
        ("20240101000000_a.sql", a),
        (
            "20240102000000_b.up.sql",
            "CREATE TABLE b (x INT); INSERT INTO log VALUES ('b');",
        ),
        ("20240102000000_b.down.sql", "DROP TABLE b;"),
        (
            "20240103000000_c.sql",
            "CREATE TABLE c (x INT); INSERT INTO log VALUES ('c');",
        ),
    ]);
    sqlx_migrate_on(db, d.path(), Some(20240102000000))
        .await
        .unwrap();
    let locks = db.locks().await;
    let set = d.set();
    let st = set.runner(&locks).status().await.unwrap();
    assert_eq!((st.count(State::Applied), st.count(State::Pending)), (2, 1));
    assert!(
        st.entries[..2]
            .iter()
            .all(|e| e.recorded_by == Some("sqlx"))
    );
    d.write("20240101000000_a.sql", &a.replace("x INT", "x INT, y INT"));
    let e = d.set().run(&locks).await.unwrap_err();
    assert!(matches!(e, Error::ForeignHistory { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("20240101000000_a.sql differs from what sqlx applied"),
        "{e}"
    );
    assert!(!db.has_table("dblock_migrations").await || db.done_versions().await.is_empty());
    d.write("20240101000000_a.sql", a);
    let report = set.run(&locks).await.unwrap();
    assert_eq!(
        (versions(&report), report.adopted),
        (vec![20240103000000], 2)
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM log").await,
        3,
        "nothing twice"
    );
    assert_eq!(db.done_versions().await.len(), 3);
}

async fn baseline_records_migrations_without_running_them(db: &TestDb) {
    let locks = db.locks().await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INT);"),
        ("0002_b.sql", "CREATE TABLE b (x INT);"),
        ("0003_c.sql", "CREATE TABLE c (x INT);"),
    ]);
    let set = d.set();
    // Without --to there must be a sqlx history to adopt from.
    let e = set.runner(&locks).baseline(None).await.unwrap_err();
    assert!(
        matches!(&e, Error::InvalidRequest { reason } if reason.contains("--to")),
        "{e:?}"
    );
    let adopted = set.runner(&locks).baseline(Some(2)).await.unwrap();
    assert_eq!(
        adopted.iter().map(|m| m.version()).collect::<Vec<_>>(),
        [1, 2]
    );
    assert!(
        !db.has_table("a").await && !db.has_table("b").await,
        "nothing ran"
    );
    let report = set.run(&locks).await.unwrap();
    assert_eq!(versions(&report), [3]);
    assert_eq!(db.done_versions().await, [1, 2, 3]);
}

/// Reverts run `.down.sql` files newest first, and forget sqlx's rows too so that the
/// next run does not adopt them back; where DDL commits as it goes (MySQL) they are
/// refused, changing nothing.
async fn reverts_run_down_files_newest_first_where_ddl_is_transactional(db: &TestDb) {
    let d = MigrationDir::new(&[
        ("20240101000000_a.up.sql", "CREATE TABLE a (x INT);"),
        ("20240101000000_a.down.sql", "DROP TABLE a;"),
        ("20240102000000_b.up.sql", "CREATE TABLE b (x INT);"),
        ("20240102000000_b.down.sql", "DROP TABLE b;"),
        (
            "20240103000000_c.up.sql",
            "-- no-transaction\nCREATE TABLE c (x INT);\nCREATE TABLE c2 (x INT);",
        ),
        (
            "20240103000000_c.down.sql",
            "-- no-transaction\nDROP TABLE c2;\nDROP TABLE c;",
        ),
    ]);
    sqlx_migrate_on(db, d.path(), Some(20240102000000))
        .await
        .unwrap();
    let set = d.set();
    let locks = db.locks().await;
    let report = set.run(&locks).await.unwrap();
    assert_eq!((report.applied.len(), report.adopted), (1, 2));
    let mut order = Vec::new();
    let reverted = set
        .runner(&locks)
        .on_applied(|a| order.push(a.file_name.clone()))
        .revert(Some(20240101000000))
        .await;
    if !db.transactional_ddl() {
        let e = reverted.unwrap_err();
        assert!(
            matches!(
                &e,
                Error::Unsupported { capability: dblock::Capability::TransactionalDdl, reason }
                    if reason.contains("not available on MySQL")
            ),
            "{e:?}"
        );
        assert_eq!(db.done_versions().await.len(), 3, "nothing reverted");
        return;
    }
    assert_eq!(reverted.unwrap().len(), 2);
    assert_eq!(
        order,
        ["20240103000000_c.down.sql", "20240102000000_b.down.sql"]
    );
    assert!(!db.has_table("c").await && !db.has_table("b").await && db.has_table("a").await);
    assert_eq!(db.done_versions().await, [20240101000000]);
    assert_eq!(
        db.versions_where("_sqlx_migrations", "1 = 1").await,
        [20240101000000]
    );
    let report = set.run(&locks).await.unwrap();
    assert_eq!(
        (report.applied.len(), report.adopted),
        (2, 0),
        "applied again, nothing adopted back"
    );
}

/// Beside sqlx's migrator, one after the other: what dblock applies it records in
/// sqlx's history exactly as sqlx's own code would (so sqlx's migrator then finds
/// nothing to do), what sqlx applies dblock adopts, and `SqlxHistory::Off` leaves
/// sqlx's history and lock alone; while sqlx's lock is held (PostgreSQL, MySQL 8: where
/// sqlx takes one), a run that keeps sqlx's history waits for it.
async fn sqlxs_history_is_kept_as_sqlx_writes_it_until_turned_off(db: &TestDb) {
    let log = |f: &str| format!("INSERT INTO log (f) VALUES ('{f}');");
    let mut files = vec![
        (
            "20240101000000_create_log.sql".to_string(),
            format!("CREATE TABLE log (f VARCHAR(64));\n{}", log("a")),
        ),
        (
            "20240102000000_b_table.up.sql".to_string(),
            format!("CREATE TABLE b (x INT);\n{}", log("b")),
        ),
        (
            "20240102000000_b_table.down.sql".to_string(),
            "DROP TABLE b;".to_string(),
        ),
        (
            "20240103000000_outside.sql".to_string(),
            "-- no-transaction\nCREATE TABLE c (x INT);\nCREATE TABLE c2 (x INT);\n".to_string(),
        ),
    ];
    let d = MigrationDir::new(&files);
    let locks = db.locks().await;
    // A fresh database where sqlx's instances may start too: asked to keep its history.
    let report = d
        .set()
        .runner(&locks)
        .sqlx_history(SqlxHistory::Always)
        .run()
        .await
        .unwrap();
    assert_eq!(report.applied.len(), 3);
    let applied = db.sqlx_rows().await;
    assert!(applied.iter().all(|r| r.execution_time > 0), "{applied:?}");
    let seen = |rows: Vec<dblock_testkit::beside::SqlxRow>| {
        // Nanoseconds; a row filled in later has dblock's milliseconds (0 for a fast one).
        assert!(
            rows.iter().all(|r| r.success && r.execution_time >= 0),
            "{rows:?}"
        );
        rows.into_iter()
            .map(|r| (r.version, r.description, r.checksum))
            .collect::<Vec<_>>()
    };
    assert_eq!(seen(db.sqlx_rows().await), sqlx_expects(d.path()).await);
    // sqlx's migrator finds nothing to do.
    sqlx_migrate_on(db, d.path(), None).await.unwrap();
    assert_eq!(db.scalar("SELECT count(*) FROM log").await, 2);

    // sqlx applies the next; dblock adopts it, and has nothing to write.
    files.push((
        "20240104000000_d.sql".to_string(),
        format!("CREATE TABLE d (x INT);\n{}", log("d")),
    ));
    d.write(&files[4].0, &files[4].1);
    sqlx_migrate_on(db, d.path(), None).await.unwrap();
    let report = d.set().run(&locks).await.unwrap();
    assert_eq!((report.applied.len(), report.adopted), (0, 1));
    assert_eq!(seen(db.sqlx_rows().await), sqlx_expects(d.path()).await);

    // While sqlx's lock is held, a run that keeps sqlx's history waits for it.
    files.push((
        "20240105000000_e.sql".to_string(),
        format!("CREATE TABLE e (x INT);\n{}", log("e")),
    ));
    d.write(&files[5].0, &files[5].1);
    let set = d.set();
    let holder = db.hold_sqlx_lock().await;
    if !matches!(db, TestDb::Sqlite(_)) {
        let waited = tokio::time::timeout(Duration::from_millis(700), set.run(&locks)).await;
        assert!(waited.is_err(), "the run waited for sqlx's lock");
        assert!(!db.has_table("e").await);
    }
    // Off: neither sqlx's lock nor its history.
    let report = within(60, "a run with sqlx's history off", async {
        set.runner(&locks)
            .sqlx_history(SqlxHistory::Off)
            .run()
            .await
    })
    .await
    .unwrap();
    assert_eq!(report.applied.len(), 1);
    drop(holder);
    let rows = seen(db.sqlx_rows().await);
    assert_eq!(rows.len(), 4, "sqlx's history left alone");
    assert_eq!(db.done_versions().await.len(), 5);
    // Turned back on, what sqlx's history lacks is filled in (dblock's times).
    set.run(&locks).await.unwrap();
    assert_eq!(seen(db.sqlx_rows().await), sqlx_expects(d.path()).await);
    sqlx_migrate_on(db, d.path(), None).await.unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) FROM log").await,
        4,
        "nothing twice"
    );
}

dblock_testkit::every_backend!(
    own_database: eight_runners_at_once_apply_each_migration_exactly_once,
    a_failing_migration_stops_the_run_names_it_and_frees_the_lock,
    an_interrupted_migration_is_refused_with_what_ran_until_someone_decides,
    a_failing_statement_outside_a_transaction_names_what_stays_applied,
    edited_and_unknown_migrations_are_refused_naming_them,
    status_and_dry_run_read_without_changing_anything,
    sqlxs_history_is_adopted_and_an_edited_file_named,
    baseline_records_migrations_without_running_them,
    reverts_run_down_files_newest_first_where_ddl_is_transactional,
    sqlxs_history_is_kept_as_sqlx_writes_it_until_turned_off,
);
