//! A wait means the same on every backend: a zero timeout tries once, like `try_lock`,
//! and however short the timeout the lock is tried at least once, even when the handle
//! must first open a connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock_testkit::TestDb;
use dblock_testkit::testdb::within;

dblock_testkit::every_backend!(
    a_zero_timeout_tries_once_like_try_lock,
    a_tiny_timeout_on_a_fresh_handle_still_tries_the_lock,
);

async fn a_zero_timeout_tries_once_like_try_lock(db: &TestDb) {
    let locks = db.locks().await;
    let other = db.locks().await;
    let g = within(
        10,
        "zero timeout, free",
        locks.try_lock_for("z", Duration::ZERO),
    )
    .await;
    let g = g
        .unwrap()
        .expect("a free lock is granted to a zero timeout");
    let refused = within(
        10,
        "zero timeout, held",
        other.try_lock_for("z", Duration::ZERO),
    )
    .await;
    assert!(refused.unwrap().is_none(), "held elsewhere: not granted");
    g.release().await.unwrap();
    // A semaphore and a lock set likewise.
    let s = within(
        10,
        "semaphore, zero",
        locks.semaphore("zs", 2).try_lock_for(Duration::ZERO),
    )
    .await;
    assert!(s.unwrap().is_some());
    let set = within(
        10,
        "lock set, zero",
        locks.request_all(["za", "zb"]).try_lock_for(Duration::ZERO),
    )
    .await;
    assert!(set.unwrap().is_some());
}

async fn a_tiny_timeout_on_a_fresh_handle_still_tries_the_lock(db: &TestDb) {
    // Each handle opens its first connection inside the request: longer than 1 ms on a
    // server, which must not count as the wait having passed untried.
    for (i, timeout) in [Duration::from_nanos(1), Duration::from_millis(1)]
        .into_iter()
        .enumerate()
    {
        let locks = db.locks().await;
        let name = format!("tiny{i}");
        let g = within(10, "tiny timeout", locks.try_lock_for(&name, timeout)).await;
        assert!(g.unwrap().is_some(), "{timeout:?}: a free lock is granted");
        let fenced = within(
            10,
            "tiny timeout, fenced",
            locks
                .request(&format!("{name}-f"))
                .fenced()
                .try_lock_for(timeout),
        )
        .await;
        assert!(fenced.unwrap().is_some(), "{timeout:?}: fenced, granted");
    }
}
