//! Concurrent index builds while sqlx's migrators wait for their lock (issue 27), on
//! PostgreSQL with sqlx's real migrator.
//!
//! sqlx's migrator waits inside `SELECT pg_advisory_lock(K)`, holding a snapshot; a
//! `CREATE INDEX CONCURRENTLY` waits for every older snapshot. A dblock run that holds
//! sqlx's lock and builds an index while a sqlx migrator waits would deadlock with it
//! (PostgreSQL then ends one of them). dblock lets sqlx's waiters go first before each
//! migration outside a transaction, and waits itself by polling, holding no snapshot.
//!
//! Each test lines the sessions up with a gate: the dblock run holding both locks stops
//! in a migration before the index builds until sqlx's migrators wait for their lock,
//! so the case is the one named, every time. sqlx's migrators among themselves
//! deadlock the same way whenever one of them builds an index while another waits
//! (sqlx's own design, which dblock cannot change); the tests give them sets in which
//! only dblock's presence could cause it: the release before (no index build), or one
//! sqlx migrator of the same release.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::migrate::{Report, Runner, SqlxHistory};
use dblock_testkit::TestDb;
use dblock_testkit::adoption::sqlx_migrate_on;
use dblock_testkit::beside::{Gate, Outcomes, sqlx_expects, up_versions};
use dblock_testkit::migrations::MigrationDir;
use dblock_testkit::testdb::within;
use futures_util::future::join_all;
use tokio::sync::watch;

const DBLOCK_RUNNERS: usize = 4;

/// The release before: six migrations in transactions, the third waiting at the gate.
fn release_before() -> Vec<(String, String)> {
    let log = |f: &str| format!("INSERT INTO migration_log (file) VALUES ('{f}');\n");
    (1..=6)
        .map(|i| {
            let file = format!("2024010{i}090000_create_t{i}.sql");
            let mut sql = String::new();
            if i == 1 {
                sql.push_str("CREATE TABLE migration_log (file text NOT NULL);\n");
            }
            if i == 3 {
                sql.push_str(Gate::SQL);
            }
            sql.push_str(&format!(
                "CREATE TABLE t{i} (id bigserial PRIMARY KEY, note text);\n\
                 INSERT INTO t{i} (note) SELECT 'n' || g FROM generate_series(1, 200) g;\n"
            ));
            sql.push_str(&log(&file));
            (file, sql)
        })
        .collect()
}

/// The release that switches: the one before, three concurrent index builds (sqlx's
/// `-- no-transaction` files, one statement each, without `IF NOT EXISTS`: built twice
/// fails), and two more migrations in transactions.
fn release_switching() -> Vec<(String, String)> {
    let mut files = release_before();
    for i in 1..=3 {
        files.push((
            format!("2024020{i}090000_index_t{i}_concurrently.sql"),
            format!("-- no-transaction\nCREATE INDEX CONCURRENTLY t{i}_note ON t{i} (note);\n"),
        ));
    }
    for i in 7..=8 {
        let file = format!("2024030{i}090000_create_t{i}.sql");
        let sql = format!(
            "CREATE TABLE t{i} (id bigserial PRIMARY KEY, note text);\n\
             INSERT INTO migration_log (file) VALUES ('{file}');\n"
        );
        files.push((file, sql));
    }
    files
}

/// dblock's runners on `dblock_files` start first; once one of them holds both locks
/// and waits at the gate, `sqlx_runners` of sqlx's migrator on `sqlx_files` start; once
/// they all wait for sqlx's lock (after `pause`), the gate opens.
async fn lined_up(
    db: &TestDb,
    dblock_dir: &MigrationDir,
    sqlx_dir: &MigrationDir,
    sqlx_runners: usize,
    pause: Duration,
    configure: impl for<'r> Fn(Runner<'r>) -> Runner<'r>,
) -> Outcomes {
    let mut gate = Gate::closed(db.url()).await;
    let set = dblock_dir.set();
    let mut handles = Vec::new();
    for _ in 0..DBLOCK_RUNNERS {
        handles.push(db.locks().await);
    }
    let (go, started) = watch::channel(false);
    let dblock = join_all(
        handles
            .iter()
            .map(|locks| configure(set.runner(locks).sqlx_history(SqlxHistory::Always)).run()),
    );
    let sqlx = join_all((0..sqlx_runners).map(|_| {
        let mut started = started.clone();
        async move {
            started.wait_for(|go| *go).await.unwrap();
            sqlx_migrate_on(db, sqlx_dir.path(), None).await
        }
    }));
    let conduct = async {
        let at_gate =
            dblock_testkit::eventually(30, &mut || async { gate.waiting().await == 1 }).await;
        assert!(at_gate, "a dblock runner reached the gate");
        go.send(true).unwrap();
        let waiting = dblock_testkit::eventually(30, &mut || async {
            db.sqlx_lock_waiters().await == sqlx_runners
        })
        .await;
        assert!(waiting, "sqlx's migrators wait for their lock");
        tokio::time::sleep(pause).await;
        gate.open();
    };
    let (dblock, sqlx, ()) = within(120, "the runners", async {
        tokio::join!(dblock, sqlx, conduct)
    })
    .await;
    Outcomes { sqlx, dblock }
}

/// Every migration of `files` applied once, the indexes valid, both histories complete
/// and as sqlx writes them.
async fn applied_once(db: &TestDb, d: &MigrationDir, files: &[(String, String)]) {
    let twice = db
        .scalars("SELECT count(*) FROM migration_log GROUP BY file HAVING count(*) > 1")
        .await;
    assert!(twice.is_empty(), "a migration ran twice");
    let logging = files
        .iter()
        .filter(|(_, s)| s.contains("migration_log (file)"))
        .count();
    assert_eq!(
        db.scalar("SELECT count(*) FROM migration_log").await,
        logging as i64
    );
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE c.relname LIKE 't__note' AND i.indisvalid"
        )
        .await,
        3,
        "three valid indexes"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM pg_index WHERE NOT indisvalid")
            .await,
        0
    );
    assert_eq!(db.done_versions().await, up_versions(files));
    let rows = db.sqlx_rows().await;
    let seen: Vec<(i64, String, String)> = rows
        .iter()
        .map(|r| (r.version, r.description.clone(), r.checksum.clone()))
        .collect();
    assert_eq!(seen, sqlx_expects(d.path()).await);
    assert!(rows.iter().all(|r| r.success));
}

/// The release that switches, on dblock's runners, while four instances of the release
/// before still run sqlx's migrator and wait for its lock: dblock lets them go first
/// (they find nothing to do), then builds the indexes with no snapshot to wait for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_migrators_waiting_for_their_lock_go_first_and_no_index_build_waits_for_them() {
    let db = TestDb::postgres_own_database("cic_before").await;
    let (before, switching) = (release_before(), release_switching());
    let (old, new) = (MigrationDir::new(&before), MigrationDir::new(&switching));
    let out = lined_up(&db, &new, &old, 4, Duration::ZERO, |r| r).await;
    assert!(out.failures().is_empty(), "{:?}", out.failures());
    // dblock applied everything: sqlx's migrators of the release before found their
    // migrations applied when they went first.
    let applied: usize = out
        .dblock
        .iter()
        .map(|r| r.as_ref().unwrap().applied.len())
        .sum();
    assert_eq!(applied, up_versions(&switching).len());
    applied_once(&db, &new, &switching).await;
    // And those instances, restarted now, still find nothing to do (sqlx's migrator
    // refuses newer versions it lacks unless told to ignore them, as for any rolling
    // deploy with sqlx alone).
    let e = sqlx_migrate_on(&db, old.path(), None).await.unwrap_err();
    assert!(e.contains("was previously applied but is missing"), "{e}");
}

/// The control: the same, with dblock building the indexes while sqlx's migrators
/// wait. The build waits for their snapshots, they wait for the lock the builder's
/// session holds, and PostgreSQL ends one of them with `deadlock detected`. The gate
/// opens after PostgreSQL's deadlock check of the waiters (`deadlock_timeout`) has
/// passed, so it is the build that is ended: dblock's run fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_building_an_index_while_sqlx_migrators_wait_deadlocks() {
    let db = TestDb::postgres_own_database("cic_control").await;
    let (before, switching) = (release_before(), release_switching());
    let (old, new) = (MigrationDir::new(&before), MigrationDir::new(&switching));
    let out = lined_up(&db, &new, &old, 4, Duration::from_millis(1500), |r| {
        r.__without_yielding_to_sqlx()
    })
    .await;
    let failures = out.failures();
    eprintln!("control: {} failed: {failures:?}", failures.len());
    assert!(
        failures.iter().any(|f| f.contains("deadlock detected")),
        "the control must deadlock: {failures:?}"
    );
}

/// One instance of the same release still on sqlx's migrator: dblock lets it go first
/// when its runner reaches the index builds, so sqlx's migrator builds them while
/// dblock's runners wait holding no snapshot; dblock then adopts what it applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlx_migrator_of_the_same_release_builds_the_indexes_while_dblock_waits() {
    let db = TestDb::postgres_own_database("cic_same").await;
    let switching = release_switching();
    let d = MigrationDir::new(&switching);
    let out = lined_up(&db, &d, &d, 1, Duration::ZERO, |r| r).await;
    assert!(out.failures().is_empty(), "{:?}", out.failures());
    let reports: Vec<&Report> = out.dblock.iter().map(|r| r.as_ref().unwrap()).collect();
    let applied: usize = reports.iter().map(|r| r.applied.len()).sum();
    let adopted: usize = reports.iter().map(|r| r.adopted).sum();
    // dblock applied the release before; sqlx's migrator the rest, adopted by dblock.
    assert_eq!((applied, adopted), (6, 5));
    applied_once(&db, &d, &switching).await;
    sqlx_migrate_on(&db, d.path(), None).await.unwrap();
}
