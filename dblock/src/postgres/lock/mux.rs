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
//! - **A transaction is open only while requests keep coming.** A request alone is one
//!   statement, its own transaction. While a lane stays busy (requests came while its
//!   message was out), or once its connection holds a thousand locks, its messages
//!   share one transaction, committed once nothing has come for a millisecond — or 1 µs
//!   for each lock the connection holds, up to 20 ms — and at least once a second
//!   however busy; never left open while the lane waits longer (and it turns a server's
//!   `idle_in_transaction_session_timeout` off for itself). A
//!   statement that fails rolls it back before anything else runs, so a failing
//!   request cannot leave the connection in an aborted transaction for the others;
//!   session locks and unlocks do not follow the transaction (PostgreSQL applies them
//!   at once and keeps them through a rollback), so a rollback loses no grant.
//! - **A full lock table** fails the request with [`Error::LockTableFull`]; the locks
//!   already held, on every connection, stay held.
//! - **A guard's check** goes through its lane, answered by the lane's next message
//!   (an empty one if nothing else waits): checks of many guards share a round trip and,
//!   on a connection holding thousands of locks, the lane's transaction.
//!
//! [`Builder::multiplex`]: crate::Builder::multiplex

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, LossReason};
use crate::key::Key;
use crate::postgres::conn::native::NativeConn;
use crate::postgres::conn::pool::Pool;
use crate::postgres::conn::wire::{Link, Message, QueryError};
use crate::postgres::sql::{first_value, i64_text};
use crate::raw::{BoxFuture, Grant, Mode, RawHeld, Req, Scope};
use crate::sync::Mutex;

use super::messages::{Release, lock_fn, unlock_fn, write_call};

pub(crate) struct Mux {
    inner: Arc<MuxInner>,
}

struct MuxInner {
    pool: Pool,
    /// The shared connections' lanes, each started on first use.
    lanes: Vec<OnceLock<mpsc::UnboundedSender<Job>>>,
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
        self.inner.lanes.len()
    }

    pub(crate) fn new(pool: Pool, n: usize) -> Mux {
        Mux {
            inner: Arc::new(MuxInner {
                pool,
                lanes: (0..n.max(1)).map(|_| OnceLock::new()).collect(),
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

    /// The lane of `key`'s shared connection, its task started on first use (in the
    /// caller's runtime, as a connection's own task is).
    fn lane(&self, key: i64) -> &mpsc::UnboundedSender<Job> {
        let i = (key as u64 % self.inner.lanes.len() as u64) as usize;
        self.inner.lanes[i].get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run_lane(self.inner.pool.clone(), rx, tx.downgrade()));
            tx
        })
    }

    /// Tries `req`'s key on its shared connection.
    ///
    /// Cancel safe: dropped at any point, whatever the lane took for it is unlocked
    /// (the lane finds nobody to hand the lock to).
    pub(crate) async fn try_acquire(&self, req: &Req<'_>) -> Result<Attempt, Error> {
        let k = req.key.as_i64();
        // Claim the key first: never two requests for one key on a shared connection.
        let Some(claim) = Claims::claim(&self.inner.claims, k) else {
            return Ok(Attempt::HeldHere);
        };
        // Names the lock while the request runs (a shared connection's later requests
        // and checks replace it: `dblock status` names multiplexed locks only so long).
        let mut comment = String::new();
        crate::status::write_comment(&mut comment, req.namespace, req.name, Some(req.scope), None);
        let (reply, answer) = oneshot::channel();
        let job = Job::Lock(LockJob {
            claim,
            mode: req.mode,
            comment,
            reply,
        });
        if self.lane(k).send(job).is_err() {
            return Err(lane_gone());
        }
        match answer.await {
            Ok(Ok(Some(held))) => Ok(Attempt::Granted(Grant {
                held: crate::raw::Held::boxed(held),
                fence: None,
            })),
            Ok(Ok(None)) => Ok(Attempt::NotFree),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(lane_gone()),
        }
    }
}

fn lane_gone() -> Error {
    Error::ConnectionLost {
        message: "the shared connection's task ended (its runtime shut down)".into(),
    }
}

// ---------------------------------------------------------------------------------
// A shared connection's lane: its requests batched, one message per batch.
// ---------------------------------------------------------------------------------

/// The most requests one message carries.
const MAX_BATCH: usize = 1024;

/// What a lane is asked to do.
enum Job {
    Lock(LockJob),
    Unlock(UnlockJob),
    Check(CheckJob),
}

/// A held guard's check ([`MuxHeld::check`]): answered by the next message the lane sends
/// on `conn` (an empty one if nothing else is waiting), so that the checks of many guards
/// share one round trip — and, on a connection holding thousands of locks, the lane's
/// transaction: a check sent alone would be a transaction of its own, whose end walks
/// every lock the session holds (~0.5 ms of the server's CPU at 6,000).
struct CheckJob {
    conn: Arc<NativeConn>,
    reply: oneshot::Sender<Result<(), QueryError>>,
}

impl CheckJob {
    /// On its own connection, alone (a connection the lane no longer uses).
    async fn alone(self) {
        let _ = self.reply.send(self.conn.query("").await.map(|_| ()));
    }
}

/// A claimed key to try on the lane's connection; the lane owns the claim until it hands
/// the lock over (or finds nobody to hand it to, and unlocks).
struct LockJob {
    claim: Claim<LaneUnlock>,
    mode: Mode,
    /// The status comment naming the lock.
    comment: String,
    reply: oneshot::Sender<Result<Option<MuxHeld>, Error>>,
}

impl LockJob {
    /// Answers a request that keeps nothing (not free, or failed). The claim ends first
    /// — queuing the unlock owed, if any, and leaving the table — so that a request the
    /// caller makes on hearing the answer claims the key afresh and queues behind that
    /// unlock on this lane, rather than finding the key still claimed ("held here") and
    /// going to a connection of its own (which a full lock table refuses to start).
    fn answer_empty(self, answer: Result<Option<MuxHeld>, Error>) {
        let LockJob { claim, reply, .. } = self;
        drop(claim);
        let _ = reply.send(answer);
    }
}

/// A held key to unlock on the connection it was taken on; `reply` (a `release` that
/// waits) learns whether the session still held it.
struct UnlockJob {
    conn: Arc<NativeConn>,
    key: Key,
    mode: Mode,
    reply: Option<oneshot::Sender<Result<bool, QueryError>>>,
}

impl UnlockJob {
    fn sql(&self) -> String {
        Release::of_one(Scope::Session, self.mode, self.key, false)
            .sql()
            .to_string()
    }
}

/// A lane's loop: every request waiting when it looks (up to [`MAX_BATCH`]) goes out in
/// one message.
///
/// Why batches, and why one transaction while busy: the end of every transaction walks
/// every lock the session holds (PostgreSQL's `LockReleaseAll`, once for regular and
/// once for advisory locks), so with thousands of session locks on one connection a
/// lock or unlock per statement costs in proportion to the locks already held. A batch
/// takes or releases its keys in one statement (`… FROM unnest('{…}')`), so the walk is
/// paid at most once per batch; and while the lane stays busy — requests came while its
/// message was out — its batches run in one transaction (`BEGIN` ahead of the first,
/// `COMMIT` alone once nothing has come for [`Lane::linger`], or after [`MAX_XACT`]),
/// so the walk is paid once per burst. A lane's requests queue while its message is out,
/// so under load a batch holds what came during one round trip; alone, a request goes
/// out at once, as one statement, its own transaction — unless its connection holds
/// [`HEAVY`] locks or more: then its every batch opens a transaction, which the bursts
/// that follow within the linger share (a caller that takes a thousand locks, waits for
/// them all, then takes the next thousand leaves each lane idle between its bursts, and
/// a commit at each gap walked every lock again: the server's CPU a lock grew with the
/// locks held, 1.4–3× from 10,000 to 50,000).
async fn run_lane(
    pool: Pool,
    mut rx: mpsc::UnboundedReceiver<Job>,
    me: mpsc::WeakUnboundedSender<Job>,
) {
    let mut lane = Lane {
        pool,
        conn: None,
        open: false,
        opened: std::time::Instant::now(),
        held: 0,
    };
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    // Whether requests came while the last message was out.
    let mut busy = false;
    loop {
        let got = match lane.open {
            false => rx.recv_many(&mut jobs, MAX_BATCH).await,
            // Inside the lane's transaction: more work within its linger continues
            // it; none, and it is committed (cancel safe: `recv_many` takes nothing it
            // does not return).
            true => {
                let more = rx.recv_many(&mut jobs, MAX_BATCH);
                match tokio::time::timeout(lane.linger(), more).await {
                    Ok(got) => got,
                    Err(_) => {
                        lane.commit().await;
                        continue;
                    }
                }
            }
        };
        if got == 0 {
            break;
        }
        let batch = std::mem::take(&mut jobs);
        run_batch(&mut lane, busy, &me, batch).await;
        busy = !rx.is_empty();
        // Never open longer than MAX_XACT, however busy: committed, and the next batch
        // begins another.
        if lane.open && lane.opened.elapsed() >= MAX_XACT {
            lane.commit().await;
        }
    }
    lane.commit().await;
}

/// How long a lane's transaction waits for more work before it is committed, at least:
/// long enough to join bursts that follow one another (a caller taking its locks a
/// thousand at a time), short against any `idle_in_transaction_session_timeout` — which
/// the transaction turns off for itself all the same (`SET LOCAL`), so that no setting of
/// the server's ends a session holding the lane's locks for a pause of the client's.
const LINGER: Duration = Duration::from_millis(1);

/// The longest a lane's transaction waits for more work ([`Lane::linger`]).
const MAX_LINGER: Duration = Duration::from_millis(20);

/// How long a lane whose connection holds `held` locks lingers ([`Lane::linger`]).
fn linger(held: usize) -> Duration {
    Duration::from_micros(u64::try_from(held).unwrap_or(u64::MAX)).clamp(LINGER, MAX_LINGER)
}

/// The longest a lane's transaction stays open, however busy the lane: a server's
/// monitoring that flags long transactions (`xact_start` in `pg_stat_activity`) never
/// sees one older, and a `transaction_timeout` (PostgreSQL 17) of a second or more never
/// ends a shared session for it.
const MAX_XACT: Duration = Duration::from_secs(1);

/// How many locks a lane's connection holds before its every batch opens a transaction
/// (not only one that came while the lane was busy): a commit then walks at least this
/// many locks (~80 µs of the server's CPU), against which the `COMMIT` the transaction
/// adds costs little.
const HEAVY: usize = 1000;

/// What a lane's transaction sets after its `BEGIN` ([`Message::BEGIN`]): the head is
/// these two statements, ahead of the batch's.
const NO_IDLE_TIMEOUT: &str = "SET LOCAL idle_in_transaction_session_timeout = 0";

/// How many statements the head of a lane's transaction is.
const HEAD: usize = 2;

/// A shared connection's state, as its lane sees it.
struct Lane {
    pool: Pool,
    /// The connection, once made; replaced when unusable.
    conn: Option<Arc<NativeConn>>,
    /// Whether a transaction the lane began (`BEGIN`) is open on `conn`.
    open: bool,
    /// When that transaction began.
    opened: std::time::Instant,
    /// About how many locks `conn`'s session holds: those the lane's statements took
    /// less those they released (a lock taken or released otherwise — retried alone after
    /// a failed statement — is not counted; the figure only paces commits).
    held: usize,
}

impl Lane {
    /// The lane's connection: the one it has if usable, else a new one (with no
    /// transaction open: a transaction ends with its session).
    async fn conn(&mut self) -> Result<Arc<NativeConn>, Error> {
        if let Some(c) = self.usable() {
            return Ok(c);
        }
        self.open = false;
        self.held = 0;
        let c = Arc::new(self.pool.connect_unpooled().await?);
        // Shared connections hold locks for their whole life: always checked.
        c.link().set_watched(true);
        self.conn = Some(c.clone());
        Ok(c)
    }

    /// How long its open transaction waits for more work before it is committed: 1 µs
    /// for every lock the session holds, from [`LINGER`] up to [`MAX_LINGER`].
    ///
    /// The end of a transaction walks every lock the session holds (PostgreSQL's
    /// `LockReleaseAll`, ~80 ns a lock, measured on PostgreSQL 15), so a session holding
    /// thousands pays a commit in proportion: the more it holds, the longer the lane waits
    /// for more requests to share that walk. Waiting costs the server nothing (the
    /// transaction has no snapshot between statements, read committed, and no
    /// transaction id: it only takes and releases session locks), and the callers nothing
    /// (each request is answered the moment its statement is).
    fn linger(&self) -> Duration {
        linger(self.held)
    }

    /// The connection it has, if usable.
    fn usable(&self) -> Option<Arc<NativeConn>> {
        self.conn.as_ref().filter(|c| c.usable()).cloned()
    }

    /// Ends the transaction the lane began, if one is open: `COMMIT`, alone. (Nothing in
    /// it needs committing — session locks are applied at once — but its end is where
    /// the server walks the session's locks, once.)
    async fn commit(&mut self) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        if let Some(c) = self.usable() {
            // A failure here is the connection's: its watch reports the loss.
            let _ = c.query("COMMIT").await;
        }
    }

    /// Ends a transaction a failed statement aborted (`ROLLBACK`), so that what
    /// follows on the connection runs.
    async fn roll_back(&mut self, c: &NativeConn) {
        if std::mem::take(&mut self.open) {
            let _ = c.query("ROLLBACK").await;
        }
    }
}

/// One statement of a batch: the jobs whose keys it takes or releases, in row order.
struct Stmt {
    unlock: bool,
    mode: Mode,
    jobs: Vec<usize>,
}

/// Appends `SELECT f(k)` for one key, or `SELECT f(k) FROM unnest('{…}') AS k` for
/// several: one statement, whose rows come in the keys' order.
fn push_calls(sql: &mut String, f: &str, keys: impl ExactSizeIterator<Item = Key>) {
    if keys.len() == 1 {
        for k in keys {
            write_call(sql, f, k);
        }
        return;
    }
    let mut kbuf = [0u8; 20];
    for part in ["SELECT ", f, "(k) FROM pg_catalog.unnest('{"] {
        sql.push_str(part);
    }
    for (i, k) in keys.enumerate() {
        if i > 0 {
            sql.push(',');
        }
        sql.push_str(i64_text(k.as_i64(), &mut kbuf));
    }
    sql.push_str("}'::pg_catalog.int8[]) AS k");
}

/// Sends one batch as one message and answers its requests; `busy`: the lane stayed
/// busy through its last message, so this one opens a transaction if none is open.
async fn run_batch(
    lane: &mut Lane,
    busy: bool,
    me: &mpsc::WeakUnboundedSender<Job>,
    batch: Vec<Job>,
) {
    let mut locks = Vec::new();
    let mut unlocks = Vec::new();
    let mut checks = Vec::new();
    for job in batch {
        match job {
            // A request given up before its turn: nothing was taken (the claim leaves).
            Job::Lock(l) if l.reply.is_closed() => {}
            Job::Lock(l) => locks.push(l),
            Job::Unlock(u) => unlocks.push(u),
            Job::Check(k) if k.reply.is_closed() => {}
            Job::Check(k) => checks.push(k),
        }
    }
    let c = if locks.is_empty() {
        lane.usable()
    } else {
        match lane.conn().await {
            Ok(c) => Some(c),
            Err(e) => {
                let message = e.to_string();
                let mut first = Some(e);
                for l in locks {
                    let e = first.take().unwrap_or_else(|| Error::ConnectionLost {
                        message: message.clone(),
                    });
                    l.answer_empty(Err(e));
                }
                locks = Vec::new();
                None
            }
        }
    };
    // Unlocks of keys taken on another (older) connection go there, one by one: a
    // connection is replaced only when unusable, so they are rare.
    let (here, elsewhere): (Vec<_>, Vec<_>) = unlocks
        .into_iter()
        .partition(|u| c.as_ref().is_some_and(|c| Arc::ptr_eq(c, &u.conn)));
    for u in elsewhere {
        unlock_alone(u).await;
    }
    // Likewise checks of a connection the lane no longer uses (its loss is known: the
    // check answers it).
    let (checks, elsewhere): (Vec<_>, Vec<_>) = checks
        .into_iter()
        .partition(|k| c.as_ref().is_some_and(|c| Arc::ptr_eq(c, &k.conn)));
    for k in elsewhere {
        k.alone().await;
    }
    let Some(c) = c else {
        return;
    };
    // Unlocks first: a key's unlock is always queued before a later request for it
    // (the request must claim the key, and the claim leaves only after its unlock is
    // queued), so in one message they must run in that order.
    let mut stmts = Vec::new();
    for unlock in [true, false] {
        for mode in [Mode::Exclusive, Mode::Shared] {
            let jobs: Vec<usize> = match unlock {
                true => (0..here.len()).filter(|&i| here[i].mode == mode).collect(),
                false => (0..locks.len())
                    .filter(|&i| locks[i].mode == mode)
                    .collect(),
            };
            if !jobs.is_empty() {
                stmts.push(Stmt { unlock, mode, jobs });
            }
        }
    }
    if stmts.is_empty() && checks.is_empty() {
        return;
    }
    // (Checks alone: the head, if the batch opens a transaction, else the empty query.)
    let mut sql = String::with_capacity(64 + 21 * (here.len() + locks.len()));
    // The head's statements come first: the rows of the batch's statements follow them.
    let begin = (busy || lane.held >= HEAVY) && !lane.open;
    if begin {
        for part in [Message::BEGIN, "; ", NO_IDLE_TIMEOUT] {
            sql.push_str(part);
        }
    }
    for st in &stmts {
        if !sql.is_empty() {
            sql.push_str("; ");
        }
        match st.unlock {
            true => push_calls(
                &mut sql,
                unlock_fn(st.mode),
                st.jobs.iter().map(|&i| here[i].key),
            ),
            false => {
                let f = lock_fn(Scope::Session, st.mode, true);
                push_calls(
                    &mut sql,
                    f,
                    st.jobs.iter().map(|&i| locks[i].claim.key_of()),
                );
            }
        }
    }
    // The status comment of the batch's last request, as when each request replaced the
    // one before it.
    if let Some(last) = locks.last() {
        sql.push_str(&last.comment);
    }
    let (rows, failed) = c.query_partial(&sql).await;
    // The message reached the server and was answered, unless the session was lost.
    for k in checks {
        let _ = k.reply.send(match &failed {
            Some(QueryError::Lost { message }) => Err(QueryError::Lost {
                message: message.clone(),
            }),
            _ => Ok(()),
        });
    }
    if begin {
        lane.open = true;
        lane.opened = std::time::Instant::now();
    }
    let mut here: Vec<Option<UnlockJob>> = here.into_iter().map(Some).collect();
    let mut locks: Vec<Option<LockJob>> = locks.into_iter().map(Some).collect();
    for (s, st) in stmts.iter().enumerate() {
        let s = s + HEAD * usize::from(begin);
        let Some(values) = rows.get(s).filter(|v| v.len() == st.jobs.len()) else {
            continue;
        };
        for (&i, v) in st.jobs.iter().zip(values) {
            let t = v.as_deref() == Some("t");
            match st.unlock {
                true => {
                    lane.held = lane.held.saturating_sub(usize::from(t));
                    if let Some(u) = here[i].take() {
                        answer_unlock(u, v.as_deref());
                    }
                }
                false => {
                    lane.held += usize::from(t);
                    if let Some(l) = locks[i].take() {
                        answer_lock(l, &c, me, v.as_deref());
                    }
                }
            }
        }
    }
    // What is left did not complete: its statement failed (or one before it did), or
    // answered with the wrong number of rows.
    let lost = match &failed {
        Some(QueryError::Lost { message }) => Some(message.clone()),
        _ => None,
    };
    if let Some(message) = lost {
        // The transaction ended with the session.
        lane.open = false;
        for u in here.into_iter().flatten() {
            if let Some(r) = u.reply {
                let _ = r.send(Err(QueryError::Lost {
                    message: message.clone(),
                }));
            }
        }
        for mut l in locks.into_iter().flatten() {
            // The session ends with its connection; the unlock is owed all the same
            // (sending it on a closed connection does nothing).
            l.claim.owe(lane_unlock(&c, me, l.claim.key_of(), l.mode));
            l.answer_empty(Err(Error::ConnectionLost {
                message: message.clone(),
            }));
        }
        return;
    }
    // A statement failed (a full lock table, say): the locks it took before failing are
    // held, which ones unknown — each of its keys is unlocked (a key it did not take
    // answers false, with a warning in the server's log), then every request left is
    // tried again alone, so that each gets its own answer.
    if failed.is_some() {
        // An open transaction is aborted now: nothing more runs in it.
        lane.roll_back(&c).await;
    }
    let left: Vec<Key> = locks.iter().flatten().map(|l| l.claim.key_of()).collect();
    if !left.is_empty() {
        for mode in [Mode::Exclusive, Mode::Shared] {
            let keys: Vec<Key> = locks
                .iter()
                .flatten()
                .filter(|l| l.mode == mode)
                .map(|l| l.claim.key_of())
                .collect();
            if keys.is_empty() {
                continue;
            }
            let mut sql = String::new();
            push_calls(&mut sql, unlock_fn(mode), keys.into_iter());
            let _ = c.query(&sql).await;
        }
    }
    for u in here.into_iter().flatten() {
        unlock_alone(u).await;
    }
    for l in locks.into_iter().flatten() {
        lock_alone(l, &c, me).await;
    }
}

/// The unlock a granted key owes, through this lane.
fn lane_unlock(
    c: &Arc<NativeConn>,
    me: &mpsc::WeakUnboundedSender<Job>,
    key: Key,
    mode: Mode,
) -> LaneUnlock {
    LaneUnlock {
        lane: me.upgrade(),
        conn: c.clone(),
        key,
        mode,
    }
}

/// Hands a lock request its answer, `t` or `f`; a lock nobody is left to take is
/// unlocked (through the lane, behind this batch).
fn answer_lock(
    mut l: LockJob,
    c: &Arc<NativeConn>,
    me: &mpsc::WeakUnboundedSender<Job>,
    v: Option<&str>,
) {
    let key = l.claim.key_of();
    match v {
        Some("f") => l.answer_empty(Ok(None)),
        Some("t") => {
            l.claim.owe(lane_unlock(c, me, key, l.mode));
            let held = MuxHeld {
                conn: c.clone(),
                claim: l.claim,
            };
            // Refused (the request was given up): dropped here, the lock is unlocked.
            let _ = l.reply.send(Ok(Some(held)));
        }
        other => {
            // Whatever it means, the key is unlocked.
            l.claim.owe(lane_unlock(c, me, key, l.mode));
            l.answer_empty(Err(Error::Unexpected {
                message: format!("a lock request (t or f): the server answered {other:?}"),
            }));
        }
    }
}

/// Hands an unlock its answer.
fn answer_unlock(u: UnlockJob, v: Option<&str>) {
    if let Some(r) = u.reply {
        let _ = r.send(match v {
            Some("t") => Ok(true),
            Some("f") => Ok(false),
            other => Err(QueryError::Db {
                code: String::new(),
                message: format!("an unlock (t or f): the server answered {other:?}"),
            }),
        });
    }
}

/// One unlock on its own connection (not the lane's batch).
async fn unlock_alone(u: UnlockJob) {
    let sql = u.sql();
    match u.reply {
        Some(r) => {
            let res = u.conn.query(&sql).await;
            let _ = r.send(res.map(|rows| first_value(&rows, 0).as_deref() == Some("t")));
        }
        None => {
            u.conn.send(&sql);
        }
    }
}

/// One lock request on its own: one statement, its own answer or error.
async fn lock_alone(mut l: LockJob, c: &Arc<NativeConn>, me: &mpsc::WeakUnboundedSender<Job>) {
    let key = l.claim.key_of();
    let mut sql = String::new();
    write_call(&mut sql, lock_fn(Scope::Session, l.mode, true), key);
    sql.push_str(&l.comment);
    match c.query(&sql).await {
        Ok(rows) => answer_lock(l, c, me, first_value(&rows, 0).as_deref()),
        Err(e) => {
            // Whatever it took is unlocked.
            l.claim.owe(lane_unlock(c, me, key, l.mode));
            l.answer_empty(Err(e.into_error()));
        }
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

    fn key_of(&self) -> Key {
        Key::from_i64(self.key)
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

/// The unlock of a key on its shared connection, queued on the connection's lane (which
/// batches it with the others waiting); straight on the connection if the lane is gone.
pub(crate) struct LaneUnlock {
    lane: Option<mpsc::UnboundedSender<Job>>,
    conn: Arc<NativeConn>,
    key: Key,
    mode: Mode,
}

impl LaneUnlock {
    /// Queues the unlock; `reply`, if any, learns whether the session held the key.
    /// Returns the job back if the lane is gone.
    fn queue(
        &self,
        reply: Option<oneshot::Sender<Result<bool, QueryError>>>,
    ) -> Result<(), UnlockJob> {
        let job = UnlockJob {
            conn: self.conn.clone(),
            key: self.key,
            mode: self.mode,
            reply,
        };
        let Some(lane) = &self.lane else {
            return Err(job);
        };
        lane.send(Job::Unlock(job)).map_err(|e| match e.0 {
            Job::Unlock(job) => job,
            // Only an unlock was sent.
            Job::Lock(_) | Job::Check(_) => UnlockJob {
                conn: self.conn.clone(),
                key: self.key,
                mode: self.mode,
                reply: None,
            },
        })
    }
}

impl LaneUnlock {
    /// Queues a check of `conn` on the lane: `None` if the lane is gone.
    fn check(&self, conn: &Arc<NativeConn>) -> Option<oneshot::Receiver<Result<(), QueryError>>> {
        let lane = self.lane.as_ref()?;
        let (reply, answer) = oneshot::channel();
        let job = Job::Check(CheckJob {
            conn: conn.clone(),
            reply,
        });
        lane.send(job).ok().map(|()| answer)
    }
}

impl Unlock for LaneUnlock {
    fn unlock(&self) {
        if let Err(job) = self.queue(None) {
            job.conn.send(&job.sql());
        }
    }
}

/// A lock held on a shared connection: dropped, its claim queues the unlock.
pub(crate) struct MuxHeld {
    conn: Arc<NativeConn>,
    claim: Claim<LaneUnlock>,
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
        // Through the lane, with whatever else it sends; straight on the connection if
        // the lane is gone. Cancel safe: if it is cancelled, the lane's answer (or the
        // connection's reply) is dropped, and nothing is left to undo.
        let res = match self.claim.owed.as_ref().and_then(|u| u.check(&self.conn)) {
            Some(answer) => answer.await.unwrap_or_else(|_| {
                Err(QueryError::Lost {
                    message: "the shared connection's task ended".into(),
                })
            }),
            None => self.conn.query("").await.map(|_| ()),
        };
        match res {
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
        // Queued here, and awaited: settled, so that the claim's end does not queue it
        // again. It is queued in this future's first poll, so a future dropped before
        // the reply has queued it already (and one dropped before its first poll never
        // settled: dropping `self` queues it).
        let Some(unlock) = self.claim.settle() else {
            return Ok(());
        };
        let (reply, answer) = oneshot::channel();
        let res = match unlock.queue(Some(reply)) {
            Ok(()) => answer.await.unwrap_or_else(|_| {
                Err(QueryError::Lost {
                    message: "the shared connection's task ended".into(),
                })
            }),
            Err(job) => job
                .conn
                .query(&job.sql())
                .await
                .map(|rows| first_value(&rows, 0).as_deref() == Some("t")),
        };
        match res {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::LockLost {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane's linger: 1 µs a held lock, from 1 ms (a connection holding few) to 20 ms.
    #[test]
    fn a_lane_lingers_in_proportion_to_the_locks_its_connection_holds() {
        let ms = |held| linger(held).as_secs_f64() * 1e3;
        assert_eq!(ms(0), 1.0);
        assert_eq!(ms(999), 1.0);
        assert_eq!(ms(6_250), 6.25);
        assert_eq!(ms(20_000), 20.0);
        assert_eq!(ms(usize::MAX), 20.0);
    }
}
