//! dblock's own PostgreSQL connections (tokio-postgres) and their small pool.
//!
//! Why not sqlx here: a lock cycle must cost one round trip. tokio-postgres pipelines:
//! a message is handed to the connection's task the moment it is issued, and that task
//! is dblock's own (`drive`), so statements can be *sent* synchronously (from a guard's
//! `Drop`, say), without waiting for the reply and without spawning, or *deferred*:
//! handed to the connection's task, which writes them the next time it runs. And if the
//! next message on that connection is issued before the task has run (a loop that takes
//! and drops locks), the message carries them at its head, so the server answers both
//! with one reply (see `Outbox`). sqlx can only send when the connection is next
//! awaited.

use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::OwnedSemaphorePermit;
use tokio_postgres::{Client, SimpleQueryMessage, SimpleQueryStream};

use super::outbox::{Outbox, send, start};
use super::prepared::{NO_SUCH_STATEMENT, Use};
use super::tls::Connector;
use super::wire::{Deferred, Link, Message, QueryError, Results, Value};
use crate::error::LossReason;

/// A pool's idle connections, which a connection returns itself to.
pub(crate) type Idle = Mutex<Vec<NativeConn>>;

/// Reads a simple query's reply as it streams in: `row(i, value)` for each row of
/// statement `i` (its first column), without collecting the messages. Returns the
/// number of statements.
///
/// The stream is pinned by the caller: a stream passed by value and pinned here is kept
/// twice in the future's state (the argument's slot and the pinned one), in every lock
/// request's future.
async fn read(
    mut stream: std::pin::Pin<&mut SimpleQueryStream>,
    mut row: impl FnMut(usize, Option<&str>),
) -> Result<usize, QueryError> {
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
    /// Whether the session's own `lock_timeout` is a lock request's wait slice (set by
    /// [`NativeConn::set_session_slice`]): a lock request's round then need not set it
    /// for its transaction, and anything else must have it reset first
    /// ([`NativeConn::reset_session_slice`]).
    pub(crate) session_slice: bool,
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
        let stream = std::pin::pin!(start(&self.client, sql)?);
        let statements = read(stream, |i, value| {
            if out.len() <= i {
                out.resize_with(i + 1, Vec::new);
            }
            out[i].push(value.map(str::to_string));
        })
        .await?;
        out.resize_with(statements, Vec::new);
        Ok(out)
    }

    /// Sends a simple query of several statements and reads every result it gets: the
    /// rows of each statement that completed (the first column), and the error that
    /// ended the message, if one did — the statements from the failed one on did not
    /// complete (the one that failed may have done part of its work: a session lock
    /// taken by a row before the error is still held). The multiplexer's batches
    /// need this: one failing statement must not lose what the others did.
    ///
    /// Not cancel safe by itself: its one caller, a multiplexer's lane, is never
    /// cancelled while it runs.
    pub(crate) async fn query_partial(&self, sql: &str) -> (Results, Option<QueryError>) {
        if !self.outbox.send_waiting(&self.client) {
            let lost = QueryError::Lost {
                message: "the connection closed".into(),
            };
            return (Vec::new(), Some(lost));
        }
        let stream = match start(&self.client, sql) {
            Ok(s) => s,
            Err(e) => return (Vec::new(), Some(e)),
        };
        let mut stream = std::pin::pin!(stream);
        let mut out: Results = vec![Vec::new()];
        while let Some(m) = stream.next().await {
            match m {
                Ok(SimpleQueryMessage::Row(r)) => {
                    if let Some(rows) = out.last_mut() {
                        rows.push(r.get(0).map(str::to_string));
                    }
                }
                Ok(SimpleQueryMessage::CommandComplete(_)) => out.push(Vec::new()),
                Ok(_) => {}
                Err(e) => {
                    // The failed statement's rows are not a result.
                    out.pop();
                    return (out, Some(QueryError::from_driver(e)));
                }
            }
        }
        out.pop();
        (out, None)
    }

    /// Sends `message` and returns, for each statement index in `want`, the first
    /// column of that statement's first row (`None` for no row, a NULL, or no index).
    ///
    /// Statements deferred on the connection (see [`Outbox`]) go out in the same
    /// message, ahead of it, and are not counted in `want`'s indices.
    ///
    /// Not cancel safe by itself: callers arm an abandon before awaiting it.
    pub(crate) async fn first_values<const N: usize>(
        &self,
        message: &Message,
        want: &[Option<u32>; N],
    ) -> Result<[Option<Value>; N], QueryError> {
        let (stream, carried) = self.outbox.carry(message, |text| start(&self.client, text));
        let stream = std::pin::pin!(stream?);
        let mut out: [Option<Value>; N] = std::array::from_fn(|_| None);
        let mut seen = [false; N];
        read(stream, |i, value| {
            let Some(i) = i.checked_sub(carried) else {
                return;
            };
            for ((w, seen), out) in want.iter().zip(&mut seen).zip(&mut out) {
                if w.map(|w| w as usize) == Some(i) && !*seen {
                    *seen = true;
                    *out = value.map(Value::new);
                }
            }
        })
        .await?;
        Ok(out)
    }

    /// Whether `message` runs as [`NativeConn::first_values_preparable`]: it may run
    /// prepared and either is prepared on this session or is seen there the second time
    /// (see `prepared.rs`); a text seen the first time is noted.
    ///
    /// A `bool`, not the statement: a value with a destructor taken where every lock
    /// request's future awaits kept room for itself there.
    pub(crate) fn runs_preparable(&self, message: &Message) -> bool {
        message.preparable()
            && self.outbox.prepared().use_for(message.last_statement()) != Use::Simple
    }

    /// [`NativeConn::first_values`] of a message [`NativeConn::runs_preparable`] said yes
    /// to: prepared if its statement is, else as a simple query with the statement's
    /// `Parse` queued just ahead of it, its reply read after the round's (no round trip
    /// of its own), the statement kept for the next time.
    pub(crate) async fn first_values_preparable<const N: usize>(
        &self,
        message: &Message,
        want: &[Option<u32>; N],
    ) -> Result<[Option<Value>; N], QueryError> {
        let text = message.last_statement();
        let statement = self.outbox.prepared().statement(text);
        if let Some(statement) = statement {
            return self.first_values_prepared(message, want, statement).await;
        }
        let mut parse = std::pin::pin!(self.client.prepare(text));
        // The first poll queues the `Parse` (tokio-postgres sends a request before it
        // awaits its reply), just ahead of the round's message: it changes nothing in a
        // transaction, and its reply is in by the time the round's is read.
        let polled = parse
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        let reply = self.first_values(message, want).await;
        let parsed = match polled {
            std::task::Poll::Ready(p) => p,
            std::task::Poll::Pending => parse.await,
        };
        let mut prepared = self.outbox.prepared();
        match parsed {
            Ok(statement) => prepared.parsed(text, Ok(statement)),
            Err(e) => prepared.parsed(text, Err(e.code().map(|c| c.code()))),
        }
        reply
    }

    /// [`NativeConn::first_values`] of a message whose last statement is prepared on the
    /// session as `statement`: the statements before it (with those deferred on the
    /// connection at their head) as a simple query, then `statement` bound and executed,
    /// both queued at once, so that they leave in one write. The simple query's reply is
    /// read first: if it failed, the round failed, as the one message would have (the
    /// statement then ran in a transaction of its own, which ended with it, and let go
    /// of whatever it took).
    async fn first_values_prepared<const N: usize>(
        &self,
        message: &Message,
        want: &[Option<u32>; N],
        statement: tokio_postgres::Statement,
    ) -> Result<[Option<Value>; N], QueryError> {
        let head = message.without_last();
        let mut execute = std::pin::pin!(self.client.query_raw(
            &statement,
            std::iter::empty::<&(dyn tokio_postgres::types::ToSql + Sync)>()
        ));
        let head_reply = {
            let mut waiting = self.outbox.waiting();
            let text = match waiting.take() {
                Some(deferred) => deferred.carried_by(&head).0,
                None => std::borrow::Cow::Borrowed(head.alone()),
            };
            let head_reply = match text.is_empty() {
                true => None,
                false => Some(start(&self.client, &text)),
            };
            // The first poll queues the Bind and Execute (tokio-postgres sends a request
            // before it awaits its reply), behind the head, before the outbox is let go.
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if let std::task::Poll::Ready(Err(e)) = execute.as_mut().poll(&mut cx) {
                return Err(QueryError::from_driver(e));
            }
            head_reply
        };
        if let Some(reply) = head_reply {
            read(std::pin::pin!(reply?), |_, _| {}).await?;
        }
        let rows = match execute.await {
            Ok(rows) => rows,
            Err(e) => {
                let e = QueryError::from_driver(e);
                if let QueryError::Db { code, .. } = &e
                    && code == NO_SUCH_STATEMENT
                {
                    // The session is not the one the statement was prepared on (an
                    // undeclared, undetected transaction pooler): the round failed, as
                    // any failed round, and nothing is prepared on this connection again.
                    self.outbox.prepared().turn_off();
                }
                return Err(e);
            }
        };
        let mut rows = std::pin::pin!(rows);
        let mut value = None;
        while let Some(row) = rows.next().await {
            let row = row.map_err(QueryError::from_driver)?;
            if value.is_none() {
                value = Some(match row.columns().first().map(|c| c.type_()) {
                    Some(&tokio_postgres::types::Type::BOOL) => {
                        match row.try_get::<_, Option<bool>>(0) {
                            Ok(Some(true)) => Some(Value::new("t")),
                            Ok(Some(false)) => Some(Value::new("f")),
                            _ => None,
                        }
                    }
                    // A wait's `void`, as a simple query shows it.
                    _ => Some(Value::new("")),
                });
            }
        }
        let last = message.statements().saturating_sub(1);
        let mut out: [Option<Value>; N] = std::array::from_fn(|_| None);
        for (w, out) in want.iter().zip(&mut out) {
            if w.map(|w| w as usize) == Some(last) {
                *out = value.clone().flatten();
            }
        }
        Ok(out)
    }

    /// Defers `statements` to the connection's task: they go out the next time that
    /// task runs, or with the next message if that comes first (see [`Outbox`]).
    /// Returns false if they could not be (the connection is gone): the caller gives the
    /// connection up.
    pub(crate) fn defer(&self, statements: Deferred) -> bool {
        if self.client.is_closed() {
            return false;
        }
        self.outbox.defer(statements, |sql| send(&self.client, sql))
    }

    /// Sends `sql` now, after anything deferred, without waiting for its reply: queued
    /// on the connection's task before this returns, so anything sent later on this
    /// connection runs after it. Returns false if it could not be queued at once (see
    /// [`send`]); the connection is then closed, which ends its session and undoes
    /// whatever was kept in it (a connection shared by many users must not run on
    /// without statements one of them sent).
    pub(crate) fn send(&self, sql: &str) -> bool {
        let sent = self.outbox.send_waiting(&self.client) && send(&self.client, sql);
        if !sent {
            self.link.mark_lost(LossReason::ConnectionClosed {
                message: "a message could not be queued on the connection".into(),
            });
            self.outbox.close_now();
        }
        sent
    }

    /// Makes `ms` the session's `lock_timeout`, once per session: `SET lock_timeout`
    /// sent now on its own (after anything deferred, which ends any transaction open),
    /// so that no rollback undoes it. Returns whether the session has it (false: the
    /// connection could not send it and is closed).
    ///
    /// The `ROLLBACK` ahead of it (a warning when, as it should be, no transaction is
    /// open) makes sure the `SET` cannot fail in an aborted transaction and leave later
    /// waits without their slice.
    pub(crate) fn set_session_slice(&mut self, ms: u128) -> bool {
        if !self.session_slice {
            self.session_slice = self.send(&format!("ROLLBACK; SET lock_timeout = {ms}"));
        }
        self.session_slice
    }

    /// Gives the session back its own `lock_timeout` (the server's, role's or
    /// database's), for a user that is not a lock request. Returns false if that could
    /// not be sent (the connection is then closed).
    pub(crate) fn reset_session_slice(&mut self) -> bool {
        if !self.session_slice {
            return true;
        }
        self.session_slice = false;
        self.send("SET lock_timeout = DEFAULT")
    }

    /// Returns the connection to its pool (or closes it if it is broken).
    pub(crate) fn recycle(mut self) {
        self.link.set_watched(false);
        self.permit = None;
        // A connection shared with a child process is never reused (a child's copy of
        // its socket would keep what the next user keeps in the session): ended for
        // every copy.
        if !self.usable() || self.link.shut_down_exported() {
            return;
        }
        self.idle_since = std::time::Instant::now();
        if let Some(pool) = self.pool.upgrade() {
            let mut idle = pool.lock().unwrap_or_else(|p| p.into_inner());
            idle.push(self);
        }
    }

    /// Gives the connection up when its state is unknown (a message was cut off mid-way):
    /// asks the server to cancel whatever the session is running, and closes it. Closing
    /// ends the session, which undoes everything it kept (its transaction, its locks).
    pub(crate) fn abandon(self) {
        self.link.set_watched(false);
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
