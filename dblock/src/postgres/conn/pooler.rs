//! Connection poolers (PgBouncer, pgcat, RDS Proxy…) between dblock and PostgreSQL.
//!
//! A pooler in **transaction** mode hands each transaction to whichever server
//! connection is free: anything that lives on a server session beyond one transaction
//! — a session-scoped advisory lock, a `SET`, a prepared statement — is lost, or stays
//! behind for the next client of that server connection. In **session** mode a client
//! keeps one server connection for as long as it stays connected, as with no pooler.
//!
//! What dblock does behind each ([`Pooler`]):
//!
//! | what                                   | direct / session pooling | transaction pooling |
//! |----------------------------------------|--------------------------|---------------------|
//! | transaction-scoped locks (the default), fencing, leases, leader election | work | work: the lock's open transaction pins one server connection |
//! | session-scoped locks, [`multiplex`](crate::Builder::multiplex) | work | refused: [`Error::BehindPooler`](crate::Error::BehindPooler); work behind a *pinning* pooler ([`Pooler::Pinning`]) |
//! | migrations ([`migrate`](crate::migrate)) | work | refused: [`Error::BehindPooler`](crate::Error::BehindPooler) (run them through a direct URL), behind a pinning pooler too |
//! | [`xact`](crate::postgres::xact) helpers | work | work (no server-side prepared statements) |
//!
//! Behind any pooler dblock sets nothing on a server session beyond the transaction
//! that needs it (`SET LOCAL`, `set_config(…, true)`), and a deadline
//! ([`try_lock_for`](crate::Request::try_lock_for), `dblock run --wait`) is kept on the
//! client as well as by the server's `lock_timeout`, since time a request spends queued
//! inside the pooler for a free server connection is time the server never sees.
//!
//! # How dblock knows
//!
//! Say it: `pooler=transaction`, `pooler=pinning`, `pooler=session` or `pooler=none` in
//! the URL (a query parameter, or a `key=value` word; dblock removes it before
//! connecting), or [`Builder::pooler`](crate::Builder::pooler). Otherwise a managed
//! service's host says it ([`implied_by_host`]: Supabase's ports, Neon's `-pooler`
//! hosts). Otherwise dblock detects a pooler on its own connections: PostgreSQL tells a client its backend's process id when it connects
//! (the cancel key), and a pooler answers with a key of its own, so the process id the
//! connection was given differs from `pg_backend_pid()`. A detected pooler is taken to
//! pool transactions, the mode in which session state is unsafe, until told otherwise.
//!
//! Limits of detection: a proxy that passes the server's cancel key through unchanged
//! is not seen (say `pooler=…` for it). On an sqlx pool ([`Locks::from_sqlx_pool`]),
//! whose connections do not expose the cancel key, the only sign used is the server's
//! port (`inet_server_port()`) differing from the port the pool connects to — which a
//! port-forward also causes, and a pooler on the server's own port does not.
//!
//! [`Locks::from_sqlx_pool`]: crate::Locks::from_sqlx_pool

use std::borrow::Cow;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use crate::raw::Pooler;

/// How the pooler in effect became known, for error messages and `dblock doctor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Known {
    /// The user said so.
    Declared,
    /// Implied by a managed service's host and port ([`implied_by_host`]).
    Host,
    /// Detected on dblock's own connections (cancel key).
    CancelKey,
    /// Detected on an sqlx pool (port).
    Port,
}

impl Known {
    /// How `pooler` is known, in words.
    pub(crate) fn describe(self, pooler: Pooler) -> &'static str {
        match (self, pooler) {
            (Known::Declared, Pooler::Pinning) => {
                "pooler=pinning was set: a server connection is pinned while a session lock \
                 is held, and nothing else of a session is kept"
            }
            (Known::Declared, Pooler::Session) => "pooler=session was set",
            (Known::Declared, Pooler::None) => "pooler=none was set",
            (Known::Declared, _) => "pooler=transaction was set",
            (Known::Host, Pooler::Transaction) => {
                "implied by the host: Supabase's port 6543 and Neon's -pooler hosts pool \
                 transactions"
            }
            (Known::Host, _) => {
                "implied by the host: Supabase's port 5432 and Neon's hosts without -pooler \
                 keep a server session per client"
            }
            (Known::CancelKey, Pooler::None) => {
                "detected: no pooler seen (the connection's process id is the server's \
                 pg_backend_pid())"
            }
            (Known::Port, Pooler::None) => {
                "detected: no pooler seen (the server's port is the one the sqlx pool \
                 connects to)"
            }
            (Known::CancelKey, _) => {
                "detected: the connection's process id is not the server's pg_backend_pid()"
            }
            (Known::Port, _) => {
                "detected: the server's port is not the one the sqlx pool connects to"
            }
        }
    }
}

/// The pooler a managed service's host and port imply, which dblock uses unless it is
/// told otherwise (`pooler=…`, [`Builder::pooler`](crate::Builder::pooler)):
///
/// - Supabase (`*.supabase.co`, `*.supabase.com`, the Supavisor hosts
///   `*.pooler.supabase.com` among them): port 6543 pools transactions, port 5432 keeps
///   a server session per client (Supavisor's session mode, or the database itself).
/// - Neon (`*.neon.tech`): an endpoint whose first label ends in `-pooler` is PgBouncer
///   in transaction mode; any other endpoint is Neon's proxy, one server session per
///   client (whose cancel keys are its own, so detection would mistake it for a pooler).
///
/// `None` for any other host, or a port the service does not document.
pub fn implied_by_host(host: &str, port: u16) -> Option<Pooler> {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let under = |domain: &str| host.ends_with(&format!(".{domain}"));
    if under("supabase.co") || under("supabase.com") {
        return match port {
            6543 => Some(Pooler::Transaction),
            5432 => Some(Pooler::Session),
            _ => None,
        };
    }
    if under("neon.tech") {
        let first = host.split('.').next().unwrap_or_default();
        return Some(match first.ends_with("-pooler") {
            true => Pooler::Transaction,
            false => Pooler::Session,
        });
    }
    None
}

/// Removes dblock's `pooler` parameter from a connection string (URL query parameter or
/// `key=value` word), returning the string the driver gets and the declared mode.
pub(crate) fn split_url(url: &str) -> Result<(Cow<'_, str>, Option<Pooler>), String> {
    let (rest, value) = split_param(url, "pooler");
    Ok((rest, value.map(|v| Pooler::parse(&v)).transpose()?))
}

/// Removes one of dblock's own parameters, `name` (`pooler`, `self_test`), from a
/// connection string — a URL query parameter or a `key=value` word, which the driver
/// would refuse — returning the string without it and its value (the last, if given
/// more than once).
pub(crate) fn split_param<'u>(url: &'u str, name: &str) -> (Cow<'u, str>, Option<String>) {
    let lower = url.get(..13).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("postgres://") || lower.starts_with("postgresql://") {
        let Some(q) = url.find('?') else {
            return (Cow::Borrowed(url), None);
        };
        let (head, query) = (&url[..q], &url[q + 1..]);
        let (query, frag) = match query.find('#') {
            Some(h) => (&query[..h], &query[h..]),
            None => (query, ""),
        };
        let mut found = None;
        let mut kept = Vec::new();
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some((k, v)) if k.eq_ignore_ascii_case(name) => found = Some(v.to_string()),
                _ => kept.push(pair),
            }
        }
        if found.is_none() {
            return (Cow::Borrowed(url), None);
        }
        let kept = kept.join("&");
        let sep = if kept.is_empty() { "" } else { "?" };
        return (Cow::Owned(format!("{head}{sep}{kept}{frag}")), found);
    }
    // A key=value connection string: `name=…` as one whitespace-separated word.
    if !url.contains('=') || url.contains("://") {
        return (Cow::Borrowed(url), None);
    }
    let mut found = None;
    let mut kept = Vec::new();
    for word in url.split_whitespace() {
        match word.split_once('=') {
            Some((k, v)) if k.trim().eq_ignore_ascii_case(name) => {
                found = Some(v.trim_matches('\'').to_string());
            }
            _ => kept.push(word),
        }
    }
    match found {
        None => (Cow::Borrowed(url), None),
        Some(v) => (Cow::Owned(kept.join(" ")), Some(v)),
    }
}

/// The process id a connection was given when it connected (its cancel key), read by
/// having the driver write a cancel request into a local pipe: tokio-postgres offers no
/// accessor for it. Nothing leaves the process. `None` if it cannot be read.
pub(crate) async fn announced_pid(token: tokio_postgres::CancelToken) -> Option<i32> {
    let (client, mut server) = tokio::io::duplex(64);
    let write = async move {
        // Whatever the sslmode, the "server" below accepts TLS and the pass-through
        // connector leaves the bytes as they are.
        let _ = token.cancel_query_raw(client, PassThrough).await;
    };
    let read = async move {
        let mut head = [0u8; 8];
        server.read_exact(&mut head).await.ok()?;
        // An SSLRequest (length 8, code 80877103) comes first unless sslmode=disable.
        if head == [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f] {
            server.write_all(b"S").await.ok()?;
            server.read_exact(&mut head).await.ok()?;
        }
        // CancelRequest: length 16, code 80877102, process id, secret key.
        if head != [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e] {
            return None;
        }
        let mut pid = [0u8; 4];
        server.read_exact(&mut pid).await.ok()?;
        Some(i32::from_be_bytes(pid))
    };
    let (_, pid) = tokio::time::timeout(std::time::Duration::from_secs(1), async {
        tokio::join!(write, read)
    })
    .await
    .ok()?;
    pid
}

/// A "TLS" connector that leaves the stream as it is, so that [`announced_pid`] reads
/// the cancel request in the clear whatever the connection's sslmode.
struct PassThrough;

impl<S> tokio_postgres::tls::TlsConnect<S> for PassThrough
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PassThroughStream<S>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<PassThroughStream<S>, std::io::Error>>;

    fn connect(self, stream: S) -> Self::Future {
        std::future::ready(Ok(PassThroughStream(stream)))
    }
}

struct PassThroughStream<S>(S);

impl<S> tokio_postgres::tls::TlsStream for PassThroughStream<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn channel_binding(&self) -> tokio_postgres::tls::ChannelBinding {
        tokio_postgres::tls::ChannelBinding::none()
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for PassThroughStream<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for PassThroughStream<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pooler_parameter_is_taken_out_of_urls_and_connection_strings() {
        let (u, p) = split_url("postgres://u@h:6432/db?pooler=transaction&sslmode=disable")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.as_ref(), p),
            (
                "postgres://u@h:6432/db?sslmode=disable",
                Some(Pooler::Transaction)
            )
        );
        let (u, p) =
            split_url("postgresql://h/db?pooler=Session").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.as_ref(), p),
            ("postgresql://h/db", Some(Pooler::Session))
        );
        let (u, p) =
            split_url("postgres://h/db?application_name=x").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.as_ref(), p),
            ("postgres://h/db?application_name=x", None)
        );
        let (u, p) =
            split_url("host=h port=6432 pooler=none dbname=x").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (u.as_ref(), p),
            ("host=h port=6432 dbname=x", Some(Pooler::None))
        );
        let (u, p) = split_url("postgres://h/db?pooler=pinning").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((u.as_ref(), p), ("postgres://h/db", Some(Pooler::Pinning)));
        assert!(split_url("postgres://h/db?pooler=sometimes").is_err());
        assert_eq!(
            split_url("sqlite:/tmp/x.db").map(|(u, p)| (u.into_owned(), p)),
            Ok(("sqlite:/tmp/x.db".to_string(), None))
        );
    }
}
