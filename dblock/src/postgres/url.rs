//! A PostgreSQL connection string (`postgres://…` or `key=value …`): what it names, and
//! the backend it opens.

use super::backend::PgBackend;
use super::conn::tls::Connector;
use crate::error::{Error, redact_url};
use crate::raw::{Options, RawLocks};

/// Opens the backend a `postgres://` or `postgresql://` URL names; the default
/// namespace with it.
pub(crate) async fn open(url: &str, opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    let invalid = |reason| Error::InvalidUrl {
        url: redact_url(url),
        reason,
    };
    // dblock's own `pooler=` parameter, which the driver would refuse.
    let (stripped, declared) = super::conn::pooler::split_url(url).map_err(invalid)?;
    let (mut config, shown, tls) = parse(&stripped).map_err(invalid)?;
    if let Some(name) = opts.setting(super::settings::APPLICATION_NAME) {
        config.application_name(name);
    }
    let mut opts = opts.clone();
    if let Some(p) = declared {
        opts.set(super::settings::POOLER, p.as_str());
    }
    let (b, ns) = PgBackend::open(config, shown, tls, &opts).await?;
    Ok((Box::new(b), ns))
}

/// Parses a PostgreSQL connection string (a `postgres://` URL or a `key=value` string,
/// libpq's conventions: its environment, its password file) into the configuration of
/// dblock's own connections, the string as it may be shown (passwords redacted), and
/// the TLS it asks for, its certificate files read.
pub(crate) fn parse(url: &str) -> Result<(tokio_postgres::Config, String, Connector), String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let parsed = super::conn::conninfo::parse(url, &env)?;
    let tls = Connector::new(&parsed.tls)?;
    Ok((parsed.config, parsed.shown, tls))
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
            assert!(parse(u).is_ok(), "{u}");
        }
    }
}
