//! `dblock doctor`: what the database a URL names does for dblock, a line a check, each
//! with a verdict and, where something is wrong, the fix (`dblock::Locks::doctor`).
//!
//! Exit codes, as monitoring plugins have them: 0 every check ok, 1 a warning (and no
//! failure), 2 a failure; the usual codes when the database cannot be reached at all
//! (69) or the URL is bad (64).

use clap::Args;
use dblock::doctor::{Diagnosis, Verdict};

use crate::{exit_code, one_line};

/// Every check came out well.
pub const EXIT_OK: u8 = 0;
/// At least one check warns, none fails.
pub const EXIT_WARN: u8 = 1;
/// At least one check fails.
pub const EXIT_FAIL: u8 = 2;

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// Database URL (as for `run`); default from the environment, else the embedded file.
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// The connections your handles may open (`Builder::max_connections`), for the
    /// lock-table check; dblock's default (64) unless given.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,

    /// The shared connections your handles multiplex session locks on
    /// (`Builder::multiplex`), for the lock-table check.
    #[arg(long, value_name = "N")]
    multiplex: Option<usize>,

    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn doctor(args: DoctorArgs) -> u8 {
    let mut builder = dblock::Locks::builder();
    if let Some(url) = &args.db {
        builder = builder.url(url);
    }
    if let Some(n) = args.max_connections {
        builder = builder.max_connections(n);
    }
    if let Some(n) = args.multiplex {
        builder = builder.multiplex(n);
    }
    let report = match builder.build().await {
        Ok(locks) => locks.doctor().await,
        Err(e) => Err(e),
    };
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            errln!("dblock: {}", one_line(&e));
            return exit_code(&e);
        }
    };
    match args.json {
        true => match serde_json::to_string_pretty(&report) {
            Ok(text) => outln!("{text}"),
            Err(e) => {
                errln!("dblock: {e}");
                return crate::EXIT_UNEXPECTED;
            }
        },
        false => print(&report),
    }
    match report.verdict {
        Verdict::Ok => EXIT_OK,
        Verdict::Warn => EXIT_WARN,
        Verdict::Fail => EXIT_FAIL,
    }
}

/// The report as text: a line a check, its fix indented under it.
fn print(report: &Diagnosis) {
    for c in &report.checks {
        outln!(
            "{:<4}  {:<16}  {}",
            c.verdict.as_str(),
            c.name,
            crate::status::shown(&c.detail)
        );
        if let Some(fix) = &c.fix {
            outln!("{:<4}  {:<16}  fix: {}", "", "", crate::status::shown(fix));
        }
    }
    let (warns, fails) = report
        .checks
        .iter()
        .fold((0, 0), |(w, f), c| match c.verdict {
            Verdict::Warn => (w + 1, f),
            Verdict::Fail => (w, f + 1),
            _ => (w, f),
        });
    outln!(
        "{}: {} checks, {warns} warnings, {fails} failures",
        report.backend,
        report.checks.len()
    );
}
