//! Fencing tokens on PostgreSQL: the table (created on first use, under dblock's own
//! set-up lock), the latest grant read back, and the check a fenced write makes. The
//! token itself is taken in the acquisition's own message (see `plan`).
//!
//! # dblock's own set-up
//!
//! `CREATE TABLE IF NOT EXISTS` is not safe run concurrently (two sessions both find the
//! table missing and one fails on a catalog's unique index), so the table is created
//! under a lock. Not the migration lock: a user's `dblock migrate` holds that for as
//! long as its migrations run, and the first fenced grant on a database must not wait
//! for it, nor fail behind it. The set-up lock [`SETUP_LOCK_KEY`] is held only for the
//! few milliseconds the DDL takes, by dblock alone; it is waited for the migration
//! runner's way (tried in a transaction, idle holding nothing between tries, so no
//! snapshot is held that a `CREATE INDEX CONCURRENTLY` would wait for), for at most
//! [`SETUP_WAIT`] whatever the request's own deadline: a fenced `try_lock` on a fresh
//! database answers held or not held, never "timed out" in dblock's set-up.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{PgConnection, Postgres, Transaction};

use super::bookkeeping::q;
use super::token::{EPOCH_SQL, NO_EPOCH_CODES};
use super::xact::map_sqlx;
use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::QueryError;
use crate::postgres::sql::{first_value, quote_ident, quote_literal};
use crate::raw::Fence;
use crate::raw::{
    BoxFuture, FENCING_TABLE, FencingStore, LatestGrant, PG_FENCING_SCHEMA as PG_SCHEMA,
};

/// The advisory key dblock's own set-up (its fencing table) is done under: `DBLOCKS`
/// and 1, beside the migration lock's `DBLOCKM` and 1. Fixed: never change it.
pub(crate) const SETUP_LOCK_KEY: i64 = 0x4442_4c4f_434b_5301;

/// The longest dblock's set-up waits for another process's: the lock is held for a
/// `CREATE TABLE`, so only a server that stops answering makes anyone wait this long.
pub(crate) const SETUP_WAIT: Duration = Duration::from_secs(30);

/// The first pause between two tries at the set-up lock; it doubles up to
/// [`POLL_MAX`].
const POLL_FIRST: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(100);

/// Runs dblock's own idempotent DDL under the set-up lock (see the module docs), in one
/// transaction that takes the lock with `pg_try_advisory_xact_lock`, runs `ddl` and
/// commits: everything on one server session even through a transaction-pooling
/// pooler. If anything fails the connection is abandoned by the caller's [`Armed`],
/// which releases the lock.
pub(crate) async fn setup_ddl(armed: &Armed, ddl: &str) -> Result<(), Error> {
    let attempt = format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_catalog.pg_try_advisory_xact_lock({SETUP_LOCK_KEY})"
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
        if started.elapsed() >= SETUP_WAIT {
            return Err(Error::Timeout {
                waiting_for: WaitingFor::FencingTable,
                after: Some(started.elapsed()),
            });
        }
        tokio::time::sleep(pause).await;
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

impl PgBackend {
    /// The qualified name of the fencing table, created on first use under dblock's own
    /// set-up lock, with its own bound ([`SETUP_WAIT`]): never the request's deadline,
    /// never behind a migration.
    pub(crate) async fn fence_table(&self) -> Result<&Arc<str>, Error> {
        if let Some(t) = self.fence_ready.get() {
            return Ok(t);
        }
        let table = self
            .fence_ready
            // Boxed, and only when it runs (once per handle): inline, this future would
            // be part of every lock request's.
            .get_or_try_init(|| {
                Box::pin(async {
                    // One table per database, like the keys (not the handle's schema).
                    let table = format!("{}.{}", quote_ident(PG_SCHEMA), FENCING_TABLE);
                    let armed = Armed::new(self.source.get().await?);
                    let rows = armed
                        .conn()
                        .query(&format!(
                            "SELECT pg_catalog.to_regclass({}) IS NOT NULL",
                            quote_literal(&table)
                        ))
                        .await
                        .map_err(QueryError::into_error)?;
                    if first_value(&rows, 0).as_deref() != Some("t") {
                        setup_ddl(&armed, &table_ddl(&table)).await?;
                    }
                    // Whether the server has the live timeline (see EPOCH_SQL): once, here,
                    // so that a platform without it keeps plain counters instead of failing
                    // every fenced grant.
                    match armed.conn().query(&format!("SELECT {EPOCH_SQL}")).await {
                        Err(QueryError::Db { code, .. })
                            if NO_EPOCH_CODES.contains(&code.as_str()) =>
                        {
                            self.fence_epoch
                                .store(false, std::sync::atomic::Ordering::Relaxed);
                        }
                        Ok(_) | Err(QueryError::Db { .. }) => {}
                        Err(e) => return Err(e.into_error()),
                    }
                    armed.disarm().recycle();
                    Ok(Arc::<str>::from(table))
                })
            })
            .await?;
        Ok(table)
    }
}

impl FencingStore for PgBackend {
    fn latest_grant(&self, key: Key) -> BoxFuture<'_, Result<Option<LatestGrant>, Error>> {
        Box::pin(PgBackend::latest_grant(self, key))
    }
}

impl PgBackend {
    /// The latest grant of `key` in the fencing table, if any.
    async fn latest_grant(&self, key: Key) -> Result<Option<LatestGrant>, Error> {
        let table = self.fence_table().await?.clone();
        let armed = Armed::new(self.source.get().await?);
        // One statement, its three values as three rows in order (unnest keeps the
        // array's order); the connection reads the first column of each row.
        let sql = format!(
            "SELECT pg_catalog.unnest(ARRAY[holder, token::text, granted_at::text]) FROM {table} \
             WHERE key = {k}",
            k = key.as_i64()
        );
        let rows = armed
            .conn()
            .query(&sql)
            .await
            .map_err(QueryError::into_error)?;
        armed.disarm().recycle();
        let mut values = rows.into_iter().next().unwrap_or_default().into_iter();
        let (Some(Some(holder)), Some(Some(token)), Some(Some(granted_at))) =
            (values.next(), values.next(), values.next())
        else {
            return Ok(None);
        };
        Ok(Some(LatestGrant {
            holder,
            token: token.parse().unwrap_or(0),
            granted_at,
        }))
    }
}

/// The PostgreSQL DDL of the fencing table `table` (`"public".dblock_fencing`): creates
/// it if it is missing, seeded with the latest tokens of older tables of that name in
/// other schemas. Run under the set-up lock ([`setup_ddl`]).
pub(crate) fn table_ddl(table: &str) -> String {
    let lit = quote_literal(table);
    let schema = quote_literal(PG_SCHEMA);
    format!(
        "DO $dblock$ DECLARE s text; BEGIN \
         IF pg_catalog.to_regclass({lit}) IS NULL THEN \
         CREATE TABLE {table} (\
         key bigint PRIMARY KEY, \
         namespace text NOT NULL, \
         name text NOT NULL, \
         token bigint NOT NULL, \
         holder text NOT NULL, \
         granted_at timestamptz NOT NULL); \
         FOR s IN SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = '{FENCING_TABLE}' AND c.relkind = 'r' AND n.nspname <> {schema} \
         AND pg_catalog.has_table_privilege(c.oid, 'SELECT') LOOP \
         EXECUTE pg_catalog.format('INSERT INTO {table} AS f SELECT key, namespace, name, token, holder, \
         granted_at FROM %I.{FENCING_TABLE} ON CONFLICT (key) DO UPDATE SET token = \
         greatest(f.token, EXCLUDED.token)', s); \
         END LOOP; END IF; END $dblock$"
    )
}

/// The latest token of `key` in `table`, read inside `tx` and held (`FOR SHARE`) until
/// `tx` ends, so that no newer grant can be made before `tx` commits.
///
/// With `idle_bound` (the grant's lease), `tx` may then sit idle at most that long
/// (`SET LOCAL idle_in_transaction_session_timeout`): a writer paused between its check
/// and its commit would otherwise hold the row, and every newer grant of the name behind
/// it, for as long as it stays paused — past the lease that freed its lock. The server
/// ends such a session instead; its commit then fails, so the write never lands.
pub(crate) async fn check(
    tx: &mut Transaction<'_, Postgres>,
    table: &str,
    key: Key,
    idle_bound: Option<Duration>,
) -> Result<Option<i64>, Error> {
    use sqlx::Row;
    // Simple-protocol statements in one message (the key is an integer): no server-side
    // prepared statement, which a transaction-pooling pooler may not carry.
    let select = format!(
        "SELECT token FROM {table} WHERE key = {} FOR SHARE",
        key.as_i64()
    );
    let sql = match idle_bound {
        // At least a millisecond: 0 would turn the bound off.
        Some(bound) => format!(
            "SET LOCAL idle_in_transaction_session_timeout = {}; {select}",
            bound.as_millis().clamp(1, i32::MAX as u128)
        ),
        None => select,
    };
    let conn: &mut PgConnection = tx;
    let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .fetch_optional(conn)
        .await
        .map_err(map_sqlx)?;
    match row {
        Some(r) => Ok(Some(r.try_get(0).map_err(map_sqlx)?)),
        None => Ok(None),
    }
}

// The check of writes to this backend's database, on the token every backend's grant
// carries: defined here, so that the friendly layer names no backend.
impl Fence {
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    /// Checks, inside `tx`, that this is still the latest grant of the name, and holds
    /// the name's fencing row until `tx` ends so that no newer grant can be made before
    /// `tx` commits. Call it just before committing the writes it protects.
    ///
    /// It compares this token with the name's row in `public.dblock_fencing` of the
    /// database `tx` runs on, and passes only if they are equal: after a failover, a
    /// grant the promoted server never received (its row is older) fails as surely as one
    /// a newer grant replaced.
    ///
    /// When the grant had a [lease](crate::Request::lease), the check also sets
    /// `idle_in_transaction_session_timeout` to the lease for the rest of `tx` (`SET
    /// LOCAL`): a writer that pauses between this check and its commit is cut off by the
    /// server after the lease, as its lock was, instead of holding the row — and every
    /// newer grant of the name — for as long as it stays paused. Its commit then fails and
    /// its writes are lost, never applied late. So commit promptly after the check; a
    /// shorter timeout the session had is raised to the lease until `tx` ends.
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] when the row holds another token (roll `tx` back); database
    /// errors.
    ///
    /// # Cancel safety
    ///
    /// If cancelled, `tx` may hold the row lock until it ends; nothing else changes.
    pub async fn check_postgres(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<(), Error> {
        let latest = check(tx, self.table(), self.key(), self.lease()).await?;
        self.stale(latest)
    }
}
