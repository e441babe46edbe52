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

/// One-shot processes keep the database's write-ahead log short. Each fenced `dblock
/// run` commits its token (a frame of the log at least) and exits without SQLite's
/// checkpoint on close; an opening that finds the log longer than a bound (32 frames)
/// checkpoints it, so that the next opening, which rebuilds the log's index from the
/// whole log, reads little. Without the bound the log grew by a frame a run, to
/// SQLite's own bound of 1,000 frames (4 MB); here 80 runs (80 tokens, checked) never
/// leave it above 40 frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shot_runs_keep_the_write_ahead_log_short() {
    let state = tempfile::tempdir().unwrap();
    let db = state.path().join("x.db");
    let url = format!("sqlite:{}", db.display());
    let wal = state.path().join("x.db-wal");
    let mut tokens = Vec::new();
    let mut longest = 0;
    for _ in 0..80 {
        let out = dblock_testkit::dblock_command(DBLOCK, state.path())
            .args([
                "run",
                "--db",
                &url,
                "w",
                "--",
                "sh",
                "-c",
                "echo $DBLOCK_FENCING_TOKEN",
            ])
            .output()
            .await
            .unwrap();
        assert_eq!(code(&out), 0, "{out:?}");
        let token: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        tokens.push(token);
        longest = longest.max(std::fs::metadata(&wal).map_or(0, |m| m.len()));
    }
    assert!(
        tokens.windows(2).all(|w| w[1] == w[0] + 1),
        "every run committed the next token: {tokens:?}"
    );
    assert!(
        longest <= 40 * (4096 + 24),
        "the log reached {longest} bytes ({} frames)",
        longest / 4120
    );
}
