//! `dblock doctor` on MySQL and MariaDB: the server and its version, TLS, and the kind of
//! lock dblock takes there. PostgreSQL's other checks (pooler, lock table, timeouts,
//! timeline) have no counterpart: `GET_LOCK` names live in the server's memory, one per
//! holding connection, and a lock waits in one statement bounded by its own timeout.

use super::{MyBackend, map_sqlx};
use crate::doctor::Check;
use crate::error::Error;

impl MyBackend {
    /// The MySQL backend's checks (see [`crate::doctor`]).
    pub(super) async fn diagnose(&self) -> Result<Vec<Check>, Error> {
        let (version, comment): (String, String) =
            sqlx::query_as("SELECT VERSION(), CAST(@@version_comment AS CHAR)")
                .fetch_one(&self.pool)
                .await
                .map_err(map_sqlx)?;
        let cipher: Option<(String, String)> =
            sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
                .fetch_optional(&self.pool)
                .await
                .map_err(map_sqlx)?;
        let cipher = cipher.map(|(_, v)| v).unwrap_or_default();
        let engine = match version.to_ascii_lowercase().contains("mariadb") {
            true => "MariaDB",
            false => "MySQL",
        };
        let o = self.pool.connect_options();
        let host = o.get_host();
        let local = o.get_socket().is_some()
            || host == "localhost"
            || host == "::1"
            || host.starts_with("127.");
        let tls = match (cipher.is_empty(), local) {
            (false, _) => Check::ok("tls", format!("in use: {cipher}")),
            (true, true) => Check::ok("tls", "not in use: the server is on this host"),
            (true, false) => Check::warn(
                "tls",
                "not in use: passwords and lock names cross the network in clear",
                "add ssl-mode=VERIFY_IDENTITY (with ssl-ca) or ssl-mode=REQUIRED to the URL",
            ),
        };
        Ok(vec![
            Check::ok("server", format!("{engine} {version} ({comment})")),
            tls,
            Check::ok(
                "lock-kind",
                format!(
                    "named locks (GET_LOCK), server-wide, keyed by database `{}` and name; one \
                     connection per held lock, up to {} at once (the pooler, lock table, \
                     timeout and timeline checks are PostgreSQL's)",
                    self.database, self.max_lock_conns
                ),
            ),
        ])
    }
}
