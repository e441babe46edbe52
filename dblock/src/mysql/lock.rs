//! One lock: taken in the request's own future, then held by a task that owns its
//! connection.
//!
//! The acquisition is one statement on dblock's own connections (`GET_LOCK(name, 0)`
//! for `try`, `GET_LOCK(name, S)` otherwise), sent from the caller's future: no task or
//! channel between the request and the server. Its connection's server id is known
//! beforehand (see `pool.rs`), so a deadline, or the request's future being dropped,
//! ends the wait with `KILL CONNECTION` from a control connection and the connection is
//! closed (`Job`'s `Drop`): nothing stays held, no wait keeps running. Once granted, a
//! task checks the connection every interval and releases the lock when asked; the
//! guard's half ([`MyHeld`]) is a channel to that task and a share of the connection's
//! slot.
//!
//! Dropping the guard of a lock on dblock's own connection (without a lease) does not
//! wait for a round trip: the connection goes straight back to its pool owing the
//! release (`pool.rs`), so that the next request to take it, often the same caller's
//! next `lock`, sends `DO RELEASE_LOCK('old'); SELECT GET_LOCK('new', S)` as one message
//! — the release carried by the next request, as on PostgreSQL. The guard's task, woken
//! by the drop, sends the release alone if no request took the connection first, so a
//! dropped guard's lock is freed promptly either way. A request cancelled while carrying
//! a release closes its connection (and kills the session), which frees the lock too.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use sqlx::{AssertSqlSafe, MySqlConnection, Row};

use super::pool::{LockConn, Parked};
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

/// Where a held lock's connection is.
enum Slot {
    /// Idle between checks, holding the lock.
    Held(LockConn),
    /// Back in its pool, owing the lock's release (the guard was dropped).
    Carried(Parked),
    /// With the task (a check or the release in progress), or gone.
    Empty,
}

/// The slot a guard and its task share. Dropped holding a connection (the runtime shut
/// down), it closes it rather than let it back into a caller's pool with a lock held.
struct SlotCell(std::sync::Mutex<Slot>);

impl SlotCell {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self) -> Slot {
        std::mem::replace(&mut *self.lock(), Slot::Empty)
    }
}

impl Drop for SlotCell {
    fn drop(&mut self) {
        if let Slot::Held(conn) = self.take() {
            let mut conn = conn;
            conn.close_on_drop();
        }
    }
}

/// The MySQL half of a guard: the way to its connection's task.
pub(crate) struct MyHeld {
    cmds: mpsc::UnboundedSender<Cmd>,
    loss: watch::Receiver<Option<LossReason>>,
    /// `None` once released explicitly.
    slot: Option<std::sync::Arc<SlotCell>>,
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
        let Some(slot) = self.slot.take() else {
            return;
        };
        if !self.carry {
            return; // the task releases when the channel closes
        }
        let mut s = slot.lock();
        if let Slot::Held(conn) = std::mem::replace(&mut *s, Slot::Empty) {
            *s = match conn.park_releasing(std::mem::take(&mut self.name)) {
                Ok(parked) => Slot::Carried(parked),
                Err(conn) => Slot::Held(conn),
            };
        }
        // The channel closes after this (its sender is a field): the task then sends
        // the release itself unless a request took the connection first.
    }
}

impl MyHeld {
    /// Why the lock was lost, if it was.
    pub(crate) fn loss(&self) -> Option<LossReason> {
        self.loss.borrow().clone()
    }

    /// Resolves with the reason once the lock is lost.
    pub(crate) fn watch_loss(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let mut rx = self.loss.clone();
        async move {
            match rx.wait_for(Option::is_some).await {
                Ok(r) => r.clone().unwrap_or_else(task_gone),
                // The task ended without a loss: the guard was released, or the runtime
                // is shutting down. Either way the lock is not held.
                Err(_) => task_gone(),
            }
        }
    }

    /// Asks the server, now, whether this session still holds the lock.
    pub(crate) async fn check(&mut self) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        if self.cmds.send(Cmd::Check(tx)).is_err() {
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
        // Not carried: the caller waits for the server's answer.
        self.slot = None;
        let (tx, rx) = oneshot::channel();
        if self.cmds.send(Cmd::Release(tx)).is_err() {
            return Err(lost(task_gone()));
        }
        rx.await.unwrap_or_else(|_| Err(lost(task_gone())))
    }
}

// Dropping a MyHeld drops its sender: the task sees the channel close and releases.

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
        who: (req.namespace.to_string(), req.name.to_string()),
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
    let token = match job.take().await? {
        Some(token) => token,
        None => return Ok(None),
    };
    let (cmds, cmd_rx) = mpsc::unbounded_channel();
    let (loss_tx, loss) = watch::channel(None);
    // No await from here to the return: the grant cannot be dropped half-made.
    let Some(conn) = job.conn.take() else {
        return Err(closed());
    };
    let slot = std::sync::Arc::new(SlotCell(std::sync::Mutex::new(Slot::Held(conn))));
    let held = MyHeld {
        cmds,
        loss,
        slot: Some(slot.clone()),
        name: job.name.clone(),
        carry: job.lease.is_none(),
        id: job.id,
        server_port: b.server_port(),
        control: job.control.clone(),
        exported: job.exported.clone(),
    };
    tokio::spawn(job.hold(slot, cmd_rx, loss_tx));
    Ok(Some(Grant {
        held: Box::new(held),
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
    /// The request's namespace and name, which a wait names in a comment.
    who: (String, String),
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
    /// `Ok(Some(_))`.
    async fn take(&mut self) -> Result<Option<Option<i64>>, Error> {
        let granted = match self.id {
            // dblock's own connection: one statement, whatever the wait.
            Some(id) => match self.wait {
                Wait::Try => self.attempt().await?,
                w => self.wait_for_it(id, w.deadline()).await?,
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
                    (Some(0), w) => self.wait_for_it(id as u64, w.deadline()).await?,
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
    async fn wait_for_it(&mut self, id: u64, deadline: Option<Instant>) -> Result<bool, Error> {
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
            let wait = get_lock(conn, &self.name, secs, carried, Some(&self.who));
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
        slot: std::sync::Arc<SlotCell>,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        loss: watch::Sender<Option<LossReason>>,
    ) {
        let mut next_check = Instant::now() + self.check_interval;
        loop {
            let cmd = tokio::select! {
                cmd = cmds.recv() => cmd,
                () = tokio::time::sleep_until(next_check), if loss.borrow().is_none() => {
                    next_check = Instant::now() + self.check_interval;
                    // Not there: the guard was dropped, and the channel closes next.
                    if self.take_from(&slot) {
                        let r = self.check().await;
                        self.put_back(&slot);
                        if let Err(reason) = r {
                            loss.send_replace(Some(reason));
                        }
                    }
                    continue;
                }
            };
            let known_loss = loss.borrow().clone();
            match (cmd, known_loss) {
                (None, known_loss) => {
                    match slot.take() {
                        Slot::Held(conn) => {
                            self.conn = Some(conn);
                            match known_loss {
                                None => self.release_or_close().await,
                                Some(_) => self.close().await,
                            }
                        }
                        Slot::Carried(parked) => {
                            // Let a request that is about to take the connection carry
                            // the release; otherwise send it now.
                            tokio::task::yield_now().await;
                            parked.pool.flush(parked.id, self.check_timeout).await;
                        }
                        Slot::Empty => {}
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
                            loss.send_replace(Some(reason.clone()));
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
    fn take_from(&mut self, slot: &SlotCell) -> bool {
        let mut s = slot.lock();
        match std::mem::replace(&mut *s, Slot::Empty) {
            Slot::Held(conn) => {
                self.conn = Some(conn);
                true
            }
            other => {
                *s = other;
                false
            }
        }
    }

    /// Moves the connection back into the shared slot (when it is still open).
    fn put_back(&mut self, slot: &SlotCell) {
        if let Some(conn) = self.conn.take() {
            *slot.lock() = Slot::Held(conn);
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
    who: Option<&(String, String)>,
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
