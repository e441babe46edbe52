//! What the runner and the backends' runners share: the migration lock's key, the
//! bookkeeping table's name and rows, what to apply, and what a run reports.

use std::collections::HashSet;
use std::time::Duration;

use super::set::{Migration, NO_TRANSACTION_HEADER};
use super::split::split;
use crate::error::Error;

/// The advisory-lock key every migration and every start-up DDL script takes first:
/// the ASCII bytes of `DBLOCKM` and a version byte, so that it is recognisable in
/// `pg_locks` (classid 1145195599 = `0x44424c4f`, objid 1129008385 = `0x434b4d01`,
/// objsubid 1).
///
/// One key for the whole database, not one per script: the catalogue indexes that
/// concurrent `CREATE … IF NOT EXISTS` collide on are database-wide, so two *different*
/// scripts race exactly as two runs of one script do.
///
/// ```sql
/// SELECT pid, mode, granted FROM pg_locks
///  WHERE locktype = 'advisory' AND classid = 1145195599 AND objid = 1129008385 AND objsubid = 1;
/// ```
pub const MIGRATION_LOCK_KEY: i64 = 0x4442_4c4f_434b_4d01;

/// The table, in the schema in use (PostgreSQL) or the database file (SQLite), that
/// records the applied migrations: `version`, `name`, `checksum`, `applied_at`,
/// `duration_ms`.
pub const TABLE: &str = "dblock_migrations";

/// `ddl` with the migration lock's acquisition as its first statement.
///
/// Sent as one simple-protocol message, the whole script runs in one implicit
/// transaction: the lock is held for all of it and released at its end, on success and
/// on failure alike, with nothing for the caller to release.
///
/// ```
/// let sql = dblock::migrate::lock_prefixed("CREATE TABLE IF NOT EXISTS t (x int);");
/// assert_eq!(
///     sql,
///     "SELECT pg_catalog.pg_advisory_xact_lock(4918577646357138689);\nCREATE TABLE IF NOT EXISTS t (x int);"
/// );
/// ```
pub fn lock_prefixed(ddl: &str) -> String {
    lock_prefixed_with(MIGRATION_LOCK_KEY, ddl)
}

/// `ddl` with the acquisition of advisory key `key`, transaction-scoped, as its first
/// statement: [`lock_prefixed`] under a key of the caller's own — the one a service's
/// start-up scripts already take, so that its old and new instances exclude each other
/// while both run (see [`run_script_with_key`](super::run_script_with_key)).
///
/// ```
/// let sql = dblock::migrate::lock_prefixed_with(0x4652_4149_5345_0001, "CREATE TABLE IF NOT EXISTS t (x int);");
/// assert_eq!(
///     sql,
///     "SELECT pg_catalog.pg_advisory_xact_lock(5067184313930678273);\nCREATE TABLE IF NOT EXISTS t (x int);"
/// );
/// ```
pub fn lock_prefixed_with(key: i64, ddl: &str) -> String {
    format!("SELECT pg_catalog.pg_advisory_xact_lock({key});\n{ddl}")
}

/// What a run did.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Report {
    /// The migrations this run applied, in order.
    pub applied: Vec<Applied>,
    /// How many migrations of the set were applied before this run (adopted ones
    /// included).
    pub already_applied: usize,
    /// How many migrations another tool had applied this run adopted: recorded as
    /// applied without running them, after verifying their checksums (see
    /// [the module](crate::migrate#adopting-another-tools-history)).
    pub adopted: usize,
}

/// One migration a run applied.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Applied {
    /// Its version.
    pub version: i64,
    /// Its name.
    pub name: String,
    /// Its file name, `VERSION_NAME.sql`.
    pub file_name: String,
    /// How long its SQL took (as recorded in `duration_ms`).
    pub duration: Duration,
    /// Whether it ran outside a transaction.
    pub no_transaction: bool,
}

/// One bookkeeping row.
#[derive(Debug, Clone, Default)]
pub(crate) struct Record {
    pub(crate) version: i64,
    pub(crate) name: String,
    pub(crate) checksum: String,
    /// When it was applied (for a started row: started), RFC 3339 in UTC; empty for
    /// "now" in rows about to be written.
    pub(crate) applied_at: String,
    pub(crate) duration_ms: i64,
    pub(crate) state: RecordState,
}

/// Whether a recorded migration is done, or was started outside a transaction and never
/// finished.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum RecordState {
    /// Applied.
    #[default]
    Done,
    /// Started, never recorded as done: how many statements are known to have
    /// completed, when it runs statement by statement (`None`: sent whole).
    Started { completed: Option<usize> },
}

impl Record {
    pub(crate) fn started(&self) -> bool {
        matches!(self.state, RecordState::Started { .. })
    }
}

/// What to apply, in order, after checking the records against the set (started rows
/// are refused before, by [`refuse_interrupted`]).
pub(crate) fn plan<'s>(
    set: &'s [Migration],
    records: &[Record],
    ignore_missing: bool,
) -> Result<Vec<&'s Migration>, Error> {
    let mut unknown = Vec::new();
    for r in records {
        match set.binary_search_by_key(&r.version, Migration::version) {
            Ok(i) => {
                let m = &set[i];
                if m.checksum() != r.checksum {
                    return Err(Error::MigrationEdited {
                        file: m.file().to_string(),
                        version: m.version(),
                        applied_checksum: r.checksum.clone(),
                        checksum: m.checksum().to_string(),
                    });
                }
            }
            Err(_) => unknown.push(format!("{} ({})", r.version, r.name)),
        }
    }
    if !unknown.is_empty() && !ignore_missing {
        return Err(Error::UnknownMigrations { missing: unknown });
    }
    let applied: HashSet<i64> = records.iter().map(|r| r.version).collect();
    Ok(set
        .iter()
        .filter(|m| !applied.contains(&m.version()))
        .collect())
}

/// The error of migration `m` failing, at `statement` (k of n) if it runs outside a
/// transaction.
pub(crate) fn failed(m: &Migration, statement: Option<(usize, usize)>, e: Error) -> Error {
    let source = match e {
        // "CREATE INDEX CONCURRENTLY cannot run inside a transaction block"
        Error::Database { code, message }
            if code.sqlstate.as_deref() == Some("25001") && !m.no_transaction() =>
        {
            Error::Database {
                code,
                message: format!(
                    "{message}; hint: make {NO_TRANSACTION_HEADER:?} the file's first line"
                ),
            }
        }
        // A failed `CREATE INDEX CONCURRENTLY` leaves an INVALID index behind, which no
        // rollback removes: the file run again fails on it, or keeps it (IF NOT EXISTS).
        Error::Database { code, message } if failed_statement_builds_concurrently(m, statement) => {
            Error::Database {
                code,
                message: format!(
                    "{message}; hint: the failed CREATE INDEX CONCURRENTLY may have left an \
                     INVALID index (see pg_index.indisvalid): drop it before running the file again"
                ),
            }
        }
        other => other,
    };
    Error::MigrationFailed {
        file: m.file().to_string(),
        version: m.version(),
        name: m.name().to_string(),
        statement,
        source: Box::new(source),
    }
}

/// Whether statement k (1-based) of `m`, run outside a transaction, builds an index
/// concurrently.
fn failed_statement_builds_concurrently(m: &Migration, statement: Option<(usize, usize)>) -> bool {
    let Some((k, _)) = statement else {
        return false;
    };
    let Some(text) = m
        .statements()
        .get(k.wrapping_sub(1))
        .map(|s| s.to_ascii_uppercase())
    else {
        return false;
    };
    // The words outside `--` comments: `CREATE [UNIQUE] INDEX CONCURRENTLY` or `REINDEX …`.
    let words: Vec<&str> = text
        .lines()
        .map(|line| line.split("--").next().unwrap_or(""))
        .flat_map(str::split_whitespace)
        .collect();
    let builds = matches!(words.first(), Some(&"CREATE") | Some(&"REINDEX"));
    builds && words.windows(2).any(|w| w == ["INDEX", "CONCURRENTLY"])
}

/// A duration in whole milliseconds, as the bookkeeping table records it.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Refuses when a migration was started and never finished (see
/// [`Error::MigrationInterrupted`]): under the lock that row was left by a run that
/// ended part way, and part of it may be applied. `by_statement` says whether the
/// backend runs no-transaction files statement by statement (else they are sent whole).
pub(crate) fn refuse_interrupted(
    set: &[Migration],
    records: &[Record],
    by_statement: bool,
) -> Result<(), Error> {
    match records.iter().find(|r| r.started()) {
        Some(r) => Err(interrupted(set, r, by_statement)),
        None => Ok(()),
    }
}

/// The error of the started row `r`: what is known to have run, and what to do.
pub(crate) fn interrupted(set: &[Migration], r: &Record, by_statement: bool) -> Error {
    let m = set
        .binary_search_by_key(&r.version, Migration::version)
        .ok()
        .and_then(|i| set.get(i));
    let file = m.map_or_else(|| format!("{}_{}", r.version, r.name), |m| m.file().into());
    let v = r.version;
    let completed = match r.state {
        RecordState::Started { completed } => completed,
        RecordState::Done => None,
    };
    // The file's statements, when it is the one that was started.
    let statements = m
        .filter(|m| m.checksum() == r.checksum && m.no_transaction() && by_statement)
        .map(|m| split(m.sql()));
    let progress = completed.zip(statements.as_ref().map(Vec::len));
    let what = match (progress, &statements) {
        (Some((k, n)), Some(stmts)) => ran_by_statement(k, n, stmts),
        _ if by_statement && completed.is_some() => format!(
            "{} of its statements are known to have completed, and the file has changed \
             since, so which ones cannot be told",
            completed.unwrap_or(0)
        ),
        _ => "it was sent whole, and the server commits DDL as it goes, so part of it may \
              be applied"
            .into(),
    };
    let what = capitalized(&what);
    let docs = if by_statement {
        "docs/migrations.md"
    } else {
        "docs/mysql.md"
    };
    // Sent whole (MySQL), a run keeping sqlx's history wrote sqlx's row first, as
    // sqlx's MySQL migrator does: success = false until done.
    let sqlx = if by_statement {
        String::new()
    } else {
        format!(
            " (and the same in _sqlx_migrations if it has a row for it: UPDATE … SET \
             success = TRUE WHERE version = {v}, or DELETE … WHERE version = {v})"
        )
    };
    let explanation = format!(
        "was started at {} outside a transaction and never recorded as done: its run was \
         killed or lost its connection (or failed part way). {what}. Check the schema, \
         finish or undo what it did, then record the decision: UPDATE dblock_migrations \
         SET state = 'done' WHERE version = {v} (it is applied), or DELETE FROM \
         dblock_migrations WHERE version = {v} (the next run applies it again, from its \
         first statement){sqlx}; see {docs}",
        r.applied_at
    );
    Error::MigrationInterrupted {
        file,
        version: v,
        started_at: r.applied_at.clone(),
        progress,
        explanation,
    }
}

/// What ran of a migration of `n` statements of which `k` are known to have completed.
fn ran_by_statement(k: usize, n: usize, stmts: &[&str]) -> String {
    let known = match k {
        0 => "none of its statements is known to have completed".to_string(),
        1 => format!("statement 1 of {n} completed"),
        k => format!("statements 1 to {k} of {n} completed"),
    };
    let Some(next) = stmts.get(k) else {
        return format!("{known}; it was not recorded as done");
    };
    let later = match n - (k + 1) {
        0 => String::new(),
        1 => format!("; statement {} did not run", k + 2),
        _ => format!("; statements {} to {n} did not run", k + 2),
    };
    format!(
        "{known}; statement {} ({}) was running, and may have been applied (a concurrent \
         index build that did not finish leaves an INVALID index){later}",
        k + 1,
        excerpt(next)
    )
}

/// `s` with its first letter in upper case (it starts a sentence).
fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(first) => first.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// The start of a statement, on one line, for a message.
fn excerpt(stmt: &str) -> String {
    let one_line: String = stmt.split_whitespace().collect::<Vec<_>>().join(" ");
    match one_line.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &one_line[..i]),
        None => one_line,
    }
}
