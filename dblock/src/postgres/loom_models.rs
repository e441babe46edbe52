//! loom models of the PostgreSQL backend's hand-offs inside the process (docs/testing.md):
//! `RUSTFLAGS="--cfg dblock_loom" cargo test -p dblock --lib --release loom_`.
//!
//! Each runs the real concurrent core — the [`Outbox`] a dropped guard's release waits in,
//! the multiplexer's [`Claims`] — against a connection of the model's own: the messages
//! in the order they were queued, which is the order the server runs them in. What the
//! server then does is read back from that order. The relay's models run the real
//! [`Relay`] (its lines, its one-shot places in line as `crate::sync::oneshot` gives them
//! under loom) with a held lock whose drop makes `held.rs`'s `Pinned`'s choice, against a
//! server lock of the model's own.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::poll_fn;
use std::task::{Context, Poll};

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

use super::conn::outbox::Outbox;
use super::conn::wire::{Deferred, Message};
use super::lock::mux::{Claims, Unlock};
use super::lock::relay::{Baton, Claim, Relay, Relayed, Relays, Turn};
use crate::raw::Scope;

/// A connection as the server reads it: every message, in the order it was queued.
#[derive(Default)]
struct Wire(Mutex<Vec<String>>);

impl Wire {
    fn send(&self, sql: &str) -> bool {
        self.0.lock().unwrap().push(sql.to_owned());
        true
    }

    /// The statements the server runs, in order.
    fn statements(&self) -> Vec<String> {
        let messages = self.0.lock().unwrap();
        messages
            .iter()
            .flat_map(|m| m.split("; "))
            .map(str::to_owned)
            .collect()
    }
}

/// A lock request's message, as a round sends it: a READ COMMITTED transaction that may
/// be chained onto a deferred `ROLLBACK`.
fn lock_message(key: &str) -> Message {
    let mut m = Message::with_capacity(64);
    m.begin(true);
    m.push(&["SELECT pg_advisory_xact_lock(", key, ")"]);
    m
}

/// One turn of a connection's task at its outbox.
type TaskTurn = fn(&Outbox, &Context<'_>, &Wire) -> Poll<()>;

/// The real one: `Outbox::poll_task`, as `conn/driver.rs` runs it.
fn task_turn(outbox: &Outbox, cx: &Context<'_>, wire: &Wire) -> Poll<()> {
    outbox.poll_task(cx, |sql| wire.send(sql)).map(|_| ())
}

/// The connection's task: runs a turn whenever woken, until told to stop (after a last
/// turn, so whatever was deferred before the stop is sent). Registered before it reads
/// the stop, so a stop asked for after the read wakes it.
fn connection_task(outbox: &Outbox, wire: &Wire, stop: &AtomicBool, turn: TaskTurn) {
    loom::future::block_on(poll_fn(|cx| {
        outbox.task.register(cx.waker());
        let stopping = stop.load(Ordering::Acquire);
        if turn(outbox, cx, wire).is_ready() || stopping {
            return Poll::Ready(());
        }
        Poll::Pending
    }));
}

/// Two lock cycles on one connection while its task runs: each request's message goes
/// out through `Outbox::carry` (as `NativeConn::first_values` sends it), each guard's drop
/// defers its `ROLLBACK` through `Outbox::defer` (as `Pinned`'s drop does), and the
/// connection's task sends whatever waits whenever it runs.
///
/// Invariant: each release reaches the server exactly once, after its own lock call and
/// before the next request's (a `ROLLBACK` that came after it would end the next lock's
/// transaction), whoever sends it — the task, or the next message at its head.
fn releases_race_the_task_and_the_next_request(turn: TaskTurn) {
    loom::model(move || {
        let outbox = Arc::new(Outbox::default());
        let wire = Arc::new(Wire::default());
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (outbox, wire, stop) = (outbox.clone(), wire.clone(), stop.clone());
            thread::spawn(move || connection_task(&outbox, &wire, &stop, turn))
        };
        for key in ["1", "2"] {
            let (queued, _) = outbox.carry(&lock_message(key), |text| wire.send(text));
            assert!(queued);
            assert!(outbox.defer(Deferred::Rollback { chain: true }, |sql| wire.send(sql)));
        }
        stop.store(true, Ordering::Release);
        outbox.task.wake();
        task.join().unwrap();

        let statements = wire.statements();
        let is_release = |s: &String| s.starts_with("ROLLBACK");
        let releases: Vec<usize> = (0..statements.len())
            .filter(|&i| is_release(&statements[i]))
            .collect();
        assert_eq!(
            releases.len(),
            2,
            "a release lost or sent twice: {statements:?}"
        );
        let at = |key: &str| {
            statements
                .iter()
                .position(|s| s == &format!("SELECT pg_advisory_xact_lock({key})"))
                .unwrap()
        };
        assert!(
            at("1") < releases[0] && releases[0] < at("2") && at("2") < releases[1],
            "a release overtaken by the next request: {statements:?}"
        );
        // Each lock call runs in a transaction begun after the release before it.
        for key in ["1", "2"] {
            let before = &statements[at(key) - 1];
            assert!(
                before.starts_with("BEGIN") || before == "ROLLBACK AND CHAIN",
                "lock {key} outside its transaction: {statements:?}"
            );
        }
    });
}

#[test]
fn loom_a_dropped_guards_release_goes_out_once_before_the_next_request() {
    releases_race_the_task_and_the_next_request(task_turn);
}

/// The control: a task that takes the waiting release under the outbox's mutex but
/// queues it after letting go of it, so the next request can come between.
fn task_turn_queueing_outside_the_mutex(
    outbox: &Outbox,
    cx: &Context<'_>,
    wire: &Wire,
) -> Poll<()> {
    outbox.task.register(cx.waker());
    let taken = outbox.waiting().take();
    if let Some(deferred) = taken {
        wire.send(deferred.sql());
    }
    Poll::Pending
}

#[test]
#[should_panic(expected = "a release overtaken by the next request")]
fn loom_control_a_release_queued_outside_the_outbox_mutex_is_overtaken() {
    releases_race_the_task_and_the_next_request(task_turn_queueing_outside_the_mutex);
}

/// The multiplexer's unlock of a key, queued on the key's shared connection.
struct WireUnlock(Arc<Wire>);

impl Unlock for WireUnlock {
    fn unlock(&self) {
        self.0.send("SELECT pg_advisory_unlock(7)");
    }
}

/// How a multiplexed request ends in the model.
#[derive(Clone, Copy)]
enum End {
    /// Granted, held, then released and the release awaited (`MuxHeld::release`).
    Release,
    /// Granted, held, then the guard dropped (`MuxHeld`'s drop).
    Drop,
    /// Cut off after its lock call was queued, before the answer (`try_acquire`'s future
    /// dropped).
    Cancelled,
    /// The control: released as before this model — the unlock queued by the awaited
    /// query with the claim still owing it, so a future dropped before the reply sent it
    /// again.
    ReleaseCutOffUnsettled,
}

/// One task's multiplexed request for key 7, as `Mux::try_acquire` and `MuxHeld` make
/// it: claim the key (or go to a connection of its own), owe the unlock, queue the lock
/// call; then hold, and end as `end` says.
fn multiplexed(claims: &Arc<Claims>, wire: &Arc<Wire>, holders: &AtomicUsize, end: End) {
    let Some(mut claim) = Claims::claim(claims, 7) else {
        // Held here already: the request goes to a connection of its own.
        return;
    };
    claim.owe(WireUnlock(wire.clone()));
    wire.send("SELECT pg_try_advisory_lock(7)");
    if let End::Cancelled = end {
        drop(claim);
        return;
    }
    // The shared session is re-entrant: the server grants it. Only the claim excludes.
    assert_eq!(
        holders.fetch_add(1, Ordering::AcqRel),
        0,
        "two holders of one key in the process"
    );
    holders.fetch_sub(1, Ordering::AcqRel);
    match end {
        End::Release => {
            let unlock = claim.settle().unwrap();
            unlock.unlock();
            drop(claim);
        }
        End::ReleaseCutOffUnsettled => {
            wire.send("SELECT pg_advisory_unlock(7)");
            drop(claim);
        }
        End::Drop | End::Cancelled => drop(claim),
    }
}

/// Replays a shared session's statements for key 7: PostgreSQL's session locks are
/// re-entrant, and `pg_advisory_unlock` of a lock the session does not hold answers
/// false (and warns).
fn replay(statements: &[String]) {
    let mut held = 0usize;
    for s in statements {
        if s.starts_with("SELECT pg_try_advisory_lock") {
            held += 1;
        } else if s.starts_with("SELECT pg_advisory_unlock") {
            assert!(
                held > 0,
                "an unlock the session did not hold: sent twice, or before its lock: {statements:?}"
            );
            held -= 1;
        }
    }
    assert_eq!(held, 0, "a release lost: {statements:?}");
}

/// Tasks sharing the multiplexed connection of one key, the first on this thread, the
/// others on threads of their own, each ending as given.
///
/// Invariant: never two holders of the key in the process; each lock call on the shared
/// session is matched by exactly one unlock after it (never lost, never twice).
fn tasks_share_a_connection(ends: &'static [End]) {
    loom::model(move || {
        let claims = Arc::new(Claims::default());
        let wire = Arc::new(Wire::default());
        let holders = Arc::new(AtomicUsize::new(0));
        let others: Vec<_> = ends[1..]
            .iter()
            .map(|&end| {
                let (claims, wire, holders) = (claims.clone(), wire.clone(), holders.clone());
                thread::spawn(move || multiplexed(&claims, &wire, &holders, end))
            })
            .collect();
        multiplexed(&claims, &wire, &holders, ends[0]);
        for other in others {
            other.join().unwrap();
        }
        replay(&wire.statements());
        // Nothing left claimed: a third request gets the shared connection.
        assert!(
            Claims::claim::<WireUnlock>(&claims, 7).is_some(),
            "a claim left behind"
        );
    });
}

#[test]
fn loom_two_tasks_on_a_multiplexed_connection_released_and_dropped() {
    tasks_share_a_connection(&[End::Release, End::Drop]);
}

#[test]
fn loom_three_tasks_on_a_multiplexed_connection_released_dropped_and_cut_off() {
    tasks_share_a_connection(&[End::Release, End::Drop, End::Cancelled]);
}

#[test]
fn loom_two_tasks_on_a_multiplexed_connection_one_cut_off() {
    tasks_share_a_connection(&[End::Cancelled, End::Release]);
}

#[test]
#[should_panic(expected = "an unlock the session did not hold")]
fn loom_control_a_cut_off_release_that_still_owes_its_unlock_sends_it_twice() {
    tasks_share_a_connection(&[End::ReleaseCutOffUnsettled, End::Drop]);
}

// The relay (`lock/relay.rs`): a held lock handed between a handle's own tasks, or the
// turn to ask the server passed on, while a task in line leaves.

/// What the model sees of the lock and of the turn at its one key.
struct Probe {
    /// The key's lock held on the server by a session of this process.
    server: AtomicBool,
    /// Tasks of the process holding the turn (asking the server, or holding the lock).
    turns: AtomicUsize,
}

impl Probe {
    /// A task takes the turn: never while another has it.
    fn take_turn(&self) {
        assert_eq!(
            self.turns.fetch_add(1, Ordering::AcqRel),
            0,
            "two tasks of the process hold the turn at one key"
        );
    }

    fn give_turn(&self) {
        self.turns.fetch_sub(1, Ordering::AcqRel);
    }

    /// The server grants the lock once no session holds it.
    fn ask_server(&self) {
        while self
            .server
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            thread::yield_now();
        }
    }
}

/// A lock held on a connection of its own, as the relay sees `held.rs`'s `Pinned`: its
/// drop makes `Pinned`'s choice — hand the lock over as it is while the relay's window
/// allows, else release it on the server and then pass the turn on.
struct Pinned {
    /// Holds the server's lock (`Pinned`'s connection).
    conn: bool,
    baton: Option<Baton<Pinned>>,
    probe: Arc<Probe>,
    /// The control: drop the turn without passing it on.
    forget_turn: bool,
}

impl Relayed for Pinned {
    fn baton(&mut self) -> &mut Option<Baton<Pinned>> {
        &mut self.baton
    }
}

impl Pinned {
    fn release(&mut self) {
        if std::mem::take(&mut self.conn) {
            self.probe.server.store(false, Ordering::Release);
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(baton) = self.baton.take() {
            if self.forget_turn {
                std::mem::forget(baton);
            } else if self.conn && baton.may_hand_over() {
                self.conn = false;
                let next = Pinned {
                    conn: true,
                    baton: None,
                    probe: self.probe.clone(),
                    forget_turn: false,
                };
                if let Some(mut back) = baton.hand_over(next) {
                    self.conn = std::mem::take(&mut back.conn);
                }
            } else {
                self.release();
                drop(baton);
            }
        }
        self.release();
    }
}

/// Whether some run of a model handed the held lock itself to a task in line.
static HANDED_OVER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A plain request, as `acquire.rs` makes it: the turn at once (`Relay::enter`) or a place
/// in line until the lock or the turn comes (`relay::wait`, no deadline); with the turn it
/// asks the server (`Claim::granted` on the grant); then it holds the lock and lets go.
fn request(relay: &std::sync::Arc<Relay<Pinned>>, probe: &Arc<Probe>, forget_turn: bool) {
    let claim = match relay.enter(relay_key()) {
        Ok(claim) => claim,
        Err(place) => match loom::future::block_on(place) {
            Ok(Turn::Held(held)) => {
                HANDED_OVER.store(true, std::sync::atomic::Ordering::Relaxed);
                probe.take_turn();
                assert!(held.conn && probe.server.load(Ordering::Acquire));
                probe.give_turn();
                drop(held);
                return;
            }
            Ok(Turn::Ask(baton)) => baton.into_claim(relay),
            Err(_) => panic!("a place in line lost its turn"),
        },
    };
    let held = granted(claim, probe, forget_turn);
    probe.give_turn();
    drop(held);
}

/// The turn taken (`claim`) and the server asked: the lock held, its baton kept.
fn granted(claim: Claim<'_, Pinned>, probe: &Arc<Probe>, forget_turn: bool) -> Pinned {
    probe.take_turn();
    probe.ask_server();
    Pinned {
        conn: true,
        baton: claim.granted(),
        probe: probe.clone(),
        forget_turn,
    }
}

/// A request that leaves: cancelled in line, or with the turn at once but not granted (a
/// failed round), which passes the turn on.
fn leave(relay: &std::sync::Arc<Relay<Pinned>>, probe: &Probe) {
    match relay.enter(relay_key()) {
        Ok(claim) => {
            probe.take_turn();
            probe.give_turn();
            drop(claim);
        }
        Err(place) => drop(place),
    }
}

fn relay_key() -> crate::key::Key {
    crate::key::Key::derive("public", "relay:model")
}

/// A holder lets go while one task waits in line for the key and another comes and
/// leaves (cancelled in line, or a round that failed with the turn), on a relay handing
/// locks over for `window` after the server's grant.
///
/// Invariants: never two tasks of the process with the turn; the task that stays gets
/// the lock, handed over or from the server (a lost turn leaves it waiting for ever,
/// which loom reports); at the end no line is left open and the server's lock is free.
fn a_holder_lets_go_while_tasks_wait_and_leave(window: std::time::Duration, forget_turn: bool) {
    loom::model(move || {
        let relays = Relays::<Pinned>::new(window);
        let relay = relays.of(Scope::Transaction).clone();
        let probe = Arc::new(Probe {
            server: AtomicBool::new(false),
            turns: AtomicUsize::new(0),
        });
        let claim = relay
            .enter(relay_key())
            .ok()
            .expect("the first takes the turn");
        let held = granted(claim, &probe, forget_turn);
        let stays = {
            let (relay, probe) = (relay.clone(), probe.clone());
            thread::spawn(move || request(&relay, &probe, false))
        };
        let leaves = {
            let (relay, probe) = (relay.clone(), probe.clone());
            thread::spawn(move || leave(&relay, &probe))
        };
        probe.give_turn();
        drop(held);
        stays.join().unwrap();
        leaves.join().unwrap();
        assert!(
            !probe.server.load(Ordering::Acquire),
            "the lock left held on the server"
        );
        assert_eq!(relay.open_lines(), 0, "a line left open");
    });
}

#[test]
fn loom_a_held_lock_handed_over_while_a_task_in_line_leaves() {
    HANDED_OVER.store(false, std::sync::atomic::Ordering::Relaxed);
    a_holder_lets_go_while_tasks_wait_and_leave(std::time::Duration::from_secs(3600), false);
    assert!(
        HANDED_OVER.load(std::sync::atomic::Ordering::Relaxed),
        "no run handed the lock over"
    );
}

#[test]
fn loom_the_turn_to_ask_passed_on_while_a_task_in_line_leaves() {
    a_holder_lets_go_while_tasks_wait_and_leave(std::time::Duration::ZERO, false);
}

#[test]
#[should_panic(expected = "deadlock")]
fn loom_control_a_held_lock_that_drops_its_turn_leaves_the_line_waiting() {
    a_holder_lets_go_while_tasks_wait_and_leave(std::time::Duration::from_secs(3600), true);
}
