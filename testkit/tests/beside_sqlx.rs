//! dblock beside sqlx's migrator during a rolling deploy (issue 27): instances still
//! running sqlx's real migrator (`sqlx::migrate::Migrator::run`, the code services run
//! at start-up, which takes sqlx's lock) and instances running dblock's, at once, on one
//! database. Every process succeeds, every migration is applied once, and both
//! histories end complete and agreeing; the control without the shared lock races.
//!
//! On PostgreSQL, where sqlx takes a lock dblock shares. sqlx's MySQL migrator takes
//! `GET_LOCK(name, -1)`: MySQL 8 reads -1 as "wait forever", and dblock holds that name
//! too; MariaDB refuses the negative timeout (NULL, warning 1411), sqlx ignores the
//! result, and so takes no lock at all there — its instances race each other, and
//! dblock's cannot exclude them (`sqlxs_mysql_migrator_takes_no_lock_on_mariadb` below
//! shows it on the server CI has). SQLite has no lock either (sqlx's SQLite migrator
//! takes none). On every backend, each tool finds what the other applied
//! (`every_backend_migrations.rs`). Concurrent index builds while sqlx's migrators wait
//! are in `beside_sqlx_index_builds.rs`. Every test has a database of its own: both
//! locks are database-wide.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use dblock::migrate::{Migrations, Runner, SqlxHistory};
use dblock_testkit::TestDb;
use dblock_testkit::adoption::{FIRST, sqlx_migrate_on, sqlx_shaped_set, version};
use dblock_testkit::beside::{Outcomes, portable_set, sqlx_expects, up_versions};
use dblock_testkit::migrations::MigrationDir;
use dblock_testkit::testdb::within;
use futures_util::future::join_all;
use tokio::sync::Barrier;

const SQLX_RUNNERS: usize = 4;
const DBLOCK_RUNNERS: usize = 4;

/// `SQLX_RUNNERS` of sqlx's migrator on `dir` and `DBLOCK_RUNNERS` of dblock's on the
/// same files, released at once, each on connections of its own.
async fn both_at_once(
    db: &TestDb,
    dir: &Path,
    configure: impl for<'r> Fn(Runner<'r>) -> Runner<'r>,
) -> Outcomes {
    let set = Migrations::from_dir(dir).unwrap();
    let mut handles = Vec::new();
    for _ in 0..DBLOCK_RUNNERS {
        handles.push(db.locks().await);
    }
    let barrier = Barrier::new(SQLX_RUNNERS + DBLOCK_RUNNERS);
    let sqlx = join_all((0..SQLX_RUNNERS).map(|_| async {
        barrier.wait().await;
        sqlx_migrate_on(db, dir, None).await
    }));
    let dblock = join_all(handles.iter().map(|locks| async {
        barrier.wait().await;
        configure(set.runner(locks)).run().await
    }));
    let (sqlx, dblock) = within(120, "the runners", async { tokio::join!(sqlx, dblock) }).await;
    Outcomes { sqlx, dblock }
}

/// A real-world-shaped set that runs in transactions: on PostgreSQL the sqlx-shaped
/// fixture without its concurrent index builds (48 timestamped migrations less six:
/// enum types, a trigger function, reversible pairs, one that reads and edits
/// `_sqlx_migrations`); elsewhere the portable set.
fn transactional_set(db: &TestDb) -> Vec<(String, String)> {
    match db {
        TestDb::Postgres(_) => sqlx_shaped_set()
            .into_iter()
            .filter(|(_, sql)| !sql.starts_with("-- no-transaction"))
            .collect(),
        _ => portable_set(),
    }
}

/// Files that appended themselves to `migration_log` more than once.
async fn logged_twice(db: &TestDb) -> Vec<i64> {
    db.scalars("SELECT count(*) FROM migration_log GROUP BY file HAVING count(*) > 1")
        .await
}

/// Each migration of `files` applied once, recorded done by dblock and as sqlx's own
/// code would record it in sqlx's history.
async fn applied_once_and_histories_agree(
    db: &TestDb,
    d: &MigrationDir,
    files: &[(String, String)],
) {
    assert!(logged_twice(db).await.is_empty(), "a migration ran twice");
    let logging = files
        .iter()
        .filter(|(_, sql)| sql.contains("INSERT INTO migration_log"))
        .count();
    assert_eq!(
        db.scalar("SELECT count(*) FROM migration_log").await,
        logging as i64,
        "every migration ran once"
    );
    let all = up_versions(files);
    assert_eq!(
        db.done_versions().await,
        all,
        "dblock's history is complete"
    );
    let rows = db.sqlx_rows().await;
    let mut expected = sqlx_expects(d.path()).await;
    // The fixture's migration that edits sqlx's history did so, once.
    if let TestDb::Postgres(_) = db {
        for e in expected.iter_mut().filter(|e| e.0 == FIRST) {
            e.1.push_str(" (noted)");
        }
    }
    let seen: Vec<(i64, String, String)> = rows
        .iter()
        .map(|r| (r.version, r.description.clone(), r.checksum.clone()))
        .collect();
    assert_eq!(
        seen, expected,
        "sqlx's history is complete and as sqlx writes it"
    );
    assert!(
        rows.iter().all(|r| r.success && r.execution_time >= 0),
        "{rows:?}"
    );
}

async fn sqlx_and_dblock_runners_at_once_on_a_fresh_database(db: &TestDb) {
    let files = transactional_set(db);
    let d = MigrationDir::new(&files);
    // A database without sqlx's table where sqlx's instances may start too: asked.
    let out = both_at_once(db, d.path(), |r| r.sqlx_history(SqlxHistory::Always)).await;
    assert!(out.failures().is_empty(), "{:?}", out.failures());
    applied_once_and_histories_agree(db, &d, &files).await;
    // Nothing left for either.
    sqlx_migrate_on(db, d.path(), None).await.unwrap();
    let again = d.set().run(&db.locks().await).await.unwrap();
    assert!(again.applied.is_empty());
    applied_once_and_histories_agree(db, &d, &files).await;
}

async fn sqlx_and_dblock_runners_at_once_on_a_database_sqlx_migrated_in_part(db: &TestDb) {
    let files = transactional_set(db);
    let d = MigrationDir::new(&files);
    let all = up_versions(&files);
    let part = all[all.len() / 3];
    sqlx_migrate_on(db, d.path(), Some(part)).await.unwrap();
    // sqlx's table exists: kept without being asked.
    let out = both_at_once(db, d.path(), |r| r).await;
    assert!(out.failures().is_empty(), "{:?}", out.failures());
    applied_once_and_histories_agree(db, &d, &files).await;
    let by_dblock: usize = out
        .dblock
        .iter()
        .map(|r| r.as_ref().unwrap().applied.len())
        .sum();
    assert!(by_dblock <= all.len() - all.iter().filter(|&&v| v <= part).count());
}

/// The control: the same, with dblock keeping sqlx's history but not holding sqlx's
/// lock. The two tools then apply the same migrations at once, and runners fail (or a
/// migration runs twice). Up to three rounds, each on an empty database.
async fn control_without_sqlxs_lock_the_two_tools_race(db: &TestDb) {
    let files = transactional_set(db);
    let d = MigrationDir::new(&files);
    let mut seen = Vec::new();
    for round in 0..3 {
        if round > 0 {
            db.reset().await;
        }
        let out = both_at_once(db, d.path(), |r| {
            r.sqlx_history(SqlxHistory::Always).__without_sqlx_lock()
        })
        .await;
        let failures = out.failures();
        let twice = logged_twice(db).await.len();
        eprintln!(
            "round {round}: {} of {} runners failed, {twice} migrations ran twice: {failures:?}",
            failures.len(),
            SQLX_RUNNERS + DBLOCK_RUNNERS
        );
        seen.push((failures.len(), twice));
        if !failures.is_empty() || twice > 0 {
            return;
        }
    }
    panic!("the control did not race in three rounds: {seen:?}");
}

/// The key (PostgreSQL) and lock name (MySQL) dblock computes for sqlx are the ones
/// sqlx's real migrator takes: seen held (`expect_held`) while sqlx's migrator is
/// stopped in a migration, and free after; or, where sqlx takes none, never seen.
async fn sqlxs_lock_as_the_server_shows_it(db: &TestDb, expect_held: bool) {
    // A migration that waits until the test has looked: the test holds a lock the
    // migration needs (an advisory key of the test's own database; a named lock with
    // the test's database in its name).
    let (hold, needs) = match db {
        TestDb::Postgres(_) => (
            "SELECT pg_advisory_lock(271828)".to_string(),
            "SELECT pg_advisory_xact_lock_shared(271828);".to_string(),
        ),
        _ => {
            let name = format!("{}-gate", db.database_name().await);
            (
                format!("DO GET_LOCK('{name}', 30)"),
                format!("DO GET_LOCK('{name}', 30);"),
            )
        }
    };
    let d = MigrationDir::new(&[
        ("1_a.sql", "CREATE TABLE a (x INT);".to_string()),
        ("2_b.sql", format!("{needs}CREATE TABLE b (x INT);")),
    ]);
    let gate = db.admin_session(&hold).await;
    assert!(!db.sqlx_lock_held().await);
    let run = sqlx_migrate_on(db, d.path(), None);
    let look = async {
        // Until it is seen, or for long enough to know it is not taken at all.
        let secs = if expect_held { 30 } else { 3 };
        let held = dblock_testkit::eventually(secs, &mut || db.sqlx_lock_held()).await;
        drop(gate);
        held
    };
    let (ran, held) = within(60, "sqlx's migrator", async { tokio::join!(run, look) }).await;
    ran.unwrap();
    assert_eq!(
        held, expect_held,
        "sqlx's migrator held the lock dblock computes for it"
    );
    assert!(!db.sqlx_lock_held().await, "and let it go");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlxs_lock_is_the_key_dblock_computes() {
    let db = TestDb::postgres_own_database("sqlx_key").await;
    sqlxs_lock_as_the_server_shows_it(&db, true).await;
}

/// On MariaDB, sqlx 0.9's MySQL migrator takes no lock: `GET_LOCK(name, -1)` is refused
/// (NULL, warning 1411: MariaDB has no negative timeout) and sqlx does not look at the
/// result. On MySQL 8 (-1: wait forever) it holds the name dblock computes; this server
/// decides which is asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlxs_mysql_migrator_takes_no_lock_on_mariadb() {
    let db = TestDb::mysql("sqlx_mysql_key").await;
    let TestDb::MySql(d) = &db else {
        unreachable!()
    };
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(d.admin())
        .await
        .unwrap();
    let mariadb = version.contains("MariaDB");
    if mariadb {
        // The cause: the very statement sqlx sends, answered with NULL.
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, -1)")
            .bind(format!("{}-probe", d.name))
            .fetch_one(d.admin())
            .await
            .unwrap();
        assert_eq!(got, None, "{version}");
    }
    sqlxs_lock_as_the_server_shows_it(&db, !mariadb).await;
}

/// Each test source on PostgreSQL, in a database of its own. (Written over `TestDb`,
/// they would run unchanged on MySQL 8, where sqlx takes its lock; not on MariaDB,
/// where it takes none: see the module documentation.)
macro_rules! on_postgres {
    ($($test:ident),* $(,)?) => {$(
        mod $test {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let db = dblock_testkit::TestDb::postgres_own_database(stringify!($test)).await;
                super::$test(&db).await;
            }
        }
    )*};
}

on_postgres!(
    sqlx_and_dblock_runners_at_once_on_a_fresh_database,
    sqlx_and_dblock_runners_at_once_on_a_database_sqlx_migrated_in_part,
    control_without_sqlxs_lock_the_two_tools_race,
);

#[test]
fn the_fixtures_are_what_the_tests_say() {
    let pg = sqlx_shaped_set();
    let transactional = pg
        .iter()
        .filter(|(_, sql)| !sql.starts_with("-- no-transaction"))
        .count();
    assert_eq!(pg.len() - transactional, 6);
    assert_eq!(version(0), FIRST);
    assert_eq!(up_versions(&portable_set()).len(), 12);
}
