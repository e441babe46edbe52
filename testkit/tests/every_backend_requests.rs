//! The one request type (`dblock::Request`) on every backend, from this one source
//! (`every_backend!`): a wait of zero tries once, exactly like `try_lock`, for one name, a
//! semaphore's slot and a lock set; and every combination of options the request refuses
//! is refused with a typed error that says why, holding nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::request::Take;
use dblock::{Error, Request};
use dblock_testkit::TestDb;
use dblock_testkit::testdb::within;

/// `req.try_lock_for(0)`, bounded; an error fails the test.
async fn zero_wait<T: Take>(req: Request<'_, T>, what: &str) -> Option<T::Guard> {
    within(10, what, req.try_lock_for(Duration::ZERO))
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// `try_lock_for(0)` is `try_lock`: granted when free, `None` (not an error, not "held")
/// when held — for each kind of request, many times over (a zero deadline raced against
/// the request's own round trip used to lose on a server: issue 22, item 4). Each grant
/// is released and confirmed (a dropped guard's release may still be on its way).
async fn a_zero_wait_tries_once_like_try_lock(db: &TestDb) {
    let locks = db.locks().await;
    let other = db.locks().await;
    for round in 0..20 {
        let what = format!("round {round}: a free lock");
        let g = zero_wait(locks.request("zero"), &what).await.expect(&what);
        let what = format!("round {round}: a held lock");
        assert!(
            zero_wait(other.request("zero"), &what).await.is_none(),
            "{what}"
        );
        g.release().await.unwrap();

        let what = format!("round {round}: a free slot");
        let slot = zero_wait(locks.semaphore("zero-sem", 1), &what)
            .await
            .expect(&what);
        let what = format!("round {round}: a slot while all are held");
        assert!(
            zero_wait(other.semaphore("zero-sem", 1), &what)
                .await
                .is_none(),
            "{what}"
        );
        slot.release().await.unwrap();

        let what = format!("round {round}: a free set");
        let set = zero_wait(locks.request_all(["zero-a", "zero-b"]), &what)
            .await
            .expect(&what);
        let what = format!("round {round}: a set while one of its names is held");
        let none = zero_wait(other.request_all(["zero-b", "zero-c"]), &what).await;
        assert!(none.is_none(), "{what}");
        set.release().await.unwrap();
    }
}

/// Each refusal is an `Error::InvalidRequest` whose message says why, made before
/// anything is taken: the names stay free. (The lease's refusals are per backend:
/// `every_backend_fencing.rs`.)
async fn combinations_that_cannot_work_are_refused_saying_why(db: &TestDb) {
    let locks = db.locks().await;
    let why = |r: Result<(), Error>, what: &str, says: &str| match r {
        Err(Error::InvalidRequest { reason }) => assert!(reason.contains(says), "{what}: {reason}"),
        other => panic!("{what}: refused with Error::InvalidRequest, not {other:?}"),
    };
    let shared_fenced = locks.request("combo").shared().fenced().try_lock().await;
    why(shared_fenced.map(drop), "a shared fenced lock", "exclusive");
    let shared_slot = locks.semaphore("combo-sem", 2).shared().try_lock().await;
    why(shared_slot.map(drop), "a shared semaphore", "exclusively");
    let waited_slot = locks.semaphore("combo-sem", 2).shared().lock().await;
    why(
        waited_slot.map(drop),
        "a shared semaphore, waited for",
        "exclusively",
    );
    let fenced_set = locks
        .request_all(["combo-a", "combo-b"])
        .fenced()
        .try_lock()
        .await;
    why(fenced_set.map(drop), "a fenced lock set", "one per name");
    let fenced_set = locks
        .request_all(["combo-a"])
        .fenced()
        .try_lock_for(Duration::from_secs(1))
        .await;
    why(
        fenced_set.map(drop),
        "a fenced lock set, waited for",
        "one per name",
    );
    for name in ["combo", "combo-a", "combo-b"] {
        assert_eq!(db.holders(name).await, 0, "{name}");
    }
    let slots = locks.slot_keys("combo-sem", 2).unwrap();
    assert_eq!(slots.len(), 2);
    // Control: the same requests without the option that does not fit are granted.
    assert!(
        locks
            .request("combo")
            .fenced()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        locks
            .semaphore("combo-sem", 2)
            .fenced()
            .try_lock()
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        locks
            .request_all(["combo-a", "combo-b"])
            .shared()
            .try_lock()
            .await
            .map(|s| s.is_some())
            .or_else(|e| match e {
                // A backend without shared locks refuses them for sets as for one name.
                Error::Unsupported {
                    capability: dblock::Capability::SharedMode,
                    ..
                } if !db.has_shared() => Ok(true),
                e => Err(e),
            })
            .unwrap()
    );
}

dblock_testkit::every_backend!(
    a_zero_wait_tries_once_like_try_lock,
    combinations_that_cannot_work_are_refused_saying_why,
);
