//! The migration runner on MySQL and MariaDB.
//!
//! The migration lock is the named lock of [`MIGRATION_LOCK_KEY`] on the database
//! (`dblock:<db hash>:44424c4f434b4d01`, see [`lock_name`](super::lock_name)), taken
//! like any dblock lock on a connection of its own and checked between migrations; the
//! migrations themselves run on a second connection.
//!
//! MySQL commits DDL implicitly, statement by statement, so a migration and its
//! bookkeeping row cannot share a transaction. Each migration is therefore recorded
//! twice: as `started` (committed) before its SQL runs, and as `done` after. A run that
//! finds a `started` row — its runner crashed, was killed or failed half way — refuses
//! to continue ([`Error::InvalidMigration`] naming the file): part of the migration may
//! be applied, and running it again could apply that part twice. Resolve it by hand
//! (see `docs/mysql.md`): inspect the schema, finish or undo the migration's statements,
//! then either mark it done
//! (`UPDATE dblock_migrations SET state = 'done' WHERE version = V`) or delete the row
//! to have the next run apply it again (`DELETE FROM dblock_migrations WHERE version = V`).

use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, MySql, Row};

use super::{MyBackend, map_sqlx};
use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::migrate::adopt::{History, baseline_records};
use crate::migrate::plan::{Applied, MIGRATION_LOCK_KEY, Record, Report, failed, millis, plan};
use crate::migrate::set::Migration;
use crate::raw::{BoxFuture, MigrationTarget, Mode, RawHeld, Req, Scope, Wait};

impl MigrationTarget for MyBackend {
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

    /// Other tools' histories are not read on MySQL (yet): none.
    fn history(&self) -> BoxFuture<'_, Result<History, Error>> {
        Box::pin(std::future::ready(Ok(History::default())))
    }

    fn baseline<'a>(
        &'a self,
        set: &'a [Migration],
        to: Option<i64>,
    ) -> BoxFuture<'a, Result<Vec<i64>, Error>> {
        Box::pin(baseline(self, set, to))
    }

    fn revert<'a>(
        &'a self,
        set: &'a [Migration],
        to: Option<i64>,
        on_reverted: &'a mut (dyn FnMut(&Applied) + Send),
    ) -> BoxFuture<'a, Result<Vec<Applied>, Error>> {
        let _ = (set, to, on_reverted);
        Box::pin(std::future::ready(Err(Error::Unsupported(
            "migrate revert is not available on MySQL/MariaDB: DDL commits as it goes, so a \
             down migration that fails half way cannot be rolled back; revert by hand and \
             delete its dblock_migrations row (docs/mysql.md)"
                .into(),
        ))))
    }
}

/// `Runner::baseline` on MySQL: under the migration lock, the table, then every row in
/// one statement (all or none), recorded `done` without running anything. Only with
/// `to` (MySQL has no sqlx history dblock reads); refuses, as a run does, while a
/// migration is recorded as started and never done.
async fn baseline(b: &MyBackend, set: &[Migration], to: Option<i64>) -> Result<Vec<i64>, Error> {
    let guard = lock(b).await?;
    let mut conn = connection(b).await?;
    sqlx::raw_sql(CREATE_TABLE)
        .execute(&mut *conn)
        .await
        .map_err(map_sqlx)?;
    let records = read_records(&mut conn, Some(set)).await?;
    let rows = baseline_records(set, &records, &History::default(), to)?;
    if !rows.is_empty() {
        let mut q = sqlx::QueryBuilder::<MySql>::new(
            "INSERT INTO dblock_migrations (version, name, checksum, state, applied_at, duration_ms) ",
        );
        q.push_values(&rows, |mut v, r| {
            v.push_bind(r.version)
                .push_bind(r.name.clone())
                .push_bind(r.checksum.clone())
                .push("'done'")
                .push(NOW)
                .push_bind(0i64);
        });
        q.build().execute(&mut *conn).await.map_err(map_sqlx)?;
    }
    drop(conn);
    guard.release().await?;
    Ok(rows.iter().map(|r| r.version).collect())
}

const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS dblock_migrations (\
     version BIGINT NOT NULL PRIMARY KEY, \
     name VARCHAR(1024) NOT NULL, \
     checksum VARCHAR(128) NOT NULL, \
     state VARCHAR(16) NOT NULL, \
     applied_at VARCHAR(32) NOT NULL, \
     duration_ms BIGINT NOT NULL) ENGINE=InnoDB";

const NOW: &str = "DATE_FORMAT(UTC_TIMESTAMP(3), '%Y-%m-%dT%H:%i:%s.%fZ')";

/// Waits for the migration lock: held until the returned half-guard drops.
async fn lock(b: &MyBackend) -> Result<Box<dyn RawHeld>, Error> {
    let key = Key::from_i64(MIGRATION_LOCK_KEY);
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

/// A start-up script under the migration lock.
pub(crate) async fn run_script(b: &MyBackend, ddl: &str) -> Result<(), Error> {
    let guard = lock(b).await?;
    let mut conn = connection(b).await?;
    let r = sqlx::raw_sql(AssertSqlSafe(ddl.to_string()))
        .execute(&mut *conn)
        .await
        .map_err(map_sqlx);
    drop(conn);
    guard.release().await?;
    r.map(|_| ())
}

/// The `done` rows of the bookkeeping table, if it exists, read without the lock (status,
/// dry runs): a `started` row may be a migration being applied right now, so it shows
/// as pending here; only a run, under the lock, can tell it was left by a crash.
pub(crate) async fn records(b: &MyBackend) -> Result<Option<Vec<Record>>, Error> {
    let mut conn = connection(b).await?;
    let exists: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.TABLES \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dblock_migrations'",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(map_sqlx)?;
    if exists == 0 {
        return Ok(None);
    }
    read_records(&mut conn, None).await.map(Some)
}

/// The `done` rows. Under the lock (`set` given), refuses on a `started` one, naming its
/// file; without it, skips such rows.
async fn read_records(
    conn: &mut PoolConnection<MySql>,
    set: Option<&[Migration]>,
) -> Result<Vec<Record>, Error> {
    let rows = sqlx::query(
        "SELECT version, name, checksum, state, applied_at, duration_ms \
         FROM dblock_migrations ORDER BY version",
    )
    .fetch_all(&mut **conn)
    .await
    .map_err(map_sqlx)?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let version: i64 = r.try_get(0).map_err(map_sqlx)?;
        let name: String = r.try_get(1).map_err(map_sqlx)?;
        let state: String = r.try_get(3).map_err(map_sqlx)?;
        let applied_at: String = r.try_get(4).map_err(map_sqlx)?;
        if state != "done" {
            let Some(set) = set else {
                continue;
            };
            let file = set
                .iter()
                .find(|m| m.version() == version)
                .map(|m| m.file().to_string())
                .unwrap_or_else(|| format!("{version}_{name}.sql"));
            return Err(Error::InvalidMigration {
                file,
                reason: format!(
                    "was started at {applied_at} and never recorded as done: its run crashed, \
                     was killed or failed part way, and MySQL commits DDL as it goes, so part \
                     of it may be applied. Check the schema, finish or undo its statements, then \
                     run UPDATE dblock_migrations SET state = 'done' WHERE version = {version} \
                     (or DELETE FROM dblock_migrations WHERE version = {version} to apply it \
                     again); see docs/mysql.md"
                ),
            });
        }
        out.push(Record {
            version,
            name,
            checksum: r.try_get(2).map_err(map_sqlx)?,
            applied_at,
            duration_ms: r.try_get(5).map_err(map_sqlx)?,
        });
    }
    Ok(out)
}

pub(crate) async fn run(
    b: &MyBackend,
    set: &[Migration],
    ignore_missing: bool,
    on_applied: &mut (dyn FnMut(&Applied) + Send),
) -> Result<Report, Error> {
    // Held until this returns, however it returns (dropping the guard releases).
    let mut guard = lock(b).await?;
    let mut conn = connection(b).await?;
    sqlx::raw_sql(CREATE_TABLE)
        .execute(&mut *conn)
        .await
        .map_err(map_sqlx)?;
    let records = read_records(&mut conn, Some(set)).await?;
    let pending = plan(set, &records, ignore_missing)?;
    let mut report = Report {
        applied: Vec::with_capacity(pending.len()),
        already_applied: set.len() - pending.len(),
        adopted: 0,
    };
    for m in pending {
        // Never start a migration without the lock.
        guard.check().await?;
        let took = apply(&mut conn, m).await?;
        let applied = Applied {
            version: m.version(),
            name: m.name().to_string(),
            file_name: m.file_name().to_string(),
            duration: took,
            no_transaction: m.no_transaction(),
        };
        on_applied(&applied);
        report.applied.push(applied);
    }
    drop(conn);
    guard.release().await?;
    Ok(report)
}

/// Records `m` as started, runs it, records it as done.
async fn apply(
    conn: &mut PoolConnection<MySql>,
    m: &Migration,
) -> Result<std::time::Duration, Error> {
    let fail = |e| failed(m, None, e);
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO dblock_migrations (version, name, checksum, state, applied_at, duration_ms) \
         VALUES (?, ?, ?, 'started', {NOW}, 0)"
    )))
    .bind(m.version())
    .bind(m.name())
    .bind(m.checksum())
    .execute(&mut **conn)
    .await
    .map_err(|e| fail(map_sqlx(e)))?;
    let t0 = Instant::now();
    // The whole file, as the client sends a script: statements run one after another,
    // each DDL statement committed by the server as it goes. A failure leaves the row
    // `started`: the next run refuses until someone has looked.
    sqlx::raw_sql(AssertSqlSafe(m.sql().to_string()))
        .execute(&mut **conn)
        .await
        .map_err(|e| fail(map_sqlx(e)))?;
    let took = t0.elapsed();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE dblock_migrations SET state = 'done', applied_at = {NOW}, duration_ms = ? \
         WHERE version = ?"
    )))
    .bind(millis(took))
    .bind(m.version())
    .execute(&mut **conn)
    .await
    .map_err(|e| fail(map_sqlx(e)))?;
    Ok(took)
}
