//! Fencing tokens: numbers that rise with every grant of a name, so that a holder that
//! lost its lock without noticing cannot overwrite the work of the holder after it.
//!
//! A lock alone cannot stop a holder that paused (a GC pause, a stopped VM, a slow
//! disk) or was cut off, lost its lock meanwhile, and then carries on: by the time it
//! acts, another holder may have the lock and have done its own work (Kleppmann, "How to
//! do distributed locking", 2016). A fencing token makes such a stale holder harmless,
//! provided the resource checks it.
//!
//! # What dblock guarantees
//!
//! Ask for one with [`Request::fenced`](crate::Request::fenced) (exclusive locks only).
//! Every fenced grant of a name then carries a token strictly greater than every earlier
//! fenced grant's token for that name — across processes, clients, and restarts of the server
//! or of every client. The latest token of each name is a row of the table
//! [`TABLE`] (`dblock_fencing`, created on first use in the schema [`PG_SCHEMA`] on
//! PostgreSQL whatever the handle's `search_path`, since a key is one per database; in
//! the database file on SQLite), incremented *while the lock is held* and committed
//! before the grant is returned: on PostgreSQL in the same round trip as the
//! acquisition, with a session lock bridging the commit so no other holder can come
//! between the increment and the grant.
//!
//! Only fenced grants raise the token: a holder that takes the same name without asking
//! for a token (a plain `lock`, `dblock run --no-fencing` or `--shared`) does not make
//! earlier tokens stale. Every writer of a fenced resource must take fenced locks.
//!
//! The token's commit is forced durable (`synchronous_commit = on` for that
//! transaction, `synchronous = FULL` on SQLite) whatever the server's settings, so a
//! crash never hands out a token twice.
//!
//! # Fenced writes to the same database
//!
//! [`Fence::check_postgres`] and [`Fence::check_sqlite`], called in the transaction that
//! makes the protected writes, make it commit only while its token is still the latest
//! grant of the name: they read the name's row and hold it against the next grant's
//! increment until the transaction ends (PostgreSQL: `FOR SHARE`; SQLite: the database
//! write lock). A stale holder's transaction fails with [`Error::StaleToken`]; a grant
//! that comes after a successful check waits for the checked transaction to commit, so
//! the new holder's work is ordered after it.
//!
//! ```no_run
//! # async fn demo(locks: dblock::Locks, pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let guard = locks.request("ledger").fenced().lock().await?;
//! let fence = guard.fence().expect("asked for a token");
//! // … a long computation, during which this process may pause and lose the lock …
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE ledger SET balance = balance + 10 WHERE id = 1").execute(&mut *tx).await?;
//! fence.check_postgres(&mut tx).await?; // Error::StaleToken if the lock was taken meanwhile
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! Check just before committing: the check holds the row until commit, delaying the next
//! grant of the name that long.
//!
//! Writes to other systems need those systems to check the token (keep the highest
//! token seen per name and refuse lower ones); `dblock run` gives it to its command as
//! `DBLOCK_FENCING_TOKEN`.
//!
//! # What it costs
//!
//! Nothing unless asked for. A fenced grant writes and commits one row (on PostgreSQL
//! in the same round trip as the lock, plus the commit's WAL flush; on SQLite, a
//! `synchronous = FULL` transaction after the file lock), so it costs what one small
//! durable write costs on that database — typically well under a millisecond on
//! PostgreSQL with fast storage, a few milliseconds of fsync on SQLite.

use std::sync::{Arc, OnceLock};

use crate::{Error, Key};

/// A grant's fencing token, and what it takes to check it. Cheap to clone; it stays
/// valid (and checkable) after the guard is dropped or the lock is lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    name: Arc<str>,
    key: Key,
    token: i64,
    /// The fencing table as SQL may name it (schema-qualified on PostgreSQL).
    table: Arc<str>,
}

impl Fence {
    pub(crate) fn new(name: &str, key: Key, token: i64, table: Arc<str>) -> Fence {
        Fence {
            name: name.into(),
            key,
            token,
            table,
        }
    }

    /// The token.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// The lock name it was granted for.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lock's key.
    pub fn key(&self) -> Key {
        self.key
    }

    fn stale(&self, latest: Option<i64>) -> Result<(), Error> {
        match latest {
            Some(l) if l == self.token => Ok(()),
            Some(l) => Err(Error::StaleToken {
                name: self.name.to_string(),
                token: self.token,
                latest: l,
            }),
            None => Err(Error::StaleToken {
                name: self.name.to_string(),
                token: self.token,
                latest: 0,
            }),
        }
    }

    /// Checks, inside `tx`, that this is still the latest grant of the name, and holds
    /// the name's fencing row until `tx` ends so that no newer grant can be made before
    /// `tx` commits. Call it just before committing the writes it protects.
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] when a newer grant exists (roll `tx` back); database errors.
    ///
    /// # Cancel safety
    ///
    /// If cancelled, `tx` may hold the row lock until it ends; nothing else changes.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn check_postgres(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<(), Error> {
        use sqlx::Row;
        // One simple-protocol statement (the key is an integer): no server-side prepared
        // statement, which a transaction-pooling pooler may not carry.
        let sql = format!(
            "SELECT token FROM {} WHERE key = {} FOR SHARE",
            self.table,
            self.key.as_i64()
        );
        let conn: &mut sqlx::PgConnection = tx;
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .fetch_optional(conn)
            .await
            .map_err(crate::postgres::xact::map_sqlx)?;
        let latest: Option<i64> = match row {
            Some(r) => Some(r.try_get(0).map_err(crate::postgres::xact::map_sqlx)?),
            None => None,
        };
        self.stale(latest)
    }

    /// Checks, inside `tx` on the embedded database file, that this is still the latest
    /// grant of the name. Begin `tx` with `BEGIN IMMEDIATE` (sqlx:
    /// `conn.begin_with("BEGIN IMMEDIATE")`) so it holds the database's write lock from
    /// the start; in a deferred transaction a grant committed after the check makes the
    /// first write fail with SQLITE_BUSY instead — also safe, less clear.
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] when a newer grant exists (roll `tx` back); database errors.
    ///
    /// # Cancel safety
    ///
    /// A read; cancelling it leaves `tx` as it was.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub async fn check_sqlite(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    ) -> Result<(), Error> {
        let conn: &mut sqlx::SqliteConnection = tx;
        let latest: Option<i64> =
            sqlx::query_scalar("SELECT token FROM dblock_fencing WHERE key = ?1")
                .bind(self.key.as_i64())
                .fetch_optional(conn)
                .await
                .map_err(|e| Error::Database {
                    code: None,
                    message: format!("fencing check: {e}"),
                })?;
        self.stale(latest)
    }
}

/// The table that keeps the latest token of every fenced name: on PostgreSQL in the
/// schema [`PG_SCHEMA`], in the database file on SQLite.
pub const TABLE: &str = "dblock_fencing";

/// The schema of the PostgreSQL fencing table, whatever the handle's `search_path`:
/// `public`.
///
/// A lock's key is one per (namespace, name) in the whole database, so its token must
/// be too: a table in each handle's schema would keep one counter per schema, and a
/// stale holder's token would pass the check against its own. dblock 0.x before this
/// kept the table in the schema in use; when the table in `public` is created, the
/// latest token of every key in any older `dblock_fencing` table the role can read is
/// carried over, so tokens never go back on upgrade.
pub const PG_SCHEMA: &str = "public";

/// The PostgreSQL DDL of the fencing table `table` (`"public".dblock_fencing`): creates
/// it if it is missing, seeded with the latest tokens of older tables of that name in
/// other schemas. Run under the migration lock.
#[cfg(feature = "postgres")]
pub(crate) fn pg_table_ddl(table: &str) -> String {
    let lit = crate::postgres::quote_literal(table);
    let schema = crate::postgres::quote_literal(PG_SCHEMA);
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
         WHERE c.relname = '{TABLE}' AND c.relkind = 'r' AND n.nspname <> {schema} \
         AND has_table_privilege(c.oid, 'SELECT') LOOP \
         EXECUTE format('INSERT INTO {table} AS f SELECT key, namespace, name, token, holder, \
         granted_at FROM %I.{TABLE} ON CONFLICT (key) DO UPDATE SET token = \
         greatest(f.token, EXCLUDED.token)', s); \
         END LOOP; END IF; END $dblock$"
    )
}

/// This process, as recorded beside each grant: `host:pid`.
pub(crate) fn holder_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown-host".into());
        format!("{host}:{}", std::process::id())
    })
}

/// The next token for `req`'s name in the embedded database, committed before it is
/// returned. Called with the lock held.
#[cfg(feature = "sqlite")]
pub(crate) async fn sqlite_next_token(
    shared: &crate::sqlite::Shared,
    req: &crate::locks::Req<'_>,
) -> Result<i64, crate::Error> {
    let db = shared.db().await?;
    let fail = |e: sqlx::Error| crate::Error::Database {
        code: None,
        message: format!("fencing token: {e}"),
    };
    sqlx::query(SQLITE_TABLE_DDL)
        .execute(db)
        .await
        .map_err(fail)?;
    sqlx::query_scalar::<_, i64>(
        "INSERT INTO dblock_fencing (key, namespace, name, token, holder, granted_at) \
         VALUES (?1, ?2, ?3, 1, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
         ON CONFLICT (key) DO UPDATE SET token = token + 1, holder = excluded.holder, \
         granted_at = excluded.granted_at RETURNING token",
    )
    .bind(req.key.as_i64())
    .bind(req.namespace)
    .bind(req.name)
    .bind(holder_id())
    .fetch_one(db)
    .await
    .map_err(fail)
}

/// The SQLite DDL of the fencing table.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_fencing (\
     key INTEGER PRIMARY KEY, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     token INTEGER NOT NULL, \
     holder TEXT NOT NULL, \
     granted_at TEXT NOT NULL)";

/// The latest grant of `key` recorded in the embedded database, if any.
#[cfg(feature = "sqlite")]
pub(crate) async fn sqlite_latest_grant(
    shared: &crate::sqlite::Shared,
    key: Key,
) -> Result<Option<crate::leader::LeaderInfo>, Error> {
    let db = shared.db().await?;
    let fail = |e: sqlx::Error| Error::Database {
        code: None,
        message: format!("fencing table: {e}"),
    };
    sqlx::query(SQLITE_TABLE_DDL)
        .execute(db)
        .await
        .map_err(fail)?;
    let row: Option<(String, i64, String)> =
        sqlx::query_as("SELECT holder, token, granted_at FROM dblock_fencing WHERE key = ?1")
            .bind(key.as_i64())
            .fetch_optional(db)
            .await
            .map_err(fail)?;
    Ok(
        row.map(|(holder, token, elected_at)| crate::leader::LeaderInfo {
            holder,
            token,
            elected_at,
        }),
    )
}
