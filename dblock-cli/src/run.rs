//! `dblock run`: take the lock, run the command, pass signals on, release.

use std::pin::pin;
use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::{EXIT_LOST, EXIT_NOT_OBTAINED, EXIT_UNAVAILABLE, EXIT_USAGE, RunArgs, exit_code, sys};

/// The signals passed on to the command (and that end a wait for the lock).
const FORWARDED: [(SignalKind, i32); 6] = [
    (SignalKind::interrupt(), libc::SIGINT),
    (SignalKind::terminate(), libc::SIGTERM),
    (SignalKind::hangup(), libc::SIGHUP),
    (SignalKind::quit(), libc::SIGQUIT),
    (SignalKind::user_defined1(), libc::SIGUSR1),
    (SignalKind::user_defined2(), libc::SIGUSR2),
];

/// Resolves with the number of the first forwarded signal received.
async fn next_signal(signals: &mut [(Signal, i32)]) -> i32 {
    let futs = signals.iter_mut().map(|(s, n)| {
        let n = *n;
        Box::pin(async move {
            s.recv().await;
            n
        })
    });
    futures_select_all(futs).await
}

/// The first of several futures to finish (a tiny `select_all`).
async fn futures_select_all<F: std::future::Future<Output = i32> + Unpin>(
    futs: impl Iterator<Item = F>,
) -> i32 {
    let mut futs: Vec<F> = futs.collect();
    std::future::poll_fn(|cx| {
        for f in futs.iter_mut() {
            if let std::task::Poll::Ready(n) = std::pin::Pin::new(f).poll(cx) {
                return std::task::Poll::Ready(n);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

pub async fn run(args: RunArgs) -> u8 {
    let name = args.name.as_str();
    // Bad input is a usage error before anything is opened.
    if let Err(e) = dblock::Key::new(args.namespace.as_deref().unwrap_or("x"), name) {
        errln!("dblock: {e}");
        return EXIT_USAGE;
    }
    // Installed first, so that a signal during the wait ends dblock cleanly.
    let mut signals = Vec::new();
    for (kind, n) in FORWARDED {
        match signal(kind) {
            Ok(s) => signals.push((s, n)),
            Err(e) => {
                errln!("dblock: cannot install a signal handler: {e}");
                return EXIT_UNAVAILABLE;
            }
        }
    }

    let mut builder = dblock::Locks::builder();
    if let Some(url) = &args.db {
        builder = builder.url(url);
    }
    if let Some(ns) = &args.namespace {
        builder = builder.namespace(ns);
    }
    let locks = tokio::select! {
        r = builder.build() => match r {
            Ok(l) => l,
            Err(e) => {
                errln!("dblock: {e}");
                return exit_code(&e);
            }
        },
        n = next_signal(&mut signals) => return 128 + n as u8,
    };

    let mut req = locks.request(name);
    if args.shared {
        req = req.shared();
    } else if !args.no_fencing {
        req = req.fenced();
    }
    let acquire = async {
        if args.no_wait {
            req.try_lock().await
        } else if let Some(d) = args.wait {
            req.try_lock_for(d).await
        } else {
            req.lock().await.map(Some)
        }
    };
    let guard = tokio::select! {
        r = acquire => match r {
            Ok(Some(g)) => g,
            Ok(None) => {
                match args.wait {
                    Some(d) if !args.no_wait => errln!(
                        "dblock: lock {name:?} not obtained within {} (held by another process)",
                        show(d)
                    ),
                    _ => errln!("dblock: lock {name:?} is held by another process (--no-wait)"),
                }
                return EXIT_NOT_OBTAINED;
            }
            Err(e) => {
                errln!("dblock: {e}");
                return exit_code(&e);
            }
        },
        n = next_signal(&mut signals) => return 128 + n as u8,
    };

    let program = &args.command[0];
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(&args.command[1..]).env("DBLOCK_NAME", name);
    match guard.fencing_token() {
        Some(t) => cmd.env("DBLOCK_FENCING_TOKEN", t.to_string()),
        None => cmd.env_remove("DBLOCK_FENCING_TOKEN"),
    };
    sys::kill_child_with_parent(&mut cmd);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            errln!("dblock: cannot run {}: {e}", program.to_string_lossy());
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
            n = next_signal(&mut signals) => sys::send_signal(pid, n),
            reason = &mut lost => {
                errln!(
                    "dblock: lock {name:?} lost while the command ran ({reason}); stopping it"
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
    if let Err(e) = guard.release().await {
        errln!("dblock: warning: releasing lock {name:?}: {e}");
    }
    code
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
