//! `dblock status` and `dblock release --force` on MySQL / MariaDB.
//!
//! Neither server lists user-level locks by default (MySQL's
//! `performance_schema.metadata_locks` needs the performance schema, MariaDB's
//! `METADATA_LOCK_INFO` a plugin), so the locks shown are those dblock can name: the
//! names asked for, the names in the fencing table (fenced grants record theirs), and
//! the locks someone waits for — a wait runs in text with a comment naming the lock,
//! which the processlist shows. For each, `IS_USED_LOCK` gives the holder's connection
//! id and the processlist its client address. sqlx offers no connection attributes, so
//! a holder's program and pid are not known to the server (see `docs/status.md`).

use std::collections::BTreeMap;

use sqlx::Row;

use super::{MyBackend, map_sqlx};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{Asked, BoxFuture, LockStatus, Mode, Party, StatusSource};
use crate::status::parse_comments;

impl StatusSource for MyBackend {
    fn status<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>> {
        Box::pin(self.lock_status(asked))
    }

    fn terminate<'a>(&'a self, asked: Asked<'a>) -> BoxFuture<'a, Result<Vec<Party>, Error>> {
        Box::pin(self.kill_holder(asked))
    }

    fn status_all<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>> {
        Box::pin(self.lock_status_of(asked, true))
    }
}

impl MyBackend {
    async fn lock_status(&self, asked: &[Asked<'_>]) -> Result<Vec<LockStatus>, Error> {
        self.lock_status_of(asked, asked.is_empty()).await
    }

    /// The locks of `asked`, and with `all` every lock this backend can list too.
    async fn lock_status_of(
        &self,
        asked: &[Asked<'_>],
        all: bool,
    ) -> Result<Vec<LockStatus>, Error> {
        let mut locks = Listing::default();
        for (ns, name, key) in asked {
            locks.add(*key, ns, name);
        }
        self.add_waiters(asked, all, &mut locks).await?;
        // Fenced names, when listing everything.
        if all {
            self.add_fenced(&mut locks).await;
        }
        let holders = self.holders(locks.0.keys().copied()).await?;
        let clients = self.clients(holders.iter().map(|h| h.1)).await?;
        for (k, id) in holders {
            if let Some(l) = locks.0.get_mut(&k) {
                l.holders.push(Party {
                    mode: Mode::Exclusive,
                    connection: Some(id),
                    client: clients.get(&id).cloned(),
                    ..Party::default()
                });
            }
        }
        // A fenced name nobody holds or awaits is history, not a lock.
        let mut out: Vec<LockStatus> = locks
            .0
            .into_values()
            .filter(|l| !l.holders.is_empty() || !l.waiters.is_empty())
            .collect();
        for l in &mut out {
            l.waiters.sort_by_key(|w| w.since);
        }
        Ok(out)
    }

    /// Waits, named by their comments (of `asked`'s locks only, unless `all`).
    async fn add_waiters(
        &self,
        asked: &[Asked<'_>],
        all: bool,
        locks: &mut Listing,
    ) -> Result<(), Error> {
        let rows = sqlx::query(
            "SELECT CAST(ID AS SIGNED), HOST, INFO FROM information_schema.PROCESSLIST \
             WHERE INFO LIKE '%/* dblock %' AND ID <> CONNECTION_ID()",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(map_sqlx)?;
        for row in rows {
            let (Ok(id), Ok(host), Ok(Some(info))) = (
                row.try_get::<i64, _>(0),
                row.try_get::<Option<String>, _>(1),
                row.try_get::<Option<String>, _>(2),
            ) else {
                continue;
            };
            for c in parse_comments(&info) {
                let key = c.key();
                if !all && !asked.iter().any(|a| a.2 == key) {
                    continue;
                }
                locks.add(key, &c.namespace, &c.name).waiters.push(Party {
                    mode: Mode::Exclusive,
                    host: c.host.clone(),
                    pid: c.pid,
                    connection: Some(id),
                    client: host.clone(),
                    since: c.since,
                    ..Party::default()
                });
            }
        }
        Ok(())
    }

    /// The names in the fencing table (none if it cannot be read).
    async fn add_fenced(&self, locks: &mut Listing) {
        let fenced: Vec<(i64, String, String)> =
            sqlx::query_as("SELECT `key`, namespace, name FROM dblock_fencing")
                .fetch_all(&self.pool)
                .await
                .unwrap_or_default();
        for (k, ns, name) in fenced {
            let key = Key::from_i64(k);
            if Key::derive(&ns, &name) == key {
                locks.add(key, &ns, &name);
            }
        }
    }

    /// The holder's connection id of each of `keys` that is held, by `IS_USED_LOCK`, a
    /// batch of names a statement.
    async fn holders(&self, keys: impl Iterator<Item = i64>) -> Result<Vec<(i64, i64)>, Error> {
        let keys: Vec<i64> = keys.collect();
        let mut holders: Vec<(i64, i64)> = Vec::new();
        for batch in keys.chunks(200) {
            let sql = batch
                .iter()
                .map(|k| {
                    let n = self.lock_name(Key::from_i64(*k));
                    format!("SELECT CAST({k} AS SIGNED), CAST(IS_USED_LOCK('{n}') AS SIGNED)")
                })
                .collect::<Vec<_>>()
                .join(" UNION ALL ");
            let rows: Vec<(i64, Option<i64>)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .fetch_all(&self.pool)
                .await
                .map_err(map_sqlx)?;
            holders.extend(rows.into_iter().filter_map(|(k, id)| Some((k, id?))));
        }
        Ok(holders)
    }

    /// The processlist's client address (`HOST`) of each connection id.
    async fn clients(
        &self,
        ids: impl Iterator<Item = i64>,
    ) -> Result<BTreeMap<i64, String>, Error> {
        let ids: Vec<String> = ids.map(|i| i.to_string()).collect();
        if ids.is_empty() {
            return Ok(BTreeMap::new());
        }
        let rows: Vec<(i64, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT CAST(ID AS SIGNED), HOST FROM information_schema.PROCESSLIST WHERE ID IN ({})",
            ids.join(",")
        )))
        .fetch_all(&self.pool)
        .await
        .map_err(map_sqlx)?;
        Ok(rows
            .into_iter()
            .filter_map(|(id, h)| Some((id, h?)))
            .collect())
    }

    async fn kill_holder(&self, asked: Asked<'_>) -> Result<Vec<Party>, Error> {
        let name = self.lock_name(asked.2);
        let id: Option<i64> = sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS SIGNED)")
            .bind(&name)
            .fetch_one(&self.pool)
            .await
            .map_err(map_sqlx)?;
        let Some(id) = id else {
            return Ok(Vec::new());
        };
        let client = self.clients(std::iter::once(id)).await?.remove(&id);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(&self.pool)
            .await
            .map_err(map_sqlx)?;
        Ok(vec![Party {
            mode: Mode::Exclusive,
            connection: Some(id),
            client,
            ..Party::default()
        }])
    }
}

/// The locks listed so far, by key.
#[derive(Default)]
struct Listing(BTreeMap<i64, LockStatus>);

impl Listing {
    /// The lock of `key`, named `ns`/`name` if it is new.
    fn add(&mut self, key: Key, ns: &str, name: &str) -> &mut LockStatus {
        self.0.entry(key.as_i64()).or_insert_with(|| LockStatus {
            key,
            namespace: Some(ns.to_string()),
            name: Some(name.to_string()),
            slot: None,
            holders: Vec::new(),
            waiters: Vec::new(),
        })
    }
}
