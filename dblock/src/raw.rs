//! The raw interface each backend implements, and the request and grant types it
//! speaks: the leaf the friendly API ([`Locks`](crate::Locks),
//! [`LockGuard`](crate::LockGuard), [`Election`](crate::leader::Election),
//! [`Fence`](crate::Fence), the migration runner) is written on once.
//!
//! In the manner of parking_lot's `lock_api`: what every backend does is required by
//! [`RawLocks`] and its supertraits — [`RawLocks::acquire`] (with a [`Wait`]) returning a
//! [`RawHeld`] that releases on drop, releases and waits with [`RawHeld::release`], checks
//! with [`RawHeld::check`] and reports loss ([`RawHeld::loss`], [`RawHeld::lost`]); the
//! latest fenced grant of a key ([`FencingStore`]); who holds and awaits locks, and ending
//! a holder ([`StatusSource`]); the migration runner's side ([`MigrationStore`]); the
//! benchmark's floor ([`RawLocks::bench_floor`]). What
//! only some backends do has a default that says so ([`RawLocks::setup`],
//! [`RawLocks::has_leases`], [`RawLocks::pooler`]). Multiplexing is a PostgreSQL detail
//! behind `acquire` (nothing outside the backend calls it), and settings only one backend
//! reads reach it by name ([`Options::setting`]).
//!
//! A backend is one module that implements these and names none of the modules above
//! it; the handle holds it as `Box<dyn RawLocks>`, made in `target.rs`. A fenced grant's
//! [`Fence`] is defined here too, so that each backend adds its own check to it
//! (`Fence::check_postgres` in the PostgreSQL backend, and so on).

use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::engine::{Engine, Exclusion};
use crate::error::{Capability, Error, LossReason};
use crate::key::Key;
use crate::migrate::store::MigrationStore;

/// A boxed, sendable future: what the object-safe interfaces return.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Whether a lock excludes everyone, or only exclusive holders. Serialized (feature
/// `serde`) as `"exclusive"` or `"shared"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Mode {
    /// One holder at a time (a writer).
    #[default]
    Exclusive,
    /// Any number of shared holders at once, and no exclusive holder (readers).
    Shared,
}

/// How long a PostgreSQL lock lives on its connection. The embedded backend has one
/// kind of lock and ignores this. Serialized (feature `serde`) as `"transaction"` or
/// `"session"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Scope {
    /// A transaction-scoped advisory lock (`pg_advisory_xact_lock`): the guard keeps a
    /// transaction open on its connection and ends it to release. Works behind PgBouncer
    /// in transaction pooling mode. The default.
    #[default]
    Transaction,
    /// A session-scoped advisory lock (`pg_advisory_lock`), released by
    /// `pg_advisory_unlock`. No transaction stays open while it is held, but it is lost
    /// or leaked behind a transaction-pooling PgBouncer.
    Session,
}

/// How long a request waits for a lock someone else holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Until it is granted.
    Forever,
    /// Not at all.
    Try,
    /// Until this instant.
    Until(Instant),
}

impl Wait {
    /// The wait of a request that waits at most `timeout`: none at all for zero (a
    /// `try_lock_for(0)` tries once, as `try_lock` does, rather than racing a deadline
    /// that has passed before the request is sent), for ever past the clock's range.
    pub(crate) fn within(timeout: Duration) -> Wait {
        if timeout.is_zero() {
            return Wait::Try;
        }
        match Instant::now().checked_add(timeout) {
            Some(t) => Wait::Until(t),
            None => Wait::Forever,
        }
    }

    /// The instant after which to give up, if any.
    pub(crate) fn deadline(self) -> Option<Instant> {
        match self {
            Wait::Forever => None,
            Wait::Try => Some(Instant::now()),
            Wait::Until(t) => Some(t),
        }
    }
}

/// One request as the backends see it: the name checked and keyed.
#[derive(Debug, Clone)]
pub(crate) struct Req<'a> {
    pub(crate) namespace: &'a str,
    pub(crate) name: &'a str,
    pub(crate) key: Key,
    pub(crate) mode: Mode,
    pub(crate) scope: Scope,
    pub(crate) wait: Wait,
    pub(crate) fenced: bool,
    pub(crate) lease: Option<Duration>,
    /// The key of the fencing row when it is not `key`: a semaphore's slots share their
    /// name's token. `None` for a plain lock.
    pub(crate) fence_key: Option<Key>,
}

impl Req<'_> {
    /// The key whose fencing row a fenced grant raises.
    pub(crate) fn fence_key(&self) -> Key {
        self.fence_key.unwrap_or(self.key)
    }
}

/// A grant's fencing token, and what it takes to check it. Cheap to clone; it stays
/// valid (and checkable) after the guard is dropped or the lock is lost. See
/// [`fencing`](crate::fencing) for what it guarantees; each backend adds the check of
/// writes to its own database (`Fence::check_postgres`, `check_sqlite`, `check_mysql`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    name: Arc<str>,
    key: Key,
    token: i64,
    /// The fencing table as SQL may name it (schema-qualified on PostgreSQL).
    table: Arc<str>,
    /// The grant's lease, if it had one: on PostgreSQL it also bounds how long a checked
    /// transaction may sit idle holding the name's row (see `check_postgres`).
    lease: Option<Duration>,
}

impl Fence {
    pub(crate) fn new(name: &str, key: Key, granted: Token) -> Fence {
        Fence {
            name: name.into(),
            key,
            token: granted.token,
            table: granted.table,
            lease: granted.lease,
        }
    }

    /// The token: greater than every earlier fenced grant's token for the name (see
    /// [`fencing`](crate::fencing) for its shape on each backend).
    pub fn token(&self) -> i64 {
        self.token
    }

    /// The lock name it was granted for.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lock's key.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The fencing table as the backend's SQL names it.
    pub(crate) fn table(&self) -> &str {
        &self.table
    }

    /// The grant's lease, if it had one.
    pub(crate) fn lease(&self) -> Option<Duration> {
        self.lease
    }

    /// The check's verdict, given the name's latest token as the fencing table has it
    /// (`None`: no row).
    pub(crate) fn stale(&self, latest: Option<i64>) -> Result<(), Error> {
        match latest {
            Some(l) if l == self.token => Ok(()),
            latest => Err(Error::StaleToken {
                name: self.name.to_string(),
                token: self.token,
                latest: latest.unwrap_or(0),
            }),
        }
    }
}

/// A grant as a backend returns it.
pub struct Grant {
    pub(crate) held: Held,
    /// The fencing token, with what checking it needs; `None` for an unfenced grant.
    pub(crate) fence: Option<Token>,
}

/// What a backend hands over with a fenced grant, for its [`Fence`](crate::fencing::Fence).
pub(crate) struct Token {
    /// The token itself.
    pub(crate) token: i64,
    /// The fencing table as SQL names it (schema-qualified on PostgreSQL).
    pub(crate) table: Arc<str>,
    /// The request's lease, which bounds a checked write's idle time on PostgreSQL.
    pub(crate) lease: Option<Duration>,
}

/// What lies between dblock and the PostgreSQL server (see the
/// [`pooler`](crate::postgres::pooler) module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Pooler {
    /// Find out when the handle is built: no pooler, or a pooler taken to pool
    /// transactions. The default.
    #[default]
    Detect,
    /// No pooler: dblock talks to PostgreSQL itself.
    None,
    /// A pooler in session mode: each client connection keeps one server connection.
    Session,
    /// A pooler in transaction mode: each transaction may run on a different server
    /// connection.
    Transaction,
    /// A pooler that pools transactions but *pins* a server connection to its client
    /// while the client holds a session-level advisory lock (RDS Proxy, pgdog with its
    /// lock tracking, Multigres): session-scoped locks work through it, other session
    /// state does not. Only declared (`pooler=pinning`): dblock cannot see pinning from
    /// the client; see docs/poolers.md for each pooler's conditions.
    Pinning,
}

impl Pooler {
    /// The value as the URL parameter spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooler::Detect => "detect",
            Pooler::None => "none",
            Pooler::Session => "session",
            Pooler::Transaction => "transaction",
            Pooler::Pinning => "pinning",
        }
    }

    /// Whether session state survives from one transaction to the next.
    pub(crate) fn keeps_sessions(self) -> bool {
        !matches!(self, Pooler::Transaction | Pooler::Pinning)
    }

    /// Whether a session-level advisory lock keeps its server session while held.
    pub(crate) fn keeps_session_locks(self) -> bool {
        !matches!(self, Pooler::Transaction)
    }

    pub(crate) fn parse(v: &str) -> Result<Pooler, String> {
        match v.to_ascii_lowercase().as_str() {
            "detect" | "" => Ok(Pooler::Detect),
            "none" | "direct" => Ok(Pooler::None),
            "session" => Ok(Pooler::Session),
            "transaction" => Ok(Pooler::Transaction),
            "pinning" => Ok(Pooler::Pinning),
            other => Err(format!(
                "pooler={other}: expected transaction, pinning, session, none or detect"
            )),
        }
    }
}

/// The options of a handle that backends read (set through [`Builder`](crate::Builder)).
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) max_connections: usize,
    pub(crate) acquire_timeout: Duration,
    pub(crate) check_interval: Duration,
    pub(crate) check_timeout: Duration,
    pub(crate) allow_network_filesystem: bool,
    /// Settings only some backends read, by name, as they read their URL's parameters:
    /// the builder's `pooler`, `multiplex` and `application_name` (PostgreSQL's). The core
    /// passes them on without knowing what they mean; a backend reads the ones it has.
    pub(crate) settings: Vec<(&'static str, String)>,
}

impl Options {
    /// The setting `name`, as last set.
    pub(crate) fn setting(&self, name: &str) -> Option<&str> {
        self.settings
            .iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Sets `name` to `value` (a later value wins).
    pub(crate) fn set(&mut self, name: &'static str, value: impl Into<String>) {
        self.settings.retain(|(n, _)| *n != name);
        self.settings.push((name, value.into()));
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_connections: 64,
            acquire_timeout: Duration::from_secs(30),
            check_interval: Duration::from_secs(1),
            check_timeout: Duration::from_secs(5),
            allow_network_filesystem: false,
            settings: Vec::new(),
        }
    }
}

/// The least room, beyond the longest time to notice a silent connection, that a lease
/// must leave for scheduling delays on the client (a tenth of that time if more).
const LEASE_SLACK: Duration = Duration::from_millis(50);

/// The one lease rule, for every backend with leases: the shortest lease with which a
/// holder cut off from the server learns of the loss before the server can end its
/// session and grant the lock to another. A silent connection is declared lost at most
/// two check intervals (a tick skipped behind a slow answer) plus the check timeout
/// after the last check that was answered was sent, and the server idles the session no
/// sooner than the lease after that check; a tenth (at least [`LEASE_SLACK`]) more
/// leaves room for scheduling delays.
pub(crate) fn shortest_lease(check_interval: Duration, check_timeout: Duration) -> Duration {
    let worst = 2 * check_interval + check_timeout;
    worst + (worst / 10).max(LEASE_SLACK)
}

/// Refuses a lease shorter than [`shortest_lease`], with what to change.
pub(crate) fn check_lease(
    lease: Duration,
    check_interval: Duration,
    check_timeout: Duration,
) -> Result<(), Error> {
    let noticed = shortest_lease(check_interval, check_timeout);
    if lease < noticed {
        return Err(Error::invalid_request(format!(
            "a lease ({lease:?}) must be at least twice the check interval plus the check \
             timeout, plus a tenth ({noticed:?} here), so that a holder cut off learns of the \
             loss before the server can grant the lock to another; lengthen the lease or \
             shorten check_interval/check_timeout"
        )));
    }
    Ok(())
}

/// A backend: what every backend does (its supertraits included: fencing tokens read
/// back, leaders' values, status, the record of runs, and the migration runner's store);
/// the few defaults are what only some backends have.
pub(crate) trait RawLocks:
    FencingStore + LeaderStore + StatusSource + RunStore + MigrationStore + Send + Sync + 'static
{
    /// `"postgres"`, `"sqlite"`: what [`Locks::backend_name`](crate::Locks::backend_name)
    /// says.
    fn name(&self) -> &'static str;

    /// Takes a lock as `req` says; `Ok(None)` if the wait ended without it. Dropping the
    /// future leaves no lock held.
    fn acquire<'a>(&'a self, req: &'a Req<'a>) -> BoxFuture<'a, Result<Option<Grant>, Error>>;

    /// [`RawLocks::acquire`] decided at once, without a future, where the backend can:
    /// `Some` with what `acquire` would have answered, or `None` to go through `acquire`
    /// (which then starts over; so `None` must leave nothing held). The embedded file
    /// answers here when the lock is free (no wait, no round trip), so an uncontended
    /// cycle allocates no future. By default `None`.
    fn acquire_now(&self, req: &Req<'_>) -> Option<Result<Option<Grant>, Error>> {
        let _ = req;
        None
    }

    /// Takes any one of `keys` (a semaphore's slots) as `req` says — `req.key` is the
    /// name's own key, which a fenced grant's token is kept under — and says which;
    /// `Ok(None)` if the wait ended without one. Dropping the future leaves nothing held.
    /// By default [`acquire_any_in_turn`]; a backend that can try several keys in one
    /// request overrides it.
    fn acquire_any<'a>(
        &'a self,
        req: &'a Req<'a>,
        keys: &'a [Key],
    ) -> BoxFuture<'a, Result<Option<(usize, Grant)>, Error>> {
        Box::pin(acquire_any_in_turn(self, req, keys))
    }

    /// Takes every one of `keys` (sorted ascending, distinct: the canonical order every
    /// caller uses) as `req` says — all or none; `req.key` is unused. `Ok(None)` if the
    /// wait ended without all of them, holding none. One [`RawHeld`] releases them all.
    /// Dropping the future leaves nothing held. By default [`acquire_all_in_order`]; a
    /// backend that can take several keys in one request overrides it.
    fn acquire_all<'a>(
        &'a self,
        req: &'a Req<'a>,
        keys: &'a [Key],
    ) -> BoxFuture<'a, Result<Option<Grant>, Error>> {
        Box::pin(acquire_all_in_order(self, req, keys))
    }

    /// Whether the server itself frees the lock of a holder silent for longer than
    /// [`Req::lease`] (elections ask for one where it does).
    fn has_leases(&self) -> bool {
        false
    }

    /// What lies between the handle and its server, as detected or declared
    /// ([`Pooler::None`] where there is no server).
    fn pooler(&self) -> Pooler {
        Pooler::None
    }

    /// `dblock doctor`'s checks of this backend's database ([`Locks::doctor`](crate::Locks::doctor)):
    /// what it finds, each with a verdict and, where something is wrong, the fix. An
    /// error only when the database cannot be asked at all. By default one line saying
    /// the backend makes no checks.
    fn diagnose(&self) -> BoxFuture<'_, Result<Vec<crate::doctor::Check>, Error>> {
        let note = crate::doctor::Check::ok(
            "server",
            format!("the {} backend makes no checks of its own", self.name()),
        );
        Box::pin(std::future::ready(Ok(vec![note])))
    }

    /// The PostgreSQL-protocol engine the handle talks to, as named when it opened;
    /// `None` for the other backends.
    fn engine(&self) -> Option<Engine> {
        None
    }

    /// Checks now that an advisory lock taken on one connection stops a try on another,
    /// for each scope. By default refused ([`Capability::ExclusionCheck`]): only
    /// PostgreSQL-protocol servers are checked.
    fn check_exclusion(&self) -> BoxFuture<'_, Result<Exclusion, Error>> {
        Box::pin(std::future::ready(Err(Error::unsupported(
            Capability::ExclusionCheck,
            format!(
                "the {} backend's locks are its own; only PostgreSQL-protocol servers' \
                 advisory locks are checked",
                self.name()
            ),
        ))))
    }

    /// The benchmark's floor on this backend: a fresh set of raw connections (or
    /// descriptors) each call. [`Error::Unsupported`] for a handle that cannot open raw
    /// connections of its own (one on a caller's sqlx pool).
    fn bench_floor(&self) -> Result<Arc<dyn BenchFloor>, Error>;

    /// The one-time setup for roles that may not create dblock's tables: creates them and
    /// grants `grant_to` what fenced locks and claims of slots need; what was made ready,
    /// as SQL names it (tables separated by `, `). By
    /// default refused: a backend that creates its tables on first use has none to do.
    fn setup<'a>(&'a self, grant_to: &'a [&'a str]) -> BoxFuture<'a, Result<String, Error>> {
        let _ = grant_to;
        Box::pin(std::future::ready(Err(Error::unsupported(
            Capability::Setup,
            format!(
                "the {} backend has no setup to do: it creates its tables on first use \
                 (setup is for PostgreSQL and MySQL roles that may not create tables)",
                self.name()
            ),
        ))))
    }
}

/// The backend half of a guard: releases the lock when dropped (without waiting).
pub(crate) trait RawHeld: Send + Sync + 'static {
    /// Why the lock was lost, once it is known to be; `None` while it is held.
    fn loss(&self) -> Option<LossReason>;

    /// Resolves when the lock is lost; never, for a backend whose locks cannot be.
    fn lost(&self) -> BoxFuture<'static, LossReason>;

    /// Checks with the database, now, that the lock is still held.
    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>>;

    /// Releases and waits for the database to confirm it.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>>;

    /// Duplicates of the descriptors that keep this lock held for as long as any copy
    /// of them is open (the lock's connection's socket, the lock file's open file
    /// description), for a child process to inherit
    /// ([`LockGuard::share_with_child`](crate::LockGuard::share_with_child)). From the
    /// first call on, the lock's connection is never reused: when the lock ends it is
    /// shut down (`shutdown(2)`, which ends it for every copy) rather than returned to a
    /// pool. [`Error::Unsupported`] where no descriptor keeps the lock alive.
    fn share(&mut self) -> BoxFuture<'_, Result<Vec<OwnedFd>, Error>> {
        Box::pin(std::future::ready(Err(Error::unsupported(
            Capability::ShareWithChild,
            "this kind of lock is not held by a descriptor a child process could inherit",
        ))))
    }
}

/// The backend half of a guard, as the guard keeps it: a half of the backend's own,
/// boxed, or an entry of a table the backend keeps for the handle, which costs no
/// allocation per grant.
pub(crate) enum Held {
    /// A backend's own half (PostgreSQL's and MySQL's connections).
    Boxed(Box<dyn RawHeld>),
    /// An entry of a table (the embedded backend's: a key of the lock file's table).
    Entry(Entry),
}

/// A held lock that is an entry of its backend's table ([`RawTable`]): released through
/// the table when dropped (without waiting), unless [`Held::release`] released it.
pub(crate) struct Entry {
    table: Arc<dyn RawTable>,
    entry: u64,
    mode: Mode,
    released: bool,
}

impl Entry {
    /// The lock `entry`, held in `mode`, of `table`.
    pub(crate) fn new(table: Arc<dyn RawTable>, entry: u64, mode: Mode) -> Entry {
        Entry {
            table,
            entry,
            mode,
            released: false,
        }
    }

    /// Keeps the drop from releasing the lock: for a lock handed to a task that had
    /// gone, which the table then releases itself.
    pub(crate) fn disarm(&mut self) {
        self.released = true;
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if !self.released {
            self.table.release(self.entry, self.mode);
        }
    }
}

/// A backend's table of held locks, each an entry ([`Entry`]): what [`RawHeld`] does
/// for a half of its own, for one entry.
pub(crate) trait RawTable: Send + Sync + 'static {
    /// Why the lock `entry` was lost, once it is known to be; `None` while it is held.
    fn loss(&self, entry: u64) -> Option<LossReason>;

    /// Resolves when the lock `entry` is lost; never, for a table whose locks cannot be
    /// lost but through [`RawTable::loss`].
    fn lost(&self, entry: u64) -> BoxFuture<'static, LossReason>;

    /// Releases the lock `entry`, held in `mode`, without waiting.
    fn release(&self, entry: u64, mode: Mode);

    /// As [`RawHeld::share`], for the lock `entry`.
    fn share(&self, entry: u64) -> Result<Vec<OwnedFd>, Error>;
}

impl Held {
    /// A backend's own half, boxed.
    pub(crate) fn boxed(held: impl RawHeld) -> Held {
        Held::Boxed(Box::new(held))
    }

    /// As [`RawHeld::loss`].
    pub(crate) fn loss(&self) -> Option<LossReason> {
        match self {
            Held::Boxed(h) => h.loss(),
            Held::Entry(e) => e.table.loss(e.entry),
        }
    }

    /// As [`RawHeld::lost`].
    pub(crate) fn lost(&self) -> BoxFuture<'static, LossReason> {
        match self {
            Held::Boxed(h) => h.lost(),
            Held::Entry(e) => e.table.lost(e.entry),
        }
    }

    /// As [`RawHeld::check`]; an entry's is its table's [`RawTable::loss`].
    pub(crate) fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        match self {
            Held::Boxed(h) => h.check(),
            Held::Entry(e) => Box::pin(std::future::ready(lost_or_ok(e.table.loss(e.entry)))),
        }
    }

    /// As [`RawHeld::release`]; an entry is released at once, and reports a loss its
    /// table knew of before.
    pub(crate) fn release(self) -> BoxFuture<'static, Result<(), Error>> {
        match self {
            Held::Boxed(h) => h.release(),
            Held::Entry(mut e) => {
                let loss = e.table.loss(e.entry);
                e.released = true;
                e.table.release(e.entry, e.mode);
                Box::pin(std::future::ready(lost_or_ok(loss)))
            }
        }
    }

    /// As [`RawHeld::share`].
    pub(crate) fn share(&mut self) -> BoxFuture<'_, Result<Vec<OwnedFd>, Error>> {
        match self {
            Held::Boxed(h) => h.share(),
            Held::Entry(e) => Box::pin(std::future::ready(e.table.share(e.entry))),
        }
    }
}

/// `Ok` for no loss, [`Error::LockLost`] for one.
fn lost_or_ok(loss: Option<LossReason>) -> Result<(), Error> {
    match loss {
        None => Ok(()),
        Some(reason) => Err(Error::LockLost { reason }),
    }
}

/// How long a wait for any of several keys waits on one of them before it tries them
/// all again: the longest a slot freed while every waiter waits on another stays
/// unused. Each slice is a request (a round trip on a server) per waiter.
pub(crate) const ANY_SLICE: Duration = Duration::from_millis(500);

/// Where a request for any of `n` keys starts (and first waits): one key on from the
/// process's previous request, from an offset scrambled from the process id. So a
/// process's waiters spread evenly over the keys (each freed key likely has one waiting
/// on it), and processes do not all start at the first key.
pub(crate) fn any_start(n: usize) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let seed = (std::process::id() as usize).wrapping_mul(0x9E37_79B9) >> 7;
    seed.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
        .checked_rem(n)
        .unwrap_or(0)
}

/// Takes any one of `keys` with one plain request per key: tries each (from a rotated
/// start) without waiting, then waits on one of them for at most [`ANY_SLICE`] (a
/// different one each round, in the backend's own line of waiters), and again, until a
/// key is granted or `req`'s wait ends. Each request leaves nothing held when it is not
/// granted or is dropped, so neither does this.
pub(crate) async fn acquire_any_in_turn<B: RawLocks + ?Sized>(
    backend: &B,
    req: &Req<'_>,
    keys: &[Key],
) -> Result<Option<(usize, Grant)>, Error> {
    let n = keys.len();
    if n == 0 {
        return Err(Error::invalid_request("a request for any of no keys"));
    }
    let deadline = req.wait.deadline();
    let mut start = any_start(n);
    loop {
        for i in 0..n {
            let slot = (start + i) % n;
            let one = Req {
                key: keys[slot],
                fence_key: Some(req.fence_key()),
                wait: Wait::Try,
                ..req.clone()
            };
            if let Some(g) = backend.acquire(&one).await? {
                return Ok(Some((slot, g)));
            }
        }
        let now = Instant::now();
        let until = match deadline {
            Some(d) if d <= now => return Ok(None),
            Some(d) => d.min(now + ANY_SLICE),
            None => now + ANY_SLICE,
        };
        let one = Req {
            key: keys[start],
            fence_key: Some(req.fence_key()),
            wait: Wait::Until(until),
            ..req.clone()
        };
        if let Some(g) = backend.acquire(&one).await? {
            return Ok(Some((start, g)));
        }
        start = (start + 1) % n;
    }
}

/// Takes every one of `keys` with one plain request per key, in their order (ascending:
/// two requests for overlapping sets meet at their lowest common key, and the one that
/// gets it first gets the rest as they are freed, so neither waits for the other in a
/// cycle), each with `req`'s wait (one deadline for all). Stops at the first key not
/// granted, or error, releasing those taken (dropping them).
pub(crate) async fn acquire_all_in_order<B: RawLocks + ?Sized>(
    backend: &B,
    req: &Req<'_>,
    keys: &[Key],
) -> Result<Option<Grant>, Error> {
    let mut held = Vec::with_capacity(keys.len());
    for &key in keys {
        let one = Req {
            key,
            fenced: false,
            fence_key: None,
            ..req.clone()
        };
        match backend.acquire(&one).await? {
            Some(g) => held.push(g.held),
            None => return Ok(None),
        }
    }
    Ok(Some(Grant {
        held: Held::boxed(HeldAll(held)),
        fence: None,
    }))
}

/// Several held locks as one: released together, lost when any of them is.
pub(crate) struct HeldAll(pub(crate) Vec<Held>);

impl RawHeld for HeldAll {
    fn loss(&self) -> Option<LossReason> {
        self.0.iter().find_map(|h| h.loss())
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        let mut all: Vec<_> = self.0.iter().map(|h| h.lost()).collect();
        Box::pin(std::future::poll_fn(move |cx| {
            for f in &mut all {
                if let std::task::Poll::Ready(r) = f.as_mut().poll(cx) {
                    return std::task::Poll::Ready(r);
                }
            }
            std::task::Poll::Pending
        }))
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            for h in &mut self.0 {
                h.check().await?;
            }
            Ok(())
        })
    }

    fn share(&mut self) -> BoxFuture<'_, Result<Vec<OwnedFd>, Error>> {
        Box::pin(async move {
            let mut fds = Vec::new();
            for h in &mut self.0 {
                fds.extend(h.share().await?);
            }
            Ok(fds)
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        // All at once; every one is released whatever the others answer, and the first
        // error is reported.
        let all = futures_util::future::join_all(self.0.into_iter().map(|h| h.release()));
        Box::pin(async move { all.await.into_iter().collect() })
    }
}

/// [`Party::since`] as `since_ms`: milliseconds since the Unix epoch, or `null`.
#[cfg(feature = "serde")]
fn serialize_unix_ms<S: serde::Serializer>(
    since: &Option<std::time::SystemTime>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match since {
        Some(t) => s.serialize_u128(
            t.duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis(),
        ),
        None => s.serialize_none(),
    }
}

/// One lock as [`Locks::status`](crate::Locks::status) sees it: its key, its name when
/// known, who holds it and who waits for it. Serialized (feature `serde`) as one of the
/// `locks` of `dblock status --json` (`docs/status.md`), without the parties' `for_ms`,
/// which only a status report (`dblock::status::Report`) knows the time for.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct LockStatus {
    /// The key the server knows the lock by.
    pub key: Key,
    /// The namespace the name is keyed in, when known.
    pub namespace: Option<String>,
    /// The lock's name, when known (`None` for a lock taken without dblock, or whose
    /// name the server could not show). For a semaphore's slot, the semaphore's name.
    pub name: Option<String>,
    /// Which slot of the semaphore `name` this lock is (see
    /// [`Locks::semaphore`](crate::Locks::semaphore)); `None` for a lock of its own name.
    pub slot: Option<u32>,
    /// Who holds it (several for a shared lock).
    pub holders: Vec<Party>,
    /// Who waits for it, longest waiting first.
    pub waiters: Vec<Party>,
}

/// A holder of a lock, or a waiter for one: what is known of its process and its
/// connection. Serialized (feature `serde`) with `since` as `since_ms`, milliseconds
/// since the Unix epoch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Party {
    /// Exclusive or shared.
    pub mode: Mode,
    /// Transaction or session scope, where the backend has the distinction and it is
    /// known.
    pub scope: Option<Scope>,
    /// The host its process runs on.
    pub host: Option<String>,
    /// Its operating-system process id.
    pub pid: Option<u32>,
    /// Its program (or the `application_name` it gave, when that is not dblock's).
    pub program: Option<String>,
    /// The server's id for its connection: PostgreSQL's backend pid, MySQL's connection
    /// id.
    pub connection: Option<i64>,
    /// The client address and port the server sees.
    pub client: Option<String>,
    /// When it was granted the lock (a holder) or began to wait (a waiter).
    #[cfg_attr(
        feature = "serde",
        serde(rename = "since_ms", serialize_with = "serialize_unix_ms")
    )]
    pub since: Option<SystemTime>,
}

/// A name asked about: namespace, name and its key.
pub(crate) type Asked<'a> = (&'a str, &'a str, Key);

/// Who holds and awaits locks, and ending a holder's session (`dblock status`, `dblock
/// release --force`): every backend can tell (on the embedded backend, ending a holder is
/// refused: its locks belong to the holding process).
pub(crate) trait StatusSource: Send + Sync {
    /// The locks of `asked` (held or awaited), or with `asked` empty every lock the
    /// backend can list.
    fn status<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>>;

    /// Ends the sessions holding `asked`'s lock; who was ended (empty: nobody held it).
    fn terminate<'a>(&'a self, asked: Asked<'a>) -> BoxFuture<'a, Result<Vec<Party>, Error>>;

    /// Every lock the backend can list, as [`status`](StatusSource::status) with nothing
    /// asked, and besides them the locks of `asked` — where a backend lists only what it
    /// is asked for (MySQL's holders nobody waits for) or shows an unnamed lock by another
    /// key (the embedded backend's byte offset) — each once, under its key. The fleet's
    /// view reads this once a scrape: everything, with the names the operator labels.
    fn status_all<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>>;
}

/// The latest fenced grant of a key, as the fencing table records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LatestGrant {
    pub(crate) holder: String,
    pub(crate) token: i64,
    pub(crate) granted_at: String,
}

/// Where a backend keeps fencing tokens, read back (leader queries): every backend has a
/// fencing table.
pub(crate) trait FencingStore: Send + Sync {
    /// The latest fenced grant of `key`, if any.
    fn latest_grant(&self, key: Key) -> BoxFuture<'_, Result<Option<LatestGrant>, Error>>;
}

/// The table of dblock's own that records each claim of a scheduled slot (see
/// [`jobs`](crate::jobs)): `dblock_runs`, beside the fencing table.
pub(crate) const RUNS_TABLE: &str = "dblock_runs";

/// One claim of a slot of a name, as the record of runs keeps it (see
/// [`jobs`](crate::jobs)): which slot, who claimed it and when, and how the run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Run {
    /// The namespace the name is keyed in.
    pub namespace: String,
    /// The name.
    pub name: String,
    /// The slot: a period's boundary on the database's clock (RFC 3339, UTC), or the
    /// text the claimant named it by.
    pub slot: String,
    /// 1 for the first claim of the slot; one more each time a later process took it
    /// over after a failure or a death (`retry_failed`).
    pub attempt: u32,
    /// The host of the process that claimed it.
    pub host: String,
    /// Its operating-system process id.
    pub pid: u32,
    /// Its program (the file name of its executable).
    pub program: String,
    /// When it claimed the slot, on the database's clock.
    pub started: SystemTime,
    /// When its outcome was recorded, on the database's clock; `None` while there is
    /// none.
    pub finished: Option<SystemTime>,
    /// The outcome recorded: 0 for success, anything else a failure (`dblock run`
    /// records its own exit code for the run); `None` while there is none.
    pub exit_code: Option<i32>,
}

/// How a claimed run ended, as far as the record says (see [`Run::outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// No outcome recorded: the run is under way, or its claimant died, lost its lock or
    /// dropped its guard without finishing (while the name's lock is free, one of these).
    Unfinished,
    /// Recorded with exit code 0.
    Succeeded,
    /// Recorded with a non-zero exit code.
    Failed {
        /// The exit code recorded.
        exit_code: i32,
    },
}

impl Run {
    /// How it ended, as far as the record says.
    pub fn outcome(&self) -> Outcome {
        match self.exit_code {
            _ if self.finished.is_none() => Outcome::Unfinished,
            Some(0) => Outcome::Succeeded,
            Some(exit_code) => Outcome::Failed { exit_code },
            None => Outcome::Unfinished,
        }
    }

    /// `program[pid]@host`: who claimed it.
    pub fn holder(&self) -> String {
        format!("{}[{}]@{}", self.program, self.pid, self.host)
    }
}

/// A [`Run`] as the stores read it: slot, namespace, name, attempt, host, pid, program,
/// started and finished (microseconds since the Unix epoch), exit code.
pub(crate) type RunRow = (
    String,
    String,
    String,
    i64,
    String,
    i64,
    String,
    i64,
    Option<i64>,
    Option<i64>,
);

impl Run {
    /// The run a store's row describes (numbers out of range read as 0, or `i32::MAX`
    /// for an exit code).
    pub(crate) fn from_row(r: RunRow) -> Run {
        Run {
            slot: r.0,
            namespace: r.1,
            name: r.2,
            attempt: u32::try_from(r.3).unwrap_or(0),
            host: r.4,
            pid: u32::try_from(r.5).unwrap_or(0),
            program: r.6,
            started: from_unix_micros(r.7),
            finished: r.8.map(from_unix_micros),
            exit_code: r.9.map(|c| i32::try_from(c).unwrap_or(i32::MAX)),
        }
    }
}

/// A claim about to be recorded: the name's key and names, the slot, and this process.
#[derive(Debug, Clone)]
pub(crate) struct NewClaim<'a> {
    pub(crate) key: Key,
    pub(crate) namespace: &'a str,
    pub(crate) name: &'a str,
    pub(crate) slot: &'a str,
    pub(crate) host: &'a str,
    pub(crate) pid: u32,
    pub(crate) program: &'a str,
}

/// A time as microseconds since the Unix epoch, as the stores read and write it (before
/// the epoch: the epoch).
pub(crate) fn from_unix_micros(us: i64) -> SystemTime {
    std::time::UNIX_EPOCH + Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

/// The record of claimed slots and their runs (`dblock_runs`, see
/// [`jobs`](crate::jobs)), and the database's clock that decides slots: every backend
/// keeps one, created on first use (and by [`RawLocks::setup`] where roles may not create
/// tables). The claim algorithm is the friendly layer's (`jobs.rs`); a store only reads
/// and writes rows, each call one atomic statement.
pub(crate) trait RunStore: Send + Sync {
    /// The database's clock now (PostgreSQL `clock_timestamp()`, MySQL
    /// `UTC_TIMESTAMP(6)`; the host's on the embedded backend).
    fn db_clock(&self) -> BoxFuture<'_, Result<SystemTime, Error>>;

    /// Records `claim` as attempt 1 of its slot unless the slot has a claim already:
    /// whether this call recorded it (the unique key on (key, slot) decides).
    fn insert_claim<'a>(&'a self, claim: &'a NewClaim<'a>) -> BoxFuture<'a, Result<bool, Error>>;

    /// The claim of `slot` of `key`, if any.
    fn read_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
    ) -> BoxFuture<'a, Result<Option<Run>, Error>>;

    /// Takes the slot's claim over for `claim`'s process if it is still attempt `seen`
    /// and has failed or has no outcome: the new attempt's number, or `None` if the row
    /// is no longer so (one statement: compare and set).
    fn retake_claim<'a>(
        &'a self,
        claim: &'a NewClaim<'a>,
        seen: u32,
    ) -> BoxFuture<'a, Result<Option<u32>, Error>>;

    /// Records `exit_code` and the time as the outcome of attempt `attempt` of the slot,
    /// if that attempt is still the slot's claim and has no outcome yet: whether it did.
    fn finish_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
        attempt: u32,
        exit_code: i32,
    ) -> BoxFuture<'a, Result<bool, Error>>;

    /// The `limit` most recent claims of `key`, newest first.
    fn recent_runs(&self, key: Key, limit: u32) -> BoxFuture<'_, Result<Vec<Run>, Error>>;

    /// Deletes the claims of `key` older than its `keep` most recent ones.
    fn prune_runs(&self, key: Key, keep: u32) -> BoxFuture<'_, Result<(), Error>>;
}

/// One term of an election (a fenced name) as the fencing table records it, with the
/// value its leader published for it ([`LeaderStore`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TermRecord {
    pub(crate) key: Key,
    pub(crate) namespace: String,
    pub(crate) name: String,
    /// `host:pid` of the process granted the term.
    pub(crate) holder: String,
    pub(crate) token: i64,
    /// When the term was granted, by the server's clock (the embedded backend's: this
    /// host's).
    pub(crate) granted_at: Option<SystemTime>,
    /// What the term's leader published, if it published anything in this term.
    pub(crate) value: Option<String>,
}

/// The longest value a leader may publish, in bytes.
pub(crate) const MAX_LEADER_VALUE: usize = 8192;

/// Refuses a value no backend can keep alike: too long, or holding NUL (PostgreSQL's
/// text cannot).
pub(crate) fn check_leader_value(value: &str) -> Result<(), Error> {
    if value.len() > MAX_LEADER_VALUE || value.contains('\0') {
        return Err(Error::InvalidRequest {
            reason: format!(
                "a leader's value is at most {MAX_LEADER_VALUE} bytes of text without NUL (this \
             one is {} bytes{})",
                value.len(),
                if value.contains('\0') {
                    ", with NUL"
                } else {
                    ""
                }
            ),
        });
    }
    Ok(())
}

/// Leaders' values: a leader publishes one for its term (an address, say), and any
/// process reads the latest terms with their values without campaigning. Every backend
/// keeps them in a table of its own beside the fencing table (`dblock_leaders`), keyed
/// like it; a value counts only for the term whose token it was published with.
pub(crate) trait LeaderStore: Send + Sync {
    /// Publishes `value` for the term `fence` was granted, if that term is still the
    /// name's latest fenced grant ([`Error::StaleToken`] otherwise): a deposed leader
    /// never overwrites its successor's value. Creates the table on first use.
    fn publish<'a>(&'a self, fence: &'a Fence, value: &'a str) -> BoxFuture<'a, Result<(), Error>>;

    /// The latest terms of the names of `keys`, and of every fenced name in namespace
    /// `.0` beginning with `.1` for each of `prefixes`; each with the value published
    /// for that term. Reads only: no table yet means no term (or no value).
    fn terms<'a>(
        &'a self,
        keys: &'a [Key],
        prefixes: &'a [(&'a str, &'a str)],
    ) -> BoxFuture<'a, Result<Vec<TermRecord>, Error>>;
}

/// The condition of a [`LeaderStore::terms`] read on a backend that binds `?`
/// parameters — each key, then for each prefix its namespace, its length in characters
/// and itself — over the fencing table aliased `f`, whose key column SQL names `key`;
/// `head` is the backend's first `?` characters of `f.name` (`LEFT(f.name, ?)`). `None`
/// when nothing is asked.
pub(crate) fn terms_condition(
    keys: usize,
    prefixes: usize,
    key: &str,
    head: &str,
) -> Option<String> {
    let mut cond: Vec<String> = Vec::new();
    if keys > 0 {
        cond.push(format!("f.{key} IN ({})", vec!["?"; keys].join(",")));
    }
    for _ in 0..prefixes {
        cond.push(format!("(f.namespace = ? AND {head} = ?)"));
    }
    (!cond.is_empty()).then(|| cond.join(" OR "))
}

/// The table leaders publish their values in, beside the fencing table.
pub(crate) const LEADERS_TABLE: &str = "dblock_leaders";

/// What one worker's timed loop did: its cycles, and the latencies of the timed ones
/// (one in [`BenchRun::TIME_EVERY`]), in microseconds.
pub(crate) struct BenchCycles {
    /// Cycles run, timed or not.
    pub(crate) cycles: u64,
    /// The timed cycles' latencies.
    pub(crate) latencies_us: Vec<f64>,
}

/// A cycle's clock, started only on the cycles [`BenchRun::drive`] times.
pub(crate) struct CycleClock(Option<Instant>);

impl CycleClock {
    /// Reads the clock when `timed`; else nothing.
    pub(crate) fn start(timed: bool) -> CycleClock {
        CycleClock(timed.then(Instant::now))
    }

    /// The time since `start`, or zero when the cycle is not timed.
    pub(crate) fn elapsed(&self) -> Duration {
        self.0.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

/// One timed loop of `dblock bench`, the same for dblock's workers and the floor's: until
/// `stop`, one cycle after another, one in [`BenchRun::TIME_EVERY`] timed, yielding every
/// `yield_every`.
#[derive(Clone, Copy)]
pub(crate) struct BenchRun {
    /// When the loop stops (checked before each group of [`BenchRun::TIME_EVERY`] cycles).
    pub(crate) stop: Instant,
    /// How many cycles between yields to the runtime (see `bench::YIELD_EVERY`).
    pub(crate) yield_every: u64,
}

impl BenchRun {
    /// Runs `cycle(i, timed)` for i = 0, 1, … until `stop`: every cycle counted, one in
    /// [`BenchRun::TIME_EVERY`] timed (`timed`: the cycle reads the clock around its lock
    /// with a [`CycleClock`] and returns the latency; the others read no clock and return
    /// zero, ignored). The stop is checked before each group of `TIME_EVERY` cycles, and
    /// the timed cycle is the group's [`BenchRun::TIMED_PHASE`]th, never a worker's first
    /// (which may carry what starting a slice costs: a connection taken, a queue formed).
    pub(crate) async fn drive<F, Fut>(self, mut cycle: F) -> Result<BenchCycles, Error>
    where
        F: FnMut(u64, bool) -> Fut,
        Fut: Future<Output = Result<Duration, Error>>,
    {
        let mut latencies_us = Vec::with_capacity(1 << 14);
        let mut i = 0u64;
        loop {
            let phase = i % Self::TIME_EVERY;
            if phase == 0 && Instant::now() >= self.stop {
                break;
            }
            let timed = phase == Self::TIMED_PHASE;
            let d = cycle(i, timed).await?;
            if timed {
                latencies_us.push(d.as_secs_f64() * 1e6);
            }
            i += 1;
            if i.is_multiple_of(self.yield_every) {
                tokio::task::yield_now().await;
            }
        }
        Ok(BenchCycles {
            cycles: i,
            latencies_us,
        })
    }

    /// One cycle in this many is timed (its latency kept), and the stop is checked once
    /// per this many: on both sides of a ratio alike, so that neither pays three clock reads a cycle. An embedded
    /// cycle is about two system calls, and the clock reads and the latency kept were a
    /// tenth of the floor's cycle (a process of one thread: 698k–728k cycles a second
    /// against 784k–790k for the same loop bare, and `scripts/ofd-floor.c`'s 781k).
    pub(crate) const TIME_EVERY: u64 = 8;

    /// Which cycle of each group of [`BenchRun::TIME_EVERY`] is timed: the middle one.
    pub(crate) const TIMED_PHASE: u64 = Self::TIME_EVERY / 2;

    /// Cycle `i`'s item of `items`, taken in turn: a worker's key (the floor's side) or
    /// name (dblock's). `bench.rs` gives every worker 64, never none.
    pub(crate) fn nth<T>(items: &[T], i: u64) -> &T {
        &items[(i % items.len() as u64) as usize]
    }
}

/// The cheapest correct way to do a lock cycle on a backend, issued directly: what
/// `dblock bench` measures dblock against. One set of raw connections (or descriptors),
/// one per worker, all opened by [`BenchFloor::open`] before anything is timed.
pub(crate) trait BenchFloor: Send + Sync {
    /// Opens what `workers` workers use (connections, descriptors), before any timing.
    fn open(self: Arc<Self>, workers: usize) -> BoxFuture<'static, Result<(), Error>> {
        let _ = workers;
        Box::pin(std::future::ready(Ok(())))
    }

    /// `worker`'s timed loop ([`BenchRun::drive`]): cycle `i` takes and releases
    /// `keys[i % keys.len()]` ([`BenchRun::nth`]; `hot`: shared by all workers) and returns
    /// the acquisition's latency. A floor may leave a lock held when a cycle returns
    /// (released with its next cycle, as dblock's guard's release rides on the next
    /// request), until [`BenchFloor::settle`]. One boxed future for the whole loop, none
    /// a cycle, and the floor borrowed: a cycle writes nothing another worker shares —
    /// the same harness as dblock's side of the ratio.
    fn run<'a>(
        &'a self,
        worker: usize,
        keys: &'a [Key],
        hot: bool,
        run: BenchRun,
    ) -> BoxFuture<'a, Result<BenchCycles, Error>>;

    /// Releases whatever `worker` still holds, when its timed run ends.
    fn settle(self: Arc<Self>, worker: usize) -> BoxFuture<'static, Result<(), Error>> {
        let _ = worker;
        Box::pin(std::future::ready(Ok(())))
    }

    /// How the floor reaches the server (`"TLS"`, `"plain TCP"`, …), once opened; `None`
    /// where that does not apply.
    fn transport(&self) -> Option<String> {
        None
    }
}

/// The table that keeps the latest token of every fenced name (see
/// [`fencing::TABLE`](crate::fencing::TABLE)).
pub(crate) const FENCING_TABLE: &str = "dblock_fencing";

/// The schema of the PostgreSQL fencing table (see
/// [`fencing::PG_SCHEMA`](crate::fencing::PG_SCHEMA)).
pub(crate) const PG_FENCING_SCHEMA: &str = "public";

/// This process, as recorded beside each fenced grant: `host:pid`.
pub(crate) fn holder_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown-host".into());
        format!("{host}:{}", std::process::id())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_requests_of_a_process_start_on_consecutive_keys() {
        // Other tests may take starts meanwhile; consecutive starts still advance by one.
        let starts: Vec<usize> = (0..6).map(|_| any_start(1_000_003)).collect();
        for w in starts.windows(2) {
            assert!(w[1] > w[0] || w[1] < 10, "{starts:?}");
        }
        assert_eq!(any_start(1), 0);
        assert_eq!(any_start(0), 0);
    }

    /// A bench loop counts every cycle and times one in `TIME_EVERY`, the middle of each
    /// group (never the first cycle): the latencies kept are the timed cycles', the
    /// others' (zero) never among them; it stops only between groups.
    #[test]
    fn a_bench_loop_counts_every_cycle_and_times_one_in_eight() {
        #![allow(clippy::unwrap_used)]
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut seen = Vec::new();
        let run = BenchRun {
            stop: Instant::now() + Duration::from_millis(50),
            yield_every: 1024,
        };
        let done = rt
            .block_on(run.drive(|i, timed| {
                seen.push((i, timed));
                // A timed cycle reports a latency the loop must keep; an untimed one, none.
                let d = match timed {
                    true => Duration::from_micros(7),
                    false => Duration::ZERO,
                };
                std::future::ready(Ok(d))
            }))
            .unwrap();
        assert!(done.cycles > 100, "{}", done.cycles);
        assert_eq!(done.cycles, seen.len() as u64);
        assert!(
            done.cycles.is_multiple_of(BenchRun::TIME_EVERY),
            "{}",
            done.cycles
        );
        assert!(!seen[0].1, "a worker's first cycle is never timed");
        for (n, (i, timed)) in seen.iter().enumerate() {
            assert_eq!(*i, n as u64);
            assert_eq!(
                *timed,
                i % BenchRun::TIME_EVERY == BenchRun::TIMED_PHASE,
                "cycle {i}"
            );
        }
        let timed = seen.iter().filter(|(_, t)| *t).count();
        assert_eq!(done.latencies_us.len(), timed);
        assert!(done.latencies_us.iter().all(|&us| us == 7.0));
        // The clock only on the timed: a cycle that is not timed reads none.
        assert_eq!(CycleClock::start(false).elapsed(), Duration::ZERO);
    }
}
