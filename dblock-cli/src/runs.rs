//! `dblock runs NAME`: the recent claimed slots of a name (`dblock run --once-per` or
//! `--slot`, `Locks::once_per`), as text or the documented JSON (`docs/scheduled-jobs.md`):
//! did last night's report run, where, and did it succeed?

use std::time::{Duration, SystemTime};

use clap::Args;
use dblock::jobs::{Outcome, Run};
use serde::Serialize;

use crate::run::time;
use crate::status::shown;
use crate::{EXIT_USAGE, exit_code, one_line};

#[derive(Args, Debug)]
pub struct RunsArgs {
    /// Database URL (as for `run`).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Namespace the NAME is keyed in (as for `run`).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,

    /// Print the documented JSON shape (docs/scheduled-jobs.md) instead of text.
    #[arg(long)]
    json: bool,

    /// How many of the most recent claims to show (at most 100, all that are kept).
    #[arg(long, value_name = "N", default_value_t = 20,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(dblock::jobs::RUNS_KEPT)))]
    last: u32,

    /// The name (as given to `dblock run`).
    #[arg(value_name = "NAME")]
    name: String,
}

/// `dblock runs --json`: version 1 of the shape.
#[derive(Serialize)]
struct Shown<'a> {
    version: u32,
    backend: &'a str,
    namespace: &'a str,
    name: &'a str,
    runs: Vec<RunJson<'a>>,
}

#[derive(Serialize)]
struct RunJson<'a> {
    slot: &'a str,
    attempt: u32,
    /// `succeeded`, `failed`, `running` or `no-outcome`.
    outcome: &'static str,
    exit_code: Option<i32>,
    host: &'a str,
    pid: u32,
    program: &'a str,
    started: String,
    started_ms: u128,
    finished: Option<String>,
    finished_ms: Option<u128>,
}

pub async fn runs(args: RunsArgs) -> u8 {
    if let Err(e) = dblock::Key::new(args.namespace.as_deref().unwrap_or("x"), &args.name) {
        errln!("dblock: {}", one_line(&e));
        return EXIT_USAGE;
    }
    let locks = match crate::status::open(args.db.as_deref(), args.namespace.as_deref()).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    let rows = match locks.runs(&args.name, args.last).await {
        Ok(r) => r,
        Err(e) => {
            errln!("dblock: {}", one_line(&e));
            return exit_code(&e);
        }
    };
    // The newest claim without an outcome is under way while the name's lock is held.
    let held = match rows.first().map(Run::outcome) {
        Some(Outcome::Unfinished) => crate::status::holders_of(&locks, &args.name, false)
            .await
            .is_some(),
        _ => false,
    };
    let state = |i: usize, r: &Run| match r.outcome() {
        Outcome::Succeeded => "succeeded",
        Outcome::Failed { .. } => "failed",
        Outcome::Unfinished if i == 0 && held => "running",
        _ => "no-outcome",
    };
    if args.json {
        let shown = Shown {
            version: 1,
            backend: locks.backend_name(),
            namespace: locks.namespace(),
            name: &args.name,
            runs: rows
                .iter()
                .enumerate()
                .map(|(i, r)| RunJson {
                    slot: &r.slot,
                    attempt: r.attempt,
                    outcome: state(i, r),
                    exit_code: r.exit_code,
                    host: &r.host,
                    pid: r.pid,
                    program: &r.program,
                    started: time(Some(r.started)),
                    started_ms: unix_ms(r.started),
                    finished: r.finished.map(|t| time(Some(t))),
                    finished_ms: r.finished.map(unix_ms),
                })
                .collect(),
        };
        match serde_json::to_string(&shown) {
            Ok(text) => outln!("{text}"),
            Err(e) => {
                errln!("dblock: {e}");
                return crate::EXIT_UNAVAILABLE;
            }
        }
        return 0;
    }
    if rows.is_empty() {
        outln!(
            "no runs of {} recorded (namespace {})",
            crate::status::quoted(&args.name),
            shown(locks.namespace())
        );
        return 0;
    }
    for (i, r) in rows.iter().enumerate() {
        outln!("{}", run_line(r, state(i, r)));
    }
    0
}

/// `SLOT  attempt N  succeeded (exit 0)  by program[pid]@host  started T  took 2.1s`,
/// every text escaped.
fn run_line(r: &Run, state: &str) -> String {
    let outcome = match r.exit_code.filter(|_| r.finished.is_some()) {
        Some(c) => format!("{state} (exit {c})"),
        None => state.to_string(),
    };
    let took = match r.finished {
        Some(f) => format!(
            ", took {}",
            crate::status::show_age(f.duration_since(r.started).unwrap_or(Duration::ZERO))
        ),
        None => String::new(),
    };
    format!(
        "{}  attempt {}  {outcome}  by {}  started {}{took}",
        shown(&r.slot),
        r.attempt,
        shown(&r.holder()),
        time(Some(r.started)),
    )
}

fn unix_ms(t: SystemTime) -> u128 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}
