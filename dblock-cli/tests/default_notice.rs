//! The host-local default is never a silent surprise: with no URL configured, `dblock`
//! says in one line on stderr that it locks on the host-local file, and
//! `DBLOCK_NO_DEFAULT_NOTICE=1` (or naming the file) silences it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::Duration;

use dblock_testkit::{SqliteDb, exit_code as code};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn run(state: &std::path::Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = dblock_testkit::dblock_command(DBLOCK, state);
    c.env_remove("DBLOCK_NO_DEFAULT_NOTICE");
    for (k, v) in env {
        c.env(k, v);
    }
    tokio::time::timeout(Duration::from_secs(60), c.args(args).output())
        .await
        .unwrap()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[tokio::test]
async fn falling_back_to_the_host_local_file_says_so_in_one_line() {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let file = s.join("dblock/locks.db").display().to_string();
    let out = run(s, &[], &["run", "job", "--", "true"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(err.starts_with("dblock: note: "), "{err:?}");
    assert!(
        err.contains(&file) && err.contains("this host only"),
        "{err:?}"
    );
    assert!(err.contains("DBLOCK_NO_DEFAULT_NOTICE=1"), "{err:?}");

    // migrate falls back the same way, and says so the same way.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("0001_a.sql"), "CREATE TABLE a (x INTEGER);").unwrap();
    let out = run(s, &[], &["migrate", dir.path().to_str().unwrap()]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(stderr(&out).contains(&file), "{out:?}");
}

#[tokio::test]
async fn the_notice_is_silenced_by_the_variable_or_by_a_chosen_url() {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let db = SqliteDb::new();
    for (env, args) in [
        (
            vec![("DBLOCK_NO_DEFAULT_NOTICE", "1")],
            vec!["run", "job", "--", "true"],
        ),
        (
            vec![],
            vec!["run", "--db", db.url.as_str(), "job", "--", "true"],
        ),
        (
            vec![("DATABASE_URL", db.url.as_str())],
            vec!["run", "job", "--", "true"],
        ),
        (
            vec![("DBLOCK_DATABASE_URL", db.url.as_str())],
            vec!["run", "job", "--", "true"],
        ),
    ] {
        let out = run(s, &env, &args).await;
        assert_eq!(code(&out), 0, "{out:?}");
        assert!(out.stderr.is_empty(), "{env:?} {args:?}: {out:?}");
    }
    // "0" does not silence it.
    let out = run(
        s,
        &[("DBLOCK_NO_DEFAULT_NOTICE", "0")],
        &["run", "job", "--", "true"],
    )
    .await;
    assert_eq!(stderr(&out).lines().count(), 1, "{out:?}");
}
