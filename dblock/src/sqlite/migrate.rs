//! The migration runner's store on the embedded backend: the migration lock is the OFD
//! lock on [`MIGRATION_LOCK_KEY`]'s byte of the lock file, the bookkeeping table lives
//! in the SQLite database, and each migration runs in a `BEGIN IMMEDIATE` transaction
//! with its row (SQLite's DDL is transactional). The runner itself is `migrate::run`.
//!
//! [`MIGRATION_LOCK_KEY`]: crate::migrate::MIGRATION_LOCK_KEY

use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Connection, Sqlite};

use super::bookkeeping::{
    ADD_STATE_COLUMNS, CREATE_TABLE, STATE_COLUMNS, connection, lock, map, read_records,
    table_exists,
};
use super::{SqliteBackend, SqliteHeld};
use crate::error::Error;
use crate::key::Key;
use crate::migrate::adopt::History;
use crate::migrate::plan::{MIGRATION_LOCK_KEY, Record, millis};
use crate::migrate::set::Migration;
use crate::migrate::store::{BoxFuture, MigrationStore, Options, Recorded, Session, Then, Write};
use crate::raw::{Mode, RawHeld};

impl MigrationStore for SqliteBackend {
    fn backend(&self) -> &'static str {
        "SQLite"
    }

    fn run_script<'a>(&'a self, ddl: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(run_script(self, ddl))
    }

    fn read<'a>(&'a self, opts: &'a Options) -> BoxFuture<'a, Result<Recorded, Error>> {
        Box::pin(async move {
            let mut conn = connection(self).await?;
            let records = match table_exists(&mut conn).await? {
                true => Some(read_records(&mut conn).await?),
                false => None,
            };
            let history = super::adopt::history(&mut conn, &opts.sqlx_table).await?;
            Ok(Recorded { records, history })
        })
    }

    fn lock_held(&self) -> BoxFuture<'_, Result<bool, Error>> {
        // Tried without waiting and let go at once: whether anyone (another process,
        // or a task of this one) holds it.
        let offset = Key::from_i64(MIGRATION_LOCK_KEY).file_offset();
        Box::pin(std::future::ready(
            match self.shared.take_now(offset, Mode::Exclusive) {
                Ok(true) => {
                    SqliteHeld::new(&self.shared, offset, Mode::Exclusive).release();
                    Ok(false)
                }
                Ok(false) => Ok(true),
                Err(e) => Err(e),
            },
        ))
    }

    fn lock<'a>(
        &'a self,
        opts: &'a Options,
        _what: &'static str,
    ) -> BoxFuture<'a, Result<Box<dyn Session + 'a>, Error>> {
        Box::pin(async move {
            let held = lock(self).await?;
            let conn = connection(self).await?;
            let s: Box<dyn Session + 'a> = Box::new(SqliteSession {
                conn: Some(conn),
                held: Some(held),
                sqlx_table: opts.sqlx_table.clone(),
                has_state: false,
            });
            Ok(s)
        })
    }

    fn transactional_ddl(&self) -> bool {
        true
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

/// The migration lock and a connection to the database file. The connection is declared
/// first, so it drops (rolling back a transaction in progress) before the lock does.
struct SqliteSession {
    conn: Option<PoolConnection<Sqlite>>,
    held: Option<SqliteHeld>,
    sqlx_table: String,
    /// The table has the columns of a started migration.
    has_state: bool,
}

impl SqliteSession {
    fn conn(&mut self) -> Result<&mut PoolConnection<Sqlite>, Error> {
        self.conn.as_mut().ok_or_else(|| Error::ConnectionLost {
            message: "the migration session has ended".into(),
        })
    }

    async fn run(&mut self, sql: &str) -> Result<(), Error> {
        let conn = self.conn()?;
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&mut **conn)
            .await
            .map_err(map)?;
        Ok(())
    }

    async fn write_one(&mut self, w: Write<'_>) -> Result<(), Error> {
        let conn = self.conn.as_mut().ok_or_else(ended)?;
        let q = match w {
            Write::Started(m, statements) => {
                if !self.has_state {
                    for sql in ADD_STATE_COLUMNS {
                        sqlx::raw_sql(sql).execute(&mut **conn).await.map_err(map)?;
                    }
                    self.has_state = true;
                }
                sqlx::query(
                    "INSERT INTO dblock_migrations (version, name, checksum, applied_at, \
                     duration_ms, state, statements_done) \
                     VALUES (?1, ?2, ?3, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), 0, 'started', ?4)",
                )
                .bind(m.version())
                .bind(m.name().to_string())
                .bind(m.checksum().to_string())
                .bind(statements.map(|_| 0i64))
            }
            Write::Progress(m, k) => {
                sqlx::query("UPDATE dblock_migrations SET statements_done = ?1 WHERE version = ?2")
                    .bind(i64::try_from(k).unwrap_or(i64::MAX))
                    .bind(m.version())
            }
            Write::Finished(m, took) => sqlx::query(
                "UPDATE dblock_migrations SET state = 'done', statements_done = NULL, \
                 applied_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), duration_ms = ?1 \
                 WHERE version = ?2",
            )
            .bind(millis(took))
            .bind(m.version()),
            Write::Unstarted(m) => sqlx::query(
                "DELETE FROM dblock_migrations WHERE version = ?1 AND state = 'started'",
            )
            .bind(m.version()),
            Write::Reverted(m) => return forget(conn, &self.sqlx_table, m).await,
            Write::Adopted(rows) => return super::adopt::record(conn, rows).await,
        };
        q.execute(&mut **conn).await.map_err(map)?;
        Ok(())
    }
}

fn ended() -> Error {
    Error::ConnectionLost {
        message: "the migration session has ended".into(),
    }
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

/// Removes a reverted migration's rows: dblock's, and sqlx's if its table exists.
async fn forget(
    conn: &mut sqlx::SqliteConnection,
    sqlx_table: &str,
    m: &Migration,
) -> Result<(), Error> {
    sqlx::query("DELETE FROM dblock_migrations WHERE version = ?1")
        .bind(m.version())
        .execute(&mut *conn)
        .await
        .map_err(map)?;
    let sqlx = sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {sqlx_table} WHERE version = ?1"
    )))
    .bind(m.version())
    .execute(&mut *conn)
    .await;
    match sqlx {
        Err(sqlx::Error::Database(e)) if e.message().starts_with("no such table") => Ok(()),
        other => other.map(drop).map_err(map),
    }
}

impl Session for SqliteSession {
    fn ensure_table(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            self.run(CREATE_TABLE).await?;
            let conn = self.conn()?;
            let n: i64 = sqlx::query_scalar(STATE_COLUMNS)
                .fetch_one(&mut **conn)
                .await
                .map_err(map)?;
            self.has_state = n == 2;
            Ok(())
        })
    }

    fn records(&mut self) -> BoxFuture<'_, Result<Vec<Record>, Error>> {
        Box::pin(async move { read_records(self.conn()?).await })
    }

    fn history(&mut self) -> BoxFuture<'_, Result<History, Error>> {
        Box::pin(async move {
            let table = self.sqlx_table.clone();
            super::adopt::history(self.conn()?, &table).await
        })
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        match self.held.as_mut() {
            Some(held) => held.check(),
            None => Box::pin(std::future::ready(Err(ended()))),
        }
    }

    fn write<'a>(&'a mut self, w: Write<'a>) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.write_one(w))
    }

    fn execute<'a>(&'a mut self, sql: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.run(sql))
    }

    fn in_transaction<'a>(
        &'a mut self,
        sql: &'a str,
        then: Then<'a>,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            let table = self.sqlx_table.clone();
            let conn = self.conn()?;
            // IMMEDIATE: the write lock up front, so the transaction never has to
            // upgrade a read lock (which SQLite may refuse at once, busy timeout or not).
            // Dropped unfinished, the transaction rolls back.
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
            let t0 = Instant::now();
            sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(&mut *tx)
                .await
                .map_err(map)?;
            let took = t0.elapsed();
            match then {
                Then::Applied(m) => {
                    insert(m, took).execute(&mut *tx).await.map_err(map)?;
                }
                Then::Reverted(m) => forget(&mut tx, &table, m).await?,
            }
            tx.commit().await.map_err(map)?;
            Ok(took)
        })
    }

    fn end_open_transaction(&mut self) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            // SQLite refuses a BEGIN within a transaction: probe with one.
            if self.run("BEGIN").await.is_err() {
                let _ = self.run("ROLLBACK").await;
                return Ok(true);
            }
            self.run("ROLLBACK").await?;
            Ok(false)
        })
    }

    fn end(&mut self, ok: bool) -> BoxFuture<'_, Result<(), Error>> {
        drop(self.conn.take());
        let released = self.held.take().map(|held| Box::new(held).release());
        Box::pin(async move {
            match released {
                // After a failure, the run's error is the one to report.
                Some(r) if ok => r.await,
                Some(r) => r.await.or(Ok(())),
                None => Ok(()),
            }
        })
    }
}
