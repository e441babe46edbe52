//! Measures how fairly a lock is handed over between many processes: every process
//! takes one name over and over, and the time each `lock()` waited is collected.
//!
//! ```text
//! cargo run --release -p dblock --example contention -- [--procs 16] [--sections 300]
//!     [--hold-us 200] [--readers 0] [--tasks 1] [--url URL]
//! ```
//!
//! Without `--url` it uses an SQLite file in a fresh temporary directory. `--readers N`
//! makes N of the processes take the lock shared, so a writer's wait behind a stream of
//! readers shows. It prints the wait percentiles and the worst wait, for writers and
//! readers apart: a fair lock keeps the worst wait near `procs × (hold + handover)`.
//! `--tasks N` runs N tasks in each process, on one handle, each taking the lock
//! `--sections` times: tasks of one process hand the lock to one another there (the
//! embedded file's table, PostgreSQL's relay), and the waits show what that does to the
//! other processes. Figures, not assertions: this measures, it does not test.

use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num = |flag: &str, default: u64| -> Result<u64, Box<dyn std::error::Error>> {
        Ok(match opt(flag) {
            Some(v) => v.parse()?,
            None => default,
        })
    };
    if args.first().map(String::as_str) == Some("--worker") {
        let (url, sections, hold_us) = (&args[1], num("--sections", 300)?, num("--hold-us", 200)?);
        let shared = args.iter().any(|a| a == "--shared");
        let locks = dblock::Locks::connect(url).await?;
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..num("--tasks", 1)? {
            tasks.spawn(worker(locks.clone(), sections, hold_us, shared));
        }
        let mut out = String::new();
        while let Some(waits) = tasks.join_next().await {
            out.push_str(&waits??);
        }
        print!("{out}");
        return Ok(());
    }
    let procs = num("--procs", 16)?;
    let sections = num("--sections", 300)?;
    let hold_us = num("--hold-us", 200)?;
    let readers = num("--readers", 0)?;
    let tasks = num("--tasks", 1)?;
    let dir = tempfile::tempdir()?;
    let url = match opt("--url") {
        Some(u) => u,
        None => format!("sqlite:{}", dir.path().join("locks.db").display()),
    };
    // Open the file (or schema) once before the clock starts.
    drop(dblock::Locks::connect(&url).await?);
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let mut children = Vec::new();
    for p in 0..procs {
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.args(["--worker", &url, "--sections", &sections.to_string()])
            .args(["--hold-us", &hold_us.to_string()])
            .args(["--tasks", &tasks.to_string()])
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if p < readers {
            cmd.arg("--shared");
        }
        children.push((p < readers, cmd.spawn()?));
    }
    let (mut w_waits, mut r_waits) = (Vec::new(), Vec::new());
    for (shared, mut child) in children {
        let out = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(out).lines();
        while let Some(line) = lines.next_line().await? {
            let us: f64 = line.parse()?;
            match shared {
                true => r_waits.push(us),
                false => w_waits.push(us),
            }
        }
        if !child.wait().await?.success() {
            return Err("a worker failed".into());
        }
    }
    let total = started.elapsed();
    println!(
        "{} on {}: {procs} processes ({readers} shared) x {tasks} task(s) x {sections} sections, hold {hold_us} µs, {:.2} s in all",
        dblock::Locks::connect(&url).await?.backend_name(),
        if url.starts_with("sqlite:") {
            "a fresh file"
        } else {
            "the given URL"
        },
        total.as_secs_f64()
    );
    for (what, waits) in [("exclusive", &mut w_waits), ("shared", &mut r_waits)] {
        if waits.is_empty() {
            continue;
        }
        waits.sort_by(f64::total_cmp);
        let pct = |p: f64| waits[((waits.len() - 1) as f64 * p).round() as usize] / 1000.0;
        println!(
            "{what:>9} waits (ms): p50 {:.2}  p90 {:.2}  p99 {:.2}  worst {:.2}  ({} waits)",
            pct(0.5),
            pct(0.9),
            pct(0.99),
            pct(1.0),
            waits.len()
        );
    }
    Ok(())
}

/// One task: `sections` times take the lock, note how long that waited, hold it for
/// `hold_us` (a busy wait, so the holder stays on the CPU like real work), release.
/// Returns the waits, a line each, in microseconds.
async fn worker(
    locks: dblock::Locks,
    sections: u64,
    hold_us: u64,
    shared: bool,
) -> Result<String, dblock::Error> {
    let hold = Duration::from_micros(hold_us);
    let mut out = String::new();
    for _ in 0..sections {
        let t = Instant::now();
        let guard = match shared {
            true => locks.request("contended").shared().lock().await?,
            false => locks.lock("contended").await?,
        };
        let waited = t.elapsed();
        let h = Instant::now();
        while h.elapsed() < hold {
            std::hint::spin_loop();
        }
        drop(guard);
        out.push_str(&format!("{}\n", waited.as_micros()));
        // Let the process's other tasks run (the runtime has one thread).
        tokio::task::yield_now().await;
    }
    Ok(out)
}
