//! Many locks at once on PostgreSQL ([`Locks::lock_all`]): every key in one message on
//! one pinned connection, all or nothing.
//!
//! A round is one message: `BEGIN; SELECT coalesce((SELECT i - 1 FROM unnest('{k₀,k₁,…}'
//! ::bigint[]) WITH ORDINALITY AS t(k, i) WHERE NOT pg_try_advisory_xact_lock(k) LIMIT
//! 1), -1)`. It tries the keys in their order (ascending: the caller sorts them) and
//! stops at the first that is busy, answering its index; `-1` means every key is held,
//! in that transaction, and the grant is made. When the names are free that is the whole acquisition: one round
//! trip, whatever their number.
//!
//! Otherwise the round's transaction is rolled back (nothing stays held) and, if the
//! request may wait, the next round first *waits* for the busy key — holding nothing
//! else, for at most one slice of the wait (`lock_timeout`) — and then tries them all
//! again in the same message. So a request never waits while it holds a key: two
//! requests for overlapping sets, or a request and a holder of single locks taken in any
//! order, cannot deadlock; and each message waits for one key at most, so a deadline is
//! kept to within a round trip. The price: a request whose names keep being taken by
//! others between its rounds goes round again (each round waits in the server's line for
//! the key that stopped the last one).
//!
//! [`Locks::lock_all`]: crate::Locks::lock_all

use std::time::Duration;

use tokio::time::Instant;

use super::held::Pinned;
use super::plan::{MAX_SERVER_MS, WAIT_SLICE_MS};
use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::postgres::backend::{BACKSTOP, POOLER_GRACE, PgBackend, server_ended};
use crate::postgres::conn::pooler::Pooler;
use crate::postgres::conn::wire::{LockSql, QueryError, Release};
use crate::postgres::conn::{Armed, Conn};
use crate::raw::{Grant, Mode, Req, Scope, Wait, acquire_all_in_order};

/// One round of a request for every one of `keys`.
pub(crate) struct AllPlan {
    pub(crate) sql: LockSql,
    /// The statement that tries every key: the index of the first busy one, or -1.
    case_at: usize,
    scope: Scope,
    lease: bool,
    /// Whether the server's lock_timeout is shorter than the wait asked for.
    sliced: bool,
}

impl AllPlan {
    /// The round that waits first for `keys[wait_on]`, if given, then tries all `keys`.
    pub(crate) fn new(
        req: &Req<'_>,
        keys: &[Key],
        wait_on: Option<usize>,
        check_disconnect: bool,
        chain: bool,
    ) -> AllPlan {
        let shared = if req.mode == Mode::Shared {
            "_shared"
        } else {
            ""
        };
        let (xact, try_fn) = match req.scope {
            Scope::Transaction => ("_xact", "pg_try_advisory_xact_lock"),
            Scope::Session => ("", "pg_try_advisory_lock"),
        };
        // The wait, as plan.rs bounds it: whole milliseconds, at least 1, at most a slice.
        let mut sliced = false;
        let wait_ms = wait_on.map(|_| match req.wait {
            Wait::Until(t) => {
                let ms = t
                    .saturating_duration_since(Instant::now())
                    .as_micros()
                    .div_ceil(1000);
                sliced = ms > WAIT_SLICE_MS;
                ms.clamp(1, WAIT_SLICE_MS)
            }
            Wait::Forever | Wait::Try => {
                sliced = true;
                WAIT_SLICE_MS
            }
        });
        let lease_ms = req.lease.map(|l| l.as_millis().clamp(1, MAX_SERVER_MS));
        const CHECK: &str = "client_connection_check_interval";
        let mut sql = LockSql::new();
        match req.scope {
            Scope::Transaction => {
                sql.begin(chain);
                if check_disconnect {
                    sql.push(&[&format!("SET LOCAL {CHECK} = 250")]);
                }
                if let Some(ms) = lease_ms {
                    sql.push(&[&format!(
                        "SET LOCAL idle_in_transaction_session_timeout = {ms}"
                    )]);
                }
                if let Some(ms) = wait_ms {
                    sql.push(&[&format!("SET LOCAL lock_timeout = {ms}")]);
                }
            }
            Scope::Session => {
                if let Some(ms) = lease_ms {
                    sql.push(&[&format!(
                        "SELECT set_config('idle_session_timeout', '{ms}', false)"
                    )]);
                }
                if check_disconnect {
                    sql.push(&[&format!("SELECT set_config('{CHECK}', '250', true)")]);
                }
                if let Some(ms) = wait_ms {
                    sql.push(&[&format!("SELECT set_config('lock_timeout', '{ms}', true)")]);
                }
            }
        }
        if let Some(w) = wait_on.and_then(|w| keys.get(w)) {
            sql.push(&[&format!(
                "SELECT pg_advisory{xact}_lock{shared}({})",
                w.as_i64()
            )]);
        }
        let case_at = sql.push(&[&try_all(keys, try_fn, shared)]);
        AllPlan {
            sql,
            case_at,
            scope: req.scope,
            lease: req.lease.is_some(),
            sliced,
        }
    }

    /// The statement whose first value [`AllPlan::busy`] reads.
    pub(crate) fn wanted(&self) -> [Option<usize>; 1] {
        [Some(self.case_at)]
    }

    /// From the first value of [`AllPlan::wanted`]: `Ok(None)` when every key is held,
    /// `Ok(Some(i))` when `keys[i]` was busy; an error for any other answer.
    fn busy(&self, first: Option<&str>, n: usize) -> Result<Option<usize>, Error> {
        match first.and_then(|v| v.parse::<i64>().ok()) {
            Some(-1) => Ok(None),
            Some(i) if usize::try_from(i).is_ok_and(|i| i < n) => Ok(usize::try_from(i).ok()),
            _ => Err(Error::unexpected(format!(
                "unexpected answer to a lock_all request: {first:?}"
            ))),
        }
    }

    /// After a round that did not end with every key held: leave the connection clean
    /// (`failed`: the round ended in an error, so no transaction may be open).
    fn clean_up(&self, conn: &Conn, failed: bool) {
        match self.scope {
            Scope::Transaction => {
                conn.send_release(Release::Rollback { chain: !failed });
            }
            // The keys taken before the busy one are session locks: unlock them all (the
            // connection is this request's alone, and an idle one holds none).
            Scope::Session => {
                let reset = if self.lease {
                    "; SET idle_session_timeout = DEFAULT"
                } else {
                    ""
                };
                conn.send(&format!("ROLLBACK; SELECT pg_advisory_unlock_all(){reset}"));
            }
        }
    }
}

/// The statement that tries `keys` in their order and stops at the first busy one,
/// answering its index, or -1 when every key was taken:
///
/// `SELECT coalesce((SELECT i - 1 FROM unnest('{k₀,k₁,…}'::bigint[]) WITH ORDINALITY AS
/// t(k, i) WHERE NOT f(k) LIMIT 1), -1)`
///
/// `unnest` yields the keys in order and `LIMIT 1` stops at the first row its filter
/// passes, so the keys after a busy one are not tried. The function is resolved once:
/// a CASE with one call per key cost the server about 10 µs per key to parse (measured
/// here: 100 keys took ~2 ms, this form the time of a one-key statement).
fn try_all(keys: &[Key], try_fn: &str, shared: &str) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(160 + keys.len() * 21);
    text.push_str("SELECT coalesce((SELECT i - 1 FROM unnest('{");
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        let _ = write!(text, "{}", k.as_i64());
    }
    let _ = write!(
        text,
        "}}'::bigint[]) WITH ORDINALITY AS t(k, i) WHERE NOT {try_fn}{shared}(k) LIMIT 1), -1)"
    );
    text
}

/// The release of every key of a grant: the transaction's `ROLLBACK`, or one unlock of
/// all the session's advisory locks (answering `t`, as a held lock's unlock does).
pub(crate) fn release_all_sql(scope: Scope, lease: bool) -> (String, usize) {
    match (scope, lease) {
        (Scope::Transaction, _) => ("ROLLBACK".into(), 1),
        (Scope::Session, false) => ("SELECT true FROM pg_advisory_unlock_all()".into(), 1),
        (Scope::Session, true) => (
            "SELECT true FROM pg_advisory_unlock_all(); SET idle_session_timeout = DEFAULT".into(),
            2,
        ),
    }
}

impl PgBackend {
    /// Takes every one of `keys` (sorted, distinct) as `req` says, all or none.
    pub(crate) async fn acquire_all(
        &self,
        req: &Req<'_>,
        keys: &[Key],
    ) -> Result<Option<Grant>, Error> {
        if req.fenced || keys.len() < 2 {
            return acquire_all_in_order(self, req, keys).await;
        }
        self.refuse_unsupported(req)?;
        // A wait without a deadline ends where the server's own lock_timeout would have
        // ended it (as for one lock).
        let bounded;
        let req = match (req.wait, self.server_lock_timeout) {
            (Wait::Forever, Some(t)) => {
                let mut r = req.clone();
                r.wait = Instant::now()
                    .checked_add(t)
                    .map_or(Wait::Forever, Wait::Until);
                bounded = r;
                &bounded
            }
            _ => req,
        };
        let deadline = req.wait.deadline();
        let queued_bound = match (self.pooler.0, req.wait) {
            (Pooler::None, _) => None,
            (_, Wait::Until(d)) => Some(d + POOLER_GRACE),
            _ => None,
        };
        let mut wait_on = None;
        loop {
            if wait_on.is_some()
                && let Wait::Until(d) = req.wait
                && d.saturating_duration_since(Instant::now()) < Duration::from_millis(1)
            {
                return Ok(None);
            }
            let conn = match queued_bound {
                Some(b) => {
                    match tokio::time::timeout_at(b, self.source.get_until(deadline)).await {
                        Ok(c) => c?,
                        Err(_) => return Ok(None),
                    }
                }
                None => self.source.get_until(deadline).await?,
            };
            let plan = AllPlan::new(
                req,
                keys,
                wait_on,
                self.check_disconnect,
                self.version >= 120_000,
            );
            let armed = Armed::new(conn);
            let request = armed.conn().lock_query(&plan.sql, plan.wanted());
            let bound = match (queued_bound, deadline) {
                (Some(b), _) => Some(b),
                (None, Some(d)) => Some(d.max(Instant::now()) + BACKSTOP),
                // No deadline: a round waits one slice at most (server-side).
                (None, None) => None,
            };
            let result = match bound {
                Some(b) => match tokio::time::timeout_at(b, request).await {
                    Ok(r) => r,
                    Err(_) => {
                        drop(armed); // abandons: cancels on the server, closes
                        return match queued_bound {
                            Some(_) => Ok(None),
                            None => Err(Error::Timeout {
                                waiting_for: WaitingFor::ServerReply,
                                after: Some(BACKSTOP),
                            }),
                        };
                    }
                },
                None => request.await,
            };
            let conn = armed.disarm();
            match result {
                Ok([first]) => match plan.busy(first.as_deref(), keys.len()) {
                    Ok(None) => {
                        conn.link().set_holding(true);
                        let (release, statements) = release_all_sql(req.scope, req.lease.is_some());
                        return Ok(Some(Grant {
                            held: Box::new(Pinned::with_release(
                                conn,
                                req.scope,
                                release.into(),
                                statements,
                                self.check_timeout,
                            )),
                            fence: None,
                        }));
                    }
                    Ok(Some(busy)) => {
                        plan.clean_up(&conn, false);
                        conn.recycle();
                        let ahead = match req.wait {
                            Wait::Forever => true,
                            Wait::Until(d) => Instant::now() < d,
                            Wait::Try => false,
                        };
                        if !ahead {
                            return Ok(None);
                        }
                        wait_on = Some(busy);
                    }
                    Err(e) => {
                        plan.clean_up(&conn, true);
                        conn.recycle();
                        return Err(e);
                    }
                },
                Err(QueryError::Db { code, message }) => {
                    plan.clean_up(&conn, true);
                    conn.recycle();
                    // One slice of the wait for the busy key ended: wait on.
                    match server_ended(req, plan.sliced, &code, message) {
                        None => continue,
                        Some(Ok(())) => return Ok(None),
                        Some(Err(e)) => return Err(e),
                    }
                }
                Err(e @ QueryError::Lost { .. }) => return Err(e.into_error()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(scope: Scope, wait: Wait) -> Req<'static> {
        Req {
            namespace: "public",
            name: "set",
            key: Key::from_i64(1),
            mode: Mode::Exclusive,
            scope,
            wait,
            fenced: false,
            lease: None,
            fence_key: None,
        }
    }

    #[test]
    fn free_names_are_one_message_of_one_statement() {
        let keys = [Key::from_i64(-5), Key::from_i64(3), Key::from_i64(9)];
        let p = AllPlan::new(
            &req(Scope::Transaction, Wait::Forever),
            &keys,
            None,
            false,
            true,
        );
        assert_eq!(
            p.sql.alone(),
            "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT coalesce((SELECT i - 1 FROM \
             unnest('{-5,3,9}'::bigint[]) WITH ORDINALITY AS t(k, i) \
             WHERE NOT pg_try_advisory_xact_lock(k) LIMIT 1), -1)"
        );
        assert_eq!(p.wanted(), [Some(1)]);
        assert_eq!(p.busy(Some("-1"), 3).unwrap(), None);
        assert_eq!(p.busy(Some("1"), 3).unwrap(), Some(1));
        assert!(p.busy(Some("3"), 3).is_err());
        assert!(p.busy(None, 3).is_err());
    }

    #[test]
    fn a_later_round_waits_for_the_busy_key_alone_then_tries_all() {
        let keys = [Key::from_i64(1), Key::from_i64(2)];
        let p = AllPlan::new(
            &req(Scope::Session, Wait::Forever),
            &keys,
            Some(1),
            false,
            true,
        );
        assert_eq!(
            p.sql.alone(),
            "SELECT set_config('lock_timeout', '2000', true); SELECT pg_advisory_lock(2); \
             SELECT coalesce((SELECT i - 1 FROM unnest('{1,2}'::bigint[]) WITH ORDINALITY \
             AS t(k, i) WHERE NOT pg_try_advisory_lock(k) LIMIT 1), -1)"
        );
        assert!(p.sliced);
        assert_eq!(release_all_sql(Scope::Session, false).1, 1);
        assert_eq!(release_all_sql(Scope::Session, true).1, 2);
    }
}
