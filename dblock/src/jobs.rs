//! Scheduled jobs across hosts: a claim per slot, so a job runs once per slot however
//! many processes fire for it, and a record of every run.
//!
//! A lock says "one at a time", not "once": ten hosts run a nightly report from cron, one
//! host's clock is five seconds behind, its cron fires after the first host has finished
//! and released the lock, and the report runs twice. A claim per scheduled slot closes
//! that: [`Locks::once_per`] decides the slot on the **database's** clock (PostgreSQL
//! `clock_timestamp()`, MySQL `UTC_TIMESTAMP(6)`; the embedded backend's database is on
//! this host, so the host's), rounded to the *nearest* boundary of the period (boundaries
//! are multiples of the period since the Unix epoch, UTC), so processes firing a little
//! early or late — by less than half the period — land in the same slot.
//! [`Locks::claim_slot`] names the slot instead (a scheduler's fire time).
//!
//! ```no_run
//! # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
//! # async fn report() -> bool { true }
//! use std::time::Duration;
//! use dblock::jobs::Claim;
//!
//! match locks.once_per("nightly-report", Duration::from_secs(24 * 3600)).claim().await? {
//!     Claim::Won(run) => {
//!         // This process won today's slot; the name's lock is held meanwhile.
//!         let ok = report().await;
//!         run.finish(if ok { 0 } else { 1 }).await?;
//!     }
//!     Claim::Taken(taken) => {
//!         let prior = taken.run();
//!         println!("slot {} already claimed by {}", prior.slot, prior.holder());
//!     }
//!     _ => {}
//! }
//! # Ok(()) }
//! ```
//!
//! # What is guaranteed
//!
//! - **At most once per slot, by default.** Of all the claims of one slot of a name
//!   (namespace and name), exactly one is recorded and wins: the one whose row the
//!   database inserted (a unique key on the name's key and the slot). Every other claim
//!   of that slot gets [`Claim::Taken`], whatever the winner's outcome — success,
//!   failure, a crash before it started its work, or a claim recorded whose reply never
//!   arrived (then nobody runs the slot, and the record shows a claim without an
//!   outcome). "Exactly once" is this plus a winner that does its work.
//! - **While a run is under way, the name is held as a lock.** A claim is made, and its
//!   outcome recorded, while the name's exclusive lock is held; the lock is released
//!   only after the outcome is recorded ([`RunGuard::finish`]). So a run that overlaps
//!   the next slot makes that slot's processes wait for the lock (or, not waiting, not
//!   obtain it), and a plain lock of the name excludes a run.
//! - **With [`retry_failed`](SlotRequest::retry_failed)**, a claim of the slot whose
//!   recorded outcome is a failure (a non-zero exit code), or that has no outcome while
//!   the name's lock is free, is taken over by the next process of the same slot that
//!   holds the lock: it runs again, as attempt 2, 3… A claim without an outcome is never
//!   taken over while its claimant holds the lock, so a live run is never run twice at
//!   once; "its claimant died" is recognised as *no outcome recorded, and the name's
//!   lock is free*: its process died (its lock with it — on the server when its
//!   connection closes, in the kernel when its process is gone), it lost its lock (an
//!   operator ended its session, or its connection broke: its work may then overlap the
//!   retry), it could not record its outcome, or it dropped its [`RunGuard`] without
//!   finishing (a panic). Runs that succeed are never run again: **at most one success
//!   per slot**, and at most one run at a time.
//! - **The record.** Each name's claims are kept in a table of dblock's, `dblock_runs`
//!   (PostgreSQL `public.dblock_runs`, one per database, like the fencing table; MySQL
//!   `dblock_runs` in the URL's database; the embedded backend's database file): slot,
//!   attempt, holder (host, pid, program), started, finished, exit code, read back with
//!   [`Locks::runs`]. A name keeps its [`RUNS_KEPT`] most recent claims (by start):
//!   older ones are deleted when a new claim is recorded, and **a slot whose claim was
//!   deleted can be claimed again**. With `once_per`, slots only move forward with the
//!   clock, so a deleted claim's slot is at least 100 slots past and no process fires
//!   for it any more; naming slots yourself ([`Locks::claim_slot`]), name them in the
//!   order they come.
//!
//! The table is created on first use (on PostgreSQL under dblock's own set-up lock, so
//! processes starting together on a fresh database never fail on it), or by
//! [`Locks::setup`] (`dblock setup`) for roles that may not create tables; a role without
//! it gets [`Error::PermissionDenied`] naming that command.
//!
//! The slot is decided when the claim is made ([`SlotRequest::slot`]), before the wait
//! for the lock: a process that waits through a long run of the previous slot still
//! claims its own slot, not the one current when it gets the lock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::Error;
use crate::guard::LockGuard;
use crate::key::{Key, check_name};
use crate::locks::Locks;
use crate::raw::{Mode, NewClaim};
use crate::request::Request;

pub use crate::raw::{Outcome, Run};

/// How many claims of each name the record keeps: the most recent, by when they were
/// made; older ones are deleted as new ones are recorded.
pub const RUNS_KEPT: u32 = 100;

/// The longest slot text, in bytes of UTF-8 (a named slot, [`Locks::claim_slot`]).
pub const MAX_SLOT_LEN: usize = 200;

/// The shortest period of [`Locks::once_per`].
pub const MIN_PERIOD: Duration = Duration::from_secs(1);

/// How many times a claim looks again when the slot's row changes under it (deleted by
/// pruning, or rewritten by something other than dblock) before it gives up.
const LOOKS: usize = 3;

impl Locks {
    /// A claim of the current slot of `name`, slots being `period` long on the
    /// database's clock (see the [module docs](crate::jobs) for the guarantees).
    /// Finish it with [`claim`](SlotRequest::claim), [`try_claim`](SlotRequest::try_claim)
    /// or [`claim_within`](SlotRequest::claim_within).
    ///
    /// A period shorter than [`MIN_PERIOD`] is refused when the claim is made
    /// ([`Error::Unsupported`]).
    pub fn once_per<'a>(&'a self, name: &'a str, period: Duration) -> SlotRequest<'a> {
        SlotRequest::new(self, name, When::Every(period))
    }

    /// A claim of the slot `slot` of `name`, named by the caller — a scheduler's fire
    /// time, say — rather than read from the database's clock: every process that claims
    /// the same text claims the same slot.
    ///
    /// An empty (or blank) slot, or one longer than [`MAX_SLOT_LEN`] bytes or holding
    /// NUL, is refused when the claim is made ([`Error::Unsupported`]).
    pub fn claim_slot<'a>(&'a self, name: &'a str, slot: &'a str) -> SlotRequest<'a> {
        SlotRequest::new(self, name, When::Named(slot))
    }

    /// The `limit` most recent claims of `name` (in the handle's namespace), newest
    /// first: who claimed each slot, when, and how it ended. At most [`RUNS_KEPT`] are
    /// kept.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`]; [`Error::PermissionDenied`] for a role that may not read
    /// (or create) the record; connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads (creating the empty table on first use).
    pub async fn runs(&self, name: &str, limit: u32) -> Result<Vec<Run>, Error> {
        let key = self.key(name)?;
        self.inner.backend.recent_runs(key, limit).await
    }
}

/// Refuses a period shorter than [`MIN_PERIOD`] (a zero period included).
pub fn check_period(period: Duration) -> Result<(), Error> {
    if period < MIN_PERIOD {
        return Err(Error::InvalidRequest {
            reason: format!("a period of {period:?}: slots must be at least a second long"),
        });
    }
    Ok(())
}

/// Refuses a slot text that is empty or blank, longer than [`MAX_SLOT_LEN`] bytes, or
/// holds NUL.
pub fn check_slot(slot: &str) -> Result<(), Error> {
    let why = if slot.trim().is_empty() {
        "it is empty"
    } else if slot.len() > MAX_SLOT_LEN {
        "it is longer than 200 bytes"
    } else if slot.contains('\0') {
        "it contains NUL"
    } else {
        return Ok(());
    };
    Err(Error::InvalidRequest {
        reason: format!("a slot named {slot:?}: {why}"),
    })
}

/// The slot of a `period` at time `at`: the boundary nearest `at` (a multiple of the
/// period since the Unix epoch; half way, the later one), written in RFC 3339, UTC, with
/// milliseconds only where the boundary has them (`2026-05-01T02:00:00Z`). A pure
/// function: every process computes the same slot from the same time.
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// let hour = Duration::from_secs(3600);
/// // 01:59:55 and 02:00:04 on 1 May 2026, both nearest 02:00.
/// let early = UNIX_EPOCH + Duration::from_secs(1_777_600_795);
/// let late = UNIX_EPOCH + Duration::from_secs(1_777_600_804);
/// assert_eq!(dblock::jobs::slot_at(early, hour), "2026-05-01T02:00:00Z");
/// assert_eq!(dblock::jobs::slot_at(late, hour), "2026-05-01T02:00:00Z");
/// ```
pub fn slot_at(at: SystemTime, period: Duration) -> String {
    let t = at
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let p = period.as_millis().max(1);
    let boundary = (t + p / 2) / p * p;
    rfc3339_ms(u64::try_from(boundary).unwrap_or(u64::MAX))
}

/// `ms` since the Unix epoch as RFC 3339 in UTC (`…T02:00:00Z`, or `…T02:00:00.500Z`).
fn rfc3339_ms(ms: u64) -> String {
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let (y, m, d) = civil_from_days(days);
    let rem = secs % 86_400;
    let (hh, mm, ss) = (rem / 3600, rem % 3600 / 60, rem % 60);
    match ms % 1000 {
        0 => format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z"),
        frac => format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}.{frac:03}Z"),
    }
}

/// The proleptic Gregorian date of a count of days since 1970-01-01 (H. Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

/// Which slot a request claims.
#[derive(Debug, Clone, Copy)]
enum When<'a> {
    /// The current slot of this period, on the database's clock.
    Every(Duration),
    /// The slot of this name.
    Named(&'a str),
}

/// A claim of a slot being set up: made by [`Locks::once_per`] or [`Locks::claim_slot`],
/// finished by [`claim`](SlotRequest::claim), [`try_claim`](SlotRequest::try_claim) or
/// [`claim_within`](SlotRequest::claim_within) — or decided in two steps,
/// [`slot`](SlotRequest::slot) then [`Slot::claim_with`] the name's lock taken your way.
#[derive(Debug, Clone)]
#[must_use = "a claim does nothing until claim, try_claim or claim_within is awaited"]
pub struct SlotRequest<'a> {
    locks: &'a Locks,
    name: &'a str,
    when: When<'a>,
    retry_failed: bool,
    fenced: bool,
}

impl<'a> SlotRequest<'a> {
    fn new(locks: &'a Locks, name: &'a str, when: When<'a>) -> SlotRequest<'a> {
        SlotRequest {
            locks,
            name,
            when,
            retry_failed: false,
            fenced: false,
        }
    }

    /// Lets this process take the slot over from a claim that failed (a non-zero exit
    /// code recorded) or whose claimant is gone (no outcome recorded, and the name's lock
    /// free): see the [module docs](crate::jobs) for exactly what that allows.
    pub fn retry_failed(mut self) -> Self {
        self.retry_failed = true;
        self
    }

    /// Takes the name's lock with a fencing token (see [`Request::fenced`]), which the
    /// winner's guard carries ([`RunGuard::lock`]).
    pub fn fenced(mut self) -> Self {
        self.fenced = true;
        self
    }

    /// Decides the slot now — on the database's clock for a period — and reads its claim,
    /// if any: the first step of a claim made in two (then take the lock of
    /// [`Slot::request`] and [`Slot::claim_with`] it).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`]; [`Error::Unsupported`] for a period under
    /// [`MIN_PERIOD`] or a bad slot text; [`Error::PermissionDenied`] for a role that may
    /// not read (or create) the record; connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads (creating the empty table on first use).
    pub async fn slot(self) -> Result<Slot<'a>, Error> {
        check_name(self.name)?;
        let backend = &self.locks.inner.backend;
        let slot = match self.when {
            When::Every(period) => {
                check_period(period)?;
                slot_at(backend.db_clock().await?, period)
            }
            When::Named(s) => {
                check_slot(s)?;
                s.to_string()
            }
        };
        let key = Key::derive(self.locks.namespace(), self.name);
        let seen = backend.read_claim(key, &slot).await?;
        Ok(Slot {
            locks: self.locks,
            name: self.name,
            key,
            slot,
            retry_failed: self.retry_failed,
            fenced: self.fenced,
            seen,
        })
    }

    /// Claims the slot, waiting for the name's lock as long as it takes (unless the
    /// slot's claim already settles it: then without the lock).
    ///
    /// # Errors
    ///
    /// As [`SlotRequest::slot`]; the lock's errors ([`Request::lock`]); connection and
    /// server errors while recording the claim.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the wait for the lock claims nothing. Cancelled once the claim is
    /// recorded, the lock is released and the claim stays without an outcome: as if this
    /// process had died (see the [module docs](crate::jobs)).
    pub async fn claim(self) -> Result<Claim, Error> {
        let slot = self.slot().await?;
        if let Some(taken) = slot.settled() {
            return Ok(Claim::Taken(taken));
        }
        let guard = slot.request().lock().await?;
        slot.claim_with(guard).await
    }

    /// Claims the slot if the name's lock is free now. `Ok(None)` when the lock is held
    /// by someone else and the slot's claim does not settle it (no claim yet; or, with
    /// `retry_failed`, one that may be retried): nothing was claimed.
    ///
    /// # Errors
    ///
    /// As [`SlotRequest::claim`].
    ///
    /// # Cancel safety
    ///
    /// As [`SlotRequest::claim`].
    pub async fn try_claim(self) -> Result<Option<Claim>, Error> {
        self.claim_waiting(Some(Duration::ZERO)).await
    }

    /// Claims the slot, waiting at most `timeout` for the name's lock (see
    /// [`Request::try_lock_for`]); `Ok(None)` as for [`SlotRequest::try_claim`] when it
    /// was not obtained.
    ///
    /// # Errors
    ///
    /// As [`SlotRequest::claim`].
    ///
    /// # Cancel safety
    ///
    /// As [`SlotRequest::claim`].
    pub async fn claim_within(self, timeout: Duration) -> Result<Option<Claim>, Error> {
        self.claim_waiting(Some(timeout)).await
    }

    async fn claim_waiting(self, timeout: Option<Duration>) -> Result<Option<Claim>, Error> {
        let slot = self.slot().await?;
        if let Some(taken) = slot.settled() {
            return Ok(Some(Claim::Taken(taken)));
        }
        let request = slot.request();
        let got = match timeout {
            Some(t) => request.try_lock_for(t).await?,
            None => Some(request.lock().await?),
        };
        match got {
            Some(guard) => slot.claim_with(guard).await.map(Some),
            None => slot.not_obtained().await,
        }
    }
}

/// A slot decided ([`SlotRequest::slot`]), with its claim as it was then: claim it under
/// the name's lock with [`Slot::claim_with`].
#[derive(Debug, Clone)]
pub struct Slot<'a> {
    locks: &'a Locks,
    name: &'a str,
    key: Key,
    slot: String,
    retry_failed: bool,
    fenced: bool,
    seen: Option<Run>,
}

impl<'a> Slot<'a> {
    /// The slot: the period's boundary (RFC 3339, UTC), or the text it was named by.
    pub fn as_str(&self) -> &str {
        &self.slot
    }

    /// The name.
    pub fn name(&self) -> &str {
        self.name
    }

    /// The slot's claim as it was when the slot was decided, if it had one.
    pub fn seen(&self) -> Option<&Run> {
        self.seen.as_ref()
    }

    /// The claim that settles this slot without the lock: one this request may not
    /// take over (any claim; with `retry_failed`, a successful one). `None` when the slot
    /// must be claimed under the lock.
    pub fn settled(&self) -> Option<Taken> {
        self.seen
            .as_ref()
            .filter(|run| !self.may_retake(run))
            .map(|run| Taken {
                run: run.clone(),
                claimant_gone: false,
                lock_held: false,
            })
    }

    /// The request for the name's lock that the claim must be made under: exclusive,
    /// fenced if [`SlotRequest::fenced`] asked for it. Take it your way (wait or not, as
    /// your scheduler needs), then [`Slot::claim_with`] its guard.
    pub fn request(&self) -> Request<'a> {
        let request = self.locks.request(self.name);
        match self.fenced {
            true => request.fenced(),
            false => request,
        }
    }

    /// Whether this request may take `run`'s claim over (under the lock).
    fn may_retake(&self, run: &Run) -> bool {
        self.retry_failed && run.outcome() != Outcome::Succeeded
    }

    /// Claims the slot under `guard`, the name's exclusive lock (of this handle's
    /// namespace), which the caller took: [`Claim::Won`] with a [`RunGuard`] holding
    /// `guard` when this process won the slot; else [`Claim::Taken`], the lock released.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] when `guard` is not the exclusive lock of this name in this
    /// handle's namespace (the lock is released); [`Error::PermissionDenied`] for a role
    /// that may not write the record; connection and server errors (the lock is
    /// released: if the claim was recorded meanwhile, it has no outcome, as if this
    /// process had died).
    ///
    /// # Cancel safety
    ///
    /// Cancelled once the claim is recorded, the lock is released and the claim stays
    /// without an outcome, as if this process had died.
    pub async fn claim_with(self, guard: LockGuard) -> Result<Claim, Error> {
        if guard.key() != self.key || guard.mode() != Mode::Exclusive {
            return Err(Error::InvalidRequest {
                reason: format!(
                    "a slot of {:?} is claimed under that name's exclusive lock in the same \
                 namespace (the guard given holds {:?})",
                    self.name,
                    guard.name()
                ),
            });
        }
        let store = &*self.locks.inner.backend;
        let me = NewClaim {
            key: self.key,
            namespace: self.locks.namespace(),
            name: self.name,
            slot: &self.slot,
            host: crate::status::host(),
            pid: std::process::id(),
            program: crate::status::program(),
        };
        for _ in 0..LOOKS {
            if store.insert_claim(&me).await? {
                if let Err(e) = store.prune_runs(self.key, RUNS_KEPT).await {
                    tracing::warn!(name = self.name, error = %e, "dblock: could not prune the record of runs");
                }
                return Ok(Claim::Won(RunGuard::new(guard, &self, 1)));
            }
            // Deleted between the insert and this read (pruned): claim again.
            let Some(run) = store.read_claim(self.key, &self.slot).await? else {
                continue;
            };
            if self.may_retake(&run) {
                match store.retake_claim(&me, run.attempt).await? {
                    Some(attempt) => return Ok(Claim::Won(RunGuard::new(guard, &self, attempt))),
                    // Changed since it was read: look again.
                    None => continue,
                }
            }
            let _ = guard.release().await;
            // Read while this process held the lock: a claim without an outcome has no
            // live claimant.
            let claimant_gone = run.outcome() == Outcome::Unfinished;
            return Ok(Claim::Taken(Taken {
                run,
                claimant_gone,
                lock_held: false,
            }));
        }
        Err(Error::Unexpected {
            message: format!(
                "the claim of slot {:?} of {:?} kept changing while this process held the \
                 name's lock: is something other than dblock writing {}?",
                self.slot,
                self.name,
                crate::raw::RUNS_TABLE
            ),
        })
    }

    /// What the claim is when the name's lock was not obtained (held by someone else):
    /// the slot's claim, read again, if it settles the slot ([`Claim::Taken`]; without an
    /// outcome, it is most likely the lock holder's run, under way); `None` if it does
    /// not (no claim yet; or, with `retry_failed`, one that may be retried): nothing was
    /// claimed.
    ///
    /// # Errors
    ///
    /// Connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn not_obtained(self) -> Result<Option<Claim>, Error> {
        let run = self
            .locks
            .inner
            .backend
            .read_claim(self.key, &self.slot)
            .await?;
        Ok(run.filter(|r| !self.may_retake(r)).map(|run| {
            Claim::Taken(Taken {
                run,
                claimant_gone: false,
                lock_held: true,
            })
        }))
    }
}

/// The outcome of a claim.
#[derive(Debug)]
#[non_exhaustive]
pub enum Claim {
    /// This process won the slot: do the work, then [`RunGuard::finish`].
    Won(RunGuard),
    /// The slot was claimed already: by whom, when, and how it ended.
    Taken(Taken),
}

/// A slot claimed by another process (or an earlier claim of this one).
#[derive(Debug, Clone)]
pub struct Taken {
    run: Run,
    claimant_gone: bool,
    lock_held: bool,
}

impl Taken {
    /// The slot's claim.
    pub fn run(&self) -> &Run {
        &self.run
    }

    /// The slot's claim.
    pub fn into_run(self) -> Run {
        self.run
    }

    /// Whether the claim has no outcome and was read while this process held the name's
    /// lock: its claimant is gone (it died, lost its lock, or dropped its guard without
    /// finishing). `false` for a claim with an outcome, or one read without the lock.
    pub fn claimant_gone(&self) -> bool {
        self.claimant_gone
    }

    /// Whether the claim was read after the name's lock was found held by another
    /// process ([`Slot::not_obtained`]): a claim without an outcome is then most likely
    /// under way. `false` when read under this process's lock, or before trying it.
    pub fn lock_held(&self) -> bool {
        self.lock_held
    }
}

/// A won slot: the name's lock, held, and the claim whose outcome
/// [`finish`](RunGuard::finish) records before releasing it.
///
/// Dropping it without finishing releases the lock and leaves the claim without an
/// outcome, which reads as a claimant that died: with
/// [`retry_failed`](SlotRequest::retry_failed), a later process of the slot runs it again.
#[must_use = "if unused the lock is released at once and the run has no outcome"]
#[clippy::has_significant_drop]
#[derive(Debug)]
pub struct RunGuard {
    lock: LockGuard,
    locks: Locks,
    key: Key,
    slot: String,
    attempt: u32,
    recorded: bool,
}

impl RunGuard {
    fn new(lock: LockGuard, slot: &Slot<'_>, attempt: u32) -> RunGuard {
        RunGuard {
            lock,
            locks: slot.locks.clone(),
            key: slot.key,
            slot: slot.slot.clone(),
            attempt,
            recorded: false,
        }
    }

    /// The slot won.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// Which attempt at the slot this is: 1, or more when it took over a failed claim.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The name's lock, held (its fencing token, [`LockGuard::lost`]…).
    pub fn lock(&self) -> &LockGuard {
        &self.lock
    }

    /// The name's lock, held ([`LockGuard::share_with_child`], [`LockGuard::check`]…).
    pub fn lock_mut(&mut self) -> &mut LockGuard {
        &mut self.lock
    }

    /// Records `exit_code` (0 for success) as the run's outcome, keeping the lock; then
    /// release it ([`RunGuard::into_lock_guard`]) or drop the guard.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] when an outcome was recorded already;
    /// [`Error::Database`] when the claim is no longer this run's (taken over by a later
    /// attempt after this process lost its lock, or deleted); connection and server
    /// errors.
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the outcome may or may not be recorded; the lock is still held.
    pub async fn record(&mut self, exit_code: i32) -> Result<(), Error> {
        if self.recorded {
            return Err(Error::InvalidRequest {
                reason: format!("the outcome of slot {:?} is recorded already", self.slot),
            });
        }
        let store = &self.locks.inner.backend;
        let done = store
            .finish_claim(self.key, &self.slot, self.attempt, exit_code)
            .await?;
        if !done {
            return Err(Error::Database {
                code: crate::ServerCode::default(),
                message: format!(
                    "the claim of slot {:?} of {:?} is no longer attempt {}: taken over after \
                     this process lost its lock, or deleted; its outcome ({exit_code}) was not \
                     recorded",
                    self.slot,
                    self.lock.name(),
                    self.attempt
                ),
            });
        }
        self.recorded = true;
        Ok(())
    }

    /// Records `exit_code` (0 for success) as the run's outcome, then releases the lock.
    ///
    /// # Errors
    ///
    /// As [`RunGuard::record`] (the lock is released all the same), else the release's
    /// ([`Error::LockLost`] when the lock was lost while the run went on).
    ///
    /// # Cancel safety
    ///
    /// Cancelled, the outcome may or may not be recorded, and the lock is released.
    pub async fn finish(mut self, exit_code: i32) -> Result<(), Error> {
        let recorded = match self.recorded {
            true => Ok(()),
            false => self.record(exit_code).await,
        };
        let released = self.lock.release().await;
        recorded.and(released)
    }

    /// [`finish`](RunGuard::finish) with exit code 0.
    ///
    /// # Errors
    ///
    /// As [`RunGuard::finish`].
    ///
    /// # Cancel safety
    ///
    /// As [`RunGuard::finish`].
    pub async fn succeeded(self) -> Result<(), Error> {
        self.finish(0).await
    }

    /// [`finish`](RunGuard::finish) with exit code 1.
    ///
    /// # Errors
    ///
    /// As [`RunGuard::finish`].
    ///
    /// # Cancel safety
    ///
    /// As [`RunGuard::finish`].
    pub async fn failed(self) -> Result<(), Error> {
        self.finish(1).await
    }

    /// The lock, keeping the claim as it is (recorded or not).
    pub fn into_lock_guard(self) -> LockGuard {
        self.lock
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(ms)
    }

    #[test]
    fn slots_round_to_the_nearest_boundary() {
        let hour = Duration::from_secs(3600);
        let two = 1_777_600_800; // 2026-05-01T02:00:00Z
        assert_eq!(slot_at(at(two, 0), hour), "2026-05-01T02:00:00Z");
        assert_eq!(slot_at(at(two - 1799, 0), hour), "2026-05-01T02:00:00Z");
        assert_eq!(slot_at(at(two + 1799, 999), hour), "2026-05-01T02:00:00Z");
        // Half way: the later boundary.
        assert_eq!(slot_at(at(two + 1800, 0), hour), "2026-05-01T03:00:00Z");
        assert_eq!(slot_at(at(two - 1800, 0), hour), "2026-05-01T02:00:00Z");
        assert_eq!(slot_at(at(two - 1801, 0), hour), "2026-05-01T01:00:00Z");
        // A day: midnight UTC.
        let day = Duration::from_secs(86_400);
        assert_eq!(slot_at(at(two, 0), day), "2026-05-01T00:00:00Z");
        // Sub-second boundaries are written with milliseconds.
        let p = Duration::from_millis(1500);
        assert_eq!(slot_at(at(0, 800), p), "1970-01-01T00:00:01.500Z");
        assert_eq!(slot_at(at(0, 700), p), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn dates_are_the_calendars() {
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_ms(946_684_799_000), "1999-12-31T23:59:59Z");
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_ms(1_777_600_800_123), "2026-05-01T02:00:00.123Z");
        // 2100 is not a leap year.
        assert_eq!(rfc3339_ms(4_107_542_400_000), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn bad_periods_and_slots_are_refused() {
        assert!(check_period(Duration::ZERO).is_err());
        assert!(check_period(Duration::from_millis(999)).is_err());
        assert!(check_period(Duration::from_secs(1)).is_ok());
        assert!(check_slot("").is_err());
        assert!(check_slot("  ").is_err());
        assert!(check_slot("a\0b").is_err());
        assert!(check_slot(&"x".repeat(201)).is_err());
        assert!(check_slot(&"x".repeat(200)).is_ok());
        assert!(check_slot("2026-05-01T02:00:00Z").is_ok());
    }

    #[test]
    fn outcomes_read_from_the_record() {
        let mut run = Run {
            namespace: "public".into(),
            name: "n".into(),
            slot: "s".into(),
            attempt: 1,
            host: "h".into(),
            pid: 7,
            program: "p".into(),
            started: UNIX_EPOCH,
            finished: None,
            exit_code: None,
        };
        assert_eq!(run.outcome(), Outcome::Unfinished);
        assert_eq!(run.holder(), "p[7]@h");
        run.finished = Some(UNIX_EPOCH);
        run.exit_code = Some(0);
        assert_eq!(run.outcome(), Outcome::Succeeded);
        run.exit_code = Some(3);
        assert_eq!(run.outcome(), Outcome::Failed { exit_code: 3 });
    }
}
