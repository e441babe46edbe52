//! A worker process for dblock's multi-process tests.
//!
//! ```text
//! dblock-worker counter URL NAME FILE ITERATIONS SLEEP_US [--no-lock]
//!     ITERATIONS times: take NAME, read the integer in FILE, sleep, write it + 1,
//!     release. An "inside" marker file created with O_EXCL counts overlapping
//!     critical sections. Prints `overlaps=N`.
//! dblock-worker hold URL NAME [--fenced]
//!     takes NAME, prints `held TOKEN`, then sleeps until killed.
//! dblock-worker wait URL NAME
//!     waits for NAME, prints `acquired`, exits.
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let locks = dblock::Locks::connect(&arg(1)).await.unwrap();
    let name = arg(2);
    match arg(0).as_str() {
        "counter" => {
            let file = std::path::PathBuf::from(arg(3));
            let marker = file.with_extension("inside");
            let iterations: u32 = arg(4).parse().unwrap();
            let sleep = Duration::from_micros(arg(5).parse().unwrap());
            let locked = !args.iter().any(|a| a == "--no-lock");
            let mut overlaps = 0u32;
            for _ in 0..iterations {
                let guard = if locked {
                    Some(locks.lock(&name).await.unwrap())
                } else {
                    None
                };
                let entered = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&marker)
                    .is_ok();
                if !entered {
                    overlaps += 1;
                }
                let n: u64 = std::fs::read_to_string(&file)
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .unwrap_or(0);
                tokio::time::sleep(sleep).await;
                std::fs::write(&file, format!("{}\n", n + 1)).unwrap();
                if entered {
                    std::fs::remove_file(&marker).unwrap();
                }
                if let Some(g) = guard {
                    g.release().await.unwrap();
                }
            }
            println!("overlaps={overlaps}");
        }
        "hold" => {
            let mut req = locks.request(&name);
            if args.iter().any(|a| a == "--fenced") {
                req = req.fenced();
            }
            let guard = req.lock().await.unwrap();
            println!("held {}", guard.fencing_token().unwrap_or(0));
            std::io::stdout().flush().unwrap();
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(guard);
        }
        "wait" => {
            let guard = locks.lock(&name).await.unwrap();
            println!("acquired");
            std::io::stdout().flush().unwrap();
            drop(guard);
        }
        other => panic!("unknown mode {other:?}"),
    }
}
