//! The synchronisation types of the in-process hand-offs, in one place: std's (and
//! futures' `AtomicWaker`) in every build, loom's under `--cfg dblock_loom`, where the models in
//! `loom_models` run the code that uses them under every interleaving the memory model
//! allows (docs/testing.md). Code whose correctness inside the process rests on a mutex
//! or an atomic imports it from here, never from `std` directly.
//!
//! tokio's types are not loom-aware; where a hand-off rests on one, the part that decides
//! is kept out of it in a small type built on these (the outbox's queue, the multiplexer's
//! claims, a guard's loss state), and tokio's own loom tests cover the rest. The relay's
//! one-shot channels are tokio's in every build and, under loom, a stand-in with tokio's
//! documented semantics built on these ([`oneshot`]), so that the relay itself is modelled.

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

/// One-shot channels (the PostgreSQL relay's places in line): tokio's.
#[cfg(not(dblock_loom))]
pub(crate) use tokio::sync::oneshot;

/// One-shot channels under loom: tokio's semantics on loom's mutex and waker, so that the
/// relay's models (`postgres/loom_models.rs`) run its hand-offs under every interleaving.
/// What the relay rests on, as tokio documents it: `send` gives the value back once the
/// receiver is gone, and a value sent to a receiver dropped unread is dropped with it.
#[cfg(dblock_loom)]
pub(crate) mod oneshot {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use super::{Arc, AtomicWaker, Mutex, lock};

    struct State<T> {
        value: Option<T>,
        sender_gone: bool,
        receiver_gone: bool,
    }

    struct Inner<T> {
        state: Mutex<State<T>>,
        receiver: AtomicWaker,
    }

    /// The sending half.
    pub(crate) struct Sender<T>(Arc<Inner<T>>);

    /// The receiving half: a future of the value.
    pub(crate) struct Receiver<T>(Arc<Inner<T>>);

    pub(crate) mod error {
        /// The sender went without sending.
        #[derive(Debug)]
        pub(crate) struct RecvError;
    }

    /// A channel for one value.
    pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                value: None,
                sender_gone: false,
                receiver_gone: false,
            }),
            receiver: AtomicWaker::default(),
        });
        (Sender(inner.clone()), Receiver(inner))
    }

    impl<T> Sender<T> {
        /// Sends `value`; gives it back if the receiver is gone.
        pub(crate) fn send(self, value: T) -> Result<(), T> {
            {
                let mut state = lock(&self.0.state);
                if state.receiver_gone {
                    return Err(value);
                }
                state.value = Some(value);
            }
            self.0.receiver.wake();
            Ok(())
        }
    }

    impl<T> Drop for Sender<T> {
        fn drop(&mut self) {
            lock(&self.0.state).sender_gone = true;
            self.0.receiver.wake();
        }
    }

    impl<T> Future for Receiver<T> {
        type Output = Result<T, error::RecvError>;

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            self.0.receiver.register(cx.waker());
            let mut state = lock(&self.0.state);
            match state.value.take() {
                Some(v) => Poll::Ready(Ok(v)),
                None if state.sender_gone => Poll::Ready(Err(error::RecvError)),
                None => Poll::Pending,
            }
        }
    }

    impl<T> Drop for Receiver<T> {
        fn drop(&mut self) {
            let unread = {
                let mut state = lock(&self.0.state);
                state.receiver_gone = true;
                state.value.take()
            };
            // Dropped outside the mutex: a turn passes itself on as it drops.
            drop(unread);
        }
    }
}

/// Locks `m`, through a poisoned lock as well (what it guards stays consistent: no
/// holder panics between two of its writes).
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
