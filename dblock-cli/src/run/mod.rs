//! `dblock run`: take the lock (and with `--once-per` or `--slot`, claim the slot), run
//! the command, pass signals on, stop it at `--max-runtime`, record the outcome, release.
//!
//! In four parts: this file (the options, their checks, and the order of the steps);
//! `take.rs` (opening the handle and taking the lock within `--wait`); `once.rs` (the
//! slot: decided, claimed, skipped, its outcome recorded); `child.rs` (the command: its
//! environment and the lock's descriptor, signals, loss, `--max-runtime`).

mod child;
mod once;
mod take;

pub(crate) use once::time;

use std::ffi::OsString;
use std::time::Duration;

use clap::{ArgGroup, Args};

use crate::{EXIT_LOST, EXIT_UNAVAILABLE, EXIT_USAGE, duration, one_line};

/// The command ran past `--max-runtime` and was stopped (as timeout(1) exits).
pub const EXIT_MAX_RUNTIME: u8 = 124;

#[derive(Args, Debug)]
#[command(
    group(ArgGroup::new("claim").args(["once_per", "slot"])),
    override_usage = "dblock run [OPTIONS] NAME -- COMMAND...\n       \
                      dblock run [OPTIONS] -- NAME -- COMMAND...   (a NAME that begins with '-')"
)]
pub struct RunArgs {
    /// Database URL: postgres://…, postgresql://…, a libpq key=value string, mysql://…,
    /// mariadb://…, sqlite:PATH (its directory must exist).
    /// Default: $DBLOCK_DATABASE_URL, then $DATABASE_URL, then the host-local file
    /// $XDG_STATE_HOME/dblock/locks.db (~/.local/state/dblock/locks.db), with a note on
    /// stderr (DBLOCK_NO_DEFAULT_NOTICE=1 silences it).
    #[arg(long, value_name = "URL")]
    pub(crate) db: Option<String>,

    /// Namespace the name is keyed in (default: the server setting dblock.namespace if
    /// set, else "public").
    #[arg(long, value_name = "NS")]
    pub(crate) namespace: Option<String>,

    /// Wait at most DURATION (500ms, 30s, 5m) for the lock; exit 75 if not obtained.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, conflicts_with = "no_wait")]
    pub(crate) wait: Option<Duration>,

    /// Do not wait: exit 75 at once if another process holds the lock.
    #[arg(long)]
    pub(crate) no_wait: bool,

    /// Take a shared (reader) lock: any number of shared holders, no exclusive one.
    #[arg(long)]
    pub(crate) shared: bool,

    /// A semaphore: at most N holders of NAME at once (each takes one of N slots;
    /// every process should use the same N). COMMAND gets DBLOCK_SLOT (0 to N-1).
    #[arg(long, value_name = "N", conflicts_with = "shared")]
    pub(crate) limit: Option<u32>,

    /// Run COMMAND at most once per slot of DURATION (at least 1s) of the database's
    /// clock, rounded to the nearest boundary: of all the processes that run this in one
    /// slot, one runs COMMAND; the others run nothing, exit 0 (see --skipped-exit) and
    /// say on stderr who ran it. COMMAND gets DBLOCK_RUN_SLOT and DBLOCK_RUN_ATTEMPT.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, conflicts_with_all = ["limit", "shared"])]
    pub(crate) once_per: Option<Duration>,

    /// As --once-per, for the slot named TEXT (a scheduler's fire time, say) instead of
    /// one read from the clock.
    #[arg(long, value_name = "TEXT", conflicts_with_all = ["limit", "shared"])]
    pub(crate) slot: Option<String>,

    /// With --once-per or --slot: run COMMAND again if the slot's run failed (exited
    /// non-zero) or its claimant died (no outcome recorded, and the lock free).
    #[arg(long, requires = "claim")]
    pub(crate) retry_failed: bool,

    /// With --once-per or --slot: exit N instead of 0 when the slot was already claimed,
    /// so a script can tell "skipped" from "ran".
    #[arg(long, value_name = "N", requires = "claim")]
    pub(crate) skipped_exit: Option<u8>,

    /// With --once-per or --slot: say nothing when the slot was already claimed.
    #[arg(long, requires = "claim")]
    pub(crate) quiet: bool,

    /// Stop COMMAND once it has run this long: SIGTERM, then SIGKILL after --grace; the
    /// lock is released only once it has exited; exit 124.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
    pub(crate) max_runtime: Option<Duration>,

    /// How long COMMAND has between SIGTERM and SIGKILL, once the lock is lost or
    /// --max-runtime has passed.
    #[arg(long, value_name = "DURATION", value_parser = duration::parse, default_value = "10s")]
    pub(crate) grace: Duration,

    /// Do not take a fencing token (DBLOCK_FENCING_TOKEN is then unset); needs no
    /// table in the database.
    #[arg(long)]
    pub(crate) no_fencing: bool,

    /// The lock name. A name that begins with `-` goes after a first `--`:
    /// `dblock run [OPTIONS] -- NAME -- COMMAND`.
    #[arg(id = "name", value_name = "NAME")]
    pub(crate) name_arg: Option<String>,

    /// The lock name, once [`RunArgs::resolve_name`] has found it.
    #[arg(skip)]
    pub(crate) name: String,

    /// The command to run, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub(crate) command: Vec<OsString>,
}

impl RunArgs {
    /// Finds NAME: the positional one (`run NAME -- COMMAND`), or, when options were
    /// ended by a first `--` (clap then hands everything after it to COMMAND), the word
    /// before a second `--` (`run -- -NAME -- COMMAND`: how a name that begins with `-`
    /// is given).
    pub(crate) fn resolve_name(&mut self) -> Result<(), String> {
        if let Some(name) = self.name_arg.take() {
            self.name = name;
            return Ok(());
        }
        match self.command.iter().position(|w| w == "--") {
            Some(1) if self.command.len() > 2 => {
                let name = self.command.remove(0);
                self.command.remove(0);
                self.name = name
                    .into_string()
                    .map_err(|n| format!("the lock name {n:?} is not valid UTF-8"))?;
                Ok(())
            }
            _ => Err(
                "the lock NAME is missing: dblock run [OPTIONS] NAME -- COMMAND \
                      (a name that begins with '-': dblock run [OPTIONS] -- NAME -- COMMAND)"
                    .to_string(),
            ),
        }
    }
}

/// What `run` holds while COMMAND runs: the lock, or a won slot (the lock and the
/// claim whose outcome is recorded when COMMAND exits).
enum Held {
    Lock(dblock::LockGuard),
    Run(dblock::jobs::RunGuard),
}

impl Held {
    fn lock_mut(&mut self) -> &mut dblock::LockGuard {
        match self {
            Held::Lock(g) => g,
            Held::Run(r) => r.lock_mut(),
        }
    }
}

pub async fn run(mut args: RunArgs) -> u8 {
    if let Err(e) = args.resolve_name() {
        errln!("dblock: {e}");
        return EXIT_USAGE;
    }
    // The name as printed: escaped, since any client of the database may have chosen it.
    let shown = crate::status::quoted(&args.name);
    if let Err(e) = check(&args) {
        errln!("dblock: {}", one_line(&e));
        return EXIT_USAGE;
    }
    // Installed first, so that a signal during the wait ends dblock cleanly.
    let mut signals = match child::signals() {
        Ok(s) => s,
        Err(e) => {
            errln!("dblock: cannot install a signal handler: {e}");
            return EXIT_UNAVAILABLE;
        }
    };
    let wait = take::Wait::of(&args);
    let locks = match take::open(&args, &wait, &mut signals).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    // The slot is decided before the wait for the lock: a process that waits through the
    // previous slot's long run still claims its own.
    let slot = match once::decide(&locks, &args).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Some(taken) = slot.as_ref().and_then(|s| s.settled()) {
        return once::skipped(&args, &shown, &taken);
    }
    let (index, guard) = match take::lock(&locks, &args, &wait, &mut signals, &shown).await {
        Ok(take::Took::Held(index, guard)) => (index, guard),
        Ok(take::Took::NotObtained(why)) => {
            return take::not_obtained(&locks, &args, &shown, slot, why).await;
        }
        Err(code) => return code,
    };
    let mut held = match slot {
        Some(slot) => match once::claim(slot, guard, &args, &shown).await {
            Ok(run) => Held::Run(run),
            Err(code) => return code,
        },
        None => Held::Lock(guard),
    };
    let run = child::Run {
        args: &args,
        shown: &shown,
        index,
        claimed: match &held {
            Held::Run(r) => Some((r.slot().to_string(), r.attempt())),
            Held::Lock(_) => None,
        },
    };
    let code = run.command(held.lock_mut(), &mut signals).await;
    finish(held, code, &shown).await
}

/// Refuses, before anything is opened, what cannot be run: a bad name, a period under a
/// second, an empty slot.
fn check(args: &RunArgs) -> Result<(), dblock::Error> {
    dblock::Key::new(args.namespace.as_deref().unwrap_or("x"), &args.name)?;
    if let Some(period) = args.once_per {
        dblock::jobs::check_period(period)?;
    }
    if let Some(slot) = &args.slot {
        dblock::jobs::check_slot(slot)?;
    }
    Ok(())
}

/// After COMMAND exited with `code` (or was stopped): the outcome recorded (a won slot),
/// then the lock released; `run`'s exit code.
async fn finish(held: Held, code: child::Ended, shown: &str) -> u8 {
    let guard = match held {
        Held::Lock(g) => g,
        Held::Run(mut run) => {
            once::record(&mut run, code.code, shown).await;
            run.into_lock_guard()
        }
    };
    if code.lost {
        // Already said; dropping the guard gives up whatever is left of the lock.
        return code.code;
    }
    let code = code.code;
    match guard.release().await {
        Ok(()) => code,
        // Lost before the command finished, as far as anyone can tell: the command may
        // have run partly outside the lock.
        Err(e @ dblock::Error::LockLost { .. }) => {
            errln!(
                "dblock: lock {shown} lost while the command ran ({}); the command exited with {code}",
                one_line(&e)
            );
            EXIT_LOST
        }
        Err(e) => {
            errln!("dblock: warning: releasing lock {shown}: {}", one_line(&e));
            code
        }
    }
}
