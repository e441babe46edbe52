//! The migration runner's store on the embedded backend: the migration lock is the OFD
//! lock on [`MIGRATION_LOCK_KEY`]'s byte of the lock file, the bookkeeping table lives
//! in the SQLite database, and each migration runs in a `BEGIN IMMEDIATE` transaction
//! with its row (SQLite's DDL is transactional). The runner itself is `migrate::run`.
//!
//! sqlx's SQLite migrator takes no lock, so there is none to share: keeping sqlx's
//! history here means writing sqlx's row with each migration, in its transaction, so
//! that a sqlx migrator starting afterwards finds it applied.
//!
//! [`MIGRATION_LOCK_KEY`]: crate::migrate::MIGRATION_LOCK_KEY

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Connection, Sqlite};

use super::SqliteBackend;
use super::bookkeeping::{
    ADD_STATE_COLUMNS, CREATE_TABLE, STATE_COLUMNS, connection, lock, map, read_records,
    table_exists,
};
use crate::error::Error;
use crate::key::Key;
use crate::migrate::adopt::History;
use crate::migrate::plan::{MIGRATION_LOCK_KEY, Record, millis};
use crate::migrate::set::Migration;
use crate::migrate::sqlx_side::{self, SqlxEntry, unhex};
use crate::migrate::store::{BoxFuture, MigrationStore, Options, Recorded, Session, Then, Write};
use crate::raw::{Held, Mode};

impl MigrationStore for SqliteBackend {
    fn backend(&self) -> &'static str {
        "SQLite"
    }

    fn run_script<'a>(&'a self, key: i64, ddl: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(run_script(self, key, ddl))
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
                    drop(self.shared.entry(offset, Mode::Exclusive));
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
            let held = Held::Entry(lock(self).await?);
            let conn = connection(self).await?;
            let s: Box<dyn Session + 'a> = Box::new(SqliteSession {
                conn: Some(conn),
                held: Some(held),
                sqlx_table: opts.sqlx_table.clone(),
                sqlx_ignored: opts.sqlx_ignored.clone(),
                keeps_sqlx: false,
                has_state: false,
            });
            Ok(s)
        })
    }

    fn transactional_ddl(&self) -> bool {
        true
    }
}

/// The seed's primitive on SQLite: the script in one transaction under the lock of
/// `key`'s byte.
async fn run_script(b: &SqliteBackend, key: i64, ddl: &str) -> Result<(), Error> {
    let _lock = b.lock_key(Key::from_i64(key)).await?;
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
    held: Option<Held>,
    sqlx_table: String,
    /// sqlx.toml's `ignored-chars`, for the checksums written into sqlx's history.
    sqlx_ignored: Option<BTreeSet<char>>,
    /// The session keeps sqlx's history.
    keeps_sqlx: bool,
    /// The table has the columns of a started migration.
    has_state: bool,
}

/// sqlx's rows, done, in one statement on `conn`; `installed_on` the entry's or now.
async fn to_sqlx(
    conn: &mut sqlx::SqliteConnection,
    table: &str,
    rows: &[SqlxEntry],
) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut q = sqlx::QueryBuilder::<Sqlite>::new(format!(
        "INSERT INTO {table} (version, description, installed_on, success, checksum, \
         execution_time) "
    ));
    q.push_values(rows, |mut v, r| {
        v.push_bind(r.version)
            .push_bind(r.description.clone())
            .push("coalesce(nullif(")
            .push_bind_unseparated(r.installed_on.clone())
            .push_unseparated(", ''), CURRENT_TIMESTAMP)")
            .push("TRUE")
            .push_bind(unhex(&r.checksum).unwrap_or_default())
            .push_bind(r.execution_time);
    });
    q.build().execute(conn).await.map_err(map)?;
    Ok(())
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

    /// sqlx's row of `m`, applied in `took`, when the session keeps sqlx's history.
    fn sqlx_row(&self, m: &Migration, took: Duration) -> Option<SqlxEntry> {
        self.keeps_sqlx
            .then(|| sqlx_side::entry(m, self.sqlx_ignored.as_ref(), took))
    }

    async fn write_one(&mut self, w: Write<'_>) -> Result<(), Error> {
        if let Write::Finished(m, took) = w {
            return self.finish(m, took).await;
        }
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
            Write::Finished(..) => return Ok(()),
            Write::Unstarted(m) => sqlx::query(
                "DELETE FROM dblock_migrations WHERE version = ?1 AND state = 'started'",
            )
            .bind(m.version()),
            Write::Reverted(m) => return forget(conn, &self.sqlx_table, m).await,
            Write::Adopted(rows) => return super::adopt::record(conn, rows).await,
            Write::ToSqlx(rows) => return to_sqlx(conn, &self.sqlx_table, rows).await,
        };
        q.execute(&mut **conn).await.map_err(map)?;
        Ok(())
    }

    /// A migration run outside a transaction, recorded as done: its row, and sqlx's, in
    /// one transaction.
    async fn finish(&mut self, m: &Migration, took: Duration) -> Result<(), Error> {
        let row = self.sqlx_row(m, took);
        let table = self.sqlx_table.clone();
        let conn = self.conn()?;
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map)?;
        sqlx::query(
            "UPDATE dblock_migrations SET state = 'done', statements_done = NULL, \
             applied_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), duration_ms = ?1 \
             WHERE version = ?2",
        )
        .bind(millis(took))
        .bind(m.version())
        .execute(&mut *tx)
        .await
        .map_err(map)?;
        if let Some(row) = row {
            to_sqlx(&mut tx, &table, std::slice::from_ref(&row)).await?;
        }
        tx.commit().await.map_err(map)
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
            let keeps_sqlx = self.keeps_sqlx;
            let ignored = self.sqlx_ignored.clone();
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
                    if keeps_sqlx {
                        let row = sqlx_side::entry(m, ignored.as_ref(), took);
                        to_sqlx(&mut tx, &table, std::slice::from_ref(&row)).await?;
                    }
                }
                Then::Reverted(m) => forget(&mut tx, &table, m).await?,
            }
            tx.commit().await.map_err(map)?;
            Ok(took)
        })
    }

    fn keep_sqlx_history(&mut self, create: bool, _lock: bool) -> BoxFuture<'_, Result<(), Error>> {
        // sqlx's SQLite migrator takes no lock: there is none to hold.
        Box::pin(async move {
            if create {
                let sql = sqlx_side::create_table(&self.sqlx_table, false);
                self.run(&sql).await?;
            }
            self.keeps_sqlx = true;
            Ok(())
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
        let released = self.held.take().map(Held::release);
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
