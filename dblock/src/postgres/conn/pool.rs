//! The small LIFO pool of dblock's own connections, and how one is opened.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::driver::drive;
use super::native::{Idle, NativeConn};
use super::outbox::Outbox;
use super::pooler::{Known, Pooler};
use super::tls::Connector;
use super::wire::Link;
use crate::engine::Engine;
use crate::error::{Error, WaitingFor};

/// The pool's settings and idle connections.
pub(crate) struct PoolShared {
    config: tokio_postgres::Config,
    shown: String,
    tls: Connector,
    idle: Arc<Idle>,
    permits: Arc<Semaphore>,
    /// The most connections open at once (the builder's `max_connections`).
    max: usize,
    acquire_timeout: Duration,
    check_interval: Duration,
    check_timeout: Duration,
    /// What lies between dblock and the server: declared, or found on the first
    /// connection (see [`super::pooler`]).
    route: std::sync::OnceLock<(Pooler, Known)>,
    /// The engine the first connection's start-up parameters named, if they did.
    engine: std::sync::OnceLock<Option<Engine>>,
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
        declared: (Pooler, Known),
    ) -> Pool {
        super::health::apply(&mut config);
        let route = std::sync::OnceLock::new();
        if declared.0 != Pooler::Detect {
            let _ = route.set(declared);
        }
        Pool {
            shared: Arc::new(PoolShared {
                config,
                shown,
                tls,
                idle: Arc::new(Mutex::new(Vec::new())),
                permits: Arc::new(Semaphore::new(max)),
                max,
                acquire_timeout,
                check_interval,
                check_timeout,
                route,
                engine: std::sync::OnceLock::new(),
            }),
        }
    }

    /// What lies between dblock and the server, once known (after the first connection
    /// unless declared).
    pub(crate) fn route(&self) -> Option<(Pooler, Known)> {
        self.shared.route.get().copied()
    }

    /// The engine the start-up parameters named (after the first connection), if they
    /// did.
    pub(crate) fn engine(&self) -> Option<Engine> {
        self.shared.engine.get().cloned().flatten()
    }

    /// The most connections the pool opens at once.
    pub(crate) fn max(&self) -> usize {
        self.shared.max
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
                return Err(closed());
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
                    Ok(Err(_)) => return Err(closed()),
                    Err(_) => {
                        return Err(Error::Timeout {
                            waiting_for: WaitingFor::PoolConnection,
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
                        // (Boxed, as it seldom runs: inline it would add to every
                        // lock request's future.)
                        && !Box::pin(c.alive(self.shared.check_timeout)).await
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
        // Boxed: connecting (TLS, start-up, detection) is a future of some 3 KB, which
        // inline would be part of every lock request's, though a connection is opened
        // once.
        let mut conn = Box::pin(self.connect()).await?;
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
        self.shared
            .engine
            .get_or_init(|| Engine::from_parameters(|p| connection.parameter(p).map(Into::into)));
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
            pool: Arc::downgrade(&self.shared.idle),
            tls: self.shared.tls.clone(),
            session_slice: false,
        })
    }
}

/// Whether a pooler stands between dblock and the server: the process id the
/// connection was given (the cancel key) is then the pooler's, not `pg_backend_pid()`.
/// A detected pooler is taken to pool transactions (see [`super::pooler`]).
async fn detect(client: &tokio_postgres::Client) -> (Pooler, Known) {
    use tokio_postgres::SimpleQueryMessage;
    let announced = super::pooler::announced_pid(client.cancel_token()).await;
    let server = match client
        .simple_query("SELECT pg_catalog.pg_backend_pid()")
        .await
    {
        Ok(msgs) => msgs.iter().find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse::<i32>().ok()),
            _ => None,
        }),
        Err(_) => None,
    };
    match (announced, server) {
        (Some(a), Some(s)) if a != s => (Pooler::Transaction, Known::CancelKey),
        _ => (Pooler::None, Known::CancelKey),
    }
}

/// The pool's semaphore closed: no connection will come (never closed today; a kind of
/// connection failure should it ever be).
fn closed() -> Error {
    Error::ConnectionLost {
        message: "dblock's connection pool is closed".into(),
    }
}
