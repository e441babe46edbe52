//! `dblock exporter`: the server's view over HTTP, with real holders, waiters and
//! leaders in processes of their own (`dblock run`), on every backend — then a scrape,
//! checked by `promtool check metrics`; the page at `/` in a real headless Chromium; a
//! server that stops answering, one that is down, one that fails over; and bad input.
//!
//! ```text
//! dblock exporter [--db URL] [--namespace NS] --listen ADDR [--name PATTERN]...
//!     [--group PATTERN]... [--election PATTERN]... [--deadline DURATION]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dblock_testkit::{
    MyDb, PgSchema, SilentProxy, SqliteDb, eventually, exit_code as code, one_line_error,
    tcp_host_port, with_host_port,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

fn dblock(state: &std::path::Path) -> Command {
    let mut c = dblock_testkit::dblock_command(DBLOCK, state);
    c.env("DBLOCK_NO_DEFAULT_NOTICE", "1");
    c
}

/// Bounds an await: a hung step fails the test with its name.
async fn within<T>(secs: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer in {secs} s"))
}

/// `dblock run --db URL [extra] NAME -- COMMAND…` in the background.
fn run(state: &std::path::Path, url: &str, extra: &[&str], name: &str, cmd: &[&str]) -> Child {
    let mut c = dblock(state);
    c.args(["run", "--db", url])
        .args(extra)
        .arg(name)
        .arg("--")
        .args(cmd)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c.spawn().unwrap()
}

/// A running `dblock exporter`, its port and what it has said on stderr.
struct Exporter {
    child: Child,
    port: u16,
    said: Arc<Mutex<Vec<String>>>,
}

impl Exporter {
    /// Starts `dblock exporter --db URL --listen 127.0.0.1:0 ARGS…` and waits until it
    /// says where it serves.
    async fn start(state: &std::path::Path, url: &str, args: &[&str]) -> Exporter {
        let mut child = dblock(state)
            .args(["exporter", "--db", url, "--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let said: Arc<Mutex<Vec<String>>> = Arc::default();
        let port = within(30, "the exporter's start", async {
            loop {
                let Some(line) = lines.next_line().await.unwrap() else {
                    panic!("the exporter ended: {:?}", said.lock().unwrap());
                };
                said.lock().unwrap().push(line.clone());
                let prefix = "dblock: exporter serving http://127.0.0.1:";
                if let Some(rest) = line.strip_prefix(prefix) {
                    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    break digits.parse::<u16>().unwrap();
                }
            }
        })
        .await;
        let keep = said.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                keep.lock().unwrap().push(line);
            }
        });
        Exporter { child, port, said }
    }

    /// GET `path`: (status, headers, body).
    async fn get(&self, path: &str) -> (u16, String, String) {
        within(60, &format!("GET {path}"), http_get(self.port, path)).await
    }

    async fn metrics(&self) -> String {
        let (status, headers, body) = self.get("/metrics").await;
        assert_eq!(status, 200, "{headers}\n{body}");
        assert!(
            headers
                .to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{headers}"
        );
        body
    }

    fn said(&self) -> String {
        self.said.lock().unwrap().join("\n")
    }

    /// Still running: no crash.
    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

async fn http_get(port: u16, path: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

/// The value of sample `name{labels}` (labels as written, `name="x"`; empty: none).
fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = match labels {
        "" => format!("{name} "),
        l => format!("{name}{{{l}}} "),
    };
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map(|v| v.trim().parse().unwrap())
}

/// `promtool check metrics` on `text`: passes, with nothing to say.
fn promtool_passes(text: &str) {
    use std::io::Write;
    let mut c = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (the Debian package `prometheus`; .ci/run installs it)");
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool: {said}\n{text}"
    );
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A holder of `deploy:7` and two waiters, two holders of `batch:*` names, all in
/// processes of their own: the exporter reports them under the labels asked for, the
/// holder as the leader of election `deploy:7` (a fenced grant), an election nobody
/// leads as absent; the second scrape, later, shows the hold and the wait have aged;
/// the output passes promtool.
async fn the_exporter_reports_holders_waiters_and_leaders(url: &str) {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let started = now_secs();
    let exp = Exporter::start(
        s,
        url,
        &[
            "--name",
            "deploy:7",
            "--group",
            "batch:*",
            "--election",
            "deploy:7",
            "--election",
            "nobody-leads",
            "--election",
            "shard:*",
        ],
    )
    .await;
    // Before anything is held: every asked-for series is there, at 0.
    let text = exp.metrics().await;
    assert_eq!(
        value(&text, "dblock_server_locks_held", "name=\"deploy:7\""),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "dblock_server_locks_held", "name=\"batch:*\""),
        Some(0.0)
    );
    assert_eq!(
        value(
            &text,
            "dblock_server_election_leader_present",
            "election=\"deploy:7\""
        ),
        Some(0.0)
    );
    promtool_passes(&text);

    let mut holder = run(s, url, &[], "deploy:7", &["sleep", "120"]);
    // A leader found by prefix: reported once its term is recorded.
    let mut shard = run(s, url, &[], "shard:1", &["sleep", "120"]);
    let mut batch: Vec<Child> = ["batch:1", "batch:2"]
        .iter()
        // Fenced (the default): the embedded backend and MySQL name a lock that is not
        // asked for by name from the fencing table only (docs/status.md).
        .map(|n| run(s, url, &[], n, &["sleep", "120"]))
        .collect();
    let held = eventually(30, &mut || async {
        let t = exp.metrics().await;
        value(&t, "dblock_server_locks_held", "name=\"deploy:7\"") == Some(1.0)
            && value(&t, "dblock_server_locks_held", "name=\"batch:*\"") == Some(2.0)
    })
    .await;
    assert!(held, "{}", exp.metrics().await);
    let mut waiters: Vec<Child> = (0..2)
        .map(|_| run(s, url, &["--wait", "120s"], "deploy:7", &["true"]))
        .collect();
    let waiting = eventually(30, &mut || async {
        let t = exp.metrics().await;
        value(&t, "dblock_server_lock_waiters", "name=\"deploy:7\"") == Some(2.0)
    })
    .await;
    assert!(waiting, "{}", exp.metrics().await);
    // Ages grow from one scrape to the next (first seen, where the server does not say).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let text = exp.metrics().await;
    let hold = value(
        &text,
        "dblock_server_lock_longest_hold_seconds",
        "name=\"deploy:7\"",
    )
    .unwrap();
    let wait = value(
        &text,
        "dblock_server_lock_oldest_wait_seconds",
        "name=\"deploy:7\"",
    )
    .unwrap();
    assert!((1.0..120.0).contains(&hold), "{text}");
    assert!((1.0..120.0).contains(&wait), "{text}");
    assert_eq!(
        value(
            &text,
            "dblock_server_election_leader_present",
            "election=\"deploy:7\""
        ),
        Some(1.0),
        "{text}"
    );
    let since = value(
        &text,
        "dblock_server_election_leader_since_timestamp_seconds",
        "election=\"deploy:7\"",
    )
    .unwrap();
    assert!(
        since > started - 60.0 && since < now_secs() + 60.0,
        "{since} {text}"
    );
    assert_eq!(
        value(
            &text,
            "dblock_server_election_leader_present",
            "election=\"nobody-leads\""
        ),
        Some(0.0)
    );
    assert_eq!(
        value(&text, "dblock_exporter_scrape_success", ""),
        Some(1.0)
    );
    assert_eq!(
        value(
            &text,
            "dblock_server_election_leader_present",
            "election=\"shard:1\""
        ),
        Some(1.0),
        "{text}"
    );
    // Names not asked for are never labels of their own.
    assert!(!text.contains("batch:1"), "{text}");
    promtool_passes(&text);

    holder.kill().await.unwrap();
    for w in &mut waiters {
        within(60, "a waiter's turn", w.wait()).await.unwrap();
    }
    for b in &mut batch {
        b.kill().await.unwrap();
    }
    shard.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_reports_holders_waiters_and_leaders_on_postgres() {
    let db = PgSchema::new("exporter_view").await;
    the_exporter_reports_holders_waiters_and_leaders(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_reports_holders_waiters_and_leaders_on_sqlite() {
    let db = SqliteDb::new();
    the_exporter_reports_holders_waiters_and_leaders(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_reports_holders_waiters_and_leaders_on_mysql() {
    let db = MyDb::new("exporter_view").await;
    the_exporter_reports_holders_waiters_and_leaders(&db.url).await;
}

/// The record of runs' collector: a job that never ran is 0; after a successful run of
/// a slot, its finish time (on the database's clock, so only bounded loosely here); a
/// later failed slot does not move it; the output passes promtool.
async fn the_exporter_reports_when_each_job_last_succeeded(url: &str) {
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let exp = Exporter::start(s, url, &["--job", "nightly", "--job", "never-ran"]).await;
    let job = |t: &str, n: &str| {
        value(
            t,
            "dblock_server_job_last_success_timestamp_seconds",
            &format!("name=\"{n}\""),
        )
    };
    let text = exp.metrics().await;
    assert_eq!(job(&text, "nightly"), Some(0.0), "{text}");
    assert_eq!(job(&text, "never-ran"), Some(0.0), "{text}");
    let before = now_secs();
    for (slot, cmd) in [("2026-12-01", "true"), ("2026-12-02", "false")] {
        let status = run(s, url, &["--slot", slot], "nightly", &[cmd])
            .wait()
            .await
            .unwrap();
        assert_eq!(status.success(), cmd == "true", "{slot}: {status:?}");
    }
    let text = exp.metrics().await;
    let last = job(&text, "nightly").unwrap();
    // The database's clock, not this host's: within a minute of the run.
    assert!(
        (before - 60.0..now_secs() + 60.0).contains(&last),
        "{last} vs {before}\n{text}"
    );
    assert_eq!(job(&text, "never-ran"), Some(0.0), "{text}");
    assert_eq!(
        value(
            &text,
            "dblock_exporter_collector_success",
            "collector=\"runs\""
        ),
        Some(1.0),
        "{text}"
    );
    promtool_passes(&text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_reports_when_each_job_last_succeeded_on_postgres() {
    let db = PgSchema::new("exporter_runs").await;
    the_exporter_reports_when_each_job_last_succeeded(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_reports_when_each_job_last_succeeded_on_sqlite() {
    let db = SqliteDb::new();
    the_exporter_reports_when_each_job_last_succeeded(&db.url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_reports_when_each_job_last_succeeded_on_mysql() {
    let db = MyDb::new("exporter_runs").await;
    the_exporter_reports_when_each_job_last_succeeded(&db.url).await;
}

/// Chromium, headless, as root in a fresh profile.
fn chromium(profile: &std::path::Path, args: &[&str]) -> std::process::Output {
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("chromium (the Debian package; .ci/run installs it)");
    assert!(
        out.status.success(),
        "chromium {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The page at `/` in a real browser, while a real holder and waiters exist: it shows
/// the lock's name (a name that is markup, shown as text, never run), the holder's
/// process and the waiters, reloads itself, and fits a phone's screen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_who_holds_what_in_a_real_browser() {
    let db = SqliteDb::new();
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let name = "<img src=x onerror=alert(1)> & \"deploy\"";
    let mut holder = run(s, &db.url, &[], name, &["sleep", "120"]);
    let holder_pid = holder.id().unwrap();
    let exp = Exporter::start(s, &db.url, &["--refresh", "3s"]).await;
    let held = eventually(30, &mut || async {
        let t = exp.metrics().await;
        value(&t, "dblock_server_locks_held", "name=\"(other)\"") == Some(1.0)
    })
    .await;
    assert!(held, "{}", exp.metrics().await);
    let mut waiters: Vec<Child> = (0..2)
        .map(|_| run(s, &db.url, &["--wait", "120s"], name, &["true"]))
        .collect();
    let waiting = eventually(30, &mut || async {
        let t = exp.metrics().await;
        value(&t, "dblock_server_lock_waiters", "name=\"(other)\"") == Some(2.0)
    })
    .await;
    assert!(waiting);

    let (status, headers, _) = exp.get("/").await;
    assert_eq!(status, 200);
    let lower = headers.to_ascii_lowercase();
    assert!(lower.contains("content-type: text/html"), "{headers}");
    assert!(
        lower.contains("content-security-policy: default-src 'none'"),
        "{headers}"
    );

    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://127.0.0.1:{}/", exp.port);
    let dom = tokio::task::spawn_blocking({
        let (p, u) = (profile.path().to_path_buf(), url.clone());
        move || chromium(&p, &["--dump-dom", &u])
    })
    .await
    .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout).to_string();
    // The name is text: escaped in the DOM, no element made of it.
    assert!(
        dom.contains("&lt;img src=x onerror=alert(1)&gt; &amp; \"deploy\""),
        "{dom}"
    );
    assert!(!dom.contains("<img"), "{dom}");
    assert!(dom.contains(&format!("[{holder_pid}]")), "{dom}");
    assert!(
        dom.contains("http-equiv=\"refresh\" content=\"3\""),
        "{dom}"
    );
    for w in &waiters {
        assert!(dom.contains(&format!("[{}]", w.id().unwrap())), "{dom}");
    }
    let row = dom
        .split("<tr>")
        .find(|r| r.contains("onerror"))
        .expect("the lock's row");
    assert!(row.contains("<span class=\"n\">2</span>"), "{row}");

    // A phone-sized screenshot, kept out of the repository.
    let shot =
        std::env::temp_dir().join(format!("dblock-exporter-page-{}.png", std::process::id()));
    tokio::task::spawn_blocking({
        let (p, u, shot) = (profile.path().to_path_buf(), url.clone(), shot.clone());
        move || {
            chromium(
                &p,
                &[
                    &format!("--screenshot={}", shot.display()),
                    "--window-size=390,844",
                    &u,
                ],
            )
        }
    })
    .await
    .unwrap();
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 1000);
    eprintln!("phone-sized screenshot: {}", shot.display());

    holder.kill().await.unwrap();
    for w in &mut waiters {
        within(60, "a waiter's turn", w.wait()).await.unwrap();
    }
}

/// A server that stops answering (a proxy that forwards nothing more): each scrape ends
/// at its deadline as a metric — success 0, no stale lock values — and the exporter
/// goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_is_a_failed_scrape_at_the_deadline_not_a_hang() {
    let db = PgSchema::new("exporter_silent").await;
    let proxy = SilentProxy::start(tcp_host_port(&db.url)).await;
    let url = with_host_port(&db.url, "127.0.0.1", proxy.port);
    let state = tempfile::tempdir().unwrap();
    let mut exp = Exporter::start(
        state.path(),
        &url,
        &["--deadline", "1s", "--name", "deploy"],
    )
    .await;
    let text = exp.metrics().await;
    assert_eq!(
        value(&text, "dblock_exporter_scrape_success", ""),
        Some(1.0)
    );
    proxy.silence();
    for _ in 0..2 {
        let text = exp.metrics().await;
        assert_eq!(
            value(&text, "dblock_exporter_scrape_success", ""),
            Some(0.0),
            "{text}"
        );
        let took = value(&text, "dblock_exporter_scrape_duration_seconds", "").unwrap();
        assert!(took >= 1.0, "ended at the deadline: {took}");
        assert_eq!(
            value(&text, "dblock_server_locks_held", "name=\"deploy\""),
            None
        );
        promtool_passes(&text);
    }
    let text = exp.metrics().await;
    assert!(
        value(&text, "dblock_exporter_scrape_failures_total", "").unwrap() >= 3.0,
        "{text}"
    );
    let (status, _, page) = exp.get("/").await;
    assert_eq!(status, 200);
    assert!(page.contains("id=\"error\""), "{page}");
    assert!(exp.alive(), "{}", exp.said());
    let said = eventually(10, &mut || async {
        exp.said().contains("scrape failed: timed out")
    })
    .await;
    assert!(said, "{}", exp.said());
}

/// A server that is down when the exporter starts: it serves anyway, says so once, and
/// each scrape reports the failure; a server that comes up is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_down_at_start_is_reported_until_it_is_up() {
    let cluster = dblock_testkit::cluster::TempCluster::start(&[]);
    let url = cluster.url();
    cluster.stop();
    let state = tempfile::tempdir().unwrap();
    let mut exp = Exporter::start(state.path(), &url, &["--deadline", "2s"]).await;
    assert!(
        exp.said().contains("cannot read the database yet"),
        "{}",
        exp.said()
    );
    let text = exp.metrics().await;
    assert_eq!(
        value(&text, "dblock_exporter_scrape_success", ""),
        Some(0.0)
    );
    promtool_passes(&text);
    cluster.start_again();
    let up = eventually(30, &mut || async {
        value(&exp.metrics().await, "dblock_exporter_scrape_success", "") == Some(1.0)
    })
    .await;
    assert!(up, "{}", exp.said());
    assert!(exp.alive());
    // Said on stderr, which this test reads on a task of its own.
    let said = eventually(10, &mut || async {
        exp.said().contains("scrapes succeed again")
    })
    .await;
    assert!(said, "{}", exp.said());
}

/// A failover: the exporter reads a primary and its standby by one URL (read-write
/// wanted); the primary stops — scrapes fail, as metrics, nothing crashes — and once the
/// standby is promoted they succeed again, through the other host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_during_a_failover_fails_cleanly_and_recovers() {
    use dblock_testkit::cluster::TempCluster;
    let primary = TempCluster::start(&[]);
    let standby = TempCluster::standby_of(&primary);
    let (p, s) = (tcp_host_port(&primary.url()), tcp_host_port(&standby.url()));
    let url = format!(
        "postgres://postgres@{}:{},{}:{}/postgres?target_session_attrs=read-write",
        p.0, p.1, s.0, s.1
    );
    let state = tempfile::tempdir().unwrap();
    let st = state.path();
    let mut holder = run(st, &primary.url(), &[], "deploy", &["sleep", "120"]);
    let mut exp = Exporter::start(
        st,
        &url,
        &[
            "--deadline",
            "2s",
            "--name",
            "deploy",
            "--election",
            "deploy",
        ],
    )
    .await;
    let seen = eventually(30, &mut || async {
        value(
            &exp.metrics().await,
            "dblock_server_locks_held",
            "name=\"deploy\"",
        ) == Some(1.0)
    })
    .await;
    assert!(seen, "{}", exp.metrics().await);
    primary.stop();
    let text = exp.metrics().await;
    assert_eq!(
        value(&text, "dblock_exporter_scrape_success", ""),
        Some(0.0),
        "{text}"
    );
    promtool_passes(&text);
    assert!(exp.alive(), "{}", exp.said());
    standby.promote();
    let back = eventually(60, &mut || async {
        value(&exp.metrics().await, "dblock_exporter_scrape_success", "") == Some(1.0)
    })
    .await;
    assert!(back, "{}", exp.said());
    // The promoted server has no holder: the lock died with the old primary.
    let text = exp.metrics().await;
    assert_eq!(
        value(&text, "dblock_server_locks_held", "name=\"deploy\""),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "dblock_server_election_leader_present",
            "election=\"deploy\""
        ),
        Some(0.0)
    );
    assert!(exp.alive());
    let _ = holder.kill().await;
}

/// Bad input: a port in use, a bad pattern, an address that is not one, a bad URL —
/// each a one-line error with its exit code, before anything is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_one_clear_line() {
    let db = SqliteDb::new();
    let state = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let cases: [(&[&str], u8, &str); 6] = [
        (&["--listen", &listen], 69, "cannot listen on"),
        (
            &["--listen", "127.0.0.1:0", "--name", "a*b"],
            64,
            "no other *",
        ),
        (
            &["--listen", "127.0.0.1:0", "--election", ""],
            64,
            "pattern",
        ),
        (&["--listen", "nonsense"], 64, "is not HOST:PORT"),
        (
            &["--listen", "127.0.0.1:0", "--deadline", "0s"],
            64,
            "more than 0",
        ),
        (
            &["--listen", "127.0.0.1:0", "--db", "postgres://u@[::1/x"],
            64,
            "invalid database URL",
        ),
    ];
    for (args, want, says) in cases {
        let mut c = dblock(state.path());
        c.arg("exporter");
        if !args.contains(&"--db") {
            c.args(["--db", &db.url]);
        }
        let out = within(30, "the exporter's refusal", c.args(args).output())
            .await
            .unwrap();
        assert_eq!(code(&out) as u8, want, "{args:?}: {out:?}");
        let line = one_line_error(&out);
        assert!(line.contains(says), "{args:?}: {line}");
    }
    drop(taken);
}
