//! Eight exports, at most three at a time: a semaphore.
//!
//! ```text
//! cargo run --example exports                    # embedded (a temporary lock file, no server)
//! DATABASE_URL=postgres://… cargo run --example exports
//! ```
//!
//! Each export takes one of the three slots of the semaphore `exports`, so however many
//! tasks (or processes: run several copies against one database) want to export, no
//! more than three do at once. See `docs/semaphores.md`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("dblock-exports-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // With no database configured, a lock file of the example's own, not your default.
    let url = match dblock::url_from_env() {
        Some(url) => url,
        None => format!("sqlite:{}", dir.join("locks.db").display()),
    };
    let locks = dblock::Locks::connect(&url).await?;
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut exports = Vec::new();
    for id in 0..8 {
        let (locks, inside, most) = (locks.clone(), inside.clone(), most.clone());
        exports.push(tokio::spawn(async move {
            let permit = locks.semaphore("exports", 3).lock().await?;
            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            println!(
                "  export {id} runs in slot {} ({now} running)",
                permit.slot()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            inside.fetch_sub(1, Ordering::SeqCst);
            permit.release().await
        }));
    }
    for e in exports {
        e.await??;
    }
    println!(
        "at most {} exports ran at once",
        most.load(Ordering::SeqCst)
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
