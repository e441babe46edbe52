//! Connections borrowed from the caller's sqlx pool ([`Locks::from_sqlx_pool`]).
//!
//! sqlx sends a request only while it is awaited, so each borrowed connection is run by
//! a small task that owns it and takes requests in order from a channel: statements
//! sent or deferred (a guard's release) are handed to that task at once (it sends them
//! on its next poll, within microseconds), and the connection goes back to the sqlx
//! pool after them. The task also runs the health checks while the connection is
//! watched.
//!
//! sqlx offers no cancel request, so a wait cut short closes its connection; on
//! PostgreSQL 14 and later each lock request sets `client_connection_check_interval`
//! for its own transaction, so the server notices the closed socket and stops waiting.
//!
//! [`Locks::from_sqlx_pool`]: crate::Locks::from_sqlx_pool

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Either, PgPool, Postgres, Row};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::wire::{Link, LostOnDrop, QueryError, Results};
use crate::error::{Error, LossReason};
use crate::postgres::store::xact::map_sqlx;

/// Where borrowed connections come from.
pub(crate) struct SqlxSource {
    pub(crate) pool: PgPool,
    pub(crate) check_interval: Duration,
    pub(crate) check_timeout: Duration,
}

impl SqlxSource {
    /// A connection from the pool, with its task started.
    pub(crate) async fn get(&self) -> Result<SqlxConn, Error> {
        // The lock's deadline bounds the wait for the lock; the wait for a connection is
        // bounded by the pool's own acquire_timeout. Boxed: sqlx's acquisition is a
        // future of some 14 KB, which inline would make every lock request's future that
        // large (allocated per request), whichever pool the handle has.
        let acquired = Box::pin(self.pool.acquire()).await;
        let conn = acquired.map_err(map_sqlx)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let link = Link::new();
        tokio::spawn(run_connection(
            conn,
            rx,
            link.clone(),
            self.check_interval,
            self.check_timeout,
        ));
        Ok(SqlxConn { tx, link })
    }
}

enum Cmd {
    Query(String, oneshot::Sender<Result<Results, QueryError>>),
    /// A health check, run to its end even if no one waits for its reply any more.
    Check(oneshot::Sender<Result<(), QueryError>>),
    Send(String),
    Recycle,
    Abandon,
}

/// A borrowed connection, as a handle on the task that runs it.
pub(crate) struct SqlxConn {
    tx: mpsc::UnboundedSender<Cmd>,
    link: Arc<Link>,
}

impl SqlxConn {
    pub(crate) fn link(&self) -> &Arc<Link> {
        &self.link
    }

    pub(crate) async fn query(&self, sql: &str) -> Result<Results, QueryError> {
        let (reply, rx) = oneshot::channel();
        let gone = || QueryError::Lost {
            message: "the connection's task ended".into(),
        };
        self.tx
            .send(Cmd::Query(sql.to_string(), reply))
            .map_err(|_| gone())?;
        rx.await.unwrap_or_else(|_| Err(gone()))
    }

    /// An empty query, run to its end by the connection's task whether or not this
    /// future is still there to read the reply (cancel safe).
    pub(crate) async fn check(&self) -> Result<(), QueryError> {
        let (reply, rx) = oneshot::channel();
        let gone = || QueryError::Lost {
            message: "the connection's task ended".into(),
        };
        self.tx.send(Cmd::Check(reply)).map_err(|_| gone())?;
        rx.await.unwrap_or_else(|_| Err(gone()))
    }

    /// Hands `sql` to the connection's task, which sends it before anything handed to
    /// it later; false if the task is gone (the connection with it).
    pub(crate) fn send(&self, sql: &str) -> bool {
        self.tx.send(Cmd::Send(sql.to_string())).is_ok()
    }

    pub(crate) fn recycle(self) {
        self.link.set_watched(false);
        let _ = self.tx.send(Cmd::Recycle);
    }

    pub(crate) fn abandon(self) {
        self.link.set_watched(false);
        self.link.mark_lost(LossReason::ConnectionClosed {
            message: "closed by dblock after a request on it was cut off".into(),
        });
        let _ = self.tx.send(Cmd::Abandon);
    }
}

/// What a borrowed connection's task does next.
enum Next {
    /// Serves the next command or tick.
    Serve,
    /// Closes the connection for good (see [`close`]).
    Close,
    /// Returns it to the sqlx pool.
    Return,
}

/// Runs one borrowed connection until it is recycled or abandoned. A handle dropped
/// without either (a panic) counts as abandoned.
async fn run_connection(
    mut conn: PoolConnection<Postgres>,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    link: Arc<Link>,
    interval: Duration,
    timeout: Duration,
) {
    let _dropped = LostOnDrop(link.clone());
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.reset();
    loop {
        let next = tokio::select! {
            cmd = rx.recv() => serve(&mut conn, cmd, &link, timeout).await,
            _ = tick.tick() => match link.watched() {
                true => watch(&mut conn, &link, timeout).await,
                false => Next::Serve,
            },
        };
        match next {
            Next::Serve => {}
            Next::Close => return close(conn),
            // Dropping a PoolConnection returns it to the sqlx pool.
            Next::Return => return,
        }
    }
}

/// Carries out one command (`None`: every handle is gone).
async fn serve(
    conn: &mut PoolConnection<Postgres>,
    cmd: Option<Cmd>,
    link: &Link,
    timeout: Duration,
) -> Next {
    match cmd {
        Some(Cmd::Query(sql, mut reply)) => {
            let res = tokio::select! {
                r = run(conn, &sql) => r,
                // The request was cancelled mid-way: its state is unknown.
                () = reply.closed() => return Next::Close,
            };
            let lost = lost_reason(&res);
            let _ = reply.send(res);
            lost_then_close(link, lost)
        }
        Some(Cmd::Check(reply)) => {
            let res = check(conn, link, timeout).await;
            let lost = lost_reason(&res);
            let _ = reply.send(res);
            lost_then_close(link, lost)
        }
        Some(Cmd::Send(sql)) => match run(conn, &sql).await {
            Ok(_) => Next::Serve,
            // Statements sent that failed leave the session's state unknown.
            Err(e) => lost_then_close(
                link,
                Some(LossReason::ConnectionClosed {
                    message: e.into_message(),
                }),
            ),
        },
        Some(Cmd::Recycle) if link.loss().is_some() => Next::Close,
        Some(Cmd::Recycle) => Next::Return,
        Some(Cmd::Abandon) | None => Next::Close,
    }
}

/// A tick while the connection is watched: a check, any failure of which loses it.
async fn watch(conn: &mut PoolConnection<Postgres>, link: &Link, timeout: Duration) -> Next {
    match check(conn, link, timeout).await {
        Ok(()) => Next::Serve,
        Err(e) => lost_then_close(
            link,
            Some(LossReason::ConnectionClosed {
                message: e.into_message(),
            }),
        ),
    }
}

/// A health check: the link's check statement, answered within `timeout`, else the
/// link is marked lost (unresponsive).
async fn check(
    conn: &mut PoolConnection<Postgres>,
    link: &Link,
    timeout: Duration,
) -> Result<(), QueryError> {
    let since = Instant::now();
    match tokio::time::timeout(timeout, run(conn, &link.check_sql())).await {
        Ok(r) => r.map(|_| ()),
        Err(_) => {
            let reason = LossReason::Unresponsive {
                after: since.elapsed(),
            };
            link.mark_lost(reason.clone());
            Err(QueryError::Lost {
                message: reason.to_string(),
            })
        }
    }
}

/// Marks the link lost for `reason` (the first reason stays) and closes, if there is
/// one.
fn lost_then_close(link: &Link, reason: Option<LossReason>) -> Next {
    match reason {
        Some(reason) => {
            link.mark_lost(reason);
            Next::Close
        }
        None => Next::Serve,
    }
}

fn lost_reason<T>(res: &Result<T, QueryError>) -> Option<LossReason> {
    match res {
        Err(QueryError::Lost { message }) => Some(LossReason::ConnectionClosed {
            message: message.clone(),
        }),
        _ => None,
    }
}

/// Closes a connection for good: taken out of the pool and its socket dropped, which
/// ends the server session and everything it held.
fn close(conn: PoolConnection<Postgres>) {
    drop(conn.detach());
}

/// Runs a simple-protocol query; the first column of each statement's rows as text.
async fn run(conn: &mut PoolConnection<Postgres>, sql: &str) -> Result<Results, QueryError> {
    let mut out: Results = vec![Vec::new()];
    let mut stream = sqlx::raw_sql(AssertSqlSafe(sql.to_string())).fetch_many(&mut **conn);
    while let Some(item) = stream.try_next().await.map_err(from_sqlx)? {
        match item {
            Either::Left(_done) => out.push(Vec::new()),
            Either::Right(row) => {
                let v = row.try_get_raw(0).ok().and_then(|v| {
                    if sqlx::ValueRef::is_null(&v) {
                        None
                    } else {
                        v.as_str().ok().map(str::to_string)
                    }
                });
                if let Some(last) = out.last_mut() {
                    last.push(v);
                }
            }
        }
    }
    out.pop();
    Ok(out)
}

fn from_sqlx(e: sqlx::Error) -> QueryError {
    match e {
        sqlx::Error::Database(db) => match db.code() {
            // The server ended the session: a FATAL error (an idle timeout, say), or an
            // admin or crash shutdown.
            _ if db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some_and(|e| {
                    matches!(
                        e.severity(),
                        sqlx::postgres::PgSeverity::Fatal | sqlx::postgres::PgSeverity::Panic
                    )
                }) =>
            {
                QueryError::Lost {
                    message: db.message().to_string(),
                }
            }
            Some(code) if code.starts_with("57P") => QueryError::Lost {
                message: db.message().to_string(),
            },
            Some(code) => QueryError::Db {
                code: code.to_string(),
                message: db.message().to_string(),
            },
            None => QueryError::Lost {
                message: db.message().to_string(),
            },
        },
        other => QueryError::Lost {
            message: other.to_string(),
        },
    }
}
