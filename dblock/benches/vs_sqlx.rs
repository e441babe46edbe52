//! PostgreSQL, one worker, uncontended: dblock's lock cycle beside the one-round-trip
//! floor and sqlx's `PgAdvisoryLock`, on the same server in the same run.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo bench -p dblock --bench vs_sqlx
//! ```
//!
//! - floor (`dblock bench`'s): `BEGIN; SELECT pg_advisory_xact_lock(k)`, the lock held
//!   when the reply comes, released by `ROLLBACK AND CHAIN` at the head of the next
//!   message: one message and one round trip per cycle (tokio-postgres);
//! - for reference, `SELECT pg_advisory_xact_lock(k)` in autocommit: less work (the lock
//!   is released inside the statement, never held across a round trip);
//! - dblock: `locks.lock(name)` and drop the guard (transaction scope, the default);
//! - dblock session: the same with `Scope::Session`;
//! - sqlx: `PgAdvisoryLock::acquire` on a pooled connection, then `release_now` (sqlx's
//!   prompt release; dropping the guard would leave the unlock queued until the
//!   connection's next use).
//!
//! The contenders run in alternating half-second slices (after one warm-up slice each).
//! Prints cycles per second and each one's ratio to the floor and to sqlx.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::{Duration, Instant};

use dblock::{Locks, Scope};

/// Seconds per contender, run in alternating slices of half a second so that a machine
/// whose speed drifts slows every contender alike.
const SECS: f64 = 3.0;
const SLICE: f64 = 0.5;

/// This process's CPU time (user + system), in seconds.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    // utime and stime: fields 14 and 15 of stat, 12 and 13 after the command name.
    let ticks: f64 = fields
        .get(11)
        .and_then(|u| u.parse::<f64>().ok())
        .unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
    ticks / 100.0
}

/// Cycles a contender ran in one slice, how long the slice took, and the CPU time this
/// process spent.
async fn slice<F, Fut>(cycle: &mut F, n: &mut u64) -> (u64, f64, f64)
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    let cpu = cpu_secs();
    let end = start + Duration::from_secs_f64(SLICE);
    let mut done = 0;
    while Instant::now() < end {
        cycle(*n).await;
        *n += 1;
        done += 1;
    }
    (done, start.elapsed().as_secs_f64(), cpu_secs() - cpu)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing to run.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // Every contender alike, without TLS: the raw floor and sqlx here have none, and
    // dblock would otherwise use it where the server offers it (sslmode=prefer).
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let url = if url.contains("sslmode=") {
        url
    } else {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}sslmode=disable")
    };
    let names: Vec<String> = (0..64).map(|i| format!("bench:vs:{i}")).collect();

    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let keys: Vec<i64> = names
        .iter()
        .map(|n| dblock::Key::new("public", n).unwrap().as_i64())
        .collect();
    let (held_client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let holding = std::cell::Cell::new(false);
    let mut held_cycle = |i: u64| {
        let head = match holding.replace(true) {
            true => "ROLLBACK AND CHAIN; ",
            false => "BEGIN; ",
        };
        let sql = format!(
            "{head}SELECT pg_advisory_xact_lock({})",
            keys[(i % 64) as usize]
        );
        let client = &held_client;
        async move {
            // Read as it streams in, nothing kept (as dblock reads its replies).
            let stream = client.simple_query_raw(&sql).await.unwrap();
            let mut stream = std::pin::pin!(stream);
            while let Some(m) = futures_util::StreamExt::next(&mut stream).await {
                m.unwrap();
            }
        }
    };
    let mut floor_cycle = |i: u64| {
        let sql = format!("SELECT pg_advisory_xact_lock({})", keys[(i % 64) as usize]);
        let client = &client;
        async move {
            client.simple_query(&sql).await.unwrap();
        }
    };
    let locks = Locks::connect(&url).await.unwrap();
    let mut xact_cycle = |i: u64| {
        let (locks, name) = (&locks, &names[(i % 64) as usize]);
        async move { drop(locks.lock(name).await.unwrap()) }
    };
    let session = Locks::builder()
        .url(&url)
        .scope(Scope::Session)
        .build()
        .await
        .unwrap();
    let mut session_cycle = |i: u64| {
        let (locks, name) = (&session, &names[(i % 64) as usize]);
        async move { drop(locks.lock(name).await.unwrap()) }
    };
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let sqlx_locks: Vec<sqlx::postgres::PgAdvisoryLock> = names
        .iter()
        .map(sqlx::postgres::PgAdvisoryLock::new)
        .collect();
    let mut sqlx_cycle = |i: u64| {
        let (pool, lock) = (&pool, &sqlx_locks[(i % 64) as usize]);
        async move {
            let conn = pool.acquire().await.unwrap();
            let guard = lock.acquire(conn).await.unwrap();
            let _conn = guard.release_now().await.unwrap();
        }
    };

    // Warm-up slice each, then alternate.
    let mut n = [0u64; 5];
    let mut total = [(0u64, 0f64, 0f64); 5];
    let slices = (SECS / SLICE).round() as usize;
    for round in 0..=slices {
        let r = [
            slice(&mut floor_cycle, &mut n[0]).await,
            {
                let r = slice(&mut held_cycle, &mut n[4]).await;
                if holding.replace(false) {
                    held_client.simple_query("ROLLBACK").await.unwrap();
                }
                r
            },
            slice(&mut xact_cycle, &mut n[1]).await,
            slice(&mut session_cycle, &mut n[2]).await,
            slice(&mut sqlx_cycle, &mut n[3]).await,
        ];
        if round > 0 {
            for (t, (ops, secs, cpu)) in total.iter_mut().zip(r) {
                t.0 += ops;
                t.1 += secs;
                t.2 += cpu;
            }
        }
    }
    let rate = |i: usize| total[i].0 as f64 / total[i].1;
    let cpu_us = |i: usize| total[i].2 * 1e6 / total[i].0.max(1) as f64;
    // In the order the slices ran.
    let (autocommit, floor, dblock_xact, dblock_session, sqlx_rate) =
        (rate(0), rate(1), rate(2), rate(3), rate(4));

    println!(
        "PostgreSQL, 1 worker, uncontended ({SECS} s each in {SLICE} s slices, same server, same run)"
    );
    println!(
        "{:<52} {:>10} {:>9} {:>9} {:>14}",
        "", "cycles/s", "÷ floor", "÷ sqlx", "client CPU µs"
    );
    for (i, (label, r)) in [
        ("reference: pg_advisory_xact_lock, autocommit", autocommit),
        ("floor: BEGIN; lock … ROLLBACK AND CHAIN (carried)", floor),
        ("dblock: lock + drop (transaction scope)", dblock_xact),
        ("dblock: lock + drop (session scope)", dblock_session),
        ("sqlx PgAdvisoryLock: acquire + release_now", sqlx_rate),
    ]
    .into_iter()
    .enumerate()
    {
        println!(
            "{label:<52} {r:>10.0} {:>9.2} {:>9.2} {:>14.1}",
            r / floor,
            r / sqlx_rate,
            cpu_us(i)
        );
    }
}
