//! An explicit lock-file path is used as written: a directory that does not exist is a
//! mistake to report, not to create (only the embedded default's directories are made).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use dblock_testkit::{exit_code as code, one_line_error};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// `--db sqlite:DIR/missing/x.db` exits 64 naming the directory, and creates nothing;
/// the default path (`$XDG_STATE_HOME/dblock/locks.db`) still gets its directories.
/// Before, the directories and a lock file were created silently: a mistyped path
/// excluded nothing and said nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_file_in_a_missing_directory_is_refused_and_nothing_is_created() {
    let state = tempfile::tempdir().unwrap();
    let missing = state.path().join("typo").join("dir");
    let url = format!("sqlite:{}", missing.join("x.db").display());
    for args in [
        vec!["run", "--db", url.as_str(), "job", "--", "true"],
        vec!["status", "--db", url.as_str()],
    ] {
        let out = dblock_testkit::dblock_command(DBLOCK, state.path())
            .args(&args)
            .output()
            .await
            .unwrap();
        assert_eq!(code(&out), 64, "{args:?}: {out:?}");
        let err = one_line_error(&out);
        assert!(err.contains("does not exist"), "{err}");
        assert!(err.contains("typo"), "{err}");
        assert!(!state.path().join("typo").exists(), "nothing was created");
    }
    // The default: created where the state directory says.
    let home = state.path().join("fresh").join("state");
    let out = dblock_testkit::dblock_command(DBLOCK, state.path())
        .env("XDG_STATE_HOME", &home)
        .env("DBLOCK_NO_DEFAULT_NOTICE", "1")
        .args(["run", "job", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(home.join("dblock").join("locks.db-locks").exists());
}
