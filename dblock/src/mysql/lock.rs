//! One held (or awaited) named lock: a task that owns its connection.
//!
//! The acquisition, the checks while the lock is held and the release all run on a
//! task spawned per request, which owns the pooled connection. The request's future
//! only waits for the task's answer, so dropping it never leaves a statement half-sent
//! or a wait running: the task sees the answer's receiver close, ends the server-side
//! wait with `KILL QUERY` from a control connection, and closes the lock's connection
//! (which releases anything it holds). The guard's half ([`MyHeld`]) is a channel to
//! the task: dropping it makes the task send `RELEASE_LOCK` at once and put the
//! connection back in the pool.

use std::time::Duration;

use sqlx::MySql;
use sqlx::pool::PoolConnection;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::{FOREVER_SECS, MyBackend, map_sqlx};
use crate::error::{Error, LossReason};
use crate::raw::{BoxFuture, Grant, RawHeld, Req, Wait};

/// How long a killed wait may take to return before its connection is dropped
/// unanswered.
const KILL_GRACE: Duration = Duration::from_secs(5);

/// How long to wait for a killed wait to return before killing it again.
const KILL_RETRY: Duration = Duration::from_millis(100);

/// A request from the guard to its task.
enum Cmd {
    Check(oneshot::Sender<Result<(), Error>>),
    Release(oneshot::Sender<Result<(), Error>>),
}

/// The MySQL half of a guard: the way to its connection's task.
pub(crate) struct MyHeld {
    cmds: mpsc::UnboundedSender<Cmd>,
    loss: watch::Receiver<Option<LossReason>>,
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

    /// Releases the lock and waits for the server's answer.
    pub(crate) async fn release(self) -> Result<(), Error> {
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
}

fn task_gone() -> LossReason {
    LossReason::ConnectionClosed {
        message: "the lock's connection task ended".into(),
    }
}

fn lost(reason: LossReason) -> Error {
    Error::LockLost { reason }
}

/// Takes the lock `req` names on a connection of `b`'s pool, by way of a task that owns
/// that connection for as long as the lock is held.
pub(crate) async fn acquire(b: &MyBackend, req: &Req<'_>) -> Result<Option<Grant>, Error> {
    let conn = b.pool.acquire().await.map_err(map_sqlx)?;
    let control = b.control().await?.clone();
    let (reply, answer) = oneshot::channel();
    let job = Job {
        conn: Some(conn),
        name: b.lock_name(req.key),
        who: (req.namespace.to_string(), req.name.to_string()),
        wait: req.wait,
        fence: req.fenced.then(|| super::fence::FenceRow {
            key: req.key,
            namespace: req.namespace.to_string(),
            name: req.name.to_string(),
        }),
        control,
        lease: req.lease,
        check_interval: b.check_interval,
        check_timeout: b.check_timeout,
    };
    tokio::spawn(job.run(reply));
    match answer.await {
        Ok(r) => r,
        Err(_) => Err(Error::ConnectionLost {
            message: "the lock's connection task ended".into(),
        }),
    }
}

struct Job {
    /// `None` once closed.
    conn: Option<PoolConnection<MySql>>,
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
}

type Reply = oneshot::Sender<Result<Option<Grant>, Error>>;

/// How a wait in `GET_LOCK` ended.
enum Ended {
    Answered(Result<Option<i64>, sqlx::Error>),
    Deadline,
    Cancelled,
}

impl Job {
    async fn run(mut self, mut reply: Reply) {
        let taken = self.take(&mut reply).await;
        let token = match taken {
            Ok(Some(token)) => token,
            Ok(None) => {
                let _ = reply.send(Ok(None));
                return;
            }
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let (cmds, cmd_rx) = mpsc::unbounded_channel();
        let (loss_tx, loss) = watch::channel(None);
        let grant = Grant {
            held: Box::new(MyHeld { cmds, loss }),
            fence: token.map(|t| (t, std::sync::Arc::from(crate::raw::FENCING_TABLE))),
        };
        // If the request's future is gone, the grant comes back and drops here, which
        // closes the command channel: `hold` then releases at once.
        drop(reply.send(Ok(Some(grant))));
        self.hold(cmd_rx, loss_tx).await;
    }

    /// Takes the lock: `Ok(Some(token))` when held (with the fencing token if asked
    /// for), `Ok(None)` when not granted in time. Leaves nothing held unless it returns
    /// `Ok(Some(_))`.
    async fn take(&mut self, reply: &mut Reply) -> Result<Option<Option<i64>>, Error> {
        let Some(conn) = self.conn.as_mut() else {
            return Err(Error::ConnectionLost {
                message: "the connection was closed".into(),
            });
        };
        // One round trip: the connection's id (for KILL QUERY, should a wait follow) and
        // an attempt that does not wait.
        let first: Result<(i64, Option<i64>), sqlx::Error> = sqlx::query_as(
            "SELECT CAST(CONNECTION_ID() AS SIGNED), CAST(GET_LOCK(?, 0) AS SIGNED)",
        )
        .bind(&self.name)
        .fetch_one(&mut **conn)
        .await;
        let (id, got) = match first {
            Ok(r) => r,
            Err(e) => {
                self.close().await;
                return Err(map_sqlx(e));
            }
        };
        let granted = match got {
            Some(1) => true,
            Some(_) => false,
            None => {
                self.close().await;
                return Err(null_get_lock());
            }
        };
        if !granted {
            let deadline = match self.wait {
                Wait::Try => return Ok(None),
                w => w.deadline(),
            };
            if !self.wait_for_it(id, deadline, reply).await? {
                return Ok(None);
            }
        }
        if reply.is_closed() {
            self.release_or_close().await;
            return Err(Error::Unsupported("cancelled".into()));
        }
        if let Some(lease) = self.lease {
            // The server closes a session idle this long, and so frees the lock of a
            // holder that fell silent; a live holder's checks keep it busy.
            let secs = lease.as_secs_f64().ceil().max(1.0) as u64;
            let set = match self.conn.as_mut() {
                Some(conn) => sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "SET SESSION wait_timeout = {secs}"
                )))
                .execute(&mut **conn)
                .await
                .map(|_| ())
                .map_err(map_sqlx),
                None => Err(Error::ConnectionLost {
                    message: "the connection was closed".into(),
                }),
            };
            if let Err(e) = set {
                self.release_or_close().await;
                return Err(e);
            }
        }
        let token = match self.fence.take() {
            None => None,
            Some(row) => {
                let Some(conn) = self.conn.as_mut() else {
                    return Err(Error::ConnectionLost {
                        message: "the connection was closed".into(),
                    });
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

    /// Waits in `GET_LOCK` until granted (`true`), the deadline passes or the request
    /// is dropped (`false`; the wait is killed and the connection closed).
    async fn wait_for_it(
        &mut self,
        id: i64,
        deadline: Option<Instant>,
        reply: &mut Reply,
    ) -> Result<bool, Error> {
        let secs = match deadline {
            None => FOREVER_SECS,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                // A backstop only: the wait is killed at the exact deadline below.
                left.as_secs() + 2
            }
        };
        let Some(conn) = self.conn.as_mut() else {
            return Ok(false);
        };
        let ended = {
            // In text, not prepared, with a comment naming the lock: the processlist then
            // shows what the wait is for (`dblock status`). Only waits pay for it, and
            // the GET_LOCK name is hex and colons, safe to quote.
            let mut sql = format!("SELECT CAST(GET_LOCK('{}', {secs}) AS SIGNED)", self.name);
            crate::status::write_comment(
                &mut sql,
                &self.who.0,
                &self.who.1,
                None,
                Some(std::time::SystemTime::now()),
            );
            let wait = async move {
                use sqlx::Row;
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .fetch_one(&mut **conn)
                    .await
                    .and_then(|row| row.try_get::<Option<i64>, _>(0))
            };
            let mut wait = std::pin::pin!(wait);
            let until = deadline.unwrap_or_else(far_future);
            let ended = tokio::select! {
                // The wait first, so its statement is sent before a cancellation that
                // is already known is acted on: a kill must find the wait running.
                biased;
                r = &mut wait => Ended::Answered(r),
                () = tokio::time::sleep_until(until) => Ended::Deadline,
                () = reply.closed() => Ended::Cancelled,
            };
            match ended {
                Ended::Answered(r) => Ended::Answered(r),
                cut => {
                    // End the wait on the server, then let the statement finish so the
                    // connection is not dropped mid-reply. Whatever it answers, the
                    // connection is closed below: a grant that raced the kill is given
                    // up with it.
                    // The kill is repeated until the wait ends: one sent before the
                    // statement reached the server finds nothing to kill.
                    let give_up = Instant::now() + KILL_GRACE;
                    loop {
                        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL QUERY {id}")))
                            .execute(&self.control)
                            .await;
                        let step = (Instant::now() + KILL_RETRY).min(give_up);
                        if tokio::time::timeout_at(step, &mut wait).await.is_ok()
                            || Instant::now() >= give_up
                        {
                            break;
                        }
                    }
                    cut
                }
            }
        };
        match ended {
            Ended::Answered(Ok(Some(1))) => Ok(true),
            // The server-side backstop ran out first (a deadline a hair before ours).
            Ended::Answered(Ok(Some(_))) => Ok(false),
            Ended::Answered(Ok(None)) => {
                // Killed by someone else, or refused.
                self.close().await;
                Err(null_get_lock())
            }
            Ended::Answered(Err(e)) => {
                self.close().await;
                Err(map_sqlx(e))
            }
            Ended::Deadline | Ended::Cancelled => {
                self.close().await;
                Ok(false)
            }
        }
    }

    /// While the lock is held: answer the guard's commands, check the connection every
    /// interval, release when the guard goes.
    async fn hold(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<Cmd>,
        loss: watch::Sender<Option<LossReason>>,
    ) {
        let mut next_check = Instant::now() + self.check_interval;
        loop {
            let cmd = tokio::select! {
                cmd = cmds.recv() => cmd,
                () = tokio::time::sleep_until(next_check), if loss.borrow().is_none() => {
                    if let Err(reason) = self.check().await {
                        loss.send_replace(Some(reason));
                    }
                    next_check = Instant::now() + self.check_interval;
                    continue;
                }
            };
            let known_loss = loss.borrow().clone();
            match (cmd, known_loss) {
                (None, None) => {
                    self.release_or_close().await;
                    return;
                }
                (None, Some(_)) => return,
                (Some(Cmd::Release(tx)), None) => {
                    let r = self.release().await;
                    let _ = tx.send(r);
                    return;
                }
                (Some(Cmd::Release(tx)), Some(reason)) => {
                    let _ = tx.send(Err(lost(reason)));
                    return;
                }
                (Some(Cmd::Check(tx)), None) => match self.check().await {
                    Ok(()) => {
                        let _ = tx.send(Ok(()));
                    }
                    Err(reason) => {
                        loss.send_replace(Some(reason.clone()));
                        let _ = tx.send(Err(lost(reason)));
                    }
                },
                (Some(Cmd::Check(tx)), Some(reason)) => {
                    let _ = tx.send(Err(lost(reason)));
                }
            }
        }
    }

    /// Asks whether this session still holds the lock; on any doubt closes the
    /// connection (which frees the lock if it somehow still held it) and says why.
    async fn check(&mut self) -> Result<(), LossReason> {
        let Some(conn) = self.conn.as_mut() else {
            return Err(task_gone());
        };
        let q = sqlx::query_scalar::<_, i64>(
            "SELECT CAST(COALESCE(IS_USED_LOCK(?) = CONNECTION_ID(), 0) AS SIGNED)",
        )
        .bind(&self.name)
        .fetch_one(&mut **conn);
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
        let Some(conn) = self.conn.as_mut() else {
            return Err(lost(task_gone()));
        };
        let r = sqlx::query_scalar::<_, Option<i64>>("SELECT CAST(RELEASE_LOCK(?) AS SIGNED)")
            .bind(&self.name)
            .fetch_one(&mut **conn)
            .await;
        match r {
            Ok(Some(1)) => {
                if self.lease.is_some() {
                    let reset = sqlx::raw_sql("SET SESSION wait_timeout = @@GLOBAL.wait_timeout")
                        .execute(&mut **conn)
                        .await;
                    if reset.is_err() {
                        // Released; only the connection is in doubt.
                        self.close().await;
                        return Ok(());
                    }
                }
                // Back to the pool, holding nothing.
                self.conn = None;
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
        if let Some(conn) = self.conn.take() {
            let _ = conn.close().await;
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Not closed or returned on purpose (the runtime is shutting down mid-statement):
        // never let such a connection back into the pool.
        if let Some(conn) = self.conn.as_mut() {
            conn.close_on_drop();
        }
    }
}

fn null_get_lock() -> Error {
    Error::Database {
        code: None,
        message: "GET_LOCK returned NULL (the wait was killed, or the server refused it)".into(),
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(FOREVER_SECS)
}
