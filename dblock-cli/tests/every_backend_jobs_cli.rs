//! `dblock run --once-per` / `--slot` as real processes on every backend, from one source
//! (`every_backend!`, each test with a database of its own): eight processes whose starts
//! are spread across a slot, as skewed clocks spread a cron's, run the command exactly
//! once per slot over three slots (and without `--once-per`, more than once);
//! `--retry-failed` after a failing run and after a SIGKILLed claimant (and never beside
//! a live one); `--max-runtime` stops a command that ignores SIGTERM, holding the lock
//! until it has exited; claims on fresh databases create the record without an error.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Output;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dblock_testkit::{TestDb, eventually, exit_code as code};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// The period of the spread test: long enough that a start delayed by a loaded machine
/// (process start-up, connecting) stays in its slot (see `spread_offsets`).
const PERIOD_SECS: u64 = 4;

/// `dblock ARGS…`, to its end (60 s at most), with a clean environment.
async fn dblock(args: &[&str]) -> Output {
    let state = tempfile::tempdir().unwrap();
    dblock_testkit::dblock_output(DBLOCK, state.path(), &[], args).await
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// The lines of `path` (none if it does not exist).
fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .map(|s| s.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The arguments of `dblock run --db URL OPTS… NAME -- sh -c SCRIPT`.
fn run_sh(db: &TestDb, opts: &[&str], name: &str, script: &str) -> Vec<String> {
    let mut args = vec!["run", "--db", db.url()];
    args.extend(opts);
    args.extend([name, "--", "sh", "-c", script]);
    to_strings(&args)
}

/// `dblock run --db URL OPTS… NAME -- sh -c SCRIPT`, to its end.
async fn run(db: &TestDb, opts: &[&str], name: &str, script: &str) -> Output {
    let args = run_sh(db, opts, name, script);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    dblock(&args).await
}

/// `dblock ARGS…` started at `at` (this host's clock, which the local servers share).
fn start_at(at: SystemTime, args: Vec<String>) -> tokio::task::JoinHandle<Output> {
    tokio::spawn(async move {
        let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
        tokio::time::sleep(wait).await;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        dblock(&args).await
    })
}

/// Eight starts spread from 1.2 s before a boundary to 0.6 s after it, as cron on hosts
/// whose clocks differ by up to 1.8 s would start them. Each process reads the slot a
/// little after it starts (start-up, connecting): rounding to the nearest boundary keeps
/// it in the boundary's slot while that delay stays under 1.4 s (half the period less
/// 0.6 s).
fn spread_offsets() -> Vec<i64> {
    (0..8).map(|i| -1200 + i * 1800 / 7).collect()
}

fn shifted(t: SystemTime, ms: i64) -> SystemTime {
    match ms {
        ms if ms < 0 => t - Duration::from_millis(ms.unsigned_abs()),
        ms => t + Duration::from_millis(ms as u64),
    }
}

/// Three slots, eight processes each, their starts spread across the slot: the command
/// runs exactly once per slot, in that slot; the seven others of each slot exit with
/// `--skipped-exit` and say in one line who ran it. The control — the same schedule
/// without `--once-per`, a lock alone — runs the command more than once in one slot.
async fn eight_skewed_processes_run_the_command_once_per_slot(db: &TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let control = dir.path().join("control");
    let period = Duration::from_secs(PERIOD_SECS);
    // The first boundary at least 2.5 s ahead, so the earliest start is still ahead.
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let first = (now.as_secs() + 3) / PERIOD_SECS * PERIOD_SECS + PERIOD_SECS;
    let boundaries: Vec<SystemTime> = (0..3)
        .map(|k| UNIX_EPOCH + Duration::from_secs(first + k * PERIOD_SECS))
        .collect();
    let mut runs = Vec::new();
    for b in &boundaries {
        for off in spread_offsets() {
            let script = format!("echo \"$DBLOCK_RUN_SLOT\" >> {}", ran.display());
            let opts = ["--once-per", "4s", "--skipped-exit", "3"];
            let args = run_sh(db, &opts, "nightly", &script);
            runs.push((*b, start_at(shifted(*b, off), args)));
        }
    }
    let mut controls = Vec::new();
    for off in spread_offsets() {
        let args = run_sh(
            db,
            &[],
            "control",
            &format!("echo ran >> {}", control.display()),
        );
        controls.push(start_at(shifted(boundaries[0], off), args));
    }
    let mut won = std::collections::HashMap::new();
    for (b, r) in runs {
        let out = r.await.unwrap();
        match code(&out) {
            0 => *won.entry(dblock::jobs::slot_at(b, period)).or_insert(0) += 1,
            3 => {
                let err = stderr(&out);
                assert!(
                    err.lines().count() == 1 && err.contains("already claimed by dblock["),
                    "{err}"
                );
            }
            _ => panic!("neither ran nor skipped: {out:?}"),
        }
    }
    for c in controls {
        assert_eq!(code(&c.await.unwrap()), 0);
    }
    let expected: Vec<String> = boundaries
        .iter()
        .map(|b| dblock::jobs::slot_at(*b, period))
        .collect();
    assert_eq!(lines(&ran), expected, "once per slot, in its own slot");
    assert!(won.values().all(|&n| n == 1), "{won:?}");
    let without = lines(&control).len();
    assert!(
        without > 1,
        "the control (a lock, no --once-per) runs more than once: {without}"
    );
}

fn to_strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// Eight processes started at once with one `--slot`: one runs the command; `--quiet`
/// skips say nothing; `dblock runs --json` shows the one claim with its outcome.
async fn a_named_slot_runs_once_however_many_claim_it(db: &TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let cmd = format!(
        "echo \"$DBLOCK_RUN_SLOT $DBLOCK_RUN_ATTEMPT\" >> {}",
        ran.display()
    );
    let all: Vec<_> = (0..8)
        .map(|i| {
            let opts = match i % 2 {
                0 => vec!["--slot", "2026-05-01T02:00:00Z", "--quiet"],
                _ => vec!["--slot", "2026-05-01T02:00:00Z"],
            };
            start_at(SystemTime::now(), run_sh(db, &opts, "report", &cmd))
        })
        .collect();
    for (i, r) in all.into_iter().enumerate() {
        let out = r.await.unwrap();
        assert_eq!(code(&out), 0, "{out:?}");
        let err = stderr(&out);
        match i % 2 {
            0 => assert!(err.is_empty(), "--quiet: {err}"),
            _ => assert!(err.is_empty() || err.contains("already claimed"), "{err}"),
        }
    }
    assert_eq!(lines(&ran), ["2026-05-01T02:00:00Z 1"]);
    let out = dblock(&["runs", "--db", db.url(), "--json", "report"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["version"], 1);
    assert_eq!(v["backend"], db.backend());
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{v}");
    assert_eq!(runs[0]["slot"], "2026-05-01T02:00:00Z");
    assert_eq!(runs[0]["outcome"], "succeeded");
    assert_eq!(runs[0]["exit_code"], 0);
    assert_eq!(runs[0]["program"], "dblock");
    let text = dblock(&["runs", "--db", db.url(), "report"]).await;
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(
        text.starts_with("2026-05-01T02:00:00Z  attempt 1  succeeded (exit 0)  by dblock["),
        "{text}"
    );
}

/// A failed run is not run again by default (at most once); `--retry-failed` runs it
/// again as attempt 2, and once that succeeded, never again.
async fn retry_failed_runs_a_failed_slot_again_and_a_succeeded_one_never(db: &TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let out = run(db, &["--slot", "s-1"], "job", "exit 3").await;
    assert_eq!(code(&out), 3, "the command's own status: {out:?}");
    let out = run(db, &["--slot", "s-1"], "job", &format!("touch {d}/again")).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(stderr(&out).contains("which exited 3 at"), "{out:?}");
    assert!(
        !dir.path().join("again").exists(),
        "at most once by default"
    );
    let retry = ["--slot", "s-1", "--retry-failed"];
    let out = run(
        db,
        &retry,
        "job",
        &format!("echo $DBLOCK_RUN_ATTEMPT > {d}/attempt"),
    )
    .await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(lines(&dir.path().join("attempt")), ["2"]);
    let out = run(db, &retry, "job", &format!("touch {d}/third")).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(stderr(&out).contains("which exited 0 at"), "{out:?}");
    assert!(
        !dir.path().join("third").exists(),
        "a success is never run again"
    );
    let runs = db.locks().await.runs("job", 10).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].attempt, runs[0].exit_code), (2, Some(0)));
}

/// A claimant SIGKILLed mid-run leaves its claim without an outcome: while it lives, a
/// `--retry-failed` process never runs beside it (the lock is held); once it is dead, a
/// plain process skips (at most once) and a `--retry-failed` one runs it, attempt 2.
async fn retry_failed_runs_again_after_a_killed_claimant_never_beside_a_live_one(db: &TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let state = tempfile::tempdir().unwrap();
    let mut claimant = dblock_testkit::dblock_command(DBLOCK, state.path())
        .env("DBLOCK_NO_DEFAULT_NOTICE", "1")
        .args(run_sh(
            db,
            &["--slot", "s"],
            "job",
            &format!("echo $$ > {d}/pid; exec sleep 60"),
        ))
        .spawn()
        .unwrap();
    let pid_file = dir.path().join("pid");
    assert!(
        eventually(30, &mut || async { lines(&pid_file).len() == 1 }).await,
        "the claimant's command started"
    );
    let beside = format!("touch {d}/beside");
    let out = run(
        db,
        &["--slot", "s", "--retry-failed", "--wait", "1s"],
        "job",
        &beside,
    )
    .await;
    assert_eq!(
        code(&out),
        75,
        "not obtained while the claimant lives: {out:?}"
    );
    let out = run(db, &["--slot", "s", "--no-wait"], "job", &beside).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(stderr(&out).contains("still running"), "{out:?}");
    assert!(
        !dir.path().join("beside").exists(),
        "never beside a live claimant"
    );

    claimant.start_kill().unwrap(); // SIGKILL dblock; its command follows (PDEATHSIG)
    claimant.wait().await.unwrap();
    let pid = lines(&pid_file)[0].clone();
    assert!(
        eventually(30, &mut || async {
            !Path::new(&format!("/proc/{pid}")).exists() && db.holders("job").await == 0
        })
        .await,
        "the killed claimant's command ended and its lock went with it"
    );
    let out = run(db, &["--slot", "s"], "job", &beside).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(stderr(&out).contains("no outcome"), "{out:?}");
    assert!(
        !dir.path().join("beside").exists(),
        "at most once by default"
    );
    let attempt = format!("echo $DBLOCK_RUN_ATTEMPT > {d}/attempt");
    let out = run(db, &["--slot", "s", "--retry-failed"], "job", &attempt).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(lines(&dir.path().join("attempt")), ["2"]);
}

/// `--max-runtime`: a command that ignores SIGTERM is sent SIGKILL after `--grace`; the
/// lock stays held until it has exited; dblock exits 124 and records it.
async fn max_runtime_stops_a_command_that_ignores_sigterm(db: &TestDb) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let state = tempfile::tempdir().unwrap();
    // The trap notes SIGTERM and carries on: the shell runs it between two sleeps.
    let script =
        format!("trap 'echo term > {d}/term' TERM; echo $$ > {d}/pid; while :; do sleep 0.1; done");
    let runner = dblock_testkit::dblock_command(DBLOCK, state.path())
        .env("DBLOCK_NO_DEFAULT_NOTICE", "1")
        .args(run_sh(
            db,
            &["--slot", "s", "--max-runtime", "1s", "--grace", "5s"],
            "stubborn",
            &script,
        ))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let term = dir.path().join("term");
    assert!(
        eventually(30, &mut || async { term.exists() }).await,
        "SIGTERM sent once --max-runtime passed"
    );
    // Ignored: the command runs on, and the lock stays held.
    let out = run(db, &["--no-wait"], "stubborn", "true").await;
    assert_eq!(code(&out), 75, "held while the command runs on: {out:?}");
    let out = tokio::time::timeout(Duration::from_secs(60), runner.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(code(&out), 124, "{out:?}");
    assert!(
        stderr(&out).contains("ran past --max-runtime 1s"),
        "{out:?}"
    );
    let pid = lines(&dir.path().join("pid"))[0].clone();
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the command was killed before dblock exited"
    );
    assert!(
        eventually(10, &mut || async { db.holders("stubborn").await == 0 }).await,
        "and the lock is free"
    );
    let runs = db.locks().await.runs("stubborn", 1).await.unwrap();
    assert_eq!(runs[0].exit_code, Some(124), "{runs:?}");
}

/// Eight processes claim one slot at once on a database dblock has never seen, five
/// fresh databases: none fails creating the record, one runs the command.
async fn claims_on_a_fresh_database_create_the_record_without_an_error(db: &TestDb) {
    let dir = tempfile::tempdir().unwrap();
    for trial in 0..5 {
        let fresh;
        let db = match trial {
            0 => db,
            _ => {
                fresh = db.fresh("jobs_fresh").await;
                &fresh
            }
        };
        let ran = dir.path().join(format!("ran{trial}"));
        let cmd = format!("echo ran >> {}", ran.display());
        let all: Vec<_> = (0..8)
            .map(|i| {
                let opts = match i % 2 {
                    0 => vec!["--slot", "first"],
                    _ => vec!["--slot", "first", "--no-wait"],
                };
                start_at(SystemTime::now(), run_sh(db, &opts, "job", &cmd))
            })
            .collect();
        for r in all {
            let out = r.await.unwrap();
            let err = stderr(&out);
            // Ran, skipped — or, not waiting, found the lock held before the slot was
            // claimed: never an error in dblock's set-up.
            assert!(
                (code(&out) == 0 && (err.is_empty() || err.contains("already claimed")))
                    || (code(&out) == 75 && err.contains("--no-wait")),
                "trial {trial}: {out:?}"
            );
        }
        assert_eq!(lines(&ran).len(), 1, "trial {trial}: once");
    }
}

dblock_testkit::every_backend!(
    eight_skewed_processes_run_the_command_once_per_slot,
    a_named_slot_runs_once_however_many_claim_it,
    retry_failed_runs_a_failed_slot_again_and_a_succeeded_one_never,
    retry_failed_runs_again_after_a_killed_claimant_never_beside_a_live_one,
    max_runtime_stops_a_command_that_ignores_sigterm,
);

dblock_testkit::every_backend!(own_database: claims_on_a_fresh_database_create_the_record_without_an_error);

/// Bad input is one line and exit 64, before anything is opened.
#[tokio::test]
async fn bad_claims_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("l.db").display());
    for (args, says) in [
        (vec!["--once-per", "0s"], "at least a second"),
        (vec!["--once-per", "500ms"], "at least a second"),
        (vec!["--once-per=-1s"], "negative"),
        (
            vec!["--once-per", "1h", "--limit", "2"],
            "cannot be used with",
        ),
        (vec!["--once-per", "1h", "--shared"], "cannot be used with"),
        (
            vec!["--once-per", "1h", "--slot", "x"],
            "cannot be used with",
        ),
        (vec!["--slot", ""], "empty"),
        (vec!["--slot", "  "], "empty"),
        (vec!["--retry-failed"], "--once-per"),
        (vec!["--skipped-exit", "3"], "--once-per"),
        (vec!["--skipped-exit", "300", "--slot", "x"], "300"),
    ] {
        let mut all = vec!["run", "--db", &url];
        all.extend(&args);
        all.extend(["job", "--", "true"]);
        let out = dblock(&all).await;
        assert_eq!(code(&out), 64, "{args:?}: {out:?}");
        let line = dblock_testkit::one_line_error(&out);
        assert!(line.contains(says), "{args:?}: {line}");
    }
    assert!(!dir.path().join("l.db").exists(), "nothing opened");
}
