//! The one error type of dblock.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong, one variant a kind, each with a one-line message.
///
/// "Someone else holds the lock" is **not** an error: [`Locks::try_lock`] and the
/// deadline waits return `Ok(None)` for it.
///
/// [`Locks::try_lock`]: crate::Locks::try_lock
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock name is empty, too long or contains NUL. Fix the name.
    #[error("invalid lock name {name:?}: {reason}")]
    InvalidName {
        /// The name (shortened for display).
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The namespace is empty, too long or contains NUL. Fix the namespace.
    #[error("invalid namespace {namespace:?}: {reason}")]
    InvalidNamespace {
        /// The namespace (shortened for display).
        namespace: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The database URL could not be understood, or names a backend this build lacks.
    /// The URL is shown with any password removed. Fix the URL (or the build's features).
    #[error("invalid database URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL, password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The database could not be reached (refused, unknown host, authentication failed,
    /// no such database). Check the server, the address and the credentials; a retry may
    /// succeed once the server is up.
    #[error("cannot connect to {target}: {message}")]
    Connect {
        /// Where dblock tried to connect (no password).
        target: String,
        /// The driver's or the server's explanation.
        message: String,
    },

    /// The connection broke while a request was in flight: the server restarted, an
    /// operator terminated the backend, the network dropped. Any lock it held is gone;
    /// retry the request.
    #[error("connection to the database lost: {message}")]
    ConnectionLost {
        /// What the driver or the server said.
        message: String,
    },

    /// The server's deadlock detector chose this request (or its transaction) as the
    /// victim: PostgreSQL's (SQLSTATE 40P01), MySQL's for named locks (error 3058) or
    /// InnoDB's (error 1213, SQLSTATE 40001). Nothing this request asked for is held;
    /// retry it, taking locks in one order everywhere (as [`Locks::lock_all`] does).
    ///
    /// [`Locks::lock_all`]: crate::Locks::lock_all
    #[error("deadlock detected: {message}")]
    Deadlock {
        /// The server's message, with its detail.
        message: String,
        /// The server's codes for it.
        code: ServerCode,
    },

    /// The server's shared lock table is full (PostgreSQL's "out of shared memory",
    /// SQLSTATE 53200). It holds `max_locks_per_transaction × (max_connections +
    /// max_prepared_transactions)` locks across *all* sessions; every lock already held
    /// stays held. Raise `max_locks_per_transaction`, or hold fewer locks at once.
    #[error("the server's lock table is full: {}", with_lock_table_hint(message))]
    LockTableFull {
        /// The server's message.
        message: String,
        /// The server's codes for it.
        code: ServerCode,
    },

    /// Something dblock waits for besides the lock itself did not happen in time: a free
    /// connection in dblock's pool, a connection attempt, a health check, or a server
    /// `statement_timeout`. `waiting_for` says what: retry later, or raise that bound.
    #[error("timed out waiting for {waiting_for}{}", after.map(|a| format!(" (after {a:?})")).unwrap_or_default())]
    Timeout {
        /// What was being waited for.
        waiting_for: WaitingFor,
        /// How long dblock waited, when it set the bound itself.
        after: Option<Duration>,
    },

    /// The lock was lost while it was held (see [`LockGuard::lost`]); reported by
    /// operations that need the lock, such as [`LockGuard::release`]. Stop the work the
    /// lock protected: another holder may have it.
    ///
    /// [`LockGuard::lost`]: crate::LockGuard::lost
    /// [`LockGuard::release`]: crate::LockGuard::release
    #[error("the lock was lost: {reason}")]
    LockLost {
        /// Why it was lost.
        reason: LossReason,
    },

    /// A fenced write was refused because a newer holder of the name exists: this
    /// holder's token is stale (see [`fencing`](crate::fencing)). Roll the transaction
    /// back and stop.
    #[error(
        "fencing token {token} of {name:?} is stale: the latest grant is {latest}; \
         the lock was lost and taken by another holder"
    )]
    StaleToken {
        /// The lock name.
        name: String,
        /// The token presented.
        token: i64,
        /// The latest token granted for the name.
        latest: i64,
    },

    /// The database answered with an error dblock does not treat specially: `code`
    /// says which ([`Error::sqlstate`], [`Error::native_code`]).
    #[error("database error{code}: {message}")]
    Database {
        /// The server's codes for it (none for an SQLite error outside a statement).
        code: ServerCode,
        /// The server's message (with detail and hint when present).
        message: String,
    },

    /// The lock file of the embedded backend lies on a network or FUSE file system,
    /// where byte-range locks are unreliable. Put it on a local disk.
    #[error(
        "{path}: byte-range locks are unreliable on {filesystem} file systems; \
         put the lock database on a local disk"
    )]
    UnsupportedFilesystem {
        /// The lock file.
        path: PathBuf,
        /// The kind of file system found.
        filesystem: &'static str,
    },

    /// A file operation of the embedded backend failed. Fix the path or its
    /// permissions, as the operating system's error says.
    #[error("{context}: {source}")]
    Io {
        /// What dblock was doing, naming the file.
        context: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },

    /// The request needs a server session that outlives one transaction, and dblock is
    /// connected through a pooler that hands each transaction to any server connection
    /// (see [`postgres::pooler`](crate::postgres::pooler)): it was refused before
    /// anything was taken. Connect past the pooler (directly, or in session mode), or do
    /// without what was refused.
    #[error("{what} cannot work through a transaction-pooling connection pooler ({how}): {fix}")]
    BehindPooler {
        /// What was refused.
        what: &'static str,
        /// How dblock knows it is behind such a pooler.
        how: &'static str,
        /// What to do instead.
        fix: &'static str,
    },

    /// The database role lacks a privilege the request needs; `fix` says which command
    /// (run once, by a role that has it) gives it. Run it.
    #[error("{message}; to fix it, {fix}")]
    PermissionDenied {
        /// The server's message.
        message: String,
        /// The command or SQL that fixes it.
        fix: String,
        /// The server's codes for it: PostgreSQL's 42501, MySQL's error number (1142,
        /// 1044…) with SQLSTATE 42000; none when dblock found the gap itself (a grant
        /// PostgreSQL answered with a warning only).
        code: ServerCode,
    },

    /// The request asks for something no backend grants as asked: options that do not
    /// go together (a shared semaphore, a fenced lock set, a fenced shared lock), a value
    /// out of range (a semaphore's limit; a lease shorter than the one lease rule
    /// allows, see [`Request::lease`]), a request for any of no keys, or a migration
    /// baseline with no version and no sqlx history to take one from. Nothing was taken
    /// or changed; the same call fails again: change the call.
    ///
    /// [`Request::lease`]: crate::Request::lease
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// What is wrong with it, and what would do.
        reason: String,
    },

    /// This backend (or this kind of handle, platform or server version) lacks what was
    /// asked for; `capability` says what. Nothing was taken or changed. Do without it,
    /// or use what the message names (another backend, dblock's own connections rather
    /// than an sqlx pool, a newer server).
    #[error("unsupported: {reason}")]
    Unsupported {
        /// What is lacking.
        capability: Capability,
        /// Why, and what to do instead.
        reason: String,
    },

    /// dblock's configuration, or the database's, cannot serve the request: a setting's
    /// value (`DBLOCK_FILE_LOCKS`), an sqlx pool with no database selected, no schema on
    /// PostgreSQL's `search_path` for migrations, a MySQL lock set of more names than the
    /// handle may open connections. Nothing was taken or changed; fix the configuration
    /// the message names (the call itself can stay).
    #[error("configuration: {reason}")]
    Configuration {
        /// What is wrong, and what to change.
        reason: String,
    },

    /// A server answered something dblock cannot map (a granted slot out of range, a
    /// row of its own table in a shape it never writes), or dblock found one of its own
    /// rules broken: a bug, in dblock or in something between it and the server. A grant
    /// it could not map was released, never reported as "not obtained". Report it.
    #[error("unexpected: {message}")]
    Unexpected {
        /// What was found.
        message: String,
    },

    /// A migration file (or the directory of a set) cannot be used: its name breaks the
    /// `VERSION_NAME.sql` rule, its contents are not UTF-8, its header is misspelt, or a
    /// migration that runs in a transaction contains transaction control (see
    /// [`Migrations`](crate::migrate::Migrations)). Also the source of a
    /// [`Error::MigrationFailed`] whose no-transaction file left a transaction open. Fix
    /// the file.
    #[error("{file}: {reason}")]
    InvalidMigration {
        /// The file (its path, for a directory's), or the directory.
        file: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Two migration files have the same version. Renumber one.
    #[error("{first} and {second} have the same version {version}; each version must be unique")]
    DuplicateMigration {
        /// The version.
        version: i64,
        /// One file.
        first: String,
        /// The other.
        second: String,
    },

    /// An applied migration's file changed since it was applied: its checksum no longer
    /// matches the one recorded. Restore the file, and put the change in a new one.
    #[error(
        "{file}: changed since it was applied (checksum {}…, applied as {}…); restore it, \
         and put the change in a new migration",
        short(.checksum),
        short(.applied_checksum)
    )]
    MigrationEdited {
        /// The file.
        file: String,
        /// Its version.
        version: i64,
        /// The checksum recorded when it was applied.
        applied_checksum: String,
        /// The file's checksum now.
        checksum: String,
    },

    /// The database has applied migrations the set lacks (a file was removed, or an
    /// older release runs against a newer database). Restore the files, or ignore them
    /// (`ignore_missing`).
    #[error(
        "the database has applied migrations this set lacks: {}; restore their files, \
         or ignore them (ignore_missing, --ignore-missing)",
        .missing.join(", ")
    )]
    UnknownMigrations {
        /// Each as `VERSION (NAME)`, as recorded.
        missing: Vec<String>,
    },

    /// Another tool's history says migrations were applied, and dblock cannot adopt it
    /// as it stands: a file differs from what that tool applied, the tool left a
    /// migration half-applied, or its history has no checksums to verify. Nothing was
    /// changed; `adopt_with` is the command that adopts the history.
    #[error("{table}: {reason}; nothing was changed (to adopt it: {adopt_with})")]
    ForeignHistory {
        /// The other tool's table, such as `_sqlx_migrations`.
        table: String,
        /// What stands in the way, naming every file that differs.
        reason: String,
        /// The command that adopts the history, such as
        /// `dblock migrate baseline DIR --to 20240105000000`.
        adopt_with: String,
    },

    /// A migration failed to apply. A migration in a transaction is rolled back whole;
    /// of one outside a transaction, the statements before `statement` stay applied.
    /// Fix what `source` says and run again.
    #[error("migration {file} failed{}: {source}", at_statement(.statement))]
    MigrationFailed {
        /// The file.
        file: String,
        /// Its version.
        version: i64,
        /// Its name.
        name: String,
        /// For a migration outside a transaction, the failing statement and how many
        /// there are (1-based).
        statement: Option<(usize, usize)>,
        /// What failed: the database's error, or the connection's.
        #[source]
        source: Box<Error>,
    },

    /// A migration that runs outside a transaction was recorded as started and never as
    /// finished: its run was killed, lost its connection, or (on MySQL, where every file
    /// runs so) failed part way. Part of it may be applied, so nothing more is applied
    /// until someone has looked; `explanation` says what is known to have run and the
    /// statement that records the decision. Nothing was changed.
    #[error("{file}: {explanation}")]
    MigrationInterrupted {
        /// The file (or, if the set lacks it, `VERSION_NAME` as recorded).
        file: String,
        /// Its version.
        version: i64,
        /// When it was started, as recorded (RFC 3339, UTC).
        started_at: String,
        /// How many of its statements are known to have completed, and how many it has,
        /// when it was run statement by statement; `None` when it was sent whole.
        progress: Option<(usize, usize)>,
        /// What ran, what may have, and what to do.
        explanation: String,
    },
}

/// The first 12 hex digits of a checksum, as messages show it.
fn short(checksum: &str) -> &str {
    checksum.get(..12).unwrap_or(checksum)
}

/// ` at statement k of n (…)` for a migration outside a transaction.
fn at_statement(statement: &Option<(usize, usize)>) -> String {
    let Some((k, n)) = *statement else {
        return String::new();
    };
    let kept = match k {
        1 => "no statement before it ran".to_string(),
        2 => "statement 1 stays applied".to_string(),
        k => format!("statements 1 to {} stay applied", k.saturating_sub(1)),
    };
    format!(" at statement {k} of {n} (outside a transaction: {kept})")
}

/// What an [`Error::Timeout`] waited for: one variant per outcome, so that callers
/// match kinds, not message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitingFor {
    /// The lock itself: the server's own `lock_timeout` (set by an administrator) ended
    /// a wait that had no deadline of its own. The lock was simply not obtained.
    LockServerLockTimeout,
    /// The lock itself: the server's `statement_timeout` cancelled the wait.
    LockServerStatementTimeout,
    /// The server to answer a lock request, past the request's deadline: the server
    /// stopped answering, and dblock gave the connection up.
    ServerReply,
    /// A free connection in dblock's pool (all `max_connections` in use).
    PoolConnection,
    /// A connection from the caller's sqlx pool (its `acquire_timeout`).
    SqlxPoolConnection,
    /// The fencing table to be created by another process, which held dblock's own
    /// set-up lock longer than that set-up's bound (30 s) — whatever the request's
    /// deadline, which dblock's set-up does not use.
    FencingTable,
    /// The migration lock (a migration runner waiting within a deadline).
    MigrationLock,
}

impl WaitingFor {
    /// Whether the wait was for the lock itself, ended by the server: the lock is held
    /// by someone else, nothing is wrong with the connection.
    pub fn is_lock(self) -> bool {
        matches!(
            self,
            WaitingFor::LockServerLockTimeout | WaitingFor::LockServerStatementTimeout
        )
    }

    /// Whether the wait was for the database or a connection to it (it stopped
    /// answering, or every connection was in use).
    pub fn is_connection(self) -> bool {
        matches!(
            self,
            WaitingFor::ServerReply | WaitingFor::PoolConnection | WaitingFor::SqlxPoolConnection
        )
    }
}

impl fmt::Display for WaitingFor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WaitingFor::LockServerLockTimeout => {
                "the lock (the server's lock_timeout ended the wait)"
            }
            WaitingFor::LockServerStatementTimeout => {
                "the lock (the server cancelled the wait: statement_timeout)"
            }
            WaitingFor::ServerReply => "the server to answer a lock request",
            WaitingFor::PoolConnection => {
                "a free connection in dblock's pool (raise max_connections)"
            }
            WaitingFor::SqlxPoolConnection => "a connection from the sqlx pool",
            WaitingFor::FencingTable => "another process to finish creating dblock's fencing table",
            WaitingFor::MigrationLock => "the migration lock",
        })
    }
}

/// What a backend lacks, in an [`Error::Unsupported`]: one variant per thing a caller
/// may do without, or get elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Capability {
    /// Shared locks: MySQL's and MariaDB's named locks (`GET_LOCK`) have no shared mode.
    /// Take the lock exclusively, or use PostgreSQL or the embedded backend.
    SharedMode,
    /// A lease on a session-scoped lock: PostgreSQL before 14 has no
    /// `idle_session_timeout`. Use a transaction-scoped lock (the default), or no lease.
    SessionLease,
    /// DDL inside a transaction: MySQL and MariaDB commit DDL as they go, so `migrate
    /// revert` (and a migration applied with its record in one transaction) cannot be
    /// rolled back when it fails half way. Revert by hand.
    TransactionalDdl,
    /// Setting up dblock's tables for roles that may not create them
    /// ([`Locks::setup`](crate::Locks::setup)): the embedded backend creates its tables on
    /// first use, so there is nothing to do.
    Setup,
    /// Ending another process's hold ([`Locks::terminate_holders`](crate::Locks::terminate_holders)):
    /// the embedded backend's locks belong to the process holding them. End that process
    /// yourself, if you mean to.
    EndHolders,
    /// Handing a held lock to a child process
    /// ([`LockGuard::share_with_child`](crate::LockGuard::share_with_child)): no descriptor
    /// keeps this lock alive (a connection borrowed from an sqlx pool, behind a pooler or
    /// proxy, MySQL over a Unix socket, POSIX record locks). The lock stays this
    /// process's alone; the child runs without it if its parent dies.
    ShareWithChild,
    /// Multiplexing locks over shared connections: needs dblock's own PostgreSQL
    /// connections (a URL), not an sqlx pool.
    Multiplexing,
    /// The benchmark's floor (`dblock bench`): needs dblock's own connections (a URL),
    /// not an sqlx pool.
    Benchmark,
    /// The migration runner: this backend has none.
    Migrations,
    /// Showing a key as the database's own tools list it
    /// ([`Key::shown_on`](crate::Key::shown_on)): the embedded backend's locks are byte
    /// ranges of its lock file, not rows a query shows; `dblock status` shows them.
    ShowKey,
    /// Advisory locks that exclude: the server (an engine other than PostgreSQL) has no
    /// advisory locks of the scope asked for (CockroachDB's session-level ones), or its
    /// check found that a lock taken on one connection did not stop another (functions
    /// that always grant, as CockroachDB's were for years), so every caller would hold
    /// the lock at once. Every request of that scope on the handle is refused; use
    /// PostgreSQL, or the scope the message names. See `docs/connecting.md` (engines).
    AdvisoryLocks,
    /// Checking that advisory locks exclude
    /// ([`Locks::check_exclusion`](crate::Locks::check_exclusion)): only PostgreSQL-protocol
    /// servers are checked; MySQL's named locks and the embedded backend's file locks are
    /// the database's and the kernel's own.
    ExclusionCheck,
}

/// What a server called an error it reported ([`Error::Database`], [`Error::Deadlock`],
/// [`Error::LockTableFull`], [`Error::PermissionDenied`]): the SQLSTATE, only when the
/// server sent one, and the backend's own code.
///
/// | backend | `sqlstate` | `native` |
/// |---|---|---|
/// | PostgreSQL | the SQLSTATE (`40P01`) | the SQLSTATE again: it has no other code |
/// | MySQL, MariaDB | the SQLSTATE sent beside the error number (`40001`; often the generic `HY000`) | the error number (`1213`) |
/// | SQLite | never (SQLite has none) | the extended result code (`2067`) |
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct ServerCode {
    /// The SQLSTATE, when the server sent one.
    pub sqlstate: Option<String>,
    /// The backend's own code, when it has one.
    pub native: Option<String>,
}

impl ServerCode {
    /// A PostgreSQL error's: its SQLSTATE is its only code.
    pub(crate) fn sqlstate(sqlstate: &str) -> ServerCode {
        ServerCode {
            sqlstate: Some(sqlstate.to_string()),
            native: Some(sqlstate.to_string()),
        }
    }

    /// An error the backend numbers (MySQL's error number, SQLite's result code), with
    /// the SQLSTATE the server sent beside it, if any.
    pub(crate) fn numbered(native: Option<String>, sqlstate: Option<String>) -> ServerCode {
        ServerCode { sqlstate, native }
    }
}

/// ` CODE` (PostgreSQL), ` NUMBER (SQLSTATE)` (MySQL, as its client prints it), or
/// nothing: what follows "database error" in a message.
impl fmt::Display for ServerCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.native, &self.sqlstate) {
            (Some(n), Some(s)) if n != s => write!(f, " {n} ({s})"),
            (Some(c), _) | (None, Some(c)) => write!(f, " {c}"),
            (None, None) => Ok(()),
        }
    }
}

/// Why a held lock was lost.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// The lock's connection closed or failed: the server restarted or shut down, an
    /// operator terminated the backend (`pg_terminate_backend`), the network broke.
    ConnectionClosed {
        /// What the driver or the server said.
        message: String,
    },
    /// The connection stopped answering health checks for this long; dblock closed it.
    Unresponsive {
        /// How long the check went unanswered.
        after: Duration,
    },
    /// The embedded backend's lock file was deleted or replaced while the lock was held:
    /// requests made since lock the file the path names now, where this lock is not
    /// seen (see [`sqlite`](crate::sqlite#identity-is-the-file-not-the-spelling)).
    LockFileReplaced {
        /// The lock file's path.
        path: std::path::PathBuf,
    },
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::ConnectionClosed { message } => {
                write!(f, "its connection closed ({message})")
            }
            LossReason::Unresponsive { after } => {
                write!(f, "its connection did not answer a check for {after:?}")
            }
            LossReason::LockFileReplaced { path } => {
                write!(f, "its lock file {} was replaced", path.display())
            }
        }
    }
}

impl Error {
    /// Whether this error says the wait for the lock itself ran out (the server's
    /// `lock_timeout` ended a wait), as opposed to a connection or server failure: the
    /// lock was simply not obtained.
    pub fn is_lock_wait_timeout(&self) -> bool {
        matches!(
            self,
            Error::Timeout {
                waiting_for: WaitingFor::LockServerLockTimeout,
                ..
            }
        )
    }

    /// Whether this error says the database could not be reached or stopped answering
    /// (as opposed to a bad request, or a lock wait the server ended: see
    /// [`Error::is_lock_wait_timeout`]).
    pub fn is_connection(&self) -> bool {
        match self {
            Error::MigrationFailed { source, .. } => source.is_connection(),
            Error::Timeout { waiting_for, .. } => waiting_for.is_connection(),
            _ => matches!(self, Error::Connect { .. } | Error::ConnectionLost { .. }),
        }
    }

    /// Whether this error is the caller's input (a name, namespace, URL, request or
    /// migration set) being wrong.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidName { .. }
                | Error::InvalidNamespace { .. }
                | Error::InvalidUrl { .. }
                | Error::InvalidRequest { .. }
        ) || self.is_bad_migration_set()
    }

    /// Whether this error is a migration set that cannot be applied as it is, found
    /// before anything was applied: a malformed file, a repeated version, an applied
    /// migration edited since, applied versions the set lacks, another tool's history
    /// that cannot be adopted as it stands, or a migration interrupted part way.
    pub fn is_bad_migration_set(&self) -> bool {
        matches!(
            self,
            Error::InvalidMigration { .. }
                | Error::DuplicateMigration { .. }
                | Error::MigrationEdited { .. }
                | Error::UnknownMigrations { .. }
                | Error::ForeignHistory { .. }
                | Error::MigrationInterrupted { .. }
        )
    }

    /// The server's codes for an error it reported (a failed migration's: its
    /// source's), if it reported one: see [`ServerCode`].
    pub fn server_code(&self) -> Option<&ServerCode> {
        match self {
            Error::Database { code, .. }
            | Error::Deadlock { code, .. }
            | Error::LockTableFull { code, .. }
            | Error::PermissionDenied { code, .. } => Some(code),
            Error::MigrationFailed { source, .. } => source.server_code(),
            _ => None,
        }
    }

    /// The SQLSTATE of an error the server reported, only when the server sent one:
    /// PostgreSQL's always, MySQL's and MariaDB's as sent beside their error number
    /// (`40001` for InnoDB's deadlock, often the generic `HY000`), SQLite's never.
    pub fn sqlstate(&self) -> Option<&str> {
        self.server_code()?.sqlstate.as_deref()
    }

    /// The backend's own code for an error the server reported: PostgreSQL's SQLSTATE,
    /// MySQL's or MariaDB's error number (`"1213"`), SQLite's extended result code
    /// (`"2067"`).
    pub fn native_code(&self) -> Option<&str> {
        self.server_code()?.native.as_deref()
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Maps a server error by SQLSTATE; `message` already carries detail and hint.
    pub(crate) fn from_sqlstate(sqlstate: &str, message: String) -> Error {
        let code = ServerCode::sqlstate(sqlstate);
        match sqlstate {
            "40P01" => Error::Deadlock { message, code },
            "53200" => Error::LockTableFull { message, code },
            // admin_shutdown, crash_shutdown, cannot_connect_now: the session is gone.
            "57P01" | "57P02" | "57P03" => Error::ConnectionLost { message },
            _ => Error::Database { code, message },
        }
    }

    /// [`Error::Unexpected`]: an answer dblock cannot map, or a rule of its own broken.
    pub(crate) fn unexpected(message: impl Into<String>) -> Error {
        Error::Unexpected {
            message: message.into(),
        }
    }

    /// [`Error::InvalidRequest`].
    pub(crate) fn invalid_request(reason: impl Into<String>) -> Error {
        Error::InvalidRequest {
            reason: reason.into(),
        }
    }

    /// [`Error::Unsupported`]: `capability` is lacking, for `reason`.
    pub(crate) fn unsupported(capability: Capability, reason: impl Into<String>) -> Error {
        Error::Unsupported {
            capability,
            reason: reason.into(),
        }
    }

    /// [`Error::Configuration`].
    pub(crate) fn configuration(reason: impl Into<String>) -> Error {
        Error::Configuration {
            reason: reason.into(),
        }
    }
}

/// The server's "out of shared memory" message, with the remedy when it lacks it.
fn with_lock_table_hint(message: &str) -> String {
    if message.contains("max_locks_per_transaction") {
        message.to_string()
    } else {
        format!("{message}; raise max_locks_per_transaction or hold fewer locks at once")
    }
}

/// A URL safe to print: the password between `:` and `@` of the authority replaced.
/// Also `password=` in the query and in `key=value` strings (see `conninfo::redact`).
pub(crate) fn redact_url(url: &str) -> String {
    crate::conninfo::redact(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db?x=1"),
            "postgres://u:***@h:5432/db?x=1"
        );
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact_url("sqlite:/tmp/x.db"), "sqlite:/tmp/x.db");
        assert_eq!(redact_url("postgres://h:5432/db"), "postgres://h:5432/db");
    }

    #[test]
    fn a_server_ended_lock_wait_is_not_a_connection_failure() {
        for (w, lock_timeout, connection) in [
            (WaitingFor::LockServerLockTimeout, true, false),
            (WaitingFor::LockServerStatementTimeout, false, false),
            (WaitingFor::ServerReply, false, true),
            (WaitingFor::PoolConnection, false, true),
            (WaitingFor::SqlxPoolConnection, false, true),
            (WaitingFor::FencingTable, false, false),
            (WaitingFor::MigrationLock, false, false),
        ] {
            let e = Error::Timeout {
                waiting_for: w,
                after: None,
            };
            assert_eq!(e.is_lock_wait_timeout(), lock_timeout, "{w:?}");
            assert_eq!(e.is_connection(), connection, "{w:?}");
        }
        // The message is what it was when the kind was a string.
        let e = Error::Timeout {
            waiting_for: WaitingFor::LockServerLockTimeout,
            after: None,
        };
        assert_eq!(
            e.to_string(),
            "timed out waiting for the lock (the server's lock_timeout ended the wait)"
        );
    }

    #[test]
    fn sqlstates_map_to_kinds() {
        assert!(matches!(
            Error::from_sqlstate("40P01", String::new()),
            Error::Deadlock { .. }
        ));
        assert!(matches!(
            Error::from_sqlstate("53200", String::new()),
            Error::LockTableFull { .. }
        ));
        assert!(matches!(
            Error::from_sqlstate("57P01", String::new()),
            Error::ConnectionLost { .. }
        ));
        assert_eq!(
            Error::from_sqlstate("42P01", String::new()).sqlstate(),
            Some("42P01")
        );
    }

    #[test]
    fn each_backends_codes_are_its_own() {
        let db = |code: ServerCode| Error::Database {
            code,
            message: "m".into(),
        };
        // PostgreSQL: the SQLSTATE is its only code.
        let pg = Error::from_sqlstate("40P01", "m".into());
        assert_eq!(
            (pg.sqlstate(), pg.native_code()),
            (Some("40P01"), Some("40P01"))
        );
        let pg = db(ServerCode::sqlstate("42P01"));
        assert_eq!(pg.to_string(), "database error 42P01: m");
        // MySQL: its number, and the SQLSTATE sent beside it, as its client shows them.
        let my = db(ServerCode::numbered(
            Some("1146".into()),
            Some("42S02".into()),
        ));
        assert_eq!(
            (my.sqlstate(), my.native_code()),
            (Some("42S02"), Some("1146"))
        );
        assert_eq!(my.to_string(), "database error 1146 (42S02): m");
        // SQLite: a result code, never a SQLSTATE.
        let lite = db(ServerCode::numbered(Some("2067".into()), None));
        assert_eq!((lite.sqlstate(), lite.native_code()), (None, Some("2067")));
        assert_eq!(lite.to_string(), "database error 2067: m");
        // None at all: no code is invented.
        let none = db(ServerCode::default());
        assert_eq!((none.sqlstate(), none.native_code()), (None, None));
        assert_eq!(none.to_string(), "database error: m");
        // Errors that are not the server's have none.
        let refused = Error::invalid_request("r");
        assert_eq!((refused.sqlstate(), refused.server_code()), (None, None));
    }
}
