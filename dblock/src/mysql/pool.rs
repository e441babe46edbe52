//! The connections locks are taken on: dblock's own (a small LIFO pool whose connections
//! know their server connection id, read once when connected) or the caller's sqlx pool
//! (whose connections do not, so the id is asked for with the first attempt).
//!
//! Knowing the id up front is what lets a contended acquisition be one statement
//! (`GET_LOCK(name, S)` straight away): a wait can be ended with `KILL` from another
//! connection without having asked the waiting connection anything first.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::mysql::MySqlConnectOptions;
use sqlx::pool::PoolConnection;
use sqlx::{ConnectOptions, Connection, MySql, MySqlConnection, MySqlPool};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::map_sqlx;
use crate::error::{Error, WaitingFor};

/// An idle connection older than this is closed rather than reused: the server may have
/// dropped it (`wait_timeout`), and a lock request should not be the one to find out.
const MAX_IDLE: Duration = Duration::from_secs(300);

/// dblock's own lock connections.
pub(crate) struct OwnPool {
    options: MySqlConnectOptions,
    idle: Mutex<Vec<Idle>>,
    permits: Arc<Semaphore>,
    acquire_timeout: Duration,
}

struct Idle {
    conn: MySqlConnection,
    id: u64,
    since: Instant,
}

impl OwnPool {
    pub(crate) fn new(
        options: MySqlConnectOptions,
        max: usize,
        acquire_timeout: Duration,
    ) -> Arc<OwnPool> {
        Arc::new(OwnPool {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(max.max(1))),
            acquire_timeout,
        })
    }

    /// A connection: the most recently used idle one, or a new one; waits (up to the
    /// acquire timeout) while `max_connections` are in use.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Result<LockConn, Error> {
        let deadline = Instant::now() + self.acquire_timeout;
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => tokio::time::timeout_at(deadline, self.permits.clone().acquire_owned())
                .await
                .map_err(|_| Error::Timeout {
                    waiting_for: WaitingFor::PoolConnection,
                    after: Some(self.acquire_timeout),
                })?
                .map_err(|_| Error::ConnectionLost {
                    message: "the connection pool was closed".into(),
                })?,
        };
        let reused = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let mut found = None;
            while let Some(c) = idle.pop() {
                if c.since.elapsed() < MAX_IDLE {
                    found = Some(c);
                    break;
                }
                drop(c); // stale: closed by dropping its socket
            }
            found
        };
        let (conn, id) = match reused {
            Some(c) => (c.conn, c.id),
            None => tokio::time::timeout_at(deadline, self.connect())
                .await
                .map_err(|_| Error::Timeout {
                    waiting_for: WaitingFor::ServerReply,
                    after: Some(self.acquire_timeout),
                })??,
        };
        Ok(LockConn::Own(Own {
            conn: Some(conn),
            id,
            pool: self.clone(),
            _permit: permit,
        }))
    }

    async fn connect(&self) -> Result<(MySqlConnection, u64), Error> {
        let mut conn = self.options.connect().await.map_err(|e| Error::Connect {
            target: "MySQL/MariaDB".into(),
            message: e.to_string(),
        })?;
        let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
            .fetch_one(&mut conn)
            .await
            .map_err(map_sqlx)?;
        Ok((conn, id as u64))
    }
}

/// One of dblock's own connections, out of its pool.
pub(crate) struct Own {
    conn: Option<MySqlConnection>,
    id: u64,
    pool: Arc<OwnPool>,
    _permit: OwnedSemaphorePermit,
}

/// The connection a lock is taken and held on.
pub(crate) enum LockConn {
    Own(Own),
    Borrowed(PoolConnection<MySql>),
}

impl LockConn {
    /// Borrows a connection of the caller's pool.
    pub(crate) async fn borrow(pool: &MySqlPool) -> Result<LockConn, Error> {
        pool.acquire()
            .await
            .map(LockConn::Borrowed)
            .map_err(map_sqlx)
    }

    /// The server's id of this session, where known without asking.
    pub(crate) fn id(&self) -> Option<u64> {
        match self {
            LockConn::Own(o) => Some(o.id),
            LockConn::Borrowed(_) => None,
        }
    }

    /// The connection to send statements on.
    pub(crate) fn raw(&mut self) -> Option<&mut MySqlConnection> {
        match self {
            LockConn::Own(o) => o.conn.as_mut(),
            LockConn::Borrowed(c) => Some(&mut **c),
        }
    }

    /// Back to its pool: only when it holds nothing and no statement is in flight.
    pub(crate) fn recycle(mut self) {
        if let LockConn::Own(o) = &mut self
            && let Some(conn) = o.conn.take()
        {
            let mut idle = o.pool.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.push(Idle {
                conn,
                id: o.id,
                since: Instant::now(),
            });
        }
        // A borrowed connection goes back to the caller's pool when dropped.
    }

    /// Closes it (the server then frees whatever the session held); it never goes back
    /// to a pool.
    pub(crate) async fn close(self) {
        match self {
            LockConn::Own(mut o) => {
                if let Some(conn) = o.conn.take() {
                    let _ = conn.close().await;
                }
            }
            LockConn::Borrowed(c) => {
                let _ = c.close().await;
            }
        }
    }

    /// Makes sure dropping it closes it rather than returning it to a pool.
    pub(crate) fn close_on_drop(&mut self) {
        match self {
            // Own connections go back only through `recycle`.
            LockConn::Own(_) => {}
            LockConn::Borrowed(c) => c.close_on_drop(),
        }
    }
}
