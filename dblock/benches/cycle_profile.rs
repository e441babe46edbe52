//! A fixed number of lock cycles of one contender, for instruction counts: run it under
//! `valgrind --tool=callgrind` (or `perf stat`) twice with different counts and divide
//! the difference by the difference in cycles, which cancels start-up and connecting.
//!
//! ```text
//! cargo bench -p dblock --bench cycle_profile --no-run
//! valgrind --tool=callgrind target/release/deps/cycle_profile-* --bench dblock 2000
//! ```
//!
//! Contenders (one worker, uncontended, a current-thread runtime, as in `vs_sqlx`):
//! `floor` (`SELECT pg_advisory_xact_lock(k)` in autocommit, raw tokio-postgres
//! `simple_query`), `dblock` (`lock` + drop, transaction scope), `session` (the same,
//! session scope) and `sqlx` (`PgAdvisoryLock` acquire + `release_now`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use dblock::{Locks, Scope};

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
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let names: Vec<String> = (0..64).map(|i| format!("bench:vs:{i}")).collect();
    let keys: Vec<i64> = names
        .iter()
        .map(|n| dblock::Key::new("public", n).unwrap().as_i64())
        .collect();
    // One warm-up cycle first, so that connecting is outside the counted difference.
    match which {
        "floor" => {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            for i in 0..=n {
                let sql = format!("SELECT pg_advisory_xact_lock({})", keys[(i % 64) as usize]);
                client.simple_query(&sql).await.unwrap();
            }
        }
        "raw" => {
            // dblock's wire pattern on raw tokio-postgres: the lock request in a
            // transaction, the ROLLBACK sent without waiting for its reply.
            use futures_util::FutureExt;
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            for i in 0..=n {
                let sql = format!(
                    "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock({})",
                    keys[(i % 64) as usize]
                );
                client.simple_query(&sql).await.unwrap();
                drop(client.simple_query_raw("ROLLBACK").now_or_never());
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
            }
        }
        other => panic!("unknown contender {other}: floor, dblock, session or sqlx"),
    }
}
