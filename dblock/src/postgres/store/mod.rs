//! The backend's other SQL, beside the lock logic: fencing tokens (`fence`, and `token`,
//! the statement that takes one), leaders' values (`leader`), the migration runner's store
//! (`migrate`, `bookkeeping`, `adopt`; `sqlx_side` beside sqlx's migrator), `status`,
//! `setup`, the record of scheduled runs (`runs`), the benchmark's floor (`floor`) and locks
//! in the caller's own transaction (`xact`).

pub(crate) mod adopt;
pub(crate) mod bookkeeping;
pub(crate) mod fence;
pub(crate) mod floor;
pub(crate) mod leader;
pub(crate) mod migrate;
pub(crate) mod runs;
pub(crate) mod setup;
pub(crate) mod sqlx_side;
pub(crate) mod status;
pub(crate) mod token;
pub mod xact;
