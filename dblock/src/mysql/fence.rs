//! The fencing table on MySQL and MariaDB: an InnoDB table in the handle's database.

use sqlx::{MySql, MySqlConnection, MySqlPool};

use super::map_sqlx;
use crate::error::Error;
use crate::key::Key;
use crate::raw::Fence;
use crate::raw::LatestGrant;

/// The DDL of the fencing table (InnoDB: transactional, so a check's shared row lock
/// holds the next grant's increment until the checking transaction ends).
pub(crate) const TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_fencing (\
     `key` BIGINT NOT NULL PRIMARY KEY, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     token BIGINT NOT NULL, \
     holder VARCHAR(255) NOT NULL, \
     granted_at VARCHAR(32) NOT NULL) ENGINE=InnoDB";

/// The DDL of the leaders' table (see `leader`), beside the fencing table. Values are kept as written (`utf8mb4_bin`), whatever
/// the database's default character set.
pub(crate) const LEADERS_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_leaders (\
     `key` BIGINT NOT NULL PRIMARY KEY, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     token BIGINT NOT NULL, \
     holder VARCHAR(255) NOT NULL, \
     value TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL, \
     published_at VARCHAR(32) NOT NULL) ENGINE=InnoDB";

/// What a fenced grant records.
pub(crate) struct FenceRow {
    pub(crate) key: Key,
    pub(crate) namespace: String,
    pub(crate) name: String,
}

/// The next token of `row`'s name, written and committed (autocommit, InnoDB) on the
/// lock's own connection while the lock is held. One statement: the new token comes
/// back in the OK packet as `LAST_INSERT_ID`.
pub(crate) async fn next_token(conn: &mut MySqlConnection, row: &FenceRow) -> Result<i64, Error> {
    let done = sqlx::query(
        "INSERT INTO dblock_fencing (`key`, namespace, name, token, holder, granted_at) \
         VALUES (?, ?, ?, LAST_INSERT_ID(1), ?, DATE_FORMAT(UTC_TIMESTAMP(3), '%Y-%m-%dT%H:%i:%s.%fZ')) \
         ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1), \
         holder = VALUES(holder), granted_at = VALUES(granted_at)",
    )
    .bind(row.key.as_i64())
    .bind(&row.namespace)
    .bind(&row.name)
    .bind(crate::raw::holder_id())
    .execute(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    i64::try_from(done.last_insert_id())
        .map_err(|_| Error::unexpected("fencing token out of range"))
}

/// The latest token of `key`, read inside the caller's transaction with a shared row
/// lock (`LOCK IN SHARE MODE`, which MySQL 8 and MariaDB both accept) held until it ends.
pub(crate) async fn latest_locked(
    tx: &mut sqlx::Transaction<'_, MySql>,
    key: Key,
) -> Result<Option<i64>, Error> {
    let conn: &mut MySqlConnection = tx;
    sqlx::query_scalar("SELECT token FROM dblock_fencing WHERE `key` = ? LOCK IN SHARE MODE")
        .bind(key.as_i64())
        .fetch_optional(conn)
        .await
        .map_err(map_sqlx)
}

// The check of writes to this backend's database, on the token every backend's grant
// carries: defined here, so that the friendly layer names no backend.
impl Fence {
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    /// Checks, inside `tx` on MySQL or MariaDB, that this is still the latest grant of
    /// the name, and holds the name's fencing row (`LOCK IN SHARE MODE`) until `tx`
    /// ends, so that no newer grant can be made before `tx` commits. Call it just before
    /// committing the writes it protects; `tx` must be on the database of the lock's
    /// handle (the fencing table is `dblock_fencing` there).
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] when a newer grant exists (roll `tx` back); database errors.
    ///
    /// # Cancel safety
    ///
    /// If cancelled, `tx` may hold the row lock until it ends; nothing else changes.
    pub async fn check_mysql(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    ) -> Result<(), Error> {
        let latest = latest_locked(tx, self.key()).await?;
        self.stale(latest)
    }
}

/// The latest fenced grant of `key`, if any.
pub(crate) async fn latest_grant(pool: &MySqlPool, key: Key) -> Result<Option<LatestGrant>, Error> {
    let row: Option<(String, i64, String)> =
        sqlx::query_as("SELECT holder, token, granted_at FROM dblock_fencing WHERE `key` = ?")
            .bind(key.as_i64())
            .fetch_optional(pool)
            .await
            .map_err(map_sqlx)?;
    Ok(row.map(|(holder, token, granted_at)| LatestGrant {
        holder,
        token,
        granted_at,
    }))
}
