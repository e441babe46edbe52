//! The migration runner's store on PostgreSQL: one pinned connection, the migration lock
//! taken by polling in autocommit (no snapshot held while waiting) and held as a session
//! lock; each migration in a transaction of its own with its bookkeeping row, or
//! statement by statement in autocommit. The runner itself is `migrate::run`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::bookkeeping::{
    POOLER_FIX, add_state_columns, create_table, holds_lock_sql, lock_held_sql, q, read_records,
    state_columns_sql, table, wait_for_key, wait_for_lock,
};
use crate::error::{Error, LossReason};
use crate::migrate::adopt::History;
use crate::migrate::plan::{MIGRATION_LOCK_KEY, Record, lock_prefixed_with, millis};
use crate::migrate::set::Migration;
use crate::migrate::sqlx_side::{self, sqlx_lock_key};
use crate::migrate::store::{
    BoxFuture, MigrationStore, Options, Recorded, ScriptPool, Session, Then, Write, sealed,
};
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::{QueryError, Results};
use crate::postgres::sql::{first_value, quote_literal};

impl MigrationStore for PgBackend {
    fn backend(&self) -> &'static str {
        "PostgreSQL"
    }

    fn run_script<'a>(&'a self, key: i64, ddl: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(run_script(self, key, ddl))
    }

    fn read<'a>(&'a self, opts: &'a Options) -> BoxFuture<'a, Result<Recorded, Error>> {
        Box::pin(read(self, opts))
    }

    fn lock_held(&self) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            let armed = Armed::new(self.pinned().await?);
            let rows = q(&armed, &lock_held_sql()).await?;
            armed.disarm().recycle();
            Ok(first_value(&rows, 0).is_some_and(|n| n != "0"))
        })
    }

    fn lock<'a>(
        &'a self,
        opts: &'a Options,
        what: &'static str,
    ) -> BoxFuture<'a, Result<Box<dyn Session + 'a>, Error>> {
        Box::pin(async move {
            let s: Box<dyn Session + 'a> = Box::new(PgSession::lock(self, opts, what).await?);
            Ok(s)
        })
    }

    fn transactional_ddl(&self) -> bool {
        true
    }

    fn server_version_num(&self) -> BoxFuture<'_, Result<Option<u32>, Error>> {
        Box::pin(async move { server_version_num(self).await.map(Some) })
    }
}

/// `dblock::migrate::run_script` on the caller's pool: one message, one implicit
/// transaction, the lock released at its end whatever happens.
impl ScriptPool for sqlx::PgPool {
    fn run_locked<'a>(&'a self, sql: String) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(self)
                .await
                .map_err(super::xact::map_sqlx)?;
            Ok(())
        })
    }
}

impl sealed::Sealed for sqlx::PgPool {}

/// The server's `server_version_num`, on a connection of its own.
async fn server_version_num(b: &PgBackend) -> Result<u32, Error> {
    let armed = Armed::new(b.pinned().await?);
    let rows = q(
        &armed,
        "SELECT pg_catalog.current_setting('server_version_num')",
    )
    .await?;
    armed.disarm().recycle();
    first_value(&rows, 0)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::unexpected("server_version_num is not a number"))
}

/// How often the server checks, while a statement of the run executes, that the client
/// is still there (PostgreSQL 14 and later), in milliseconds.
const CLIENT_CHECK_MS: u32 = 1000;

/// The seed's primitive on one of the handle's connections, under advisory key `key`.
async fn run_script(b: &PgBackend, key: i64, ddl: &str) -> Result<(), Error> {
    b.trust(crate::raw::Scope::Transaction).await?;
    let armed = Armed::new(b.pinned().await?);
    let res = armed.conn().query(&lock_prefixed_with(key, ddl)).await;
    let conn = armed.disarm();
    match res {
        // A failed multi-statement message rolls its implicit transaction back: the
        // connection is clean, and the transaction-scoped lock is gone either way.
        Ok(_) => {
            conn.recycle();
            Ok(())
        }
        Err(e @ QueryError::Db { .. }) => {
            conn.recycle();
            Err(e.into_error())
        }
        Err(e) => {
            conn.abandon();
            Err(e.into_error())
        }
    }
}

/// The bookkeeping rows (if the table exists) and other tools' histories, read without
/// the lock on a connection of its own.
async fn read(b: &PgBackend, opts: &Options) -> Result<Recorded, Error> {
    let table = table(b)?;
    let armed = Armed::new(b.pinned().await?);
    let exists = q(
        &armed,
        &format!(
            "SELECT pg_catalog.to_regclass({}) IS NOT NULL",
            quote_literal(&table)
        ),
    )
    .await?;
    let records = match first_value(&exists, 0).as_deref() {
        Some("t") => Some(read_records(&armed, &table).await?),
        _ => None,
    };
    let history = super::adopt::history(&armed, &opts.sqlx_table).await?;
    armed.disarm().recycle();
    Ok(Recorded { records, history })
}

/// A run's connection, the migration lock it holds, and what it changed on the session.
struct PgSession {
    /// `None` once ended.
    armed: Option<Armed>,
    /// The migration lock is held (as a session lock).
    locked: bool,
    /// `client_connection_check_interval` was set and must be reset.
    checking: bool,
    /// The role the run connects as, for permission errors.
    role: String,
    /// dblock's table, qualified.
    table: String,
    /// sqlx's table, as SQL names it.
    sqlx_table: String,
    /// sqlx.toml's `ignored-chars`, for the checksums written into sqlx's history.
    sqlx_ignored: Option<BTreeSet<char>>,
    /// The session keeps sqlx's history (see `Session::keep_sqlx_history`).
    keeps_sqlx: bool,
    /// sqlx's lock, held (as a session lock) while keeping sqlx's history.
    sqlx_key: Option<i64>,
    /// The table has the columns of a started migration.
    has_state: bool,
}

impl PgSession {
    /// A pinned connection that watches for its client, then the migration lock, waited
    /// for holding no snapshot (see [`wait_for_lock`]). Dropped on the way (an error, a
    /// cancelled future), the connection is abandoned, which releases everything.
    async fn lock(b: &PgBackend, opts: &Options, what: &'static str) -> Result<Self, Error> {
        b.refuse_behind_pooler(what, POOLER_FIX, false)?;
        b.trust(crate::raw::Scope::Session).await?;
        let mut s = PgSession {
            table: table(b)?,
            armed: Some(Armed::new(b.pinned().await?)),
            locked: false,
            checking: false,
            role: b.role.clone(),
            sqlx_table: opts.sqlx_table.clone(),
            sqlx_ignored: opts.sqlx_ignored.clone(),
            keeps_sqlx: false,
            sqlx_key: None,
            has_state: false,
        };
        // Set for the run only where the session lacks it (dblock's own connections
        // already have it; a borrowed sqlx connection may not): what is set is reset.
        let v = s
            .q(
                "SELECT pg_catalog.current_setting('server_version_num')::int >= 140000 \
                AND coalesce(pg_catalog.current_setting('client_connection_check_interval', true), '0') = '0'",
            )
            .await?;
        if first_value(&v, 0).as_deref() == Some("t") {
            s.q(&format!(
                "SET client_connection_check_interval = {CLIENT_CHECK_MS}"
            ))
            .await?;
            s.checking = true;
        }
        wait_for_lock(s.armed()?, None).await?;
        s.locked = true;
        Ok(s)
    }

    fn armed(&self) -> Result<&Armed, Error> {
        self.armed.as_ref().ok_or_else(|| Error::ConnectionLost {
            message: "the migration session has ended".into(),
        })
    }

    async fn q(&self, sql: &str) -> Result<Results, Error> {
        q(self.armed()?, sql).await
    }

    /// The INSERT of a done row (and, keeping sqlx's history, of sqlx's row).
    fn insert(&self, m: &Migration, took: Duration) -> String {
        format!(
            "INSERT INTO {} (version, name, checksum, duration_ms) VALUES ({}, {}, {}, {}){}",
            self.table,
            m.version(),
            quote_literal(m.name()),
            quote_literal(m.checksum()),
            millis(took),
            self.to_sqlx(m, took)
        )
    }

    /// `; ` and the INSERT of sqlx's row of `m`, applied in `took`, when the session
    /// keeps sqlx's history; else nothing.
    fn to_sqlx(&self, m: &Migration, took: Duration) -> String {
        if !self.keeps_sqlx {
            return String::new();
        }
        let row = sqlx_side::entry(m, self.sqlx_ignored.as_ref(), took);
        format!(
            "; {}",
            super::sqlx_side::insert(&self.sqlx_table, std::slice::from_ref(&row))
        )
    }

    /// The deletion of a reverted migration's rows: dblock's, and sqlx's if its table
    /// exists.
    async fn forget(&self, m: &Migration) -> Result<String, Error> {
        let v = m.version();
        let mut sql = format!("DELETE FROM {} WHERE version = {v}", self.table);
        let sqlx = self
            .q(&format!(
                "SELECT pg_catalog.to_regclass({}) IS NOT NULL",
                quote_literal(&self.sqlx_table)
            ))
            .await?;
        if first_value(&sqlx, 0).as_deref() == Some("t") {
            sql.push_str(&format!(
                "; DELETE FROM {} WHERE version = {v}",
                self.sqlx_table
            ));
        }
        Ok(sql)
    }

    /// The SQL of one bookkeeping change.
    async fn write_sql(&mut self, w: Write<'_>) -> Result<Option<String>, Error> {
        let t = self.table.clone();
        Ok(Some(match w {
            Write::Started(m, statements) => {
                if !self.has_state {
                    self.q(&add_state_columns(&t)).await?;
                    self.has_state = true;
                }
                format!(
                    "INSERT INTO {t} (version, name, checksum, duration_ms, state, \
                     statements_done) VALUES ({}, {}, {}, 0, 'started', {})",
                    m.version(),
                    quote_literal(m.name()),
                    quote_literal(m.checksum()),
                    statements.map_or("NULL", |_| "0")
                )
            }
            Write::Progress(m, k) => format!(
                "UPDATE {t} SET statements_done = {k} WHERE version = {}",
                m.version()
            ),
            // One message, so one implicit transaction with sqlx's row.
            Write::Finished(m, took) => format!(
                "UPDATE {t} SET state = 'done', statements_done = NULL, applied_at = pg_catalog.now(), \
                 duration_ms = {} WHERE version = {}{}",
                millis(took),
                m.version(),
                self.to_sqlx(m, took)
            ),
            Write::Unstarted(m) => format!(
                "DELETE FROM {t} WHERE version = {} AND state = 'started'",
                m.version()
            ),
            Write::Reverted(m) => self.forget(m).await?,
            Write::Adopted(rows) => {
                super::adopt::record(self.armed()?, &self.table, rows).await?;
                return Ok(None);
            }
            Write::ToSqlx(&[]) => return Ok(None),
            Write::ToSqlx(rows) => super::sqlx_side::insert(&self.sqlx_table, rows),
        }))
    }
}

impl Session for PgSession {
    fn ensure_table(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            let schema = self.table.split('.').next().unwrap_or(&self.table);
            let schema = schema.trim_matches('"').to_string();
            let fix = format!(
                "run dblock migrate as a role that may create objects in schema {schema:?} \
                 (its owner), or have the owner run once: GRANT CREATE ON SCHEMA \"{schema}\" \
                 TO {}",
                self.role
            );
            self.q(&create_table(&self.table))
                .await
                .map_err(|e| super::setup::owner_needed(e, &fix))?;
            let columns = self.q(&state_columns_sql(&self.table)).await?;
            self.has_state = first_value(&columns, 0).as_deref() == Some("2");
            Ok(())
        })
    }

    fn records(&mut self) -> BoxFuture<'_, Result<Vec<Record>, Error>> {
        Box::pin(async move { read_records(self.armed()?, &self.table).await })
    }

    fn history(&mut self) -> BoxFuture<'_, Result<History, Error>> {
        Box::pin(async move { super::adopt::history(self.armed()?, &self.sqlx_table).await })
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            let rows = self.q(&holds_lock_sql()).await?;
            match first_value(&rows, 0).as_deref() {
                Some("1") => Ok(()),
                _ => Err(lock_gone()),
            }
        })
    }

    fn write<'a>(&'a mut self, w: Write<'a>) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            if let Some(sql) = self.write_sql(w).await? {
                self.q(&sql).await?;
            }
            Ok(())
        })
    }

    fn execute<'a>(&'a mut self, sql: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move { self.q(sql).await.map(drop) })
    }

    fn in_transaction<'a>(
        &'a mut self,
        sql: &'a str,
        then: Then<'a>,
    ) -> BoxFuture<'a, Result<Duration, Error>> {
        Box::pin(async move {
            // The deletion's SQL is settled before the transaction starts.
            let forget = match then {
                Then::Reverted(m) => Some(self.forget(m).await?),
                Then::Applied(_) => None,
            };
            self.q("BEGIN ISOLATION LEVEL READ COMMITTED").await?;
            let t0 = Instant::now();
            // The file as one message, inside the open transaction: the server parses
            // it, and the first failing statement aborts the transaction.
            let res = self.q(sql).await;
            let took = t0.elapsed();
            let res = match (res, then) {
                (Err(e), _) => Err(e),
                (Ok(_), Then::Applied(m)) => {
                    let commit = format!("{}; COMMIT", self.insert(m, took));
                    self.q(&commit).await
                }
                (Ok(_), Then::Reverted(_)) => {
                    let commit = format!("{}; COMMIT", forget.unwrap_or_default());
                    self.q(&commit).await
                }
            };
            if let Err(e) = res {
                if !e.is_connection() {
                    let _ = self.q("ROLLBACK").await;
                }
                return Err(e);
            }
            Ok(took)
        })
    }

    fn keep_sqlx_history(&mut self, create: bool, lock: bool) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            if lock {
                let db = self.q("SELECT pg_catalog.current_database()").await?;
                let key = sqlx_lock_key(&first_value(&db, 0).unwrap_or_default());
                // As dblock's own: polled in autocommit, so no snapshot is held while
                // a sqlx migrator holding it builds an index concurrently.
                wait_for_key(self.armed()?, key, None).await?;
                self.sqlx_key = Some(key);
            }
            if create {
                self.q(&sqlx_side::create_table(&self.sqlx_table, true))
                    .await?;
            }
            self.keeps_sqlx = true;
            Ok(())
        })
    }

    fn yield_to_sqlx_waiters(&mut self) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            let Some(key) = self.sqlx_key else {
                return Ok(false);
            };
            let waiting = self.q(&super::sqlx_side::waiters(key)).await?;
            if first_value(&waiting, 0).as_deref().is_none_or(|n| n == "0") {
                return Ok(false);
            }
            // The waiters are granted the lock in turn as it is released; polling, this
            // session holds no snapshot while their migrators run.
            self.sqlx_key = None;
            let released = self
                .q(&format!("SELECT pg_catalog.pg_advisory_unlock({key})"))
                .await?;
            if first_value(&released, 0).as_deref() != Some("t") {
                return Err(lock_gone());
            }
            wait_for_key(self.armed()?, key, None).await?;
            self.sqlx_key = Some(key);
            Ok(true)
        })
    }

    fn end_open_transaction(&mut self) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            // In autocommit a statement's transaction starts with it.
            let open = self
                .q("SELECT pg_catalog.transaction_timestamp() <> pg_catalog.statement_timestamp()")
                .await?;
            if first_value(&open, 0).as_deref() != Some("t") {
                return Ok(false);
            }
            self.q("ROLLBACK").await?;
            Ok(true)
        })
    }

    fn end(&mut self, ok: bool) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(self.end_session(ok))
    }
}

impl PgSession {
    /// Leaves the session as it was found — no transaction, no lock, no setting — and
    /// returns the connection to the pool; or, if that cannot be confirmed, abandons it,
    /// which releases everything on the server.
    async fn end_session(&mut self, ok: bool) -> Result<(), Error> {
        let Some(armed) = self.armed.take() else {
            return Ok(());
        };
        let mut stmts = Vec::new();
        if !ok {
            // Ends a failed migration's transaction (a warning if there is none).
            stmts.push("ROLLBACK".to_string());
        }
        // sqlx's lock first: taken after dblock's, released before it.
        if let Some(key) = self.sqlx_key.take() {
            stmts.push(format!("SELECT pg_catalog.pg_advisory_unlock({key})"));
        }
        let unlock_at = self.locked.then(|| {
            stmts.push(format!(
                "SELECT pg_catalog.pg_advisory_unlock({MIGRATION_LOCK_KEY})"
            ));
            stmts.len() - 1
        });
        if self.checking {
            stmts.push("RESET client_connection_check_interval".to_string());
        }
        if stmts.is_empty() {
            armed.disarm().recycle();
            return Ok(());
        }
        let res = armed.conn().query(&stmts.join("; ")).await;
        let conn = armed.disarm();
        match res {
            Ok(rows) if unlock_at.is_none_or(|i| first_value(&rows, i).as_deref() == Some("t")) => {
                conn.recycle();
                Ok(())
            }
            Ok(_) => {
                conn.abandon();
                if ok { Err(lock_gone()) } else { Ok(()) }
            }
            Err(e) => {
                conn.abandon();
                // After a failure, the first error is the one to report.
                if ok { Err(e.into_error()) } else { Ok(()) }
            }
        }
    }
}

/// The session no longer holds the migration lock.
fn lock_gone() -> Error {
    Error::LockLost {
        reason: LossReason::ConnectionClosed {
            message: "the session no longer held the migration lock (a pooler between dblock \
                      and the server may have switched sessions)"
                .into(),
        },
    }
}
