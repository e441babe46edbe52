//! Named locks for every process sharing one database: PostgreSQL, MySQL/MariaDB, or an
//! embedded SQLite file.
//!
//! Services scale out to several processes and hosts; the database they already share
//! is the one place they can agree on who may do a thing now. dblock gives them named
//! exclusive and shared locks, on PostgreSQL (advisory locks), on MySQL 8 or MariaDB
//! 10.6+ (named locks, `GET_LOCK`; exclusive only), or on an embedded SQLite file
//! (byte-range locks that exclude across the processes of one host).
//!
//! ```no_run
//! # async fn demo() -> Result<(), dblock::Error> {
//! // DBLOCK_DATABASE_URL, else DATABASE_URL, else ~/.local/state/dblock/locks.db
//! let locks = dblock::Locks::from_env().await?;
//!
//! // Wait for the lock; dropping the guard releases it.
//! let guard = locks.lock("autoland:7").await?;
//! // … land proposal 7: no other process does so meanwhile …
//! guard.release().await?;
//!
//! // Or take it only if it is free: "held elsewhere" is an answer, not an error.
//! match locks.try_lock("nightly-report").await? {
//!     Some(_guard) => { /* run the report */ }
//!     None => { /* another process is running it */ }
//! }
//! # Ok(()) }
//! ```
//!
//! # Behaviour
//!
//! - **Keys.** A name maps to a 64-bit key by a fixed function of (namespace, name):
//!   see [`Key`]. The namespace is [`DEFAULT_NAMESPACE`] unless set
//!   ([`Builder::namespace`], or the server setting [`NAMESPACE_SETTING`]), never
//!   guessed from `search_path`, so every process on one database keys a name alike.
//! - **PostgreSQL.** Transaction-scoped advisory locks by default (safe behind
//!   PgBouncer's transaction pooling), session-scoped on request ([`Scope`]). Each
//!   lock pins its own connection for its whole life, so two tasks of one process
//!   exclude each other even though PostgreSQL's locks are re-entrant per session.
//!   Taking a lock is one round trip; releasing it is sent at once without waiting.
//! - **Embedded.** See [`sqlite`](crate::sqlite#the-mechanism) for the mechanism.
//! - **Cancellation.** Every future may be dropped at any await point: no lock stays
//!   held once the future and any guard are gone, and no pooled connection is reused
//!   holding a lock or an open transaction. A wait that gives up also stops waiting on
//!   the server.
//! - **Semaphores.** [`Locks::semaphore`]: at most N holders of a name at once, each
//!   holding one of N slot locks (`docs/semaphores.md`).
//! - **Your own transaction.** [`postgres::xact`] takes a lock inside an sqlx
//!   transaction of yours, released with it.
//! - **Scheduled jobs.** [`Locks::once_per`]: a claim per scheduled slot, decided on the
//!   database's clock, so a job every host's scheduler fires runs once per slot; a record
//!   of every run ([`jobs`], `docs/scheduled-jobs.md`).
//! - **Migrations.** [`migrate`]: start-up scripts and an ordered migration set, applied
//!   under one database-wide lock by every instance starting at once, each migration
//!   exactly once ([`migrations!`] embeds a set at compile time).
//!
//! # Cargo features
//!
//! | feature    | default | what it adds |
//! |------------|---------|--------------|
//! | `postgres` | yes     | PostgreSQL advisory locks; locks inside your sqlx transactions |
//! | `tls`      | yes     | TLS on dblock's own PostgreSQL connections (rustls; libpq's `sslmode`, `sslrootcert`, `sslcert`, `sslkey`) |
//! | `sqlite`   | yes     | the embedded default: an SQLite file and byte-range locks beside it (Linux) |
//! | `mysql`    | yes     | MySQL 8 / MariaDB 10.6+ named locks (`GET_LOCK`): see [`mysql`] |
//! | `macros`   | yes     | [`migrations!`]: a directory of migrations embedded at compile time |
//! | `metrics`  | no      | counters, histograms and a gauge of locks through the `metrics` facade (`docs/observability.md`); `tracing` events are always on |
//! | `serde`    | no      | `serde::Serialize` for [`LockStatus`], [`Party`], [`Key`], [`Mode`], [`Scope`] and [`status::Report`] (`dblock status --json`'s shape, `docs/status.md`) |

#![cfg_attr(docsrs, feature(doc_cfg))]
// Shared helpers (connection strings, migration reverts, pooler settings) serve some backends
// and not others; a build with one backend leaves the rest unused, which is expected.
#![cfg_attr(
    not(all(feature = "postgres", feature = "sqlite", feature = "mysql")),
    allow(dead_code)
)]

/// The `dblock bench` workloads: the command-line program's, not a public API (no
/// stability promised).
#[doc(hidden)]
pub mod bench;
mod conninfo;
pub mod doctor;
mod engine;
mod error;
pub mod fencing;
pub mod fleet;
mod guard;
mod inspect;
pub mod jobs;
mod key;
pub mod leader;
mod lock_set;
mod locks;
pub mod migrate;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
mod observe;
/// The parsers, for the property tests and fuzz targets: not a public API (no stability
/// promised).
#[doc(hidden)]
pub mod parsers;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod raw;
pub mod request;
mod semaphore;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;
pub mod status;
mod sync;
mod sys;
mod target;
mod text;

/// The loom models of the hand-offs that are not a backend's (a guard's loss state);
/// the backends' are in theirs. `RUSTFLAGS="--cfg dblock_loom"`: see docs/testing.md.
#[cfg(all(test, dblock_loom))]
mod loom_models;

pub use error::{Capability, Error, LossReason, ServerCode, WaitingFor};
pub use fencing::Fence;
pub use guard::LockGuard;
pub use key::{DEFAULT_NAMESPACE, Key, MAX_NAME_LEN, MAX_NAMESPACE_LEN, NAMESPACE_SETTING};
pub use lock_set::{LockSet, LockSetRequest};
pub use locks::{Builder, Locks};
pub use raw::{LockStatus, Mode, Party, Scope};
pub use request::Request;
pub use semaphore::{MAX_SEMAPHORE_LIMIT, SemaphoreGuard, SemaphoreRequest};
pub use target::{URL_ENV_VARS, default_sqlite_path, url_from_env};

#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
pub use dblock_macros::migrations;

/// The sqlx that dblock's public API takes and returns (0.9): name its types through this
/// re-export — `dblock::sqlx::PgPool` — so that an application on another sqlx version
/// still compiles (two sqlx versions' `Pool<Postgres>` are different types).
pub use sqlx;

/// The README's examples, compiled as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

/// The examples of the reference pages in `docs/`, compiled as doctests too.
#[cfg(doctest)]
mod docs_doctests {
    #[doc = include_str!("../../docs/locks-and-loss.md")]
    struct LocksAndLoss;
    #[doc = include_str!("../../docs/migrations.md")]
    struct Migrations;
    #[doc = include_str!("../../docs/how-it-works.md")]
    struct HowItWorks;
    #[doc = include_str!("../../docs/choosing.md")]
    struct Choosing;
    #[doc = include_str!("../../docs/errors.md")]
    struct Errors;
    #[doc = include_str!("../../docs/lock-sets.md")]
    struct LockSets;
    #[doc = include_str!("../../docs/semaphores.md")]
    struct Semaphores;
    #[doc = include_str!("../../docs/status.md")]
    struct Status;
    #[doc = include_str!("../../docs/scheduled-jobs.md")]
    struct ScheduledJobs;
    #[cfg(feature = "mysql")]
    #[doc = include_str!("../../docs/mysql.md")]
    struct MySql;
    #[cfg(all(feature = "metrics", feature = "postgres"))]
    #[doc = include_str!("../../docs/observability.md")]
    struct Observability;
}
