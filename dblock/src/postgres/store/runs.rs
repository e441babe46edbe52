//! The record of runs on PostgreSQL (`public.dblock_runs`, one per database like the
//! fencing table): created on first use under dblock's own set-up lock (see `fence`), so
//! processes claiming slots together on a fresh database never fail in its creation;
//! each read and write one statement in autocommit, on the server's clock
//! (`clock_timestamp()`, the wall clock at the call: `now()` would be the transaction's
//! start).

use std::sync::Arc;
use std::time::SystemTime;

use super::bookkeeping::q;
use super::fence::setup_ddl;
use crate::error::Error;
use crate::key::Key;
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::Results;
use crate::postgres::sql::{first_value, quote_ident, quote_literal};
use crate::raw::{
    BoxFuture, NewClaim, PG_FENCING_SCHEMA, RUNS_TABLE, Run, RunStore, from_unix_micros,
};

/// The table's definition: one row per claimed slot of a name, the unique key deciding
/// who claims it. Run under the set-up lock ([`setup_ddl`]).
pub(crate) fn table_ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         key bigint NOT NULL, \
         slot text NOT NULL, \
         namespace text NOT NULL, \
         name text NOT NULL, \
         attempt integer NOT NULL, \
         host text NOT NULL, \
         pid bigint NOT NULL, \
         program text NOT NULL, \
         started_at timestamptz NOT NULL, \
         finished_at timestamptz, \
         exit_code integer, \
         PRIMARY KEY (key, slot)); \
         CREATE INDEX IF NOT EXISTS {RUNS_TABLE}_started ON {table} (key, started_at)"
    )
}

/// The qualified table name.
pub(crate) fn table_name() -> String {
    format!("{}.{RUNS_TABLE}", quote_ident(PG_FENCING_SCHEMA))
}

/// The columns a [`Run`] is read from, as text, in this order.
const FIELDS: usize = 10;

fn fields_sql() -> &'static str {
    "ARRAY[slot, namespace, name, attempt::text, host, pid::text, program, \
     (extract(epoch FROM started_at) * 1000000)::bigint::text, \
     (extract(epoch FROM finished_at) * 1000000)::bigint::text, exit_code::text]"
}

/// The runs of `table` that `filter` selects, newest first, at most `limit`: each
/// row's fields as rows of one column, in order (the connection reads first columns).
fn select_sql(table: &str, filter: &str, limit: u32) -> String {
    format!(
        "SELECT u.v FROM (SELECT pg_catalog.row_number() OVER (ORDER BY started_at DESC, slot) AS n, \
         {fields} AS a FROM {table} WHERE {filter} ORDER BY started_at DESC, slot \
         LIMIT {limit}) r CROSS JOIN LATERAL pg_catalog.unnest(r.a) WITH ORDINALITY AS u(v, i) \
         ORDER BY r.n, u.i",
        fields = fields_sql()
    )
}

/// The runs in `rows` (statement 0), as [`select_sql`] lays them out.
fn parse_runs(rows: &Results) -> Result<Vec<Run>, Error> {
    let values = rows.first().map(Vec::as_slice).unwrap_or_default();
    values.chunks(FIELDS).map(parse_run).collect()
}

fn parse_run(f: &[Option<String>]) -> Result<Run, Error> {
    let bad = || Error::unexpected(format!("unexpected row in {RUNS_TABLE}: {f:?}"));
    let text = |i: usize| f.get(i).cloned().flatten().ok_or_else(bad);
    let num = |i: usize| -> Result<Option<i64>, Error> {
        match f.get(i).ok_or_else(bad)? {
            Some(v) => v.parse().map(Some).map_err(|_| bad()),
            None => Ok(None),
        }
    };
    let int = |i: usize| num(i)?.ok_or_else(bad);
    Ok(Run::from_row((
        text(0)?,
        text(1)?,
        text(2)?,
        int(3)?,
        text(4)?,
        int(5)?,
        text(6)?,
        int(7)?,
        num(8)?,
        num(9)?,
    )))
}

impl PgBackend {
    /// The qualified name of the record of runs, created on first use under dblock's own
    /// set-up lock (never the request's deadline, never behind a migration).
    async fn runs_table(&self) -> Result<&Arc<str>, Error> {
        if let Some(t) = self.runs_ready.get() {
            return Ok(t);
        }
        self.runs_ready
            .get_or_try_init(|| async {
                let table = table_name();
                let armed = Armed::new(self.source.get().await?);
                let sql = format!(
                    "SELECT pg_catalog.to_regclass({}) IS NOT NULL",
                    quote_literal(&table)
                );
                if first_value(&q(&armed, &sql).await?, 0).as_deref() != Some("t") {
                    setup_ddl(&armed, &table_ddl(&table)).await?;
                }
                armed.disarm().recycle();
                Ok(Arc::<str>::from(table))
            })
            .await
            .map_err(|e| self.runs_permission(e))
    }

    /// Runs `sql` (built on the table's name) on a connection of the handle's.
    async fn runs_query(&self, sql: impl FnOnce(&str) -> String) -> Result<Results, Error> {
        let table = self.runs_table().await?.clone();
        let armed = Armed::new(self.source.get().await?);
        let rows = q(&armed, &sql(&table))
            .await
            .map_err(|e| self.runs_permission(e))?;
        armed.disarm().recycle();
        Ok(rows)
    }

    async fn clock(&self) -> Result<SystemTime, Error> {
        let armed = Armed::new(self.source.get().await?);
        let rows = q(
            &armed,
            "SELECT (extract(epoch FROM pg_catalog.clock_timestamp()) * 1000000)::bigint",
        )
        .await?;
        armed.disarm().recycle();
        first_value(&rows, 0)
            .and_then(|v| v.parse().ok())
            .map(from_unix_micros)
            .ok_or_else(|| Error::unexpected("the server's clock could not be read"))
    }

    async fn insert_claim(&self, c: &NewClaim<'_>) -> Result<bool, Error> {
        let rows = self
            .runs_query(|t| {
                format!(
                    "INSERT INTO {t} (key, slot, namespace, name, attempt, host, pid, program, \
                     started_at) VALUES ({k}, {s}, {ns}, {n}, 1, {h}, {pid}, {p}, \
                     pg_catalog.clock_timestamp()) ON CONFLICT (key, slot) DO NOTHING RETURNING 1",
                    k = c.key.as_i64(),
                    s = quote_literal(c.slot),
                    ns = quote_literal(c.namespace),
                    n = quote_literal(c.name),
                    h = quote_literal(c.host),
                    pid = c.pid,
                    p = quote_literal(c.program),
                )
            })
            .await?;
        Ok(first_value(&rows, 0).is_some())
    }

    async fn read_claim(&self, key: Key, slot: &str) -> Result<Option<Run>, Error> {
        let filter = format!("key = {} AND slot = {}", key.as_i64(), quote_literal(slot));
        let rows = self.runs_query(|t| select_sql(t, &filter, 1)).await?;
        Ok(parse_runs(&rows)?.into_iter().next())
    }

    async fn retake_claim(&self, c: &NewClaim<'_>, seen: u32) -> Result<Option<u32>, Error> {
        let rows = self
            .runs_query(|t| {
                format!(
                    "UPDATE {t} SET attempt = attempt + 1, host = {h}, pid = {pid}, program = {p}, \
                     started_at = pg_catalog.clock_timestamp(), finished_at = NULL, exit_code = NULL \
                     WHERE key = {k} AND slot = {s} AND attempt = {seen} \
                     AND (finished_at IS NULL OR exit_code IS DISTINCT FROM 0) RETURNING attempt",
                    k = c.key.as_i64(),
                    s = quote_literal(c.slot),
                    h = quote_literal(c.host),
                    pid = c.pid,
                    p = quote_literal(c.program),
                )
            })
            .await?;
        Ok(first_value(&rows, 0).and_then(|v| v.parse().ok()))
    }

    async fn finish_claim(
        &self,
        key: Key,
        slot: &str,
        attempt: u32,
        exit_code: i32,
    ) -> Result<bool, Error> {
        let rows = self
            .runs_query(|t| {
                format!(
                    "UPDATE {t} SET finished_at = pg_catalog.clock_timestamp(), exit_code = {exit_code} \
                     WHERE key = {k} AND slot = {s} AND attempt = {attempt} \
                     AND finished_at IS NULL RETURNING 1",
                    k = key.as_i64(),
                    s = quote_literal(slot),
                )
            })
            .await?;
        Ok(first_value(&rows, 0).is_some())
    }

    async fn recent_runs(&self, key: Key, limit: u32) -> Result<Vec<Run>, Error> {
        let filter = format!("key = {}", key.as_i64());
        let rows = self.runs_query(|t| select_sql(t, &filter, limit)).await?;
        parse_runs(&rows)
    }

    async fn prune_runs(&self, key: Key, keep: u32) -> Result<(), Error> {
        let k = key.as_i64();
        let offset = keep.saturating_sub(1);
        self.runs_query(|t| {
            format!(
                "DELETE FROM {t} WHERE key = {k} AND started_at < (SELECT started_at FROM {t} \
                 WHERE key = {k} ORDER BY started_at DESC OFFSET {offset} LIMIT 1)"
            )
        })
        .await
        .map(drop)
    }
}

impl RunStore for PgBackend {
    fn db_clock(&self) -> BoxFuture<'_, Result<SystemTime, Error>> {
        Box::pin(self.clock())
    }

    fn insert_claim<'a>(&'a self, claim: &'a NewClaim<'a>) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(PgBackend::insert_claim(self, claim))
    }

    fn read_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
    ) -> BoxFuture<'a, Result<Option<Run>, Error>> {
        Box::pin(PgBackend::read_claim(self, key, slot))
    }

    fn retake_claim<'a>(
        &'a self,
        claim: &'a NewClaim<'a>,
        seen: u32,
    ) -> BoxFuture<'a, Result<Option<u32>, Error>> {
        Box::pin(PgBackend::retake_claim(self, claim, seen))
    }

    fn finish_claim<'a>(
        &'a self,
        key: Key,
        slot: &'a str,
        attempt: u32,
        exit_code: i32,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(PgBackend::finish_claim(self, key, slot, attempt, exit_code))
    }

    fn recent_runs(&self, key: Key, limit: u32) -> BoxFuture<'_, Result<Vec<Run>, Error>> {
        Box::pin(PgBackend::recent_runs(self, key, limit))
    }

    fn prune_runs(&self, key: Key, keep: u32) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(PgBackend::prune_runs(self, key, keep))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_parse_from_their_fields_with_any_text() {
        let v = |s: &str| Some(s.to_string());
        let rows: Results = vec![vec![
            v("2026-05-01T02:00:00Z"),
            v("public"),
            v("a\tname"),
            v("2"),
            v("host"),
            v("4242"),
            v("dblock"),
            v("1777600800123456"),
            None,
            None,
        ]];
        let runs = parse_runs(&rows).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].name, "a\tname");
        assert_eq!(runs[0].attempt, 2);
        assert_eq!(runs[0].finished, None);
        assert_eq!(runs[0].started, from_unix_micros(1_777_600_800_123_456),);
        assert!(parse_runs(&vec![vec![v("x"), None]]).is_err());
    }
}
