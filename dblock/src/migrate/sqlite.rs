//! The runner on the embedded backend: the migration lock is the OFD lock on
//! [`MIGRATION_LOCK_KEY`]'s byte of the lock file, the bookkeeping table lives in the
//! SQLite database, and each migration runs in a `BEGIN IMMEDIATE` transaction with its
//! row.

use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Connection, Row, Sqlite};

use super::{Applied, MIGRATION_LOCK_KEY, Migration, Record, Report, failed, millis, plan};
use crate::sqlite::{SqliteBackend, SqliteHeld};
use crate::{Error, Key};

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

/// The seed's primitive on SQLite: the script in one transaction under the lock.
pub(crate) async fn run_script(b: &SqliteBackend, ddl: &str) -> Result<(), Error> {
    let _lock = lock(b).await?;
    let mut conn = connection(b).await?;
    // Dropped unfinished, the transaction rolls back (sent to the connection's worker
    // at once, ahead of anything else on it).
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
    sqlx::raw_sql(AssertSqlSafe(ddl))
        .execute(&mut *tx)
        .await
        .map_err(map)?;
    tx.commit().await.map_err(map)
}

/// The bookkeeping rows, read without the lock; `None` if the table does not exist.
pub(crate) async fn records(b: &SqliteBackend) -> Result<Option<Vec<Record>>, Error> {
    let mut conn = connection(b).await?;
    let exists: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'dblock_migrations'",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(map)?;
    if exists == 0 {
        return Ok(None);
    }
    read_records(&mut conn).await.map(Some)
}

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

pub(crate) async fn run(
    b: &SqliteBackend,
    set: &[Migration],
    ignore_missing: bool,
    on_applied: &mut (dyn FnMut(&Applied) + Send),
) -> Result<Report, Error> {
    // Held until this function returns, however it returns; declared first, so dropped
    // after the connection and any transaction on it.
    let _lock = lock(b).await?;
    let mut conn = connection(b).await?;
    sqlx::raw_sql(CREATE_TABLE)
        .execute(&mut *conn)
        .await
        .map_err(map)?;
    let mut records = read_records(&mut conn).await?;
    // sqlx's history: adopted, or refused, before anything is applied.
    let history = super::adopt::sqlite::history(&mut conn).await?;
    let adopted = super::adopt_or_refuse(set, &mut records, &history)?;
    let pending = plan(set, &records, ignore_missing)?;
    super::adopt::sqlite::record(&mut conn, &adopted).await?;
    let mut report = Report {
        applied: Vec::with_capacity(pending.len()),
        already_applied: set.len() - pending.len(),
        adopted: adopted.len(),
    };
    for m in pending {
        let duration = if m.no_transaction() {
            apply_outside_transaction(&mut conn, m).await?
        } else {
            apply_in_transaction(&mut conn, m).await?
        };
        let applied = Applied {
            version: m.version(),
            name: m.name().to_string(),
            file_name: m.file_name().to_string(),
            duration,
            no_transaction: m.no_transaction(),
        };
        on_applied(&applied);
        report.applied.push(applied);
    }
    Ok(report)
}

fn insert(
    m: &Migration,
    took: Duration,
) -> sqlx::query::Query<'static, Sqlite, sqlx::sqlite::SqliteArguments> {
    sqlx::query(
        "INSERT INTO dblock_migrations (version, name, checksum, applied_at, duration_ms) \
         VALUES (?1, ?2, ?3, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), ?4)",
    )
    .bind(m.version())
    .bind(m.name().to_string())
    .bind(m.checksum().to_string())
    .bind(millis(took))
}

async fn apply_in_transaction(
    conn: &mut PoolConnection<Sqlite>,
    m: &Migration,
) -> Result<Duration, Error> {
    let fail = |e| failed(m, None, map(e));
    // IMMEDIATE: the write lock up front, so the transaction never has to upgrade a read
    // lock (which SQLite may refuse at once, busy timeout or not).
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(fail)?;
    let t0 = Instant::now();
    sqlx::raw_sql(AssertSqlSafe(m.sql()))
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let took = t0.elapsed();
    insert(m, took).execute(&mut *tx).await.map_err(fail)?;
    tx.commit().await.map_err(fail)?;
    Ok(took)
}

async fn apply_outside_transaction(
    conn: &mut PoolConnection<Sqlite>,
    m: &Migration,
) -> Result<Duration, Error> {
    let statements = m.statements();
    let n = statements.len();
    let t0 = Instant::now();
    for (i, stmt) in statements.iter().enumerate() {
        sqlx::raw_sql(AssertSqlSafe(*stmt))
            .execute(&mut **conn)
            .await
            .map_err(|e| failed(m, Some((i + 1, n)), map(e)))?;
    }
    let took = t0.elapsed();
    // A BEGIN without its COMMIT would leave the row, and the pooled connection, inside
    // the file's transaction. SQLite refuses a BEGIN within a transaction: probe with one.
    if sqlx::raw_sql("BEGIN").execute(&mut **conn).await.is_err() {
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut **conn).await;
        return Err(failed(
            m,
            None,
            Error::Unsupported(
                "it left a transaction open (a BEGIN without its COMMIT); \
                 the open transaction was rolled back"
                    .into(),
            ),
        ));
    }
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut **conn)
        .await
        .map_err(|e| failed(m, None, map(e)))?;
    insert(m, took)
        .execute(&mut **conn)
        .await
        .map_err(|e| failed(m, None, map(e)))?;
    Ok(took)
}
