//! A throwaway PostgreSQL cluster, for tests that must restart a server or fill its lock
//! table: things no test may do to the server other tests share.
//!
//! Needs PostgreSQL's server binaries: `DBLOCK_TEST_PG_BIN`, else the newest
//! `/usr/lib/postgresql/*/bin`, else `pg_config --bindir`. Run as root, the cluster runs
//! as the `postgres` user (PostgreSQL refuses to run as root).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A cluster in a temporary directory, on a port of its own; stopped and removed on drop.
pub struct TempCluster {
    pub dir: tempfile::TempDir,
    pub port: u16,
    bin: PathBuf,
    run_as_postgres: bool,
}

fn bin_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("DBLOCK_TEST_PG_BIN") {
        return PathBuf::from(p);
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    if let Some((_, p)) = found.pop() {
        return p;
    }
    let out = Command::new("pg_config").arg("--bindir").output();
    match out {
        Ok(o) if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        _ => panic!(
            "no PostgreSQL server binaries found for a throwaway cluster: set DBLOCK_TEST_PG_BIN \
             to the directory holding initdb and pg_ctl"
        ),
    }
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl TempCluster {
    /// Creates and starts a cluster with extra `postgresql.conf` settings.
    pub fn start(settings: &[(&str, &str)]) -> TempCluster {
        let bin = bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("dblock-pg-")
            .tempdir()
            .unwrap();
        // SAFETY-free check: geteuid has no preconditions.
        let run_as_postgres = is_root();
        if run_as_postgres {
            chown_postgres(dir.path());
        }
        let port = free_port();
        let c = TempCluster {
            dir,
            port,
            bin,
            run_as_postgres,
        };
        let data = c.data();
        c.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        let mut conf = format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             fsync = off\nmax_connections = 40\n",
            c.dir.path().display()
        );
        for (k, v) in settings {
            conf.push_str(&format!("{k} = {v}\n"));
        }
        let conf_path = data.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path).unwrap();
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing).unwrap();
        c.pg_ctl(&["start", "-w", "-t", "60"]);
        c
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The data directory (to change `postgresql.conf`, `pg_hba.conf`; then restart).
    pub fn data_dir(&self) -> PathBuf {
        self.data()
    }

    /// A hot standby of `primary` (pg_basebackup -R over the primary's socket), started,
    /// on a port of its own.
    pub fn standby_of(primary: &TempCluster) -> TempCluster {
        let dir = tempfile::Builder::new()
            .prefix("dblock-pg-")
            .tempdir()
            .unwrap();
        if primary.run_as_postgres {
            chown_postgres(dir.path());
        }
        let c = TempCluster {
            dir,
            port: free_port(),
            bin: primary.bin.clone(),
            run_as_postgres: primary.run_as_postgres,
        };
        let data = c.data();
        let (socket, port) = (
            primary.dir.path().display().to_string(),
            primary.port.to_string(),
        );
        c.run(
            "pg_basebackup",
            &[
                "-D",
                data.to_str().unwrap(),
                "-h",
                &socket,
                "-p",
                &port,
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
                "-N",
            ],
        );
        let conf_path = data.join("postgresql.conf");
        let mut conf = std::fs::read_to_string(&conf_path).unwrap();
        conf.push_str(&format!(
            "\nport = {}\nunix_socket_directories = '{}'\n",
            c.port,
            c.dir.path().display()
        ));
        std::fs::write(&conf_path, conf).unwrap();
        c.pg_ctl(&["start", "-w", "-t", "60"]);
        c
    }

    /// Promotes a standby to primary, waiting until it accepts writes.
    pub fn promote(&self) {
        self.pg_ctl(&["promote", "-w", "-t", "60"]);
    }

    /// The URL of the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Restarts the server (fast shutdown: every session is terminated).
    pub fn restart(&self) {
        self.pg_ctl(&["restart", "-w", "-m", "fast", "-t", "60"]);
    }

    /// Stops the server at once.
    pub fn stop(&self) {
        self.pg_ctl(&["stop", "-w", "-m", "immediate", "-t", "60"]);
    }

    /// Starts a stopped server.
    pub fn start_again(&self) {
        self.pg_ctl(&["start", "-w", "-t", "60"]);
    }

    fn pg_ctl(&self, args: &[&str]) {
        let data = self.data();
        let log = self.dir.path().join("server.log");
        let mut all = vec!["-D", data.to_str().unwrap(), "-l", log.to_str().unwrap()];
        all.extend_from_slice(args);
        self.run("pg_ctl", &all);
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let exe = self.bin.join(tool);
        let out = if self.run_as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(args)
                .output()
        } else {
            Command::new(&exe).args(args).output()
        };
        match out {
            Ok(o) if o.status.success() => {}
            other => {
                let log =
                    std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
                panic!("{} {args:?} failed: {other:?}\n{log}", exe.display())
            }
        }
    }
}

impl Drop for TempCluster {
    fn drop(&mut self) {
        let data = self.data();
        let exe = self.bin.join("pg_ctl");
        let args = [
            "-D",
            data.to_str().unwrap_or(""),
            "stop",
            "-m",
            "immediate",
            "-w",
        ];
        let _ = if self.run_as_postgres {
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&exe)
                .args(args)
                .output()
        } else {
            Command::new(&exe).args(args).output()
        };
    }
}

pub(crate) fn is_root() -> bool {
    // The effective uid, read without unsafe code.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// Makes a file the server reads (a key, say) the `postgres` user's, mode 0600, when the
/// server runs as `postgres`.
pub fn give_to_postgres(file: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    if is_root() {
        chown_postgres(file);
    }
}

pub(crate) fn chown_postgres(dir: &Path) {
    let ok = Command::new("chown")
        .args(["postgres:postgres", dir.to_str().unwrap()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "cannot chown {} to postgres", dir.display());
}

/// Every bigint advisory-lock function dblock (or its exclusion check) may call, with
/// its return type: what [`granting_stubs`] replaces.
pub const ADVISORY_FUNCTIONS: &[(&str, &str)] = &[
    ("pg_try_advisory_xact_lock", "boolean"),
    ("pg_try_advisory_xact_lock_shared", "boolean"),
    ("pg_try_advisory_lock", "boolean"),
    ("pg_try_advisory_lock_shared", "boolean"),
    ("pg_advisory_unlock", "boolean"),
    ("pg_advisory_unlock_shared", "boolean"),
    ("pg_advisory_xact_lock", "void"),
    ("pg_advisory_xact_lock_shared", "void"),
    ("pg_advisory_lock", "void"),
    ("pg_advisory_lock_shared", "void"),
];

/// `CREATE OR REPLACE FUNCTION` statements putting stubs of [`ADVISORY_FUNCTIONS`] in
/// `schema` that always grant: the tries and unlocks answer true, the waits return at
/// once — an engine whose advisory locks exclude nothing (as CockroachDB's once did).
/// `LANGUAGE sql`, so that even in `pg_catalog` the stub's body is what runs (a built-in
/// C function keeps its own code whatever `pg_proc` says; an inlined SQL body does not).
pub fn granting_stubs(schema: &str) -> String {
    ADVISORY_FUNCTIONS
        .iter()
        .map(|(f, ret)| {
            let body = if *ret == "void" {
                "SELECT NULL::void"
            } else {
                "SELECT true"
            };
            format!(
                "CREATE OR REPLACE FUNCTION {schema}.{f}(bigint) RETURNS {ret} \
                 LANGUAGE sql AS '{body}';"
            )
        })
        .collect()
}
