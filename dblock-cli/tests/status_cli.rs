//! `dblock status`, `dblock release --force` and what a waiting `dblock run` says, with
//! a real holder and real waiters in processes of their own, on every backend:
//!
//! ```text
//! dblock status [--db URL] [--namespace NS] [NAME...] [--json] [--watch]
//! dblock release [--db URL] [--namespace NS] NAME --force
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;

use dblock_testkit::{MyDb, PgSchema, SqliteDb, eventually, exit_code as code};
use serde_json::Value;
use tokio::process::{Child, Command};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

fn dblock(state: &std::path::Path) -> Command {
    let mut c = dblock_testkit::dblock_command(DBLOCK, state);
    c.env("DBLOCK_NO_DEFAULT_NOTICE", "1");
    c
}

/// A name that would end a comment early, were it not encoded.
const NAME: &str = "deploy */ 7; x";

/// `dblock run --db URL [extra] NAME -- COMMAND…` started in the background.
fn start(state: &std::path::Path, url: &str, extra: &[&str], command: &[&str]) -> Child {
    let mut c = dblock(state);
    c.args(["run", "--db", url])
        .args(extra)
        .arg(NAME)
        .arg("--")
        .args(command)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c.spawn().unwrap()
}

/// `dblock status --db URL --json [NAME]`, the lock named NAME in it (or Null).
async fn status_json(state: &std::path::Path, url: &str, by_name: bool) -> Value {
    if by_name {
        return status_json_in(state, url, true, None).await;
    }
    // Listing the whole database: other tests hold locks of the same name in namespaces
    // of their own; keep to this handle's (as `status NAME` reports it).
    let mine = status_json_in(state, url, true, None).await;
    let ns = mine["namespace"].as_str().map(str::to_string);
    status_json_in(state, url, false, ns.as_deref()).await
}

/// As [`status_json`], the lock of that name in namespace `ns` when given (the listing
/// covers the whole database, where other tests hold locks of the same name).
async fn status_json_in(
    state: &std::path::Path,
    url: &str,
    by_name: bool,
    ns: Option<&str>,
) -> Value {
    let mut c = dblock(state);
    c.args(["status", "--db", url, "--json"]);
    if by_name {
        c.arg(NAME);
    }
    let out = c.output().await.unwrap();
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["version"], 1);
    v["locks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == NAME && ns.is_none_or(|ns| l["namespace"] == ns))
        .cloned()
        .unwrap_or(Value::Null)
}

fn pids(parties: &Value) -> Vec<u64> {
    let mut p: Vec<u64> = parties
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["pid"].as_u64()).collect())
        .unwrap_or_default();
    p.sort();
    p
}

/// One holder, two waiters: `status` (JSON, text, listing all and by name) shows the
/// name, the holder's pid and both waiters'.
async fn status_shows_the_holder_and_its_waiters(url: &str, pids_known: bool) {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let mut holder = start(s, url, &[], &["sleep", "60"]);
    let holder_pid = holder.id().unwrap() as u64;
    assert!(
        eventually(20, &mut || async {
            !status_json(s, url, true).await["holders"].is_null()
        })
        .await,
        "the holder never showed"
    );
    let mut w1 = start(s, url, &["--wait", "60s"], &["true"]);
    let mut w2 = start(s, url, &["--wait", "60s"], &["true"]);
    let mut waiter_pids = vec![w1.id().unwrap() as u64, w2.id().unwrap() as u64];
    waiter_pids.sort();
    let both_wait = eventually(20, &mut || async {
        let l = status_json(s, url, false).await;
        l["waiters"].as_array().is_some_and(|w| w.len() == 2)
    })
    .await;
    assert!(both_wait, "{:#}", status_json(s, url, false).await);
    for by_name in [false, true] {
        let l = status_json(s, url, by_name).await;
        assert_eq!(l["name"], NAME, "{l:#}");
        assert_eq!(l["holders"].as_array().unwrap().len(), 1, "{l:#}");
        assert_eq!(l["holders"][0]["mode"], "exclusive");
        if pids_known {
            assert_eq!(pids(&l["holders"]), vec![holder_pid], "{l:#}");
            assert_eq!(pids(&l["waiters"]), waiter_pids, "{l:#}");
        } else {
            assert!(l["holders"][0]["connection"].as_i64().is_some(), "{l:#}");
        }
    }
    // The text names the lock, the holder and both waiters.
    let out = dblock(s)
        .args(["status", "--db", url, NAME])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with(NAME), "{text}");
    assert_eq!(text.matches("held by").count(), 1, "{text}");
    assert_eq!(text.matches("waiting").count(), 2, "{text}");
    if pids_known {
        assert!(text.contains(&format!("[{holder_pid}]")), "{text}");
    }
    holder.kill().await.unwrap();
    for w in [&mut w1, &mut w2] {
        let st = tokio::time::timeout(std::time::Duration::from_secs(30), w.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(st.success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_holder_and_its_waiters_on_postgres() {
    let db = PgSchema::new("status_waiters").await;
    status_shows_the_holder_and_its_waiters(&db.url, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_holder_and_its_waiters_on_sqlite() {
    let db = SqliteDb::new();
    status_shows_the_holder_and_its_waiters(&db.url, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_holder_and_its_waiters_on_mysql() {
    let db = MyDb::new("status_waiters").await;
    // The server knows no client pids: holders show their connection.
    status_shows_the_holder_and_its_waiters(&db.url, false).await;
}

/// The name outlives the request's own statement: after the holder's health check
/// replaced it in `pg_stat_activity.query`, `status` still names the lock,
/// held by the right process, in a namespace of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_holder_stays_named_after_its_health_checks() {
    let db = PgSchema::new("status_checked").await;
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    // Unfenced: no fencing table row to fall back on.
    let mut holder = start(s, &db.url, &["--no-fencing"], &["sleep", "60"]);
    let checked = db
        .eventually(20, || async {
            db.admin()
                .query(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = $1 \
                     AND state = 'idle in transaction' AND query NOT LIKE '%advisory%'",
                    &[&db.app],
                )
                .await
                .unwrap()
                .len()
                == 1
        })
        .await;
    assert!(checked, "no health check ran");
    let l = status_json_in(s, &db.url, false, Some(&db.name)).await;
    assert_eq!(l["namespace"], db.name.as_str(), "{l:#}");
    assert_eq!(l["holders"][0]["pid"], holder.id().unwrap(), "{l:#}");
    assert_eq!(l["holders"][0]["scope"], "transaction", "{l:#}");
    assert!(l["holders"][0]["since_ms"].as_u64().is_some(), "{l:#}");
    holder.kill().await.unwrap();
}

/// `release --force` ends the holder's session: refused without `--force`, it frees
/// the lock, prints whom it ended, and the holder's `dblock run` exits 70.
async fn release_force_ends_the_holder(url: &str, names_pid: bool) {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let mut holder = start(s, url, &[], &["sleep", "60"]);
    let holder_pid = holder.id().unwrap();
    assert!(
        eventually(20, &mut || async {
            !status_json(s, url, true).await["holders"].is_null()
        })
        .await
    );
    let out = dblock(s)
        .args(["release", "--db", url, NAME])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 64);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    // Still held: a try fails.
    let out = dblock(s)
        .args(["run", "--db", url, "--no-wait", NAME, "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 75);
    let out = dblock(s)
        .args(["release", "--db", url, NAME, "--force"])
        .output()
        .await
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.starts_with("ended "), "{said}");
    if names_pid {
        assert!(said.contains(&format!("[{holder_pid}]")), "{said}");
    }
    let st = tokio::time::timeout(std::time::Duration::from_secs(30), holder.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(st.code(), Some(70));
    let out = dblock(s)
        .args(["run", "--db", url, "--wait", "10s", NAME, "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_force_ends_the_holder_on_postgres() {
    let db = PgSchema::new("status_force").await;
    release_force_ends_the_holder(&db.url, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_force_ends_the_holder_on_mysql() {
    let db = MyDb::new("status_force").await;
    release_force_ends_the_holder(&db.url, false).await;
}

/// The embedded backend cannot end another process's lock: it refuses, naming the
/// holder's pid, and the holder keeps the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_force_on_sqlite_refuses_and_names_the_holder() {
    let db = SqliteDb::new();
    let s = db.dir.path();
    let mut holder = start(s, &db.url, &[], &["sleep", "60"]);
    let pid = holder.id().unwrap();
    assert!(
        eventually(20, &mut || async {
            !status_json(s, &db.url, true).await["holders"].is_null()
        })
        .await
    );
    let out = dblock(s)
        .args(["release", "--db", &db.url, NAME, "--force"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 64);
    let err = dblock_testkit::one_line_error(&out);
    assert!(err.contains(&format!("kill {pid}")), "{err}");
    assert!(holder.try_wait().unwrap().is_none(), "the holder runs on");
    holder.kill().await.unwrap();
}

/// A wait says after a second what it waits for and who holds it; its timeout names
/// the holder too.
async fn a_wait_names_the_holder(url: &str) {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let mut holder = start(s, url, &[], &["sleep", "60"]);
    let pid = holder.id().unwrap();
    assert!(
        eventually(20, &mut || async {
            !status_json(s, url, true).await["holders"].is_null()
        })
        .await
    );
    let out = dblock(s)
        .env("DBLOCK_WAIT_NOTICE", "1")
        .args(["run", "--db", url, "--wait", "2500ms", NAME, "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 75);
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(lines[0].starts_with("dblock: waiting for lock"), "{err}");
    assert!(lines[1].contains("not obtained within 2500ms"), "{err}");
    for l in lines {
        assert!(l.contains(&format!("[{pid}]")), "{err}");
    }
    holder.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_names_the_holder_on_postgres() {
    let db = PgSchema::new("status_wait").await;
    a_wait_names_the_holder(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_names_the_holder_on_sqlite() {
    let db = SqliteDb::new();
    a_wait_names_the_holder(&db.url).await;
}

/// dblock's own connections say who they are: `program[pid]@host` unless the builder
/// (or the URL, or PGAPPNAME) names them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connections_say_which_process_they_belong_to() {
    let db = PgSchema::new("status_appname").await;
    let base = dblock_testkit::pg_url();
    let opts = format!("-c dblock.namespace={}", db.name);
    let url = dblock_testkit::with_params(&base, &[("options", &opts)]);
    let app_of = |pid: i32| {
        let admin = db.admin();
        async move {
            admin
                .query_one(
                    "SELECT application_name FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .unwrap()
                .get::<_, String>(0)
        }
    };
    let key = dblock::Key::new(&db.name, "app:1").unwrap();
    for (builder_name, want) in [
        (None, dblock::status::default_application_name()),
        (Some("billing-worker"), "billing-worker".to_string()),
    ] {
        let mut b = dblock::Locks::builder().url(&url);
        if let Some(n) = builder_name {
            b = b.application_name(n);
        }
        let locks = b.build().await.unwrap();
        let g = locks.lock("app:1").await.unwrap();
        let held = db.advisory(key).await;
        assert_eq!(held.len(), 1);
        assert_eq!(app_of(held[0].0).await, want);
        g.release().await.unwrap();
    }
    let want = format!("[{}]@", std::process::id());
    assert!(dblock::status::default_application_name().contains(&want));
}
