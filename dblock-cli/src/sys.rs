//! The system calls of `dblock run`: the child's parent-death signal and signal
//! delivery. The only `unsafe` of the binary.
#![allow(unsafe_code)]

#[cfg(any(target_os = "linux", target_os = "android"))]
use std::io;

/// Arranges for the command `cmd` starts to receive SIGKILL if dblock dies, however it
/// dies (Linux `PR_SET_PDEATHSIG`), so that it does not run on for long without its
/// dblock. The signal comes after the dying process's descriptors close, so on its own
/// it leaves a moment in which the lock is free and COMMAND runs; what closes that
/// moment is COMMAND's inherited copy of the lock's descriptor (`run.rs`). The signal
/// follows the *thread* that forked: dblock spawns from its main thread, which lives as
/// long as the process.
///
/// Other platforms have no parent-death signal: there a command outlives a dblock
/// killed with SIGKILL (signals dblock receives are still passed on).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn kill_child_with_parent(cmd: &mut tokio::process::Command) {
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe functions (prctl, getppid, _exit); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // dblock died before the prctl took effect: do not start the command.
            if libc::getppid() != parent {
                libc::_exit(128 + libc::SIGKILL);
            }
            Ok(())
        });
    }
}

/// Without a parent-death signal there is nothing to arrange.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub fn kill_child_with_parent(_cmd: &mut tokio::process::Command) {}

/// Sends `signal` to process `pid`; an already-reaped process is not an error.
pub fn send_signal(pid: u32, signal: i32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill has no memory-safety preconditions; a stale pid yields ESRCH.
    unsafe {
        libc::kill(pid, signal);
    }
}
