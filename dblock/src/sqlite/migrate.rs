//! The runner on the embedded backend: the migration lock is the OFD lock on
//! [`MIGRATION_LOCK_KEY`]'s byte of the lock file, the bookkeeping table lives in the
//! SQLite database, and each migration runs in a `BEGIN IMMEDIATE` transaction with its
//! row.

use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Connection, Sqlite};

use super::SqliteBackend;
use super::bookkeeping::{CREATE_TABLE, connection, lock, map, read_records};
use crate::error::Error;
use crate::migrate::adopt::{History, adopt_or_refuse};
use crate::migrate::plan::{Applied, Record, Report, failed, millis, plan};
use crate::migrate::set::Migration;
use crate::raw::{BoxFuture, MigrationTarget};

impl MigrationTarget for SqliteBackend {
    fn run_script<'a>(&'a self, ddl: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(run_script(self, ddl))
    }

    fn records(&self) -> BoxFuture<'_, Result<Option<Vec<Record>>, Error>> {
        Box::pin(records(self))
    }

    fn run<'a>(
        &'a self,
        set: &'a [Migration],
        ignore_missing: bool,
        on_applied: &'a mut (dyn FnMut(&Applied) + Send),
    ) -> BoxFuture<'a, Result<Report, Error>> {
        Box::pin(run(self, set, ignore_missing, on_applied))
    }

    fn history(&self) -> BoxFuture<'_, Result<History, Error>> {
        Box::pin(super::adopt::history_unlocked(self))
    }

    fn baseline<'a>(
        &'a self,
        set: &'a [Migration],
        to: Option<i64>,
    ) -> BoxFuture<'a, Result<Vec<i64>, Error>> {
        Box::pin(super::adopt::baseline(self, set, to))
    }
}

/// The seed's primitive on SQLite: the script in one transaction under the lock.
async fn run_script(b: &SqliteBackend, ddl: &str) -> Result<(), Error> {
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
async fn records(b: &SqliteBackend) -> Result<Option<Vec<Record>>, Error> {
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

async fn run(
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
    let history = super::adopt::history(&mut conn).await?;
    let adopted = adopt_or_refuse(set, &mut records, &history)?;
    let pending = plan(set, &records, ignore_missing)?;
    super::adopt::record(&mut conn, &adopted).await?;
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
