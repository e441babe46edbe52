//! Three processes stand for election; one leads; kill it and another takes over.
//!
//! ```text
//! cargo run --example leader                    # the embedded default (no server)
//! DATABASE_URL=postgres://… cargo run --example leader
//! ```
//!
//! Each candidate runs `Election::run`: while it leads, its work runs with the term's
//! fencing token; when the term is lost the work is dropped and the process stands
//! again. The coordinator kills the first leader with SIGKILL and watches a new one take
//! over, with a higher token.

use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("LEADER_CANDIDATE") {
        Ok(id) => candidate(&id).await,
        Err(_) => coordinator().await,
    }
}

async fn candidate(id: &str) -> Result<(), Box<dyn std::error::Error>> {
    let locks = dblock::Locks::from_env().await?;
    let election = dblock::leader::Election::new(&locks, "example-scheduler");
    election
        .run(|fence| async move {
            loop {
                // The leader's work; every write it makes would be checked against `fence`.
                println!("leading {id} {}", fence.token());
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
        .await?;
    Ok(())
}

async fn coordinator() -> Result<(), Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut children = Vec::new();
    for id in 1..=3 {
        let mut child = tokio::process::Command::new(&exe)
            .env("LEADER_CANDIDATE", id.to_string())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = tx.send(line);
            }
        });
        children.push(child);
    }
    let mut first: Option<(usize, i64)> = None;
    let mut killed_at = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Ok(Some(line)) = tokio::time::timeout_at(deadline.into(), rx.recv()).await {
        let mut parts = line.split_whitespace().skip(1);
        let (Some(id), Some(token)) = (parts.next(), parts.next()) else {
            continue;
        };
        let (id, token): (usize, i64) = (id.parse()?, token.parse()?);
        match (first, killed_at) {
            (None, _) => {
                println!("candidate {id} leads (fencing token {token}); killing it with SIGKILL");
                first = Some((id, token));
                children[id - 1].start_kill()?;
                killed_at = Some(Instant::now());
            }
            (Some((old, old_token)), Some(at)) if id != old => {
                println!(
                    "candidate {id} took over after {:?} (fencing token {token} > {old_token})",
                    at.elapsed()
                );
                return Ok(());
            }
            _ => {}
        }
    }
    Err("no leader took over".into())
}
