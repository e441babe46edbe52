//! Opening the handle and taking the lock within `--wait`: the fencing token when the
//! role may have one, the notice while waiting, and what is said when the lock is not
//! obtained.

use std::time::Duration;

use tokio::time::Instant;

use super::RunArgs;
use super::child::{Signals, next_signal};
use crate::{EXIT_NOT_OBTAINED, exit_code, one_line};

/// How long connecting may run past the end of a `--wait`: a wait shorter than opening
/// the handle takes still tries the lock once, while a handle stuck opening (behind a
/// saturated pooler, dblock's first statement waits in its queue) gives up soon after
/// the wait.
const CONNECT_ALLOWANCE: Duration = Duration::from_secs(1);

/// `--wait`/`--no-wait`: whether to try once, and the deadline of a wait.
pub(super) struct Wait {
    try_once: bool,
    deadline: Option<Instant>,
}

impl Wait {
    /// `--wait D` counts from here, connecting included (behind a saturated pooler even
    /// opening the handle waits, in the pooler's queue), but connecting may run
    /// [`CONNECT_ALLOWANCE`] past D, so that a wait shorter than a connection takes still
    /// tries the lock once. `--wait 0s` is `--no-wait`: connect, then try once.
    pub(super) fn of(args: &RunArgs) -> Wait {
        let deadline = match (args.no_wait, args.wait) {
            (false, Some(d)) if !d.is_zero() => Instant::now().checked_add(d),
            _ => None,
        };
        Wait {
            try_once: args.no_wait || args.wait.is_some_and(|d| d.is_zero()),
            deadline,
        }
    }

    /// What is left of the wait: zero to try once, `None` for no bound.
    fn left(&self) -> Option<Duration> {
        match self.try_once {
            true => Some(Duration::ZERO),
            false => self
                .deadline
                .map(|t| t.saturating_duration_since(Instant::now())),
        }
    }
}

/// The handle, opened within the wait (or ended by a signal); `Err(exit code)`.
pub(super) async fn open(
    args: &RunArgs,
    wait: &Wait,
    signals: &mut Signals,
) -> Result<dblock::Locks, u8> {
    crate::notice::embedded_default(args.db.as_deref());
    let mut builder = dblock::Locks::builder();
    if let Some(url) = &args.db {
        builder = builder.url(url);
    }
    if let Some(ns) = &args.namespace {
        builder = builder.namespace(ns);
    }
    let build = async {
        match wait.deadline {
            Some(t) => tokio::time::timeout_at(t + CONNECT_ALLOWANCE, builder.build())
                .await
                .ok(),
            None => Some(builder.build().await),
        }
    };
    let started = std::time::Instant::now();
    tokio::select! {
        r = build => match r {
            Some(Ok(l)) => Ok(l),
            Some(Err(e)) => {
                errln!("dblock: {}", one_line(&e));
                Err(exit_code(&e))
            }
            None => {
                errln!(
                    "dblock: lock {} not obtained within {}: still connecting to the \
                     database after {} (a slow network, or a pooler queueing dblock's first \
                     statement)",
                    crate::status::quoted(&args.name),
                    show(args.wait.unwrap_or_default()),
                    show(started.elapsed())
                );
                Err(EXIT_NOT_OBTAINED)
            }
        },
        r = next_signal(signals) => Err(128 + r.signal as u8),
    }
}

/// What taking the lock gave.
pub(super) enum Took {
    /// The lock, and the semaphore slot it is (with `--limit`).
    Held(Option<u32>, dblock::LockGuard),
    /// Not obtained: held elsewhere when the wait ended, or (with the error) a wait the
    /// server's own `lock_timeout` ended.
    NotObtained(Option<dblock::Error>),
}

/// Takes the lock as `args` say (a semaphore's slot with `--limit`; with a fencing token
/// unless `--shared`, `--no-fencing`, or the role may not have one), within the wait;
/// after a second of waiting says what for and who holds it. `Err(exit code)`.
pub(super) async fn lock(
    locks: &dblock::Locks,
    args: &RunArgs,
    wait: &Wait,
    signals: &mut Signals,
    shown: &str,
) -> Result<Took, u8> {
    let name = args.name.as_str();
    // One request, whatever it takes; --no-wait is a wait of zero, which tries once.
    let take = |fenced: bool| async move {
        match args.limit {
            Some(limit) => take(locks.semaphore(name, limit), args, fenced, wait.left()).await,
            None => take(locks.request(name), args, fenced, wait.left()).await,
        }
    };
    let acquire = async {
        let fenced = !args.shared && !args.no_fencing;
        match take(fenced).await {
            // A role that may not create dblock's fencing table still gets its lock:
            // without a token, said once, with the command that enables tokens.
            Err(dblock::Error::PermissionDenied { message, fix, .. }) if fenced => {
                errln!(
                    "dblock: note: running without a fencing token (DBLOCK_FENCING_TOKEN \
                     unset): {message}; {fix}; --no-fencing silences this"
                );
                take(false).await
            }
            other => other,
        }
    };
    tokio::select! {
        () = waiting_notice(locks, args, shown) => Err(crate::EXIT_UNAVAILABLE),
        r = acquire => match r {
            Ok(Some((slot, guard))) => Ok(Took::Held(slot, guard)),
            Ok(None) => Ok(Took::NotObtained(None)),
            // The server's own lock_timeout ended a wait without a deadline: not obtained.
            Err(e) if e.is_lock_wait_timeout() => Ok(Took::NotObtained(Some(e))),
            Err(e) => {
                errln!("dblock: {}", one_line(&e));
                Err(exit_code(&e))
            }
        },
        r = next_signal(signals) => Err(128 + r.signal as u8),
    }
}

/// After a second of waiting, says what for and who holds it (on a terminal, or with
/// `DBLOCK_WAIT_NOTICE=1`); never resolves.
async fn waiting_notice(locks: &dblock::Locks, args: &RunArgs, shown: &str) {
    if !wait_notice_wanted() {
        return std::future::pending().await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    match args.limit {
        Some(n) => errln!("dblock: waiting for a slot of {shown}: all {n} held"),
        None => {
            let who = crate::status::holders_of(locks, &args.name, false).await;
            errln!(
                "dblock: waiting for lock {shown}, held by {}",
                who.as_deref().unwrap_or("another process")
            );
        }
    }
    std::future::pending::<()>().await
}

/// The lock was not obtained (`why`: a wait the server ended): with a slot, the slot's
/// claim may settle it (skipped); otherwise says who holds the lock; `run`'s exit code.
pub(super) async fn not_obtained(
    locks: &dblock::Locks,
    args: &RunArgs,
    shown: &str,
    slot: Option<dblock::jobs::Slot<'_>>,
    why: Option<dblock::Error>,
) -> u8 {
    if let Some(slot) = slot {
        match slot.not_obtained().await {
            Ok(Some(dblock::jobs::Claim::Taken(taken))) => {
                return super::once::skipped(args, shown, &taken);
            }
            Ok(_) => {}
            Err(e) => {
                errln!("dblock: {}", one_line(&e));
                return exit_code(&e);
            }
        }
    }
    if let Some(e) = why {
        errln!("dblock: lock {shown} not obtained: {}", one_line(&e));
        return EXIT_NOT_OBTAINED;
    }
    let held_by = match args.limit {
        Some(n) => format!("all {n} slots held by other processes"),
        None => match crate::status::holders_of(locks, &args.name, false).await {
            Some(who) => format!("held by {who}"),
            None => "held by another process".to_string(),
        },
    };
    match args.wait {
        Some(d) if !args.no_wait => errln!(
            "dblock: lock {shown} not obtained within {} ({})",
            show(d),
            held_by
        ),
        _ if args.limit.is_some() => errln!("dblock: lock {shown}: {held_by} (--no-wait)"),
        _ => errln!("dblock: lock {shown} is {held_by} (--no-wait)"),
    }
    EXIT_NOT_OBTAINED
}

/// Whether a wait says after a second what it waits for: on a terminal, or when
/// `DBLOCK_WAIT_NOTICE` is set (to anything but empty or `0`).
fn wait_notice_wanted() -> bool {
    use std::io::IsTerminal;
    match std::env::var_os("DBLOCK_WAIT_NOTICE") {
        Some(v) => !v.is_empty() && v != "0",
        None => std::io::stderr().is_terminal(),
    }
}

pub(super) fn show(d: Duration) -> String {
    if d.subsec_millis() == 0 && d.as_secs() > 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// What `run` holds: a lock's guard, or a semaphore slot's (and which slot).
trait Held {
    fn split(self) -> (Option<u32>, dblock::LockGuard);
}

impl Held for dblock::LockGuard {
    fn split(self) -> (Option<u32>, dblock::LockGuard) {
        (None, self)
    }
}

impl Held for dblock::SemaphoreGuard {
    fn split(self) -> (Option<u32>, dblock::LockGuard) {
        (Some(self.slot()), self.into_lock_guard())
    }
}

/// Takes `req` with `run`'s options: shared or (`fenced`) with a token, waiting at most
/// `wait` (`None`: until granted).
async fn take<T: dblock::request::Take>(
    req: dblock::Request<'_, T>,
    args: &RunArgs,
    fenced: bool,
    wait: Option<Duration>,
) -> Result<Option<(Option<u32>, dblock::LockGuard)>, dblock::Error>
where
    T::Guard: Held,
{
    let req = match (args.shared, fenced) {
        (true, _) => req.shared(),
        (false, true) => req.fenced(),
        (false, false) => req,
    };
    let got = match wait {
        Some(t) => req.try_lock_for(t).await,
        None => req.lock().await.map(Some),
    };
    got.map(|g| g.map(Held::split))
}
