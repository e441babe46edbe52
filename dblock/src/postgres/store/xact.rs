//! Locks inside your own sqlx transaction, released with it: the hub seed's use.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), dblock::Error> {
//! use dblock::{Key, Mode, postgres::xact};
//! let mut tx = pool.begin().await.map_err(xact::map_sqlx)?;
//! // One landing of proposal 7 at a time, across every process: held until `tx` ends.
//! // The key needs no connection: the namespace and the name are enough.
//! xact::lock(&mut tx, Key::new("public", "autoland:7")?, Mode::Exclusive).await?;
//! // … the checks and the landing, in `tx` …
//! tx.commit().await.map_err(xact::map_sqlx)?;
//! # Ok(()) }
//! ```
//!
//! Both helpers take the lock's [`Mode`]: [`lock`] waits, [`try_lock`] answers at once.
//! Each is one statement, and neither needs a [`Locks`](crate::Locks) handle; the key of
//! a name is [`Key::new`]`(namespace, name)`, with the namespace your handles use (see
//! [`Locks::namespace`](crate::Locks::namespace)).
//!
//! The lock belongs to the transaction: it is released by `COMMIT` or `ROLLBACK`, and
//! cannot be released earlier. Within one transaction a second request for a key it
//! already holds succeeds at once (PostgreSQL's locks are re-entrant per session), so do
//! not share one transaction between tasks that must exclude each other.
//!
//! These helpers send plain simple-protocol queries, so they work through a
//! transaction-pooling pooler that does not support prepared statements.

use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, Transaction};

use crate::error::ServerCode;
use crate::{Error, Key, Mode};

/// Waits for the lock `key` in `mode` inside `tx`; it is held until `tx` commits or
/// rolls back.
///
/// # Errors
///
/// [`Error::Deadlock`] when the server's deadlock detector picks this transaction (it
/// then must be rolled back); connection and server errors.
///
/// # Cancel safety
///
/// If cancelled, the lock may still be granted to `tx` a moment later; it is then
/// released with `tx`, like everything else the transaction did.
pub async fn lock(tx: &mut Transaction<'_, Postgres>, key: Key, mode: Mode) -> Result<(), Error> {
    let sql = match mode {
        Mode::Exclusive => "SELECT pg_advisory_xact_lock",
        Mode::Shared => "SELECT pg_advisory_xact_lock_shared",
    };
    let conn: &mut PgConnection = tx;
    sqlx::raw_sql(simple(sql, key))
        .execute(conn)
        .await
        .map_err(map_sqlx)?;
    Ok(())
}

/// Takes the lock `key` in `mode` inside `tx` if it is free now: `Ok(true)` if taken.
///
/// # Errors
///
/// As [`lock`].
///
/// # Cancel safety
///
/// As [`lock`].
pub async fn try_lock(
    tx: &mut Transaction<'_, Postgres>,
    key: Key,
    mode: Mode,
) -> Result<bool, Error> {
    let sql = match mode {
        Mode::Exclusive => "SELECT pg_catalog.pg_try_advisory_xact_lock",
        Mode::Shared => "SELECT pg_catalog.pg_try_advisory_xact_lock_shared",
    };
    let conn: &mut PgConnection = tx;
    let row = sqlx::raw_sql(simple(sql, key))
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)?;
    row.try_get::<bool, _>(0).map_err(map_sqlx)
}

/// The namespace a [`Locks`](crate::Locks) handle on the same connection settings uses
/// by default: the setting [`NAMESPACE_SETTING`](crate::NAMESPACE_SETTING) if set and
/// not empty, else [`DEFAULT_NAMESPACE`](crate::DEFAULT_NAMESPACE).
///
/// # Errors
///
/// Connection and server errors.
///
/// # Cancel safety
///
/// A read; cancelling it has no effect on the database.
pub async fn current_namespace(conn: &mut PgConnection) -> Result<String, Error> {
    let sql = format!(
        "SELECT pg_catalog.current_setting({}, true)",
        crate::postgres::sql::quote_literal(crate::NAMESPACE_SETTING)
    );
    let row = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_one(conn)
        .await
        .map_err(map_sqlx)?;
    let ns: Option<String> = row.try_get(0).map_err(map_sqlx)?;
    Ok(ns
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| crate::DEFAULT_NAMESPACE.to_string()))
}

/// `f(key)` as one simple-protocol statement: no server-side prepared statement, which
/// a transaction-pooling pooler (PgBouncer before 1.21, or without
/// `max_prepared_statements`) would leave on a server connection for another client,
/// or not find on the next one. The key is an integer, written in decimal.
fn simple(f: &str, key: Key) -> AssertSqlSafe<String> {
    AssertSqlSafe(format!("{f}({})", key.as_i64()))
}

/// Maps an sqlx error to dblock's: SQLSTATEs by kind, broken connections to
/// [`Error::ConnectionLost`].
pub fn map_sqlx(e: sqlx::Error) -> Error {
    match e {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => Error::from_sqlstate(&code, db.message().to_string()),
            None => Error::Database {
                code: ServerCode::default(),
                message: db.message().to_string(),
            },
        },
        sqlx::Error::Io(e) => Error::ConnectionLost {
            message: e.to_string(),
        },
        sqlx::Error::PoolTimedOut => Error::Timeout {
            waiting_for: crate::error::WaitingFor::SqlxPoolConnection,
            after: None,
        },
        other => Error::Database {
            code: ServerCode::default(),
            message: other.to_string(),
        },
    }
}
