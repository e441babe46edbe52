//! A throwaway MariaDB (or MySQL) server in a temporary directory, on a port of its own,
//! taking TCP connections over TLS only: for the tests of `ssl-mode` and friends.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::tls::Certs;

/// A server started with `mariadb-install-db` and `mariadbd` (`DBLOCK_TEST_MARIADB_BIN`
/// names their directory where they are not on the PATH or in /usr/sbin), root without
/// a password, a database `dblock`; stopped and removed on drop.
pub struct TempMariaDb {
    pub dir: tempfile::TempDir,
    pub port: u16,
    pub socket: PathBuf,
    child: Child,
}

fn program(name: &str) -> PathBuf {
    let dirs = std::env::var("DBLOCK_TEST_MARIADB_BIN")
        .into_iter()
        .chain(["/usr/sbin".to_string(), "/usr/bin".to_string()]);
    for d in dirs {
        let p = PathBuf::from(d).join(name);
        if p.exists() {
            return p;
        }
    }
    PathBuf::from(name)
}

impl TempMariaDb {
    /// Starts a server whose TCP listener requires TLS (`require_secure_transport`),
    /// with `certs`' server certificate.
    pub fn start_tls(certs: &Certs) -> TempMariaDb {
        crate::watchdog();
        let dir = tempfile::Builder::new()
            .prefix("dblock-mariadb-")
            .tempdir()
            .unwrap();
        let data = dir.path().join("data");
        let out = Command::new(program("mariadb-install-db"))
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args([
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ])
            .output()
            .unwrap_or_else(|e| panic!("mariadb-install-db is needed for this test: {e}"));
        assert!(out.status.success(), "mariadb-install-db: {out:?}");
        let port = crate::cluster::free_port();
        let socket = dir.path().join("mysqld.sock");
        let child = Command::new(program("mariadbd"))
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--pid-file={}", dir.path().join("pid").display()))
            .arg(format!("--port={port}"))
            .args(["--user=root", "--bind-address=127.0.0.1"])
            .arg(format!("--ssl-cert={}", certs.server_cert.display()))
            .arg(format!("--ssl-key={}", certs.server_key.display()))
            .arg(format!("--ssl-ca={}", certs.ca.display()))
            .arg("--require-secure-transport=ON")
            .arg("--skip-log-bin")
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("err.log")).unwrap(),
            ))
            .spawn()
            .unwrap_or_else(|e| panic!("mariadbd is needed for this test: {e}"));
        let server = TempMariaDb {
            dir,
            port,
            socket,
            child,
        };
        // Ready when its socket takes a connection; then the test's database.
        let end = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let made = Command::new(program("mariadb"))
                .arg(format!("--socket={}", server.socket.display()))
                .args(["-uroot", "-e", "CREATE DATABASE IF NOT EXISTS dblock"])
                .output();
            if matches!(&made, Ok(o) if o.status.success()) {
                break;
            }
            assert!(
                std::time::Instant::now() < end,
                "the throwaway MariaDB did not start: {}",
                std::fs::read_to_string(server.dir.path().join("err.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    /// A `mysql://` URL of its database `dblock` over TCP on `host`, with `params`.
    pub fn url(&self, host: &str, params: &str) -> String {
        format!("mysql://root@{host}:{}/dblock?{params}", self.port)
    }
}

impl Drop for TempMariaDb {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let end = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
