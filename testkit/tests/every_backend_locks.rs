//! The locking semantics every backend must have — on PostgreSQL, MySQL/MariaDB and the
//! embedded SQLite file, from this one source (`every_backend!`): exclusion across real
//! OS processes (with its control), a SIGKILLed holder, one holder at a time, `try`,
//! deadlines, cancellation, the shared mode, bad input. Each backend's own traps are
//! tested in its own file (`postgres_locks.rs`, `mysql_locks.rs`, `sqlite_*.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::{Error, Locks};
use dblock_testkit::testdb::within;
use dblock_testkit::{TestDb, semantics};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// Runs `procs` worker processes doing `iterations` read–sleep–write increments of one
/// counter file each; returns (final counter, overlapping critical sections seen).
async fn counter_run(url: &str, procs: usize, iterations: u32, locked: bool) -> (u64, u32) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("counter");
    std::fs::write(&file, "0\n").unwrap();
    let mut children = Vec::new();
    for _ in 0..procs {
        let mut cmd = Command::new(WORKER);
        cmd.args(["counter", url, "the-counter", file.to_str().unwrap()])
            .arg(iterations.to_string())
            .arg("1000")
            .stdout(Stdio::piped());
        if !locked {
            cmd.arg("--no-lock");
        }
        children.push(cmd.spawn().unwrap());
    }
    let mut overlaps = 0;
    for c in children {
        let out = c.wait_with_output().await.unwrap();
        assert!(out.status.success(), "worker failed: {out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        overlaps += text
            .trim()
            .strip_prefix("overlaps=")
            .unwrap()
            .parse::<u32>()
            .unwrap();
    }
    let n = std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (n, overlaps)
}

/// 8 processes × 50 read–sleep–write increments of one file, under the lock and
/// (the control) without it.
async fn eight_processes_never_overlap(db: &TestDb) {
    let url = db.url();
    let (n, overlaps) = counter_run(url, 8, 50, true).await;
    assert_eq!((n, overlaps), (400, 0), "with the lock: exact, no overlap");
    // The control: the same work without the lock loses updates, so the test can fail.
    let (n, overlaps) = counter_run(url, 8, 50, false).await;
    eprintln!("without the lock: counter {n} of 400, {overlaps} overlaps");
    assert!(
        n < 400 && overlaps > 0,
        "the control must race: counter {n}, overlaps {overlaps}"
    );
}

async fn spawn_reporting(
    args: &[&str],
) -> (
    Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut child = Command::new(WORKER)
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// A holder killed with SIGKILL never releases anything itself: the server (or the
/// kernel) must, and a waiter in another process gets the lock within a second.
async fn a_killed_holder_frees_the_lock_for_a_waiter(db: &TestDb) {
    let url = db.url();
    let (mut holder, mut hl) = spawn_reporting(&["hold", url, "k"]).await;
    let held = tokio::time::timeout(Duration::from_secs(10), hl.next_line()).await;
    assert!(
        matches!(&held, Ok(Ok(Some(l))) if l.starts_with("held")),
        "{held:?}"
    );
    let (mut waiter, mut wl) = spawn_reporting(&["wait", url, "k"]).await;
    // The waiter is really waiting.
    let early = tokio::time::timeout(Duration::from_millis(500), wl.next_line()).await;
    assert!(
        early.is_err(),
        "the waiter must not get a held lock: {early:?}"
    );
    let killed = Instant::now();
    holder.start_kill().unwrap(); // SIGKILL
    let got = tokio::time::timeout(Duration::from_secs(10), wl.next_line()).await;
    let after = killed.elapsed();
    assert!(
        matches!(&got, Ok(Ok(Some(l))) if l == "acquired"),
        "{got:?}"
    );
    eprintln!("waiter acquired {after:?} after the holder's SIGKILL");
    assert!(after < Duration::from_secs(1), "took {after:?}");
    let _ = holder.wait().await;
    assert!(waiter.wait().await.unwrap().success());
}

async fn one_holder_at_a_time(db: &TestDb) {
    semantics::an_exclusive_lock_has_one_holder_at_a_time(&db.locks().await).await;
}

async fn try_lock_reports_a_held_lock_as_none(db: &TestDb) {
    semantics::try_lock_reports_a_held_lock_as_none(&db.locks().await).await;
}

/// A deadline gives up no earlier than the deadline and leaves no wait behind on the
/// server; a lock freed in time is granted.
async fn a_deadline_wait_gives_up_or_gets_the_lock(db: &TestDb) {
    let locks = db.locks().await;
    semantics::a_deadline_wait_gives_up_or_gets_the_lock(&locks).await;
    let _g = locks.lock("d2").await.unwrap();
    let other = db.locks().await;
    for ms in [50u64, 300] {
        let t = Instant::now();
        let r = other
            .try_lock_for("d2", Duration::from_millis(ms))
            .await
            .unwrap();
        assert!(r.is_none());
        assert!(t.elapsed() >= Duration::from_millis(ms), "{ms} ms: early");
        assert!(db.until_waiting("d2", 0).await, "{ms} ms: a wait was left");
    }
}

async fn tasks_of_one_process_exclude_each_other(db: &TestDb) {
    semantics::tasks_of_one_process_exclude_each_other(&db.locks().await, |l| l.request("t")).await;
}

/// Readers share and exclude writers where the backend has a shared mode; where it has
/// none (MySQL's named locks) `shared()` is a typed error and nothing is taken — never
/// exclusive-as-shared.
async fn shared_mode_is_honoured_or_refused(db: &TestDb) {
    let locks = db.locks().await;
    if db.has_shared() {
        semantics::shared_holders_coexist_and_exclude_an_exclusive_one(&locks).await;
        return;
    }
    for r in [
        locks.request("rw").shared().try_lock().await.map(|_| ()),
        locks.request("rw").shared().lock().await.map(|_| ()),
    ] {
        match r {
            Err(Error::Unsupported {
                capability: dblock::Capability::SharedMode,
                reason,
            }) => assert!(reason.contains("shared"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(db.holders("rw").await, 0, "nothing taken");
}

/// Polls `fut` at most `polls` times, yielding to the runtime in between; drops it
/// unfinished otherwise. Returns whether it finished.
async fn polled<F: std::future::Future>(fut: F, polls: u64) -> bool {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..polls {
        let ready =
            std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx).is_ready()))
                .await;
        if ready {
            return true;
        }
        tokio::task::yield_now().await;
    }
    false
}

/// Acquisitions dropped at any point — on a free lock (before, during, just after the
/// grant), or while waiting behind a holder — leave nothing held and no wait running
/// on the server; when the holder lets go, no ghost waiter takes the lock.
async fn a_cancelled_acquisition_leaves_nothing_held(db: &TestDb) {
    let locks = db.locks().await;
    // Deterministic spread of cancellation points.
    let mut seed = 0x2545_f491_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut cut = 0;
    for i in 0..60 {
        // Cut most acquisitions after a random number of polls (timers tick in whole
        // milliseconds, coarser than an acquisition), some after a few milliseconds.
        let granted = match i % 4 {
            3 => tokio::time::timeout(Duration::from_millis(1 + next() % 5), locks.lock("c"))
                .await
                .is_ok(),
            _ => polled(locks.lock("c"), next() % 60).await,
        };
        if !granted {
            cut += 1;
        }
        let free =
            dblock_testkit::eventually(10, &mut || async { db.holders("c").await == 0 }).await;
        assert!(free, "round {i}: still held");
    }
    eprintln!("{cut} of 60 acquisitions on a free lock were cut off");
    // Behind a holder on another handle: every wait is cut off mid-wait.
    let holder = db.locks().await;
    let g = holder.lock("c").await.unwrap();
    for _ in 0..15 {
        let after = Duration::from_millis(1 + next() % 30);
        assert!(
            tokio::time::timeout(after, locks.lock("c")).await.is_err(),
            "granted while held"
        );
    }
    assert!(db.until_waiting("c", 0).await, "waits still running");
    assert_eq!(db.holders("c").await, 1);
    g.release().await.unwrap();
    // No ghost waiter took it: a third handle gets it at once.
    let third = db.locks().await;
    let got = within(10, "try_lock", third.try_lock("c")).await.unwrap();
    assert!(got.is_some(), "a cancelled waiter took the lock");
    // And the cancelling handle is fit for use.
    drop(got);
    let g = within(10, "lock after cancellations", locks.lock("c"))
        .await
        .unwrap();
    g.release().await.unwrap();
}

/// Bad names and namespaces are typed errors that take nothing; an unreachable server
/// (an unusable path) is a typed error, never a hang.
async fn bad_input_is_a_typed_error(db: &TestDb) {
    let locks = db.locks().await;
    for bad in ["", "nul\0inside", &"x".repeat(dblock::MAX_NAME_LEN + 1)] {
        assert!(
            matches!(locks.lock(bad).await, Err(Error::InvalidName { .. })),
            "{bad:?}"
        );
        assert!(matches!(
            locks.try_lock(bad).await,
            Err(Error::InvalidName { .. })
        ));
        assert!(matches!(locks.key(bad), Err(Error::InvalidName { .. })));
    }
    // The longest valid name works.
    let long = "é".repeat(dblock::MAX_NAME_LEN / 2);
    let g = locks.try_lock(&long).await.unwrap().expect("free");
    assert_eq!(db.holders(&long).await, 1);
    drop(g);
    let bad_ns = db.builder().namespace("").build().await;
    assert!(matches!(bad_ns, Err(Error::InvalidNamespace { .. })));
    let r = within(30, "connect", Locks::connect(&db.unreachable_url())).await;
    assert!(
        matches!(r, Err(Error::Connect { .. } | Error::Io { .. })),
        "{:?}",
        r.err()
    );
}

dblock_testkit::every_backend!(
    eight_processes_never_overlap,
    a_killed_holder_frees_the_lock_for_a_waiter,
    one_holder_at_a_time,
    try_lock_reports_a_held_lock_as_none,
    a_deadline_wait_gives_up_or_gets_the_lock,
    tasks_of_one_process_exclude_each_other,
    shared_mode_is_honoured_or_refused,
    a_cancelled_acquisition_leaves_nothing_held,
    bad_input_is_a_typed_error,
);
