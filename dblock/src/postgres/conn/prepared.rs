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
//! (`NativeConn::first_values_prepared`).
//!
//! Why only a wait: tokio-postgres ends every extended-protocol request in a `Sync` of
//! its own, so a prepared round takes two replies where a simple one takes one. On a hot
//! name the parse is on every hand-off's path and the CPU is not the limit: there the
//! transaction-scoped hand-off between handles went from 0.84–0.92× sqlx's
//! `PgAdvisoryLock` (which prepares its statements too) to 0.97–0.98×. On an uncontended
//! try the second reply cost eight workers on two cores more than the parse saved
//! (0.90–0.96× the build before). A session-scoped wait's head is the previous lock's
//! `pg_advisory_unlock`, itself parsed and planned: it gained nothing. Figures:
//! docs/performance.md, seventeenth session.
//!
//! When: the second time a text is seen on the session, its `Parse` is queued behind that
//! round's message, without waiting (its reply is read at a later use); from the third
//! on, it runs prepared. A name waited for once costs nothing more. At most
//! [`MAX_PREPARED`] statements a session (the server keeps about 8 KiB each, measured
//! with `pg_backend_memory_contexts`): past that, texts run as simple queries. A session
//! whose server refuses a `Parse` (but for an aborted transaction, which a wait's ended
//! slice leaves) or loses a prepared statement prepares nothing more.
//!
//! [`Message::mark_preparable`]: super::wire::Message::mark_preparable

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures_util::FutureExt;
use tokio_postgres::{Client, Statement};

/// The most statements one session prepares.
pub(crate) const MAX_PREPARED: usize = 256;

/// The most texts remembered as seen once (then forgotten all at once).
const MAX_SEEN: usize = 1024;

/// A statement's `Parse` on its way: queued on the connection, its reply read at a later
/// use.
type Preparing = Pin<Box<dyn Future<Output = Result<Statement, tokio_postgres::Error>> + Send>>;

/// A text's statement on the session.
enum Slot {
    Preparing(Preparing),
    Ready(Statement),
}

/// What a session has prepared, and the texts it has seen once.
#[derive(Default)]
pub(crate) struct Prepared {
    seen: HashSet<Box<str>>,
    slots: HashMap<Box<str>, Slot>,
    /// Set when the session showed it is not one session (a `Parse` refused but for an
    /// aborted transaction, a prepared statement missing: a transaction pooler that was
    /// neither declared nor detected): nothing is prepared on it any more.
    off: bool,
}

/// The server's code for a statement sent in a transaction already aborted.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// The server's code for a prepared statement it does not have.
pub(crate) const NO_SUCH_STATEMENT: &str = "26000";

impl Prepared {
    /// The statement of `text`, if it is prepared and its `Parse` has been answered.
    pub(crate) fn ready(&mut self, text: &str) -> Option<Statement> {
        let slot = self.slots.get_mut(text)?;
        if let Slot::Preparing(p) = slot {
            match p.now_or_never() {
                None => return None,
                Some(Ok(s)) => *slot = Slot::Ready(s),
                // Not prepared: the text runs as a simple query. Behind a round that
                // failed (a wait's slice ended), the `Parse` met the aborted transaction
                // and may be sent again; any other refusal turns preparing off.
                Some(Err(e)) => {
                    self.slots.remove(text);
                    if e.code().map(|c| c.code()) != Some(IN_FAILED_TRANSACTION) {
                        self.turn_off();
                    }
                    return None;
                }
            }
        }
        match self.slots.get(text) {
            Some(Slot::Ready(s)) => Some(s.clone()),
            _ => None,
        }
    }

    /// Notes that `text` runs as a simple query on `client` now (after its message was
    /// queued): the second time it is seen, its `Parse` is queued behind it.
    pub(crate) fn saw(&mut self, client: &Arc<Client>, text: &str) {
        if self.off || self.slots.len() >= MAX_PREPARED || self.slots.contains_key(text) {
            return;
        }
        if !self.seen.remove(text) {
            if self.seen.len() >= MAX_SEEN {
                self.seen.clear();
            }
            self.seen.insert(text.into());
            return;
        }
        let (client, owned) = (client.clone(), String::from(text));
        let mut parse: Preparing = Box::pin(async move { client.prepare(&owned).await });
        // The first poll queues the `Parse` (and its `Sync`) on the connection; its reply
        // is read at the next use, when it has long arrived.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match parse.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Ok(s)) => {
                self.slots.insert(text.into(), Slot::Ready(s));
            }
            std::task::Poll::Ready(Err(_)) => {}
            std::task::Poll::Pending => {
                self.slots.insert(text.into(), Slot::Preparing(parse));
            }
        }
    }

    /// Stops preparing on this session, and forgets what it prepared: its statements
    /// run as simple queries from now on.
    pub(crate) fn turn_off(&mut self) {
        self.off = true;
        self.slots.clear();
        self.seen.clear();
    }
}
