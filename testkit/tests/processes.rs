//! Exclusion across real OS processes, on PostgreSQL, MySQL/MariaDB and the embedded
//! SQLite file: one source, every backend (`every_backend!`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

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
async fn eight_processes_never_overlap(url: &str) {
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
async fn a_killed_holder_frees_the_lock_for_a_waiter(url: &str) {
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

dblock_testkit::every_backend!(
    eight_processes_never_overlap,
    a_killed_holder_frees_the_lock_for_a_waiter,
);
