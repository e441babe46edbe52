//! Regressions of issue 9 at the command line: `dblock run` with waits that dblock makes
//! on its own behalf, and waits longer than the server's largest timeout. Real
//! PostgreSQL (DATABASE_URL), real processes; every wait bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::Duration;

use dblock_testkit::{PgDatabase, PgSchema, exit_code as code};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// Runs `dblock ARGS` to its end, at most `secs` seconds (then it is killed and the test
/// fails).
async fn run(state: &std::path::Path, secs: u64, args: &[&str]) -> Output {
    let child = dblock_testkit::dblock_command(DBLOCK, state)
        .args(args)
        .output();
    match tokio::time::timeout(Duration::from_secs(secs), child).await {
        Ok(out) => out.unwrap(),
        Err(_) => panic!("dblock {args:?} still running after {secs} s"),
    }
}

/// Item 2 (revised by issue 22): `run --no-wait` is fenced by default, and dblock creates
/// its fencing table under a set-up lock of its own: behind a running migration it runs
/// at once, neither hanging nor failing.
#[tokio::test]
async fn run_no_wait_does_not_wait_behind_a_running_migration() {
    let db = PgDatabase::new("cli_fence_migr").await;
    let state = tempfile::tempdir().unwrap();
    let migrator = db.admin().await;
    let key = dblock::migrate::MIGRATION_LOCK_KEY;
    migrator
        .batch_execute(&format!("SELECT pg_advisory_lock({key})"))
        .await
        .unwrap();
    let out = run(
        state.path(),
        20,
        &["run", "--db", &db.url, "--no-wait", "job", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stderr.is_empty(), "{out:?}");
}

/// Item 7: `--wait 597h` (beyond 2³¹ − 1 ms) on a free lock runs the command.
#[tokio::test]
async fn run_with_a_wait_beyond_the_servers_timeout_limit_runs() {
    let s = PgSchema::new("cli_long_wait").await;
    let state = tempfile::tempdir().unwrap();
    for extra in [&[][..], &["--no-fencing"][..]] {
        let mut args = vec!["run", "--db", &s.url, "--wait", "597h"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["job", "--", "true"]);
        let out = run(state.path(), 20, &args).await;
        assert_eq!(
            code(&out),
            0,
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
