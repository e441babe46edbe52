//! Fencing tokens on the embedded backend: the table in the database file, the next
//! token committed while the file lock is held, the latest grant read back, and the
//! check a fenced write makes.
//!
//! # Tokens never go backwards, without a disk write per grant
//!
//! A token is `epoch × 2^40 + n`. The epoch is this boot's (Linux names each boot in
//! `/proc/sys/kernel/random/boot_id`): the first grant of a boot raises it by one in
//! `dblock_fencing_epoch` and commits that to the disk (`synchronous = FULL`, an
//! `fsync`) before any token of the epoch is handed out; the boot is read once per
//! process. Grants within the epoch commit with `synchronous = NORMAL`: their commit is
//! in the operating system's cache, which any crash of a process (dblock's, or kill -9)
//! keeps, but a power loss or a crash of the operating system may lose — the last
//! grants of that boot roll back. Such a loss is always followed by a new boot, whose
//! epoch starts above every token of the last one (`n` stays below 2^40), so a token
//! handed out after it is above every token handed out before it, recorded or lost.
//! A power loss cannot make a token go backwards; it can make the latest grant that
//! `Locks::current_leader` and the fencing table show an older one (of the lost boot)
//! until the next grant. Where the boot cannot be named (not Linux), every grant
//! commits to the disk, as before.

use super::{Shared, SqliteBackend};
use crate::error::Error;
use crate::key::Key;
use crate::raw::Fence;
use crate::raw::{BoxFuture, FencingStore, LatestGrant, Req, holder_id};
use rusqlite::OptionalExtension;

impl FencingStore for SqliteBackend {
    fn latest_grant(&self, key: Key) -> BoxFuture<'_, Result<Option<LatestGrant>, Error>> {
        Box::pin(latest_grant(&self.shared, key))
    }
}

/// The latest token of `key`, read inside `tx` (which holds the database's write lock
/// if it began `IMMEDIATE`).
pub(crate) async fn check(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    key: Key,
) -> Result<Option<i64>, Error> {
    let conn: &mut sqlx::SqliteConnection = tx;
    sqlx::query_scalar("SELECT token FROM dblock_fencing WHERE key = ?1")
        .bind(key.as_i64())
        .fetch_optional(conn)
        .await
        .map_err(|e| Error::Database {
            code: super::bookkeeping::code_of(&e),
            message: format!("fencing check: {e}"),
        })
}

// The check of writes to this backend's database, on the token every backend's grant
// carries: defined here, so that the friendly layer names no backend.
impl Fence {
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
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
    pub async fn check_sqlite(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    ) -> Result<(), Error> {
        let latest = check(tx, self.key()).await?;
        self.stale(latest)
    }
}

/// The next token for `req`'s name in the embedded database, committed before it is
/// returned (see the module docs for what "committed" means within an epoch). Called
/// with the lock held.
pub(crate) async fn next_token(shared: &Shared, req: &Req<'_>) -> Result<i64, Error> {
    let holder = holder_id();
    // The epoch's first read made the table; without an epoch, every grant makes sure.
    let Some(epoch) = epoch(shared).await? else {
        let fail = |e: sqlx::Error| Error::Database {
            code: super::bookkeeping::code_of(&e),
            message: format!("fencing token: {e}"),
        };
        let db = shared.db().await?;
        sqlx::query(TABLE_DDL).execute(db).await.map_err(fail)?;
        return sqlx::query_scalar::<_, i64>(NEXT_TOKEN)
            .bind(req.fence_key().as_i64())
            .bind(req.namespace)
            .bind(req.name)
            .bind(holder)
            .bind(0_i64)
            .fetch_one(db)
            .await
            .map_err(fail);
    };
    let base = epoch << EPOCH_BITS;
    let key = req.fence_key().as_i64();
    shared
        .tokens
        .write("fencing token", |db| {
            let mut next = db.prepare_cached(NEXT_TOKEN)?;
            next.query_row((key, req.namespace, req.name, holder, base), |r| r.get(0))
        })
        .await
}

/// The grant's row written, its token (at least `?5`, the epoch's first, and above the
/// name's last) read back.
const NEXT_TOKEN: &str = "INSERT INTO dblock_fencing (key, namespace, name, token, holder, granted_at) \
     VALUES (?1, ?2, ?3, max(?5, 1), ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
     ON CONFLICT (key) DO UPDATE SET token = max(token + 1, ?5), holder = excluded.holder, \
     granted_at = excluded.granted_at RETURNING token";

/// The bits of a token below its epoch: 2^40 grants of one name per boot.
const EPOCH_BITS: u32 = 40;

/// The DDL of the table of the epoch (one row: the epoch, and the boot it is of).
pub(crate) const EPOCH_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_fencing_epoch (\
     id INTEGER PRIMARY KEY CHECK (id = 1), \
     epoch INTEGER NOT NULL, \
     boot TEXT NOT NULL)";

/// This boot's name, read once per process; `None` where the system has none to read.
fn boot_id() -> Option<&'static str> {
    static BOOT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    BOOT.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
    .as_deref()
}

/// This boot's epoch, once per handle: read, or — the first grant of a boot — raised
/// and committed to the disk. `None` where the boot cannot be named.
async fn epoch(shared: &Shared) -> Result<Option<i64>, Error> {
    let fail = |e: sqlx::Error| Error::Database {
        code: super::bookkeeping::code_of(&e),
        message: format!("fencing epoch: {e}"),
    };
    let epoch = shared.epoch.get_or_try_init(|| async {
        let Some(boot) = boot_id() else {
            return Ok(None);
        };
        // A ready file needs no DDL: the tables are made only when the read finds one
        // missing. The read names both tables, so that it fails while either is: it
        // named only the epoch's, and a process starting beside one that had made the
        // epoch's table but not yet the fencing table skipped the DDL and failed its
        // grant with "no such table: dblock_fencing". (Made fencing table first, too.)
        let row = shared
            .tokens
            .read("fencing epoch", |db| {
                let read = || {
                    db.query_row(
                        "SELECT epoch, boot FROM dblock_fencing_epoch WHERE id = 1 \
                         AND NOT EXISTS (SELECT 1 FROM dblock_fencing WHERE 0)",
                        [],
                        |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)),
                    )
                    .optional()
                };
                match read() {
                    Err(e) if e.sqlite_error_code() != Some(rusqlite::ErrorCode::DatabaseBusy) => {
                        db.execute_batch(&format!("{TABLE_DDL}; {EPOCH_DDL}"))?;
                        read()
                    }
                    r => r,
                }
            })
            .await?;
        if let Some((epoch, of)) = row
            && of == boot
        {
            return Ok(Some(epoch));
        }
        // A new boot: the next epoch, on the disk before any token of it is handed out
        // (another process raising it first for the same boot is kept, not raised again).
        let durable = shared.db().await?;
        let epoch = sqlx::query_scalar::<_, i64>(
            "INSERT INTO dblock_fencing_epoch (id, epoch, boot) VALUES (1, 1, ?1) \
             ON CONFLICT (id) DO UPDATE SET \
             epoch = CASE WHEN boot = excluded.boot THEN epoch ELSE epoch + 1 END, \
             boot = excluded.boot RETURNING epoch",
        )
        .bind(boot)
        .fetch_one(durable)
        .await
        .map_err(fail)?;
        Ok::<_, Error>(Some(epoch))
    });
    epoch.await.copied()
}

/// The DDL of the fencing table.
pub(crate) const TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS dblock_fencing (\
     key INTEGER PRIMARY KEY, \
     namespace TEXT NOT NULL, \
     name TEXT NOT NULL, \
     token INTEGER NOT NULL, \
     holder TEXT NOT NULL, \
     granted_at TEXT NOT NULL)";

/// The latest grant of `key` recorded in the embedded database, if any.
async fn latest_grant(shared: &Shared, key: Key) -> Result<Option<LatestGrant>, Error> {
    let db = shared.db().await?;
    let fail = |e: sqlx::Error| Error::Database {
        code: super::bookkeeping::code_of(&e),
        message: format!("fencing table: {e}"),
    };
    sqlx::query(TABLE_DDL).execute(db).await.map_err(fail)?;
    let row: Option<(String, i64, String)> =
        sqlx::query_as("SELECT holder, token, granted_at FROM dblock_fencing WHERE key = ?1")
            .bind(key.as_i64())
            .fetch_optional(db)
            .await
            .map_err(fail)?;
    Ok(row.map(|(holder, token, granted_at)| LatestGrant {
        holder,
        token,
        granted_at,
    }))
}
