//! One acquisition on PostgreSQL, whatever it takes — one key, any one of several, all
//! of a set — in one round loop: take a connection, send the round's message (see
//! `plan`), read its answer, then grant, or clean up and wait on in a new round, or
//! give up. A request whose keys are free is one round: one round trip on a pinned
//! connection.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::held::Pinned;
use super::mux;
use super::plan::{Answer, Plan, Round, Server, Slice, WAIT_SLICE_MS, What};
use super::relay;
use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::postgres::backend::{PgBackend, Source};
use crate::postgres::conn::pooler::Pooler;
use crate::postgres::conn::wire::{QueryError, Value};
use crate::postgres::conn::{Armed, Conn};
use crate::raw::{
    Grant, Req, Scope, Token, Wait, acquire_all_in_order, acquire_any_in_turn, check_lease,
};

/// How long past a deadline the client waits for the server's own lock_timeout to
/// answer before giving the connection up.
pub(crate) const BACKSTOP: Duration = Duration::from_secs(2);

/// Behind a pooler, how long past a deadline the client waits for the server's answer
/// before it gives the request up (the server's own lock_timeout normally answers at
/// the deadline; a request still queued in the pooler never would).
pub(crate) const POOLER_GRACE: Duration = Duration::from_millis(100);

const LOCK_NOT_AVAILABLE: &str = "55P03";

const QUERY_CANCELED: &str = "57014";

/// A round's reply: the first values [`Plan::wanted`] asked for, or the failure.
type Reply = Result<[Option<Value>; 2], QueryError>;

/// What follows a round.
enum Then {
    /// The request is over: granted (the slot and the grant) or not.
    Done(Option<(usize, Grant)>),
    /// A new round: one slice of the wait ended, or a lock set's key `busy` stopped
    /// this one.
    Again { busy: Option<usize> },
}

/// How long a request waits for a connection and for the server's answer.
struct Bounds {
    /// The request's deadline, if it has one.
    deadline: Option<Instant>,
    /// Behind a pooler, with a deadline: when the request is given up even if the
    /// server never answered (it may sit in the pooler's queue, which the server's
    /// lock_timeout does not count).
    queued: Option<Instant>,
}

impl Bounds {
    fn of(wait: Wait, pooler: Pooler) -> Bounds {
        Bounds {
            deadline: wait.deadline(),
            queued: match (pooler, wait) {
                (Pooler::None, _) => None,
                (_, Wait::Until(d)) => Some(d + POOLER_GRACE),
                _ => None,
            },
        }
    }

    /// When to stop waiting for the server's answer: the server ends the wait
    /// (lock_timeout) and this is a backstop for a server that stops answering, or,
    /// behind a pooler, the caller's deadline kept here too.
    fn answer_by(&self) -> Option<Instant> {
        match (self.queued, self.deadline) {
            (Some(q), _) => Some(q),
            (None, Some(d)) => Some(d.max(Instant::now()) + BACKSTOP),
            // No deadline: a round waits one slice at most (server-side).
            (None, None) => None,
        }
    }

    /// How a request the server did not answer by [`Bounds::answer_by`] ends: not
    /// obtained by the deadline, counting the pooler's queue; else the server stopped
    /// answering.
    fn unanswered(&self) -> Result<Option<(usize, Grant)>, Error> {
        match self.queued {
            Some(_) => Ok(None),
            None => Err(Error::Timeout {
                waiting_for: WaitingFor::ServerReply,
                after: Some(BACKSTOP),
            }),
        }
    }
}

impl PgBackend {
    /// Takes a lock as `req` says: one round trip on a pinned connection.
    pub(crate) async fn acquire(&self, req: &Req<'_>) -> Result<Option<Grant>, Error> {
        Ok(self.take(req, What::One).await?.map(|(_, g)| g))
    }

    /// Takes any one of `keys`, `req.key` being the name's; the index of the key
    /// granted. A fenced request, or one a multiplexing handle would take on a shared
    /// connection, takes them one by one instead.
    pub(crate) async fn acquire_any(
        &self,
        req: &Req<'_>,
        keys: &[Key],
    ) -> Result<Option<(usize, Grant)>, Error> {
        let multiplexed = self.mux.is_some() && mux::Mux::applies(req);
        if req.fenced || multiplexed || keys.is_empty() {
            return acquire_any_in_turn(self, req, keys).await;
        }
        self.take(req, What::AnyOf(keys)).await
    }

    /// Takes every one of `keys` (sorted, distinct) as `req` says, all or none: every
    /// key in one message on one pinned connection. A fenced request takes them one by
    /// one.
    pub(crate) async fn acquire_all(
        &self,
        req: &Req<'_>,
        keys: &[Key],
    ) -> Result<Option<Grant>, Error> {
        if req.fenced || keys.len() < 2 {
            return acquire_all_in_order(self, req, keys).await;
        }
        Ok(self.take(req, What::AllOf(keys)).await?.map(|(_, g)| g))
    }

    /// Refuses what the server or the path to it cannot do: a lease too short to be
    /// noticed in time or without `idle_session_timeout`; a session lock behind a
    /// transaction pooler.
    fn refuse_unsupported(&self, req: &Req<'_>) -> Result<(), Error> {
        if let Some(lease) = req.lease {
            // The one lease rule (raw.rs); the server's idle timeouts count whole
            // milliseconds, rounded up (plan.rs), so never shorter than `lease`.
            check_lease(lease, self.check_interval, self.check_timeout)?;
            if req.scope == Scope::Session && self.version < 140_000 {
                return Err(Error::unsupported(
                    crate::error::Capability::SessionLease,
                    "a lease on a session-scoped lock needs PostgreSQL 14 (idle_session_timeout)",
                ));
            }
        }
        if req.scope == Scope::Session {
            self.refuse_behind_pooler(
                "a session-scoped lock",
                "the pooler would hand the session, and the lock with it, to another client; \
                 use transaction-scoped locks (the default), or a URL that reaches PostgreSQL \
                 directly or through a session-pooling port (say so with pooler=session), \
                 or a pooler that pins a session lock's connection (pooler=pinning)",
                true,
            )?;
        }
        Ok(())
    }

    /// Takes `what` as `req` says, in rounds (see the module docs); the slot granted
    /// (0 unless `what` is any of several keys).
    async fn take(&self, req: &Req<'_>, what: What<'_>) -> Result<Option<(usize, Grant)>, Error> {
        match self.server_bound(req) {
            None => self.take_within(req, what).await,
            // Rare (an administrator's lock_timeout): boxed, so that every request's
            // future does not carry room for a second request.
            Some(bounded) => Box::pin(self.take_within(&bounded, what)).await,
        }
    }

    /// [`PgBackend::take`], with the request's wait as the server bounds it.
    async fn take_within(
        &self,
        req: &Req<'_>,
        what: What<'_>,
    ) -> Result<Option<(usize, Grant)>, Error> {
        self.refuse_unsupported(req)?;
        // The rare steps' futures are boxed where they are taken, so that every request's
        // future (boxed once, at the backend's seam) does not carry their room.
        if self.must_check() {
            Box::pin(self.trust(req.scope)).await?;
        }
        // A reference into the handle (set once): what every request's future keeps.
        let fence = match req.fenced {
            true => Some(
                Box::pin(self.fence_table())
                    .await
                    .map_err(|e| self.fencing_permission(e))?,
            ),
            false => None,
        };
        let epoch = self.fence_epoch.load(std::sync::atomic::Ordering::Relaxed);
        if let (What::One, Some(mux)) = (what, &self.mux)
            && mux::Mux::applies(req)
        {
            match Box::pin(mux.try_acquire(req)).await? {
                mux::Attempt::Granted(g) => return Ok(Some((0, g))),
                mux::Attempt::NotFree if req.wait == Wait::Try => return Ok(None),
                // Waiting never blocks a shared connection: wait on a connection of its own.
                mux::Attempt::NotFree | mux::Attempt::HeldHere => {}
            }
        }
        // Computed where used rather than kept: every request's future stays smaller.
        let bounds = || Bounds::of(req.wait, self.pooler.0);
        // Behind a task of this handle that holds or asks for the key, wait for it to
        // hand over the lock, or its turn to ask (`relay.rs`).
        let mut claim = None;
        if let (What::One, None, true) = (what, &self.mux, relay::takes_part(req)) {
            let relay = self.relays.of(req.scope);
            match relay.enter(req.key) {
                Ok(turn) => claim = Some(turn),
                // Boxed: inline, the wait in line would make every request's future larger.
                Err(line) => match Box::pin(relay::wait(line, bounds().deadline)).await {
                    None => return Ok(None),
                    Some(Ok(relay::Turn::Held(held))) => {
                        return Ok(Some((
                            0,
                            Grant {
                                held: crate::raw::Held::boxed(held),
                                fence: None,
                            },
                        )));
                    }
                    Some(Ok(relay::Turn::Ask(turn))) => claim = Some(turn.into_claim(relay)),
                    // Never (the relay outlives its lines): ask the server without a turn.
                    Some(Err(_)) => {}
                },
            }
        }
        // Made for each round rather than kept, like the bounds.
        let on = || Server {
            fence: fence.map(|t| (&**t, epoch)),
            check_disconnect: self.check_disconnect,
            chain: self.version >= 120_000,
            own_session: matches!(self.source, Source::Native(_)) && self.pooler.0 == Pooler::None,
        };
        let mut round = Round::first(what);
        round.try_first = Round::should_try_first(req, what, self.busy.recently(req.key));
        loop {
            if round.out_of_time(req.wait) {
                return Ok(None);
            }
            let Some(mut conn) = self.connection(bounds()).await? else {
                return Ok(None);
            };
            let slice = Slice::of_round(req, what, &round);
            // A whole slice is set once as the session's own lock_timeout, so that the
            // rounds that wait one (a name taken in turn, a long wait) send none.
            let mut plan = {
                let on = on();
                let session_slice =
                    on.own_session && slice.is_whole() && conn.set_session_slice(WAIT_SLICE_MS);
                Plan::build_in(req, what, &round, &on, slice, session_slice)
            };
            let by = bounds().answer_by();
            let Some((conn, reply)) = exchange(Armed::new(conn), &plan, by).await else {
                return bounds().unanswered();
            };
            match self.after(conn, req, &mut plan, reply, fence, &mut claim)? {
                Then::Done(granted) => return Ok(granted),
                Then::Again { busy } => round.next(what, busy),
            }
        }
    }

    /// A request without a deadline, on a server whose sessions have a `lock_timeout` of
    /// their own (an administrator's): its wait ends where that would have ended it, had
    /// dblock not replaced it with its slices.
    fn server_bound<'r>(&self, req: &Req<'r>) -> Option<Req<'r>> {
        match (req.wait, self.server_lock_timeout) {
            (Wait::Forever, Some(t)) => Some(Req {
                wait: Instant::now()
                    .checked_add(t)
                    .map_or(Wait::Forever, Wait::Until),
                ..req.clone()
            }),
            _ => None,
        }
    }

    /// A connection for the next round; `None` if the deadline passed while it sat in a
    /// pooler's queue.
    async fn connection(&self, bounds: Bounds) -> Result<Option<Conn>, Error> {
        // The timed wait (behind a pooler, with a deadline) boxed: inline, its timer and
        // the connection's future would make every request's future larger.
        match bounds.queued {
            Some(q) => match Box::pin(tokio::time::timeout_at(
                q,
                self.source.get_until(bounds.deadline),
            ))
            .await
            {
                Ok(c) => c.map(Some),
                Err(_) => Ok(None),
            },
            None => self.source.get_until(bounds.deadline).await.map(Some),
        }
    }

    /// What follows a round that was answered: a grant, or the connection cleaned up and
    /// then a new round, not obtained, or the error. (Inlined into the loop: called once a
    /// round, it saves moving the connection and the reply into a call.)
    #[inline(always)]
    fn after(
        &self,
        conn: Conn,
        req: &Req<'_>,
        plan: &mut Plan<'_>,
        reply: Reply,
        fence: Option<&Arc<str>>,
        claim: &mut Option<relay::Claim<'_, Pinned>>,
    ) -> Result<Then, Error> {
        let answer = match reply {
            Ok(firsts) => plan.read(&firsts),
            Err(QueryError::Db { code, message }) => {
                plan.clean_up(conn, true);
                return match server_ended(req, plan.sliced, &code, message) {
                    None => {
                        // A slice of the wait ended: the key is busy.
                        self.busy.mark(req.key);
                        Ok(Then::Again { busy: None })
                    }
                    Some(Ok(())) => Ok(Then::Done(None)),
                    Some(Err(e)) if req.fenced => Err(self.fencing_permission(e)),
                    Some(Err(e)) => Err(e),
                };
            }
            Err(e @ QueryError::Lost { .. }) => return Err(e.into_error()),
        };
        match answer {
            Ok(Answer::Granted { slot, token }) => {
                let mut held = Pinned::new(
                    conn,
                    plan.release(slot),
                    plan.check_sql(),
                    self.check_timeout,
                );
                held.baton = claim.take().and_then(relay::Claim::granted);
                let fence = token.zip(fence.cloned()).map(|(token, table)| Token {
                    token,
                    table,
                    lease: req.lease,
                });
                Ok(Then::Done(Some((
                    slot,
                    Grant {
                        held: crate::raw::Held::boxed(held),
                        fence,
                    },
                ))))
            }
            Ok(Answer::NotGranted) => {
                plan.clean_up(conn, false);
                match plan.tried_first && wait_ahead(req.wait) {
                    // The try found the key busy: wait for it in the next round, and let
                    // requests for it wait at once for a while.
                    true => {
                        self.busy.mark(req.key);
                        Ok(Then::Again { busy: None })
                    }
                    false => Ok(Then::Done(None)),
                }
            }
            Ok(Answer::Busy(busy)) => {
                plan.clean_up(conn, false);
                Ok(match wait_ahead(req.wait) {
                    true => Then::Again { busy: Some(busy) },
                    false => Then::Done(None),
                })
            }
            // Cleaned up as after a failure: whatever the round took is let go.
            Err(e) => {
                plan.clean_up(conn, true);
                Err(e)
            }
        }
    }
}

/// Sends `plan`'s message on `conn` and reads its reply by `answer_by` (see
/// [`Bounds::answer_by`]); `None` if the server did not answer in time (the connection
/// is then abandoned: cancelled on the server, closed). Cancelled, the connection is
/// abandoned too.
async fn exchange(
    armed: Armed,
    plan: &Plan<'_>,
    answer_by: Option<Instant>,
) -> Option<(Conn, Reply)> {
    // A reply awaited with a deadline is boxed: inline, its timer made every request's
    // future larger (a lock without a deadline, or a try, has none).
    let reply = match answer_by {
        Some(by) => {
            let reply = armed.conn().first_values(&plan.sql, plan.wanted());
            Box::pin(tokio::time::timeout_at(by, reply)).await.ok()?
        }
        None => armed.conn().first_values(&plan.sql, plan.wanted()).await,
    };
    Some((armed.disarm(), reply))
}

/// Whether some of the request's wait is left.
fn wait_ahead(wait: Wait) -> bool {
    match wait {
        Wait::Forever => true,
        Wait::Until(d) => Instant::now() < d,
        Wait::Try => false,
    }
}

/// How a round the server ended with error `code` ends its request: `None` to wait on
/// in a new round (one slice of the wait ended, see `WAIT_SLICE_MS`, and the caller's
/// deadline, if any, is still ahead); `Some(Ok(()))` not obtained; else the error.
fn server_ended(
    req: &Req<'_>,
    sliced: bool,
    code: &str,
    message: String,
) -> Option<Result<(), Error>> {
    if code == LOCK_NOT_AVAILABLE {
        if sliced && wait_ahead(req.wait) {
            return None;
        }
        return Some(match req.wait {
            Wait::Forever => Err(Error::Timeout {
                waiting_for: WaitingFor::LockServerLockTimeout,
                after: None,
            }),
            _ => Ok(()),
        });
    }
    if code == QUERY_CANCELED {
        return Some(Err(Error::Timeout {
            waiting_for: WaitingFor::LockServerStatementTimeout,
            after: None,
        }));
    }
    Some(Err(Error::from_sqlstate(code, message)))
}
