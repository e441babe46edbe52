//! `dblock migrate`: apply a directory of migrations, list what a run would apply, or
//! show where each migration stands. The work is the library's (`dblock::migrate`);
//! this is arguments, output and exit codes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use dblock::migrate::{Migrations, State};

use crate::{EXIT_BAD_MIGRATIONS, exit_code};

#[derive(Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "DIR holds VERSION_NAME.sql files (0001_create_users.sql), applied in \
                  version order, each in a transaction with its row in dblock_migrations; \
                  a file whose first line is `-- dblock:no-transaction` runs statement by \
                  statement outside one (CREATE INDEX CONCURRENTLY).\n\n\
                  Exit: 0 everything is applied; 65 the migration set cannot be applied \
                  (a malformed file, an edited migration, versions DIR lacks); 69 the \
                  database cannot be reached or a migration failed on it."
)]
pub struct MigrateArgs {
    #[command(subcommand)]
    action: Option<Action>,

    #[command(flatten)]
    target: Target,

    /// List the migrations a run would apply, and change nothing (no lock, no table).
    #[arg(long)]
    dry_run: bool,
}

#[derive(Subcommand, Debug)]
enum Action {
    /// Show each migration of DIR and of the database: applied, pending, edited since
    /// it was applied, or unknown to DIR. Exits 65 when a run would refuse.
    Status(Target),
}

#[derive(Args, Debug)]
struct Target {
    /// Database URL: postgres://…, postgresql://…, sqlite:PATH. Default:
    /// $DBLOCK_DATABASE_URL, then $DATABASE_URL, then
    /// $XDG_STATE_HOME/dblock/locks.db (~/.local/state/dblock/locks.db).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Proceed although the database has applied migrations DIR lacks (they are left
    /// alone).
    #[arg(long)]
    ignore_missing: bool,

    /// The directory of migrations.
    #[arg(value_name = "DIR", required = true)]
    dir: Option<PathBuf>,
}

pub fn main(args: MigrateArgs) -> u8 {
    crate::block_on(false, async {
        let res = match args.action {
            Some(Action::Status(target)) => status(&target).await,
            None => apply(&args.target, args.dry_run).await,
        };
        match res {
            Ok(code) => code,
            Err(e) => {
                errln!("dblock: {}", crate::one_line(&e));
                if e.is_bad_migration_set() {
                    EXIT_BAD_MIGRATIONS
                } else {
                    exit_code(&e)
                }
            }
        }
    })
}

/// The set, then the database: a bad directory is reported without connecting.
async fn open(target: &Target) -> Result<(Migrations, dblock::Locks, &Path), dblock::Error> {
    let dir = target.dir.as_deref().unwrap_or(Path::new("."));
    let set = Migrations::from_dir(dir)?;
    crate::notice::embedded_default(target.db.as_deref());
    let mut builder = dblock::Locks::builder();
    if let Some(url) = &target.db {
        builder = builder.url(url);
    }
    Ok((set, builder.build().await?, dir))
}

async fn apply(target: &Target, dry_run: bool) -> Result<u8, dblock::Error> {
    let (set, locks, _) = open(target).await?;
    let runner = set.runner(&locks).ignore_missing(target.ignore_missing);
    if dry_run {
        let pending = runner.dry_run().await?;
        let already = set.len() - pending.len();
        for m in &pending {
            let how = if m.no_transaction() {
                "  (no transaction)"
            } else {
                ""
            };
            out(&format!("pending  {}{how}", m.file_name()));
        }
        out(&match pending.len() {
            0 => format!("nothing to do: {already} already applied (dry run)"),
            n => format!("{n} pending, {already} already applied (dry run: nothing changed)"),
        });
        return Ok(0);
    }
    let report = runner
        .on_applied(|m| out(&format!("applied  {}  ({})", m.file_name, show(m.duration))))
        .run()
        .await?;
    out(&match report.applied.len() {
        0 => format!("nothing to do: {} already applied", report.already_applied),
        n => format!("{n} applied, {} already applied", report.already_applied),
    });
    Ok(0)
}

async fn status(target: &Target) -> Result<u8, dblock::Error> {
    let (set, locks, dir) = open(target).await?;
    let status = set
        .runner(&locks)
        .ignore_missing(target.ignore_missing)
        .status()
        .await?;
    let label = |e: &dblock::migrate::StatusEntry| match &e.file_name {
        Some(f) => f.clone(),
        None => format!("{} ({})", e.version, e.name),
    };
    let width = status
        .entries
        .iter()
        .map(|e| label(e).len())
        .max()
        .unwrap_or(0);
    for e in &status.entries {
        let when = e.applied_at.as_deref().unwrap_or_default();
        let took = e.duration.map(show).unwrap_or_default();
        let line = match e.state {
            State::Applied => format!("applied  {:width$}  {when}  {took}", label(e)),
            State::Pending => format!("pending  {}", label(e)),
            State::Edited => format!(
                "edited   {:width$}  {when}  the file changed since it was applied",
                label(e)
            ),
            State::Unknown => format!(
                "unknown  {:width$}  {when}  applied, but not in {}",
                label(e),
                dir.display()
            ),
            _ => format!("{:8} {}", e.state.to_string(), label(e)),
        };
        out(line.trim_end());
    }
    let counts: Vec<String> = [
        State::Applied,
        State::Pending,
        State::Edited,
        State::Unknown,
    ]
    .into_iter()
    .map(|s| format!("{} {s}", status.count(s)))
    .collect();
    out(&counts.join(", "));
    if status.would_refuse() {
        errln!(
            "dblock: a run would refuse: {} edited since applied, {} applied but not in {} \
             (see dblock migrate --help)",
            status.count(State::Edited),
            status.count(State::Unknown),
            dir.display()
        );
        return Ok(EXIT_BAD_MIGRATIONS);
    }
    Ok(0)
}

/// A line on stdout; a closed pipe is not worth a panic.
fn out(line: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

fn show(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}
