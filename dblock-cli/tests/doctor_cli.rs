//! `dblock doctor` against real servers, one test per verdict that can be produced
//! here: the tests' PostgreSQL (all well), a role without rights on the fencing table
//! (fail, and the fix it names works), a throwaway cluster with a short
//! idle-in-transaction timeout, a small lock table and per-role timeouts (warn, with the
//! control that the timeout really ends a holder), PgBouncer in front (the pooler
//! detected or declared), a server whose advisory-lock functions are shadowed on the
//! search_path and then replaced by stubs (ok, then fail), a TLS-only cluster, MariaDB
//! and the embedded file. `--json` is parsed, and the exit codes are 0, 1 and 2.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock_testkit::cluster::{TempCluster, granting_stubs};
use dblock_testkit::pgbouncer::{Options, PgBouncer, PoolMode};
use dblock_testkit::tls::{Certs, tls_only_cluster};
use dblock_testkit::{PgSchema, admin_connect, exit_code, pg_url, with_params};
use serde_json::Value;

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// Every check a PostgreSQL report has, in order.
const PG_CHECKS: &[&str] = &[
    "server",
    "tls",
    "pooler",
    "advisory-locks",
    "tables",
    "lock-table",
    "timeouts",
    "timeouts",
    "timeouts",
    "connection-check",
    "fencing-timeline",
];

/// `dblock doctor ARGS --json`: the exit code and the parsed report.
async fn doctor(args: &[&str]) -> (i32, Value) {
    let state = tempfile::tempdir().unwrap();
    let mut all = vec!["doctor"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = dblock_testkit::dblock_output(DBLOCK, state.path(), &[], &all).await;
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    let report: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}; stderr {:?}", out.stderr));
    (exit_code(&out), report)
}

/// The checks named `name`: (verdict, detail, fix).
fn checks(report: &Value, name: &str) -> Vec<(String, String, Option<String>)> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["name"] == name)
        .map(|c| {
            (
                c["verdict"].as_str().unwrap().to_string(),
                c["detail"].as_str().unwrap().to_string(),
                c["fix"].as_str().map(str::to_string),
            )
        })
        .collect()
}

fn check(report: &Value, name: &str) -> (String, String, Option<String>) {
    checks(report, name)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no {name} check in {report:#}"))
}

fn names(report: &Value) -> Vec<String> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect()
}

/// `url` connecting as `user` instead.
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let rest = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{rest}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_tests_server_every_check_is_ok_and_the_exit_code_is_0() {
    let s = PgSchema::new("doc_ok").await;
    let url = with_params(&s.url, &[("sslmode", "disable")]);
    let (code, report) = doctor(&["--db", &url]).await;
    assert_eq!(report["backend"], "postgres");
    assert_eq!(names(&report), PG_CHECKS, "{report:#}");
    assert_eq!(
        (code, report["verdict"].as_str()),
        (0, Some("ok")),
        "{report:#}"
    );
    assert!(check(&report, "server").1.starts_with("PostgreSQL"));
    assert!(
        check(&report, "tls").1.starts_with("not in use"),
        "sslmode=disable"
    );
    assert!(check(&report, "pooler").1.starts_with("none"));
    assert!(
        check(&report, "advisory-locks")
            .1
            .contains("session-scoped locks exclude")
    );
    assert!(
        check(&report, "fencing-timeline")
            .1
            .contains("WAL timeline")
    );
    // The text form: a line a check, the same exit code.
    let state = tempfile::tempdir().unwrap();
    let out =
        dblock_testkit::dblock_output(DBLOCK, state.path(), &[], &["doctor", "--db", &url]).await;
    assert_eq!(exit_code(&out), 0);
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text.lines().filter(|l| l.starts_with("ok ")).count(),
        PG_CHECKS.len(),
        "{text}"
    );
    assert!(text.contains("0 warnings, 0 failures"), "{text}");
    // What the handle is configured for counts: a multiplexing handle may hold any
    // number of locks, more than a small lock table keeps in all (the tests' server, with
    // PostgreSQL's defaults: 6400).
    let capacity: i64 = s
        .admin()
        .query_one(
            "SELECT current_setting('max_locks_per_transaction')::bigint * \
             (current_setting('max_connections')::bigint \
             + current_setting('max_prepared_transactions')::bigint)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (code, report) = doctor(&["--db", &url, "--multiplex", "2"]).await;
    let (verdict, detail, _) = check(&report, "lock-table");
    let expected = if capacity < 10_000 {
        (1, "warn")
    } else {
        (0, "ok")
    };
    assert_eq!((code, verdict.as_str()), expected, "{capacity}: {report:#}");
    assert!(
        detail.contains("multiplexes session locks on 2 connections"),
        "{detail}"
    );
}

/// A role without rights on dblock's tables: the tables check fails (exit 2) and names
/// `dblock setup --grant ROLE`; after running that fix, it is ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_rights_on_the_fencing_table_fails_and_setup_fixes_it() {
    let s = PgSchema::new("doc_role").await;
    let role = format!("{}_app", s.name);
    s.admin()
        .batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN"))
        .await
        .unwrap();
    // The tables exist (made by the owner), and the role has no grant on them.
    s.locks().await.setup(&[]).await.unwrap();
    let url = with_params(&as_user(&pg_url(), &role), &[("application_name", &s.app)]);
    let (code, report) = doctor(&["--db", &url]).await;
    let (verdict, detail, fix) = check(&report, "tables");
    assert_eq!((code, verdict.as_str()), (2, "fail"), "{report:#}");
    assert_eq!(report["verdict"], "fail");
    assert!(
        detail.contains(&role) && detail.contains("dblock_fencing"),
        "{detail}"
    );
    let fix = fix.unwrap();
    assert!(
        fix.contains(&format!("dblock setup --db OWNER_URL --grant {role}")),
        "{fix}"
    );
    // The control that the verdict is true: a fenced lock fails for this role.
    let locks = dblock::Locks::connect(&url).await.unwrap();
    let e = locks.request("x").fenced().lock().await.unwrap_err();
    assert!(matches!(e, dblock::Error::PermissionDenied { .. }), "{e:?}");
    // The fix it names.
    let state = tempfile::tempdir().unwrap();
    let out = dblock_testkit::dblock_output(
        DBLOCK,
        state.path(),
        &[],
        &["setup", "--db", &s.url, "--grant", &role],
    )
    .await;
    assert_eq!(exit_code(&out), 0, "{out:?}");
    let (_, report) = doctor(&["--db", &url]).await;
    assert_eq!(check(&report, "tables").0, "ok", "{report:#}");
}

/// A server whose settings end holders and waits: a short
/// idle_in_transaction_session_timeout and a small lock table (the server's), and
/// lock_timeout and statement_timeout set for the role and the database (which
/// `pg_settings` shows the session): each warns with its fix, exit 1. The control: the
/// idle timeout, shorter than the holder's check interval, really ends a
/// transaction-scoped holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_idle_timeout_a_small_lock_table_and_per_role_timeouts_warn() {
    let cluster = TempCluster::start(&[
        ("idle_in_transaction_session_timeout", "'500ms'"),
        ("max_locks_per_transaction", "10"),
    ]);
    let admin = admin_connect(&cluster.url()).await;
    admin
        .batch_execute(
            "ALTER ROLE postgres SET lock_timeout = '3s'; \
             ALTER DATABASE postgres SET statement_timeout = '1500ms'",
        )
        .await
        .unwrap();
    let (code, report) = doctor(&["--db", &cluster.url()]).await;
    assert_eq!(
        (code, report["verdict"].as_str()),
        (1, Some("warn")),
        "{report:#}"
    );
    let timeouts = checks(&report, "timeouts");
    let warned: Vec<&str> = timeouts
        .iter()
        .filter(|c| c.0 == "warn" && c.2.is_some())
        .map(|c| c.1.as_str())
        .collect();
    assert_eq!(warned.len(), 3, "{timeouts:?}");
    assert!(
        warned[0].starts_with("idle_in_transaction_session_timeout = 500 ms")
            && warned[0].contains("check interval"),
        "{warned:?}"
    );
    assert!(
        warned[1].starts_with("statement_timeout = 1500 ms"),
        "{warned:?}"
    );
    assert!(warned[2].starts_with("lock_timeout = 3 s"), "{warned:?}");
    let (verdict, detail, fix) = check(&report, "lock-table");
    assert_eq!(verdict, "warn");
    assert!(
        detail.starts_with("400 locks in all"),
        "10 × (40 + 0): {detail}"
    );
    assert!(fix.unwrap().contains("max_locks_per_transaction"));
    // Everything else is fine.
    for name in [
        "server",
        "tls",
        "pooler",
        "advisory-locks",
        "tables",
        "connection-check",
    ] {
        assert_eq!(check(&report, name).0, "ok", "{name}: {report:#}");
    }

    // The control: what the idle timeout warns of happens, to a holder checked every
    // second (the default).
    let locks = dblock::Locks::connect(&cluster.url()).await.unwrap();
    let g = locks.lock("held").await.unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(20), g.lost()).await;
    assert!(lost.is_ok(), "the server ended the idle holder");

    // Without the settings, no warning: the verdicts follow the server.
    for sql in [
        "ALTER ROLE postgres RESET lock_timeout",
        "ALTER DATABASE postgres RESET statement_timeout",
        "ALTER SYSTEM SET idle_in_transaction_session_timeout = 0",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let (_, report) = doctor(&["--db", &cluster.url()]).await;
    assert!(
        checks(&report, "timeouts").iter().all(|c| c.0 == "ok"),
        "{report:#}"
    );
}

/// Through PgBouncer: the pooler detected (transaction pooling: session locks refused,
/// so not checked), or declared pinning — truly (session mode: a session lock excludes)
/// or falsely (transaction mode: the check finds session locks that do not exclude).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_the_pooler_is_reported_detected_or_declared() {
    let s = PgSchema::new("doc_pgb").await;
    let b = PgBouncer::with(Options::new(PoolMode::Session, 3).search_path(&s.name));
    let url = with_params(&b.test_url(), &[("application_name", &s.app)]);
    let (_, report) = doctor(&["--db", &url]).await;
    let (verdict, detail, _) = check(&report, "pooler");
    assert_eq!(verdict, "ok");
    assert!(
        detail.starts_with("transaction pooling") && detail.contains("detected"),
        "{detail}"
    );
    let exclusion = check(&report, "advisory-locks").1;
    assert!(
        exclusion.contains("transaction-scoped locks exclude") && exclusion.contains("untested"),
        "{exclusion}"
    );
    let (_, report) = doctor(&["--db", &format!("{url}&pooler=pinning")]).await;
    let detail = check(&report, "pooler").1;
    assert!(
        detail.contains("pinning pooler") && detail.contains("pooler=pinning was set"),
        "{detail}"
    );
    assert!(
        check(&report, "advisory-locks")
            .1
            .contains("session-scoped locks exclude")
    );
    // Declared pinning on a transaction pooler that does not pin: PgBouncer hands the
    // server connection released last to the next client (LIFO), so another client's try
    // reaches the holder's session, where the lock is re-entrant. The check finds it out.
    let t = PgBouncer::with(Options::new(PoolMode::Transaction, 2).search_path(&s.name));
    let lying = with_params(
        &t.test_url(),
        &[("application_name", &s.app), ("pooler", "pinning")],
    );
    let (code, report) = doctor(&["--db", &lying]).await;
    let (verdict, detail, fix) = check(&report, "advisory-locks");
    assert_eq!((code, verdict.as_str()), (2, "fail"), "{report:#}");
    assert!(
        detail.contains("transaction-scoped locks exclude")
            && detail.contains("session-scoped locks DO NOT exclude"),
        "{detail}"
    );
    assert!(fix.unwrap().contains("remove pooler=pinning"));
    // A direct connection, for contrast.
    let (_, report) = doctor(&["--db", &s.url]).await;
    assert!(
        check(&report, "pooler").1.starts_with("none: detected"),
        "{report:#}"
    );
}

/// A role whose search_path puts a schema of stubs before pg_catalog: dblock's calls
/// are qualified, so the check still finds locks that exclude (while an unqualified call
/// reaches the stub: the control). Then pg_catalog's own functions replaced by the stubs:
/// the check fails, exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadowed_functions_are_not_trusted_and_stubbed_ones_fail() {
    let cluster = TempCluster::start(&[]);
    let admin = admin_connect(&cluster.url()).await;
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA shadow; {} ALTER ROLE postgres SET search_path = shadow, pg_catalog",
            granting_stubs("shadow")
        ))
        .await
        .unwrap();
    // The control: unqualified, two sessions both "take" one key.
    let a = admin_connect(&cluster.url()).await;
    let b = admin_connect(&cluster.url()).await;
    let first: bool = a
        .query_one("SELECT pg_try_advisory_lock(7)", &[])
        .await
        .unwrap()
        .get(0);
    let second: bool = b
        .query_one("SELECT pg_try_advisory_lock(7)", &[])
        .await
        .unwrap()
        .get(0);
    assert!(first && second, "the shadowing stubs are in place");
    let (code, report) = doctor(&["--db", &cluster.url()]).await;
    assert_eq!(check(&report, "advisory-locks").0, "ok", "{report:#}");
    assert_eq!(code, 0, "{report:#}");

    admin
        .batch_execute(&granting_stubs("pg_catalog"))
        .await
        .unwrap();
    let (code, report) = doctor(&["--db", &cluster.url()]).await;
    let (verdict, detail, fix) = check(&report, "advisory-locks");
    assert_eq!((code, verdict.as_str()), (2, "fail"), "{report:#}");
    assert!(detail.contains("DO NOT exclude"), "{detail}");
    assert!(fix.unwrap().contains("exclude nothing"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_in_use_is_reported_on_a_tls_only_cluster() {
    let certs = Certs::generate("db.dblock.test", "postgres");
    let c = tls_only_cluster(&certs, "hostssl all all 127.0.0.1/32 trust");
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=require",
        c.port
    );
    let (_, report) = doctor(&["--db", &url]).await;
    let (verdict, detail, _) = check(&report, "tls");
    assert_eq!(verdict, "ok");
    assert!(detail.starts_with("in use: TLSv1."), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_and_the_embedded_file_get_the_checks_that_apply() {
    let (code, report) = doctor(&["--db", &dblock_testkit::mysql::mysql_url()]).await;
    assert_eq!(report["backend"], "mysql");
    assert_eq!(names(&report), ["server", "tls", "lock-kind"]);
    assert_eq!(code, 0, "{report:#}");
    assert!(
        check(&report, "server").1.starts_with("M"),
        "MySQL or MariaDB"
    );
    assert!(check(&report, "lock-kind").1.contains("GET_LOCK"));

    let db = dblock_testkit::SqliteDb::new();
    let (code, report) = doctor(&["--db", &db.url]).await;
    assert_eq!(report["backend"], "sqlite");
    assert_eq!(names(&report), ["server", "lock-kind", "filesystem"]);
    assert_eq!(code, 0, "{report:#}");
    assert!(check(&report, "lock-kind").1.contains("-locks"));
}

/// On a hot standby fencing tokens cannot be taken (nor the live timeline read): the
/// timeline line warns and points at the primary, whose own line is ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_warns_that_fencing_needs_the_primary() {
    let primary = TempCluster::start(&[("wal_level", "replica")]);
    let standby = TempCluster::standby_of(&primary);
    let (code, report) = doctor(&["--db", &standby.url()]).await;
    let (verdict, detail, fix) = check(&report, "fencing-timeline");
    assert_eq!((code, verdict.as_str()), (1, "warn"), "{report:#}");
    assert!(detail.starts_with("a standby"), "{detail}");
    assert!(fix.unwrap().contains("primary"));
    let (code, report) = doctor(&["--db", &primary.url()]).await;
    assert_eq!(check(&report, "fencing-timeline").0, "ok", "{report:#}");
    assert_eq!(code, 0, "{report:#}");
}
