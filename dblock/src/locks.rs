//! The handle and its builder.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::key::{Key, check_name, check_namespace};
use crate::observe::MetricsConfig;
use crate::raw::{Options, RawLocks, Scope};
use crate::target::{self, Pool};

pub(crate) struct Inner {
    pub(crate) backend: Box<dyn RawLocks>,
    pub(crate) namespace: String,
    pub(crate) scope: Scope,
    pub(crate) metrics: MetricsConfig,
}

/// A handle on one database's locks: cheap to clone, shared by every task of a process.
///
/// Built from a URL ([`Locks::connect`]), the environment ([`Locks::from_env`]), an
/// existing sqlx pool ([`Locks::from_sqlx_pool`]) or a [`Builder`].
///
/// ```no_run
/// # async fn demo() -> Result<(), dblock::Error> {
/// let locks = dblock::Locks::connect("postgres://postgres@localhost/app").await?;
/// let guard = locks.lock("autoland:7").await?;
/// // … one process at a time lands proposal 7 …
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locks {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Locks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locks")
            .field("backend", &self.backend_name())
            .field("namespace", &self.inner.namespace)
            .finish()
    }
}

impl Locks {
    /// A builder, for options beyond the URL.
    pub fn builder() -> Builder {
        Builder::default()
    }

    /// Opens the database named by `url`: `postgres://…`, `postgresql://…` or a libpq
    /// `key=value` string (PostgreSQL), `mysql://…` or `mariadb://…` (MySQL 8, MariaDB
    /// 10.6+), `sqlite:PATH` or `sqlite://PATH` (the embedded backend).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] for a URL dblock cannot use; [`Error::Connect`] when a
    /// PostgreSQL or MySQL server cannot be reached; [`Error::Io`] or
    /// [`Error::UnsupportedFilesystem`] when the embedded lock file cannot be used.
    ///
    /// # Cancel safety
    ///
    /// Cancelling it closes any connection it had opened; nothing is left behind.
    pub async fn connect(url: &str) -> Result<Locks, Error> {
        Builder::default().url(url).build().await
    }

    /// Opens the database named by `DBLOCK_DATABASE_URL`, else `DATABASE_URL`, else the
    /// embedded default, an SQLite file at `$XDG_STATE_HOME/dblock/locks.db`
    /// (`$HOME/.local/state/dblock/locks.db` when `XDG_STATE_HOME` is unset).
    ///
    /// # Errors
    ///
    /// As [`Locks::connect`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::connect`].
    pub async fn from_env() -> Result<Locks, Error> {
        Builder::default().build().await
    }

    /// A handle on the caller's sqlx pool: dblock borrows a connection from it for each
    /// held or waiting lock (so size the pool for that) and returns it on release. Use
    /// this for TLS, or to share one pool's settings.
    ///
    /// dblock's own connections ([`Locks::connect`]) are faster: there a release is sent
    /// from the guard's drop itself, and a cut-off wait is cancelled on the server with a
    /// cancel request. On a borrowed connection both go through a small task, and a
    /// cut-off wait closes its connection (PostgreSQL 14 and later then stop waiting
    /// within 250 ms; older servers wait until the lock is granted, then release it).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::PgPool::connect("postgres://app@db/app?sslmode=require").await?;
    /// let locks = dblock::Locks::from_sqlx_pool(pool).await?;
    /// let _guard = locks.lock("autoland:7").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// Connection and server errors of the first connection.
    ///
    /// # Cancel safety
    ///
    /// Cancelling it returns the borrowed connection; nothing is left behind.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn from_sqlx_pool(pool: sqlx::PgPool) -> Result<Locks, Error> {
        Builder::default().sqlx_pool(pool).build().await
    }

    /// A handle on the caller's sqlx MySQL / MariaDB pool: dblock borrows a connection
    /// from it for each held or waiting lock (so size the pool for that) and returns it,
    /// holding nothing, on release. The pool's connections must have a database
    /// selected. See [`mysql`](crate::mysql) for lock names and behaviour.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = dblock::sqlx::MySqlPool::connect("mysql://app@db/app").await?;
    /// let locks = dblock::Locks::from_sqlx_mysql_pool(pool).await?;
    /// let _guard = locks.lock("autoland:7").await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// Connection and server errors of the first connection; [`Error::Configuration`]
    /// when its connections have no database selected.
    ///
    /// # Cancel safety
    ///
    /// Cancelling it returns the borrowed connection; nothing is left behind.
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub async fn from_sqlx_mysql_pool(pool: sqlx::MySqlPool) -> Result<Locks, Error> {
        Builder::default().sqlx_mysql_pool(pool).build().await
    }

    /// The namespace every name of this handle is keyed in.
    pub fn namespace(&self) -> &str {
        &self.inner.namespace
    }

    /// What lies between this handle and PostgreSQL, as detected or declared (see
    /// [`Builder::pooler`]); [`Pooler::None`](crate::postgres::Pooler::None) on the
    /// embedded backend.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn pooler(&self) -> crate::raw::Pooler {
        self.inner.backend.pooler()
    }

    /// `"postgres"`, `"mysql"` or `"sqlite"`.
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }

    /// The key `name` maps to in this handle's namespace.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty, too long or NUL-containing name.
    pub fn key(&self, name: &str) -> Result<Key, Error> {
        check_name(name)?;
        Ok(Key::derive(&self.inner.namespace, name))
    }
}

/// Options for a [`Locks`] handle.
#[derive(Clone)]
pub struct Builder {
    url: Option<String>,
    /// A caller's sqlx pool, which wins over the URL.
    pool: Option<Pool>,
    namespace: Option<String>,
    scope: Scope,
    opts: Options,
    metrics: MetricsConfig,
}

// By hand: the URL may hold a password, which Debug output must not show.
impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Builder");
        d.field("url", &self.url.as_deref().map(crate::error::redact_url))
            .field("pool", &self.pool)
            .field("namespace", &self.namespace)
            .field("scope", &self.scope)
            .field("max_connections", &self.opts.max_connections)
            .field("acquire_timeout", &self.opts.acquire_timeout)
            .field("check_interval", &self.opts.check_interval)
            .field("check_timeout", &self.opts.check_timeout)
            .field(
                "allow_network_filesystem",
                &self.opts.allow_network_filesystem,
            )
            .field("settings", &self.opts.settings)
            .finish()
    }
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            url: None,
            pool: None,
            namespace: None,
            scope: Scope::Transaction,
            opts: Options::default(),
            metrics: MetricsConfig::default(),
        }
    }
}

impl Builder {
    /// The database URL. Without one, `DBLOCK_DATABASE_URL`, then `DATABASE_URL`, then
    /// the embedded default are used (see [`Locks::from_env`]).
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// Borrow connections from this sqlx pool instead of opening dblock's own (see
    /// [`Locks::from_sqlx_pool`]); the URL is then ignored.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn sqlx_pool(mut self, pool: sqlx::PgPool) -> Self {
        self.pool = Some(Pool::Postgres(pool));
        self
    }

    /// Borrow connections from this sqlx MySQL / MariaDB pool instead of opening
    /// dblock's own (see [`Locks::from_sqlx_mysql_pool`]); the URL is then ignored.
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub fn sqlx_mysql_pool(mut self, pool: sqlx::MySqlPool) -> Self {
        self.pool = Some(Pool::MySql(pool));
        self
    }

    /// The namespace names are keyed in. Unset, on PostgreSQL the server setting
    /// [`NAMESPACE_SETTING`](crate::NAMESPACE_SETTING) if it is set, else (and on the
    /// embedded backend) [`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE) — never the
    /// schema in use, which depends on `search_path` and on which schemas exist. Two
    /// deployments sharing one database set a namespace each.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// The default PostgreSQL scope of this handle's locks ([`Scope::Transaction`]
    /// unless set).
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// How many PostgreSQL connections dblock may open (64 unless set). Each held or
    /// waiting lock pins one; requests beyond wait for one to come free (see
    /// [`acquire_timeout`](Builder::acquire_timeout)).
    pub fn max_connections(mut self, n: usize) -> Self {
        self.opts.max_connections = n.max(1);
        self
    }

    /// How long a request waits for one of dblock's connections to come free when all
    /// [`max_connections`](Builder::max_connections) are in use: 30 seconds unless set,
    /// then [`Error::Timeout`]. This bounds the wait for a *connection*; the wait for the
    /// lock itself is the request's (see [`Request::try_lock_for`](crate::Request::try_lock_for)), and a request with a
    /// deadline of its own waits for a connection no longer than that either (a
    /// `try_lock` not at all). A handle on an sqlx pool uses that pool's
    /// `acquire_timeout` instead.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.opts.acquire_timeout = timeout;
        self
    }

    /// How often a held PostgreSQL lock's connection is checked, so that a silently
    /// broken connection is noticed ([`LockGuard::lost`](crate::LockGuard::lost)); one second unless set. On
    /// dblock's own connections a connection the server closes is noticed at once
    /// regardless; on connections borrowed from an sqlx pool, at the next check.
    pub fn check_interval(mut self, interval: Duration) -> Self {
        self.opts.check_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// How long a check may go unanswered before the lock is declared lost and its
    /// connection closed; five seconds unless set.
    pub fn check_timeout(mut self, timeout: Duration) -> Self {
        self.opts.check_timeout = timeout.max(Duration::from_millis(10));
        self
    }

    /// Takes session-scoped PostgreSQL locks on at most `n` shared connections, many
    /// locks per connection, each released on its own — for a process that holds
    /// thousands of locks at once. A lock that is not free at once is waited for on a
    /// connection of its own. See [`postgres`](crate::postgres#multiplexing) for how no
    /// two owners can arise on a shared, re-entrant session. Off (`0`) unless set;
    /// transaction-scoped and leased requests never multiplex.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), dblock::Error> {
    /// use dblock::{Locks, Scope};
    /// let locks = Locks::builder()
    ///     .url("postgres://postgres@localhost/app")
    ///     .scope(Scope::Session)
    ///     .multiplex(4)
    ///     .build()
    ///     .await?;
    /// let mut guards = Vec::new();
    /// for tenant in 0..5000 {
    ///     guards.push(locks.lock(&format!("tenant:{tenant}")).await?); // on 4 connections
    /// }
    /// # Ok(()) }
    /// ```
    pub fn multiplex(mut self, n: usize) -> Self {
        // Read by name by the backend that has it (PostgreSQL), like the URL's settings.
        self.opts.set("multiplex", n.min(64).to_string());
        self
    }

    /// How long after PostgreSQL grants a lock this handle may hand it straight to another
    /// of its own tasks waiting for the same name, with no round trip, before it lets the
    /// server give it to another process's waiter: 5 ms unless set. Longer favours this
    /// process's throughput on a hot name; [`Duration::ZERO`] sends every hand-off through
    /// the server, in the server's order among all processes (`docs/how-it-works.md`).
    /// Plain requests only (one name, exclusive, with a wait, unfenced, no lease, not
    /// multiplexed); the embedded file and MySQL/MariaDB ignore it.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), dblock::Error> {
    /// use std::time::Duration;
    /// let locks = dblock::Locks::builder()
    ///     .url("postgres://postgres@localhost/app")
    ///     .hand_over(Duration::ZERO) // strict server order between all waiters
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn hand_over(mut self, window: Duration) -> Self {
        let micros = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        self.opts.set("hand_over", micros.to_string());
        self
    }

    /// Lets the embedded backend use a lock file on a network or FUSE file system,
    /// where byte-range locks may not exclude across hosts. Off unless set: such file
    /// systems are refused with [`Error::UnsupportedFilesystem`].
    pub fn allow_network_filesystem(mut self, allow: bool) -> Self {
        self.opts.allow_network_filesystem = allow;
        self
    }

    /// What lies between dblock and PostgreSQL: a connection pooler in transaction or
    /// session mode, or none. Detected unless set (see
    /// [`postgres::pooler`](crate::postgres::pooler) for how, and its limits); a
    /// `pooler=…` parameter in the URL sets it too. Behind a transaction pooler,
    /// session-scoped locks and migrations are refused with
    /// [`Error::BehindPooler`].
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn pooler(mut self, pooler: crate::raw::Pooler) -> Self {
        self.opts.set("pooler", pooler.as_str());
        self
    }

    /// When the handle checks that its server's advisory locks exclude (see
    /// [`postgres::engine`](crate::postgres::engine)): by default
    /// ([`SelfTest::Auto`](crate::postgres::engine::SelfTest::Auto)) on every engine but
    /// PostgreSQL, once, before the handle's first grant;
    /// [`SelfTest::Always`](crate::postgres::engine::SelfTest::Always) on PostgreSQL too.
    /// A `self_test=…` parameter in the URL sets it too.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn self_test(mut self, when: crate::postgres::engine::SelfTest) -> Self {
        self.opts.set("self_test", when.as_str());
        self
    }

    /// Labels this handle's metrics with a `group` derived from each lock's name — say its
    /// kind, `autoland` for `autoland:7` — where the default labels (`backend`, `mode`)
    /// are too coarse. The function must map the names of a process to a *bounded* set
    /// of groups (or `None`, no label): every distinct label value is a time series the
    /// recorder keeps for the life of the process, which is why the name itself is never
    /// a label. Each grant then builds its labels at run time (an allocation or two).
    /// See `docs/observability.md`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), dblock::Error> {
    /// let locks = dblock::Locks::builder()
    ///     .metrics_group(|name| name.split_once(':').map(|(kind, _)| kind))
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "metrics")]
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub fn metrics_group(mut self, group: fn(&str) -> Option<&str>) -> Self {
        self.metrics.group = Some(group);
        self
    }

    /// The `application_name` dblock's own PostgreSQL connections give (ahead of the
    /// URL's `application_name=` and `PGAPPNAME`; the default is
    /// [`default_application_name`](crate::status::default_application_name),
    /// `program[pid]@host`). Not applied to a borrowed sqlx pool, whose options are the
    /// caller's.
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.opts.set("application_name", name);
        self
    }

    /// Opens the handle.
    ///
    /// # Errors
    ///
    /// As [`Locks::connect`], and [`Error::InvalidNamespace`] for a bad namespace.
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::connect`].
    pub async fn build(self) -> Result<Locks, Error> {
        if let Some(ns) = &self.namespace {
            check_namespace(ns)?;
        }
        let (backend, namespace) =
            target::open_source(self.pool.clone(), self.url.as_deref(), &self.opts).await?;
        self.finish(backend, namespace)
    }

    fn finish(self, backend: Box<dyn RawLocks>, default_namespace: String) -> Result<Locks, Error> {
        let namespace = self.namespace.unwrap_or(default_namespace);
        check_namespace(&namespace)?;
        #[cfg(feature = "metrics")]
        crate::observe::meter::describe();
        Ok(Locks {
            inner: Arc::new(Inner {
                backend,
                namespace,
                scope: self.scope,
                metrics: self.metrics,
            }),
        })
    }
}
