//! Waiting for a lock another process holds, on the embedded backend: in line, not by
//! polling. The order is asserted, never the time: a released lock goes to the process
//! at the head of the line, not back to the releaser; new readers do not pass a waiting
//! writer; a cancelled wait leaves nothing held and at most one thread behind.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::MetadataExt;
use std::process::Stdio;
use std::time::Duration;

use dblock_testkit::SqliteDb;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

type Lines = tokio::io::Lines<BufReader<tokio::process::ChildStdout>>;

fn spawn(args: &[&str]) -> (Child, Lines) {
    let mut child = Command::new(WORKER)
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

async fn line(lines: &mut Lines, secs: u64) -> Option<String> {
    match tokio::time::timeout(Duration::from_secs(secs), lines.next_line()).await {
        Ok(Ok(l)) => l,
        _ => None,
    }
}

/// Kernel locks (held and blocked) on `db`'s lock file whose range `fits` (start, end).
fn kernel_locks(db: &SqliteDb, fits: impl Fn(u64, u64) -> bool) -> usize {
    let ino = std::fs::metadata(db.dir.path().join("locks.db-locks"))
        .unwrap()
        .ino()
        .to_string();
    std::fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .map(|l| {
            l.split_whitespace()
                .filter(|t| *t != "->")
                .collect::<Vec<_>>()
        })
        .filter(|t| {
            let start = t.get(6).and_then(|v| v.parse().ok());
            let end = t.get(7).and_then(|v| {
                if *v == "EOF" {
                    Some(u64::MAX)
                } else {
                    v.parse().ok()
                }
            });
            t.get(5).and_then(|d| d.rsplit(':').next()) == Some(ino.as_str())
                && start.zip(end).is_some_and(|(s, e)| fits(s, e))
        })
        .count()
}

/// Kernel locks covering byte `offset` of `db`'s lock file, held and blocked.
fn kernel_locks_at(db: &SqliteDb, offset: u64) -> usize {
    kernel_locks(db, |s, e| s <= offset && offset <= e)
}

/// Waits (bounded) until another process is in line for `name`: its thread holds, or
/// waits in the kernel for, the name's gate byte alone (a holder in this process may
/// hold gate and lock byte together, a range of two). Returns whether that was seen.
async fn until_in_line(db: &SqliteDb, locks: &dblock::Locks, name: &str) -> bool {
    let gate = locks.key(name).unwrap().file_offset() ^ 1;
    dblock_testkit::eventually(5, &mut || async {
        kernel_locks(db, |s, e| s == gate && e == gate) > 0
    })
    .await
}

/// The releasing process comes straight back for the lock, as a loop of critical
/// sections does: it must queue behind the process that was waiting, not take the lock
/// again before that process wakes up. (Before, waiters in other processes polled every
/// few milliseconds and the releaser won nearly every time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_lock_goes_to_the_waiting_process_not_back_to_the_releaser() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    for round in 0..5 {
        let g = locks.lock("h").await.unwrap();
        let (mut waiter, mut wl) = spawn(&["wait", &db.url, "h"]);
        let queued = until_in_line(&db, &locks, "h").await;
        drop(g);
        let again = tokio::time::timeout(Duration::from_secs(10), locks.lock("h"))
            .await
            .unwrap()
            .unwrap();
        // The waiter prints before it releases: if it had the lock first, the line is
        // already there.
        let w = line(&mut wl, 1).await;
        assert_eq!(
            w.as_deref(),
            Some("acquired"),
            "round {round}: the releaser took the lock back before the waiting process \
             (waiter seen in line: {queued})"
        );
        drop(again);
        assert!(waiter.wait().await.unwrap().success());
    }
}

/// Readers keep a name busy; a writer of another process lines up; from then on a new
/// reader waits behind the writer instead of joining the readers, in another process or
/// in the readers' own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_readers_do_not_pass_a_waiting_writer() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let (mut reader, mut rl) = spawn(&["hold", &db.url, "r", "--shared"]);
    assert!(
        line(&mut rl, 10)
            .await
            .is_some_and(|l| l.starts_with("held"))
    );
    let here = locks.request("r").shared().lock().await.unwrap();
    // The control: with no writer waiting, readers share.
    let other = dblock::Locks::connect(&db.url).await.unwrap();
    drop(
        other
            .request("r")
            .shared()
            .try_lock()
            .await
            .unwrap()
            .unwrap(),
    );
    let (mut writer, mut wl) = spawn(&["wait", &db.url, "r"]);
    let queued = until_in_line(&db, &locks, "r").await;
    assert!(
        locks
            .request("r")
            .shared()
            .try_lock_for(Duration::from_millis(200))
            .await
            .unwrap()
            .is_none(),
        "a new reader passed a waiting writer (writer seen in line: {queued})"
    );
    // The readers leave; the writer gets it, then readers again.
    drop(here);
    reader.start_kill().unwrap();
    let _ = reader.wait().await;
    assert_eq!(line(&mut wl, 10).await.as_deref(), Some("acquired"));
    assert!(writer.wait().await.unwrap().success());
    let r = tokio::time::timeout(Duration::from_secs(5), locks.request("r").shared().lock()).await;
    assert!(matches!(r, Ok(Ok(_))), "{r:?}");
}

/// Threads of this process standing in line for `name` (named `dblock-` and the low 32
/// bits of the key's file offset in hex).
fn wait_threads(locks: &dblock::Locks, name: &str) -> usize {
    let comm = format!(
        "dblock-{:08x}",
        locks.key(name).unwrap().file_offset() as u32
    );
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim() == comm)
        .count()
}

/// Waits for a lock held by another process cut off every way — deadlines, dropped
/// futures, at every moment — leave nothing held: once the holder dies another process
/// gets the lock, and the thread that stood in line goes away. However many waits were
/// cut off, the process stood in line at most once per name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waits_across_processes_leave_nothing_held() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let (mut holder, mut hl) = spawn(&["hold", &db.url, "c"]);
    assert!(
        line(&mut hl, 10)
            .await
            .is_some_and(|l| l.starts_with("held"))
    );
    for us in [0u64, 50, 200, 1000, 5000, 20_000] {
        for _ in 0..3 {
            let r = locks.try_lock_for("c", Duration::from_micros(us)).await;
            assert!(matches!(r, Ok(None)), "{r:?}");
            let r = tokio::time::timeout(Duration::from_micros(us), locks.lock("c")).await;
            assert!(r.is_err(), "{r:?}");
            let r = locks
                .request("c")
                .shared()
                .try_lock_for(Duration::from_micros(us))
                .await;
            assert!(matches!(r, Ok(None)), "{r:?}");
        }
    }
    let threads = wait_threads(&locks, "c");
    assert!(threads <= 1, "{threads} threads wait in line for one name");
    holder.start_kill().unwrap();
    let _ = holder.wait().await;
    // Another process gets it: the place this process left in line holds nothing.
    let (mut waiter, mut wl) = spawn(&["wait", &db.url, "c"]);
    assert_eq!(line(&mut wl, 10).await.as_deref(), Some("acquired"));
    assert!(waiter.wait().await.unwrap().success());
    assert!(
        dblock_testkit::eventually(5, &mut || async { wait_threads(&locks, "c") == 0 }).await,
        "the thread in line did not leave"
    );
    let g = locks.try_lock("c").await.unwrap();
    assert!(g.is_some());
}

/// A wait that was cut off leaves the process's place in line to the next request of
/// the same kind, which then gets the lock when the holder goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_request_takes_over_a_cancelled_place_in_line() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let (mut holder, mut hl) = spawn(&["hold", &db.url, "p"]);
    assert!(
        line(&mut hl, 10)
            .await
            .is_some_and(|l| l.starts_with("held"))
    );
    assert!(
        locks
            .try_lock_for("p", Duration::from_millis(50))
            .await
            .unwrap()
            .is_none()
    );
    let waiting = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("p").await.map(drop) })
    };
    tokio::time::sleep(Duration::from_millis(50)).await; // not synchronisation: a gap
    holder.start_kill().unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), waiting).await;
    assert!(matches!(r, Ok(Ok(Ok(())))), "{r:?}");
    assert!(wait_threads(&locks, "p") <= 1);
}

/// A writer that gave up no longer holds back readers: its place at the head of the
/// line (the gate) is given back at once, not when the readers it waited for leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_gave_up_no_longer_holds_back_readers() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let (mut reader, mut rl) = spawn(&["hold", &db.url, "g", "--shared"]);
    assert!(
        line(&mut rl, 10)
            .await
            .is_some_and(|l| l.starts_with("held"))
    );
    for _ in 0..3 {
        let w = locks.try_lock_for("g", Duration::from_millis(200)).await;
        assert!(matches!(w, Ok(None)), "{w:?}");
        // The reader in the other process still holds "g"; a reader here may join it.
        let r = locks
            .request("g")
            .shared()
            .try_lock_for(Duration::from_secs(5))
            .await
            .unwrap();
        assert!(r.is_some(), "a writer that gave up still keeps readers out");
    }
    reader.start_kill().unwrap();
    let _ = reader.wait().await;
}

/// Inside a process a released lock goes straight to the next task waiting for it —
/// unless another process is at the head of the line: then that process gets it first,
/// as it would from a holder with nobody behind it. (A hand-over that did not look at
/// the line would let one busy process keep a name from everyone else.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_handed_over_inside_a_process_gives_way_to_a_process_in_line() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    for round in 0..3 {
        let g = locks.lock("h").await.unwrap();
        let mut local = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.lock("h").await.unwrap() })
        };
        // Observed waiting behind `g`, not slept for.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut local)
                .await
                .is_err(),
            "round {round}: the task waits while the lock is held"
        );
        let (mut waiter, mut wl) = spawn(&["wait", &db.url, "h"]);
        let queued = until_in_line(&db, &locks, "h").await;
        drop(g);
        let here = tokio::time::timeout(Duration::from_secs(10), local)
            .await
            .unwrap()
            .unwrap();
        // The waiting process prints before it releases: if it had the lock before the
        // task here, the line is already there.
        let w = line(&mut wl, 1).await;
        assert_eq!(
            w.as_deref(),
            Some("acquired"),
            "round {round}: the lock went to the task here before the process in line \
             (waiter seen in line: {queued})"
        );
        drop(here);
        assert!(waiter.wait().await.unwrap().success());
    }
}

/// Tasks of one process waiting behind each other on one name, cut off at every moment
/// (deadlines from nothing to a few hand-overs long), never leave the name held: when
/// they are done, the byte in the file is free and another process takes the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_off_waits_behind_a_holder_leave_nothing_held() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let mut tasks = Vec::new();
    for t in 0..6u64 {
        let locks = locks.clone();
        tasks.push(tokio::spawn(async move {
            let mut got = 0u32;
            for i in 0..200u64 {
                let us = (i * 7 + t * 13) % 60;
                if let Ok(Some(g)) = locks.try_lock_for("cut", Duration::from_micros(us)).await {
                    got += 1;
                    if i % 3 == 0 {
                        tokio::task::yield_now().await;
                    }
                    drop(g);
                }
            }
            got
        }));
    }
    let mut got = 0;
    for t in tasks {
        got += t.await.unwrap();
    }
    assert!(got > 0, "no task ever got the lock");
    let offset = locks.key("cut").unwrap().file_offset();
    assert_eq!(kernel_locks_at(&db, offset), 0, "the byte is still locked");
    let (mut waiter, mut wl) = spawn(&["wait", &db.url, "cut"]);
    assert_eq!(line(&mut wl, 10).await.as_deref(), Some("acquired"));
    assert!(waiter.wait().await.unwrap().success());
}
