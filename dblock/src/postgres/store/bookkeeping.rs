//! The PostgreSQL migration runner's shared pieces: the bookkeeping table (its name,
//! definition and rows) and the migration lock, waited for without holding a snapshot.
//! Used by the runner's store (`migrate`) and adoption (`adopt`); the fencing table is
//! created under a set-up lock of its own (`fence`).

use std::time::Duration;

use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::migrate::plan::{MIGRATION_LOCK_KEY, Record, RecordState, TABLE};
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::{QueryError, Results};
use crate::postgres::sql::{first_value, quote_ident, quote_literal};

/// The first pause between two attempts at the lock; it doubles up to [`POLL_MAX`].
const POLL_FIRST: Duration = Duration::from_millis(20);
const POLL_MAX: Duration = Duration::from_millis(100);

/// Why a migration run (or baseline, or revert) is refused behind a transaction pooler,
/// and what to do.
pub(crate) const POOLER_FIX: &str = "it holds the migration lock across many transactions, \
     and runs statements outside any; run migrations through a URL that reaches PostgreSQL \
     directly, or through a session-pooling port (say so with pooler=session)";

/// The qualified bookkeeping table.
pub(crate) fn table(b: &PgBackend) -> Result<String, Error> {
    match &b.schema {
        Some(s) => Ok(format!("{}.{TABLE}", quote_ident(s))),
        None => Err(Error::configuration(
            "migrations need a schema for their bookkeeping table, and no schema of the \
             search_path exists",
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

pub(crate) async fn read_records(armed: &Armed, table: &str) -> Result<Vec<Record>, Error> {
    // One text column per row (the connection layer reads first columns), the name
    // last since it is the only field that could hold anything. `state` and
    // `statements_done` through the row's JSON: a table of an earlier dblock lacks them
    // (every row of it is done).
    let rows = q(
        armed,
        &format!(
            "SELECT pg_catalog.concat_ws(E'\\t', version, checksum, duration_ms, \
             pg_catalog.to_char(applied_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), \
             coalesce(to_jsonb(d)->>'state', 'done'), \
             coalesce(to_jsonb(d)->>'statements_done', ''), name) \
             FROM {table} d ORDER BY version"
        ),
    )
    .await?;
    rows.first()
        .map(|rows| rows.iter().map(|r| parse_record(r.as_deref())).collect())
        .unwrap_or(Ok(Vec::new()))
}

fn parse_record(row: Option<&str>) -> Result<Record, Error> {
    let bad = || Error::unexpected(format!("unexpected row in {TABLE}: {row:?}"));
    let mut f = row.ok_or_else(bad)?.splitn(7, '\t');
    let mut next = || f.next().ok_or_else(bad);
    let version = next()?.parse().map_err(|_| bad())?;
    let checksum = next()?.to_string();
    let duration_ms = next()?.parse().map_err(|_| bad())?;
    let applied_at = next()?.to_string();
    let state = next()?;
    let completed = match next()? {
        "" => None,
        n => Some(n.parse().map_err(|_| bad())?),
    };
    let state = match state {
        "done" => RecordState::Done,
        _ => RecordState::Started { completed },
    };
    let name = next()?.to_string();
    Ok(Record {
        version,
        name,
        checksum,
        applied_at,
        duration_ms,
        state,
    })
}

/// Whether the session holding the migration lock (as a session lock) still holds it.
pub(crate) fn holds_lock_sql() -> String {
    let (classid, objid) = Key::from_i64(MIGRATION_LOCK_KEY).pg_locks_ids();
    format!(
        "SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted \
         AND pid = pg_catalog.pg_backend_pid() AND classid = {classid} AND objid = {objid} \
         AND objsubid = 1"
    )
}

/// Whether any session of this database holds the migration lock now.
pub(crate) fn lock_held_sql() -> String {
    let (classid, objid) = Key::from_i64(MIGRATION_LOCK_KEY).pg_locks_ids();
    format!(
        "SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted \
         AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()) \
         AND classid = {classid} AND objid = {objid} AND objsubid = 1"
    )
}

/// Waits for the migration lock, as a session lock, holding no snapshot: a short
/// `pg_try_advisory_lock` in autocommit now and then, idle in between (see the module
/// documentation). With a deadline (the caller's, when dblock waits on its behalf),
/// gives up with [`Error::Timeout`] once it has passed; it always tries once.
pub(crate) async fn wait_for_lock(
    armed: &Armed,
    deadline: Option<tokio::time::Instant>,
) -> Result<(), Error> {
    wait_for_key(armed, MIGRATION_LOCK_KEY, deadline).await
}

/// [`wait_for_lock`] for advisory key `key` (sqlx's migration lock, say).
pub(crate) async fn wait_for_key(
    armed: &Armed,
    key: i64,
    deadline: Option<tokio::time::Instant>,
) -> Result<(), Error> {
    let sql = format!("SELECT pg_catalog.pg_try_advisory_lock({key})");
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
                    waiting_for: WaitingFor::MigrationLock,
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

/// The bookkeeping table's definition.
pub(crate) fn create_table(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         version bigint PRIMARY KEY, \
         name text NOT NULL, \
         checksum text NOT NULL, \
         applied_at timestamptz NOT NULL DEFAULT pg_catalog.now(), \
         duration_ms bigint NOT NULL, \
         {STATE_COLUMNS})"
    )
}

/// The columns a migration started outside a transaction needs (a table of an earlier
/// dblock gets them when it first runs one): `state` (`done`, `started`) and, for a
/// started one, how many statements are known to have completed.
const STATE_COLUMNS: &str = "state text NOT NULL DEFAULT 'done', statements_done bigint";

/// Adds [`STATE_COLUMNS`] to a table of an earlier dblock.
pub(crate) fn add_state_columns(table: &str) -> String {
    format!(
        "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS state text NOT NULL DEFAULT 'done', \
         ADD COLUMN IF NOT EXISTS statements_done bigint"
    )
}

/// Whether `table` has [`STATE_COLUMNS`] (`2`).
pub(crate) fn state_columns_sql(table: &str) -> String {
    format!(
        "SELECT pg_catalog.count(*) FROM pg_catalog.pg_attribute WHERE attrelid = pg_catalog.to_regclass({}) \
         AND attname IN ('state', 'statements_done') AND NOT attisdropped",
        quote_literal(table)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookkeeping_rows_parse_with_any_name() {
        let r = parse_record(Some(
            "12\tabc\t34\t2026-05-01T12:00:00.123Z\tdone\t\tname\twith\ttabs",
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
        assert_eq!(r.state, RecordState::Done);
        let r = parse_record(Some("12\tabc\t0\t2026-05-01T12:00:00.123Z\tstarted\t2\tn")).unwrap();
        assert_eq!(r.state, RecordState::Started { completed: Some(2) });
        assert!(parse_record(Some("x\tabc")).is_err());
        assert!(parse_record(None).is_err());
    }
}
