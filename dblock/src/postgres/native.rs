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

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Poll;
use std::time::Duration;

use futures_util::task::AtomicWaker;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, SimpleQueryMessage, SimpleQueryStream};

use super::conn::{Link, LockSql, QueryError, Release, Results};
use super::pooler::{Known, Pooler};
use super::tls::Connector;
use crate::{Error, LossReason};

/// The pool's settings and idle connections.
pub(crate) struct PoolShared {
    config: tokio_postgres::Config,
    shown: String,
    tls: Connector,
    idle: Mutex<Vec<NativeConn>>,
    permits: Arc<Semaphore>,
    acquire_timeout: Duration,
    check_interval: Duration,
    check_timeout: Duration,
    /// What lies between dblock and the server: declared, or found on the first
    /// connection (see [`super::pooler`]).
    route: std::sync::OnceLock<(Pooler, Known)>,
}

/// A small LIFO pool of dblock's own connections.
#[derive(Clone)]
pub(crate) struct Pool {
    shared: Arc<PoolShared>,
}

impl Pool {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        mut config: tokio_postgres::Config,
        shown: String,
        tls: Connector,
        max: usize,
        acquire_timeout: Duration,
        check_interval: Duration,
        check_timeout: Duration,
        declared: Pooler,
    ) -> Pool {
        super::health::apply(&mut config);
        let route = std::sync::OnceLock::new();
        if declared != Pooler::Detect {
            let _ = route.set((declared, Known::Declared));
        }
        Pool {
            shared: Arc::new(PoolShared {
                config,
                shown,
                tls,
                idle: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(max)),
                acquire_timeout,
                check_interval,
                check_timeout,
                route,
            }),
        }
    }

    /// What lies between dblock and the server, once known (after the first connection
    /// unless declared).
    pub(crate) fn route(&self) -> Option<(Pooler, Known)> {
        self.shared.route.get().copied()
    }

    pub(crate) fn config(&self) -> &tokio_postgres::Config {
        &self.shared.config
    }

    /// How the pool's connections are opened (TLS).
    pub(crate) fn tls(&self) -> &Connector {
        &self.shared.tls
    }

    /// A connection: an idle one if there is one, else a new one. Waits at most the
    /// acquire timeout for one to come free when all are in use.
    ///
    /// Cancel safe: a connection being opened when the future is dropped is closed.
    /// With a `deadline` (a lock request's), waits for one to come free no later than
    /// that either.
    pub(crate) async fn get_until(
        &self,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<NativeConn, Error> {
        let sem = self.shared.permits.clone();
        // A free permit is taken without awaiting: an await could yield for tokio's
        // cooperative budget.
        let permit = match sem.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(tokio::sync::TryAcquireError::Closed) => {
                return Err(Error::Unsupported("the pool is closed".into()));
            }
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                let wait = match deadline {
                    Some(d) => self
                        .shared
                        .acquire_timeout
                        .min(d.saturating_duration_since(tokio::time::Instant::now())),
                    None => self.shared.acquire_timeout,
                };
                match tokio::time::timeout(wait, sem.acquire_owned()).await {
                    Ok(Ok(p)) => p,
                    Ok(Err(_)) => return Err(Error::Unsupported("the pool is closed".into())),
                    Err(_) => {
                        return Err(Error::Timeout {
                            waiting_for: "a free connection in dblock's pool (raise max_connections)",
                            after: Some(wait),
                        });
                    }
                }
            }
        };
        loop {
            let idle = {
                let mut idle = self.shared.idle.lock().unwrap_or_else(|p| p.into_inner());
                idle.pop()
            };
            match idle {
                Some(mut c) if c.usable() => {
                    // Idle a while: checked before it carries a request, so a peer that
                    // went away silently costs a check, not a request lost in the void.
                    // A connection used more recently goes out as it is (no round trip
                    // on the hot path).
                    if c.idle_since.elapsed() >= self.shared.check_interval
                        && !c.alive(self.shared.check_timeout).await
                    {
                        c.abandon();
                        continue;
                    }
                    c.permit = Some(permit);
                    return Ok(c);
                }
                Some(_) => continue,
                None => break,
            }
        }
        let mut conn = self.connect().await?;
        conn.permit = Some(permit);
        Ok(conn)
    }

    /// Closes the idle connections.
    pub(crate) fn close_idle(&self) {
        self.shared
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// A new connection outside the pool's count, for a multiplexing handle's shared
    /// connections (which are never returned to the pool).
    pub(crate) async fn connect_unpooled(&self) -> Result<NativeConn, Error> {
        self.connect().await
    }

    async fn connect(&self) -> Result<NativeConn, Error> {
        let shared = &self.shared;
        let (client, connection) =
            shared
                .tls
                .connect(&shared.config)
                .await
                .map_err(|e| Error::Connect {
                    target: shared.shown.clone(),
                    message: super::tls::describe(&e),
                })?;
        // PostgreSQL 14+ can notice, while a lock request waits, that the client closed
        // its socket: a cut-off wait then ends on the server even if the cancel request
        // raced ahead of the request and was ignored.
        let major: u32 = connection
            .parameter("server_version")
            .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let client = Arc::new(client);
        let link = Link::new();
        let outbox = Arc::new(Outbox::default());
        tokio::spawn(drive(
            connection,
            Arc::downgrade(&client),
            link.clone(),
            outbox.clone(),
            self.shared.check_interval,
            self.shared.check_timeout,
        ));
        let route = match self.shared.route.get() {
            Some((r, _)) => *r,
            None => {
                let r = detect(&client).await;
                let _ = self.shared.route.set(r);
                r.0
            }
        };
        // A session-level SET would stay on a pooler's server connection for its next
        // client: behind a pooler, requests set it for their own transaction instead.
        if major >= 14 && route == Pooler::None {
            // Best effort: a server that refuses it still works, with cancel requests only.
            let _ = client
                .batch_execute("SET client_connection_check_interval = 250")
                .await;
        }
        Ok(NativeConn {
            idle_since: std::time::Instant::now(),
            client,
            link,
            outbox,
            permit: None,
            pool: Arc::downgrade(&self.shared),
            tls: self.shared.tls.clone(),
        })
    }
}

/// Whether a pooler stands between dblock and the server: the process id the
/// connection was given (the cancel key) is then the pooler's, not `pg_backend_pid()`.
/// A detected pooler is taken to pool transactions (see [`super::pooler`]).
async fn detect(client: &Client) -> (Pooler, Known) {
    let announced = super::pooler::announced_pid(client.cancel_token()).await;
    let server = match client.simple_query("SELECT pg_backend_pid()").await {
        Ok(msgs) => msgs.iter().find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse::<i32>().ok()),
            _ => None,
        }),
        Err(_) => None,
    };
    match (announced, server) {
        (Some(a), Some(s)) if a != s => (Pooler::Transaction, Known::CancelKey),
        _ => (Pooler::None, Known::Declared),
    }
}

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
struct Outbox {
    /// The release waiting to be sent. Whoever takes it queues it (alone, or ahead of
    /// its own request) while holding the mutex, so nothing issued later on the
    /// connection can overtake it.
    waiting: Mutex<Option<Release>>,
    /// Set to have the connection's task drop the socket at once, without waiting for
    /// replies still outstanding (a blocked lock request's, say).
    closing: AtomicBool,
    /// The connection's task, woken when there is something to send or to close.
    task: AtomicWaker,
}

impl Outbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Release>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a waiting release on its own. Returns false if it could not be.
    fn flush(&self, client: &Client) -> bool {
        let mut waiting = self.lock();
        match waiting.take() {
            None => true,
            Some(r) => queue(client, r.sql()),
        }
    }

    /// [`Outbox::flush`] from the connection's task, which holds the client weakly.
    /// Returns false if a release waits and cannot be queued (the client is gone: the
    /// session ends with the connection, which releases everything it held).
    fn flush_with(&self, client: impl FnOnce() -> Option<Arc<Client>>) -> bool {
        let mut waiting = self.lock();
        match waiting.take() {
            None => true,
            Some(r) => client().is_some_and(|c| queue(&c, r.sql())),
        }
    }

    /// Has the connection's task drop the socket at once.
    fn close_now(&self) {
        self.closing.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// Queues `sql` on the connection without waiting for its reply. Returns false if it
/// was not queued: the connection is gone (or, should the driver ever need more than
/// one poll to queue a request, which it does not, the caller must give it up).
fn queue(client: &Client, sql: &str) -> bool {
    // `simple_query_raw` encodes and queues the request on its first poll, before any
    // await; the reply is dropped unread (the connection task discards it).
    matches!(client.simple_query_raw(sql).now_or_never(), Some(Ok(_)))
}

/// Queues a simple query on the connection; its reply comes through the stream.
fn send(client: &Client, sql: &str) -> Result<SimpleQueryStream, QueryError> {
    // Queued in the first poll (see `queue`); a driver that ever needed more would make
    // this fail loudly rather than send out of order.
    match client.simple_query_raw(sql).now_or_never() {
        Some(Ok(stream)) => Ok(stream),
        Some(Err(e)) => Err(QueryError::from_driver(e)),
        None => Err(QueryError::Lost {
            message: "the driver did not queue the request at once".into(),
        }),
    }
}

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

/// Runs a connection: its I/O, and while a lock is held on it, a health check every
/// interval. Marks the link lost when the connection ends or a check goes unanswered
/// for `timeout`; returning drops the socket, which ends the server session.
///
/// One hand-written poll rather than a `select!` loop: it runs twice per lock cycle (to
/// write the request, to read the reply), so it does no more than it must each time —
/// no future is built or registered anew, and the timers are polled only while they
/// can matter.
async fn drive(
    connection: tokio_postgres::Connection<tokio_postgres::Socket, super::tls::Stream>,
    client: Weak<Client>,
    link: Arc<Link>,
    outbox: Arc<Outbox>,
    interval: Duration,
    timeout: Duration,
) {
    let _dropped = super::conn::LostOnDrop(link.clone());
    type Ping = Pin<Box<dyn Future<Output = Result<(), QueryError>> + Send>>;
    let mut connection = std::pin::pin!(connection);
    // A check in flight, and when it fails if still unanswered.
    let mut ping: Option<(Ping, Pin<Box<tokio::time::Sleep>>)> = None;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let lost = std::future::poll_fn(|cx| {
        outbox.task.register(cx.waker());
        if outbox.closing.load(Ordering::Acquire) {
            return Poll::Ready(LossReason::ConnectionClosed {
                message: "closed by dblock".into(),
            });
        }
        // A ROLLBACK handed over since the last poll goes out before anything else.
        if !outbox.flush_with(|| client.upgrade()) {
            return Poll::Ready(LossReason::ConnectionClosed {
                message: "the connection closed".into(),
            });
        }
        if let Poll::Ready(end) = connection.as_mut().poll(cx) {
            let message = match end {
                Ok(()) => "closed by dblock".to_string(),
                Err(e) => match QueryError::from_driver(e) {
                    QueryError::Db { message, .. } | QueryError::Lost { message } => message,
                },
            };
            return Poll::Ready(LossReason::ConnectionClosed { message });
        }
        loop {
            if let Some((p, overdue)) = &mut ping {
                match p.as_mut().poll(cx) {
                    Poll::Ready(res) => {
                        ping = None;
                        if let Err(QueryError::Lost { message }) = res {
                            link.mark_lost(LossReason::ConnectionClosed { message });
                        }
                    }
                    // Failed the moment its deadline passes, not at the next tick.
                    Poll::Pending => {
                        if overdue.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(LossReason::Unresponsive { after: timeout });
                        }
                    }
                }
            }
            if tick.poll_tick(cx).is_pending() {
                return Poll::Pending;
            }
            // A tick: check the connection if a lock is held on it and no check is out.
            if !link.holding() || ping.is_some() {
                continue;
            }
            if let Some(c) = client.upgrade() {
                let p: Ping = Box::pin(async move {
                    c.simple_query("")
                        .await
                        .map(|_| ())
                        .map_err(QueryError::from_driver)
                });
                let overdue = Box::pin(tokio::time::sleep(timeout));
                ping = Some((p, overdue));
            }
        }
    })
    .await;
    link.mark_lost(lost);
}

/// One of dblock's connections, checked out of the pool.
pub(crate) struct NativeConn {
    /// When it was last returned to the pool.
    idle_since: std::time::Instant,
    client: Arc<Client>,
    link: Arc<Link>,
    outbox: Arc<Outbox>,
    permit: Option<OwnedSemaphorePermit>,
    pool: Weak<PoolShared>,
    /// For the cancel request of [`NativeConn::abandon`], over the session's kind of
    /// connection.
    tls: Connector,
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
    async fn alive(&self, timeout: Duration) -> bool {
        matches!(
            tokio::time::timeout(timeout, self.query("")).await,
            Ok(Ok(_))
        )
    }

    /// Sends a simple query (one or more statements) and waits for every result.
    ///
    /// Not cancel safe by itself: callers arm an abandon before awaiting it.
    pub(crate) async fn query(&self, sql: &str) -> Result<Results, QueryError> {
        if !self.outbox.flush(&self.client) {
            return Err(QueryError::Lost {
                message: "the connection closed".into(),
            });
        }
        let mut out: Results = Vec::new();
        let statements = read(send(&self.client, sql)?, |i, value| {
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
            // Queued before the mutex is released, like the task's own flush.
            match waiting.take() {
                None => (send(&self.client, sql.alone())?, 0),
                Some(release) => {
                    let (text, carried) = release.carried_by(sql);
                    (send(&self.client, &text)?, carried)
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
    pub(crate) fn release_soon(&self, release: Release) -> bool {
        if self.client.is_closed() {
            return false;
        }
        {
            let mut waiting = self.outbox.lock();
            // One holder at a time, so never two; were there, the first goes first.
            if let Some(earlier) = waiting.take()
                && !queue(&self.client, earlier.sql())
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
    pub(crate) fn fire(&self, sql: &str) -> bool {
        if !self.outbox.flush(&self.client) {
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
        if !self.usable() {
            return;
        }
        self.idle_since = std::time::Instant::now();
        if let Some(pool) = self.pool.upgrade() {
            let mut idle = pool.idle.lock().unwrap_or_else(|p| p.into_inner());
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
