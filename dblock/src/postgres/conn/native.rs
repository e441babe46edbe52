//! dblock's own PostgreSQL connections (tokio-postgres) and their small pool.
//!
//! Why not sqlx here: a lock cycle must cost one round trip. tokio-postgres pipelines:
//! a request is handed to the connection's task the moment it is issued, and that task
//! is dblock's own (`drive`), so a guard's `Drop` can *send* its release
//! synchronously, without waiting for the reply and without spawning: it hands the
//! release to the connection's task, which writes it the next time it runs. And if
//! the next lock request on that connection is issued before the task has run (a loop
//! that takes and drops locks), the request carries the release at the head of its own
//! message, so the server answers both with one reply (see `Outbox`). sqlx can only
//! send when the connection is next awaited.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use tokio::sync::OwnedSemaphorePermit;
use tokio_postgres::{Client, SimpleQueryMessage, SimpleQueryStream};

use super::outbox::{Outbox, send, start};
use super::tls::Connector;
use super::wire::{Link, LockSql, QueryError, Release, Results};
use crate::error::LossReason;

/// A pool's idle connections, which a connection returns itself to.
pub(crate) type Idle = Mutex<Vec<NativeConn>>;

/// Reads a simple query's reply as it streams in: `row(i, value)` for each row of
/// statement `i` (its first column), without collecting the messages. Returns the
/// number of statements.
async fn read(
    stream: SimpleQueryStream,
    mut row: impl FnMut(usize, Option<&str>),
) -> Result<usize, QueryError> {
    let mut stream = std::pin::pin!(stream);
    let mut i = 0;
    while let Some(m) = stream.next().await {
        match m.map_err(QueryError::from_driver)? {
            SimpleQueryMessage::Row(r) => row(i, r.get(0)),
            // An empty query ends with EmptyQueryResponse, which counts as a statement too.
            SimpleQueryMessage::CommandComplete(_) => i += 1,
            _ => {}
        }
    }
    Ok(i)
}

/// One of dblock's connections, checked out of the pool.
pub(crate) struct NativeConn {
    /// When it was last returned to the pool.
    pub(crate) idle_since: std::time::Instant,
    pub(crate) client: Arc<Client>,
    pub(crate) link: Arc<Link>,
    pub(crate) outbox: Arc<Outbox>,
    pub(crate) permit: Option<OwnedSemaphorePermit>,
    pub(crate) pool: Weak<Idle>,
    /// For the cancel request of [`NativeConn::abandon`], over the session's kind of
    /// connection.
    pub(crate) tls: Connector,
}

impl NativeConn {
    pub(crate) fn usable(&self) -> bool {
        !self.client.is_closed() && self.link.loss().is_none()
    }

    pub(crate) fn link(&self) -> &Arc<Link> {
        &self.link
    }

    /// Whether the connection answers an empty query within `timeout`.
    ///
    /// Cancel safe: dropped mid-way, the connection is dropped with it (closed).
    pub(crate) async fn alive(&self, timeout: Duration) -> bool {
        matches!(
            tokio::time::timeout(timeout, self.query("")).await,
            Ok(Ok(_))
        )
    }

    /// Sends a simple query (one or more statements) and waits for every result.
    ///
    /// Not cancel safe by itself: callers arm an abandon before awaiting it.
    pub(crate) async fn query(&self, sql: &str) -> Result<Results, QueryError> {
        if !self.outbox.send_waiting(&self.client) {
            return Err(QueryError::Lost {
                message: "the connection closed".into(),
            });
        }
        let mut out: Results = Vec::new();
        let statements = read(start(&self.client, sql)?, |i, value| {
            if out.len() <= i {
                out.resize_with(i + 1, Vec::new);
            }
            out[i].push(value.map(str::to_string));
        })
        .await?;
        out.resize_with(statements, Vec::new);
        Ok(out)
    }

    /// Sends a lock request and returns, for each statement index in `want`, the first
    /// column of that statement's first row (`None` for no row, a NULL, or no index).
    ///
    /// A release still waiting to be sent on the connection (see [`Outbox`]) goes out
    /// in the same message, ahead of the request, and its statements are not counted
    /// in `want`'s indices. Only for lock requests, which behave alike after a
    /// transaction ended in their own message: they begin a transaction of their own
    /// or are plain `SELECT`s.
    ///
    /// Not cancel safe by itself: callers arm an abandon before awaiting it.
    pub(crate) async fn lock_query<const N: usize>(
        &self,
        sql: &LockSql,
        want: [Option<usize>; N],
    ) -> Result<[Option<String>; N], QueryError> {
        let (stream, carried) = {
            let mut waiting = self.outbox.lock();
            // Queued before the mutex is released, like the task's own send.
            match waiting.take() {
                None => (start(&self.client, sql.alone())?, 0),
                Some(release) => {
                    let (text, carried) = release.carried_by(sql);
                    (start(&self.client, &text)?, carried)
                }
            }
        };
        let mut out: [Option<String>; N] = std::array::from_fn(|_| None);
        let mut seen = [false; N];
        read(stream, |i, value| {
            let Some(i) = i.checked_sub(carried) else {
                return;
            };
            for ((w, seen), out) in want.iter().zip(&mut seen).zip(&mut out) {
                if *w == Some(i) && !*seen {
                    *seen = true;
                    *out = value.map(str::to_string);
                }
            }
        })
        .await?;
        Ok(out)
    }

    /// Hands a held lock's release to the connection's task: it goes out the next time
    /// that task runs, or with the next lock request if that comes first (see
    /// [`Outbox`]). Returns false if the connection is gone.
    pub(crate) fn send_release(&self, release: Release) -> bool {
        if self.client.is_closed() {
            return false;
        }
        {
            let mut waiting = self.outbox.lock();
            // One holder at a time, so never two; were there, the first goes first.
            if let Some(earlier) = waiting.take()
                && !send(&self.client, earlier.sql())
            {
                return false;
            }
            *waiting = Some(release);
        }
        self.outbox.task.wake();
        true
    }

    /// Sends `sql` now without waiting for its reply. Returns false if it could not be
    /// sent (the connection is gone).
    ///
    /// The request is queued on the connection's task before this returns, so anything
    /// sent later on this connection runs after it.
    pub(crate) fn send(&self, sql: &str) -> bool {
        if !self.outbox.send_waiting(&self.client) {
            return false;
        }
        // `simple_query_raw` encodes and queues the request on its first poll, before
        // any await; the reply is dropped unread (the connection task discards it).
        match self.client.simple_query_raw(sql).now_or_never() {
            Some(Ok(_stream)) => true,
            Some(Err(_)) => false,
            None => {
                // Should the driver ever need more than one poll, finish sending on the
                // runtime; the request still precedes anything issued after it.
                let client = self.client.clone();
                let sql = sql.to_string();
                match tokio::runtime::Handle::try_current() {
                    Ok(h) => {
                        h.spawn(async move {
                            let _ = client.simple_query_raw(&sql).await;
                        });
                        true
                    }
                    Err(_) => false,
                }
            }
        }
    }

    /// Returns the connection to its pool (or closes it if it is broken).
    pub(crate) fn recycle(mut self) {
        self.link.set_holding(false);
        self.permit = None;
        // A connection shared with a child process is never reused (a child's copy of
        // its socket would hold the next lock taken on it): ended for every copy.
        if !self.usable() || self.link.shut_down_exported() {
            return;
        }
        self.idle_since = std::time::Instant::now();
        if let Some(pool) = self.pool.upgrade() {
            let mut idle = pool.lock().unwrap_or_else(|p| p.into_inner());
            idle.push(self);
        }
    }

    /// Gives the connection up when its state is unknown (a request was cut off mid-way):
    /// asks the server to cancel whatever the session is running, and closes it. Closing
    /// ends the session, which releases every lock and transaction it had.
    pub(crate) fn abandon(self) {
        self.link.set_holding(false);
        // Whatever the connection held is gone from now on: say so at once.
        self.link.mark_lost(LossReason::ConnectionClosed {
            message: "closed by dblock after a request on it was cut off".into(),
        });
        self.outbox.close_now();
        let token = self.client.cancel_token();
        let tls = self.tls.clone();
        drop(self);
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                // A cancel request that arrives before the request starts executing is
                // ignored by the server; send it again a little later to cover that race
                // on servers without client_connection_check_interval.
                for pause in [0u64, 200, 1000] {
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    let _ = tokio::time::timeout(Duration::from_secs(5), tls.cancel(&token)).await;
                }
            });
        }
    }
}
