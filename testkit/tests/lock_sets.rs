//! Many names at once (`Locks::lock_all`), on PostgreSQL, MySQL/MariaDB and the embedded
//! SQLite file (one source, every backend), and across real OS processes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::{Error, Locks, Scope};
use dblock_testkit::{TestDb, every_backend};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

async fn within<T>(secs: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer in {secs} s"))
}

/// Whether `other` can take `name` now (taking and releasing it).
async fn free(other: &Locks, name: &str) -> bool {
    within(10, "probe", other.try_lock(name))
        .await
        .unwrap()
        .is_some()
}

/// Whether `other` can take `name` within 5 s: a dropped guard's release is sent, not
/// awaited (on MySQL a lock's own task sends it).
async fn freed(other: &Locks, name: &str) -> bool {
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        if free(other, name).await {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// All or nothing: with one name held elsewhere, a try takes none of the others; once
/// it is freed, all are taken, and releasing the set frees them all.
async fn a_set_is_taken_whole_or_not_at_all(db: &TestDb) {
    let url = db.url();
    let a = within(10, "connect", Locks::connect(url)).await.unwrap();
    let b = within(10, "connect", Locks::connect(url)).await.unwrap();
    let names = ["pin:a", "pin:b", "pin:c", "pin:d"];
    let blocker = within(10, "lock", b.lock("pin:c")).await.unwrap();
    let r = within(10, "try_lock_all", a.try_lock_all(names))
        .await
        .unwrap();
    assert!(r.is_none(), "one name is held elsewhere");
    for n in ["pin:a", "pin:b", "pin:d"] {
        assert!(
            freed(&b, n).await,
            "{n} must not stay held by the failed try"
        );
    }
    // A deadline: not granted while the blocker holds on, and nothing kept.
    let started = Instant::now();
    let r = within(
        10,
        "try_lock_all_for",
        a.try_lock_all_for(names, Duration::from_millis(300)),
    )
    .await
    .unwrap();
    assert!(r.is_none());
    assert!(started.elapsed() >= Duration::from_millis(300));
    for n in ["pin:a", "pin:b", "pin:d"] {
        assert!(
            freed(&b, n).await,
            "{n} must not stay held after the deadline"
        );
    }
    // A waiter gets them all once the blocker lets go.
    let waiter = tokio::spawn({
        let a = a.clone();
        async move { a.lock_all(names).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "it waits for pin:c");
    drop(blocker);
    let set = within(10, "lock_all", waiter).await.unwrap().unwrap();
    assert_eq!(set.len(), 4);
    assert!(set.is_held());
    for n in names {
        assert!(!free(&b, n).await, "{n} is held by the set");
    }
    within(10, "release", set.release()).await.unwrap();
    for n in names {
        assert!(free(&b, n).await, "{n} is free after the release");
    }
}

/// Names given twice are taken once; an empty set is granted at once; the set's names
/// come back in key order; bad names are refused before anything is taken.
async fn names_are_checked_deduplicated_and_ordered(db: &TestDb) {
    let url = db.url();
    let locks = within(10, "connect", Locks::connect(url)).await.unwrap();
    let set = within(10, "lock_all", locks.lock_all(["x", "y", "x"]))
        .await
        .unwrap();
    assert_eq!(set.len(), 2);
    let keys: Vec<i64> = set.keys().map(|k| k.as_i64()).collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
    drop(set);
    let empty = within(10, "lock_all", locks.lock_all(Vec::<String>::new()))
        .await
        .unwrap();
    assert!(empty.is_empty());
    let r = within(10, "lock_all", locks.lock_all(["ok", ""])).await;
    assert!(matches!(r, Err(Error::InvalidName { .. })), "{r:?}");
    assert!(free(&locks, "ok").await);
}

/// Dropping a waiting `lock_all` leaves none of its names held.
async fn a_cancelled_wait_leaves_nothing_held(db: &TestDb) {
    let url = db.url();
    let a = within(10, "connect", Locks::connect(url)).await.unwrap();
    let b = within(10, "connect", Locks::connect(url)).await.unwrap();
    let blocker = within(10, "lock", b.lock("m:3")).await.unwrap();
    let r = tokio::time::timeout(
        Duration::from_millis(300),
        a.lock_all(["m:1", "m:2", "m:3", "m:4"]),
    )
    .await;
    assert!(r.is_err(), "still waiting when dropped");
    drop(blocker);
    for n in ["m:1", "m:2", "m:3", "m:4"] {
        assert!(freed(&b, n).await, "{n} left held by a dropped wait");
    }
}

/// Two real processes lock overlapping sets, given in opposite orders, `iterations`
/// times each: (overlaps, errors) summed, and the first error seen.
async fn two_processes(
    url: &str,
    sets: [&str; 2],
    iterations: u32,
    extra: &[&str],
) -> (u32, u32, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    for names in sets {
        let mut child = Command::new(WORKER)
            .args(["lock-all", url, names, &iterations.to_string()])
            .arg(dir.path())
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = within(30, "ready", lines.next_line()).await;
        assert!(matches!(&ready, Ok(Some(l)) if l == "ready"), "{ready:?}");
        children.push((child, lines));
    }
    for (child, _) in &mut children {
        child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"go\n")
            .await
            .unwrap();
    }
    let (mut overlaps, mut errors, mut said) = (0, 0, Vec::new());
    for (mut child, mut lines) in children {
        let line = within(300, "the worker finishes", lines.next_line())
            .await
            .unwrap()
            .unwrap();
        let mut parts = line.split(' ');
        let o = parts.next().unwrap().strip_prefix("overlaps=").unwrap();
        let e = parts.next().unwrap().strip_prefix("errors=").unwrap();
        overlaps += o.parse::<u32>().unwrap();
        errors += e.parse::<u32>().unwrap();
        if let Ok(Some(l)) = within(10, "rest", lines.next_line()).await {
            said.push(l);
        }
        assert!(within(30, "exit", child.wait()).await.unwrap().success());
    }
    (overlaps, errors, said)
}

const SETS: [&str; 2] = ["s:a,s:b,s:c,s:d", "s:d,s:c,s:b,s:x"];

/// 1,000 times each, opposite orders: no deadlock error, no overlap. Control: the same
/// processes unlocked overlap.
async fn two_processes_in_opposite_orders_never_deadlock_or_overlap(db: &TestDb) {
    let url = db.url();
    let (overlaps, errors, said) = two_processes(url, SETS, 1000, &[]).await;
    assert_eq!((overlaps, errors), (0, 0), "{said:?}");
    let (overlaps, _, _) = two_processes(url, SETS, 200, &["--no-lock"]).await;
    eprintln!("without locks: {overlaps} overlaps");
    assert!(overlaps > 0, "the control must overlap");
}

every_backend!(
    a_set_is_taken_whole_or_not_at_all,
    names_are_checked_deduplicated_and_ordered,
    a_cancelled_wait_leaves_nothing_held,
    two_processes_in_opposite_orders_never_deadlock_or_overlap,
);

/// The control for deadlock freedom, on PostgreSQL: the same processes taking their
/// names one lock at a time, in the order given, deadlock (each waits for a name the
/// other holds; the server cannot see it, each lock being on a connection of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lock_at_a_time_in_opposite_orders_deadlocks_on_postgres() {
    let s = dblock_testkit::PgSchema::new("lockset_deadlock").await;
    let (_, errors, said) = two_processes(&s.url, SETS, 1000, &["--one-by-one"]).await;
    eprintln!("one by one: {errors} errors, {said:?}");
    assert!(errors > 0, "the control must deadlock");
    assert!(said.iter().any(|l| l.contains("deadlock")), "{said:?}");
}

/// Session-scoped sets on PostgreSQL: all or nothing, and released by one unlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_scoped_sets_on_postgres() {
    let s = dblock_testkit::PgSchema::new("lockset_session").await;
    let a = within(10, "connect", Locks::connect(&s.url)).await.unwrap();
    let b = within(10, "connect", Locks::connect(&s.url)).await.unwrap();
    let blocker = within(10, "lock", b.lock("q:2")).await.unwrap();
    let r = within(
        10,
        "try",
        a.request_all(["q:1", "q:2", "q:3"])
            .scope(Scope::Session)
            .try_lock(),
    )
    .await
    .unwrap();
    assert!(r.is_none());
    assert!(free(&b, "q:1").await && free(&b, "q:3").await);
    drop(blocker);
    let set = within(
        10,
        "lock",
        a.request_all(["q:1", "q:2", "q:3"])
            .scope(Scope::Session)
            .lock(),
    )
    .await
    .unwrap();
    assert!(!free(&b, "q:2").await);
    within(10, "release", set.release()).await.unwrap();
    for n in ["q:1", "q:2", "q:3"] {
        assert!(free(&b, n).await, "{n}");
    }
}
