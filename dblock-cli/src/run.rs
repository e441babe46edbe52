//! `dblock run`: take the lock, run the command, pass signals on, release.

use std::pin::pin;
use std::time::Duration;

use crate::{
    EXIT_LOST, EXIT_NOT_OBTAINED, EXIT_UNAVAILABLE, EXIT_USAGE, RunArgs, exit_code, one_line, sys,
};

/// The signals passed on to the command (and that end a wait for the lock).
const FORWARDED: [i32; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// How long connecting may run past the end of a `--wait`: a wait shorter than opening
/// the handle takes still tries the lock once, while a handle stuck opening (behind a
/// saturated pooler, dblock's first statement waits in its queue) gives up soon after
/// the wait.
const CONNECT_ALLOWANCE: Duration = Duration::from_secs(1);

/// A signal dblock received, and whether the kernel generated it for the terminal's
/// foreground process group (Ctrl-C, Ctrl-\, a hangup) rather than a process sending
/// it.
struct Received {
    signal: i32,
    from_terminal: bool,
}

/// Starts receiving [`FORWARDED`] signals, with their origin, on a thread of their own
/// (tokio's signal streams do not say where a signal came from).
fn signals() -> std::io::Result<tokio::sync::mpsc::UnboundedReceiver<Received>> {
    use signal_hook::iterator::SignalsInfo;
    use signal_hook::iterator::exfiltrator::WithOrigin;
    use signal_hook::low_level::siginfo::Cause;
    let mut info = SignalsInfo::<WithOrigin>::new(FORWARDED)?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name("dblock-signals".into())
        .spawn(move || {
            for origin in info.forever() {
                let from_terminal = matches!(origin.cause, Cause::Kernel);
                if tx
                    .send(Received {
                        signal: origin.signal,
                        from_terminal,
                    })
                    .is_err()
                {
                    break;
                }
            }
        })?;
    Ok(rx)
}

/// The next signal (never resolves if the receiving thread is gone).
async fn next_signal(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Received>) -> Received {
    match rx.recv().await {
        Some(r) => r,
        None => std::future::pending().await,
    }
}

pub async fn run(args: RunArgs) -> u8 {
    let name = args.name.as_str();
    // The name as printed: escaped, since any client of the database may have chosen it.
    let shown = crate::status::quoted(name);
    // Bad input is a usage error before anything is opened.
    if let Err(e) = dblock::Key::new(args.namespace.as_deref().unwrap_or("x"), name) {
        errln!("dblock: {}", crate::one_line(&e));
        return EXIT_USAGE;
    }
    // Installed first, so that a signal during the wait ends dblock cleanly.
    let mut signals = match signals() {
        Ok(s) => s,
        Err(e) => {
            errln!("dblock: cannot install a signal handler: {e}");
            return EXIT_UNAVAILABLE;
        }
    };

    crate::notice::embedded_default(args.db.as_deref());
    let mut builder = dblock::Locks::builder();
    if let Some(url) = &args.db {
        builder = builder.url(url);
    }
    if let Some(ns) = &args.namespace {
        builder = builder.namespace(ns);
    }
    // `--wait D` counts from here, connecting included (behind a saturated pooler even
    // opening the handle waits, in the pooler's queue), but connecting may run
    // CONNECT_ALLOWANCE past D, so that a wait shorter than a connection takes still
    // tries the lock once. `--wait 0s` is `--no-wait`: connect, then try once.
    let deadline = match (args.no_wait, args.wait) {
        (false, Some(d)) if !d.is_zero() => tokio::time::Instant::now().checked_add(d),
        _ => None,
    };
    let build = async {
        match deadline {
            Some(t) => tokio::time::timeout_at(t + CONNECT_ALLOWANCE, builder.build())
                .await
                .ok(),
            None => Some(builder.build().await),
        }
    };
    let started = std::time::Instant::now();
    let locks = tokio::select! {
        r = build => match r {
            Some(Ok(l)) => l,
            Some(Err(e)) => {
                errln!("dblock: {}", one_line(&e));
                return exit_code(&e);
            }
            None => {
                errln!(
                    "dblock: lock {shown} not obtained within {}: still connecting to the \
                     database after {} (a slow network, or a pooler queueing dblock's first \
                     statement)",
                    show(args.wait.unwrap_or_default()),
                    show(started.elapsed())
                );
                return EXIT_NOT_OBTAINED;
            }
        },
        r = next_signal(&mut signals) => return 128 + r.signal as u8,
    };
    let try_once = args.no_wait || args.wait.is_some_and(|d| d.is_zero());
    let left = move || deadline.map(|t| t.saturating_duration_since(tokio::time::Instant::now()));
    // The guard, and the semaphore slot it holds (with --limit): one request, whatever
    // it takes; --no-wait is a wait of zero, which tries once.
    let take = |fenced: bool| {
        let (locks, opts) = (&locks, &args);
        async move {
            let wait = if try_once {
                Some(Duration::ZERO)
            } else {
                left()
            };
            match args.limit {
                Some(limit) => take(locks.semaphore(name, limit), opts, fenced, wait).await,
                None => take(locks.request(name), opts, fenced, wait).await,
            }
        }
    };
    let held_by = match args.limit {
        Some(n) => format!("all {n} slots held by other processes"),
        None => "held by another process".to_string(),
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
    // After a second of waiting, say what for and who holds it (on a terminal, or
    // with DBLOCK_WAIT_NOTICE=1).
    let notice = async {
        if !wait_notice_wanted() {
            return std::future::pending().await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        match args.limit {
            Some(n) => errln!("dblock: waiting for a slot of {shown}: all {n} held"),
            None => {
                let who = crate::status::holders_of(&locks, name, false).await;
                errln!(
                    "dblock: waiting for lock {shown}, held by {}",
                    who.as_deref().unwrap_or("another process")
                );
            }
        }
        std::future::pending::<()>().await
    };
    let (slot, mut guard) = tokio::select! {
        () = notice => return EXIT_UNAVAILABLE,
        r = acquire => match r {
            Ok(Some(g)) => g,
            Ok(None) => {
                let held_by = match args.limit {
                    Some(_) => held_by,
                    None => match crate::status::holders_of(&locks, name, false).await {
                        Some(who) => format!("held by {who}"),
                        None => held_by,
                    },
                };
                match args.wait {
                    Some(d) if !args.no_wait => errln!(
                        "dblock: lock {shown} not obtained within {} ({})",
                        show(d),
                        held_by
                    ),
                    _ if args.limit.is_some() => {
                        errln!("dblock: lock {shown}: {held_by} (--no-wait)")
                    }
                    _ => errln!("dblock: lock {shown} is {held_by} (--no-wait)"),
                }
                return EXIT_NOT_OBTAINED;
            }
            // The server's own lock_timeout ended a wait without a deadline: not obtained.
            Err(e) if e.is_lock_wait_timeout() => {
                errln!("dblock: lock {shown} not obtained: {}", one_line(&e));
                return EXIT_NOT_OBTAINED;
            }
            Err(e) => {
                errln!("dblock: {}", one_line(&e));
                return exit_code(&e);
            }
        },
        r = next_signal(&mut signals) => return 128 + r.signal as u8,
    };

    let program = &args.command[0];
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(&args.command[1..]).env("DBLOCK_NAME", name);
    match slot {
        Some(s) => cmd.env("DBLOCK_SLOT", s.to_string()),
        None => cmd.env_remove("DBLOCK_SLOT"),
    };
    match guard.fencing_token() {
        Some(t) => cmd.env("DBLOCK_FENCING_TOKEN", t.to_string()),
        None => cmd.env_remove("DBLOCK_FENCING_TOKEN"),
    };
    // COMMAND holds the lock too: it inherits the descriptor that keeps the lock alive,
    // so that if dblock dies, by any signal, the lock stays held until COMMAND (and
    // whatever it started that kept the descriptor) has exited as well.
    match share_lock(&mut guard, &mut cmd, &shown).await {
        Ok(()) => {}
        Err(code) => {
            let _ = guard.release().await;
            return code;
        }
    }
    sys::kill_child_with_parent(&mut cmd);
    let spawned = cmd.spawn();
    // This process's copies of the shared descriptors go with `cmd`.
    drop(cmd);
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            errln!(
                "dblock: cannot run {}: {e}",
                crate::status::shown(&program.to_string_lossy())
            );
            let _ = guard.release().await;
            return match e.kind() {
                std::io::ErrorKind::NotFound => 127,
                _ => 126,
            };
        }
    };
    let pid = child.id().unwrap_or(0);

    let mut lost = pin!(guard.lost());
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            // A signal the terminal sent to the foreground group reached the command too
            // (it shares dblock's process group): passing it on would deliver it twice,
            // and a second Ctrl-C means "abort now" to many programs.
            r = next_signal(&mut signals) => {
                if !r.from_terminal {
                    sys::send_signal(pid, r.signal);
                }
            }
            reason = &mut lost => {
                errln!(
                    "dblock: lock {shown} lost while the command ran ({reason}); stopping it"
                );
                sys::send_signal(pid, libc::SIGTERM);
                if tokio::time::timeout(args.grace, child.wait()).await.is_err() {
                    sys::send_signal(pid, libc::SIGKILL);
                    let _ = child.wait().await;
                }
                return EXIT_LOST;
            }
        }
    };
    let code = match status {
        Ok(s) => exit_status_code(s),
        Err(e) => {
            errln!("dblock: lost track of the command: {e}");
            EXIT_UNAVAILABLE
        }
    };
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

/// Set (to anything but empty or `0`) and COMMAND does not inherit the lock's descriptor:
/// the behaviour before it did, for the tests that show the race it closes (a killed
/// dblock's lock freed a moment before its COMMAND is stopped), and to silence the note
/// where the lock cannot be shared.
pub(crate) const NO_INHERIT_VAR: &str = "DBLOCK_RUN_NO_INHERIT";

/// Makes COMMAND inherit the lock's descriptor (`DBLOCK_LOCK_FD` names it); where the
/// lock cannot be shared, says so once and goes on with the parent-death signal alone.
/// `Err(exit code)` when the lock was lost before COMMAND could start.
async fn share_lock(
    guard: &mut dblock::LockGuard,
    cmd: &mut tokio::process::Command,
    shown: &str,
) -> Result<(), u8> {
    if std::env::var_os(NO_INHERIT_VAR).is_some_and(|v| !v.is_empty() && v != "0") {
        cmd.env_remove("DBLOCK_LOCK_FD");
        return Ok(());
    }
    match guard.share_with_child(cmd.as_std_mut()).await {
        Ok(fds) => {
            let list: Vec<String> = fds.iter().map(i32::to_string).collect();
            cmd.env("DBLOCK_LOCK_FD", list.join(","));
            Ok(())
        }
        Err(e @ dblock::Error::LockLost { .. }) => {
            errln!(
                "dblock: lock {shown} lost before the command started ({}); not running it",
                one_line(&e)
            );
            Err(EXIT_LOST)
        }
        Err(e) => {
            errln!(
                "dblock: note: the command does not hold lock {shown} itself ({}): if dblock \
                 is killed, the lock may be freed a moment before the command is stopped \
                 ({NO_INHERIT_VAR}=1 silences this)",
                one_line(&e)
            );
            cmd.env_remove("DBLOCK_LOCK_FD");
            Ok(())
        }
    }
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

/// The command's exit code, or 128+N for signal N.
fn exit_status_code(s: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        (None, None) => EXIT_UNAVAILABLE,
    }
}

fn show(d: Duration) -> String {
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
