//! The command-line contract, tested as written:
//!
//! ```text
//! dblock run [--db URL] [--namespace NS] [--wait DURATION | --no-wait] [--shared] NAME -- COMMAND [ARGS...]
//! dblock key [--namespace NS] NAME
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use dblock_testkit::{MyDb, PgSchema, SqliteDb, exit_code as code, one_line_error, signal};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// `dblock` with a clean environment: no URL variables, state under `state`.
fn dblock(state: &std::path::Path) -> Command {
    dblock_testkit::dblock_command(DBLOCK, state)
}

async fn run(state: &std::path::Path, args: &[&str]) -> Output {
    dblock(state).args(args).output().await.unwrap()
}

#[tokio::test]
async fn run_exits_with_the_commands_status_and_sets_its_environment() {
    let db = SqliteDb::new();
    let out = run(
        db.dir.path(),
        &[
            "run",
            "--db",
            &db.url,
            "job:1",
            "--",
            "sh",
            "-c",
            "echo \"$DBLOCK_NAME $DBLOCK_FENCING_TOKEN\"; exit 7",
        ],
    )
    .await;
    assert_eq!(code(&out), 7);
    // A fresh file's first token: epoch 1 of this boot (epoch x 2^40, then one more per grant).
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("job:1 {}", 1i64 << 40)
    );
    let out = run(
        db.dir.path(),
        &["run", "--db", &db.url, "job:1", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 0);
    assert!(out.stderr.is_empty());
}

#[tokio::test]
async fn a_command_ended_by_signal_n_gives_128_plus_n() {
    let db = SqliteDb::new();
    let out = run(
        db.dir.path(),
        &[
            "run",
            "--db",
            &db.url,
            "s",
            "--",
            "sh",
            "-c",
            "kill -TERM $$",
        ],
    )
    .await;
    assert_eq!(code(&out), 128 + 15);
    let out = run(
        db.dir.path(),
        &[
            "run",
            "--db",
            &db.url,
            "s",
            "--",
            "sh",
            "-c",
            "kill -KILL $$",
        ],
    )
    .await;
    assert_eq!(code(&out), 128 + 9);
}

#[tokio::test]
async fn run_excludes_a_second_run_on_postgres_and_sqlite() {
    let s = PgSchema::new("cli_excl").await;
    let db = SqliteDb::new();
    for url in [s.url.as_str(), db.url.as_str()] {
        // Checked every 50 ms: on PostgreSQL a lock a try granted is named (by its
        // holder's comment: program, pid, host) from its first health check on.
        let locks = dblock_testkit::checked_often(url).await;
        let g = locks.lock("busy").await.unwrap();
        let named = dblock_testkit::until_named_as_holder(&locks, "busy").await;
        assert!(named, "{url}: the holder never named");
        let out = run(
            db.dir.path(),
            &["run", "--db", url, "--no-wait", "busy", "--", "true"],
        )
        .await;
        assert_eq!(code(&out), 75, "{url}");
        // The holder is named: this test's process.
        let err = one_line_error(&out);
        assert!(err.contains(&format!("[{}]", std::process::id())), "{err}");
        let t = Instant::now();
        let out = run(
            db.dir.path(),
            &["run", "--db", url, "--wait", "300ms", "busy", "--", "true"],
        )
        .await;
        assert_eq!(code(&out), 75, "{url}");
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(one_line_error(&out).contains("not obtained within 300ms"));
        // A shared run is refused too, and after the release everything runs.
        let out = run(
            db.dir.path(),
            &[
                "run",
                "--db",
                url,
                "--no-wait",
                "--shared",
                "busy",
                "--",
                "true",
            ],
        )
        .await;
        assert_eq!(code(&out), 75, "{url}");
        // Released and confirmed before the next run asks: a dropped guard's release is
        // sent without waiting, and on PostgreSQL may queue behind a health check (every
        // 50 ms here), so a run started at once could still find the lock held.
        g.release().await.unwrap();
        let out = run(
            db.dir.path(),
            &["run", "--db", url, "--no-wait", "busy", "--", "true"],
        )
        .await;
        assert_eq!(code(&out), 0, "{url}: {out:?}");
    }
}

#[tokio::test]
async fn shared_runs_hold_the_lock_together() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let reader = locks.request("report").shared().lock().await.unwrap();
    let out = run(
        db.dir.path(),
        &[
            "run",
            "--db",
            &db.url,
            "--no-wait",
            "--shared",
            "report",
            "--",
            "sh",
            "-c",
            "test -z \"$DBLOCK_FENCING_TOKEN\"",
        ],
    )
    .await;
    assert_eq!(
        code(&out),
        0,
        "a reader joins a reader, without a token: {out:?}"
    );
    drop(reader);
}

#[tokio::test]
async fn the_database_url_falls_back_through_the_environment_to_the_state_directory() {
    let state = tempfile::tempdir().unwrap();
    // No --db and no variables: the embedded default under XDG_STATE_HOME.
    let out = run(state.path(), &["run", "x", "--", "true"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(state.path().join("dblock/locks.db-locks").exists());
    // HOME when XDG_STATE_HOME is unset.
    let home = tempfile::tempdir().unwrap();
    let out = dblock(state.path())
        .env_remove("XDG_STATE_HOME")
        .env("HOME", home.path())
        .args(["run", "x", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(
        home.path()
            .join(".local/state/dblock/locks.db-locks")
            .exists()
    );
    // DATABASE_URL, and DBLOCK_DATABASE_URL before it.
    let a = SqliteDb::new();
    let b = SqliteDb::new();
    let out = dblock(state.path())
        .env("DATABASE_URL", &a.url)
        .args(["run", "x", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0);
    assert!(a.dir.path().join("locks.db-locks").exists());
    let out = dblock(state.path())
        .env("DATABASE_URL", &a.url)
        .env("DBLOCK_DATABASE_URL", &b.url)
        .args(["run", "x", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0);
    assert!(b.dir.path().join("locks.db-locks").exists());
    // And --db before both; sqlite://PATH is accepted.
    let c = SqliteDb::new();
    let url = format!("sqlite://{}", c.path.display());
    let out = dblock(state.path())
        .env("DBLOCK_DATABASE_URL", &b.url)
        .args(["run", "--db", &url, "x", "--", "true"])
        .output()
        .await
        .unwrap();
    assert_eq!(code(&out), 0);
    assert!(c.dir.path().join("locks.db-locks").exists());
    // postgresql:// is accepted as well as postgres://.
    let s = PgSchema::new("cli_scheme").await;
    let url = s.url.replacen("postgres://", "postgresql://", 1);
    let out = run(state.path(), &["run", "--db", &url, "x", "--", "true"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
}

#[tokio::test]
async fn usage_errors_exit_64_with_one_line() {
    let state = tempfile::tempdir().unwrap();
    let p = state.path();
    for args in [
        vec!["run", "", "--", "true"], // empty name
        vec!["run", "--db", "http://localhost/x", "n", "--", "true"], // unknown scheme
        vec!["run", "--db", "mysql://root@localhost", "n", "--", "true"], // no database
        vec!["run", "--db", "sqlite::memory:", "n", "--", "true"],
        vec!["run", "n", "true"],                                    // no --
        vec!["run", "--wait", "5", "n", "--", "true"],               // no unit
        vec!["run", "--wait", "1s", "--no-wait", "n", "--", "true"], // both
        vec!["run", "--namespace", "", "n", "--", "true"],
        vec!["frobnicate"],
        vec!["key", ""],
        vec![],
    ] {
        let out = run(p, &args).await;
        assert_eq!(code(&out), 64, "{args:?}: {out:?}");
        one_line_error(&out);
    }
    let name = "x".repeat(dblock::MAX_NAME_LEN + 1);
    let out = run(p, &["run", &name, "--", "true"]).await;
    assert_eq!(code(&out), 64);
    one_line_error(&out);
}

#[tokio::test]
async fn an_unreachable_database_exits_69() {
    let state = tempfile::tempdir().unwrap();
    let out = run(
        state.path(),
        &[
            "run",
            "--db",
            "postgres://postgres@127.0.0.1:1/test",
            "n",
            "--",
            "true",
        ],
    )
    .await;
    assert_eq!(code(&out), 69);
    assert!(one_line_error(&out).contains("cannot connect"));
    let out = run(
        state.path(),
        &[
            "run",
            "--db",
            "postgres://u:sekret@127.0.0.1:1/test",
            "n",
            "--",
            "true",
        ],
    )
    .await;
    assert!(
        !one_line_error(&out).contains("sekret"),
        "no password in messages"
    );
}

#[tokio::test]
async fn a_missing_command_exits_127_and_releases() {
    let db = SqliteDb::new();
    let out = run(
        db.dir.path(),
        &["run", "--db", &db.url, "m", "--", "/no/such/command"],
    )
    .await;
    assert_eq!(code(&out), 127);
    one_line_error(&out);
    let out = run(
        db.dir.path(),
        &["run", "--db", &db.url, "--no-wait", "m", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 0);
}

/// Starts `dblock run … -- sh -c SCRIPT` and waits for the script's first line.
async fn start(
    url: &str,
    state: &std::path::Path,
    name: &str,
    script: &str,
) -> (tokio::process::Child, String) {
    let mut child = dblock(state)
        .args(["run", "--db", url, name, "--", "sh", "-c", script])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, first)
}

#[tokio::test]
async fn sigint_and_sigterm_are_passed_to_the_command() {
    let db = SqliteDb::new();
    for (sig, code_want) in [("-TERM", 42), ("-INT", 43)] {
        let script =
            "trap 'exit 42' TERM; trap 'exit 43' INT; echo ready; while :; do sleep 0.05; done";
        let (mut child, first) = start(&db.url, db.dir.path(), "sig", script).await;
        assert_eq!(first, "ready");
        signal(child.id().unwrap(), sig);
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(status.code(), Some(code_want), "{sig}");
    }
}

fn alive(pid: u32) -> bool {
    // A zombie (state Z) is dead; a missing /proc entry is gone.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .next();
            state != Some("Z")
        }
        Err(_) => false,
    }
}

/// dblock killed with SIGKILL: its command must not run on outside the lock.
#[tokio::test]
async fn a_killed_dblock_takes_its_command_with_it() {
    let s = PgSchema::new("cli_kill").await;
    let db = SqliteDb::new();
    for url in [s.url.as_str(), db.url.as_str()] {
        let (mut child, first) = start(url, db.dir.path(), "k", "echo $$; exec sleep 100").await;
        let command_pid: u32 = first.parse().unwrap();
        assert!(alive(command_pid));
        child.start_kill().unwrap(); // SIGKILL to dblock
        child.wait().await.unwrap();
        let gone = dblock_testkit::eventually(5, &mut || async { !alive(command_pid) }).await;
        assert!(gone, "{url}: the command outlived dblock");
        // And the lock is free.
        let locks = dblock::Locks::connect(url).await.unwrap();
        let free = dblock_testkit::eventually(5, &mut || async {
            locks.try_lock("k").await.unwrap().is_some()
        })
        .await;
        assert!(free, "{url}");
    }
}

#[tokio::test]
async fn key_prints_the_key_and_where_pg_locks_shows_it() {
    let state = tempfile::tempdir().unwrap();
    let out = run(state.path(), &["key", "autoland:7"]).await;
    assert_eq!(code(&out), 0);
    let text = String::from_utf8(out.stdout).unwrap();
    let key = dblock::Key::new("public", "autoland:7").unwrap();
    let (classid, objid) = key.pg_locks_ids();
    assert!(
        text.contains(&format!("key       {}", key.as_i64())),
        "{text}"
    );
    assert!(
        text.contains(&format!("classid={classid} objid={objid} objsubid=1")),
        "{text}"
    );
    let out = run(
        state.path(),
        &["key", "--namespace", "tenant_a", "autoland:7"],
    )
    .await;
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(
            &dblock::Key::new("tenant_a", "autoland:7")
                .unwrap()
                .to_string()
        )
    );
}

/// The key `dblock key` prints is the one `dblock run` holds, as pg_locks shows it.
#[tokio::test]
async fn the_printed_key_is_found_in_pg_locks_while_run_holds_it() {
    let s = PgSchema::new("cli_pglocks").await;
    let (mut child, _) = start(
        &s.url,
        std::path::Path::new("/tmp"),
        "visible",
        "echo in; sleep 100",
    )
    .await;
    let out = run(
        std::path::Path::new("/tmp"),
        &["key", "--namespace", &s.name, "visible"],
    )
    .await;
    let text = String::from_utf8(out.stdout).unwrap();
    let query = text
        .lines()
        .find_map(|l| l.strip_prefix("query     "))
        .unwrap();
    let rows = s.admin().query(query, &[]).await.unwrap();
    assert_eq!(rows.len(), 1, "{query}");
    child.start_kill().unwrap();
    child.wait().await.unwrap();
}

/// The lock lost while COMMAND runs: COMMAND gets SIGTERM, then SIGKILL after the grace
/// period, and dblock exits 70 saying the lock was lost.
#[tokio::test]
async fn a_lost_lock_stops_the_command_and_exits_70() {
    let s = PgSchema::new("cli_lost").await;
    let key = dblock::Key::new(&s.name, "lost").unwrap();
    for (script, grace, ignores_term) in [
        (
            "trap 'echo got-term >&2; exit 0' TERM; echo in; while :; do sleep 0.05; done",
            "10s",
            false,
        ),
        (
            "trap '' TERM; echo in; while :; do sleep 0.05; done",
            "300ms",
            true,
        ),
    ] {
        let mut child = dblock(std::path::Path::new("/tmp"))
            .args([
                "run", "--db", &s.url, "--grace", grace, "lost", "--", "sh", "-c", script,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first.as_deref(), Some("in"));
        let cut = Instant::now();
        assert_eq!(s.terminate_holders(key).await, 1);
        let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        let took = cut.elapsed();
        assert_eq!(out.status.code(), Some(70), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("dblock: lock \"lost\" lost while the command ran"),
            "{err}"
        );
        if ignores_term {
            assert!(
                took >= Duration::from_millis(300),
                "SIGKILL only after the grace period: {took:?}"
            );
        } else {
            assert!(err.contains("got-term"), "the command got SIGTERM: {err}");
            assert!(took < Duration::from_secs(5), "{took:?}");
        }
    }
}

/// `dblock bench --json` prints one object per workload with the documented fields, on
/// every backend (figures are not judged here: benchmarks are not timed tests). A floor
/// that kept the hot lock after its slice would hang dblock's hot workers here.
#[tokio::test]
async fn bench_json_reports_every_workload_with_its_floor() {
    let s = PgSchema::new("cli_bench").await;
    let db = SqliteDb::new();
    let my = MyDb::new("cli_bench").await;
    for (url, backend) in [
        (s.url.as_str(), "postgres"),
        (db.url.as_str(), "sqlite"),
        (my.url.as_str(), "mysql"),
    ] {
        let out = run(
            db.dir.path(),
            &["bench", "--db", url, "--seconds", "0.2", "--json"],
        )
        .await;
        assert_eq!(code(&out), 0, "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        let rows: Vec<serde_json::Value> = serde_json::from_str(text.trim()).unwrap();
        let got: Vec<(String, u64)> = rows
            .iter()
            .map(|r| {
                (
                    r["workload"].as_str().unwrap().to_string(),
                    r["workers"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("uncontended".into(), 1),
                ("uncontended".into(), 8),
                ("hot".into(), 8)
            ],
            "{text}"
        );
        for r in &rows {
            assert_eq!(r["backend"], backend);
            for field in ["ops_per_sec", "p50_us", "p99_us", "floor_ops_per_sec"] {
                assert!(r[field].as_f64().unwrap() > 0.0, "{field} in {r}");
            }
            // PostgreSQL's floor checked that it connects as dblock does, and says how.
            if backend == "postgres" {
                assert!(
                    matches!(r["transport"].as_str(), Some("TLS" | "no TLS")),
                    "{r}"
                );
            }
        }
    }
    let out = run(db.dir.path(), &["bench", "--db", &db.url, "--seconds", "0"]).await;
    assert_eq!(code(&out), 64);
}

/// `dblock bench --one-thread` measures in a process of one thread (what makes the
/// embedded floor a plain C loop of `F_OFD_SETLK`: Linux counts no references to the
/// open file then), and says so in every row; the default runtime's process has more
/// (the control: the same count read the same way sees the runtime's threads).
#[cfg(target_os = "linux")]
#[tokio::test]
async fn bench_one_thread_runs_in_a_process_of_one_thread() {
    let db = SqliteDb::new();
    for (args, one) in [(&["--one-thread"][..], true), (&[][..], false)] {
        let mut argv = vec!["bench", "--db", &db.url, "--seconds", "0.1", "--json"];
        argv.extend_from_slice(args);
        let out = run(db.dir.path(), &argv).await;
        assert_eq!(code(&out), 0, "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        let rows: Vec<serde_json::Value> = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(rows.len(), 3, "{text}");
        for r in &rows {
            let threads = r["process_threads"].as_u64().unwrap();
            match one {
                true => assert_eq!(threads, 1, "{r}"),
                false => assert!(threads > 1, "{r}"),
            }
            assert!(r["floor_ops_per_sec"].as_f64().unwrap() > 0.0, "{r}");
            // Both sides' CPU a cycle: each ran flat out for the slice, so it took some.
            for side in ["cpu_us", "floor_cpu_us"] {
                let (u, s) = (&r[side]["user"], &r[side]["system"]);
                let (u, s) = (u.as_f64().unwrap(), s.as_f64().unwrap());
                assert!(u >= 0.0 && s >= 0.0 && u + s > 0.0, "{side}: {r}");
            }
        }
    }
    // The table says how many threads the process had.
    let out = run(
        db.dir.path(),
        &["bench", "--db", &db.url, "--seconds", "0.1", "--one-thread"],
    )
    .await;
    assert_eq!(code(&out), 0, "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("a process of 1 thread"), "{text}");
    assert!(text.contains("cpu µs u+s"), "{text}");
}

/// `run`, `key` and `bench` with a mysql:// URL: the run holds the lock `key` names (as
/// the server shows it), with a fencing token; a second run is refused; `--shared` is a
/// usage error; the benchmark reports every workload beside its floor.
#[tokio::test]
async fn run_key_and_bench_work_with_a_mysql_url() {
    let db = MyDb::new("cli_mysql").await;
    let state = tempfile::tempdir().unwrap();
    let (mut child, first) = start(
        &db.url,
        state.path(),
        "visible",
        // `exec`: the command itself sleeps, so killing dblock (its parent-death signal)
        // ends the command and frees the lock; a `sleep` in the background would keep
        // the lock's descriptor, and so the lock, until it ended.
        "echo token=$DBLOCK_FENCING_TOKEN; exec sleep 100",
    )
    .await;
    assert_eq!(first, "token=1");
    let out = run(state.path(), &["key", "--db", &db.url, "visible"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains(&db.lock_name("visible")), "{text}");
    let query = text
        .lines()
        .find_map(|l| l.strip_prefix("query     "))
        .unwrap();
    let holder: Option<i64> =
        dblock::sqlx::query_scalar(dblock::sqlx::AssertSqlSafe(query.to_string()))
            .fetch_one(db.admin())
            .await
            .unwrap();
    assert!(holder.is_some(), "{query} shows the run's session");
    let out = run(
        state.path(),
        &["run", "--db", &db.url, "--no-wait", "visible", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 75);
    let out = run(
        state.path(),
        &["run", "--db", &db.url, "--shared", "other", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 64);
    assert!(one_line_error(&out).contains("shared"));
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    assert!(db.eventually_free(&db.lock_name("visible"), 10).await);

    let out = run(
        state.path(),
        &["bench", "--db", &db.url, "--seconds", "0.2", "--json"],
    )
    .await;
    assert_eq!(code(&out), 0, "{out:?}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(String::from_utf8(out.stdout).unwrap().trim()).unwrap();
    assert_eq!(rows.len(), 3);
    for r in &rows {
        assert_eq!(r["backend"], "mysql");
        for field in ["ops_per_sec", "p50_us", "floor_ops_per_sec"] {
            assert!(r[field].as_f64().unwrap() > 0.0, "{field} in {r}");
        }
    }
}

/// Output to a pipe whose reader has gone is dropped, not a panic.
#[tokio::test]
async fn a_closed_stdout_is_not_a_panic() {
    let state = tempfile::tempdir().unwrap();
    let mut child = dblock(state.path())
        .args(["key", "autoland:7"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away before dblock writes
    let out = child.wait_with_output().await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0));
}
