//! MySQL / MariaDB (`MYSQL_URL`): a dropped guard's `RELEASE_LOCK` may be carried by the
//! next request on its connection (one message: release, then `GET_LOCK`), but the lock
//! is freed promptly whether or not a next request comes, and whatever becomes of it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::Locks;
use dblock_testkit::MyDb;

const T: Duration = Duration::from_secs(10);

/// Nothing follows the drop: the pool's flusher sends the release by itself, and another
/// connection can take the lock within a bounded poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_guard_is_freed_with_no_next_request() {
    let db = MyDb::new("carry_alone").await;
    let locks = db.locks().await;
    let other = db.locks().await;
    let name = db.lock_name("a");
    for round in 0..20 {
        let g = locks.lock("a").await.unwrap();
        assert!(db.holder(&name).await.is_some(), "round {round}: held");
        drop(g);
        assert!(db.eventually_free(&name, 10).await, "round {round}: freed");
        let g2 = tokio::time::timeout(T, other.lock("a"))
            .await
            .expect("another connection takes it")
            .unwrap();
        g2.release().await.unwrap();
    }
}

/// The next request on the same handle takes another lock straight after the drop (so
/// the release is likely carried on the reused connection): the old lock is free, the
/// new one held, and a waiter on the old one gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_carried_by_the_next_request_frees_the_old_lock() {
    let db = MyDb::new("carry_next").await;
    let locks = db.locks().await;
    let waiter_locks = db.locks().await;
    let (old, new) = (db.lock_name("old"), db.lock_name("new"));
    for round in 0..20 {
        let g = locks.lock("old").await.unwrap();
        let session = db.holder(&old).await.unwrap();
        let wl = waiter_locks.clone();
        let waiter = tokio::spawn(async move { wl.lock("old").await });
        // The waiter is in GET_LOCK on its own session before the drop.
        assert!(
            dblock_testkit::eventually(10, &mut || async {
                let n: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
                     WHERE INFO LIKE '%GET_LOCK%' AND ID <> CONNECTION_ID()",
                )
                .fetch_one(db.admin())
                .await
                .unwrap();
                n > 0
            })
            .await,
            "round {round}: the waiter waits"
        );
        drop(g);
        let g_new = tokio::time::timeout(T, locks.lock("new"))
            .await
            .unwrap()
            .unwrap();
        let w = tokio::time::timeout(T, waiter)
            .await
            .expect("the waiter is granted the old lock")
            .unwrap()
            .unwrap();
        let holder_old = db.holder(&old).await.unwrap();
        assert_ne!(holder_old, session, "round {round}: the old session let go");
        assert!(db.holder(&new).await.is_some());
        w.release().await.unwrap();
        g_new.release().await.unwrap();
        assert_eq!(db.holder(&new).await, None, "round {round}: one release");
    }
}

/// The same lock again, straight after the drop, on the same handle: the connection
/// holds it once (one release frees it), and in between it was free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_lock_again_is_held_once() {
    let db = MyDb::new("carry_same").await;
    let locks = db.locks().await;
    let name = db.lock_name("s");
    for round in 0..20 {
        let g = locks.lock("s").await.unwrap();
        drop(g);
        let g = tokio::time::timeout(T, locks.lock("s"))
            .await
            .unwrap()
            .unwrap();
        g.release().await.unwrap();
        assert_eq!(db.holder(&name).await, None, "round {round}: one release");
    }
}

/// A request that would carry the release is cancelled while it waits (its future
/// dropped, and a deadline passing): the old lock is freed all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_request_does_not_lose_a_carried_release() {
    let db = MyDb::new("carry_cancel").await;
    let locks = Locks::builder()
        .url(&db.url)
        .max_connections(1)
        .build()
        .await
        .unwrap();
    let blocker = db.locks().await;
    let (x, y) = (db.lock_name("x"), db.lock_name("y"));
    let _y = blocker.lock("y").await.unwrap();
    for round in 0..10 {
        let g = locks.lock("x").await.unwrap();
        drop(g);
        // One connection: the next request takes the one that held "x".
        if round % 2 == 0 {
            let cancelled = tokio::time::timeout(Duration::from_millis(100), locks.lock("y")).await;
            assert!(cancelled.is_err(), "round {round}: y is held elsewhere");
        } else {
            let none = locks
                .try_lock_for("y", Duration::from_millis(100))
                .await
                .unwrap();
            assert!(none.is_none(), "round {round}: y is held elsewhere");
        }
        assert!(db.eventually_free(&x, 10).await, "round {round}: x freed");
        let again = blocker.try_lock("x").await.unwrap();
        assert!(again.is_some(), "round {round}: x free for others");
        again.unwrap().release().await.unwrap();
    }
    assert!(db.holder(&y).await.is_some(), "y still the blocker's");
}
