//! The embedded migration store's shared pieces: the bookkeeping table (its definition
//! and rows), the migration lock, and a connection to the database file. Used by the
//! store (`migrate`) and sqlx's history (`adopt`).

use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, Sqlite};

use super::SqliteBackend;
use crate::error::{Error, ServerCode};
use crate::key::Key;
use crate::migrate::plan::{MIGRATION_LOCK_KEY, Record, RecordState};
use crate::raw::Entry;

pub(crate) const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS dblock_migrations (\
     version INTEGER PRIMARY KEY, \
     name TEXT NOT NULL, \
     checksum TEXT NOT NULL, \
     applied_at TEXT NOT NULL, \
     duration_ms INTEGER NOT NULL, \
     state TEXT NOT NULL DEFAULT 'done', \
     statements_done INTEGER)";

/// The columns a migration started outside a transaction needs, added to a table of an
/// earlier dblock when it first runs one (SQLite adds one column per statement).
pub(crate) const ADD_STATE_COLUMNS: [&str; 2] = [
    "ALTER TABLE dblock_migrations ADD COLUMN state TEXT NOT NULL DEFAULT 'done'",
    "ALTER TABLE dblock_migrations ADD COLUMN statements_done INTEGER",
];

/// How many of the state columns the table has (`2`: all).
pub(crate) const STATE_COLUMNS: &str = "SELECT count(*) FROM pragma_table_info('dblock_migrations') \
     WHERE name IN ('state', 'statements_done')";

pub(crate) fn map(e: sqlx::Error) -> Error {
    let code = code_of(&e);
    match e {
        sqlx::Error::Database(db) => Error::Database {
            code,
            message: db.message().to_string(),
        },
        other => Error::Database {
            code,
            message: other.to_string(),
        },
    }
}

/// An SQLite error's code: its extended result code (`2067`), never a SQLSTATE.
pub(crate) fn code_of(e: &sqlx::Error) -> ServerCode {
    match e {
        sqlx::Error::Database(db) => ServerCode::numbered(db.code().map(|c| c.into_owned()), None),
        _ => ServerCode::default(),
    }
}

/// Waits for the migration lock: the byte at the key's offset, as for any lock, but
/// taken by its raw key rather than derived from a name. Polled, so cancellable; the
/// kernel drops it if the process dies.
pub(crate) async fn lock(b: &SqliteBackend) -> Result<Entry, Error> {
    b.lock_key(Key::from_i64(MIGRATION_LOCK_KEY)).await
}

pub(crate) async fn connection(b: &SqliteBackend) -> Result<PoolConnection<Sqlite>, Error> {
    b.shared.db().await?.acquire().await.map_err(map)
}

/// Whether the bookkeeping table exists.
pub(crate) async fn table_exists(conn: &mut PoolConnection<Sqlite>) -> Result<bool, Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'dblock_migrations'",
    )
    .fetch_one(&mut **conn)
    .await
    .map_err(map)?;
    Ok(n > 0)
}

/// The bookkeeping rows (a table of an earlier dblock has no state columns: every row
/// of it is done).
pub(crate) async fn read_records(conn: &mut PoolConnection<Sqlite>) -> Result<Vec<Record>, Error> {
    let rows = sqlx::query("SELECT * FROM dblock_migrations ORDER BY version")
        .fetch_all(&mut **conn)
        .await
        .map_err(map)?;
    rows.iter().map(record).collect()
}

fn record(r: &SqliteRow) -> Result<Record, Error> {
    let state: String = optional(r, "state")?.unwrap_or_else(|| "done".into());
    let completed: Option<i64> = optional(r, "statements_done")?.flatten();
    let state = match state.as_str() {
        "done" => RecordState::Done,
        _ => RecordState::Started {
            completed: completed.and_then(|k| usize::try_from(k).ok()),
        },
    };
    Ok(Record {
        version: r.try_get("version").map_err(map)?,
        name: r.try_get("name").map_err(map)?,
        checksum: r.try_get("checksum").map_err(map)?,
        applied_at: r.try_get("applied_at").map_err(map)?,
        duration_ms: r.try_get("duration_ms").map_err(map)?,
        state,
    })
}

/// A column that a table of an earlier dblock lacks: `None` then.
fn optional<T>(r: &SqliteRow, column: &str) -> Result<Option<T>, Error>
where
    T: for<'r> sqlx::Decode<'r, Sqlite> + sqlx::Type<Sqlite>,
{
    match r.try_get(column) {
        Ok(v) => Ok(Some(v)),
        Err(sqlx::Error::ColumnNotFound(_)) => Ok(None),
        Err(e) => Err(map(e)),
    }
}
