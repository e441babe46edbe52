//! `dblock doctor` on the embedded backend: no server, TLS or pooler to check; the lock
//! file, the kind of byte-range lock, and the file system under it.

use super::SqliteBackend;
use super::sys::Flavor;
use crate::doctor::Check;

impl SqliteBackend {
    /// The embedded backend's checks (see [`crate::doctor`]).
    pub(super) fn diagnose(&self) -> Vec<Check> {
        let s = &self.shared;
        let kind = match s.lock.flavor {
            Flavor::Ofd => "open-file-description locks (F_OFD_SETLK): one per open of the file",
            Flavor::Posix => {
                "POSIX record locks (F_SETLK): one per process (DBLOCK_FILE_LOCKS=posix, or a \
                 platform without OFD locks)"
            }
        };
        let mut checks = vec![
            Check::ok(
                "server",
                format!(
                    "embedded: the SQLite file {} (no server, TLS or pooler to check; the \
                     locks exclude the processes of this host only)",
                    s.db_path.display()
                ),
            ),
            Check::ok("lock-kind", format!("{kind}, on {}", s.lock.path.display())),
        ];
        checks.push(match s.lock.network_fs() {
            Some(fs) => Check::warn(
                "filesystem",
                format!(
                    "the lock file is on {fs} (allowed by allow_network_filesystem): \
                     byte-range locks there may not exclude across hosts"
                ),
                "put the database on a local file system, or use PostgreSQL or MySQL for \
                 processes on several hosts",
            ),
            None => Check::ok("filesystem", "a local file system"),
        });
        checks
    }
}
