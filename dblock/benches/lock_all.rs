//! PostgreSQL, one worker, uncontended: `lock_all` of 100 free names beside 100
//! sequential `lock` calls on the same names, on the same server in the same run.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo bench -p dblock --bench lock_all
//! ```
//!
//! - lock_all: `locks.lock_all(names)` and drop the set (transaction scope, the default):
//!   one message, one CASE statement trying the 100 keys;
//! - sequential: `locks.lock(name)` and drop the guard, for each of the 100 names in turn
//!   (one round trip each; holding all 100 at once would need 100 connections);
//! - floor: one `SELECT pg_advisory_xact_lock(k)` round trip in autocommit (tokio-postgres),
//!   for scale.
//!
//! The contenders run in alternating half-second slices (after one warm-up slice each).
//! Prints sets of 100 names per second and the ratio of the two.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::{Duration, Instant};

use dblock::Locks;

const SECS: f64 = 4.0;
const SLICE: f64 = 0.5;
const NAMES: usize = 100;

/// Operations a contender ran in one slice, and how long the slice took.
async fn slice<F, Fut>(op: &mut F) -> (u64, f64)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(SLICE);
    let mut done = 0;
    while Instant::now() < end {
        op().await;
        done += 1;
    }
    (done, start.elapsed().as_secs_f64())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing to run.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let names: Vec<String> = (0..NAMES).map(|i| format!("bench:all:{i}")).collect();
    let locks = Locks::connect(&url).await.unwrap();

    let mut all_op = || {
        let (locks, names) = (&locks, &names);
        async move { drop(locks.lock_all(names).await.unwrap()) }
    };
    let mut seq_op = || {
        let (locks, names) = (&locks, &names);
        async move {
            for n in names {
                drop(locks.lock(n).await.unwrap());
            }
        }
    };
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let key = dblock::Key::new("public", "bench:all:floor")
        .unwrap()
        .as_i64();
    let floor_sql = format!("SELECT pg_advisory_xact_lock({key})");
    let mut floor_op = || {
        let (client, sql) = (&client, &floor_sql);
        async move {
            client.simple_query(sql).await.unwrap();
        }
    };

    let mut total = [(0u64, 0f64); 3];
    let slices = (SECS / SLICE).round() as usize;
    for round in 0..=slices {
        let r = [
            slice(&mut all_op).await,
            slice(&mut seq_op).await,
            slice(&mut floor_op).await,
        ];
        if round > 0 {
            for (t, (ops, secs)) in total.iter_mut().zip(r) {
                t.0 += ops;
                t.1 += secs;
            }
        }
    }
    let per_op_ms = |i: usize| total[i].1 * 1e3 / total[i].0.max(1) as f64;
    let (all, seq, floor) = (per_op_ms(0), per_op_ms(1), per_op_ms(2));
    println!(
        "PostgreSQL, 1 worker, {NAMES} free names ({SECS} s each in {SLICE} s slices, same server, same run)"
    );
    println!("lock_all of {NAMES} names + drop:      {all:>9.3} ms");
    println!("{NAMES} sequential lock + drop:        {seq:>9.3} ms");
    println!("floor: one pg_advisory_xact_lock:   {floor:>9.3} ms");
    println!("sequential ÷ lock_all:              {:>9.1}×", seq / all);
}
