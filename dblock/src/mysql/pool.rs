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
//! sends it at the head of its own message ([`LockConn::carried`]); if none has taken it
//! by the time the pool's flusher runs (one task for the pool's life, woken by the drop),
//! the flusher takes the connection back and sends the release alone
//! ([`OwnPool::flush_owing`]). A connection carrying a release never leaves this pool by
//! any other way than those two, or being closed (which frees its locks on the server).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::mysql::MySqlConnectOptions;
use sqlx::pool::PoolConnection;
use sqlx::{ConnectOptions, Connection, MySql, MySqlConnection, MySqlPool};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
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
    /// How long the flusher waits for a release's answer before closing the connection.
    release_timeout: Duration,
    /// Wakes the flusher: a connection went back to the pool owing a release.
    flusher: Arc<Notify>,
    /// Whether the flusher task is running (it clears this when it ends, so that one on
    /// another runtime starts at the next wake).
    flusher_running: Arc<AtomicBool>,
}

impl Drop for OwnPool {
    fn drop(&mut self) {
        // The flusher holds the pool weakly: woken, it finds it gone and ends.
        self.flusher.notify_one();
    }
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
        release_timeout: Duration,
    ) -> Arc<OwnPool> {
        Arc::new(OwnPool {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(max.max(1))),
            acquire_timeout,
            release_timeout,
            flusher: Arc::new(Notify::new()),
            flusher_running: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Has the flusher send the releases idle connections owe, unless a request takes
    /// them first; starts the flusher on the current runtime if none runs. (Outside a
    /// runtime with no flusher running, the release waits for the next request on the
    /// connection, or for the connection to close.)
    fn wake_flusher(self: &Arc<Self>) {
        if !self.flusher_running.swap(true, Ordering::AcqRel) {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    let running = Running(self.flusher_running.clone());
                    rt.spawn(flusher(Arc::downgrade(self), self.flusher.clone(), running));
                }
                Err(_) => self.flusher_running.store(false, Ordering::Release),
            }
        }
        self.flusher.notify_one();
    }

    /// Whether an idle connection owes a release.
    fn owes(&self) -> bool {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.iter().any(|c| c.release.is_some())
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

    /// Takes every idle connection still carrying a release out of the pool, sends each
    /// its release alone and puts it back; one the server does not confirm within the
    /// release timeout is closed instead (which frees its locks too).
    pub(crate) async fn flush_owing(&self) {
        let owing: Vec<Idle> = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let (owing, rest) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|c| c.release.is_some());
            *idle = rest;
            owing
        };
        for c in owing {
            let Idle {
                mut conn,
                id,
                release: Some(name),
                ..
            } = c
            else {
                continue;
            };
            let sent =
                tokio::time::timeout(self.release_timeout, release_lock(&mut conn, &name)).await;
            if let Ok(Ok(1)) = sent {
                self.park(conn, id, None);
            }
            // Otherwise dropped: its socket closes and the server frees what it held.
        }
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

/// Clears the pool's "flusher running" flag when the flusher ends (its pool gone, or
/// its runtime shutting down).
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The pool's flusher: woken when a connection goes back owing a release, it lets a
/// request that is about to take the connection carry the release (one yield), then
/// sends what is still owed. Ends when the pool is gone.
async fn flusher(pool: Weak<OwnPool>, wake: Arc<Notify>, _running: Running) {
    loop {
        wake.notified().await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        // Woken from a worker thread, this runs once the dropping task yields: usually
        // after its next request took the connection, and carried the release.
        if !pool.owes() {
            continue;
        }
        tokio::task::yield_now().await;
        pool.flush_owing().await;
    }
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
            let owes = release.is_some();
            o.pool.park(conn, o.id, release);
            // A release not sent yet (none is, today): have the flusher send it.
            if owes {
                o.pool.wake_flusher();
            }
        }
        // A borrowed connection goes back to the caller's pool when dropped.
    }

    /// Back to its pool still holding the lock `name`, owing its release: the next
    /// request on it carries the release, or the pool's flusher sends it
    /// ([`OwnPool::flush_owing`]). Only dblock's own connections can; a borrowed one is
    /// handed back unchanged.
    pub(crate) fn park_releasing(mut self, name: String) -> Result<(), LockConn> {
        match &mut self {
            LockConn::Own(o) if o.release.is_none() => match o.conn.take() {
                Some(conn) => {
                    o.pool.park(conn, o.id, Some(name));
                    o.pool.wake_flusher();
                    Ok(())
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
