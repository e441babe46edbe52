//! `dblock migrate`: apply a directory of migrations, list what a run would apply, show
//! where each migration stands, adopt another tool's history, revert, or write the next
//! file. The work is the library's (`dblock::migrate`); this is arguments, output and
//! exit codes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use dblock::migrate::{Migrations, Runner, SqlxConfig, SqlxHistory, State, StatusEntry};

use crate::sqlx_toml::SqlxToml;
use crate::{EXIT_BAD_MIGRATIONS, exit_code};

#[derive(Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "DIR holds VERSION_NAME.sql files (0001_create_users.sql; sqlx-cli's \
                  directories as they are, with .up.sql/.down.sql pairs and timestamp \
                  versions; Flyway's V1__name.sql), applied in version order, each in a \
                  transaction with its row in dblock_migrations; a file whose first line \
                  is `-- dblock:no-transaction` or sqlx's `-- no-transaction` runs \
                  statement by statement outside one (CREATE INDEX CONCURRENTLY). On a \
                  database sqlx migrated, what _sqlx_migrations records is adopted (each \
                  file's checksum verified), never applied again; while that history \
                  exists, dblock also holds sqlx's migration lock and records what it \
                  applies there, so instances still running sqlx's migrator during a \
                  rolling deploy take turns with it (--sqlx-history). A sqlx.toml in the \
                  current directory is read as sqlx-cli reads it: [migrate] table-name \
                  and ignored-chars for adoption, migrations-dir as the default DIR.\n\n\
                  Exit: 0 everything is applied; 65 the migration set cannot be applied \
                  (a malformed file or sqlx.toml, an edited migration, versions DIR lacks, \
                  another tool's history that cannot be adopted as it stands, a \
                  no-transaction migration interrupted part way); 69 the database cannot \
                  be reached or a migration failed on it."
)]
pub struct MigrateArgs {
    #[command(subcommand)]
    action: Option<Action>,

    #[command(flatten)]
    target: Target,

    /// List the migrations a run would apply (and which run outside a transaction),
    /// warn about statements that cannot run inside one, and change nothing (no lock,
    /// no table).
    #[arg(long)]
    dry_run: bool,
}

#[derive(Subcommand, Debug)]
enum Action {
    /// Show each migration of DIR and of the database: applied, pending, edited since
    /// it was applied, unknown to DIR, interrupted part way, or being applied. Exits 65
    /// when a run would refuse.
    Status(Target),
    /// Adopt a database another tool migrated: record migrations as applied without
    /// running them. Without --to, the versions sqlx's _sqlx_migrations records (files
    /// that differ from what sqlx applied are accepted as they are, and named); with
    /// --to VERSION, every migration of DIR up to VERSION.
    Baseline(Bounded),
    /// Revert the latest applied migration with its .down.sql (or with --to VERSION,
    /// every applied migration above VERSION, newest first). PostgreSQL and SQLite
    /// (refused on MySQL, where DDL commits as it goes).
    Revert(Bounded),
    /// Write the next migration file into DIR in the directory's own naming (the next
    /// timestamp or number; an .up.sql/.down.sql pair for a reversible directory).
    New(NewArgs),
}

#[derive(Args, Debug)]
struct Bounded {
    #[command(flatten)]
    target: Target,

    /// The version to stop at (see the command's description).
    #[arg(long, value_name = "VERSION")]
    to: Option<i64>,
}

#[derive(Args, Debug)]
struct NewArgs {
    /// What the migration does, as its file name will say it ("add users email").
    #[arg(value_name = "NAME")]
    name: String,

    /// The directory of migrations (created if missing). Default: sqlx.toml's
    /// `migrations-dir`, else `migrations`.
    #[arg(value_name = "DIR")]
    dir: Option<PathBuf>,
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

    /// The directory of migrations. Default: sqlx.toml's `migrations-dir` (in the
    /// current directory), else `migrations`, as sqlx-cli does.
    #[arg(value_name = "DIR")]
    dir: Option<PathBuf>,

    /// Keep sqlx's history too, holding sqlx's migration lock, so that instances still
    /// running sqlx's migrator take turns with dblock and never apply a migration
    /// twice: `auto` where sqlx's history table exists, `always` (creating it: a fresh
    /// database where sqlx instances may also start), `off` once every instance runs
    /// dblock.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = SqlxHistoryArg::Auto)]
    sqlx_history: SqlxHistoryArg,
}

/// `--sqlx-history`'s values.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum SqlxHistoryArg {
    Auto,
    Always,
    Off,
}

impl From<SqlxHistoryArg> for SqlxHistory {
    fn from(a: SqlxHistoryArg) -> SqlxHistory {
        match a {
            SqlxHistoryArg::Auto => SqlxHistory::Auto,
            SqlxHistoryArg::Always => SqlxHistory::Always,
            SqlxHistoryArg::Off => SqlxHistory::Off,
        }
    }
}

pub fn main(args: MigrateArgs) -> u8 {
    crate::block_on(false, async {
        // sqlx.toml first: a bad one is reported before anything is read or connected.
        let toml = match SqlxToml::read() {
            Ok(t) => t,
            Err(e) => return report(&e, None),
        };
        let given = match &args.action {
            Some(Action::Status(t)) => t.dir.clone(),
            Some(Action::Baseline(b) | Action::Revert(b)) => b.target.dir.clone(),
            Some(Action::New(n)) => n.dir.clone(),
            None => args.target.dir.clone(),
        };
        let dir = given.unwrap_or_else(|| toml.dir());
        let res = async {
            match &args.action {
                Some(Action::Status(t)) => status(open(t, &toml, &dir).await?).await,
                Some(Action::Baseline(b)) => {
                    baseline(open(&b.target, &toml, &dir).await?, b.to).await
                }
                Some(Action::Revert(b)) => revert(open(&b.target, &toml, &dir).await?, b.to).await,
                Some(Action::New(n)) => new(&n.name, &dir),
                None => apply(open(&args.target, &toml, &dir).await?, args.dry_run).await,
            }
        };
        match res.await {
            Ok(code) => code,
            Err(e) => report(&e, Some(&dir)),
        }
    })
}

/// The error on one line, and its exit code.
fn report(e: &dblock::Error, dir: Option<&Path>) -> u8 {
    let mut line = crate::one_line(e);
    if let (dblock::Error::ForeignHistory { .. }, Some(dir)) = (e, dir) {
        // The command that adopts, with the directory as given.
        line = line.replace(" DIR", &format!(" {}", dir.display()));
    }
    errln!("dblock: {line}");
    if e.is_bad_migration_set() {
        EXIT_BAD_MIGRATIONS
    } else {
        exit_code(e)
    }
}

/// A set, the handle it runs on, and what the runner is told.
struct Opened<'a> {
    set: Migrations,
    locks: dblock::Locks,
    dir: &'a Path,
    sqlx: Option<SqlxConfig>,
    ignore_missing: bool,
    sqlx_history: SqlxHistory,
}

impl Opened<'_> {
    /// A runner with the command's options and sqlx.toml's settings.
    fn runner(&self) -> Runner<'_> {
        let runner = self
            .set
            .runner(&self.locks)
            .ignore_missing(self.ignore_missing)
            .sqlx_history(self.sqlx_history);
        match &self.sqlx {
            Some(config) => runner.sqlx_config(config.clone()),
            None => runner,
        }
    }
}

/// The set, then the database: a bad directory is reported without connecting.
async fn open<'a>(
    target: &Target,
    toml: &SqlxToml,
    dir: &'a Path,
) -> Result<Opened<'a>, dblock::Error> {
    let set = Migrations::from_dir(dir)?;
    crate::notice::embedded_default(target.db.as_deref());
    let mut builder = dblock::Locks::builder();
    if let Some(url) = &target.db {
        builder = builder.url(url);
    }
    Ok(Opened {
        set,
        locks: builder.build().await?,
        dir,
        sqlx: toml.config.clone(),
        ignore_missing: target.ignore_missing,
        sqlx_history: target.sqlx_history.into(),
    })
}

async fn apply(o: Opened<'_>, dry_run: bool) -> Result<u8, dblock::Error> {
    let set = &o.set;
    let runner = || o.runner();
    let pending = runner().dry_run().await?;
    // Before anything runs: statements that cannot run in the transaction they would
    // run in.
    let version = runner().server_version_num().await?;
    for m in &pending {
        for h in m.transaction_hazards(version) {
            errln!(
                "dblock: warning: {}: {h}; make `-- no-transaction` (or `{}`) its first line",
                m.file_name(),
                dblock::migrate::NO_TRANSACTION_HEADER
            );
        }
    }
    if dry_run {
        let already = set.len() - pending.len();
        for m in &pending {
            let how = if m.no_transaction() {
                "  (no transaction)"
            } else {
                ""
            };
            out(&format!("pending  {}{how}", m.file_name()));
        }
        let outside = pending.iter().filter(|m| m.no_transaction()).count();
        let outside = match outside {
            0 => String::new(),
            n => format!(" ({n} outside a transaction)"),
        };
        out(&match pending.len() {
            0 => format!("nothing to do: {already} already applied (dry run)"),
            n => format!(
                "{n} pending{outside}, {already} already applied (dry run: nothing changed)"
            ),
        });
        return Ok(0);
    }
    let report = runner()
        .on_applied(|m| out(&format!("applied  {}  ({})", m.file_name, show(m.duration))))
        .run()
        .await?;
    let table = o.sqlx.as_ref().and_then(|c| c.table_name.as_deref());
    let adopted = match report.adopted {
        0 => String::new(),
        n => format!(
            " ({n} adopted from {})",
            table.unwrap_or("_sqlx_migrations")
        ),
    };
    out(&match report.applied.len() {
        0 => format!(
            "nothing to do: {} already applied{adopted}",
            report.already_applied
        ),
        n => format!(
            "{n} applied, {} already applied{adopted}",
            report.already_applied
        ),
    });
    Ok(0)
}

async fn baseline(o: Opened<'_>, to: Option<i64>) -> Result<u8, dblock::Error> {
    // Named before adopting: the files that differ from what sqlx applied.
    let status = o.runner().status().await?;
    let differing: Vec<i64> = status
        .entries
        .iter()
        .filter(|e| e.state == State::Edited && e.recorded_by.is_some())
        .map(|e| e.version)
        .collect();
    let adopted = o.runner().baseline(to).await?;
    for m in &adopted {
        let note = if differing.contains(&m.version()) {
            "  (differs from what sqlx applied: accepted as it is now)"
        } else {
            ""
        };
        out(&format!("adopted  {}{note}", m.file_name()));
    }
    out(&format!(
        "{} adopted: recorded as applied without running them",
        adopted.len()
    ));
    Ok(0)
}

async fn revert(o: Opened<'_>, to: Option<i64>) -> Result<u8, dblock::Error> {
    let reverted = o
        .runner()
        .on_applied(|m| out(&format!("reverted {}  ({})", m.file_name, show(m.duration))))
        .revert(to)
        .await?;
    out(&match reverted.len() {
        0 => "nothing to revert".to_string(),
        n => format!("{n} reverted"),
    });
    Ok(0)
}

fn new(name: &str, dir: &Path) -> Result<u8, dblock::Error> {
    let io = |context: String| move |source| dblock::Error::Io { context, source };
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let set = Migrations::from_dir(dir)?;
    for name in set.new_file_names(name)? {
        let path = dir.join(&name);
        let body = if name.ends_with(".down.sql") {
            "-- Revert the migration of the .up.sql beside this file.\n"
        } else {
            "-- Add the migration here.\n"
        };
        // create_new: never overwrite a file that appeared meanwhile.
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|mut f| f.write_all(body.as_bytes()))
            .map_err(io(format!("creating {}", path.display())))?;
        out(&path.display().to_string());
    }
    Ok(0)
}

async fn status(o: Opened<'_>) -> Result<u8, dblock::Error> {
    let dir = o.dir;
    let status = o.runner().status().await?;
    let label = |e: &StatusEntry| match &e.file_name {
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
        out(status_line(e, &label(e), width, dir).trim_end());
    }
    let mut counts: Vec<String> = [
        State::Applied,
        State::Pending,
        State::Edited,
        State::Unknown,
    ]
    .into_iter()
    .map(|s| format!("{} {s}", status.count(s)))
    .collect();
    // Shown only when there are any, so the usual line stays as it always was.
    for s in [State::Interrupted, State::Applying] {
        if status.count(s) > 0 {
            counts.push(format!("{} {s}", status.count(s)));
        }
    }
    out(&counts.join(", "));
    let shown = |why: &str| {
        why.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace(" DIR", &format!(" {}", dir.display()))
    };
    if let Some(why) = status.foreign.as_deref().or(status.interrupted.as_deref()) {
        errln!("dblock: a run would refuse: {}", shown(why));
        return Ok(EXIT_BAD_MIGRATIONS);
    }
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

/// One entry of `migrate status`: its state, file, when, and what to know of it.
fn status_line(e: &StatusEntry, label: &str, width: usize, dir: &Path) -> String {
    let when = e.applied_at.as_deref().unwrap_or_default();
    let took = e.duration.map(show).unwrap_or_default();
    let by = match e.recorded_by {
        Some(tool) if e.state == State::Applied => {
            format!("  (by {tool}; adopted by the next run)")
        }
        Some(tool) if e.state == State::Edited => format!("  (by {tool})"),
        _ => String::new(),
    };
    let progress = match e.progress {
        Some((k, n)) => format!(" ({k} of {n} statements completed)"),
        None => String::new(),
    };
    match e.state {
        State::Applied => format!("applied  {label:width$}  {when}  {took}{by}"),
        State::Pending if e.no_transaction => format!("pending  {label}  (no transaction)"),
        State::Pending => format!("pending  {label}"),
        State::Edited => {
            format!("edited   {label:width$}  {when}  the file changed since it was applied{by}")
        }
        State::Unknown => format!(
            "unknown  {label:width$}  {when}  applied, but not in {}",
            dir.display()
        ),
        State::Interrupted => format!(
            "interrupted  {label:width$}  {when}  started outside a transaction and never \
             finished{progress}: a run refuses until it is resolved"
        ),
        State::Applying => {
            format!("applying  {label:width$}  {when}  being applied now{progress}")
        }
        _ => format!("{:8} {label}", e.state.to_string()),
    }
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
