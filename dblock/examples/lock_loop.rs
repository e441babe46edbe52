//! A plain lock loop on one handle: `--workers` tasks take and drop locks for
//! `--seconds`, and one JSON line reports the cycles a second and this process's CPU a
//! cycle (user and kernel, Linux), and the cycles of the whole run with its warm-up
//! (`all_cycles`: what a server's CPU over the run is divided by).
//!
//! ```text
//! cargo run --release -p dblock --example lock_loop -- URL [--workers 8] [--seconds 3] [--hot]
//! ```
//!
//! Each worker cycles through 64 names of its own (`loop:W:I`); with `--hot` every worker
//! takes `loop:hot`. The runtime has a thread per core, as the `dblock` program's.
//!
//! `dblock bench` measures dblock beside a floor with a harness that has changed with
//! dblock; this loop uses nothing but `Locks::connect` and `Locks::lock`, so that
//! `scripts/bench-against.py --loop` can build the very same program against an earlier
//! commit's library and compare the libraries alone, with one harness on both sides.
//! Figures, not assertions.

use std::time::{Duration, Instant};

/// This process's user and kernel CPU time so far, in ticks of 10 ms (`/proc/self/stat`'s
/// fields 14 and 15, counted after the command name's last `)`); `None` off Linux. The
/// same parse as `dblock bench`'s (`bench.rs`), written again: this loop must build
/// against earlier commits' libraries, which do not have it.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let mut next = || fields.next()?.parse::<u64>().ok();
    Some((next()?, next()?))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let url = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .cloned()
        .ok_or("usage: lock_loop URL [--workers N] [--seconds S] [--hot]")?;
    let workers: usize = opt("--workers").map_or(Ok(8), |v| v.parse())?;
    let seconds: f64 = opt("--seconds").map_or(Ok(3.0), |v| v.parse())?;
    let hot = args.iter().any(|a| a == "--hot");
    if workers == 0 || !(seconds > 0.0 && seconds <= 3600.0) {
        return Err("--workers must be at least 1, --seconds more than 0 and at most 3600".into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let locks = dblock::Locks::connect(&url).await?;
        let names: std::sync::Arc<Vec<Vec<String>>> = std::sync::Arc::new(
            (0..workers)
                .map(|w| {
                    (0..64)
                        .map(|i| match hot {
                            true => "loop:hot".to_string(),
                            false => format!("loop:{w}:{i}"),
                        })
                        .collect()
                })
                .collect(),
        );
        // Warm up (the handle's connections opened, the names keyed), then the timed run.
        let mut counts = Vec::new();
        for secs in [seconds.min(0.3), seconds] {
            let before = cpu_ticks();
            let start = Instant::now();
            let stop = start + Duration::from_secs_f64(secs);
            let tasks: Vec<_> = (0..workers)
                .map(|w| {
                    let (locks, names) = (locks.clone(), names.clone());
                    tokio::spawn(async move {
                        let mut n = 0u64;
                        while Instant::now() < stop {
                            drop(locks.lock(&names[w][(n % 64) as usize]).await?);
                            n += 1;
                        }
                        Ok::<u64, dblock::Error>(n)
                    })
                })
                .collect();
            let mut cycles = 0;
            for t in tasks {
                cycles += t.await??;
            }
            counts.push((cycles, start.elapsed(), before, cpu_ticks()));
        }
        let Some(&(cycles, elapsed, before, after)) = counts.last() else {
            return Err("no run".into());
        };
        let per_cycle = |ticks: u64| ticks as f64 * 10_000.0 / cycles.max(1) as f64;
        let (user, system) = match (before, after) {
            (Some(b), Some(a)) => (
                format!("{:.3}", per_cycle(a.0.saturating_sub(b.0))),
                format!("{:.3}", per_cycle(a.1.saturating_sub(b.1))),
            ),
            _ => ("null".to_string(), "null".to_string()),
        };
        let all_cycles: u64 = counts.iter().map(|c| c.0).sum();
        println!(
            "{{\"workload\": \"{}\", \"workers\": {workers}, \"ops_per_sec\": {:.1}, \"user_us\": {user}, \"system_us\": {system}, \"all_cycles\": {all_cycles}}}",
            if hot { "hot" } else { "uncontended" },
            cycles as f64 / elapsed.as_secs_f64(),
        );
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}
