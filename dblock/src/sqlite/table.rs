//! The process's table of a lock file's keys: which keys it holds (in which mode,
//! through which descriptor), which it waits for in line, and which of its tasks wait
//! behind its own holders. Split by key into parts ([`Shard`](super::file::Shard)),
//! each under its own mutex. The rules are in the [module docs](super#one-process-many-tasks).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::oneshot;

use crate::error::Error;
use crate::raw::Mode;

use super::file::Desc;
use super::sys::{self, Attempt};
use super::{Behind, Shared, Slot, Table, queue};
use crate::raw::Entry;

/// What a waiting request does next.
pub(super) enum Step {
    Granted(Entry),
    /// Wait for the place in line to deliver.
    InLine(u64, queue::Receiver),
    /// Wait behind this process's holder: the lock comes on the channel, or the channel
    /// closes when there is something new to look at.
    Behind(u64, oneshot::Receiver<Entry>),
    /// Wait for something in this process to change (a place in line freed).
    Local,
}

static IDS: AtomicU64 = AtomicU64::new(1);

/// A slot without a descriptor: never, as a slot refers to its part's only once the part
/// has one, which it keeps; an error rather than a panic should that ever change.
fn no_descriptor() -> std::io::Error {
    std::io::Error::other("internal: a held key without its lock file's descriptor")
}

impl Shared {
    /// Takes the lock at `offset` now if this process's table and the file allow it.
    pub(super) fn take_now(&self, offset: u64, mode: Mode) -> Result<bool, Error> {
        let shard = self.lock.shard(offset);
        let mut table = shard.table.lock().unwrap_or_else(|p| p.into_inner());
        self.take_locked(&mut table, offset, mode)
    }

    fn take_locked(&self, table: &mut Table, offset: u64, mode: Mode) -> Result<bool, Error> {
        match (table.held.get_mut(&offset), mode) {
            // Another shared holder of this process already has the read lock: join it,
            // unless a writer of another process is at the head of the line (it holds
            // the gate), which readers must not pass.
            (Some(slot), Mode::Shared) if !slot.writer => {
                let lf = &self.lock;
                let fail = |e| Error::io(format!("cannot lock {}", lf.path.display()), e);
                let desc = slot
                    .desc_or(&table.desc)
                    .ok_or_else(|| fail(no_descriptor()))?;
                let gate = queue::gate(offset);
                match sys::try_lock(desc.file_for(offset), lf.flavor, gate, 1, Mode::Shared)
                    .map_err(fail)?
                {
                    Attempt::Busy => return Ok(false),
                    Attempt::Granted => {
                        sys::unlock(desc.file_for(offset), lf.flavor, gate, 1).map_err(fail)?;
                    }
                }
                slot.readers += 1;
                return Ok(true);
            }
            (Some(_), _) => return Ok(false),
            (None, _) => {}
        }
        // The process is in line for it: the lock is held elsewhere, and the bytes must
        // not be touched while the line's thread works on them (locks of one owner
        // merge).
        if table.queued.contains_key(&offset) {
            return Ok(false);
        }
        // Given back to a process in line a moment ago: not taken again before it has
        // woken up and taken its turn (the line's thread waits for that).
        if !table.yielded.is_empty()
            && let Some(at) = table.yielded.get(&offset)
        {
            if at.elapsed() < queue::YIELD {
                return Ok(false);
            }
            table.yielded.remove(&offset);
        }
        self.grant_new(table, offset, mode)
    }

    /// Takes the lock at `offset`, held by no task of this process, if the file allows
    /// it: the one place a lock byte is newly locked for a request.
    fn grant_new(&self, table: &mut Table, offset: u64, mode: Mode) -> Result<bool, Error> {
        let lf = &self.lock;
        let fail = |e| Error::io(format!("cannot lock {}", lf.path.display()), e);
        // A replaced file is reopened and the request retried; a path replaced again and
        // again is an error, not a loop.
        for _ in 0..8 {
            // The part's copy of the current descriptor, renewed after a reopen; a slot
            // granted through it refers to it without a copy of its own.
            if !table.desc.as_ref().is_some_and(|d| lf.is_current(d)) {
                table.set_desc(lf.current());
            }
            let Some(desc) = table.desc.as_ref() else {
                return Err(fail(no_descriptor()));
            };
            // An exclusive holder keeps the gate while no process waits in line for a key
            // like this one: one call to take, one to give back. Otherwise the gate goes
            // back at once, for the line's next head to take.
            let gate = mode == Mode::Exclusive && desc.line(offset).load(Ordering::Acquire) == 0;
            // Gate and lock byte at once: free only if nobody holds the lock and nobody
            // is at the head of the line (whoever is holds the gate).
            match sys::try_lock(
                desc.file_for(offset),
                lf.flavor,
                queue::pair(offset),
                2,
                mode,
            )
            .map_err(fail)?
            {
                Attempt::Busy => return Ok(false),
                Attempt::Granted => {}
            }
            if !gate
                && let Err(e) =
                    sys::unlock(desc.file_for(offset), lf.flavor, queue::gate(offset), 1)
            {
                let _ = sys::unlock(desc.file_for(offset), lf.flavor, queue::pair(offset), 2);
                return Err(fail(e));
            }
            if lf.still_named(desc) {
                table.held.insert(
                    offset,
                    Slot {
                        gate,
                        ..Slot::new(mode, None)
                    },
                );
                return Ok(true);
            }
            // The byte was granted in a file the path no longer names: nobody opening
            // the path now would see it. Give it back; use the new file.
            sys::unlock(desc.file_for(offset), lf.flavor, queue::pair(offset), 2).map_err(fail)?;
            lf.reopen(desc)?;
        }
        Err(Error::io(
            format!("cannot lock {}", lf.path.display()),
            std::io::Error::other("the lock file keeps being replaced"),
        ))
    }

    /// One look at the table for a waiting request: the lock, a place in line to wait
    /// in, a place behind this process's holder, or nothing to do but wait for a change
    /// in this process.
    pub(super) fn step(self: &Arc<Self>, offset: u64, mode: Mode) -> Result<Step, Error> {
        let lf = &self.lock;
        let mut table = lf
            .shard(offset)
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.take_locked(&mut table, offset, mode)? {
            return Ok(Step::Granted(self.entry(offset, mode)));
        }
        if let Some(slot) = table.held.get_mut(&offset) {
            // Held in this process: its release hands the lock over or wakes us.
            let (tx, rx) = oneshot::channel();
            let id = IDS.fetch_add(1, Ordering::Relaxed);
            slot.behind.push_back(Behind {
                id,
                mode,
                shared: self.clone(),
                tx,
            });
            return Ok(Step::Behind(id, rx));
        }
        if let Some(q) = table.queued.get_mut(&offset) {
            return Ok(match queue::adopt(q, self, mode) {
                Some((id, rx)) => Step::InLine(id, rx),
                None => Step::Local,
            });
        }
        let after = table.yielded.remove(&offset);
        let (id, rx) = queue::join(lf, &mut table.queued, self, offset, mode, after)?;
        Ok(Step::InLine(id, rx))
    }

    /// Takes request `id` out of the tasks waiting behind this process's holder of
    /// `offset`, if it is still there.
    pub(super) fn leave(&self, offset: u64, id: u64) {
        let shard = self.lock.shard(offset);
        let mut table = shard.table.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = table.held.get_mut(&offset)
            && let Some(i) = slot.behind.iter().position(|b| b.id == id)
        {
            let gone = slot.behind.remove(i);
            drop(table);
            drop(gone);
        }
    }

    pub(super) fn release(&self, offset: u64, mode: Mode) {
        let lf = &self.lock;
        let shard = lf.shard(offset);
        let mut guard = shard.table.lock().unwrap_or_else(|p| p.into_inner());
        // Borrowed as a table (not through the guard), so that its fields borrow apart.
        let table = &mut *guard;
        let Some(slot) = table.held.get_mut(&offset) else {
            return;
        };
        match mode {
            Mode::Shared => slot.readers = slot.readers.saturating_sub(1),
            Mode::Exclusive => slot.writer = false,
        }
        // Channels closed (and values dropped: a lock nobody took is released) only
        // after the table is unlocked.
        let mut woken = Vec::new();
        if slot.readers > 0 || slot.writer {
            // Still held here. Shared waiters look again: one may have been kept out
            // by another process's writer that has left the line since.
            let behind = std::mem::take(&mut slot.behind);
            let (stay, go) = behind.into_iter().partition(|b| b.mode == Mode::Exclusive);
            slot.behind = stay;
            woken.extend(go);
            drop(guard);
            drop(woken);
            return;
        }
        let mut undelivered = Vec::new();
        let hand_over = mode == Mode::Exclusive
            && slot
                .desc_or(&table.desc)
                .is_some_and(|desc| self.may_hand_over(slot, desc, offset));
        if hand_over {
            // Straight to the next exclusive waiter of this process: the byte stays
            // locked, so nobody else can come between.
            while slot
                .behind
                .front()
                .is_some_and(|b| b.mode == Mode::Exclusive)
            {
                let Some(next) = slot.behind.pop_front() else {
                    break;
                };
                slot.writer = true;
                match next.tx.send(next.shared.entry(offset, mode)) {
                    Ok(()) => {
                        drop(guard);
                        return;
                    }
                    // Gone (cancelled) meanwhile: the next one.
                    Err(mut held) => {
                        held.disarm();
                        undelivered.push(held);
                        slot.writer = false;
                    }
                }
            }
        }
        if let Some(slot) = table.held.remove(&offset)
            && let Some(desc) = slot.desc_or(&table.desc)
        {
            // Unlocking a byte this owner holds cannot fail short of a closed
            // descriptor, which the Arc rules out. Should it fail anyway, the lock
            // stays until the process exits: never two holders.
            let _ = match slot.gate {
                true => sys::unlock(desc.file_for(offset), lf.flavor, queue::pair(offset), 2),
                false => sys::unlock(desc.file_for(offset), lf.flavor, offset, 1),
            };
            // The gate went back with the lock while a process waited for it in the
            // kernel: this process's next request lets that one wake up first.
            if slot.gate && desc.line(offset).load(Ordering::Acquire) > 0 {
                table.yielded.insert(offset, std::time::Instant::now());
            }
            // (Mostly nobody: then nothing to move.)
            if !slot.behind.is_empty() {
                woken.extend(slot.behind);
            }
        }
        drop(guard);
        drop(undelivered);
        drop(woken);
    }

    /// Whether the lock at `offset` may go straight to another task of this process
    /// (see the [module docs](super#one-process-many-tasks)): only if there is one
    /// waiting for it, no other process is at the head of the line (holds the gate), and
    /// the file the byte is locked in (`desc`, the slot's) is still the one its path
    /// names.
    fn may_hand_over(&self, slot: &Slot, desc: &Arc<Desc>, offset: u64) -> bool {
        if !slot
            .behind
            .front()
            .is_some_and(|b| b.mode == Mode::Exclusive)
        {
            return false;
        }
        let lf = &self.lock;
        if slot.gate {
            // Holding the gate, this process is at the head of the line itself; another
            // process in line waits for the gate in the kernel, unseen by a probe, but
            // counted: then the lock goes back (gate too) for it to take.
            return desc.line(offset).load(Ordering::Acquire) == 0 && lf.still_named(desc);
        }
        let gate = queue::gate(offset);
        match sys::probe(desc.file_for(offset), lf.flavor, gate, 1, Mode::Exclusive) {
            Ok(Attempt::Granted) => {}
            Ok(Attempt::Busy) | Err(_) => return false,
        }
        // The same bound in time as a new grant's (see [`super::file::REPLACED_BOUND`]).
        lf.still_named(desc)
    }

    /// Whether the lock at `offset` is held through the file the lock path names now:
    /// false once the lock file has been replaced under it.
    pub(super) fn in_current_file(&self, offset: u64) -> bool {
        let lf = &self.lock;
        let table = lf
            .shard(offset)
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let named = table
            .held
            .get(&offset)
            .and_then(|slot| slot.desc_or(&table.desc))
            .is_some_and(|desc| desc.is_named_by(&lf.path));
        if !named {
            // New grants look at the path again rather than trust the last look.
            lf.recheck();
        }
        named
    }
}
