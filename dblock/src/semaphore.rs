//! Semaphores: at most N holders of a name at once, across processes.
//!
//! A semaphore of limit N is N locks, its *slots*, whose keys are derived from the
//! name ([`Key::slot`]); a holder holds one slot. Everything a lock does, a slot does
//! (waiting, deadlines, cancellation, loss, fencing), because a slot *is* a lock on
//! every backend: see `docs/semaphores.md` for the guarantees and their limits.

use std::ops::{Deref, DerefMut};

use crate::error::Error;
use crate::guard::LockGuard;
use crate::key::{Key, check_name, key_of};
use crate::locks::Locks;
use crate::raw::{BoxFuture, Grant, Mode};
use crate::request::sealed::{Call, Observed, Sealed};
use crate::request::{AnyOf, Request};

pub use crate::key::MAX_SEMAPHORE_LIMIT;

impl Locks {
    /// A request for one of `limit` slots of the semaphore `name`: at most `limit`
    /// holders of the name at once, across processes. Finish it with
    /// [`lock`](Request::lock), [`try_lock`](Request::try_lock) or
    /// [`try_lock_for`](Request::try_lock_for).
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
    /// let permit = locks.semaphore("exports", 3).lock().await?;
    /// // … at most three processes export at once …
    /// permit.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// Every process using a name should give it the same limit: a holder with limit
    /// `m` takes one of the first `m` slots, so at any moment at most `m` holders whose
    /// limit is `m` or less hold the name (see `docs/semaphores.md`).
    ///
    /// Shared mode is refused: see [`AnyOf`].
    pub fn semaphore<'a>(&'a self, name: &'a str, limit: u32) -> SemaphoreRequest<'a> {
        Request::new(self, AnyOf { name, limit })
    }

    /// The keys of the `limit` slots of the semaphore `name`, slot 0 first.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::InvalidRequest`] for a limit of 0
    /// or above [`MAX_SEMAPHORE_LIMIT`].
    pub fn slot_keys(&self, name: &str, limit: u32) -> Result<Vec<Key>, Error> {
        check_name(name)?;
        check_limit(limit)?;
        Ok(slot_keys(&self.inner.namespace, name, limit))
    }
}

fn check_limit(limit: u32) -> Result<(), Error> {
    if (1..=MAX_SEMAPHORE_LIMIT).contains(&limit) {
        Ok(())
    } else {
        Err(Error::invalid_request(format!(
            "a semaphore's limit must be between 1 and {MAX_SEMAPHORE_LIMIT}, not {limit}"
        )))
    }
}

fn slot_keys(namespace: &str, name: &str, limit: u32) -> Vec<Key> {
    (0..limit)
        .map(|slot| Key::derive_slot(namespace, name, slot))
        .collect()
}

/// A semaphore request being set up: created by [`Locks::semaphore`], finished by
/// [`lock`](Request::lock), [`try_lock`](Request::try_lock) or
/// [`try_lock_for`](Request::try_lock_for), which give a [`SemaphoreGuard`]. The one
/// [`Request`] type, for any one of a semaphore's slots.
pub type SemaphoreRequest<'a> = Request<'a, AnyOf<'a>>;

/// A semaphore's slots checked and keyed.
pub struct Slots<'a> {
    name: &'a str,
    /// The name's own key: a fenced grant's token row.
    key: Key,
    /// The slots' keys, slot 0 first.
    keys: Vec<Key>,
    limit: u32,
}

impl<'a> Sealed for AnyOf<'a> {
    type Guard = SemaphoreGuard;
    type Prepared = Slots<'a>;
    type Granted = (usize, Grant);

    fn refuse(mode: Mode, _: bool) -> Result<(), Error> {
        match mode {
            Mode::Exclusive => Ok(()),
            Mode::Shared => Err(Error::invalid_request(
                "a semaphore's slots are taken exclusively: a slot held by one holder at a \
                 time is what bounds the holders to the limit, and shared holders of a slot \
                 would not exclude each other",
            )),
        }
    }

    fn prepare(self, namespace: &str) -> Result<Slots<'a>, Error> {
        let key = key_of(namespace, self.name)?;
        check_limit(self.limit)?;
        Ok(Slots {
            name: self.name,
            key,
            keys: slot_keys(namespace, self.name, self.limit),
            limit: self.limit,
        })
    }

    fn named<'p>(p: &'p Slots<'a>) -> Option<(&'p str, Key)> {
        // Observed as a lock on the name; its guard's key is the granted slot's.
        Some((p.name, p.key))
    }

    fn acquire<'r>(
        p: &'r Slots<'a>,
        call: Call<'r>,
    ) -> BoxFuture<'r, Result<Option<(usize, Grant)>, Error>> {
        call.backend.acquire_any(call.req, &p.keys)
    }

    fn granted(
        p: &Slots<'a>,
        (slot, grant): (usize, Grant),
        name: &str,
        _: Key,
    ) -> Result<(Grant, Key, u32), Error> {
        match (p.keys.get(slot), u32::try_from(slot)) {
            (Some(&key), Ok(index)) => Ok((grant, key, index)),
            // Dropping the grant releases it: a backend's answer dblock cannot map is an
            // error, never "not obtained".
            _ => Err(Error::unexpected(format!(
                "a request for semaphore {:?}, whose limit is {}: slot {slot} granted",
                name, p.limit
            ))),
        }
    }

    fn guard(
        p: Slots<'a>,
        grant: Grant,
        tally: Observed,
        name_key: Key,
        index: u32,
    ) -> SemaphoreGuard {
        SemaphoreGuard {
            guard: LockGuard::keyed(tally.0, name_key, grant),
            slot: index,
            limit: p.limit,
        }
    }

    fn nothing(_: Slots<'a>, _: Mode) -> Option<SemaphoreGuard> {
        None
    }
}

/// A held slot of a semaphore: a [`LockGuard`] on the slot's key (its
/// [`key`](LockGuard::key) is the slot's, its [`name`](LockGuard::name) the
/// semaphore's), which it derefs to for loss, checks and fencing. Dropping it frees the
/// slot at once.
#[must_use = "if unused the slot is released immediately"]
#[clippy::has_significant_drop]
#[derive(Debug)]
pub struct SemaphoreGuard {
    guard: LockGuard,
    slot: u32,
    limit: u32,
}

impl SemaphoreGuard {
    /// Which slot is held, from 0 to `limit − 1`.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The limit it was asked for with.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The slot's lock guard.
    pub fn into_lock_guard(self) -> LockGuard {
        self.guard
    }

    /// Frees the slot now and waits for the database to confirm it.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockGuard::release`].
    pub async fn release(self) -> Result<(), Error> {
        self.guard.release().await
    }
}

impl Deref for SemaphoreGuard {
    type Target = LockGuard;

    fn deref(&self) -> &LockGuard {
        &self.guard
    }
}

impl DerefMut for SemaphoreGuard {
    fn deref_mut(&mut self) -> &mut LockGuard {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_outside_one_to_the_maximum_are_refused() {
        assert!(check_limit(0).is_err());
        assert!(check_limit(1).is_ok());
        assert!(check_limit(MAX_SEMAPHORE_LIMIT).is_ok());
        assert!(check_limit(MAX_SEMAPHORE_LIMIT + 1).is_err());
    }

    #[test]
    fn slot_keys_depend_on_the_name_and_slot_not_the_limit() {
        let three = slot_keys("public", "exports", 3);
        let five = slot_keys("public", "exports", 5);
        assert_eq!(three[..], five[..3]);
        assert_eq!(three[1], Key::slot("public", "exports", 1).unwrap());
    }

    fn assert_send_sync_static<T: Send + Sync + 'static>() {}
    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn guards_and_futures_are_send_and_static() {
        assert_send_sync_static::<SemaphoreGuard>();
        #[allow(unreachable_code, unused_variables, clippy::diverging_sub_expression)]
        let _ = || {
            let locks: Locks = todo!();
            assert_send(&locks.semaphore("x", 2).lock());
            assert_send(&locks.semaphore("x", 2).try_lock());
        };
    }
}
