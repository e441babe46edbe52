//! Which database a URL names, and where the embedded default lives.

use std::path::PathBuf;

use crate::Error;
use crate::error::redact_url;

/// The environment variables read, in order, by [`Locks::from_env`](crate::Locks::from_env)
/// and the command-line program when no URL is given.
pub const URL_ENV_VARS: [&str; 2] = ["DBLOCK_DATABASE_URL", "DATABASE_URL"];

/// A database named by a URL, parsed but not yet opened.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    /// `postgres://` or `postgresql://`.
    #[cfg(feature = "postgres")]
    Postgres {
        config: Box<tokio_postgres::Config>,
        /// The URL as it may be shown: password redacted.
        shown: String,
        /// The TLS the URL asked for, its certificate files read.
        tls: crate::postgres::tls::Connector,
    },
    /// `sqlite:PATH`, `sqlite://PATH`, or the default file.
    #[cfg(feature = "sqlite")]
    Sqlite { path: PathBuf },
}

impl Target {
    /// Parses a database URL.
    pub(crate) fn parse(url: &str) -> Result<Target, Error> {
        let invalid = |reason: String| Error::InvalidUrl {
            url: redact_url(url),
            reason,
        };
        if crate::conninfo::is_key_value(url) {
            return parse_postgres(url).map_err(invalid);
        }
        let scheme = match url.find(':') {
            Some(i) => &url[..i],
            None => {
                return Err(invalid(
                    "expected postgres://…, postgresql://…, key=value … or sqlite:PATH".into(),
                ));
            }
        };
        match scheme.to_ascii_lowercase().as_str() {
            "postgres" | "postgresql" => parse_postgres(url).map_err(invalid),
            "sqlite" => parse_sqlite(url).map_err(invalid),
            other => Err(invalid(format!(
                "unknown scheme {other:?}: expected postgres://…, postgresql://… or sqlite:PATH"
            ))),
        }
    }

    /// The embedded default: `$XDG_STATE_HOME/dblock/locks.db`, or
    /// `$HOME/.local/state/dblock/locks.db` when `XDG_STATE_HOME` is unset or empty.
    #[cfg(feature = "sqlite")]
    pub(crate) fn default_embedded() -> Result<Target, Error> {
        default_sqlite_path().map(|path| Target::Sqlite { path })
    }
}

/// The path of the embedded default database file (see [`Locks::from_env`](crate::Locks::from_env)).
///
/// # Errors
///
/// [`Error::InvalidUrl`] when neither `XDG_STATE_HOME` nor `HOME` is set.
pub fn default_sqlite_path() -> Result<PathBuf, Error> {
    let non_empty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty());
    let base = match (non_empty("XDG_STATE_HOME"), non_empty("HOME")) {
        (Some(state), _) => PathBuf::from(state),
        (None, Some(home)) => PathBuf::from(home).join(".local/state"),
        (None, None) => {
            return Err(Error::InvalidUrl {
                url: String::new(),
                reason: "no database URL given and neither XDG_STATE_HOME nor HOME is set \
                         to place the embedded default in"
                    .into(),
            });
        }
    };
    Ok(base.join("dblock").join("locks.db"))
}

/// The URL from the environment, if any: the first non-empty of [`URL_ENV_VARS`].
pub fn url_from_env() -> Option<String> {
    URL_ENV_VARS
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .find(|s| !s.is_empty())
}

#[cfg(feature = "postgres")]
fn parse_postgres(url: &str) -> Result<Target, String> {
    // libpq's conventions: both string forms, its environment, its password file.
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let parsed = crate::conninfo::parse(url, &env)?;
    let tls = crate::postgres::tls::Connector::new(&parsed.tls)?;
    Ok(Target::Postgres {
        config: Box::new(parsed.config),
        shown: parsed.shown,
        tls,
    })
}

#[cfg(not(feature = "postgres"))]
fn parse_postgres(_: &str) -> Result<Target, String> {
    Err("this build of dblock has no PostgreSQL support (cargo feature \"postgres\")".into())
}

#[cfg(feature = "sqlite")]
fn parse_sqlite(url: &str) -> Result<Target, String> {
    // `sqlite:PATH` and sqlx's `sqlite://PATH` (so `sqlite:///abs` is absolute);
    // anything after `?` (sqlx's `mode=rwc` and the like) is ignored.
    let rest = &url["sqlite:".len()..];
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let path = rest.split('?').next().unwrap_or_default();
    if path.is_empty() {
        return Err("no file path after sqlite:".into());
    }
    if path == ":memory:" || path.starts_with("file::memory:") {
        return Err("an in-memory database cannot be shared between processes".into());
    }
    Ok(Target::Sqlite {
        path: PathBuf::from(path),
    })
}

#[cfg(not(feature = "sqlite"))]
fn parse_sqlite(_: &str) -> Result<Target, String> {
    Err("this build of dblock has no SQLite support (cargo feature \"sqlite\")".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_name_files() {
        let path = |u: &str| match Target::parse(u).unwrap() {
            Target::Sqlite { path } => path,
            #[allow(unreachable_patterns)]
            _ => panic!("{u} is not sqlite"),
        };
        assert_eq!(path("sqlite:/tmp/a.db"), PathBuf::from("/tmp/a.db"));
        assert_eq!(path("sqlite:///tmp/a.db"), PathBuf::from("/tmp/a.db"));
        assert_eq!(path("sqlite://rel/a.db"), PathBuf::from("rel/a.db"));
        assert_eq!(path("sqlite:a.db?mode=rwc"), PathBuf::from("a.db"));
    }

    #[test]
    fn postgres_urls_parse_with_both_schemes() {
        for u in [
            "postgres://postgres@127.0.0.1:5432/test",
            "postgresql://u:pw@localhost/db?application_name=x",
        ] {
            assert!(
                matches!(Target::parse(u), Ok(Target::Postgres { .. })),
                "{u}"
            );
        }
    }

    #[test]
    fn bad_urls_are_typed_errors() {
        for u in [
            "mysql://root@localhost/test",
            "http://x",
            "nonsense",
            "",
            "sqlite:",
            "sqlite::memory:",
            "postgres://u@h:notaport/db",
        ] {
            assert!(
                matches!(Target::parse(u), Err(Error::InvalidUrl { .. })),
                "{u:?} gave {:?}",
                Target::parse(u)
            );
        }
    }

    #[test]
    fn error_messages_hide_passwords() {
        let e = Target::parse("postgres://u:hunter2@h:notaport/db").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }
}
