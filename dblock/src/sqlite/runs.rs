//! The record of runs on the embedded backend: the table `dblock_runs` in the database
//! file, created on first use (SQLite serialises writers, and a `CREATE TABLE IF NOT
//! EXISTS` that lost the race finds the table made). The database is on this host, so
//! its clock is the host's: slots are decided, and times written, on it.

use std::time::SystemTime;

use super::{Shared, SqliteBackend};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BoxFuture, NewClaim, Run, RunRow, RunStore};

/// The table's definition; times are RFC 3339 text in UTC, to the millisecond.
const TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_runs (\
     key INTEGER NOT NULL, \
     slot TEXT NOT NULL, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     attempt INTEGER NOT NULL, \
     host TEXT NOT NULL, \
     pid INTEGER NOT NULL, \
     program TEXT NOT NULL, \
     started_at TEXT NOT NULL, \
     finished_at TEXT, \
     exit_code INTEGER, \
     PRIMARY KEY (key, slot)); \
     CREATE INDEX IF NOT EXISTS dblock_runs_started ON dblock_runs (key, started_at)";

/// Now, as the table writes times.
const NOW: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";

/// Microseconds since the Unix epoch of a time column.
macro_rules! micros {
    ($col:literal) => {
        concat!(
            "CAST(round((julianday(",
            $col,
            ") - 2440587.5) * 86400000.0) AS INTEGER) * 1000"
        )
    };
}

/// A [`Run`]'s columns, in the order of [`RunRow`].
const COLUMNS: &str = concat!(
    "slot, namespace, name, attempt, host, pid, program, ",
    micros!("started_at"),
    ", ",
    micros!("finished_at"),
    ", exit_code"
);

fn fail(e: sqlx::Error) -> Error {
    match super::bookkeeping::map(e) {
        Error::Database { code, message } => Error::Database {
            code,
            message: format!("the record of runs: {message}"),
        },
        other => other,
    }
}

/// The database, with the table made.
async fn db(shared: &Shared) -> Result<&sqlx::SqlitePool, Error> {
    let db = shared.db().await?;
    sqlx::raw_sql(TABLE_DDL).execute(db).await.map_err(fail)?;
    Ok(db)
}

async fn insert_claim(shared: &Shared, c: &NewClaim<'_>) -> Result<bool, Error> {
    let sql = format!(
        "INSERT INTO dblock_runs (key, slot, namespace, name, attempt, host, pid, program, \
         started_at) VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7, {NOW}) \
         ON CONFLICT (key, slot) DO NOTHING"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(c.key.as_i64())
        .bind(c.slot)
        .bind(c.namespace)
        .bind(c.name)
        .bind(c.host)
        .bind(i64::from(c.pid))
        .bind(c.program)
        .execute(db(shared).await?)
        .await
        .map_err(fail)?;
    Ok(done.rows_affected() == 1)
}

async fn read_claim(shared: &Shared, key: Key, slot: &str) -> Result<Option<Run>, Error> {
    let sql = format!("SELECT {COLUMNS} FROM dblock_runs WHERE key = ?1 AND slot = ?2");
    let row: Option<RunRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(key.as_i64())
        .bind(slot)
        .fetch_optional(db(shared).await?)
        .await
        .map_err(fail)?;
    Ok(row.map(Run::from_row))
}

async fn retake_claim(shared: &Shared, c: &NewClaim<'_>, seen: u32) -> Result<Option<u32>, Error> {
    let sql = format!(
        "UPDATE dblock_runs SET attempt = attempt + 1, host = ?1, pid = ?2, program = ?3, \
         started_at = {NOW}, finished_at = NULL, exit_code = NULL \
         WHERE key = ?4 AND slot = ?5 AND attempt = ?6 \
         AND (finished_at IS NULL OR exit_code IS NOT 0)"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(c.host)
        .bind(i64::from(c.pid))
        .bind(c.program)
        .bind(c.key.as_i64())
        .bind(c.slot)
        .bind(i64::from(seen))
        .execute(db(shared).await?)
        .await
        .map_err(fail)?;
    Ok((done.rows_affected() == 1).then_some(seen + 1))
}

async fn finish_claim(
    shared: &Shared,
    key: Key,
    slot: &str,
    attempt: u32,
    exit_code: i32,
) -> Result<bool, Error> {
    let sql = format!(
        "UPDATE dblock_runs SET finished_at = {NOW}, exit_code = ?1 \
         WHERE key = ?2 AND slot = ?3 AND attempt = ?4 AND finished_at IS NULL"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(exit_code)
        .bind(key.as_i64())
        .bind(slot)
        .bind(i64::from(attempt))
        .execute(db(shared).await?)
        .await
        .map_err(fail)?;
    Ok(done.rows_affected() == 1)
}

async fn recent_runs(shared: &Shared, key: Key, limit: u32) -> Result<Vec<Run>, Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM dblock_runs WHERE key = ?1 ORDER BY started_at DESC, slot \
         LIMIT ?2"
    );
    let rows: Vec<RunRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(key.as_i64())
        .bind(i64::from(limit))
        .fetch_all(db(shared).await?)
        .await
        .map_err(fail)?;
    Ok(rows.into_iter().map(Run::from_row).collect())
}

async fn prune_runs(shared: &Shared, key: Key, keep: u32) -> Result<(), Error> {
    sqlx::query(
        "DELETE FROM dblock_runs WHERE key = ?1 AND started_at < (SELECT started_at FROM \
         dblock_runs WHERE key = ?1 ORDER BY started_at DESC LIMIT 1 OFFSET ?2)",
    )
    .bind(key.as_i64())
    .bind(i64::from(keep.saturating_sub(1)))
    .execute(db(shared).await?)
    .await
    .map(drop)
    .map_err(fail)
}

impl RunStore for SqliteBackend {
    fn db_clock(&self) -> BoxFuture<'_, Result<SystemTime, Error>> {
        Box::pin(std::future::ready(Ok(SystemTime::now())))
    }

    fn insert_claim<'a>(&'a self, claim: &'a NewClaim<'a>) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(insert_claim(&self.shared, claim))
    }

    fn read_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
    ) -> BoxFuture<'a, Result<Option<Run>, Error>> {
        Box::pin(read_claim(&self.shared, key, slot))
    }

    fn retake_claim<'a>(
        &'a self,
        claim: &'a NewClaim<'a>,
        seen: u32,
    ) -> BoxFuture<'a, Result<Option<u32>, Error>> {
        Box::pin(retake_claim(&self.shared, claim, seen))
    }

    fn finish_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
        attempt: u32,
        exit_code: i32,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(finish_claim(&self.shared, key, slot, attempt, exit_code))
    }

    fn recent_runs(&self, key: Key, limit: u32) -> BoxFuture<'_, Result<Vec<Run>, Error>> {
        Box::pin(recent_runs(&self.shared, key, limit))
    }

    fn prune_runs(&self, key: Key, keep: u32) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(prune_runs(&self.shared, key, keep))
    }
}
