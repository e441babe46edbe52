//! The interface between the migration runner (written once, in `run.rs`) and each
//! backend: where the migration lock, the bookkeeping table and its rows, and other
//! tools' histories live, and how one migration is applied in or outside a transaction.
//!
//! A backend implements [`MigrationStore`] (what can be done without the lock, and
//! taking it) and [`Session`] (what is done while the lock is held). The runner decides
//! everything else — what to adopt, what to apply, in what order, what to refuse — so
//! every backend behaves alike.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::adopt::History;
use super::plan::Record;
use super::set::Migration;
use super::sqlx_side::SqlxEntry;
use crate::error::Error;

/// A boxed, sendable future (as the raw interface returns; defined here too so that this
/// leaf imports nothing above it).
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a run reads and writes besides dblock's own table: the names it was given.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// sqlx's history table as SQL names it (sqlx.toml's `table-name`, checked by
    /// [`check_table_name`](super::sqlx_config::check_table_name)); `_sqlx_migrations`
    /// unless configured.
    pub(crate) sqlx_table: String,
    /// sqlx.toml's `ignored-chars`, for the checksums written into sqlx's history
    /// (`None`: the file as it is, sqlx's default).
    pub(crate) sqlx_ignored: Option<BTreeSet<char>>,
}

/// What is recorded, read without the lock.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recorded {
    /// dblock's rows; `None` when the bookkeeping table does not exist.
    pub(crate) records: Option<Vec<Record>>,
    /// Other tools' histories.
    pub(crate) history: History,
}

/// A change to the bookkeeping, made in autocommit (or, through
/// [`Session::in_transaction`], with the migration).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Write<'a> {
    /// A migration about to run outside a transaction, recorded as started, with none
    /// of its statements completed: `Some(n)` when its `n` statements are sent one by
    /// one (progress is then recorded), `None` when the file is sent whole.
    Started(&'a Migration, Option<usize>),
    /// Statements 1 to `k` of a started migration are known to have completed.
    Progress(&'a Migration, usize),
    /// A started migration, applied: its row becomes done.
    Finished(&'a Migration, Duration),
    /// A started migration that failed where the run could see exactly what ran: its
    /// row is removed (the error says what stays applied).
    Unstarted(&'a Migration),
    /// A reverted migration: its row is removed, and sqlx's row of its version if
    /// sqlx's history table exists (so that the next run does not adopt it back).
    Reverted(&'a Migration),
    /// Rows of migrations recorded as applied without running them (adopted, baseline),
    /// in one statement: all or none.
    Adopted(&'a [Record]),
    /// Rows for sqlx's history only (migrations dblock recorded that it lacks), in one
    /// statement; only once the session keeps sqlx's history
    /// ([`Session::keep_sqlx_history`]).
    ToSqlx(&'a [SqlxEntry]),
}

/// What a backend can do without the migration lock, and taking it.
pub(crate) trait MigrationStore: Send + Sync {
    /// The backend as messages name it: `"PostgreSQL"`, `"MySQL/MariaDB"`, `"SQLite"`.
    fn backend(&self) -> &'static str;

    /// The start-up script primitive: `ddl` whole, under the lock of advisory key
    /// `key` (the migration lock's, or the caller's own).
    fn run_script<'a>(&'a self, key: i64, ddl: &'a str) -> BoxFuture<'a, Result<(), Error>>;

    /// What is recorded, read without the lock, never creating anything.
    fn read<'a>(&'a self, opts: &'a Options) -> BoxFuture<'a, Result<Recorded, Error>>;

    /// Whether someone holds the migration lock right now (a run, a start-up script),
    /// found by looking, not by taking it.
    fn lock_held(&self) -> BoxFuture<'_, Result<bool, Error>>;

    /// Waits for the migration lock, holding nothing the lock's holder could wait for
    /// (no snapshot, no transaction), and returns the session that holds it. `what`
    /// names the operation for errors ("a migration run").
    fn lock<'a>(
        &'a self,
        opts: &'a Options,
        what: &'static str,
    ) -> BoxFuture<'a, Result<Box<dyn Session + 'a>, Error>>;

    /// Whether DDL is transactional here (PostgreSQL, SQLite): a migration then runs in
    /// one transaction with its row, and a no-transaction one statement by statement.
    /// Where it is not (MySQL), every file is sent whole, recorded as started before and
    /// as done after, and reverts are refused.
    fn transactional_ddl(&self) -> bool;

    /// The server's `server_version_num`, where there is one.
    fn server_version_num(&self) -> BoxFuture<'_, Result<Option<u32>, Error>> {
        Box::pin(std::future::ready(Ok(None)))
    }
}

/// How a transaction of [`Session::in_transaction`] ends its bookkeeping.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Then<'a> {
    /// The migration, applied: its row, done, with the time the SQL took.
    Applied(&'a Migration),
    /// [`Write::Reverted`].
    Reverted(&'a Migration),
}

/// The migration lock, held, and the connection a run works on. Dropped without
/// [`Session::end`] (a cancelled run), it gives the connection up, which releases the
/// lock and rolls back a transaction in progress.
pub(crate) trait Session: Send {
    /// Creates the bookkeeping table if it is missing (only ever under the lock).
    fn ensure_table(&mut self) -> BoxFuture<'_, Result<(), Error>>;

    /// dblock's rows, in version order.
    fn records(&mut self) -> BoxFuture<'_, Result<Vec<Record>, Error>>;

    /// Other tools' histories.
    fn history(&mut self) -> BoxFuture<'_, Result<History, Error>>;

    /// Checks with the database, now, that the lock is still held.
    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>>;

    /// Makes one bookkeeping change, in autocommit.
    fn write<'a>(&'a mut self, w: Write<'a>) -> BoxFuture<'a, Result<(), Error>>;

    /// Runs `sql` (one statement, or a whole file the server runs statement after
    /// statement) in autocommit.
    fn execute<'a>(&'a mut self, sql: &'a str) -> BoxFuture<'a, Result<(), Error>>;

    /// Runs `sql` and `then`'s bookkeeping in one transaction: all or nothing. Returns
    /// how long `sql` took. On failure nothing of it stays, and no transaction is left
    /// open on a connection that is still usable.
    fn in_transaction<'a>(
        &'a mut self,
        sql: &'a str,
        then: Then<'a>,
    ) -> BoxFuture<'a, Result<Duration, Error>>;

    /// From now on, keeps sqlx's history too: holds sqlx's migration lock (where sqlx
    /// takes one; with `lock`, which only a test's control turns off), waited for
    /// holding no snapshot, creates sqlx's table as sqlx would if `create`, and records
    /// each migration it applies there, as sqlx would, with dblock's row. The runner
    /// reads the histories again afterwards: a sqlx migrator may have held the lock.
    fn keep_sqlx_history(&mut self, create: bool, lock: bool) -> BoxFuture<'_, Result<(), Error>>;

    /// Before a migration outside a transaction, while keeping sqlx's history: if a
    /// session waits for sqlx's lock, which this one holds, lets it go first (releases
    /// the lock and waits for it again, holding no snapshot) and returns `true`; the
    /// runner then reads the histories again. A waiter for a lock blocks inside a
    /// statement holding a snapshot, and a concurrent index build waits for every such
    /// snapshot: building while one waits would deadlock. `false` where sqlx's waiters
    /// hold nothing a migration waits for (MySQL) or sqlx takes no lock (SQLite).
    fn yield_to_sqlx_waiters(&mut self) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(std::future::ready(Ok(false)))
    }

    /// After statements run in autocommit: whether one of them left a transaction open
    /// (a `BEGIN` without its `COMMIT`), which is then rolled back.
    fn end_open_transaction(&mut self) -> BoxFuture<'_, Result<bool, Error>>;

    /// Releases the lock and returns the connection (or gives it up where that cannot
    /// be confirmed). After a failed run (`ok` false), its own errors are not reported:
    /// the run's error is the one that matters.
    fn end(&mut self, ok: bool) -> BoxFuture<'_, Result<(), Error>>;
}

/// A caller's connection pool on which [`run_script`](super::run_script) runs a start-up
/// script: sqlx's `PgPool` (cargo feature `postgres`). Implemented by dblock only.
pub trait ScriptPool: sealed::Sealed + Sync {
    /// Sends `sql` (the script with the migration lock's acquisition first) as one
    /// simple-protocol message on one of the pool's connections.
    #[doc(hidden)]
    fn run_locked<'a>(&'a self, sql: String) -> BoxFuture<'a, Result<(), Error>>;
}

pub(crate) mod sealed {
    /// Keeps [`ScriptPool`](super::ScriptPool) to the pools dblock knows.
    pub trait Sealed {}
}
