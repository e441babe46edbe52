//! `dblock`: run a command under a named lock shared by every process of a database.
//!
//! ```text
//! dblock run [--db URL] [--namespace NS] [--wait DURATION | --no-wait] [--shared | --limit N]
//!            [--once-per DURATION | --slot TEXT] [--retry-failed] [--skipped-exit N] [--quiet]
//!            [--max-runtime DURATION] [--grace DURATION] [--no-fencing] NAME -- COMMAND [ARGS...]
//! dblock runs [--db URL] [--namespace NS] [--last N] [--json] NAME
//! dblock key [--namespace NS] [--limit N] NAME
//! dblock status [--db URL] [--namespace NS] [NAME...] [--json] [--watch]
//! dblock release [--db URL] [--namespace NS] NAME --force
//! dblock migrate [--db URL] [--ignore-missing] DIR [--dry-run]
//! dblock migrate status [--db URL] [--ignore-missing] DIR
//! dblock setup [--db URL] [--grant ROLE]...
//! dblock doctor [--db URL] [--max-connections N] [--multiplex N] [--json]
//! dblock exporter [--db URL] [--namespace NS] --listen ADDR [--name PATTERN]... [--group PATTERN]... [--election PATTERN]...
//! dblock migrate baseline [--db URL] DIR [--to VERSION]
//! dblock migrate revert [--db URL] DIR [--to VERSION]
//! dblock migrate new NAME [DIR]
//! ```
//!
//! Exit codes: COMMAND's own status (128+N when signal N ended it); 64 usage errors
//! (including a bad name or URL, options that do not go together, what the backend
//! lacks, and what a transaction-pooling pooler cannot do); 69 the database cannot be
//! reached or fails; 70 the lock was lost while COMMAND ran; 75 the lock was not
//! obtained; 76 the server answered something dblock cannot map (a bug: report it); 78
//! dblock's or the database's configuration cannot serve the request; 124 COMMAND ran
//! past `--max-runtime` and was stopped. With `--once-per`/`--slot`, a slot already
//! claimed: 0, or `--skipped-exit N`. `dblock doctor`: 0 every check ok, 1 a warning, 2
//! a failure.
//!
//! `dblock migrate`: 0 when everything is applied (including nothing to do); 65 for a
//! migration set that cannot be applied (a malformed file name, an edited migration,
//! applied versions DIR lacks, another tool's history that cannot be adopted as it
//! stands, a file that is not a regular file); 69 when the database cannot be reached or a migration
//! fails on it.

/// `println!` that never panics: output to a closed pipe (the reader went away) is
/// dropped, as a well-behaved command-line tool does.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `eprintln!` that never panics, and writes its line whole ([`write_whole`]).
macro_rules! errln {
    ($($arg:tt)*) => {{
        let _ = crate::write_whole(
            &mut std::io::stderr().lock(),
            format_args!($($arg)*),
            true,
        );
    }};
}

/// `eprint!` that never panics, and writes its text whole ([`write_whole`]).
macro_rules! err {
    ($($arg:tt)*) => {{
        let _ = crate::write_whole(
            &mut std::io::stderr().lock(),
            format_args!($($arg)*),
            false,
        );
    }};
}

/// Formats `args` (and a newline, if `newline`) first, then hands `w` the text in one
/// `write_all`. Standard error is unbuffered: `writeln!` to it makes one `write` per
/// piece of the format (five for the default-store notice), so the lines of several
/// `dblock run`s sharing one pipe or log file could interleave mid-line. One `write` of
/// up to `PIPE_BUF` bytes (4,096 on Linux) to a pipe is never interleaved with another.
pub(crate) fn write_whole(
    w: &mut impl std::io::Write,
    args: std::fmt::Arguments<'_>,
    newline: bool,
) -> std::io::Result<()> {
    let mut text = match args.as_str() {
        Some(s) => String::from(s),
        None => std::fmt::format(args),
    };
    if newline {
        text.push('\n');
    }
    w.write_all(text.as_bytes())
}

mod doctor;
mod duration;
mod exporter;
mod migrate;
mod notice;
mod run;
mod runs;
mod setup;
mod sqlx_toml;
mod status;
mod sys;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Usage error (sysexits EX_USAGE).
pub const EXIT_USAGE: u8 = 64;
/// The database cannot be reached or fails (EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: u8 = 69;
/// The lock was lost while the command ran (EX_SOFTWARE).
pub const EXIT_LOST: u8 = 70;
/// The lock was not obtained (EX_TEMPFAIL).
pub const EXIT_NOT_OBTAINED: u8 = 75;
/// The migration set cannot be applied as it is (EX_DATAERR).
pub const EXIT_BAD_MIGRATIONS: u8 = 65;
/// The server answered something dblock cannot map, or dblock broke a rule of its own: a
/// bug to report (EX_PROTOCOL).
pub const EXIT_UNEXPECTED: u8 = 76;
/// dblock's or the database's configuration cannot serve the request (EX_CONFIG).
pub const EXIT_CONFIG: u8 = 78;

#[derive(Parser, Debug)]
#[command(
    name = "dblock",
    version,
    about = "Named locks for every process sharing one database",
    long_about = "Named locks for every process sharing one database: PostgreSQL advisory \
                  locks, MySQL/MariaDB named locks, or an embedded SQLite file (the default) \
                  for the processes of one host."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run COMMAND while holding the lock NAME; exit with COMMAND's status. With
    /// --once-per or --slot, at most once per slot across every process.
    Run(run::RunArgs),
    /// Print the key of NAME, and where the database shows it (PostgreSQL's pg_locks,
    /// MySQL's named lock).
    Key(KeyArgs),
    /// Show who holds and who awaits locks (all, or the NAMEs given).
    Status(status::StatusArgs),
    /// Show the recent claimed slots of NAME (`run --once-per`/`--slot`): who ran each,
    /// when, and how it ended.
    Runs(runs::RunsArgs),
    /// Break lock NAME by ending its holder's database session (needs --force).
    Release(status::ReleaseArgs),
    /// Measure lock cycles against the floor of the same work done directly.
    Bench(BenchArgs),
    /// Apply the migrations in DIR the database lacks, under the database-wide
    /// migration lock; `migrate status DIR` shows where each stands.
    Migrate(migrate::MigrateArgs),
    /// Create dblock's fencing table once, as the schema's owner, and grant roles that
    /// may not create tables what fenced locks and leader election need.
    Setup(setup::SetupArgs),
    /// Check what the database does for dblock: server, engine, TLS, pooler, whether
    /// advisory locks exclude, dblock's tables and rights, the lock table, timeouts,
    /// the WAL timeline. Exit 0 all ok, 1 warnings, 2 failures.
    Doctor(doctor::DoctorArgs),
    /// Serve the fleet's view over HTTP: /metrics (Prometheus) and / (who holds what).
    Exporter(exporter::ExporterArgs),
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// Database URL (as for `run`).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Seconds per workload (and as many for its floor).
    #[arg(long, value_name = "N", default_value_t = 3.0)]
    seconds: f64,

    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,

    /// Run every worker on one thread (a current-thread runtime), so that the process
    /// has one thread: on the embedded file the floor is then exactly a C loop of
    /// `F_OFD_SETLK` (Linux counts no references to the open file in such a process).
    #[arg(long)]
    one_thread: bool,
}

#[derive(Args, Debug)]
struct KeyArgs {
    /// Namespace the name is keyed in.
    #[arg(long, value_name = "NS", default_value = dblock::DEFAULT_NAMESPACE)]
    namespace: String,

    /// The database whose tools to show the key's lock in (a mysql:// URL: the named
    /// lock, GET_LOCK's name, on that database); without it, where PostgreSQL's pg_locks
    /// shows it. Nothing is connected to.
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Print the keys of the N slots of the semaphore NAME (see dblock run --limit).
    #[arg(long, value_name = "N")]
    limit: Option<u32>,

    /// The lock name.
    #[arg(value_name = "NAME")]
    name: String,
}

/// The command line, parsed. `dblock run`, the command run most often and the one whose
/// start-up is on every use's path, is parsed against its own arguments alone (building
/// every subcommand's parser took a quarter of a millisecond); anything that does not
/// parse that way (help, a mistake) is parsed again in full, for the full message.
fn parse(argv: Vec<std::ffi::OsString>) -> Result<Cli, clap::Error> {
    use clap::FromArgMatches;
    if argv.get(1).is_some_and(|a| a == "run") {
        let cmd = run::RunArgs::augment_args(clap::Command::new("run"));
        if let Ok(args) = cmd
            .try_get_matches_from(&argv[1..])
            .and_then(|m| run::RunArgs::from_arg_matches(&m))
        {
            return Ok(Cli {
                command: Command::Run(args),
            });
        }
    }
    Cli::try_parse_from(argv)
}

fn main() -> ExitCode {
    let cli = match parse(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    ExitCode::SUCCESS
                }
                _ => {
                    let text = e.to_string();
                    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
                    let first = lines.next().unwrap_or("invalid arguments");
                    let first = first.strip_prefix("error: ").unwrap_or(first);
                    // "the following required arguments were not provided:" + the list.
                    let more = match (first.ends_with(':'), lines.next()) {
                        (true, Some(next)) => format!(" {}", next.trim()),
                        _ => String::new(),
                    };
                    errln!("dblock: {first}{more} (see dblock --help)");
                    ExitCode::from(EXIT_USAGE)
                }
            };
        }
    };
    let code = match cli.command {
        Command::Key(args) => key(&args),
        // Eight workers need more than one thread.
        Command::Bench(args) => block_on(!args.one_thread, bench(args)),
        // One thread: the command is forked from the main thread, whose death (with the
        // process) is what its parent-death signal follows.
        Command::Run(args) => block_on(false, run::run(args)),
        Command::Migrate(args) => migrate::main(args),
        Command::Setup(args) => block_on(false, setup::setup(args)),
        Command::Doctor(args) => block_on(false, doctor::doctor(args)),
        Command::Exporter(args) => block_on(false, exporter::exporter(args)),
        Command::Status(args) => block_on(false, status::status(args)),
        Command::Runs(args) => block_on(false, runs::runs(args)),
        Command::Release(args) => block_on(false, status::release(args)),
    };
    ExitCode::from(code)
}

fn key(args: &KeyArgs) -> u8 {
    if let Some(limit) = args.limit {
        return slot_keys(args, limit);
    }
    // Where the database (PostgreSQL's unless --db names another) shows the key's lock.
    match dblock::Key::new(&args.namespace, &args.name)
        .and_then(|k| Ok((k, k.shown_on(args.db.as_deref())?)))
    {
        Ok((key, shown)) => {
            outln!("key       {key}");
            match &shown.context {
                Some(c) => outln!("{:<9} {}   {c}", shown.listed_in, shown.id),
                None => outln!("{:<9} {}", shown.listed_in, shown.id),
            }
            outln!("query     {}", shown.query);
            0
        }
        Err(e) => {
            errln!("dblock: {}", crate::one_line(&e));
            exit_code(&e)
        }
    }
}

async fn bench(args: BenchArgs) -> u8 {
    if !(args.seconds > 0.0 && args.seconds <= 3600.0) {
        errln!("dblock: --seconds must be more than 0 and at most 3600");
        return EXIT_USAGE;
    }
    notice::embedded_default(args.db.as_deref());
    let mut builder = dblock::Locks::builder();
    if let Some(url) = &args.db {
        builder = builder.url(url);
    }
    let locks = match builder.build().await {
        Ok(l) => l,
        Err(e) => {
            errln!("dblock: {}", crate::one_line(&e));
            return exit_code(&e);
        }
    };
    use std::io::IsTerminal;
    let tty = std::io::stderr().is_terminal();
    let progress = |step: &str| {
        // One line rewritten in place on a terminal; a line per step in a log.
        match tty {
            true => err!("\r\x1b[2K{step}…"),
            false => errln!("{step}…"),
        }
    };
    let rows = match dblock::bench::run(&locks, args.seconds, progress).await {
        Ok(r) => r,
        Err(e) => {
            if tty {
                err!("\r\x1b[2K");
            }
            errln!("dblock: {}", crate::one_line(&e));
            return exit_code(&e);
        }
    };
    if tty {
        err!("\r\x1b[2K");
    }
    if args.json {
        match serde_json::to_string(&rows) {
            Ok(json) => outln!("{json}"),
            Err(e) => {
                errln!("dblock: cannot write the results as JSON: {e}");
                return EXIT_UNEXPECTED;
            }
        }
    } else {
        outln!(
            "{:<9} {:<12} {:>7} {:>11} {:>9} {:>9} {:>13} {:>7} {:>13} {:>13}",
            "backend",
            "workload",
            "workers",
            "ops/s",
            "p50 µs",
            "p99 µs",
            "floor ops/s",
            "ratio",
            "cpu µs u+s",
            "floor u+s"
        );
        for r in &rows {
            outln!(
                "{:<9} {:<12} {:>7} {:>11.0} {:>9.1} {:>9.1} {:>13.0} {:>7.2} {:>13} {:>13}",
                r.backend,
                r.workload,
                r.workers,
                r.ops_per_sec,
                r.p50_us,
                r.p99_us,
                r.floor_ops_per_sec,
                r.ratio(),
                cpu_cell(r.cpu_us),
                cpu_cell(r.floor_cpu_us)
            );
        }
        // Floor and dblock reach the server alike (checked on both): say how.
        if let Some(t) = rows.iter().find_map(|r| r.transport.as_deref()) {
            outln!("(dblock and its floor both connected with {t})");
        }
        // The kernel's work per `fcntl` depends on it (see `--one-thread`): say it.
        if let Some(n) = rows.iter().filter_map(|r| r.process_threads).max() {
            let s = if n == 1 { "" } else { "s" };
            outln!("(measured in a process of {n} thread{s})");
        }
        if rows.iter().any(|r| r.cpu_us.is_some()) {
            outln!("(cpu: this process's time a cycle, user + kernel, µs; a server's is its own)");
        }
    }
    0
}

/// A cycle's CPU time in `dblock bench`'s table: user + system microseconds, or `-`
/// where the platform does not tell.
fn cpu_cell(cpu: Option<dblock::bench::CpuPerCycle>) -> String {
    match cpu {
        Some(c) => format!("{:.2}+{:.2}", c.user, c.system),
        None => "-".into(),
    }
}

/// An error as one line, whatever the server put in its detail, and without a
/// terminal escape from a name or a server's message in it.
pub(crate) fn one_line(e: &dblock::Error) -> String {
    let text = e.to_string();
    let words = text.split_whitespace().collect::<Vec<_>>().join(" ");
    status::shown(&words).into_owned()
}

/// `dblock key --limit N`: the semaphore's slot keys, one a line.
fn slot_keys(args: &KeyArgs, limit: u32) -> u8 {
    if !(1..=dblock::MAX_SEMAPHORE_LIMIT).contains(&limit) {
        errln!(
            "dblock: --limit must be between 1 and {}",
            dblock::MAX_SEMAPHORE_LIMIT
        );
        return EXIT_USAGE;
    }
    for slot in 0..limit {
        let shown = dblock::Key::slot(&args.namespace, &args.name, slot)
            .and_then(|k| Ok((k, k.shown_on(args.db.as_deref())?)));
        match shown {
            Ok((key, shown)) => outln!(
                "slot {slot:<4} key {key:<20}  {} {}",
                shown.listed_in,
                shown.id
            ),
            Err(e) => {
                errln!("dblock: {}", crate::one_line(&e));
                return exit_code(&e);
            }
        }
    }
    0
}

/// Runs `f` to its exit code on a new tokio runtime: one thread unless `multi_thread`.
pub(crate) fn block_on(multi_thread: bool, f: impl std::future::Future<Output = u8>) -> u8 {
    let mut builder = match multi_thread {
        true => tokio::runtime::Builder::new_multi_thread(),
        false => tokio::runtime::Builder::new_current_thread(),
    };
    match builder.enable_all().build() {
        Ok(rt) => rt.block_on(f),
        Err(e) => {
            errln!("dblock: cannot start: {e}");
            EXIT_UNAVAILABLE
        }
    }
}

/// The exit code for a library error.
fn exit_code(e: &dblock::Error) -> u8 {
    match e {
        dblock::Error::InvalidName { .. }
        | dblock::Error::InvalidNamespace { .. }
        | dblock::Error::InvalidUrl { .. }
        | dblock::Error::InvalidRequest { .. }
        | dblock::Error::Unsupported { .. }
        | dblock::Error::BehindPooler { .. } => EXIT_USAGE,
        dblock::Error::Configuration { .. } => EXIT_CONFIG,
        dblock::Error::Unexpected { .. } => EXIT_UNEXPECTED,
        dblock::Error::LockLost { .. } => EXIT_LOST,
        // A role without a privilege: as for a server that refuses, with the fix named.
        dblock::Error::PermissionDenied { .. } => EXIT_UNAVAILABLE,
        _ => EXIT_UNAVAILABLE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that keeps each `write` call apart, as a pipe's reader would see them
    /// when several writers share it.
    #[derive(Default)]
    struct Calls(Vec<Vec<u8>>);

    impl std::io::Write for Calls {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_to_stderr_is_one_write() {
        let (path, name) = ("/var/tmp/dblock.db", "nightly");
        let mut calls = Calls::default();
        super::write_whole(
            &mut calls,
            format_args!("dblock: no --db: the embedded store {path}; {name} is local"),
            true,
        )
        .unwrap();
        let want = format!("dblock: no --db: the embedded store {path}; {name} is local\n");
        assert_eq!(calls.0, vec![want.as_bytes().to_vec()]);
        // The control: what `writeln!` did, one call per piece of the format.
        let mut control = Calls::default();
        use std::io::Write as _;
        writeln!(
            control,
            "dblock: no --db: the embedded store {path}; {name} is local"
        )
        .unwrap();
        assert!(control.0.len() > 1, "{:?}", control.0.len());
        assert_eq!(control.0.concat(), want.as_bytes());
    }

    fn argv(args: &[&str]) -> Vec<std::ffi::OsString> {
        std::iter::once("dblock")
            .chain(args.iter().copied())
            .map(Into::into)
            .collect()
    }

    /// `dblock run` parsed against its own arguments alone gives what the whole command
    /// line's parser gives, for every form of `run` (the shortcut is only a shortcut).
    #[test]
    fn run_parses_alone_as_in_the_whole_command_line() {
        for args in [
            &["run", "x", "--", "true"][..],
            &[
                "run",
                "--db",
                "sqlite:/tmp/x.db",
                "--no-wait",
                "x",
                "--",
                "sh",
                "-c",
                "echo",
            ],
            &[
                "run",
                "--wait",
                "5s",
                "--shared",
                "--namespace",
                "ns",
                "x",
                "--",
                "true",
            ],
            &[
                "run",
                "--limit",
                "3",
                "--no-fencing",
                "x",
                "--",
                "a",
                "--b",
                "-c",
            ],
            &[
                "run",
                "--once-per",
                "1h",
                "--retry-failed",
                "job",
                "--",
                "true",
            ],
            &["run", "--", "-dash", "--", "true"],
            &[
                "run",
                "--max-runtime",
                "10s",
                "--grace",
                "1s",
                "x",
                "--",
                "true",
            ],
        ] {
            let whole = Cli::try_parse_from(argv(args)).unwrap();
            let alone = parse(argv(args)).unwrap();
            assert_eq!(format!("{alone:?}"), format!("{whole:?}"), "{args:?}");
        }
    }

    /// What the shortcut cannot parse is parsed in full: the same error, the same help.
    #[test]
    fn run_errors_and_help_come_from_the_whole_command_line() {
        for args in [
            &["run"][..],
            &["run", "--help"],
            &["run", "--bogus", "x", "--", "true"],
            &["run", "--limit", "3", "--shared", "x", "--", "true"],
            &["run", "--wait", "soon", "x", "--", "true"],
        ] {
            let whole = Cli::try_parse_from(argv(args)).unwrap_err();
            let alone = parse(argv(args)).unwrap_err();
            assert_eq!(alone.kind(), whole.kind(), "{args:?}");
            assert_eq!(alone.to_string(), whole.to_string(), "{args:?}");
        }
    }
}
