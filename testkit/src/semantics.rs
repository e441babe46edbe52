//! Checks of locking semantics that every backend must pass, written once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use dblock::{Locks, Mode};

/// The hub seed's test, ported: a named lock is held by one holder at a time across
/// the database's sessions; other names are free.
pub async fn an_exclusive_lock_has_one_holder_at_a_time(locks: &Locks) {
    let held = locks.lock("autoland:7").await.unwrap();
    // The second request itself, driven for 300 ms: it must still be waiting then (a
    // request that was never made could not pass this).
    let second = tokio::time::timeout(Duration::from_millis(300), locks.lock("autoland:7")).await;
    assert!(second.is_err(), "the second holder waits: {second:?}");
    let (tx, rx) = tokio::sync::oneshot::channel();
    let db = locks.clone();
    tokio::spawn(async move {
        let g = db.lock("autoland:7").await.unwrap();
        let _ = tx.send(());
        drop(g);
    });
    let other = tokio::time::timeout(Duration::from_secs(2), locks.lock("autoland:8")).await;
    assert!(matches!(other, Ok(Ok(_))), "another name is free");
    drop(other);
    drop(held);
    assert!(
        tokio::time::timeout(Duration::from_secs(5), rx)
            .await
            .is_ok(),
        "and takes it once it is let go"
    );
}

/// `try_lock` answers `None` for a held lock, and the lock is free after a drop.
pub async fn try_lock_reports_a_held_lock_as_none(locks: &Locks) {
    let g = locks.try_lock("t").await.unwrap();
    assert!(g.is_some(), "a free lock is taken");
    assert!(
        locks.try_lock("t").await.unwrap().is_none(),
        "a held lock is refused"
    );
    drop(g);
    let again = crate::eventually(5, &mut || async {
        locks.try_lock("t").await.unwrap().is_some()
    })
    .await;
    assert!(again, "free again after the drop");
}

/// A deadline wait gives up no earlier than the deadline, and gets a lock freed in time.
pub async fn a_deadline_wait_gives_up_or_gets_the_lock(locks: &Locks) {
    let g = locks.lock("d").await.unwrap();
    let t = Instant::now();
    let r = locks
        .try_lock_for("d", Duration::from_millis(300))
        .await
        .unwrap();
    assert!(r.is_none());
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "waited the whole deadline"
    );
    let (started, on_start) = tokio::sync::oneshot::channel();
    let mut waiter = {
        let locks = locks.clone();
        tokio::spawn(async move {
            let _ = started.send(());
            locks.try_lock_for("d", Duration::from_secs(10)).await
        })
    };
    on_start.await.unwrap();
    // Observed waiting, not slept for: it has not finished while the lock is held.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut waiter)
            .await
            .is_err(),
        "the waiter waits while the lock is held"
    );
    drop(g);
    let got = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("granted within its deadline");
    assert!(
        got.unwrap().unwrap().is_some(),
        "granted before the deadline"
    );
}

/// Shared holders coexist; an exclusive holder excludes them and they exclude it.
pub async fn shared_holders_coexist_and_exclude_an_exclusive_one(locks: &Locks) {
    let r1 = locks.request("rw").shared().lock().await.unwrap();
    let r2 = locks.request("rw").shared().try_lock().await.unwrap();
    assert!(r2.is_some(), "two readers at once");
    assert_eq!(r1.mode(), Mode::Shared);
    assert!(
        locks.try_lock("rw").await.unwrap().is_none(),
        "no writer while readers hold"
    );
    drop(r1);
    assert!(
        locks.try_lock("rw").await.unwrap().is_none(),
        "nor while one reader holds"
    );
    drop(r2);
    let w = locks.lock("rw").await.unwrap();
    assert!(
        locks
            .request("rw")
            .shared()
            .try_lock()
            .await
            .unwrap()
            .is_none(),
        "no reader while a writer holds"
    );
    // Released and confirmed: a drop only *sends* the release, which another
    // connection's request could overtake.
    w.release().await.unwrap();
    assert!(
        locks
            .request("rw")
            .shared()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
}

/// Tasks of one process sharing one handle never overlap inside the lock. Control: the
/// same detector, with the tasks taking no lock, sees them overlap.
pub async fn tasks_of_one_process_exclude_each_other(
    locks: &Locks,
    req: fn(&Locks) -> dblock::Request<'_>,
) {
    let control = overlapping_sections(locks, req, false).await;
    assert!(
        control > 0,
        "control: without the lock the detector sees overlaps"
    );
    assert_eq!(overlapping_sections(locks, req, true).await, 0);
}

/// 4 tasks × 20 sections that each stay inside 1 ms; returns how many sections began
/// while another was inside.
async fn overlapping_sections(
    locks: &Locks,
    req: fn(&Locks) -> dblock::Request<'_>,
    locked: bool,
) -> u32 {
    let inside = Arc::new(AtomicU32::new(0));
    let overlaps = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (locks, inside, overlaps) = (locks.clone(), inside.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let g = match locked {
                    true => Some(req(&locks).lock().await.unwrap()),
                    false => None,
                };
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                if let Some(g) = g {
                    g.release().await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("the sections end")
            .unwrap();
    }
    overlaps.load(Ordering::SeqCst)
}
