//! The connections locks are taken on: dblock's own (a small LIFO pool whose connections
//! know their server connection id, read once when connected) or the caller's sqlx pool
//! (whose connections do not, so the id is asked for with the first attempt).
//!
//! Knowing the id up front is what lets a contended acquisition be one statement
//! (`GET_LOCK(name, S)` straight away): a wait can be ended with `KILL` from another
//! connection without having asked the waiting connection anything first.
//!
//! An idle connection of dblock's own may carry a release: a dropped guard's
//! `RELEASE_LOCK` not yet sent (see `lock.rs`). The next request to take the connection
//! sends it at the head of its own message ([`LockConn::carried`]); if none does by the
//! time the guard's task runs, the task takes the connection back and sends it alone
//! ([`OwnPool::flush`]). A connection carrying a release never leaves this pool by any
//! other way than those two, or being closed (which frees its locks on the server).

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
    /// The lock name whose `RELEASE_LOCK` this connection still owes.
    release: Option<String>,
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
        let (conn, id, release) = match reused {
            Some(c) => (c.conn, c.id, c.release),
            // Boxed: connecting is a future of some 17 KB, which inline would make
            // every lock request's future that large, though it connects seldom.
            None => tokio::time::timeout_at(deadline, Box::pin(self.connect()))
                .await
                .map_err(|_| Error::Timeout {
                    waiting_for: WaitingFor::ServerReply,
                    after: Some(self.acquire_timeout),
                })?
                .map(|(conn, id)| (conn, id, None))?,
        };
        Ok(LockConn::Own(Own {
            conn: Some(conn),
            id,
            pool: self.clone(),
            _permit: permit,
            release,
        }))
    }

    fn park(&self, conn: MySqlConnection, id: u64, release: Option<String>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.push(Idle {
            conn,
            id,
            since: Instant::now(),
            release,
        });
    }

    /// If the idle connection `id` still carries a release, takes it out of the pool,
    /// sends the release alone and puts it back; if the server does not confirm within
    /// `timeout`, the connection is closed instead (which frees its locks too).
    pub(crate) async fn flush(&self, id: u64, timeout: Duration) {
        let found = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.iter()
                .position(|c| c.id == id && c.release.is_some())
                .map(|i| idle.remove(i))
        };
        let Some(Idle {
            mut conn,
            release: Some(name),
            ..
        }) = found
        else {
            return;
        };
        let sent = tokio::time::timeout(timeout, release_lock(&mut conn, &name)).await;
        if let Ok(Ok(1)) = sent {
            self.park(conn, id, None);
        }
        // Otherwise dropped: its socket closes and the server frees what it held.
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
    /// A release this connection still owes (it came out of the pool carrying it).
    release: Option<String>,
}

/// `RELEASE_LOCK(name)`'s answer (1 when this session held it).
async fn release_lock(conn: &mut MySqlConnection, name: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar::<_, Option<i64>>("SELECT CAST(RELEASE_LOCK(?) AS SIGNED)")
        .bind(name)
        .fetch_one(conn)
        .await
        .map(|r| r.unwrap_or(0))
}

/// Where a connection carrying a release was parked: what [`OwnPool::flush`] needs.
pub(crate) struct Parked {
    pub(crate) pool: Arc<OwnPool>,
    pub(crate) id: u64,
}

/// The connection a lock is taken and held on.
pub(crate) enum LockConn {
    Own(Own),
    Borrowed(PoolConnection<MySql>),
}

impl LockConn {
    /// Borrows a connection of the caller's pool.
    pub(crate) async fn borrow(pool: &MySqlPool) -> Result<LockConn, Error> {
        // Boxed, as sqlx's acquisition (which may connect) is a large future.
        Box::pin(pool.acquire())
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

    /// The release this connection owes, to be sent at the head of the next statement
    /// on it. Whoever takes it must send it, or close the connection.
    pub(crate) fn carried(&mut self) -> Option<String> {
        match self {
            LockConn::Own(o) => o.release.take(),
            LockConn::Borrowed(_) => None,
        }
    }

    /// Back to its pool: only when it holds nothing and no statement is in flight.
    pub(crate) fn recycle(mut self) {
        if let LockConn::Own(o) = &mut self
            && let Some(conn) = o.conn.take()
        {
            let release = o.release.take();
            let flush = release.is_some().then(|| (o.pool.clone(), o.id));
            o.pool.park(conn, o.id, release);
            // A release not sent yet (none is, today): send it now.
            if let (Some((pool, id)), Ok(rt)) = (flush, tokio::runtime::Handle::try_current()) {
                rt.spawn(async move { pool.flush(id, Duration::from_secs(10)).await });
            }
        }
        // A borrowed connection goes back to the caller's pool when dropped.
    }

    /// Back to its pool still holding the lock `name`, owing its release: the next
    /// request on it carries the release, or [`OwnPool::flush`] sends it. Only dblock's
    /// own connections can; a borrowed one is handed back unchanged.
    pub(crate) fn park_releasing(mut self, name: String) -> Result<Parked, LockConn> {
        match &mut self {
            LockConn::Own(o) if o.release.is_none() => match o.conn.take() {
                Some(conn) => {
                    o.pool.park(conn, o.id, Some(name));
                    Ok(Parked {
                        pool: o.pool.clone(),
                        id: o.id,
                    })
                }
                None => Err(self),
            },
            _ => Err(self),
        }
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
