//! Waiting in line for a lock another process holds. The protocol is in the
//! [module docs](super#waiting-in-line).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::Error;
use crate::raw::Mode;

use super::file::{Desc, LockFile};
use super::sys;
use super::{Entry, Shared, Slot};

/// The gate byte of the lock byte at `offset`: its neighbour in an aligned pair, so that
/// one system call can try both.
pub(crate) fn gate(offset: u64) -> u64 {
    offset ^ 1
}

/// The first byte of the pair (gate and lock) of `offset`.
pub(crate) fn pair(offset: u64) -> u64 {
    offset & !1
}

/// This process's place in line for one key: one thread waiting in the kernel, for
/// whichever local request wants the lock when it comes.
pub(crate) struct Queued {
    mode: Mode,
    /// Who gets the lock when the kernel grants it; `None` once every request that
    /// wanted it gave up (the thread then leaves the line, or a new request of the same
    /// mode takes the place over).
    pub(super) taker: Option<Taker>,
}

/// The request a place in line delivers to. (Its parts are visible beside this module
/// for the loom models' controls, which deliver wrongly on purpose.)
pub(super) struct Taker {
    id: u64,
    pub(super) shared: Arc<Shared>,
    pub(super) tx: oneshot::Sender<Result<Entry, Error>>,
}

impl Taker {
    /// A new request's claim, and what it waits on.
    fn new(shared: &Arc<Shared>) -> (Taker, u64, Receiver) {
        let (tx, rx) = oneshot::channel();
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let taker = Taker {
            id,
            shared: shared.clone(),
            tx,
        };
        (taker, id, rx)
    }
}

impl Queued {
    /// A place in line in `mode` for a new request (its id, and what it waits on): what
    /// [`join`] puts in the table once its thread runs.
    pub(super) fn new(shared: &Arc<Shared>, mode: Mode) -> (Queued, u64, Receiver) {
        let (taker, id, rx) = Taker::new(shared);
        let queued = Queued {
            mode,
            taker: Some(taker),
        };
        (queued, id, rx)
    }
}

pub(crate) type Receiver = oneshot::Receiver<Result<Entry, Error>>;

static IDS: AtomicU64 = AtomicU64::new(1);

/// Takes over this process's place in line for `offset` if it waits in `mode` for
/// nobody; `None` if the place is taken or waits in the other mode.
pub(crate) fn adopt(
    queued: &mut Queued,
    shared: &Arc<Shared>,
    mode: Mode,
) -> Option<(u64, Receiver)> {
    if queued.mode != mode || queued.taker.is_some() {
        return None;
    }
    let (taker, id, rx) = Taker::new(shared);
    queued.taker = Some(taker);
    Some((id, rx))
}

/// Joins the line for `offset`: a thread waits in the kernel (see the module docs). The
/// caller holds the table lock and has checked that the process is not in line yet.
pub(crate) fn join(
    lf: &Arc<LockFile>,
    queued: &mut super::OffsetMap<Queued>,
    shared: &Arc<Shared>,
    offset: u64,
    mode: Mode,
    after: Option<Instant>,
) -> Result<(u64, Receiver), Error> {
    let thread_lf = lf.clone();
    std::thread::Builder::new()
        // Named for the key, as tools show it (15 bytes): `dblock-` and the low 32 bits
        // of the offset in hex.
        .name(format!("dblock-{:08x}", offset as u32))
        .spawn(move || wait_in_kernel(thread_lf, offset, mode, after))
        .map_err(|e| Error::io("cannot start a thread to wait for a lock", e))?;
    let (place, id, rx) = Queued::new(shared, mode);
    queued.insert(offset, place);
    Ok((id, rx))
}

/// Gives up request `id`'s claim on the place in line, if it still has it.
pub(crate) fn give_up(lf: &LockFile, offset: u64, id: u64) {
    let shard = lf.shard(offset);
    let mut table = shard.table.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(q) = table.queued.get_mut(&offset)
        && q.taker.as_ref().is_some_and(|t| t.id == id)
    {
        let taker = q.taker.take();
        drop(table);
        drop(taker); // its Arc<Shared> and channel
        // Another request of this process waiting for the place may take it over now.
        if shard.waiters.load(Ordering::SeqCst) > 0 {
            shard.released.notify_waiters();
        }
    }
}

/// The first interval between two looks at the lock byte from the head of the line; each
/// look waits one interval longer, up to [`HEAD_POLL_MAX`].
const HEAD_POLL: Duration = Duration::from_micros(50);
const HEAD_POLL_MAX: Duration = Duration::from_millis(1);

/// How long a process that gave a lock back, gate and all, to a process waiting in the
/// kernel lets that process go first (see [`let_waiter_go_first`]).
pub(crate) const YIELD: Duration = Duration::from_millis(20);

/// If the lock at `offset` was given back (gate too) at `yielded` while another process
/// waited for the gate in the kernel; woken, it has not necessarily run yet, and a gate
/// taken before it does would pass it. So look (without locking) until another process
/// holds the gate or the lock byte — it has taken its turn — or [`YIELD`] has passed,
/// or nobody here wants the place any more.
fn let_waiter_go_first(lf: &LockFile, offset: u64, yielded: Option<Instant>) {
    let Some(yielded) = yielded else {
        return;
    };
    let desc = lf.current();
    let mut polls = 0u32;
    while yielded.elapsed() < YIELD && wanted(lf, offset) {
        match sys::probe(
            desc.file_for(offset),
            lf.flavor,
            pair(offset),
            2,
            Mode::Exclusive,
        ) {
            Ok(sys::Attempt::Granted) => {}
            Ok(sys::Attempt::Busy) | Err(_) => return,
        }
        polls = polls.saturating_add(1);
        std::thread::sleep(HEAD_POLL.saturating_mul(polls).min(HEAD_POLL_MAX));
    }
}

/// Whether any request still wants the place in line for `offset`.
pub(super) fn wanted(lf: &LockFile, offset: u64) -> bool {
    let table = lf
        .shard(offset)
        .table
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    table.queued.get(&offset).is_some_and(|q| q.taker.is_some())
}

/// A place in line counted in the lock file's shared counts (see [`sys::LineCounts`])
/// for as long as this value lives: while it does, exclusive requests of every process
/// for keys of its group give the gate back after their try instead of keeping it.
struct Counted(Arc<Desc>, u64);

impl Counted {
    fn new(desc: &Arc<Desc>, offset: u64) -> Counted {
        desc.line(offset).fetch_add(1, Ordering::SeqCst);
        Counted(desc.clone(), offset)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        // Never below zero, should the counts have been cleared meanwhile (a second
        // descriptor of the file opened by this process with POSIX locks, which own
        // nothing apart from the process's first).
        let _ = self
            .0
            .line(self.1)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_sub(1))
            });
    }
}

/// The thread of a place in line: take the gate (the kernel queues conflicting waiters
/// in arrival order), then, at the head of the line, the lock byte (polled, so that a
/// place nobody wants any more is left at once); give the gate back; hand the lock to
/// whoever wants it now, or give it back too.
fn wait_in_kernel(lf: Arc<LockFile>, offset: u64, mode: Mode, after: Option<Instant>) {
    let flavor = lf.flavor;
    let_waiter_go_first(&lf, offset, after);
    let outcome: Outcome = loop {
        let desc = lf.current();
        // Counted in line (in the file, for every process to see) until this round ends.
        let _counted = Counted::new(&desc, offset);
        match sys::lock_wait(
            desc.file_for(offset),
            flavor,
            gate(offset),
            1,
            Mode::Exclusive,
        ) {
            Ok(()) => {}
            // POSIX locks: the kernel's deadlock detection sees one owner per process, so
            // another of this process's threads waiting elsewhere can make it see a cycle
            // that is not there (gates are only ever held by heads of lines, which do not
            // wait in the kernel). Look again shortly; leave if nobody wants the place.
            Err(e) if e.raw_os_error() == Some(libc::EDEADLK) => {
                if !wanted(&lf, offset) {
                    break Ok(None);
                }
                std::thread::sleep(HEAD_POLL_MAX);
                continue;
            }
            Err(e) => break Err(e),
        }
        // At the head of the line. Nobody can pass now (they need the gate), so the lock
        // byte is polled rather than waited for in the kernel: a wait there could not be
        // cut off, and a request given up must leave the line at once, not when the lock
        // comes free (a writer that gave up would otherwise still hold back readers).
        let mut polls = 0u32;
        let got = loop {
            if !wanted(&lf, offset) {
                break Ok(false);
            }
            match sys::try_lock(desc.file_for(offset), flavor, offset, 1, mode) {
                Ok(sys::Attempt::Granted) => break Ok(true),
                Ok(sys::Attempt::Busy) => {}
                Err(e) => break Err(e),
            }
            polls = polls.saturating_add(1);
            std::thread::sleep(HEAD_POLL.saturating_mul(polls).min(HEAD_POLL_MAX));
        };
        let _ = sys::unlock(desc.file_for(offset), flavor, gate(offset), 1);
        match got {
            Ok(true) => {}
            Ok(false) => break Ok(None),
            Err(e) => break Err(e),
        }
        if desc.is_named_by(&lf.path) {
            break Ok(Some(desc));
        }
        // Granted in a file the path no longer names: give it back, line up again in
        // the file it names now.
        let _ = sys::unlock(desc.file_for(offset), flavor, offset, 1);
        if let Err(e) = lf.reopen(&desc) {
            break Err(std::io::Error::other(e.to_string()));
        }
    };
    deliver(&lf, offset, mode, outcome);
}

/// How a place in line's wait in the kernel ended: the lock byte granted in `desc` (the
/// gate given back), left without the lock (nobody wanted it any more), or failed.
pub(super) type Outcome = Result<Option<Arc<Desc>>, std::io::Error>;

/// The end of a place in line: under the table's lock, the place leaves the table and
/// a lock granted goes to the request that wants it now (one that adopted the place
/// meanwhile included) — or, if nobody does or its receiver is gone, back to the file.
/// Requests that give up ([`give_up`]) or adopt the place ([`adopt`]) race this; the
/// loom models (`loom_models.rs`) run it against them.
pub(super) fn deliver(lf: &LockFile, offset: u64, mode: Mode, outcome: Outcome) {
    let flavor = lf.flavor;
    let shard = lf.shard(offset);
    let mut table = shard.table.lock().unwrap_or_else(|p| p.into_inner());
    let taker = table.queued.remove(&offset).and_then(|q| q.taker);
    // Sent values are dropped (and a lock so released) only after the table is unlocked.
    let mut undelivered = None;
    match (outcome, taker) {
        (Ok(Some(desc)), Some(taker)) => {
            table.held.insert(offset, Slot::new(mode, Some(desc)));
            let held = taker.shared.entry(offset, mode);
            undelivered = taker.tx.send(Ok(held)).err();
        }
        (Ok(Some(desc)), None) => {
            // Everyone gave up while the lock was being granted.
            let _ = sys::unlock(desc.file_for(offset), flavor, offset, 1);
        }
        (Err(e), Some(taker)) => {
            let err = Error::io(format!("cannot lock {}", lf.path.display()), e);
            let _ = taker.tx.send(Err(err));
        }
        (Err(_), None) | (Ok(None), _) => {}
    }
    drop(table);
    drop(undelivered);
    shard.released.notify_waiters();
}
