//! The lock statements a session has prepared (`Parse`d once, then run by `Bind` and
//! `Execute`), so that a hot name's wait skips the server's parse, analysis and planning
//! of its statement on every hand-off.
//!
//! Which statements: a round [`Message::mark_preparable`] marked — one key's
//! transaction-scoped wait, its text the same every time (a name found busy lately waits
//! at once, with no time in its comment), on dblock's own session straight to the
//! server (never through a pooler, whose next client would not have the statement, nor
//! on a caller's sqlx connection). The comment naming the lock is part of the prepared
//! text, so `pg_stat_activity.query` still names the waiter, and the holder after. What
//! goes ahead of it in its message (`ROLLBACK AND CHAIN` or `BEGIN`, the wait's
//! settings) is sent as a simple query queued in the same write
//! (`NativeConn::first_values_preparable`).
//!
//! Why only a wait: tokio-postgres ends every extended-protocol request in a `Sync` of
//! its own, so a prepared round takes two replies where a simple one takes one. On a hot
//! name the parse is on every hand-off's path and the CPU is not the limit: there the
//! transaction-scoped hand-off between handles went from 0.84–0.92× sqlx's
//! `PgAdvisoryLock` (which prepares its statements too) to 0.97–1.01×. On an uncontended
//! try the second reply cost eight workers on two cores more than the parse saved
//! (0.90–0.96× the build before). A session-scoped wait's head is the previous lock's
//! `pg_advisory_unlock`, itself parsed and planned: it gained nothing. Figures:
//! docs/performance.md, seventeenth session.
//!
//! When: the second time a text is seen on the session, its `Parse` is queued just ahead
//! of that round's message and its reply read after the round's (no round trip of its
//! own); from the third on, it runs prepared. Nothing is kept waiting for a reply between
//! rounds: a pending `Parse` held in the session's state would hold its client, and a
//! connection given up must close when it is dropped. A name waited for once costs
//! nothing more. At most [`MAX_PREPARED`] statements a
//! session (the server keeps about 8 KiB each, measured with
//! `pg_backend_memory_contexts`): past that, texts run as simple queries. A session
//! whose server refuses a `Parse` (but for an aborted transaction, which a wait's ended
//! slice leaves) or loses a prepared statement prepares nothing more.
//!
//! [`Message::mark_preparable`]: super::wire::Message::mark_preparable

use std::collections::{HashMap, HashSet};

use tokio_postgres::Statement;

/// The most statements one session prepares.
pub(crate) const MAX_PREPARED: usize = 256;

/// The most texts remembered as seen once (then forgotten all at once).
const MAX_SEEN: usize = 1024;

/// The server's code for a statement sent in a transaction already aborted.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// The server's code for a prepared statement it does not have.
pub(crate) const NO_SUCH_STATEMENT: &str = "26000";

/// What a session has prepared, and the texts it has seen once.
#[derive(Default)]
pub(crate) struct Prepared {
    seen: HashSet<Box<str>>,
    statements: HashMap<Box<str>, Statement>,
    /// Set when the session showed it is not one session (a `Parse` refused but for an
    /// aborted transaction, a prepared statement missing: a transaction pooler that was
    /// neither declared nor detected): nothing is prepared on it any more.
    off: bool,
}

/// How a preparable round runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// As a simple query, its text noted as seen.
    Simple,
    /// As a simple query with the statement's `Parse` queued just ahead of it and its
    /// reply read after the round's: the text's second time on the session.
    SimpleThenPrepare,
    /// Prepared.
    Prepared,
}

impl Prepared {
    /// How the round whose last statement is `text` runs; the text is noted as seen.
    pub(crate) fn use_for(&mut self, text: &str) -> Use {
        if self.statements.contains_key(text) {
            return Use::Prepared;
        }
        if self.off || self.statements.len() >= MAX_PREPARED {
            return Use::Simple;
        }
        if self.seen.contains(text) {
            return Use::SimpleThenPrepare;
        }
        if self.seen.len() >= MAX_SEEN {
            self.seen.clear();
        }
        self.seen.insert(text.into());
        Use::Simple
    }

    /// The statement prepared for `text`, if there is one.
    pub(crate) fn statement(&self, text: &str) -> Option<Statement> {
        self.statements.get(text).cloned()
    }

    /// Keeps `text`'s statement, or, if its `Parse` was refused with `code`, notes why:
    /// behind a round that failed (a wait's slice ended) the `Parse` met the aborted
    /// transaction and may be sent again; any other refusal turns preparing off.
    pub(crate) fn parsed(&mut self, text: &str, parse: Result<Statement, Option<&str>>) {
        match parse {
            Ok(statement) => {
                self.seen.remove(text);
                self.statements.insert(text.into(), statement);
            }
            Err(Some(IN_FAILED_TRANSACTION)) => {}
            Err(_) => self.turn_off(),
        }
    }

    /// Stops preparing on this session, and forgets what it prepared: its statements
    /// run as simple queries from now on.
    pub(crate) fn turn_off(&mut self) {
        self.off = true;
        self.statements.clear();
        self.seen.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text runs simple the first time, prepares the second, and runs prepared once a
    /// statement is kept; a `Parse` refused in an aborted transaction is tried again, any
    /// other refusal turns preparing off.
    #[test]
    fn a_text_is_prepared_the_second_time_and_a_refusal_turns_preparing_off() {
        let mut p = Prepared::default();
        assert_eq!(p.use_for("a"), Use::Simple);
        assert_eq!(p.use_for("a"), Use::SimpleThenPrepare);
        // Refused behind a failed round: the next time prepares again.
        p.parsed("a", Err(Some(IN_FAILED_TRANSACTION)));
        assert_eq!(p.use_for("a"), Use::SimpleThenPrepare);
        assert_eq!(p.use_for("b"), Use::Simple);
        // Any other refusal: nothing is prepared on the session any more.
        p.parsed("a", Err(Some("42P05")));
        assert_eq!(p.use_for("a"), Use::Simple);
        assert_eq!(p.use_for("a"), Use::Simple);
        assert_eq!(p.use_for("b"), Use::Simple);
        assert!(p.statement("a").is_none());
    }

    /// The seen texts are bounded: past `MAX_SEEN` they are forgotten all at once.
    #[test]
    fn the_texts_seen_once_are_bounded() {
        let mut p = Prepared::default();
        for i in 0..MAX_SEEN {
            assert_eq!(p.use_for(&i.to_string()), Use::Simple);
        }
        assert_eq!(p.use_for("0"), Use::SimpleThenPrepare);
        assert_eq!(p.use_for("new"), Use::Simple);
        assert!(p.seen.len() <= MAX_SEEN);
        assert_eq!(
            p.use_for("0"),
            Use::Simple,
            "forgotten when the set was full"
        );
    }
}
