//! Every `Error::Unsupported` a backend answers for a feature it truly lacks, reached:
//! setup where tables are made on first use, the benchmark on a handle that borrows a
//! caller's sqlx pool (it needs raw connections of its own), ending a holder on the
//! embedded backend (whose locks belong to the holding process). What every backend does
//! is required by the raw interface, so nothing else answers `Unsupported` for a whole
//! feature.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use dblock::{Capability, Error, Locks};
use dblock_testkit::TestDb;
use dblock_testkit::testdb::within;

/// `r` is `Error::Unsupported` for `lacking`, its reason saying `says`.
fn unsupported<T: std::fmt::Debug>(
    r: Result<T, Error>,
    lacking: Capability,
    what: &str,
    says: &str,
) {
    match r {
        Err(Error::Unsupported { capability, reason }) => {
            assert_eq!(capability, lacking, "{what}: {reason}");
            assert!(reason.contains(says), "{what}: {reason}");
        }
        other => panic!("{what}: Error::Unsupported, not {other:?}"),
    }
}

/// Setup is for servers' roles that may lack the right to create dblock's table
/// (PostgreSQL's `public`, a MySQL database); the embedded backend creates its tables on
/// first use and says so, naming itself.
async fn setup_is_refused_where_tables_are_made_on_first_use(db: &TestDb) {
    let locks = db.locks().await;
    let r = within(30, "setup", locks.setup(&[])).await;
    match db.backend() {
        "postgres" => assert_eq!(
            r.unwrap(),
            "public.dblock_fencing, public.dblock_leaders, public.dblock_runs"
        ),
        "mysql" => {
            let tables = r.unwrap();
            let tables: Vec<&str> = tables.split(", ").collect();
            assert_eq!(tables.len(), 3, "{tables:?}");
            assert!(tables[0].ends_with(".dblock_fencing"), "{tables:?}");
            assert!(tables[1].ends_with(".dblock_leaders"), "{tables:?}");
            assert!(tables[2].ends_with(".dblock_runs"), "{tables:?}");
        }
        backend => unsupported(
            r,
            Capability::Setup,
            "setup",
            &format!("the {backend} backend has no setup"),
        ),
    }
}

dblock_testkit::every_backend!(setup_is_refused_where_tables_are_made_on_first_use);

/// `dblock bench` measures its floor on raw connections it opens itself: a handle on a
/// caller's sqlx pool cannot, and says so before anything is timed. Control: the same
/// database through a URL runs (one short run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmark_is_refused_on_a_borrowed_sqlx_pool() {
    let pg = TestDb::postgres("bench_sqlx").await;
    let my = TestDb::mysql("bench_sqlx").await;
    let borrowed = [
        (
            "postgres",
            Locks::from_sqlx_pool(sqlx::PgPool::connect(pg.url()).await.unwrap())
                .await
                .unwrap(),
        ),
        (
            "mysql",
            Locks::from_sqlx_mysql_pool(sqlx::MySqlPool::connect(my.url()).await.unwrap())
                .await
                .unwrap(),
        ),
    ];
    for (backend, locks) in &borrowed {
        let r = within(30, "bench", dblock::bench::run(locks, 0.05, |_| {})).await;
        unsupported(r, Capability::Benchmark, backend, "not an sqlx pool");
    }
    let direct = pg.locks().await;
    let rows = within(60, "bench", dblock::bench::run(&direct, 0.05, |_| {}))
        .await
        .unwrap();
    assert_eq!(rows.len(), dblock::bench::WORKLOADS.len());
}

/// The embedded backend's locks belong to the process holding them: `terminate_holders`
/// is refused, naming the holder's process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ending_a_holder_is_refused_on_the_embedded_backend() {
    let db = TestDb::sqlite("terminate").await;
    let locks = db.locks().await;
    let _g = locks.lock("held").await.unwrap();
    let r = within(30, "terminate", locks.terminate_holders("held")).await;
    unsupported(
        r,
        Capability::EndHolders,
        "terminate_holders",
        &std::process::id().to_string(),
    );
}
