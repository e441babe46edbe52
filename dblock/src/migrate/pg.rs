//! The runner on PostgreSQL: one pinned connection, the migration lock taken by polling
//! in autocommit and held as a session lock, each migration in a transaction of its own
//! with its bookkeeping row.

use std::time::{Duration, Instant};

use super::{Applied, MIGRATION_LOCK_KEY, Migration, Record, Report, TABLE, failed, millis, plan};
use crate::Error;
use crate::postgres::{
    Armed, PgBackend, QueryError, Results, first_value, quote_ident, quote_literal,
};

/// The first pause between two attempts at the lock; it doubles up to [`POLL_MAX`].
const POLL_FIRST: Duration = Duration::from_millis(20);
const POLL_MAX: Duration = Duration::from_millis(100);

/// How often the server checks, while a statement of the run executes, that the client
/// is still there (PostgreSQL 14 and later), in milliseconds.
const CLIENT_CHECK_MS: u32 = 1000;

/// Why a migration run (or baseline, or revert) is refused behind a transaction pooler,
/// and what to do.
pub(crate) const POOLER_FIX: &str = "it holds the migration lock across many transactions, \
     and runs statements outside any; run migrations through a URL that reaches PostgreSQL \
     directly, or through a session-pooling port (say so with pooler=session)";

/// The qualified bookkeeping table.
pub(crate) fn table(b: &PgBackend) -> Result<String, Error> {
    match &b.schema {
        Some(s) => Ok(format!("{}.{TABLE}", quote_ident(s))),
        None => Err(Error::Unsupported(
            "migrations need a schema for their bookkeeping table, and no schema of the \
             search_path exists"
                .into(),
        )),
    }
}

pub(crate) async fn q(armed: &Armed, sql: &str) -> Result<Results, Error> {
    armed
        .conn()
        .query(sql)
        .await
        .map_err(QueryError::into_error)
}

/// The seed's primitive on one of the handle's connections.
pub(crate) async fn run_script(b: &PgBackend, ddl: &str) -> Result<(), Error> {
    let armed = Armed::new(b.pinned().await?);
    let res = armed.conn().query(&super::lock_prefixed(ddl)).await;
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
pub(crate) async fn records(b: &PgBackend) -> Result<Option<Vec<Record>>, Error> {
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

pub(crate) async fn read_records(armed: &Armed, table: &str) -> Result<Vec<Record>, Error> {
    // One text column per row (the connection layer reads first columns), the name
    // last since it is the only field that could hold anything.
    let rows = q(
        armed,
        &format!(
            "SELECT concat_ws(E'\\t', version, checksum, duration_ms, \
             to_char(applied_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), name) \
             FROM {table} ORDER BY version"
        ),
    )
    .await?;
    rows.first()
        .map(|rows| rows.iter().map(|r| parse_record(r.as_deref())).collect())
        .unwrap_or(Ok(Vec::new()))
}

fn parse_record(row: Option<&str>) -> Result<Record, Error> {
    let bad = || Error::Database {
        code: None,
        message: format!("unexpected row in {TABLE}: {row:?}"),
    };
    let mut f = row.ok_or_else(bad)?.splitn(5, '\t');
    let mut next = || f.next().ok_or_else(bad);
    let version = next()?.parse().map_err(|_| bad())?;
    let checksum = next()?.to_string();
    let duration_ms = next()?.parse().map_err(|_| bad())?;
    let applied_at = next()?.to_string();
    let name = next()?.to_string();
    Ok(Record {
        version,
        name,
        checksum,
        applied_at,
        duration_ms,
    })
}

/// Waits for the migration lock, as a session lock, holding no snapshot: a short
/// `pg_try_advisory_lock` in autocommit now and then, idle in between (see the module
/// documentation). With a deadline (the caller's, when dblock waits on its behalf),
/// gives up with [`Error::Timeout`] once it has passed; it always tries once.
pub(crate) async fn wait_for_lock(
    armed: &Armed,
    deadline: Option<tokio::time::Instant>,
) -> Result<(), Error> {
    let sql = format!("SELECT pg_try_advisory_lock({MIGRATION_LOCK_KEY})");
    let started = tokio::time::Instant::now();
    let mut pause = POLL_FIRST;
    loop {
        let rows = q(armed, &sql).await?;
        if first_value(&rows, 0).as_deref() == Some("t") {
            return Ok(());
        }
        let mut next = tokio::time::Instant::now() + pause;
        if let Some(d) = deadline.filter(|&d| next > d) {
            if tokio::time::Instant::now() >= d {
                return Err(Error::Timeout {
                    waiting_for: "the migration lock (dblock creates its fencing table under it)",
                    after: Some(started.elapsed()),
                });
            }
            // One last try at the deadline.
            next = d;
        }
        tokio::time::sleep_until(next).await;
        pause = (pause * 2).min(POLL_MAX);
    }
}

/// Runs dblock's own idempotent DDL under the migration lock, waiting for it the
/// runner's way (no snapshot held, so never in the way of a CREATE INDEX CONCURRENTLY).
/// If anything fails the connection is abandoned by the caller's [`Armed`], which
/// releases the lock.
///
/// The lock is a transaction-scoped one taken with `pg_try_advisory_xact_lock` in a
/// transaction that then runs the DDL and commits: everything on one server session
/// even through a transaction-pooling pooler, which a session lock would not be.
pub(crate) async fn own_ddl(
    armed: &Armed,
    ddl: &str,
    deadline: Option<tokio::time::Instant>,
) -> Result<(), Error> {
    let attempt = format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_try_advisory_xact_lock({MIGRATION_LOCK_KEY})"
    );
    let started = tokio::time::Instant::now();
    let mut pause = POLL_FIRST;
    loop {
        let rows = q(armed, &attempt).await?;
        if first_value(&rows, 1).as_deref() == Some("t") {
            break;
        }
        // Idle, holding nothing, between attempts.
        q(armed, "ROLLBACK").await?;
        let mut next = tokio::time::Instant::now() + pause;
        if let Some(d) = deadline.filter(|&d| next > d) {
            if tokio::time::Instant::now() >= d {
                return Err(Error::Timeout {
                    waiting_for: "the migration lock (dblock creates its fencing table under it)",
                    after: Some(started.elapsed()),
                });
            }
            // One last try at the deadline.
            next = d;
        }
        tokio::time::sleep_until(next).await;
        pause = (pause * 2).min(POLL_MAX);
    }
    match q(armed, &format!("{ddl}; COMMIT")).await {
        Ok(_) => Ok(()),
        Err(e) => {
            let _ = q(armed, "ROLLBACK").await;
            Err(e)
        }
    }
}

/// The bookkeeping table's definition.
pub(crate) fn create_table(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         version bigint PRIMARY KEY, \
         name text NOT NULL, \
         checksum text NOT NULL, \
         applied_at timestamptz NOT NULL DEFAULT now(), \
         duration_ms bigint NOT NULL)"
    )
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

pub(crate) async fn run(
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
            .map_err(|e| crate::postgres::owner_needed(e, &fix))?;
        let mut records = read_records(&self.armed, table).await?;
        // Another tool's history: adopted, or refused, before anything is applied.
        let history = super::adopt::pg::history(&self.armed).await?;
        let adopted = super::adopt_or_refuse(set, &mut records, &history)?;
        let pending = plan(set, &records, ignore_missing)?;
        super::adopt::pg::record(&self.armed, table, &adopted).await?;
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
                            reason: crate::LossReason::ConnectionClosed {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookkeeping_rows_parse_with_any_name() {
        let r = parse_record(Some(
            "12\tabc\t34\t2026-05-01T12:00:00.123Z\tname\twith\ttabs",
        ))
        .unwrap();
        assert_eq!(
            (
                r.version,
                r.checksum.as_str(),
                r.duration_ms,
                r.name.as_str()
            ),
            (12, "abc", 34, "name\twith\ttabs")
        );
        assert_eq!(r.applied_at, "2026-05-01T12:00:00.123Z");
        assert!(parse_record(Some("x\tabc")).is_err());
        assert!(parse_record(None).is_err());
    }
}
