//! Six processes start at once and each runs the same embedded migrations; each
//! migration is applied exactly once, by whichever process holds the migration lock.
//!
//! ```text
//! cargo run --example migrate                     # a temporary SQLite file (no server)
//! DATABASE_URL=postgres://… cargo run --example migrate
//! ```
//!
//! The migrations are `examples/migrations/*.sql`, embedded in the binary at compile
//! time by `dblock::migrations!`. Against PostgreSQL the example creates the table
//! `example_notes` and the bookkeeping table `dblock_migrations` in the schema in use.

use std::time::Duration;

const WORKERS: u32 = 6;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("MIGRATE_WORKER") {
        Ok(id) => worker(&id).await,
        Err(_) => coordinator().await,
    }
}

/// One instance of a service starting up: it brings the schema up to date first.
async fn worker(id: &str) -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("MIGRATE_URL")?;
    let locks = dblock::Locks::connect(&url).await?;
    let report = dblock::migrations!("examples/migrations")
        .runner(&locks)
        .on_applied(|m| println!("  process {id} applied {} in {:?}", m.file_name, m.duration))
        .run()
        .await?;
    if report.applied.is_empty() {
        println!("  process {id}: nothing to do");
    }
    Ok(())
}

async fn coordinator() -> Result<(), Box<dyn std::error::Error>> {
    let tmp = std::env::temp_dir().join(format!("dblock-migrate-{}", std::process::id()));
    let url = match dblock::url_from_env() {
        Some(url) => url,
        None => {
            std::fs::create_dir_all(&tmp)?;
            format!("sqlite:{}", tmp.join("example.db").display())
        }
    };
    let locks = dblock::Locks::connect(&url).await?;
    let set = dblock::migrations!("examples/migrations");
    println!(
        "{WORKERS} processes start at once and migrate one {} database ({} migrations)",
        locks.backend_name(),
        set.len()
    );
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for id in 1..=WORKERS {
        children.push(
            tokio::process::Command::new(&exe)
                .env("MIGRATE_WORKER", id.to_string())
                .env("MIGRATE_URL", &url)
                .spawn()?,
        );
    }
    for mut c in children {
        let status = tokio::time::timeout(Duration::from_secs(60), c.wait()).await??;
        if !status.success() {
            return Err(format!("a process failed: {status}").into());
        }
    }
    let status = set.runner(&locks).status().await?;
    for e in &status.entries {
        println!(
            "{:8} {}  applied at {}",
            e.state.to_string(),
            e.file_name.as_deref().unwrap_or(&e.name),
            e.applied_at.as_deref().unwrap_or("-")
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
    if status.count(dblock::migrate::State::Applied) != set.len() {
        return Err("not every migration was applied".into());
    }
    Ok(())
}
