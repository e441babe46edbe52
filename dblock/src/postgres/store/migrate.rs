//! The runner on PostgreSQL: one pinned connection, the migration lock taken by polling
//! in autocommit and held as a session lock, each migration in a transaction of its own
//! with its bookkeeping row.

use std::time::{Duration, Instant};

use super::bookkeeping::{POOLER_FIX, create_table, q, read_records, table, wait_for_lock};
use crate::error::{Error, LossReason};
use crate::migrate::adopt::{History, adopt_or_refuse};
use crate::migrate::plan::{
    Applied, MIGRATION_LOCK_KEY, Record, Report, failed, lock_prefixed, millis, plan,
};
use crate::migrate::set::Migration;
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::QueryError;
use crate::postgres::sql::{first_value, quote_literal};
use crate::raw::{BoxFuture, MigrationTarget};

impl MigrationTarget for PgBackend {
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

    fn revert<'a>(
        &'a self,
        set: &'a [Migration],
        to: Option<i64>,
        on_reverted: &'a mut (dyn FnMut(&Applied) + Send),
    ) -> BoxFuture<'a, Result<Vec<Applied>, Error>> {
        Box::pin(super::revert::revert(self, set, to, on_reverted))
    }

    fn server_version_num(&self) -> BoxFuture<'_, Result<Option<u32>, Error>> {
        Box::pin(async move { server_version_num(self).await.map(Some) })
    }
}

/// The server's `server_version_num`, on a connection of its own.
async fn server_version_num(b: &PgBackend) -> Result<u32, Error> {
    let armed = Armed::new(b.pinned().await?);
    let rows = q(&armed, "SELECT current_setting('server_version_num')").await?;
    armed.disarm().recycle();
    first_value(&rows, 0)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::Database {
            code: None,
            message: "server_version_num is not a number".into(),
        })
}

/// How often the server checks, while a statement of the run executes, that the client
/// is still there (PostgreSQL 14 and later), in milliseconds.
const CLIENT_CHECK_MS: u32 = 1000;

/// The seed's primitive on one of the handle's connections.
async fn run_script(b: &PgBackend, ddl: &str) -> Result<(), Error> {
    let armed = Armed::new(b.pinned().await?);
    let res = armed.conn().query(&lock_prefixed(ddl)).await;
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

/// The bookkeeping rows, read without the lock; `None` if the table does not exist.
async fn records(b: &PgBackend) -> Result<Option<Vec<Record>>, Error> {
    let table = table(b)?;
    let armed = Armed::new(b.pinned().await?);
    let exists = q(
        &armed,
        &format!("SELECT to_regclass({}) IS NOT NULL", quote_literal(&table)),
    )
    .await?;
    let records = match first_value(&exists, 0).as_deref() {
        Some("t") => Some(read_records(&armed, &table).await?),
        _ => None,
    };
    armed.disarm().recycle();
    Ok(records)
}

/// A run's connection and what it has changed on the session.
struct Session {
    armed: Armed,
    /// The migration lock is held (as a session lock).
    locked: bool,
    /// `client_connection_check_interval` was set and must be reset.
    checking: bool,
    /// The role the run connects as, for permission errors.
    role: String,
}

async fn run(
    b: &PgBackend,
    set: &[Migration],
    ignore_missing: bool,
    on_applied: &mut (dyn FnMut(&Applied) + Send),
) -> Result<Report, Error> {
    b.refuse_behind_pooler("a migration run", POOLER_FIX)?;
    let table = table(b)?;
    let mut s = Session {
        armed: Armed::new(b.pinned().await?),
        locked: false,
        checking: false,
        role: b.role.clone(),
    };
    let res = s
        .apply_pending(&table, set, ignore_missing, on_applied)
        .await;
    let end = s.end(res.is_ok()).await;
    let report = res?;
    end?;
    Ok(report)
}

impl Session {
    async fn apply_pending(
        &mut self,
        table: &str,
        set: &[Migration],
        ignore_missing: bool,
        on_applied: &mut (dyn FnMut(&Applied) + Send),
    ) -> Result<Report, Error> {
        // Set for the run only where the session lacks it (dblock's own connections
        // already have it; a borrowed sqlx connection may not): what is set is reset.
        let v = q(
            &self.armed,
            "SELECT current_setting('server_version_num')::int >= 140000 \
             AND coalesce(current_setting('client_connection_check_interval', true), '0') = '0'",
        )
        .await?;
        if first_value(&v, 0).as_deref() == Some("t") {
            q(
                &self.armed,
                &format!("SET client_connection_check_interval = {CLIENT_CHECK_MS}"),
            )
            .await?;
            self.checking = true;
        }
        self.lock().await?;
        // Only now, under the lock: the table, then what is applied.
        let schema = table.split('.').next().unwrap_or(table).trim_matches('"');
        let fix = format!(
            "run dblock migrate as a role that may create objects in schema {schema:?} (its \
             owner), or have the owner run once: GRANT CREATE ON SCHEMA \"{schema}\" TO {}",
            self.role
        );
        q(&self.armed, &create_table(table))
            .await
            .map_err(|e| super::setup::owner_needed(e, &fix))?;
        let mut records = read_records(&self.armed, table).await?;
        // Another tool's history: adopted, or refused, before anything is applied.
        let history = super::adopt::history(&self.armed).await?;
        let adopted = adopt_or_refuse(set, &mut records, &history)?;
        let pending = plan(set, &records, ignore_missing)?;
        super::adopt::record(&self.armed, table, &adopted).await?;
        let mut report = Report {
            applied: Vec::with_capacity(pending.len()),
            already_applied: set.len() - pending.len(),
            adopted: adopted.len(),
        };
        for m in pending {
            let duration = if m.no_transaction() {
                self.apply_outside_transaction(table, m).await?
            } else {
                self.apply_in_transaction(table, m).await?
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

    /// Waits for the migration lock holding no snapshot (see [`wait_for_lock`]).
    async fn lock(&mut self) -> Result<(), Error> {
        wait_for_lock(&self.armed, None).await?;
        self.locked = true;
        Ok(())
    }

    fn insert(table: &str, m: &Migration, ms: i64) -> String {
        format!(
            "INSERT INTO {table} (version, name, checksum, duration_ms) VALUES ({}, {}, {}, {ms})",
            m.version(),
            quote_literal(m.name()),
            quote_literal(m.checksum()),
        )
    }

    /// The migration and its row in one transaction.
    async fn apply_in_transaction(
        &mut self,
        table: &str,
        m: &Migration,
    ) -> Result<Duration, Error> {
        let fail = |e| failed(m, None, e);
        q(&self.armed, "BEGIN ISOLATION LEVEL READ COMMITTED")
            .await
            .map_err(fail)?;
        let t0 = Instant::now();
        // The file as one message, inside the open transaction: the server parses it,
        // and the first failing statement aborts the transaction.
        q(&self.armed, m.sql()).await.map_err(fail)?;
        let took = t0.elapsed();
        let commit = format!("{}; COMMIT", Session::insert(table, m, millis(took)));
        q(&self.armed, &commit).await.map_err(fail)?;
        Ok(took)
    }

    /// The migration's statements one by one in autocommit, then its row.
    async fn apply_outside_transaction(
        &mut self,
        table: &str,
        m: &Migration,
    ) -> Result<Duration, Error> {
        let statements = m.statements();
        let n = statements.len();
        let t0 = Instant::now();
        for (i, stmt) in statements.iter().enumerate() {
            q(&self.armed, stmt)
                .await
                .map_err(|e| failed(m, Some((i + 1, n)), e))?;
        }
        let took = t0.elapsed();
        // A statement of the file may have opened a transaction it did not end; in
        // autocommit a statement's transaction starts with it.
        let open = q(
            &self.armed,
            "SELECT transaction_timestamp() <> statement_timestamp()",
        )
        .await
        .map_err(|e| failed(m, None, e))?;
        if first_value(&open, 0).as_deref() == Some("t") {
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
        q(&self.armed, &Session::insert(table, m, millis(took)))
            .await
            .map_err(|e| failed(m, None, e))?;
        Ok(took)
    }

    /// Leaves the session as it was found — no transaction, no lock, no setting — and
    /// returns the connection to the pool; or, if that cannot be confirmed, abandons it,
    /// which releases everything on the server.
    async fn end(self, ok: bool) -> Result<(), Error> {
        let mut stmts = Vec::new();
        if !ok {
            // Ends a failed migration's transaction (a warning if there is none).
            stmts.push("ROLLBACK".to_string());
        }
        let unlock_at = self.locked.then(|| {
            stmts.push(format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"));
            stmts.len() - 1
        });
        if self.checking {
            stmts.push("RESET client_connection_check_interval".to_string());
        }
        if stmts.is_empty() {
            self.armed.disarm().recycle();
            return Ok(());
        }
        let res = self.armed.conn().query(&stmts.join("; ")).await;
        let conn = self.armed.disarm();
        match res {
            Ok(rows) => {
                let released =
                    unlock_at.is_none_or(|i| first_value(&rows, i).as_deref() == Some("t"));
                if released {
                    conn.recycle();
                    Ok(())
                } else {
                    conn.abandon();
                    if ok {
                        Err(Error::LockLost {
                            reason: LossReason::ConnectionClosed {
                                message: "the session no longer held the migration lock at \
                                          the end of the run (a pooler between dblock and the \
                                          server may have switched sessions)"
                                    .into(),
                            },
                        })
                    } else {
                        Ok(())
                    }
                }
            }
            Err(e) => {
                conn.abandon();
                // After a failure, the first error is the one to report.
                if ok { Err(e.into_error()) } else { Ok(()) }
            }
        }
    }
}
