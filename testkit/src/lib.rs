//! Test support for dblock: a schema (and lock namespace) of its own for every test,
//! an administrator's view of `pg_locks`, and the worker binary for tests across real
//! OS processes.
//!
//! The servers come from the environment: `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`). A server that cannot be reached fails the
//! test with a message saying so; it is never skipped.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

pub mod adoption;
pub mod appdb;
pub mod beside;
pub mod cluster;
pub mod mariadb_server;
pub mod migrations;
pub mod mysql;
pub mod pgbouncer;
pub mod semantics;
pub mod testdb;
pub mod tls;

pub use mysql::{MyDb, mysql_url};
pub use testdb::TestDb;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio_postgres::{Client, NoTls};

/// The PostgreSQL server the tests use.
pub fn pg_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_string())
}

/// A backstop for awaits a test forgot to bound: the first use of the testkit in a test
/// binary starts a thread that ends the process, failing it, once the binary has run for
/// `DBLOCK_TEST_WATCHDOG_SECS` (900 unless set) — a hang fails CI instead of stalling it.
/// Tests still bound their own awaits; this only catches what they miss.
pub fn watchdog() {
    static START: std::sync::Once = std::sync::Once::new();
    START.call_once(|| {
        let secs = std::env::var("DBLOCK_TEST_WATCHDOG_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(900u64);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(secs));
            eprintln!(
                "dblock-testkit watchdog: this test binary is still running after {secs} s; \
                 a test hangs (an unbounded await?)"
            );
            std::process::exit(101);
        });
    });
}

/// Connects as the tests' administrator, failing loudly when the server is missing.
pub async fn admin_connect(url: &str) -> Client {
    watchdog();
    let (client, conn) = match tokio_postgres::connect(url, NoTls).await {
        Ok(c) => c,
        Err(e) => panic!(
            "PostgreSQL at {url} is not reachable ({e}); start it or point DATABASE_URL at \
             a server (see README: Running the tests)"
        ),
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

pub(crate) fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let tag: String = tag
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(30)
        .collect();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "t_{tag}_{}_{}_{:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos & 0xffff
    )
}

/// A schema of one test's own: its name is the schema in use and (through the setting
/// `dblock.namespace`) the default namespace of every handle built from
/// [`PgSchema::url`], so tests running in parallel never share a lock by accident,
/// and its connections carry an `application_name` of their own so the test can find
/// them in `pg_stat_activity`.
pub struct PgSchema {
    pub name: String,
    pub url: String,
    pub app: String,
    admin: Client,
    base: String,
    /// The database of the schema's own, if it has one (dropped after the schema).
    _db: Option<PgDatabase>,
}

impl PgSchema {
    pub async fn new(tag: &str) -> PgSchema {
        PgSchema::on(&pg_url(), tag).await
    }

    pub async fn on(base: &str, tag: &str) -> PgSchema {
        let name = unique(tag);
        let admin = admin_connect(base).await;
        admin
            .batch_execute(&format!("CREATE SCHEMA \"{name}\""))
            .await
            .unwrap();
        let app = format!("dbl-{name}");
        let url = with_params(
            base,
            &[
                (
                    "options",
                    &format!("-c search_path={name} -c dblock.namespace={name}"),
                ),
                ("application_name", &app),
            ],
        );
        PgSchema {
            name,
            url,
            app,
            admin,
            base: base.to_string(),
            _db: None,
        }
    }

    /// A schema in a database of its own ([`PgDatabase`]): for tests that take the
    /// database-wide migration lock, so that tests running in parallel never wait for
    /// each other's migrations or see each other's sessions holding it.
    pub async fn own_database(tag: &str) -> PgSchema {
        let db = PgDatabase::new(tag).await;
        let mut s = PgSchema::on(&with_database(&pg_url(), &db.name), tag).await;
        s._db = Some(db);
        s
    }

    pub fn admin(&self) -> &Client {
        &self.admin
    }

    /// A handle on this schema's namespace.
    pub async fn locks(&self) -> dblock::Locks {
        dblock::Locks::connect(&self.url).await.unwrap()
    }

    /// Rows of `pg_locks` for advisory key `key`: (pid, mode, granted).
    pub async fn advisory(&self, key: dblock::Key) -> Vec<(i32, String, bool)> {
        let (classid, objid) = key.pg_locks_ids();
        self.admin
            .query(
                "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory' \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND classid = $1::int8::oid AND objid = $2::int8::oid AND objsubid = 1",
                &[&(classid as i64), &(objid as i64)],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    }

    /// The sessions of this test's handles: (pid, state), where state is `idle`,
    /// `active`, `idle in transaction`…
    pub async fn sessions(&self) -> Vec<(i32, String)> {
        self.admin
            .query(
                "SELECT pid, coalesce(state, '') FROM pg_stat_activity WHERE application_name = $1",
                &[&self.app],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }

    /// Every advisory lock held or awaited by this test's sessions.
    pub async fn advisory_of_sessions(&self) -> Vec<(i32, String, bool)> {
        self.admin
            .query(
                "SELECT l.pid, l.mode, l.granted FROM pg_locks l JOIN pg_stat_activity a \
                 ON a.pid = l.pid WHERE l.locktype = 'advisory' AND a.application_name = $1",
                &[&self.app],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    }

    /// Terminates the test's sessions that hold or wait for `key`; returns how many.
    pub async fn terminate_holders(&self, key: dblock::Key) -> usize {
        let mut n = 0;
        for (pid, _, granted) in self.advisory(key).await {
            if granted {
                // With a timeout (PostgreSQL 14+) it returns once the backend has
                // exited, so its locks are gone: the client may see its socket close
                // before that, and a test that asks for the lock at once would race.
                self.admin
                    .query("SELECT pg_terminate_backend($1, 5000)", &[&pid])
                    .await
                    .unwrap();
                n += 1;
            }
        }
        n
    }

    /// Polls `f` until it is true or `secs` pass; returns whether it became true.
    pub async fn eventually<F, Fut>(&self, secs: u64, mut f: F) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        eventually(secs, &mut f).await
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        // Left behind when the test failed, to look at; dropped otherwise.
        if std::thread::panicking() {
            eprintln!("test schema {} left in place for inspection", self.name);
            return;
        }
        drop_in_background(
            self.base.clone(),
            format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name),
        );
    }
}

/// Runs `sql` on `url` from a `Drop` (which cannot await, and may run inside a runtime):
/// on a thread of its own with a runtime of its own, waiting for it; errors are ignored.
fn drop_in_background(url: String, sql: String) {
    let _ = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            if let Ok((c, conn)) = tokio_postgres::connect(&url, NoTls).await {
                tokio::spawn(conn);
                let _ = c.batch_execute(&sql).await;
            }
        });
    })
    .join();
}

/// A handle on `url` whose held locks are checked every 50 ms: on PostgreSQL a lock a
/// try granted is named (by its holder's comment) from its first health check on, so a
/// test that reads holders' names waits that long at most ([`until_named_as_holder`]).
pub async fn checked_often(url: &str) -> dblock::Locks {
    dblock::Locks::builder()
        .url(url)
        .check_interval(std::time::Duration::from_millis(50))
        .build()
        .await
        .unwrap()
}

/// Waits (up to 10 s) until `locks`' status of `name` shows this process as a holder:
/// on PostgreSQL a lock a try granted is named, with its holder's pid, from its first
/// health check on (give the handle a short `check_interval`). Whether it did.
pub async fn until_named_as_holder(locks: &dblock::Locks, name: &str) -> bool {
    let me = Some(std::process::id());
    eventually(10, &mut || async {
        let st = locks.status(&[name]).await.unwrap_or_default();
        st.iter().flat_map(|l| &l.holders).any(|h| h.pid == me)
    })
    .await
}

/// Polls `f` until it is true or `secs` pass; returns whether it became true.
pub async fn eventually<F, Fut>(secs: u64, f: &mut F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if f().await {
            return true;
        }
        if std::time::Instant::now() > end {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// `base` naming database `db` instead of its own (see [`adoption::with_database`]).
pub use adoption::with_database;

/// A database of one test's own, on the server of [`pg_url`]: for tests that take the
/// database-wide migration lock or depend on what exists database-wide (the fencing
/// table). Dropped (with `FORCE`) when the test passes; left for inspection when it fails.
pub struct PgDatabase {
    pub name: String,
    /// The URL of the database, with `application_name` set to [`PgDatabase::app`].
    pub url: String,
    pub app: String,
}

impl PgDatabase {
    pub async fn new(tag: &str) -> PgDatabase {
        let base = pg_url();
        let name = unique(tag);
        let admin = admin_connect(&base).await;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap();
        let app = format!("dbl-{name}");
        let url = with_params(&with_database(&base, &name), &[("application_name", &app)]);
        PgDatabase { name, url, app }
    }

    /// An administrator's connection to the test's database.
    pub async fn admin(&self) -> Client {
        admin_connect(&self.url).await
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test database {} left in place for inspection", self.name);
            return;
        }
        drop_in_background(
            pg_url(),
            format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name),
        );
    }
}

/// `base` with query parameters added.
pub fn with_params(base: &str, params: &[(&str, &str)]) -> String {
    let mut url = base.to_string();
    for (k, v) in params {
        url.push(if url.contains('?') { '&' } else { '?' });
        url.push_str(k);
        url.push('=');
        url.push_str(&percent_encode(v));
    }
    url
}

fn percent_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An SQLite database in a temporary directory of its own.
pub struct SqliteDb {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub url: String,
}

impl SqliteDb {
    pub fn new() -> SqliteDb {
        watchdog();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locks.db");
        let url = format!("sqlite:{}", path.display());
        SqliteDb { dir, path, url }
    }

    pub async fn locks(&self) -> dblock::Locks {
        dblock::Locks::connect(&self.url).await.unwrap()
    }
}

impl Default for SqliteDb {
    fn default() -> Self {
        SqliteDb::new()
    }
}

/// The `dblock` program with a clean environment: no URL variables, state (the
/// embedded default's directory) under `state`, killed if the test drops it.
pub fn dblock_command(bin: &str, state: &std::path::Path) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(bin);
    c.env_remove("DBLOCK_DATABASE_URL")
        .env_remove("DATABASE_URL")
        .env("XDG_STATE_HOME", state)
        .kill_on_drop(true);
    c
}

/// Runs the `dblock` program ([`dblock_command`], `DBLOCK_NO_DEFAULT_NOTICE=1`, with
/// `env`) with `args` to its end; fails the test if it runs for more than 60 s.
pub async fn dblock_output(
    bin: &str,
    state: &std::path::Path,
    env: &[(&str, &str)],
    args: &[&str],
) -> std::process::Output {
    let mut c = dblock_command(bin, state);
    c.env("DBLOCK_NO_DEFAULT_NOTICE", "1")
        .envs(env.iter().copied())
        .args(args);
    match tokio::time::timeout(std::time::Duration::from_secs(60), c.output()).await {
        Ok(out) => out.unwrap(),
        Err(_) => panic!("dblock {args:?} still running after 60 s"),
    }
}

/// Holds the database-wide migration lock of the PostgreSQL database at `url` on a
/// session of its own, as a `dblock migrate` that runs for minutes would, until the
/// returned client is dropped.
pub async fn hold_migration_lock(url: &str) -> Client {
    let migrating = admin_connect(url).await;
    migrating
        .batch_execute(&format!(
            "SELECT pg_advisory_lock({})",
            dblock::migrate::MIGRATION_LOCK_KEY
        ))
        .await
        .unwrap();
    migrating
}

/// Behind `proxy` falling silent, when does the holder of `guard` learn that it lost the
/// lock, and when is `other` granted it? (learned, granted), from the moment of silence.
/// `free_now`, run at that moment, may free the lock on the server at once (a control);
/// otherwise the holder's lease must.
pub async fn silent_holder_race<F: std::future::Future<Output = ()>>(
    guard: dblock::LockGuard,
    proxy: &SilentProxy,
    other: &dblock::Locks,
    name: &str,
    free_now: F,
) -> (std::time::Duration, std::time::Duration) {
    use testdb::within;
    let lost = guard.lost();
    let lost = tokio::spawn(async move {
        lost.await;
        tokio::time::Instant::now()
    });
    let silent_at = tokio::time::Instant::now();
    proxy.silence();
    free_now.await;
    let g = within(60, "the lock, for another handle", other.lock(name))
        .await
        .unwrap();
    let granted = tokio::time::Instant::now() - silent_at;
    let learned = within(60, "the silent holder's lost()", lost)
        .await
        .unwrap()
        - silent_at;
    drop(g);
    drop(guard);
    (learned, granted)
}

/// The error contract of the `dblock` program: one line on stderr, starting
/// `dblock: `, never a panic or a backtrace. Returns the line.
pub fn one_line_error(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("dblock: "), "{err:?}");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err:?}"
    );
    err
}

/// A process's exit code (-1 if a signal ended it).
pub fn exit_code(out: &std::process::Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

/// Sends `sig` (e.g. `"-STOP"`) to process `pid` with kill(1), failing the test if it
/// cannot.
pub fn signal(pid: impl std::fmt::Display, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill {sig} {pid}");
}

/// `base` (a `postgres://` URL) with its host and port replaced by `host:port`; user,
/// password, database and parameters are kept. For routing a handle through a proxy.
pub fn with_host_port(base: &str, host: &str, port: u16) -> String {
    let Some(scheme_end) = base.find("://") else {
        panic!("DATABASE_URL must be a postgres:// URL to route it elsewhere: {base}");
    };
    let start = scheme_end + 3;
    let end = base[start..]
        .find(['/', '?'])
        .map_or(base.len(), |i| start + i);
    let authority = &base[start..end];
    let userinfo = match authority.rfind('@') {
        Some(at) => &authority[..=at],
        None => "",
    };
    format!("{}{userinfo}{host}:{port}{}", &base[..start], &base[end..])
}

/// The first TCP host and port of `url`, as the driver reads it.
pub fn tcp_host_port(url: &str) -> (String, u16) {
    let config: tokio_postgres::Config = url.parse().unwrap();
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        None => "localhost".to_string(),
        #[allow(unreachable_patterns)]
        Some(other) => panic!("a TCP host is needed to proxy {url}: {other:?}"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    (host, port)
}

/// A TCP proxy on 127.0.0.1 in front of a PostgreSQL server that can fall silent:
/// after [`SilentProxy::silence`] it forwards nothing more in either direction and
/// closes nothing, like a network partition that drops packets.
pub struct SilentProxy {
    pub port: u16,
    silent: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl SilentProxy {
    pub async fn start(target: (String, u16)) -> SilentProxy {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let silent = Arc::new(AtomicBool::new(false));
        let tasks: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        let (s, t) = (silent.clone(), tasks.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) =
                    tokio::net::TcpStream::connect((target.0.as_str(), target.1)).await
                else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                for (r, w) in [(cr, sw), (sr, cw)] {
                    let s = s.clone();
                    let h = tokio::spawn(forward(r, w, s));
                    t.lock().unwrap().push(h.abort_handle());
                }
            }
        });
        tasks.lock().unwrap().push(accept.abort_handle());
        SilentProxy {
            port,
            silent,
            tasks,
        }
    }

    /// Stops forwarding, for good, without closing any connection.
    pub fn silence(&self) {
        self.silent.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn forward(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    silent: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if silent.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
        // Woken now and then to notice silence even with no traffic.
        let n = match tokio::time::timeout(std::time::Duration::from_millis(20), r.read(&mut buf))
            .await
        {
            Err(_) => continue,
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(n)) => n,
        };
        if silent.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    // Silent: hold both halves open, forwarding nothing, until the test ends.
    std::future::pending::<()>().await;
    drop((r, w));
}

impl Drop for SilentProxy {
    fn drop(&mut self) {
        for t in self.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

/// `base` (a `postgres://` URL) connecting as `user` (no password) instead of its own
/// user; host, port, database and parameters are kept.
pub fn with_user(base: &str, user: &str) -> String {
    let Some(scheme_end) = base.find("://") else {
        panic!("DATABASE_URL must be a postgres:// URL to connect as another role: {base}");
    };
    let start = scheme_end + 3;
    let end = base[start..]
        .find(['/', '?'])
        .map_or(base.len(), |i| start + i);
    let authority = &base[start..end];
    let hostport = match authority.rfind('@') {
        Some(at) => &authority[at + 1..],
        None => authority,
    };
    format!(
        "{}{}@{hostport}{}",
        &base[..start],
        percent_encode(user),
        &base[end..]
    )
}
