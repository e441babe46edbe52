//! One lock request, whatever it takes: one name ([`Locks::request`]), any one of a
//! semaphore's slots ([`Locks::semaphore`]) or every name of a set
//! ([`Locks::request_all`]).
//!
//! The options (mode, scope, fencing, lease) and the finishers (`lock`, `try_lock`,
//! `try_lock_for`) are written once, on [`Request`]; so are the refusal of options that
//! do not go together, the request the backend is given and the observation of the
//! acquisition (`observe::Attempt`). What differs by what is taken — checking and keying
//! the names, which backend call takes them, the guard a grant becomes — is the
//! [`Take`] of [`One`], [`AnyOf`] and [`AllOf`].
//!
//! Every combination of options either works on every backend that can do it or is
//! refused saying why: with [`Error::InvalidRequest`] where no backend could grant it,
//! with [`Error::Unsupported`] where this backend lacks it:
//!
//! | request | refused | why |
//! |---|---|---|
//! | any, `shared()` with `fenced()` | always | a token orders holders one after another; shared holders hold at once |
//! | a semaphore ([`AnyOf`]), `shared()` | always | a slot is held by one holder, so that N slots bound the holders to N; shared holders of a slot would not exclude each other |
//! | a lock set ([`AllOf`]), `fenced()` | always | a token belongs to one name and a guard carries one; a set would need one per name (fence the set's work under a name of its own) |
//! | any, `lease(…)` | where the backend has no leases, or the lease is too short to be safe | see [`Request::lease`] |

use std::time::Duration;

use crate::error::{Error, WaitingFor};
use crate::guard::LockGuard;
use crate::key::{Key, key_of};
use crate::locks::Locks;
use crate::observe::{Attempt, Tally};
use crate::raw::{Grant, Mode, RawLocks, Req, Scope, Wait};
use sealed::{Call, Observed};

impl Locks {
    /// A request for the lock `name`, to set a mode, scope or fencing before taking it.
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
    /// use std::time::Duration;
    /// if let Some(reader) = locks.request("report").shared().try_lock_for(Duration::from_secs(5)).await? {
    ///     // … read while no writer holds "report" …
    ///     drop(reader);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn request<'a>(&'a self, name: &'a str) -> Request<'a> {
        Request::new(self, One { name })
    }

    /// Waits for the exclusive lock `name` and returns its guard.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the wait gives up the place in line; no lock is left held, on the
    /// server or anywhere else, once the future is dropped.
    pub async fn lock(&self, name: &str) -> Result<LockGuard, Error> {
        self.request(name).lock().await
    }

    /// Takes the exclusive lock `name` if it is free now; `Ok(None)` if someone else
    /// holds it.
    ///
    /// # Errors
    ///
    /// As [`Locks::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::lock`].
    pub async fn try_lock(&self, name: &str) -> Result<Option<LockGuard>, Error> {
        self.request(name).try_lock().await
    }

    /// Waits at most `timeout` for the exclusive lock `name`; `Ok(None)` if it was not
    /// granted in time. However short the timeout, the lock is tried once:
    /// `Duration::ZERO` is [`try_lock`](Locks::try_lock). See [`Request::try_lock_for`]
    /// for what the timeout counts.
    ///
    /// # Errors
    ///
    /// As [`Locks::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`Locks::lock`].
    pub async fn try_lock_for(
        &self,
        name: &str,
        timeout: Duration,
    ) -> Result<Option<LockGuard>, Error> {
        self.request(name).try_lock_for(timeout).await
    }
}

/// A lock request being set up: created by [`Locks::request`] (one name),
/// [`Locks::semaphore`] (any one of a semaphore's slots) or [`Locks::request_all`] (every
/// name of a set), finished by [`lock`](Request::lock), [`try_lock`](Request::try_lock)
/// or [`try_lock_for`](Request::try_lock_for), which give the guard of what it takes:
/// a [`LockGuard`], a [`SemaphoreGuard`](crate::SemaphoreGuard) or a
/// [`LockSet`](crate::LockSet).
///
/// `T`, what is taken, is [`One`] unless named, so `Request<'a>` is a request for one
/// name; [`SemaphoreRequest`](crate::SemaphoreRequest) and
/// [`LockSetRequest`](crate::LockSetRequest) name the other two.
#[derive(Debug, Clone)]
#[must_use = "a request does nothing until lock, try_lock or try_lock_for is awaited"]
pub struct Request<'a, T = One<'a>> {
    locks: &'a Locks,
    what: T,
    mode: Mode,
    scope: Scope,
    fenced: bool,
    lease: Option<Duration>,
}

/// What a [`Request`] takes, and the guard its grant gives: [`One`] name (a
/// [`LockGuard`]), [`AnyOf`] a semaphore's slots (a
/// [`SemaphoreGuard`](crate::SemaphoreGuard)), [`AllOf`] a set of names (a
/// [`LockSet`](crate::LockSet)). Implemented by these three only.
///
/// Generic code names the guard as `T::Guard`:
///
/// ```no_run
/// use std::time::Duration;
/// use dblock::request::Take;
///
/// /// Waits at most `wait` (`None`: for ever) for whatever `req` takes.
/// async fn take<T: Take>(
///     req: dblock::Request<'_, T>,
///     wait: Option<Duration>,
/// ) -> Result<Option<T::Guard>, dblock::Error> {
///     match wait {
///         Some(t) => req.try_lock_for(t).await,
///         None => req.lock().await.map(Some),
///     }
/// }
/// ```
pub trait Take: sealed::Sealed {}

impl<T: sealed::Sealed> Take for T {}

/// One name: [`Locks::request`]'s. Its grant is a [`LockGuard`].
#[derive(Debug, Clone, Copy)]
pub struct One<'a> {
    pub(crate) name: &'a str,
}

/// Any one of the `limit` slots of a semaphore: [`Locks::semaphore`]'s. Its grant is a
/// [`SemaphoreGuard`](crate::SemaphoreGuard).
///
/// Shared mode is refused ([`Error::InvalidRequest`]): a slot is held by one holder at a
/// time, which is what bounds the holders to `limit`; shared holders of a slot would not
/// exclude each other, and the limit would bound nothing.
#[derive(Debug, Clone, Copy)]
pub struct AnyOf<'a> {
    pub(crate) name: &'a str,
    pub(crate) limit: u32,
}

/// Every one of a set of names, all or none: [`Locks::request_all`]'s. Its grant is a
/// [`LockSet`](crate::LockSet).
///
/// A fencing token is refused ([`Error::InvalidRequest`]): a token belongs to one name and a
/// guard carries one, where a set would need one per name. Fence the set's work under a
/// name of its own (a fenced [`Locks::request`] taken with the set), or take the names'
/// fenced locks one by one in key order.
#[derive(Debug, Clone)]
pub struct AllOf {
    pub(crate) names: Vec<String>,
}

/// The half of [`Take`] only dblock implements: how a kind of request is checked, keyed,
/// taken and turned into its guard.
pub(crate) mod sealed {
    use super::{Error, Grant, Key, Mode, RawLocks, Req, Tally};

    /// A backend call as a kind of request makes it: the backend and the request it is
    /// given (opaque outside the crate, so that the sealed trait names no crate-private
    /// type).
    #[derive(Clone, Copy)]
    pub struct Call<'r> {
        pub(crate) backend: &'r dyn RawLocks,
        pub(crate) req: &'r Req<'r>,
    }

    /// A grant's [`Tally`], for the guard to keep.
    pub struct Observed(pub(crate) Tally);

    /// How a kind of request is taken: [`Take`](super::Take)'s half that only dblock
    /// implements.
    pub trait Sealed: Sized {
        /// The guard of a grant: [`LockGuard`](crate::LockGuard),
        /// [`SemaphoreGuard`](crate::SemaphoreGuard) or [`LockSet`](crate::LockSet).
        type Guard;
        /// The names checked and keyed, kept until the guard is made.
        type Prepared: Send + Sync;
        /// What the backend grants.
        type Granted: Send;

        /// Refuses options this kind of request cannot honour, saying why.
        fn refuse(mode: Mode, fenced: bool) -> Result<(), Error>;

        /// Checks the names (and limit) and derives their keys.
        fn prepare(self, namespace: &str) -> Result<Self::Prepared, Error>;

        /// The name and key the backend's request (and its observation) carries; `None`
        /// when there is nothing to take.
        fn named(p: &Self::Prepared) -> Option<(&str, Key)>;

        /// The backend's acquisition: its one virtual call and boxed future.
        fn acquire<'r>(
            p: &'r Self::Prepared,
            call: Call<'r>,
        ) -> crate::raw::BoxFuture<'r, Result<Option<Self::Granted>, Error>>;

        /// The backend's acquisition decided at once, where it can be
        /// ([`RawLocks::acquire_now`](crate::raw::RawLocks::acquire_now)); `None` to
        /// go through [`Sealed::acquire`]. By default `None`.
        #[inline]
        fn acquire_now(
            p: &Self::Prepared,
            call: Call<'_>,
        ) -> Option<Result<Option<Self::Granted>, Error>> {
            let _ = (p, call);
            None
        }

        /// What was granted of the request for `name` (keyed `key`): the grant, the key
        /// its guard reports (a semaphore's slot's, else `key`), and which of the
        /// request's keys it is (0 but for a semaphore).
        fn granted(
            p: &Self::Prepared,
            granted: Self::Granted,
            name: &str,
            key: Key,
        ) -> Result<(Grant, Key, u32), Error>;

        /// The guard of a grant (`index` as [`Sealed::granted`] said it).
        fn guard(
            p: Self::Prepared,
            grant: Grant,
            tally: Observed,
            name_key: Key,
            index: u32,
        ) -> Self::Guard;

        /// The guard of a request with nothing to take: a set of no names (for the
        /// others, [`Sealed::named`] is never `None`).
        fn nothing(p: Self::Prepared, mode: Mode) -> Option<Self::Guard>;
    }
}

impl<'a> sealed::Sealed for One<'a> {
    type Guard = LockGuard;
    type Prepared = (&'a str, Key);
    type Granted = Grant;

    #[inline]
    fn refuse(_: Mode, _: bool) -> Result<(), Error> {
        Ok(())
    }

    #[inline]
    fn prepare(self, namespace: &str) -> Result<(&'a str, Key), Error> {
        Ok((self.name, key_of(namespace, self.name)?))
    }

    #[inline]
    fn named(p: &(&'a str, Key)) -> Option<(&'a str, Key)> {
        Some(*p)
    }

    #[inline]
    fn acquire<'r>(
        _: &'r (&'a str, Key),
        call: Call<'r>,
    ) -> crate::raw::BoxFuture<'r, Result<Option<Grant>, Error>> {
        call.backend.acquire(call.req)
    }

    #[inline]
    fn acquire_now(_: &(&'a str, Key), call: Call<'_>) -> Option<Result<Option<Grant>, Error>> {
        call.backend.acquire_now(call.req)
    }

    #[inline]
    fn granted(
        _: &(&'a str, Key),
        g: Grant,
        _: &str,
        key: Key,
    ) -> Result<(Grant, Key, u32), Error> {
        Ok((g, key, 0))
    }

    #[inline]
    fn guard(_: (&'a str, Key), grant: Grant, tally: Observed, _: Key, _: u32) -> LockGuard {
        LockGuard::new(tally.0, grant)
    }

    #[inline]
    fn nothing(_: (&'a str, Key), _: Mode) -> Option<LockGuard> {
        None
    }
}

impl<'a, T: Take> Request<'a, T> {
    pub(crate) fn new(locks: &'a Locks, what: T) -> Self {
        Request {
            locks,
            what,
            mode: Mode::Exclusive,
            scope: locks.inner.scope,
            fenced: false,
            lease: None,
        }
    }

    /// Asks for shared (reader) locks: any number of shared holders at once, and no
    /// exclusive one. Refused, when taken, with a fencing token or for a semaphore (see
    /// the [`request`](crate::request) module).
    pub fn shared(self) -> Self {
        self.mode(Mode::Shared)
    }

    /// Asks for the given mode ([`Mode::Exclusive`] unless set).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Asks for the given PostgreSQL scope (the handle's default otherwise).
    pub fn scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// Asks for a fencing token with the grant: see [`fencing`](crate::fencing) for what
    /// it costs and guarantees. A semaphore's token is its name's, greater than every
    /// earlier fenced grant's of the name whichever slot it was (its slots are then taken
    /// one request at a time, `docs/semaphores.md`). Refused, when taken, with shared mode
    /// or for a lock set (see the [`request`](crate::request) module).
    pub fn fenced(mut self) -> Self {
        self.fenced = true;
        self
    }

    /// Bounds how long the lock outlives a holder that falls silent (its host cut off,
    /// its process paused): the server ends the holder's session, and so frees the lock,
    /// once the session has been idle for `lease`. A live holder never is: its
    /// connection is checked every [`check_interval`](crate::Builder::check_interval),
    /// which keeps the session busy. PostgreSQL and MySQL/MariaDB (the embedded backend's
    /// locks end with their process).
    ///
    /// A holder cut off from the server must learn that it lost the lock before the
    /// server can grant it to anyone else, so `lease` must be at least
    /// `2 × check_interval + check_timeout`, plus a tenth of that (7.7 s with the
    /// defaults; see [`Builder::check_interval`](crate::Builder::check_interval) and
    /// [`Builder::check_timeout`](crate::Builder::check_timeout)); a shorter lease is
    /// refused with [`Error::InvalidRequest`] — one rule on every backend. The server's idle
    /// timeout counts whole milliseconds on PostgreSQL and whole seconds on MySQL
    /// (`wait_timeout`); the lease is rounded up to them, never down. Leases beyond the
    /// server's limit for its idle timeouts (PostgreSQL 2³¹ − 1 ms, about 24.8 days; MySQL
    /// 365 days) are capped to it.
    ///
    /// Implemented with the server's own idle timeouts for the lock's session
    /// (`idle_in_transaction_session_timeout` for a transaction-scoped lock,
    /// `idle_session_timeout`, PostgreSQL 14+, for a session-scoped one; MySQL's
    /// `wait_timeout`), so it holds even when the holder's host is gone.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }
}

impl<T: Take> Request<'_, T> {
    /// Waits until the lock (a slot; every name of the set) is granted.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::InvalidRequest`] for options that
    /// do not go together (see the [`request`](crate::request) module), a semaphore's
    /// limit of 0 or above [`MAX_SEMAPHORE_LIMIT`](crate::MAX_SEMAPHORE_LIMIT), or a lease
    /// shorter than the lease rule; [`Error::Unsupported`] for what the backend lacks
    /// (shared mode on MySQL, a session-scoped lease before PostgreSQL 14); connection
    /// and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the wait gives up the place in line; nothing is left held, on the
    /// server or anywhere else, once the future is dropped.
    pub async fn lock(self) -> Result<T::Guard, Error> {
        match self.acquire(Wait::Forever).await? {
            Some(guard) => Ok(guard),
            // Not expected: a backend asks again when a slice of its wait ends (PostgreSQL
            // sets lock_timeout for each); kept for a server that answers otherwise.
            None => Err(Error::Timeout {
                waiting_for: WaitingFor::LockServerLockTimeout,
                after: None,
            }),
        }
    }

    /// Takes the lock if it is free now (a slot, if one is; every name, if all are);
    /// `Ok(None)`, holding nothing, if not.
    ///
    /// # Errors
    ///
    /// As [`Request::lock`].
    ///
    /// # Cancel safety
    ///
    /// As [`Request::lock`].
    pub async fn try_lock(self) -> Result<Option<T::Guard>, Error> {
        self.acquire(Wait::Try).await
    }

    /// Waits at most `timeout`; `Ok(None)`, holding nothing, if the lock was not granted
    /// in time.
    ///
    /// However short the timeout, the lock is tried once: `Duration::ZERO` is
    /// [`try_lock`](Request::try_lock), on every backend. The timeout bounds the wait for
    /// the lock, from the call: opening a new connection to the server does not count
    /// toward it (that has its own bound, the URL's `connect_timeout`; failing is an
    /// error, never `Ok(None)`), waiting for one of the handle's connections to come free
    /// when all [`max_connections`](crate::Builder::max_connections) are in use does. The
    /// wait ends on the server too (PostgreSQL's `lock_timeout`), not only in this
    /// process. The one wait that does not count is dblock's own set-up: a fenced
    /// request's first use of a database creates the fencing table under a lock of
    /// dblock's own, with its own bound, so that no request fails in it for having a
    /// short deadline (it takes milliseconds; it never waits behind a migration).
    ///
    /// # Errors
    ///
    /// As [`Request::lock`]; [`Error::Timeout`] when the deadline passed while waiting for
    /// one of the handle's connections.
    ///
    /// # Cancel safety
    ///
    /// As [`Request::lock`].
    pub async fn try_lock_for(self, timeout: Duration) -> Result<Option<T::Guard>, Error> {
        self.acquire(Wait::within(timeout)).await
    }

    /// The request, written once for every kind: refuse what does not go together, key
    /// the names, ask the backend, observe it, make the guard.
    async fn acquire(self, wait: Wait) -> Result<Option<T::Guard>, Error> {
        let inner = &self.locks.inner;
        let prepared = self.what.prepare(&inner.namespace)?;
        if self.fenced && self.mode == Mode::Shared {
            return Err(Error::invalid_request(
                "fencing tokens are granted to exclusive locks only",
            ));
        }
        T::refuse(self.mode, self.fenced)?;
        let Some((name, name_key)) = T::named(&prepared) else {
            return Ok(T::nothing(prepared, self.mode));
        };
        let req = Req {
            namespace: &inner.namespace,
            name,
            key: name_key,
            mode: self.mode,
            scope: self.scope,
            wait,
            fenced: self.fenced,
            lease: self.lease,
            fence_key: None,
        };
        let backend = inner.backend.name();
        let call = Call {
            backend: &*inner.backend,
            req: &req,
        };
        let (granted, attempt) = if Attempt::wanted() {
            // Decided at once where the backend can (no future boxed), else its future; on
            // the first poll either way, so an attempt observed is timed from before it.
            let acquire = async {
                match T::acquire_now(&prepared, call) {
                    Some(now) => now,
                    None => T::acquire(&prepared, call).await,
                }
            };
            let attempt = Attempt::start(&req, backend, inner.metrics);
            // Boxed: the observation's room (its span, its timing) is carried only by
            // requests somebody observes, not copied with every request's future.
            match Box::pin(Attempt::run(Some(attempt), wait, acquire)).await? {
                Some(got) => got,
                None => return Ok(None),
            }
        } else {
            // Nobody listens (no subscriber, no logger, no metrics feature): nothing to
            // time or report but a loss, and nothing spent on it.
            let granted = match T::acquire_now(&prepared, call) {
                Some(now) => now,
                None => T::acquire(&prepared, call).await,
            };
            match granted? {
                Some(g) => (g, None),
                None => return Ok(None),
            }
        };
        let (grant, key, index) = T::granted(&prepared, granted, name, name_key)?;
        let token = grant.fence.as_ref().map(|f| f.token);
        let tally = Observed(Attempt::tally(attempt, &req, key, backend, token));
        Ok(Some(T::guard(prepared, grant, tally, name_key, index)))
    }
}
