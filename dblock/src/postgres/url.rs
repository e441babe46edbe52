//! A `postgres://` URL: what it names, and the backend it opens.

use super::backend::PgBackend;
use crate::error::{Error, redact_url};
use crate::raw::{Options, RawLocks};

/// Opens the backend a `postgres://` or `postgresql://` URL names; the default
/// namespace with it.
pub(crate) async fn open(url: &str, opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    let (config, shown) = parse(url).map_err(|reason| Error::InvalidUrl {
        url: redact_url(url),
        reason,
    })?;
    let (b, ns) = PgBackend::open(config, shown, opts).await?;
    Ok((Box::new(b), ns))
}

/// Parses a `postgres://` or `postgresql://` URL into the configuration of dblock's
/// own connections, and the URL as it may be shown (password redacted).
pub(crate) fn parse(url: &str) -> Result<(tokio_postgres::Config, String), String> {
    use std::str::FromStr;
    let mut config = tokio_postgres::Config::from_str(url).map_err(|e| e.to_string())?;
    if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
        return Err(
            "sslmode=require: dblock's own connections do not speak TLS yet; \
                    build the handle from your sqlx pool (Locks::from_sqlx_pool) instead"
                .into(),
        );
    }
    if config.get_hosts().is_empty() {
        config.host("localhost");
    }
    if config.get_user().is_none() {
        // libpq's default: the operating-system user.
        if let Some(user) = std::env::var_os("USER").and_then(|u| u.into_string().ok()) {
            config.user(&user);
        }
    }
    if config.get_application_name().is_none() {
        config.application_name("dblock");
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(std::time::Duration::from_secs(10));
    }
    // A dead peer must not look alive for two hours: probe idle sockets after 30 s.
    config.keepalives_idle(std::time::Duration::from_secs(30));
    Ok((config, redact_url(url)))
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
