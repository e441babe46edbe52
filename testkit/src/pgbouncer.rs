//! A PgBouncer of the test's own (the Debian package's binary), in front of the tests'
//! PostgreSQL: its own config in a temporary directory, its own port, a small pool.
//!
//! Needs `pgbouncer` on the PATH or in `/usr/sbin` (`.ci/run` installs the package);
//! a missing binary fails the test, it is never skipped. Run as root, PgBouncer runs as
//! the `postgres` user (it refuses to run as root).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// PgBouncer's `pool_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A server connection per client connection, for the client's whole session.
    Session,
    /// A server connection per transaction.
    Transaction,
    /// A server connection per statement: no transaction may span two.
    Statement,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
            PoolMode::Statement => "statement",
        }
    }
}

/// A running PgBouncer; killed and its directory removed on drop.
pub struct PgBouncer {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub mode: PoolMode,
    child: Child,
}

/// Settings beyond the defaults the helper writes.
#[derive(Debug, Clone)]
pub struct Options {
    pub mode: PoolMode,
    /// `default_pool_size`: server connections per (database, user).
    pub pool_size: u32,
    /// `search_path` and `dblock.namespace` every server connection gets (PgBouncer 1.18
    /// refuses the `options` startup parameter the tests' schema URLs use), via
    /// `connect_query`. A session pooler's `DISCARD ALL` resets them between clients.
    pub search_path: Option<String>,
    /// Extra `[pgbouncer]` settings.
    pub settings: Vec<(String, String)>,
    /// Send the server connections to this port instead of the tests' server (a port
    /// where nothing listens, to see PgBouncer's login errors).
    pub server_port: Option<u16>,
}

impl Options {
    pub fn new(mode: PoolMode, pool_size: u32) -> Options {
        Options {
            mode,
            pool_size,
            search_path: None,
            settings: Vec::new(),
            server_port: None,
        }
    }

    pub fn search_path(mut self, schema: &str) -> Options {
        self.search_path = Some(schema.to_string());
        self
    }

    pub fn server_port(mut self, port: u16) -> Options {
        self.server_port = Some(port);
        self
    }

    pub fn set(mut self, key: &str, value: &str) -> Options {
        self.settings.push((key.to_string(), value.to_string()));
        self
    }
}

fn binary() -> PathBuf {
    for p in ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"] {
        if std::path::Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    PathBuf::from("pgbouncer")
}

impl PgBouncer {
    /// Starts PgBouncer in `mode` with `pool_size` server connections.
    pub fn start(mode: PoolMode, pool_size: u32) -> PgBouncer {
        PgBouncer::with(Options::new(mode, pool_size))
    }

    pub fn with(opts: Options) -> PgBouncer {
        let base = tokio_postgres::Config::from_str(&crate::pg_url()).unwrap();
        let (host, port) = match (base.get_hosts().first(), base.get_ports().first()) {
            (Some(tokio_postgres::config::Host::Tcp(h)), p) => (h.clone(), *p.unwrap_or(&5432)),
            _ => ("127.0.0.1".to_string(), 5432),
        };
        let port = opts.server_port.unwrap_or(port);
        let dir = tempfile::Builder::new()
            .prefix("dblock-pgbouncer-")
            .tempdir()
            .unwrap();
        let root = crate::cluster::is_root();
        let port_ = crate::cluster::free_port();
        let d = dir.path().display().to_string();
        let connect_query = match &opts.search_path {
            // Double the single quotes for PgBouncer's quoting of the value.
            Some(s) => format!(
                " connect_query='SET search_path TO \"{s}\"; SET dblock.namespace TO \"{s}\"'"
            ),
            None => String::new(),
        };
        let mut conf = format!(
            "[databases]\n* = host={host} port={port}{connect_query}\n\n[pgbouncer]\n\
             listen_addr = 127.0.0.1\nlisten_port = {port_}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {d}/users.txt\npool_mode = {}\n\
             default_pool_size = {}\nmax_client_conn = 500\n\
             ignore_startup_parameters = extra_float_digits\nlogfile = {d}/pgbouncer.log\n\
             pidfile = {d}/pgbouncer.pid\n",
            opts.mode.as_str(),
            opts.pool_size,
        );
        for (k, v) in &opts.settings {
            conf.push_str(&format!("{k} = {v}\n"));
        }
        std::fs::write(dir.path().join("pgbouncer.ini"), conf).unwrap();
        let user = base.get_user().unwrap_or("postgres").to_string();
        std::fs::write(dir.path().join("users.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        if root {
            crate::cluster::chown_postgres(dir.path());
        }
        let mut cmd = Command::new(binary());
        if root {
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(dir.path().join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start PgBouncer ({e}): install it (apt-get install pgbouncer; \
                     .ci/run does)"
                )
            });
        let b = PgBouncer {
            dir,
            port: port_,
            mode: opts.mode,
            child,
        };
        let end = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port_)).is_err() {
            assert!(
                Instant::now() < end,
                "PgBouncer did not start listening: {}",
                b.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        b
    }

    /// A URL for database `db` through this PgBouncer (the tests' user).
    pub fn url(&self, db: &str) -> String {
        let base = tokio_postgres::Config::from_str(&crate::pg_url()).unwrap();
        let user = base.get_user().unwrap_or("postgres");
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    /// The tests' database through this PgBouncer.
    pub fn test_url(&self) -> String {
        let base = tokio_postgres::Config::from_str(&crate::pg_url()).unwrap();
        self.url(base.get_dbname().unwrap_or("test"))
    }

    /// PgBouncer's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
