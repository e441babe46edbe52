//! Regressions for defects found in review, each reproduced against a real server
//! before it was fixed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use dblock::{Error, Locks, LossReason, Scope};
use dblock_testkit::{PgSchema, eventually, signal};

async fn side_conn(url: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c
}

/// A fenced transaction-scoped request that fails after its bridging session lock was
/// granted (here: its deadline passes while it waits for a previous holder's fenced
/// write to commit) must not leave that session lock on a pooled connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fenced_request_leaves_no_lock_behind() {
    let s = PgSchema::new("fenced_leak").await;
    let locks = s.locks().await;
    let key = locks.key("x").unwrap();
    locks
        .request("x")
        .fenced()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    for attempt in ["deadline", "try"] {
        // A previous holder's fenced write, not yet committed: FOR SHARE on the row.
        let side = side_conn(&s.url).await;
        side.batch_execute(&format!(
            "BEGIN; SELECT token FROM \"{}\".dblock_fencing WHERE key = {} FOR SHARE",
            dblock::fencing::PG_SCHEMA,
            key.as_i64()
        ))
        .await
        .unwrap();
        let r = match attempt {
            "deadline" => {
                locks
                    .request("x")
                    .fenced()
                    .try_lock_for(Duration::from_millis(300))
                    .await
            }
            _ => locks.request("x").fenced().try_lock().await,
        };
        assert!(
            matches!(r, Ok(None)),
            "{attempt}: not obtained while the row is held: {r:?}"
        );
        side.batch_execute("COMMIT").await.unwrap();
        let clean = eventually(5, &mut || async { s.advisory(key).await.is_empty() }).await;
        assert!(
            clean,
            "{attempt}: lock left behind: {:?}",
            s.advisory(key).await
        );
        let other = s.locks().await;
        assert!(other.try_lock("x").await.unwrap().is_some(), "{attempt}");
    }
}

/// A check cut off mid-way leaves the lock held (issue 9, item 6: it used to give the
/// connection up): the guard says so truthfully, and no other process can take the lock.
/// (One thread, so the check's first poll cannot also read its reply.)
#[tokio::test(flavor = "current_thread")]
async fn a_cancelled_check_keeps_the_lock() {
    let s = PgSchema::new("cancel_check").await;
    let locks = s.locks().await;
    let mut g = locks.lock("y").await.unwrap();
    tokio::select! {
        biased;
        _ = g.check() => panic!("a check cannot finish without a round trip"),
        () = async {} => {}
    }
    assert!(g.is_held(), "the lock survives a cancelled check");
    let other = s.locks().await;
    assert!(
        other.try_lock("y").await.unwrap().is_none(),
        "and is still held"
    );
    tokio::time::timeout(Duration::from_secs(10), g.check())
        .await
        .expect("a check answers")
        .expect("the lock is held");
    g.release().await.unwrap();
}

/// release() on a server that stops answering returns within check_timeout, reporting
/// the loss, instead of waiting for TCP to give up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_on_a_silent_server_is_bounded() {
    let s = PgSchema::new("silent_release").await;
    let locks = Locks::builder()
        .url(&s.url)
        .check_interval(Duration::from_millis(100))
        .check_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let g = locks.lock("w").await.unwrap();
    let pid = s.advisory(g.key()).await[0].0;
    signal(pid, "-STOP");
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(4), g.release()).await;
    signal(pid, "-CONT");
    let r = r.expect("release returned");
    assert!(
        matches!(
            r,
            Err(Error::LockLost {
                reason: LossReason::Unresponsive { .. }
            })
        ),
        "{r:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

/// Multiplexed: a second shared holder of the same process is granted, as it would be
/// from any other session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_shared_holder_is_granted_on_a_multiplexed_handle() {
    let s = PgSchema::new("mux_shared").await;
    let locks = Locks::builder()
        .url(&s.url)
        .scope(Scope::Session)
        .multiplex(2)
        .build()
        .await
        .unwrap();
    let a = locks.request("z").shared().try_lock().await.unwrap();
    let b = locks.request("z").shared().try_lock().await.unwrap();
    assert!(a.is_some() && b.is_some(), "two shared holders");
    assert!(
        locks.try_lock("z").await.unwrap().is_none(),
        "no exclusive one meanwhile"
    );
}

/// A server-side lock_timeout ending a wait without a deadline is a lock-wait timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_lock_timeout_is_a_lock_wait_timeout() {
    let s = PgSchema::new("server_lt").await;
    let holder = s.locks().await;
    let _g = holder.lock("t").await.unwrap();
    let admin = s.admin();
    // A role whose sessions have lock_timeout set, as an administrator might.
    let role = format!("r_{}", s.name);
    admin.batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN; ALTER ROLE \"{role}\" SET lock_timeout = '200ms'; GRANT ALL ON SCHEMA \"{}\" TO \"{role}\"", s.name)).await.unwrap();
    // The role put into the URL structurally, whoever DATABASE_URL's user is.
    let url = dblock_testkit::with_user(&s.url, &role);
    let waiter = Locks::connect(&url).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), waiter.lock("t"))
        .await
        .expect("the role's lock_timeout ends the wait");
    let e = r.unwrap_err();
    assert!(e.is_lock_wait_timeout(), "{e:?}");
    drop(waiter);
    drop(_g);
    admin
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await
        .unwrap();
}
