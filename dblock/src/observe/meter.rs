//! The `metrics` facade side of [`observe`](super): names, labels, and one call into the
//! recorder per phase of a lock's life. Compiled only with the `metrics` feature.
//!
//! Keys are built from static parts (`Key::from_static_parts`), so that with no recorder
//! installed a phase costs one thread-local read and a few calls into the no-op
//! recorder, and never an allocation; only the opt-in `group` label
//! ([`Builder::metrics_group`](crate::Builder::metrics_group)) builds keys at run time.

use metrics::{Key, Label, Metadata};

use crate::raw::Mode;

/// Locks granted.
pub(crate) const ACQUIRED: &str = "dblock_locks_acquired_total";
/// `try_lock` answered "held elsewhere".
pub(crate) const NOT_OBTAINED: &str = "dblock_locks_not_obtained_total";
/// A wait with a deadline ended without the lock.
pub(crate) const TIMED_OUT: &str = "dblock_locks_timed_out_total";
/// A request failed with an error (connection, server, bad name).
pub(crate) const FAILED: &str = "dblock_lock_errors_total";
/// Held locks that were lost.
pub(crate) const LOST: &str = "dblock_locks_lost_total";
/// Held locks that ended without a loss seen (released or dropped).
pub(crate) const RELEASED: &str = "dblock_locks_released_total";
/// Seconds from request to grant.
pub(crate) const WAIT: &str = "dblock_lock_wait_seconds";
/// Seconds from grant to release or loss.
pub(crate) const HELD_FOR: &str = "dblock_lock_held_seconds";
/// Locks this process holds now.
pub(crate) const HELD: &str = "dblock_locks_held";

static META: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

macro_rules! sets {
    ($($backend:literal),*) => {
        &[$(
            [Label::from_static_parts("backend", $backend), Label::from_static_parts("mode", "exclusive")],
            [Label::from_static_parts("backend", $backend), Label::from_static_parts("mode", "shared")],
        )*]
    };
}

/// `backend` × `mode`, as static label sets (the last backend is "other").
static SETS: &[[Label; 2]] = sets!("postgres", "sqlite", "mysql", "other");

/// The labels of one lock's metrics: static unless a group label was asked for.
#[derive(Clone)]
pub(crate) enum Labels {
    Static(&'static [Label]),
    Grouped(Vec<Label>),
}

impl Labels {
    pub(crate) fn new(backend: &str, mode: Mode, group: Option<&str>) -> Labels {
        let b = match backend {
            "postgres" => 0,
            "sqlite" => 1,
            "mysql" => 2,
            _ => 3,
        };
        let m = match mode {
            Mode::Exclusive => 0,
            Mode::Shared => 1,
        };
        let set: &'static [Label] = match SETS.get(b * 2 + m) {
            Some(s) => s,
            None => &[],
        };
        match group {
            None => Labels::Static(set),
            Some(g) => {
                let mut v = set.to_vec();
                v.push(Label::new("group", g.to_owned()));
                Labels::Grouped(v)
            }
        }
    }

    fn key(&self, name: &'static str) -> Key {
        match self {
            Labels::Static(set) => Key::from_static_parts(name, set),
            Labels::Grouped(v) => Key::from_parts(name, v.clone()),
        }
    }
}

/// A grant: counted, its wait recorded, one more lock held.
pub(crate) fn granted(labels: &Labels, wait_s: f64) {
    metrics::with_recorder(|r| {
        r.register_counter(&labels.key(ACQUIRED), &META)
            .increment(1);
        r.register_histogram(&labels.key(WAIT), &META)
            .record(wait_s);
        r.register_gauge(&labels.key(HELD), &META).increment(1.0);
    });
}

/// A request that ended without the lock: `counter` is [`NOT_OBTAINED`], [`TIMED_OUT`] or
/// [`FAILED`].
pub(crate) fn not_granted(labels: &Labels, counter: &'static str) {
    metrics::with_recorder(|r| {
        r.register_counter(&labels.key(counter), &META).increment(1);
    });
}

/// A held lock seen lost.
pub(crate) fn lost(labels: &Labels) {
    metrics::with_recorder(|r| {
        r.register_counter(&labels.key(LOST), &META).increment(1);
    });
}

/// A guard's end: released unless its loss was counted, one lock fewer held.
pub(crate) fn ended(labels: &Labels, was_lost: bool, held_s: Option<f64>) {
    metrics::with_recorder(|r| {
        if !was_lost {
            r.register_counter(&labels.key(RELEASED), &META)
                .increment(1);
        }
        if let Some(s) = held_s {
            r.register_histogram(&labels.key(HELD_FOR), &META).record(s);
        }
        r.register_gauge(&labels.key(HELD), &META).decrement(1.0);
    });
}

/// Describes every metric to the recorder (units and help text), for exporters that
/// print them: called once per handle.
pub(crate) fn describe() {
    use metrics::Unit;
    metrics::with_recorder(|r| {
        let c = |name: &'static str, help: &'static str| {
            r.describe_counter(name.into(), Some(Unit::Count), help.into());
        };
        c(ACQUIRED, "Locks granted");
        c(
            NOT_OBTAINED,
            "try_lock requests that found the lock held elsewhere",
        );
        c(
            TIMED_OUT,
            "Requests whose deadline passed before the lock was granted",
        );
        c(FAILED, "Requests that failed with an error");
        c(
            LOST,
            "Held locks that were lost (connection closed, unresponsive, lock file replaced)",
        );
        c(
            RELEASED,
            "Held locks released (or dropped) with no loss seen",
        );
        r.describe_histogram(
            WAIT.into(),
            Some(Unit::Seconds),
            "Time from request to grant".into(),
        );
        r.describe_histogram(
            HELD_FOR.into(),
            Some(Unit::Seconds),
            "Time from grant to release or loss".into(),
        );
        r.describe_gauge(
            HELD.into(),
            Some(Unit::Count),
            "Locks this process holds now".into(),
        );
    });
}
