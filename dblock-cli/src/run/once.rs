//! `--once-per` and `--slot`: the slot decided (before the wait for the lock), claimed
//! under the lock, skipped with one line saying who ran it, and the command's outcome
//! recorded.

use std::time::SystemTime;

use dblock::jobs::{Claim, Outcome, RunGuard, Slot, Taken};

use super::RunArgs;
use crate::{exit_code, one_line};

/// The slot this run claims, decided now (on the database's clock for `--once-per`),
/// with its claim as it stands; `None` without `--once-per` or `--slot`. `Err(exit
/// code)`.
pub(super) async fn decide<'a>(
    locks: &'a dblock::Locks,
    args: &'a RunArgs,
) -> Result<Option<Slot<'a>>, u8> {
    let request = match (args.once_per, &args.slot) {
        (Some(period), _) => locks.once_per(&args.name, period),
        (None, Some(slot)) => locks.claim_slot(&args.name, slot),
        (None, None) => return Ok(None),
    };
    let request = match args.retry_failed {
        true => request.retry_failed(),
        false => request,
    };
    request.slot().await.map(Some).map_err(|e| {
        errln!("dblock: {}", one_line(&e));
        exit_code(&e)
    })
}

/// Claims `slot` under `guard`: the won run, or `Err` with the exit code of a skipped
/// (or failed) claim, said.
pub(super) async fn claim(
    slot: Slot<'_>,
    guard: dblock::LockGuard,
    args: &RunArgs,
    shown: &str,
) -> Result<RunGuard, u8> {
    match slot.claim_with(guard).await {
        Ok(Claim::Won(run)) => Ok(run),
        Ok(Claim::Taken(taken)) => Err(skipped(args, shown, &taken)),
        Ok(_) => Err(crate::EXIT_UNAVAILABLE),
        Err(e) => {
            errln!("dblock: {}", one_line(&e));
            Err(exit_code(&e))
        }
    }
}

/// The slot was claimed already: says so in one line (unless `--quiet`), runs nothing;
/// `--skipped-exit` (0 unless set).
pub(super) fn skipped(args: &RunArgs, shown: &str, taken: &Taken) -> u8 {
    if !args.quiet {
        errln!("dblock: {}", skip_line(shown, taken));
    }
    args.skipped_exit.unwrap_or(0)
}

/// `slot S of "report" already claimed by dblock[4242]@host-a at T (attempt 1), which
/// exited 0 at T'; not running the command`.
fn skip_line(shown: &str, taken: &Taken) -> String {
    let run = taken.run();
    let how = match run.outcome() {
        Outcome::Succeeded => format!("which exited 0 at {}", time(run.finished)),
        Outcome::Failed { exit_code } => format!(
            "which exited {exit_code} at {} (--retry-failed runs it again)",
            time(run.finished)
        ),
        Outcome::Unfinished if taken.claimant_gone() => "which recorded no outcome: it died or \
             lost its lock (--retry-failed runs it again)"
            .to_string(),
        Outcome::Unfinished if taken.lock_held() => "still running".to_string(),
        _ => "which has no outcome recorded: still running, or it died or lost its lock \
              (--retry-failed runs it again if so)"
            .to_string(),
    };
    format!(
        "slot {} of {shown} already claimed by {} at {} (attempt {}), {how}; not running the \
         command",
        crate::status::shown(&run.slot),
        crate::status::shown(&run.holder()),
        time(Some(run.started)),
        run.attempt,
    )
}

/// A time as RFC 3339 (UTC, to the millisecond).
pub(crate) fn time(t: Option<SystemTime>) -> String {
    t.and_then(|t| jiff::Timestamp::try_from(t).ok())
        .map(|t| format!("{:.3}", t))
        .unwrap_or_else(|| "?".into())
}

/// Records `code` as the outcome of the won slot; a failure to is said, and changes
/// nothing else (the lock is released next all the same).
pub(super) async fn record(run: &mut RunGuard, code: u8, shown: &str) {
    if let Err(e) = run.record(i32::from(code)).await {
        errln!(
            "dblock: warning: the outcome ({code}) of slot {} of {shown} was not recorded: {}",
            crate::status::shown(run.slot()),
            one_line(&e)
        );
    }
}
