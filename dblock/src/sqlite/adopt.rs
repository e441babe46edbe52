//! sqlx's history in an SQLite database (the same table, `checksum` a BLOB), and
//! baseline there.

use sqlx::pool::PoolConnection;
use sqlx::{Row, Sqlite};

use super::SqliteBackend;
use super::bookkeeping::{CREATE_TABLE, connection, lock, map, read_records};
use crate::error::Error;
use crate::migrate::adopt::{History, SQLX_TABLE, SqlxRow, baseline_records};
use crate::migrate::plan::Record;
use crate::migrate::set::Migration;

/// `_sqlx_migrations`, if the database has it (SQLite has no other tool's table
/// dblock reads).
pub(crate) async fn history(conn: &mut PoolConnection<Sqlite>) -> Result<History, Error> {
    let exists: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_one(&mut **conn)
    .await
    .map_err(map)?;
    if exists == 0 {
        return Ok(History::default());
    }
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT version, description, \
         coalesce(strftime('%Y-%m-%dT%H:%M:%fZ', installed_on), ''), \
         success, lower(hex(checksum)), execution_time FROM {SQLX_TABLE} ORDER BY version"
    )))
    .fetch_all(&mut **conn)
    .await
    .map_err(map)?;
    let sqlx = rows
        .iter()
        .map(|r| {
            Ok(SqlxRow {
                version: r.try_get(0).map_err(map)?,
                description: r.try_get(1).map_err(map)?,
                installed_on: r.try_get(2).map_err(map)?,
                success: r.try_get(3).map_err(map)?,
                checksum: r.try_get(4).map_err(map)?,
                execution_time: r.try_get(5).map_err(map)?,
            })
        })
        .collect::<Result<_, Error>>()?;
    Ok(History {
        sqlx,
        others: Vec::new(),
    })
}

/// [`history`] without the lock (status, dry runs).
pub(crate) async fn history_unlocked(b: &SqliteBackend) -> Result<History, Error> {
    history(&mut connection(b).await?).await
}

/// Records `rows` as applied, in one statement (all or none).
pub(crate) async fn record(
    conn: &mut PoolConnection<Sqlite>,
    rows: &[Record],
) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut q = sqlx::QueryBuilder::<Sqlite>::new(
        "INSERT INTO dblock_migrations (version, name, checksum, applied_at, duration_ms) ",
    );
    q.push_values(rows, |mut b, r| {
        b.push_bind(r.version)
            .push_bind(r.name.clone())
            .push_bind(r.checksum.clone())
            .push("coalesce(nullif(")
            .push_bind_unseparated(r.applied_at.clone())
            .push_unseparated(", ''), strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))")
            .push_bind(r.duration_ms);
    });
    q.build().execute(&mut **conn).await.map_err(map)?;
    Ok(())
}

/// `Runner::baseline` on SQLite: under the migration lock, the table, then the rows.
pub(crate) async fn baseline(
    b: &SqliteBackend,
    set: &[Migration],
    to: Option<i64>,
) -> Result<Vec<i64>, Error> {
    let _lock = lock(b).await?;
    let mut conn = connection(b).await?;
    sqlx::raw_sql(CREATE_TABLE)
        .execute(&mut *conn)
        .await
        .map_err(map)?;
    let records = read_records(&mut conn).await?;
    let h = history(&mut conn).await?;
    let rows = baseline_records(set, &records, &h, to)?;
    record(&mut conn, &rows).await?;
    Ok(rows.iter().map(|r| r.version).collect())
}
