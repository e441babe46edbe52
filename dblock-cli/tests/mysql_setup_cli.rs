//! `dblock setup --db mysql://…` on a real MariaDB, with a user the test creates (and
//! drops) that may read its database but not create tables in it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;

use dblock_testkit::{MyDb, exit_code as code};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn dblock(state: &std::path::Path, args: &[&str]) -> Output {
    dblock_testkit::dblock_output(DBLOCK, state, &[], args).await
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A user that may not create tables runs under the lock without a token (said once);
/// `dblock setup` run by one that may creates the table and grants it, after which the
/// user's runs get tokens. Before, `setup --db mysql://…` answered "the embedded backend
/// needs none" and exited 64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_on_mysql_creates_the_fencing_table_and_grants_a_user_its_rows() {
    let db = MyDb::new("cli_my_setup").await;
    let user = format!("dbl{}", std::process::id());
    let mine = db.read_only_user(&user).await;
    let state = tempfile::tempdir().unwrap();
    let echo_token = [
        "--",
        "sh",
        "-c",
        "echo \"token=${DBLOCK_FENCING_TOKEN:-none}\"",
    ];

    let out = dblock(
        state.path(),
        &[&["run", "--db", &mine, "job"][..], &echo_token].concat(),
    )
    .await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(text(&out.stdout).trim(), "token=none");
    let note = text(&out.stderr);
    assert!(note.contains("running without a fencing token"), "{note}");
    assert!(note.contains("dblock setup"), "{note}");

    let out = dblock(state.path(), &["setup", "--db", &db.url, "--grant", &user]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let said = text(&out.stdout);
    assert!(said.contains("dblock_fencing ready"), "{said}");
    assert!(said.contains(&format!("granted to {user}")), "{said}");
    // Twice is fine.
    let out = dblock(state.path(), &["setup", "--db", &db.url, "--grant", &user]).await;
    assert_eq!(code(&out), 0, "{out:?}");

    for expected in ["token=1", "token=2"] {
        let out = dblock(
            state.path(),
            &[&["run", "--db", &mine, "job"][..], &echo_token].concat(),
        )
        .await;
        assert_eq!(code(&out), 0, "{out:?}");
        assert_eq!(text(&out.stdout).trim(), expected);
        assert!(out.stderr.is_empty(), "{out:?}");
    }

    // The user itself may not set up (no CREATE, no GRANT): refused, saying who may.
    let out = dblock(state.path(), &["setup", "--db", &mine, "--grant", &user]).await;
    assert_eq!(code(&out), 69, "{out:?}");
    assert!(text(&out.stderr).contains("dblock setup"), "{out:?}");
    // The embedded backend needs none, and says so.
    let file = state.path().join("x.db");
    let out = dblock(
        state.path(),
        &["setup", "--db", &format!("sqlite:{}", file.display())],
    )
    .await;
    assert_eq!(code(&out), 64, "{out:?}");
    assert!(
        text(&out.stderr).contains("sqlite backend has no setup to do"),
        "{out:?}"
    );
    db.drop_user(&user).await;
}
