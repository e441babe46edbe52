//! Fencing tokens on the embedded backend: the table in the database file, the next
//! token committed (`synchronous = FULL`) while the file lock is held, the latest grant
//! read back, and the check a fenced write makes.

use super::{Shared, SqliteBackend};
use crate::error::Error;
use crate::key::Key;
use crate::raw::Fence;
use crate::raw::{BoxFuture, FencingStore, LatestGrant, Req, holder_id};

impl FencingStore for SqliteBackend {
    fn latest_grant(&self, key: Key) -> BoxFuture<'_, Result<Option<LatestGrant>, Error>> {
        Box::pin(latest_grant(&self.shared, key))
    }
}

/// The latest token of `key`, read inside `tx` (which holds the database's write lock
/// if it began `IMMEDIATE`).
pub(crate) async fn check(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    key: Key,
) -> Result<Option<i64>, Error> {
    let conn: &mut sqlx::SqliteConnection = tx;
    sqlx::query_scalar("SELECT token FROM dblock_fencing WHERE key = ?1")
        .bind(key.as_i64())
        .fetch_optional(conn)
        .await
        .map_err(|e| Error::Database {
            code: super::bookkeeping::code_of(&e),
            message: format!("fencing check: {e}"),
        })
}

// The check of writes to this backend's database, on the token every backend's grant
// carries: defined here, so that the friendly layer names no backend.
impl Fence {
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    /// Checks, inside `tx` on the embedded database file, that this is still the latest
    /// grant of the name. Begin `tx` with `BEGIN IMMEDIATE` (sqlx:
    /// `conn.begin_with("BEGIN IMMEDIATE")`) so it holds the database's write lock from
    /// the start; in a deferred transaction a grant committed after the check makes the
    /// first write fail with SQLITE_BUSY instead — also safe, less clear.
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] when a newer grant exists (roll `tx` back); database errors.
    ///
    /// # Cancel safety
    ///
    /// A read; cancelling it leaves `tx` as it was.
    pub async fn check_sqlite(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    ) -> Result<(), Error> {
        let latest = check(tx, self.key()).await?;
        self.stale(latest)
    }
}

/// The next token for `req`'s name in the embedded database, committed before it is
/// returned. Called with the lock held.
pub(crate) async fn next_token(shared: &Shared, req: &Req<'_>) -> Result<i64, Error> {
    let db = shared.db().await?;
    let fail = |e: sqlx::Error| Error::Database {
        code: super::bookkeeping::code_of(&e),
        message: format!("fencing token: {e}"),
    };
    sqlx::query(TABLE_DDL).execute(db).await.map_err(fail)?;
    sqlx::query_scalar::<_, i64>(
        "INSERT INTO dblock_fencing (key, namespace, name, token, holder, granted_at) \
         VALUES (?1, ?2, ?3, 1, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
         ON CONFLICT (key) DO UPDATE SET token = token + 1, holder = excluded.holder, \
         granted_at = excluded.granted_at RETURNING token",
    )
    .bind(req.fence_key().as_i64())
    .bind(req.namespace)
    .bind(req.name)
    .bind(holder_id())
    .fetch_one(db)
    .await
    .map_err(fail)
}

/// The DDL of the fencing table.
pub(crate) const TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_fencing (\
     key INTEGER PRIMARY KEY, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     token INTEGER NOT NULL, \
     holder TEXT NOT NULL, \
     granted_at TEXT NOT NULL)";

/// The latest grant of `key` recorded in the embedded database, if any.
async fn latest_grant(shared: &Shared, key: Key) -> Result<Option<LatestGrant>, Error> {
    let db = shared.db().await?;
    let fail = |e: sqlx::Error| Error::Database {
        code: super::bookkeeping::code_of(&e),
        message: format!("fencing table: {e}"),
    };
    sqlx::query(TABLE_DDL).execute(db).await.map_err(fail)?;
    let row: Option<(String, i64, String)> =
        sqlx::query_as("SELECT holder, token, granted_at FROM dblock_fencing WHERE key = ?1")
            .bind(key.as_i64())
            .fetch_optional(db)
            .await
            .map_err(fail)?;
    Ok(row.map(|(holder, token, granted_at)| LatestGrant {
        holder,
        token,
        granted_at,
    }))
}
