//! What a connection, its task and its user exchange, whichever kind the connection
//! is: messages and the statements deferred to them, results, failures, and the link a
//! connection shares with its watchdog. A leaf: it names no connection kind.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

use crate::error::{Error, LossReason};

/// Rows of each statement of a simple query, first column only, as text.
pub(crate) type Results = Vec<Vec<Option<String>>>;

/// One value of a reply, as text: a lock request's answer allocates nothing (see
/// [`ShortText`](crate::text::ShortText)).
pub(crate) use crate::text::ShortText as Value;

/// Statements handed to a connection to send later ([`Conn::defer`]): its task sends
/// them alone the next time it runs, unless the next [`Message`] on the connection comes
/// first and carries them at its head ([`Deferred::carried_by`]).
///
/// [`Conn::defer`]: super::Conn::defer
pub(crate) enum Deferred {
    /// `ROLLBACK` of the transaction open on the connection (or of whatever a failed
    /// message left).
    Rollback {
        /// Whether the transaction is known to be one begun `ISOLATION LEVEL READ
        /// COMMITTED` (by [`Message::begin`]) and still open (if failed, in an aborted
        /// state): then a message that begins the same kind of transaction may carry it
        /// as `ROLLBACK AND CHAIN`. Not after a message that failed, which may have left
        /// no transaction open, where `AND CHAIN` is an error.
        chain: bool,
    },
    /// One statement whose effect no rollback undoes: ahead of a message that begins no
    /// transaction it shares that message's implicit one, and takes effect even if the
    /// message then fails, just as when sent alone.
    Standalone(Cow<'static, str>),
    /// `statements` statements that must take effect whatever the next message does:
    /// carried in a transaction of their own.
    InOwnTransaction {
        sql: Cow<'static, str>,
        statements: usize,
    },
}

impl Deferred {
    /// The statements sent on their own.
    pub(crate) fn sql(&self) -> &str {
        match self {
            Deferred::Rollback { .. } => "ROLLBACK",
            Deferred::Standalone(sql) | Deferred::InOwnTransaction { sql, .. } => sql,
        }
    }

    /// The text of `next` carrying these statements at its head, and how many
    /// statements they add before `next`'s own.
    pub(crate) fn carried_by<'a>(&self, next: &'a Message) -> (Cow<'a, str>, usize) {
        match self {
            Deferred::Rollback { chain: true } => match next.chained() {
                // `ROLLBACK AND CHAIN` stands in for the message's own BEGIN.
                Some(text) => (Cow::Owned(text), 0),
                None => (Cow::Borrowed(next.carrying_rollback()), 1),
            },
            Deferred::Rollback { chain: false } => (Cow::Borrowed(next.carrying_rollback()), 1),
            Deferred::Standalone(sql) if !next.begins() => {
                (Cow::Owned(joined(&["", sql, "; "], next)), 1)
            }
            // A transaction of its own, as when sent alone: committed whatever the message
            // then does (a SET is transactional), and the message starts with no snapshot
            // taken (a BEGIN ISOLATION LEVEL after a SELECT in one implicit block could
            // fail).
            Deferred::Standalone(sql) => {
                (Cow::Owned(joined(&["BEGIN; ", sql, "; COMMIT; "], next)), 3)
            }
            Deferred::InOwnTransaction { sql, statements } => (
                Cow::Owned(joined(&["BEGIN; ", sql, "; COMMIT; "], next)),
                statements + 2,
            ),
        }
    }
}

/// `head` then `next`'s statements, as one text.
fn joined(head: &[&str], next: &Message) -> String {
    let next = next.alone();
    let mut text = String::with_capacity(head.iter().map(|h| h.len()).sum::<usize>() + next.len());
    for part in head {
        text.push_str(part);
    }
    text.push_str(next);
    text
}

/// The statements of one simple-query message, written behind room for a `ROLLBACK`, so
/// that a [`Deferred`] one waiting on the connection can go out at its head without the
/// message copying itself. What may carry deferred statements: a message that begins a
/// transaction of its own ([`Message::begin`]) or runs plain statements, which behave
/// alike whether or not a transaction ended just before them in the same message.
pub(crate) struct Message {
    /// `ROLLBACK; ` then the statements, separated by `; `.
    text: String,
    /// Statements so far.
    statements: u32,
    /// Where the statements after a leading [`Message::begin`] start in `text`, if the
    /// message opened with one that may be chained.
    /// (`u32`s: a message is never 4 GiB, and every lock request's future holds one.)
    after_begin: Option<u32>,
    /// Whether the message opens with [`Message::begin`].
    begins: bool,
    /// Where [`Message::annotate`]'s comment starts in `text`; 0 if there is none (the
    /// text starts with `ROLLBACK; `, so no comment starts at 0).
    comment_at: u32,
    /// Where the last statement starts in `text` if it may run prepared (see
    /// [`Message::preparable`]); 0 if not. Found once, when the message is marked, rather
    /// than each time a round asks for it. (Each field as small as it can be: every lock
    /// request's future holds a message, and within the 1,032 bytes the C allocator's
    /// per-thread cache takes it stays cheap to allocate.)
    last: u32,
    /// If the prepared form takes the last statement's one integer as a parameter, the
    /// comment not sent with it (see [`Message::keyed`]): where the integer starts and where
    /// the `)` after it is, from the last statement's start; `(0, 0)` if not. Until the
    /// message is marked, the same for a last statement [`Message::push_call`] wrote, so
    /// that marking it does not search the text for what was just written there.
    key: (u8, u8),
}

/// What a held lock's health checks send, kept as the grant left it: the text of the
/// message that granted the lock (whose comment starts at `at`) and when. The label
/// ([`crate::status::label`]) is written only when a check first sends it — most locks
/// are released long before their first check, and pay for none.
pub(crate) struct CheckSql {
    text: String,
    at: usize,
    since: std::time::SystemTime,
}

impl CheckSql {
    /// The label a check sends: the comment, with the time of the grant.
    pub(crate) fn label(&self) -> Arc<str> {
        crate::status::label(self.text.get(self.at..).unwrap_or_default(), self.since)
    }
}

/// What a connection's checks send (see [`Link::check_sql`]).
enum Check {
    /// The empty query.
    Empty,
    /// A lock's comment, its label not yet written.
    Granted(CheckSql),
    /// The label, once written.
    Label(Arc<str>),
}

impl Message {
    const CARRIED: &'static str = "ROLLBACK; ";
    pub(crate) const BEGIN: &'static str = "BEGIN ISOLATION LEVEL READ COMMITTED";
    pub(crate) const CHAIN: &'static str = "ROLLBACK AND CHAIN";

    /// A message whose text is expected to take about `bytes` (it grows past them as
    /// needed): one allocation for the whole message, written once.
    pub(crate) fn with_capacity(bytes: usize) -> Message {
        let mut text = String::with_capacity(Message::CARRIED.len() + bytes);
        text.push_str(Message::CARRIED);
        Message {
            text,
            statements: 0,
            after_begin: None,
            begins: false,
            comment_at: 0,
            last: 0,
            key: (0, 0),
        }
    }

    /// Starts a new statement; returns its index.
    fn next_statement(&mut self) -> usize {
        if self.statements > 0 {
            self.text.push_str("; ");
        }
        self.last = 0;
        self.key = (0, 0);
        self.statements = self.statements.saturating_add(1);
        self.statements as usize - 1
    }

    /// Appends a statement made of `parts`; returns its index.
    pub(crate) fn push(&mut self, parts: &[&str]) -> usize {
        let i = self.next_statement();
        for p in parts {
            self.text.push_str(p);
        }
        i
    }

    /// Appends the call `HEAD(INTEGER)` of one integer (`head` ends with its `(`), the
    /// integer written as `integer`; returns its index. Remembers where the integer is,
    /// for [`Message::mark_preparable`].
    pub(crate) fn push_call(&mut self, head: &[&str], integer: &str) -> usize {
        let i = self.next_statement();
        let start = self.text.len();
        for p in head {
            self.text.push_str(p);
        }
        let open = self.text.len() - start;
        self.text.push_str(integer);
        let close = self.text.len() - start;
        self.text.push(')');
        self.key = match (u8::try_from(open), u8::try_from(close)) {
            (Ok(o), Ok(c)) if o > 0 => (o, c),
            _ => (0, 0),
        };
        i
    }

    /// Appends a statement written by `args`; returns its index.
    pub(crate) fn push_fmt(&mut self, args: std::fmt::Arguments<'_>) -> usize {
        use std::fmt::Write;
        // Writing into a String cannot fail.
        self.push_with(|text| {
            let _ = text.write_fmt(args);
        })
    }

    /// Appends a statement `write` writes at the end of the text; returns its index.
    pub(crate) fn push_with(&mut self, write: impl FnOnce(&mut String)) -> usize {
        let i = self.next_statement();
        write(&mut self.text);
        i
    }

    /// Appends `BEGIN ISOLATION LEVEL READ COMMITTED`. As the first statement, and with
    /// `chain` (PostgreSQL 12 or later), a deferred `ROLLBACK` of a transaction of the
    /// same kind may stand in for it as `ROLLBACK AND CHAIN`, which ends that
    /// transaction and at once begins one with the same characteristics: READ
    /// COMMITTED, as this BEGIN would.
    pub(crate) fn begin(&mut self, chain: bool) -> usize {
        let first = self.statements == 0;
        let i = self.push(&[Message::BEGIN]);
        if first {
            self.begins = true;
            if chain {
                self.after_begin = u32::try_from(self.text.len()).ok();
            }
        }
        i
    }

    /// Lets `f` append to the message's last statement (a comment).
    pub(crate) fn annotate(&mut self, f: impl FnOnce(&mut String)) {
        self.comment_at = u32::try_from(self.text.len()).unwrap_or(0);
        f(&mut self.text);
    }

    /// Hands the message's text over to a held lock's health checks, if it carries a
    /// comment (granted at `since`): no copy, once the message was sent. The message is
    /// left empty.
    pub(crate) fn take_check(&mut self, since: std::time::SystemTime) -> Option<CheckSql> {
        let at = std::mem::take(&mut self.comment_at) as usize;
        if at == 0 {
            return None;
        }
        Some(CheckSql {
            text: std::mem::take(&mut self.text),
            at,
            since,
        })
    }

    /// Removes what [`Message::annotate`] appended (tests compare bare statements).
    #[cfg(test)]
    pub(crate) fn strip_annotation(&mut self) {
        let at = std::mem::take(&mut self.comment_at) as usize;
        if at != 0 {
            self.text.truncate(at);
        }
    }

    /// Marks the last statement as one that may run prepared, apart from the statements
    /// before it (see `conn/prepared.rs`): its text is the same every time the request
    /// is made (no time in its comment), its one row a `void` (a wait) or a `bool` (read
    /// as `t` or `f`, as a simple query shows it). After a leading BEGIN, only if there
    /// is a statement after it. If `keyed`, one statement serves every key: its integer
    /// is a parameter and its comment is not sent with it (see [`Message::keyed`]) — for
    /// a try, whose comment need only show once the lock has been held a while, and the
    /// held lock's health checks send it; a wait's must show while it waits, so its whole
    /// text is prepared. Keyed only if what follows the integer's
    /// `)` is nothing or one comment with no `*` inside (dblock's comments percent-encode
    /// it, see `status::encode`; a search for one byte is the cheapest that proves the
    /// comment one).
    pub(crate) fn mark_preparable(&mut self, keyed: bool) {
        // The span of a call `push_call` wrote last (a statement after it, or a mark,
        // clears it).
        let written = std::mem::take(&mut self.key);
        self.last = 0;
        if self.statements <= u32::from(self.begins) {
            return;
        }
        let last = self.last_at();
        self.last = u32::try_from(last).unwrap_or(0);
        if !keyed || self.last == 0 {
            return;
        }
        let statement = self.text.get(last..).unwrap_or_default();
        // Written by `push_call`: where its integer is is known, not searched for.
        let span = match written {
            (0, _) => key_span(statement).map(|(open, close, _)| (open, close)),
            (open, close) => Some((usize::from(open), usize::from(close))),
        };
        self.key = span
            .filter(|&(_, close)| {
                let rest = statement.get(close + 1..).unwrap_or_default().trim_start();
                rest.is_empty()
                    || (rest.len() >= 4
                        && rest.starts_with("/*")
                        && rest.ends_with("*/")
                        && rest
                            .get(2..rest.len() - 2)
                            .is_some_and(|body| !body.contains('*')))
            })
            .and_then(|(open, close)| Some((u8::try_from(open).ok()?, u8::try_from(close).ok()?)))
            .unwrap_or((0, 0));
    }

    /// The last statement's parts, if [`Message::mark_preparable`] marked it `keyed`:
    /// its text up to and with the `(` ahead of its one integer, and the integer. What
    /// follows the `)` (nothing, or the comment naming the lock) is not sent with it: the
    /// held lock's health checks send the comment (see `extended::Last::key`).
    pub(crate) fn keyed(&self) -> Option<(&str, i64)> {
        // Unmarked (`last` 0), `key` may hold what `push_call` wrote: not keyed yet.
        if self.key.0 == 0 || self.last == 0 {
            return None;
        }
        let statement = self.text.get(self.last as usize..)?;
        let (open, close) = (usize::from(self.key.0), usize::from(self.key.1));
        Some((
            statement.get(..open)?,
            statement.get(open..close)?.parse().ok()?,
        ))
    }

    /// Whether [`Message::mark_preparable`] marked the message (and no statement was
    /// added since).
    pub(crate) fn preparable(&self) -> bool {
        self.last != 0
    }

    /// Where the last statement starts in `text`: after the last `; ` ahead of the
    /// comment (a statement dblock writes holds none, and the comment's values are
    /// percent-encoded), which is the carried `ROLLBACK; `'s for a message of one.
    fn last_at(&self) -> usize {
        if self.last != 0 {
            return self.last as usize;
        }
        let end = match self.comment_at {
            0 => self.text.len(),
            c => c as usize,
        };
        // Bytes, not `rfind("; ")`: a two-byte pattern's searcher costs more to set up
        // than the few dozen bytes it searches.
        self.text
            .as_bytes()
            .get(..end)
            .and_then(|t| t.windows(2).rposition(|w| w == b"; "))
            .map_or(Message::CARRIED.len(), |at| at + "; ".len())
    }

    /// The last statement's text (with a comment appended to it).
    pub(crate) fn last_statement(&self) -> &str {
        self.text.get(self.last_at()..).unwrap_or_default()
    }

    /// The message without its last statement: what goes ahead of it, as a simple query,
    /// when it runs prepared.
    pub(crate) fn without_last(&self) -> Message {
        let cut = self.last_at().saturating_sub(match self.statements > 1 {
            true => "; ".len(),
            false => 0,
        });
        let statements = self.statements.saturating_sub(1);
        Message {
            text: self.text.get(..cut).unwrap_or_default().to_string(),
            statements,
            after_begin: self.after_begin.filter(|a| *a as usize <= cut),
            begins: self.begins && statements > 0,
            comment_at: 0,
            last: 0,
            key: (0, 0),
        }
    }

    /// The statements ahead of the last one, with those `deferred` on the connection
    /// carried at their head, and how many statements were carried: what
    /// [`Deferred::carried_by`] makes of [`Message::without_last`], without copying the
    /// text where a `ROLLBACK` is carried (every round after a transaction-scoped lock's
    /// release) or nothing is.
    pub(crate) fn head_carrying<'a>(&'a self, deferred: Option<&Deferred>) -> (Head<'a>, usize) {
        let cut = self.last_at().saturating_sub(match self.statements > 1 {
            true => "; ".len(),
            false => 0,
        });
        let borrowed = |from: usize| Cow::Borrowed(self.text.get(from..cut).unwrap_or_default());
        let chainable = self.after_begin.filter(|a| *a as usize <= cut);
        match (deferred, chainable) {
            (None, _) => (Head::of(None, borrowed(Message::CARRIED.len())), 0),
            (Some(Deferred::Rollback { chain: true }), Some(after)) => {
                (Head::of(Some(Message::CHAIN), borrowed(after as usize)), 0)
            }
            (Some(Deferred::Rollback { .. }), _) => (Head::of(None, borrowed(0)), 1),
            (Some(d), _) => {
                let without = self.without_last();
                let (text, carried) = d.carried_by(&without);
                (Head::of(None, Cow::Owned(text.into_owned())), carried)
            }
        }
    }

    /// How many statements the message has.
    pub(crate) fn statements(&self) -> usize {
        self.statements as usize
    }

    /// Whether the message opens with a BEGIN.
    pub(crate) fn begins(&self) -> bool {
        self.begins
    }

    /// The message alone.
    pub(crate) fn alone(&self) -> &str {
        self.text.get(Message::CARRIED.len()..).unwrap_or_default()
    }

    /// `ROLLBACK; ` and the message, one statement more than [`Message::alone`].
    pub(crate) fn carrying_rollback(&self) -> &str {
        &self.text
    }

    /// The message with `ROLLBACK AND CHAIN` for its leading BEGIN, as many statements
    /// as [`Message::alone`]; `None` if it has no such BEGIN.
    pub(crate) fn chained(&self) -> Option<String> {
        let rest = self.text.get(self.after_begin? as usize..)?;
        let mut text = String::with_capacity(Message::CHAIN.len() + rest.len());
        text.push_str(Message::CHAIN);
        text.push_str(rest);
        Some(text)
    }
}

/// The statements that go ahead of a message's last one ([`Message::head_carrying`]): a
/// first statement standing apart (`ROLLBACK AND CHAIN` in place of the message's BEGIN),
/// then the rest's text, statements joined by `; `.
pub(crate) struct Head<'a> {
    first: Option<&'static str>,
    rest: Cow<'a, str>,
}

impl<'a> Head<'a> {
    fn of(first: Option<&'static str>, rest: Cow<'a, str>) -> Head<'a> {
        Head { first, rest }
    }

    /// The statements, in order. (The rest's text may begin with the `; ` that followed
    /// a BEGIN, and end in the `; ` that joined carried statements to a message with
    /// nothing ahead of its last statement.)
    pub(crate) fn statements(&self) -> impl Iterator<Item = &str> {
        let rest = self.rest.strip_suffix("; ").unwrap_or(&self.rest);
        let rest = match self.first {
            Some(_) => rest.strip_prefix("; ").unwrap_or(rest),
            None => rest,
        };
        self.first.into_iter().chain(
            (!rest.is_empty())
                .then(|| rest.split("; "))
                .into_iter()
                .flatten(),
        )
    }
}

/// A statement of one integer, `PREFIX(INTEGER)REST`, as its parts: its text up to and
/// with the `(`, the integer, and what follows the `)`, trimmed at its start.
pub(crate) fn split_key(statement: &str) -> Option<(&str, i64, &str)> {
    let (open, close, key) = key_span(statement)?;
    Some((
        statement.get(..open)?,
        key,
        statement.get(close + 1..)?.trim_start(),
    ))
}

/// Where the integer of `PREFIX(INTEGER)REST` starts (after the first `(`), where the
/// `)` after it is, and the integer.
fn key_span(statement: &str) -> Option<(usize, usize, i64)> {
    // Bytes, not `str::find(char)`: its searcher's set-up costs more than the few dozen
    // bytes it scans, twice a round.
    let bytes = statement.as_bytes();
    let open = bytes.iter().position(|&b| b == b'(')? + 1;
    let close = open + bytes.get(open..)?.iter().position(|&b| b == b')')?;
    Some((open, close, statement.get(open..close)?.parse().ok()?))
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
    /// What the server or the driver said.
    pub(crate) fn into_message(self) -> String {
        match self {
            QueryError::Db { message, .. } | QueryError::Lost { message } => message,
        }
    }

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

/// What a connection and its watchdog (the task that checks it) share.
pub(crate) struct Link {
    /// Whether the watchdog checks the connection every interval: while what its user
    /// keeps in the session depends on the session staying alive.
    watched: AtomicBool,
    /// `Some` once the connection is known to be gone.
    lost: watch::Sender<Option<LossReason>>,
    /// What a check sends: the empty query, or a comment the connection's user chose
    /// (so that `pg_stat_activity.query` keeps showing it).
    check_sql: std::sync::Mutex<Check>,
    /// This process's duplicate of the socket, once the connection is shared with a
    /// child process: shut down when the connection is lost or given up, since closing
    /// this process's descriptors no longer ends it while the child holds one.
    exported: std::sync::Mutex<Option<std::os::fd::OwnedFd>>,
}

impl Link {
    pub(crate) fn new() -> Arc<Link> {
        Arc::new(Link {
            watched: AtomicBool::new(false),
            lost: watch::Sender::new(None),
            check_sql: std::sync::Mutex::new(Check::Empty),
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

    /// Whether the connection's socket was shared with a child (see [`Link::export`]).
    pub(crate) fn is_exported(&self) -> bool {
        self.exported
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
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

    /// Sets what checks send from now on (a comment: still an empty query to the server).
    pub(crate) fn set_check_sql(&self, sql: CheckSql) {
        *self.check_sql.lock().unwrap_or_else(|p| p.into_inner()) = Check::Granted(sql);
    }

    /// What a check sends: the comment set, its label written on the first check, or
    /// the empty query.
    pub(crate) fn check_sql(&self) -> Arc<str> {
        let mut check = self.check_sql.lock().unwrap_or_else(|p| p.into_inner());
        let label = match &*check {
            Check::Empty => return Arc::from(""),
            Check::Label(l) => return l.clone(),
            Check::Granted(g) => g.label(),
        };
        *check = Check::Label(label.clone());
        label
    }

    /// Whether the watchdog checks the connection.
    pub(crate) fn watched(&self) -> bool {
        self.watched.load(Ordering::Relaxed)
    }

    /// Turns the watchdog's checks on or off.
    pub(crate) fn set_watched(&self, on: bool) {
        self.watched.store(on, Ordering::Relaxed);
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
    pub(crate) fn lost(&self) -> impl std::future::Future<Output = LossReason> + Send + 'static {
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
/// (its runtime shut down), the connection is gone with it, and must show as lost
/// rather than alive forever.
pub(crate) struct LostOnDrop(pub(crate) Arc<Link>);

impl Drop for LostOnDrop {
    fn drop(&mut self) {
        // A no-op when the task ended normally: it marks the link lost itself first.
        self.0.mark_lost(LossReason::ConnectionClosed {
            message: "the runtime driving the connection shut down".into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(last: &str, comment: &str) -> Message {
        let mut m = Message::with_capacity(64);
        m.begin(true);
        m.push(&[last]);
        if !comment.is_empty() {
            m.annotate(|t| t.push_str(comment));
        }
        m
    }

    /// A round's head as [`Message::head_carrying`] gives it, copying nothing where a
    /// `ROLLBACK` or nothing is carried, is the head the message without its last
    /// statement carries ([`Deferred::carried_by`]), statement for statement.
    #[test]
    fn a_borrowed_head_is_the_carried_head() {
        let messages = || {
            let mut chained = message("SELECT f(1)", " /* c */");
            chained.mark_preparable(true);
            let mut set = Message::with_capacity(64);
            set.begin(true);
            set.push(&["SET LOCAL lock_timeout = 5"]);
            set.push(&["SELECT g(2)"]);
            set.mark_preparable(false);
            let mut unchained = Message::with_capacity(64);
            unchained.begin(false);
            unchained.push(&["SELECT f(3)"]);
            unchained.mark_preparable(true);
            let mut alone = Message::with_capacity(64);
            alone.push(&["SELECT pg_catalog.pg_advisory_unlock(4)"]);
            alone.push(&["SELECT f(5)"]);
            alone.mark_preparable(true);
            let mut one = Message::with_capacity(64);
            one.push(&["SELECT f(6)"]);
            one.mark_preparable(true);
            [chained, set, unchained, alone, one]
        };
        let deferred = || {
            [
                None,
                Some(Deferred::Rollback { chain: true }),
                Some(Deferred::Rollback { chain: false }),
                Some(Deferred::Standalone(
                    "SELECT pg_catalog.pg_advisory_unlock(7)".into(),
                )),
                Some(Deferred::InOwnTransaction {
                    sql: "SELECT 1; SELECT 2".into(),
                    statements: 2,
                }),
            ]
        };
        for m in messages() {
            assert!(m.preparable(), "{}", m.alone());
            for d in deferred() {
                let without = m.without_last();
                let (text, carried) = match &d {
                    Some(d) => d.carried_by(&without),
                    None => (Cow::Borrowed(without.alone()), 0),
                };
                let text = text.strip_suffix("; ").unwrap_or(&text);
                let want: Vec<&str> = match text.is_empty() {
                    true => Vec::new(),
                    false => text.split("; ").collect(),
                };
                let (head, got_carried) = m.head_carrying(d.as_ref());
                let got: Vec<&str> = head.statements().collect();
                assert_eq!(
                    got,
                    want,
                    "{} carrying {:?}",
                    m.alone(),
                    d.as_ref().map(Deferred::sql)
                );
                assert_eq!(got_carried, carried, "{}", m.alone());
                assert_eq!(got.len(), carried + m.statements() - 1, "{}", m.alone());
            }
        }
    }

    /// A call written by `push_call` is the text of the same call pushed whole and is
    /// keyed alike; a statement after it is read from its own text.
    #[test]
    fn a_written_call_is_keyed_as_the_same_text() {
        for key in [i64::MIN, -1, 0, 7, i64::MAX] {
            let text = format!("{key}");
            let mut m = Message::with_capacity(64);
            m.begin(true);
            m.push_call(&["SELECT f", "("], &text);
            m.annotate(|t| t.push_str(" /* dblock name=a */"));
            let mut whole = message(&format!("SELECT f({key})"), " /* dblock name=a */");
            assert_eq!(m.alone(), whole.alone());
            m.mark_preparable(true);
            whole.mark_preparable(true);
            assert_eq!(m.keyed(), Some(("SELECT f(", key)));
            assert_eq!(whole.keyed(), Some(("SELECT f(", key)));
            // Marked again (as a plan never does): the same.
            m.mark_preparable(true);
            assert_eq!(m.keyed(), Some(("SELECT f(", key)));
        }
        // Not marked: not keyed, whatever the call wrote.
        let mut m = Message::with_capacity(64);
        m.begin(true);
        m.push_call(&["SELECT f("], "5");
        assert!(!m.preparable());
        assert_eq!(m.keyed(), None);
        // A statement after the call is the last one: read from its own text.
        let mut m = Message::with_capacity(64);
        m.begin(true);
        m.push_call(&["SELECT f("], "5");
        m.push(&["SELECT g(6)"]);
        m.mark_preparable(true);
        assert_eq!(m.keyed(), Some(("SELECT g(", 6)));
        let mut m = Message::with_capacity(64);
        m.begin(true);
        m.push_call(&["SELECT f("], "5");
        m.push(&["SELECT g()"]);
        m.mark_preparable(true);
        assert_eq!(m.keyed(), None);
        // A comment that is not one dblock writes keeps the call's whole text prepared.
        let mut m = Message::with_capacity(64);
        m.begin(true);
        m.push_call(&["SELECT f("], "5");
        m.annotate(|t| t.push_str(" /* a*b */"));
        m.mark_preparable(true);
        assert!(m.preparable());
        assert_eq!(m.keyed(), None);
    }

    /// A keyed statement is one integer's call and, after it, nothing or one comment:
    /// anything else keeps its whole text prepared, as a wait's is.
    #[test]
    fn only_a_call_of_one_integer_and_a_comment_is_keyed() {
        let mut m = message("SELECT f(-42)", " /* dblock name=a */");
        m.mark_preparable(true);
        assert_eq!(m.keyed(), Some(("SELECT f(", -42)));
        let mut m = message("SELECT f(42)", "");
        m.mark_preparable(true);
        assert_eq!(m.keyed(), Some(("SELECT f(", 42)));
        let mut m = message("SELECT f(42)", " /**/");
        m.mark_preparable(true);
        assert_eq!(m.keyed(), Some(("SELECT f(", 42)));
        for (last, comment) in [
            ("SELECT f(42) AND g()", ""),
            ("SELECT f(42)", " /* a */ /* b */"),
            ("SELECT f(42)", " /* a */*/"),
            // A star inside: never in dblock's comments, which percent-encode it.
            ("SELECT f(42)", " /* a*b */"),
            // An unterminated comment, whose `/*` and `*/` share the star.
            ("SELECT f(42)", " /*/"),
            ("SELECT f(x)", ""),
        ] {
            let mut m = message(last, comment);
            m.mark_preparable(true);
            assert!(m.preparable(), "{last}{comment}");
            assert_eq!(m.keyed(), None, "{last}{comment}");
        }
        // Not asked: never keyed.
        let mut m = message("SELECT f(42)", " /* dblock name=a */");
        m.mark_preparable(false);
        assert_eq!(m.keyed(), None);
        // A BEGIN alone has no statement to prepare.
        let mut m = Message::with_capacity(16);
        m.begin(true);
        m.mark_preparable(true);
        assert!(!m.preparable());
    }
}
