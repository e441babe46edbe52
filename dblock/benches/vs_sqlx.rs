//! PostgreSQL, one worker, uncontended: dblock's lock cycle beside the one-round-trip
//! floor and sqlx's `PgAdvisoryLock`, on the same server in the same run.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo bench -p dblock --bench vs_sqlx
//! ```
//!
//! - floor: `SELECT pg_advisory_xact_lock(k)` in autocommit, one round trip (tokio-postgres);
//! - dblock: `locks.lock(name)` and drop the guard (transaction scope, the default);
//! - dblock session: the same with `Scope::Session`;
//! - sqlx: `PgAdvisoryLock::acquire` on a pooled connection, then `release_now` (sqlx's
//!   prompt release; dropping the guard would leave the unlock queued until the
//!   connection's next use).
//!
//! Prints cycles per second and each one's ratio to the floor and to sqlx.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::{Duration, Instant};

use dblock::{Locks, Scope};

const SECS: f64 = 3.0;

async fn rate<F, Fut>(mut cycle: F) -> f64
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    // Warm up, then measure.
    let warm = Instant::now() + Duration::from_millis(300);
    let mut i = 0;
    while Instant::now() < warm {
        cycle(i).await;
        i += 1;
    }
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(SECS);
    let mut n = 0u64;
    while Instant::now() < end {
        cycle(n).await;
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing to run.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let names: Vec<String> = (0..64).map(|i| format!("bench:vs:{i}")).collect();

    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let keys: Vec<i64> = names
        .iter()
        .map(|n| dblock::Key::new("public", n).unwrap().as_i64())
        .collect();
    let floor = rate(|i| {
        let sql = format!("SELECT pg_advisory_xact_lock({})", keys[(i % 64) as usize]);
        let client = &client;
        async move {
            client.simple_query(&sql).await.unwrap();
        }
    })
    .await;

    let locks = Locks::connect(&url).await.unwrap();
    let dblock_xact = rate(|i| {
        let (locks, name) = (&locks, &names[(i % 64) as usize]);
        async move { drop(locks.lock(name).await.unwrap()) }
    })
    .await;

    let session = Locks::builder()
        .url(&url)
        .scope(Scope::Session)
        .build()
        .await
        .unwrap();
    let dblock_session = rate(|i| {
        let (locks, name) = (&session, &names[(i % 64) as usize]);
        async move { drop(locks.lock(name).await.unwrap()) }
    })
    .await;

    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let sqlx_locks: Vec<sqlx::postgres::PgAdvisoryLock> = names
        .iter()
        .map(sqlx::postgres::PgAdvisoryLock::new)
        .collect();
    let sqlx_rate = rate(|i| {
        let (pool, lock) = (&pool, &sqlx_locks[(i % 64) as usize]);
        async move {
            let conn = pool.acquire().await.unwrap();
            let guard = lock.acquire(conn).await.unwrap();
            let _conn = guard.release_now().await.unwrap();
        }
    })
    .await;

    println!("PostgreSQL, 1 worker, uncontended ({SECS} s each, same server, same run)");
    println!(
        "{:<44} {:>10} {:>9} {:>9}",
        "", "cycles/s", "÷ floor", "÷ sqlx"
    );
    for (label, r) in [
        ("floor: pg_advisory_xact_lock, autocommit", floor),
        ("dblock: lock + drop (transaction scope)", dblock_xact),
        ("dblock: lock + drop (session scope)", dblock_session),
        ("sqlx PgAdvisoryLock: acquire + release_now", sqlx_rate),
    ] {
        println!(
            "{label:<44} {r:>10.0} {:>9.2} {:>9.2}",
            r / floor,
            r / sqlx_rate
        );
    }
}
