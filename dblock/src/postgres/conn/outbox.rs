//! The statements deferred to a connection's task ([`Outbox`]), and the two ways a
//! message goes onto a tokio-postgres client: [`send`] (without waiting for the reply)
//! and [`start`] (the reply read as it streams in).

use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::FutureExt;
use tokio_postgres::{Client, SimpleQueryStream};

use super::prepared::Prepared;
use super::wire::{Deferred, Message, QueryError};
use crate::error::LossReason;
use crate::sync::{AtomicBool, AtomicWaker, Mutex, MutexGuard, Ordering};

/// Statements deferred to the connection's task ([`Deferred`]), so that they can go
/// out in one message with the next one on the connection.
///
/// Sent on their own, they cost a message of their own and, on the client, a wake-up
/// for their reply; the server answers every message with a separate write. Handed over
/// here instead, they are queued by the connection's task the next time that task runs —
/// exactly when a request queued on the driver would have been written — unless a
/// message on the connection comes first (a loop issuing one after another), which then
/// carries them at its head (see [`Deferred::carried_by`]): a `ROLLBACK` as `ROLLBACK AND
/// CHAIN` in place of the message's BEGIN (or `ROLLBACK; …`), a standalone statement
/// ahead of a message that begins no transaction, others in a transaction of their own
/// (`BEGIN; …; COMMIT; …`). One message, one reply; either way the statements leave no
/// later than they would have.
#[derive(Default)]
pub(crate) struct Outbox {
    /// The statements waiting to be sent. Whoever takes them queues them (alone, or
    /// ahead of its own message) while holding the mutex, so nothing issued later on the
    /// connection can overtake them.
    pub(crate) waiting: Mutex<Option<Deferred>>,
    /// Set to have the connection's task drop the socket at once, without waiting for
    /// replies still outstanding (a message the server is blocked in, say).
    pub(crate) closing: AtomicBool,
    /// The connection's task, woken when there is something to send or to close.
    pub(crate) task: AtomicWaker,
    /// The lock statements the session has prepared (kept here, with what else the
    /// connection's users share, rather than in the connection itself: a held lock
    /// carries the connection, and every lock request's future holds it).
    pub(crate) prepared: Mutex<Prepared>,
    /// The buffer a prepared round's message is written into (`extended::encode`), kept
    /// so that each round reuses the room of the one before instead of allocating.
    pub(crate) encoded: Mutex<bytes::BytesMut>,
}

/// The outbox's hand-offs take the way a message is queued on the connection as `send`
/// (`sql` → whether it was queued at once; [`send`] on a client), so that the loom models
/// (`postgres/loom_models.rs`) run them against a connection of their own.
impl Outbox {
    pub(crate) fn waiting(&self) -> MutexGuard<'_, Option<Deferred>> {
        crate::sync::lock(&self.waiting)
    }

    /// The session's prepared statements.
    pub(crate) fn prepared(&self) -> MutexGuard<'_, Prepared> {
        crate::sync::lock(&self.prepared)
    }

    /// The buffer of the connection's prepared rounds.
    pub(crate) fn encoded(&self) -> MutexGuard<'_, bytes::BytesMut> {
        crate::sync::lock(&self.encoded)
    }

    /// Queues the waiting statements on their own. Returns false if they could not be.
    pub(crate) fn send_waiting(&self, client: &Client) -> bool {
        self.send_waiting_by(|sql| send(client, sql))
    }

    /// Queues the waiting statements on their own through `send`, before the mutex is
    /// released (so nothing issued later overtakes them). Returns false if statements
    /// wait and could not be queued.
    pub(crate) fn send_waiting_by(&self, send: impl FnOnce(&str) -> bool) -> bool {
        let mut waiting = self.waiting();
        match waiting.take() {
            None => true,
            Some(r) => send(r.sql()),
        }
    }

    /// Defers `statements` (see [`NativeConn::defer`](super::native::NativeConn::defer)):
    /// statements still waiting, which one user at a time never leaves, go out first
    /// through `send`; then the connection's task is woken. Returns false if those could
    /// not be queued.
    pub(crate) fn defer(&self, statements: Deferred, send: impl FnOnce(&str) -> bool) -> bool {
        {
            let mut waiting = self.waiting();
            if let Some(earlier) = waiting.take()
                && !send(earlier.sql())
            {
                return false;
            }
            *waiting = Some(statements);
        }
        self.task.wake();
        true
    }

    /// Queues `next` through `start`, carrying the statements waiting at its head (see
    /// [`Deferred::carried_by`]), before the mutex is released like the task's own send.
    /// Returns what `start` returned and how many statements were carried ahead of
    /// `next`'s own.
    pub(crate) fn carry<T>(&self, next: &Message, start: impl FnOnce(&str) -> T) -> (T, usize) {
        let mut waiting = self.waiting();
        match waiting.take() {
            None => (start(next.alone()), 0),
            Some(deferred) => {
                let (text, carried) = deferred.carried_by(next);
                (start(&text), carried)
            }
        }
    }

    /// The connection's task's turn at the outbox: registers the task to be woken, then
    /// sends what waits through `send`. Registered first, so that statements deferred
    /// after the look wake it again. Ready when the task must end: closed by dblock, or
    /// statements wait that cannot be queued (the client is gone: the session ends with
    /// the connection, which undoes everything it kept).
    pub(crate) fn poll_task(
        &self,
        cx: &Context<'_>,
        send: impl FnOnce(&str) -> bool,
    ) -> Poll<LossReason> {
        self.task.register(cx.waker());
        if self.closing.load(Ordering::Acquire) {
            return Poll::Ready(LossReason::ConnectionClosed {
                message: "closed by dblock".into(),
            });
        }
        // Statements deferred since the last poll go out before anything else.
        if !self.send_waiting_by(send) {
            return Poll::Ready(LossReason::ConnectionClosed {
                message: "the connection closed".into(),
            });
        }
        Poll::Pending
    }

    /// Has the connection's task drop the socket at once.
    pub(crate) fn close_now(&self) {
        self.closing.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// Queues `sql` on `client` (held weakly by the connection's task) if it is still there.
pub(crate) fn send_if_there(client: impl FnOnce() -> Option<Arc<Client>>, sql: &str) -> bool {
    client().is_some_and(|c| send(&c, sql))
}

/// Queues `sql` on the connection without waiting for its reply, ahead of anything
/// queued after it. Returns false if it was not queued at once — the connection is gone
/// (or, should the driver ever need more than one poll to queue a message, which it does
/// not) — and the caller then gives the connection up: every `send` behaves so.
pub(crate) fn send(client: &Client, sql: &str) -> bool {
    // `simple_query_raw` encodes and queues the request on its first poll, before any
    // await; the reply is dropped unread (the connection task discards it).
    matches!(client.simple_query_raw(sql).now_or_never(), Some(Ok(_)))
}

/// Queues a simple query on the connection; its reply comes through the stream.
pub(crate) fn start(client: &Client, sql: &str) -> Result<SimpleQueryStream, QueryError> {
    // Queued in the first poll (see `send`); a driver that ever needed more would make
    // this fail loudly rather than send out of order.
    match client.simple_query_raw(sql).now_or_never() {
        Some(Ok(stream)) => Ok(stream),
        Some(Err(e)) => Err(QueryError::from_driver(e)),
        None => Err(QueryError::Lost {
            message: "the driver did not queue the request at once".into(),
        }),
    }
}
