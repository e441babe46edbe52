//! Migrations' PostgreSQL traps (and SQLite's): the seed's experiment with and without
//! the lock, start-up scripts (under dblock's key, and under a service's own beside its
//! old instances), the lock taken before the table is read, a handle on an
//! sqlx pool, cancellation, and the concurrent-index trap. What every backend must do
//! is tested once for all in `every_backend_migrations.rs`. Each PostgreSQL test has a
//! database of its own: the migration lock is database-wide.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use dblock::Error;
use dblock::Locks;
use dblock::migrate::{MIGRATION_LOCK_KEY, Migrations, State};
use dblock_testkit::cluster::TempCluster;
use dblock_testkit::migrations::{MigrationDir, SUBSYSTEMS, migration_key, seed_script, seed_set};
use dblock_testkit::{PgSchema, SqliteDb, admin_connect, eventually};
use tokio::sync::Barrier;

const RUNNERS: usize = 8;

fn versions(report: &dblock::migrate::Report) -> Vec<i64> {
    report.applied.iter().map(|a| a.version).collect()
}

/// `RUNNERS` connections run the seed's six scripts at the same moment, each script as
/// one message (one implicit transaction), without any lock; returns the SQLSTATE (or
/// message) of every failure.
async fn scripts_without_the_lock(url: &str) -> Vec<String> {
    let barrier = Arc::new(Barrier::new(RUNNERS));
    let mut tasks = Vec::new();
    for _ in 0..RUNNERS {
        let client = admin_connect(url).await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut failures = Vec::new();
            for sub in SUBSYSTEMS {
                if let Err(e) = client.batch_execute(&seed_script(sub)).await {
                    failures.push(match e.code() {
                        Some(c) => c.code().to_string(),
                        None => e.to_string(),
                    });
                }
            }
            failures
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// The control: the seed's observation, reproduced, so that the tests below can fail.
/// From an empty schema, concurrent `IF NOT EXISTS` scripts collide on the catalogue's
/// unique indexes; with the tables in place, `ALTER TABLE` / `CREATE POLICY` deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_the_seeds_scripts_fail_when_run_at_once() {
    let s = PgSchema::own_database("mig_control").await;
    let mut empty = Vec::new();
    for _ in 0..4 {
        s.empty().await;
        empty.extend(scripts_without_the_lock(&s.url).await);
    }
    let mut existing = Vec::new();
    for _ in 0..4 {
        existing.extend(scripts_without_the_lock(&s.url).await);
    }
    let count = |v: &[String], code: &str| v.iter().filter(|c| *c == code).count();
    eprintln!(
        "without the lock: empty schema {} failures ({} duplicate keys), existing tables {} \
         failures ({} deadlocks)",
        empty.len(),
        count(&empty, "23505"),
        existing.len(),
        count(&existing, "40P01")
    );
    assert!(
        count(&empty, "23505") > 0,
        "the control must race: from an empty schema, duplicate keys on the catalogue \
         (23505) expected: {empty:?}"
    );
    assert!(
        count(&existing, "40P01") > 0,
        "the control must race: with the tables in place, deadlocks (40P01) expected: \
         {existing:?}"
    );
}

/// The seed's primitive under the control's concurrency: zero failures, from an empty
/// schema and with everything in place, on sqlx pools and on dblock handles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_prefixed_scripts_never_fail_when_run_at_once() {
    let s = PgSchema::own_database("mig_prefixed").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(RUNNERS as u32)
        .connect(&s.url)
        .await
        .unwrap();
    let handle = s.locks().await;
    for round in 0..6 {
        // Rounds 0–2 from an empty schema, 3–5 against the tables they left.
        if round < 3 {
            s.empty().await;
        }
        let barrier = Arc::new(Barrier::new(RUNNERS));
        let mut tasks = Vec::new();
        for i in 0..RUNNERS {
            let (pool, handle, barrier) = (pool.clone(), handle.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let mut failures = Vec::new();
                for sub in SUBSYSTEMS {
                    let script = seed_script(sub);
                    // Half the runners on an sqlx pool, half on a dblock handle.
                    let res = if i % 2 == 0 {
                        dblock::migrate::run_script(&pool, &script).await
                    } else {
                        handle.run_script(&script).await
                    };
                    if let Err(e) = res {
                        failures.push(e.to_string());
                    }
                }
                failures
            }));
        }
        for t in tasks {
            let failures = t.await.unwrap();
            assert!(failures.is_empty(), "round {round}: {failures:?}");
        }
        for sub in SUBSYSTEMS {
            assert!(s.has_relation(&format!("_app_{sub}")).await);
        }
    }
    assert!(s.migration_lock_of_sessions().await.is_empty());
}

/// The seed's own key: `FRAISE` and a version byte.
const SERVICE_KEY: i64 = 0x4652_4149_5345_0001;

/// Instances switching one by one: four old ones send each script as the seed does
/// (`SELECT pg_advisory_xact_lock(SERVICE_KEY);` then the script, one message), four new
/// ones run it with dblock (two on an sqlx pool, two on a handle) under `key` (the
/// service's own, or with `None` dblock's), all at once, in rounds from an empty schema
/// and then with the tables in place; returns every failure.
async fn old_and_new_instances_at_once(s: &PgSchema, key: Option<i64>) -> Vec<String> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&s.url)
        .await
        .unwrap();
    let handle = s.locks().await;
    let mut all = Vec::new();
    for round in 0..4 {
        if round < 2 {
            s.empty().await;
        }
        let barrier = Arc::new(Barrier::new(RUNNERS));
        let mut tasks = Vec::new();
        for i in 0..RUNNERS {
            let old = admin_connect(&s.url).await;
            let (pool, handle, barrier) = (pool.clone(), handle.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let mut failures = Vec::new();
                for sub in SUBSYSTEMS {
                    let ddl = seed_script(sub);
                    let res = match (i % 4, key) {
                        (0 | 1, _) => old
                            .batch_execute(&format!(
                                "SELECT pg_advisory_xact_lock({SERVICE_KEY});\n{ddl}"
                            ))
                            .await
                            .map_err(|e| e.to_string()),
                        (2, Some(k)) => dblock::migrate::run_script_with_key(&pool, k, &ddl)
                            .await
                            .map_err(|e| e.to_string()),
                        (2, None) => dblock::migrate::run_script(&pool, &ddl)
                            .await
                            .map_err(|e| e.to_string()),
                        (_, Some(k)) => handle
                            .run_script_with_key(k, &ddl)
                            .await
                            .map_err(|e| e.to_string()),
                        (_, None) => handle.run_script(&ddl).await.map_err(|e| e.to_string()),
                    };
                    if let Err(e) = res {
                        failures.push(format!("round {round}: {e}"));
                    }
                }
                failures
            }));
        }
        for t in tasks {
            all.extend(t.await.unwrap());
        }
    }
    all
}

/// A service whose start-up scripts take a key of their own moves to dblock instance by
/// instance: dblock's scripts under that key, beside old instances still sending the
/// seed's message, never fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_and_dblock_instances_take_turns_under_the_services_own_key() {
    let s = PgSchema::own_database("mig_own_key").await;
    let failures = old_and_new_instances_at_once(&s, Some(SERVICE_KEY)).await;
    assert!(failures.is_empty(), "{failures:?}");
    for sub in SUBSYSTEMS {
        assert!(s.has_relation(&format!("_app_{sub}")).await);
    }
}

/// The control: the same with dblock's scripts under dblock's own key, which the old
/// instances do not take: the two kinds race (duplicate catalogue keys, deadlocks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_under_different_keys_old_and_new_instances_race() {
    let s = PgSchema::own_database("mig_two_keys").await;
    let failures = old_and_new_instances_at_once(&s, None).await;
    eprintln!("under two keys: {} failures: {failures:?}", failures.len());
    assert!(
        failures
            .iter()
            .any(|f| f.contains("duplicate key") || f.contains("deadlock")),
        "the control must race: {failures:?}"
    );
}

/// The seed's experiment with the runner: eight runners on separate connections start
/// together, from an empty schema and again with every table in place (bookkeeping
/// reset, as when a database built by the old start-up scripts adopts the runner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_runners_apply_each_migration_exactly_once() {
    let s = PgSchema::own_database("mig_runners").await;
    let d = MigrationDir::new(&seed_set());
    let set = Arc::new(d.set());
    let mut handles = Vec::new();
    for _ in 0..RUNNERS {
        handles.push(s.locks().await);
    }
    let mut logged = 0;
    for round in 0..7 {
        if round < 4 {
            s.empty().await;
            logged = 0;
        } else {
            s.admin()
                .batch_execute(&format!("DROP TABLE \"{}\".dblock_migrations", s.name))
                .await
                .unwrap();
        }
        let barrier = Arc::new(Barrier::new(RUNNERS));
        let mut tasks = Vec::new();
        for locks in &handles {
            let (locks, set, barrier) = (locks.clone(), set.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                set.run(&locks).await
            }));
        }
        let mut applied = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(report) => applied.extend(versions(&report)),
                Err(e) => panic!("round {round}: a runner failed: {e}"),
            }
        }
        applied.sort();
        assert_eq!(
            applied,
            [1, 2, 3, 4, 5, 6],
            "round {round}: each exactly once"
        );
        assert_eq!(s.applied_versions().await, [1, 2, 3, 4, 5, 6]);
        logged += 6;
        assert_eq!(s.count("migration_log").await, logged, "round {round}");
    }
    assert!(s.migration_lock_of_sessions().await.is_empty());
}

/// A runner that reads what is applied before it holds the lock applies a migration
/// another runner has just applied. Here a holder applies both migrations and records
/// them while the run waits: the run must create nothing and apply nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_is_taken_before_the_table_is_created_and_the_applied_ones_are_read() {
    let s = PgSchema::own_database("mig_order").await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x int);"),
        ("0002_b.sql", "CREATE TABLE b (x int);"),
    ]);
    let set = d.set();
    let holder = admin_connect(&s.url).await;
    holder
        .batch_execute(&format!("SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})"))
        .await
        .unwrap();
    let locks = s.locks().await;
    let run = {
        let set = set.clone();
        tokio::spawn(async move { set.run(&locks).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!run.is_finished(), "the run waits for the lock");
    assert!(
        !s.has_relation("dblock_migrations").await,
        "the bookkeeping table is created only under the lock"
    );
    let rows: Vec<String> = set
        .iter()
        .map(|m| format!("({}, '{}', '{}', 1)", m.version(), m.name(), m.checksum()))
        .collect();
    holder
        .batch_execute(&format!(
            "CREATE TABLE a (x int); CREATE TABLE b (x int);
             CREATE TABLE dblock_migrations (version bigint PRIMARY KEY, name text NOT NULL,
               checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(),
               duration_ms bigint NOT NULL);
             INSERT INTO dblock_migrations (version, name, checksum, duration_ms) VALUES {};
             SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})",
            rows.join(", ")
        ))
        .await
        .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(report.applied.is_empty(), "{report:?}");
    assert_eq!(report.already_applied, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_rolls_its_migration_back_and_frees_the_lock() {
    let s = PgSchema::own_database("mig_cancel").await;
    let locks = s.locks().await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x int);"),
        (
            "0002_slow.sql",
            "CREATE TABLE slow (x int);\nSELECT pg_sleep(30);\n",
        ),
    ]);
    let set = d.set();
    let run = tokio::time::timeout(Duration::from_millis(1500), set.run(&locks)).await;
    assert!(run.is_err(), "still sleeping: {run:?}");
    assert!(
        eventually(5, &mut || async {
            s.migration_lock_of_sessions().await.is_empty()
        })
        .await,
        "the dropped run's connection was cancelled and closed"
    );
    assert!(!s.has_relation("slow").await);
    assert_eq!(s.applied_versions().await, [1]);
    d.write("0002_slow.sql", "CREATE TABLE slow (x int);\n");
    let t = Instant::now();
    assert_eq!(versions(&d.set().run(&locks).await.unwrap()), [2]);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// A handle on the caller's sqlx pool runs migrations on a borrowed connection, with
/// the same guarantees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_on_an_sqlx_pool_runs_migrations_and_releases_after_a_failure() {
    let s = PgSchema::own_database("mig_sqlx").await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&s.url)
        .await
        .unwrap();
    let locks = Locks::from_sqlx_pool(pool).await.unwrap();
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x int);"),
        ("0002_bad.sql", "CREATE TABLE bad (x int); SELECT nonsense;"),
    ]);
    let err = d.set().run(&locks).await.unwrap_err();
    assert!(err.to_string().contains("0002_bad.sql"), "{err}");
    assert!(!s.has_relation("bad").await);
    assert!(
        eventually(5, &mut || async {
            s.migration_lock_of_sessions().await.is_empty()
        })
        .await
    );
    d.write("0002_bad.sql", "CREATE TABLE bad (x int);");
    assert_eq!(versions(&d.set().run(&locks).await.unwrap()), [2]);
    assert_eq!(s.applied_versions().await, [1, 2]);
}

/// The trap the runner's way of waiting avoids (golang-migrate #960): `CREATE INDEX
/// CONCURRENTLY` waits for every older snapshot, and a migrator blocked inside
/// `pg_advisory_lock` holds one while it waits for the lock the index builder holds.
/// On a throwaway cluster, since the index build waits for every snapshot of the
/// database, and the control's waiter would stall any migration of other tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_index_build_does_not_deadlock_a_waiting_runner() {
    let cluster = TempCluster::start(&[]);
    let url = cluster.url();
    let admin = admin_connect(&url).await;
    let d = MigrationDir::new(&[
        (
            "0001_table.sql",
            // Holds the lock long enough for a second migrator to start waiting.
            "CREATE TABLE t AS SELECT g AS x FROM generate_series(1, 100000) g;\n\
             SELECT pg_sleep(1);\n",
        ),
        (
            "0002_index.sql",
            "-- dblock:no-transaction\nCREATE INDEX CONCURRENTLY t_x ON t (x);\n",
        ),
    ]);
    let set = Arc::new(d.set());
    let (a, b) = (
        Locks::connect(&url).await.unwrap(),
        Locks::connect(&url).await.unwrap(),
    );
    let lock_granted = || async {
        let (classid, objid) = migration_key().pg_locks_ids();
        let n: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND classid = $1::int8::oid AND objid = $2::int8::oid",
                &[&(classid as i64), &(objid as i64)],
            )
            .await
            .unwrap()
            .get(0);
        n > 0
    };

    // With dblock's runner waiting: both finish.
    let first = {
        let (set, a) = (set.clone(), a.clone());
        tokio::spawn(async move { set.run(&a).await })
    };
    assert!(eventually(10, &mut || lock_granted()).await);
    let second = {
        let (set, b) = (set.clone(), b.clone());
        tokio::spawn(async move { set.run(&b).await })
    };
    let both = tokio::time::timeout(Duration::from_secs(30), async {
        (first.await.unwrap(), second.await.unwrap())
    })
    .await
    .expect("the runners deadlocked or hung");
    assert_eq!(versions(&both.0.unwrap()), [1, 2]);
    assert_eq!(versions(&both.1.unwrap()), Vec::<i64>::new());
    let valid: bool = admin
        .query_one(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 't_x'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(valid);

    // The control: the same run while another migrator waits inside pg_advisory_lock,
    // in a transaction. One of the two fails with a deadlock, or the build hangs.
    admin
        .batch_execute("DROP TABLE t; DROP TABLE dblock_migrations")
        .await
        .unwrap();
    let first = {
        let (set, a) = (set.clone(), a.clone());
        tokio::spawn(async move { set.run(&a).await })
    };
    assert!(eventually(10, &mut || lock_granted()).await);
    let blocking = admin_connect(&url).await;
    let waiter = tokio::spawn(async move {
        blocking
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_lock({MIGRATION_LOCK_KEY}); COMMIT; \
                 SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"
            ))
            .await
            .map_err(|e| e.code().map(|c| c.code().to_string()))
    });
    let run = tokio::time::timeout(Duration::from_secs(15), first).await;
    let waited = tokio::time::timeout(Duration::from_secs(5), waiter).await;
    eprintln!("control: runner {run:?}, blocked waiter {waited:?}");
    let run_deadlocked = matches!(&run, Ok(Ok(Err(e))) if e.sqlstate() == Some("40P01"));
    let waiter_deadlocked = matches!(&waited, Ok(Ok(Err(Some(c)))) if c == "40P01");
    let hung = run.is_err();
    assert!(
        run_deadlocked || waiter_deadlocked || hung,
        "the control must show the trap: runner {run:?}, waiter {waited:?}"
    );
    drop(cluster);
}

/// `dblock::migrations!` embeds the directory: the same set as reading it, and it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_set_equals_its_directory_and_runs() {
    let embedded = dblock::migrations!("tests/fixtures/migrations");
    let read = Migrations::from_dir(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/migrations"
    ))
    .unwrap();
    let shape = |s: &Migrations| {
        s.iter()
            .map(|m| {
                (
                    m.version(),
                    m.name().to_string(),
                    m.checksum().to_string(),
                    m.no_transaction(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(shape(&embedded), shape(&read));
    assert_eq!(embedded.len(), 3, "README.txt is not a migration");
    assert_eq!(
        embedded.get(1).unwrap().file(),
        "tests/fixtures/migrations/0001_create_items.sql"
    );
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let report = embedded.run(&locks).await.unwrap();
    assert_eq!(versions(&report), [1, 2, 10]);
    assert!(embedded.run(&locks).await.unwrap().applied.is_empty());
}

// ---- SQLite ----

async fn sqlite_count(db: &SqliteDb, sql: &str) -> i64 {
    let pool = sqlx::SqlitePool::connect(&db.url).await.unwrap();
    let n = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    n
}

async fn sqlite_has_table(db: &SqliteDb, name: &str) -> bool {
    sqlite_count(
        db,
        &format!("SELECT count(*) FROM sqlite_master WHERE name = '{name}'"),
    )
    .await
        > 0
}

/// SQLite's own trap: `VACUUM` cannot run in a transaction, so a migration of it fails
/// (named) until the no-transaction header runs it outside one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_vacuum_runs_only_outside_a_transaction() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let d = MigrationDir::new(&[
        ("0001_a.sql", "CREATE TABLE a (x INTEGER);"),
        ("0002_vacuum.sql", "VACUUM;"),
    ]);
    let err = d.set().run(&locks).await.unwrap_err().to_string();
    assert!(err.contains("0002_vacuum.sql"), "{err}");
    d.write("0002_vacuum.sql", "-- dblock:no-transaction\nVACUUM;");
    assert_eq!(versions(&d.set().run(&locks).await.unwrap()), [2]);
    let status = d.set().runner(&locks).status().await.unwrap();
    assert_eq!(status.count(State::Applied), 2);
    assert!(sqlite_has_table(&db, "a").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_run_script_runs_whole_or_not_at_all() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    locks
        .run_script("CREATE TABLE IF NOT EXISTS s (x INTEGER); INSERT INTO s VALUES (1);")
        .await
        .unwrap();
    let err = locks
        .run_script("INSERT INTO s VALUES (2); INSERT INTO nowhere VALUES (1);")
        .await;
    assert!(err.is_err());
    assert_eq!(sqlite_count(&db, "SELECT count(*) FROM s").await, 1);
    assert!(matches!(
        locks
            .run_script("CREATE TABLE u (x INTEGER); COMMIT;")
            .await,
        Err(Error::InvalidMigration { .. })
    ));
}
