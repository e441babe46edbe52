//! PostgreSQL, one hot name, 8 workers: dblock beside pgbench's hand-off script, sqlx's
//! `PgAdvisoryLock` and the hand-off floor, side by side in one run.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo bench -p dblock --bench pg_hot
//! ```
//!
//! Every contender takes and releases one lock, 8 clients at once, on a multi-thread
//! runtime (one thread per core) like `dblock bench`'s; each hand-off passes through a
//! client (the lock is held across a round trip):
//!
//! - floor: raw tokio-postgres, `BEGIN; SELECT pg_advisory_xact_lock(k)` then, in the
//!   holder's next message, `ROLLBACK AND CHAIN; SELECT pg_advisory_xact_lock(k)`
//!   (one message per hand-off, as `dblock bench`'s `hot` floor);
//! - dblock: `lock(name)` and drop the guard, transaction scope (the default) and
//!   session scope, on one handle (its tasks hand the lock to one another inside the
//!   process while the server's grant is fresh: `postgres/lock/relay.rs`); and on a
//!   handle per worker, as separate processes would (every hand-off through the server),
//!   in each scope;
//! - sqlx: `PgAdvisoryLock::acquire` (`pg_advisory_lock`) on a connection of the task's
//!   own, then `release_now` (`pg_advisory_unlock`, awaited);
//! - pgbench: `-c 8 -j 2 -f` a script of `BEGIN; SELECT pg_advisory_xact_lock(k);
//!   COMMIT;` (each statement awaited), with `-M simple` and `-M prepared`, its `tps`
//!   (which leaves out connecting).
//!
//! The contenders run in alternating slices of `SLICE_SECS` (1 s unless set) for
//! `ROUNDS` rounds (5 unless set), after one warm-up slice each, so a drifting machine
//! slows every contender alike; the report gives rates and dblock's ratios.
//!
//! Each contender runs on a runtime of its own (a thread per core, as `dblock bench`'s),
//! and each round starts one contender further on, so that none inherits another's
//! threads or always follows the same neighbour. On a 2-core machine a hand-off loop
//! run on worker threads that had just been busy with something else (the one-handle
//! rows, 1.8M in-process hand-offs a second) ran at about 12,000 a second for the next
//! 0.2–1.2 s instead of about 19,000, raw clients and dblock alike, and less often so on
//! threads of their own (`docs/performance.md`, thirteenth session): with one runtime
//! for all and a fixed order, the row after the one-handle rows was measured in that
//! state every round.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dblock::{Locks, Scope};
use futures_util::StreamExt;

const WORKERS: usize = 8;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `cycle(worker)` on `WORKERS` tasks for `secs`; returns cycles per second.
async fn run<F, Fut>(secs: f64, cycle: F) -> f64
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    run_then(secs, cycle, |_| async {}).await
}

/// [`run`], then `end(worker)` as each task stops (the floor's holder releases there,
/// or the others would wait for it forever).
async fn run_then<F, Fut, E, EFut>(secs: f64, cycle: F, end: E) -> f64
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
    E: Fn(usize) -> EFut + Clone + Send + Sync + 'static,
    EFut: std::future::Future<Output = ()> + Send,
{
    let ops = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let stop = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (cycle, end, ops) = (cycle.clone(), end.clone(), ops.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < stop {
                cycle(w).await;
                n += 1;
            }
            end(w).await;
            ops.fetch_add(n, Ordering::Relaxed);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    ops.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Drains a simple query's reply without keeping it.
async fn drain(client: &tokio_postgres::Client, sql: &str) {
    let stream = client.simple_query_raw(sql).await.unwrap();
    let mut stream = std::pin::pin!(stream);
    while let Some(m) = stream.next().await {
        m.unwrap();
    }
}

fn pgbench() -> Option<std::path::PathBuf> {
    if let Ok(p) = std::env::var("PGBENCH") {
        return Some(p.into());
    }
    let mut found: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(Result::ok)
        .map(|d| d.path().join("bin/pgbench"))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop()
}

/// A multi-thread runtime of a thread per core: one for each contender.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// pgbench's tps over `secs` (whole seconds, at least 1) with `script`.
async fn run_pgbench(
    bin: &std::path::Path,
    url: &str,
    script: &std::path::Path,
    mode: &str,
    secs: u64,
) -> f64 {
    let out = tokio::process::Command::new(bin)
        .args(["-n", "-c", "8", "-j", "2", "-M", mode, "-T"])
        .arg(secs.to_string())
        .arg("-f")
        .arg(script)
        .arg(url)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "pgbench gave no tps: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

/// The URL with `sslmode=disable` unless it names a mode: every contender then
/// connects alike (this bench's raw connections and sqlx here have no TLS; dblock and
/// pgbench would otherwise use it where the server offers it). `dblock bench` compares
/// dblock with its floor over TLS.
fn plain(url: &str) -> String {
    if url.contains("sslmode=") {
        return url.to_string();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}sslmode=disable")
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let url = plain(
        &std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
    );
    let slice: f64 = env_or("SLICE_SECS", 1.0);
    let rounds: usize = env_or("ROUNDS", 5);
    let name = "bench:hot:side-by-side";
    let key = dblock::Key::new("public", name).unwrap().as_i64();

    // Each contender: its label and one slice's run, on its own runtime.
    type Slice = Box<dyn FnMut() -> f64>;
    let mut contenders: Vec<(&str, Slice)> = Vec::new();

    // The floor's connections, one per worker, each remembering whether it holds.
    let rt = runtime();
    let floor_conns = rt.block_on(async {
        let mut conns = Vec::new();
        for _ in 0..WORKERS {
            let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            conns.push(Arc::new((c, std::sync::atomic::AtomicBool::new(false))));
        }
        Arc::new(conns)
    });
    let floor = {
        let conns = floor_conns.clone();
        move |w: usize| {
            let conns = conns.clone();
            async move {
                let (c, holding) = &*conns[w];
                let head = match holding.swap(true, Ordering::Relaxed) {
                    true => "ROLLBACK AND CHAIN; ",
                    false => "BEGIN; ",
                };
                drain(c, &format!("{head}SELECT pg_advisory_xact_lock({key})")).await;
            }
        }
    };
    // Each floor task releases what it still holds when it stops.
    let settle_floor = move |w: usize| {
        let conns = floor_conns.clone();
        async move {
            let (c, holding) = &*conns[w];
            if holding.swap(false, Ordering::Relaxed) {
                drain(c, "ROLLBACK").await;
            }
        }
    };
    contenders.push((
        "floor: one message per hand-off (raw)",
        Box::new(move || rt.block_on(run_then(slice, floor.clone(), settle_floor.clone()))),
    ));

    let dblock_cycle = |locks: Locks| {
        move |_w: usize| {
            let locks = locks.clone();
            async move { drop(locks.lock(name).await.unwrap()) }
        }
    };
    for (label, scope) in [
        (
            "dblock: lock + drop (transaction scope)",
            Scope::Transaction,
        ),
        ("dblock: lock + drop (session scope)", Scope::Session),
    ] {
        let rt = runtime();
        let locks = rt
            .block_on(Locks::builder().url(&url).scope(scope).build())
            .unwrap();
        let cycle = dblock_cycle(locks);
        contenders.push((
            label,
            Box::new(move || rt.block_on(run(slice, cycle.clone()))),
        ));
    }

    // A handle per worker, as eight processes would have: no hand-over inside the
    // process, every hand-off through the server. Transaction scope's release is the
    // transaction's end; session scope's is `pg_advisory_unlock`, as sqlx's.
    for (label, scope) in [
        (
            "dblock: a handle per worker (transaction)",
            Scope::Transaction,
        ),
        ("dblock: a handle per worker (session)", Scope::Session),
    ] {
        let rt = runtime();
        let apart = rt.block_on(async {
            let mut apart = Vec::new();
            for _ in 0..WORKERS {
                apart.push(
                    Locks::builder()
                        .url(&url)
                        .scope(scope)
                        .build()
                        .await
                        .unwrap(),
                );
            }
            Arc::new(apart)
        });
        let apart_cycle = move |w: usize| {
            let locks = apart[w].clone();
            async move { drop(locks.lock(name).await.unwrap()) }
        };
        contenders.push((
            label,
            Box::new(move || rt.block_on(run(slice, apart_cycle.clone()))),
        ));
    }
    // Where the peers' rows start: sqlx, then pgbench's two protocols.
    let sqlx_row = contenders.len();
    let pgbench_rows = sqlx_row + 1;

    // sqlx: a connection of each task's own, held for the run.
    let sqlx_rt = Arc::new(runtime());
    let rt = sqlx_rt.clone();
    let sqlx_conns = rt.block_on(async {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(WORKERS as u32)
            .connect(&url)
            .await
            .unwrap();
        let mut conns = Vec::new();
        for _ in 0..WORKERS {
            conns.push(Arc::new(tokio::sync::Mutex::new(Some(
                pool.acquire().await.unwrap(),
            ))));
        }
        Arc::new(conns)
    });
    let sqlx_lock = Arc::new(sqlx::postgres::PgAdvisoryLock::new(name));
    let sqlx_cycle = move |w: usize| {
        let (conns, lock) = (sqlx_conns.clone(), sqlx_lock.clone());
        async move {
            let mut slot = conns[w].lock().await;
            let conn = slot.take().unwrap();
            let guard = lock.acquire(conn).await.unwrap();
            *slot = Some(guard.release_now().await.unwrap());
        }
    };
    contenders.push((
        "sqlx PgAdvisoryLock: acquire + release_now",
        Box::new(move || rt.block_on(run(slice, sqlx_cycle.clone()))),
    ));

    let bin = pgbench();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("hot.sql");
    std::fs::write(
        &script,
        format!("BEGIN;\nSELECT pg_advisory_xact_lock({key});\nCOMMIT;\n"),
    )
    .unwrap();
    let pg_secs = slice.round().max(1.0) as u64;
    for (label, mode) in [
        ("pgbench -M simple: BEGIN; lock; COMMIT", "simple"),
        ("pgbench -M prepared: BEGIN; lock; COMMIT", "prepared"),
    ] {
        let (rt, bin, url, script) = (runtime(), bin.clone(), url.clone(), script.clone());
        contenders.push((
            label,
            Box::new(move || match &bin {
                Some(bin) => rt.block_on(run_pgbench(bin, &url, &script, mode, pg_secs)),
                None => 0.0,
            }),
        ));
    }

    // Round 0 warms every contender up; each round starts one contender further on.
    let n = contenders.len();
    let mut totals = vec![Vec::new(); n];
    for round in 0..=rounds {
        let mut r = vec![0.0; n];
        for i in (0..n).map(|i| (i + round) % n) {
            r[i] = (contenders[i].1)();
        }
        if round > 0 {
            for (t, v) in totals.iter_mut().zip(r) {
                t.push(v);
            }
        }
    }
    let labels: Vec<&str> = contenders.iter().map(|c| c.0).collect();
    let mean = |v: &Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let rates: Vec<f64> = totals.iter().map(mean).collect();
    let pg_best = rates[pgbench_rows].max(rates[pgbench_rows + 1]);
    println!(
        "PostgreSQL hot name, {WORKERS} workers ({rounds} rounds of {slice} s slices, alternating; same server, same run)"
    );
    println!(
        "{:<44} {:>10} {:>9} {:>9} {:>11}   per round",
        "", "cycles/s", "÷ floor", "÷ sqlx", "÷ pgbench"
    );
    for (i, label) in labels.iter().enumerate() {
        if i >= pgbench_rows && bin.is_none() {
            println!("{label:<44} (no pgbench found; set PGBENCH)");
            continue;
        }
        let per: Vec<String> = totals[i].iter().map(|v| format!("{v:.0}")).collect();
        println!(
            "{label:<44} {:>10.0} {:>9.2} {:>9.2} {:>11.2}   {}",
            rates[i],
            rates[i] / rates[0],
            rates[i] / rates[sqlx_row],
            rates[i] / pg_best,
            per.join(" ")
        );
    }
    // Round by round: the issue's "in at least 4 of 5 side-by-side runs".
    let ahead = |i: usize| {
        (0..totals[i].len())
            .filter(|&r| {
                let best = totals[pgbench_rows]
                    .get(r)
                    .copied()
                    .unwrap_or(0.0)
                    .max(totals[pgbench_rows + 1].get(r).copied().unwrap_or(0.0));
                totals[i][r] >= totals[sqlx_row][r] && totals[i][r] >= best
            })
            .count()
    };
    for (i, label) in labels.iter().enumerate().take(sqlx_row).skip(1) {
        println!(
            "{label}: ahead of sqlx and pgbench in {} of {rounds} rounds",
            ahead(i)
        );
    }
    println!("(÷ pgbench: against the faster of its two protocols)");
    // sqlx's pooled connections go back to their pool on a task: drop them inside
    // their runtime.
    let _inside = sqlx_rt.enter();
    drop(contenders);
}
