//! `dblock status` and `dblock release --force` on PostgreSQL: advisory locks from
//! `pg_locks`, who holds and awaits them from `pg_stat_activity`, their names from the
//! comment each request carries (see [`status`](crate::status)), else from the fencing
//! table.

use std::collections::BTreeMap;

use crate::error::Error;
use crate::key::Key;
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::{QueryError, Results};
use crate::postgres::sql::quote_literal;
use crate::raw::{
    Asked, BoxFuture, FENCING_TABLE, LockStatus, Mode, PG_FENCING_SCHEMA, Party, Scope,
    StatusSource,
};
use crate::status::{comment_for, from_unix_ms, parse_application_name};

/// Values each lock row carries (see [`PgBackend::lock_rows`]).
const COLUMNS: usize = 10;

impl StatusSource for PgBackend {
    fn status<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>> {
        Box::pin(self.lock_status(asked))
    }

    fn terminate<'a>(&'a self, asked: Asked<'a>) -> BoxFuture<'a, Result<Vec<Party>, Error>> {
        Box::pin(self.terminate_holders(asked.2))
    }

    fn status_all<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>> {
        // pg_locks lists every advisory lock under its own key: the asked ones are among
        // them (named by the caller, who knows their keys).
        let _ = asked;
        Box::pin(self.lock_status(&[]))
    }
}

impl PgBackend {
    /// One query on a connection of the handle's own.
    async fn run(&self, sql: &str) -> Result<Results, Error> {
        let armed = Armed::new(self.source.get().await?);
        let rows = armed
            .conn()
            .query(sql)
            .await
            .map_err(QueryError::into_error)?;
        armed.disarm().recycle();
        Ok(rows)
    }

    /// The rows of pg_locks' advisory locks on this database (bigint keys), `keys`
    /// only unless empty, with what pg_stat_activity says of their sessions;
    /// `terminate`: end the holders' sessions too.
    fn lock_rows(&self, keys: &[Key], terminate: bool) -> String {
        let key = "((l.classid::bigint << 32) | l.objid::bigint)";
        let filter = match keys {
            [] => String::new(),
            ks => format!(
                " AND {key} IN ({})",
                ks.iter()
                    .map(|k| k.as_i64().to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        };
        let waitstart = match self.version >= 140_000 {
            true => "(extract(epoch FROM l.waitstart) * 1000)::text",
            false => "NULL::text",
        };
        // Terminating, the `granted` value says whether the holder was ended; the
        // subquery (OFFSET 0 keeps it apart) picks the holders before anyone is.
        let (granted, only_granted) = match terminate {
            true => (
                "pg_catalog.pg_terminate_backend(h.pid)::text",
                " AND l.granted",
            ),
            false => ("h.granted::text", ""),
        };
        format!(
            "SELECT pg_catalog.unnest(ARRAY[h.k::text, h.mode, {granted}, h.pid::text, \
             h.application_name, h.client, h.xact_start, h.query_start, h.waitstart, h.query]) \
             FROM (SELECT {key} AS k, l.mode, l.granted, l.pid, a.application_name, \
             host(a.client_addr) || ':' || a.client_port::text AS client, \
             (extract(epoch FROM a.xact_start) * 1000)::text AS xact_start, \
             (extract(epoch FROM a.query_start) * 1000)::text AS query_start, \
             {waitstart} AS waitstart, a.query \
             FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.pid <> pg_catalog.pg_backend_pid() \
             AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())\
             {only_granted}{filter} ORDER BY l.granted DESC, l.pid OFFSET 0) h"
        )
    }

    async fn lock_status(&self, asked: &[Asked<'_>]) -> Result<Vec<LockStatus>, Error> {
        let keys: Vec<Key> = asked.iter().map(|a| a.2).collect();
        let rows = self.run(&self.lock_rows(&keys, false)).await?;
        let mut locks: BTreeMap<i64, LockStatus> = BTreeMap::new();
        for row in rows.into_iter().next().unwrap_or_default().chunks(COLUMNS) {
            let Some((key, granted, party)) = read_row(row) else {
                continue;
            };
            let lock = locks.entry(key.as_i64()).or_insert_with(|| LockStatus {
                key,
                namespace: None,
                name: None,
                slot: None,
                holders: Vec::new(),
                waiters: Vec::new(),
            });
            if let Some((ns, name, slot)) = party.1 {
                lock.namespace.get_or_insert(ns);
                lock.name.get_or_insert(name);
                lock.slot = lock.slot.or(slot);
            }
            match granted {
                true => lock.holders.push(party.0),
                false => lock.waiters.push(party.0),
            }
        }
        self.names_from_fencing(&mut locks).await;
        let mut out: Vec<LockStatus> = locks.into_values().collect();
        for l in &mut out {
            l.waiters.sort_by_key(|w| w.since);
        }
        Ok(out)
    }

    /// Names still unknown, from the fencing table (fenced grants record theirs);
    /// nothing if there is no table or it cannot be read.
    async fn names_from_fencing(&self, locks: &mut BTreeMap<i64, LockStatus>) {
        let unnamed: Vec<String> = locks
            .values()
            .filter(|l| l.name.is_none())
            .map(|l| l.key.as_i64().to_string())
            .collect();
        if unnamed.is_empty() {
            return;
        }
        let exists = self
            .run(&format!(
                "SELECT pg_catalog.to_regclass(pg_catalog.format('%I.%I', {}, '{FENCING_TABLE}'))::text",
                quote_literal(PG_FENCING_SCHEMA)
            ))
            .await;
        let Ok(Some(qualified)) = exists.map(|r| crate::postgres::sql::first_value(&r, 0)) else {
            return;
        };
        let Ok(rows) = self
            .run(&format!(
                "SELECT pg_catalog.unnest(ARRAY[key::text, namespace, name]) FROM {qualified} \
                 WHERE key IN ({})",
                unnamed.join(",")
            ))
            .await
        else {
            return;
        };
        for row in rows.into_iter().next().unwrap_or_default().chunks(3) {
            let [Some(k), Some(ns), Some(name)] = row else {
                continue;
            };
            let Ok(k) = k.parse::<i64>() else { continue };
            // Believed only if the name hashes to the key.
            if Key::derive(ns, name).as_i64() != k {
                continue;
            }
            if let Some(l) = locks.get_mut(&k) {
                l.namespace = Some(ns.clone());
                l.name = Some(name.clone());
            }
        }
    }

    async fn terminate_holders(&self, key: Key) -> Result<Vec<Party>, Error> {
        let rows = self.run(&self.lock_rows(&[key], true)).await?;
        Ok(rows
            .into_iter()
            .next()
            .unwrap_or_default()
            .chunks(COLUMNS)
            .filter_map(read_row)
            .filter(|(_, ended, _)| *ended)
            .map(|(_, _, (p, _))| p)
            .collect())
    }
}

/// One row of [`PgBackend::lock_rows`]: the key, whether granted, the party and the
/// (namespace, name, semaphore slot) its comment gives.
#[allow(clippy::type_complexity)]
fn read_row(
    row: &[Option<String>],
) -> Option<(Key, bool, (Party, Option<(String, String, Option<u32>)>))> {
    let [
        key,
        mode,
        granted,
        pid,
        app,
        client,
        xact_start,
        query_start,
        waitstart,
        query,
    ] = row
    else {
        return None;
    };
    let key = Key::from_i64(key.as_deref()?.parse().ok()?);
    let granted = granted.as_deref() == Some("true");
    let ms = |v: &Option<String>| v.as_deref()?.parse::<f64>().ok().and_then(from_unix_ms);
    let (comment, slot) = match query.as_deref().and_then(|q| comment_for(q, key)) {
        Some((c, slot)) => (Some(c), slot),
        None => (None, None),
    };
    let app = app.as_deref().filter(|a| !a.is_empty());
    let from_app = app.and_then(parse_application_name);
    let mut party = Party {
        mode: match mode.as_deref() {
            Some("ShareLock") => Mode::Shared,
            _ => Mode::Exclusive,
        },
        scope: comment.as_ref().and_then(|c| c.scope),
        connection: pid.as_deref().and_then(|p| p.parse().ok()),
        client: client.clone(),
        ..Party::default()
    };
    match (&comment, &from_app) {
        (Some(c), _) if c.pid.is_some() => {
            party.host = c.host.clone();
            party.pid = c.pid;
        }
        (_, Some((_, pid, host))) => {
            party.host = Some(host.clone());
            party.pid = Some(*pid);
        }
        _ => {}
    }
    party.program = match &from_app {
        Some((program, _, _)) => Some(program.clone()),
        None => app.map(str::to_string),
    };
    party.since = match (granted, &comment) {
        // The grant's time, from the health check's comment; before the first check,
        // the request's own statement (its transaction, for a transaction lock).
        (true, Some(c)) => c.since.or_else(|| match c.scope {
            Some(Scope::Session) => ms(query_start),
            _ => ms(xact_start),
        }),
        (true, None) => ms(xact_start),
        // A wait's later slices carry when it began; else the server's own record.
        (false, c) => c
            .as_ref()
            .and_then(|c| c.since)
            .or_else(|| ms(waitstart))
            .or_else(|| ms(query_start)),
    };
    let named = comment.map(|c| (c.namespace, c.name, slot));
    Some((key, granted, (party, named)))
}
