//! One lock: taken in the request's own future, then held by a task that owns its
//! connection.
//!
//! The acquisition is one statement on dblock's own connections (`GET_LOCK(name, 0)`
//! for `try`, `GET_LOCK(name, S)` otherwise), sent from the caller's future: no task or
//! channel between the request and the server. Its connection's server id is known
//! beforehand (see `pool.rs`), so a deadline, or the request's future being dropped,
//! ends the wait with `KILL CONNECTION` from a control connection and the connection is
//! closed (`Job`'s `Drop`): nothing stays held, no wait keeps running.
//!
//! Once granted, a lock held past one check interval gets a task that checks its
//! connection every interval and releases the lock when asked; the guard's half
//! ([`MyHeld`]) shares the connection's slot with that task ([`Shared`]). The task is
//! started only when it is needed — by the handle's keeper ([`Keeper`]) once the grant
//! is an interval old, or at once by a `check`, an explicit `release`, a lease (whose
//! checks keep the session alive) or a drop that cannot leave the release to be carried
//! — so that a lock taken and dropped within an interval, the common case, costs no task,
//! no channel and no timer: only the statement that takes it.
//!
//! Dropping the guard of a lock on dblock's own connection (without a lease) does not
//! wait for a round trip: the connection goes straight back to its pool owing the
//! release (`pool.rs`), so that the next request to take it, often the same caller's
//! next `lock`, sends `DO RELEASE_LOCK('old'); SELECT GET_LOCK('new', S)` as one message
//! — the release carried by the next request, as on PostgreSQL. The pool's flusher,
//! woken by the drop, sends the release alone if no request took the connection first,
//! so a dropped guard's lock is freed promptly either way (`pool.rs`). A request
//! cancelled while carrying a release closes its connection (and kills the session),
//! which frees the lock too.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use sqlx::{AssertSqlSafe, MySqlConnection, Row};

use super::pool::LockConn;
use super::{FOREVER_SECS, MyBackend, map_sqlx};
use crate::error::{Error, LossReason, ServerCode};
use crate::raw::{BoxFuture, Grant, RawHeld, Req, Wait};

/// A held lock's connection shared with a child process: this process's duplicate of
/// its socket, shut down (which ends the connection for every copy) when the lock ends,
/// instead of the connection going back to a pool.
type Exported = std::sync::Arc<std::sync::Mutex<Option<std::os::fd::OwnedFd>>>;

/// Shuts down an exported connection's socket, once: the child's copy must not keep a
/// session (or a lock) the lock's owner has ended.
fn shut_down(exported: &Exported) -> bool {
    let fd = exported.lock().unwrap_or_else(|e| e.into_inner()).take();
    match fd {
        Some(fd) => {
            crate::sys::shutdown(&fd);
            true
        }
        None => false,
    }
}

/// A request from the guard to its task.
enum Cmd {
    Check(oneshot::Sender<Result<(), Error>>),
    Release(oneshot::Sender<Result<(), Error>>),
}

/// What a guard, the keeper and (once started) the lock's task share.
struct Shared {
    state: Mutex<State>,
    /// The task ended, or never will start (the guard went before it was needed).
    /// Outside the mutex: the task's future may be dropped while it is held (a spawn on
    /// a runtime shutting down drops it at once).
    ended: AtomicBool,
    /// Woken when a loss is recorded or the task ends.
    changed: Notify,
}

struct State {
    /// The held lock's connection, idle between checks; `None` while the task uses it (a
    /// check or the release in progress), once back in its pool owing the release (the
    /// guard was dropped), or gone.
    conn: Option<LockConn>,
    /// What the task needs, until it starts (`None` after, or once the guard is gone).
    job: Option<Job>,
    /// The way to the task, once started; dropped with the guard, which ends the task.
    cmds: Option<mpsc::UnboundedSender<Cmd>>,
    /// When the first periodic check is due.
    first_check: Instant,
    /// Why the lock was lost, once known.
    loss: Option<LossReason>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lose(&self, reason: LossReason) {
        self.lock().loss = Some(reason);
        self.changed.notify_waiters();
    }

    fn end(&self) {
        self.ended.store(true, Ordering::Release);
        self.changed.notify_waiters();
    }

    /// The way to the lock's task, starting it if it has not started. `None` when it
    /// ended, or never will.
    fn task(self: &Arc<Self>, s: &mut State) -> Option<mpsc::UnboundedSender<Cmd>> {
        if let Some(tx) = &s.cmds {
            return Some(tx.clone());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.start(s, rx)?;
        s.cmds = Some(tx.clone());
        Some(tx)
    }

    /// Starts the lock's task on the current runtime, with `rx` as its commands; `None`
    /// (nothing started) when it started before, or there is no runtime.
    fn start(self: &Arc<Self>, s: &mut State, rx: mpsc::UnboundedReceiver<Cmd>) -> Option<()> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let job = s.job.take()?;
        let ended = TaskEnded(self.clone());
        rt.spawn(job.hold(self.clone(), rx, s.first_check, ended));
        Some(())
    }
}

impl Drop for Shared {
    /// Dropped holding a connection (the runtime shut down, or there was none to start
    /// the task that would release it), it closes it rather than let it back into a
    /// caller's pool with a lock held.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(conn) = state.conn.take() {
            if let Some(job) = &state.job {
                shut_down(&job.exported);
            }
            let mut conn = conn;
            conn.close_on_drop();
        }
    }
}

/// Marks the task ended when it returns or is dropped (its runtime shutting down):
/// `lost()` then resolves.
struct TaskEnded(Arc<Shared>);

impl Drop for TaskEnded {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A handle's keeper: starts the task of each grant still held one check interval after
/// it was made, so that its checks begin. One task for the handle, running while grants
/// wait for it (it ends when none is left, and starts again with the next).
pub(crate) struct Keeper {
    state: Mutex<KeeperState>,
    /// How often it looks: a quarter of the check interval, so a grant's first check comes
    /// between one and one and a quarter intervals after it.
    tick: Duration,
}

struct KeeperState {
    /// Grants not yet an interval old, oldest first, with when they are.
    waiting: std::collections::VecDeque<(Instant, Weak<Shared>)>,
    /// The length at which `watch` drops the grants already gone, so that a stream of
    /// short grants keeps a few dozen entries, not an interval's worth (each weak
    /// reference keeps its grant's ~470 bytes allocated).
    purge_at: usize,
    running: bool,
}

/// The fewest entries the keeper keeps before it looks for grants already gone.
const PURGE_MIN: usize = 64;

impl Keeper {
    pub(crate) fn new(check_interval: Duration) -> Arc<Keeper> {
        Arc::new(Keeper {
            state: Mutex::new(KeeperState {
                waiting: std::collections::VecDeque::new(),
                purge_at: PURGE_MIN,
                running: false,
            }),
            tick: (check_interval / 4).max(Duration::from_millis(5)),
        })
    }

    fn lock(&self) -> MutexGuard<'_, KeeperState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches `shared`'s grant from now on; starts the keeper's task if none runs.
    /// `false` when there is no runtime to run it on (the caller starts the lock's task
    /// itself).
    fn watch(self: &Arc<Self>, due: Instant, shared: &Arc<Shared>) -> bool {
        let start = {
            let mut k = self.lock();
            if k.waiting.len() >= k.purge_at {
                // Amortized: the next purge waits until the live entries double.
                k.waiting.retain(|(_, w)| w.strong_count() > 0);
                k.purge_at = (2 * k.waiting.len()).max(PURGE_MIN);
            }
            k.waiting.push_back((due, Arc::downgrade(shared)));
            !std::mem::replace(&mut k.running, true)
        };
        if start {
            // Spawned outside the lock: a runtime shutting down drops the task at once,
            // and its `KeeperRunning` takes the lock.
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(self.clone().run(KeeperRunning(Some(self.clone()))));
                }
                Err(_) => {
                    self.lock().running = false;
                    return false;
                }
            }
        }
        true
    }

    async fn run(self: Arc<Self>, mut running: KeeperRunning) {
        loop {
            tokio::time::sleep(self.tick).await;
            let due = {
                let mut k = self.lock();
                let now = Instant::now();
                let mut due = Vec::new();
                while let Some((at, _)) = k.waiting.front() {
                    if *at > now {
                        break;
                    }
                    if let Some((_, w)) = k.waiting.pop_front()
                        && let Some(shared) = w.upgrade()
                    {
                        due.push(shared);
                    }
                }
                // Grants dropped since they were made: forget them now (their memory is
                // kept while a weak reference stays).
                k.waiting.retain(|(_, w)| w.strong_count() > 0);
                k.purge_at = (2 * k.waiting.len()).max(PURGE_MIN);
                if due.is_empty() && k.waiting.is_empty() {
                    // Under the lock, so that a grant watched now starts another.
                    k.running = false;
                    running.0 = None;
                    return;
                }
                due
            };
            for shared in due {
                let mut s = shared.lock();
                if s.conn.is_some() {
                    let _ = shared.task(&mut s);
                }
            }
        }
    }
}

/// Clears the keeper's "running" flag if its task is dropped (the runtime shutting
/// down), so that the next grant starts another. `None` once the task ended by itself
/// (having cleared the flag).
struct KeeperRunning(Option<Arc<Keeper>>);

impl Drop for KeeperRunning {
    fn drop(&mut self) {
        if let Some(k) = self.0.take() {
            k.lock().running = false;
        }
    }
}

/// The MySQL half of a guard: its share of the lock's connection and task.
pub(crate) struct MyHeld {
    /// `None` once released explicitly.
    shared: Option<Arc<Shared>>,
    /// The lock's name, for a release carried by the next request.
    name: String,
    /// Whether dropping the guard may leave the release to be carried (not with a lease:
    /// its release also resets the session's `wait_timeout`; not once shared with a
    /// child).
    carry: bool,
    /// The session's id on the server, the server's port, and the connection for asking
    /// the server about it: what finds the lock's socket to share with a child.
    id: Option<u64>,
    server_port: u16,
    control: sqlx::MySqlPool,
    exported: Exported,
}

impl Drop for MyHeld {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let mut s = shared.lock();
        // A running task sees its channel close, and releases (or finds the connection
        // gone back to its pool owing the release).
        let started = s.cmds.take().is_some();
        if self.carry
            && let Some(conn) = s.conn.take()
            && let Err(conn) = conn.park_releasing(std::mem::take(&mut self.name))
        {
            s.conn = Some(conn);
        }
        if started {
            return;
        }
        let started = match s.conn {
            // Not carried (a borrowed connection, or shared with a child): a task of its
            // own releases it, its channel closed from the start. With no runtime to run
            // it, `Shared`'s drop closes the connection, which frees the lock.
            Some(_) => {
                let (_, rx) = mpsc::unbounded_channel();
                shared.start(&mut s, rx).is_some()
            }
            None => {
                s.job = None;
                false
            }
        };
        drop(s);
        if !started {
            shared.end();
        }
    }
}

impl MyHeld {
    /// Why the lock was lost, if it was.
    pub(crate) fn loss(&self) -> Option<LossReason> {
        self.shared.as_ref().and_then(|s| s.lock().loss.clone())
    }

    /// Resolves with the reason once the lock is lost.
    pub(crate) fn watch_loss(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            let Some(shared) = shared else {
                return task_gone();
            };
            loop {
                let changed = shared.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if let Some(r) = &shared.lock().loss {
                    return r.clone();
                }
                // The task ended without a loss: the guard was released, or the runtime
                // is shutting down. Either way the lock is not held.
                if shared.ended.load(Ordering::Acquire) {
                    if let Some(r) = &shared.lock().loss {
                        return r.clone();
                    }
                    return task_gone();
                }
                changed.await;
            }
        }
    }

    /// The way to the lock's task, started now if it was not.
    fn task(&self) -> Result<mpsc::UnboundedSender<Cmd>, Error> {
        let Some(shared) = &self.shared else {
            return Err(lost(task_gone()));
        };
        let mut s = shared.lock();
        if let Some(reason) = &s.loss {
            return Err(lost(reason.clone()));
        }
        shared.task(&mut s).ok_or_else(|| lost(task_gone()))
    }

    /// Asks the server, now, whether this session still holds the lock.
    pub(crate) async fn check(&mut self) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        if self.task()?.send(Cmd::Check(tx)).is_err() {
            return Err(lost(task_gone()));
        }
        rx.await.unwrap_or_else(|_| Err(lost(task_gone())))
    }

    /// A duplicate of the lock's connection's socket, found among this process's
    /// descriptors by the address the server sees the session connect from (sqlx
    /// exposes no descriptor); from now on the connection is shut down, not reused, when
    /// the lock ends.
    pub(crate) async fn share(&mut self) -> Result<std::os::fd::OwnedFd, Error> {
        if let Some(reason) = self.loss() {
            return Err(lost(reason));
        }
        let cloned = {
            let mine = self.exported.lock().unwrap_or_else(|e| e.into_inner());
            mine.as_ref().map(std::os::fd::OwnedFd::try_clone)
        };
        if let Some(dup) = cloned {
            return dup.map_err(|e| Error::io("duplicating the lock's socket", e));
        }
        let Some(id) = self.id else {
            return Err(closed());
        };
        let host: Option<String> =
            sqlx::query_scalar("SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = ?")
                .bind(id)
                .fetch_optional(&self.control)
                .await
                .map_err(map_sqlx)?
                .flatten();
        let Some(host) = host else {
            return Err(lost(task_gone()));
        };
        // `address:port` over TCP; `localhost` alone over a Unix socket, whose
        // connections to one server cannot be told apart from this side.
        let local = host
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok());
        let Some(local) = local else {
            return Err(Error::unsupported(
                crate::error::Capability::ShareWithChild,
                format!(
                    "the lock's MySQL connection comes from {host:?} (a Unix socket?): its \
                     socket cannot be told from this process's others, so it cannot be \
                     shared with a child"
                ),
            ));
        };
        let peer = crate::sys::Peer::Tcp {
            local,
            remote: self.server_port,
        };
        let fd = crate::sys::find_socket(peer).map_err(|e| {
            Error::unsupported(
                crate::error::Capability::ShareWithChild,
                format!(
                    "the lock's MySQL connection (the server sees it from {host}) cannot be \
                     shared with a child: {e}"
                ),
            )
        })?;
        let keep = fd
            .try_clone()
            .map_err(|e| Error::io("duplicating the lock's socket", e))?;
        self.carry = false;
        *self.exported.lock().unwrap_or_else(|e| e.into_inner()) = Some(keep);
        Ok(fd)
    }

    /// Releases the lock and waits for the server's answer.
    pub(crate) async fn release(mut self) -> Result<(), Error> {
        // Not carried: the caller waits for the server's answer, which the task sends
        // whether or not this future is polled to the end.
        let Some(shared) = self.shared.take() else {
            return Err(lost(task_gone()));
        };
        let (tx, rx) = oneshot::channel();
        let sent = {
            let mut s = shared.lock();
            let sent = match &s.loss {
                Some(reason) => Err(lost(reason.clone())),
                None => match shared.task(&mut s) {
                    Some(cmds) => Ok(cmds.send(Cmd::Release(tx)).is_ok()),
                    None => Err(lost(task_gone())),
                },
            };
            // The channel closes: the task ends after the release (or at once, with
            // nothing to release).
            s.cmds = None;
            sent
        };
        match sent {
            Ok(true) => rx.await.unwrap_or_else(|_| Err(lost(task_gone()))),
            Ok(false) => Err(lost(task_gone())),
            Err(e) => Err(e),
        }
    }
}

impl RawHeld for MyHeld {
    fn loss(&self) -> Option<LossReason> {
        MyHeld::loss(self)
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        Box::pin(self.watch_loss())
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(MyHeld::check(self))
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(MyHeld::release(*self))
    }

    fn share(&mut self) -> BoxFuture<'_, Result<Vec<std::os::fd::OwnedFd>, Error>> {
        Box::pin(async move { MyHeld::share(self).await.map(|fd| vec![fd]) })
    }
}

fn task_gone() -> LossReason {
    LossReason::ConnectionClosed {
        message: "the lock's connection task ended".into(),
    }
}

fn lost(reason: LossReason) -> Error {
    Error::LockLost { reason }
}

/// Takes the lock `req` names on a connection of `b`'s, in the caller's future; once
/// granted, a task takes the connection over to hold, check and release it.
pub(crate) async fn acquire(b: &MyBackend, req: &Req<'_>) -> Result<Option<Grant>, Error> {
    let control = b.control().await?.clone();
    let conn = b.lock_conn().await?;
    let mut job = Job {
        id: conn.id(),
        conn: Some(conn),
        name: b.lock_name(req.key),
        wait: req.wait,
        fence: req.fenced.then(|| super::fence::FenceRow {
            key: req.fence_key(),
            namespace: req.namespace.to_string(),
            name: req.name.to_string(),
        }),
        control,
        lease: req.lease,
        check_interval: b.check_interval,
        check_timeout: b.check_timeout,
        exported: Exported::default(),
    };
    let token = match job.take((req.namespace, req.name)).await? {
        Some(token) => token,
        None => return Ok(None),
    };
    // No await from here to the return: the grant cannot be dropped half-made.
    let Some(conn) = job.conn.take() else {
        return Err(closed());
    };
    let first_check = Instant::now() + job.check_interval;
    let (name, id, control, exported) = (
        job.name.clone(),
        job.id,
        job.control.clone(),
        job.exported.clone(),
    );
    let lease = job.lease.is_some();
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            conn: Some(conn),
            job: Some(job),
            cmds: None,
            first_check,
            loss: None,
        }),
        ended: AtomicBool::new(false),
        changed: Notify::new(),
    });
    // A lease's checks keep its session alive from the start: its task starts now.
    // Otherwise the keeper starts it should the grant outlive an interval.
    if lease || !b.keeper.watch(first_check, &shared) {
        let mut s = shared.lock();
        let _ = shared.task(&mut s);
    }
    let held = MyHeld {
        shared: Some(shared),
        name,
        carry: !lease,
        id,
        server_port: b.server_port(),
        control,
        exported,
    };
    Ok(Some(Grant {
        held: crate::raw::Held::boxed(held),
        fence: token.map(|token| crate::raw::Token {
            token,
            table: std::sync::Arc::from(crate::raw::FENCING_TABLE),
            lease: req.lease,
        }),
    }))
}

/// One lock's connection and what to do with it. Dropped with its connection still in
/// it (the request's future dropped mid-statement, or the runtime shutting down), it
/// kills the session (`KILL CONNECTION`, from the control pool) and closes it, so that
/// neither a running wait nor a grant survives.
struct Job {
    /// `None` once closed or recycled.
    conn: Option<LockConn>,
    /// The session's id on the server, once known.
    id: Option<u64>,
    name: String,
    wait: Wait,
    fence: Option<super::fence::FenceRow>,
    control: sqlx::MySqlPool,
    /// The session's `wait_timeout` while held, when the request set a lease.
    lease: Option<Duration>,
    check_interval: Duration,
    check_timeout: Duration,
    /// Set once the guard shared the connection with a child: see [`Exported`].
    exported: Exported,
}

/// How a wait in `GET_LOCK` ended.
enum Ended {
    Answered(Result<Option<i64>, sqlx::Error>),
    Deadline,
}

fn closed() -> Error {
    Error::ConnectionLost {
        message: "the connection was closed".into(),
    }
}

impl Job {
    /// Takes the lock: `Ok(Some(token))` when held (with the fencing token if asked
    /// for), `Ok(None)` when not granted in time. Leaves nothing held unless it returns
    /// `Ok(Some(_))`. `who` is the request's namespace and name, which a wait names in
    /// a comment.
    async fn take(&mut self, who: (&str, &str)) -> Result<Option<Option<i64>>, Error> {
        let granted = match self.id {
            // dblock's own connection: one statement, whatever the wait.
            Some(id) => match self.wait {
                Wait::Try => self.attempt().await?,
                w => self.wait_for_it(id, w.deadline(), who).await?,
            },
            // A borrowed one: its id (for KILL, should a wait follow) and an attempt
            // that does not wait, in one round trip.
            None => {
                let Some(conn) = self.conn.as_mut().and_then(LockConn::raw) else {
                    return Err(closed());
                };
                let first: Result<(i64, Option<i64>), sqlx::Error> = sqlx::query_as(
                    "SELECT CAST(CONNECTION_ID() AS SIGNED), CAST(GET_LOCK(?, 0) AS SIGNED)",
                )
                .bind(&self.name)
                .fetch_one(conn)
                .await;
                let (id, got) = match first {
                    Ok(r) => r,
                    Err(e) => {
                        self.close().await;
                        return Err(map_sqlx(e));
                    }
                };
                self.id = Some(id as u64);
                match (got, self.wait) {
                    (Some(1), _) => true,
                    (None, _) => {
                        self.close().await;
                        return Err(null_get_lock());
                    }
                    (Some(0), Wait::Try) => {
                        self.recycle();
                        false
                    }
                    (Some(0), w) => self.wait_for_it(id as u64, w.deadline(), who).await?,
                    (Some(other), _) => {
                        self.close().await;
                        return Err(unmapped_get_lock(other));
                    }
                }
            }
        };
        if !granted {
            return Ok(None);
        }
        if let Some(lease) = self.lease {
            // The server closes a session idle this long, and so frees the lock of a
            // holder that fell silent; a live holder's checks keep it busy.
            let secs = super::lease_secs(lease);
            let set = match self.conn.as_mut().and_then(LockConn::raw) {
                Some(conn) => sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "SET SESSION wait_timeout = {secs}"
                )))
                .execute(conn)
                .await
                .map(|_| ())
                .map_err(map_sqlx),
                None => Err(closed()),
            };
            if let Err(e) = set {
                self.release_or_close().await;
                return Err(e);
            }
        }
        let token = match self.fence.take() {
            None => None,
            Some(row) => {
                let Some(conn) = self.conn.as_mut().and_then(LockConn::raw) else {
                    return Err(closed());
                };
                match super::fence::next_token(conn, &row).await {
                    Ok(t) => Some(t),
                    Err(e) => {
                        self.release_or_close().await;
                        return Err(e);
                    }
                }
            }
        };
        Ok(Some(token))
    }

    /// `GET_LOCK(name, 0)`: whether it was granted. Not granted, the connection goes
    /// back to its pool.
    async fn attempt(&mut self) -> Result<bool, Error> {
        let Some(lc) = self.conn.as_mut() else {
            return Err(closed());
        };
        let carried = lc.carried();
        let Some(conn) = lc.raw() else {
            return Err(closed());
        };
        let r = get_lock(conn, &self.name, 0, carried, None).await;
        match r {
            Ok(Some(1)) => Ok(true),
            Ok(Some(0)) => {
                self.recycle();
                Ok(false)
            }
            Ok(Some(other)) => {
                self.close().await;
                Err(unmapped_get_lock(other))
            }
            Ok(None) => {
                self.close().await;
                Err(null_get_lock())
            }
            Err(e) => {
                self.close().await;
                Err(map_sqlx(e))
            }
        }
    }

    /// Waits in `GET_LOCK` until granted (`true`) or the deadline passes (`false`; the
    /// session is killed and the connection closed, so a grant that raced the deadline
    /// is given up with it).
    async fn wait_for_it(
        &mut self,
        id: u64,
        deadline: Option<Instant>,
        who: (&str, &str),
    ) -> Result<bool, Error> {
        let secs = match deadline {
            None => FOREVER_SECS,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    // A deadline that passed before the wait began (a slow connection):
                    // every request tries the lock at least once.
                    return self.attempt().await;
                }
                // A backstop only: the wait is ended at the exact deadline below.
                left.as_secs() + 2
            }
        };
        let Some(lc) = self.conn.as_mut() else {
            return Err(closed());
        };
        let carried = lc.carried();
        let Some(conn) = lc.raw() else {
            return Err(closed());
        };
        let ended = {
            // A wait names its lock in a comment, so the processlist shows what it is for
            // (`dblock status`); only waits pay for it.
            let wait = get_lock(conn, &self.name, secs, carried, Some(who));
            match deadline {
                None => Ended::Answered(wait.await),
                Some(until) => tokio::select! {
                    // The wait first: a grant that is ready wins over a deadline just
                    // passed.
                    biased;
                    r = wait => Ended::Answered(r),
                    () = tokio::time::sleep_until(until) => Ended::Deadline,
                },
            }
        };
        match ended {
            Ended::Answered(Ok(Some(1))) => Ok(true),
            // The server-side backstop ran out first (a deadline a hair before ours).
            Ended::Answered(Ok(Some(0))) => {
                self.recycle();
                Ok(false)
            }
            Ended::Answered(Ok(Some(other))) => {
                self.close().await;
                Err(unmapped_get_lock(other))
            }
            Ended::Answered(Ok(None)) => {
                // Killed by someone else, or refused.
                self.close().await;
                Err(null_get_lock())
            }
            Ended::Answered(Err(e)) => {
                self.close().await;
                Err(map_sqlx(e))
            }
            Ended::Deadline => {
                // The statement is cut off mid-reply: end the session on the server
                // (which ends the wait, or frees a grant that just raced in) and drop
                // the connection.
                let kill = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")));
                let _ = tokio::time::timeout(self.check_timeout, kill.execute(&self.control)).await;
                if let Some(mut conn) = self.conn.take() {
                    conn.close_on_drop();
                }
                Ok(false)
            }
        }
    }

    /// While the lock is held: answer the guard's commands, check the connection every
    /// interval, release when the guard goes.
    async fn hold(
        mut self,
        slot: Arc<Shared>,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        first_check: Instant,
        _ended: TaskEnded,
    ) {
        let mut next_check = first_check;
        let mut known = None;
        loop {
            let cmd = tokio::select! {
                cmd = cmds.recv() => cmd,
                () = tokio::time::sleep_until(next_check), if known.is_none() => {
                    next_check = Instant::now() + self.check_interval;
                    // Not there: the guard was dropped, and the channel closes next.
                    if self.take_from(&slot) {
                        let r = self.check().await;
                        self.put_back(&slot);
                        if let Err(reason) = r {
                            known = Some(reason.clone());
                            slot.lose(reason);
                        }
                    }
                    continue;
                }
            };
            let known_loss = known.clone();
            match (cmd, known_loss) {
                (None, known_loss) => {
                    // The connection is here unless the guard's drop sent it back to its
                    // pool owing the release (the pool's flusher sends it, if no request
                    // carries it first).
                    let held = slot.lock().conn.take();
                    if let Some(conn) = held {
                        self.conn = Some(conn);
                        match known_loss {
                            None => self.release_or_close().await,
                            Some(_) => self.close().await,
                        }
                    }
                    return;
                }
                (Some(Cmd::Release(tx)), None) => {
                    let r = match self.take_from(&slot) {
                        true => self.release().await,
                        false => Err(lost(task_gone())),
                    };
                    let _ = tx.send(r);
                    return;
                }
                (Some(Cmd::Release(tx)), Some(reason)) => {
                    let _ = tx.send(Err(lost(reason)));
                    return;
                }
                (Some(Cmd::Check(tx)), None) => {
                    let r = match self.take_from(&slot) {
                        true => self.check().await,
                        false => Err(task_gone()),
                    };
                    self.put_back(&slot);
                    match r {
                        Ok(()) => {
                            let _ = tx.send(Ok(()));
                        }
                        Err(reason) => {
                            known = Some(reason.clone());
                            slot.lose(reason.clone());
                            let _ = tx.send(Err(lost(reason)));
                        }
                    }
                }
                (Some(Cmd::Check(tx)), Some(reason)) => {
                    let _ = tx.send(Err(lost(reason)));
                }
            }
        }
    }

    /// Moves the connection from the shared slot into the job, if it is there.
    fn take_from(&mut self, slot: &Shared) -> bool {
        self.conn = slot.lock().conn.take();
        self.conn.is_some()
    }

    /// Moves the connection back into the shared slot (when it is still open).
    fn put_back(&mut self, slot: &Shared) {
        if let Some(conn) = self.conn.take() {
            slot.lock().conn = Some(conn);
        }
    }

    /// Asks whether this session still holds the lock; on any doubt closes the
    /// connection (which frees the lock if it somehow still held it) and says why.
    async fn check(&mut self) -> Result<(), LossReason> {
        let Some(conn) = self.conn.as_mut().and_then(LockConn::raw) else {
            return Err(task_gone());
        };
        let q = sqlx::query_scalar::<_, i64>(
            "SELECT CAST(COALESCE(IS_USED_LOCK(?) = CONNECTION_ID(), 0) AS SIGNED)",
        )
        .bind(&self.name)
        .fetch_one(conn);
        let outcome = tokio::time::timeout(self.check_timeout, q).await;
        let reason = match outcome {
            Ok(Ok(1)) => return Ok(()),
            Ok(Ok(_)) => LossReason::ConnectionClosed {
                message: format!(
                    "the server no longer shows this session holding {}",
                    self.name
                ),
            },
            Ok(Err(e)) => LossReason::ConnectionClosed {
                message: e.to_string(),
            },
            Err(_) => LossReason::Unresponsive {
                after: self.check_timeout,
            },
        };
        self.close().await;
        Err(reason)
    }

    /// `RELEASE_LOCK`, then the connection goes back to the pool; if the server does not
    /// confirm, the connection is closed instead.
    async fn release(&mut self) -> Result<(), Error> {
        let Some(conn) = self.conn.as_mut().and_then(LockConn::raw) else {
            return Err(lost(task_gone()));
        };
        let r = sqlx::query_scalar::<_, Option<i64>>("SELECT CAST(RELEASE_LOCK(?) AS SIGNED)")
            .bind(&self.name)
            .fetch_one(&mut *conn)
            .await;
        match r {
            Ok(Some(1)) => {
                if self.lease.is_some() {
                    let reset = sqlx::raw_sql("SET SESSION wait_timeout = @@GLOBAL.wait_timeout")
                        .execute(conn)
                        .await;
                    if reset.is_err() {
                        // Released; only the connection is in doubt.
                        self.close().await;
                        return Ok(());
                    }
                }
                // Back to the pool, holding nothing.
                self.recycle();
                Ok(())
            }
            Ok(_) => {
                self.close().await;
                Err(lost(LossReason::ConnectionClosed {
                    message: format!("the server did not show this session holding {}", self.name),
                }))
            }
            Err(e) => {
                self.close().await;
                Err(lost(LossReason::ConnectionClosed {
                    message: e.to_string(),
                }))
            }
        }
    }

    async fn release_or_close(&mut self) {
        let _ = self.release().await;
    }

    /// Closes the connection (the server then frees whatever it held); it never goes
    /// back to the pool.
    async fn close(&mut self) {
        shut_down(&self.exported);
        if let Some(conn) = self.conn.take() {
            conn.close().await;
        }
    }

    /// Back to its pool: it holds nothing and no statement is in flight. A connection
    /// shared with a child is shut down and dropped instead.
    fn recycle(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            match shut_down(&self.exported) {
                true => conn.close_on_drop(),
                false => conn.recycle(),
            }
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Not closed or recycled on purpose: the request's future was dropped (a wait
        // or a grant may be in flight), or the runtime is shutting down. Never let such
        // a connection back into a pool, and end its session on the server.
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        shut_down(&self.exported);
        conn.close_on_drop();
        drop(conn);
        if let (Some(id), Ok(rt)) = (self.id, tokio::runtime::Handle::try_current()) {
            let control = self.control.clone();
            let timeout = self.check_timeout;
            rt.spawn(async move {
                let kill = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")));
                let _ = tokio::time::timeout(timeout, kill.execute(&control)).await;
            });
        }
    }
}

/// `GET_LOCK(name, secs)`, with a carried release of `carried` at the head of the same
/// message when there is one (sent on its own first if a name were not plain text).
async fn get_lock(
    conn: &mut MySqlConnection,
    name: &str,
    secs: u64,
    carried: Option<String>,
    who: Option<(&str, &str)>,
) -> Result<Option<i64>, sqlx::Error> {
    let plain = |n: &str| n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b':');
    // Lock names are `dblock:` and hex digits (checked): safe in the text.
    if plain(name) && carried.as_deref().is_none_or(plain) && (carried.is_some() || who.is_some()) {
        let mut sql = String::new();
        if let Some(old) = &carried {
            sql.push_str(&format!("DO RELEASE_LOCK('{old}'); "));
        }
        sql.push_str(&format!(
            "SELECT CAST(GET_LOCK('{name}', {secs}) AS SIGNED)"
        ));
        if let Some((namespace, lock)) = who {
            crate::status::write_comment(
                &mut sql,
                namespace,
                lock,
                None,
                Some(std::time::SystemTime::now()),
            );
        }
        let rows = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(conn).await?;
        return match rows.last() {
            Some(row) => row.try_get(0),
            None => Err(sqlx::Error::RowNotFound),
        };
    }
    if let Some(old) = carried {
        sqlx::query("DO RELEASE_LOCK(?)")
            .bind(&old)
            .execute(&mut *conn)
            .await?;
    }
    sqlx::query_scalar::<_, Option<i64>>("SELECT CAST(GET_LOCK(?, ?) AS SIGNED)")
        .bind(name)
        .bind(secs)
        .fetch_one(conn)
        .await
}

/// `GET_LOCK` answers 1, 0 or NULL; anything else is not "not obtained", and the
/// session is closed in case it was granted.
fn unmapped_get_lock(answer: i64) -> Error {
    Error::unexpected(format!(
        "GET_LOCK answered {answer} (it answers 1, 0 or NULL)"
    ))
}

fn null_get_lock() -> Error {
    Error::Database {
        code: ServerCode::default(),
        message: "GET_LOCK returned NULL (the wait was killed, or the server refused it)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> Arc<Shared> {
        Arc::new(Shared {
            state: Mutex::new(State {
                conn: None,
                job: None,
                cmds: None,
                first_check: Instant::now(),
                loss: None,
            }),
            ended: AtomicBool::new(false),
            changed: Notify::new(),
        })
    }

    /// A stream of grants dropped within their interval leaves the keeper a few dozen
    /// entries, not one per grant; grants still held are all kept (the control).
    #[test]
    fn the_keeper_forgets_grants_already_gone() {
        let keeper = Keeper::new(Duration::from_secs(1));
        let due = Instant::now() + Duration::from_secs(1);
        for _ in 0..10_000 {
            let g = grant();
            // No runtime here: it is recorded all the same, and says no task will run.
            assert!(!keeper.watch(due, &g));
        }
        let len = keeper.lock().waiting.len();
        assert!(len <= 2 * PURGE_MIN, "{len} entries for grants all gone");

        let held: Vec<Arc<Shared>> = (0..1_000).map(|_| grant()).collect();
        for g in &held {
            keeper.watch(due, g);
        }
        let live = keeper
            .lock()
            .waiting
            .iter()
            .filter(|(_, w)| w.strong_count() > 0)
            .count();
        assert_eq!(live, held.len());
    }
}
