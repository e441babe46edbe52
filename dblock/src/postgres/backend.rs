//! The PostgreSQL backend: where its connections come from, what it learns when it
//! opens, and `RawLocks` (an acquisition itself is `lock/acquire.rs`'s).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::conn::borrowed::SqlxSource;
use super::conn::pool::Pool;
use super::conn::pooler::{Known, Pooler};
use super::conn::tls::Connector;
use super::conn::wire::QueryError;
use super::conn::{Armed, Conn};
use super::lock::mux;
use super::settings::PgSettings;
use super::sql::first_value;
use crate::engine::{Engine, Exclusion, SelfTest};
use crate::error::Error;
use crate::key::{DEFAULT_NAMESPACE, Key, NAMESPACE_SETTING};
use crate::raw::{BenchFloor, BoxFuture, Grant, Options, RawLocks, Req};

/// Where a backend's connections come from.
pub(super) enum Source {
    /// dblock's own pool (tokio-postgres), from a URL.
    Native(Pool),
    /// The caller's sqlx pool.
    Sqlx(SqlxSource),
}

impl Source {
    /// A connection for anything but a lock request, with the session's own
    /// `lock_timeout` (a lock request may have left its wait slice there). Waiting for
    /// one (all in use) is bounded by the pool's acquire timeout.
    pub(super) async fn get(&self) -> Result<Conn, Error> {
        match self {
            Source::Native(p) => {
                let mut c = p.get_until(None).await?;
                // If it cannot be sent, the connection is closed and its first query
                // fails as a lost connection does.
                c.reset_session_slice();
                Ok(Conn::Native(c))
            }
            Source::Sqlx(p) => p.get().await.map(Conn::Sqlx),
        }
    }

    /// A connection for a lock request (which may leave its wait slice as the session's
    /// `lock_timeout`): on dblock's own pool the wait for one to come
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
    pub(super) mux: Option<mux::Mux>,
    /// Whether lock requests set `client_connection_check_interval` (sqlx connections
    /// on PostgreSQL 14+: the only way to end a cut-off wait without a cancel request).
    pub(super) check_disconnect: bool,
    /// Which keys were found busy lately: whether a request tries first.
    pub(super) busy: super::lock::busy::Busy,
    /// This handle's tasks waiting behind one another for a key, and the hand-over of
    /// the lock between them (`lock/relay.rs`).
    pub(super) relays: super::lock::relay::Relays<super::lock::held::Pinned>,
    /// `server_version_num`.
    pub(super) version: u32,
    /// How often held connections are checked (a lease must be longer).
    pub(super) check_interval: Duration,
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
    /// The engine the server is, as named when the handle opened.
    pub(crate) engine: Engine,
    /// Whether the engine's advisory locks are checked before the handle's first grant
    /// (any engine but PostgreSQL, or `self_test=always`).
    pub(super) self_test: bool,
    /// What that check found, once it has run.
    pub(super) exclusion: tokio::sync::OnceCell<Exclusion>,
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
            (pg.pooler, pg.pooler_known),
        );
        let mux = (pg.multiplex > 0).then(|| mux::Mux::new(pool.clone(), pg.multiplex));
        let (mut b, ns) =
            PgBackend::finish_open(Source::Native(pool.clone()), false, opts, pg.hand_over).await?;
        // The start-up parameters name the engine where they tell; `version()`, read in
        // the opening query anyway, where they do not, or where it contradicts a claim to
        // be PostgreSQL (a server that copies PostgreSQL's parameters).
        let engine = match pool.engine() {
            Some(e) if !e.trusted() || b.engine.trusted() => e,
            _ => b.engine.clone(),
        };
        b.set_engine(engine, pg.self_test);
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
        let (mut b, ns) = PgBackend::finish_open(source, true, opts, pg.hand_over).await?;
        let engine = b.engine.clone();
        b.set_engine(engine, pg.self_test);
        if pg.pooler != Pooler::Detect {
            b.set_pooler((pg.pooler, pg.pooler_known));
        } else if b.server_port.is_some_and(|p| Some(p) != b.sqlx_port()) {
            b.set_pooler((Pooler::Transaction, Known::Port));
        }
        Ok((b, ns))
    }

    /// Records which engine the server is, and whether its locks are to be checked.
    fn set_engine(&mut self, engine: Engine, when: SelfTest) {
        self.self_test = when == SelfTest::Always || !engine.trusted();
        self.engine = engine;
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
    /// transaction-pooling pooler: anything of a session (`locks_only` false), or, with
    /// `locks_only`, only session locks — which a pinning pooler keeps.
    pub(crate) fn refuse_behind_pooler(
        &self,
        what: &'static str,
        fix: &'static str,
        locks_only: bool,
    ) -> Result<(), Error> {
        let (p, how) = self.pooler;
        let kept = match locks_only {
            true => p.keeps_session_locks(),
            false => p.keeps_sessions(),
        };
        match kept {
            false => Err(Error::BehindPooler {
                what,
                how: how.describe(p),
                fix,
            }),
            true => Ok(()),
        }
    }

    async fn finish_open(
        source: Source,
        sqlx: bool,
        opts: &Options,
        hand_over: Duration,
    ) -> Result<(PgBackend, String), Error> {
        let armed = Armed::new(source.get().await?);
        let rows = armed
            .conn()
            .query(&format!(
                "SELECT pg_catalog.current_schema(); SELECT pg_catalog.current_setting('server_version_num'); \
                 SELECT pg_catalog.current_setting('{}', true); \
                 SELECT (extract(epoch FROM pg_catalog.current_setting('lock_timeout')::interval) \
                 * 1000)::bigint; SELECT pg_catalog.inet_server_port(); SELECT current_user; \
                 SELECT pg_catalog.version()",
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
        // Told by the start-up parameters where they are seen (`set_engine`), else here.
        let engine = Engine::from_version_text(&first_value(&rows, 6).unwrap_or_default());
        let namespace = first_value(&rows, 2)
            .filter(|ns| !ns.is_empty())
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
        Ok((
            PgBackend {
                source,
                mux: None,
                check_disconnect: sqlx && version >= 140_000,
                busy: Default::default(),
                relays: super::lock::relay::Relays::new(hand_over),
                version,
                check_interval: opts.check_interval,
                check_timeout: opts.check_timeout,
                schema,
                fence_ready: tokio::sync::OnceCell::new(),
                runs_ready: tokio::sync::OnceCell::new(),
                fence_epoch: std::sync::atomic::AtomicBool::new(true),
                pooler: (Pooler::None, Known::Port),
                server_port,
                role,
                self_test: !engine.trusted(),
                engine,
                exclusion: tokio::sync::OnceCell::new(),
                server_lock_timeout: first_value(&rows, 3)
                    .and_then(|ms| ms.parse::<u64>().ok())
                    .filter(|&ms| ms > 0)
                    .map(Duration::from_millis),
            },
            namespace,
        ))
    }

    /// A connection of this handle's own, pinned for the caller (the migration runner):
    /// it must go back through [`Conn::recycle`] only with no lock held and no
    /// transaction open, and through [`Conn::abandon`] (or a dropped [`Armed`]) whenever
    /// that is in doubt.
    pub(crate) async fn pinned(&self) -> Result<Conn, Error> {
        self.source.get().await
    }
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

    fn diagnose(&self) -> BoxFuture<'_, Result<Vec<crate::doctor::Check>, Error>> {
        Box::pin(PgBackend::diagnose(self))
    }

    fn engine(&self) -> Option<Engine> {
        Some(self.engine.clone())
    }

    fn check_exclusion(&self) -> BoxFuture<'_, Result<Exclusion, Error>> {
        Box::pin(PgBackend::check_exclusion(self))
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

#[cfg(test)]
mod tests {
    use super::PgBackend;
    use crate::key::Key;
    use crate::raw::Req;

    /// The size of the future `f` returns, from its type alone (`f` is never called).
    fn future_size<'a, F, Fut, A>(_: F) -> usize
    where
        F: Fn(&'a PgBackend, &'a Req<'a>, A) -> Fut,
        Fut: std::future::Future,
    {
        std::mem::size_of::<Fut>()
    }

    /// A lock request's future is allocated (boxed) for every request and lives while
    /// the request is in flight: connecting, sqlx's pool acquisition and the once-per-
    /// handle checks are boxed where they happen, so that they do not make every
    /// request's future their size. Before, it was 15,376 bytes: 15 MB for 1,000
    /// requests in flight, and a 15 KB allocation per lock cycle.
    #[test]
    fn a_lock_requests_future_stays_small() {
        let one = future_size(|b: &PgBackend, r: &Req<'_>, ()| b.acquire(r));
        let any = future_size(|b: &PgBackend, r: &Req<'_>, k: &'static [Key]| b.acquire_any(r, k));
        let all = future_size(|b: &PgBackend, r: &Req<'_>, k: &'static [Key]| b.acquire_all(r, k));
        for (what, size) in [("acquire", one), ("acquire_any", any), ("acquire_all", all)] {
            assert!(size <= 4096, "{what}'s future is {size} bytes");
        }
        // One name, the request every lock makes: within the C allocator's per-thread
        // cache (glibc's tcache takes up to 1,032 bytes). At 1,392 bytes each cycle's
        // box went through malloc's slow path and its free through consolidation, a
        // few hundred instructions a lock more on the client.
        assert!(one <= 1032, "acquire's future is {one} bytes");
    }
}
