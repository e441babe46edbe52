//! PostgreSQL: how soon the release of a dropped guard reaches the server, on an idle
//! multi-thread runtime (no other task runs, and none polls the connection).
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo bench -p dblock --bench pg_release
//! ```
//!
//! Each sample: dblock takes a lock (transaction scope, the default); a waiter on a
//! connection of its own, run by a thread of its own, asks for the same key with
//! `BEGIN; SELECT pg_advisory_xact_lock(k)` and is seen waiting in `pg_locks`; the
//! runtime is left idle for a few milliseconds (its threads park); then the guard is
//! dropped. The figure is the time from the drop to the waiter's reply: the release
//! sent, run by the server, the lock granted to the waiter and its reply read back —
//! an upper bound on the time the release takes to reach the server. Alternating with
//! each sample, a control: the same on a raw tokio-postgres connection whose `ROLLBACK`
//! is queued the moment it is released (what the machine allows). `SAMPLES` (500
//! unless set) samples each; prints p50, p90, p99 and the worst. Every connection
//! without TLS (`sslmode=disable` unless the URL names a mode).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use dblock::Locks;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The waiter: a thread with a runtime and a connection of its own. For each key it is
/// sent, it asks for the lock and answers with the instant the grant arrived, then
/// releases it.
fn waiter(
    url: String,
    pid_tx: mpsc::Sender<i32>,
) -> (
    mpsc::Sender<i64>,
    tokio::sync::mpsc::UnboundedReceiver<Instant>,
) {
    let (key_tx, key_rx) = mpsc::channel::<i64>();
    // Awaited by the idle runtime: no thread of it blocks or polls while it waits.
    let (at_tx, at_rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            let pid: i32 = c
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .unwrap()
                .get(0);
            pid_tx.send(pid).unwrap();
            while let Ok(k) = key_rx.recv() {
                c.simple_query(&format!("BEGIN; SELECT pg_advisory_xact_lock({k})"))
                    .await
                    .unwrap();
                let at = Instant::now();
                c.simple_query("ROLLBACK").await.unwrap();
                at_tx.send(at).unwrap();
            }
        });
    });
    (key_tx, at_rx)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    // Without TLS for every connection, like the control's (raw tokio-postgres here has
    // none).
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let url = if url.contains("sslmode=") {
        url
    } else {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}sslmode=disable")
    };
    let samples: usize = env_or("SAMPLES", 500);
    let locks = Locks::connect(&url).await.unwrap();
    let (admin, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let (pid_tx, pid_rx) = mpsc::channel();
    let (keys, mut grants) = waiter(url.clone(), pid_tx);
    let pid = pid_rx.recv().unwrap();
    let waiting = admin
        .prepare("SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted")
        .await
        .unwrap();

    // The control: a raw tokio-postgres connection whose release is queued on its
    // connection's task at once (what the machine allows, on the same runtime).
    let (raw, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);

    let mut lat = Vec::with_capacity(samples);
    let mut control = Vec::with_capacity(samples);
    for i in 0..2 * (samples + 10) {
        let name = format!("bench:release:{}", i % 64);
        let key = locks.key(&name).unwrap().as_i64();
        let dblock = i % 2 == 0;
        let g = match dblock {
            true => Some(locks.lock(&name).await.unwrap()),
            false => {
                raw.simple_query(&format!("BEGIN; SELECT pg_advisory_xact_lock({key})"))
                    .await
                    .unwrap();
                None
            }
        };
        keys.send(key).unwrap();
        // Seen waiting on the server, not slept for.
        loop {
            let n: i64 = admin.query_one(&waiting, &[&pid]).await.unwrap().get(0);
            if n > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        // Idle: the runtime's threads park, the connection's task sleeps.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let t = Instant::now();
        match g {
            Some(g) => drop(g),
            None => {
                use futures_util::FutureExt;
                // Queued in its first poll; the reply is dropped unread.
                let _ = raw.simple_query_raw("ROLLBACK").now_or_never();
            }
        }
        let at = grants.recv().await.unwrap();
        // The first few warm up connections and code paths.
        if i >= 20 {
            let us = at.saturating_duration_since(t).as_secs_f64() * 1e6;
            match dblock {
                true => lat.push(us),
                false => control.push(us),
            }
        }
    }
    println!(
        "PostgreSQL: a released lock, release -> the waiter's grant arrives ({samples} samples each, alternating, idle multi-thread runtime)"
    );
    for (label, v) in [
        ("dblock: guard dropped", &mut lat),
        ("control: raw ROLLBACK queued", &mut control),
    ] {
        v.sort_by(f64::total_cmp);
        let p = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        println!(
            "{label:<30} p50 {:>6.0} µs   p90 {:>6.0} µs   p99 {:>6.0} µs   worst {:>6.0} µs",
            p(0.5),
            p(0.9),
            p(0.99),
            p(1.0)
        );
    }
}
