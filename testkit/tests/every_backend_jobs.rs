//! Claims of scheduled slots through the library (`Locks::once_per`, `claim_slot`,
//! `runs`), written once and run on every backend: one winner among handles racing for a
//! slot, the outcome recorded and read back, `retry_failed` after a failure and after a
//! dropped guard (never after a success), the lock held while a run is under way, the
//! record pruned to its bound, and bad input refused.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::Error;
use dblock::jobs::{Claim, Outcome, RUNS_KEPT, RunGuard};
use dblock_testkit::TestDb;
use dblock_testkit::testdb::within;

fn won(c: Claim) -> RunGuard {
    match c {
        Claim::Won(run) => run,
        other => panic!("expected to win the slot: {other:?}"),
    }
}

fn taken(c: Claim) -> dblock::jobs::Taken {
    match c {
        Claim::Taken(t) => t,
        other => panic!("expected the slot taken: {other:?}"),
    }
}

/// Eight handles claim one slot at once: one wins; while its run is under way the name's
/// lock is held; its outcome is recorded, and every later claim is told who ran it.
async fn one_of_many_handles_wins_a_slot_and_its_outcome_is_recorded(db: &TestDb) {
    let hour = Duration::from_secs(3600);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let locks = db.locks().await;
        tasks.push(tokio::spawn(async move {
            match locks.once_per("report", hour).claim().await.unwrap() {
                Claim::Won(run) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    run.finish(0).await.unwrap();
                    true
                }
                Claim::Taken(t) => {
                    assert_eq!(t.run().attempt, 1);
                    false
                }
                other => panic!("a new kind of claim: {other:?}"),
            }
        }));
    }
    let mut winners = 0;
    for t in tasks {
        winners += usize::from(within(60, "a claim", t).await.unwrap());
    }
    assert_eq!(winners, 1, "one winner");

    let locks = db.locks().await;
    let t = taken(locks.once_per("report", hour).claim().await.unwrap());
    let r = t.run();
    assert_eq!(r.outcome(), Outcome::Succeeded);
    assert!(r.slot.ends_with(":00:00Z"), "{}", r.slot);
    assert_eq!(r.pid, std::process::id());
    assert!(r.finished.unwrap() >= r.started);
    let runs = locks.runs("report", 10).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].holder(), r.holder());
    assert_eq!(runs[0].namespace, db.namespace());
    assert!(locks.runs("other", 10).await.unwrap().is_empty());

    // While a run is under way the name is held, and a claim that finds it held says so.
    let run = won(locks.claim_slot("report", "next").claim().await.unwrap());
    let other = db.locks().await;
    assert!(
        other.try_lock("report").await.unwrap().is_none(),
        "the name is held while the run is under way"
    );
    let t = taken(other.claim_slot("report", "next").claim().await.unwrap());
    assert_eq!(t.run().outcome(), Outcome::Unfinished);
    run.finish(0).await.unwrap();
    assert!(
        other.try_lock("report").await.unwrap().is_some(),
        "released"
    );
}

/// `retry_failed`: a failed run is taken over (attempt 2), a dropped guard reads as a
/// dead claimant and is taken over (attempt 3), a success never is; without it, none is.
async fn retry_failed_takes_over_failures_and_dead_claimants_never_successes(db: &TestDb) {
    let locks = db.locks().await;
    let claim = |retry: bool| {
        let req = locks.claim_slot("job", "2026-05-01");
        match retry {
            true => req.retry_failed().claim(),
            false => req.claim(),
        }
    };
    won(claim(false).await.unwrap()).failed().await.unwrap();
    let t = taken(claim(false).await.unwrap());
    assert_eq!(t.run().outcome(), Outcome::Failed { exit_code: 1 });
    let run = won(claim(true).await.unwrap());
    assert_eq!(run.attempt(), 2);
    drop(run); // as if its process died: no outcome recorded, the lock freed
    let t = taken(claim(false).await.unwrap());
    assert_eq!(t.run().outcome(), Outcome::Unfinished);
    let run = won(claim(true).await.unwrap());
    assert_eq!(run.attempt(), 3);
    run.succeeded().await.unwrap();
    let t = taken(claim(true).await.unwrap());
    assert_eq!(t.run().attempt, 3);
    assert_eq!(t.run().outcome(), Outcome::Succeeded);
}

/// A claim made in two steps under a lock taken the caller's way: a live claimant's
/// claim is never taken over (its lock is held: not obtained); under the lock, a claim
/// without an outcome is known to have no live claimant. A guard of another name is
/// refused.
async fn a_claim_under_the_callers_lock_knows_a_dead_claimant(db: &TestDb) {
    let locks = db.locks().await;
    let first = won(locks.claim_slot("two", "s").claim().await.unwrap());
    let other = db.locks().await;
    let slot = other
        .claim_slot("two", "s")
        .retry_failed()
        .slot()
        .await
        .unwrap();
    assert_eq!(slot.as_str(), "s");
    assert!(
        slot.settled().is_none(),
        "may be retried: no settling without the lock"
    );
    let got = slot
        .request()
        .try_lock_for(Duration::from_millis(200))
        .await
        .unwrap();
    assert!(got.is_none(), "the live claimant holds the lock");
    assert!(
        slot.not_obtained().await.unwrap().is_none(),
        "nothing claimed"
    );
    drop(first);

    let slot = other.claim_slot("two", "s").slot().await.unwrap();
    let guard = within(10, "the lock", slot.request().lock()).await.unwrap();
    let t = taken(slot.claim_with(guard).await.unwrap());
    assert!(t.claimant_gone(), "read under the lock without an outcome");
    assert!(!t.lock_held());

    let slot = other.claim_slot("two", "t").slot().await.unwrap();
    let wrong = other.lock("not-two").await.unwrap();
    let e = slot.claim_with(wrong).await.unwrap_err();
    assert!(matches!(e, Error::InvalidRequest { .. }), "{e:?}");
    assert!(
        other.try_lock("not-two").await.unwrap().is_some(),
        "released"
    );
}

/// A fenced claim's lock carries a token; a period under a second and a blank slot are
/// refused before anything is taken.
async fn fenced_claims_carry_a_token_and_bad_input_is_refused(db: &TestDb) {
    let locks = db.locks().await;
    let run = won(locks.claim_slot("f", "s").fenced().claim().await.unwrap());
    assert!(run.lock().fencing_token().is_some());
    run.succeeded().await.unwrap();
    for period in [Duration::ZERO, Duration::from_millis(999)] {
        let e = locks.once_per("f", period).claim().await.unwrap_err();
        assert!(matches!(e, Error::InvalidRequest { .. }), "{e:?}");
    }
    for slot in ["", " ", "a\0b"] {
        let e = locks.claim_slot("f", slot).claim().await.unwrap_err();
        assert!(matches!(e, Error::InvalidRequest { .. }), "{e:?}");
    }
    let e = locks.claim_slot("", "s").claim().await.unwrap_err();
    assert!(matches!(e, Error::InvalidName { .. }), "{e:?}");
    assert!(
        locks.try_lock("f").await.unwrap().is_some(),
        "nothing left held"
    );
}

/// The record keeps a name's `RUNS_KEPT` most recent claims: older ones are deleted as
/// new ones are made (and a deleted slot could be claimed again, as documented).
async fn the_record_keeps_the_most_recent_claims_of_a_name(db: &TestDb) {
    let locks = db.locks().await;
    let n = RUNS_KEPT + 3;
    for i in 0..n {
        let slot = format!("{i:04}");
        won(locks.claim_slot("many", &slot).claim().await.unwrap())
            .succeeded()
            .await
            .unwrap();
        // Distinct start times on a millisecond clock (the embedded backend's).
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let runs = locks.runs("many", RUNS_KEPT).await.unwrap();
    assert_eq!(runs.len() as u32, RUNS_KEPT);
    assert_eq!(runs[0].slot, format!("{:04}", n - 1), "newest first");
    assert_eq!(
        runs.last().unwrap().slot,
        "0003",
        "the three oldest deleted"
    );
    let again = locks.claim_slot("many", "0000").claim().await.unwrap();
    assert!(
        matches!(again, Claim::Won(_)),
        "a deleted claim's slot is claimable"
    );
}

dblock_testkit::every_backend!(
    one_of_many_handles_wins_a_slot_and_its_outcome_is_recorded,
    retry_failed_takes_over_failures_and_dead_claimants_never_successes,
    a_claim_under_the_callers_lock_knows_a_dead_claimant,
    fenced_claims_carry_a_token_and_bad_input_is_refused,
    the_record_keeps_the_most_recent_claims_of_a_name,
);
