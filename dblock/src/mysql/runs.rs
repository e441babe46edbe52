//! The record of runs on MySQL and MariaDB: the InnoDB table `dblock_runs` in the
//! handle's database, created on first use (`CREATE TABLE IF NOT EXISTS` takes the
//! table name's exclusive metadata lock, so processes creating it together wait for
//! each other rather than fail); each read and write one statement in autocommit, on
//! the server's clock (`UTC_TIMESTAMP(6)`: UTC whatever the session's time zone).

use std::time::SystemTime;

use super::{MyBackend, map_sqlx, setup};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BoxFuture, NewClaim, Run, RunRow, RunStore, from_unix_micros};

/// The table's definition. The slot compares byte for byte (`utf8mb4_bin`): two slots
/// are one only when their text is identical.
pub(crate) const TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_runs (\
     `key` BIGINT NOT NULL, \
     slot VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
     namespace TEXT CHARACTER SET utf8mb4 NOT NULL, \
     name TEXT CHARACTER SET utf8mb4 NOT NULL, \
     attempt INT NOT NULL, \
     host VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL, \
     pid BIGINT NOT NULL, \
     program VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL, \
     started_at DATETIME(6) NOT NULL, \
     finished_at DATETIME(6) NULL, \
     exit_code INT NULL, \
     PRIMARY KEY (`key`, slot), \
     KEY dblock_runs_started (`key`, started_at)) ENGINE=InnoDB";

/// Microseconds since the Unix epoch of a `DATETIME(6)` column written in UTC.
macro_rules! micros {
    ($col:literal) => {
        concat!(
            "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', ",
            $col,
            ")"
        )
    };
}

/// A [`Run`]'s columns, in the order of [`RunRow`].
const COLUMNS: &str = concat!(
    "CAST(slot AS CHAR), namespace, name, CAST(attempt AS SIGNED), host, pid, program, ",
    micros!("started_at"),
    ", ",
    micros!("finished_at"),
    ", CAST(exit_code AS SIGNED)"
);

/// ER_DUP_ENTRY: the slot's row exists.
const DUPLICATE: u16 = 1062;

impl MyBackend {
    /// Creates the record of runs if it is missing (once per handle). Looked for first:
    /// `CREATE TABLE IF NOT EXISTS` needs the CREATE privilege even when the table
    /// exists, which a user granted only the table's rows (`dblock setup`) lacks.
    pub(crate) async fn ensure_runs_table(&self) -> Result<(), Error> {
        self.runs_table_ready
            .get_or_try_init(|| async {
                let exists: Option<i64> = sqlx::query_scalar(
                    "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() \
                     AND TABLE_NAME = 'dblock_runs'",
                )
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.runs_error(e))?;
                if exists.is_some() {
                    return Ok(());
                }
                sqlx::raw_sql(TABLE_DDL)
                    .execute(&self.pool)
                    .await
                    .map(drop)
                    .map_err(|e| self.runs_error(e))
            })
            .await
            .map(drop)
    }

    /// An sqlx error as dblock's; a missing privilege names `dblock setup`.
    fn runs_error(&self, e: sqlx::Error) -> Error {
        setup::permission(e, &setup::fix_for(&self.database))
    }

    async fn clock(&self) -> Result<SystemTime, Error> {
        let us: i64 = sqlx::query_scalar(concat!("SELECT ", micros!("UTC_TIMESTAMP(6)")))
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(from_unix_micros(us))
    }

    async fn insert_claim(&self, c: &NewClaim<'_>) -> Result<bool, Error> {
        self.ensure_runs_table().await?;
        let inserted = sqlx::query(
            "INSERT INTO dblock_runs (`key`, slot, namespace, name, attempt, host, pid, \
             program, started_at) VALUES (?, ?, ?, ?, 1, ?, ?, ?, UTC_TIMESTAMP(6))",
        )
        .bind(c.key.as_i64())
        .bind(c.slot)
        .bind(c.namespace)
        .bind(c.name)
        .bind(c.host)
        .bind(i64::from(c.pid))
        .bind(c.program)
        .execute(&self.pool)
        .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(db))
                if db
                    .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                    .is_some_and(|m| m.number() == DUPLICATE) =>
            {
                Ok(false)
            }
            Err(e) => Err(self.runs_error(e)),
        }
    }

    async fn read_claim(&self, key: Key, slot: &str) -> Result<Option<Run>, Error> {
        self.ensure_runs_table().await?;
        let sql = format!("SELECT {COLUMNS} FROM dblock_runs WHERE `key` = ? AND slot = ?");
        let row: Option<RunRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(key.as_i64())
            .bind(slot)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.runs_error(e))?;
        Ok(row.map(Run::from_row))
    }

    async fn retake_claim(&self, c: &NewClaim<'_>, seen: u32) -> Result<Option<u32>, Error> {
        self.ensure_runs_table().await?;
        let done = sqlx::query(
            "UPDATE dblock_runs SET attempt = attempt + 1, host = ?, pid = ?, program = ?, \
             started_at = UTC_TIMESTAMP(6), finished_at = NULL, exit_code = NULL \
             WHERE `key` = ? AND slot = ? AND attempt = ? \
             AND (finished_at IS NULL OR NOT (exit_code <=> 0))",
        )
        .bind(c.host)
        .bind(i64::from(c.pid))
        .bind(c.program)
        .bind(c.key.as_i64())
        .bind(c.slot)
        .bind(seen)
        .execute(&self.pool)
        .await
        .map_err(|e| self.runs_error(e))?;
        Ok((done.rows_affected() == 1).then_some(seen + 1))
    }

    async fn finish_claim(
        &self,
        key: Key,
        slot: &str,
        attempt: u32,
        exit_code: i32,
    ) -> Result<bool, Error> {
        self.ensure_runs_table().await?;
        let done = sqlx::query(
            "UPDATE dblock_runs SET finished_at = UTC_TIMESTAMP(6), exit_code = ? \
             WHERE `key` = ? AND slot = ? AND attempt = ? AND finished_at IS NULL",
        )
        .bind(exit_code)
        .bind(key.as_i64())
        .bind(slot)
        .bind(attempt)
        .execute(&self.pool)
        .await
        .map_err(|e| self.runs_error(e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn recent_runs(&self, key: Key, limit: u32) -> Result<Vec<Run>, Error> {
        self.ensure_runs_table().await?;
        let sql = format!(
            "SELECT {COLUMNS} FROM dblock_runs WHERE `key` = ? \
             ORDER BY started_at DESC, slot LIMIT ?"
        );
        let rows: Vec<RunRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(key.as_i64())
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.runs_error(e))?;
        Ok(rows.into_iter().map(Run::from_row).collect())
    }

    async fn prune_runs(&self, key: Key, keep: u32) -> Result<(), Error> {
        self.ensure_runs_table().await?;
        // The newest kept row's start, read through a derived table (MySQL refuses a
        // subquery on the table a DELETE deletes from).
        sqlx::query(
            "DELETE FROM dblock_runs WHERE `key` = ? AND started_at < (SELECT started_at FROM \
             (SELECT started_at FROM dblock_runs WHERE `key` = ? ORDER BY started_at DESC \
             LIMIT 1 OFFSET ?) AS kept)",
        )
        .bind(key.as_i64())
        .bind(key.as_i64())
        .bind(keep.saturating_sub(1))
        .execute(&self.pool)
        .await
        .map(drop)
        .map_err(|e| self.runs_error(e))
    }
}

impl RunStore for MyBackend {
    fn db_clock(&self) -> BoxFuture<'_, Result<SystemTime, Error>> {
        Box::pin(self.clock())
    }

    fn insert_claim<'a>(&'a self, claim: &'a NewClaim<'a>) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(MyBackend::insert_claim(self, claim))
    }

    fn read_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
    ) -> BoxFuture<'a, Result<Option<Run>, Error>> {
        Box::pin(MyBackend::read_claim(self, key, slot))
    }

    fn retake_claim<'a>(
        &'a self,
        claim: &'a NewClaim<'a>,
        seen: u32,
    ) -> BoxFuture<'a, Result<Option<u32>, Error>> {
        Box::pin(MyBackend::retake_claim(self, claim, seen))
    }

    fn finish_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
        attempt: u32,
        exit_code: i32,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(MyBackend::finish_claim(self, key, slot, attempt, exit_code))
    }

    fn recent_runs(&self, key: Key, limit: u32) -> BoxFuture<'_, Result<Vec<Run>, Error>> {
        Box::pin(MyBackend::recent_runs(self, key, limit))
    }

    fn prune_runs(&self, key: Key, keep: u32) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(MyBackend::prune_runs(self, key, keep))
    }
}
