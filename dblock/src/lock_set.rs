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

use crate::error::{Error, LossReason};
use crate::guard::LockGuard;
use crate::key::{Key, check_name};
use crate::locks::Locks;
use crate::raw::{BoxFuture, Grant, Mode};
use crate::request::sealed::{Call, Observed, Sealed};
use crate::request::{AllOf, Request};

impl Locks {
    /// A request for every one of `names` at once, to set a mode, scope or lease before
    /// taking them. Finish it with [`lock`](Request::lock), [`try_lock`](Request::try_lock)
    /// or [`try_lock_for`](Request::try_lock_for). A fencing token is refused: see
    /// [`AllOf`].
    pub fn request_all<I, S>(&self, names: I) -> LockSetRequest<'_>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Request::new(
            self,
            AllOf {
                names: names.into_iter().map(Into::into).collect(),
            },
        )
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
/// [`Locks::request_all`], finished by [`lock`](Request::lock),
/// [`try_lock`](Request::try_lock) or [`try_lock_for`](Request::try_lock_for), which give
/// a [`LockSet`]. The one [`Request`] type, for every name of a set.
pub type LockSetRequest<'a> = Request<'a, AllOf>;

/// A set's names checked, keyed and put in the canonical order: ascending by key, each key
/// once.
pub struct Set {
    /// (key, name), ascending by key.
    named: Vec<(Key, String)>,
    /// The keys alone, as the backend takes them.
    keys: Vec<Key>,
}

impl Sealed for AllOf {
    type Guard = LockSet;
    type Prepared = Set;
    type Granted = Grant;

    fn refuse(_: Mode, fenced: bool) -> Result<(), Error> {
        match fenced {
            false => Ok(()),
            true => Err(Error::invalid_request(
                "a lock set carries no fencing token: a token belongs to one name and a \
                 guard carries one, where a set would need one per name (fence the set's \
                 work under a name of its own)",
            )),
        }
    }

    fn prepare(self, namespace: &str) -> Result<Set, Error> {
        let mut named = Vec::with_capacity(self.names.len());
        for name in self.names {
            check_name(&name)?;
            named.push((Key::derive(namespace, &name), name));
        }
        named.sort_unstable_by_key(|(k, _)| k.as_i64());
        named.dedup_by_key(|(k, _)| *k);
        let keys = named.iter().map(|(k, _)| *k).collect();
        Ok(Set { named, keys })
    }

    fn named(p: &Set) -> Option<(&str, Key)> {
        // Observed as one request under its first name (by key): one acquisition, one
        // held lock in the gauge, whatever the set's size (docs/observability.md).
        p.named.first().map(|(k, n)| (n.as_str(), *k))
    }

    fn acquire<'r>(p: &'r Set, call: Call<'r>) -> BoxFuture<'r, Result<Option<Grant>, Error>> {
        call.backend.acquire_all(call.req, &p.keys)
    }

    fn granted(_: &Set, g: Grant, _: &str, key: Key) -> Result<(Grant, Key, u32), Error> {
        Ok((g, key, 0))
    }

    fn guard(p: Set, grant: Grant, tally: Observed, _: Key, _: u32) -> LockSet {
        LockSet {
            mode: tally.0.mode(),
            set: p,
            guard: Some(LockGuard::new(tally.0, grant)),
        }
    }

    fn nothing(p: Set, mode: Mode) -> Option<LockSet> {
        Some(LockSet {
            set: p,
            mode,
            guard: None,
        })
    }
}

/// Every lock of a [`Locks::lock_all`] request: a [`LockGuard`] of them all (named for
/// the first name by key) plus the names. Dropping it releases them all at once;
/// [`release`](LockSet::release) does the same and reports errors.
#[must_use = "if unused the locks are released immediately"]
#[clippy::has_significant_drop]
pub struct LockSet {
    /// The keys and names, in the order taken: ascending keys.
    set: Set,
    mode: Mode,
    /// `None` for an empty set.
    guard: Option<LockGuard>,
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
        self.set.named.iter().map(|(_, n)| n.as_str())
    }

    /// The keys held, ascending.
    pub fn keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.set.keys.iter().copied()
    }

    /// How many names are held.
    pub fn len(&self) -> usize {
        self.set.keys.len()
    }

    /// Whether the set holds no names (`lock_all` of none).
    pub fn is_empty(&self) -> bool {
        self.set.keys.is_empty()
    }

    /// Exclusive or shared.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether every lock is still held as far as this process knows (see
    /// [`LockGuard::is_held`]).
    pub fn is_held(&self) -> bool {
        self.guard.as_ref().is_none_or(LockGuard::is_held)
    }

    /// A future that resolves, with the reason, when any of the locks is lost (see
    /// [`LockGuard::lost`]); it does not borrow the set.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future has no effect on the locks.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let lost = self.guard.as_ref().map(LockGuard::lost);
        async move {
            match lost {
                Some(f) => f.await,
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
    /// Cancelling the check has no effect on the locks (as [`LockGuard::check`]).
    pub async fn check(&mut self) -> Result<(), Error> {
        match self.guard.as_mut() {
            Some(g) => g.check().await,
            None => Ok(()),
        }
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
    /// Cancelling the release still releases (as [`LockGuard::release`]).
    pub async fn release(self) -> Result<(), Error> {
        match self.guard {
            Some(g) => g.release().await,
            None => Ok(()),
        }
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
