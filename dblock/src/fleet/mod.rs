//! The fleet's view: what the server shows of every process at once — locks held and
//! awaited, the longest hold and the oldest wait, whether each election has a leader and
//! since when — as Prometheus metrics and as a page of who holds what. `dblock exporter`
//! serves both over HTTP; this module is what it is made of, for an application that
//! would rather serve them itself.
//!
//! ```no_run
//! # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
//! use dblock::fleet::{Exporter, Labels, NamePattern};
//!
//! let exporter = Exporter::new(&locks)
//!     // `scheduler` a label of its own, every `autoland:` lock counted together.
//!     .labels(
//!         Labels::new()
//!             .name(NamePattern::parse("scheduler")?)
//!             .group(NamePattern::parse("autoland:*")?),
//!     )
//!     .elections(vec![NamePattern::parse("scheduler")?]);
//! let scraped = exporter.scrape().await; // one read of the server, within 5 s
//! println!("{}", scraped.text()); // what GET /metrics returns
//! let page = dblock::fleet::page::render(&scraped, std::time::Duration::from_secs(5));
//! # drop(page);
//! # Ok(()) }
//! ```
//!
//! # Bounded cardinality
//!
//! Lock names are chosen by every client of the database and may be unbounded
//! (`tenant:81723`). A name becomes a label value only when the operator says so
//! ([`Labels::name`], at most [`Labels::max_names`] of them a scrape); a
//! [group](Labels::group) counts every name with a prefix under one value
//! (`name="autoland:*"`); everything else counts under `name="(other)"`. Elections are
//! reported only for the patterns given ([`Exporter::elections`]).
//!
//! # Metrics
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `dblock_server_locks_held` | gauge | `name` | locks held now (a semaphore's slots one each) |
//! | `dblock_server_lock_waiters` | gauge | `name` | requests waiting now |
//! | `dblock_server_lock_longest_hold_seconds` | gauge | `name` | age of the longest current hold (0: none) |
//! | `dblock_server_lock_oldest_wait_seconds` | gauge | `name` | age of the oldest current wait (0: none) |
//! | `dblock_server_election_leader_present` | gauge | `election` | 1 while someone leads, else 0 |
//! | `dblock_server_election_leader_since_timestamp_seconds` | gauge | `election` | when the current term began (only while one leads) |
//! | `dblock_server_job_last_success_timestamp_seconds` | gauge | `name` | when the job run once per slot last succeeded, from the record of runs; 0 when it holds no success ([`RunsCollector`], `--job NAME`) |
//! | `dblock_exporter_scrape_success` | gauge | | 1 if the last scrape read the server within its deadline and every collector succeeded |
//! | `dblock_exporter_scrape_duration_seconds` | gauge | | how long it took |
//! | `dblock_exporter_scrape_failures_total` | counter | | failed scrapes since start |
//! | `dblock_exporter_collector_success` | gauge | `collector` | 1 if that collector succeeded |
//!
//! Where a backend does not record when a lock was taken (the embedded backend, MySQL),
//! a hold's age counts from when the exporter first saw it: a lower bound. A failed
//! scrape reports only the exporter's own families, never stale values.
//!
//! # Adding a collector
//!
//! Each scrape runs every [`Collector`] in turn on one [`Scrape`] (what was read, and
//! the handle to read more with); [`Exporter::collector`] adds one.

pub mod collect;
mod names;
pub mod page;
pub mod text;

pub use collect::{
    COLLECTOR_SUCCESS, CollectFuture, Collector, ElectionCollector, Exporter, JOB_LAST_SUCCESS,
    LEADER_PRESENT, LEADER_SINCE, LOCK_WAITERS, LOCKS_HELD, LONGEST_HOLD, LockCollector,
    OLDEST_WAIT, RunsCollector, SCRAPE_DURATION, SCRAPE_FAILURES, SCRAPE_SUCCESS, Scrape, Scraped,
    Since,
};
pub use names::{Labels, NamePattern};
pub use text::{Family, Kind};
