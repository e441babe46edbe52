//! Four processes land five proposals; each proposal is landed exactly once.
//!
//! ```text
//! cargo run --example autoland                    # embedded (a temporary lock file, no server)
//! DATABASE_URL=postgres://… cargo run --example autoland
//! ```
//!
//! This is the hub seed's job: several web processes record a proposal's last checks
//! and each would land it. The lock `autoland:ID`, held across the check and the
//! landing, makes exactly one of them do it. The example starts copies of itself as
//! separate OS processes, so the exclusion shown is between processes, not tasks.

use std::path::Path;
use std::time::Duration;

const PROPOSALS: u32 = 5;
const WORKERS: u32 = 4;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("AUTOLAND_WORKER") {
        Ok(id) => worker(&id, Path::new(&std::env::var("AUTOLAND_DIR")?)).await,
        Err(_) => coordinator().await,
    }
}

/// One web process: tries to land every proposal.
async fn worker(id: &str, landed: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let locks = dblock::Locks::from_env().await?;
    let start: u32 = id.parse().unwrap_or(0);
    // Each worker visits the proposals in its own order, so they meet on every one.
    for p in (0..PROPOSALS).map(|k| (start + k) % PROPOSALS + 1) {
        // One evaluation of proposal p at a time, in any process.
        let guard = locks.lock(&format!("autoland:{p}")).await?;
        let marker = landed.join(format!("proposal-{p}"));
        if !marker.exists() {
            // The checks take a while: without the lock, others would land it meanwhile.
            tokio::time::sleep(Duration::from_millis(30)).await;
            std::fs::write(&marker, id)?;
            println!("  worker {id} landed proposal {p}");
        }
        guard.release().await?;
    }
    Ok(())
}

async fn coordinator() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("dblock-autoland-{}", std::process::id()));
    let landed_dir = dir.join("landed");
    std::fs::create_dir_all(&landed_dir)?;
    // With no database configured, the example uses an embedded lock file of its own in a
    // temporary directory (removed at the end) rather than your real default,
    // ~/.local/state/dblock/locks.db, which `dblock run` uses.
    let url = match dblock::url_from_env() {
        Some(url) => url,
        None => format!("sqlite:{}", dir.join("locks.db").display()),
    };
    let locks = dblock::Locks::connect(&url).await?;
    let where_ = match dblock::url_from_env() {
        Some(_) => "the database in DBLOCK_DATABASE_URL/DATABASE_URL".to_string(),
        None => format!(
            "a temporary embedded lock file, {}-locks",
            dir.join("locks.db").display()
        ),
    };
    println!(
        "{WORKERS} processes land {PROPOSALS} proposals, locking on {where_} ({})",
        locks.backend_name()
    );
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for id in 1..=WORKERS {
        children.push(
            tokio::process::Command::new(&exe)
                .env("AUTOLAND_WORKER", id.to_string())
                .env("AUTOLAND_DIR", &landed_dir)
                .env("DBLOCK_DATABASE_URL", &url)
                .spawn()?,
        );
    }
    for mut c in children {
        let status = c.wait().await?;
        if !status.success() {
            return Err(format!("a worker failed: {status}").into());
        }
    }
    let landed = std::fs::read_dir(&landed_dir)?.count();
    std::fs::remove_dir_all(&dir)?;
    println!("{landed} of {PROPOSALS} proposals landed, each exactly once");
    if landed as u32 != PROPOSALS {
        return Err("a proposal was not landed".into());
    }
    Ok(())
}
