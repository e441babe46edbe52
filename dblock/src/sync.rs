//! The synchronisation types of the in-process hand-offs, in one place: std's (and
//! futures' `AtomicWaker`) in every build, loom's under `--cfg dblock_loom`, where the models in
//! `loom_models` run the code that uses them under every interleaving the memory model
//! allows (docs/testing.md). Code whose correctness inside the process rests on a mutex
//! or an atomic imports it from here, never from `std` directly.
//!
//! tokio's types are not loom-aware; where a hand-off rests on one, the part that decides
//! is kept out of it in a small type built on these (the outbox's queue, the multiplexer's
//! claims, a guard's loss state), and tokio's own loom tests cover the rest.

// A build without some backend leaves what only that backend uses unused.
#![cfg_attr(
    not(all(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(unused_imports)
)]

#[cfg(not(dblock_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
#[cfg(not(dblock_loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

#[cfg(dblock_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU8, Ordering};
#[cfg(dblock_loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

/// Wakes a task parked on it: futures' `AtomicWaker`, or loom's.
#[cfg(not(dblock_loom))]
pub(crate) use futures_util::task::AtomicWaker;

/// Wakes a task parked on it: loom's, with futures' signatures.
#[cfg(dblock_loom)]
#[derive(Default)]
pub(crate) struct AtomicWaker(loom::future::AtomicWaker);

#[cfg(dblock_loom)]
impl AtomicWaker {
    pub(crate) fn register(&self, waker: &std::task::Waker) {
        self.0.register_by_ref(waker);
    }

    pub(crate) fn wake(&self) {
        self.0.wake();
    }
}

/// Locks `m`, through a poisoned lock as well (what it guards stays consistent: no
/// holder panics between two of its writes).
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
