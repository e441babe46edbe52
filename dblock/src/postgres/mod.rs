//! The PostgreSQL backend: advisory locks on connections dblock owns.
//!
//! # Multiplexing
//!
//! One connection per lock is the default — it is what makes a lock cost one round trip
//! and a wait cost nothing on the client — but a process that holds thousands of locks
//! at once would need thousands of connections. With
//! [`Builder::multiplex(n)`](crate::Builder::multiplex), session-scoped locks are taken
//! with `pg_try_advisory_lock` on one of at most `n` shared connections, many locks per
//! connection, each released on its own by `pg_advisory_unlock`:
//!
//! - a key is taken on a shared connection only if this process holds it on none of
//!   them (PostgreSQL's locks are re-entrant per session); a second local request for a
//!   held key goes to a connection of its own, where the server arbitrates;
//! - every request and release of one key goes to the same shared connection (key mod
//!   `n`), which the server serves in order, so a release always precedes a later
//!   request for the key;
//! - a lock that is not free at once is waited for on a connection of its own, never on
//!   a shared one;
//! - a shared connection keeps a transaction open only while its requests keep coming
//!   (one transaction per burst, so that PostgreSQL's end-of-transaction walk of the
//!   session's locks is paid once per burst), commits it once nothing has come for a
//!   millisecond — 1 µs for each lock it holds, up to 20 ms, once it holds a thousand —
//!   and at least once a second however busy, and rolls it back the moment a statement
//!   fails, so a failing request
//!   cannot disturb the others; a full server lock table fails the request with
//!   [`Error::LockTableFull`] and every lock already held stays held.
//!
//! Every lock pins one connection for its whole life, so PostgreSQL's re-entrancy
//! (a session may take the lock it already holds) can never make two holders: two
//! tasks of one process asking for one name ask on two sessions, and the server makes
//! one wait. One acquisition is one round trip: the statements it needs go out as one
//! simple-protocol message.
//!
//! # Files
//!
//! - `backend`: the backend as opened (where its connections come from, what it learns
//!   of the server) and its `RawLocks`; `url` (a URL → the backend), `settings` (its
//!   settings, read by name), `sql` (quoting, a key in decimal), `engine` (which
//!   engine the handle talks to, and the self-test of its advisory locks), `doctor`
//!   (`dblock doctor`'s checks of the server).
//! - `lock/`, the lock logic: `acquire` (one round loop for one key, any one of several
//!   and all of a set: take a connection, send the round, read it, then grant, or clean
//!   up and wait on in a new round), `plan` (what one round sends and how its answer is
//!   read), `busy` (which keys were found busy lately: whether a request tries first),
//!   `relay` (the handle's own tasks waiting for a key behind one another, and the
//!   hand-over of the held lock between them without a round trip),
//!   `messages` (the text of every lock message: a round's settings and lock
//!   calls, clean-ups, releases), and the guard's half: `held` (a connection of its own)
//!   or `mux` (shared connections: a lane per connection batching its requests and
//!   releases into one message; its `Claims`, the keys claimed on them and the unlock
//!   each owes).
//! - `loom_models` (tests, under `--cfg dblock_loom`): the outbox's, the claims' and the
//!   relay's hand-offs under every interleaving (docs/testing.md).
//! - `conn/`, the connection layer, which knows nothing of locks — messages, statements
//!   sent or deferred, results, health checks: `mod` (a connection and its operations,
//!   `Armed`), dblock's own connections (`native`, `pool`, `outbox`, `driver`,
//!   `prepared`, the lock statements a session has prepared, and `extended`, a round
//!   and its prepared statement under one `Sync`), one
//!   borrowed from an sqlx pool (`borrowed`), `wire` (what they exchange), `tls`,
//!   `conninfo` (connection strings), `health`, `pooler`.
//! - `store/`, the backend's other SQL: `fence` (the fencing table and check; `token`, a
//!   leaf, the statement that takes a token), `migrate` (the migration runner's store,
//!   with `bookkeeping`, `adopt`), `status`, `setup`, `floor` (the benchmark's floor),
//!   `xact` (locks in the caller's own transaction).

mod backend;
mod conn;
mod doctor;
pub mod engine;
mod lock;
#[cfg(all(test, dblock_loom))]
mod loom_models;
mod settings;
mod sql;
mod store;
mod url;

use crate::error::Error;
use crate::raw::{Options, RawLocks};

pub use conn::health;
pub use conn::pooler::{self, Pooler};
pub use store::xact;
pub(crate) use url::{open, read as read_connection_string};

/// How PostgreSQL shows the advisory lock of `key`: a row of `pg_locks` (the query is for an
/// operator to run, not one dblock sends).
pub(crate) fn shown_as(key: crate::Key) -> crate::status::ShownAs {
    let (classid, objid) = key.pg_locks_ids();
    crate::status::ShownAs {
        listed_in: "pg_locks",
        id: format!("classid={classid} objid={objid} objsubid=1"),
        context: None,
        query: format!(
            "SELECT * FROM pg_locks WHERE locktype = 'advisory' AND classid = {classid} \
             AND objid = {objid} AND objsubid = 1;"
        ),
    }
}

/// Opens the backend on the caller's sqlx pool; the default namespace with it.
pub(crate) async fn from_sqlx(
    pool: sqlx::PgPool,
    opts: &Options,
) -> Result<(Box<dyn RawLocks>, String), Error> {
    let (b, ns) = backend::PgBackend::from_sqlx(pool, opts).await?;
    Ok((Box::new(b), ns))
}
