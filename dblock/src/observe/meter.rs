//! The `metrics` facade side of [`observe`](super): names, labels, and one call into the
//! recorder per phase of a lock's life. Compiled only with the `metrics` feature.
//!
//! Keys are built at compile time ([`KEYS`]: `Key::from_static_parts`, hashed), so that with no recorder
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
/// 1 while this process leads an election, 0 while it stands or after its term (label
/// `election`: the election's name, which the program chooses).
pub(crate) const LEADING: &str = "dblock_election_is_leader";

static META: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The metrics, in the order of a row of [`KEYS`].
const NAMES: [&str; 9] = [
    ACQUIRED,
    NOT_OBTAINED,
    TIMED_OUT,
    FAILED,
    LOST,
    RELEASED,
    WAIT,
    HELD_FOR,
    HELD,
];

macro_rules! sets {
    ($($backend:literal),*) => {
        [$(
            [Label::from_static_parts("backend", $backend), Label::from_static_parts("mode", "exclusive")],
            [Label::from_static_parts("backend", $backend), Label::from_static_parts("mode", "shared")],
        )*]
    };
}

/// `backend` × `mode`, as static label sets (the last backend is "other").
static SETS: [[Label; 2]; 8] = sets!("postgres", "sqlite", "mysql", "other");

const fn row(labels: &'static [Label]) -> [Key; 9] {
    [
        Key::from_static_parts(NAMES[0], labels),
        Key::from_static_parts(NAMES[1], labels),
        Key::from_static_parts(NAMES[2], labels),
        Key::from_static_parts(NAMES[3], labels),
        Key::from_static_parts(NAMES[4], labels),
        Key::from_static_parts(NAMES[5], labels),
        Key::from_static_parts(NAMES[6], labels),
        Key::from_static_parts(NAMES[7], labels),
        Key::from_static_parts(NAMES[8], labels),
    ]
}

/// Every metric's key for every static label set, hashed at compile time: a key built
/// at run time costs a hash of its name and labels (about 200 instructions) each time.
static KEYS: [[Key; 9]; 8] = [
    row(&SETS[0]),
    row(&SETS[1]),
    row(&SETS[2]),
    row(&SETS[3]),
    row(&SETS[4]),
    row(&SETS[5]),
    row(&SETS[6]),
    row(&SETS[7]),
];

/// One of the metrics, as an index into a row of [`KEYS`].
#[derive(Clone, Copy)]
pub(crate) enum M {
    Acquired = 0,
    NotObtained,
    TimedOut,
    Failed,
    Lost,
    Released,
    Wait,
    HeldFor,
    Held,
}

/// The labels of one lock's metrics: static keys unless a group label was asked for.
#[derive(Clone)]
pub(crate) enum Labels {
    Static(&'static [Key; 9]),
    Grouped(Vec<Label>),
    /// Not recorded (a grant made while nobody listened, which the metrics feature
    /// never makes).
    None,
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
        let i = b * 2 + m;
        match (group, KEYS.get(i), SETS.get(i)) {
            (None, Some(keys), _) => Labels::Static(keys),
            (Some(g), _, Some(set)) => {
                let mut v = set.to_vec();
                v.push(Label::new("group", g.to_owned()));
                Labels::Grouped(v)
            }
            _ => Labels::None,
        }
    }

    /// Calls `f` with the key of metric `m`.
    #[inline]
    fn with(&self, m: M, f: impl FnOnce(&Key)) {
        match self {
            Labels::Static(keys) => f(&keys[m as usize]),
            Labels::Grouped(v) => f(&Key::from_parts(NAMES[m as usize], v.clone())),
            Labels::None => {}
        }
    }
}

/// A grant: counted, its wait recorded, one more lock held.
pub(crate) fn granted(labels: &Labels, wait_s: f64) {
    metrics::with_recorder(|r| {
        labels.with(M::Acquired, |k| r.register_counter(k, &META).increment(1));
        labels.with(M::Wait, |k| r.register_histogram(k, &META).record(wait_s));
        labels.with(M::Held, |k| r.register_gauge(k, &META).increment(1.0));
    });
}

/// A request that ended without the lock: [`M::NotObtained`], [`M::TimedOut`] or
/// [`M::Failed`].
pub(crate) fn not_granted(labels: &Labels, counter: M) {
    metrics::with_recorder(|r| {
        labels.with(counter, |k| r.register_counter(k, &META).increment(1));
    });
}

/// A held lock seen lost.
pub(crate) fn lost(labels: &Labels) {
    metrics::with_recorder(|r| {
        labels.with(M::Lost, |k| r.register_counter(k, &META).increment(1));
    });
}

/// A guard's end: released unless its loss was counted, one lock fewer held.
pub(crate) fn ended(labels: &Labels, was_lost: bool, held_s: Option<f64>) {
    metrics::with_recorder(|r| {
        if !was_lost {
            labels.with(M::Released, |k| r.register_counter(k, &META).increment(1));
        }
        if let Some(s) = held_s {
            labels.with(M::HeldFor, |k| r.register_histogram(k, &META).record(s));
        }
        labels.with(M::Held, |k| r.register_gauge(k, &META).decrement(1.0));
    });
}

/// This process's role in election `name`: 1 leading, 0 not (Kubernetes' leader gauge).
pub(crate) fn leading(name: &str, leads: bool) {
    metrics::with_recorder(|r| {
        let key = Key::from_parts(LEADING, vec![Label::new("election", name.to_owned())]);
        r.register_gauge(&key, &META)
            .set(if leads { 1.0 } else { 0.0 });
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
        r.describe_gauge(
            LEADING.into(),
            None,
            "1 while this process leads the election, 0 while it stands or after its term".into(),
        );
    });
}
