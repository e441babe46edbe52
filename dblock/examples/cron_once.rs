//! A tokio-cron-scheduler job that runs once per slot across processes.
//!
//! ```text
//! cargo run --example cron_once                    # the embedded default (no server)
//! DATABASE_URL=postgres://… cargo run --example cron_once
//! ```
//!
//! tokio-cron-scheduler fires a job in every process that schedules it: three replicas,
//! three runs per tick. Here each replica's job claims the tick's slot first
//! (`Locks::once_per`, the slot read from the database's clock and rounded to the nearest
//! boundary, so replicas whose clocks or schedulers fire a little apart agree on it): one
//! replica runs the work, the others are told who did. The coordinator starts three
//! replicas, lets them run for a few ticks, and checks that every slot ran once.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use dblock::jobs::Claim;
use tokio_cron_scheduler::{Job, JobScheduler};

/// The schedule (every two seconds, as cron with seconds writes it) and its period.
const SCHEDULE: &str = "*/2 * * * * *";
const PERIOD: Duration = Duration::from_secs(2);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("CRON_REPLICA") {
        Ok(id) => replica(&id).await,
        Err(_) => coordinator().await,
    }
}

/// One replica: a scheduler whose job claims each tick's slot before working.
async fn replica(id: &str) -> Result<(), Box<dyn std::error::Error>> {
    let locks = dblock::Locks::from_env().await?;
    let scheduler = JobScheduler::new().await?;
    let id = id.to_string();
    scheduler
        .add(Job::new_async(SCHEDULE, move |_job, _scheduler| {
            let (locks, id) = (locks.clone(), id.clone());
            Box::pin(async move {
                if let Err(e) = tick(&locks, &id).await {
                    eprintln!("replica {id}: {e}");
                }
            })
        })?)
        .await?;
    scheduler.start().await?;
    tokio::time::sleep(Duration::from_secs(9)).await;
    Ok(())
}

/// One tick: the work, if this replica wins the slot.
async fn tick(locks: &dblock::Locks, id: &str) -> Result<(), dblock::Error> {
    // Don't wait for the lock: a replica that finds it held is told the slot's claim.
    match locks.once_per("example-report", PERIOD).try_claim().await? {
        Some(Claim::Won(run)) => {
            println!("ran {} in replica {id}", run.slot());
            tokio::time::sleep(Duration::from_millis(300)).await; // the work
            run.succeeded().await
        }
        Some(Claim::Taken(taken)) => {
            let prior = taken.run();
            println!("skipped {} (claimed by {})", prior.slot, prior.holder());
            Ok(())
        }
        // The lock is held (a slow previous run, say) and the slot not yet claimed.
        _ => Ok(()),
    }
}

async fn coordinator() -> Result<(), Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let mut replicas = Vec::new();
    for id in 0..3 {
        let child = tokio::process::Command::new(&exe)
            .env("CRON_REPLICA", id.to_string())
            .stdout(Stdio::piped())
            .spawn()?;
        replicas.push(child.wait_with_output());
    }
    let mut ran: BTreeMap<String, usize> = BTreeMap::new();
    for out in futures_util::future::join_all(replicas).await {
        for line in String::from_utf8_lossy(&out?.stdout).lines() {
            println!("{line}");
            if let Some(slot) = line.strip_prefix("ran ").and_then(|l| l.split(' ').next()) {
                *ran.entry(slot.to_string()).or_default() += 1;
            }
        }
    }
    for (slot, n) in &ran {
        println!("slot {slot}: ran {n} time(s)");
    }
    if ran.values().any(|&n| n != 1) {
        return Err("a slot ran more than once".into());
    }
    Ok(())
}
