//! The text of every message the lock logic sends on PostgreSQL, written here once: a
//! round of an acquisition (its opening settings, then one key, any one of several, all
//! of a set, or a fenced key with its token), the clean-up after a round that did not end
//! held, and a held lock's release. What to write — which keys, whether to wait, for how
//! long — is decided in `plan`; here is only how it is spelt.

use std::borrow::Cow;

use crate::key::Key;
use crate::postgres::conn::wire::{Deferred, Message};
use crate::postgres::sql::i64_text;
use crate::postgres::store::token::next_token_sql;
use crate::raw::{Mode, Req, Scope};

/// How long a fenced `try_lock` waits for a previous holder's fenced write to commit.
const FENCED_TRY_ROW_WAIT_MS: u32 = 100;

/// Lets the server notice, while it waits, that the client went away.
const CHECK: &str = "client_connection_check_interval";
const CHECK_MS: u32 = 250;

/// The advisory-lock function of a request: `pg_[try_]advisory[_xact]_lock[_shared]`,
/// schema-qualified like every function dblock calls (a `search_path` cannot redirect it).
pub(crate) fn lock_fn(scope: Scope, mode: Mode, try_: bool) -> &'static str {
    use {Mode::*, Scope::*};
    match (try_, scope, mode) {
        (false, Transaction, Exclusive) => "pg_catalog.pg_advisory_xact_lock",
        (false, Transaction, Shared) => "pg_catalog.pg_advisory_xact_lock_shared",
        (false, Session, Exclusive) => "pg_catalog.pg_advisory_lock",
        (false, Session, Shared) => "pg_catalog.pg_advisory_lock_shared",
        (true, Transaction, Exclusive) => "pg_catalog.pg_try_advisory_xact_lock",
        (true, Transaction, Shared) => "pg_catalog.pg_try_advisory_xact_lock_shared",
        (true, Session, Exclusive) => "pg_catalog.pg_try_advisory_lock",
        (true, Session, Shared) => "pg_catalog.pg_try_advisory_lock_shared",
    }
}

/// The function that unlocks a session lock of `mode`, named once.
pub(crate) fn unlock_fn(mode: Mode) -> &'static str {
    match mode {
        Mode::Exclusive => "pg_catalog.pg_advisory_unlock",
        Mode::Shared => "pg_catalog.pg_advisory_unlock_shared",
    }
}

/// What a call of `f` on one key is written as up to its key, `SELECT f(`: the one
/// spelling of [`write_call`] (into a `String`: a release, a batch's single call) and
/// [`lock_one`] (into a [`Message`], which remembers where the key is).
fn call_head(f: &str) -> [&str; 3] {
    ["SELECT ", f, "("]
}

/// `SELECT f(key)` at the end of `out`, `f` a function of one key ([`lock_fn`],
/// [`unlock_fn`]).
pub(crate) fn write_call(out: &mut String, f: &str, key: Key) {
    let mut kbuf = [0u8; 20];
    for part in call_head(f) {
        out.push_str(part);
    }
    out.push_str(i64_text(key.as_i64(), &mut kbuf));
    out.push(')');
}

/// The `WHERE` clause that takes a fenced key's session lock before its token row is
/// written: no row, and no token, when the key is not free.
pub(crate) fn take_first(key: Key) -> String {
    format!("WHERE pg_catalog.pg_try_advisory_lock({}) ", key.as_i64())
}

/// What a round's message sets for itself before it locks.
pub(crate) struct Settings {
    /// Whether the server has `ROLLBACK AND CHAIN` (PostgreSQL 12), which may then stand
    /// in for the round's `BEGIN` (see [`Message::begin`]).
    pub(crate) chain: bool,
    /// Whether to set `client_connection_check_interval` for the round.
    pub(crate) check_disconnect: bool,
    /// The lease: the session's idle timeout while the lock is held, in milliseconds.
    pub(crate) lease_ms: Option<u128>,
    /// The round's `lock_timeout`; `None`: the round tries without waiting.
    pub(crate) timeout_ms: Option<u128>,
    /// Whether the session's own `lock_timeout` already is `timeout_ms` (see
    /// `NativeConn::set_session_slice`): the round then sets none.
    pub(crate) timeout_set: bool,
}

impl Settings {
    /// Whether the round tries without waiting.
    pub(crate) fn tries(&self) -> bool {
        self.timeout_ms.is_none()
    }
}

/// Opens a round: for a transaction-scoped request its `BEGIN` and `SET LOCAL`s; for a
/// session-scoped one, `set_config` calls (the lease's for the session, the others for
/// the round's implicit transaction alone).
pub(crate) fn open(msg: &mut Message, scope: Scope, s: &Settings) {
    match scope {
        Scope::Transaction => {
            msg.begin(s.chain);
            // Only a round that waits needs the server to watch for a client gone away.
            if s.check_disconnect && !s.tries() {
                msg.push_fmt(format_args!("SET LOCAL {CHECK} = {CHECK_MS}"));
            }
            if let Some(ms) = s.lease_ms {
                msg.push_fmt(format_args!(
                    "SET LOCAL idle_in_transaction_session_timeout = {ms}"
                ));
            }
            if let Some(ms) = s.timeout_ms.filter(|_| !s.timeout_set) {
                msg.push_fmt(format_args!("SET LOCAL lock_timeout = {ms}"));
            }
        }
        Scope::Session => {
            if let Some(ms) = s.lease_ms {
                msg.push_fmt(format_args!(
                    "SELECT pg_catalog.set_config('idle_session_timeout', '{ms}', false)"
                ));
            }
            if s.check_disconnect && !s.tries() {
                msg.push_fmt(format_args!(
                    "SELECT pg_catalog.set_config('{CHECK}', '{CHECK_MS}', true)"
                ));
            }
            if let Some(ms) = s.timeout_ms.filter(|_| !s.timeout_set) {
                msg.push_fmt(format_args!(
                    "SELECT pg_catalog.set_config('lock_timeout', '{ms}', true)"
                ));
            }
        }
    }
}

/// The statement that takes (or, with `try_`, tries) one key; its index.
pub(crate) fn lock_one(msg: &mut Message, scope: Scope, mode: Mode, key: Key, try_: bool) -> usize {
    let mut kbuf = [0u8; 20];
    let k = i64_text(key.as_i64(), &mut kbuf);
    msg.push_call(&call_head(lock_fn(scope, mode, try_)), k)
}

/// The statement that takes any one of `keys`, answering the index of the key granted:
/// `SELECT CASE WHEN pg_try_advisory_xact_lock(k₂) THEN 2 WHEN … ELSE (SELECT 2 FROM
/// pg_advisory_xact_lock(k₂) AS w) END` — each key tried in turn from `start` (CASE stops
/// at the first granted), then a wait on `keys[start]` alone; the scalar subquery is
/// evaluated only when the ELSE is reached. A try ends `ELSE NULL END`. Its index.
pub(crate) fn lock_any(
    msg: &mut Message,
    scope: Scope,
    keys: &[Key],
    start: usize,
    try_: bool,
) -> usize {
    use std::fmt::Write;
    let n = keys.len();
    let tries = lock_fn(scope, Mode::Exclusive, true);
    msg.push_with(|text| {
        text.push_str("SELECT CASE");
        for i in 0..n {
            let slot = (start + i) % n;
            let _ = write!(text, " WHEN {tries}({}) THEN {slot}", keys[slot].as_i64());
        }
        if try_ {
            text.push_str(" ELSE NULL END");
        } else {
            let slot = start % n;
            let _ = write!(
                text,
                " ELSE (SELECT {slot} FROM {}({}) AS w) END",
                lock_fn(scope, Mode::Exclusive, false),
                keys[slot].as_i64(),
            );
        }
    })
}

/// The statements of a round of a request for every one of `keys`: with `wait_on`, a
/// wait for that key alone first; then the statement that tries `keys` in their order
/// and stops at the first busy one, answering its index, or -1 when every key was taken
/// (its index is returned):
///
/// `SELECT coalesce((SELECT i - 1 FROM unnest('{k₀,k₁,…}'::bigint[]) WITH ORDINALITY AS
/// t(k, i) WHERE NOT f(k) LIMIT 1), -1)`
///
/// `unnest` yields the keys in order and `LIMIT 1` stops at the first row its filter
/// passes, so the keys after a busy one are not tried. The function is resolved once:
/// a CASE with one call per key cost the server about 10 µs per key to parse (measured
/// here: 100 keys took ~2 ms, this form the time of a one-key statement).
pub(crate) fn lock_all(
    msg: &mut Message,
    scope: Scope,
    mode: Mode,
    keys: &[Key],
    wait_on: Option<usize>,
) -> usize {
    use std::fmt::Write;
    if let Some(&w) = wait_on.and_then(|w| keys.get(w)) {
        lock_one(msg, scope, mode, w, false);
    }
    msg.push_with(|text| {
        text.reserve(160 + keys.len() * 21);
        text.push_str("SELECT coalesce((SELECT i - 1 FROM pg_catalog.unnest('{");
        for (i, k) in keys.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            let _ = write!(text, "{}", k.as_i64());
        }
        let _ = write!(
            text,
            "}}'::bigint[]) WITH ORDINALITY AS t(k, i) WHERE NOT {}(k) LIMIT 1), -1)",
            lock_fn(scope, mode, true)
        );
    })
}

/// Where a fenced round answers: its token, and the statement that must answer `t`.
pub(crate) struct Fenced {
    pub(crate) token_at: usize,
    pub(crate) must_be_true: Option<usize>,
}

/// A fenced round (exclusive, one key): the token is committed *while the lock is held*
/// and before the grant is returned. A session lock taken first bridges the commit, so
/// no other holder can come between the increment and the grant; a transaction-scoped
/// request then takes its transaction lock (re-entrant, so at once) and drops the bridge.
/// `fence`: the fencing table, and whether tokens carry the timeline (see
/// [`next_token_sql`]).
pub(crate) fn lock_fenced(
    msg: &mut Message,
    req: &Req<'_>,
    s: &Settings,
    (table, epoch): (&str, bool),
) -> Fenced {
    let mut kbuf = [0u8; 20];
    let k = i64_text(req.key.as_i64(), &mut kbuf);
    msg.begin(s.chain);
    // The token must be durable before it is handed out, whatever the server's
    // synchronous_commit: a crash must never reissue a token.
    msg.push(&["SET LOCAL synchronous_commit = on"]);
    if s.tries() {
        // A try must not wait long on the fencing row, which a previous holder's fenced
        // write holds until it commits.
        msg.push_fmt(format_args!(
            "SET LOCAL lock_timeout = {FENCED_TRY_ROW_WAIT_MS}"
        ));
    }
    if s.check_disconnect {
        msg.push_fmt(format_args!("SET LOCAL {CHECK} = {CHECK_MS}"));
    }
    if let Some(ms) = s.timeout_ms {
        msg.push_fmt(format_args!("SET LOCAL lock_timeout = {ms}"));
    }
    let cond = match s.tries() {
        true => take_first(req.key),
        false => {
            msg.push(&["SELECT pg_catalog.pg_advisory_lock(", k, ")"]);
            String::new()
        }
    };
    let token_at = msg.push(&[&next_token_sql(table, req, &cond, epoch)]);
    msg.push(&["COMMIT"]);
    let mut must_be_true = None;
    match (req.scope, s.lease_ms) {
        (Scope::Session, Some(ms)) => {
            msg.push_fmt(format_args!(
                "SELECT pg_catalog.set_config('idle_session_timeout', '{ms}', false)"
            ));
        }
        (Scope::Session, None) => {}
        (Scope::Transaction, lease_ms) => {
            msg.begin(false);
            if let Some(ms) = lease_ms {
                msg.push_fmt(format_args!(
                    "SET LOCAL idle_in_transaction_session_timeout = {ms}"
                ));
            }
            // Re-entrant, so immediate when the session lock above was granted; a try,
            // so it never waits when it was not.
            must_be_true =
                Some(msg.push(&["SELECT pg_catalog.pg_try_advisory_xact_lock(", k, ")"]));
            msg.push(&["SELECT pg_catalog.pg_advisory_unlock(", k, ")"]);
        }
    }
    Fenced {
        token_at,
        must_be_true,
    }
}

/// What releases a held lock, or a held set: the transaction's `ROLLBACK`, or a session
/// lock's unlock (answering `t` when the session held it), with the lease's reset.
pub(crate) struct Release {
    scope: Scope,
    /// Whether a session lock's lease set the session's `idle_session_timeout`.
    lease: bool,
    sql: Cow<'static, str>,
}

impl Release {
    /// The release of one key (no allocation for a transaction-scoped lock's).
    pub(crate) fn of_one(scope: Scope, mode: Mode, key: Key, lease: bool) -> Release {
        let sql = match (scope, mode) {
            (Scope::Transaction, _) => Cow::Borrowed("ROLLBACK"),
            (Scope::Session, mode) => {
                let f = unlock_fn(mode);
                // `SELECT `, `(`, a key's at most 20 characters, `)`.
                let mut sql = String::with_capacity(f.len() + 29);
                write_call(&mut sql, f, key);
                Cow::Owned(sql)
            }
        };
        Release::with_reset(scope, lease, sql)
    }

    /// The release of every key of a set (or of whatever a round may have taken): the
    /// `ROLLBACK`, or one unlock of all the session's advisory locks (the connection is
    /// the request's alone, and a recycled one holds none), answering `t` as one lock's
    /// unlock does.
    pub(crate) fn of_all(scope: Scope, lease: bool) -> Release {
        let sql = match scope {
            Scope::Transaction => Cow::Borrowed("ROLLBACK"),
            Scope::Session => Cow::Borrowed("SELECT true FROM pg_catalog.pg_advisory_unlock_all()"),
        };
        Release::with_reset(scope, lease, sql)
    }

    /// A lease's `idle_session_timeout` must not outlive the lock on a pooled session.
    fn with_reset(scope: Scope, lease: bool, sql: Cow<'static, str>) -> Release {
        let lease = lease && scope == Scope::Session;
        let sql = match lease {
            true => Cow::Owned(format!("{sql}; SET idle_session_timeout = DEFAULT")),
            false => sql,
        };
        Release { scope, lease, sql }
    }

    pub(crate) fn scope(&self) -> Scope {
        self.scope
    }

    /// The release, sent on its own.
    pub(crate) fn sql(&self) -> &str {
        &self.sql
    }

    /// The release as a guard's drop defers it: a transaction's `ROLLBACK` may chain the
    /// next request's transaction (the lock's is open and READ COMMITTED); an unlock
    /// takes effect even if the next message fails (advisory session locks are not
    /// transactional); a lease's reset, a transactional `SET`, needs a transaction of its
    /// own.
    pub(crate) fn deferred(&mut self) -> Deferred {
        let sql = std::mem::take(&mut self.sql);
        match (self.scope, self.lease) {
            (Scope::Transaction, _) => Deferred::Rollback { chain: true },
            (Scope::Session, false) => Deferred::Standalone(sql),
            (Scope::Session, true) => Deferred::InOwnTransaction { sql, statements: 2 },
        }
    }

    /// What leaves a connection clean after a round that did not end held: `ROLLBACK`
    /// (a warning if no transaction is open) and this release; unlocking a lock not held
    /// is a no-op with a warning.
    pub(crate) fn after_rollback(&self) -> String {
        format!("ROLLBACK; {}", self.sql)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session-scoped release carried ahead of the next request is bound as the
    /// session's own prepared unlock (`conn/extended.rs` spells the statements it
    /// prepares, knowing nothing of locks): the two spellings held together, so that a
    /// change to one does not quietly send every carried release parsed again.
    #[test]
    fn a_session_release_is_bound_as_the_sessions_own_statement() {
        use crate::postgres::conn::extended::fixed_for;
        let k = Key::from_i64(-7);
        for (mode, name) in [
            (Mode::Exclusive, "dblock_unlock"),
            (Mode::Shared, "dblock_unlock_shared"),
        ] {
            let r = Release::of_one(Scope::Session, mode, k, false);
            assert_eq!(fixed_for(r.sql()), Some((name, Some(-7))), "{}", r.sql());
        }
        let r = Release::of_one(Scope::Transaction, Mode::Exclusive, k, false);
        assert_eq!(fixed_for(r.sql()), Some(("dblock_rollback", None)));
    }

    #[test]
    fn every_lock_function_is_named_as_the_server_spells_it() {
        let mut names = Vec::new();
        for try_ in [false, true] {
            for scope in [Scope::Transaction, Scope::Session] {
                for mode in [Mode::Exclusive, Mode::Shared] {
                    let expected = format!(
                        "pg_catalog.pg_{}advisory{}_lock{}",
                        if try_ { "try_" } else { "" },
                        if scope == Scope::Transaction {
                            "_xact"
                        } else {
                            ""
                        },
                        if mode == Mode::Shared { "_shared" } else { "" },
                    );
                    assert_eq!(lock_fn(scope, mode, try_), expected);
                    names.push(expected);
                }
            }
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 8);
    }

    /// A key's call is the same text whether a request's message writes it (remembering
    /// where its key is) or a batch, a lane's lone try or a release writes it into a
    /// `String`: a multiplexed lane and a pinned request take one key by one statement.
    #[test]
    fn a_call_is_spelt_alike_in_a_message_and_in_a_string() {
        for k in [i64::MIN, -7, 0, 42, i64::MAX].map(Key::from_i64) {
            for try_ in [false, true] {
                for scope in [Scope::Transaction, Scope::Session] {
                    for mode in [Mode::Exclusive, Mode::Shared] {
                        let f = lock_fn(scope, mode, try_);
                        let mut written = String::new();
                        write_call(&mut written, f, k);
                        assert_eq!(written, format!("SELECT {f}({})", k.as_i64()));
                        let mut msg = Message::with_capacity(64);
                        assert_eq!(lock_one(&mut msg, scope, mode, k, try_), 0);
                        assert_eq!(msg.alone(), written);
                    }
                }
            }
        }
    }

    #[test]
    fn releases_are_spelt_once_for_a_lock_and_for_a_set() {
        let k = Key::from_i64(-7);
        let r = Release::of_one(Scope::Session, Mode::Shared, k, false);
        assert_eq!(r.sql(), "SELECT pg_catalog.pg_advisory_unlock_shared(-7)");
        assert_eq!(
            r.after_rollback(),
            "ROLLBACK; SELECT pg_catalog.pg_advisory_unlock_shared(-7)"
        );
        let r = Release::of_one(Scope::Session, Mode::Exclusive, k, true);
        assert_eq!(
            r.sql(),
            "SELECT pg_catalog.pg_advisory_unlock(-7); SET idle_session_timeout = DEFAULT"
        );
        let r = Release::of_all(Scope::Session, true);
        assert_eq!(
            r.sql(),
            "SELECT true FROM pg_catalog.pg_advisory_unlock_all(); SET idle_session_timeout = DEFAULT"
        );
        // A transaction-scoped lock's lease is the transaction's own: nothing to reset.
        let r = Release::of_one(Scope::Transaction, Mode::Exclusive, k, true);
        assert_eq!(r.sql(), "ROLLBACK");
        assert!(matches!(
            Release::of_all(Scope::Transaction, true).deferred(),
            Deferred::Rollback { chain: true }
        ));
        assert!(matches!(
            Release::of_all(Scope::Session, false).deferred(),
            Deferred::Standalone(_)
        ));
        assert!(matches!(
            Release::of_all(Scope::Session, true).deferred(),
            Deferred::InOwnTransaction { statements: 2, .. }
        ));
    }
}
