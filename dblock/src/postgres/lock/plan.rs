//! One round of an acquisition on PostgreSQL: what it sends (decided here, spelt in
//! `messages`) and how its answer is read. A request is one round when what it asks
//! for is free, and a round per slice of waiting otherwise (see `acquire`).
//!
//! - **One key**: `BEGIN …; SET LOCAL lock_timeout …; SELECT pg_advisory_xact_lock(k)`,
//!   or a try; fenced, its token committed under a bridging session lock (see
//!   [`messages::lock_fenced`]).
//! - **Any one of several keys** (a semaphore's slots): one `CASE` statement trying each
//!   key in turn from a rotating start, then waiting on one of them for a shorter slice
//!   ([`ANY_SLICE`]), so that the others are tried again soon.
//! - **All of a set**: one statement tries every key in their order (ascending: the
//!   caller sorts them) and stops at the first that is busy, answering its index; `-1`
//!   means every key is held, in that round's transaction. When the names are free that
//!   is the whole acquisition: one round trip, whatever their number. Otherwise the
//!   round's transaction is rolled back (nothing stays held) and, if the request may
//!   wait, the next round first *waits* for the busy key — holding nothing else, for at
//!   most one slice — and then tries them all again in the same message. So a request
//!   never waits while it holds a key: two requests for overlapping sets, or a request
//!   and a holder of single locks taken in any order, cannot deadlock; and each message
//!   waits for one key at most, so a deadline is kept to within a round trip. The price:
//!   a request whose names keep being taken by others between its rounds goes round
//!   again.
//!
//! An answer the plan cannot read (a slot out of range, a token that is not a number)
//! is an [`Error::Unexpected`], never "not obtained": the round is cleaned up like
//! a failed one, so nothing stays held.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::messages::{self, Release, Settings};
use crate::error::Error;
use crate::key::Key;
use crate::postgres::conn::Conn;
use crate::postgres::conn::wire::{CheckSql, Deferred, Message, Value};
use crate::raw::{ANY_SLICE, Mode, Req, Scope, Wait, any_start};
use crate::status::write_comment;

/// The longest `lock_timeout`, `idle_in_transaction_session_timeout` or
/// `idle_session_timeout` the server accepts, in milliseconds (2³¹ − 1: about 24.8 days).
pub(crate) const MAX_SERVER_MS: u128 = i32::MAX as u128;

/// The longest one lock-waiting statement runs, in milliseconds; a longer wait is
/// several statements (each in a transaction of its own), one after the other.
///
/// A backend blocked in `pg_advisory_lock` holds a snapshot, and `CREATE INDEX
/// CONCURRENTLY` waits for every transaction holding a snapshot older than its own. So a
/// process that holds a lock others wait for and then runs a CIC migration would wait for
/// those waiters while they wait for it: a deadlock PostgreSQL cannot see, since the
/// edge from the lock to the migration runs through the client. Ending every wait after
/// a slice ends the waiter's transaction, and its next statement's snapshot is newer
/// than the index build's: CIC waits at most about one slice for dblock's waiters. It
/// also keeps every wait within the server's limit on `lock_timeout` (2³¹ − 1 ms).
/// The cost: one round trip per slice of waiting, and a waiter whose slice ends rejoins
/// the server's queue at its end.
pub(crate) const WAIT_SLICE_MS: u128 = 2_000;

/// About the most a one-key or any-of round's statements take before its comment
/// (`BEGIN …; SET LOCAL …` three times, the lock call with a 20-digit key).
const ROUND_BYTES: usize = 256;

/// About the most the comment naming the lock takes besides its namespace and name
/// (the holder, `program[pid]@host`, and the field names).
const COMMENT_BYTES: usize = 128;

/// What a request takes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum What<'k> {
    /// `req.key`.
    One,
    /// Any one of these keys (a semaphore's slots; `req.key` is the name's).
    AnyOf(&'k [Key]),
    /// Every one of these keys, sorted ascending and distinct (a lock set).
    AllOf(&'k [Key]),
}

/// Where a request's rounds stand.
pub(crate) struct Round {
    /// 1 for the first round.
    number: u32,
    /// [`What::AnyOf`]: the key tried first and waited on.
    start: usize,
    /// [`What::AllOf`]: the key the last round found busy, waited for first.
    wait_on: Option<usize>,
    /// When the first round began.
    began: SystemTime,
    /// Whether this round only tries, though the request may wait: a request's first
    /// round, unless its key was found busy lately (see [`busy`](super::busy)). Its
    /// wait, if the try finds the key busy, is set up in the next round.
    pub(crate) try_first: bool,
}

impl Round {
    pub(crate) fn first(what: What<'_>) -> Round {
        Round {
            number: 1,
            start: match what {
                What::AnyOf(keys) => any_start(keys.len()),
                _ => 0,
            },
            wait_on: None,
            began: SystemTime::now(),
            try_first: false,
        }
    }

    /// Whether `req`'s first round for `what` should only try (see [`Round::try_first`]):
    /// it may wait, its wait is not yet set up, and `busy_lately` does not say the key
    /// was just found busy. A fenced request, and a lock set (whose first round already
    /// only tries), never do.
    pub(crate) fn should_try_first(req: &Req<'_>, what: What<'_>, busy_lately: bool) -> bool {
        let may_wait = req.wait != Wait::Try;
        let kind = matches!(what, What::One | What::AnyOf(_));
        may_wait && kind && !req.fenced && !busy_lately
    }

    /// The next round (one slice of the wait ended, or a lock set's `busy` key stopped
    /// the last one): an any-of request starts (and waits) on the next key.
    pub(crate) fn next(&mut self, what: What<'_>, busy: Option<usize>) {
        self.number += 1;
        self.try_first = false;
        if let What::AnyOf(keys) = what {
            self.start = (self.start + 1) % keys.len().max(1);
        }
        if busy.is_some() {
            self.wait_on = busy;
        }
    }

    /// Whether a lock set's request, about to wait for its busy key, has no time left to
    /// wait (under a millisecond, which `lock_timeout` cannot express).
    pub(crate) fn out_of_time(&self, wait: Wait) -> bool {
        match (self.wait_on, wait) {
            (Some(_), Wait::Until(d)) => {
                d.saturating_duration_since(Instant::now()) < Duration::from_millis(1)
            }
            _ => false,
        }
    }

    /// When the wait began, on its second and later rounds (the first one's start is
    /// the statement's own, which the server shows).
    fn waiting_since(&self) -> Option<SystemTime> {
        (self.number > 1).then_some(self.began)
    }
}

/// What a plan depends on besides the request: the handle and its server.
pub(crate) struct Server<'a> {
    /// The fencing table, and whether tokens carry the timeline (see
    /// [`next_token_sql`](crate::postgres::store::token::next_token_sql)); `None` unless
    /// the request is fenced.
    pub(crate) fence: Option<(&'a str, bool)>,
    /// Whether the round sets `client_connection_check_interval` itself.
    pub(crate) check_disconnect: bool,
    /// Whether the server has `ROLLBACK AND CHAIN` (PostgreSQL 12).
    pub(crate) chain: bool,
    /// Whether the session is dblock's own, straight to the server: a whole wait slice
    /// may then be set as its own `lock_timeout`, and one key's statement may run
    /// prepared on it (`conn/prepared.rs`). A session setting or a prepared statement
    /// must not reach a pooler's next client, nor a caller's sqlx connection.
    pub(crate) own_session: bool,
}

/// How long one round may wait: `lock_timeout` in whole milliseconds, rounded up (the
/// server must not give up before the deadline), at least 1 (0 would mean "forever"),
/// at most a slice; `None` to try without waiting. `sliced`: the request's wait is longer
/// than this round's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Slice {
    timeout_ms: Option<u128>,
    sliced: bool,
}

impl Slice {
    /// The slice of `req`'s round `round` for `what`.
    pub(crate) fn of_round(req: &Req<'_>, what: What<'_>, round: &Round) -> Slice {
        match what {
            _ if round.try_first => Slice::of(Wait::Try, WAIT_SLICE_MS),
            What::One => Slice::of(req.wait, WAIT_SLICE_MS),
            // A wait for any of several keys waits on one of them: a shorter slice, so
            // that the others are tried again soon (see ANY_SLICE).
            What::AnyOf(_) => Slice::of(req.wait, ANY_SLICE.as_millis()),
            What::AllOf(_) => Slice::of_set(req.wait, round.wait_on),
        }
    }

    /// Whether the round waits a whole [`WAIT_SLICE_MS`]: what a session's own
    /// `lock_timeout` may be set to once (see `NativeConn::set_session_slice`), so that
    /// such rounds — every round of a wait without a deadline, the hot path of a name
    /// taken in turn — send no `lock_timeout` of their own.
    pub(crate) fn is_whole(&self) -> bool {
        self.timeout_ms == Some(WAIT_SLICE_MS)
    }

    fn of(wait: Wait, slice_ms: u128) -> Slice {
        match wait {
            Wait::Until(t) => {
                let left = t.saturating_duration_since(Instant::now());
                let ms = left.as_micros().div_ceil(1000);
                Slice {
                    // A deadline less than a millisecond away is a try.
                    timeout_ms: (left >= Duration::from_millis(1)).then(|| ms.min(slice_ms)),
                    sliced: ms > slice_ms,
                }
            }
            Wait::Forever => Slice {
                timeout_ms: Some(slice_ms),
                sliced: true,
            },
            Wait::Try => Slice {
                timeout_ms: None,
                sliced: false,
            },
        }
    }

    /// A lock set's round: it waits only for the key the last round found busy (at
    /// least a millisecond: the round was sent because time was left), and otherwise
    /// only tries.
    fn of_set(wait: Wait, wait_on: Option<usize>) -> Slice {
        match wait_on {
            None => Slice::of(Wait::Try, WAIT_SLICE_MS),
            Some(_) => {
                let s = Slice::of(wait, WAIT_SLICE_MS);
                Slice {
                    timeout_ms: Some(s.timeout_ms.unwrap_or(1)),
                    ..s
                }
            }
        }
    }
}

/// A round's answer, as the plan reads it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Held: `slot`, the index of the key granted among an any-of request's (else 0),
    /// and a fenced request's token.
    Granted { slot: usize, token: Option<i64> },
    /// Not granted, and the round's wait is over.
    NotGranted,
    /// A lock set's key `.0` was busy: nothing is held.
    Busy(usize),
}

/// One round: its message, and how its answer is read and its connection left.
pub(crate) struct Plan<'k> {
    pub(crate) sql: Message,
    what: What<'k>,
    /// The statements whose first values [`Plan::read`] reads (see [`Plan::wanted`]): a
    /// single key's `must_be_true` and `token_at`, or the any-of or all-of statement.
    at: [Option<u32>; 2],
    scope: Scope,
    mode: Mode,
    key: Key,
    lease: bool,
    fenced: bool,
    /// Whether the request's wait is longer than this round's.
    pub(crate) sliced: bool,
    /// Whether the round only tried, though the request may wait (see
    /// [`Round::try_first`]): not granted, it waits in the next round.
    pub(crate) tried_first: bool,
}

impl<'k> Plan<'k> {
    /// The plan of `req`'s round `round` for `what`, on a session whose `lock_timeout`
    /// is its own.
    #[cfg(test)]
    pub(crate) fn build(req: &Req<'_>, what: What<'k>, round: &Round, on: &Server<'_>) -> Plan<'k> {
        Plan::build_in(
            req,
            what,
            round,
            on,
            Slice::of_round(req, what, round),
            false,
        )
    }

    /// [`Plan::build`] of a round whose slice is `slice` ([`Slice::of_round`]), on a
    /// session whose own `lock_timeout` is a whole slice if `session_slice` (see
    /// [`Slice::is_whole`]): then a round that waits a whole slice sets none.
    pub(crate) fn build_in(
        req: &Req<'_>,
        what: What<'k>,
        round: &Round,
        on: &Server<'_>,
        slice: Slice,
        session_slice: bool,
    ) -> Plan<'k> {
        debug_assert!(!req.fenced || (on.fence.is_some() && matches!(what, What::One)));
        let settings = Settings {
            chain: on.chain,
            timeout_set: session_slice && slice.is_whole(),
            check_disconnect: on.check_disconnect,
            // A lease beyond the server's limit is capped: it only bounds how long the
            // lock outlives a silent holder, and a live holder's session is never idle
            // that long.
            lease_ms: req.lease.map(|l| l.as_millis().clamp(1, MAX_SERVER_MS)),
            timeout_ms: slice.timeout_ms,
        };
        // Sized for the statements and the comment naming the lock, so that the text is
        // written into one allocation (a set's keys take their own room, see lock_all).
        let mut sql = Message::with_capacity(
            ROUND_BYTES + COMMENT_BYTES + req.namespace.len() + req.name.len(),
        );
        let at = write_round(&mut sql, req, what, round, on.fence, &settings);
        if !matches!(what, What::AllOf(_)) {
            // Names the lock in pg_stat_activity for `dblock status`: no extra round
            // trip.
            let since = round.waiting_since();
            sql.annotate(|text| {
                write_comment(text, req.namespace, req.name, Some(req.scope), since)
            });
            // One key's try or wait, the same text each time the name is asked for, on
            // dblock's own session: it may run prepared (see `conn/prepared.rs`).
            if on.own_session && matches!(what, What::One) && !req.fenced && since.is_none() {
                // A try's statement serves every key (its comment left to the held lock's
                // health checks, shown from the first); a wait's must show while it waits.
                sql.mark_preparable(settings.tries());
            }
        }
        Plan {
            sql,
            what,
            // (`u32`s: a statement's index in a message; every lock request's future
            // holds the plan.)
            at: at.map(|a| a.and_then(|a| u32::try_from(a).ok())),
            scope: req.scope,
            mode: req.mode,
            key: req.key,
            lease: req.lease.is_some(),
            fenced: req.fenced,
            sliced: slice.sliced,
            tried_first: round.try_first,
        }
    }

    /// The statements whose first values [`Plan::read`] reads.
    pub(crate) fn wanted(&self) -> &[Option<u32>; 2] {
        &self.at
    }

    /// The round's answer, from the first values of [`Plan::wanted`]; an error for an
    /// answer that means nothing dblock asked.
    pub(crate) fn read(&self, firsts: &[Option<Value>; 2]) -> Result<Answer, Error> {
        let [first, second] = [
            firsts[0].as_ref().map(Value::as_str),
            firsts[1].as_ref().map(Value::as_str),
        ];
        match self.what {
            What::One => read_one(self.at.map(|a| a.map(|a| a as usize)), first, second),
            What::AnyOf(keys) => read_slot(first, keys.len()),
            What::AllOf(keys) => read_busy(first, keys.len()),
        }
    }

    /// What releases the grant of `slot` (see [`Answer::Granted`]).
    pub(crate) fn release(&self, slot: usize) -> Release {
        let key = match self.what {
            What::AllOf(_) => return Release::of_all(self.scope, self.lease),
            What::AnyOf(keys) => keys.get(slot).copied().unwrap_or(self.key),
            What::One => self.key,
        };
        Release::of_one(self.scope, self.mode, key, self.lease)
    }

    /// What health checks of the held lock's connection send: the round's comment,
    /// with when the lock was granted (now), so that `pg_stat_activity.query` keeps
    /// naming it. Takes the message's text, sent already: the label is written only if
    /// a check is ever sent.
    pub(crate) fn check_sql(&mut self) -> Option<CheckSql> {
        self.sql.take_check(SystemTime::now())
    }

    /// After a round that did not end held: leaves the connection clean and returns it
    /// to its pool (or gives it up if that cannot be sent). `failed`: the round ended in
    /// an error, so the state it left is unknown (no transaction may be open); otherwise
    /// it ran to its end, with a transaction-scoped round's transaction open.
    pub(crate) fn clean_up(&self, conn: Conn, failed: bool) {
        let sent = match (self.scope, self.fenced) {
            // Ends the transaction, failed or not (a warning if there is none).
            (Scope::Transaction, false) => conn.defer(Deferred::Rollback { chain: !failed }),
            // A fenced request takes a session lock first (to bridge its token's commit):
            // it survives the ROLLBACK, so unlock it too (a no-op with a warning if the
            // round failed before taking it).
            (Scope::Transaction, true) => conn.send(
                &Release::of_one(Scope::Session, self.mode, self.key, false).after_rollback(),
            ),
            // A session lock may have been granted before a later statement failed (or
            // an answer was unreadable): unlock what the round may have taken, and end
            // the implicit transaction if one is open.
            (Scope::Session, _) => conn.send(&self.session_release().after_rollback()),
        };
        match sent {
            true => conn.recycle(),
            false => conn.abandon(),
        }
    }

    /// The unlock of every key a session-scoped round may have taken.
    fn session_release(&self) -> Release {
        match self.what {
            What::One => Release::of_one(Scope::Session, self.mode, self.key, self.lease),
            What::AnyOf(_) | What::AllOf(_) => Release::of_all(Scope::Session, self.lease),
        }
    }
}

/// Writes round `round` of `req` for `what` into `sql`; where its answer is read (see
/// [`Plan::wanted`]).
fn write_round(
    sql: &mut Message,
    req: &Req<'_>,
    what: What<'_>,
    round: &Round,
    fence: Option<(&str, bool)>,
    s: &Settings,
) -> [Option<usize>; 2] {
    match (what, fence) {
        (What::One, Some(fence)) if req.fenced => {
            let f = messages::lock_fenced(sql, req, s, fence);
            [f.must_be_true, Some(f.token_at)]
        }
        (What::One, _) => {
            messages::open(sql, req.scope, s);
            let i = messages::lock_one(sql, req.scope, req.mode, req.key, s.tries());
            [s.tries().then_some(i), None]
        }
        (What::AnyOf(keys), _) => {
            messages::open(sql, req.scope, s);
            let i = messages::lock_any(sql, req.scope, keys, round.start, s.tries());
            [Some(i), None]
        }
        (What::AllOf(keys), _) => {
            messages::open(sql, req.scope, s);
            let i = messages::lock_all(sql, req.scope, req.mode, keys, round.wait_on);
            [Some(i), None]
        }
    }
}

/// An answer dblock cannot map to what it asked.
fn unexpected(asked: &str, answer: Option<&str>) -> Error {
    Error::Unexpected {
        message: format!("{asked}: the server answered {answer:?}"),
    }
}

/// One key's answer: `must_be_true`'s value (`t` or `f`) where the round tries, and a
/// fenced round's token (no row when the key was not free).
pub(crate) fn read_one(
    at: [Option<usize>; 2],
    must_be_true: Option<&str>,
    token: Option<&str>,
) -> Result<Answer, Error> {
    let token = match (at[1], token) {
        (None, _) => None,
        // A fenced try returns no token row when the lock was not free.
        (Some(_), None) => return Ok(Answer::NotGranted),
        (Some(_), Some(t)) => match t.parse::<i64>() {
            Ok(t) => Some(t),
            Err(_) => return Err(unexpected("a fencing token", Some(t))),
        },
    };
    match (at[0], must_be_true) {
        (None, _) | (Some(_), Some("t")) => Ok(Answer::Granted { slot: 0, token }),
        (Some(_), Some("f")) => Ok(Answer::NotGranted),
        (Some(_), other) => Err(unexpected("a lock request (t or f)", other)),
    }
}

/// An any-of answer: the index of the key granted, below `n`, or NULL for none.
fn read_slot(first: Option<&str>, n: usize) -> Result<Answer, Error> {
    let Some(v) = first else {
        return Ok(Answer::NotGranted);
    };
    match v.parse::<usize>() {
        Ok(slot) if slot < n => Ok(Answer::Granted { slot, token: None }),
        _ => Err(unexpected(
            &format!("a request for any of {n} keys (the index of one)"),
            first,
        )),
    }
}

/// An all-of answer: -1 when every key is held, else the index of the busy key.
fn read_busy(first: Option<&str>, n: usize) -> Result<Answer, Error> {
    let answer = first.and_then(|v| v.parse::<i64>().ok());
    if answer == Some(-1) {
        return Ok(Answer::Granted {
            slot: 0,
            token: None,
        });
    }
    match answer
        .and_then(|i| usize::try_from(i).ok())
        .filter(|&i| i < n)
    {
        Some(i) => Ok(Answer::Busy(i)),
        None => Err(unexpected(
            &format!("a request for all of {n} keys (-1 or a busy key's index)"),
            first,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\"public\".dblock_fencing";

    /// The plan of `req`'s first round, fenced in [`TABLE`] if `fenced`, with its comment
    /// (unless `comment`) and on a server with `ROLLBACK AND CHAIN` (if `chain`).
    fn plan_of<'k>(
        req: &Req<'_>,
        what: What<'k>,
        round: &Round,
        comment: bool,
        chain: bool,
    ) -> Plan<'k> {
        let on = Server {
            fence: req.fenced.then_some((TABLE, true)),
            check_disconnect: false,
            chain,
            own_session: false,
        };
        let mut p = Plan::build(req, what, round, &on);
        if !comment {
            p.sql.strip_annotation();
        }
        p
    }

    /// The plan of one key's first round, without its comment.
    fn plan(req: &Req<'_>) -> Plan<'static> {
        plan_of(req, What::One, &Round::first(What::One), false, true)
    }

    fn req(scope: Scope, mode: Mode, wait: Wait, fenced: bool) -> Req<'static> {
        Req {
            namespace: "public",
            name: "it's",
            key: Key::from_i64(42),
            mode,
            scope,
            wait,
            fenced,
            lease: None,
            fence_key: None,
        }
    }

    fn round(what: What<'_>, start: usize, wait_on: Option<usize>) -> Round {
        Round {
            start,
            wait_on,
            ..Round::first(what)
        }
    }

    #[test]
    fn a_plain_transaction_lock_is_one_message() {
        // A wait is one slice at most (see WAIT_SLICE_MS).
        let p = plan(&req(
            Scope::Transaction,
            Mode::Exclusive,
            Wait::Forever,
            false,
        ));
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = 2000; \
             SELECT pg_catalog.pg_advisory_xact_lock(42)"
        );
        assert!(p.sliced);
        let p = plan(&req(Scope::Session, Mode::Exclusive, Wait::Forever, false));
        assert_eq!(
            p.sql.alone(),
            "SELECT pg_catalog.set_config('lock_timeout', '2000', true); SELECT pg_catalog.pg_advisory_lock(42)"
        );
        let p = plan(&req(Scope::Session, Mode::Shared, Wait::Try, false));
        assert_eq!(
            p.sql.alone(),
            "SELECT pg_catalog.pg_try_advisory_lock_shared(42)"
        );
        assert_eq!(*p.wanted(), [Some(0), None]);
    }

    /// Which rounds may run prepared (`conn/prepared.rs`), and what goes ahead of the
    /// prepared statement as a simple query: one key's transaction-scoped wait on
    /// dblock's own session, its text the same each time; never a try, a later round of
    /// a wait (its comment has the time), a fenced round, a session-scoped one, another
    /// kind of request, or a session that is not dblock's own.
    #[test]
    fn one_keys_rounds_on_an_own_session_may_run_prepared_and_nothing_else() {
        let on = |own: bool| Server {
            fence: None,
            check_disconnect: true,
            chain: true,
            own_session: own,
        };
        let first = Round::first(What::One);
        // A wait at once (a hot name's): its BEGIN and settings ahead, the wait prepared.
        let w = req(Scope::Transaction, Mode::Exclusive, Wait::Forever, false);
        let p = Plan::build(&w, What::One, &first, &on(true));
        assert!(p.sql.preparable());
        assert!(
            p.sql
                .last_statement()
                .starts_with("SELECT pg_catalog.pg_advisory_xact_lock(42) /* dblock "),
            "{}",
            p.sql.last_statement()
        );
        assert!(p.sql.last_statement().ends_with(" */"));
        let head = p.sql.without_last();
        assert!(
            head.alone()
                .starts_with("BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL "),
            "{}",
            head.alone()
        );
        assert!(!head.alone().ends_with("; "), "{}", head.alone());
        assert_eq!(head.statements(), p.sql.statements() - 1);
        let (chained, _) = Deferred::Rollback { chain: true }.carried_by(&head);
        assert!(
            chained.starts_with("ROLLBACK AND CHAIN; SET LOCAL "),
            "{chained}"
        );
        let (rolled, _) = Deferred::Rollback { chain: false }.carried_by(&head);
        assert!(rolled.starts_with("ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED; "));
        // A wait with nothing to set (its slice and the connection check the session's
        // own, as on dblock's own sessions): the BEGIN alone ahead.
        let own = Server {
            check_disconnect: false,
            ..on(true)
        };
        let mut quiet = Plan::build_in(
            &w,
            What::One,
            &first,
            &own,
            Slice::of_round(&w, What::One, &first),
            true,
        );
        let head = quiet.sql.without_last();
        assert_eq!(head.alone(), "BEGIN ISOLATION LEVEL READ COMMITTED");
        assert_eq!(
            Deferred::Rollback { chain: true }.carried_by(&head).0,
            "ROLLBACK AND CHAIN"
        );
        quiet.sql.strip_annotation();
        assert_eq!(
            quiet.sql.last_statement(),
            "SELECT pg_catalog.pg_advisory_xact_lock(42)"
        );
        // A try too (the uncontended path: its head and statement under one `Sync`).
        let t = req(Scope::Transaction, Mode::Exclusive, Wait::Try, false);
        let tried = Plan::build(&t, What::One, &first, &on(true));
        assert!(tried.sql.preparable());
        assert!(
            tried
                .sql
                .last_statement()
                .starts_with("SELECT pg_catalog.pg_try_advisory_xact_lock(42) /* dblock "),
            "{}",
            tried.sql.last_statement()
        );
        // Never: a later round of a wait (the time in its comment), …
        let mut later = Round::first(What::One);
        later.next(What::One, None);
        assert!(
            !Plan::build(&w, What::One, &later, &on(true))
                .sql
                .preparable()
        );
        // … a fenced round, …
        let f = req(Scope::Transaction, Mode::Exclusive, Wait::Forever, true);
        let fenced = Server {
            fence: Some((TABLE, true)),
            ..on(true)
        };
        assert!(!Plan::build(&f, What::One, &first, &fenced).sql.preparable());
        // (A session-scoped wait too: the lock statement alone, or after its settings.)
        let sw = req(Scope::Session, Mode::Exclusive, Wait::Forever, false);
        let session = Plan::build(&sw, What::One, &first, &on(true));
        assert!(session.sql.preparable());
        assert!(
            session
                .sql
                .last_statement()
                .starts_with("SELECT pg_catalog.pg_advisory_lock(42) /* dblock "),
            "{}",
            session.sql.last_statement()
        );
        // … any of several keys, …
        let keys = [Key::from_i64(1), Key::from_i64(2)];
        let any = What::AnyOf(&keys);
        assert!(
            !Plan::build(&w, any, &Round::first(any), &on(true))
                .sql
                .preparable()
        );
        // … or a session that is not dblock's own (a pooler's, a caller's).
        assert!(
            !Plan::build(&w, What::One, &first, &on(false))
                .sql
                .preparable()
        );
    }

    #[test]
    fn a_first_round_only_tries_and_the_next_sets_up_the_wait() {
        let wait = req(Scope::Transaction, Mode::Exclusive, Wait::Forever, false);
        let mut rd = Round::first(What::One);
        rd.try_first = Round::should_try_first(&wait, What::One, false);
        assert!(rd.try_first);
        let on = Server {
            fence: None,
            check_disconnect: true,
            chain: true,
            own_session: true,
        };
        let mut p = Plan::build(&wait, What::One, &rd, &on);
        p.sql.strip_annotation();
        // What the floor sends: no lock_timeout, no connection check.
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_catalog.pg_try_advisory_xact_lock(42)"
        );
        assert!(p.tried_first);
        assert_eq!(
            p.read(&[Some(Value::new("f")), None]).ok(),
            Some(Answer::NotGranted)
        );
        rd.next(What::One, None);
        assert!(!rd.try_first);
        let mut p = Plan::build(&wait, What::One, &rd, &on);
        p.sql.strip_annotation();
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; \
             SET LOCAL client_connection_check_interval = 250; \
             SET LOCAL lock_timeout = 2000; SELECT pg_catalog.pg_advisory_xact_lock(42)"
        );
        assert!(!p.tried_first);
        // On a session whose own lock_timeout is the slice, a whole slice sets none; a
        // shorter wait (a deadline near) still sets its own.
        let slice = Slice::of_round(&wait, What::One, &rd);
        assert!(slice.is_whole());
        let mut p = Plan::build_in(&wait, What::One, &rd, &on, slice, true);
        p.sql.strip_annotation();
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; \
             SET LOCAL client_connection_check_interval = 250; \
             SELECT pg_catalog.pg_advisory_xact_lock(42)"
        );
        let soon = req(
            Scope::Transaction,
            Mode::Exclusive,
            Wait::Until(Instant::now() + Duration::from_millis(300)),
            false,
        );
        let slice = Slice::of_round(&soon, What::One, &rd);
        assert!(!slice.is_whole());
        let p = Plan::build_in(&soon, What::One, &rd, &on, slice, true);
        assert!(p.sql.alone().contains("SET LOCAL lock_timeout = "));
        // A key found busy lately waits at once; a try, a fenced request and a lock set
        // never try first (a set's first round already only tries).
        assert!(!Round::should_try_first(&wait, What::One, true));
        let keys = [Key::from_i64(1), Key::from_i64(2)];
        assert!(Round::should_try_first(&wait, What::AnyOf(&keys), false));
        assert!(!Round::should_try_first(&wait, What::AllOf(&keys), false));
        let t = req(Scope::Transaction, Mode::Exclusive, Wait::Try, false);
        assert!(!Round::should_try_first(&t, What::One, false));
        let f = req(Scope::Transaction, Mode::Exclusive, Wait::Forever, true);
        assert!(!Round::should_try_first(&f, What::One, false));
        // Any of several keys: the first round tries them all, waiting on none.
        let any = What::AnyOf(&keys);
        let mut rd = round(any, 0, None);
        rd.try_first = true;
        let mut p = Plan::build(&wait, any, &rd, &on);
        p.sql.strip_annotation();
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT CASE \
             WHEN pg_catalog.pg_try_advisory_xact_lock(1) THEN 0 \
             WHEN pg_catalog.pg_try_advisory_xact_lock(2) THEN 1 ELSE NULL END"
        );
    }

    #[test]
    fn a_request_for_any_of_several_keys_is_one_statement() {
        let keys = [Key::from_i64(10), Key::from_i64(11), Key::from_i64(12)];
        let any = What::AnyOf(&keys);
        let r = req(Scope::Transaction, Mode::Exclusive, Wait::Forever, false);
        let p = plan_of(&r, any, &round(any, 1, None), false, true);
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = 500; \
             SELECT CASE WHEN pg_catalog.pg_try_advisory_xact_lock(11) THEN 1 \
             WHEN pg_catalog.pg_try_advisory_xact_lock(12) THEN 2 WHEN pg_catalog.pg_try_advisory_xact_lock(10) THEN 0 \
             ELSE (SELECT 1 FROM pg_catalog.pg_advisory_xact_lock(11) AS w) END"
        );
        assert!(p.sliced);
        assert_eq!(*p.wanted(), [Some(2), None]);
        assert_eq!(
            p.read(&[Some(Value::new("2")), None]).ok(),
            Some(Answer::Granted {
                slot: 2,
                token: None
            })
        );
        assert_eq!(p.read(&[None, None]).ok(), Some(Answer::NotGranted));
        // The granted slot's key is the one released.
        assert_eq!(
            plan_of(
                &req(Scope::Session, Mode::Exclusive, Wait::Try, false),
                any,
                &round(any, 0, None),
                false,
                true
            )
            .release(2)
            .sql(),
            "SELECT pg_catalog.pg_advisory_unlock(12)"
        );
        let r = req(Scope::Session, Mode::Exclusive, Wait::Try, false);
        let p = plan_of(&r, any, &round(any, 1, None), false, true);
        assert_eq!(
            p.sql.alone(),
            "SELECT CASE WHEN pg_catalog.pg_try_advisory_lock(11) THEN 1 \
             WHEN pg_catalog.pg_try_advisory_lock(12) THEN 2 WHEN pg_catalog.pg_try_advisory_lock(10) THEN 0 ELSE NULL END"
        );
    }

    #[test]
    fn an_answer_dblock_cannot_map_is_an_error_never_not_granted() {
        let keys = [Key::from_i64(1), Key::from_i64(2)];
        // Any of two keys: a slot out of range, or not a number.
        for bad in ["2", "-1", "x", ""] {
            let e = read_slot(Some(bad), keys.len());
            assert!(matches!(e, Err(Error::Unexpected { .. })), "{bad}: {e:?}");
        }
        assert_eq!(
            read_slot(Some("1"), 2).ok(),
            Some(Answer::Granted {
                slot: 1,
                token: None
            })
        );
        assert_eq!(read_slot(None, 2).ok(), Some(Answer::NotGranted));
        // All of two keys.
        for bad in [Some("2"), Some("-2"), Some("x"), None] {
            let e = read_busy(bad, keys.len());
            assert!(matches!(e, Err(Error::Unexpected { .. })), "{bad:?}: {e:?}");
        }
        assert_eq!(read_busy(Some("1"), 2).ok(), Some(Answer::Busy(1)));
        assert_eq!(
            read_busy(Some("-1"), 2).ok(),
            Some(Answer::Granted {
                slot: 0,
                token: None
            })
        );
        // One key: a try answers t or f; a fenced grant's token is a number.
        let tried = [Some(0), None];
        assert_eq!(
            read_one(tried, Some("t"), None).ok(),
            Some(Answer::Granted {
                slot: 0,
                token: None
            })
        );
        assert_eq!(
            read_one(tried, Some("f"), None).ok(),
            Some(Answer::NotGranted)
        );
        for bad in [None, Some("true"), Some("")] {
            let e = read_one(tried, bad, None);
            assert!(matches!(e, Err(Error::Unexpected { .. })), "{bad:?}: {e:?}");
        }
        let fenced = [Some(7), Some(4)];
        assert_eq!(
            read_one(fenced, Some("t"), Some("12")).ok(),
            Some(Answer::Granted {
                slot: 0,
                token: Some(12)
            })
        );
        // A fenced try writes no token row when the key was not free.
        assert_eq!(
            read_one(fenced, Some("t"), None).ok(),
            Some(Answer::NotGranted)
        );
        let e = read_one(fenced, Some("t"), Some("12.5"));
        assert!(matches!(e, Err(Error::Unexpected { .. })), "{e:?}");
        // Through a plan, as the round loop reads it.
        let any = What::AnyOf(&keys);
        let r = req(Scope::Transaction, Mode::Exclusive, Wait::Try, false);
        let p = plan_of(&r, any, &round(any, 0, None), false, true);
        assert!(matches!(
            p.read(&[Some(Value::new("5")), None]),
            Err(Error::Unexpected { .. })
        ));
    }

    #[test]
    fn every_request_names_its_lock_in_a_comment_the_chained_form_keeps() {
        for (scope, fenced, later) in [
            (Scope::Transaction, false, false),
            (Scope::Session, false, true),
            (Scope::Transaction, true, false),
        ] {
            let r = req(scope, Mode::Exclusive, Wait::Forever, fenced);
            let mut rd = Round::first(What::One);
            if later {
                rd.next(What::One, None);
            }
            let mut p = plan_of(&r, What::One, &rd, true, true);
            let key = Key::derive("public", "it's");
            for text in [
                p.sql.alone().to_string(),
                Deferred::Rollback { chain: true }
                    .carried_by(&p.sql)
                    .0
                    .into_owned(),
            ] {
                // The test request's key is 42, not the name's: parse the comment alone.
                let c = crate::status::parse_comments(&text);
                assert_eq!(c.len(), 1, "{text}");
                assert_eq!(c[0].key(), key);
                assert_eq!(c[0].scope, Some(scope));
                assert_eq!(c[0].since.is_some(), later, "{text}");
                // The statements are unchanged: the comment ends the last one.
                assert!(text.ends_with(" */"), "{text}");
            }
            assert!(p.check_sql().is_some_and(|c| c.label().contains(" since=")));
        }
    }

    #[test]
    fn a_deadline_becomes_a_server_side_lock_timeout() {
        let until = Instant::now() + Duration::from_secs(5);
        let p = plan(&req(
            Scope::Transaction,
            Mode::Exclusive,
            Wait::Until(until),
            false,
        ));
        assert!(
            p.sql.alone().contains("SET LOCAL lock_timeout = "),
            "{}",
            p.sql.alone()
        );
        let p = plan(&req(
            Scope::Session,
            Mode::Exclusive,
            Wait::Until(until),
            false,
        ));
        assert!(
            p.sql
                .alone()
                .starts_with("SELECT pg_catalog.set_config('lock_timeout', "),
            "{}",
            p.sql.alone()
        );
        // A deadline already past is a try: lock_timeout = 0 would wait forever.
        let p = plan(&req(
            Scope::Session,
            Mode::Exclusive,
            Wait::Until(Instant::now()),
            false,
        ));
        assert_eq!(p.sql.alone(), "SELECT pg_catalog.pg_try_advisory_lock(42)");
    }

    #[test]
    fn a_fenced_transaction_lock_commits_its_token_under_a_bridging_session_lock() {
        let p = plan(&req(
            Scope::Transaction,
            Mode::Exclusive,
            Wait::Forever,
            true,
        ));
        let stmts: Vec<&str> = p.sql.alone().split("; ").collect();
        // The token's commit is durable whatever the server's synchronous_commit.
        assert_eq!(stmts[1], "SET LOCAL synchronous_commit = on");
        assert_eq!(stmts[2], "SET LOCAL lock_timeout = 2000");
        assert_eq!(stmts[3], "SELECT pg_catalog.pg_advisory_lock(42)");
        assert!(stmts[4].starts_with("INSERT INTO \"public\".dblock_fencing"));
        assert!(
            stmts[4].contains("E'it''s'"),
            "names are quoted: {}",
            stmts[4]
        );
        assert_eq!(stmts[5], "COMMIT");
        assert_eq!(stmts[7], "SELECT pg_catalog.pg_try_advisory_xact_lock(42)");
        assert_eq!(stmts[8], "SELECT pg_catalog.pg_advisory_unlock(42)");
        assert_eq!(*p.wanted(), [Some(7), Some(4)]);
        // A fenced try bounds its wait on the fencing row.
        let p = plan(&req(Scope::Transaction, Mode::Exclusive, Wait::Try, true));
        assert!(
            p.sql.alone().contains("SET LOCAL lock_timeout = 100"),
            "{}",
            p.sql.alone()
        );
        assert!(
            p.sql
                .alone()
                .contains("WHERE pg_catalog.pg_try_advisory_lock(42) "),
            "{}",
            p.sql.alone()
        );
    }

    #[test]
    fn a_lock_request_can_carry_a_rollback() {
        let p = plan(&req(Scope::Transaction, Mode::Exclusive, Wait::Try, false));
        assert_eq!(
            p.sql.carrying_rollback(),
            "ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_catalog.pg_try_advisory_xact_lock(42)"
        );
        assert_eq!(*p.wanted(), [Some(1), None]);
        assert_eq!(
            p.read(&[Some(Value::new("t")), None]).ok(),
            Some(Answer::Granted {
                slot: 0,
                token: None
            })
        );
        assert_eq!(
            p.read(&[Some(Value::new("f")), None]).ok(),
            Some(Answer::NotGranted)
        );
    }

    #[test]
    fn a_session_release_is_carried_in_a_transaction_of_its_own_where_it_must_be() {
        for (mode, lease) in [
            (Mode::Exclusive, false),
            (Mode::Shared, false),
            (Mode::Exclusive, true),
        ] {
            let r = Release::of_one(Scope::Session, mode, Key::from_i64(7), lease).deferred();
            let p = plan(&req(Scope::Transaction, Mode::Exclusive, Wait::Try, false));
            let (text, skip) = r.carried_by(&p.sql);
            assert!(
                text.starts_with("BEGIN; SELECT pg_catalog.pg_advisory_unlock"),
                "{text}"
            );
            let stmts: Vec<&str> = text.split("; ").collect();
            assert_eq!(stmts[skip - 1], "COMMIT");
            assert_eq!(stmts[skip..].join("; "), p.sql.alone());
            // Before a request that begins no transaction, a lone unlock joins its
            // implicit one; a lease's (a SET besides) keeps a transaction of its own.
            let p = plan(&req(Scope::Session, Mode::Exclusive, Wait::Try, false));
            let (text, skip) = r.carried_by(&p.sql);
            let stmts: Vec<&str> = text.split("; ").collect();
            assert_eq!(stmts[skip..].join("; "), p.sql.alone());
            if lease {
                assert!(text.starts_with("BEGIN; "), "{text}");
            } else {
                assert_eq!(skip, 1);
                assert!(
                    text.starts_with("SELECT pg_catalog.pg_advisory_unlock"),
                    "{text}"
                );
            }
        }
        assert_eq!(Deferred::Rollback { chain: true }.sql(), "ROLLBACK");
    }

    #[test]
    fn a_carried_rollback_chains_only_a_transaction_known_to_be_open() {
        let p = plan(&req(Scope::Transaction, Mode::Exclusive, Wait::Try, false));
        let (text, skip) = Deferred::Rollback { chain: true }.carried_by(&p.sql);
        assert_eq!(
            text,
            "ROLLBACK AND CHAIN; SELECT pg_catalog.pg_try_advisory_xact_lock(42)"
        );
        assert_eq!(
            skip, 0,
            "AND CHAIN stands in for the BEGIN: same statements"
        );
        let (text, skip) = Deferred::Rollback { chain: false }.carried_by(&p.sql);
        assert_eq!(text, format!("ROLLBACK; {}", p.sql.alone()));
        assert_eq!(skip, 1);
        // A server without AND CHAIN, or a request that does not begin a transaction.
        let r = req(Scope::Transaction, Mode::Exclusive, Wait::Try, false);
        let old = plan_of(&r, What::One, &Round::first(What::One), false, false);
        assert_eq!(Deferred::Rollback { chain: true }.carried_by(&old.sql).1, 1);
        let session = plan(&req(Scope::Session, Mode::Exclusive, Wait::Try, false));
        let (text, skip) = Deferred::Rollback { chain: true }.carried_by(&session.sql);
        assert_eq!(text, "ROLLBACK; SELECT pg_catalog.pg_try_advisory_lock(42)");
        assert_eq!(skip, 1);
        // A fenced request chains its first BEGIN only.
        let fenced = plan(&req(
            Scope::Transaction,
            Mode::Exclusive,
            Wait::Forever,
            true,
        ));
        let (text, _) = Deferred::Rollback { chain: true }.carried_by(&fenced.sql);
        assert!(
            text.starts_with("ROLLBACK AND CHAIN; SET LOCAL synchronous_commit = on; "),
            "{text}"
        );
        assert_eq!(
            text.matches("BEGIN ISOLATION LEVEL READ COMMITTED").count(),
            1
        );
    }

    #[test]
    fn free_names_are_one_message_of_one_statement() {
        let keys = [Key::from_i64(-5), Key::from_i64(3), Key::from_i64(9)];
        let all = What::AllOf(&keys);
        let r = req(Scope::Transaction, Mode::Exclusive, Wait::Forever, false);
        let mut p = plan_of(&r, all, &Round::first(all), true, true);
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT coalesce((SELECT i - 1 FROM \
             pg_catalog.unnest('{-5,3,9}'::bigint[]) WITH ORDINALITY AS t(k, i) \
             WHERE NOT pg_catalog.pg_try_advisory_xact_lock(k) LIMIT 1), -1)"
        );
        assert!(!p.sliced);
        assert_eq!(*p.wanted(), [Some(1), None]);
        assert_eq!(
            p.read(&[Some(Value::new("1")), None]).ok(),
            Some(Answer::Busy(1))
        );
        assert!(
            p.check_sql().is_none(),
            "a set's message carries no comment"
        );
    }

    #[test]
    fn a_later_round_waits_for_the_busy_key_alone_then_tries_all() {
        let keys = [Key::from_i64(1), Key::from_i64(2)];
        let all = What::AllOf(&keys);
        let mut rd = Round::first(all);
        rd.next(all, Some(1));
        let r = req(Scope::Session, Mode::Exclusive, Wait::Forever, false);
        let p = plan_of(&r, all, &rd, true, true);
        assert_eq!(
            p.sql.alone(),
            "SELECT pg_catalog.set_config('lock_timeout', '2000', true); SELECT pg_catalog.pg_advisory_lock(2); \
             SELECT coalesce((SELECT i - 1 FROM pg_catalog.unnest('{1,2}'::bigint[]) WITH ORDINALITY \
             AS t(k, i) WHERE NOT pg_catalog.pg_try_advisory_lock(k) LIMIT 1), -1)"
        );
        assert!(p.sliced);
        assert_eq!(
            p.release(0).sql(),
            "SELECT true FROM pg_catalog.pg_advisory_unlock_all()"
        );
        // Under a millisecond left, the round is not sent.
        assert!(rd.out_of_time(Wait::Until(Instant::now())));
        assert!(!rd.out_of_time(Wait::Forever));
    }
}
