//! What dblock tells `tracing` subscribers and (with the `metrics` feature) metrics
//! recorders about each lock: requested, granted or not, released, lost. Written once in
//! the friendly layer — a [`Request`](crate::Request) makes an [`Attempt`], a granted
//! attempt becomes the guard's [`Tally`] — so every backend reports alike. The names,
//! fields and labels are documented in `docs/observability.md`.
//!
//! Nothing here may cost a lock cycle anything measurable when nobody listens. So every
//! DEBUG event and the request's span are behind one check ([`on`]: two relaxed atomic
//! loads with no subscriber and no logger), not only behind tracing's macros: sqlx turns
//! on tracing's `log` feature, with which even a disabled span does work on every enter,
//! exit and drop. The backend's future is instrumented only when the span is live; the
//! clock is read only when someone listens or the `metrics` feature is on; nothing is
//! allocated for a name of up to [`Name::INLINE`] bytes (it is kept inline; a longer one
//! is boxed), and the loss state shared with
//! [`LockGuard::lost`](crate::LockGuard::lost)'s future is allocated only once a loss is
//! seen or that future is asked for.

#[cfg(feature = "metrics")]
pub(crate) mod meter;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tracing::Span;

use crate::error::{Error, LossReason};
use crate::key::Key;
use crate::raw::{Mode, Req, Scope, Wait};
// A guard's loss state is shared with its loss futures: loom's under `--cfg dblock_loom`.
use crate::sync::{Arc, AtomicU8, Ordering};
// A guard's copy of its lock's name: inline when short (no allocation per grant).
use crate::text::ShortText as Name;

/// The target of the events and spans of lock requests and guards.
pub(crate) const TARGET: &str = "dblock::lock";

/// Whether anyone may want dblock's DEBUG events: a tracing subscriber enabled for
/// [`TARGET`] at DEBUG, or (tracing forwards its events to `log` while no subscriber is
/// set, with the `log` feature sqlx turns on) a `log` logger at DEBUG.
#[inline]
pub(crate) fn on() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::DEBUG)
        || log::max_level() >= log::LevelFilter::Debug
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

pub(crate) fn mode_str(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "exclusive",
        Mode::Shared => "shared",
    }
}

fn scope_str(scope: Scope) -> &'static str {
    match scope {
        Scope::Transaction => "transaction",
        Scope::Session => "session",
    }
}

fn wait_str(wait: Wait) -> &'static str {
    match wait {
        Wait::Forever => "forever",
        Wait::Try => "try",
        Wait::Until(_) => "until",
    }
}

/// How a handle labels its metrics (set on the [`Builder`](crate::Builder)).
#[derive(Clone, Copy, Default)]
pub(crate) struct MetricsConfig {
    /// Maps a lock name to its `group` label, if any.
    #[cfg(feature = "metrics")]
    pub(crate) group: Option<fn(&str) -> Option<&str>>,
}

/// One request, from its start to its outcome (or its cancellation, on drop).
pub(crate) struct Attempt {
    /// Whether anyone listens to the events ([`on`] when the request started).
    on: bool,
    span: Span,
    start: Option<Instant>,
    done: bool,
    #[cfg(feature = "metrics")]
    labels: meter::Labels,
}

impl Attempt {
    /// Starts observing `req` on `backend`: a `lock` span (which the caller instruments
    /// the backend's future with) and a "lock requested" event.
    pub(crate) fn start(req: &Req<'_>, backend: &'static str, cfg: MetricsConfig) -> Attempt {
        let _ = cfg;
        let on = on();
        if !on {
            return Attempt {
                on,
                span: Span::none(),
                start: cfg!(feature = "metrics").then(Instant::now),
                done: false,
                #[cfg(feature = "metrics")]
                labels: meter::Labels::new(backend, req.mode, cfg.group.and_then(|f| f(req.name))),
            };
        }
        let span = tracing::debug_span!(
            target: TARGET,
            "lock",
            name = req.name,
            key = req.key.as_i64(),
            mode = mode_str(req.mode),
            scope = scope_str(req.scope),
            namespace = req.namespace,
            backend,
            wait = wait_str(req.wait),
            fenced = req.fenced,
        );
        span.in_scope(|| tracing::debug!(target: TARGET, "lock requested"));
        Attempt {
            on,
            span,
            start: Some(Instant::now()),
            done: false,
            #[cfg(feature = "metrics")]
            labels: meter::Labels::new(backend, req.mode, cfg.group.and_then(|f| f(req.name))),
        }
    }

    /// Whether a request is worth observing: someone listens ([`on`]) or the `metrics`
    /// feature is on. When it is not, the request makes no `Attempt`, and its guard an
    /// [unobserved](Tally::unobserved) tally.
    #[inline]
    pub(crate) fn wanted() -> bool {
        cfg!(feature = "metrics") || on()
    }

    /// The span to instrument the backend's acquisition with; `None` when no one listens
    /// (instrumenting with a disabled span still costs, on every poll).
    pub(crate) fn span(&self) -> Option<&Span> {
        (!self.span.is_disabled()).then_some(&self.span)
    }

    /// Runs a backend's acquisition observed as `attempt` (if any): inside its span, with
    /// "not obtained" or "failed" reported here. A grant comes back with the attempt,
    /// for the caller to turn into its guard's tally ([`Attempt::granted`]) once it
    /// knows what was granted.
    pub(crate) async fn run<T>(
        attempt: Option<Attempt>,
        wait: Wait,
        acquire: impl std::future::Future<Output = Result<Option<T>, Error>>,
    ) -> Result<Option<(T, Option<Attempt>)>, Error> {
        let result = match attempt.as_ref().and_then(Attempt::span) {
            Some(span) => tracing::Instrument::instrument(acquire, span.clone()).await,
            None => acquire.await,
        };
        match result {
            Ok(Some(granted)) => Ok(Some((granted, attempt))),
            Ok(None) => {
                if let Some(a) = attempt {
                    a.not_granted(wait);
                }
                Ok(None)
            }
            Err(e) => {
                if let Some(a) = attempt {
                    a.failed(&e);
                }
                Err(e)
            }
        }
    }

    /// The tally of a grant of `req`, its guard reported under `key` (a semaphore's
    /// slot's; else `req.key`): from its attempt ([`Attempt::granted`]), or
    /// [unobserved](Tally::unobserved) when there was none.
    #[inline]
    pub(crate) fn tally(
        attempt: Option<Attempt>,
        req: &Req<'_>,
        key: Key,
        backend: &'static str,
        token: Option<i64>,
    ) -> Tally {
        match attempt {
            Some(a) => a.granted(req, key, backend, token),
            None => Tally::unobserved(req, key, backend),
        }
    }

    fn waited(&self) -> (Option<Instant>, Duration) {
        match self.start {
            Some(start) => {
                let now = Instant::now();
                (Some(now), now.saturating_duration_since(start))
            }
            None => (None, Duration::ZERO),
        }
    }

    /// The lock was granted: the guard's [`Tally`] starts.
    pub(crate) fn granted(
        mut self,
        req: &Req<'_>,
        key: Key,
        backend: &'static str,
        token: Option<i64>,
    ) -> Tally {
        self.done = true;
        let (now, waited) = self.waited();
        if self.on {
            let _e = self.span.enter();
            tracing::debug!(target: TARGET, wait_us = micros(waited), token, "lock granted");
        }
        #[cfg(feature = "metrics")]
        meter::granted(&self.labels, waited.as_secs_f64());
        Tally {
            info: Info {
                name: Name::new(req.name),
                key,
                mode: req.mode,
                backend,
                granted: now,
                #[cfg(feature = "metrics")]
                labels: std::mem::replace(&mut self.labels, meter::Labels::None),
            },
            shared: OnceLock::new(),
        }
    }

    /// The wait ended without the lock: held elsewhere (`try_lock`) or the deadline passed.
    pub(crate) fn not_granted(mut self, wait: Wait) {
        self.done = true;
        let (_, waited) = self.waited();
        let _e = self.span.enter();
        if wait == Wait::Try {
            if self.on {
                tracing::debug!(target: TARGET, wait_us = micros(waited), "lock not obtained: held elsewhere");
            }
            #[cfg(feature = "metrics")]
            meter::not_granted(&self.labels, meter::M::NotObtained);
        } else {
            if self.on {
                tracing::debug!(target: TARGET, wait_us = micros(waited), "lock not obtained: timed out");
            }
            #[cfg(feature = "metrics")]
            meter::not_granted(&self.labels, meter::M::TimedOut);
        }
    }

    /// The request failed: a timeout (of a connection wait, say) counts as timed out.
    pub(crate) fn failed(mut self, error: &Error) {
        self.done = true;
        let (_, waited) = self.waited();
        let _e = self.span.enter();
        let timed_out = matches!(error, Error::Timeout { .. });
        tracing::debug!(target: TARGET, wait_us = micros(waited), timed_out, %error, "lock request failed");
        #[cfg(feature = "metrics")]
        meter::not_granted(
            &self.labels,
            if timed_out {
                meter::M::TimedOut
            } else {
                meter::M::Failed
            },
        );
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.done && self.on {
            let (_, waited) = self.waited();
            let _e = self.span.enter();
            tracing::debug!(target: TARGET, wait_us = micros(waited), "lock request cancelled");
        }
    }
}

const HELD: u8 = 0;
const LOST: u8 = 1;
const ENDED: u8 = 2;
/// `release` is under way: a loss the release itself sees is still reported, one that
/// [`LockGuard::lost`](crate::LockGuard::lost)'s future sees is not (a backend's loss
/// future may resolve because the lock was released).
const CLOSING: u8 = 3;

/// What the loss reporters share with the guard: whether the loss was reported, whether
/// the guard ended.
struct Shared {
    state: AtomicU8,
}

/// The lock, as its events and metrics describe it.
#[derive(Clone)]
struct Info {
    name: Name,
    key: Key,
    mode: Mode,
    backend: &'static str,
    granted: Option<Instant>,
    #[cfg(feature = "metrics")]
    labels: meter::Labels,
}

impl Info {
    /// Reports the loss if the state is one of `from` (then marks it lost).
    #[cold]
    fn report_loss(&self, shared: &Shared, from: &[u8], reason: &LossReason) {
        let won = from.iter().any(|&f| {
            shared
                .state
                .compare_exchange(f, LOST, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        });
        if !won {
            return;
        }
        tracing::warn!(
            target: TARGET,
            name = self.name.as_str(),
            key = self.key.as_i64(),
            mode = mode_str(self.mode),
            backend = self.backend,
            held_us = self.granted.map(|g| micros(g.elapsed())),
            %reason,
            "lock lost",
        );
        #[cfg(feature = "metrics")]
        meter::lost(&self.labels);
    }
}

/// A held lock as observed: reports its loss once, and its end (release or drop).
pub(crate) struct Tally {
    info: Info,
    /// Allocated once a loss is seen or [`Tally::loss_reporter`] is asked for.
    shared: OnceLock<Arc<Shared>>,
}

impl Tally {
    /// The tally of a grant no one was listening for: it still reports a loss (a WARN)
    /// and, if a subscriber arrived meanwhile, the release.
    pub(crate) fn unobserved(req: &Req<'_>, key: Key, backend: &'static str) -> Tally {
        Tally {
            info: Info {
                name: Name::new(req.name),
                key,
                mode: req.mode,
                backend,
                granted: None,
                #[cfg(feature = "metrics")]
                labels: meter::Labels::None,
            },
            shared: OnceLock::new(),
        }
    }

    pub(crate) fn name(&self) -> &str {
        self.info.name.as_str()
    }

    pub(crate) fn key(&self) -> Key {
        self.info.key
    }

    pub(crate) fn mode(&self) -> Mode {
        self.info.mode
    }

    fn shared(&self) -> &Arc<Shared> {
        self.shared.get_or_init(|| {
            Arc::new(Shared {
                state: AtomicU8::new(HELD),
            })
        })
    }

    /// The guard itself saw its lock lost (`is_held`, `check`, `release`): reported
    /// once per guard.
    #[cold]
    pub(crate) fn saw_loss(&self, reason: &LossReason) {
        self.info
            .report_loss(self.shared(), &[HELD, CLOSING], reason);
    }

    /// `release` starts: from now on only the guard's own calls report a loss.
    pub(crate) fn closing(&self) {
        if let Some(s) = self.shared.get() {
            let _ = s
                .state
                .compare_exchange(HELD, CLOSING, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// What [`LockGuard::lost`](crate::LockGuard::lost)'s future reports through when it
    /// resolves.
    pub(crate) fn loss_reporter(&self) -> LossReporter {
        LossReporter {
            shared: self.shared().clone(),
            info: self.info.clone(),
        }
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        let was_lost = match self.shared.get() {
            Some(s) => s.state.swap(ENDED, Ordering::AcqRel) == LOST,
            None => false,
        };
        let info = &self.info;
        let held_for = info.granted.map(|g| g.elapsed());
        if !was_lost && on() {
            tracing::debug!(
                target: TARGET,
                name = info.name.as_str(),
                key = info.key.as_i64(),
                mode = mode_str(info.mode),
                backend = info.backend,
                held_us = held_for.map(micros),
                "lock released",
            );
        }
        #[cfg(feature = "metrics")]
        meter::ended(&info.labels, was_lost, held_for.map(|d| d.as_secs_f64()));
    }
}

/// Reports a loss [`LockGuard::lost`](crate::LockGuard::lost)'s future saw, unless the
/// guard saw it first or had started to release (or ended).
pub(crate) struct LossReporter {
    shared: Arc<Shared>,
    info: Info,
}

impl LossReporter {
    pub(crate) fn report(&self, reason: &LossReason) {
        self.info.report_loss(&self.shared, &[HELD], reason);
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Counts WARN events of [`TARGET`]; wants nothing else.
    #[derive(Clone, Default)]
    struct Warnings(Arc<AtomicUsize>);

    impl tracing::Subscriber for Warnings {
        fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
            m.target() == TARGET && *m.level() == tracing::Level::WARN
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, _: &tracing::Event<'_>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// A lock granted while nobody listened (the path that skips all observation when
    /// the `metrics` feature is off) still reports its loss, once, to a subscriber that
    /// arrived since.
    #[tokio::test(flavor = "current_thread")]
    async fn an_unobserved_grant_still_reports_its_loss_once() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("locks.db").display());
        let locks = crate::Locks::connect(&url).await.unwrap();
        let guard = locks.lock("unobserved").await.unwrap();
        assert_eq!(guard.name(), "unobserved");
        assert_eq!(guard.key(), locks.key("unobserved").unwrap());
        let warnings = Warnings::default();
        let _sub = tracing::subscriber::set_default(warnings.clone());
        std::fs::remove_file(dir.path().join("locks.db-locks")).unwrap();
        assert!(!guard.is_held());
        assert!(!guard.is_held());
        assert!(guard.release().await.is_err());
        assert_eq!(warnings.0.load(Ordering::SeqCst), 1);
    }
}
