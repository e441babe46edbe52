//! Claims of slots for a role that may not create tables: `dblock run --once-per` and
//! `dblock runs` are refused in one line naming `dblock setup` (never run without the
//! record, which would give up "once"), and work once the owner has run it — on
//! PostgreSQL (a database of the test's own, PostgreSQL 15's default privileges) and on
//! MariaDB.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;

use dblock_testkit::{MyDb, PgDatabase, exit_code as code, one_line_error};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn dblock(args: &[&str]) -> Output {
    let state = tempfile::tempdir().unwrap();
    dblock_testkit::dblock_output(DBLOCK, state.path(), &[], args).await
}

/// `scheme://user@rest` for `scheme://anyone@rest`.
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let rest = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{rest}")
}

/// What both backends must show: refused until the owner's setup, then once per slot.
async fn refused_until_setup_then_once(url: &str, owner_url: &str, role: &str) {
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let touch = format!("echo x >> {}", ran.display());
    let run = [
        "run",
        "--db",
        url,
        "--once-per",
        "1h",
        "job",
        "--",
        "sh",
        "-c",
        &touch,
    ];
    let out = dblock(&run).await;
    assert_eq!(code(&out), 69, "{out:?}");
    let line = one_line_error(&out);
    assert!(
        line.contains("dblock setup") && line.contains("--grant"),
        "{line}"
    );
    assert!(!ran.exists(), "not run without the record");
    let out = dblock(&["runs", "--db", url, "job"]).await;
    assert_eq!(code(&out), 69, "{out:?}");
    assert!(one_line_error(&out).contains("dblock setup"), "{out:?}");

    let out = dblock(&["setup", "--db", owner_url, "--grant", role]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("dblock_runs ready"), "{said}");
    assert!(said.contains("dblock_fencing ready"), "{said}");

    for _ in 0..2 {
        let out = dblock(&run).await;
        assert_eq!(code(&out), 0, "{out:?}");
    }
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "x\n", "once");
    let out = dblock(&["runs", "--db", url, "job"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("attempt 1  succeeded (exit 0)"),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_role_without_the_record_is_told_to_run_setup() {
    let db = PgDatabase::new("jobs_leastpriv").await;
    let role = format!("{}_app", db.name);
    let admin = db.admin().await;
    admin
        .batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN"))
        .await
        .unwrap();
    refused_until_setup_then_once(&as_user(&db.url, &role), &db.url, &role).await;
    admin
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_user_without_the_record_is_told_to_run_setup() {
    let db = MyDb::new("jobs_leastpriv").await;
    let user = format!("dblj{}", std::process::id());
    let admin = db.admin();
    let sql = |sql: String| async move {
        dblock::sqlx::raw_sql(dblock::sqlx::AssertSqlSafe(sql))
            .execute(admin)
            .await
            .unwrap();
    };
    sql(format!("DROP USER IF EXISTS '{user}'@'%'")).await;
    sql(format!("CREATE USER '{user}'@'%'")).await;
    sql(format!("GRANT SELECT ON `{}`.* TO '{user}'@'%'", db.name)).await;
    refused_until_setup_then_once(&as_user(&db.url, &user), &db.url, &user).await;
    sql(format!("DROP USER IF EXISTS '{user}'@'%'")).await;
}
