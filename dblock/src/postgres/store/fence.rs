//! Fencing tokens on PostgreSQL: the table (created on first use, under the migration
//! lock), the latest grant read back, and the check a fenced write makes. The token
//! itself is taken in the acquisition's own message (see `plan`).

use std::sync::Arc;

use tokio::time::Instant;

use sqlx::{PgConnection, Postgres, Transaction};

use super::bookkeeping::own_ddl;
use super::token::{EPOCH_SQL, NO_EPOCH_CODES};
use super::xact::map_sqlx;
use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::postgres::backend::{BACKSTOP, PgBackend};
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::QueryError;
use crate::postgres::sql::{first_value, quote_ident, quote_literal};
use crate::raw::Fence;
use crate::raw::{
    BoxFuture, FENCING_TABLE, FencingStore, LatestGrant, PG_FENCING_SCHEMA as PG_SCHEMA,
};

impl PgBackend {
    /// The qualified name of the fencing table, created on first use. Creating it waits
    /// for the migration lock: never past `deadline` (the request's), plus [`BACKSTOP`]
    /// for a server that stops answering or another task creating it.
    pub(crate) async fn fence_table_until(
        &self,
        deadline: Option<Instant>,
    ) -> Result<&Arc<str>, Error> {
        if let Some(t) = self.fence_ready.get() {
            return Ok(t);
        }
        let Some(d) = deadline else {
            return self.fence_table(None).await;
        };
        match tokio::time::timeout_at(d + BACKSTOP, self.fence_table(deadline)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                waiting_for: WaitingFor::FencingTable,
                after: None,
            }),
        }
    }

    async fn fence_table(&self, deadline: Option<Instant>) -> Result<&Arc<str>, Error> {
        let table = self
            .fence_ready
            .get_or_try_init(|| async {
                // One table per database, like the keys (not the handle's schema).
                let table = format!("{}.{}", quote_ident(PG_SCHEMA), FENCING_TABLE);
                let armed = Armed::new(self.source.get().await?);
                let rows = armed
                    .conn()
                    .query(&format!(
                        "SELECT to_regclass({}) IS NOT NULL",
                        quote_literal(&table)
                    ))
                    .await
                    .map_err(QueryError::into_error)?;
                if first_value(&rows, 0).as_deref() != Some("t") {
                    // Idempotent DDL is not concurrency-safe: under the migration lock,
                    // waited for the runner's way (no snapshot held while waiting, so a
                    // concurrent CREATE INDEX CONCURRENTLY cannot deadlock with it).
                    let ddl = table_ddl(&table);
                    own_ddl(&armed, &ddl, deadline).await?;
                }
                // Whether the server has the live timeline (see EPOCH_SQL): once, here,
                // so that a platform without it keeps plain counters instead of failing
                // every fenced grant.
                match armed.conn().query(&format!("SELECT {EPOCH_SQL}")).await {
                    Err(QueryError::Db { code, .. }) if NO_EPOCH_CODES.contains(&code.as_str()) => {
                        self.fence_epoch
                            .store(false, std::sync::atomic::Ordering::Relaxed);
                    }
                    Ok(_) | Err(QueryError::Db { .. }) => {}
                    Err(e) => return Err(e.into_error()),
                }
                armed.disarm().recycle();
                Ok(Arc::<str>::from(table))
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
        let table = self.fence_table_until(None).await?.clone();
        let armed = Armed::new(self.source.get().await?);
        // One statement, its three values as three rows in order (unnest keeps the
        // array's order); the connection reads the first column of each row.
        let sql = format!(
            "SELECT unnest(ARRAY[holder, token::text, granted_at::text]) FROM {table} \
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
/// other schemas. Run under the migration lock.
pub(crate) fn table_ddl(table: &str) -> String {
    let lit = quote_literal(table);
    let schema = quote_literal(PG_SCHEMA);
    format!(
        "DO $dblock$ DECLARE s text; BEGIN \
         IF to_regclass({lit}) IS NULL THEN \
         CREATE TABLE {table} (\
         key bigint PRIMARY KEY, \
         namespace text NOT NULL, \
         name text NOT NULL, \
         token bigint NOT NULL, \
         holder text NOT NULL, \
         granted_at timestamptz NOT NULL); \
         FOR s IN SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = '{FENCING_TABLE}' AND c.relkind = 'r' AND n.nspname <> {schema} \
         AND has_table_privilege(c.oid, 'SELECT') LOOP \
         EXECUTE format('INSERT INTO {table} AS f SELECT key, namespace, name, token, holder, \
         granted_at FROM %I.{FENCING_TABLE} ON CONFLICT (key) DO UPDATE SET token = \
         greatest(f.token, EXCLUDED.token)', s); \
         END LOOP; END IF; END $dblock$"
    )
}

/// The latest token of `key` in `table`, read inside `tx` and held (`FOR SHARE`) until
/// `tx` ends, so that no newer grant can be made before `tx` commits.
pub(crate) async fn check(
    tx: &mut Transaction<'_, Postgres>,
    table: &str,
    key: Key,
) -> Result<Option<i64>, Error> {
    use sqlx::Row;
    // One simple-protocol statement (the key is an integer): no server-side prepared
    // statement, which a transaction-pooling pooler may not carry.
    let sql = format!(
        "SELECT token FROM {table} WHERE key = {} FOR SHARE",
        key.as_i64()
    );
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
        let latest = check(tx, self.table(), self.key()).await?;
        self.stale(latest)
    }
}
