//! A fixed number of lock cycles of one contender, for instruction counts and CPU per
//! cycle. Prints wall time, this process's CPU time and the server backends' CPU time
//! per cycle (from `/proc/*/schedstat`, nanoseconds, so short runs are precise; the
//! backends are found by an `application_name` of the run's own).
//!
//! ```text
//! cargo bench -p dblock --bench cycle_profile -- dblock 20000
//! ```
//!
//! For instructions, run it under `valgrind --tool=callgrind` twice with different
//! counts and divide the difference by the difference in cycles, which cancels
//! start-up and connecting:
//!
//! ```text
//! cargo bench -p dblock --bench cycle_profile --no-run
//! valgrind --tool=callgrind target/release/deps/cycle_profile-* --bench dblock 2000
//! ```
//!
//! Contenders (one worker, uncontended, a current-thread runtime, as in `vs_sqlx`):
//!
//! - `floor`: `SELECT pg_advisory_xact_lock(k)` in autocommit, raw tokio-postgres
//!   `simple_query`;
//! - `raw`: dblock's wire pattern before it carried releases, on raw tokio-postgres:
//!   `BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock(k)`, then
//!   `ROLLBACK` sent without waiting for its reply;
//! - `carried`: the same with the `ROLLBACK` at the head of the next request's message;
//! - `dblock`: `lock` + drop, transaction scope; `session`: the same, session scope;
//! - `sqlx`: `PgAdvisoryLock` acquire + `release_now`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Instant;

use dblock::{Locks, Scope};
use futures_util::FutureExt;

/// CPU time of a process (all its threads), nanoseconds.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing to run.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let rest: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with("--")).collect();
    let which = rest.first().map(|s| s.as_str()).unwrap_or("dblock");
    let n: u64 = rest.get(1).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let app = format!("cycle_profile_{}", std::process::id());
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}application_name={app}");
    let (admin, conn) = tokio_postgres::connect(&base, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let backends = || async {
        admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
                &[&app],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get::<_, i32>(0) as u32)
            .collect::<Vec<u32>>()
    };
    let names: Vec<String> = (0..64).map(|i| format!("bench:vs:{i}")).collect();
    let keys: Vec<i64> = names
        .iter()
        .map(|n| dblock::Key::new("public", n).unwrap().as_i64())
        .collect();
    let mut timing: Option<(Instant, u64, Vec<u32>, u64)> = None;
    // Starts the clocks after the warm-up cycle, so connecting is left out.
    macro_rules! start {
        () => {{
            let pids = backends().await;
            let server: u64 = pids.iter().map(|&p| cpu_ns(p)).sum();
            timing = Some((Instant::now(), cpu_ns(std::process::id()), pids, server));
        }};
    }
    match which {
        "floor" | "raw" | "carried" | "chain" => {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut open = false;
            for i in 0..=n {
                let k = keys[(i % 64) as usize];
                match which {
                    "floor" => {
                        let sql = format!("SELECT pg_advisory_xact_lock({k})");
                        client.simple_query(&sql).await.unwrap();
                    }
                    "raw" => {
                        let sql = format!(
                            "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock({k})"
                        );
                        client.simple_query(&sql).await.unwrap();
                        drop(client.simple_query_raw("ROLLBACK").now_or_never());
                    }
                    "chain" if open => {
                        let sql = format!("ROLLBACK AND CHAIN; SELECT pg_advisory_xact_lock({k})");
                        client.simple_query(&sql).await.unwrap();
                    }
                    _ => {
                        let carried = if open { "ROLLBACK; " } else { "" };
                        let sql = format!(
                            "{carried}BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock({k})"
                        );
                        client.simple_query(&sql).await.unwrap();
                        open = true;
                    }
                }
                if i == 0 {
                    start!();
                }
            }
        }
        "dblock" | "session" => {
            let scope = if which == "session" {
                Scope::Session
            } else {
                Scope::Transaction
            };
            let locks = Locks::builder()
                .url(&url)
                .scope(scope)
                .build()
                .await
                .unwrap();
            for i in 0..=n {
                drop(locks.lock(&names[(i % 64) as usize]).await.unwrap());
                if i == 0 {
                    start!();
                }
            }
        }
        "sqlx" => {
            let pool = sqlx::PgPool::connect(&url).await.unwrap();
            let locks: Vec<sqlx::postgres::PgAdvisoryLock> = names
                .iter()
                .map(sqlx::postgres::PgAdvisoryLock::new)
                .collect();
            for i in 0..=n {
                let conn = pool.acquire().await.unwrap();
                let guard = locks[(i % 64) as usize].acquire(conn).await.unwrap();
                let _conn = guard.release_now().await.unwrap();
                if i == 0 {
                    start!();
                }
            }
        }
        other => panic!("unknown contender {other}: floor, raw, carried, dblock, session or sqlx"),
    }
    let Some((t0, client0, pids, server0)) = timing else {
        return;
    };
    let wall = t0.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64;
    let client = (cpu_ns(std::process::id()) - client0) as f64 / 1e3 / n.max(1) as f64;
    let server_now: u64 = pids.iter().map(|&p| cpu_ns(p)).sum();
    let server = server_now.saturating_sub(server0) as f64 / 1e3 / n.max(1) as f64;
    println!(
        "{which:<8} n={n:<7} wall {wall:7.2} µs/cycle  client CPU {client:6.2} µs  server CPU {server:6.2} µs  ({} backends)",
        pids.len()
    );
}
