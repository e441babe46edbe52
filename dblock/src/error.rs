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
    /// The lock name is empty, too long or contains NUL.
    #[error("invalid lock name {name:?}: {reason}")]
    InvalidName {
        /// The name (shortened for display).
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The namespace is empty, too long or contains NUL.
    #[error("invalid namespace {namespace:?}: {reason}")]
    InvalidNamespace {
        /// The namespace (shortened for display).
        namespace: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The database URL could not be understood, or names a backend this build lacks.
    /// The URL is shown with any password removed.
    #[error("invalid database URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL, password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The database could not be reached (refused, unknown host, authentication failed,
    /// no such database).
    #[error("cannot connect to {target}: {message}")]
    Connect {
        /// Where dblock tried to connect (no password).
        target: String,
        /// The driver's or the server's explanation.
        message: String,
    },

    /// The connection broke while a request was in flight: the server restarted, an
    /// operator terminated the backend, the network dropped. Any lock it held is gone.
    #[error("connection to the database lost: {message}")]
    ConnectionLost {
        /// What the driver or the server said.
        message: String,
    },

    /// PostgreSQL's deadlock detector chose this request as the victim (SQLSTATE 40P01).
    #[error("deadlock detected: {message}")]
    Deadlock {
        /// The server's message, with its detail.
        message: String,
    },

    /// The server's shared lock table is full (PostgreSQL's "out of shared memory",
    /// SQLSTATE 53200). It holds `max_locks_per_transaction × (max_connections +
    /// max_prepared_transactions)` locks across *all* sessions; every lock already held
    /// stays held.
    #[error("the server's lock table is full: {}", with_lock_table_hint(message))]
    LockTableFull {
        /// The server's message.
        message: String,
    },

    /// Something dblock waits for besides the lock itself did not happen in time: a free
    /// connection in dblock's pool, a connection attempt, a health check, or a server
    /// `statement_timeout`.
    #[error("timed out waiting for {waiting_for}{}", after.map(|a| format!(" (after {a:?})")).unwrap_or_default())]
    Timeout {
        /// What was being waited for.
        waiting_for: WaitingFor,
        /// How long dblock waited, when it set the bound itself.
        after: Option<Duration>,
    },

    /// The lock was lost while it was held (see [`LockGuard::lost`]); reported by
    /// operations that need the lock, such as [`LockGuard::release`].
    ///
    /// [`LockGuard::lost`]: crate::LockGuard::lost
    /// [`LockGuard::release`]: crate::LockGuard::release
    #[error("the lock was lost: {reason}")]
    LockLost {
        /// Why it was lost.
        reason: LossReason,
    },

    /// A fenced write was refused because a newer holder of the name exists: this
    /// holder's token is stale (see [`fencing`](crate::fencing)).
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

    /// The database answered with an error dblock does not treat specially.
    #[error("database error{}: {message}", code.as_deref().map(|c| format!(" {c}")).unwrap_or_default())]
    Database {
        /// SQLSTATE, when the server sent one.
        code: Option<String>,
        /// The server's message (with detail and hint when present).
        message: String,
    },

    /// The database answered a lock request with something dblock did not ask for (a
    /// semaphore slot out of range, a fencing token that is not a number): a defect in
    /// dblock or something between it and the server, never "not obtained". Whatever the
    /// request may have taken was released.
    #[error("unexpected answer from the database to {message}")]
    UnexpectedAnswer {
        /// What was asked, and what came back.
        message: String,
    },

    /// The lock file of the embedded backend lies on a network or FUSE file system,
    /// where byte-range locks are unreliable.
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

    /// A file operation of the embedded backend failed.
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
    /// anything was taken.
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
    /// (run once, by a role that has it) gives it.
    #[error("{message}; to fix it, {fix}")]
    PermissionDenied {
        /// The server's message.
        message: String,
        /// The command or SQL that fixes it.
        fix: String,
    },

    /// The request combines options this backend does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A migration file (or the directory of a set) cannot be used: its name breaks the
    /// `VERSION_NAME.sql` rule, its contents are not UTF-8, its header is misspelt, or a
    /// migration that runs in a transaction contains transaction control (see
    /// [`Migrations`](crate::migrate::Migrations)).
    #[error("{file}: {reason}")]
    InvalidMigration {
        /// The file (its path, for a directory's), or the directory.
        file: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Two migration files have the same version.
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
    /// matches the one recorded.
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
    /// older release runs against a newer database).
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
    let kept = match statement {
        None => return String::new(),
        Some((1, _)) => "none of it was applied".to_string(),
        Some((2, _)) => "statement 1 stays applied".to_string(),
        Some((k, _)) => format!("statements 1 to {} stay applied", k.saturating_sub(1)),
    };
    match statement {
        Some((k, n)) => format!(" at statement {k} of {n} (outside a transaction: {kept})"),
        None => String::new(),
    }
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

    /// Whether this error is the caller's input (a name, namespace, URL or migration
    /// set) being wrong.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Error::InvalidName { .. } | Error::InvalidNamespace { .. } | Error::InvalidUrl { .. }
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

    /// The SQLSTATE of a database error, if there is one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Database { code, .. } => code.as_deref(),
            Error::Deadlock { .. } => Some("40P01"),
            Error::LockTableFull { .. } => Some("53200"),
            Error::PermissionDenied { .. } => Some("42501"),
            Error::MigrationFailed { source, .. } => source.sqlstate(),
            _ => None,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Maps a server error by SQLSTATE; `message` already carries detail and hint.
    pub(crate) fn from_sqlstate(code: &str, message: String) -> Error {
        match code {
            "40P01" => Error::Deadlock { message },
            "53200" => Error::LockTableFull { message },
            // admin_shutdown, crash_shutdown, cannot_connect_now: the session is gone.
            "57P01" | "57P02" | "57P03" => Error::ConnectionLost { message },
            _ => Error::Database {
                code: Some(code.to_string()),
                message,
            },
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
}
