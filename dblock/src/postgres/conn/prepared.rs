//! The lock statements a session has prepared (`Parse`d once, then run by `Bind` and
//! `Execute`), so that a lock request skips the server's parse, analysis and planning of
//! its statement: about a third of the server's work for a lone lock statement (pgbench,
//! `-M simple` against `-M prepared`).
//!
//! Which statements: a round [`Message::mark_preparable`] marked — one key's try or
//! wait, in either scope, its text the same every time (a name found busy lately waits
//! at once, with no time in its comment), on dblock's own session straight to the server
//! (never through a pooler, whose next client would not have the statement, nor on a
//! caller's sqlx connection). A try's statement serves every key, its key a parameter,
//! its comment the process's mark alone (`/* dblock holder=… */`, no name): the lock's
//! name shows in `pg_stat_activity.query` from the held lock's first health check, which
//! sends its comment (within one `check_interval` of the grant), and a lock let go before
//! then never costs the server a `Parse` of it; a
//! wait's whole text is prepared, comment included, so that it names the waiter while it
//! waits. What goes ahead of it in its round (`ROLLBACK AND CHAIN` or
//! `BEGIN`, a session-scoped lock's `pg_advisory_unlock` carried by the next request, a
//! wait's settings) goes in the same round under one `Sync` (`extended.rs`), the common
//! ones prepared once a session: one write, one reply, as the simple query.
//!
//! Why one `Sync`: tokio-postgres's published API ends every extended-protocol request
//! in a `Sync` of its own, so a prepared round took two replies where a simple one takes
//! one; on an uncontended try with eight workers on two cores the second reply cost more
//! than the parse saved (0.90–0.96× the build before), and only a hot name's wait gained
//! (docs/performance.md, seventeenth session). dblock's copy of tokio-postgres sends a
//! round's messages as they are (vendor/tokio-postgres/PATCH.md).
//!
//! When: a try's statement (one a session, for every key) is parsed in the first round
//! that needs it; a wait's text is run as a simple query the first time it is seen on the
//! session, parsed the second time in that round (after its head: a head that fails
//! leaves it unsent, and the next time parses again), and bound and executed from then
//! on. A name waited for once costs nothing more. At most [`MAX_PREPARED`] statements a
//! session (the server keeps about 8 KiB each, measured with
//! `pg_backend_memory_contexts`): past that, texts run as simple queries. A statement
//! refused or missing (an undetected transaction pooler) turns preparing off on the
//! connection, and that round runs again as the simple query it would have been.
//!
//! [`Message::mark_preparable`]: super::wire::Message::mark_preparable

use std::collections::{HashMap, HashSet};

/// The most statements one session prepares.
pub(crate) const MAX_PREPARED: usize = 256;

/// The most texts remembered as seen once (then forgotten all at once).
const MAX_SEEN: usize = 1024;

/// The server's code for a prepared statement it does not have.
pub(crate) const NO_SUCH_STATEMENT: &str = "26000";

/// What a session has prepared, and the texts it has seen once.
#[derive(Default)]
pub(crate) struct Prepared {
    seen: HashSet<Box<str>>,
    /// Each prepared text's statement (named by `extended::Name::of`).
    statements: HashMap<Box<str>, u32>,
    /// The id the next statement prepared takes.
    next: u32,
    /// Whether the session has the statements that open a round (`extended::FIXED`).
    pub(crate) fixed: bool,
    /// Set when the session showed it is not one session (a `Parse` refused, a prepared
    /// statement missing: a transaction pooler that was neither declared nor detected):
    /// nothing is prepared on it any more.
    off: bool,
    /// The text last found prepared, and its statement: a session's tries all ask for the
    /// same one (the statement that serves every key), and comparing its few dozen bytes
    /// costs a tenth of hashing them.
    last: Option<(Box<str>, u32)>,
}

/// How a named `Parse` went (see [`Prepared::parsed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parse<'a> {
    /// The server has the statement.
    Completed,
    /// A statement ahead of it failed, and the server skipped it.
    NotReached,
    /// Refused, with the server's code if it gave one.
    Refused(Option<&'a str>),
}

/// How a preparable round runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// As a simple query, its text noted as seen.
    Simple,
    /// Under one `Sync`, the statement's `Parse` in the round, under this id: the text's
    /// second time on the session.
    Prepare(u32),
    /// Prepared, as this statement.
    Prepared(u32),
}

impl Prepared {
    /// How the round whose last statement is `text` runs; the text is noted as seen.
    /// `at_once`: prepared the first time it is seen (a statement that serves every key).
    /// One look-up of the text: the statement's id comes with the answer.
    pub(crate) fn use_for(&mut self, text: &str, at_once: bool) -> Use {
        if let Some((last, id)) = &self.last
            && **last == *text
        {
            return Use::Prepared(*id);
        }
        if let Some(&id) = self.statements.get(text) {
            self.last = Some((text.into(), id));
            return Use::Prepared(id);
        }
        if self.off || self.statements.len() >= MAX_PREPARED {
            return Use::Simple;
        }
        if at_once || self.seen.contains(text) {
            return Use::Prepare(self.next);
        }
        if self.seen.len() >= MAX_SEEN {
            self.seen.clear();
        }
        self.seen.insert(text.into());
        Use::Simple
    }

    /// The statement prepared for `text` (`Ok`), or the id a statement for it is to be
    /// parsed under (`Err`).
    #[cfg(test)]
    pub(crate) fn statement(&self, text: &str) -> Result<u32, u32> {
        self.statements.get(text).copied().ok_or(self.next)
    }

    /// Notes how the named `Parse` of `text` as statement `id` went: completed (the
    /// statement is kept), not reached (a statement ahead of it failed: the next time
    /// parses again), or refused with `code`, which turns preparing off. (It is sent after
    /// the round's head, which begins or rolls back a transaction: it never meets an
    /// aborted one.)
    ///
    /// `text` `None`: only the statements that open a round were parsed.
    pub(crate) fn parsed(&mut self, text: Option<&str>, id: u32, parse: Parse<'_>) {
        match parse {
            Parse::Completed => {
                self.fixed = true;
                if let Some(text) = text {
                    self.seen.remove(text);
                    self.statements.insert(text.into(), id);
                    self.next = self.next.wrapping_add(1);
                }
            }
            Parse::NotReached => {}
            Parse::Refused(_) => self.turn_off(),
        }
    }

    /// Stops preparing on this session, and forgets what it prepared: its statements
    /// run as simple queries from now on. (The server keeps those it has, at most
    /// [`MAX_PREPARED`], until the session ends.)
    pub(crate) fn turn_off(&mut self) {
        self.off = true;
        self.fixed = false;
        self.statements.clear();
        self.seen.clear();
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text runs simple the first time, prepares the second, and runs prepared once a
    /// statement is kept; a `Parse` not reached is tried again, a refusal turns preparing
    /// off.
    #[test]
    fn a_text_is_prepared_the_second_time_and_a_refusal_turns_preparing_off() {
        let mut p = Prepared::default();
        // A statement for every key: prepared the first time.
        assert_eq!(p.use_for("k(", true), Use::Prepare(0));
        assert_eq!(p.statement("k("), Err(0));
        assert_eq!(p.use_for("a", false), Use::Simple);
        assert_eq!(p.use_for("a", false), Use::Prepare(0));
        // Not reached: the next time prepares again.
        p.parsed(Some("a"), 0, Parse::NotReached);
        assert_eq!(p.use_for("a", false), Use::Prepare(0));
        assert_eq!(p.statement("a"), Err(0));
        // Completed: kept, and the next text takes the next id.
        p.parsed(Some("a"), 0, Parse::Completed);
        assert_eq!(p.use_for("a", false), Use::Prepared(0));
        // Asked again (the text last found): the same statement.
        assert_eq!(p.use_for("a", false), Use::Prepared(0));
        assert_eq!(p.statement("a"), Ok(0));
        assert_eq!(p.statement("b"), Err(1));
        assert_eq!(p.use_for("b", false), Use::Simple);
        assert_eq!(p.use_for("b", false), Use::Prepare(1));
        // Any other refusal: nothing is prepared on the session any more.
        p.parsed(Some("b"), 1, Parse::Refused(Some("42P05")));
        assert_eq!(p.use_for("a", false), Use::Simple);
        assert_eq!(p.use_for("a", false), Use::Simple);
        assert_eq!(p.use_for("b", false), Use::Simple);
        assert!(p.statement("a").is_err());
        assert_eq!(p.use_for("c", true), Use::Simple, "off: not even at once");
    }

    /// The seen texts are bounded: past `MAX_SEEN` they are forgotten all at once.
    #[test]
    fn the_texts_seen_once_are_bounded() {
        let mut p = Prepared::default();
        for i in 0..MAX_SEEN {
            assert_eq!(p.use_for(&i.to_string(), false), Use::Simple);
        }
        assert_eq!(p.use_for("0", false), Use::Prepare(0));
        assert_eq!(p.use_for("new", false), Use::Simple);
        assert!(p.seen.len() <= MAX_SEEN);
        assert_eq!(
            p.use_for("0", false),
            Use::Simple,
            "forgotten when the set was full"
        );
    }
}
