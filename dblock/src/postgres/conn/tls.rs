//! TLS on dblock's own PostgreSQL connections: libpq's `sslmode` over rustls.
//!
//! | `sslmode`     | encrypted                         | server certificate checked            |
//! |---------------|-----------------------------------|---------------------------------------|
//! | `disable`     | never                             | —                                     |
//! | `allow`       | only if the server refuses plain  | no                                    |
//! | `prefer`      | if the server offers TLS (default) | no                                   |
//! | `require`     | always                            | no (as `verify-ca` with a root file)  |
//! | `verify-ca`   | always                            | signed by `sslrootcert`               |
//! | `verify-full` | always                            | signed by `sslrootcert`, for the host |
//!
//! As in libpq: `require` with a root certificate (given, or `~/.postgresql/root.crt`)
//! checks the chain like `verify-ca`; `sslrootcert=system` (the operating system's
//! trusted roots, read with `rustls-native-certs` as OpenSSL-based libpq reads them)
//! makes `verify-full` the default and refuses weaker modes; Unix-socket connections
//! never use TLS. rustls is used with the `ring` provider, so no system OpenSSL is
//! needed.

use std::path::PathBuf;

use tokio_postgres::config::SslMode as DriverMode;
use tokio_postgres::{CancelToken, Client, Config, Connection, Socket};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    /// Parses a `sslmode` value.
    pub(crate) fn parse(s: &str) -> Option<SslMode> {
        Some(match s {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// What tokio-postgres is told: it knows only disable, prefer and require; `allow`
    /// starts plain and retries with TLS (see [`Connector::connect`]).
    pub(crate) fn driver_mode(self) -> DriverMode {
        match self {
            SslMode::Disable | SslMode::Allow => DriverMode::Disable,
            SslMode::Prefer => DriverMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => DriverMode::Require,
        }
    }
}

/// Where the certificates that may sign the server's come from (`sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RootCert {
    /// A PEM file of one or more certificates.
    File(PathBuf),
    /// The operating system's trusted roots (`sslrootcert=system`).
    System,
}

/// The TLS settings of a connection string, defaults resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TlsOptions {
    pub(crate) mode: SslMode,
    pub(crate) root_cert: Option<RootCert>,
    /// Client certificate chain and its key (`sslcert`, `sslkey`), PEM files.
    pub(crate) client_cert: Option<(PathBuf, PathBuf)>,
}

/// The stream of an encrypted connection.
#[cfg(feature = "tls")]
pub(crate) type Stream = rustls_impl::RustlsStream;
/// The stream of an encrypted connection: none in a build without TLS.
#[cfg(not(feature = "tls"))]
pub(crate) type Stream = tokio_postgres::tls::NoTlsStream;

#[cfg(feature = "tls")]
type Make = rustls_impl::MakeRustls;
#[cfg(not(feature = "tls"))]
type Make = tokio_postgres::NoTls;

/// Opens dblock's connections with the TLS a connection string asked for.
#[derive(Clone)]
pub(crate) struct Connector {
    mode: SslMode,
    make: Make,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("sslmode", &self.mode.as_str())
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// Reads the certificate files and builds the TLS configuration. Errors are the
    /// reason, for an [`Error::InvalidUrl`](crate::Error::InvalidUrl).
    pub(crate) fn new(opts: &TlsOptions) -> Result<Connector, String> {
        #[cfg(feature = "tls")]
        {
            Ok(Connector {
                mode: opts.mode,
                make: rustls_impl::MakeRustls::new(opts)?,
            })
        }
        #[cfg(not(feature = "tls"))]
        {
            if opts.mode >= SslMode::Require || opts.client_cert.is_some() {
                return Err(format!(
                    "sslmode={} needs TLS, which this build of dblock lacks (cargo feature \"tls\")",
                    opts.mode.as_str()
                ));
            }
            Ok(Connector {
                mode: opts.mode,
                make: tokio_postgres::NoTls,
            })
        }
    }

    /// The connector maker (a copy, for the driver to consume).
    #[allow(clippy::clone_on_copy)] // `NoTls` is Copy; the rustls maker is not.
    fn make(&self) -> Make {
        self.make.clone()
    }

    /// Connects as `config` says, with this connector's TLS. `config`'s own sslmode must
    /// be [`SslMode::driver_mode`] of this connector's.
    ///
    /// Cancel safe: dropping the future closes the socket being opened.
    pub(crate) async fn connect(
        &self,
        config: &Config,
    ) -> Result<(Client, Connection<Socket, Stream>), tokio_postgres::Error> {
        let unix_only = !config.get_hosts().is_empty()
            && config
                .get_hosts()
                .iter()
                .all(|h| !matches!(h, tokio_postgres::config::Host::Tcp(_)));
        if unix_only && config.get_ssl_mode() != DriverMode::Disable {
            // libpq never uses TLS on a Unix socket, and the server would refuse it.
            let mut plain = config.clone();
            plain.ssl_mode(DriverMode::Disable);
            return plain.connect(self.make()).await;
        }
        match config.connect(self.make()).await {
            // `allow`: the server refused a plain connection (a `hostssl`-only pg_hba, say):
            // try again with TLS, as libpq does.
            Err(e) if self.mode == SslMode::Allow && e.as_db_error().is_some() => {
                let mut tls = config.clone();
                tls.ssl_mode(DriverMode::Require);
                tls.connect(self.make()).await
            }
            other => other,
        }
    }

    /// Asks the server to cancel what the session of `token` is running, over the same
    /// kind of connection the session has.
    ///
    /// Cancel safe: the request is a connection of its own, closed when dropped.
    pub(crate) async fn cancel(&self, token: &CancelToken) -> Result<(), tokio_postgres::Error> {
        token.cancel_query(self.make()).await
    }
}

/// A connection error as one line: the driver's words and, once each, its causes
/// (tokio-postgres puts the useful part — refused, timed out, the certificate's fault —
/// in the source). The server's own errors are its message.
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return db.message().to_string();
    }
    let mut m = e.to_string();
    #[cfg(feature = "tls")]
    let ours = format!("unexpected error: {}", rustls_impl::OURS);
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let s_text = s.to_string();
        if !m.contains(&s_text) {
            m.push_str(": ");
            m.push_str(&s_text);
        }
        src = s.source();
    }
    #[cfg(feature = "tls")]
    let m = m.replace(&ours, rustls_impl::OURS);
    m
}

#[cfg(feature = "tls")]
mod rustls_impl {
    use std::future::Future;
    use std::io;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::crypto::CryptoProvider;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
    use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio_postgres::Socket;
    use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

    use super::{RootCert, SslMode, TlsOptions};

    /// Makes a TLS connector per host name.
    #[derive(Clone)]
    pub(crate) struct MakeRustls(Arc<ClientConfig>);

    impl MakeRustls {
        pub(crate) fn new(opts: &TlsOptions) -> Result<MakeRustls, String> {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let verifier: Arc<dyn ServerCertVerifier> = match &opts.root_cert {
                Some(root) if opts.mode >= SslMode::Require => {
                    let roots = Arc::new(load_roots(root)?);
                    let inner =
                        WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                            .build()
                            .map_err(|e| format!("sslrootcert: {e}"))?;
                    Arc::new(Checked {
                        inner,
                        check_name: opts.mode == SslMode::VerifyFull,
                        roots: match root {
                            RootCert::File(p) => format!("sslrootcert {}", p.display()),
                            RootCert::System => "the system's trusted roots".into(),
                        },
                    })
                }
                _ if opts.mode >= SslMode::VerifyCa => {
                    return Err(format!(
                        "sslmode={} checks the server's certificate but no root certificate is \
                         given: set sslrootcert to a file, or sslrootcert=system for the \
                         system's trusted roots",
                        opts.mode.as_str()
                    ));
                }
                _ => Arc::new(Unchecked(provider.clone())),
            };
            let builder = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .dangerous()
                .with_custom_certificate_verifier(verifier);
            let mut config = match &opts.client_cert {
                Some((cert, key)) => {
                    let certs = CertificateDer::pem_file_iter(cert)
                        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                        .map_err(|e| format!("sslcert {}: {e}", cert.display()))?;
                    if certs.is_empty() {
                        return Err(format!("sslcert {}: no certificate in it", cert.display()));
                    }
                    let key_der = PrivateKeyDer::from_pem_file(key)
                        .map_err(|e| format!("sslkey {}: {e}", key.display()))?;
                    builder
                        .with_client_auth_cert(certs, key_der)
                        .map_err(|e| format!("sslcert/sslkey: {e}"))?
                }
                None => builder.with_no_client_auth(),
            };
            // PostgreSQL 17 requires it for `sslnegotiation=direct`; older servers ignore it.
            config.alpn_protocols = vec![b"postgresql".to_vec()];
            Ok(MakeRustls(Arc::new(config)))
        }
    }

    fn load_roots(root: &RootCert) -> Result<RootCertStore, String> {
        let mut store = RootCertStore::empty();
        match root {
            RootCert::File(path) => {
                let certs = CertificateDer::pem_file_iter(path)
                    .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
                for c in certs {
                    store
                        .add(c)
                        .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
                }
                if store.is_empty() {
                    return Err(format!(
                        "sslrootcert {}: no certificate in it",
                        path.display()
                    ));
                }
            }
            RootCert::System => {
                let found = rustls_native_certs::load_native_certs();
                store.add_parsable_certificates(found.certs);
                if store.is_empty() {
                    let why = found
                        .errors
                        .first()
                        .map(|e| format!(" ({e})"))
                        .unwrap_or_default();
                    return Err(format!(
                        "sslrootcert=system: no trusted root certificates found on this \
                         system{why}"
                    ));
                }
            }
        }
        Ok(store)
    }

    /// `allow`, `prefer`, `require` without a root certificate: encrypted, but any
    /// certificate is accepted (the handshake's signatures are still checked).
    #[derive(Debug)]
    struct Unchecked(Arc<CryptoProvider>);

    impl ServerCertVerifier for Unchecked {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    /// `verify-ca` (chain only) and `verify-full` (chain and host name).
    #[derive(Debug)]
    struct Checked {
        inner: Arc<WebPkiServerVerifier>,
        check_name: bool,
        /// Where the trusted roots came from, for messages.
        roots: String,
    }

    impl ServerCertVerifier for Checked {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            use rustls::Error::InvalidCertificate;
            match self
                .inner
                .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
            {
                // webpki checks the name only once the chain is good.
                Err(InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) if !self.check_name => Ok(ServerCertVerified::assertion()),
                Err(InvalidCertificate(CertificateError::NotValidForNameContext {
                    presented,
                    ..
                })) => {
                    let names: Vec<&str> = presented.iter().map(|p| presented_name(p)).collect();
                    Err(rustls::Error::General(format!(
                        "{OURS}is not valid for host name {} (it is for {}; sslmode=verify-full \
                         checks the name)",
                        shown_name(server_name),
                        names.join(", ")
                    )))
                }
                Err(InvalidCertificate(CertificateError::NotValidForName)) => {
                    Err(rustls::Error::General(format!(
                        "{OURS}is not valid for host name {} (sslmode=verify-full checks the \
                         name)",
                        shown_name(server_name)
                    )))
                }
                Err(InvalidCertificate(CertificateError::UnknownIssuer)) => {
                    Err(rustls::Error::General(format!(
                        "{OURS}is not signed by a certificate in {} (UnknownIssuer)",
                        self.roots
                    )))
                }
                other => other,
            }
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls12_signature(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls13_signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.inner.supported_verify_schemes()
        }
    }

    /// How the messages of [`Checked`] begin; [`super::describe`] drops the "unexpected
    /// error: " rustls puts before them.
    pub(super) const OURS: &str = "the server's certificate ";

    /// `DnsName("db.example.com")` as rustls reports a presented name: the name.
    fn presented_name(p: &str) -> &str {
        p.strip_prefix("DnsName(\"")
            .and_then(|p| p.strip_suffix("\")"))
            .unwrap_or(p)
    }

    fn shown_name(name: &ServerName<'_>) -> String {
        match name {
            ServerName::DnsName(d) => d.as_ref().to_string(),
            ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
            other => format!("{other:?}"),
        }
    }

    /// The TLS connector for one host.
    pub(crate) struct RustlsConnect {
        config: Arc<ClientConfig>,
        name: Option<ServerName<'static>>,
    }

    impl MakeTlsConnect<Socket> for MakeRustls {
        type Stream = RustlsStream;
        type TlsConnect = RustlsConnect;
        type Error = std::convert::Infallible;

        fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, Self::Error> {
            // Empty for a Unix socket, where TLS is never attempted.
            Ok(RustlsConnect {
                config: self.0.clone(),
                name: ServerName::try_from(domain.to_string()).ok(),
            })
        }
    }

    impl TlsConnect<Socket> for RustlsConnect {
        type Stream = RustlsStream;
        type Error = io::Error;
        type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

        fn connect(self, stream: Socket) -> Self::Future {
            Box::pin(async move {
                let name = self.name.ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "the host is no valid name to check the server's certificate against",
                    )
                })?;
                let s = tokio_rustls::TlsConnector::from(self.config)
                    .connect(name, stream)
                    .await?;
                Ok(RustlsStream(Box::new(s)))
            })
        }
    }

    /// An encrypted connection's stream.
    pub(crate) struct RustlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

    impl TlsStream for RustlsStream {
        fn channel_binding(&self) -> ChannelBinding {
            // SCRAM channel binding (tls-server-end-point) would need the certificate's
            // signature hash; without it, `channel_binding=prefer` (the default)
            // authenticates without binding.
            ChannelBinding::none()
        }
    }

    impl AsyncRead for RustlsStream {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for RustlsStream {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut *self.0).poll_write(cx, buf)
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut *self.0).poll_shutdown(cx)
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut *self.0).poll_write_vectored(cx, bufs)
        }

        fn is_write_vectored(&self) -> bool {
            self.0.is_write_vectored()
        }
    }
}
