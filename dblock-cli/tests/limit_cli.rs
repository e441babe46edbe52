//! `dblock run --limit N`: a semaphore from the command line, on every backend.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::{Duration, Instant};

use dblock_testkit::{MyDb, PgSchema, SqliteDb, exit_code as code, one_line_error};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn run(state: &std::path::Path, args: &[&str]) -> Output {
    dblock_testkit::dblock_command(DBLOCK, state)
        .args(args)
        .output()
        .await
        .unwrap()
}

/// With both slots of a limit-2 semaphore held, `run --limit 2` is refused (at once, or
/// after its wait); with one freed it runs in that slot, told which in `DBLOCK_SLOT`, with
/// a fencing token; `--limit 3` fits beside the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_a_limit_takes_a_free_slot_or_exits_75() {
    let pg = PgSchema::new("cli_limit").await;
    let my = MyDb::new("cli_limit").await;
    let sqlite = SqliteDb::new();
    let state = tempfile::tempdir().unwrap();
    let state = state.path();
    for url in [pg.url.as_str(), my.url.as_str(), sqlite.url.as_str()] {
        let locks = dblock::Locks::connect(url).await.unwrap();
        let a = locks.semaphore("exports", 2).lock().await.unwrap();
        let b = locks.semaphore("exports", 2).lock().await.unwrap();
        let base = ["run", "--db", url, "--limit", "2"];
        let out = run(
            state,
            &[&base[..], &["--no-wait", "exports", "--", "true"]].concat(),
        )
        .await;
        assert_eq!(code(&out), 75, "{url}: {out:?}");
        assert!(
            one_line_error(&out).contains("all 2 slots held by other processes"),
            "{out:?}"
        );
        let t = Instant::now();
        let out = run(
            state,
            &[&base[..], &["--wait", "300ms", "exports", "--", "true"]].concat(),
        )
        .await;
        assert_eq!(code(&out), 75, "{url}: {out:?}");
        assert!(t.elapsed() >= Duration::from_millis(300));
        let wider = run(
            state,
            &[
                "run",
                "--db",
                url,
                "--limit",
                "3",
                "--no-wait",
                "exports",
                "--",
                "sh",
                "-c",
                "test \"$DBLOCK_SLOT\" = 2",
            ],
        )
        .await;
        assert_eq!(code(&wider), 0, "{url}: limit 3 takes slot 2: {wider:?}");
        let freed = b.slot();
        b.release().await.unwrap();
        let check = format!(
            "test \"$DBLOCK_SLOT\" = {freed} && test -n \"$DBLOCK_FENCING_TOKEN\" && test \"$DBLOCK_NAME\" = exports"
        );
        let out = run(
            state,
            &[
                &base[..],
                &["--no-wait", "exports", "--", "sh", "-c", &check],
            ]
            .concat(),
        )
        .await;
        assert_eq!(code(&out), 0, "{url}: runs in the freed slot: {out:?}");
        drop(a);
    }
    let out = run(
        state,
        &[
            "run",
            "--db",
            &sqlite.url,
            "--limit",
            "2",
            "--shared",
            "x",
            "--",
            "true",
        ],
    )
    .await;
    assert_eq!(code(&out), 64, "--limit and --shared conflict: {out:?}");
}
