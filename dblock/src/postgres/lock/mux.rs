//! Many session locks over a few shared connections ([`Builder::multiplex`]).
//!
//! One connection per lock is the right default — it is what makes a lock cost one
//! round trip and a wait cost nothing — but a process that holds thousands of locks at
//! once (a lock per tenant, per shard, per file) would need thousands of connections.
//! With multiplexing, session-scoped locks are taken with `pg_try_advisory_lock` on one
//! of at most `n` shared connections, many locks per connection, each released on its
//! own by `pg_advisory_unlock` (as .NET's DistributedLock multiplexes).
//!
//! - **No two owners.** PostgreSQL's locks are re-entrant per session, so a key is
//!   taken on a shared connection only if this process holds it on none of them; a
//!   second local request for a key already held goes to a connection of its own, where
//!   the server arbitrates as between any two sessions.
//! - **Order.** Every request and release of one key goes to the same shared connection
//!   (key mod `n`), whose requests the server runs in order, so a release is always
//!   applied before a later request for the key.
//! - **Waiting never blocks a shared connection.** A lock that is not free at once is
//!   waited for on a connection of its own (the non-multiplexed path).
//! - **Nothing leaves a transaction open.** Requests on shared connections are single
//!   statements or implicit transactions, never `BEGIN` … `COMMIT`, so a failing
//!   request cannot leave the connection in an aborted transaction for the others.
//! - **A full lock table** fails the request with [`Error::LockTableFull`]; the locks
//!   already held, on every connection, stay held.
//!
//! [`Builder::multiplex`]: crate::Builder::multiplex

use std::collections::HashSet;
use std::sync::Arc;

use crate::error::{Error, LossReason};
use crate::key::Key;
use crate::postgres::conn::native::NativeConn;
use crate::postgres::conn::pool::Pool;
use crate::postgres::conn::wire::{Link, QueryError};
use crate::postgres::sql::first_value;
use crate::postgres::store::token::next_token_sql;
use crate::raw::{BoxFuture, Grant, RawHeld, Req, Scope};
use crate::sync::Mutex;

use super::messages::{Release, take_first, write_lock_call};
use super::plan::{Answer, read_one};

pub(crate) struct Mux {
    inner: Arc<MuxInner>,
}

struct MuxInner {
    pool: Pool,
    /// The shared connections, opened on first use, replaced when lost.
    slots: Vec<tokio::sync::Mutex<Option<Arc<NativeConn>>>>,
    /// Keys this process holds (or is taking) on a shared connection.
    claims: crate::sync::Arc<Claims>,
}

/// The outcome of a multiplexed attempt.
pub(crate) enum Attempt {
    Granted(Grant),
    /// The server says another session holds it: the caller waits on a connection of
    /// its own if the request may wait.
    NotFree,
    /// This process already holds (or is taking) the key on a shared connection: the
    /// request goes to a connection of its own, where the server decides (a second
    /// shared holder is granted at once).
    HeldHere,
}

impl Mux {
    /// How many shared connections it keeps.
    pub(crate) fn width(&self) -> usize {
        self.inner.slots.len()
    }

    pub(crate) fn new(pool: Pool, n: usize) -> Mux {
        Mux {
            inner: Arc::new(MuxInner {
                pool,
                slots: (0..n.max(1))
                    .map(|_| tokio::sync::Mutex::new(None))
                    .collect(),
                claims: Default::default(),
            }),
        }
    }

    /// Whether this request is one for the shared connections. Fenced requests are not:
    /// they may wait on the fencing row for a previous holder's write to commit, and no
    /// request may wait on a shared connection.
    pub(crate) fn applies(req: &Req<'_>) -> bool {
        req.scope == Scope::Session && req.lease.is_none() && !req.fenced
    }

    async fn conn(&self, key: i64) -> Result<Arc<NativeConn>, Error> {
        let i = (key as u64 % self.inner.slots.len() as u64) as usize;
        let mut slot = self.inner.slots[i].lock().await;
        if let Some(c) = slot.as_ref().filter(|c| c.usable()) {
            return Ok(c.clone());
        }
        let c = Arc::new(self.inner.pool.connect_unpooled().await?);
        // Shared connections hold locks for their whole life: always checked.
        c.link().set_watched(true);
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Tries `req`'s key on its shared connection.
    pub(crate) async fn try_acquire(
        &self,
        req: &Req<'_>,
        fence_table: Option<&Arc<str>>,
        epoch: bool,
    ) -> Result<Attempt, Error> {
        let k = req.key.as_i64();
        // Claim the key first: never two requests for one key on a shared connection.
        let Some(mut claim) = Claims::claim(&self.inner.claims, k) else {
            return Ok(Attempt::HeldHere);
        };
        let conn = self.conn(k).await?;
        let mut sql = match fence_table {
            Some(table) => next_token_sql(table, req, &take_first(req.key), epoch),
            None => {
                let mut sql = String::new();
                write_lock_call(&mut sql, Scope::Session, req.mode, req.key, true);
                sql
            }
        };
        // Names the lock while the request runs (a shared connection's later requests
        // and checks replace it: `dblock status` names multiplexed locks only so long).
        crate::status::write_comment(&mut sql, req.namespace, req.name, Some(req.scope), None);
        let unlock = Release::of_one(Scope::Session, req.mode, req.key, false)
            .sql()
            .to_string();
        // From here on, however this ends — this future dropped mid-request, an error
        // (a fenced request may have taken the lock before its INSERT failed), an answer
        // that cannot be read — the unlock is queued behind the request on the same
        // connection, once, before the claim leaves: the key ends up free.
        claim.owe(ConnUnlock {
            conn: conn.clone(),
            sql: unlock,
        });
        let rows = conn.query(&sql).await.map_err(QueryError::into_error)?;
        // Read as a pinned connection's round is: an answer that is neither a grant nor
        // a refusal is an error, and whatever it took is unlocked.
        let first = first_value(&rows, 0);
        let answer = match fence_table {
            Some(_) => read_one([None, Some(0)], None, first.as_deref()),
            None => read_one([Some(0), None], first.as_deref(), None),
        };
        let token = match answer? {
            Answer::Granted { token, .. } => token,
            Answer::NotGranted | Answer::Busy(_) => {
                // The server took nothing: nothing to unlock.
                claim.settle();
                return Ok(Attempt::NotFree);
            }
        };
        Ok(Attempt::Granted(Grant {
            held: Box::new(MuxHeld { conn, claim }),
            fence: token.zip(fence_table.cloned()),
        }))
    }
}

/// The keys this process holds (or is taking) on a shared connection, at most one claim
/// each: PostgreSQL's locks are re-entrant per session, so a second claim on one shared
/// session would make two holders. The concurrent core of multiplexing, which the loom
/// models (`postgres/loom_models.rs`) run.
#[derive(Default)]
pub(crate) struct Claims {
    held: Mutex<HashSet<i64>>,
}

/// Queues the unlock of a claimed key on its shared connection (without waiting).
pub(crate) trait Unlock {
    fn unlock(&self);
}

impl Claims {
    /// Claims `key`; `None` if this process holds or is taking it already.
    pub(crate) fn claim<U: Unlock>(
        claims: &crate::sync::Arc<Claims>,
        key: i64,
    ) -> Option<Claim<U>> {
        crate::sync::lock(&claims.held).insert(key).then(|| Claim {
            claims: claims.clone(),
            key,
            owed: None,
        })
    }
}

/// A claim on a key, and the unlock owed once the key's lock call is on its way. Dropped,
/// it queues the owed unlock, then leaves the table: a later request for the key, which
/// must claim it first, queues behind the unlock on the same connection.
pub(crate) struct Claim<U: Unlock> {
    claims: crate::sync::Arc<Claims>,
    key: i64,
    owed: Option<U>,
}

impl<U: Unlock> Claim<U> {
    pub(crate) fn key(&self) -> i64 {
        self.key
    }

    /// The key's lock call is about to be queued: from now on the key is unlocked through
    /// `by` when the claim ends, unless [`Claim::settle`]d.
    pub(crate) fn owe(&mut self, by: U) {
        self.owed = Some(by);
    }

    /// Nothing is owed any more (the server took nothing, or the caller queues the unlock
    /// itself, now): the owed unlock, if any.
    pub(crate) fn settle(&mut self) -> Option<U> {
        self.owed.take()
    }
}

impl<U: Unlock> Drop for Claim<U> {
    fn drop(&mut self) {
        if let Some(u) = self.owed.take() {
            u.unlock();
        }
        crate::sync::lock(&self.claims.held).remove(&self.key);
    }
}

/// The unlock of a key on its shared connection.
pub(crate) struct ConnUnlock {
    conn: Arc<NativeConn>,
    sql: String,
}

impl Unlock for ConnUnlock {
    fn unlock(&self) {
        self.conn.send(&self.sql);
    }
}

/// A lock held on a shared connection: dropped, its claim queues the unlock.
pub(crate) struct MuxHeld {
    conn: Arc<NativeConn>,
    claim: Claim<ConnUnlock>,
}

impl MuxHeld {
    fn link(&self) -> &Arc<Link> {
        self.conn.link()
    }

    fn loss(&self) -> Option<LossReason> {
        self.conn.link().loss()
    }

    async fn check(&mut self) -> Result<(), Error> {
        if let Some(reason) = self.loss() {
            return Err(Error::LockLost { reason });
        }
        // Cancel safe: if it is cancelled, the reply is read and dropped by the
        // connection, and nothing is left to undo.
        match self.conn.query("").await {
            Ok(_) => Ok(()),
            Err(QueryError::Lost { message }) => Err(Error::LockLost {
                reason: LossReason::ConnectionClosed { message },
            }),
            Err(e) => Err(e.into_error()),
        }
    }

    async fn release(mut self) -> Result<(), Error> {
        if let Some(reason) = self.loss() {
            return Err(Error::LockLost { reason });
        }
        // Sent here, and awaited: settled, so that the claim's end does not send it
        // again. The query queues it in its first poll, this one, so a future dropped
        // before the reply has sent it already (and one dropped before its first poll
        // never settled: dropping `self` sends it).
        let Some(unlock) = self.claim.settle() else {
            return Ok(());
        };
        let res = self.conn.query(&unlock.sql).await;
        match res {
            Ok(rows) if first_value(&rows, 0).as_deref() == Some("t") => Ok(()),
            Ok(_) => Err(Error::LockLost {
                reason: LossReason::ConnectionClosed {
                    message: "the shared session no longer held the lock".into(),
                },
            }),
            Err(QueryError::Lost { message }) => Err(Error::LockLost {
                reason: LossReason::ConnectionClosed { message },
            }),
            Err(e) => Err(e.into_error()),
        }
    }
}

impl RawHeld for MuxHeld {
    fn loss(&self) -> Option<LossReason> {
        MuxHeld::loss(self)
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        Box::pin(self.link().lost())
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(MuxHeld::check(self))
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(MuxHeld::release(*self))
    }
}

impl std::fmt::Debug for MuxHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxHeld")
            .field("key", &Key::from_i64(self.claim.key()))
            .finish()
    }
}
