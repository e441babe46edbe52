//! The PostgreSQL backend: where its connections come from, what it learns when it
//! opens, and one acquisition — plan, send, read, grant or clean up.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::conn::borrowed::SqlxSource;
use super::conn::pool::Pool;
use super::conn::pooler::{Known, Pooler};
use super::conn::tls::Connector;
use super::conn::wire::QueryError;
use super::conn::{Armed, Conn};
use super::lock::held::Pinned;
use super::lock::mux;
use super::lock::plan::{Any, Plan};
use super::settings::PgSettings;
use super::sql::first_value;
use crate::error::{Error, WaitingFor};
use crate::key::{DEFAULT_NAMESPACE, Key, NAMESPACE_SETTING};
use crate::raw::{
    BenchFloor, BoxFuture, Grant, Options, RawLocks, Req, Scope, Wait, acquire_any_in_turn,
    any_start,
};

/// Where a backend's connections come from.
pub(super) enum Source {
    /// dblock's own pool (tokio-postgres), from a URL.
    Native(Pool),
    /// The caller's sqlx pool.
    Sqlx(SqlxSource),
}

impl Source {
    /// A connection. Waiting for one (all in use) is bounded by the pool's acquire
    /// timeout.
    pub(super) async fn get(&self) -> Result<Conn, Error> {
        self.get_until(None).await
    }

    /// A connection for a lock request: on dblock's own pool the wait for one to come
    /// free ends at the request's deadline too (an sqlx pool keeps its own bound).
    pub(super) async fn get_until(&self, deadline: Option<Instant>) -> Result<Conn, Error> {
        match self {
            Source::Native(p) => p.get_until(deadline).await.map(Conn::Native),
            Source::Sqlx(p) => p.get().await.map(Conn::Sqlx),
        }
    }
}

/// The backend of a handle built from a `postgres://` URL.
pub(crate) struct PgBackend {
    pub(super) source: Source,
    /// Shared connections for session locks, when the handle multiplexes.
    mux: Option<mux::Mux>,
    /// Whether lock requests set `client_connection_check_interval` (sqlx connections
    /// on PostgreSQL 14+: the only way to end a cut-off wait without a cancel request).
    pub(super) check_disconnect: bool,
    /// `server_version_num`.
    pub(super) version: u32,
    /// How often held connections are checked (a lease must be longer).
    check_interval: Duration,
    /// How long a check may go unanswered (and a release, before it is given up).
    pub(super) check_timeout: Duration,
    /// The schema `current_schema()` named when the handle was built (where dblock's
    /// own tables go).
    pub(crate) schema: Option<String>,
    /// Set once the fencing table is known to exist: its qualified name.
    pub(super) fence_ready: tokio::sync::OnceCell<Arc<str>>,
    /// Set once the record of runs is known to exist: its qualified name.
    pub(super) runs_ready: tokio::sync::OnceCell<Arc<str>>,
    /// Whether fencing tokens carry the server's timeline ([`EPOCH_SQL`]): cleared
    /// when the fencing table is first used on a server without it.
    ///
    /// [`EPOCH_SQL`]: super::store::token::EPOCH_SQL
    pub(super) fence_epoch: std::sync::atomic::AtomicBool,
    /// The sessions' own `lock_timeout` (an administrator's, for the role or database),
    /// read when the handle was built: it still ends a wait without a deadline, which
    /// dblock runs in slices of its own `lock_timeout` (see [`WAIT_SLICE_MS`](super::lock::plan::WAIT_SLICE_MS)).
    pub(super) server_lock_timeout: Option<Duration>,
    /// What lies between dblock and the server ([`Pooler::Detect`] resolved), and how
    /// that is known.
    pub(crate) pooler: (Pooler, Known),
    /// `inet_server_port()` as the first connection saw it (`None` on a Unix socket).
    server_port: Option<u16>,
    /// The role the handle connects as (`current_user`), for the setup command that
    /// permission errors name.
    pub(crate) role: String,
}

impl PgBackend {
    /// Connects once (so a bad URL or an unreachable server fails here, not at the first
    /// lock) and reads the schema in use and the default namespace
    /// ([`NAMESPACE_SETTING`](crate::NAMESPACE_SETTING), else [`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE)).
    pub(crate) async fn open(
        config: tokio_postgres::Config,
        shown: String,
        tls: Connector,
        opts: &Options,
    ) -> Result<(PgBackend, String), Error> {
        let pg = PgSettings::of(opts)?;
        let pool = Pool::new(
            config,
            shown,
            tls,
            opts.max_connections,
            opts.acquire_timeout,
            opts.check_interval,
            opts.check_timeout,
            pg.pooler,
        );
        let mux = (pg.multiplex > 0).then(|| mux::Mux::new(pool.clone(), pg.multiplex));
        let (mut b, ns) = PgBackend::finish_open(Source::Native(pool.clone()), false, opts).await?;
        if mux.is_some() {
            // A multiplexing handle keeps to its shared connections until it must wait.
            pool.close_idle();
        }
        b.mux = mux;
        if let Some(route) = pool.route() {
            b.set_pooler(route);
        }
        Ok((b, ns))
    }

    /// A backend on the caller's sqlx pool.
    pub(crate) async fn from_sqlx(
        pool: sqlx::PgPool,
        opts: &Options,
    ) -> Result<(PgBackend, String), Error> {
        let source = Source::Sqlx(SqlxSource {
            pool,
            check_interval: opts.check_interval,
            check_timeout: opts.check_timeout,
        });
        let pg = PgSettings::of(opts)?;
        if pg.multiplex > 0 {
            return Err(Error::unsupported(
                crate::error::Capability::Multiplexing,
                "multiplexing needs dblock's own connections (a postgres:// URL), not an sqlx pool",
            ));
        }
        let (mut b, ns) = PgBackend::finish_open(source, true, opts).await?;
        if pg.pooler != Pooler::Detect {
            b.set_pooler((pg.pooler, Known::Declared));
        } else if b.server_port.is_some_and(|p| Some(p) != b.sqlx_port()) {
            b.set_pooler((Pooler::Transaction, Known::Port));
        }
        Ok((b, ns))
    }

    /// Records what lies between dblock and the server.
    fn set_pooler(&mut self, route: (Pooler, Known)) {
        self.pooler = route;
        if route.0 != Pooler::None {
            // Set per request (SET LOCAL) rather than on the session.
            self.check_disconnect = self.version >= 140_000;
        }
    }

    /// The TCP port the sqlx pool connects to (`None` for a Unix socket).
    fn sqlx_port(&self) -> Option<u16> {
        match &self.source {
            Source::Sqlx(s) => {
                let o = s.pool.connect_options();
                (!o.get_host().starts_with('/')).then(|| o.get_port())
            }
            Source::Native(_) => None,
        }
    }

    /// Refuses, before anything is taken, what cannot work through a
    /// transaction-pooling pooler.
    pub(crate) fn refuse_behind_pooler(
        &self,
        what: &'static str,
        fix: &'static str,
    ) -> Result<(), Error> {
        match self.pooler {
            (p, how) if !p.keeps_sessions() => Err(Error::BehindPooler {
                what,
                how: how.describe(),
                fix,
            }),
            _ => Ok(()),
        }
    }

    async fn finish_open(
        source: Source,
        sqlx: bool,
        opts: &Options,
    ) -> Result<(PgBackend, String), Error> {
        let armed = Armed::new(source.get().await?);
        let rows = armed
            .conn()
            .query(&format!(
                "SELECT current_schema(); SELECT current_setting('server_version_num'); \
                 SELECT current_setting('{}', true); \
                 SELECT (extract(epoch FROM current_setting('lock_timeout')::interval) \
                 * 1000)::bigint; SELECT inet_server_port(); SELECT current_user",
                NAMESPACE_SETTING
            ))
            .await
            .map_err(QueryError::into_error)?;
        armed.disarm().recycle();
        let schema = first_value(&rows, 0);
        let version: u32 = first_value(&rows, 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        // Never the schema in use: that depends on search_path and on which of its
        // schemas exist, so two processes meaning one lock could key it differently.
        let server_port = first_value(&rows, 4).and_then(|v| v.parse().ok());
        let role = first_value(&rows, 5).unwrap_or_default();
        let namespace = first_value(&rows, 2)
            .filter(|ns| !ns.is_empty())
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
        Ok((
            PgBackend {
                source,
                mux: None,
                check_disconnect: sqlx && version >= 140_000,
                version,
                check_interval: opts.check_interval,
                check_timeout: opts.check_timeout,
                schema,
                fence_ready: tokio::sync::OnceCell::new(),
                runs_ready: tokio::sync::OnceCell::new(),
                fence_epoch: std::sync::atomic::AtomicBool::new(true),
                pooler: (Pooler::None, Known::Declared),
                server_port,
                role,
                server_lock_timeout: first_value(&rows, 3)
                    .and_then(|ms| ms.parse::<u64>().ok())
                    .filter(|&ms| ms > 0)
                    .map(Duration::from_millis),
            },
            namespace,
        ))
    }

    /// Takes a lock as `req` says: one round trip on a pinned connection.
    async fn acquire(&self, req: &Req<'_>) -> Result<Option<Grant>, Error> {
        Ok(self.acquire_keys(req, &[]).await?.map(|(_, g)| g))
    }

    /// Takes any one of `keys` (see [`Any`]), `req.key` being the name's; the index of
    /// the key granted. A fenced request, or one a multiplexing handle would take on a
    /// shared connection, takes them one by one instead.
    async fn acquire_any(
        &self,
        req: &Req<'_>,
        keys: &[Key],
    ) -> Result<Option<(usize, Grant)>, Error> {
        let multiplexed = self.mux.is_some() && mux::Mux::applies(req);
        if req.fenced || multiplexed || keys.is_empty() {
            return acquire_any_in_turn(self, req, keys).await;
        }
        self.acquire_keys(req, keys).await
    }

    /// Refuses what the server or the path to it cannot do: a lease too short to be
    /// noticed in time or without `idle_session_timeout`; a session lock behind a
    /// transaction pooler.
    pub(super) fn refuse_unsupported(&self, req: &Req<'_>) -> Result<(), Error> {
        if let Some(lease) = req.lease {
            // The one lease rule (raw.rs); the server's idle timeouts count whole
            // milliseconds, rounded up (plan.rs), so never shorter than `lease`.
            crate::raw::check_lease(lease, self.check_interval, self.check_timeout)?;
            if req.scope == Scope::Session && self.version < 140_000 {
                return Err(Error::unsupported(
                    crate::error::Capability::SessionLease,
                    "a lease on a session-scoped lock needs PostgreSQL 14 (idle_session_timeout)",
                ));
            }
        }
        if req.scope == Scope::Session {
            self.refuse_behind_pooler(
                "a session-scoped lock",
                "the pooler would hand the session, and the lock with it, to another client; \
                 use transaction-scoped locks (the default), or a URL that reaches PostgreSQL \
                 directly or through a session-pooling port (say so with pooler=session)",
            )?;
        }
        Ok(())
    }

    /// Takes `req.key`, or with `any` keys any one of them: one round trip on a pinned
    /// connection per slice of waiting.
    async fn acquire_keys(
        &self,
        req: &Req<'_>,
        any: &[Key],
    ) -> Result<Option<(usize, Grant)>, Error> {
        self.refuse_unsupported(req)?;
        let fence_table = match req.fenced {
            true => Some(
                self.fence_table()
                    .await
                    .map_err(|e| self.fencing_permission(e))?
                    .clone(),
            ),
            false => None,
        };
        let epoch = self.fence_epoch.load(std::sync::atomic::Ordering::Relaxed);
        if let Some(mux) = self
            .mux
            .as_ref()
            .filter(|_| any.is_empty() && mux::Mux::applies(req))
        {
            match mux.try_acquire(req, fence_table.as_ref(), epoch).await? {
                mux::Attempt::Granted(g) => return Ok(Some((0, g))),
                mux::Attempt::NotFree if req.wait == Wait::Try => return Ok(None),
                // Waiting never blocks a shared connection: wait on a connection of its own.
                mux::Attempt::NotFree | mux::Attempt::HeldHere => {}
            }
        }
        // A wait without a deadline ends where the server's own lock_timeout would have
        // ended it, had dblock not replaced that with its slices.
        let server_bound;
        let req = match (req.wait, self.server_lock_timeout) {
            (Wait::Forever, Some(t)) => {
                let mut r = req.clone();
                r.wait = Instant::now()
                    .checked_add(t)
                    .map_or(Wait::Forever, Wait::Until);
                server_bound = r;
                &server_bound
            }
            _ => req,
        };
        let deadline = req.wait.deadline();
        // Behind a pooler a request may sit in the pooler's queue, which the server's
        // lock_timeout does not count: the caller's deadline is kept here too.
        let queued_bound = match (self.pooler.0, req.wait) {
            (Pooler::None, _) => None,
            (_, Wait::Until(d)) => Some(d + POOLER_GRACE),
            _ => None,
        };
        // A wait longer than one slice goes round again (see WAIT_SLICE_MS), on the
        // next of `any` keys; the later slices say when the wait began, for `dblock
        // status`.
        let mut start = if any.is_empty() {
            0
        } else {
            any_start(any.len())
        };
        let began = std::time::SystemTime::now();
        let mut slices = 0u32;
        loop {
            slices += 1;
            let conn = match queued_bound {
                Some(b) => {
                    match tokio::time::timeout_at(b, self.source.get_until(deadline)).await {
                        Ok(c) => c?,
                        Err(_) => return Ok(None),
                    }
                }
                None => self.source.get_until(deadline).await?,
            };
            let plan = Plan::build(
                req,
                fence_table.as_deref().map(|t| (t, epoch)),
                self.check_disconnect,
                self.version >= 120_000,
                (!any.is_empty()).then_some(Any { keys: any, start }),
                (slices > 1).then_some(began),
            );
            start = (start + 1) % any.len().max(1);
            let armed = Armed::new(conn);
            let result = match deadline {
                // The server ends the wait (lock_timeout); the client-side bound is a
                // backstop for a server that stops answering.
                Some(d) => {
                    let request = armed.conn().lock_query(&plan.sql, plan.wanted());
                    match tokio::time::timeout_at(queued_bound.unwrap_or(d + BACKSTOP), request)
                        .await
                    {
                        Ok(r) => r,
                        // Not granted by the deadline, counting the pooler's queue.
                        Err(_) if queued_bound.is_some() => {
                            drop(armed); // abandons: cancels, closes
                            return Ok(None);
                        }
                        Err(_) => {
                            drop(armed); // abandons: cancels on the server, closes
                            return Err(Error::Timeout {
                                waiting_for: WaitingFor::ServerReply,
                                after: Some(BACKSTOP),
                            });
                        }
                    }
                }
                None => armed.conn().lock_query(&plan.sql, plan.wanted()).await,
            };
            let conn = armed.disarm();
            let outcome = result.map(|firsts| match any.is_empty() {
                true => plan.outcome(&firsts).map(|token| (0, token)),
                false => plan.granted_slot(&firsts).map(|slot| (slot, None)),
            });
            return match outcome {
                Ok(granted) => {
                    match granted.filter(|&(slot, _)| any.is_empty() || slot < any.len()) {
                        Some((slot, token)) => {
                            conn.link().set_holding(true);
                            conn.link()
                                .set_label(crate::status::label(plan.sql.comment()));
                            let held = match any.get(slot) {
                                Some(&key) => Pinned::new(
                                    conn,
                                    &Req { key, ..req.clone() },
                                    self.check_timeout,
                                ),
                                None => Pinned::new(conn, req, self.check_timeout),
                            };
                            Ok(Some((
                                slot,
                                Grant {
                                    held: Box::new(held),
                                    fence: token.zip(fence_table),
                                },
                            )))
                        }
                        None => {
                            plan.clean_up(&conn, false);
                            conn.recycle();
                            Ok(None)
                        }
                    }
                }
                Err(QueryError::Db { code, message }) => {
                    plan.clean_up(&conn, true);
                    conn.recycle();
                    match server_ended(req, plan.sliced, &code, message) {
                        None => continue,
                        Some(Ok(())) => Ok(None),
                        Some(Err(e)) if req.fenced => Err(self.fencing_permission(e)),
                        Some(Err(e)) => Err(e),
                    }
                }
                Err(e @ QueryError::Lost { .. }) => Err(e.into_error()),
            };
        }
    }

    /// A connection of this handle's own, pinned for the caller (the migration runner):
    /// it must go back through [`Conn::recycle`] only with no lock held and no
    /// transaction open, and through [`Conn::abandon`] (or a dropped [`Armed`]) whenever
    /// that is in doubt.
    pub(crate) async fn pinned(&self) -> Result<Conn, Error> {
        self.source.get().await
    }
}

/// How long past a deadline the client waits for the server's own lock_timeout to
/// answer before giving the connection up.
pub(super) const BACKSTOP: Duration = Duration::from_secs(2);

/// Behind a pooler, how long past a deadline the client waits for the server's answer
/// before it gives the request up (the server's own lock_timeout normally answers at
/// the deadline; a request still queued in the pooler never would).
pub(super) const POOLER_GRACE: Duration = Duration::from_millis(100);

pub(super) const LOCK_NOT_AVAILABLE: &str = "55P03";

pub(super) const QUERY_CANCELED: &str = "57014";

/// How a lock statement the server ended with error `code` ends its request: `None` to
/// wait on in a new statement (one slice of the wait ended, see `WAIT_SLICE_MS`, and the
/// caller's deadline, if any, is still ahead); `Some(Ok(()))` not obtained; else the
/// error.
pub(super) fn server_ended(
    req: &Req<'_>,
    sliced: bool,
    code: &str,
    message: String,
) -> Option<Result<(), Error>> {
    if code == LOCK_NOT_AVAILABLE {
        let ahead = match req.wait {
            Wait::Forever => true,
            Wait::Until(d) => Instant::now() < d,
            Wait::Try => false,
        };
        if sliced && ahead {
            return None;
        }
        return Some(match req.wait {
            Wait::Forever => Err(Error::Timeout {
                waiting_for: WaitingFor::LockServerLockTimeout,
                after: None,
            }),
            _ => Ok(()),
        });
    }
    if code == QUERY_CANCELED {
        return Some(Err(Error::Timeout {
            waiting_for: WaitingFor::LockServerStatementTimeout,
            after: None,
        }));
    }
    Some(Err(Error::from_sqlstate(code, message)))
}

impl RawLocks for PgBackend {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn acquire<'a>(&'a self, req: &'a Req<'a>) -> BoxFuture<'a, Result<Option<Grant>, Error>> {
        Box::pin(PgBackend::acquire(self, req))
    }

    fn acquire_any<'a>(
        &'a self,
        req: &'a Req<'a>,
        keys: &'a [Key],
    ) -> BoxFuture<'a, Result<Option<(usize, Grant)>, Error>> {
        Box::pin(PgBackend::acquire_any(self, req, keys))
    }

    fn acquire_all<'a>(
        &'a self,
        req: &'a Req<'a>,
        keys: &'a [Key],
    ) -> BoxFuture<'a, Result<Option<Grant>, Error>> {
        Box::pin(PgBackend::acquire_all(self, req, keys))
    }

    fn has_leases(&self) -> bool {
        true
    }

    fn pooler(&self) -> Pooler {
        self.pooler.0
    }

    fn migrations(&self) -> Option<&dyn crate::migrate::store::MigrationStore> {
        Some(self)
    }

    fn bench_floor(&self) -> Result<Arc<dyn BenchFloor>, Error> {
        match &self.source {
            Source::Native(p) => Ok(Arc::new(super::store::floor::Floor::new(
                p.config().clone(),
                p.tls().clone(),
                p.clone(),
            ))),
            Source::Sqlx(_) => Err(Error::unsupported(
                crate::error::Capability::Benchmark,
                "the benchmark needs a postgres:// URL, not an sqlx pool",
            )),
        }
    }

    fn setup<'a>(&'a self, grant_to: &'a [&'a str]) -> BoxFuture<'a, Result<String, Error>> {
        Box::pin(self.setup_tables(grant_to))
    }
}
