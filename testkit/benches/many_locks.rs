//! Scale: one process holding many locks at once over 8 multiplexed connections, on a
//! throwaway cluster whose lock table has room for them (`max_locks_per_transaction =
//! 2000`, 40 connections: 80,000 entries).
//!
//! ```text
//! cargo bench -p dblock-testkit --bench many_locks            # 1,000 to 50,000
//! cargo bench -p dblock-testkit --bench many_locks -- 1000 50000
//! ```
//!
//! For each count, a fresh process (so that memory freed by a smaller run cannot be
//! reused by a larger one) builds a handle with `scope(Session).multiplex(8)`, takes
//! that many distinct locks with `try_lock` (1,000 requests in flight at a time,
//! pipelined on the shared connections), and reports:
//! - the time until every lock is granted, and the server's count of granted advisory
//!   locks (checked equal);
//! - resident memory per held lock: the process's RSS after, less before, divided by the
//!   count (guards and the handle's bookkeeping included);
//! - the time to release them all: from dropping every guard until the server shows
//!   none held (polled in `pg_locks`);
//! - the server sessions the handle used, and the CPU time per lock taken of those
//!   sessions (server) and of this process (client), from `/proc/*/schedstat`.
//!
//! With `LAPS=1` in the environment it also prints, every 5,000 locks, how long the last
//! 5,000 took and the server's CPU a lock over them: whether the cost of a lock grows
//! with the locks already held.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::{Duration, Instant};

use dblock::{Locks, Scope};
use dblock_testkit::cluster::TempCluster;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap()
        * 1024
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// CPU time of these processes (all their threads), nanoseconds.
fn cpu_ns(pids: &[i32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_dir(format!("/proc/{pid}/task")).ok())
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

async fn granted(admin: &tokio_postgres::Client) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// One count, in this process: prints one line of the table.
async fn one(url: &str, n: usize) {
    let (admin, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let locks = Locks::builder()
        .url(url)
        .scope(Scope::Session)
        .multiplex(8)
        .build()
        .await
        .unwrap();
    let names: Vec<String> = (0..n).map(|i| format!("tenant:{i}")).collect();
    // The shared connections opened, and the code paths run, before measuring.
    for i in 0..8 {
        drop(locks.try_lock(&format!("warm:{i}")).await.unwrap());
    }
    // The handle's server sessions, for their CPU time.
    let pids: Vec<i32> = admin
        .query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend' \
             AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (server0, client0) = (cpu_ns(&pids), cpu_ns(&[std::process::id() as i32]));
    let before = rss_bytes();
    let t = Instant::now();
    let mut guards = Vec::with_capacity(n);
    let (mut lap, mut lap_cpu) = (Instant::now(), server0);
    for (c, chunk) in names.chunks(1000).enumerate() {
        if std::env::var_os("LAPS").is_some() && c % 5 == 0 && c > 0 {
            let cpu = cpu_ns(&pids);
            eprintln!(
                "  {} held: the last 5,000 took {:?}, the server's CPU {:.1} µs a lock",
                c * 1000,
                lap.elapsed(),
                (cpu - lap_cpu) as f64 / 1e3 / 5000.0
            );
            (lap, lap_cpu) = (Instant::now(), cpu);
        }
        let mut set = tokio::task::JoinSet::new();
        for (i, name) in chunk.iter().enumerate() {
            let (locks, name) = (locks.clone(), name.clone());
            set.spawn(async move { (i, locks.try_lock(&name).await) });
        }
        let mut got: Vec<_> = set.join_all().await;
        got.sort_by_key(|g| g.0);
        for (_, g) in got {
            guards.push(g.unwrap().expect("a free lock"));
        }
    }
    let acquire = t.elapsed();
    let after = rss_bytes();
    let server_us = (cpu_ns(&pids) - server0) as f64 / 1e3 / n as f64;
    let client_us = (cpu_ns(&[std::process::id() as i32]) - client0) as f64 / 1e3 / n as f64;
    let held = granted(&admin).await;
    assert_eq!(
        held as usize, n,
        "every lock granted, as the server sees it"
    );
    let sessions: i64 = admin
        .query_one(
            "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let t = Instant::now();
    drop(guards);
    let dropped = t.elapsed();
    let mut polls = 0;
    while granted(&admin).await > 0 {
        polls += 1;
        assert!(polls < 100_000, "the locks were never all released");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let release = t.elapsed();
    println!(
        "{n:>7} {:>11.1} {:>13.0} {:>14.1} {:>14.1} {:>9.1} {:>9.1} {:>9} {:>12.1} {:>12.1}   load {}",
        acquire.as_secs_f64() * 1e3,
        n as f64 / acquire.as_secs_f64(),
        (after.saturating_sub(before)) as f64 / n as f64,
        release.as_secs_f64() * 1e3,
        dropped.as_secs_f64() * 1e3,
        (after.saturating_sub(before)) as f64 / (1 << 20) as f64,
        sessions,
        server_us,
        client_us,
        load()
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing to run.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let rt = || {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    if let Some(i) = args.iter().position(|a| a == "--one") {
        let url = &args[i + 1];
        let n: usize = args[i + 2].parse().unwrap();
        rt().block_on(one(url, n));
        return;
    }
    let counts: Vec<usize> = args[1..]
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect::<Vec<_>>();
    let counts = if counts.is_empty() {
        vec![1_000, 5_000, 10_000, 50_000]
    } else {
        counts
    };
    let cluster = TempCluster::start(&[("max_locks_per_transaction", "2000")]);
    let url = format!("{}?sslmode=disable", cluster.url());
    println!("many locks on one process: scope(Session).multiplex(8), a throwaway cluster");
    println!(
        "{:>7} {:>11} {:>13} {:>14} {:>14} {:>9} {:>9} {:>9} {:>12} {:>12}",
        "locks",
        "acquire ms",
        "acquired/s",
        "RSS B/lock",
        "release ms",
        "drop ms",
        "RSS MiB",
        "sessions",
        "srv CPU µs",
        "cli CPU µs"
    );
    let exe = std::env::current_exe().unwrap();
    for n in counts {
        let status = std::process::Command::new(&exe)
            .args(["--bench", "--one", &url, &n.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "{n} locks: {status}");
    }
    drop(cluster);
}
