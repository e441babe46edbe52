//! Which keys were found busy lately, so that a request knows whether to try first.
//!
//! A request that may wait costs more to send than a try: its round sets the wait's
//! `lock_timeout` (the slices that keep a waiter from blocking `CREATE INDEX
//! CONCURRENTLY`, see [`WAIT_SLICE_MS`](super::plan::WAIT_SLICE_MS)), and behind a
//! pooler or on an sqlx connection `client_connection_check_interval`, each a statement
//! the server parses and runs. A free name needs none of that. So a request first only
//! *tries* — the one statement a bare `pg_advisory_xact_lock` costs — and sets up its
//! wait in a second round when the try finds the name busy. A try never overtakes a
//! waiter: the server refuses a lock whose queue holds a conflicting request.
//!
//! On a name that is busy again and again (many workers taking turns) the try would be
//! a round trip wasted every time. This table remembers, per key, when a try last found
//! it busy (or a wait's slice ended); within [`RECENT`] of that, a request skips the try
//! and waits at once. It is a hint: keys share its slots, and a wrong guess costs one
//! round trip or one statement, never correctness.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::key::Key;

/// Slots in the table (keys share them by a hash of the key).
const SLOTS: usize = 256;

/// How long a key found busy counts as busy: a request within this time of it waits at
/// once instead of trying first.
pub(crate) const RECENT: Duration = Duration::from_secs(1);

/// When keys were last found busy, per slot: [`Busy::now`] then (0: never).
pub(crate) struct Busy {
    base: Instant,
    slots: Box<[AtomicU32]>,
}

impl Default for Busy {
    fn default() -> Busy {
        Busy {
            base: Instant::now(),
            slots: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

impl Busy {
    fn slot(&self, key: Key) -> &AtomicU32 {
        // Fibonacci hashing: the top bits of the product mix every bit of the key.
        let h = (key.as_i64() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56;
        &self.slots[h as usize % SLOTS]
    }

    /// Now, as the table counts: milliseconds since `base`, wrapping every 49.7 days
    /// (a mark then older than that may pass for recent for a second: one wait without
    /// a try first, never a wrong answer), never 0.
    fn now(&self) -> u32 {
        // Truncation is the wrap.
        (self.base.elapsed().as_millis() as u32).max(1)
    }

    /// Records that `key` was found busy now.
    pub(crate) fn mark(&self, key: Key) {
        self.slot(key).store(self.now(), Ordering::Relaxed);
    }

    /// Whether `key` (or a key sharing its slot) was found busy within [`RECENT`].
    pub(crate) fn recently(&self, key: Key) -> bool {
        match self.slot(key).load(Ordering::Relaxed) {
            0 => false,
            at => u128::from(self.now().wrapping_sub(at)) < RECENT.as_millis(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_found_busy_counts_as_busy_for_a_while_and_others_do_not() {
        let busy = Busy::default();
        let k = Key::derive("public", "hot");
        assert!(!busy.recently(k));
        busy.mark(k);
        assert!(busy.recently(k));
        // Most other keys are in other slots.
        let others = (0..100)
            .map(|i| Key::derive("public", &format!("cold-{i}")))
            .filter(|&o| busy.recently(o))
            .count();
        assert!(others < 10, "{others} of 100 keys counted as busy");
        // An old mark no longer counts.
        let old = Busy {
            base: Instant::now() - RECENT - Duration::from_millis(50),
            ..Busy::default()
        };
        old.slot(k).store(1, Ordering::Relaxed);
        assert!(!old.recently(k));
    }
}
