//! What a connection, its task and the lock logic exchange, whichever kind the
//! connection is: results, releases, lock requests' SQL, failures and the link a
//! connection shares with its watchdog. A leaf: it names no connection kind.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

use crate::error::{Error, LossReason};

/// Rows of each statement of a simple query, first column only, as text.
pub(crate) type Results = Vec<Vec<Option<String>>>;

/// A held lock's release, as handed to `Conn::send_release`.
pub(crate) enum Release {
    /// `ROLLBACK`, which ends a transaction-scoped lock's transaction (or whatever
    /// transaction a failed request left).
    Rollback {
        /// Whether the transaction is known to be one dblock began `ISOLATION LEVEL READ
        /// COMMITTED` and still open (if failed, in an aborted state), as a held lock's
        /// is: then a request that begins the same kind of transaction may carry the
        /// release as `ROLLBACK AND CHAIN` (see [`LockSql::begin`]). Not after a request
        /// that failed, which may have left no transaction open, where `AND CHAIN` is
        /// an error.
        chain: bool,
    },
    /// A session-scoped lock's unlock: `statements` statements that can run in a
    /// transaction of their own.
    Unlock {
        sql: Cow<'static, str>,
        statements: usize,
    },
}

impl Release {
    /// The release sent on its own.
    pub(crate) fn sql(&self) -> &str {
        match self {
            Release::Rollback { .. } => "ROLLBACK",
            Release::Unlock { sql, .. } => sql,
        }
    }

    /// The message of lock request `req` carrying this release at its head, and how
    /// many statements the release adds before the request's.
    pub(crate) fn carried_by<'a>(&self, req: &'a LockSql) -> (Cow<'a, str>, usize) {
        match self {
            Release::Rollback { chain: true } => match req.chained() {
                // `ROLLBACK AND CHAIN` stands in for the request's own BEGIN.
                Some(text) => (Cow::Owned(text), 0),
                None => (Cow::Borrowed(req.carrying_rollback()), 1),
            },
            Release::Rollback { chain: false } => (Cow::Borrowed(req.carrying_rollback()), 1),
            // A lone pg_advisory_unlock ahead of a request that begins no transaction:
            // both in one implicit transaction. The unlock takes effect at once and is
            // not undone if the transaction then fails (advisory session locks are not
            // transactional), just as when sent alone.
            Release::Unlock { sql, statements } if *statements == 1 && !req.begins() => {
                let req = req.alone();
                let mut text = String::with_capacity(sql.len() + req.len() + 2);
                for part in [sql, "; ", req] {
                    text.push_str(part);
                }
                (Cow::Owned(text), 1)
            }
            // Otherwise in a transaction of its own, as when sent alone: committed
            // whatever the request then does (a lease's reset is a transactional SET),
            // and the request starts with no snapshot taken (a BEGIN ISOLATION LEVEL
            // after a SELECT in one implicit block could fail).
            Release::Unlock { sql, statements } => {
                let req = req.alone();
                let mut text = String::with_capacity(sql.len() + req.len() + 17);
                for part in ["BEGIN; ", sql, "; COMMIT; ", req] {
                    text.push_str(part);
                }
                (Cow::Owned(text), statements + 2)
            }
        }
    }
}

/// The SQL of a lock request, written behind room for a `ROLLBACK` so that the request
/// can carry one waiting to be sent on its connection without copying itself.
pub(crate) struct LockSql {
    /// `ROLLBACK; ` then the request's statements, separated by `; `.
    text: String,
    /// Statements so far.
    statements: usize,
    /// Where the statements after a leading [`LockSql::begin`] start in `text`, if the
    /// request opened with one that may be chained.
    after_begin: Option<usize>,
    /// Whether the request opens with [`LockSql::begin`].
    begins: bool,
    /// Where [`LockSql::annotate`]'s comment starts in `text`, if there is one.
    comment_at: Option<usize>,
}

impl LockSql {
    const CARRIED: &'static str = "ROLLBACK; ";
    const BEGIN: &'static str = "BEGIN ISOLATION LEVEL READ COMMITTED";
    const CHAIN: &'static str = "ROLLBACK AND CHAIN";

    pub(crate) fn new() -> LockSql {
        let mut text = String::with_capacity(128);
        text.push_str(LockSql::CARRIED);
        LockSql {
            text,
            statements: 0,
            after_begin: None,
            begins: false,
            comment_at: None,
        }
    }

    /// Appends a statement made of `parts`; returns its index.
    pub(crate) fn push(&mut self, parts: &[&str]) -> usize {
        if self.statements > 0 {
            self.text.push_str("; ");
        }
        for p in parts {
            self.text.push_str(p);
        }
        self.statements += 1;
        self.statements - 1
    }

    /// Appends `BEGIN ISOLATION LEVEL READ COMMITTED`. As the first statement, and with
    /// `chain` (PostgreSQL 12 or later), a waiting `ROLLBACK` of a transaction of the
    /// same kind may stand in for it as `ROLLBACK AND CHAIN`, which ends that
    /// transaction and at once begins one with the same characteristics: READ
    /// COMMITTED, as this BEGIN would.
    pub(crate) fn begin(&mut self, chain: bool) -> usize {
        let first = self.statements == 0;
        let i = self.push(&[LockSql::BEGIN]);
        if first {
            self.begins = true;
            if chain {
                self.after_begin = Some(self.text.len());
            }
        }
        i
    }

    /// Lets `f` append to the request's last statement (a comment).
    pub(crate) fn annotate(&mut self, f: impl FnOnce(&mut String)) {
        self.comment_at = Some(self.text.len());
        f(&mut self.text);
    }

    /// The comment [`LockSql::annotate`] appended (empty if none).
    pub(crate) fn comment(&self) -> &str {
        self.comment_at
            .and_then(|at| self.text.get(at..))
            .unwrap_or_default()
    }

    /// Removes what [`LockSql::annotate`] appended (tests compare bare statements).
    #[cfg(test)]
    pub(crate) fn strip_annotation(&mut self) {
        if let Some(at) = self.comment_at.take() {
            self.text.truncate(at);
        }
    }

    /// Whether the request opens with a BEGIN (a transaction-scoped one).
    pub(crate) fn begins(&self) -> bool {
        self.begins
    }

    /// The request alone.
    pub(crate) fn alone(&self) -> &str {
        self.text.get(LockSql::CARRIED.len()..).unwrap_or_default()
    }

    /// `ROLLBACK; ` and the request, one statement more than [`LockSql::alone`].
    pub(crate) fn carrying_rollback(&self) -> &str {
        &self.text
    }

    /// The request with `ROLLBACK AND CHAIN` for its leading BEGIN, as many statements
    /// as [`LockSql::alone`]; `None` if it has no such BEGIN.
    pub(crate) fn chained(&self) -> Option<String> {
        let rest = self.text.get(self.after_begin?..)?;
        let mut text = String::with_capacity(LockSql::CHAIN.len() + rest.len());
        text.push_str(LockSql::CHAIN);
        text.push_str(rest);
        Some(text)
    }
}

/// A failed request, before it is mapped to an [`Error`].
#[derive(Debug)]
pub(crate) enum QueryError {
    /// The server answered with an error; the connection is usable.
    Db { code: String, message: String },
    /// The connection is gone.
    Lost { message: String },
}

impl QueryError {
    pub(crate) fn into_error(self) -> Error {
        match self {
            QueryError::Db { code, message } => Error::from_sqlstate(&code, message),
            QueryError::Lost { message } => Error::ConnectionLost { message },
        }
    }

    pub(crate) fn from_driver(e: tokio_postgres::Error) -> QueryError {
        match e.as_db_error() {
            Some(db) => {
                let mut message = db.message().to_string();
                if let Some(d) = db.detail() {
                    message.push_str(" (");
                    message.push_str(d);
                    message.push(')');
                }
                if let Some(h) = db.hint() {
                    message.push_str("; hint: ");
                    message.push_str(h);
                }
                let code = db.code().code().to_string();
                // A FATAL error ends the session, whatever its code.
                if matches!(db.severity(), "FATAL" | "PANIC") {
                    QueryError::Lost { message }
                } else {
                    QueryError::Db { code, message }
                }
            }
            None => QueryError::Lost {
                message: e.to_string(),
            },
        }
    }
}

/// What a connection and its watchdog share.
pub(crate) struct Link {
    /// Whether a lock is held on the connection (the watchdog checks only then).
    holding: AtomicBool,
    /// `Some` once the connection is known to be gone.
    lost: watch::Sender<Option<LossReason>>,
    /// What health checks send while a lock is held: a comment naming the lock (see
    /// [`status`](crate::status)), so that `pg_stat_activity.query` keeps naming it.
    label: std::sync::Mutex<Option<Arc<str>>>,
    /// This process's duplicate of the socket, once a held lock's connection is shared
    /// with a child process: shut down when the connection is lost or given up, since
    /// closing this process's descriptors no longer ends it while the child holds one.
    exported: std::sync::Mutex<Option<std::os::fd::OwnedFd>>,
}

impl Link {
    pub(crate) fn new() -> Arc<Link> {
        Arc::new(Link {
            holding: AtomicBool::new(false),
            lost: watch::Sender::new(None),
            label: std::sync::Mutex::new(None),
            exported: std::sync::Mutex::new(None),
        })
    }

    /// Keeps `fd`, a duplicate of the connection's socket shared with a child, to shut
    /// it down when the connection ends (see [`Link::shut_down_exported`]).
    pub(crate) fn export(&self, fd: std::os::fd::OwnedFd) {
        *self.exported.lock().unwrap_or_else(|p| p.into_inner()) = Some(fd);
    }

    /// A duplicate of the exported socket, for another child.
    pub(crate) fn exported_dup(&self) -> Option<std::io::Result<std::os::fd::OwnedFd>> {
        let fd = self.exported.lock().unwrap_or_else(|p| p.into_inner());
        fd.as_ref().map(std::os::fd::OwnedFd::try_clone)
    }

    /// Ends a connection shared with a child for every copy of its socket
    /// (`shutdown(2)`), once; whether it was shared.
    pub(crate) fn shut_down_exported(&self) -> bool {
        let fd = self
            .exported
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match fd {
            Some(fd) => {
                crate::sys::shutdown(&fd);
                true
            }
            None => false,
        }
    }

    /// Sets what health checks send while the lock now granted is held.
    pub(crate) fn set_label(&self, label: Arc<str>) {
        *self.label.lock().unwrap_or_else(|p| p.into_inner()) = Some(label);
    }

    /// What a health check sends: the held lock's comment, or the empty query.
    pub(crate) fn label(&self) -> Arc<str> {
        match &*self.label.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(l) => l.clone(),
            None => Arc::from(""),
        }
    }

    pub(crate) fn holding(&self) -> bool {
        self.holding.load(Ordering::Relaxed)
    }

    pub(crate) fn set_holding(&self, on: bool) {
        self.holding.store(on, Ordering::Relaxed);
    }

    pub(crate) fn loss(&self) -> Option<LossReason> {
        self.lost.borrow().clone()
    }

    pub(crate) fn mark_lost(&self, reason: LossReason) {
        self.lost.send_if_modified(|s| {
            if s.is_none() {
                *s = Some(reason);
                true
            } else {
                false
            }
        });
        // A connection given up must end on the server too, whoever else holds a copy.
        self.shut_down_exported();
    }

    /// Resolves when the connection is lost.
    pub(crate) fn watch(&self) -> impl std::future::Future<Output = LossReason> + Send + 'static {
        let mut rx = self.lost.subscribe();
        async move {
            match rx.wait_for(Option::is_some).await {
                Ok(r) => r.clone().unwrap_or(LossReason::ConnectionClosed {
                    message: "closed".into(),
                }),
                // The sender lives in the Link, which outlives every connection use; if it
                // is gone, so is the connection.
                Err(_) => LossReason::ConnectionClosed {
                    message: "closed".into(),
                },
            }
        }
    }
}

/// Held by the task that runs a connection: if the task is dropped before it ends
/// (its runtime shut down), the connection is gone with it, and whatever was held on
/// it must show as lost rather than held forever.
pub(crate) struct LostOnDrop(pub(crate) Arc<Link>);

impl Drop for LostOnDrop {
    fn drop(&mut self) {
        // A no-op when the task ended normally: it marks the link lost itself first.
        self.0.mark_lost(LossReason::ConnectionClosed {
            message: "the runtime driving the connection shut down".into(),
        });
    }
}
