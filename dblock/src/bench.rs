//! The standard workloads of `dblock bench`, each measured beside its floor: the
//! cheapest correct way to do the same work issued directly, on the same server (or
//! lock file), in the same run. Every floor connection (or descriptor) is opened
//! before anything is timed, and dblock's pool is filled by a warm-up first.
//!
//! | workload      | what a worker does                                   | floor |
//! |---------------|------------------------------------------------------|-------|
//! | `uncontended` | take and release a lock of its own (1 and 8 workers) | PostgreSQL: per cycle one message, one round trip: `BEGIN; SELECT pg_advisory_xact_lock(k)`, the lock held when the reply comes, released by `ROLLBACK AND CHAIN` at the head of the next message (`postgres/store/floor.rs`); MySQL/MariaDB: per cycle one message, `DO RELEASE_LOCK('old'); SELECT GET_LOCK('new', S)` (`mysql/floor.rs`); SQLite: `F_OFD_SETLK` lock + unlock |
//! | `hot`         | take and release one lock shared by 8 workers        | PostgreSQL and MySQL/MariaDB: the same loop on one key, so every hand-off is one message (the holder's release and its next request); SQLite: turns through an async FIFO mutex, each holder locking and unlocking the byte (`sqlite/floor.rs`) |
//!
//! Each workload and its floor run in alternating slices of half a second, so that a
//! machine whose speed drifts (a shared host, a CPU changing frequency) slows both
//! alike, and the ratio stays meaningful where absolute figures are not.
//!
//! A dblock cycle is `lock().await` then dropping the guard, the way a program uses it;
//! latency is the time `lock()` takes (for the floors, the lock statement's), read on
//! one cycle in eight on both sides (`raw::BenchRun::TIME_EVERY`; never a worker's first).
//!
//! A floor holds the lock across a round trip, as dblock does: an autocommit
//! `pg_advisory_xact_lock` is released inside the server by the statement itself, so
//! it is different (less) work, and no floor for hand-offs. On PostgreSQL the floor and
//! dblock reach the server the same way (TLS or not, checked on both); the report says
//! which. Numbers come from this machine and this server: compare ratios, not absolute
//! figures.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::Error;
use crate::key::Key;
use crate::locks::Locks;
use crate::raw::{BenchCycles, BenchFloor, BenchRun, BoxFuture, CycleClock};

/// One measured line of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// `"postgres"`, `"mysql"` or `"sqlite"`.
    pub backend: &'static str,
    /// `"uncontended"` or `"hot"`.
    pub workload: &'static str,
    /// Concurrent workers.
    pub workers: usize,
    /// Lock + release cycles per second, all workers together.
    pub ops_per_sec: f64,
    /// Median acquisition latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile acquisition latency, microseconds.
    pub p99_us: f64,
    /// The floor's cycles per second, measured in the same run.
    pub floor_ops_per_sec: f64,
    /// The floor's median latency, microseconds.
    pub floor_p50_us: f64,
    /// How both reach the server, checked on each (`"TLS"`, `"no TLS"`), where that
    /// applies.
    pub transport: Option<String>,
    /// Threads the process had while the row was measured (the most seen before and
    /// after it), where the platform tells (Linux); `None` elsewhere. With one thread
    /// (a current-thread runtime, `dblock bench --one-thread`) Linux takes no reference
    /// to an open file per system call, so the embedded floor is then exactly a C loop
    /// of `F_OFD_SETLK`; with more, every `fcntl` pays an atomic count on both sides.
    pub process_threads: Option<u64>,
    /// This process's CPU time a dblock cycle, microseconds, in user space and in the
    /// kernel (`/proc/self/stat`, Linux; `None` elsewhere). The whole process's, all
    /// workers together, divided by the cycles: what a cycle costs the client, not the
    /// server (a PostgreSQL or MySQL server is another process).
    pub cpu_us: Option<CpuPerCycle>,
    /// The same for the floor.
    pub floor_cpu_us: Option<CpuPerCycle>,
}

/// CPU time a cycle, microseconds: in user space and in the kernel (system calls).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuPerCycle {
    /// In user space (dblock, the runtime, the driver).
    pub user: f64,
    /// In the kernel, on the process's behalf.
    pub system: f64,
}

#[cfg(feature = "serde")]
impl serde::Serialize for CpuPerCycle {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut m = s.serialize_struct("CpuPerCycle", 2)?;
        m.serialize_field("user", &self.user)?;
        m.serialize_field("system", &self.system)?;
        m.end()
    }
}

impl Measurement {
    /// dblock's rate as a fraction of the floor's.
    pub fn ratio(&self) -> f64 {
        if self.floor_ops_per_sec > 0.0 {
            self.ops_per_sec / self.floor_ops_per_sec
        } else {
            0.0
        }
    }
}

/// One object of `dblock bench --json`'s array (`docs/performance.md`): the fields, and
/// `ratio` after `floor_p50_us`.
#[cfg(feature = "serde")]
impl serde::Serialize for Measurement {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        let mut m = s.serialize_struct("Measurement", 13)?;
        m.serialize_field("backend", self.backend)?;
        m.serialize_field("workload", self.workload)?;
        m.serialize_field("workers", &self.workers)?;
        m.serialize_field("ops_per_sec", &self.ops_per_sec)?;
        m.serialize_field("p50_us", &self.p50_us)?;
        m.serialize_field("p99_us", &self.p99_us)?;
        m.serialize_field("floor_ops_per_sec", &self.floor_ops_per_sec)?;
        m.serialize_field("floor_p50_us", &self.floor_p50_us)?;
        m.serialize_field("ratio", &self.ratio())?;
        m.serialize_field("transport", &self.transport)?;
        m.serialize_field("process_threads", &self.process_threads)?;
        m.serialize_field("cpu_us", &self.cpu_us)?;
        m.serialize_field("floor_cpu_us", &self.floor_cpu_us)?;
        m.end()
    }
}

/// Cycles and the timed ones' latencies from one timed run, and the process's CPU
/// time meanwhile (`None` where the platform does not tell).
struct Sample {
    ops: u64,
    elapsed: Duration,
    latencies_us: Vec<f64>,
    cpu: Option<Cpu>,
}

/// CPU time of this process: user, system.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cpu {
    user: Duration,
    system: Duration,
}

impl Sample {
    fn empty() -> Sample {
        Sample {
            ops: 0,
            elapsed: Duration::ZERO,
            latencies_us: Vec::new(),
            cpu: Some(Cpu {
                user: Duration::ZERO,
                system: Duration::ZERO,
            }),
        }
    }

    fn add(&mut self, other: Sample) {
        self.ops += other.ops;
        self.elapsed += other.elapsed;
        self.latencies_us.extend(other.latencies_us);
        // Unknown once any slice's is.
        self.cpu = match (self.cpu, other.cpu) {
            (Some(a), Some(b)) => Some(Cpu {
                user: a.user + b.user,
                system: a.system + b.system,
            }),
            _ => None,
        };
    }

    /// CPU time a cycle, microseconds.
    fn cpu_per_cycle(&self) -> Option<CpuPerCycle> {
        let (cpu, ops) = (self.cpu?, self.ops.max(1) as f64);
        Some(CpuPerCycle {
            user: cpu.user.as_secs_f64() * 1e6 / ops,
            system: cpu.system.as_secs_f64() * 1e6 / ops,
        })
    }

    fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn percentile(&mut self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        self.latencies_us.sort_by(f64::total_cmp);
        let i = ((self.latencies_us.len() - 1) as f64 * p).round() as usize;
        self.latencies_us[i.min(self.latencies_us.len() - 1)]
    }
}

/// Runs `workers` workers for `secs`, worker `w` the loop `work(w, run)` returns (see
/// [`BenchRun::drive`]).
///
/// Both sides of a ratio pay the same harness: one cycle in [`BenchRun::TIME_EVERY`]
/// timed (a clock read on each side of the lock, a latency kept) and the stop checked, per
/// worker one task and its own clones of what it uses (the handle and its names; the
/// floor and its keys), and nothing written a cycle that another worker shares. (Until
/// the ninth session dblock's side cloned two `Arc`s all workers shared every cycle, and
/// the floor's one and boxed its cycle's future; until the eleventh, every cycle was
/// timed, three clock reads a cycle on both sides, a tenth of an embedded floor's cycle.)
async fn timed<M, Fut>(workers: usize, secs: f64, work: M) -> Result<Sample, Error>
where
    M: Fn(usize, BenchRun) -> Fut,
    Fut: std::future::Future<Output = Result<BenchCycles, Error>> + Send + 'static,
{
    timed_then(workers, secs, work, None).await
}

/// How many cycles a worker runs before it lets the runtime run another task. A cycle
/// that never waits (an embedded lock granted at once, and its floor's) never gives its
/// thread back on its own: without this, each of the runtime's two threads ran the first
/// worker it picked up for the whole slice, and "8 workers" were 2 (counted per worker
/// in a 0.5 s slice, 2026-12-05: 320k and 322k cycles, the other six none). A yield makes
/// the runtime poll its driver, a few microseconds: every 1,024 cycles that is under
/// 0.5 % of a slice, on both sides of a ratio alike, and every worker runs (51k–99k
/// cycles each in the same slice).
const YIELD_EVERY: u64 = 1024;

/// [`timed`], then `settle(worker)` as each worker stops (untimed, but inside the
/// slice: a lock a floor still holds is released before the next slice starts, and a
/// `hot` worker's last lock before the others can stop waiting for it).
async fn timed_then<M, Fut>(
    workers: usize,
    secs: f64,
    work: M,
    settle: Option<Arc<dyn BenchFloor>>,
) -> Result<Sample, Error>
where
    M: Fn(usize, BenchRun) -> Fut,
    Fut: std::future::Future<Output = Result<BenchCycles, Error>> + Send + 'static,
{
    run_workers(workers, secs, YIELD_EVERY, work, settle).await
}

/// [`timed_then`], each worker yielding every `yield_every` cycles.
async fn run_workers<M, Fut>(
    workers: usize,
    secs: f64,
    yield_every: u64,
    work: M,
    settle: Option<Arc<dyn BenchFloor>>,
) -> Result<Sample, Error>
where
    M: Fn(usize, BenchRun) -> Fut,
    Fut: std::future::Future<Output = Result<BenchCycles, Error>> + Send + 'static,
{
    let run = BenchRun {
        stop: Instant::now() + Duration::from_secs_f64(secs),
        yield_every,
    };
    let start = Instant::now();
    let cpu_before = process_cpu();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let worker = work(w, run);
        let settle = settle.clone();
        tasks.push(tokio::spawn(async move {
            let lat = worker.await?;
            if let Some(floor) = settle {
                floor.settle(w).await?;
            }
            Ok::<_, Error>(lat)
        }));
    }
    let (mut ops, mut latencies_us) = (0, Vec::new());
    for t in tasks {
        let done = t.await.map_err(|e| Error::Io {
            context: "a benchmark worker failed".into(),
            source: std::io::Error::other(e),
        })??;
        ops += done.cycles;
        latencies_us.extend(done.latencies_us);
    }
    let elapsed = start.elapsed();
    let cpu = match (cpu_before, process_cpu()) {
        (Some(a), Some(b)) => Some(Cpu {
            user: b.user.saturating_sub(a.user),
            system: b.system.saturating_sub(a.system),
        }),
        _ => None,
    };
    Ok(Sample {
        ops,
        elapsed,
        latencies_us,
        cpu,
    })
}

/// The length of one slice of a workload or its floor, in seconds.
const SLICE: f64 = 0.5;

/// The workloads, in the order they run: (workload, workers).
pub const WORKLOADS: [(&str, usize); 3] = [("uncontended", 1), ("uncontended", 8), ("hot", 8)];

/// Runs every workload against `locks` for `secs` seconds each (and its floor as long),
/// calling `progress` before each step.
///
/// # Errors
///
/// The first error of a lock request or a floor query.
///
/// # Cancel safety
///
/// Cancelling it stops the run; locks its workers held are released as their guards
/// drop.
pub async fn run(
    locks: &Locks,
    secs: f64,
    mut progress: impl FnMut(&str),
) -> Result<Vec<Measurement>, Error> {
    let backend = locks.backend_name();
    // One set of floor connections for the whole run, every one opened before anything
    // is timed (dblock's pool is filled by the warm-up below, before timing too).
    let floor = Floor::open(locks, WORKLOADS.iter().map(|w| w.1).max().unwrap_or(1)).await?;
    let transport = floor.raw.transport();
    let mut out = Vec::new();
    for (workload, workers) in WORKLOADS {
        let hot = workload == "hot";
        // Names (and keys) are computed once, outside the timed loops.
        let names: std::sync::Arc<Vec<Vec<String>>> = std::sync::Arc::new(
            (0..workers)
                .map(|w| {
                    (0..64)
                        .map(|i| match hot {
                            true => "bench:hot".to_string(),
                            false => format!("bench:{w}:{i}"),
                        })
                        .collect()
                })
                .collect(),
        );
        let threads_before = process_threads();
        // Warm up: open the connections both sides need.
        progress(&format!("{backend} {workload} x{workers}: warming up"));
        let floor_workers = floor.workers(locks, workers, hot);
        let dblock_workers = |w: usize, run: BenchRun| {
            let (locks, names) = (locks.clone(), names.clone());
            async move {
                run.drive(|i, timed| {
                    dblock_cycle(&locks, BenchRun::nth::<String>(&names[w], i), timed)
                })
                .await
            }
        };
        let _ = timed_then(
            workers,
            secs.min(0.3) / 2.0,
            &floor_workers,
            Some(floor.raw.clone()),
        )
        .await?;
        let _ = timed(workers, secs.min(0.3) / 2.0, dblock_workers).await?;

        let slices = ((secs / SLICE).round() as usize).max(1);
        let slice = secs / slices as f64;
        let (mut f, mut d) = (Sample::empty(), Sample::empty());
        for k in 0..slices {
            progress(&format!(
                "{backend} {workload} x{workers}: slice {}/{slices}",
                k + 1
            ));
            f.add(timed_then(workers, slice, &floor_workers, Some(floor.raw.clone())).await?);
            d.add(timed(workers, slice, dblock_workers).await?);
        }
        out.push(Measurement {
            backend,
            workload,
            workers,
            ops_per_sec: d.rate(),
            p50_us: d.percentile(0.5),
            p99_us: d.percentile(0.99),
            floor_ops_per_sec: f.rate(),
            floor_p50_us: f.percentile(0.5),
            transport: transport.clone(),
            process_threads: threads_before.max(process_threads()),
            cpu_us: d.cpu_per_cycle(),
            floor_cpu_us: f.cpu_per_cycle(),
        });
    }
    Ok(out)
}

/// The threads of this process now, from `/proc/self/status` (Linux); `None` where
/// the platform does not say or the file cannot be read.
fn process_threads() -> Option<u64> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    threads_of_status(&status)
}

/// This process's CPU time so far, from `/proc/self/stat` (Linux); `None` where the
/// platform does not say or the file cannot be read.
fn process_cpu() -> Option<Cpu> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    cpu_of_stat(&stat)
}

/// The `utime` and `stime` fields (14 and 15) of a `/proc/PID/stat` text, in the
/// kernel's user-visible clock ticks (`USER_HZ`, 100 a second on Linux whatever the
/// kernel's own tick). The command name (field 2) is in parentheses and may hold
/// spaces and parentheses itself: fields are counted after its last `)`.
fn cpu_of_stat(stat: &str) -> Option<Cpu> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let mut ticks = || fields.next()?.parse::<u64>().ok();
    let (user, system) = (ticks()?, ticks()?);
    Some(Cpu {
        user: Duration::from_millis(user.saturating_mul(10)),
        system: Duration::from_millis(system.saturating_mul(10)),
    })
}

/// The `Threads:` field of a `/proc/PID/status` text.
fn threads_of_status(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// One dblock cycle: lock, then drop the guard (which sends the release); the lock's
/// latency when `timed`.
async fn dblock_cycle(locks: &Locks, name: &str, timed: bool) -> Result<Duration, Error> {
    let t = CycleClock::start(timed);
    let g = locks.lock(name).await?;
    let d = t.elapsed();
    drop(g);
    Ok(d)
}

/// What the floor is measured with: the backend's own (see [`BenchFloor`]), one set of
/// connections (or descriptors) for the whole run.
struct Floor {
    raw: Arc<dyn BenchFloor>,
}

impl Floor {
    /// Fails here, before any workload, when the backend has no floor; opens what
    /// `workers` workers use.
    async fn open(locks: &Locks, workers: usize) -> Result<Floor, Error> {
        let raw = floor_of(locks)?;
        raw.clone().open(workers).await?;
        Ok(Floor { raw })
    }

    /// The floor's workers: each its own raw connection (or descriptor) of the floor.
    fn workers(
        &self,
        locks: &Locks,
        workers: usize,
        hot: bool,
    ) -> impl Fn(usize, BenchRun) -> BoxFuture<'static, Result<BenchCycles, Error>> {
        let ns = locks.namespace();
        let raw = self.raw.clone();
        // Keys are derived once, outside the timed loops (dblock's names likewise).
        let keys: Arc<Vec<Vec<Key>>> = Arc::new(
            (0..workers)
                .map(|w| {
                    (0..64)
                        .map(|i| match hot {
                            true => Key::derive(ns, "bench:hot"),
                            false => Key::derive(ns, &format!("bench:{w}:{i}")),
                        })
                        .collect()
                })
                .collect(),
        );
        move |w, run| {
            let (raw, keys) = (raw.clone(), keys.clone());
            Box::pin(async move { raw.run(w, &keys[w], hot, run).await })
        }
    }
}

/// The backend's raw connections (or descriptors), not yet opened.
fn floor_of(locks: &Locks) -> Result<Arc<dyn BenchFloor>, Error> {
    locks.inner.backend.bench_floor()
}

#[cfg(all(test, feature = "serde"))]
mod tests {
    use super::*;

    /// `dblock bench --json`'s objects have the fields `docs/performance.md` lists, in
    /// its order, `ratio` computed, a missing `transport` `null`.
    #[test]
    fn a_measurement_serializes_to_the_documented_fields() {
        let m = Measurement {
            backend: "postgres",
            workload: "hot",
            workers: 8,
            ops_per_sec: 300.0,
            p50_us: 1.5,
            p99_us: 9.0,
            floor_ops_per_sec: 400.0,
            floor_p50_us: 1.0,
            transport: None,
            process_threads: Some(1),
            cpu_us: Some(CpuPerCycle {
                user: 0.25,
                system: 0.5,
            }),
            floor_cpu_us: None,
        };
        let text = serde_json::to_string(&[m]).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let o = v[0].as_object().unwrap();
        let fields: Vec<&str> = o.keys().map(String::as_str).collect();
        let mut documented = vec![
            "backend",
            "workload",
            "workers",
            "ops_per_sec",
            "p50_us",
            "p99_us",
            "floor_ops_per_sec",
            "floor_p50_us",
            "ratio",
            "transport",
            "process_threads",
            "cpu_us",
            "floor_cpu_us",
        ];
        // serde_json's map is sorted by key unless told to keep order: compare as sets,
        // and the text for the order.
        let mut sorted = fields.clone();
        sorted.sort_unstable();
        documented.sort_unstable();
        assert_eq!(sorted, documented);
        assert!(
            text.find("\"floor_p50_us\"") < text.find("\"ratio\""),
            "{text}"
        );
        assert_eq!(v[0]["ratio"], 0.75);
        assert_eq!(v[0]["workers"], 8);
        assert!(v[0]["transport"].is_null());
        assert_eq!(v[0]["process_threads"], 1);
        assert_eq!(v[0]["cpu_us"]["user"], 0.25);
        assert_eq!(v[0]["cpu_us"]["system"], 0.5);
        assert!(v[0]["floor_cpu_us"].is_null());
        let page = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/performance.md"
        ))
        .unwrap();
        for f in &documented {
            assert!(
                page.contains(&format!("`{f}`")),
                "docs/performance.md names `{f}`"
            );
        }
    }
}

#[cfg(test)]
mod threads {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The count comes from the `Threads:` line, whatever its neighbours; a text
    /// without one, or with a value that is not a count, gives none.
    #[test]
    fn the_thread_count_is_read_from_the_status_text() {
        let status = "Name:\tdblock\nState:\tR (running)\nThreads:\t3\nSigQ:\t0/1\n";
        assert_eq!(threads_of_status(status), Some(3));
        assert_eq!(threads_of_status("Name:\tdblock\n"), None);
        assert_eq!(threads_of_status("Threads:\tmany\n"), None);
    }

    /// User and system time are fields 14 and 15, counted after the command name's last
    /// `)` however many spaces and parentheses it holds; a short or garbled text gives
    /// none.
    #[test]
    fn the_cpu_time_is_read_from_the_stat_text() {
        let tail = "S 1 2 3 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0 99 1000 200";
        let ms = Duration::from_millis;
        for comm in ["dblock", "a b) c (d", ")"] {
            let stat = format!("4242 ({comm}) {tail}");
            assert_eq!(
                cpu_of_stat(&stat),
                Some(Cpu {
                    user: ms(2500),
                    system: ms(750)
                }),
                "{stat}"
            );
        }
        assert_eq!(cpu_of_stat("4242 (dblock) S 1 2 3"), None);
        assert_eq!(cpu_of_stat("4242 dblock S"), None);
        assert_eq!(
            cpu_of_stat("4242 (dblock) S 1 2 3 0 -1 4194560 100 0 0 0 x 75"),
            None
        );
        // A process older than a 32-bit count of ticks (497 days of CPU) still reads.
        let long = "4242 (dblock) S 1 2 3 0 -1 4194560 100 0 0 0 5000000000 1 0";
        assert_eq!(
            cpu_of_stat(long).map(|c| c.user),
            Some(Duration::from_secs(50_000_000))
        );
        // This process's own, on Linux: read, and moving forward with work done.
        if cfg!(target_os = "linux") {
            let before = process_cpu().unwrap();
            let start = std::time::Instant::now();
            let mut x = 0u64;
            while start.elapsed() < Duration::from_millis(100) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            let after = process_cpu().unwrap();
            assert!(after.user + after.system > before.user + before.system);
        }
    }
}

#[cfg(test)]
mod workers {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Runs 8 workers for two seconds on a runtime of two threads, each cycle blocking its
    /// thread for 20 µs without ever waiting (as an embedded lock granted at once does),
    /// yielding every `yield_every` cycles; how many workers made a cycle.
    fn workers_that_ran(yield_every: u64) -> usize {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let counts: Arc<Vec<AtomicU64>> = Arc::new((0..8).map(|_| AtomicU64::new(0)).collect());
        let c = counts.clone();
        rt.block_on(run_workers(
            8,
            2.0,
            yield_every,
            |w, run: BenchRun| {
                let c = c.clone();
                async move {
                    run.drive(|_, _| {
                        std::thread::sleep(Duration::from_micros(20));
                        c[w].fetch_add(1, Ordering::Relaxed);
                        std::future::ready(Ok(Duration::from_micros(20)))
                    })
                    .await
                }
            },
            None,
        ))
        .unwrap();
        counts
            .iter()
            .filter(|n| n.load(Ordering::Relaxed) > 0)
            .count()
    }

    /// "8 workers" are 8 even when no cycle waits: the harness's yield lets the runtime
    /// run every worker. The control, never yielding, runs only as many as it has
    /// threads.
    #[test]
    fn every_worker_runs_though_no_cycle_waits() {
        assert_eq!(workers_that_ran(YIELD_EVERY), 8);
        assert!(workers_that_ran(u64::MAX) <= 2);
    }
}
