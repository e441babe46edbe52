//! dblock's metrics in Prometheus's text format: a few lock cycles on the embedded default
//! (or `--url`), then the scrape page printed — or served, with `--serve`, while the
//! cycles go on.
//!
//! ```text
//! cargo run -p dblock --features metrics --example prometheus -- [--url URL] [--serve 127.0.0.1:9187]
//! ```
//!
//! Without `--url` it uses an SQLite file in a fresh temporary directory. The recorder is
//! `metrics-exporter-prometheus` (without its HTTP listener: `--serve` answers every
//! connection with the page itself). Lock names are grouped by their kind
//! ([`Builder::metrics_group`](dblock::Builder::metrics_group)): `build:1`, `build:2`, …
//! are counted under `group="build"`, never one series per name.

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    // Wait and hold times as true histograms, with buckets from 100 µs to 10 s.
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &[0.0001, 0.001, 0.01, 0.1, 1.0, 10.0],
        )?
        .install_recorder()?;

    let dir = tempfile::tempdir()?;
    let url = match opt("--url") {
        Some(u) => u,
        None => format!("sqlite:{}", dir.path().join("locks.db").display()),
    };
    let locks = dblock::Locks::builder()
        .url(url)
        .metrics_group(|name| name.split_once(':').map(|(kind, _)| kind))
        .build()
        .await?;

    match opt("--serve") {
        None => {
            workload(&locks).await?;
            print!("{}", handle.render());
        }
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(&addr).await?;
            eprintln!("serving http://{addr}/metrics; Ctrl-C to stop");
            tokio::spawn(serve(listener, handle));
            loop {
                workload(&locks).await?;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    Ok(())
}

/// Some of each outcome: granted, held elsewhere, timed out, released.
async fn workload(locks: &dblock::Locks) -> Result<(), dblock::Error> {
    for i in 0..5 {
        let guard = locks.lock(&format!("build:{i}")).await?;
        let reader = locks.request("report:daily").shared().lock().await?;
        // Held here, so another request for it is not granted.
        assert!(locks.try_lock(&format!("build:{i}")).await?.is_none());
        assert!(
            locks
                .try_lock_for(&format!("build:{i}"), Duration::from_millis(20))
                .await?
                .is_none()
        );
        drop(reader);
        guard.release().await?;
    }
    Ok(())
}

/// Answers every connection with the scrape page (a minimal HTTP/1.0 response).
async fn serve(listener: tokio::net::TcpListener, handle: PrometheusHandle) {
    while let Ok((mut conn, _)) = listener.accept().await {
        // Read the request (whatever it asks for), so that closing does not reset it.
        let mut request = [0u8; 4096];
        let _ = conn.read(&mut request).await;
        let body = handle.render();
        let head = format!(
            "HTTP/1.0 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let _ = conn.write_all(head.as_bytes()).await;
        let _ = conn.write_all(body.as_bytes()).await;
    }
}
