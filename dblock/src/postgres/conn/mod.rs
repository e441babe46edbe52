//! The connection layer: one connection as its users see it, dblock's own
//! (tokio-postgres) or one borrowed from the caller's sqlx pool, and the few operations
//! both offer — query, send, defer, check, recycle, abandon — over which the lock logic
//! and the stores are written once. It speaks of messages and statements only: what
//! they mean (a lock, its release) is the caller's.
//!
//! One name per idea: to **send** is to queue statements on the connection at once,
//! without waiting for their reply, ordered before anything issued after them, or to
//! answer false when they could not be queued at once, the connection then given up;
//! to **defer** is to hand statements to the connection to send later (its task sends
//! them when it next runs, or the next message carries them at its head); to **start**
//! is to send and read the reply as it streams; **abandon** gives a connection up
//! (cancel + close); **recycle** returns it to its pool.

pub(crate) mod borrowed;
pub(crate) mod conninfo;
pub(crate) mod driver;
pub(crate) mod extended;
pub mod health;
pub(crate) mod native;
pub(crate) mod outbox;
pub(crate) mod pool;
pub mod pooler;
pub(crate) mod prepared;
pub(crate) mod tls;
pub(crate) mod wire;

use std::sync::Arc;

use crate::postgres::sql::first_value;
use borrowed::SqlxConn;
use native::NativeConn;
use wire::{Deferred, Link, Message, QueryError, Results, Value};

/// A connection checked out for one user: a request and, if it keeps something in the
/// session (a lock), for as long as it does.
pub(crate) enum Conn {
    Native(NativeConn),
    Sqlx(SqlxConn),
}

impl Conn {
    pub(crate) fn link(&self) -> &Arc<Link> {
        match self {
            Conn::Native(c) => c.link(),
            Conn::Sqlx(c) => c.link(),
        }
    }

    /// Makes `ms` the session's `lock_timeout` on dblock's own connections (see
    /// [`NativeConn::set_session_slice`]); a borrowed connection's session is the
    /// caller's, and is left alone. Returns whether the session has it.
    pub(crate) fn set_session_slice(&mut self, ms: u128) -> bool {
        match self {
            Conn::Native(c) => c.set_session_slice(ms),
            Conn::Sqlx(_) => false,
        }
    }

    /// Sends a simple query (one or more statements) and waits for every result.
    ///
    /// Not cancel safe by itself: callers hold the connection in an [`Armed`] while
    /// awaiting it.
    pub(crate) async fn query(&self, sql: &str) -> Result<Results, QueryError> {
        match self {
            Conn::Native(c) => c.query(sql).await,
            Conn::Sqlx(c) => c.query(sql).await,
        }
    }

    /// Checks that the connection answers: an empty query, its reply read and dropped.
    ///
    /// Cancel safe: the query is queued at once, and a reply no one waits for any more
    /// is read and discarded by the connection (its task, on a borrowed connection),
    /// which stays usable.
    pub(crate) async fn check(&self) -> Result<(), QueryError> {
        match self {
            Conn::Native(c) => c.query(&c.link().check_sql()).await.map(|_| ()),
            Conn::Sqlx(c) => c.check().await,
        }
    }

    /// Sends `message` and returns, for each statement index in `want`, the first
    /// column of that statement's first row (`None` for no row, a NULL, or no index).
    /// On dblock's own connections the message carries statements still deferred (see
    /// [`Conn::defer`]) at its head.
    ///
    /// Not cancel safe by itself: callers hold the connection in an [`Armed`] while
    /// awaiting it.
    pub(crate) async fn first_values<const N: usize>(
        &self,
        message: &Message,
        want: &[Option<u32>; N],
    ) -> Result<[Option<Value>; N], QueryError> {
        match self {
            // Boxed, as the borrowed connection's query below: inline, it made every
            // request's future larger.
            Conn::Native(c) => match c.runs_preparable(message) {
                Some(how) => Box::pin(c.first_values_preparable(message, want, how)).await,
                None => c.first_values(message, want).await,
            },
            Conn::Sqlx(c) => {
                // Boxed: inline, a borrowed connection's query made every request's future
                // larger, on dblock's own connections too.
                let rows = Box::pin(c.query(message.alone())).await?;
                Ok(want.map(|i| {
                    i.and_then(|i| first_value(&rows, i as usize))
                        .map(|v| Value::new(&v))
                }))
            }
        }
    }

    /// Defers `statements`: sent without waiting for their reply, ordered before
    /// anything sent after them. On dblock's own connections they are handed to the
    /// connection's task, which sends them the next time it runs, unless the next
    /// message on the connection comes first and carries them at its head; a borrowed
    /// connection's task sends them at once. Returns false if the connection is gone.
    pub(crate) fn defer(&self, statements: Deferred) -> bool {
        match self {
            Conn::Native(c) => c.defer(statements),
            Conn::Sqlx(c) => c.send(statements.sql()),
        }
    }

    /// Sends `sql` now without waiting for its reply, ordered before anything sent after
    /// it. Returns false if it could not be queued at once (the connection is gone, or
    /// closed for it): the caller gives the connection up.
    pub(crate) fn send(&self, sql: &str) -> bool {
        match self {
            Conn::Native(c) => c.send(sql),
            Conn::Sqlx(c) => c.send(sql),
        }
    }

    /// Returns the connection to its pool (or closes it if it is broken).
    pub(crate) fn recycle(self) {
        match self {
            Conn::Native(c) => c.recycle(),
            Conn::Sqlx(c) => c.recycle(),
        }
    }

    /// Gives up a connection whose state is unknown: stops whatever the server session
    /// is doing as far as possible, and closes it, which releases everything it held.
    pub(crate) fn abandon(self) {
        match self {
            Conn::Native(c) => c.abandon(),
            Conn::Sqlx(c) => c.abandon(),
        }
    }
}

/// Arms [`Conn::abandon`] for the duration of a request: dropped while armed (the
/// request's future was cancelled), the connection is abandoned.
pub(crate) struct Armed(Option<Conn>);

impl Armed {
    pub(crate) fn new(conn: Conn) -> Armed {
        Armed(Some(conn))
    }

    pub(crate) fn conn(&self) -> &Conn {
        // Invariant: the Option is Some until `disarm` consumes self.
        match &self.0 {
            Some(c) => c,
            None => unreachable_conn(),
        }
    }

    pub(crate) fn disarm(mut self) -> Conn {
        match self.0.take() {
            Some(c) => c,
            None => unreachable_conn(),
        }
    }
}

#[cold]
#[allow(clippy::panic)]
fn unreachable_conn() -> ! {
    // `Armed` holds its connection from `new` until `disarm` consumes it.
    panic!("dblock internal error: armed connection missing")
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.abandon();
        }
    }
}
