//! Many names at once: [`Locks::lock_all`] takes every name or none, in one canonical
//! order, and returns one [`LockSet`] that releases them all.
//!
//! The names' keys are sorted and taken in that order by every request, so two
//! `lock_all` calls over overlapping names never wait for each other in a cycle, however
//! the callers ordered their names. On PostgreSQL the whole set is one message on one
//! connection (one round trip when the names are free), and a request never waits while
//! it holds any of the names; elsewhere each name is one request, taken in key order.
//! See `docs/lock-sets.md`.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, LossReason, WaitingFor};
use crate::key::{Key, check_name};
use crate::locks::Locks;
use crate::observe::{Attempt, Tally};
use crate::raw::{Mode, RawHeld, Req, Scope, Wait};

impl Locks {
    /// A request for every one of `names` at once, to set a mode, scope or lease before
    /// taking them. Finish it with [`lock`](LockSetRequest::lock),
    /// [`try_lock`](LockSetRequest::try_lock) or
    /// [`try_lock_for`](LockSetRequest::try_lock_for).
    pub fn request_all<I, S>(&self, names: I) -> LockSetRequest<'_>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        LockSetRequest {
            locks: self,
            names: names.into_iter().map(Into::into).collect(),
            mode: Mode::Exclusive,
            scope: self.inner.scope,
            lease: None,
        }
    }

    /// Waits for the exclusive locks of every one of `names` — all or none — and
    /// returns one guard for them all.
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
    /// let pins = locks.lock_all(["pin:a", "pin:b", "pin:c"]).await?;
    /// // … no one else holds any of the three …
    /// pins.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; connection and server errors. A name given
    /// twice is taken once.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the wait gives up the place in line; none of the names is left held,
    /// on the server or anywhere else, once the future is dropped.
    pub async fn lock_all<I, S>(&self, names: I) -> Result<LockSet, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.request_all(names).lock().await
    }

    /// Takes the exclusive locks of every one of `names` if all are free now;
    /// `Ok(None)`, holding none, if any is held by someone else.
    ///
    /// # Errors
    ///
    /// As [`Locks::lock_all`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::lock_all`].
    pub async fn try_lock_all<I, S>(&self, names: I) -> Result<Option<LockSet>, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.request_all(names).try_lock().await
    }

    /// Waits at most `timeout` for the exclusive locks of every one of `names`;
    /// `Ok(None)`, holding none, if they were not all granted in time.
    ///
    /// # Errors
    ///
    /// As [`Locks::lock_all`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::lock_all`].
    pub async fn try_lock_all_for<I, S>(
        &self,
        names: I,
        timeout: Duration,
    ) -> Result<Option<LockSet>, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.request_all(names).try_lock_for(timeout).await
    }
}

/// A request for several names at once being set up: created by
/// [`Locks::request_all`], finished by [`lock`](LockSetRequest::lock),
/// [`try_lock`](LockSetRequest::try_lock) or [`try_lock_for`](LockSetRequest::try_lock_for).
#[derive(Debug, Clone)]
#[must_use = "a request does nothing until lock, try_lock or try_lock_for is awaited"]
pub struct LockSetRequest<'a> {
    locks: &'a Locks,
    names: Vec<String>,
    mode: Mode,
    scope: Scope,
    lease: Option<Duration>,
}

impl LockSetRequest<'_> {
    /// Asks for shared (reader) locks on every name.
    pub fn shared(mut self) -> Self {
        self.mode = Mode::Shared;
        self
    }

    /// Asks for the given mode on every name.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Asks for the given PostgreSQL scope (the handle's default otherwise).
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// Bounds how long the locks outlive a holder that falls silent, as
    /// [`Request::lease`](crate::Request::lease) does for one lock.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Waits until every name is granted.
    ///
    /// # Errors
    ///
    /// As [`Locks::lock_all`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::lock_all`].
    pub async fn lock(self) -> Result<LockSet, Error> {
        match self.acquire(Wait::Forever).await? {
            Some(set) => Ok(set),
            None => Err(Error::Timeout {
                waiting_for: WaitingFor::LockServerLockTimeout,
                after: None,
            }),
        }
    }

    /// Takes every name if all are free now; `Ok(None)`, holding none, if not.
    ///
    /// # Errors
    ///
    /// As [`Locks::lock_all`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::lock_all`].
    pub async fn try_lock(self) -> Result<Option<LockSet>, Error> {
        self.acquire(Wait::Try).await
    }

    /// Waits at most `timeout` for every name; `Ok(None)`, holding none, if they were
    /// not all granted in time.
    ///
    /// # Errors
    ///
    /// As [`Locks::lock_all`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::lock_all`].
    pub async fn try_lock_for(self, timeout: Duration) -> Result<Option<LockSet>, Error> {
        let wait = match Instant::now().checked_add(timeout) {
            Some(t) => Wait::Until(t),
            None => Wait::Forever,
        };
        self.acquire(wait).await
    }

    async fn acquire(self, wait: Wait) -> Result<Option<LockSet>, Error> {
        let inner = &self.locks.inner;
        let mut named = Vec::with_capacity(self.names.len());
        for name in self.names {
            check_name(&name)?;
            named.push((Key::derive(&inner.namespace, &name), name));
        }
        // The canonical order: by key, each key once.
        named.sort_unstable_by_key(|(k, _)| k.as_i64());
        named.dedup_by_key(|(k, _)| *k);
        let keys: Vec<Key> = named.iter().map(|(k, _)| *k).collect();
        let Some(&(first, ref first_name)) = named.first() else {
            return Ok(Some(LockSet {
                names: Vec::new(),
                mode: self.mode,
                held: None,
            }));
        };
        let req = Req {
            namespace: &inner.namespace,
            name: first_name,
            key: first,
            mode: self.mode,
            scope: self.scope,
            wait,
            fenced: false,
            lease: self.lease,
            fence_key: None,
        };
        // Observed as one request under its first name (by key): one acquisition, one
        // held lock in the gauge, whatever the set's size (docs/observability.md).
        let backend = inner.backend.name();
        let attempt = Attempt::wanted().then(|| Attempt::start(&req, backend, inner.metrics));
        let acquire = inner.backend.acquire_all(&req, &keys);
        let Some((g, attempt)) = Attempt::run(attempt, req.wait, acquire).await? else {
            return Ok(None);
        };
        let tally = Attempt::tally(attempt, &req, backend, None);
        Ok(Some(LockSet {
            names: named,
            mode: self.mode,
            held: Some((g.held, tally)),
        }))
    }
}

/// Every lock of a [`Locks::lock_all`] request. Dropping it releases them all at once;
/// [`release`](LockSet::release) does the same and reports errors.
#[must_use = "if unused the locks are released immediately"]
#[clippy::has_significant_drop]
pub struct LockSet {
    /// (key, name), in the order taken: ascending keys.
    names: Vec<(Key, String)>,
    mode: Mode,
    /// `None` for an empty set; with what tracing and metrics are told of it.
    held: Option<(Box<dyn RawHeld>, Tally)>,
}

impl fmt::Debug for LockSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockSet")
            .field("names", &self.names().collect::<Vec<_>>())
            .field("mode", &self.mode)
            .finish()
    }
}

impl LockSet {
    /// The names held, each once, in the order they were taken (by key).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(|(_, n)| n.as_str())
    }

    /// The keys held, ascending.
    pub fn keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.names.iter().map(|(k, _)| *k)
    }

    /// How many names are held.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether the set holds no names (`lock_all` of none).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Exclusive or shared.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether every lock is still held as far as this process knows (see
    /// [`LockGuard::is_held`](crate::LockGuard::is_held)).
    pub fn is_held(&self) -> bool {
        let Some((h, tally)) = &self.held else {
            return true;
        };
        match h.loss() {
            None => true,
            Some(reason) => {
                tally.saw_loss(&reason);
                false
            }
        }
    }

    /// A future that resolves, with the reason, when any of the locks is lost (see
    /// [`LockGuard::lost`](crate::LockGuard::lost)); it does not borrow the set.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future has no effect on the locks.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let lost = self
            .held
            .as_ref()
            .map(|(h, tally)| (h.lost(), tally.loss_reporter()));
        async move {
            match lost {
                Some((f, reporter)) => {
                    let reason = f.await;
                    reporter.report(&reason);
                    reason
                }
                None => std::future::pending().await,
            }
        }
    }

    /// Checks with the database, now, that every lock is still held.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] when one is not.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the check has no effect on the locks (as
    /// [`LockGuard::check`](crate::LockGuard::check)).
    pub async fn check(&mut self) -> Result<(), Error> {
        let Some((h, tally)) = self.held.as_mut() else {
            return Ok(());
        };
        let r = h.check().await;
        if let Err(Error::LockLost { reason }) = &r {
            tally.saw_loss(reason);
        }
        r
    }

    /// Releases every lock now and waits for the database to confirm it.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] if a lock had been lost before; connection errors. Either
    /// way none of the locks is held any more.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the release still releases (as
    /// [`LockGuard::release`](crate::LockGuard::release)).
    pub async fn release(self) -> Result<(), Error> {
        let Some((held, tally)) = self.held else {
            return Ok(());
        };
        tally.closing();
        let r = held.release().await;
        if let Err(Error::LockLost { reason }) = &r {
            tally.saw_loss(reason);
        }
        drop(tally);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync_static<T: Send + Sync + 'static>() {}
    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn sets_and_their_futures_are_send_and_static() {
        assert_send_sync_static::<LockSet>();
        #[allow(unreachable_code, unused_variables, clippy::diverging_sub_expression)]
        let _ = || {
            let locks: Locks = todo!();
            assert_send(&locks.lock_all(["a", "b"]));
            assert_send(&locks.try_lock_all(vec![String::from("a")]));
            let set: LockSet = todo!();
            assert_send(&set.lost());
            assert_send(&set.release());
        };
    }
}
