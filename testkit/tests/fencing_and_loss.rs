//! Losing a lock on PostgreSQL — a restarted server, a silent backend, a session-scoped
//! lease. (Fencing, leases and elections on every backend: every_backend_fencing.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::{Error, Locks, LossReason, Scope};
use dblock_testkit::cluster::TempCluster;
use dblock_testkit::{PgSchema, signal};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// A restarted server ends every lock; every holder is told; tokens keep rising.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_tells_every_holder_and_tokens_keep_rising() {
    let cluster = TempCluster::start(&[]);
    let locks = Locks::connect(&cluster.url()).await.unwrap();
    let a = locks.request("a").fenced().lock().await.unwrap();
    let b = locks
        .request("b")
        .scope(Scope::Session)
        .fenced()
        .lock()
        .await
        .unwrap();
    let c = locks.request("c").lock().await.unwrap();
    let (ta, tb) = (a.fencing_token().unwrap(), b.fencing_token().unwrap());
    let lost = [a.lost(), b.lost(), c.lost()];
    cluster.restart();
    for (i, l) in lost.into_iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(10), l).await;
        assert!(
            matches!(r, Ok(LossReason::ConnectionClosed { .. })),
            "holder {i}: {r:?}"
        );
    }
    assert!(!a.is_held() && !b.is_held() && !c.is_held());
    assert!(matches!(c.release().await, Err(Error::LockLost { .. })));
    drop((a, b));
    // The same handle goes on, on new connections; and so does a new client.
    let a2 = locks.request("a").fenced().lock().await.unwrap();
    assert!(a2.fencing_token().unwrap() > ta);
    drop(a2);
    let fresh = Locks::connect(&cluster.url()).await.unwrap();
    let b2 = fresh.request("b").fenced().lock().await.unwrap();
    assert!(b2.fencing_token().unwrap() > tb);
}

/// A server that stops answering (its backend stopped) is noticed by the active check,
/// without any traffic of the holder's own, within check_interval + check_timeout (not at
/// the first tick after the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_loss_is_detected_within_interval_plus_timeout() {
    let s = PgSchema::new("silent_bound").await;
    // With these, checking only on ticks declared the loss after 2.95 s: over the bound.
    let (interval, timeout) = (Duration::from_millis(1000), Duration::from_millis(1500));
    let locks = Locks::builder()
        .url(&s.url)
        .check_interval(interval)
        .check_timeout(timeout)
        .build()
        .await
        .unwrap();
    let g = locks.lock("v").await.unwrap();
    let pid = s.advisory(g.key()).await[0].0;
    // Just after a check has completed: the worst case.
    tokio::time::sleep(interval + Duration::from_millis(50)).await;
    signal(pid, "-STOP");
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(5), g.lost()).await;
    let took = t.elapsed();
    signal(pid, "-CONT");
    assert!(matches!(r, Ok(LossReason::Unresponsive { .. })), "{r:?}");
    assert!(!g.is_held());
    eprintln!(
        "declared lost after {took:?} (bound {:?})",
        interval + timeout
    );
    // The bound, with a margin for a loaded machine's scheduling.
    assert!(
        took < interval + timeout + Duration::from_millis(250),
        "{took:?}"
    );
}

/// A lease frees the lock of a holder that falls silent (here: a paused process),
/// enforced by the server; a live holder keeps it however long it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_frees_a_paused_holders_lock() {
    let s = PgSchema::new("lease").await;
    let other = s.locks().await;
    // The transaction scope (the default): every_backend_fencing.rs.
    for scope in ["session"] {
        let mut args = vec![
            "hold",
            s.url.as_str(),
            "l",
            "--lease-ms",
            "600",
            "--check-ms",
            "100",
        ];
        if scope == "session" {
            args.push("--session");
        }
        let mut holder = Command::new(WORKER)
            .args(&args)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
        let held = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .unwrap()
            .unwrap();
        assert!(held.unwrap().starts_with("held"));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            other.try_lock("l").await.unwrap().is_none(),
            "{scope}: a live holder keeps its lease"
        );
        let pid = holder.id().unwrap();
        signal(pid, "-STOP");
        let paused = Instant::now();
        let g = other
            .try_lock_for("l", Duration::from_secs(10))
            .await
            .unwrap();
        let took = paused.elapsed();
        signal(pid, "-CONT");
        eprintln!("{scope}: a paused holder's lock freed after {took:?} (lease 600ms)");
        assert!(g.is_some(), "{scope}: freed within the lease");
        assert!(
            took >= Duration::from_millis(450) && took < Duration::from_secs(3),
            "{scope}: {took:?}"
        );
        drop(g);
        let _ = holder.start_kill();
        let _ = holder.wait().await;
    }
}
