//! The standard workloads of `dblock bench`, each measured beside its floor: the
//! cheapest correct way to do the same work issued directly, on the same server (or
//! lock file), in the same run.
//!
//! | workload      | what a worker does                                   | floor |
//! |---------------|------------------------------------------------------|-------|
//! | `uncontended` | take and release a lock of its own (1 and 8 workers) | PostgreSQL: `SELECT pg_advisory_xact_lock(k)` in autocommit, one round trip per cycle; SQLite: `F_OFD_SETLK` lock + unlock |
//! | `hot`         | take and release one lock shared by 8 workers        | PostgreSQL: `BEGIN`; `SELECT pg_advisory_xact_lock(k)`; `COMMIT` on one key, 8 clients, each statement awaited (what `pgbench -f` runs); SQLite: lock + unlock of one byte from 8 descriptors |
//!
//! Each workload and its floor run in alternating slices of half a second, so that a
//! machine whose speed drifts (a shared host, a CPU changing frequency) slows both
//! alike, and the ratio stays meaningful where absolute figures are not.
//!
//! A dblock cycle is `lock().await` then dropping the guard, the way a program uses it;
//! latency is the time `lock()` takes (for the floors, the lock statement's).
//!
//! The `hot` floor holds the lock from one statement to the next, as dblock does: an
//! autocommit `pg_advisory_xact_lock` is released inside the server by the statement
//! itself and never hands the lock over through a client, so it is no floor for
//! handoffs. Numbers come from this machine and this server:
//! compare ratios, not absolute figures.

use std::time::Duration;

use tokio::time::Instant;

use crate::{Error, Locks};

/// One measured line of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// `"postgres"` or `"sqlite"`.
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

    /// The measurement as a JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"backend\":\"{}\",\"workload\":\"{}\",\"workers\":{},\"ops_per_sec\":{:.1},\
             \"p50_us\":{:.1},\"p99_us\":{:.1},\"floor_ops_per_sec\":{:.1},\"floor_p50_us\":{:.1},\
             \"ratio\":{:.3}}}",
            self.backend,
            self.workload,
            self.workers,
            self.ops_per_sec,
            self.p50_us,
            self.p99_us,
            self.floor_ops_per_sec,
            self.floor_p50_us,
            self.ratio()
        )
    }
}

/// Cycles and their latencies from one timed run.
struct Sample {
    ops: u64,
    elapsed: Duration,
    latencies_us: Vec<f64>,
}

impl Sample {
    fn empty() -> Sample {
        Sample {
            ops: 0,
            elapsed: Duration::ZERO,
            latencies_us: Vec::new(),
        }
    }

    fn add(&mut self, other: Sample) {
        self.ops += other.ops;
        self.elapsed += other.elapsed;
        self.latencies_us.extend(other.latencies_us);
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

/// Runs `workers` copies of `cycle` for `secs`; each call of `cycle(worker, i)` is one
/// cycle and returns its acquisition latency.
async fn timed<F, Fut>(workers: usize, secs: f64, cycle: F) -> Result<Sample, Error>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<Duration, Error>> + Send,
{
    let stop = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let cycle = cycle.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(1 << 16);
            let mut i = 0u64;
            while Instant::now() < stop {
                let d = cycle(w, i).await?;
                lat.push(d.as_secs_f64() * 1e6);
                i += 1;
            }
            Ok::<_, Error>(lat)
        }));
    }
    let mut latencies_us = Vec::new();
    for t in tasks {
        let lat = t
            .await
            .map_err(|e| Error::Unsupported(format!("a benchmark worker failed: {e}")))??;
        latencies_us.extend(lat);
    }
    Ok(Sample {
        ops: latencies_us.len() as u64,
        elapsed: start.elapsed(),
        latencies_us,
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
    let floor = Floor::open(locks).await?;
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
        // Warm up: open the connections both sides need.
        progress(&format!("{backend} {workload} x{workers}: warming up"));
        let _ = timed(workers, secs.min(0.3) / 2.0, floor.cycle(locks, hot)?).await?;
        let l = locks.clone();
        let n = names.clone();
        let _ = timed(workers, secs.min(0.3) / 2.0, move |w, i| {
            let (l, n) = (l.clone(), n.clone());
            async move { dblock_cycle(&l, &n[w][(i % 64) as usize]).await }
        })
        .await?;

        let slices = ((secs / SLICE).round() as usize).max(1);
        let slice = secs / slices as f64;
        let (mut f, mut d) = (Sample::empty(), Sample::empty());
        for k in 0..slices {
            progress(&format!(
                "{backend} {workload} x{workers}: slice {}/{slices}",
                k + 1
            ));
            f.add(timed(workers, slice, floor.cycle(locks, hot)?).await?);
            let l = locks.clone();
            let n = names.clone();
            d.add(
                timed(workers, slice, move |w, i| {
                    let (l, n) = (l.clone(), n.clone());
                    async move { dblock_cycle(&l, &n[w][(i % 64) as usize]).await }
                })
                .await?,
            );
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
        });
    }
    Ok(out)
}

/// One dblock cycle: lock, then drop the guard (which sends the release).
async fn dblock_cycle(locks: &Locks, name: &str) -> Result<Duration, Error> {
    let t = Instant::now();
    let g = locks.lock(name).await?;
    let d = t.elapsed();
    drop(g);
    Ok(d)
}

/// What the floor is measured with.
enum Floor {
    #[cfg(feature = "postgres")]
    Postgres(Box<(tokio_postgres::Config, crate::postgres::tls::Connector)>),
    #[cfg(feature = "sqlite")]
    Sqlite(std::path::PathBuf),
}

type BoxCycle =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Duration, Error>> + Send>>;

impl Floor {
    async fn open(locks: &Locks) -> Result<Floor, Error> {
        match &locks.inner.backend {
            #[cfg(feature = "postgres")]
            crate::locks::Backend::Postgres(b) => match b.native_config() {
                Some(c) => Ok(Floor::Postgres(Box::new(c))),
                None => Err(Error::Unsupported(
                    "the benchmark needs a postgres:// URL, not an sqlx pool".into(),
                )),
            },
            #[cfg(feature = "sqlite")]
            crate::locks::Backend::Sqlite(b) => Ok(Floor::Sqlite(b.lock_path())),
        }
    }

    /// A cycle of the floor: per worker, its own raw connection (or descriptor).
    fn cycle(
        &self,
        locks: &Locks,
        hot: bool,
    ) -> Result<impl Fn(usize, u64) -> BoxCycle + Clone + Send + 'static, Error> {
        let ns = locks.namespace().to_string();
        let raw: std::sync::Arc<RawSet> = std::sync::Arc::new(match self {
            #[cfg(feature = "postgres")]
            Floor::Postgres(c) => RawSet::Postgres(c.clone(), tokio::sync::Mutex::new(Vec::new())),
            #[cfg(feature = "sqlite")]
            Floor::Sqlite(p) => RawSet::Sqlite(p.clone(), std::sync::Mutex::new(Vec::new())),
        });
        Ok(move |w: usize, i: u64| {
            let raw = raw.clone();
            let key = match hot {
                true => crate::Key::derive(&ns, "bench:hot"),
                false => crate::Key::derive(&ns, &format!("bench:{w}:{}", i % 64)),
            };
            Box::pin(async move { raw.cycle(w, key, hot).await }) as BoxCycle
        })
    }
}

/// Raw connections or descriptors, one per worker, opened on first use.
enum RawSet {
    #[cfg(feature = "postgres")]
    Postgres(
        Box<(tokio_postgres::Config, crate::postgres::tls::Connector)>,
        tokio::sync::Mutex<Vec<Option<std::sync::Arc<tokio_postgres::Client>>>>,
    ),
    #[cfg(feature = "sqlite")]
    Sqlite(
        std::path::PathBuf,
        std::sync::Mutex<Vec<Option<std::sync::Arc<std::fs::File>>>>,
    ),
}

impl RawSet {
    async fn cycle(&self, w: usize, key: crate::Key, hot: bool) -> Result<Duration, Error> {
        match self {
            #[cfg(feature = "postgres")]
            RawSet::Postgres(config, clients) => {
                let client = {
                    let mut cs = clients.lock().await;
                    if cs.len() <= w {
                        cs.resize(w + 1, None);
                    }
                    match &cs[w] {
                        Some(c) => c.clone(),
                        None => {
                            let (c, conn) =
                                // Over the same TLS as dblock's connections: the floor
                                // pays what they pay.
                                config.1.connect(&config.0).await.map_err(|e| {
                                    Error::Connect {
                                        target: "the benchmark's floor".into(),
                                        message: crate::postgres::tls::describe(&e),
                                    }
                                })?;
                            tokio::spawn(conn);
                            let c = std::sync::Arc::new(c);
                            cs[w] = Some(c.clone());
                            c
                        }
                    }
                };
                let lost = |e: tokio_postgres::Error| Error::ConnectionLost {
                    message: e.to_string(),
                };
                let sql = format!("SELECT pg_advisory_xact_lock({})", key.as_i64());
                if !hot {
                    let t = Instant::now();
                    client.simple_query(&sql).await.map_err(lost)?;
                    return Ok(t.elapsed());
                }
                client.simple_query("BEGIN").await.map_err(lost)?;
                let t = Instant::now();
                client.simple_query(&sql).await.map_err(lost)?;
                let d = t.elapsed();
                client.simple_query("COMMIT").await.map_err(lost)?;
                Ok(d)
            }
            #[cfg(feature = "sqlite")]
            RawSet::Sqlite(path, files) => {
                let file = {
                    let mut fs = files.lock().unwrap_or_else(|p| p.into_inner());
                    if fs.len() <= w {
                        fs.resize(w + 1, None);
                    }
                    match &fs[w] {
                        Some(f) => f.clone(),
                        None => {
                            let f = std::fs::OpenOptions::new()
                                .read(true)
                                .write(true)
                                .open(path)
                                .map_err(|e| Error::io("the benchmark's floor", e))?;
                            let f = std::sync::Arc::new(f);
                            fs[w] = Some(f.clone());
                            f
                        }
                    }
                };
                let t = Instant::now();
                loop {
                    match crate::sqlite::raw_try_lock(&file, key.file_offset()) {
                        Ok(true) => break,
                        Ok(false) => tokio::task::yield_now().await,
                        Err(e) => return Err(Error::io("the benchmark's floor", e)),
                    }
                }
                let d = t.elapsed();
                crate::sqlite::raw_unlock(&file, key.file_offset())
                    .map_err(|e| Error::io("the benchmark's floor", e))?;
                Ok(d)
            }
        }
    }
}
