//! A lock handed straight from one task of this process to the next one waiting for
//! it, without a round trip: the relay.
//!
//! When several tasks of one handle wait for one name, each used to wait on a
//! connection of its own, and every hand-off between them went through the server: the
//! holder's release, then the server waking the next session and answering it — a
//! round trip on the path of every hand-off, and a connection per waiting task. Instead,
//! the first task asking for a name (per key and scope) takes the *turn* (a [`Claim`]
//! while it asks, kept as the lock's [`Baton`] once granted) and asks the server; the others line up behind it here, in arrival order, on a
//! one-shot channel each. When the holder lets go and a task of this process is in
//! line, the lock is handed to that task as it is — the same connection, the server's
//! lock never let go — provided it is still healthy and the server granted it less than
//! [`WINDOW`] ago; otherwise the lock is released on the server and the first task in
//! line asks the server in its turn.
//!
//! Fairness is between processes, as on the embedded file: the server queues waiters of
//! other processes in arrival order, and this process keeps a grant for its own tasks
//! for at most [`WINDOW`] past the server's grant (plus the hold of the task it was last
//! handed to), then stands in the server's line again, with one connection rather than
//! one per task.
//!
//! Only plain requests take part: one name, exclusive, with a wait (`try_lock` asks the
//! server at once), unfenced (each fenced grant raises the token on the server), without
//! a lease (set on the connection by the grant), on a handle that does not multiplex. A
//! task in line leaves it at once when its deadline passes or it is cancelled; a turn
//! or a lock handed to a task that left meanwhile goes to the next one in line, or back.

use std::collections::VecDeque;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::key::{DigestMap, Key};
use crate::raw::{Mode, Req, Scope, Wait};
use crate::sync::{Mutex, oneshot};

/// How long after the server granted a lock this process may keep handing it to its own
/// waiting tasks before it lets the server give it to another process's waiter, unless
/// the handle was built with another (`Builder::hand_over`).
pub(crate) const WINDOW: Duration = Duration::from_millis(5);

/// Parts of a scope's table, by key, each under its own mutex.
const PARTS: usize = 16;

/// Whether `req` takes part (see the module docs).
pub(crate) fn takes_part(req: &Req<'_>) -> bool {
    req.mode == Mode::Exclusive && req.wait != Wait::Try && !req.fenced && req.lease.is_none()
}

/// A held lock that can be handed over: it keeps its turn (the lock's connection of its
/// own, `held.rs`'s `Pinned`; a type parameter so that this file names no other).
pub(crate) trait Relayed: Send + Sized + 'static {
    /// The turn the lock keeps, if it stood in a line.
    fn baton(&mut self) -> &mut Option<Baton<Self>>;
}

/// What a task in line is given.
pub(crate) enum Turn<H: Relayed> {
    /// The lock itself, still held on the server.
    Held(H),
    /// The turn to ask the server.
    Ask(Baton<H>),
}

/// The lines of one scope of a handle: per key, the tasks waiting behind the one whose
/// turn it is. A key has a line while a task of this process holds it or asks for it.
/// (Locks of the two scopes on one key are taken apart on the server: a handle has a
/// relay per scope, see [`Relays`].)
pub(crate) struct Relay<H: Relayed> {
    parts: [Mutex<Lines<H>>; PARTS],
    /// How long after the server's grant a lock may still be handed over ([`WINDOW`]
    /// unless the handle was built with another; zero: never).
    window: Duration,
}

/// One part's lines: per key, the tasks in line, first first.
type Lines<H> = DigestMap<Key, VecDeque<oneshot::Sender<Turn<H>>>>;

/// A handle's relays, one per scope.
pub(crate) struct Relays<H: Relayed> {
    transaction: Arc<Relay<H>>,
    session: Arc<Relay<H>>,
}

impl<H: Relayed> Relays<H> {
    /// A handle's relays, handing a lock over up to `window` after the server's grant.
    pub(crate) fn new(window: Duration) -> Self {
        Relays {
            transaction: Arc::new(Relay::new(window)),
            session: Arc::new(Relay::new(window)),
        }
    }

    /// The relay of `scope`'s locks.
    pub(crate) fn of(&self, scope: Scope) -> &Arc<Relay<H>> {
        match scope {
            Scope::Transaction => &self.transaction,
            Scope::Session => &self.session,
        }
    }
}

impl<H: Relayed> Relay<H> {
    /// A relay handing a lock over up to `window` after the server's grant.
    fn new(window: Duration) -> Self {
        Relay {
            parts: std::array::from_fn(|_| Mutex::new(DigestMap::default())),
            window,
        }
    }

    fn part(&self, key: Key) -> &Mutex<Lines<H>> {
        let h = (key.as_i64() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60;
        &self.parts[h as usize % PARTS]
    }

    /// Takes the turn for `key` if no task of this process has it (`Ok`: ask the
    /// server), else stands in line (`Err`: what the turn or the lock arrives on).
    pub(crate) fn enter(
        self: &Arc<Self>,
        key: Key,
    ) -> Result<Claim<'_, H>, oneshot::Receiver<Turn<H>>> {
        let mut part = crate::sync::lock(self.part(key));
        match part.entry(key) {
            Entry::Vacant(v) => {
                v.insert(VecDeque::new());
                Ok(Claim {
                    relay: Some(self),
                    key,
                })
            }
            Entry::Occupied(mut o) => {
                let (tx, rx) = oneshot::channel();
                o.get_mut().push_back(tx);
                Err(rx)
            }
        }
    }

    /// Gives `turn` to the first task in `key`'s line that is still there; gives it
    /// back when nobody is (the line is then closed: the next task to come takes the
    /// turn).
    fn pass(&self, key: Key, mut turn: Turn<H>) -> Option<Turn<H>> {
        loop {
            let next = {
                let mut lines = crate::sync::lock(self.part(key));
                // One look-up, whether the line goes on or closes.
                let Entry::Occupied(mut line) = lines.entry(key) else {
                    return Some(turn);
                };
                match line.get_mut().pop_front() {
                    Some(next) => next,
                    None => {
                        line.remove();
                        return Some(turn);
                    }
                }
            };
            // Sent outside the mutex: a turn that comes back (its task left) is tried
            // on the next task, and one dropped in a channel nobody reads passes itself on.
            match next.send(turn) {
                Ok(()) => return None,
                Err(back) => turn = back,
            }
        }
    }

    /// Passes the turn to ask the server to the next task in `key`'s line, or closes it.
    fn pass_ask(self: &Arc<Self>, key: Key) {
        let turn = Turn::Ask(Baton {
            relay: Some(self.clone()),
            key,
            since: None,
        });
        spend(self.pass(key, turn));
    }

    /// The number of keys with a line now (tests).
    #[cfg(test)]
    pub(crate) fn open_lines(&self) -> usize {
        self.parts.iter().map(|p| crate::sync::lock(p).len()).sum()
    }
}

/// Spends a turn that came back from a closed line: nothing of it passes on.
fn spend<H: Relayed>(turn: Option<Turn<H>>) {
    match turn {
        Some(Turn::Ask(mut b)) => b.relay = None,
        Some(Turn::Held(mut h)) => disarm(&mut h),
        None => {}
    }
}

/// Spends the turn a held lock keeps: released as if it had stood in no line.
fn disarm<H: Relayed>(held: &mut H) {
    if let Some(b) = held.baton().as_mut() {
        b.relay = None;
    }
}

/// Waits in line for a turn until `deadline`; `None` once the deadline passed (the
/// place in line is given up: whatever comes for it goes to the next task).
///
/// # Cancel safety
///
/// Cancelled, the place in line is given up in the same way.
pub(crate) async fn wait<H: Relayed>(
    rx: oneshot::Receiver<Turn<H>>,
    deadline: Option<Instant>,
) -> Option<Result<Turn<H>, oneshot::error::RecvError>> {
    match deadline {
        None => Some(rx.await),
        Some(d) => tokio::time::timeout_at(d, rx).await.ok(),
    }
}

/// The turn of a request in flight at one key: it asks the server. Borrowed from the
/// handle's relay (two words), so that it adds little to every request's future; on a
/// grant it becomes the lock's [`Baton`]. Dropped (not granted, failed, cancelled), it
/// passes the turn to the next task in line, or closes the line.
pub(crate) struct Claim<'a, H: Relayed> {
    /// `None` once spent.
    relay: Option<&'a Arc<Relay<H>>>,
    key: Key,
}

impl<H: Relayed> Claim<'_, H> {
    /// The lock's baton, the server having granted it now.
    pub(crate) fn granted(mut self) -> Option<Baton<H>> {
        let relay = self.relay.take()?;
        Some(Baton {
            relay: Some(relay.clone()),
            key: self.key,
            since: Some(Instant::now()),
        })
    }
}

impl<H: Relayed> Drop for Claim<'_, H> {
    fn drop(&mut self) {
        if let Some(relay) = self.relay.take() {
            relay.pass_ask(self.key);
        }
    }
}

/// The turn of one task of this process at one key, owned: kept in the held lock's
/// [`Pinned`], or on its way to the next task in line. Dropped, it passes the turn to
/// ask the server to the next task in line, or closes the line.
pub(crate) struct Baton<H: Relayed> {
    /// `None` once spent.
    relay: Option<Arc<Relay<H>>>,
    key: Key,
    /// When the server granted the lock this turn holds.
    since: Option<Instant>,
}

impl<H: Relayed> Baton<H> {
    /// The turn as a request in flight holds it: `relay` is the handle's own, whose
    /// line this is.
    pub(crate) fn into_claim(mut self, relay: &Arc<Relay<H>>) -> Claim<'_, H> {
        self.relay = None;
        Claim {
            relay: Some(relay),
            key: self.key,
        }
    }

    /// Whether the lock may go to a task in line as it is: granted by the server less
    /// than the relay's window ([`WINDOW`] unless set) ago.
    pub(crate) fn may_hand_over(&self) -> bool {
        match (&self.relay, self.since) {
            (Some(relay), Some(t)) => t.elapsed() < relay.window,
            _ => false,
        }
    }

    /// Hands `held` (whose baton this is, taken out of it) to the first task in line;
    /// gives it back, its baton spent, when nobody waits.
    pub(crate) fn hand_over(mut self, mut held: H) -> Option<H> {
        let Some(relay) = self.relay.take() else {
            return Some(held);
        };
        let key = self.key;
        *held.baton() = Some(Baton {
            relay: Some(relay.clone()),
            key,
            since: self.since,
        });
        match relay.pass(key, Turn::Held(held)) {
            None => None,
            Some(Turn::Held(mut back)) => {
                disarm(&mut back);
                Some(back)
            }
            // Not what was passed; spent as it is.
            other => {
                spend(other);
                None
            }
        }
    }
}

impl<H: Relayed> Drop for Baton<H> {
    fn drop(&mut self) {
        if let Some(relay) = self.relay.take() {
            relay.pass_ask(self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held lock as far as the relay sees one.
    struct Held(Option<Baton<Held>>);

    impl Relayed for Held {
        fn baton(&mut self) -> &mut Option<Baton<Held>> {
            &mut self.0
        }
    }

    fn key(name: &str) -> Key {
        Key::derive("public", name)
    }

    #[tokio::test]
    async fn a_turn_passes_in_arrival_order_skipping_tasks_that_left_and_then_closes() {
        let relays = Relays::<Held>::new(WINDOW);
        let relay = relays.of(Scope::Transaction);
        let k = key("relay:a");
        let first = relay.enter(k).ok().expect("the first task takes the turn");
        let second = relay.enter(k).err().expect("the second stands in line");
        let third = relay.enter(k).err().expect("the third too");
        let fourth = relay.enter(k).err().expect("and the fourth");
        // Another key, the other scope: lines of their own.
        let other = relay.enter(key("relay:b")).ok();
        assert!(other.is_some());
        let session = relays.of(Scope::Session).enter(k).ok();
        assert!(session.is_some());
        assert_eq!(relay.open_lines(), 2);
        drop(other);
        // The second task left (its deadline passed): the turn goes to the third.
        drop(second);
        drop(first);
        let Ok(Turn::Ask(third_turn)) = third.await else {
            panic!("the third task should have the turn");
        };
        // A turn dropped in a channel nobody read passes itself on.
        drop(third_turn);
        let Ok(Turn::Ask(fourth_turn)) = fourth.await else {
            panic!("the fourth task should have the turn");
        };
        assert_eq!(relay.open_lines(), 1);
        // As a request in flight holds it, then dropped (not granted): the line closes.
        drop(fourth_turn.into_claim(relay));
        assert_eq!(relay.open_lines(), 0, "the line closed with nobody in it");
        assert!(
            relay.enter(k).is_ok(),
            "the next task takes the turn at once"
        );
        assert_eq!(relays.of(Scope::Session).open_lines(), 1);
        drop(session);
        assert_eq!(relays.of(Scope::Session).open_lines(), 0);
    }

    #[tokio::test]
    async fn a_place_in_line_is_given_up_at_its_deadline() {
        let relays = Relays::<Held>::new(WINDOW);
        let relay = relays.of(Scope::Transaction);
        let k = key("relay:deadline");
        let first = relay.enter(k).ok();
        let rx = relay.enter(k).err().expect("in line");
        let deadline = Instant::now() + Duration::from_millis(20);
        assert!(wait(rx, Some(deadline)).await.is_none());
        let rx = relay.enter(k).err().expect("in line again");
        drop(first);
        assert!(matches!(wait(rx, None).await, Some(Ok(Turn::Ask(_)))));
    }

    #[test]
    fn only_plain_waiting_requests_take_part() {
        let req = |mode, wait, fenced, lease| Req {
            namespace: "public",
            name: "n",
            key: key("n"),
            mode,
            scope: Scope::Transaction,
            wait,
            fenced,
            lease,
            fence_key: None,
        };
        let later = Wait::Until(Instant::now() + Duration::from_secs(1));
        assert!(takes_part(&req(
            Mode::Exclusive,
            Wait::Forever,
            false,
            None
        )));
        assert!(takes_part(&req(Mode::Exclusive, later, false, None)));
        assert!(!takes_part(&req(Mode::Exclusive, Wait::Try, false, None)));
        assert!(!takes_part(&req(Mode::Shared, Wait::Forever, false, None)));
        assert!(!takes_part(&req(
            Mode::Exclusive,
            Wait::Forever,
            true,
            None
        )));
        let lease = Some(Duration::from_secs(5));
        assert!(!takes_part(&req(
            Mode::Exclusive,
            Wait::Forever,
            false,
            lease
        )));
    }
}
