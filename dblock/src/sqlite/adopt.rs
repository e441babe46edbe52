//! sqlx's history in an SQLite database (the same table as elsewhere, `checksum` a
//! BLOB), and the recording of adopted rows.

use sqlx::pool::PoolConnection;
use sqlx::{Row, Sqlite};

use super::bookkeeping::map;
use crate::error::Error;
use crate::migrate::adopt::{History, SqlxRow};
use crate::migrate::plan::Record;

/// sqlx's history in `table` (its name as SQL writes it), if the database has it
/// (SQLite has no other tool's table dblock reads).
pub(crate) async fn history(
    conn: &mut PoolConnection<Sqlite>,
    table: &str,
) -> Result<History, Error> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT version, description, \
         coalesce(strftime('%Y-%m-%dT%H:%M:%fZ', installed_on), ''), \
         success, lower(hex(checksum)), execution_time FROM {table} ORDER BY version"
    )))
    .fetch_all(&mut **conn)
    .await;
    let rows = match rows {
        Ok(rows) => rows,
        // No such table (or no such attached database): sqlx never ran here.
        Err(sqlx::Error::Database(e)) if e.message().starts_with("no such table") => {
            return Ok(History::default());
        }
        Err(e) => return Err(map(e)),
    };
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
        sqlx_table: true,
        others: Vec::new(),
    })
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
