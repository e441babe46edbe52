//! loom models of a guard's loss state (docs/testing.md): `RUSTFLAGS="--cfg dblock_loom" cargo
//! test -p dblock --lib --release loom_`. The backends' hand-offs have models of their own
//! (`postgres/loom_models.rs`, `sqlite/loom_models.rs`).
//!
//! A real [`LockGuard`] — its `release`, drop, `is_held` and `lost` future, and the
//! [`Tally`](crate::observe::Tally) that reports the lock's end — over a backend half
//! whose connection the model marks lost while the release is under way. The half does
//! what `Pinned` (PostgreSQL) does with its link: a release first asks whether the
//! connection was lost, and `lost` resolves once it is. What is reported is read from the
//! tracing events the guard emits, as an operator sees them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::poll_fn;
use std::sync::atomic::AtomicUsize as StdCount;
use std::task::Poll;

use loom::sync::{Arc, Mutex};
use loom::thread;

use crate::error::{Error, LossReason};
use crate::guard::LockGuard;
use crate::key::Key;
use crate::observe::{TARGET, Tally};
use crate::raw::{BoxFuture, Grant, Mode, RawHeld, Req, Scope, Wait};
use crate::sync::AtomicWaker;

/// What a lock's connection and its holder share (`Link`): lost once, first reason wins,
/// and the task waiting for the loss woken.
#[derive(Default)]
struct Link {
    lost: Mutex<Option<LossReason>>,
    waiting: AtomicWaker,
}

impl Link {
    fn mark_lost(&self) {
        let mut lost = self.lost.lock().unwrap();
        if lost.is_none() {
            *lost = Some(LossReason::ConnectionClosed {
                message: "the model's connection closed".into(),
            });
        }
        drop(lost);
        self.waiting.wake();
    }

    fn loss(&self) -> Option<LossReason> {
        self.lost.lock().unwrap().clone()
    }
}

/// The backend's half of the guard, over the model's link; `checks_loss` false for the
/// control, a release that does not first ask whether the connection was lost.
struct Held(Arc<Link>, bool);

impl RawHeld for Held {
    fn loss(&self) -> Option<LossReason> {
        self.0.loss()
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        let link = self.0.clone();
        Box::pin(poll_fn(move |cx| {
            link.waiting.register(cx.waker());
            match link.loss() {
                Some(reason) => Poll::Ready(reason),
                None => Poll::Pending,
            }
        }))
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        let loss = self.0.loss();
        Box::pin(async move {
            match loss {
                Some(reason) => Err(Error::LockLost { reason }),
                None => Ok(()),
            }
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        // As `Pinned::release`: a connection already lost has nothing to release.
        Box::pin(async move {
            match self.0.loss().filter(|_| self.1) {
                Some(reason) => Err(Error::LockLost { reason }),
                None => Ok(()),
            }
        })
    }
}

/// The guard's ends, as its tracing events report them.
#[derive(Clone, Default)]
struct Reports {
    lost: std::sync::Arc<StdCount>,
    released: std::sync::Arc<StdCount>,
}

impl Reports {
    fn lost(&self) -> usize {
        self.lost.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn released(&self) -> usize {
        self.released.load(std::sync::atomic::Ordering::SeqCst)
    }
}

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for Reports {
    fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
        m.target() == TARGET
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &tracing::Event<'_>) {
        let mut m = Message(String::new());
        e.record(&mut m);
        let count = match m.0.as_str() {
            "lock lost" => &self.lost,
            "lock released" => &self.released,
            _ => return,
        };
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

fn guard(link: &Arc<Link>, checks_loss: bool) -> LockGuard {
    let req = Req {
        namespace: "model",
        name: "model",
        key: Key::from_i64(7),
        mode: Mode::Exclusive,
        scope: Scope::Transaction,
        wait: Wait::Forever,
        fenced: false,
        lease: None,
        fence_key: None,
    };
    let tally = Tally::unobserved(&req, req.key, "model");
    LockGuard::new(
        tally,
        Grant {
            held: crate::raw::Held::boxed(Held(link.clone(), checks_loss)),
            fence: None,
        },
    )
}

/// How the guard's owner ends the lock in the model.
#[derive(Clone, Copy)]
enum Owner {
    /// `release().await`.
    Releases,
    /// `is_held()`, then drops the guard.
    LooksThenDrops,
    /// The control: `release().await` over a backend half that releases without asking
    /// whether the connection was lost.
    ReleasesBlindly,
}

/// The guard's owner ends the lock while its connection is marked lost (by the
/// connection's task) and a `lost()` future, raced against the work, waits on another
/// task.
///
/// Invariant: the lock's end is reported once — lost or released, never both, never
/// twice; a release that succeeded is never reported as a loss; a loss the owner saw
/// (an error from `release`, `is_held` false) is reported.
fn loss_marked_while_the_owner_ends_the_lock(owner: Owner) {
    loom::model(move || {
        let reports = Reports::default();
        let _subscriber = tracing::subscriber::set_default(reports.clone());
        let link = Arc::new(Link::default());
        let guard = guard(&link, !matches!(owner, Owner::ReleasesBlindly));
        let lost = guard.lost();
        let watcher = thread::spawn(move || loom::future::block_on(lost));
        let connection = {
            let link = link.clone();
            thread::spawn(move || link.mark_lost())
        };
        let saw_loss = match owner {
            Owner::Releases | Owner::ReleasesBlindly => {
                loom::future::block_on(guard.release()).is_err()
            }
            Owner::LooksThenDrops => {
                let held = guard.is_held();
                drop(guard);
                !held
            }
        };
        connection.join().unwrap();
        watcher.join().unwrap();
        assert!(reports.lost() <= 1, "a loss reported twice");
        assert_eq!(
            reports.lost() + reports.released(),
            1,
            "the lock's end reported other than once (lost {}, released {})",
            reports.lost(),
            reports.released()
        );
        if saw_loss {
            assert_eq!(reports.lost(), 1, "a loss the owner saw went unreported");
        } else if let Owner::Releases | Owner::ReleasesBlindly = owner {
            assert_eq!(reports.lost(), 0, "a release reported as a loss");
        }
    });
}

#[test]
fn loom_a_loss_marked_while_the_guard_releases_is_reported_once_or_not_at_all() {
    loss_marked_while_the_owner_ends_the_lock(Owner::Releases);
}

#[test]
fn loom_a_loss_marked_while_the_guard_is_dropped_is_reported_once_or_not_at_all() {
    loss_marked_while_the_owner_ends_the_lock(Owner::LooksThenDrops);
}

#[test]
#[should_panic(expected = "a release reported as a loss")]
fn loom_control_a_release_that_does_not_ask_about_loss_is_reported_as_a_loss() {
    loss_marked_while_the_owner_ends_the_lock(Owner::ReleasesBlindly);
}
