//! A lock shared with a child process (`LockGuard::share_with_child`) on every backend:
//! it outlives its holder's death for as long as the child lives (with its control),
//! and ends for the child too when the holder releases it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;

use dblock_testkit::testdb::within;
use dblock_testkit::{TestDb, eventually, signal};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

dblock_testkit::every_backend!(
    a_shared_lock_outlives_its_killed_holder_until_the_child_exits,
    a_shared_lock_released_by_its_holder_is_free_while_the_child_runs,
);

/// `dblock-worker hold-share URL NAME [extra]`: the worker, its output, and its child's pid.
async fn holder(
    db: &TestDb,
    name: &str,
    extra: &[&str],
) -> (
    Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    u32,
) {
    let mut c = Command::new(WORKER)
        .args(["hold-share", db.url(), name])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
    let held = within(20, "held", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    let child: u32 = held.strip_prefix("held ").unwrap().parse().unwrap();
    (c, lines, child)
}

async fn is_free(locks: &dblock::Locks, name: &str) -> bool {
    match within(10, "try_lock", locks.try_lock(name)).await.unwrap() {
        Some(g) => {
            g.release().await.unwrap();
            true
        }
        None => false,
    }
}

/// SIGKILL the holder: while the child that shares the lock runs, nobody else gets it;
/// once the child is gone, the lock is free. The control, the same without sharing:
/// the lock is free as soon as the holder dies, the child still running.
async fn a_shared_lock_outlives_its_killed_holder_until_the_child_exits(db: &TestDb) {
    let other = db.locks().await;
    for share in [true, false] {
        let name = format!("shared-{share}");
        let extra: &[&str] = if share { &[] } else { &["--no-share"] };
        let (mut worker, _lines, child) = holder(db, &name, extra).await;
        signal(worker.id().unwrap(), "-KILL");
        within(10, "the holder's death", worker.wait())
            .await
            .unwrap();
        if share {
            // The server (or kernel) had every chance to free it; it must not have.
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(!is_free(&other, &name).await, "held while the child lives");
            assert_eq!(db.holders(&name).await, 1);
            signal(child, "-KILL");
        }
        let freed = eventually(10, &mut || async { is_free(&other, &name).await }).await;
        assert!(
            freed,
            "share={share}: free once the holder (and child) are gone"
        );
        if !share {
            // Control: freed although the child still runs.
            assert!(std::path::Path::new(&format!("/proc/{child}")).exists());
            signal(child, "-KILL");
        }
    }
}

/// Released by its holder, a shared lock is free for others at once, though the child
/// that shares it still runs: the child's copy does not keep it.
async fn a_shared_lock_released_by_its_holder_is_free_while_the_child_runs(db: &TestDb) {
    let other = db.locks().await;
    let (mut worker, mut lines, child) = holder(db, "released", &[]).await;
    worker
        .stdin
        .as_mut()
        .unwrap()
        .write_all(b"release\n")
        .await
        .unwrap();
    let said = within(20, "released", lines.next_line()).await.unwrap();
    assert_eq!(said.as_deref(), Some("released"));
    let freed = eventually(10, &mut || async { is_free(&other, "released").await }).await;
    assert!(freed, "free after the release, the child still running");
    assert!(std::path::Path::new(&format!("/proc/{child}")).exists());
    signal(child, "-KILL");
    drop(worker);
}
