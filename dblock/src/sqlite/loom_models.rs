//! loom models of the embedded backend's process lock table (docs/testing.md):
//! `RUSTFLAGS="--cfg dblock_loom" cargo test -p dblock --lib --release loom_`.
//!
//! The real table — `Shared::take_now`, `step`, `leave` and the release that hands an
//! exclusive lock straight to the next task waiting behind its holder (`table.rs`) — on
//! a real lock file (a new one each run of the model), with the table's part under
//! loom's mutex. tokio's oneshot channels, which carry a handed-over lock, are not
//! loom-aware: loom sees each send, receive and drop as one step (tokio checks them
//! under loom itself). The line of waiters in the kernel (`queue.rs`) runs on a thread
//! of its own, outside any model: the models keep to one process's tasks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

use super::table::Step;
use super::{Shared, SqliteBackend, SqliteHeld, sys};
use crate::raw::{Mode, Options};

/// The lock's byte in the lock file.
const KEY: u64 = 4242;

/// Holds `held` as the only holder of the key in the process, then drops it (which
/// releases it, or hands it over).
fn hold(holders: &AtomicUsize, held: SqliteHeld) {
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
        let held = SqliteHeld::new(&shared, KEY, Mode::Exclusive);
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
