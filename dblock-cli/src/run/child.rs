//! The command: started with the lock's environment and descriptor, its signals passed
//! on, stopped when the lock is lost or `--max-runtime` has passed, its exit status read.

use std::ffi::OsString;
use std::pin::pin;
use std::time::Duration;

use super::{EXIT_MAX_RUNTIME, RunArgs};
use crate::{EXIT_LOST, EXIT_UNAVAILABLE, one_line, sys};

/// The signals passed on to the command (and that end a wait for the lock).
const FORWARDED: [i32; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// A signal dblock received, and whether the kernel generated it for the terminal's
/// foreground process group (Ctrl-C, Ctrl-\, a hangup) rather than a process sending
/// it.
pub(super) struct Received {
    pub(super) signal: i32,
    from_terminal: bool,
}

/// Where [`FORWARDED`] signals arrive: signal-hook's delivery (which says where a
/// signal came from; tokio's signal streams do not) read on the runtime, without a
/// thread of its own (starting one was a tenth of a millisecond of every `dblock run`).
pub(super) struct Signals {
    delivery: SignalDelivery<tokio::net::UnixStream, WithOrigin>,
    arrived: std::collections::VecDeque<Received>,
}

use signal_hook::iterator::backend::SignalDelivery;
use signal_hook::iterator::exfiltrator::WithOrigin;

/// Starts receiving [`FORWARDED`] signals, with their origin. Inside the runtime.
pub(super) fn signals() -> std::io::Result<Signals> {
    let (read, write) = std::os::unix::net::UnixStream::pair()?;
    read.set_nonblocking(true)?;
    write.set_nonblocking(true)?;
    let read = tokio::net::UnixStream::from_std(read)?;
    let delivery = SignalDelivery::with_pipe(read, write, WithOrigin::default(), FORWARDED)?;
    Ok(Signals {
        delivery,
        arrived: std::collections::VecDeque::new(),
    })
}

/// The next signal (never resolves if the signals can no longer be read).
pub(super) async fn next_signal(signals: &mut Signals) -> Received {
    use signal_hook::low_level::siginfo::Cause;
    loop {
        if let Some(r) = signals.arrived.pop_front() {
            return r;
        }
        let read = signals.delivery.get_read();
        if read.readable().await.is_err() {
            return std::future::pending().await;
        }
        // The pipe is drained by `pending` below, past tokio: forget the readiness first,
        // so that a signal arriving after the drain makes the pipe ready again.
        let _ = read.try_io(tokio::io::Interest::READABLE, || {
            Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
        });
        for origin in signals.delivery.pending() {
            signals.arrived.push_back(Received {
                signal: origin.signal,
                from_terminal: matches!(origin.cause, Cause::Kernel),
            });
        }
    }
}

/// How the command ended: `run`'s exit code for it, and whether the lock was lost
/// (already said, and the command stopped).
pub(super) struct Ended {
    pub(super) code: u8,
    pub(super) lost: bool,
}

impl Ended {
    fn with(code: u8) -> Ended {
        Ended { code, lost: false }
    }
}

/// The command to run under a held lock.
pub(super) struct Run<'a> {
    pub(super) args: &'a RunArgs,
    /// The lock's name as printed.
    pub(super) shown: &'a str,
    /// The semaphore slot held (`--limit`).
    pub(super) index: Option<u32>,
    /// The claimed slot and attempt (`--once-per`, `--slot`).
    pub(super) claimed: Option<(String, u32)>,
}

impl Run<'_> {
    /// Runs the command while `guard` is held, to its end: its exit code (126/127 when it
    /// cannot be started; 124 when stopped at `--max-runtime`; 70 when the lock was lost).
    pub(super) async fn command(
        &self,
        guard: &mut dblock::LockGuard,
        signals: &mut Signals,
    ) -> Ended {
        let program = &self.args.command[0];
        let mut cmd = self.prepare(guard);
        // COMMAND holds the lock too: it inherits the descriptor that keeps the lock
        // alive, so that if dblock dies, by any signal, the lock stays held until COMMAND
        // (and whatever it started that kept the descriptor) has exited as well.
        if let Err(code) = share_lock(guard, &mut cmd, self.shown).await {
            return Ended { code, lost: true };
        }
        sys::kill_child_with_parent(&mut cmd);
        let spawned = cmd.spawn();
        // This process's copies of the shared descriptors go with `cmd`.
        drop(cmd);
        match spawned {
            Ok(child) => self.supervise(child, guard, signals).await,
            Err(e) => {
                errln!("dblock: cannot run {}: {e}", shown_os(program));
                Ended::with(match e.kind() {
                    std::io::ErrorKind::NotFound => 127,
                    _ => 126,
                })
            }
        }
    }

    /// The command with its environment: `DBLOCK_NAME`, `DBLOCK_SLOT` (a semaphore's),
    /// `DBLOCK_FENCING_TOKEN`, `DBLOCK_RUN_SLOT` and `DBLOCK_RUN_ATTEMPT` (a claimed
    /// slot's), each set or removed.
    fn prepare(&self, guard: &dblock::LockGuard) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.args.command[0]);
        cmd.args(&self.args.command[1..])
            .env("DBLOCK_NAME", &self.args.name);
        let vars: [(&str, Option<String>); 4] = [
            ("DBLOCK_SLOT", self.index.map(|s| s.to_string())),
            (
                "DBLOCK_FENCING_TOKEN",
                guard.fencing_token().map(|t| t.to_string()),
            ),
            (
                "DBLOCK_RUN_SLOT",
                self.claimed.as_ref().map(|c| c.0.clone()),
            ),
            (
                "DBLOCK_RUN_ATTEMPT",
                self.claimed.as_ref().map(|c| c.1.to_string()),
            ),
        ];
        for (var, value) in vars {
            match value {
                Some(v) => cmd.env(var, v),
                None => cmd.env_remove(var),
            };
        }
        cmd
    }

    /// Waits for the command, passing signals on; stops it when the lock is lost or
    /// `--max-runtime` has passed.
    async fn supervise(
        &self,
        mut child: tokio::process::Child,
        guard: &dblock::LockGuard,
        signals: &mut Signals,
    ) -> Ended {
        let pid = child.id().unwrap_or(0);
        let mut lost = pin!(guard.lost());
        let mut too_long = pin!(async {
            match self.args.max_runtime {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        });
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                // A signal the terminal sent to the foreground group reached the command
                // too (it shares dblock's process group): passing it on would deliver it
                // twice, and a second Ctrl-C means "abort now" to many programs.
                r = next_signal(signals) => {
                    if !r.from_terminal {
                        sys::send_signal(pid, r.signal);
                    }
                }
                reason = &mut lost => {
                    errln!(
                        "dblock: lock {} lost while the command ran ({reason}); stopping it",
                        self.shown
                    );
                    stop(&mut child, pid, self.args.grace).await;
                    return Ended { code: EXIT_LOST, lost: true };
                }
                () = &mut too_long => {
                    errln!(
                        "dblock: the command ran past --max-runtime {}; stopping it \
                         (SIGTERM, then SIGKILL after --grace {}); lock {} is released once \
                         it has exited",
                        super::take::show(self.args.max_runtime.unwrap_or_default()),
                        super::take::show(self.args.grace),
                        self.shown
                    );
                    stop(&mut child, pid, self.args.grace).await;
                    return Ended::with(EXIT_MAX_RUNTIME);
                }
            }
        };
        Ended::with(match status {
            Ok(s) => exit_status_code(s),
            Err(e) => {
                errln!("dblock: lost track of the command: {e}");
                EXIT_UNAVAILABLE
            }
        })
    }
}

/// Stops the command: SIGTERM, then SIGKILL once `grace` has passed; returns once it
/// has exited.
async fn stop(child: &mut tokio::process::Child, pid: u32, grace: Duration) {
    sys::send_signal(pid, libc::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        sys::send_signal(pid, libc::SIGKILL);
        let _ = child.wait().await;
    }
}

fn shown_os(s: &OsString) -> String {
    crate::status::shown(&s.to_string_lossy()).into_owned()
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

/// The command's exit code, or 128+N for signal N.
fn exit_status_code(s: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        (None, None) => EXIT_UNAVAILABLE,
    }
}
