//! Leaders' values on the embedded backend: `dblock_leaders` in the database file, one
//! row per election name (keyed like the fencing table), written by the leader of the
//! term it names and read with the fencing table's record of the latest term.

use super::{Shared, SqliteBackend};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BoxFuture, Fence, LeaderStore, TermRecord, check_leader_value, terms_condition};
use crate::status::from_unix_ms;

/// The DDL of the leaders' table.
const TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_leaders (\
     key INTEGER PRIMARY KEY, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     token INTEGER NOT NULL, \
     holder TEXT NOT NULL, \
     value TEXT, \
     published_at TEXT NOT NULL)";

/// Both tables (a reader of a file no fenced grant has touched yet finds neither).
async fn ensure_tables(db: &sqlx::SqlitePool) -> Result<(), Error> {
    for ddl in [super::fence::TABLE_DDL, TABLE_DDL] {
        sqlx::query(ddl)
            .execute(db)
            .await
            .map_err(fail("leaders' table"))?;
    }
    Ok(())
}

fn fail(what: &'static str) -> impl Fn(sqlx::Error) -> Error {
    move |e| match super::bookkeeping::map(e) {
        Error::Database { code, message } => Error::Database {
            code,
            message: format!("{what}: {message}"),
        },
        other => other,
    }
}

impl LeaderStore for SqliteBackend {
    fn publish<'a>(&'a self, fence: &'a Fence, value: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(publish(&self.shared, fence, value))
    }

    fn terms<'a>(
        &'a self,
        keys: &'a [Key],
        prefixes: &'a [(&'a str, &'a str)],
    ) -> BoxFuture<'a, Result<Vec<TermRecord>, Error>> {
        Box::pin(terms(&self.shared, keys, prefixes))
    }
}

async fn publish(shared: &Shared, fence: &Fence, value: &str) -> Result<(), Error> {
    check_leader_value(value)?;
    let db = shared.db().await?;
    ensure_tables(db).await?;
    // Written only from the fencing row of this very term, and never over a newer
    // term's value.
    let written = sqlx::query(
        "INSERT INTO dblock_leaders AS l \
         (key, namespace, name, token, holder, value, published_at) \
         SELECT f.key, f.namespace, f.name, f.token, f.holder, ?1, \
         strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
         FROM dblock_fencing f WHERE f.key = ?2 AND f.token = ?3 \
         ON CONFLICT (key) DO UPDATE SET namespace = excluded.namespace, \
         name = excluded.name, token = excluded.token, holder = excluded.holder, \
         value = excluded.value, published_at = excluded.published_at \
         WHERE l.token <= excluded.token",
    )
    .bind(value)
    .bind(fence.key().as_i64())
    .bind(fence.token())
    .execute(db)
    .await
    .map_err(fail("publishing a leader's value"))?;
    if written.rows_affected() > 0 {
        return Ok(());
    }
    let latest: Option<i64> = sqlx::query_scalar("SELECT token FROM dblock_fencing WHERE key = ?1")
        .bind(fence.key().as_i64())
        .fetch_optional(db)
        .await
        .map_err(fail("fencing table"))?;
    Err(Error::StaleToken {
        name: fence.name().to_string(),
        token: fence.token(),
        latest: latest.unwrap_or(0),
    })
}

/// One term row: key, namespace, name, holder, token, granted (ms), value.
type Row = (
    i64,
    String,
    String,
    String,
    i64,
    Option<f64>,
    Option<String>,
);

async fn terms(
    shared: &Shared,
    keys: &[Key],
    prefixes: &[(&str, &str)],
) -> Result<Vec<TermRecord>, Error> {
    let head = "substr(f.name, 1, ?)";
    let Some(cond) = terms_condition(keys.len(), prefixes.len(), "key", head) else {
        return Ok(Vec::new());
    };
    let db = shared.db().await?;
    ensure_tables(db).await?;
    let sql = format!(
        "SELECT f.key, f.namespace, f.name, f.holder, f.token, \
         (julianday(f.granted_at) - 2440587.5) * 86400000.0, l.value \
         FROM dblock_fencing f LEFT JOIN dblock_leaders l \
         ON l.key = f.key AND l.token = f.token WHERE {cond} ORDER BY f.key"
    );
    let mut q = sqlx::query_as::<_, Row>(sqlx::AssertSqlSafe(sql));
    for k in keys {
        q = q.bind(k.as_i64());
    }
    for (ns, prefix) in prefixes {
        q = q
            .bind(*ns)
            .bind(prefix.chars().count() as i64)
            .bind(*prefix);
    }
    let rows = q.fetch_all(db).await.map_err(fail("leaders' table"))?;
    Ok(rows
        .into_iter()
        .map(
            |(key, namespace, name, holder, token, ms, value)| TermRecord {
                key: Key::from_i64(key),
                namespace,
                name,
                holder,
                token,
                granted_at: ms.and_then(from_unix_ms),
                value,
            },
        )
        .collect())
}
