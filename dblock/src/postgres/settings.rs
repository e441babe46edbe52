//! PostgreSQL's own settings of a handle — the builder's `pooler`, `multiplex`,
//! `hand_over`, `self_test` and `application_name` — read by name from the handle's options, which carry them for this
//! backend without knowing what they mean.

use super::conn::pooler::{Known, Pooler};
use crate::engine::SelfTest;
use crate::error::Error;
use crate::raw::Options;

/// The builder's `multiplex(n)`, as the options carry it.
pub(crate) const MULTIPLEX: &str = "multiplex";
/// The builder's `hand_over(window)`, in microseconds, as the options carry it.
pub(crate) const HAND_OVER: &str = "hand_over";
/// The builder's `pooler(p)` (or the URL's `pooler=`), as the options carry it.
pub(crate) const POOLER: &str = "pooler";
/// Set (to `host`) when [`POOLER`] was implied by a managed service's host rather than
/// declared (see [`implied_by_host`](super::conn::pooler::implied_by_host)).
pub(crate) const POOLER_FROM: &str = "pooler_from";
/// The builder's `self_test(t)` (or the URL's `self_test=`), as the options carry it.
pub(crate) const SELF_TEST: &str = "self_test";
/// The builder's `application_name(name)`, as the options carry it.
pub(crate) const APPLICATION_NAME: &str = "application_name";

/// What this backend reads of a handle's options beyond what every backend does.
#[derive(Debug, Clone)]
pub(crate) struct PgSettings {
    /// What lies between dblock and PostgreSQL, as declared (or to detect).
    pub(crate) pooler: Pooler,
    /// How [`pooler`](Self::pooler) is known when it is not [`Pooler::Detect`].
    pub(crate) pooler_known: Known,
    /// How many shared connections session locks are multiplexed on (0: none).
    pub(crate) multiplex: usize,
    /// When the engine's advisory locks are checked before the handle's first grant.
    pub(crate) self_test: SelfTest,
    /// How long after the server's grant a lock may go to another task of the handle
    /// without a round trip (`lock/relay.rs`).
    pub(crate) hand_over: std::time::Duration,
}

impl PgSettings {
    /// The settings `opts` carries.
    pub(crate) fn of(opts: &Options) -> Result<PgSettings, Error> {
        let invalid = |name: &str, value: &str, why: String| {
            Error::configuration(format!("{name} = {value:?}: {why}"))
        };
        let pooler = match opts.setting(POOLER) {
            Some(v) => Pooler::parse(v).map_err(|why| invalid(POOLER, v, why))?,
            None => Pooler::Detect,
        };
        let multiplex = match opts.setting(MULTIPLEX) {
            Some(v) => v
                .parse()
                .map_err(|e| invalid(MULTIPLEX, v, format!("{e}")))?,
            None => 0,
        };
        let pooler_known = match opts.setting(POOLER_FROM) {
            Some("host") => Known::Host,
            _ => Known::Declared,
        };
        let self_test = match opts.setting(SELF_TEST) {
            Some(v) => SelfTest::parse(v).map_err(|why| invalid(SELF_TEST, v, why))?,
            None => SelfTest::Auto,
        };
        let hand_over = match opts.setting(HAND_OVER) {
            Some(v) => std::time::Duration::from_micros(
                v.parse()
                    .map_err(|e| invalid(HAND_OVER, v, format!("{e}")))?,
            ),
            None => super::lock::relay::WINDOW,
        };
        Ok(PgSettings {
            pooler,
            pooler_known,
            multiplex,
            self_test,
            hand_over,
        })
    }
}
