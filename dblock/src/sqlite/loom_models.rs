//! loom models of the embedded backend's process lock table (docs/testing.md):
//! `RUSTFLAGS="--cfg dblock_loom" cargo test -p dblock --lib --release loom_`.
//!
//! The real table — `Shared::take_now`, `step`, `leave` and the release that hands an
//! exclusive lock straight to the next task waiting behind its holder (`table.rs`) — on
//! a real lock file (a new one each run of the model), with the table's part under
//! loom's mutex. tokio's oneshot channels, which carry a handed-over lock, are not
//! loom-aware: loom sees each send, receive and drop as one step (tokio checks them
//! under loom itself). The line of waiters in the kernel (`queue.rs`) waits on a thread
//! of its own, in `fcntl`, outside any model; what its thread does when that wait ends
//! (`queue::deliver`) is modelled below, against the requests that race it. The models
//! keep to one process's tasks, on OFD locks (another descriptor of the lock file sees
//! what the process holds in it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

use super::file::LockFile;
use super::table::Step;
use super::{Shared, Slot, SqliteBackend, queue, sys};
use crate::raw::Entry;
use crate::raw::{Mode, Options};

/// The lock's byte in the lock file.
const KEY: u64 = 4242;

/// Holds `held` as the only holder of the key in the process, then drops it (which
/// releases it, or hands it over).
fn hold(holders: &AtomicUsize, held: Entry) {
    assert_eq!(
        holders.fetch_add(1, Ordering::AcqRel),
        0,
        "two holders of one key in the process"
    );
    holders.fetch_sub(1, Ordering::AcqRel);
    drop(held);
}

/// A request that waits for the key as `SqliteBackend::wait` does while this process
/// holds it: look (`step`), wait behind the holder for the lock to be handed over or for
/// something new to look at, and leave its place however the wait ends. Cancelled, it
/// gives up after its first look: its receiver dropped, then its place left (the order in
/// which a dropped wait's future drops them). Returns whether it got the lock.
/// Counts in `handed` the locks handed over to it on its channel.
fn waiter(
    shared: &Arc<Shared>,
    holders: &AtomicUsize,
    cancelled: bool,
    handed: &std::sync::atomic::AtomicUsize,
) -> bool {
    loop {
        match shared.step(KEY, Mode::Exclusive).unwrap() {
            Step::Granted(held) => {
                hold(holders, held);
                return true;
            }
            Step::Behind(id, rx) => {
                if cancelled {
                    drop(rx);
                    shared.leave(KEY, id);
                    return false;
                }
                let delivered = loom::future::block_on(rx);
                shared.leave(KEY, id);
                match delivered {
                    Ok(held) => {
                        handed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        hold(holders, held);
                        return true;
                    }
                    // Released with nobody handed to, or something changed: look again.
                    Err(_) => continue,
                }
            }
            Step::InLine(..) | Step::Local => panic!("no other process holds the model's lock"),
        }
    }
}

/// A task of this process holds the key; others wait for it behind the holder, one of
/// them cancelled and `staying` not, while the holder lets go.
///
/// Invariant: never two holders of the key in the process; each waiter that stays gets
/// the lock (loom fails a model whose threads all wait: a hand-over lost on a cancelled
/// waiter); once all are done the table keeps nothing of the key and the byte is free in
/// the file (taken through a descriptor of its own).
fn a_waiter_cancelled_during_the_hand_over(staying: usize) {
    let dir = tempfile::tempdir().unwrap();
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let handed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handed_in_model = handed.clone();
    loom::model(move || {
        let run = runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (backend, lock_path) = {
            let db = dir.path().join(format!("model-{run}.db"));
            let backend = SqliteBackend::open(db, &Options::default()).unwrap();
            let path = backend.shared.lock.path.clone();
            (backend, path)
        };
        let shared = backend.shared.clone();
        let holders = Arc::new(AtomicUsize::new(0));
        assert!(shared.take_now(KEY, Mode::Exclusive).unwrap());
        let held = shared.entry(KEY, Mode::Exclusive);
        let spawn = |cancelled: bool| {
            let (shared, holders) = (shared.clone(), holders.clone());
            let handed = handed_in_model.clone();
            thread::spawn(move || waiter(&shared, &holders, cancelled, &handed))
        };
        let cancelled = spawn(true);
        let stay: Vec<_> = (0..staying).map(|_| spawn(false)).collect();
        hold(&holders, held);
        // The cancelled one gets the lock only if its look came after the release.
        cancelled.join().unwrap();
        for stays in stay {
            assert!(
                stays.join().unwrap(),
                "a waiter that stayed did not get the lock"
            );
        }

        let table = shared.lock.shard(KEY).table.lock().unwrap();
        assert!(
            !table.held.contains_key(&KEY) && !table.queued.contains_key(&KEY),
            "the key left in the process's table"
        );
        drop(table);
        let other = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&lock_path)
            .unwrap();
        assert!(
            matches!(
                sys::try_lock(&other, shared.lock.flavor, KEY, 1, Mode::Exclusive).unwrap(),
                sys::Attempt::Granted
            ),
            "the byte left locked in the file"
        );
        drop(other);
        drop(backend);
    });
    // Some runs went through the hand-over itself, not only through fresh looks.
    assert!(handed.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn loom_a_waiter_cancelled_during_the_hand_over_leaves_it_to_the_next_or_free() {
    a_waiter_cancelled_during_the_hand_over(1);
}

#[test]
fn loom_a_waiter_cancelled_between_two_hand_overs_leaves_them_to_the_others() {
    a_waiter_cancelled_during_the_hand_over(2);
}

// The line of waiters (`queue.rs`). Its thread waits in the kernel (`fcntl`), which loom
// cannot run; what decides inside the process is what follows the wait — `queue::deliver`,
// the real code the thread runs when its wait ends — and the requests racing it: one that
// gives up its claim (`queue::give_up`, as a dropped wait's `Claim` does) and one that
// arrives and takes the place over (`queue::adopt`, through `Shared::step`). In the models
// a loom thread stands for the kernel's grant: at the head of the line, it looks whether
// the place is still wanted (`queue::wanted`, the head's own look), takes the lock byte if
// so (nobody else holds it: granted at once), and delivers. The gate is left out: only
// other processes wait for it, and the models keep to one.

/// The end of a place in line: `queue::deliver`, or a control's.
type Deliver = fn(&LockFile, u64, Mode, queue::Outcome);

/// The kernel's grant to the place in line for [`KEY`], as the line's thread sees it at
/// the head of the line: still wanted, the byte is granted; then the place ends.
fn kernel_grants(lf: &LockFile, deliver: Deliver) {
    let desc = lf.current();
    let outcome = match queue::wanted(lf, KEY) {
        true => {
            let granted =
                sys::try_lock(desc.file_for(KEY), lf.flavor, KEY, 1, Mode::Exclusive).unwrap();
            assert!(matches!(granted, sys::Attempt::Granted));
            Some(desc)
        }
        false => None,
    };
    deliver(lf, KEY, Mode::Exclusive, Ok(outcome));
}

/// Holds `held` as the only holder of the key in the process, with the byte locked in
/// the file (seen through a descriptor of its own, `other`), then drops it.
fn hold_in_file(holders: &AtomicUsize, other: &std::fs::File, flavor: sys::Flavor, held: Entry) {
    let seen = sys::probe(other, flavor, KEY, 1, Mode::Exclusive).unwrap();
    assert!(
        matches!(seen, sys::Attempt::Busy),
        "a holder whose byte is not locked in the file (released twice, or never taken)"
    );
    hold(holders, held);
}

/// Which ways the new requests of a model's runs went (across runs: std's atomics).
#[derive(Default)]
struct Ways {
    /// Took the place over and got the kernel's grant through it.
    adopted: std::sync::atomic::AtomicUsize,
    /// Took the place over, and the place ended with nobody handed to.
    adopted_then_ended: std::sync::atomic::AtomicUsize,
}

impl Ways {
    fn count(n: &std::sync::atomic::AtomicUsize) {
        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn seen(n: &std::sync::atomic::AtomicUsize) -> bool {
        n.load(std::sync::atomic::Ordering::Relaxed) > 0
    }
}

/// A request for the key as `SqliteBackend::wait` makes it, from its first look: the lock
/// now, a place behind this process's holder, the place in line (taken over if nobody
/// wants it), or nothing to do but look again. Returns once it holds the lock.
fn arrives(shared: &Arc<Shared>, holders: &AtomicUsize, other: &std::fs::File, ways: &Ways) {
    let flavor = shared.lock.flavor;
    loop {
        match shared.step(KEY, Mode::Exclusive).unwrap() {
            Step::Granted(held) => return hold_in_file(holders, other, flavor, held),
            Step::Behind(id, rx) => {
                let delivered = loom::future::block_on(rx);
                shared.leave(KEY, id);
                if let Ok(held) = delivered {
                    return hold_in_file(holders, other, flavor, held);
                }
            }
            Step::InLine(id, rx) => {
                let delivered = loom::future::block_on(rx);
                queue::give_up(&shared.lock, KEY, id);
                match delivered {
                    Ok(held) => {
                        Ways::count(&ways.adopted);
                        return hold_in_file(holders, other, flavor, held.unwrap());
                    }
                    // The place ended with nobody handed to: look again.
                    Err(_) => Ways::count(&ways.adopted_then_ended),
                }
            }
            // The place in line is someone else's: the real request waits for a change
            // (`Shard::released`); the model lets the others run.
            Step::Local => thread::yield_now(),
        }
    }
}

/// How the request that holds the place in line when the kernel grants behaves.
#[derive(Clone, Copy, PartialEq)]
enum First {
    /// Gave up before the grant came (receiver dropped, claim given up).
    GaveUp,
    /// Cancelled while the kernel grants: its receiver dropped, then its claim given up
    /// (the order a dropped wait's future drops them).
    Cancelled,
    /// Waits for the grant, then gives up its claim (a wait that ends with the lock
    /// drops its `Claim`) and holds the lock.
    Stays,
}

/// The process stands in line for the key (a place whose request is `first`), and the
/// kernel grants while `first` gives up, is cancelled or waits, and, with `arriving`, a
/// new request for the key comes (and may take the place over, or wait behind).
///
/// Invariant: never two holders in the process, and a holder's byte locked in the file;
/// a grant is never lost — a request that still wants the lock gets it (the one that
/// stayed in line from the place itself; loom fails a model whose threads all wait);
/// nothing left behind — no place in line, no holder in the table, the byte free in the
/// file.
fn the_line_ends_while_requests_come_and_go(first: First, arriving: bool, deliver: Deliver) {
    let dir = tempfile::tempdir().unwrap();
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let ways = std::sync::Arc::new(Ways::default());
    let ways_in_model = ways.clone();
    loom::model(move || {
        let run = runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let backend = SqliteBackend::open(
            dir.path().join(format!("model-{run}.db")),
            &Options::default(),
        )
        .unwrap();
        let shared = backend.shared.clone();
        let lf = shared.lock.clone();
        let other = Arc::new(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&lf.path)
                .unwrap(),
        );
        let holders = Arc::new(AtomicUsize::new(0));
        // In line, as `queue::join` leaves the table (its thread is the kernel's below).
        let (place, id, rx) = queue::Queued::new(&shared, Mode::Exclusive);
        shared
            .lock
            .shard(KEY)
            .table
            .lock()
            .unwrap()
            .queued
            .insert(KEY, place);
        let kernel = {
            let lf = lf.clone();
            thread::spawn(move || kernel_grants(&lf, deliver))
        };
        let first_request = match first {
            First::GaveUp => {
                drop(rx);
                queue::give_up(&lf, KEY, id);
                None
            }
            First::Cancelled => {
                let lf = lf.clone();
                Some(thread::spawn(move || {
                    drop(rx);
                    queue::give_up(&lf, KEY, id);
                }))
            }
            First::Stays => {
                let (lf, holders, other) = (lf.clone(), holders.clone(), other.clone());
                Some(thread::spawn(move || {
                    let delivered = loom::future::block_on(rx);
                    queue::give_up(&lf, KEY, id);
                    match delivered {
                        Ok(held) => hold_in_file(&holders, &other, lf.flavor, held.unwrap()),
                        Err(_) => panic!("the place in line ended without its request"),
                    }
                }))
            }
        };
        if arriving {
            arrives(&shared, &holders, &other, &ways_in_model);
        }
        kernel.join().unwrap();
        if let Some(first_request) = first_request {
            first_request.join().unwrap();
        }

        let table = lf.shard(KEY).table.lock().unwrap();
        assert!(
            !table.held.contains_key(&KEY) && !table.queued.contains_key(&KEY),
            "the key left behind in the process's table"
        );
        drop(table);
        assert!(
            matches!(
                sys::probe(&other, lf.flavor, KEY, 1, Mode::Exclusive).unwrap(),
                sys::Attempt::Granted
            ),
            "the byte left locked in the file"
        );
        drop(backend);
    });
    if arriving && first != First::Stays {
        // Some runs took the place over and got the grant through it; some took it over
        // just as it ended (the head's look had found nobody), and looked again.
        assert!(Ways::seen(&ways.adopted), "no run took the place over");
        assert!(
            Ways::seen(&ways.adopted_then_ended),
            "no run took over a place that was ending"
        );
    }
}

#[test]
fn loom_a_place_in_line_cancelled_while_the_kernel_grants_leaves_nothing_behind() {
    the_line_ends_while_requests_come_and_go(First::Cancelled, false, queue::deliver);
}

#[test]
fn loom_a_request_that_takes_over_a_given_up_place_against_the_grant_gets_the_lock() {
    the_line_ends_while_requests_come_and_go(First::GaveUp, true, queue::deliver);
}

#[test]
fn loom_a_cancel_a_take_over_and_the_grant_together_lose_nothing() {
    the_line_ends_while_requests_come_and_go(First::Cancelled, true, queue::deliver);
}

#[test]
fn loom_the_grant_goes_to_the_request_in_line_and_a_new_one_waits_behind_it() {
    the_line_ends_while_requests_come_and_go(First::Stays, true, queue::deliver);
}

/// The control: a delivery that takes the send for done — a lock sent to a request whose
/// receiver was dropped meanwhile is neither held nor given back.
fn deliver_without_asking_whether_the_receiver_lives(
    lf: &LockFile,
    offset: u64,
    mode: Mode,
    outcome: queue::Outcome,
) {
    let mut table = lf.shard(offset).table.lock().unwrap();
    let taker = table.queued.remove(&offset).and_then(|q| q.taker);
    match (outcome, taker) {
        (Ok(Some(desc)), Some(taker)) => {
            table.held.insert(offset, Slot::new(mode, Some(desc)));
            let held = taker.shared.entry(offset, mode);
            if let Err(Ok(mut undelivered)) = taker.tx.send(Ok(held)) {
                undelivered.disarm();
            }
        }
        (Ok(Some(desc)), None) => {
            let _ = sys::unlock(desc.file_for(offset), lf.flavor, offset, 1);
        }
        _ => {}
    }
}

/// The control: a delivery that sends the lock without recording it in the table, so
/// nothing in the process keeps a new request from taking it too.
fn deliver_without_recording_the_holder(
    lf: &LockFile,
    offset: u64,
    mode: Mode,
    outcome: queue::Outcome,
) {
    let mut table = lf.shard(offset).table.lock().unwrap();
    let taker = table.queued.remove(&offset).and_then(|q| q.taker);
    let mut undelivered = None;
    match (outcome, taker) {
        (Ok(Some(_)), Some(taker)) => {
            let held = taker.shared.entry(offset, mode);
            undelivered = taker.tx.send(Ok(held)).err();
        }
        (Ok(Some(desc)), None) => {
            let _ = sys::unlock(desc.file_for(offset), lf.flavor, offset, 1);
        }
        _ => {}
    }
    drop(table);
    drop(undelivered);
}

#[test]
#[should_panic(expected = "two holders of one key in the process")]
fn loom_control_a_delivery_that_does_not_record_the_holder_makes_two() {
    the_line_ends_while_requests_come_and_go(
        First::Stays,
        true,
        deliver_without_recording_the_holder,
    );
}

#[test]
#[should_panic(expected = "the key left behind in the process's table")]
fn loom_control_a_delivery_that_ignores_a_dropped_receiver_leaves_the_lock_held() {
    the_line_ends_while_requests_come_and_go(
        First::Cancelled,
        false,
        deliver_without_asking_whether_the_receiver_lives,
    );
}
