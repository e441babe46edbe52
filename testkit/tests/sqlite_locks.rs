//! Locking semantics of the embedded backend, on real files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Error, Locks};
use dblock_testkit::{SqliteDb, semantics};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exclusive_lock_has_one_holder_at_a_time() {
    let db = SqliteDb::new();
    semantics::an_exclusive_lock_has_one_holder_at_a_time(&db.locks().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_common_semantics_hold() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    semantics::try_lock_reports_a_held_lock_as_none(&locks).await;
    semantics::a_deadline_wait_gives_up_or_gets_the_lock(&locks).await;
    semantics::shared_holders_coexist_and_exclude_an_exclusive_one(&locks).await;
    semantics::tasks_of_one_process_exclude_each_other(&locks, |l| l.request("counter")).await;
}

/// Two handles of one process are two open file descriptions: they exclude each other
/// through the kernel, as two processes would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handles_on_one_file_exclude_each_other() {
    let db = SqliteDb::new();
    let a = db.locks().await;
    let b = db.locks().await;
    let g = a.lock("x").await.unwrap();
    assert!(b.try_lock("x").await.unwrap().is_none());
    let rs = a.request("y").shared().lock().await.unwrap();
    assert!(
        b.request("y").shared().try_lock().await.unwrap().is_some(),
        "readers share across handles"
    );
    assert!(b.try_lock("y").await.unwrap().is_none());
    drop(rs);
    let mut waiter = tokio::spawn(async move { b.lock("x").await.map(drop) });
    // Observed waiting, not slept for: it does not finish while the lock is held.
    assert!(
        tokio::time::timeout(Duration::from_millis(50), &mut waiter)
            .await
            .is_err(),
        "the waiter waits while the lock is held"
    );
    drop(g);
    let r = tokio::time::timeout(Duration::from_secs(5), waiter).await;
    assert!(matches!(r, Ok(Ok(Ok(())))), "{r:?}");
}

/// A cancelled wait leaves nothing behind: the lock is free for others afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_waits_leave_nothing_held() {
    let db = SqliteDb::new();
    let a = db.locks().await;
    let b = db.locks().await;
    let g = a.lock("c").await.unwrap();
    for us in [0u64, 100, 1000, 3000, 10_000] {
        let r = tokio::time::timeout(Duration::from_micros(us), b.lock("c")).await;
        assert!(r.is_err());
        if let Ok(g2) =
            tokio::time::timeout(Duration::from_micros(us), b.lock(&format!("free{us}"))).await
        {
            drop(g2.unwrap());
        }
    }
    drop(g);
    assert!(b.try_lock("c").await.unwrap().is_some());
    for us in [0u64, 100, 1000, 3000, 10_000] {
        assert!(a.try_lock(&format!("free{us}")).await.unwrap().is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_file_lies_beside_the_database_and_the_namespace_is_public() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    assert_eq!(locks.namespace(), dblock::DEFAULT_NAMESPACE);
    assert_eq!(locks.backend_name(), "sqlite");
    assert!(db.dir.path().join("locks.db-locks").exists());
    let url2 = format!("sqlite://{}", db.path.display());
    let other = Locks::connect(&url2).await.unwrap();
    let _g = locks.lock("same").await.unwrap();
    assert!(
        other.try_lock("same").await.unwrap().is_none(),
        "sqlite://PATH names the same file"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_path_is_a_typed_error() {
    let r = Locks::connect("sqlite:/proc/no/such/dir/x.db").await;
    assert!(matches!(r, Err(Error::Io { .. })), "{r:?}");
    let r = Locks::connect("sqlite::memory:").await;
    assert!(matches!(r, Err(Error::InvalidUrl { .. })), "{r:?}");
    let db = SqliteDb::new();
    let locks = db.locks().await;
    assert!(matches!(
        locks.lock("").await,
        Err(Error::InvalidName { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_rise_with_every_grant() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let mut last = 0;
    for _ in 0..5 {
        let g = locks.request("f").fenced().lock().await.unwrap();
        let t = g.fencing_token().unwrap();
        assert!(t > last, "{t} after {last}");
        last = t;
    }
    // A new handle (a restarted process) continues above.
    let again = db.locks().await;
    let g = again.request("f").fenced().lock().await.unwrap();
    assert!(g.fencing_token().unwrap() > last);
    assert!(matches!(
        again.request("f").shared().fenced().try_lock().await,
        Err(Error::Unsupported(_))
    ));
}
