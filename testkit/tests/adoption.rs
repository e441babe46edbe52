//! sqlx-cli's directories and databases taken over by dblock, on PostgreSQL: a set
//! shaped like real ones run by eight runners at once on a fresh database (with sqlx's
//! own migrator as the control), a database sqlx migrated adopted without applying
//! anything twice, edited files named, and other tools' histories refused with the
//! command that adopts them. Adoption and reverts on every backend are in
//! `every_backend_migrations.rs`.
//!
//! Every test works in a database of its own: the migration lock is database-wide.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use dblock::Error;
use dblock::migrate::{Migrations, State};
use dblock_testkit::adoption::{
    FIRST, MIGRATIONS, OwnDatabase, READS_SQLX_HISTORY, sqlx_migrate, sqlx_shaped_set, version,
};
use dblock_testkit::migrations::MigrationDir;
use tokio::sync::Barrier;
use tokio::time::timeout;

const RUNNERS: usize = 8;
const BOUND: Duration = Duration::from_secs(120);

/// Runs `set` with `RUNNERS` handles at once; returns every runner's outcome.
async fn run_at_once(db: &OwnDatabase, set: Arc<Migrations>) -> Vec<Result<Vec<i64>, Error>> {
    let mut handles = Vec::new();
    for _ in 0..RUNNERS {
        handles.push(db.locks().await);
    }
    let barrier = Arc::new(Barrier::new(RUNNERS));
    let mut tasks = Vec::new();
    for locks in handles {
        let (set, barrier) = (set.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            set.run(&locks)
                .await
                .map(|r| r.applied.iter().map(|a| a.version).collect())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(timeout(BOUND, t).await.expect("a runner hung").unwrap());
    }
    out
}

/// How many times each file appended itself to `migration_log`, for those that did
/// more than once.
async fn logged_twice(db: &OwnDatabase) -> Vec<(String, i64)> {
    db.admin()
        .query(
            "SELECT file, count(*) FROM migration_log GROUP BY file HAVING count(*) > 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

async fn invalid_indexes(db: &OwnDatabase) -> i64 {
    db.one("SELECT count(*) FROM pg_index WHERE NOT indisvalid")
        .await
}

/// The fixture's versions, in order.
fn all_versions() -> Vec<i64> {
    (0..MIGRATIONS).map(version).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_runners_apply_an_sqlx_shaped_set_once_on_a_fresh_database() {
    let db = OwnDatabase::new("adopt_fresh").await;
    let d = MigrationDir::new(&sqlx_shaped_set());
    let set = Arc::new(d.set());
    let outcomes = run_at_once(&db, set.clone()).await;
    let mut applied = Vec::new();
    for (i, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(v) => applied.extend(v),
            Err(e) => panic!("runner {i} failed: {e}"),
        }
    }
    applied.sort();
    assert_eq!(
        applied,
        all_versions(),
        "each migration once, by one runner"
    );
    assert_eq!(db.versions("dblock_migrations").await, all_versions());
    assert!(logged_twice(&db).await.is_empty());
    let logged: i64 = db.one("SELECT count(*) FROM migration_log").await;
    assert_eq!(
        logged as usize,
        MIGRATIONS - 6,
        "every in-transaction migration logged once"
    );
    // The concurrent index builds ran outside a transaction and left valid indexes.
    let built: i64 = db
        .one("SELECT count(*) FROM pg_indexes WHERE indexname LIKE 't0__note_idx'")
        .await;
    assert_eq!(built, 6);
    assert_eq!(invalid_indexes(&db).await, 0);
    // The migration that reads sqlx's history found none, and did not fail.
    let note: String = db.one("SELECT note FROM history_notes").await;
    assert_eq!(note, "no sqlx history");
    // Nothing left to do, and status agrees.
    let locks = db.locks().await;
    let again = set.run(&locks).await.unwrap();
    assert!(again.applied.is_empty());
    let st = set.runner(&locks).status().await.unwrap();
    assert_eq!(st.count(State::Applied), MIGRATIONS);
    assert!(!st.would_refuse());
    db.drop().await;
}

/// The control for the test above: the same set, eight runners at once, with sqlx's
/// own migrator (`Migrator::run`, what services call at start-up). It fails in most
/// runners (measured: 7 of 8, four runs out of four: `deadlock detected` beside the
/// concurrent index builds, and an index built twice), so the fixture does exercise what dblock's lock prevents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_sqlxs_own_migrator_fails_with_eight_runners_at_once() {
    let db = OwnDatabase::new("adopt_sqlx_control").await;
    let d = MigrationDir::new(&sqlx_shaped_set());
    let barrier = Arc::new(Barrier::new(RUNNERS));
    let mut tasks = Vec::new();
    for _ in 0..RUNNERS {
        let (url, dir, barrier) = (db.url.clone(), d.path().to_path_buf(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            sqlx_migrate(&url, &dir, None).await
        }));
    }
    let mut failures = Vec::new();
    for t in tasks {
        match timeout(BOUND, t).await {
            Ok(r) => {
                if let Err(e) = r.unwrap() {
                    failures.push(e);
                }
            }
            Err(_) => failures.push("hung for 120 s".into()),
        }
    }
    eprintln!(
        "sqlx's migrator, {RUNNERS} at once: {} failed: {failures:?}; invalid indexes left: {}",
        failures.len(),
        invalid_indexes(&db).await
    );
    assert!(
        !failures.is_empty(),
        "the control must race: sqlx's runners were expected to fail"
    );
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_sqlx_migrated_is_adopted_and_nothing_is_applied_again() {
    let db = OwnDatabase::new("adopt_sqlx").await;
    let d = MigrationDir::new(&sqlx_shaped_set());
    // sqlx applies all but the last five, as `sqlx migrate run` would.
    let upto = version(MIGRATIONS - 6);
    sqlx_migrate(&db.url, d.path(), Some(upto)).await.unwrap();
    let by_sqlx = db.versions("_sqlx_migrations").await;
    assert_eq!(by_sqlx.len(), MIGRATIONS - 5);
    // The migration that reads and edits sqlx's history did so.
    let note: String = db.one("SELECT note FROM history_notes").await;
    assert_eq!(note, format!("sqlx rows: {READS_SQLX_HISTORY}"));
    let logged_by_sqlx: i64 = db.one("SELECT count(*) FROM migration_log").await;

    let set = Arc::new(d.set());
    let locks = db.locks().await;
    // Status and dry run, before anything is adopted: sqlx's migrations show as applied.
    let st = set.runner(&locks).status().await.unwrap();
    assert_eq!(st.count(State::Applied), MIGRATIONS - 5, "{:?}", st.entries);
    assert_eq!(st.count(State::Pending), 5);
    assert!(
        st.entries
            .iter()
            .filter(|e| e.state == State::Applied)
            .all(|e| e.recorded_by == Some("sqlx"))
    );
    assert!(!st.would_refuse(), "{:?}", st.foreign);
    let pending: Vec<i64> = set
        .runner(&locks)
        .dry_run()
        .await
        .unwrap()
        .iter()
        .map(|m| m.version())
        .collect();
    assert_eq!(pending, all_versions()[MIGRATIONS - 5..]);
    assert!(
        !db.has("dblock_migrations").await,
        "status and dry run change nothing"
    );

    // Eight runners at once: the five new ones applied once, nothing again.
    let mut applied = Vec::new();
    for o in run_at_once(&db, set.clone()).await {
        applied.extend(o.unwrap());
    }
    applied.sort();
    assert_eq!(applied, all_versions()[MIGRATIONS - 5..]);
    assert!(
        logged_twice(&db).await.is_empty(),
        "{:?}",
        logged_twice(&db).await
    );
    let logged: i64 = db.one("SELECT count(*) FROM migration_log").await;
    assert_eq!(
        logged - logged_by_sqlx,
        5,
        "the five new ones, nothing else"
    );
    assert_eq!(db.versions("dblock_migrations").await, all_versions());
    // Adopted rows carry sqlx's installation time, not the run's.
    let adopted_at_sqlx: bool = db
        .one(
            "SELECT d.applied_at = date_trunc('milliseconds', s.installed_on) \
             FROM dblock_migrations d \
             JOIN _sqlx_migrations s USING (version) WHERE version = 20230105090000",
        )
        .await;
    assert!(adopted_at_sqlx);
    let st = set.runner(&locks).status().await.unwrap();
    assert_eq!(st.count(State::Applied), MIGRATIONS);
    assert!(st.entries.iter().all(|e| e.recorded_by.is_none()));
    assert_eq!(FIRST, all_versions()[0]);
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edited_files_are_named_and_nothing_changes_until_baseline_adopts_them() {
    let db = OwnDatabase::new("adopt_edited").await;
    let files = sqlx_shaped_set();
    let d = MigrationDir::new(&files);
    sqlx_migrate(&db.url, d.path(), Some(version(10)))
        .await
        .unwrap();
    // Two applied files edited since (a comment, a changed default); one new file.
    let edit = |i: usize, f: &dyn Fn(&str) -> String| {
        let (file, sql) = files
            .iter()
            .find(|(f, _)| f.starts_with(&version(i).to_string()) && !f.ends_with(".down.sql"))
            .unwrap();
        d.write(file, &f(sql));
        file.clone()
    };
    let first = edit(2, &|s| format!("-- reviewed\n{s}"));
    let second = edit(7, &|s| s.replace("'{}'", "'[]'"));

    let set = d.set();
    let locks = db.locks().await;
    let st = set.runner(&locks).status().await.unwrap();
    assert!(st.would_refuse());
    assert_eq!(st.count(State::Edited), 2);
    let e = set.run(&locks).await.unwrap_err();
    assert!(e.is_bad_migration_set(), "{e}");
    let msg = e.to_string();
    assert!(matches!(e, Error::ForeignHistory { .. }), "{msg}");
    for f in [&first, &second] {
        assert!(
            msg.contains(&format!("{f} differs from what sqlx applied")),
            "{f}: {msg}"
        );
    }
    assert!(msg.contains("dblock migrate baseline DIR"), "{msg}");
    // Nothing changed: no row, the next migration not applied.
    assert!(db.versions("dblock_migrations").await.is_empty());
    assert!(!db.has("t11").await);

    // Baseline adopts sqlx's history with the files as they are; the run then applies
    // the rest, once.
    let adopted: Vec<i64> = set
        .runner(&locks)
        .baseline(None)
        .await
        .unwrap()
        .iter()
        .map(|m| m.version())
        .collect();
    assert_eq!(adopted, all_versions()[..11]);
    let report = set.run(&locks).await.unwrap();
    assert_eq!(report.applied.len(), MIGRATIONS - 11);
    assert!(logged_twice(&db).await.is_empty());
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_without_checksums_is_refused_with_the_command_that_adopts_it() {
    let db = OwnDatabase::new("adopt_golang").await;
    let d = MigrationDir::new(&[
        ("1_a.up.sql", "CREATE TABLE a (x int);"),
        ("1_a.down.sql", "DROP TABLE a;"),
        ("2_b.up.sql", "CREATE TABLE b (x int);"),
        ("2_b.down.sql", "DROP TABLE b;"),
        ("3_c.up.sql", "CREATE TABLE c (x int);"),
        ("3_c.down.sql", "DROP TABLE c;"),
    ]);
    // golang-migrate's table, as it leaves it after applying 1 and 2.
    db.admin()
        .batch_execute(
            "CREATE TABLE schema_migrations (version bigint NOT NULL PRIMARY KEY, \
             dirty boolean NOT NULL); INSERT INTO schema_migrations VALUES (2, false); \
             CREATE TABLE a (x int); CREATE TABLE b (x int);",
        )
        .await
        .unwrap();
    let set = d.set();
    let locks = db.locks().await;
    let e = set.run(&locks).await.unwrap_err().to_string();
    assert!(
        e.starts_with("schema_migrations: golang-migrate's history says"),
        "{e}"
    );
    assert!(
        e.ends_with("(to adopt it: dblock migrate baseline DIR --to 2)"),
        "{e}"
    );
    assert!(!db.has("c").await, "nothing applied");
    let adopted = set.runner(&locks).baseline(Some(2)).await.unwrap();
    assert_eq!(adopted.len(), 2);
    let report = set.run(&locks).await.unwrap();
    assert_eq!(
        report.applied.iter().map(|a| a.version).collect::<Vec<_>>(),
        [3]
    );
    assert!(db.has("c").await);
    db.drop().await;
}

/// `dblock::migrations!` embeds an sqlx-cli reversible directory (pairs, sqlx's
/// no-transaction marker) as `from_dir` reads it, and it runs (here on SQLite, where
/// sqlx's marker lets `VACUUM` run outside a transaction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_sqlx_directory_equals_its_directory_and_runs() {
    let embedded = dblock::migrations!("tests/fixtures/sqlx_reversible");
    let read = Migrations::from_dir(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sqlx_reversible"
    ))
    .unwrap();
    let shape = |s: &Migrations| {
        s.iter()
            .map(|m| {
                (
                    m.version(),
                    m.checksum().to_string(),
                    m.no_transaction(),
                    m.down_sql().map(str::to_string),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(shape(&embedded), shape(&read));
    assert_eq!(embedded.len(), 3);
    assert!(embedded.get(20240102093000).unwrap().no_transaction());
    assert_eq!(
        embedded.get(20240103093000).unwrap().down_sql(),
        Some("ALTER TABLE items DROP COLUMN price;\n")
    );
    let db = dblock_testkit::SqliteDb::new();
    let locks = db.locks().await;
    let report = timeout(BOUND, embedded.run(&locks)).await.unwrap().unwrap();
    assert_eq!(report.applied.len(), 3);
    assert!(report.applied[1].no_transaction);
}
