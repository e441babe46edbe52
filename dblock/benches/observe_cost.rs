//! What tracing and metrics cost the cheapest lock cycle there is — the embedded backend,
//! uncontended, one task — with nobody listening, and with a listener. Prints wall time
//! per cycle; for a figure that load on the machine does not move, count instructions
//! under callgrind at two cycle counts and divide the difference by the difference in
//! cycles (start-up cancels out):
//!
//! ```text
//! cargo bench -p dblock --bench observe_cost [--features metrics] --no-run
//! valgrind --tool=callgrind target/release/deps/observe_cost-* --bench plain 1000
//! valgrind --tool=callgrind target/release/deps/observe_cost-* --bench plain 11000
//! ```
//!
//! Modes: `plain` (no subscriber, no recorder: what every user who does not ask pays),
//! `subscriber` (a tracing subscriber that takes every dblock event and drops it),
//! `recorder` (with `--features metrics`: the Prometheus exporter's recorder installed).
//! See `docs/observability.md` for the figures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Instant;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing to run.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let rest: Vec<&String> = args[1..].iter().filter(|a| !a.starts_with("--")).collect();
    let mode = rest.first().map(|s| s.as_str()).unwrap_or("plain");
    let n: u64 = rest.get(1).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let _sub = match mode {
        "plain" => None,
        "subscriber" => Some(tracing::subscriber::set_default(Discard)),
        #[cfg(feature = "metrics")]
        "recorder" => {
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .unwrap();
            None
        }
        other => panic!("unknown mode {other} (recorder needs --features metrics)"),
    };
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("locks.db").display());
    let locks = dblock::Locks::connect(&url).await.unwrap();
    drop(locks.lock("bench:observe").await.unwrap());
    let start = Instant::now();
    for _ in 0..n {
        drop(locks.lock("bench:observe").await.unwrap());
    }
    let ns = start.elapsed().as_nanos() as f64 / n as f64;
    println!(
        "mode={mode} metrics_feature={} cycles={n} ns_per_cycle={ns:.0}",
        cfg!(feature = "metrics")
    );
}

/// A subscriber that wants every event and span, and keeps nothing.
struct Discard;

impl tracing::Subscriber for Discard {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        std::hint::black_box(event);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}
