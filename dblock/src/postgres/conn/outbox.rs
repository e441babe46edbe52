//! The release a guard's drop hands to its connection's task, and the two ways a
//! request goes onto a tokio-postgres client: [`send`] (without waiting for the reply)
//! and [`start`] (the reply read as it streams in).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::FutureExt;
use futures_util::task::AtomicWaker;
use tokio_postgres::{Client, SimpleQueryStream};

use super::wire::{QueryError, Release};

/// A release handed from a guard's drop to the connection's task, so that it can go
/// out in one message with the next lock request on the connection.
///
/// Sent on its own, a release costs a message of its own and, on the client, a wake-up
/// for its reply; the server answers every message with a separate write. Handed over
/// here instead, it is queued by the connection's task the next time that task runs —
/// exactly when a request queued on the driver would have been written — unless a lock
/// request on the connection comes first (a loop that takes and drops locks), which
/// then carries it at the head of its own message (see `Release::carried_by`): for a
/// transaction-scoped lock's, `ROLLBACK AND CHAIN; SELECT pg_advisory_xact_lock(…)`
/// (or `ROLLBACK; …`); for a session-scoped lock's, `SELECT pg_advisory_unlock(…); …`
/// (or, where it needs a transaction of its own, `BEGIN; …; COMMIT; …`). One message,
/// one reply; either way the release leaves no later than it would have.
#[derive(Default)]
pub(crate) struct Outbox {
    /// The release waiting to be sent. Whoever takes it queues it (alone, or ahead of
    /// its own request) while holding the mutex, so nothing issued later on the
    /// connection can overtake it.
    pub(crate) waiting: Mutex<Option<Release>>,
    /// Set to have the connection's task drop the socket at once, without waiting for
    /// replies still outstanding (a blocked lock request's, say).
    pub(crate) closing: AtomicBool,
    /// The connection's task, woken when there is something to send or to close.
    pub(crate) task: AtomicWaker,
}

impl Outbox {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Option<Release>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a waiting release on its own. Returns false if it could not be.
    pub(crate) fn send_waiting(&self, client: &Client) -> bool {
        let mut waiting = self.lock();
        match waiting.take() {
            None => true,
            Some(r) => send(client, r.sql()),
        }
    }

    /// [`Outbox::send_waiting`] from the connection's task, which holds the client weakly.
    /// Returns false if a release waits and cannot be queued (the client is gone: the
    /// session ends with the connection, which releases everything it held).
    pub(crate) fn send_waiting_with(&self, client: impl FnOnce() -> Option<Arc<Client>>) -> bool {
        let mut waiting = self.lock();
        match waiting.take() {
            None => true,
            Some(r) => client().is_some_and(|c| send(&c, r.sql())),
        }
    }

    /// Has the connection's task drop the socket at once.
    pub(crate) fn close_now(&self) {
        self.closing.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// Queues `sql` on the connection without waiting for its reply. Returns false if it
/// was not queued: the connection is gone (or, should the driver ever need more than
/// one poll to queue a request, which it does not, the caller must give it up).
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
