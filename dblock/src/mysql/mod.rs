//! MySQL 8 and MariaDB 10.6+: named locks with `GET_LOCK` / `RELEASE_LOCK`.
//!
//! Reached through `mysql://` and `mariadb://` URLs (parsed by sqlx's MySQL driver, so
//! its options apply: `?socket=/run/mysqld/mysqld.sock`, `ssl-mode`, `charset`…), or
//! from a pool of yours with [`Locks::from_sqlx_mysql_pool`](crate::Locks::from_sqlx_mysql_pool).
//! The URL (or the pool's connections) must name a database: the database is part of
//! every lock name, and holds the fencing and migration tables.
//!
//! # Lock names
//!
//! `GET_LOCK` names are server-wide, not per database, and at most 64 characters on
//! MySQL. A dblock lock `(namespace, name)` on database `DB` is the named lock
//!
//! ```text
//! dblock:<first 8 hex digits of SHA-256(UTF-8(DB))>:<the Key as 16 hex digits>
//! ```
//!
//! 32 ASCII characters, lower case (MariaDB compares lock names case-insensitively;
//! these never differ by case alone). The [`Key`] is the one PostgreSQL and the embedded
//! backend use, of `(namespace, name)`; the namespace defaults to
//! [`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE) on MySQL (the database, which plays the
//! part PostgreSQL's schema plays, is already in the lock name). [`lock_name`] computes
//! it, `dblock key --db mysql://…/DB NAME` prints it, and an operator finds the holder
//! with
//!
//! ```sql
//! SELECT IS_USED_LOCK('dblock:9f86d081:b1167d87635fc618');      -- the holder's connection id
//! SELECT * FROM performance_schema.metadata_locks                -- MySQL 8
//!  WHERE OBJECT_TYPE = 'USER LEVEL LOCK' AND OBJECT_NAME LIKE 'dblock:%';
//! SELECT * FROM information_schema.METADATA_LOCK_INFO           -- MariaDB, with the
//!  WHERE LOCK_TYPE = 'User lock' AND TABLE_SCHEMA LIKE 'dblock:%'; -- metadata_lock_info plugin
//! ```
//!
//! # The traps, and what dblock does about each
//!
//! - **Re-entrancy.** `GET_LOCK` is re-entrant within a session (and counts). Each held
//!   lock pins a connection of its own for its whole life, so two guards of one process
//!   are two sessions and exclude each other, as on PostgreSQL; one `RELEASE_LOCK`
//!   undoes the one `GET_LOCK`, and the connection goes back to the pool holding
//!   nothing.
//! - **Whole seconds, and no "forever" on MariaDB.** The timeout is in seconds, and
//!   MariaDB answers a negative one (MySQL's "wait forever") with NULL and warning 1411.
//!   dblock waits in `GET_LOCK(name, S)` with `S` one year for an unbounded wait, or the
//!   deadline rounded up plus a second as a server-side backstop, and ends the wait
//!   itself at the exact deadline: `KILL CONNECTION` of the waiting session from a
//!   second connection, whose id dblock read when it opened the connection. The
//!   connection is closed, never reused, so no grant that raced the kill survives and
//!   no kill can hit a later statement. `try_lock` is `GET_LOCK(name, 0)`. Each is one
//!   statement, one round trip. (On a caller's sqlx pool, whose connections' ids are
//!   not known beforehand, the first statement asks for the id with `GET_LOCK(name, 0)`
//!   and a wait follows as a second.)
//! - **Cancellation.** The acquisition runs in the request's own future; dropping it
//!   mid-statement kills the session the same way (from a spawned task) and closes the
//!   connection. Nothing stays held.
//! - **No shared mode.** Named locks are exclusive only. dblock refuses `shared()`
//!   requests with [`Error::Unsupported`] rather than take them exclusively (or grant
//!   readers a lock a writer could take).
//! - **A killed holder** (its process killed, its connection closed) frees its locks:
//!   the server ends the session. **A lost connection** (`KILL CONNECTION`, a restart, a
//!   broken network) is noticed within [`check_interval`](crate::Builder::check_interval)
//!   (the first check of a grant comes between one and 1¼ intervals after it: its task
//!   starts then, so a lock dropped sooner costs none): the lock's task asks the server
//!   whether this session still holds the name (`IS_USED_LOCK(name) = CONNECTION_ID()`)
//!   each interval, and reports the loss through
//!   [`LockGuard::lost`](crate::LockGuard::lost) and
//!   [`is_held`](crate::LockGuard::is_held).
//! - **A silent holder** (its host cut off, its process paused) keeps its session until
//!   the server drops it. [`Request::lease`](crate::Request::lease) bounds that: the
//!   lock's session gets `wait_timeout` = the lease (whole seconds, at least one), so
//!   the server closes it, freeing the lock, once it has been idle that long; a live
//!   holder's checks keep it busy. The pool gets the connection back with the server's
//!   default restored.
//! - **Proxies** that switch server connections between statements (some pools, Vitess)
//!   break `RELEASE_LOCK` and the checks: connect dblock to the server itself.
//!
//! # Migrations
//!
//! [`Migrations`](crate::migrate::Migrations) and `dblock migrate` take the named lock of
//! [`MIGRATION_LOCK_KEY`](crate::migrate::MIGRATION_LOCK_KEY) on the database. MySQL
//! commits DDL implicitly, so a migration and its bookkeeping row cannot share a
//! transaction: each is recorded in `dblock_migrations` as `started` (committed) before
//! its SQL runs and as `done` after. A run that finds a `started` row refuses to go on
//! ([`Error::InvalidMigration`] naming the file) until an operator has checked the
//! schema and either marked it done or deleted the row (`docs/mysql.md`): never run
//! twice silently. Each file is sent as one script; the
//! [`NO_TRANSACTION_HEADER`](crate::migrate::NO_TRANSACTION_HEADER) changes nothing here.
//!
//! Fencing tokens live in the InnoDB table `dblock_fencing` of the database (see
//! [`fencing`](crate::fencing)), incremented on the lock's own connection in autocommit,
//! so committed before the grant returns. Claims of scheduled slots are recorded in
//! `dblock_runs` there (see [`jobs`](crate::jobs)).

mod doctor;
pub(crate) mod fence;
mod floor;
mod leader;
mod lock;
pub(crate) mod migrate;
mod pool;
mod runs;
mod setup;
mod status;

use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, MySqlPool};

use crate::error::{Error, ServerCode, WaitingFor};
use crate::key::Key;
use crate::raw::{
    BenchFloor, BoxFuture, FencingStore, Grant, LatestGrant, Mode, Options, RawLocks, Req,
};

/// Opens dblock's own connections on a `mysql://` or `mariadb://` URL; the default
/// namespace is [`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE).
pub(crate) async fn open(url: &str, opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    let options = read_url(url)?;
    let b = MyBackend::open(options, crate::error::redact_url(url), opts).await?;
    Ok((Box::new(b), crate::DEFAULT_NAMESPACE.to_string()))
}

/// A handle on the caller's sqlx pool.
pub(crate) async fn from_sqlx(
    pool: MySqlPool,
    opts: &Options,
) -> Result<(Box<dyn RawLocks>, String), Error> {
    let b = MyBackend::from_sqlx(pool, opts).await?;
    Ok((Box::new(b), crate::DEFAULT_NAMESPACE.to_string()))
}

/// The `GET_LOCK` name of `key` on database `database`: `dblock:` + the first 8 hex
/// digits of SHA-256 of the database name + `:` + the key as 16 hex digits. Fixed for
/// all versions of dblock: never change it.
///
/// ```
/// use dblock::{Key, mysql::lock_name};
/// let key = Key::new("public", "autoland:7")?;
/// // Pinned: never change this value.
/// assert_eq!(lock_name("test", key), "dblock:9f86d081:b1167d87635fc618");
/// assert!(lock_name(&"x".repeat(64), key).len() <= 64);
/// # Ok::<(), dblock::Error>(())
/// ```
pub fn lock_name(database: &str, key: Key) -> String {
    name_in(&name_prefix(database), key)
}

/// How MySQL/MariaDB shows the lock of `key` on the database of `url`: a named lock.
pub(crate) fn shown_as(url: &str, key: Key) -> Result<crate::status::ShownAs, Error> {
    let database = database_of_url(url)?;
    let name = lock_name(&database, key);
    Ok(crate::status::ShownAs {
        listed_in: "mysql",
        query: format!("SELECT IS_USED_LOCK('{name}');"),
        id: name,
        context: Some(format!("(database {database})")),
    })
}

/// `dblock:<first 8 hex digits of SHA-256(database)>:`, the part of [`lock_name`] that
/// depends on the database only.
pub(crate) fn name_prefix(database: &str) -> String {
    let digest = Sha256::digest(database.as_bytes());
    let mut out = String::with_capacity(16);
    out.push_str("dblock:");
    for b in &digest[..4] {
        out.push_str(&format!("{b:02x}"));
    }
    out.push(':');
    out
}

pub(crate) fn name_in(prefix: &str, key: Key) -> String {
    format!("{prefix}{:016x}", key.as_i64() as u64)
}

/// The database a `mysql://` or `mariadb://` URL names (what [`lock_name`] takes), read
/// from the URL alone, without connecting.
///
/// ```
/// assert_eq!(dblock::mysql::database_of_url("mariadb://app:pw@db:3306/shop?ssl-mode=required")?, "shop");
/// # Ok::<(), dblock::Error>(())
/// ```
///
/// # Errors
///
/// [`Error::InvalidUrl`] for a URL that is not a MySQL one or names no database.
pub fn database_of_url(url: &str) -> Result<String, Error> {
    let invalid = |reason: String| Error::InvalidUrl {
        url: crate::error::redact_url(url),
        reason,
    };
    let scheme = url
        .split(':')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    if scheme != "mysql" && scheme != "mariadb" {
        return Err(invalid("expected mysql://… or mariadb://…".into()));
    }
    let options = parse_url(url).map_err(invalid)?;
    Ok(options.get_database().unwrap_or_default().to_string())
}

/// The backend of a handle on a MySQL or MariaDB database.
pub(crate) struct MyBackend {
    /// The caller's pool, or dblock's own for what is not a lock (the fencing and
    /// migration tables).
    pub(crate) pool: MySqlPool,
    /// dblock's own lock connections (`None` on the caller's pool: locks borrow its
    /// connections).
    own_locks: Option<Arc<pool::OwnPool>>,
    /// A connection or two for `KILL QUERY`, opened on first use.
    control: tokio::sync::OnceCell<MySqlPool>,
    /// The database every lock name includes.
    pub(crate) database: Arc<str>,
    /// Its part of every lock name, hashed once.
    name_prefix: String,
    check_interval: Duration,
    check_timeout: Duration,
    /// Starts the task of each grant held past a check interval (`lock.rs`).
    keeper: Arc<lock::Keeper>,
    /// How many lock connections the handle may have at once (each held name pins one).
    max_lock_conns: usize,
    /// Whether dblock opened the pool itself (the benchmark's floor needs its options).
    pub(crate) own: bool,
    fence_table_ready: tokio::sync::OnceCell<()>,
    runs_table_ready: tokio::sync::OnceCell<()>,
    /// The benchmark's floor, one per handle: its connections, once open, serve every
    /// slice of a run (none is opened inside a timed slice after the warm-up).
    floor: std::sync::OnceLock<Arc<floor::Floor>>,
}

/// The longest wait `GET_LOCK` is asked for when there is no deadline: a year, since
/// MariaDB refuses MySQL's negative "forever".
pub(crate) const FOREVER_SECS: u64 = 365 * 24 * 3600;

impl MyBackend {
    /// Opens dblock's own pool on `options`.
    pub(crate) async fn open(
        options: MySqlConnectOptions,
        shown: String,
        opts: &Options,
    ) -> Result<MyBackend, Error> {
        let Some(database) = options.get_database().map(Arc::<str>::from) else {
            return Err(Error::InvalidUrl {
                url: shown,
                reason: "a mysql:// URL must name a database (mysql://user@host/DATABASE): \
                         lock names include it, and its tables hold fencing tokens"
                    .into(),
            });
        };
        // One connection first, so that an unreachable server or a refused login fails
        // at once (a pool would retry until its acquire timeout).
        let first = tokio::time::timeout(opts.acquire_timeout, options.connect()).await;
        let connect_error = |message: String| Error::Connect {
            target: shown.clone(),
            message,
        };
        match first {
            Ok(Ok(conn)) => {
                let _ = sqlx::Connection::close(conn).await;
            }
            Ok(Err(e)) => return Err(connect_error(e.to_string())),
            Err(_) => {
                return Err(connect_error(format!(
                    "no answer in {:?}",
                    opts.acquire_timeout
                )));
            }
        }
        let pool = MySqlPoolOptions::new()
            .max_connections(u32::try_from(opts.max_connections).unwrap_or(u32::MAX))
            .min_connections(0)
            .acquire_timeout(opts.acquire_timeout)
            // Each lock's task checks its connection while it is held; a ping before
            // every acquisition would add a round trip to every lock.
            .test_before_acquire(false)
            .connect_lazy_with(options.clone());
        let mut b = MyBackend::new(pool, database, opts, true);
        b.own_locks = Some(pool::OwnPool::new(
            options,
            opts.max_connections,
            opts.acquire_timeout,
            opts.check_timeout,
        ));
        Ok(b)
    }

    /// Borrows connections from the caller's pool.
    pub(crate) async fn from_sqlx(pool: MySqlPool, opts: &Options) -> Result<MyBackend, Error> {
        let database: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
            .fetch_one(&pool)
            .await
            .map_err(map_sqlx)?;
        let Some(database) = database else {
            return Err(Error::configuration(
                "the sqlx pool's connections have no database selected; lock names include \
                 the database, and its tables hold fencing tokens",
            ));
        };
        Ok(MyBackend::new(pool, database.into(), opts, false))
    }

    fn new(pool: MySqlPool, database: Arc<str>, opts: &Options, own: bool) -> MyBackend {
        let max_lock_conns = match own {
            true => opts.max_connections.max(1),
            false => pool.options().get_max_connections() as usize,
        };
        MyBackend {
            max_lock_conns,
            pool,
            own_locks: None,
            name_prefix: name_prefix(&database),
            control: tokio::sync::OnceCell::new(),
            database,
            check_interval: opts.check_interval,
            check_timeout: opts.check_timeout,
            keeper: lock::Keeper::new(opts.check_interval),
            own,
            fence_table_ready: tokio::sync::OnceCell::new(),
            runs_table_ready: tokio::sync::OnceCell::new(),
            floor: std::sync::OnceLock::new(),
        }
    }

    /// A connection to take a lock on.
    async fn lock_conn(&self) -> Result<pool::LockConn, Error> {
        match &self.own_locks {
            Some(own) => own.acquire().await,
            None => pool::LockConn::borrow(&self.pool).await,
        }
    }

    /// The TCP port the handle's connections reach the server on.
    pub(crate) fn server_port(&self) -> u16 {
        self.pool.connect_options().get_port()
    }

    /// The `GET_LOCK` name of `key` on this database.
    pub(crate) fn lock_name(&self, key: Key) -> String {
        name_in(&self.name_prefix, key)
    }

    /// Takes the lock `req` asks for: see [`lock`] for the protocol.
    async fn take(&self, req: &Req<'_>) -> Result<Option<Grant>, Error> {
        self.refuse(req)?;
        if req.fenced {
            self.ensure_fence_table().await?;
        }
        lock::acquire(self, req).await
    }

    /// Refuses what named locks cannot do: a shared mode, a lease shorter than the one
    /// lease rule allows.
    fn refuse(&self, req: &Req<'_>) -> Result<(), Error> {
        if req.mode == Mode::Shared {
            return Err(Error::unsupported(
                crate::error::Capability::SharedMode,
                "MySQL and MariaDB named locks (GET_LOCK) have no shared mode; dblock \
                 refuses shared() there rather than grant it exclusively",
            ));
        }
        if let Some(lease) = req.lease {
            // The one lease rule (raw.rs). The session's wait_timeout counts whole
            // seconds: the lease is rounded up (`lease_secs`), never down, so the server
            // idles the session no sooner than the rule allows.
            crate::raw::check_lease(lease, self.check_interval, self.check_timeout)?;
        }
        Ok(())
    }

    /// The pool `KILL QUERY` is sent on: the lock pool's connect options, at most two
    /// connections, so that a kill never waits behind locks for a connection.
    async fn control(&self) -> Result<&MySqlPool, Error> {
        self.control
            .get_or_try_init(|| async {
                let options = (*self.pool.connect_options()).clone();
                Ok(MySqlPoolOptions::new()
                    .max_connections(2)
                    .min_connections(0)
                    .acquire_timeout(self.check_timeout)
                    .connect_lazy_with(options))
            })
            .await
    }

    /// Creates the fencing table if it is missing (once per handle). Looked for first:
    /// `CREATE TABLE IF NOT EXISTS` needs the CREATE privilege even when the table
    /// exists, which a user granted only the table's rows (`dblock setup`) lacks.
    pub(crate) async fn ensure_fence_table(&self) -> Result<(), Error> {
        self.fence_table_ready
            // Boxed, and only when it runs (once per handle): inline, this future would
            // be part of every fenced lock request's.
            .get_or_try_init(|| {
                Box::pin(async {
                    let fix = setup::fix_for(&self.database);
                    let exists: Option<i64> = sqlx::query_scalar(
                        "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() \
                     AND TABLE_NAME = 'dblock_fencing'",
                    )
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(|e| setup::permission(e, &fix))?;
                    if exists.is_some() {
                        return Ok(());
                    }
                    sqlx::raw_sql(fence::TABLE_DDL)
                        .execute(&self.pool)
                        .await
                        .map(|_| ())
                        .map_err(|e| setup::permission(e, &fix))
                })
            })
            .await
            .map(|_| ())
    }

    /// The latest fenced grant of `key`, from the fencing table.
    async fn latest(&self, key: Key) -> Result<Option<LatestGrant>, Error> {
        self.ensure_fence_table().await?;
        fence::latest_grant(&self.pool, key).await
    }
}

impl RawLocks for MyBackend {
    fn name(&self) -> &'static str {
        "mysql"
    }

    fn diagnose(&self) -> BoxFuture<'_, Result<Vec<crate::doctor::Check>, Error>> {
        Box::pin(MyBackend::diagnose(self))
    }

    fn acquire<'a>(&'a self, req: &'a Req<'a>) -> BoxFuture<'a, Result<Option<Grant>, Error>> {
        Box::pin(self.take(req))
    }

    fn acquire_all<'a>(
        &'a self,
        req: &'a Req<'a>,
        keys: &'a [Key],
    ) -> BoxFuture<'a, Result<Option<Grant>, Error>> {
        // One session per name: a set larger than the handle's connections could only
        // take part of itself and then wait, holding that part, for a connection that
        // never comes. Known before anything is taken.
        if keys.len() > self.max_lock_conns {
            let n = keys.len();
            let max = self.max_lock_conns;
            return Box::pin(std::future::ready(Err(Error::configuration(format!(
                "a set of {n} names needs {n} connections on MySQL/MariaDB (one session \
                 holds each name) and this handle may open {max}: raise \
                 Builder::max_connections (or the sqlx pool's max_connections), or lock \
                 fewer names at once"
            )))));
        }
        Box::pin(crate::raw::acquire_all_in_order(self, req, keys))
    }

    fn has_leases(&self) -> bool {
        true
    }

    fn setup<'a>(&'a self, grant_to: &'a [&'a str]) -> BoxFuture<'a, Result<String, Error>> {
        Box::pin(setup::setup(self, grant_to))
    }

    fn bench_floor(&self) -> Result<Arc<dyn BenchFloor>, Error> {
        match self.own {
            true => Ok(self
                .floor
                .get_or_init(|| {
                    Arc::new(floor::Floor::new(
                        (*self.pool.connect_options()).clone(),
                        self.database.clone(),
                    ))
                })
                .clone()),
            false => Err(Error::unsupported(
                crate::error::Capability::Benchmark,
                "the benchmark needs a mysql:// URL, not an sqlx pool",
            )),
        }
    }
}

impl FencingStore for MyBackend {
    fn latest_grant(&self, key: Key) -> BoxFuture<'_, Result<Option<LatestGrant>, Error>> {
        Box::pin(self.latest(key))
    }
}

/// The session `wait_timeout` (whole seconds) of a lease: rounded up, the safe way (the
/// server must not idle a holder's session sooner than the lease), at least one second,
/// and at most MySQL's limit for it (365 days).
pub(crate) fn lease_secs(lease: Duration) -> u64 {
    let whole = lease.as_secs() + u64::from(lease.subsec_nanos() > 0);
    whole.clamp(1, 31_536_000)
}

/// The MySQL error numbers of a deadlock: ER_LOCK_DEADLOCK (InnoDB's, SQLSTATE 40001)
/// and ER_USER_LOCK_DEADLOCK (named locks').
const DEADLOCKS: [u16; 2] = [1213, 3058];

/// An sqlx error as dblock's: a server error keeps its number as its native code and
/// the SQLSTATE the server sent beside it (`ServerCode`).
pub(crate) fn map_sqlx(e: sqlx::Error) -> Error {
    match e {
        sqlx::Error::Database(db) => {
            let number = db
                .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .map(|m| m.number());
            let code = ServerCode::numbered(
                number.map(|n| n.to_string()),
                db.code().map(|c| c.into_owned()),
            );
            let message = db.message().to_string();
            match number {
                Some(n) if DEADLOCKS.contains(&n) => Error::Deadlock { message, code },
                _ => Error::Database { code, message },
            }
        }
        sqlx::Error::PoolTimedOut => Error::Timeout {
            waiting_for: WaitingFor::SqlxPoolConnection,
            after: None,
        },
        sqlx::Error::Io(e) => Error::ConnectionLost {
            message: e.to_string(),
        },
        other => Error::ConnectionLost {
            message: other.to_string(),
        },
    }
}

/// [`parse_url`] with its error as [`Error::InvalidUrl`], password redacted.
pub(crate) fn read_url(url: &str) -> Result<MySqlConnectOptions, Error> {
    parse_url(url).map_err(|reason| Error::InvalidUrl {
        url: crate::error::redact_url(url),
        reason,
    })
}

/// Parses a `mysql://` or `mariadb://` URL.
pub(crate) fn parse_url(url: &str) -> Result<MySqlConnectOptions, String> {
    use std::str::FromStr;
    // sqlx's parser reads the scheme as mysql's; MariaDB's is the same protocol.
    let url = match url.find("://") {
        Some(i) => format!("mysql{}", &url[i..]),
        None => return Err("expected mysql://user@host/DATABASE".into()),
    };
    let options = MySqlConnectOptions::from_str(&url).map_err(|e| e.to_string())?;
    if options.get_database().is_none_or(str::is_empty) {
        return Err(
            "a mysql:// URL must name a database (mysql://user@host/DATABASE): lock names \
             include it, and its tables hold fencing tokens"
                .into(),
        );
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock request's future is allocated for every request and lives while it is in
    /// flight: connecting and sqlx's pool acquisition are boxed where they happen, so
    /// that they do not make every request's future their size (it was 18,344 bytes).
    #[test]
    fn a_lock_requests_future_stays_small() {
        fn future_size<'a, F, Fut>(_: F) -> usize
        where
            F: Fn(&'a MyBackend, &'a Req<'a>) -> Fut,
            Fut: std::future::Future,
        {
            std::mem::size_of::<Fut>()
        }
        let size = future_size(|b: &MyBackend, r: &Req<'_>| b.take(r));
        assert!(size <= 4096, "the request's future is {size} bytes");
    }

    #[test]
    fn lock_names_are_pinned_short_and_per_database() {
        let key = Key::new("public", "autoland:7").unwrap();
        // sha256("test") = 9f86d081…; the key of ("public", "autoland:7") = b1167d87635fc618.
        assert_eq!(lock_name("test", key), "dblock:9f86d081:b1167d87635fc618");
        assert_ne!(lock_name("test", key), lock_name("test2", key));
        assert_ne!(lock_name("test", key), lock_name("Test", key));
        for db in ["", "x", &"é".repeat(64)] {
            let n = lock_name(db, Key::from_i64(i64::MIN));
            assert_eq!(n.len(), 32, "{n}");
            assert_eq!(n, n.to_ascii_lowercase());
        }
        assert_eq!(
            lock_name("test", Key::from_i64(-1)),
            "dblock:9f86d081:ffffffffffffffff"
        );
    }

    #[test]
    fn a_lease_becomes_whole_seconds_rounded_up() {
        assert_eq!(lease_secs(Duration::from_millis(7_700)), 8);
        assert_eq!(lease_secs(Duration::from_secs(8)), 8);
        assert_eq!(lease_secs(Duration::from_nanos(8_000_000_001)), 9);
        assert_eq!(lease_secs(Duration::from_millis(1)), 1);
        assert_eq!(lease_secs(Duration::from_secs(u64::MAX)), 31_536_000);
    }

    #[test]
    fn urls_need_a_database_and_accept_both_schemes() {
        assert_eq!(
            parse_url("mariadb://root@127.0.0.1:3306/test")
                .unwrap()
                .get_database(),
            Some("test")
        );
        assert!(parse_url("mysql://root@127.0.0.1:3306/test?socket=/tmp/s.sock").is_ok());
        assert!(parse_url("mysql://root@127.0.0.1:3306").is_err());
        assert!(parse_url("mysql://root@127.0.0.1:3306/").is_err());
    }
}
