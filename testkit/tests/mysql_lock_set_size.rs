//! A MySQL/MariaDB lock set needs one session per name: a set larger than the handle
//! may open is refused before anything is taken.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::Error;
use dblock_testkit::MyDb;
use dblock_testkit::testdb::within;

/// Five names on a handle of four connections (dblock's own, and an sqlx pool's): an
/// `Configuration` error at once that says what to change, with no name held meanwhile
/// or after; four names fit. Before, the set held four names for the pool's acquire
/// timeout (30 s by default), then failed with `Timeout { PoolConnection }`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_set_larger_than_the_pool_is_refused_before_anything_is_taken() {
    let db = MyDb::new("my_set_size").await;
    let own = dblock::Locks::builder()
        .url(&db.url)
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(120))
        .build()
        .await
        .unwrap();
    let pool = dblock::sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(120))
        .connect(&db.url)
        .await
        .unwrap();
    let borrowed = dblock::Locks::from_sqlx_mysql_pool(pool).await.unwrap();
    let names = ["s0", "s1", "s2", "s3", "s4"];
    for locks in [&own, &borrowed] {
        // Bounded only so that the old behaviour fails instead of hanging.
        let r = within(60, "lock_all of 5", locks.lock_all(names)).await;
        match r {
            Err(Error::Configuration { reason }) => {
                assert!(reason.contains("max_connections"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        let r = within(60, "try_lock_all of 5", locks.try_lock_all(names)).await;
        assert!(matches!(r, Err(Error::Configuration { .. })), "{r:?}");
        for n in names {
            assert_eq!(db.holder(&db.lock_name(n)).await, None, "{n} is not held");
        }
        let four = within(
            30,
            "lock_all of 4",
            locks.lock_all(names[..4].iter().copied()),
        )
        .await;
        let four = four.unwrap();
        assert_eq!(four.len(), 4);
        four.release().await.unwrap();
    }
}
