//! The migration runner's store on MySQL and MariaDB. The runner itself is
//! `migrate::run`.
//!
//! The migration lock is the named lock of [`MIGRATION_LOCK_KEY`] on the database
//! (`dblock:<db hash>:44424c4f434b4d01`, see [`lock_name`](super::lock_name)), taken
//! like any dblock lock on a connection of its own and checked before each migration;
//! the migrations themselves run on a second connection.
//!
//! MySQL commits DDL implicitly, statement by statement, so a migration and its
//! bookkeeping row cannot share a transaction (the store says so: its DDL is not
//! transactional). Each migration is therefore recorded twice: as `started`
//! (committed) before its SQL runs, and as `done` after. A run that finds a `started`
//! row — its runner crashed, was killed or failed half way — refuses to continue
//! ([`Error::MigrationInterrupted`] naming the file): part of the migration may be
//! applied, and running it again could apply that part twice. Resolve it by hand (see
//! `docs/mysql.md`): inspect the schema, finish or undo the migration's statements,
//! then either mark it done
//! (`UPDATE dblock_migrations SET state = 'done' WHERE version = V`) or delete the row
//! to have the next run apply it again (`DELETE FROM dblock_migrations WHERE version = V`).
//!
//! sqlx's history (`_sqlx_migrations`, which sqlx's MySQL migrator keeps in the
//! database) is adopted as on the other backends. Where it is kept too (see
//! `migrate::sqlx_side`), the run also holds sqlx's lock — `GET_LOCK` of
//! [`sqlx_mysql_lock_name`], polled on the migrations' connection — and writes sqlx's
//! row as sqlx's MySQL migrator does: `success = FALSE` before the file, `TRUE` and the
//! execution time after. A session waiting in `GET_LOCK` holds no metadata lock a
//! migration could wait for, so sqlx's waiters are never let go first here.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, Row};

use super::{MyBackend, map_sqlx};
use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::migrate::MIGRATION_LOCK_KEY;
use crate::migrate::adopt::{History, SqlxRow};
use crate::migrate::plan::{Record, RecordState, millis};
use crate::migrate::set::Migration;
use crate::migrate::sqlx_side::{self, SqlxEntry, sqlx_mysql_lock_name, unhex};
use crate::migrate::store::{BoxFuture, MigrationStore, Options, Recorded, Session, Then, Write};
use crate::raw::{Held, Mode, Req, Scope, Wait};

impl MigrationStore for MyBackend {
    fn backend(&self) -> &'static str {
        "MySQL/MariaDB"
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
            let history = history(&mut conn, &opts.sqlx_table).await?;
            Ok(Recorded { records, history })
        })
    }

    fn lock_held(&self) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            let name = self.lock_name(Key::from_i64(MIGRATION_LOCK_KEY));
            let holder: Option<u64> =
                sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)")
                    .bind(name)
                    .fetch_one(&self.pool)
                    .await
                    .map_err(map_sqlx)?;
            Ok(holder.is_some())
        })
    }

    fn lock<'a>(
        &'a self,
        opts: &'a Options,
        _what: &'static str,
    ) -> BoxFuture<'a, Result<Box<dyn Session + 'a>, Error>> {
        Box::pin(async move {
            let guard = lock(self, MIGRATION_LOCK_KEY).await?;
            let conn = connection(self).await?;
            let s: Box<dyn Session + 'a> = Box::new(MySession {
                conn: Some(conn),
                guard: Some(guard),
                sqlx_table: opts.sqlx_table.clone(),
                sqlx_ignored: opts.sqlx_ignored.clone(),
                keeps_sqlx: false,
                sqlx_lock: None,
            });
            Ok(s)
        })
    }

    fn transactional_ddl(&self) -> bool {
        false
    }
}

const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS dblock_migrations (\
     version BIGINT NOT NULL PRIMARY KEY, \
     name VARCHAR(1024) NOT NULL, \
     checksum VARCHAR(128) NOT NULL, \
     state VARCHAR(16) NOT NULL, \
     applied_at VARCHAR(32) NOT NULL, \
     duration_ms BIGINT NOT NULL) ENGINE=InnoDB";

const NOW: &str = "DATE_FORMAT(UTC_TIMESTAMP(3), '%Y-%m-%dT%H:%i:%s.%fZ')";

/// MySQL's `ER_NO_SUCH_TABLE`.
const NO_SUCH_TABLE: &str = "1146";

/// Waits for the migration lock (or the lock of the caller's `key`): held until the
/// returned half-guard drops.
async fn lock(b: &MyBackend, key: i64) -> Result<Held, Error> {
    let key = Key::from_i64(key);
    let req = Req {
        namespace: crate::DEFAULT_NAMESPACE,
        name: "dblock migration lock",
        key,
        mode: Mode::Exclusive,
        scope: Scope::Session,
        wait: Wait::Forever,
        fenced: false,
        lease: None,
        fence_key: None,
    };
    match super::lock::acquire(b, &req).await? {
        Some(grant) => Ok(grant.held),
        None => Err(Error::Timeout {
            waiting_for: WaitingFor::MigrationLock,
            after: None,
        }),
    }
}

async fn connection(b: &MyBackend) -> Result<PoolConnection<MySql>, Error> {
    b.pool.acquire().await.map_err(map_sqlx)
}

/// A start-up script under the lock of `key`.
pub(crate) async fn run_script(b: &MyBackend, key: i64, ddl: &str) -> Result<(), Error> {
    let guard = lock(b, key).await?;
    let mut conn = connection(b).await?;
    let r = sqlx::raw_sql(AssertSqlSafe(ddl.to_string()))
        .execute(&mut *conn)
        .await
        .map_err(map_sqlx);
    drop(conn);
    guard.release().await?;
    r.map(|_| ())
}

async fn table_exists(conn: &mut PoolConnection<MySql>) -> Result<bool, Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dblock_migrations'",
    )
    .fetch_one(&mut **conn)
    .await
    .map_err(map_sqlx)?;
    Ok(n > 0)
}

/// The bookkeeping rows, `started` ones included (without the lock, such a row may be a
/// migration being applied right now; the runner tells which).
async fn read_records(conn: &mut PoolConnection<MySql>) -> Result<Vec<Record>, Error> {
    let rows = sqlx::query(
        "SELECT version, name, checksum, state, applied_at, duration_ms \
         FROM dblock_migrations ORDER BY version",
    )
    .fetch_all(&mut **conn)
    .await
    .map_err(map_sqlx)?;
    rows.iter()
        .map(|r| {
            let state: String = r.try_get(3).map_err(map_sqlx)?;
            Ok(Record {
                version: r.try_get(0).map_err(map_sqlx)?,
                name: r.try_get(1).map_err(map_sqlx)?,
                checksum: r.try_get(2).map_err(map_sqlx)?,
                applied_at: r.try_get(4).map_err(map_sqlx)?,
                duration_ms: r.try_get(5).map_err(map_sqlx)?,
                state: match state.as_str() {
                    "done" => RecordState::Done,
                    // Sent whole: how much of it ran is not known.
                    _ => RecordState::Started { completed: None },
                },
            })
        })
        .collect()
}

/// sqlx's history in `table` (its name as SQL writes it: `_sqlx_migrations`, or
/// `db.table`), if there is one. `installed_on` (a `TIMESTAMP`, shown in the session's
/// time zone) is read as seconds since the epoch, so the text is UTC whatever that is.
async fn history(conn: &mut PoolConnection<MySql>, table: &str) -> Result<History, Error> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT version, description, DATE_FORMAT(TIMESTAMPADD(SECOND, \
         UNIX_TIMESTAMP(installed_on), '1970-01-01 00:00:00'), '%Y-%m-%dT%H:%i:%s.000Z'), \
         success, LOWER(HEX(checksum)), execution_time FROM {table} ORDER BY version"
    )))
    .fetch_all(&mut **conn)
    .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(sqlx::Error::Database(e)) if mysql_number(&*e).as_deref() == Some(NO_SUCH_TABLE) => {
            return Ok(History::default());
        }
        Err(e) => return Err(map_sqlx(e)),
    };
    let sqlx = rows
        .iter()
        .map(|r| {
            Ok(SqlxRow {
                version: r.try_get(0).map_err(map_sqlx)?,
                description: r.try_get(1).map_err(map_sqlx)?,
                installed_on: r.try_get(2).map_err(map_sqlx)?,
                success: r.try_get(3).map_err(map_sqlx)?,
                checksum: r.try_get(4).map_err(map_sqlx)?,
                execution_time: r.try_get(5).map_err(map_sqlx)?,
            })
        })
        .collect::<Result<_, Error>>()?;
    Ok(History {
        sqlx,
        sqlx_table: true,
        others: Vec::new(),
    })
}

fn mysql_number(e: &dyn sqlx::error::DatabaseError) -> Option<String> {
    e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .map(|m| m.number().to_string())
}

/// The migration lock (on a connection of its own) and the connection migrations run on.
struct MySession {
    conn: Option<PoolConnection<MySql>>,
    guard: Option<Held>,
    sqlx_table: String,
    /// sqlx.toml's `ignored-chars`, for the checksums written into sqlx's history.
    sqlx_ignored: Option<BTreeSet<char>>,
    /// The session keeps sqlx's history.
    keeps_sqlx: bool,
    /// sqlx's lock name, held on `conn` while keeping sqlx's history.
    sqlx_lock: Option<String>,
}

/// The first pause between two attempts at sqlx's lock; it doubles up to
/// [`POLL_MAX`].
const POLL_FIRST: Duration = Duration::from_millis(20);
const POLL_MAX: Duration = Duration::from_millis(100);

/// A connection closed when dropped, unless taken back out.
struct Closing(Option<PoolConnection<MySql>>);

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}

impl Drop for MySession {
    /// Dropped before [`Session::end`] (a cancelled run): the connection is closed, not
    /// returned to the pool, where its next user would wait for the file still running.
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(conn.detach());
        }
    }
}

impl MySession {
    fn conn(&mut self) -> Result<&mut PoolConnection<MySql>, Error> {
        self.conn.as_mut().ok_or_else(|| Error::ConnectionLost {
            message: "the migration session has ended".into(),
        })
    }

    async fn run(&mut self, sql: &str) -> Result<(), Error> {
        let conn = self.conn()?;
        sqlx::raw_sql(AssertSqlSafe(sql.to_string()))
            .execute(&mut **conn)
            .await
            .map_err(map_sqlx)?;
        Ok(())
    }

    /// Waits for sqlx's lock `name` on the migrations' connection, trying without
    /// waiting now and then (cancellable, unlike a `GET_LOCK` that waits).
    async fn take_sqlx_lock(&mut self, name: &str) -> Result<(), Error> {
        let mut pause = POLL_FIRST;
        loop {
            let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
                .bind(name)
                .fetch_one(&mut **self.conn()?)
                .await
                .map_err(map_sqlx)?;
            if got == Some(1) {
                return Ok(());
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    /// sqlx's row of `m` as its MySQL migrator writes it before the file:
    /// `success = FALSE`, `execution_time = -1`.
    async fn sqlx_started(&mut self, m: &Migration) -> Result<(), Error> {
        let row = sqlx_side::entry(m, self.sqlx_ignored.as_ref(), Duration::ZERO);
        let q = format!(
            "INSERT INTO {} (version, description, success, checksum, execution_time) \
             VALUES (?, ?, FALSE, ?, -1)",
            self.sqlx_table
        );
        sqlx::query(AssertSqlSafe(q))
            .bind(row.version)
            .bind(row.description)
            .bind(unhex(&row.checksum).unwrap_or_default())
            .execute(&mut **self.conn()?)
            .await
            .map_err(map_sqlx)?;
        Ok(())
    }

    /// sqlx's rows `rows`, done, in one statement; `installed_on` the entry's (UTC) or
    /// now.
    async fn write_sqlx_rows(&mut self, rows: &[SqlxEntry]) -> Result<(), Error> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut q = sqlx::QueryBuilder::<MySql>::new(format!(
            "INSERT INTO {} (version, description, installed_on, success, checksum, \
             execution_time) ",
            self.sqlx_table
        ));
        q.push_values(rows, |mut v, r| {
            v.push_bind(r.version)
                .push_bind(r.description.clone())
                // The UTC text read as seconds since the epoch, so the session's time
                // zone does not matter.
                .push(
                    "coalesce(FROM_UNIXTIME(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', \
                       STR_TO_DATE(",
                )
                .push_bind_unseparated(r.installed_on.clone())
                .push_unseparated(", '%Y-%m-%dT%H:%i:%s.%fZ')) / 1000000), CURRENT_TIMESTAMP)")
                .push("TRUE")
                .push_bind(unhex(&r.checksum).unwrap_or_default())
                .push_bind(r.execution_time);
        });
        q.build()
            .execute(&mut **self.conn()?)
            .await
            .map_err(map_sqlx)?;
        Ok(())
    }

    async fn write_one(&mut self, w: Write<'_>) -> Result<(), Error> {
        if self.keeps_sqlx {
            self.write_sqlx(w).await?;
        }
        let q = match w {
            // Sent whole, whatever the file says: the row is all there is to record.
            Write::Started(m, _) => started(m),
            // Never sent: files are not run statement by statement here.
            Write::Progress(..) => return Ok(()),
            Write::Finished(m, took) => sqlx::query(AssertSqlSafe(format!(
                "UPDATE dblock_migrations SET state = 'done', applied_at = {NOW}, \
                 duration_ms = ? WHERE version = ?"
            )))
            .bind(millis(took))
            .bind(m.version()),
            Write::Unstarted(m) => {
                sqlx::query("DELETE FROM dblock_migrations WHERE version = ? AND state = 'started'")
                    .bind(m.version())
            }
            Write::Reverted(_) => {
                return Err(Error::unsupported(
                    crate::error::Capability::TransactionalDdl,
                    "reverts are refused on MySQL/MariaDB (DDL commits as it goes)",
                ));
            }
            Write::Adopted(rows) => return self.record(rows).await,
            Write::ToSqlx(_) => return Ok(()),
        };
        q.execute(&mut **self.conn()?).await.map_err(map_sqlx)?;
        Ok(())
    }

    /// sqlx's side of a bookkeeping change, made first: a migration is recorded as
    /// started in both histories before its file runs, and done in sqlx's before
    /// dblock's row says so (a run that stops between the two leaves dblock's row
    /// started, which the next run refuses until someone looks).
    async fn write_sqlx(&mut self, w: Write<'_>) -> Result<(), Error> {
        let t = self.sqlx_table.clone();
        match w {
            Write::Started(m, _) => self.sqlx_started(m).await,
            Write::Finished(m, took) => {
                let q =
                    format!("UPDATE {t} SET success = TRUE, execution_time = ? WHERE version = ?");
                let nanos = sqlx_side::entry(m, None, took).execution_time;
                sqlx::query(AssertSqlSafe(q))
                    .bind(nanos)
                    .bind(m.version())
                    .execute(&mut **self.conn()?)
                    .await
                    .map_err(map_sqlx)?;
                Ok(())
            }
            Write::Unstarted(m) => {
                let q = format!("DELETE FROM {t} WHERE version = ? AND NOT success");
                sqlx::query(AssertSqlSafe(q))
                    .bind(m.version())
                    .execute(&mut **self.conn()?)
                    .await
                    .map_err(map_sqlx)?;
                Ok(())
            }
            Write::ToSqlx(rows) => self.write_sqlx_rows(rows).await,
            Write::Progress(..) | Write::Reverted(_) | Write::Adopted(_) => Ok(()),
        }
    }

    /// Records `rows` as done, in one statement (all or none).
    async fn record(&mut self, rows: &[Record]) -> Result<(), Error> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut q = sqlx::QueryBuilder::<MySql>::new(
            "INSERT INTO dblock_migrations (version, name, checksum, state, applied_at, \
             duration_ms) ",
        );
        q.push_values(rows, |mut v, r| {
            v.push_bind(r.version)
                .push_bind(r.name.clone())
                .push_bind(r.checksum.clone())
                .push("'done'")
                .push("coalesce(nullif(")
                .push_bind_unseparated(r.applied_at.clone())
                .push_unseparated(format!(", ''), {NOW})"))
                .push_bind(r.duration_ms);
        });
        q.build()
            .execute(&mut **self.conn()?)
            .await
            .map_err(map_sqlx)?;
        Ok(())
    }
}

/// The row of a migration about to be sent.
fn started(m: &Migration) -> sqlx::query::Query<'_, MySql, sqlx::mysql::MySqlArguments> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO dblock_migrations (version, name, checksum, state, applied_at, duration_ms) \
         VALUES (?, ?, ?, 'started', {NOW}, 0)"
    )))
    .bind(m.version())
    .bind(m.name())
    .bind(m.checksum())
}

impl Session for MySession {
    fn ensure_table(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(self.run(CREATE_TABLE))
    }

    fn records(&mut self) -> BoxFuture<'_, Result<Vec<Record>, Error>> {
        Box::pin(async move { read_records(self.conn()?).await })
    }

    fn history(&mut self) -> BoxFuture<'_, Result<History, Error>> {
        Box::pin(async move {
            let table = self.sqlx_table.clone();
            history(self.conn()?, &table).await
        })
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        match self.guard.as_mut() {
            Some(g) => g.check(),
            None => Box::pin(std::future::ready(Err(Error::ConnectionLost {
                message: "the migration session has ended".into(),
            }))),
        }
    }

    fn write<'a>(&'a mut self, w: Write<'a>) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.write_one(w))
    }

    fn execute<'a>(&'a mut self, sql: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        // The whole file, as the client sends a script: statements run one after
        // another, each DDL statement committed by the server as it goes.
        Box::pin(self.run(sql))
    }

    fn in_transaction<'a>(
        &'a mut self,
        _sql: &'a str,
        _then: Then<'a>,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(std::future::ready(Err(Error::unsupported(
            crate::error::Capability::TransactionalDdl,
            "MySQL commits DDL as it goes: a migration cannot share a transaction with its \
             bookkeeping row",
        ))))
    }

    fn keep_sqlx_history(&mut self, create: bool, lock: bool) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            if lock {
                let db: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
                    .fetch_one(&mut **self.conn()?)
                    .await
                    .map_err(map_sqlx)?;
                let name = sqlx_mysql_lock_name(&db.unwrap_or_default());
                self.take_sqlx_lock(&name).await?;
                self.sqlx_lock = Some(name);
            }
            if create {
                self.run(&sqlx_side::create_table(&self.sqlx_table, false))
                    .await?;
            }
            self.keeps_sqlx = true;
            Ok(())
        })
    }

    fn end_open_transaction(&mut self) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            let conn = self.conn()?;
            let open: i64 = sqlx::query_scalar("SELECT @@in_transaction")
                .fetch_one(&mut **conn)
                .await
                .map_err(map_sqlx)?;
            if open != 0 {
                self.run("ROLLBACK").await?;
            }
            Ok(open != 0)
        })
    }

    fn end(&mut self, ok: bool) -> BoxFuture<'_, Result<(), Error>> {
        // sqlx's lock lives on the migrations' connection: released before it goes
        // back to the pool; if that is not confirmed (an error, this future dropped),
        // the connection is closed, which releases it.
        let sqlx_lock = self
            .sqlx_lock
            .take()
            .zip(self.conn.take().map(|c| Closing(Some(c))));
        drop(self.conn.take());
        let released = self.guard.take().map(|g| g.release());
        Box::pin(async move {
            if let Some((name, mut conn)) = sqlx_lock
                && let Some(c) = conn.0.as_mut()
            {
                let r = sqlx::query("DO RELEASE_LOCK(?)")
                    .bind(name)
                    .execute(&mut **c)
                    .await;
                if r.is_ok() {
                    // Released: back to the pool.
                    drop(conn.0.take());
                }
            }
            match released {
                Some(r) if ok => r.await,
                // After a failure, the run's error is the one to report.
                Some(r) => r.await.or(Ok(())),
                None => Ok(()),
            }
        })
    }
}
