//! `dblock status` (who holds and awaits locks) and `dblock release NAME --force` (end
//! the holder's session), and the one-line description of a holder that `dblock run`
//! prints while it waits.

use std::time::{Duration, SystemTime};

use clap::Args;
use dblock::status::{LockStatus, Party, age, mode_str, scope_str};

use crate::{EXIT_USAGE, exit_code, one_line};

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Database URL (as for `run`).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Namespace the NAMEs are keyed in (as for `run`).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,

    /// Print the documented JSON shape (docs/status.md) instead of text.
    #[arg(long)]
    json: bool,

    /// Print again every 2 seconds until interrupted.
    #[arg(long)]
    watch: bool,

    /// Only these locks (by name); without NAMEs, every lock the database shows.
    #[arg(value_name = "NAME")]
    names: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ReleaseArgs {
    /// Database URL (as for `run`).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Namespace the NAME is keyed in (as for `run`).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,

    /// End the holder's database session (required: the holder loses the lock).
    #[arg(long)]
    force: bool,

    /// The lock name.
    #[arg(value_name = "NAME")]
    name: String,
}

async fn open(db: Option<&str>, namespace: Option<&str>) -> Result<dblock::Locks, u8> {
    crate::notice::embedded_default(db);
    let mut builder = dblock::Locks::builder().max_connections(2);
    if let Some(url) = db {
        builder = builder.url(url);
    }
    if let Some(ns) = namespace {
        builder = builder.namespace(ns);
    }
    builder.build().await.map_err(|e| {
        errln!("dblock: {}", one_line(&e));
        exit_code(&e)
    })
}

pub async fn status(args: StatusArgs) -> u8 {
    let locks = match open(args.db.as_deref(), args.namespace.as_deref()).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
    loop {
        let rows = match locks.status(&names).await {
            Ok(r) => r,
            Err(e) => {
                errln!("dblock: {}", one_line(&e));
                return exit_code(&e);
            }
        };
        let now = SystemTime::now();
        if args.json {
            outln!(
                "{}",
                dblock::status::to_json(locks.backend_name(), &rows, now)
            );
        } else {
            if args.watch {
                // Clear the screen, cursor home.
                outln!("\x1b[2J\x1b[H{} locks, {:?}", locks.backend_name(), now);
            }
            print_text(&rows, now);
        }
        if !args.watch {
            return 0;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn print_text(rows: &[LockStatus], now: SystemTime) {
    if rows.is_empty() {
        outln!("no locks held or awaited");
        return;
    }
    for l in rows {
        match (&l.name, &l.namespace) {
            (Some(n), Some(ns)) => outln!("{n}  (namespace {ns}, key {})", l.key),
            (Some(n), None) => outln!("{n}  (key {})", l.key),
            _ => outln!(
                "key {}  (name unknown: not taken by dblock, or not shown)",
                l.key
            ),
        }
        for h in &l.holders {
            outln!("  held by   {}", party_line(h, now));
        }
        for w in &l.waiters {
            outln!("  waiting   {}", party_line(w, now));
        }
    }
}

/// `program[pid]@host (connection N), exclusive, transaction, for 12s`.
fn party_line(p: &Party, now: SystemTime) -> String {
    let mut s = p.describe();
    if let Some(c) = &p.client {
        s.push_str(&format!(" from {c}"));
    }
    s.push_str(&format!(", {}", mode_str(p.mode)));
    if let Some(scope) = p.scope {
        s.push_str(&format!(", {}", scope_str(scope)));
    }
    if let Some(t) = p.since {
        s.push_str(&format!(", for {}", show_age(age(t, now))));
    }
    s
}

fn show_age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{:.1}s", d.as_secs_f64()),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// Who holds `name`, as one phrase (`dblock[42]@ci-7 (connection 9), for 3.0s`), if
/// the backend can tell within a second.
pub async fn holders_of(locks: &dblock::Locks, name: &str) -> Option<String> {
    let rows = tokio::time::timeout(Duration::from_secs(1), locks.status(&[name]))
        .await
        .ok()?
        .ok()?;
    let now = SystemTime::now();
    let held: Vec<String> = rows
        .iter()
        .flat_map(|l| l.holders.iter())
        .map(|h| {
            let mut s = h.describe();
            if let Some(t) = h.since {
                s.push_str(&format!(", for {}", show_age(age(t, now))));
            }
            s
        })
        .collect();
    (!held.is_empty()).then(|| held.join("; "))
}

pub async fn release(args: ReleaseArgs) -> u8 {
    if !args.force {
        errln!(
            "dblock: release {name:?} would end the database session of whoever holds it, \
             which loses the lock mid-work; pass --force if that is what you mean \
             (`dblock status {name}` shows the holder)",
            name = args.name
        );
        return EXIT_USAGE;
    }
    let locks = match open(args.db.as_deref(), args.namespace.as_deref()).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    match locks.terminate_holders(&args.name).await {
        Ok(ended) if ended.is_empty() => {
            outln!("lock {:?} is not held: nothing ended", args.name);
            0
        }
        Ok(ended) => {
            for p in &ended {
                outln!(
                    "ended {}, which held lock {:?}",
                    party_line(p, SystemTime::now()),
                    args.name
                );
            }
            0
        }
        Err(e) => {
            errln!("dblock: {}", one_line(&e));
            exit_code(&e)
        }
    }
}
