//! Leaders' values on PostgreSQL: `public.dblock_leaders`, one row per election name
//! (keyed like the fencing table), written by the leader of the term it names and read
//! by anyone together with the fencing table's record of the latest term.
//!
//! The table is created on the first publish, under dblock's set-up lock (as the fencing
//! table is: `CREATE TABLE IF NOT EXISTS` run by eight processes at once fails in some),
//! or once by `dblock setup` for roles that may not create tables. Readers never create
//! it: a reader that finds no table finds no value.

use super::fence::setup_ddl;
use crate::error::Error;
use crate::key::Key;
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::{QueryError, Results};
use crate::postgres::sql::{quote_ident, quote_literal};
use crate::raw::{
    BoxFuture, FENCING_TABLE, Fence, LEADERS_TABLE, LeaderStore, PG_FENCING_SCHEMA, TermRecord,
    check_leader_value,
};
use crate::status::from_unix_ms;

/// SQLSTATE undefined_table.
const UNDEFINED_TABLE: &str = "42P01";

/// Values each term row carries (see [`PgBackend::read_terms`]).
const COLUMNS: usize = 7;

/// `public.dblock_leaders`, as SQL names it.
pub(crate) fn leaders_table() -> String {
    format!("{}.{LEADERS_TABLE}", quote_ident(PG_FENCING_SCHEMA))
}

fn fencing_table() -> String {
    format!("{}.{FENCING_TABLE}", quote_ident(PG_FENCING_SCHEMA))
}

/// The DDL of the leaders' table `table`, for [`setup_ddl`] (under the set-up lock).
pub(crate) fn table_ddl(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         key bigint PRIMARY KEY, \
         namespace text NOT NULL, \
         name text NOT NULL, \
         token bigint NOT NULL, \
         holder text NOT NULL, \
         value text, \
         published_at timestamptz NOT NULL)"
    )
}

impl LeaderStore for PgBackend {
    fn publish<'a>(&'a self, fence: &'a Fence, value: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.publish_value(fence, value))
    }

    fn terms<'a>(
        &'a self,
        keys: &'a [Key],
        prefixes: &'a [(&'a str, &'a str)],
    ) -> BoxFuture<'a, Result<Vec<TermRecord>, Error>> {
        Box::pin(self.read_terms(keys, prefixes))
    }
}

impl PgBackend {
    /// One statement on a connection of the handle's own; the connection is kept when
    /// the server answers with an error.
    async fn one(&self, sql: &str) -> Result<Result<Results, QueryError>, Error> {
        let armed = Armed::new(self.source.get().await?);
        let out = armed.conn().query(sql).await;
        match &out {
            Ok(_) | Err(QueryError::Db { .. }) => armed.disarm().recycle(),
            Err(QueryError::Lost { .. }) => {}
        }
        Ok(out)
    }

    async fn publish_value(&self, fence: &Fence, value: &str) -> Result<(), Error> {
        check_leader_value(value)?;
        let table = leaders_table();
        // Written only from the fencing row of this very term: no row (a newer term,
        // or none) writes nothing; nor does an older term over a newer one's value.
        let sql = format!(
            "INSERT INTO {table} AS l (key, namespace, name, token, holder, value, published_at) \
             SELECT f.key, f.namespace, f.name, f.token, f.holder, {v}, pg_catalog.now() \
             FROM {fencing} f WHERE f.key = {k} AND f.token = {t} \
             ON CONFLICT (key) DO UPDATE SET namespace = EXCLUDED.namespace, \
             name = EXCLUDED.name, token = EXCLUDED.token, holder = EXCLUDED.holder, \
             value = EXCLUDED.value, published_at = EXCLUDED.published_at \
             WHERE l.token <= EXCLUDED.token RETURNING 1",
            v = quote_literal(value),
            fencing = fencing_table(),
            k = fence.key().as_i64(),
            t = fence.token(),
        );
        let mut created = false;
        let rows = loop {
            match self.one(&sql).await? {
                Ok(rows) => break rows,
                Err(QueryError::Db { code, .. }) if code == UNDEFINED_TABLE && !created => {
                    self.create_leaders_table().await?;
                    created = true;
                }
                Err(e) => return Err(self.fencing_permission(e.into_error())),
            }
        };
        if rows.first().is_some_and(|r| !r.is_empty()) {
            return Ok(());
        }
        // Nothing written: a newer term (or no record of this one).
        let latest = self
            .one(&format!(
                "SELECT token::text FROM {} WHERE key = {}",
                fencing_table(),
                fence.key().as_i64()
            ))
            .await?
            .map_err(QueryError::into_error)?;
        let latest = crate::postgres::sql::first_value(&latest, 0).and_then(|t| t.parse().ok());
        Err(Error::StaleToken {
            name: fence.name().to_string(),
            token: fence.token(),
            latest: latest.unwrap_or(0),
        })
    }

    /// Creates the leaders' table under dblock's set-up lock.
    async fn create_leaders_table(&self) -> Result<(), Error> {
        let armed = Armed::new(self.source.get().await?);
        setup_ddl(&armed, &table_ddl(&leaders_table()))
            .await
            .map_err(|e| self.fencing_permission(e))?;
        armed.disarm().recycle();
        Ok(())
    }

    /// The latest terms of `keys` and of the names with `prefixes`, with their values:
    /// one statement, each term's values as rows in order (the connection reads the
    /// first column of each row).
    async fn read_terms(
        &self,
        keys: &[Key],
        prefixes: &[(&str, &str)],
    ) -> Result<Vec<TermRecord>, Error> {
        let mut cond: Vec<String> = Vec::new();
        if !keys.is_empty() {
            let list: Vec<String> = keys.iter().map(|k| k.as_i64().to_string()).collect();
            cond.push(format!("f.key IN ({})", list.join(",")));
        }
        for (ns, prefix) in prefixes {
            cond.push(format!(
                "(f.namespace = {} AND pg_catalog.left(f.name, {}) = {})",
                quote_literal(ns),
                prefix.chars().count(),
                quote_literal(prefix)
            ));
        }
        if cond.is_empty() {
            return Ok(Vec::new());
        }
        let select = |value: &str, join: &str| {
            format!(
                "SELECT pg_catalog.unnest(ARRAY[f.key::text, f.namespace, f.name, f.holder, f.token::text, \
                 (extract(epoch FROM f.granted_at) * 1000)::text, {value}]) \
                 FROM {} f{join} WHERE {} ORDER BY f.key",
                fencing_table(),
                cond.join(" OR ")
            )
        };
        let with_values = select(
            "l.value",
            &format!(
                " LEFT JOIN {} l ON l.key = f.key AND l.token = f.token",
                leaders_table()
            ),
        );
        let rows = match self.one(&with_values).await? {
            Ok(rows) => rows,
            // No leaders' table yet (nobody published): the terms without values; no
            // fencing table either: no terms.
            Err(QueryError::Db { code, .. }) if code == UNDEFINED_TABLE => {
                match self.one(&select("NULL::text", "")).await? {
                    Ok(rows) => rows,
                    Err(QueryError::Db { code, .. }) if code == UNDEFINED_TABLE => {
                        return Ok(Vec::new());
                    }
                    Err(e) => return Err(e.into_error()),
                }
            }
            Err(e) => return Err(e.into_error()),
        };
        Ok(rows
            .into_iter()
            .next()
            .unwrap_or_default()
            .chunks(COLUMNS)
            .filter_map(read_term)
            .collect())
    }
}

/// One term row of [`PgBackend::read_terms`].
fn read_term(row: &[Option<String>]) -> Option<TermRecord> {
    let [key, namespace, name, holder, token, granted_at, value] = row else {
        return None;
    };
    Some(TermRecord {
        key: Key::from_i64(key.as_deref()?.parse().ok()?),
        namespace: namespace.clone()?,
        name: name.clone()?,
        holder: holder.clone()?,
        token: token.as_deref()?.parse().ok()?,
        granted_at: granted_at
            .as_deref()
            .and_then(|v| v.parse::<f64>().ok())
            .and_then(from_unix_ms),
        value: value.clone(),
    })
}
