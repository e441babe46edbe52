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

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::OwnedSemaphorePermit;
use tokio_postgres::{Client, SimpleQueryMessage, SimpleQueryStream};

use super::outbox::{Outbox, send, start};
use super::prepared::{NO_SUCH_STATEMENT, Parse, Use};
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

/// How a message [`NativeConn::runs_preparable`] said yes to runs: its statement's id
/// (`Ok`: prepared on the session; `Err`: the id it is parsed under in this round), and
/// its last statement's parts if one statement serves every key ([`Message::keyed`],
/// found once a round). Ids and borrowed text, nothing with a destructor: a value with
/// one taken where every lock request's future awaits kept room for itself there.
pub(crate) struct Preparable<'m> {
    statement: Result<u32, u32>,
    keyed: Option<(&'m str, i64)>,
    /// Whether the session has the statements that open a round, read under the same
    /// lock as the statement.
    fixed: super::extended::Fixed,
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

    /// Whether `message` runs as [`NativeConn::first_values_preparable`]: `Some` if it
    /// may run prepared and either is prepared on this session or is to be in this round
    /// (see `prepared.rs`, and [`Preparable`]); a text seen the first time is noted.
    pub(crate) fn runs_preparable<'m>(&self, message: &'m Message) -> Option<Preparable<'m>> {
        if !message.preparable() {
            return None;
        }
        let keyed = message.keyed();
        let (text, at_once) = match keyed {
            Some((prefix, _)) => (prefix, true),
            None => (message.last_statement(), false),
        };
        let mut prepared = self.outbox.prepared();
        let statement = match prepared.use_for(text, at_once) {
            Use::Simple => return None,
            Use::Prepare(id) => Err(id),
            Use::Prepared(id) => Ok(id),
        };
        let fixed = match prepared.fixed {
            true => super::extended::Fixed::Have,
            false => super::extended::Fixed::Parse,
        };
        Some(Preparable {
            statement,
            keyed,
            fixed,
        })
    }

    /// [`NativeConn::first_values`] of a message [`NativeConn::runs_preparable`] said yes
    /// to, under one `Sync` (see `extended.rs`): its head (with the statements deferred
    /// on the connection carried at its head) a statement at a time, then its last
    /// statement as the session's prepared statement — parsed under its name in this
    /// same round if it is not yet; a keyed one (see [`Message::keyed`]) with its key
    /// bound, its comment left to the held lock's health checks (see
    /// `extended::Last::key`). One write, one reply, as a simple query.
    ///
    /// A head that does not split into its statements where a simple query would (never
    /// the case for the texts dblock writes) runs as [`NativeConn::first_values`].
    ///
    /// Not cancel safe by itself, as [`NativeConn::first_values`]: callers arm an abandon
    /// before awaiting it.
    pub(crate) async fn first_values_preparable<const N: usize>(
        &self,
        message: &Message,
        want: &[Option<u32>; N],
        how: Preparable<'_>,
    ) -> Result<[Option<Value>; N], QueryError> {
        let Preparable {
            statement,
            keyed,
            fixed,
        } = how;
        // The statement's text, as the session's cache knows it.
        let text = keyed.map_or(message.last_statement(), |(prefix, _)| prefix);
        let sent = {
            let mut waiting = self.outbox.waiting();
            let deferred = waiting.take();
            let (head, carried) = message.head_carrying(deferred.as_ref());
            let statements = head.statements().count();
            let (id, parse) = match statement {
                Ok(id) => (id, false),
                Err(id) => (id, true),
            };
            let keyed_text;
            let last = super::extended::Last {
                name: super::extended::Name::of(id),
                parse: match (parse, keyed) {
                    (false, _) => None,
                    (true, None) => Some(text),
                    (true, Some((prefix, _))) => {
                        // Marked as dblock's, with no name: shown until the
                        // held lock's first health check names it.
                        let mut text = format!("{prefix}$1)");
                        crate::status::write_holder_mark(&mut text);
                        keyed_text = text;
                        Some(keyed_text.as_str())
                    }
                },
                key: keyed.map(|(_, key)| key),
            };
            // A head that splits into as many statements as were written (never otherwise
            // for the texts dblock writes).
            let encoded = match statements == carried + message.statements().saturating_sub(1) {
                true => super::extended::encode(
                    &mut self.outbox.encoded(),
                    head.statements(),
                    fixed,
                    &last,
                ),
                false => None,
            };
            match encoded {
                Some(encoded) => Some((
                    self.client
                        .send_encoded(encoded)
                        .map_err(QueryError::from_driver)?,
                    statements,
                    carried,
                    id,
                    parse,
                    fixed == super::extended::Fixed::Parse,
                    deferred,
                )),
                None => {
                    *waiting = deferred;
                    None
                }
            }
        };
        let Some((mut responses, head, carried, id, parse, parse_fixed, deferred)) = sent else {
            return self.first_values(message, want).await;
        };
        let mut out: [Option<Value>; N] = std::array::from_fn(|_| None);
        let mut seen = [false; N];
        let read = super::extended::read(&mut responses, |i, value| {
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
        .await;
        // Let go of now: what is left of the reply (after an error, its `ReadyForQuery`)
        // is then dropped by the connection's task, which never waits on this round.
        drop(responses);
        if parse || parse_fixed {
            let outcome = match (&read.error, read.bound(head)) {
                (_, true) => Parse::Completed,
                (Some(QueryError::Db { code, .. }), false) if read.failed_between(head) => {
                    Parse::Refused(Some(code))
                }
                (Some(_), false) if read.failed_between(head) => Parse::Refused(None),
                _ => Parse::NotReached,
            };
            self.outbox
                .prepared()
                .parsed(parse.then_some(text), id, outcome);
        }
        let between = read.failed_between(head);
        let first = read.failed_first();
        match read.error {
            None => Ok(out),
            // A prepared statement refused or missing (the server session is not the one
            // they were prepared on: an undeclared, undetected transaction pooler moved
            // the connection between transactions, or left another client's statements of
            // the same name): never the lock statement's own failure. Nothing is prepared
            // on this connection again, and the round runs as the simple query it would
            // have been — after a `ROLLBACK` if its head ran (its transaction is aborted;
            // what the head carried is done), else with what it carried.
            Some(QueryError::Db { code, .. })
                if between || (first && code == NO_SUCH_STATEMENT) =>
            {
                self.outbox.prepared().turn_off();
                self.put_back(match between {
                    true => Some(Deferred::Rollback { chain: false }),
                    false => deferred,
                });
                self.first_values(message, want).await
            }
            Some(e) => Err(e),
        }
    }

    /// Puts back statements taken from the outbox for a round that did not run them:
    /// waiting again, to go with the next message; if others were deferred since, these
    /// are sent now, ahead of them.
    fn put_back(&self, deferred: Option<Deferred>) {
        let Some(deferred) = deferred else { return };
        let mut waiting = self.outbox.waiting();
        match waiting.take() {
            None => *waiting = Some(deferred),
            Some(later) => {
                if !send(&self.client, deferred.sql()) {
                    self.outbox.close_now();
                }
                *waiting = Some(later);
            }
        }
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
