//! A PostgreSQL connection string (`postgres://…` or `key=value …`): what it names, and
//! the backend it opens.

use super::backend::PgBackend;
use super::conn::conninfo::Parsed;
use super::conn::pooler::Pooler;
use super::conn::tls::Connector;
use super::engine::SelfTest;
use crate::error::{Error, redact_url};
use crate::raw::{Options, RawLocks};

/// Opens the backend a `postgres://` or `postgresql://` URL names; the default
/// namespace with it.
pub(crate) async fn open(url: &str, opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    let (parsed, declared, self_test) = read_all(url, &process_env)?;
    let tls = Connector::new(&parsed.tls).map_err(|reason| invalid(url, reason))?;
    let mut config = parsed.config;
    if let Some(name) = opts.setting(super::settings::APPLICATION_NAME) {
        config.application_name(name);
    }
    let mut opts = opts.clone();
    if let Some(p) = declared {
        opts.set(super::settings::POOLER, p.as_str());
    }
    if let Some(t) = self_test {
        opts.set(super::settings::SELF_TEST, t.as_str());
    }
    let (b, ns) = PgBackend::open(config, parsed.shown, tls, &opts).await?;
    Ok((Box::new(b), ns))
}

/// Reads a PostgreSQL connection string (a `postgres://` URL or a `key=value` string)
/// without opening anything: dblock's own `pooler=` and `self_test=` parameters (which
/// the driver would refuse), then libpq's keys, filled from `env` (libpq's environment variables, `HOME`,
/// `USER`) and the password file. The error is [`Error::InvalidUrl`], password redacted.
pub(crate) fn read(
    url: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Parsed, Option<Pooler>), Error> {
    read_all(url, env).map(|(parsed, declared, _)| (parsed, declared))
}

/// [`read`], and dblock's `self_test=` parameter.
fn read_all(
    url: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Parsed, Option<Pooler>, Option<SelfTest>), Error> {
    let (stripped, declared) = super::conn::pooler::split_url(url).map_err(|r| invalid(url, r))?;
    let (stripped, self_test) = super::conn::pooler::split_param(&stripped, "self_test");
    let self_test = self_test
        .map(|v| SelfTest::parse(&v))
        .transpose()
        .map_err(|r| invalid(url, r))?;
    let parsed = super::conn::conninfo::parse(&stripped, env).map_err(|r| invalid(url, r))?;
    Ok((parsed, declared, self_test))
}

/// libpq's environment: a variable set to the empty string counts as unset.
fn process_env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

fn invalid(url: &str, reason: String) -> Error {
    Error::InvalidUrl {
        url: redact_url(url),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_urls_parse_with_both_schemes() {
        for u in [
            "postgres://postgres@127.0.0.1:5432/test",
            "postgresql://u:pw@localhost/db?application_name=x",
        ] {
            assert!(read(u, &process_env).is_ok(), "{u}");
        }
    }

    #[test]
    fn the_self_test_parameter_is_read_and_taken_out() {
        let none = |_: &str| None;
        for (u, want) in [
            ("postgres://h/db?self_test=always", Some(SelfTest::Always)),
            (
                "postgres://h/db?pooler=session&self_test=auto",
                Some(SelfTest::Auto),
            ),
            ("host=h dbname=db self_test=always", Some(SelfTest::Always)),
            ("postgres://h/db", None),
        ] {
            let (_, _, got) = read_all(u, &none).unwrap_or_else(|e| panic!("{u}: {e}"));
            assert_eq!(got, want, "{u}");
        }
        assert!(matches!(
            read_all("postgres://h/db?self_test=sometimes", &none),
            Err(Error::InvalidUrl { .. })
        ));
    }
}
