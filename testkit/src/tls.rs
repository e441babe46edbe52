//! Certificates made by the test itself (with the `openssl` program) and a throwaway
//! cluster that accepts TCP connections over TLS only.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cluster::TempCluster;

/// A CA, a server certificate it signed, a client certificate it signed, and a second
/// CA that signed nothing of this server's; all PEM files in one directory.
pub struct Certs {
    pub dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("the openssl program is needed to make test certificates: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn new_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-subj",
            &format!("/CN=dblock test {name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

fn signed(dir: &Path, name: &str, cn: &str, ext: &str) {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

impl Certs {
    /// A server certificate for the DNS name `server_name` only (not for 127.0.0.1),
    /// and a client certificate for the role `client_role`.
    pub fn generate(server_name: &str, client_role: &str) -> Certs {
        let dir = tempfile::Builder::new()
            .prefix("dblock-certs-")
            .tempdir()
            .unwrap();
        let d = dir.path();
        new_ca(d, "ca");
        new_ca(d, "other_ca");
        signed(
            d,
            "server",
            server_name,
            &format!(
                "subjectAltName=DNS:{server_name}\nbasicConstraints=CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
            ),
        );
        signed(
            d,
            "client",
            client_role,
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        );
        Certs {
            ca: d.join("ca.crt"),
            other_ca: d.join("other_ca.crt"),
            server_cert: d.join("server.crt"),
            server_key: d.join("server.key"),
            client_cert: d.join("client.crt"),
            client_key: d.join("client.key"),
            dir,
        }
    }
}

/// A throwaway cluster whose TCP listener takes TLS connections only, with `certs`'
/// server certificate, and `hba` as its `pg_hba.conf` lines for `hostssl` (a `local`
/// line with trust comes first, for the test's administration over the Unix socket).
pub fn tls_only_cluster(certs: &Certs, hba: &str) -> TempCluster {
    let c = TempCluster::start(&[]);
    let data = c.data_dir();
    for (from, to) in [
        (&certs.server_cert, "server.crt"),
        (&certs.server_key, "server.key"),
        (&certs.ca, "root.crt"),
    ] {
        std::fs::copy(from, data.join(to)).unwrap();
        crate::cluster::give_to_postgres(&data.join(to));
    }
    let conf = data.join("postgresql.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(
        "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
         ssl_ca_file = 'root.crt'\n",
    );
    std::fs::write(&conf, text).unwrap();
    std::fs::write(
        data.join("pg_hba.conf"),
        format!("local all all trust\n{hba}\n"),
    )
    .unwrap();
    c.restart();
    c
}

impl TempCluster {
    /// A `key=value` connection string for the cluster's Unix socket, as `postgres`.
    pub fn socket_conninfo(&self, dbname: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={dbname}",
            self.dir.path().display(),
            self.port
        )
    }
}
