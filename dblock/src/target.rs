//! Which backend a handle opens — on a URL, or on a caller's sqlx pool — and where the
//! embedded default lives: the one place that names the backends (an arm each in
//! [`open`], and in [`open_source`] for the pools).

use std::path::PathBuf;

use crate::error::{Error, redact_url};
use crate::raw::{Options, RawLocks};

/// A caller's sqlx pool a handle borrows connections from (see
/// [`Builder::sqlx_pool`](crate::Builder::sqlx_pool)).
#[derive(Clone, Debug)]
pub(crate) enum Pool {
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

/// Opens the backend of a handle: on the caller's pool if there is one, else on `url`,
/// else on the URL of the environment ([`URL_ENV_VARS`]), else on the embedded default.
/// The default namespace it brings with it.
pub(crate) async fn open_source(
    pool: Option<Pool>,
    url: Option<&str>,
    opts: &Options,
) -> Result<(Box<dyn RawLocks>, String), Error> {
    match pool {
        #[cfg(feature = "postgres")]
        Some(Pool::Postgres(pool)) => return crate::postgres::from_sqlx(pool, opts).await,
        #[cfg(feature = "mysql")]
        Some(Pool::MySql(pool)) => return crate::mysql::from_sqlx(pool, opts).await,
        None => {}
    }
    match url.map(str::to_string).or_else(url_from_env) {
        Some(url) => open(&url, opts).await,
        #[cfg(feature = "sqlite")]
        None => open_default(opts),
        #[cfg(not(feature = "sqlite"))]
        None => Err(Error::InvalidUrl {
            url: String::new(),
            reason: "no database URL given, and this build has no embedded default".into(),
        }),
    }
}

/// The environment variables read, in order, by [`Locks::from_env`](crate::Locks::from_env)
/// and the command-line program when no URL is given.
pub const URL_ENV_VARS: [&str; 2] = ["DBLOCK_DATABASE_URL", "DATABASE_URL"];

/// Opens the backend a database URL names, and the default namespace it brings.
pub(crate) async fn open(url: &str, opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    let invalid = |reason: String| Error::InvalidUrl {
        url: redact_url(url),
        reason,
    };
    // libpq's `key=value` strings name no scheme: PostgreSQL's.
    #[cfg(feature = "postgres")]
    if crate::conninfo::is_key_value(url) {
        return crate::postgres::open(url, opts).await;
    }
    let Some(colon) = url.find(':') else {
        return Err(invalid(
            "expected postgres://…, postgresql://…, key=value …, mysql://…, mariadb://… or \
             sqlite:PATH"
                .into(),
        ));
    };
    match url[..colon].to_ascii_lowercase().as_str() {
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => crate::postgres::open(url, opts).await,
        #[cfg(feature = "sqlite")]
        "sqlite" => crate::sqlite::open(url, opts),
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => crate::mysql::open(url, opts).await,
        #[cfg(not(feature = "mysql"))]
        "mysql" | "mariadb" => Err(invalid(
            "this build of dblock has no MySQL support (cargo feature \"mysql\")".into(),
        )),
        #[cfg(not(feature = "postgres"))]
        "postgres" | "postgresql" => Err(invalid(
            "this build of dblock has no PostgreSQL support (cargo feature \"postgres\")".into(),
        )),
        #[cfg(not(feature = "sqlite"))]
        "sqlite" => Err(invalid(
            "this build of dblock has no SQLite support (cargo feature \"sqlite\")".into(),
        )),
        other => Err(invalid(format!(
            "unknown scheme {other:?}: expected postgres://…, postgresql://…, mysql://…, \
             mariadb://… or sqlite:PATH"
        ))),
    }
}

impl crate::Key {
    /// How the database `url` names (PostgreSQL's, when `None`) shows this key's lock to
    /// its own tools: where it is listed, as what, and a query that shows it. What `dblock
    /// key` prints.
    ///
    /// ```
    /// let key = dblock::Key::new("public", "autoland:7")?;
    /// let shown = key.shown_on(None)?;
    /// assert_eq!(shown.listed_in, "pg_locks");
    /// let shown = key.shown_on(Some("mysql://app@db/app"))?;
    /// assert_eq!(shown.id, dblock::mysql::lock_name("app", key));
    /// # Ok::<(), dblock::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidUrl`] for a URL dblock cannot read, or whose backend this build
    /// lacks; [`Error::Unsupported`] for the embedded backend, whose locks are byte ranges
    /// of its lock file (see `dblock status`).
    pub fn shown_on(&self, url: Option<&str>) -> Result<crate::status::ShownAs, Error> {
        let Some(url) = url else {
            #[cfg(feature = "postgres")]
            return Ok(crate::postgres::shown_as(*self));
            #[cfg(not(feature = "postgres"))]
            return Err(Error::InvalidUrl {
                url: String::new(),
                reason: "no database URL given, and this build has no PostgreSQL support".into(),
            });
        };
        let invalid = |reason: String| Error::InvalidUrl {
            url: redact_url(url),
            reason,
        };
        #[cfg(feature = "postgres")]
        if crate::conninfo::is_key_value(url) {
            return Ok(crate::postgres::shown_as(*self));
        }
        let scheme = url
            .split(':')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        match scheme.as_str() {
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => Ok(crate::postgres::shown_as(*self)),
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => crate::mysql::shown_as(url, *self),
            "sqlite" => Err(Error::unsupported(
                crate::error::Capability::ShowKey,
                "the embedded backend's locks are byte ranges of its lock file, not rows a query \
                 shows: see dblock status",
            )),
            other => Err(invalid(format!(
                "no backend of this build opens {other:?} URLs"
            ))),
        }
    }
}

/// Opens the embedded default: `$XDG_STATE_HOME/dblock/locks.db`, or
/// `$HOME/.local/state/dblock/locks.db` when `XDG_STATE_HOME` is unset or empty.
#[cfg(feature = "sqlite")]
pub(crate) fn open_default(opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    crate::sqlite::open_path(default_sqlite_path()?, opts)
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

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    fn opened(url: &str) -> Result<(), Error> {
        // Every URL here fails before any I/O: the future is ready at its first poll.
        match open(url, &Options::default()).now_or_never() {
            Some(r) => r.map(|_| ()),
            None => panic!("{url} did not fail at once"),
        }
    }

    #[test]
    fn bad_urls_are_typed_errors() {
        for u in [
            "mysql://root@localhost",
            "http://x",
            "nonsense",
            "",
            "sqlite:",
            "sqlite::memory:",
            "postgres://u@h:notaport/db",
        ] {
            let r = opened(u);
            assert!(
                matches!(r, Err(Error::InvalidUrl { .. })),
                "{u:?} gave {r:?}"
            );
        }
    }

    #[test]
    fn error_messages_hide_passwords() {
        let e = opened("postgres://u:hunter2@h:notaport/db").unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }
}
