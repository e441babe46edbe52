//! The SQL of one acquisition on PostgreSQL, and of a held lock's release: what a
//! request sends as one simple-protocol message, and how its reply is read.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::key::Key;
use crate::postgres::conn::Conn;
use crate::postgres::conn::wire::{LockSql, Release};
use crate::postgres::sql::i64_text;
use crate::postgres::store::token::next_token_sql;
use crate::raw::{ANY_SLICE, Mode, Req, Scope, Wait};
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

/// How long a fenced `try_lock` waits for a previous holder's fenced write to commit.
const FENCED_TRY_ROW_WAIT_MS: u32 = 100;

/// The SQL of one acquisition, and how to read its result.
pub(crate) struct Plan {
    pub(crate) sql: LockSql,
    scope: Scope,
    key: Key,
    mode: Mode,
    /// Whether the request set a lease (which the clean-up must undo).
    lease: bool,
    /// The statement whose single boolean row must be `t` for the lock to be held, if
    /// any (a plan has at most one).
    must_be_true: Option<usize>,
    /// Index of the statement returning the fencing token, if any.
    token_at: Option<usize>,
    /// Whether the server's lock_timeout is shorter than the wait asked for.
    pub(crate) sliced: bool,
    /// Whether the request takes any one of several keys (see [`Any`]): then the
    /// statement at `must_be_true` returns the index of the key granted, or NULL.
    any: bool,
}

/// A request for any one of several keys (a semaphore's slots), in one statement:
/// `SELECT CASE WHEN pg_try_advisory_xact_lock(k₂) THEN 2 WHEN … ELSE (SELECT 2 FROM
/// pg_advisory_xact_lock(k₂)) END` — each key tried in turn from `start` (CASE stops at
/// the first granted), then a wait on `keys[start]` alone, as long as one slice; the
/// scalar subquery is evaluated only when the ELSE is reached. A try ends `ELSE NULL`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Any<'a> {
    pub(crate) keys: &'a [Key],
    pub(crate) start: usize,
}

impl Plan {
    /// `fence`: the fencing table, and whether tokens carry the timeline (see
    /// [`next_token_sql`]). `chain`: whether the server has `ROLLBACK AND CHAIN`
    /// (PostgreSQL 12).
    /// `waiting_since`: when the wait began, on a wait's second and later slices (the
    /// first one's start is the statement's own, which the server shows).
    #[cfg(test)]
    pub(crate) fn new(
        req: &Req<'_>,
        fence: Option<(&str, bool)>,
        check_disconnect: bool,
        chain: bool,
        waiting_since: Option<SystemTime>,
    ) -> Plan {
        Plan::build(req, fence, check_disconnect, chain, None, waiting_since)
    }

    /// The plan of `req` (`fence` and `chain` as for [`Plan::new`]), for any one of
    /// several keys when `any` is given (never with a fenced request, which takes its
    /// slots one by one).
    pub(crate) fn build(
        req: &Req<'_>,
        fence: Option<(&str, bool)>,
        check_disconnect: bool,
        chain: bool,
        any: Option<Any<'_>>,
        waiting_since: Option<SystemTime>,
    ) -> Plan {
        debug_assert!(!req.fenced || fence.is_some());
        debug_assert!(!(req.fenced && any.is_some()));
        let (fence_table, epoch) = (fence.map(|f| f.0), fence.is_some_and(|f| f.1));
        let mut kbuf = [0u8; 20];
        let k = i64_text(req.key.as_i64(), &mut kbuf);
        let shared = if req.mode == Mode::Shared {
            "_shared"
        } else {
            ""
        };
        // Whole milliseconds left, at least 1 (lock_timeout = 0 would mean "forever"),
        // at most one WAIT_SLICE_MS: a longer wait is asked for again, so that no waiter
        // holds one statement's snapshot for longer than that.
        let mut sliced = false;
        // A wait for any of several keys waits on one of them: a shorter slice, so that
        // the others are tried again soon (see ANY_SLICE).
        let slice_ms = match any {
            Some(_) => ANY_SLICE.as_millis(),
            None => WAIT_SLICE_MS,
        };
        let timeout_ms = match req.wait {
            Wait::Until(t) => {
                // Rounded up: the server must not give up before the deadline.
                let left = t.saturating_duration_since(Instant::now());
                let ms = left.as_micros().div_ceil(1000);
                sliced = ms > slice_ms;
                if left < Duration::from_millis(1) {
                    None
                } else {
                    Some(ms.min(slice_ms))
                }
            }
            Wait::Forever => {
                sliced = true;
                Some(slice_ms)
            }
            Wait::Try => None,
        };
        let try_ =
            req.wait == Wait::Try || (matches!(req.wait, Wait::Until(_)) && timeout_ms.is_none());
        let mut sql = LockSql::new();
        let mut must_be_true = None;
        let mut token_at = None;
        let fenced = req.fenced && fence_table.is_some();
        // A lease beyond the server's limit is capped: it only bounds how long the lock
        // outlives a silent holder, and a live holder's session is never idle that long.
        let lease_ms = req.lease.map(|l| l.as_millis().clamp(1, MAX_SERVER_MS));
        // Lets the server notice, while it waits, that the client went away.
        const CHECK: &str = "client_connection_check_interval";
        let check_ms = 250;
        match (req.scope, fenced) {
            (Scope::Transaction, false) => {
                sql.begin(chain);
                if check_disconnect {
                    sql.push(&[&format!("SET LOCAL {CHECK} = {check_ms}")]);
                }
                if let Some(ms) = lease_ms {
                    sql.push(&[&format!(
                        "SET LOCAL idle_in_transaction_session_timeout = {ms}"
                    )]);
                }
                if let Some(ms) = timeout_ms {
                    sql.push(&[&format!("SET LOCAL lock_timeout = {ms}")]);
                }
                if let Some(any) = any {
                    must_be_true = Some(push_any(&mut sql, any, "_xact", try_));
                } else {
                    let f = if try_ {
                        "SELECT pg_try_advisory_xact_lock"
                    } else {
                        "SELECT pg_advisory_xact_lock"
                    };
                    let i = sql.push(&[f, shared, "(", k, ")"]);
                    if try_ {
                        must_be_true = Some(i);
                    }
                }
            }
            (Scope::Session, false) => {
                if let Some(ms) = lease_ms {
                    sql.push(&[&format!(
                        "SELECT set_config('idle_session_timeout', '{ms}', false)"
                    )]);
                }
                if check_disconnect {
                    sql.push(&[&format!("SELECT set_config('{CHECK}', '{check_ms}', true)")]);
                }
                if let Some(ms) = timeout_ms {
                    sql.push(&[&format!("SELECT set_config('lock_timeout', '{ms}', true)")]);
                }
                if let Some(any) = any {
                    must_be_true = Some(push_any(&mut sql, any, "", try_));
                } else {
                    let f = if try_ {
                        "SELECT pg_try_advisory_lock"
                    } else {
                        "SELECT pg_advisory_lock"
                    };
                    let i = sql.push(&[f, shared, "(", k, ")"]);
                    if try_ {
                        must_be_true = Some(i);
                    }
                }
            }
            (scope, true) => {
                // The token is committed *while the lock is held* and before the grant is
                // returned: a session lock taken first bridges the commit, so no other
                // holder can come between the increment and the grant.
                let table = fence_table.unwrap_or_default();
                sql.begin(chain);
                // The token must be durable before it is handed out, whatever the
                // server's synchronous_commit: a crash must never reissue a token.
                sql.push(&["SET LOCAL synchronous_commit = on"]);
                if try_ {
                    // A try must not wait long on the fencing row, which a previous
                    // holder's fenced write holds until it commits.
                    sql.push(&[&format!(
                        "SET LOCAL lock_timeout = {FENCED_TRY_ROW_WAIT_MS}"
                    )]);
                }
                if check_disconnect {
                    sql.push(&[&format!("SET LOCAL {CHECK} = {check_ms}")]);
                }
                if let Some(ms) = timeout_ms {
                    sql.push(&[&format!("SET LOCAL lock_timeout = {ms}")]);
                }
                let cond = if try_ {
                    format!("WHERE pg_try_advisory_lock({k}) ")
                } else {
                    String::new()
                };
                let upsert = next_token_sql(table, req, &cond, epoch);
                if !try_ {
                    sql.push(&["SELECT pg_advisory_lock(", k, ")"]);
                }
                token_at = Some(sql.push(&[&upsert]));
                sql.push(&["COMMIT"]);
                if let (Scope::Session, Some(ms)) = (scope, lease_ms) {
                    sql.push(&[&format!(
                        "SELECT set_config('idle_session_timeout', '{ms}', false)"
                    )]);
                }
                if scope == Scope::Transaction {
                    sql.begin(false);
                    if let Some(ms) = lease_ms {
                        sql.push(&[&format!(
                            "SET LOCAL idle_in_transaction_session_timeout = {ms}"
                        )]);
                    }
                    // Re-entrant, so immediate when the session lock above was granted;
                    // a try, so it never waits when it was not.
                    must_be_true = Some(sql.push(&["SELECT pg_try_advisory_xact_lock(", k, ")"]));
                    sql.push(&["SELECT pg_advisory_unlock(", k, ")"]);
                }
            }
        }
        // Names the lock in pg_stat_activity for `dblock status`: no extra round trip.
        sql.annotate(|text| {
            write_comment(
                text,
                req.namespace,
                req.name,
                Some(req.scope),
                waiting_since,
            )
        });
        Plan {
            sql,
            scope: req.scope,
            key: req.key,
            mode: req.mode,
            lease: req.lease.is_some(),
            must_be_true,
            token_at,
            sliced,
            any: any.is_some(),
        }
    }

    /// From the first values of [`Plan::wanted`], for a request for any of several
    /// keys: the index of the key granted, if one was.
    pub(crate) fn granted_slot(&self, firsts: &[Option<String>; 2]) -> Option<usize> {
        debug_assert!(self.any);
        firsts[0].as_deref()?.parse().ok()
    }

    /// The statements whose first values [`Plan::outcome`] reads.
    pub(crate) fn wanted(&self) -> [Option<usize>; 2] {
        [self.must_be_true, self.token_at]
    }

    /// From the first values of [`Plan::wanted`]: `None` if the lock was not obtained,
    /// `Some(token)` if it was.
    pub(crate) fn outcome(&self, firsts: &[Option<String>; 2]) -> Option<Option<i64>> {
        debug_assert!(!self.any);
        let [must_be_true, token] = firsts;
        if self.must_be_true.is_some() && must_be_true.as_deref() != Some("t") {
            return None;
        }
        match self.token_at {
            None => Some(None),
            // A fenced try returns no token row when the lock was not free.
            Some(_) => Some(token.as_deref()?.parse::<i64>().ok()),
        }
    }

    /// After a request that did not end with the lock held: leave the connection clean.
    /// `failed`: the request ended in an error, so the state it left is unknown (no
    /// transaction may be open); otherwise it ran to its end, with a transaction-scoped
    /// request's transaction open.
    pub(crate) fn clean_up(&self, conn: &Conn, failed: bool) {
        let sql = match self.scope {
            // A fenced request takes a session lock first (to bridge its token's commit):
            // it survives the ROLLBACK, so unlock it too (a no-op with a warning if the
            // request failed before taking it).
            Scope::Transaction if self.token_at.is_some() => format!(
                "ROLLBACK; {}",
                release_sql(Scope::Session, self.mode, self.key, false)
            ),
            // Ends the transaction, failed or not (a warning if there is none).
            Scope::Transaction => {
                conn.send_release(Release::Rollback { chain: !failed });
                return;
            }
            // A session lock may have been granted before a later statement failed:
            // unlock it, and end the implicit transaction if one is open. Unlocking a
            // lock not held is a no-op with a warning.
            Scope::Session => format!(
                "ROLLBACK; {}",
                release_sql(Scope::Session, self.mode, self.key, self.lease)
            ),
        };
        conn.send(&sql);
    }
}

/// Writes the statement of an [`Any`] request (`scope`: `"_xact"` or `""`); returns its
/// index.
fn push_any(sql: &mut LockSql, any: Any<'_>, scope: &str, try_: bool) -> usize {
    use std::fmt::Write;
    let n = any.keys.len();
    let mut text = String::from("SELECT CASE");
    for i in 0..n {
        let slot = (any.start + i) % n;
        let _ = write!(
            text,
            " WHEN pg_try_advisory{scope}_lock({}) THEN {slot}",
            any.keys[slot].as_i64()
        );
    }
    if try_ {
        text.push_str(" ELSE NULL END");
    } else {
        let _ = write!(
            text,
            " ELSE (SELECT {s} FROM pg_advisory{scope}_lock({}) AS w) END",
            any.keys[any.start % n].as_i64(),
            s = any.start % n
        );
    }
    sql.push(&[&text])
}

/// How many statements [`release_sql`] writes.
pub(crate) fn release_statements(scope: Scope, lease: bool) -> usize {
    match scope {
        Scope::Session if lease => 2,
        _ => 1,
    }
}

/// The statement that releases a held lock.
pub(crate) fn release_sql(scope: Scope, mode: Mode, key: Key, lease: bool) -> Cow<'static, str> {
    if scope == Scope::Session && lease {
        // The lease's idle_session_timeout must not outlive the lock on a pooled session.
        return Cow::Owned(format!(
            "{}; SET idle_session_timeout = DEFAULT",
            release_sql(scope, mode, key, false)
        ));
    }
    let f = match (scope, mode) {
        (Scope::Transaction, _) => return Cow::Borrowed("ROLLBACK"),
        (Scope::Session, Mode::Exclusive) => "SELECT pg_advisory_unlock(",
        (Scope::Session, Mode::Shared) => "SELECT pg_advisory_unlock_shared(",
    };
    let mut kbuf = [0u8; 20];
    let k = i64_text(key.as_i64(), &mut kbuf);
    let mut sql = String::with_capacity(f.len() + k.len() + 1);
    for part in [f, k, ")"] {
        sql.push_str(part);
    }
    Cow::Owned(sql)
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Plan {
        fn new_t(req: &Req<'_>, fence_table: Option<&str>) -> Plan {
            let mut p = Plan::new(req, fence_table.map(|t| (t, true)), false, true, None);
            p.sql.strip_annotation();
            p
        }
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

    #[test]
    fn a_plain_transaction_lock_is_one_message() {
        // A wait is one slice at most (see WAIT_SLICE_MS).
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Forever, false),
            None,
        );
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = 2000; \
             SELECT pg_advisory_xact_lock(42)"
        );
        assert!(p.sliced);
        let p = Plan::new_t(
            &req(Scope::Session, Mode::Exclusive, Wait::Forever, false),
            None,
        );
        assert_eq!(
            p.sql.alone(),
            "SELECT set_config('lock_timeout', '2000', true); SELECT pg_advisory_lock(42)"
        );
        let p = Plan::new_t(&req(Scope::Session, Mode::Shared, Wait::Try, false), None);
        assert_eq!(p.sql.alone(), "SELECT pg_try_advisory_lock_shared(42)");
        assert_eq!(p.must_be_true, Some(0));
    }

    #[test]
    fn a_request_for_any_of_several_keys_is_one_statement() {
        let keys = [Key::from_i64(10), Key::from_i64(11), Key::from_i64(12)];
        let any = Some(Any {
            keys: &keys,
            start: 1,
        });
        let r = req(Scope::Transaction, Mode::Exclusive, Wait::Forever, false);
        let mut p = Plan::build(&r, None, false, true, any, None);
        p.sql.strip_annotation();
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = 500; \
             SELECT CASE WHEN pg_try_advisory_xact_lock(11) THEN 1 \
             WHEN pg_try_advisory_xact_lock(12) THEN 2 WHEN pg_try_advisory_xact_lock(10) THEN 0 \
             ELSE (SELECT 1 FROM pg_advisory_xact_lock(11) AS w) END"
        );
        assert!(p.sliced);
        assert_eq!(p.wanted(), [Some(2), None]);
        assert_eq!(p.granted_slot(&[Some("2".into()), None]), Some(2));
        assert_eq!(p.granted_slot(&[None, None]), None);
        let r = req(Scope::Session, Mode::Exclusive, Wait::Try, false);
        let mut p = Plan::build(&r, None, false, true, any, None);
        p.sql.strip_annotation();
        assert_eq!(
            p.sql.alone(),
            "SELECT CASE WHEN pg_try_advisory_lock(11) THEN 1 \
             WHEN pg_try_advisory_lock(12) THEN 2 WHEN pg_try_advisory_lock(10) THEN 0 ELSE NULL END"
        );
    }

    #[test]
    fn every_request_names_its_lock_in_a_comment_the_chained_form_keeps() {
        let since = SystemTime::now();
        for (scope, fenced, waiting) in [
            (Scope::Transaction, false, None),
            (Scope::Session, false, Some(since)),
            (Scope::Transaction, true, None),
        ] {
            let p = Plan::new(
                &req(scope, Mode::Exclusive, Wait::Forever, fenced),
                Some(("\"public\".dblock_fencing", true)),
                false,
                true,
                waiting,
            );
            let key = Key::derive("public", "it's");
            for text in [
                p.sql.alone().to_string(),
                Release::Rollback { chain: true }
                    .carried_by(&p.sql)
                    .0
                    .into_owned(),
            ] {
                // The test request's key is 42, not the name's: parse the comment alone.
                let c = crate::status::parse_comments(&text);
                assert_eq!(c.len(), 1, "{text}");
                assert_eq!(c[0].key(), key);
                assert_eq!(c[0].scope, Some(scope));
                assert_eq!(c[0].since.is_some(), waiting.is_some(), "{text}");
                // The statements are unchanged: the comment ends the last one.
                assert!(text.ends_with(" */"), "{text}");
            }
        }
    }

    #[test]
    fn a_deadline_becomes_a_server_side_lock_timeout() {
        let until = Instant::now() + Duration::from_secs(5);
        let p = Plan::new_t(
            &req(
                Scope::Transaction,
                Mode::Exclusive,
                Wait::Until(until),
                false,
            ),
            None,
        );
        assert!(
            p.sql.alone().contains("SET LOCAL lock_timeout = "),
            "{}",
            p.sql.alone()
        );
        let p = Plan::new_t(
            &req(Scope::Session, Mode::Exclusive, Wait::Until(until), false),
            None,
        );
        assert!(
            p.sql
                .alone()
                .starts_with("SELECT set_config('lock_timeout', "),
            "{}",
            p.sql.alone()
        );
        // A deadline already past is a try: lock_timeout = 0 would wait forever.
        let p = Plan::new_t(
            &req(
                Scope::Session,
                Mode::Exclusive,
                Wait::Until(Instant::now()),
                false,
            ),
            None,
        );
        assert_eq!(p.sql.alone(), "SELECT pg_try_advisory_lock(42)");
    }

    #[test]
    fn a_fenced_transaction_lock_commits_its_token_under_a_bridging_session_lock() {
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Forever, true),
            Some("\"public\".dblock_fencing"),
        );
        let stmts: Vec<&str> = p.sql.alone().split("; ").collect();
        // The token's commit is durable whatever the server's synchronous_commit.
        assert_eq!(stmts[1], "SET LOCAL synchronous_commit = on");
        assert_eq!(stmts[2], "SET LOCAL lock_timeout = 2000");
        assert_eq!(stmts[3], "SELECT pg_advisory_lock(42)");
        assert!(stmts[4].starts_with("INSERT INTO \"public\".dblock_fencing"));
        assert!(
            stmts[4].contains("E'it''s'"),
            "names are quoted: {}",
            stmts[4]
        );
        assert_eq!(stmts[5], "COMMIT");
        assert_eq!(stmts[7], "SELECT pg_try_advisory_xact_lock(42)");
        assert_eq!(stmts[8], "SELECT pg_advisory_unlock(42)");
        assert_eq!(p.token_at, Some(4));
        assert_eq!(p.must_be_true, Some(7));
        // A fenced try bounds its wait on the fencing row.
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, true),
            Some("\"public\".dblock_fencing"),
        );
        assert!(
            p.sql.alone().contains("SET LOCAL lock_timeout = 100"),
            "{}",
            p.sql.alone()
        );
    }

    #[test]
    fn a_lock_request_can_carry_a_rollback() {
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
            None,
        );
        assert_eq!(
            p.sql.carrying_rollback(),
            "ROLLBACK; BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_try_advisory_xact_lock(42)"
        );
        assert_eq!(p.wanted(), [Some(1), None]);
        assert_eq!(p.outcome(&[Some("t".into()), None]), Some(None));
        assert_eq!(p.outcome(&[Some("f".into()), None]), None);
    }

    #[test]
    fn a_session_release_is_carried_in_a_transaction_of_its_own_where_it_must_be() {
        for (mode, lease) in [
            (Mode::Exclusive, false),
            (Mode::Shared, false),
            (Mode::Exclusive, true),
        ] {
            let sql = release_sql(Scope::Session, mode, Key::from_i64(7), lease);
            let statements = release_statements(Scope::Session, lease);
            assert_eq!(sql.split("; ").count(), statements, "{sql}");
            let r = Release::Unlock { sql, statements };
            let p = Plan::new_t(
                &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
                None,
            );
            let (text, skip) = r.carried_by(&p.sql);
            assert!(
                text.starts_with("BEGIN; SELECT pg_advisory_unlock"),
                "{text}"
            );
            let stmts: Vec<&str> = text.split("; ").collect();
            assert_eq!(stmts[skip - 1], "COMMIT");
            assert_eq!(stmts[skip..].join("; "), p.sql.alone());
            // Before a request that begins no transaction, a lone unlock joins its
            // implicit one; a lease's (a SET besides) keeps a transaction of its own.
            let p = Plan::new_t(
                &req(Scope::Session, Mode::Exclusive, Wait::Try, false),
                None,
            );
            let (text, skip) = r.carried_by(&p.sql);
            let stmts: Vec<&str> = text.split("; ").collect();
            assert_eq!(stmts[skip..].join("; "), p.sql.alone());
            if lease {
                assert!(text.starts_with("BEGIN; "), "{text}");
            } else {
                assert_eq!(skip, 1);
                assert!(text.starts_with("SELECT pg_advisory_unlock"), "{text}");
            }
        }
        assert_eq!(release_statements(Scope::Transaction, true), 1);
        assert_eq!(Release::Rollback { chain: true }.sql(), "ROLLBACK");
    }

    #[test]
    fn a_carried_rollback_chains_only_a_transaction_known_to_be_open() {
        let p = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
            None,
        );
        let (text, skip) = Release::Rollback { chain: true }.carried_by(&p.sql);
        assert_eq!(
            text,
            "ROLLBACK AND CHAIN; SELECT pg_try_advisory_xact_lock(42)"
        );
        assert_eq!(
            skip, 0,
            "AND CHAIN stands in for the BEGIN: same statements"
        );
        let (text, skip) = Release::Rollback { chain: false }.carried_by(&p.sql);
        assert_eq!(text, format!("ROLLBACK; {}", p.sql.alone()));
        assert_eq!(skip, 1);
        // A server without AND CHAIN, or a request that does not begin a transaction.
        let mut old = Plan::new(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Try, false),
            None,
            false,
            false,
            None,
        );
        old.sql.strip_annotation();
        assert_eq!(Release::Rollback { chain: true }.carried_by(&old.sql).1, 1);
        let session = Plan::new_t(
            &req(Scope::Session, Mode::Exclusive, Wait::Try, false),
            None,
        );
        let (text, skip) = Release::Rollback { chain: true }.carried_by(&session.sql);
        assert_eq!(text, "ROLLBACK; SELECT pg_try_advisory_lock(42)");
        assert_eq!(skip, 1);
        // A fenced request chains its first BEGIN only.
        let fenced = Plan::new_t(
            &req(Scope::Transaction, Mode::Exclusive, Wait::Forever, true),
            Some("\"public\".dblock_fencing"),
        );
        let (text, _) = Release::Rollback { chain: true }.carried_by(&fenced.sql);
        assert!(
            text.starts_with("ROLLBACK AND CHAIN; SET LOCAL synchronous_commit = on; "),
            "{text}"
        );
        assert_eq!(
            text.matches("BEGIN ISOLATION LEVEL READ COMMITTED").count(),
            1
        );
    }
}
