//! The embedded migration runner's shared pieces: the bookkeeping table (its
//! definition and rows), the migration lock, and a connection to the database file.
//! Used by the runner (`migrate`) and adoption (`adopt`).

use sqlx::pool::PoolConnection;
use sqlx::{Row, Sqlite};

use super::{SqliteBackend, SqliteHeld};
use crate::error::Error;
use crate::key::Key;
use crate::migrate::plan::{MIGRATION_LOCK_KEY, Record};

pub(crate) const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS dblock_migrations (\
     version INTEGER PRIMARY KEY, \
     name TEXT NOT NULL, \
     checksum TEXT NOT NULL, \
     applied_at TEXT NOT NULL, \
     duration_ms INTEGER NOT NULL)";

pub(crate) fn map(e: sqlx::Error) -> Error {
    match e {
        sqlx::Error::Database(db) => Error::Database {
            code: None,
            message: db.message().to_string(),
        },
        other => Error::Database {
            code: None,
            message: other.to_string(),
        },
    }
}

/// Waits for the migration lock: the byte at the key's offset, as for any lock, but
/// taken by its raw key rather than derived from a name. Polled, so cancellable; the
/// kernel drops it if the process dies.
pub(crate) async fn lock(b: &SqliteBackend) -> Result<SqliteHeld, Error> {
    b.lock_key(Key::from_i64(MIGRATION_LOCK_KEY)).await
}

pub(crate) async fn connection(b: &SqliteBackend) -> Result<PoolConnection<Sqlite>, Error> {
    b.shared.db().await?.acquire().await.map_err(map)
}

/// The bookkeeping rows.
pub(crate) async fn read_records(conn: &mut PoolConnection<Sqlite>) -> Result<Vec<Record>, Error> {
    let rows = sqlx::query(
        "SELECT version, name, checksum, applied_at, duration_ms FROM dblock_migrations \
         ORDER BY version",
    )
    .fetch_all(&mut **conn)
    .await
    .map_err(map)?;
    rows.iter()
        .map(|r| {
            Ok(Record {
                version: r.try_get(0).map_err(map)?,
                name: r.try_get(1).map_err(map)?,
                checksum: r.try_get(2).map_err(map)?,
                applied_at: r.try_get(3).map_err(map)?,
                duration_ms: r.try_get(4).map_err(map)?,
            })
        })
        .collect()
}
