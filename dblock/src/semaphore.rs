//! Semaphores: at most N holders of a name at once, across processes.
//!
//! A semaphore of limit N is N locks, its *slots*, whose keys are derived from the
//! name ([`Key::slot`]); a holder holds one slot. Everything a lock does, a slot does
//! (waiting, deadlines, cancellation, loss, fencing), because a slot *is* a lock on
//! every backend: see `docs/semaphores.md` for the guarantees and their limits.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, WaitingFor};
use crate::guard::LockGuard;
use crate::key::{Key, check_name};
use crate::locks::Locks;
use crate::observe::Attempt;
use crate::raw::{Mode, Req, Scope, Wait};

/// The largest limit a semaphore may have.
pub const MAX_SEMAPHORE_LIMIT: u32 = 1024;

impl Locks {
    /// A request for one of `limit` slots of the semaphore `name`: at most `limit`
    /// holders of the name at once, across processes. Finish it with
    /// [`lock`](SemaphoreRequest::lock), [`try_lock`](SemaphoreRequest::try_lock) or
    /// [`try_lock_for`](SemaphoreRequest::try_lock_for).
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
    pub fn semaphore<'a>(&'a self, name: &'a str, limit: u32) -> SemaphoreRequest<'a> {
        SemaphoreRequest {
            locks: self,
            name,
            limit,
            scope: self.inner.scope,
            fenced: false,
            lease: None,
        }
    }

    /// The keys of the `limit` slots of the semaphore `name`, slot 0 first.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::Unsupported`] for a limit of 0
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
        Err(Error::Unsupported(format!(
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
/// [`lock`](SemaphoreRequest::lock), [`try_lock`](SemaphoreRequest::try_lock) or
/// [`try_lock_for`](SemaphoreRequest::try_lock_for).
#[derive(Debug, Clone)]
#[must_use = "a request does nothing until lock, try_lock or try_lock_for is awaited"]
pub struct SemaphoreRequest<'a> {
    locks: &'a Locks,
    name: &'a str,
    limit: u32,
    scope: Scope,
    fenced: bool,
    lease: Option<Duration>,
}

impl SemaphoreRequest<'_> {
    /// Asks for the given PostgreSQL scope (the handle's default otherwise).
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// Asks for a fencing token with the grant: greater than every earlier fenced
    /// grant's token for this *name*, whichever slot it was. Slots are then taken one
    /// request at a time (see `docs/semaphores.md`).
    pub fn fenced(mut self) -> Self {
        self.fenced = true;
        self
    }

    /// Bounds how long a slot outlives a holder that falls silent, as
    /// [`Request::lease`](crate::Request::lease) does for a lock.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Waits until a slot is granted.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::Unsupported`] for a limit of 0
    /// or above [`MAX_SEMAPHORE_LIMIT`]; connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the wait gives up the place in line; no slot is left held, on the
    /// server or anywhere else, once the future is dropped.
    pub async fn lock(self) -> Result<SemaphoreGuard, Error> {
        match self.acquire(Wait::Forever).await? {
            Some(guard) => Ok(guard),
            None => Err(Error::Timeout {
                waiting_for: WaitingFor::LockServerLockTimeout,
                after: None,
            }),
        }
    }

    /// Takes a slot if one is free now; `Ok(None)` if all `limit` are held.
    ///
    /// # Errors
    ///
    /// As [`SemaphoreRequest::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`SemaphoreRequest::lock`].
    pub async fn try_lock(self) -> Result<Option<SemaphoreGuard>, Error> {
        self.acquire(Wait::Try).await
    }

    /// Waits at most `timeout` for a slot; `Ok(None)` if none was granted in time.
    ///
    /// # Errors
    ///
    /// As [`SemaphoreRequest::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`SemaphoreRequest::lock`].
    pub async fn try_lock_for(self, timeout: Duration) -> Result<Option<SemaphoreGuard>, Error> {
        let wait = match Instant::now().checked_add(timeout) {
            Some(t) => Wait::Until(t),
            None => Wait::Forever,
        };
        self.acquire(wait).await
    }

    async fn acquire(self, wait: Wait) -> Result<Option<SemaphoreGuard>, Error> {
        let inner = &self.locks.inner;
        check_name(self.name)?;
        check_limit(self.limit)?;
        let keys = slot_keys(&inner.namespace, self.name, self.limit);
        let req = Req {
            namespace: &inner.namespace,
            name: self.name,
            key: Key::derive(&inner.namespace, self.name),
            mode: Mode::Exclusive,
            scope: self.scope,
            wait,
            fenced: self.fenced,
            lease: self.lease,
            fence_key: None,
        };
        // Observed as a lock on the name (its key the granted slot's): see `Request::acquire`.
        let backend = inner.backend.name();
        let attempt = Attempt::wanted().then(|| Attempt::start(&req, backend, inner.metrics));
        let acquire = inner.backend.acquire_any(&req, &keys);
        let Some(((slot, grant), attempt)) = Attempt::run(attempt, req.wait, acquire).await? else {
            return Ok(None);
        };
        let Some(&key) = keys.get(slot) else {
            return Ok(None);
        };
        let slot_req = Req { key, ..req.clone() };
        let token = grant.fence.as_ref().map(|f| f.0);
        let tally = Attempt::tally(attempt, &slot_req, backend, token);
        Ok(Some(SemaphoreGuard {
            guard: LockGuard::keyed(tally, req.key, grant),
            slot: slot as u32,
            limit: self.limit,
        }))
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
