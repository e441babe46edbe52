//! The PostgreSQL backend: advisory locks on connections dblock owns.
//!
//! # Multiplexing
//!
//! One connection per lock is the default — it is what makes a lock cost one round trip
//! and a wait cost nothing on the client — but a process that holds thousands of locks
//! at once would need thousands of connections. With
//! [`Builder::multiplex(n)`](crate::Builder::multiplex), session-scoped locks are taken
//! with `pg_try_advisory_lock` on one of at most `n` shared connections, many locks per
//! connection, each released on its own by `pg_advisory_unlock`:
//!
//! - a key is taken on a shared connection only if this process holds it on none of
//!   them (PostgreSQL's locks are re-entrant per session); a second local request for a
//!   held key goes to a connection of its own, where the server arbitrates;
//! - every request and release of one key goes to the same shared connection (key mod
//!   `n`), which the server serves in order, so a release always precedes a later
//!   request for the key;
//! - a lock that is not free at once is waited for on a connection of its own, never on
//!   a shared one;
//! - requests on shared connections never leave a transaction open, so a failing one
//!   cannot disturb the others; a full server lock table fails the request with
//!   [`Error::LockTableFull`] and every lock already held stays held.
//!
//! Every lock pins one connection for its whole life, so PostgreSQL's re-entrancy
//! (a session may take the lock it already holds) can never make two holders: two
//! tasks of one process asking for one name ask on two sessions, and the server makes
//! one wait. One acquisition is one round trip: the statements it needs go out as one
//! simple-protocol message.

mod conn;
pub mod health;
mod mux;
mod native;
pub mod pooler;
mod setup;
mod sqlx_conn;
pub(crate) mod tls;
pub mod xact;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::locks::{Builder, Grant, Mode, Req, Scope, Wait};
use crate::{Error, Key, LossReason};

pub(crate) use conn::{Armed, Conn, LockSql, QueryError, Release, Results};
use native::Pool;
use pooler::Known;
pub use pooler::Pooler;
pub(crate) use setup::owner_needed;
pub use setup::setup;
use sqlx_conn::SqlxSource;

/// Where a backend's connections come from.
enum Source {
    /// dblock's own pool (tokio-postgres), from a URL.
    Native(Pool),
    /// The caller's sqlx pool.
    Sqlx(SqlxSource),
}

impl Source {
    /// A connection. Waiting for one (all in use) is bounded by the pool's acquire
    /// timeout.
    async fn get(&self) -> Result<Conn, Error> {
        self.get_until(None).await
    }

    /// A connection for a lock request: on dblock's own pool the wait for one to come
    /// free ends at the request's deadline too (an sqlx pool keeps its own bound).
    async fn get_until(&self, deadline: Option<Instant>) -> Result<Conn, Error> {
        match self {
            Source::Native(p) => p.get_until(deadline).await.map(Conn::Native),
            Source::Sqlx(p) => p.get().await.map(Conn::Sqlx),
        }
    }
}

/// The backend of a handle built from a `postgres://` URL.
pub(crate) struct PgBackend {
    source: Source,
    /// Shared connections for session locks, when the handle multiplexes.
    mux: Option<mux::Mux>,
    /// Whether lock requests set `client_connection_check_interval` (sqlx connections
    /// on PostgreSQL 14+: the only way to end a cut-off wait without a cancel request).
    check_disconnect: bool,
    /// `server_version_num`.
    version: u32,
    /// How often held connections are checked (a lease must be longer).
    check_interval: Duration,
    /// How long a check may go unanswered (and a release, before it is given up).
    check_timeout: Duration,
    /// The schema `current_schema()` named when the handle was built (where dblock's
    /// own tables go).
    pub(crate) schema: Option<String>,
    /// Set once the fencing table is known to exist: its qualified name.
    fence_ready: tokio::sync::OnceCell<Arc<str>>,
    /// What lies between dblock and the server ([`Pooler::Detect`] resolved), and how
    /// that is known.
    pub(crate) pooler: (Pooler, Known),
    /// `inet_server_port()` as the first connection saw it (`None` on a Unix socket).
    server_port: Option<u16>,
    /// The role the handle connects as (`current_user`), for the setup command that
    /// permission errors name.
    pub(crate) role: String,
    /// The sessions' own `lock_timeout` (an administrator's, for the role or database),
    /// read when the handle was built: it still ends a wait without a deadline, which
    /// dblock runs in slices of its own `lock_timeout` (see [`WAIT_SLICE_MS`]).
    server_lock_timeout: Option<Duration>,
}

impl PgBackend {
    /// Connects once (so a bad URL or an unreachable server fails here, not at the first
    /// lock) and reads the schema in use and the default namespace
    /// ([`NAMESPACE_SETTING`](crate::NAMESPACE_SETTING), else [`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE)).
    pub(crate) async fn open(
        config: tokio_postgres::Config,
        shown: String,
        tls: tls::Connector,
        opts: &Builder,
    ) -> Result<(PgBackend, String), Error> {
        let pool = Pool::new(
            config,
            shown,
            tls,
            opts.max_connections,
            opts.acquire_timeout,
            opts.check_interval,
            opts.check_timeout,
            opts.pooler,
        );
        let mux = (opts.multiplex > 0).then(|| mux::Mux::new(pool.clone(), opts.multiplex));
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
        opts: &Builder,
    ) -> Result<(PgBackend, String), Error> {
        let source = Source::Sqlx(SqlxSource {
            pool,
            check_interval: opts.check_interval,
            check_timeout: opts.check_timeout,
        });
        if opts.multiplex > 0 {
            return Err(Error::Unsupported(
                "multiplexing needs dblock's own connections (a postgres:// URL), not an sqlx pool"
                    .into(),
            ));
        }
        let (mut b, ns) = PgBackend::finish_open(source, true, opts).await?;
        if opts.pooler != Pooler::Detect {
            b.set_pooler((opts.pooler, Known::Declared));
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
        opts: &Builder,
    ) -> Result<(PgBackend, String), Error> {
        let armed = Armed::new(source.get().await?);
        let rows = armed
            .conn()
            .query(&format!(
                "SELECT current_schema(); SELECT current_setting('server_version_num'); \
                 SELECT current_setting('{}', true); \
                 SELECT (extract(epoch FROM current_setting('lock_timeout')::interval) \
                 * 1000)::bigint; SELECT inet_server_port(); SELECT current_user",
                crate::NAMESPACE_SETTING
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
            .unwrap_or_else(|| crate::DEFAULT_NAMESPACE.to_string());
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
    pub(crate) async fn acquire(&self, req: &Req<'_>) -> Result<Option<Grant>, Error> {
        if let Some(lease) = req.lease {
            // The holder must learn of a loss before the server can end its session and
            // grant the lock to another: a silent connection is declared lost at most
            // two check intervals (a tick skipped behind a slow answer) plus the check
            // timeout after the last check that was answered was sent, and the server
            // idles the session no sooner than `lease` after that check.
            let worst = 2 * self.check_interval + self.check_timeout;
            let noticed = worst + (worst / 10).max(LEASE_SLACK);
            if lease < noticed {
                return Err(Error::Unsupported(format!(
                    "a lease ({lease:?}) must be at least twice the check interval plus the \
                     check timeout, plus a tenth ({noticed:?} here), so that a holder \
                     cut off learns of the loss before the server can grant the lock to \
                     another; lengthen the lease or shorten check_interval/check_timeout"
                )));
            }
            if req.scope == Scope::Session && self.version < 140_000 {
                return Err(Error::Unsupported(
                    "a lease on a session-scoped lock needs PostgreSQL 14 (idle_session_timeout)"
                        .into(),
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
        let fence_table = match req.fenced {
            true => Some(
                self.fence_table_until(req.wait.deadline())
                    .await
                    .map_err(|e| self.fencing_permission(e))?
                    .clone(),
            ),
            false => None,
        };
        if let Some(mux) = self.mux.as_ref().filter(|_| mux::Mux::applies(req)) {
            match mux.try_acquire(req, fence_table.as_ref()).await? {
                mux::Attempt::Granted(g) => return Ok(Some(g)),
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
        // A wait longer than one slice goes round again (see WAIT_SLICE_MS).
        loop {
            let conn = match queued_bound {
                Some(b) => {
                    match tokio::time::timeout_at(b, self.source.get_until(deadline)).await {
                        Ok(c) => c?,
                        Err(_) => return Ok(None),
                    }
                }
                None => self.source.get_until(deadline).await?,
            };
            let plan = Plan::new(
                req,
                fence_table.as_deref(),
                self.check_disconnect,
                self.version >= 120_000,
            );
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
                                waiting_for: "the server to answer a lock request",
                                after: Some(BACKSTOP),
                            });
                        }
                    }
                }
                None => armed.conn().lock_query(&plan.sql, plan.wanted()).await,
            };
            let conn = armed.disarm();
            return match result {
                Ok(firsts) => match plan.outcome(&firsts) {
                    Some(token) => {
                        conn.link().set_holding(true);
                        Ok(Some(Grant {
                            held: crate::guard::Held::Postgres(PgHeld::new(
                                conn,
                                req,
                                self.check_timeout,
                            )),
                            fence: token.zip(fence_table),
                        }))
                    }
                    None => {
                        plan.clean_up(&conn, false);
                        conn.recycle();
                        Ok(None)
                    }
                },
                Err(QueryError::Db { code, message }) => {
                    plan.clean_up(&conn, true);
                    conn.recycle();
                    if code == LOCK_NOT_AVAILABLE {
                        // One slice of the wait ended (see WAIT_SLICE_MS) and the
                        // caller's deadline, if any, is still ahead: wait on, in a new
                        // statement and transaction.
                        let ahead = match req.wait {
                            Wait::Forever => true,
                            Wait::Until(d) => Instant::now() < d,
                            Wait::Try => false,
                        };
                        if plan.sliced && ahead {
                            continue;
                        }
                        return match req.wait {
                            Wait::Forever => Err(Error::Timeout {
                                waiting_for: crate::error::SERVER_LOCK_TIMEOUT,
                                after: None,
                            }),
                            _ => Ok(None),
                        };
                    }
                    if code == QUERY_CANCELED {
                        return Err(Error::Timeout {
                            waiting_for: "the lock (the server cancelled the wait: statement_timeout)",
                            after: None,
                        });
                    }
                    let e = Error::from_sqlstate(&code, message);
                    Err(match req.fenced {
                        true => self.fencing_permission(e),
                        false => e,
                    })
                }
                Err(e @ QueryError::Lost { .. }) => Err(e.into_error()),
            };
        }
    }

    /// The configuration of dblock's own connections, if it uses its own.
    pub(crate) fn native_config(&self) -> Option<(tokio_postgres::Config, tls::Connector)> {
        match &self.source {
            Source::Native(p) => Some((p.config().clone(), p.tls().clone())),
            Source::Sqlx(_) => None,
        }
    }

    /// The latest grant of `key` in the fencing table, if any.
    pub(crate) async fn latest_grant(
        &self,
        key: Key,
    ) -> Result<Option<crate::leader::LeaderInfo>, Error> {
        let table = self.fence_table_until(None).await?.clone();
        let armed = Armed::new(self.source.get().await?);
        // One statement, its three values as three rows in order (unnest keeps the
        // array's order); the connection reads the first column of each row.
        let sql = format!(
            "SELECT unnest(ARRAY[holder, token::text, granted_at::text]) FROM {table} \
             WHERE key = {k}",
            k = key.as_i64()
        );
        let rows = armed
            .conn()
            .query(&sql)
            .await
            .map_err(QueryError::into_error)?;
        armed.disarm().recycle();
        let mut values = rows.into_iter().next().unwrap_or_default().into_iter();
        let (Some(Some(holder)), Some(Some(token)), Some(Some(elected_at))) =
            (values.next(), values.next(), values.next())
        else {
            return Ok(None);
        };
        Ok(Some(crate::leader::LeaderInfo {
            holder,
            token: token.parse().unwrap_or(0),
            elected_at,
        }))
    }

    /// A connection of this handle's own, pinned for the caller (the migration runner):
    /// it must go back through [`Conn::recycle`] only with no lock held and no
    /// transaction open, and through [`Conn::abandon`] (or a dropped [`Armed`]) whenever
    /// that is in doubt.
    pub(crate) async fn pinned(&self) -> Result<Conn, Error> {
        self.source.get().await
    }

    /// The qualified name of the fencing table, created on first use. Creating it waits
    /// for the migration lock: never past `deadline` (the request's), plus [`BACKSTOP`]
    /// for a server that stops answering or another task creating it.
    pub(crate) async fn fence_table_until(
        &self,
        deadline: Option<Instant>,
    ) -> Result<&Arc<str>, Error> {
        if let Some(t) = self.fence_ready.get() {
            return Ok(t);
        }
        let Some(d) = deadline else {
            return self.fence_table(None).await;
        };
        match tokio::time::timeout_at(d + BACKSTOP, self.fence_table(deadline)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                waiting_for: "the fencing table to be created",
                after: None,
            }),
        }
    }

    async fn fence_table(&self, deadline: Option<Instant>) -> Result<&Arc<str>, Error> {
        let table = self
            .fence_ready
            .get_or_try_init(|| async {
                // One table per database, like the keys (not the handle's schema).
                let table = format!(
                    "{}.{}",
                    quote_ident(crate::fencing::PG_SCHEMA),
                    crate::fencing::TABLE
                );
                let armed = Armed::new(self.source.get().await?);
                let rows = armed
                    .conn()
                    .query(&format!(
                        "SELECT to_regclass({}) IS NOT NULL",
                        quote_literal(&table)
                    ))
                    .await
                    .map_err(QueryError::into_error)?;
                if first_value(&rows, 0).as_deref() != Some("t") {
                    // Idempotent DDL is not concurrency-safe: under the migration lock,
                    // waited for the runner's way (no snapshot held while waiting, so a
                    // concurrent CREATE INDEX CONCURRENTLY cannot deadlock with it).
                    let ddl = crate::fencing::pg_table_ddl(&table);
                    crate::migrate::pg::own_ddl(&armed, &ddl, deadline).await?;
                }
                armed.disarm().recycle();
                Ok(Arc::<str>::from(table))
            })
            .await?;
        Ok(table)
    }
}

/// How long past a deadline the client waits for the server's own lock_timeout to
/// answer before giving the connection up.
const BACKSTOP: Duration = Duration::from_secs(2);

/// Behind a pooler, how long past a deadline the client waits for the server's answer
/// before it gives the request up (the server's own lock_timeout normally answers at
/// the deadline; a request still queued in the pooler never would).
const POOLER_GRACE: Duration = Duration::from_millis(100);

const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The least room, beyond the longest time to notice a silent connection, that a lease
/// must leave for scheduling delays on the client (a tenth of that time if more).
const LEASE_SLACK: Duration = Duration::from_millis(50);

/// The longest `lock_timeout`, `idle_in_transaction_session_timeout` or
/// `idle_session_timeout` the server accepts, in milliseconds (2³¹ − 1: about 24.8 days).
const MAX_SERVER_MS: u128 = i32::MAX as u128;

/// The longest one lock-waiting statement runs, in milliseconds; a longer wait is
/// several statements (each in a transaction of its own), one after the other.
///
/// A backend blocked in `pg_advisory_lock` holds a snapshot, and `CREATE INDEX
/// CONCURRENTLY` waits for every transaction holding a snapshot older than its own. So a
/// process that holds a lock others wait for and then runs a CIC migration would wait for
/// those waiters while they wait for it: a deadlock PostgreSQL cannot see, since the
/// edge from the lock to the migration runs through the client. Ending every wait after
/// a slice ends the waiter's transaction, and its next statement's snapshot is newer
/// than the index build's: CIC waits at most about one slice for dblock's waiters. It
/// also keeps every wait within the server's limit on `lock_timeout` (2³¹ − 1 ms).
/// The cost: one round trip per slice of waiting, and a waiter whose slice ends rejoins
/// the server's queue at its end.
const WAIT_SLICE_MS: u128 = 2_000;

/// How long a fenced `try_lock` waits for a previous holder's fenced write to commit.
const FENCED_TRY_ROW_WAIT_MS: u32 = 100;
const QUERY_CANCELED: &str = "57014";

/// The SQL of one acquisition, and how to read its result.
struct Plan {
    sql: LockSql,
    scope: Scope,
    key: Key,
    mode: Mode,
    /// Whether the request set a lease (which the clean-up must undo).
    lease: bool,
    /// The statement whose single boolean row must be `t` for the lock to be held, if
    /// any (a plan has at most one).
    must_be_true: Option<usize>,
    /// Index of the statement returning the fencing token, if any.
    token_at: Option<usize>,
    /// Whether the server's lock_timeout is shorter than the wait asked for.
    sliced: bool,
}

impl Plan {
    /// `chain`: whether the server has `ROLLBACK AND CHAIN` (PostgreSQL 12).
    fn new(req: &Req<'_>, fence_table: Option<&str>, check_disconnect: bool, chain: bool) -> Plan {
        debug_assert!(!req.fenced || fence_table.is_some());
        let mut kbuf = [0u8; 20];
        let k = i64_text(req.key.as_i64(), &mut kbuf);
        let shared = if req.mode == Mode::Shared {
            "_shared"
        } else {
            ""
        };
        // Whole milliseconds left, at least 1 (lock_timeout = 0 would mean "forever"),
        // at most one WAIT_SLICE_MS: a longer wait is asked for again, so that no waiter
        // holds one statement's snapshot for longer than that.
        let mut sliced = false;
        let timeout_ms = match req.wait {
            Wait::Until(t) => {
                // Rounded up: the server must not give up before the deadline.
                let left = t.saturating_duration_since(Instant::now());
                let ms = left.as_micros().div_ceil(1000);
                sliced = ms > WAIT_SLICE_MS;
                if left < Duration::from_millis(1) {
                    None
                } else {
                    Some(ms.min(WAIT_SLICE_MS))
                }
            }
            Wait::Forever => {
                sliced = true;
                Some(WAIT_SLICE_MS)
            }
            Wait::Try => None,
        };
        let try_ =
            req.wait == Wait::Try || (matches!(req.wait, Wait::Until(_)) && timeout_ms.is_none());
        let mut sql = LockSql::new();
        let mut must_be_true = None;
        let mut token_at = None;
        let fenced = req.fenced && fence_table.is_some();
        // A lease beyond the server's limit is capped: it only bounds how long the lock
        // outlives a silent holder, and a live holder's session is never idle that long.
        let lease_ms = req.lease.map(|l| l.as_millis().clamp(1, MAX_SERVER_MS));
        // Lets the server notice, while it waits, that the client went away.
        const CHECK: &str = "client_connection_check_interval";
        let check_ms = 250;
        match (req.scope, fenced) {
            (Scope::Transaction, false) => {
                sql.begin(chain);
                if check_disconnect {
                    sql.push(&[&format!("SET LOCAL {CHECK} = {check_ms}")]);
                }
                if let Some(ms) = lease_ms {
                    sql.push(&[&format!(
                        "SET LOCAL idle_in_transaction_session_timeout = {ms}"
                    )]);
                }
                if let Some(ms) = timeout_ms {
                    sql.push(&[&format!("SET LOCAL lock_timeout = {ms}")]);
                }
                let f = if try_ {
                    "SELECT pg_try_advisory_xact_lock"
                } else {
                    "SELECT pg_advisory_xact_lock"
                };
                let i = sql.push(&[f, shared, "(", k, ")"]);
                if try_ {
                    must_be_true = Some(i);
                }
            }
            (Scope::Session, false) => {
                if let Some(ms) = lease_ms {
                    sql.push(&[&format!(
                        "SELECT set_config('idle_session_timeout', '{ms}', false)"
                    )]);
                }
                if check_disconnect {
                    sql.push(&[&format!("SELECT set_config('{CHECK}', '{check_ms}', true)")]);
                }
                if let Some(ms) = timeout_ms {
                    sql.push(&[&format!("SELECT set_config('lock_timeout', '{ms}', true)")]);
                }
                let f = if try_ {
                    "SELECT pg_try_advisory_lock"
                } else {
                    "SELECT pg_advisory_lock"
                };
                let i = sql.push(&[f, shared, "(", k, ")"]);
                if try_ {
                    must_be_true = Some(i);
                }
            }
            (scope, true) => {
                // The token is committed *while the lock is held* and before the grant is
                // returned: a session lock taken first bridges the commit, so no other
                // holder can come between the increment and the grant.
                let table = fence_table.unwrap_or_default();
                sql.begin(chain);
                // The token must be durable before it is handed out, whatever the
                // server's synchronous_commit: a crash must never reissue a token.
                sql.push(&["SET LOCAL synchronous_commit = on"]);
                if try_ {
                    // A try must not wait long on the fencing row, which a previous
                    // holder's fenced write holds until it commits.
                    sql.push(&[&format!(
                        "SET LOCAL lock_timeout = {FENCED_TRY_ROW_WAIT_MS}"
                    )]);
                }
                if check_disconnect {
                    sql.push(&[&format!("SET LOCAL {CHECK} = {check_ms}")]);
                }
                if let Some(ms) = timeout_ms {
                    sql.push(&[&format!("SET LOCAL lock_timeout = {ms}")]);
                }
                let upsert = format!(
                    "INSERT INTO {table} AS f (key, namespace, name, token, holder, granted_at) \
                     SELECT {k}, {ns}, {name}, 1, {holder}, now() {cond}\
                     ON CONFLICT (key) DO UPDATE SET token = f.token + 1, \
                     holder = EXCLUDED.holder, granted_at = EXCLUDED.granted_at RETURNING token",
                    ns = quote_literal(req.namespace),
                    name = quote_literal(req.name),
                    holder = quote_literal(crate::fencing::holder_id()),
                    cond = if try_ {
                        format!("WHERE pg_try_advisory_lock({k}) ")
                    } else {
                        String::new()
                    },
                );
                if !try_ {
                    sql.push(&["SELECT pg_advisory_lock(", k, ")"]);
                }
                token_at = Some(sql.push(&[&upsert]));
                sql.push(&["COMMIT"]);
                if scope == Scope::Session
                    && let Some(ms) = lease_ms
                {
                    sql.push(&[&format!(
                        "SELECT set_config('idle_session_timeout', '{ms}', false)"
                    )]);
                }
                if scope == Scope::Transaction {
                    sql.begin(false);
                    if let Some(ms) = lease_ms {
                        sql.push(&[&format!(
                            "SET LOCAL idle_in_transaction_session_timeout = {ms}"
                        )]);
                    }
                    // Re-entrant, so immediate when the session lock above was granted;
                    // a try, so it never waits when it was not.
                    must_be_true = Some(sql.push(&["SELECT pg_try_advisory_xact_lock(", k, ")"]));
                    sql.push(&["SELECT pg_advisory_unlock(", k, ")"]);
                }
            }
        }
        Plan {
            sql,
            scope: req.scope,
            key: req.key,
            mode: req.mode,
            lease: req.lease.is_some(),
            must_be_true,
            token_at,
            sliced,
        }
    }

    /// The statements whose first values [`Plan::outcome`] reads.
    fn wanted(&self) -> [Option<usize>; 2] {
        [self.must_be_true, self.token_at]
    }

    /// From the first values of [`Plan::wanted`]: `None` if the lock was not obtained,
    /// `Some(token)` if it was.
    fn outcome(&self, firsts: &[Option<String>; 2]) -> Option<Option<i64>> {
        let [must_be_true, token] = firsts;
        if self.must_be_true.is_some() && must_be_true.as_deref() != Some("t") {
            return None;
        }
        match self.token_at {
            None => Some(None),
            // A fenced try returns no token row when the lock was not free.
            Some(_) => Some(token.as_deref()?.parse::<i64>().ok()),
        }
    }

    /// After a request that did not end with the lock held: leave the connection clean.
    /// `failed`: the request ended in an error, so the state it left is unknown (no
    /// transaction may be open); otherwise it ran to its end, with a transaction-scoped
    /// request's transaction open.
    fn clean_up(&self, conn: &Conn, failed: bool) {
        let sql = match self.scope {
            // A fenced request takes a session lock first (to bridge its token's commit):
            // it survives the ROLLBACK, so unlock it too (a no-op with a warning if the
            // request failed before taking it).
            Scope::Transaction if self.token_at.is_some() => format!(
                "ROLLBACK; {}",
                release_sql(Scope::Session, self.mode, self.key, false)
            ),
            // Ends the transaction, failed or not (a warning if there is none).
            Scope::Transaction => {
                conn.release_soon(Release::Rollback { chain: !failed });
                return;
            }
            // A session lock may have been granted before a later statement failed:
            // unlock it, and end the implicit transaction if one is open. Unlocking a
            // lock not held is a no-op with a warning.
            Scope::Session => format!(
                "ROLLBACK; {}",
                release_sql(Scope::Session, self.mode, self.key, self.lease)
            ),
        };
        conn.fire(&sql);
    }
}

/// `k` in decimal, written into `buf`: a key's text without the formatting machinery.
fn i64_text(k: i64, buf: &mut [u8; 20]) -> &str {
    let mut n = k.unsigned_abs();
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if k < 0 {
        at -= 1;
        buf[at] = b'-';
    }
    // Only ASCII digits and '-' were written.
    std::str::from_utf8(&buf[at..]).unwrap_or_default()
}

/// How many statements [`release_sql`] writes.
fn release_statements(scope: Scope, lease: bool) -> usize {
    match scope {
        Scope::Session if lease => 2,
        _ => 1,
    }
}

/// The statement that releases a held lock.
fn release_sql(scope: Scope, mode: Mode, key: Key, lease: bool) -> Cow<'static, str> {
    if scope == Scope::Session && lease {
        // The lease's idle_session_timeout must not outlive the lock on a pooled session.
        return Cow::Owned(format!(
            "{}; SET idle_session_timeout = DEFAULT",
            release_sql(scope, mode, key, false)
        ));
    }
    let f = match (scope, mode) {
        (Scope::Transaction, _) => return Cow::Borrowed("ROLLBACK"),
        (Scope::Session, Mode::Exclusive) => "SELECT pg_advisory_unlock(",
        (Scope::Session, Mode::Shared) => "SELECT pg_advisory_unlock_shared(",
    };
    let mut kbuf = [0u8; 20];
    let k = i64_text(key.as_i64(), &mut kbuf);
    let mut sql = String::with_capacity(f.len() + k.len() + 1);
    for part in [f, k, ")"] {
        sql.push_str(part);
    }
    Cow::Owned(sql)
}

/// The PostgreSQL half of a guard.
pub(crate) enum PgHeld {
    /// On a connection of its own, pinned for the lock's life.
    Pinned(Pinned),
    /// On one of a multiplexing handle's shared connections.
    Shared(mux::MuxHeld),
}

impl PgHeld {
    fn new(conn: Conn, req: &Req<'_>, release_timeout: Duration) -> PgHeld {
        PgHeld::Pinned(Pinned::new(conn, req, release_timeout))
    }

    pub(crate) fn loss(&self) -> Option<LossReason> {
        match self {
            PgHeld::Pinned(p) => p.loss(),
            PgHeld::Shared(m) => m.loss(),
        }
    }

    pub(crate) fn watch_loss(
        &self,
    ) -> impl std::future::Future<Output = LossReason> + Send + 'static {
        let w = match self {
            PgHeld::Pinned(p) => Some(p.link.watch()),
            PgHeld::Shared(m) => Some(m.link().watch()),
        };
        async move {
            match w {
                Some(w) => w.await,
                None => std::future::pending().await,
            }
        }
    }

    pub(crate) async fn check(&mut self) -> Result<(), Error> {
        match self {
            PgHeld::Pinned(p) => p.check().await,
            PgHeld::Shared(m) => m.check().await,
        }
    }

    pub(crate) async fn release(self) -> Result<(), Error> {
        match self {
            PgHeld::Pinned(p) => p.release().await,
            PgHeld::Shared(m) => m.release().await,
        }
    }
}

/// A lock on a connection of its own.
pub(crate) struct Pinned {
    /// `None` once the connection was given up (a cut-off check): the lock is then lost,
    /// as `link` says.
    conn: Option<Conn>,
    link: Arc<conn::Link>,
    /// The release statement (no allocation for a transaction-scoped lock's).
    release: Cow<'static, str>,
    /// How many statements `release` is.
    release_statements: usize,
    scope: Scope,
    /// How long a release may go unanswered before the connection is given up.
    release_timeout: Duration,
}

impl Pinned {
    fn new(conn: Conn, req: &Req<'_>, release_timeout: Duration) -> Pinned {
        Pinned {
            link: conn.link().clone(),
            conn: Some(conn),
            release: release_sql(req.scope, req.mode, req.key, req.lease.is_some()),
            release_statements: release_statements(req.scope, req.lease.is_some()),
            scope: req.scope,
            release_timeout,
        }
    }

    pub(crate) fn loss(&self) -> Option<LossReason> {
        self.link.loss()
    }

    pub(crate) async fn check(&mut self) -> Result<(), Error> {
        if let Some(reason) = self.link.loss() {
            return Err(Error::LockLost { reason });
        }
        let Some(conn) = self.conn.as_ref() else {
            return Err(Error::Unsupported("the guard was already released".into()));
        };
        // Cancel safe: cut off mid-way, the reply is read and dropped by the connection,
        // which keeps the lock (as on a multiplexing handle's shared connections).
        let res = conn.check().await;
        match (res, self.link.loss()) {
            (_, Some(reason)) => Err(Error::LockLost { reason }),
            (Ok(_), None) => Ok(()),
            (Err(QueryError::Lost { message }), None) => Err(Error::LockLost {
                reason: LossReason::ConnectionClosed { message },
            }),
            (Err(e), None) => Err(e.into_error()),
        }
    }

    pub(crate) async fn release(mut self) -> Result<(), Error> {
        if let Some(reason) = self.link.loss() {
            return Err(Error::LockLost { reason });
        }
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        // Bounded: a server that stops answering must not hold the caller (the watchdog
        // is off once the release starts). Past the bound the connection is given up,
        // which frees the lock on the server when it notices.
        let armed = Armed::new(conn);
        let res =
            match tokio::time::timeout(self.release_timeout, armed.conn().query(&self.release))
                .await
            {
                Ok(res) => res,
                Err(_) => {
                    drop(armed);
                    return Err(Error::LockLost {
                        reason: LossReason::Unresponsive {
                            after: self.release_timeout,
                        },
                    });
                }
            };
        let conn = armed.disarm();
        match res {
            Ok(rows) => {
                // pg_advisory_unlock answers f when the session did not hold the lock.
                let held = self.scope == Scope::Transaction
                    || first_value(&rows, 0).as_deref() == Some("t");
                conn.recycle();
                if held {
                    Ok(())
                } else {
                    Err(Error::LockLost {
                        reason: LossReason::ConnectionClosed {
                            message: "the session no longer held the lock (a pooler between \
                                      dblock and the server may have switched sessions)"
                                .into(),
                        },
                    })
                }
            }
            Err(e) => {
                conn.abandon();
                Err(match e {
                    QueryError::Lost { message } => Error::LockLost {
                        reason: LossReason::ConnectionClosed { message },
                    },
                    other => other.into_error(),
                })
            }
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.link().set_holding(false);
            let release = match self.scope {
                // The lock's transaction is open: a request may chain it.
                Scope::Transaction => Release::Rollback { chain: true },
                Scope::Session => Release::Unlock {
                    sql: std::mem::take(&mut self.release),
                    statements: self.release_statements,
                },
            };
            if conn.release_soon(release) {
                conn.recycle();
            } else {
                conn.abandon();
            }
        }
    }
}

/// The first column of the first row of statement `i`.
pub(crate) fn first_value(rows: &Results, i: usize) -> Option<String> {
    rows.get(i)?.first()?.clone()
}

/// `s` as an SQL string literal, safe whatever `standard_conforming_strings` says.
pub(crate) fn quote_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 3);
    out.push_str("E'");
    for c in s.chars() {
        match c {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// `s` as an SQL identifier.
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Plan {
        fn new_t(req: &Req<'_>, fence_table: Option<&str>) -> Plan {
            Plan::new(req, fence_table, false, true)
        }
    }

    fn req(scope: Scope, mode: Mode, wait: Wait, fenced: bool) -> Req<'static> {
        Req {
            namespace: "public",
            name: "it's",
            key: Key::from_i64(42),
            mode,
            scope,
            wait,
            fenced,
            lease: None,
        }
    }

    #[test]
    fn a_plain_transaction_lock_is_one_message() {
        // A wait is one slice at most (see WAIT_SLICE_MS).
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Forever, false),
            None,
        );
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = 2000; \
             SELECT pg_advisory_xact_lock(42)"
        );
        assert!(p.sliced);
        let p = Plan::new_t(
            &req(Scope::Session, Mode::Exclusive, Wait::Forever, false),
            None,
        );
        assert_eq!(
            p.sql.alone(),
            "SELECT set_config('lock_timeout', '2000', true); SELECT pg_advisory_lock(42)"
        );
        let p = Plan::new_t(&req(Scope::Session, Mode::Shared, Wait::Try, false), None);
        assert_eq!(p.sql.alone(), "SELECT pg_try_advisory_lock_shared(42)");
        assert_eq!(p.must_be_true, Some(0));
    }

    #[test]
    fn a_deadline_becomes_a_server_side_lock_timeout() {
        let until = Instant::now() + Duration::from_secs(5);
        let p = Plan::new_t(
            &req(
                Scope::Transaction,
                Mode::Exclusive,
                Wait::Until(until),
                false,
            ),
            None,
        );
        assert!(
            p.sql.alone().contains("SET LOCAL lock_timeout = "),
            "{}",
            p.sql.alone()
        );
        let p = Plan::new_t(
            &req(Scope::Session, Mode::Exclusive, Wait::Until(until), false),
            None,
        );
        assert!(
            p.sql
                .alone()
                .starts_with("SELECT set_config('lock_timeout', "),
            "{}",
            p.sql.alone()
        );
        // A deadline already past is a try: lock_timeout = 0 would wait forever.
        let p = Plan::new_t(
            &req(
                Scope::Session,
                Mode::Exclusive,
                Wait::Until(Instant::now()),
                false,
            ),
            None,
        );
        assert_eq!(p.sql.alone(), "SELECT pg_try_advisory_lock(42)");
    }

    #[test]
    fn a_fenced_transaction_lock_commits_its_token_under_a_bridging_session_lock() {
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Forever, true),
            Some("\"public\".dblock_fencing"),
        );
        let stmts: Vec<&str> = p.sql.alone().split("; ").collect();
        // The token's commit is durable whatever the server's synchronous_commit.
        assert_eq!(stmts[1], "SET LOCAL synchronous_commit = on");
        assert_eq!(stmts[2], "SET LOCAL lock_timeout = 2000");
        assert_eq!(stmts[3], "SELECT pg_advisory_lock(42)");
        assert!(stmts[4].starts_with("INSERT INTO \"public\".dblock_fencing"));
        assert!(
            stmts[4].contains("E'it''s'"),
            "names are quoted: {}",
            stmts[4]
        );
        assert_eq!(stmts[5], "COMMIT");
        assert_eq!(stmts[7], "SELECT pg_try_advisory_xact_lock(42)");
        assert_eq!(stmts[8], "SELECT pg_advisory_unlock(42)");
        assert_eq!(p.token_at, Some(4));
        assert_eq!(p.must_be_true, Some(7));
        // A fenced try bounds its wait on the fencing row.
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, true),
            Some("\"public\".dblock_fencing"),
        );
        assert!(
            p.sql.alone().contains("SET LOCAL lock_timeout = 100"),
            "{}",
            p.sql.alone()
        );
    }

    #[test]
    fn keys_are_written_in_decimal() {
        let mut buf = [0u8; 20];
        for k in [0, 1, -1, 42, -5686219459067394536, i64::MAX, i64::MIN] {
            assert_eq!(i64_text(k, &mut buf), k.to_string());
        }
    }

    #[test]
    fn a_lock_request_can_carry_a_rollback() {
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
            None,
        );
        assert_eq!(
            p.sql.carrying_rollback(),
            "ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_try_advisory_xact_lock(42)"
        );
        assert_eq!(p.wanted(), [Some(1), None]);
        assert_eq!(p.outcome(&[Some("t".into()), None]), Some(None));
        assert_eq!(p.outcome(&[Some("f".into()), None]), None);
    }

    #[test]
    fn a_session_release_is_carried_in_a_transaction_of_its_own_where_it_must_be() {
        for (mode, lease) in [
            (Mode::Exclusive, false),
            (Mode::Shared, false),
            (Mode::Exclusive, true),
        ] {
            let sql = release_sql(Scope::Session, mode, Key::from_i64(7), lease);
            let statements = release_statements(Scope::Session, lease);
            assert_eq!(sql.split("; ").count(), statements, "{sql}");
            let r = Release::Unlock { sql, statements };
            let p = Plan::new_t(
                &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
                None,
            );
            let (text, skip) = r.carried_by(&p.sql);
            assert!(
                text.starts_with("BEGIN; SELECT pg_advisory_unlock"),
                "{text}"
            );
            let stmts: Vec<&str> = text.split("; ").collect();
            assert_eq!(stmts[skip - 1], "COMMIT");
            assert_eq!(stmts[skip..].join("; "), p.sql.alone());
            // Before a request that begins no transaction, a lone unlock joins its
            // implicit one; a lease's (a SET besides) keeps a transaction of its own.
            let p = Plan::new_t(
                &req(Scope::Session, Mode::Exclusive, Wait::Try, false),
                None,
            );
            let (text, skip) = r.carried_by(&p.sql);
            let stmts: Vec<&str> = text.split("; ").collect();
            assert_eq!(stmts[skip..].join("; "), p.sql.alone());
            if lease {
                assert!(text.starts_with("BEGIN; "), "{text}");
            } else {
                assert_eq!(skip, 1);
                assert!(text.starts_with("SELECT pg_advisory_unlock"), "{text}");
            }
        }
        assert_eq!(release_statements(Scope::Transaction, true), 1);
        assert_eq!(Release::Rollback { chain: true }.sql(), "ROLLBACK");
    }

    #[test]
    fn a_carried_rollback_chains_only_a_transaction_known_to_be_open() {
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
            None,
        );
        let (text, skip) = Release::Rollback { chain: true }.carried_by(&p.sql);
        assert_eq!(
            text,
            "ROLLBACK AND CHAIN; SELECT pg_try_advisory_xact_lock(42)"
        );
        assert_eq!(
            skip, 0,
            "AND CHAIN stands in for the BEGIN: same statements"
        );
        let (text, skip) = Release::Rollback { chain: false }.carried_by(&p.sql);
        assert_eq!(text, format!("ROLLBACK; {}", p.sql.alone()));
        assert_eq!(skip, 1);
        // A server without AND CHAIN, or a request that does not begin a transaction.
        let old = Plan::new(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
            None,
            false,
            false,
        );
        assert_eq!(Release::Rollback { chain: true }.carried_by(&old.sql).1, 1);
        let session = Plan::new_t(
            &req(Scope::Session, Mode::Exclusive, Wait::Try, false),
            None,
        );
        let (text, skip) = Release::Rollback { chain: true }.carried_by(&session.sql);
        assert_eq!(text, "ROLLBACK; SELECT pg_try_advisory_lock(42)");
        assert_eq!(skip, 1);
        // A fenced request chains its first BEGIN only.
        let fenced = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Forever, true),
            Some("\"public\".dblock_fencing"),
        );
        let (text, _) = Release::Rollback { chain: true }.carried_by(&fenced.sql);
        assert!(
            text.starts_with("ROLLBACK AND CHAIN; SET LOCAL synchronous_commit = on; "),
            "{text}"
        );
        assert_eq!(
            text.matches("BEGIN ISOLATION LEVEL READ COMMITTED").count(),
            1
        );
    }

    #[test]
    fn literals_and_identifiers_are_quoted() {
        assert_eq!(quote_literal(r"a'b\c"), r"E'a''b\\c'");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }
}
