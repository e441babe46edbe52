//! COMMAND never runs outside the lock, even when dblock itself is SIGKILLed under heavy
//! process churn: the kill -9 storm, on every backend, with its control.
//!
//! Four loops run `dblock run NAME -- read-sleep-write` on one counter file, each
//! section logging its start (the value it read, its fencing token, its dblock's pid)
//! and its end (the value it wrote). A killer SIGKILLs the dblock of the running section
//! at random moments, while two loops fork `/bin/true` as fast as they can. Half the
//! sections do their work in a child of COMMAND (a subshell), which the parent-death
//! signal does not reach — as in a shell script — so a section whose dblock was killed
//! finishes its write later. Each run must leave the counter strictly increasing and
//! no section may start before the previous one has ended (if it ever does). The
//! control is the same storm with COMMAND not inheriting the lock's descriptor
//! (`DBLOCK_RUN_NO_INHERIT=1`, the old behaviour): there the next holder is granted
//! while the killed holder's work still runs.
//!
//! Each log line ends with the section's kind (`direct` or `subshell`), so a violation
//! says which. The control's overlaps come from the subshell sections: the race the
//! issue saw with COMMAND itself (its dblock's descriptors closed before the
//! parent-death signal reached it, under heavier churn) was not reproduced on the test
//! machine — 0 overlaps in 30 s of direct-only sections per backend, about 1,000
//! sections and 600 kills in all, at load 8–12 — so the test shows the descriptor
//! closing the subshell case, and the direct case is covered by construction (COMMAND
//! holds the same descriptor).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dblock_testkit::{MyDb, PgSchema, SqliteDb};
use tokio::process::Command;

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// One section: read the counter, say so, work a while, write it + 1 (by rename, so that
/// a section killed mid-write leaves the old value, not an empty file), say so. `$PPID`
/// is the shell's parent, dblock, in the subshell too.
const SECTION: &str = r#"n=$(cat "$C"); echo "start $n $DBLOCK_FENCING_TOKEN $PPID ${K:-direct}" >> "$L"; sleep 0.05; echo $((n+1)) > "$C.new" && mv "$C.new" "$C" && echo "end $((n+1)) $DBLOCK_FENCING_TOKEN ${K:-direct}" >> "$L""#;

/// What a storm found.
#[derive(Debug, Default)]
struct Report {
    sections: usize,
    /// Runs whose dblock the killer SIGKILLed (mostly while its section ran).
    kills: usize,
    /// A section that ended after the next one started, or a value written twice or
    /// going back.
    violations: Vec<String>,
    /// Runs that ended otherwise than by their command's success or the killer.
    errors: Vec<String>,
}

/// Reads the log: every `end` of a section must come before the next section's
/// `start`, and the values written must rise strictly.
fn analyse(log: &str) -> (usize, Vec<String>) {
    let mut violations = Vec::new();
    let mut last_start: Option<String> = None;
    let mut started = 0;
    let mut last_written: Option<i64> = None;
    for line in log.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first() {
            Some(&"start") => {
                started += 1;
                last_start = f.get(2).map(|t| t.to_string());
            }
            Some(&"end") => {
                let token = f.get(2).copied().unwrap_or("");
                if last_start.as_deref() != Some(token) {
                    violations.push(format!(
                        "section {token} ended after section {} started: {line}",
                        last_start.as_deref().unwrap_or("?")
                    ));
                }
                let value: i64 = f.get(1).and_then(|v| v.parse().ok()).unwrap_or(-1);
                if last_written.is_some_and(|w| value <= w) {
                    violations.push(format!("wrote {value} after {last_written:?}: {line}"));
                }
                last_written = Some(value);
            }
            _ => {}
        }
    }
    (started, violations)
}

/// The pid of the dblock of the last section started, if it has not ended.
fn running(log: &str) -> Option<u32> {
    let last = log.lines().rev().find(|l| !l.is_empty())?;
    let f: Vec<&str> = last.split_whitespace().collect();
    (f.first() == Some(&"start")).then(|| f.get(3)?.parse().ok())?
}

async fn storm(url: &str, inherit: bool, secs: u64, stop_at_first_violation: bool) -> Report {
    let dir = tempfile::tempdir().unwrap();
    let counter = dir.path().join("counter");
    let log = dir.path().join("log");
    std::fs::write(&counter, "0\n").unwrap();
    std::fs::write(&log, "").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);

    // The churn beside it: two loops forking /bin/true.
    let mut churn: Vec<_> = (0..2)
        .map(|_| {
            Command::new("sh")
                .args(["-c", "while :; do /bin/true; done"])
                .kill_on_drop(true)
                .spawn()
                .unwrap()
        })
        .collect();

    let mut loops = Vec::new();
    for w in 0..4 {
        let (url, counter, log, state, stop) = (
            url.to_string(),
            counter.clone(),
            log.clone(),
            dir.path().to_path_buf(),
            stop.clone(),
        );
        loops.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            let mut killed_runs = 0;
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) && tokio::time::Instant::now() < deadline {
                // Half the sections do their work in a subshell, out of the reach of the
                // parent-death signal.
                let script = match (w + i) % 2 {
                    0 => SECTION.to_string(),
                    _ => format!("K=subshell; ( {SECTION} ) & wait"),
                };
                i += 1;
                let mut c = run_command(&state, &url, &script, &counter, &log, inherit);
                let out = c.output();
                let out = tokio::time::timeout(Duration::from_secs(60), out)
                    .await
                    .expect("a run ended within 60 s")
                    .unwrap();
                match out.status.code() {
                    None => killed_runs += 1,
                    Some(0) => {}
                    Some(_) => errors.push(format!("{out:?}")),
                }
            }
            (errors, killed_runs)
        }));
    }

    // The killer: the running section's dblock, at a random moment of it, about every
    // other section.
    let mut rng = fastrand::Rng::with_seed(u64::from(inherit) + secs);
    while tokio::time::Instant::now() < deadline && !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(rng.u64(20..90))).await;
        let text = std::fs::read_to_string(&log).unwrap();
        if stop_at_first_violation && !analyse(&text).1.is_empty() {
            stop.store(true, Ordering::SeqCst);
            break;
        }
        if let Some(pid) = running(&text) {
            tokio::time::sleep(Duration::from_millis(rng.u64(0..40))).await;
            // The dblock processes are this test's children: a pid that ended is not
            // reused before it is reaped by its loop, which waits for it.
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut report = Report::default();
    for l in loops {
        let (errors, killed) = l.await.unwrap();
        report.errors.extend(errors);
        report.kills += killed;
    }
    for c in &mut churn {
        let _ = c.start_kill();
    }
    // The work of a section whose dblock was killed may still be running: let it end.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    let (sections, violations) = analyse(&text);
    if std::env::var_os("STORM_DEBUG").is_some() {
        eprintln!("{text}");
    }
    report.sections = sections;
    report.violations = violations;
    report
}

fn run_command(
    state: &Path,
    url: &str,
    script: &str,
    counter: &Path,
    log: &Path,
    inherit: bool,
) -> Command {
    let mut c = dblock_testkit::dblock_command(DBLOCK, state);
    c.env("DBLOCK_NO_DEFAULT_NOTICE", "1")
        .env("C", counter)
        .env("L", log)
        .args(["run", "--db", url, "storm", "--", "sh", "-c", script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    match inherit {
        true => c.env_remove("DBLOCK_RUN_NO_INHERIT"),
        false => c.env("DBLOCK_RUN_NO_INHERIT", "1"),
    };
    c
}

async fn storm_and_control(backend: &str, url: &str) {
    let r = storm(url, true, 5, false).await;
    eprintln!(
        "{backend}: {} sections, {} killed, {} violations, {} errors",
        r.sections,
        r.kills,
        r.violations.len(),
        r.errors.len()
    );
    assert!(r.errors.is_empty(), "{backend}: {:?}", r.errors);
    assert!(
        r.violations.is_empty(),
        "{backend}: a section ran outside the lock: {:?}",
        r.violations
    );
    assert!(
        r.sections >= 20 && r.kills >= 10,
        "{backend}: the storm must do something: {r:?}"
    );
    // Control: without the inherited descriptor, the next holder gets the lock while a
    // killed holder's work still runs.
    let c = storm(url, false, 10, true).await;
    eprintln!(
        "{backend} control: {} sections, {} killed, {} violations: {:?}",
        c.sections,
        c.kills,
        c.violations.len(),
        c.violations.first()
    );
    assert!(
        !c.violations.is_empty(),
        "{backend} control: the storm must show the race without the inherited descriptor: \
         {c:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_dblocks_command_never_runs_outside_the_lock_on_postgres() {
    let s = PgSchema::new("storm").await;
    storm_and_control("postgres", &s.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_dblocks_command_never_runs_outside_the_lock_on_mysql() {
    let db = MyDb::new("storm").await;
    storm_and_control("mysql", &db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_dblocks_command_never_runs_outside_the_lock_on_sqlite() {
    let db = SqliteDb::new();
    storm_and_control("sqlite", &db.url).await;
}
