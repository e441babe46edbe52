//! What `--wait` means on the command line, the same on every backend: `--wait 0s`
//! tries once, like `--no-wait`; the wait is for the lock, counted once connected, so a
//! short wait on a free lock runs; "held by" names a real holder.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;

use dblock_testkit::{MyDb, PgSchema, SqliteDb, exit_code as code, one_line_error};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn run(state: &std::path::Path, args: &[&str]) -> Output {
    dblock_testkit::dblock_output(DBLOCK, state, &[], args).await
}

/// On a free lock, `--wait 0s`, `0ms`, `1ms` and `5ms` run the command: the lock is
/// tried once however short the wait, and connecting (a new handle, a fencing table on a
/// fresh schema) does not use the wait up. Before, PostgreSQL exited 75 "the database did
/// not answer in time" and MariaDB 75 "held by another process" with nothing holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_or_tiny_wait_on_a_free_lock_runs_the_command_on_every_backend() {
    let pg = PgSchema::new("cli_wait0").await;
    let my = MyDb::new("cli_wait0").await;
    let sqlite = SqliteDb::new();
    let state = tempfile::tempdir().unwrap();
    for url in [pg.url.as_str(), my.url.as_str(), sqlite.url.as_str()] {
        for wait in ["0s", "0ms", "1ms", "5ms"] {
            for extra in [&[][..], &["--no-fencing"], &["--limit", "2"]] {
                let name = format!("free-{wait}-{}", extra.len());
                let args = [
                    &["run", "--db", url, "--wait", wait][..],
                    extra,
                    &[&name, "--", "true"],
                ]
                .concat();
                let out = run(state.path(), &args).await;
                assert_eq!(code(&out), 0, "{args:?}: {out:?}");
                assert!(out.stderr.is_empty(), "{args:?}: {out:?}");
            }
        }
    }
}

/// On a held lock `--wait 0s` is refused, exit 75, like `--no-wait`, saying it is held
/// and naming the holder the server shows: this test's process (PostgreSQL and the
/// embedded file show its pid; MySQL its connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_wait_on_a_held_lock_is_refused_and_names_the_real_holder() {
    let pg = PgSchema::new("cli_wait0_held").await;
    let my = MyDb::new("cli_wait0_held").await;
    let sqlite = SqliteDb::new();
    let state = tempfile::tempdir().unwrap();
    for (url, shown) in [
        (pg.url.as_str(), format!("[{}]", std::process::id())),
        (my.url.as_str(), "connection ".to_string()),
        (sqlite.url.as_str(), format!("[{}]", std::process::id())),
    ] {
        // Checked every 50 ms: on PostgreSQL a lock a try granted is named (by its
        // holder's comment: program, pid, host) from its first health check on; until
        // then by its session's application_name, which this test's URLs set.
        let locks = dblock_testkit::checked_often(url).await;
        let held = locks.lock("busy").await.unwrap();
        if url == pg.url {
            let named = dblock_testkit::until_named_as_holder(&locks, "busy").await;
            assert!(named, "the holder never named");
        }
        for how in [&["--wait", "0s"][..], &["--no-wait"]] {
            let args = [&["run", "--db", url][..], how, &["busy", "--", "true"]].concat();
            let out = run(state.path(), &args).await;
            assert_eq!(code(&out), 75, "{args:?}: {out:?}");
            let err = one_line_error(&out);
            assert!(err.contains("held by"), "{args:?}: {err}");
            // The holder is named when the server (or /proc) says within a second who it
            // is; a loaded machine may not, and then the message says no more than it
            // knows.
            assert!(
                err.contains(&shown) || err.contains("held by another process"),
                "{args:?}: {err}"
            );
        }
        held.release().await.unwrap();
        let out = run(
            state.path(),
            &["run", "--db", url, "--wait", "0s", "busy", "--", "true"],
        )
        .await;
        assert_eq!(code(&out), 0, "{url}: {out:?}");
    }
}
