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
    } else if opts.setting(super::settings::POOLER).is_none()
        && let Some(p) = implied(&config)
    {
        opts.set(super::settings::POOLER, p.as_str());
        opts.set(super::settings::POOLER_FROM, "host");
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

/// The pooler the first TCP host (and its port) implies, if a managed service's.
fn implied(config: &tokio_postgres::Config) -> Option<Pooler> {
    use tokio_postgres::config::Host;
    let (i, host) = config
        .get_hosts()
        .iter()
        .enumerate()
        .find_map(|(i, h)| match h {
            Host::Tcp(h) => Some((i, h)),
            Host::Unix(_) => None,
        })?;
    let ports = config.get_ports();
    let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    super::conn::pooler::implied_by_host(host, port)
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
    fn a_managed_services_host_implies_its_pooler() {
        let of = |u: &str| {
            implied(
                &read(u, &process_env)
                    .unwrap_or_else(|e| panic!("{e}"))
                    .0
                    .config,
            )
        };
        let pooler = "aws-0-eu-west-1.pooler.supabase.com";
        assert_eq!(
            of(&format!("postgres://u@{pooler}:6543/db")),
            Some(Pooler::Transaction)
        );
        assert_eq!(
            of(&format!("postgres://u@{pooler}:5432/db")),
            Some(Pooler::Session)
        );
        assert_eq!(
            of(&format!("postgres://u@{pooler}/db")),
            Some(Pooler::Session),
            "5432 by default"
        );
        assert_eq!(
            of("postgres://u@db.abcdefgh.supabase.co:6543/db"),
            Some(Pooler::Transaction)
        );
        assert_eq!(
            of("host=db.abcdefgh.supabase.co port=5432 dbname=x"),
            Some(Pooler::Session)
        );
        assert_eq!(
            of("postgres://u@db.abcdefgh.supabase.co:6000/db"),
            None,
            "a port Supabase does not document"
        );
        assert_eq!(
            of("postgres://u@ep-cool-darkness-123456-pooler.us-east-2.aws.neon.tech/db"),
            Some(Pooler::Transaction)
        );
        assert_eq!(
            of("postgres://u@EP-Cool-Darkness-123456.us-east-2.aws.neon.tech./db"),
            Some(Pooler::Session)
        );
        // Look-alikes are not the services.
        assert_eq!(of("postgres://u@supabase.co.example.com:6543/db"), None);
        assert_eq!(of("postgres://u@notsupabase.co:6543/db"), None);
        assert_eq!(of("postgres://u@x-pooler.example.com/db"), None);
        assert_eq!(of("postgres://u@127.0.0.1:6543/db"), None);
        assert_eq!(of("host=/var/run/postgresql port=6543 dbname=x"), None);
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
