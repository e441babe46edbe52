//! Schema migrations that are safe when every instance starts at once.
//!
//! Two tools, one lock. The lock is [`MIGRATION_LOCK_KEY`], one key for the whole
//! database (PostgreSQL's advisory lock, MySQL's named lock, the lock file's byte on
//! SQLite), taken by every migration and every start-up DDL script.
//!
//! # Why one lock, and why for idempotent scripts too
//!
//! `CREATE … IF NOT EXISTS` is not atomic: it checks the catalogue, then creates. Two
//! sessions running it at once both pass the check and one fails on a catalogue unique
//! index: measured with four instances starting against one empty database, three of
//! four failed, in ten rounds out of ten, with
//!
//! ```text
//! ERROR:  duplicate key value violates unique constraint "pg_type_typname_nsp_index"
//! ERROR:  duplicate key value violates unique constraint "pg_class_relname_nsp_index"
//! ```
//!
//! and against a database where the tables already existed, the `ALTER TABLE … ENABLE
//! ROW LEVEL SECURITY` and `CREATE POLICY` statements deadlocked, two runs each waiting
//! for the other's `ACCESS EXCLUSIVE` lock. Those catalogue indexes are database-wide, so
//! two *different* scripts collide exactly as two runs of one script do: a key per
//! script would leave the common case — six subsystems' scripts at once — racing. Hence
//! one key for every script.
//!
//! # Start-up scripts: [`run_script`]
//!
//! For a component that owns an idempotent DDL script and runs it at every start:
//! [`run_script`] (on your sqlx pool) or [`Locks::run_script`] sends
//! [`lock_prefixed`]`(ddl)`: `SELECT pg_catalog.pg_advisory_xact_lock(KEY);` followed by the script,
//! unaltered, as one simple-protocol message. PostgreSQL runs such a message as one
//! implicit transaction, so the lock is held for the whole script and released at its
//! end, on success and failure alike; there is nothing to release and no path that
//! leaves it held.
//!
//! Its waiters wait *inside a statement*, and so hold a snapshot while they wait. That is
//! harmless for scripts of ordinary DDL, but a `CREATE INDEX CONCURRENTLY` running
//! meanwhile waits for every such snapshot, and PostgreSQL then reports a deadlock (see
//! below). Scripts that build indexes concurrently belong in the runner.
//!
//! # The runner: [`Migrations`]
//!
//! An ordered set of `VERSION_NAME.sql` files ([the rule](Migrations#the-file-name-rule)),
//! from a directory ([`Migrations::from_dir`]) or embedded in the binary at compile time
//! ([`migrations!`](crate::migrations)), applied by [`Migrations::run`] (or
//! [`Migrations::runner`] for options). A run:
//!
//! 1. waits for the migration lock **without holding a snapshot**: it polls
//!    `pg_try_advisory_lock(KEY)` in autocommit, outside any transaction, every 20 ms
//!    backing off to 100 ms, on one connection it keeps for the whole run, and holds
//!    the lock as a session lock;
//! 2. only then creates the bookkeeping table `dblock_migrations` (in the schema in use)
//!    if it is missing, and reads what is applied — reading first would let two
//!    instances both decide to apply the same migration;
//! 3. refuses, before applying anything, when an applied migration's file changed
//!    ([`Error::MigrationEdited`]) and when the database has applied versions the set
//!    lacks ([`Error::UnknownMigrations`], unless
//!    [`ignore_missing`](Runner::ignore_missing));
//! 4. applies each pending migration in version order, after checking that the lock is
//!    still held, each **in one transaction with its bookkeeping row** (version, name,
//!    checksum, `applied_at`, `duration_ms`): all or nothing. A failure ([`Error::MigrationFailed`], naming the file) rolls it back
//!    and stops the run. A pending migration older than applied ones (a branch merged
//!    late) is applied too; a file renamed with its contents unchanged is still the
//!    applied migration (versions and checksums identify migrations, not names);
//! 5. releases the lock, on success and on failure. If the connection is in any doubt
//!    (it broke, or the run's future was dropped) dblock cancels what it was doing and
//!    closes it, which releases the lock on the server.
//!
//! While a run executes a statement, its connection asks PostgreSQL (14 and later) to
//! check every second that the client is still there (`client_connection_check_interval`),
//! so a runner killed mid-migration stops holding the lock within about a second
//! instead of when its statement would have finished.
//!
//! # Migrations outside a transaction
//!
//! Some statements cannot run in a transaction, `CREATE INDEX CONCURRENTLY` above all.
//! A migration whose first line is [`NO_TRANSACTION_HEADER`]
//!
//! ```sql
//! -- dblock:no-transaction
//! DROP INDEX CONCURRENTLY IF EXISTS users_email_idx;
//! CREATE INDEX CONCURRENTLY users_email_idx ON users (email);
//! ```
//!
//! is split into statements (quotes, dollar quotes, comments and routine bodies
//! respected) which are sent one at a time, each in autocommit. It is not all or
//! nothing, so it is recorded as it goes: as `started` before its first statement, with
//! the number of statements completed after each, and as done after the last. If
//! statement *k* fails, the ones before it stay applied, the error says so
//! ([`Error::MigrationFailed`]), and the row is removed: fix the file (written to be
//! re-run) and run again. If the run ends any other way — killed, its connection lost,
//! its future dropped — the row stays `started`, and every later run (and dry run, and
//! baseline) refuses with [`Error::MigrationInterrupted`], which says which statements
//! are known to have completed, which one was running, and how to record what you
//! decide: `UPDATE dblock_migrations SET state = 'done' WHERE version = V` once it is
//! finished by hand, or `DELETE FROM dblock_migrations WHERE version = V` to have the
//! next run apply it from its first statement. [`Runner::status`] shows it as
//! [`State::Interrupted`] (and [`State::Applying`] while a run holds the lock). A
//! concurrent index build that fails or is cancelled leaves an `INVALID` index behind,
//! which `CREATE INDEX CONCURRENTLY IF NOT EXISTS` would then silently keep: drop it
//! first, as above.
//!
//! **Why the runner polls.** `CREATE INDEX CONCURRENTLY` waits for every transaction
//! holding a snapshot older than its own to finish. A second migrator blocked inside
//! `pg_advisory_lock` is running a statement and holds such a snapshot, while waiting for
//! the lock the index builder's session holds: PostgreSQL reports `deadlock detected`
//! and one of them fails (golang-migrate #960, Flyway #1654/#3508). dblock's waiters
//! run a short `pg_try_advisory_lock` now and then and hold no snapshot in between, so
//! the index build never waits for them.
//!
//! # SQLite
//!
//! The same runner and guarantees on the embedded backend: the lock is the OFD
//! byte-range lock on `MIGRATION_LOCK_KEY`'s byte of the lock file (waited for by
//! polling, released by the kernel if the process dies, with no snapshot to hold), the
//! bookkeeping table lives in the SQLite database, and each migration runs in a
//! `BEGIN IMMEDIATE` transaction with its row (SQLite's DDL is transactional). The
//! header works the same way (`VACUUM` needs it, for one), and so do reverts.
//!
//! # MySQL and MariaDB
//!
//! The same runner: the lock is the named lock of [`MIGRATION_LOCK_KEY`], checked
//! before each migration. The server commits DDL as it goes, so no migration shares a
//! transaction with its row: every file is sent whole, recorded as `started` before
//! and done after, and one that fails or is interrupted is refused by the next run
//! ([`Error::MigrationInterrupted`]) until someone has looked (see `docs/mysql.md`).
//! Reverts are refused ([`Error::Unsupported`]).
//!
//! # Other tools' directories
//!
//! A directory written for sqlx-cli works unchanged: `VERSION_NAME.sql` with any
//! positive version (timestamps too), sqlx's `-- no-transaction` first line as well as
//! dblock's header, and reversible pairs `VERSION_NAME.up.sql` / `.down.sql` (the
//! `.up.sql` is applied; the `.down.sql` is kept for a revert). Flyway's and refinery's
//! `VVERSION__NAME.sql` and golang-migrate's `.up.sql` / `.down.sql` are read too (see
//! [the rule](Migrations#the-file-name-rule)).
//!
//! Before anything runs, [`Migration::transaction_hazards`] names the statements that
//! cannot run inside a transaction (`CREATE INDEX CONCURRENTLY`, `VACUUM`,
//! `ALTER TYPE … ADD VALUE` before PostgreSQL 12…) in files without a no-transaction
//! header; `dblock migrate --dry-run` prints them.
//!
//! # Adopting another tool's history
//!
//! A database another tool migrated is never migrated again.
//!
//! - **sqlx** (`_sqlx_migrations`, or the table `sqlx.toml`'s `table-name` names, given
//!   with [`Runner::sqlx_config`]; found through the `search_path` as sqlx finds it on
//!   PostgreSQL, in the database on MySQL, in the database file on SQLite): every run,
//!   under the migration lock and
//!   before anything is applied, adopts each version sqlx applied that
//!   `dblock_migrations` lacks, after verifying sqlx's checksum (the SHA-384 of the
//!   file's SQL, [`Migration::sqlx_checksum`], or of the file without the characters
//!   `sqlx.toml`'s `ignored-chars` names): it is recorded as applied, with sqlx's
//!   `installed_on` and `execution_time`, and not run. If any file differs from what
//!   sqlx applied, or sqlx recorded a version as failed, the run refuses with
//!   [`Error::ForeignHistory`], changing nothing and naming every such file;
//!   [`Runner::baseline`] (`dblock migrate baseline DIR`) adopts the files as they are.
//!   [`Runner::status`] and [`Runner::dry_run`] show sqlx's migrations as applied.
//! - On PostgreSQL, **golang-migrate** (`schema_migrations` with its `dirty` column),
//!   **Flyway** (`flyway_schema_history`), **refinery** (`refinery_schema_history`) and
//!   **goose** (`goose_db_version`) keep no checksums to verify: on a database where one
//!   of them applied migrations and dblock records none, a run refuses with
//!   [`Error::ForeignHistory`] naming the command that adopts,
//!   `dblock migrate baseline DIR --to VERSION` ([`Runner::baseline`]).
//!
//! dblock writes to none of those tables but sqlx's (below).
//!
//! # Beside sqlx's migrator
//!
//! During a rolling deploy, instances still calling sqlx's migrator at start-up and
//! instances running dblock's share the database. While sqlx's history table exists
//! ([`SqlxHistory::Auto`], the default; or always, [`SqlxHistory::Always`], which
//! creates it), a run also holds sqlx's migration lock — the key sqlx derives from the
//! database, [`sqlx_lock_key`], taken after dblock's and, like it, by polling, holding
//! no snapshot — and writes each migration it applies into sqlx's history exactly as
//! sqlx would (version, description, success, checksum, execution time in
//! nanoseconds), in the migration's own transaction; what dblock recorded and sqlx's
//! history lacks is written there too. So a sqlx instance that runs after dblock finds
//! nothing to do, and one that runs before makes dblock wait, then be adopted.
//!
//! sqlx's migrator waits inside `pg_advisory_lock`, holding a snapshot that a
//! concurrent index build would wait for. So before each migration outside a
//! transaction, a run that sees sessions waiting for sqlx's key lets them go first: it
//! releases that key, waits for it again by polling, reads sqlx's history again,
//! adopts what they applied, and plans again. A sqlx instance that starts waiting after
//! that look, while the index builds, still deadlocks with the build (PostgreSQL ends
//! one of them): finish the switch before releases that build indexes concurrently.
//! [`SqlxHistory::Off`] stops all of this once every instance runs dblock. On
//! MySQL 8 the lock is sqlx's `GET_LOCK` name ([`sqlx_mysql_lock_name`]); sqlx takes
//! none on MariaDB (its negative timeout is refused) or SQLite, where the history is
//! still written. The recipe and what is and is not guaranteed:
//! `docs/adopting-sqlx-migrations.md`.
//!
//! # The caller's own key
//!
//! A service whose start-up scripts already take an advisory key of their own moves to
//! dblock instance by instance with [`run_script_with_key`] (and
//! [`Locks::run_script_with_key`]): the script is sent as old instances send it,
//! `SELECT pg_catalog.pg_advisory_xact_lock(KEY);` then the DDL in one message, so old and new
//! instances exclude each other while both run.
//!
//! # Status and dry runs
//!
//! [`Runner::status`] and [`Runner::dry_run`] only read: they take no lock, never create
//! the bookkeeping table (an absent table means nothing is applied), and so answer at
//! once even while a run holds the lock. They show the committed state: a migration
//! being applied in a transaction at that moment shows as pending; one being applied
//! outside a transaction shows as [`State::Applying`] while a run holds the lock, and
//! as [`State::Interrupted`] (a run would refuse) once nobody does.

pub(crate) mod adopt;
mod files;
pub(crate) mod layout;
mod lint;
pub(crate) mod plan;
pub(crate) mod revert;
mod run;
pub(crate) mod set;
pub(crate) mod split;
mod sqlx_config;
pub(crate) mod sqlx_side;
mod status;
pub(crate) mod store;

use std::fmt;

use crate::error::Error;
use crate::locks::Locks;
use run::{Ctx, Guards};
use store::MigrationStore;

pub use files::MAX_FILE_BYTES;
pub use layout::Layout;
pub use lint::Hazard;
pub use plan::{Applied, MIGRATION_LOCK_KEY, Report, TABLE, lock_prefixed, lock_prefixed_with};
pub use set::{Migration, Migrations, NO_TRANSACTION_HEADER, SQLX_NO_TRANSACTION};
pub use sqlx_config::SqlxConfig;
pub use sqlx_side::{SqlxHistory, sqlx_lock_key, sqlx_mysql_lock_name};
pub use status::{State, Status, StatusEntry};
pub use store::ScriptPool;

/// Runs the idempotent start-up script `ddl` under the migration lock, on a connection
/// of `pool` (sqlx's `PgPool`, cargo feature `postgres`: see [`ScriptPool`]): the seed's
/// primitive (see [above](self#start-up-scripts-run_script)).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), dblock::Error> {
/// const DDL: &str = "CREATE TABLE IF NOT EXISTS cron_state (job text PRIMARY KEY, last_run timestamptz);
///                    CREATE INDEX IF NOT EXISTS cron_state_last_run ON cron_state (last_run);";
/// dblock::migrate::run_script(&pool, DDL).await?;
/// # Ok(()) }
/// ```
///
/// The script must not contain transaction control (`BEGIN`, `COMMIT`…): a `COMMIT`
/// would end the transaction, and the lock with it, half way through.
///
/// # Errors
///
/// [`Error::InvalidMigration`] for a script with transaction control; the error of the
/// first statement that failed (nothing of the script is then applied); connection
/// errors.
///
/// # Cancel safety
///
/// If cancelled, the script may still run to its end (or fail) on the server; the lock
/// is released when its transaction ends either way, and the script is applied whole or
/// not at all.
pub async fn run_script<P: ScriptPool + ?Sized>(pool: &P, ddl: &str) -> Result<(), Error> {
    run_script_with_key(pool, MIGRATION_LOCK_KEY, ddl).await
}

/// [`run_script`] under advisory key `key` instead of [`MIGRATION_LOCK_KEY`]: the key
/// a service's start-up scripts already take, so that it can move to dblock instance by
/// instance (see [the module](self#the-callers-own-key)). The script is sent as
/// [`lock_prefixed_with`]`(key, ddl)`, the very message such a service sends, so old
/// and new instances exclude each other.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), dblock::Error> {
/// /// The key the server's scripts took before dblock: `FRAISE` and a version byte.
/// const MIGRATION_LOCK_KEY: i64 = 0x4652_4149_5345_0001;
/// const DDL: &str = "CREATE TABLE IF NOT EXISTS _fraiseql_cron_state (job text PRIMARY KEY);";
/// dblock::migrate::run_script_with_key(&pool, MIGRATION_LOCK_KEY, DDL).await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// As [`run_script`].
///
/// # Cancel safety
///
/// As [`run_script`].
pub async fn run_script_with_key<P: ScriptPool + ?Sized>(
    pool: &P,
    key: i64,
    ddl: &str,
) -> Result<(), Error> {
    check_script(ddl)?;
    pool.run_locked(lock_prefixed_with(key, ddl)).await
}

/// Refuses a start-up script with transaction control, which would end the lock early.
fn check_script(ddl: &str) -> Result<(), Error> {
    for (i, stmt) in split::split(ddl).iter().enumerate() {
        if let Some(word) = split::transaction_control(stmt) {
            return Err(Error::InvalidMigration {
                file: "start-up script".into(),
                reason: format!(
                    "statement {} is {word}: the script runs in one transaction under the \
                     migration lock, and transaction control would end both early",
                    i + 1
                ),
            });
        }
    }
    Ok(())
}

impl Locks {
    /// Runs the idempotent start-up script `ddl` under the migration lock, on one of
    /// this handle's connections: [`run_script`] for a handle.
    ///
    /// On PostgreSQL, [`lock_prefixed`]`(ddl)` as one message, so its waiters wait inside
    /// a statement (see [the module](crate::migrate#start-up-scripts-run_script)). On
    /// MySQL/MariaDB, the migration lock's named lock, then the script (DDL commits as it
    /// goes). On SQLite, the migration lock's byte of the lock file, then the script in
    /// one `BEGIN IMMEDIATE` transaction.
    ///
    /// # Errors
    ///
    /// As [`run_script`].
    ///
    /// # Cancel safety
    ///
    /// On PostgreSQL, cancelling it cancels the script on the server and closes the
    /// connection: the script is applied whole or not at all, and the lock is released.
    /// On SQLite, the transaction is rolled back and the lock released. On MySQL/MariaDB
    /// the lock is released at once, what the server has run of the script stays
    /// applied, and a statement it was running may finish after the lock is released
    /// (the script must be idempotent, and the next start runs it again).
    pub async fn run_script(&self, ddl: &str) -> Result<(), Error> {
        self.run_script_with_key(MIGRATION_LOCK_KEY, ddl).await
    }

    /// [`Locks::run_script`] under advisory key `key` instead of
    /// [`MIGRATION_LOCK_KEY`] (see [`run_script_with_key`]). On PostgreSQL,
    /// [`lock_prefixed_with`]`(key, ddl)` as one message; on SQLite, `key`'s byte of the
    /// lock file; on MySQL, dblock's named lock of `key` (only dblock instances share it).
    ///
    /// # Errors
    ///
    /// As [`run_script`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::run_script`].
    pub async fn run_script_with_key(&self, key: i64, ddl: &str) -> Result<(), Error> {
        check_script(ddl)?;
        store(self).run_script(key, ddl).await
    }
}

impl Migrations {
    /// Applies the pending migrations under the migration lock; see
    /// [the module](crate::migrate#the-runner-migrations) for what a run guarantees.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), dblock::Error> {
    /// let locks = dblock::Locks::from_env().await?;
    /// let set = dblock::migrate::Migrations::from_dir("migrations")?;
    /// let report = set.run(&locks).await?;
    /// for m in &report.applied {
    ///     println!("applied {} in {:?}", m.file_name, m.duration);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Runner::run`].
    ///
    /// # Cancel safety
    ///
    /// As [`Runner::run`].
    pub async fn run(&self, locks: &Locks) -> Result<Report, Error> {
        self.runner(locks).run().await
    }

    /// A run with options: see [`Runner`].
    pub fn runner<'a>(&'a self, locks: &'a Locks) -> Runner<'a> {
        Runner {
            set: self,
            locks,
            ignore_missing: false,
            on_applied: None,
            sqlx: SqlxConfig::default(),
            sqlx_history: SqlxHistory::default(),
            guards: Guards::default(),
        }
    }
}

/// A run of a [`Migrations`] set being set up: created by [`Migrations::runner`],
/// finished by [`run`](Runner::run), [`dry_run`](Runner::dry_run) or
/// [`status`](Runner::status).
///
/// ```no_run
/// # async fn demo(locks: dblock::Locks, set: dblock::migrate::Migrations) -> Result<(), dblock::Error> {
/// set.runner(&locks)
///     .on_applied(|m| println!("applied {} ({:?})", m.file_name, m.duration))
///     .run()
///     .await?;
/// # Ok(()) }
/// ```
#[must_use = "a runner does nothing until run, dry_run or status is awaited"]
pub struct Runner<'a> {
    set: &'a Migrations,
    locks: &'a Locks,
    ignore_missing: bool,
    on_applied: Option<OnApplied<'a>>,
    sqlx: SqlxConfig,
    sqlx_history: SqlxHistory,
    guards: Guards,
}

/// The callback of [`Runner::on_applied`].
type OnApplied<'a> = Box<dyn FnMut(&Applied) + Send + 'a>;

impl fmt::Debug for Runner<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("migrations", &self.set.len())
            .field("locks", self.locks)
            .field("ignore_missing", &self.ignore_missing)
            .field("sqlx", &self.sqlx)
            .field("sqlx_history", &self.sqlx_history)
            .finish_non_exhaustive()
    }
}

impl<'a> Runner<'a> {
    /// Proceed even though the database has applied versions the set lacks (a newer
    /// release's migrations, say); they are left alone. Off unless set: such a run is
    /// refused with [`Error::UnknownMigrations`].
    pub fn ignore_missing(mut self, ignore: bool) -> Self {
        self.ignore_missing = ignore;
        self
    }

    /// Calls `f` after each migration is applied and committed, as it happens (a run
    /// that fails later has still applied these).
    pub fn on_applied(mut self, f: impl FnMut(&Applied) + Send + 'a) -> Self {
        self.on_applied = Some(Box::new(f));
        self
    }

    /// How sqlx keeps its history on this database (`sqlx.toml`'s `table-name` and
    /// `ignored-chars`), for adopting it: see [`SqlxConfig`]. By default
    /// `_sqlx_migrations`, with either checksum accepted.
    pub fn sqlx_config(mut self, config: SqlxConfig) -> Self {
        self.sqlx = config;
        self
    }

    /// Whether the run keeps sqlx's history (and holds sqlx's migration lock) beside
    /// its own: [`SqlxHistory::Auto`] (the default) where sqlx's history table exists,
    /// [`SqlxHistory::Always`], or [`SqlxHistory::Off`] once every instance runs dblock.
    /// See [the module](crate::migrate#beside-sqlxs-migrator).
    pub fn sqlx_history(mut self, mode: SqlxHistory) -> Self {
        self.sqlx_history = mode;
        self
    }

    /// For tests' controls only: keep sqlx's history without holding sqlx's lock, to
    /// show the race the lock prevents. Never use it.
    #[doc(hidden)]
    pub fn __without_sqlx_lock(mut self) -> Self {
        self.guards.sqlx_lock = false;
        self
    }

    /// For tests' controls only: run migrations outside a transaction while sqlx's
    /// migrators wait, to show the deadlock letting them go first prevents. Never use
    /// it.
    #[doc(hidden)]
    pub fn __without_yielding_to_sqlx(mut self) -> Self {
        self.guards.yield_to_sqlx = false;
        self
    }

    /// Applies the pending migrations under the migration lock.
    ///
    /// # Errors
    ///
    /// Before anything is applied: [`Error::InvalidMigration`] or
    /// [`Error::DuplicateMigration`] for an embedded set with a bad file,
    /// [`Error::MigrationEdited`], [`Error::UnknownMigrations`],
    /// [`Error::ForeignHistory`], [`Error::MigrationInterrupted`]. While applying:
    /// [`Error::MigrationFailed`] naming the migration, whose
    /// [`source`](std::error::Error::source) is the database's error; the migrations
    /// before it stay applied. Connection errors. In every case the lock is no longer
    /// held once this returns (on a broken connection: once the server notices).
    ///
    /// # Cancel safety
    ///
    /// Cancelling a run stops it where it is. On PostgreSQL its connection is abandoned:
    /// the statement running is cancelled, the migration's transaction rolls back, and
    /// closing the connection releases the lock. On SQLite the transaction rolls back and
    /// the lock is released. On MySQL the lock is released and the migration's
    /// connection closed (the statement running may still finish on the server).
    /// Migrations committed before stay applied; a no-transaction migration (any
    /// migration, on MySQL) stays recorded as started, and the next run refuses with
    /// [`Error::MigrationInterrupted`] until its row records a decision.
    pub async fn run(mut self) -> Result<Report, Error> {
        let set = self.set.checked()?;
        let mut ignore = |_: &Applied| {};
        let on_applied: &mut (dyn FnMut(&Applied) + Send) = match &mut self.on_applied {
            Some(f) => f.as_mut(),
            None => &mut ignore,
        };
        let c = ctx(self.locks, set, self.sqlx.clone()).beside(self.sqlx_history, self.guards);
        run::run(&c, self.ignore_missing, on_applied).await
    }

    /// The migrations a run would apply now, in order, after the same checks a run
    /// makes; changes nothing (see [the module](crate::migrate#status-and-dry-runs)).
    ///
    /// # Errors
    ///
    /// As [`Runner::run`], short of [`Error::MigrationFailed`].
    ///
    /// # Cancel safety
    ///
    /// A read; cancelling it has no effect on the database.
    pub async fn dry_run(self) -> Result<Vec<&'a Migration>, Error> {
        // Not `self` across the await: the callback is Send but not Sync.
        let (set, locks, ignore_missing, sqlx) =
            (self.set, self.locks, self.ignore_missing, self.sqlx);
        let set = set.checked()?;
        run::dry_run(&ctx(locks, set, sqlx), ignore_missing).await
    }

    /// Every migration of the set and of the database, with its state: applied,
    /// pending, edited since it was applied, or unknown to the set. Changes nothing.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidMigration`] or [`Error::DuplicateMigration`] for an embedded set
    /// with a bad file; connection and server errors. Edited and unknown migrations are
    /// reported in the status, not as errors.
    ///
    /// # Cancel safety
    ///
    /// A read; cancelling it has no effect on the database.
    pub async fn status(self) -> Result<Status, Error> {
        let (set, locks, ignore_missing, sqlx) =
            (self.set, self.locks, self.ignore_missing, self.sqlx);
        let set = set.checked()?;
        status::status(&ctx(locks, set, sqlx), ignore_missing).await
    }

    /// Reverts applied migrations with their `.down.sql`, newest first, under the
    /// migration lock: the latest applied migration, or with `to` every applied one
    /// above version `to`. Each `.down.sql` runs in one transaction with the deletion of
    /// its bookkeeping row (and of sqlx's row in `_sqlx_migrations`, if that table
    /// exists, so that the next run does not adopt it again); a `.down.sql` with a
    /// no-transaction header runs statement by statement, as a migration would. Calls
    /// [`on_applied`](Runner::on_applied)'s callback after each, and returns them in
    /// order (`file_name` is the `.down.sql`'s).
    ///
    /// # Errors
    ///
    /// Before anything runs: [`Error::InvalidMigration`] naming a migration to revert
    /// that has no `.down.sql`, [`Error::MigrationEdited`], [`Error::UnknownMigrations`]
    /// for applied versions the set lacks (above `to`), [`Error::ForeignHistory`] as for
    /// a run; [`Error::Unsupported`] on MySQL/MariaDB (DDL commits as it goes, so a
    /// `.down.sql` that fails half way could not be rolled back). While reverting:
    /// [`Error::MigrationFailed`] naming the `.down.sql` (rolled back whole, or for a
    /// no-transaction one, the statements before the failing one stay applied).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the connection is closed: the `.down.sql` being run is rolled back
    /// (if it runs in a transaction), those before it stay reverted, and the lock is
    /// released.
    pub async fn revert(mut self, to: Option<i64>) -> Result<Vec<Applied>, Error> {
        let set = self.set.checked()?;
        let mut ignore = |_: &Applied| {};
        let on_reverted: &mut (dyn FnMut(&Applied) + Send) = match &mut self.on_applied {
            Some(f) => f.as_mut(),
            None => &mut ignore,
        };
        let c = ctx(self.locks, set, self.sqlx.clone()).beside(self.sqlx_history, self.guards);
        run::revert(&c, to, on_reverted).await
    }

    /// The server's `server_version_num` (`160004` for 16.4), for
    /// [`Migration::transaction_hazards`]; `None` on SQLite and MySQL.
    ///
    /// # Errors
    ///
    /// Connection errors.
    ///
    /// # Cancel safety
    ///
    /// A read; cancelling it has no effect on the database.
    pub fn server_version_num(
        &self,
    ) -> impl std::future::Future<Output = Result<Option<u32>, Error>> + Send + 'a {
        // Not `self` across the await: the callback is Send but not Sync.
        let locks = self.locks;
        async move { store(locks).server_version_num().await }
    }

    /// Records migrations as applied **without running them**, under the migration lock:
    /// adopts a database another tool migrated.
    ///
    /// With `to`, every migration of the set up to version `to` that dblock has not
    /// recorded (for a history dblock cannot verify: golang-migrate, Flyway, refinery,
    /// goose, or none). Without, the versions sqlx's history records as
    /// applied, with the files as they are now, including files that differ from what
    /// sqlx applied (which a run refuses to adopt). Returns the migrations recorded.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`] without `to` when there is no sqlx history; as
    /// [`Runner::run`] for a bad set, an interrupted migration and connection errors.
    ///
    /// # Cancel safety
    ///
    /// The rows are written in one statement: all or none. Cancelled, the connection is
    /// closed, which releases the lock.
    pub async fn baseline(self, to: Option<i64>) -> Result<Vec<&'a Migration>, Error> {
        let (set, locks, sqlx) = (self.set, self.locks, self.sqlx);
        let (mode, guards) = (self.sqlx_history, self.guards);
        let list = set.checked()?;
        let versions = run::baseline(&ctx(locks, list, sqlx).beside(mode, guards), to).await?;
        Ok(versions.into_iter().filter_map(|v| set.get(v)).collect())
    }
}

/// The handle's backend as the runner sees it: every backend has a migration store.
fn store(locks: &Locks) -> &dyn MigrationStore {
    &*locks.inner.backend
}

/// What the runner is given for `set` on `locks`.
fn ctx<'a>(locks: &'a Locks, set: &'a [Migration], sqlx: SqlxConfig) -> Ctx<'a> {
    Ctx {
        store: store(locks),
        set,
        sqlx,
        sqlx_history: SqlxHistory::default(),
        guards: Guards::default(),
    }
}

impl<'a> Ctx<'a> {
    /// With how the run keeps sqlx's history.
    fn beside(self, sqlx_history: SqlxHistory, guards: Guards) -> Ctx<'a> {
        Ctx {
            sqlx_history,
            guards,
            ..self
        }
    }
}

#[cfg(test)]
mod tests;
