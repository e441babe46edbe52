//! Which server speaks PostgreSQL's protocol to a handle, and whether its advisory locks
//! exclude: what [`Locks::engine`](crate::Locks::engine) and
//! [`Locks::check_exclusion`](crate::Locks::check_exclusion) answer.
//!
//! Engines that speak PostgreSQL's protocol differ most where dblock depends on them:
//! CockroachDB's advisory-lock functions were for years stubs that always grant, and its
//! real ones (from 2026) are transaction-level only; YugabyteDB had a setting that turned
//! the functions into no-ops before they became generally available. A lock that every
//! caller "holds" at once excludes nothing, so dblock names the engine when a handle opens
//! — from the start-up parameters the server sends unasked (PostgreSQL: `server_version`;
//! CockroachDB adds `crdb_version`; YugabyteDB's `server_version` reads `11.2-YB-…`), so
//! PostgreSQL itself pays no round trip for it — and, on any other engine (or when told
//! to, `self_test=always`), checks once per handle, before its first grant, that a lock
//! taken on one connection stops another. See `docs/connecting.md` for the table of
//! engines.

use std::fmt;

/// The server behind a PostgreSQL-protocol connection, as it names itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Engine {
    /// PostgreSQL (or a service that runs it unchanged: RDS, Cloud SQL, Supabase, Neon…).
    /// Its advisory locks exclude; dblock trusts them without a check.
    PostgreSql {
        /// `server_version`, as sent (`16.4`, `17.2 (Debian 17.2-1.pgdg120+1)`).
        version: String,
    },
    /// CockroachDB: `crdb_version` among the start-up parameters, or `CockroachDB` in
    /// `version()`.
    CockroachDb {
        /// `crdb_version` (`CockroachDB CCL v24.1.0 (…)`) or `version()`.
        version: String,
    },
    /// YugabyteDB's YSQL: `-YB-` in `server_version` (`11.2-YB-2.20.1.0-b0`).
    YugabyteDb {
        /// `server_version`, as sent.
        version: String,
    },
    /// Another server that speaks the protocol (Materialize, QuestDB, Redshift, …), or one
    /// that does not say what it is.
    Other {
        /// What it said of itself: `server_version`, or `version()`; empty if nothing.
        version: String,
    },
}

/// Start-up parameters (ParameterStatus) that only servers other than PostgreSQL send.
const FOREIGN_PARAMETERS: &[&str] = &["mz_version", "questdb_version", "crate_version"];

impl Engine {
    /// The engine the start-up parameters name: `parameter(name)` answers what the server
    /// sent (ParameterStatus) for `name`. `None` when they do not tell (no
    /// `server_version`: an sqlx connection, which does not expose them, or a proxy that
    /// drops them), for [`Engine::from_version_text`] to decide.
    pub fn from_parameters(parameter: impl Fn(&str) -> Option<String>) -> Option<Engine> {
        if let Some(version) = parameter("crdb_version") {
            return Some(Engine::CockroachDb { version });
        }
        let version = parameter("server_version")?;
        if version.contains("-YB-") {
            return Some(Engine::YugabyteDb { version });
        }
        if FOREIGN_PARAMETERS.iter().any(|p| parameter(p).is_some()) {
            return Some(Engine::Other { version });
        }
        Some(Engine::of_server_version(version))
    }

    /// The engine `SELECT version()` names (`PostgreSQL 16.4 on x86_64-pc-linux-gnu, …`,
    /// `PostgreSQL 11.2-YB-2.20.1.0-b0 on …`, `CockroachDB CCL v24.1.0 (…)`).
    pub fn from_version_text(text: &str) -> Engine {
        if text.contains("CockroachDB") {
            return Engine::CockroachDb {
                version: text.to_string(),
            };
        }
        match text.strip_prefix("PostgreSQL ") {
            Some(rest) => {
                let version = rest.split(' ').next().unwrap_or_default().to_string();
                if version.contains("-YB-") {
                    Engine::YugabyteDb { version }
                } else {
                    Engine::of_server_version(version)
                }
            }
            None => Engine::Other {
                version: text.to_string(),
            },
        }
    }

    /// PostgreSQL when `version` reads as one dblock supports (major 9 and later), else
    /// another engine (Redshift says `8.0.2`).
    fn of_server_version(version: String) -> Engine {
        let major: Option<u32> = version
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|m| m.parse().ok());
        match major {
            Some(m) if m >= 9 => Engine::PostgreSql { version },
            _ => Engine::Other { version },
        }
    }

    /// The engine's name: `PostgreSQL`, `CockroachDB`, `YugabyteDB`, or `an unrecognised
    /// PostgreSQL-protocol server`.
    pub fn name(&self) -> &'static str {
        match self {
            Engine::PostgreSql { .. } => "PostgreSQL",
            Engine::CockroachDb { .. } => "CockroachDB",
            Engine::YugabyteDb { .. } => "YugabyteDB",
            Engine::Other { .. } => "an unrecognised PostgreSQL-protocol server",
        }
    }

    /// What the server said its version is.
    pub fn version(&self) -> &str {
        match self {
            Engine::PostgreSql { version }
            | Engine::CockroachDb { version }
            | Engine::YugabyteDb { version }
            | Engine::Other { version } => version,
        }
    }

    /// Whether dblock trusts the engine's advisory locks without checking them
    /// (PostgreSQL's); any other is checked once per handle before its first grant.
    pub fn trusted(&self) -> bool {
        matches!(self, Engine::PostgreSql { .. })
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.version() {
            "" => f.write_str(self.name()),
            v => write!(f, "{} {v}", self.name()),
        }
    }
}

/// What the check of one scope's advisory locks found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// A lock taken on one connection stopped a try on another: the locks exclude.
    Excludes,
    /// A lock taken on one connection did not stop a try on another: every caller would
    /// "hold" the lock at once. Locks of this scope are refused.
    DoesNotExclude,
    /// The server refused the lock functions, or never granted a free key (its message).
    /// Locks of this scope are refused.
    Unavailable {
        /// What the server answered.
        message: String,
    },
    /// Not checked: session locks behind a transaction pooler (refused there anyway,
    /// and a session lock taken to check would stay on the pooler's server connection).
    Untested,
}

impl Verdict {
    /// Whether locks of the scope may be trusted.
    pub fn excludes(&self) -> bool {
        matches!(self, Verdict::Excludes)
    }
}

/// What [`Locks::check_exclusion`](crate::Locks::check_exclusion) found: one verdict per
/// scope, on the engine named.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Exclusion {
    /// The engine checked.
    pub engine: Engine,
    /// Transaction-scoped locks (`pg_try_advisory_xact_lock`).
    pub transaction: Verdict,
    /// Session-scoped locks (`pg_try_advisory_lock`).
    pub session: Verdict,
}

/// When a handle checks its engine's locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SelfTest {
    /// Every engine but PostgreSQL (recognised from its start-up parameters), once per
    /// handle before its first grant. The default.
    #[default]
    Auto,
    /// Every engine, PostgreSQL too: for a server that says it is PostgreSQL and may
    /// not be, or to see the check work.
    Always,
}

impl SelfTest {
    /// The value as the URL parameter (`self_test=`) spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SelfTest::Auto => "auto",
            SelfTest::Always => "always",
        }
    }

    pub(crate) fn parse(v: &str) -> Result<SelfTest, String> {
        match v.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(SelfTest::Auto),
            "always" => Ok(SelfTest::Always),
            other => Err(format!("self_test={other}: expected auto or always")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn start_up_parameters_name_the_engine() {
        let pg = Engine::from_parameters(params(&[("server_version", "16.4 (Debian 16.4-1)")]));
        assert_eq!(
            pg,
            Some(Engine::PostgreSql {
                version: "16.4 (Debian 16.4-1)".into()
            })
        );
        assert!(pg.is_some_and(|e| e.trusted()));
        let crdb = Engine::from_parameters(params(&[
            ("server_version", "13.0.0"),
            ("crdb_version", "CockroachDB CCL v24.1.0"),
        ]));
        assert!(matches!(crdb, Some(Engine::CockroachDb { .. })));
        let yb = Engine::from_parameters(params(&[("server_version", "11.2-YB-2.20.1.0-b0")]));
        assert!(matches!(yb, Some(Engine::YugabyteDb { .. })));
        let mz = Engine::from_parameters(params(&[
            ("server_version", "9.5.0"),
            ("mz_version", "v0.100"),
        ]));
        assert!(matches!(mz, Some(Engine::Other { .. })));
        let redshift = Engine::from_parameters(params(&[("server_version", "8.0.2")]));
        assert!(matches!(redshift, Some(Engine::Other { .. })));
        assert_eq!(Engine::from_parameters(params(&[])), None);
    }

    #[test]
    fn version_text_names_the_engine() {
        let pg = Engine::from_version_text("PostgreSQL 17.2 on x86_64-pc-linux-gnu, compiled");
        assert_eq!(
            pg,
            Engine::PostgreSql {
                version: "17.2".into()
            }
        );
        assert!(matches!(
            Engine::from_version_text("PostgreSQL 11.2-YB-2.20.1.0-b0 on x86_64"),
            Engine::YugabyteDb { .. }
        ));
        assert!(matches!(
            Engine::from_version_text("CockroachDB CCL v24.1.0 (x86_64-pc-linux-gnu)"),
            Engine::CockroachDb { .. }
        ));
        assert!(matches!(
            Engine::from_version_text("QuestDB"),
            Engine::Other { .. }
        ));
    }
}
