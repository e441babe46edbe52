//! Fencing tokens: numbers that rise with every grant of a name, so that a holder that
//! lost its lock without noticing cannot overwrite the work of the holder after it.

use std::sync::OnceLock;

/// The table, in the schema in use, that keeps the latest token of every fenced name.
pub const TABLE: &str = "dblock_fencing";

/// The PostgreSQL DDL of the fencing table.
pub(crate) fn pg_table_ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         key bigint PRIMARY KEY, \
         namespace text NOT NULL, \
         name text NOT NULL, \
         token bigint NOT NULL, \
         holder text NOT NULL, \
         granted_at timestamptz NOT NULL)"
    )
}

/// This process, as recorded beside each grant: `host:pid`.
pub(crate) fn holder_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown-host".into());
        format!("{host}:{}", std::process::id())
    })
}

/// The next token for `req`'s name in the embedded database, committed before it is
/// returned. Called with the lock held.
#[cfg(feature = "sqlite")]
pub(crate) async fn sqlite_next_token(
    shared: &crate::sqlite::Shared,
    req: &crate::locks::Req<'_>,
) -> Result<i64, crate::Error> {
    let db = shared.db().await?;
    let fail = |e: sqlx::Error| crate::Error::Database {
        code: None,
        message: format!("fencing token: {e}"),
    };
    sqlx::query(SQLITE_TABLE_DDL)
        .execute(db)
        .await
        .map_err(fail)?;
    sqlx::query_scalar::<_, i64>(
        "INSERT INTO dblock_fencing (key, namespace, name, token, holder, granted_at) \
         VALUES (?1, ?2, ?3, 1, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
         ON CONFLICT (key) DO UPDATE SET token = token + 1, holder = excluded.holder, \
         granted_at = excluded.granted_at RETURNING token",
    )
    .bind(req.key.as_i64())
    .bind(req.namespace)
    .bind(req.name)
    .bind(holder_id())
    .fetch_one(db)
    .await
    .map_err(fail)
}

/// The SQLite DDL of the fencing table.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_fencing (\
     key INTEGER PRIMARY KEY, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     token INTEGER NOT NULL, \
     holder TEXT NOT NULL, \
     granted_at TEXT NOT NULL)";
