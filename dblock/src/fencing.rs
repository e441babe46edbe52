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
//! the handle's database on MySQL/MariaDB; in the database file on SQLite), incremented
//! *while the lock is held* and committed before the grant is returned: on PostgreSQL in
//! the same round trip as the acquisition, with a session lock bridging the commit so no
//! other holder can come between the increment and the grant; on MySQL/MariaDB in one
//! autocommit statement on the lock's own connection.
//!
//! A token is an `i64` that only rises per name; it is not consecutive, and only its
//! order means anything. On SQLite, MySQL and MariaDB it is a counter (1, 2, 3, …). On
//! PostgreSQL it is `timeline × 2⁴⁰ + n`: the server's live WAL timeline, which every
//! promotion of a replica raises, times 2⁴⁰, plus a count within the timeline — so tokens
//! keep rising across a failover to an asynchronous replica that lacked the last grants,
//! where a counter would go back and hand a number out twice. Tokens of earlier dblock
//! releases (counters) stay below. Where that guarantee ends (platforms that keep the
//! timeline, split brain): `docs/locks-and-loss.md`, "Fencing tokens across a PostgreSQL
//! failover".
//!
//! Only fenced grants raise the token: a holder that takes the same name without asking
//! for a token (a plain `lock`, `dblock run --no-fencing` or `--shared`) does not make
//! earlier tokens stale. Every writer of a fenced resource must take fenced locks.
//!
//! The token's commit is forced durable (`synchronous_commit = on` for that
//! transaction, `synchronous = FULL` on SQLite) whatever the server's settings, so a
//! crash never hands out a token twice. MySQL has no per-transaction override: there a
//! commit is as durable as the server's `innodb_flush_log_at_trx_commit` makes it (1,
//! the default, is durable).
//!
//! # Fenced writes to the same database
//!
//! [`Fence::check_postgres`], [`Fence::check_sqlite`] and [`Fence::check_mysql`] (each
//! defined by its backend), called in the transaction that
//! makes the protected writes, make it commit only while its token is still the latest
//! grant of the name: they read the name's row and hold it against the next grant's
//! increment until the transaction ends (PostgreSQL: `FOR SHARE`; MySQL/MariaDB:
//! `LOCK IN SHARE MODE`; SQLite: the database write lock). A stale holder's transaction fails with [`Error::StaleToken`](crate::Error::StaleToken); a grant
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
//! grant of the name that long. On PostgreSQL a grant with a
//! [lease](crate::Request::lease) bounds that delay: the checked transaction may sit idle
//! at most the lease, after which the server ends its session (its writes are never
//! committed), so a writer paused between check and commit cannot keep the next holder
//! waiting past the lease. MySQL/MariaDB have no idle timeout of one transaction: there a
//! paused writer holds the row until it wakes or its session ends, and the next fenced
//! grant waits up to `innodb_lock_wait_timeout` for it (then fails); SQLite has no leases.
//!
//! Writes to other systems need those systems to check the token (keep the highest
//! token seen per name and refuse lower ones); `dblock run` gives it to its command as
//! `DBLOCK_FENCING_TOKEN`.
//!
//! # What it costs
//!
//! Nothing unless asked for. A fenced grant writes and commits one row (on PostgreSQL
//! in the same round trip as the lock, plus the commit's WAL flush; on MySQL/MariaDB one
//! more round trip after the lock, an InnoDB commit; on SQLite, a `synchronous = FULL`
//! transaction after the file lock), so it costs what one small durable write costs on
//! that database — typically well under a millisecond on PostgreSQL with fast storage,
//! a few milliseconds of fsync on SQLite.

pub use crate::raw::Fence;

/// The table that keeps the latest token of every fenced name: on PostgreSQL in the
/// schema [`PG_SCHEMA`], on MySQL/MariaDB in the handle's database, in the database file
/// on SQLite.
pub const TABLE: &str = crate::raw::FENCING_TABLE;

/// The schema of the PostgreSQL fencing table, whatever the handle's `search_path`:
/// `public`.
///
/// A lock's key is one per (namespace, name) in the whole database, so its token must
/// be too: a table in each handle's schema would keep one counter per schema, and a
/// stale holder's token would pass the check against its own. dblock 0.x before this
/// kept the table in the schema in use; when the table in `public` is created, the
/// latest token of every key in any older `dblock_fencing` table the role can read is
/// carried over, so tokens never go back on upgrade.
pub const PG_SCHEMA: &str = crate::raw::PG_FENCING_SCHEMA;
