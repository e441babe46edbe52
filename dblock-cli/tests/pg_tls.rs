//! TLS on dblock's own connections, against a throwaway cluster whose TCP listener takes
//! TLS connections only (`hostssl` lines alone in pg_hba.conf), with a CA, a server and
//! a client certificate the test makes itself. Every sslmode of libpq is tried, with the
//! control that a plain connection is refused there.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::process::Output;
use std::time::Duration;

use dblock_testkit::cluster::TempCluster;
use dblock_testkit::tls::{Certs, tls_only_cluster};
use dblock_testkit::{admin_connect, exit_code as code, one_line_error};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// The server certificate's only name; the cluster listens on 127.0.0.1, which the
/// certificate does not name.
const SERVER_NAME: &str = "db.dblock.test";

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("bounded: a connection attempt hung")
}

fn url(c: &TempCluster, params: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{}/postgres?{params}", c.port)
}

/// Whether every session of `app` on the cluster is encrypted (and there is one).
async fn sessions_encrypted(c: &TempCluster, app: &str) -> bool {
    let admin = admin_connect(&c.socket_conninfo("postgres")).await;
    let rows = admin
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.application_name = $1",
            &[&app],
        )
        .await
        .unwrap();
    assert!(!rows.is_empty(), "no session of {app}");
    rows.iter().all(|r| r.get::<_, bool>(0))
}

/// dblock with a clean environment (no URL, no PG* variables).
fn dblock(state: &std::path::Path) -> tokio::process::Command {
    let mut c = dblock_testkit::dblock_command(DBLOCK, state);
    for v in [
        "PGHOST",
        "PGPORT",
        "PGUSER",
        "PGPASSWORD",
        "PGSSLMODE",
        "PGSSLROOTCERT",
    ] {
        c.env_remove(v);
    }
    c
}

async fn run(state: &std::path::Path, args: &[&str]) -> Output {
    within(dblock(state).args(args).output()).await.unwrap()
}

#[tokio::test]
async fn every_sslmode_that_may_encrypt_reaches_a_tls_only_server() {
    let certs = Certs::generate(SERVER_NAME, "certuser");
    let c = tls_only_cluster(&certs, "hostssl all all 127.0.0.1/32 trust");
    let ca = certs.ca.display().to_string();

    // The control: this server refuses plain connections.
    let e = within(dblock::Locks::connect(&url(&c, "sslmode=disable")))
        .await
        .expect_err("a plain connection to a TLS-only server");
    assert!(e.is_connection(), "{e}");
    assert!(e.to_string().contains("no encryption"), "{e}");

    for (mode, extra) in [
        ("allow", String::new()),
        ("prefer", String::new()),
        ("require", String::new()),
        ("verify-ca", format!("&sslrootcert={ca}")),
    ] {
        let app = format!("dblock_tls_{}", mode.replace('-', "_"));
        let u = url(&c, &format!("sslmode={mode}{extra}&application_name={app}"));
        let locks = within(dblock::Locks::connect(&u))
            .await
            .unwrap_or_else(|e| panic!("sslmode={mode}: {e}"));
        let guard = within(locks.lock("tls:job")).await.unwrap();
        assert!(sessions_encrypted(&c, &app).await, "sslmode={mode}");
        within(guard.release()).await.unwrap();
    }

    // verify-full: the certificate's host name, reached at 127.0.0.1 (hostaddr).
    let full = format!(
        "host={SERVER_NAME} hostaddr=127.0.0.1 port={} user=postgres dbname=postgres \
         sslmode=verify-full sslrootcert={ca} application_name=dblock_tls_full",
        c.port
    );
    let locks = within(dblock::Locks::connect(&full)).await.unwrap();
    let guard = within(locks.lock("tls:job")).await.unwrap();
    assert!(sessions_encrypted(&c, "dblock_tls_full").await);
    within(guard.release()).await.unwrap();
}

#[tokio::test]
async fn verification_refuses_a_certificate_for_another_host_or_from_another_ca() {
    let certs = Certs::generate(SERVER_NAME, "certuser");
    let c = tls_only_cluster(&certs, "hostssl all all 127.0.0.1/32 trust");
    let ca = certs.ca.display().to_string();

    // The certificate is for db.dblock.test; 127.0.0.1 is another host name.
    let u = url(&c, &format!("sslmode=verify-full&sslrootcert={ca}"));
    let e = within(dblock::Locks::connect(&u)).await.err().unwrap();
    let msg = e.to_string();
    assert!(e.is_connection(), "{msg}");
    assert!(!msg.contains('\n'), "one line: {msg:?}");
    assert!(
        msg.contains("not valid for host name 127.0.0.1") && msg.contains(SERVER_NAME),
        "{msg}"
    );
    // Signed by a CA the client does not trust: refused by verify-ca and verify-full.
    let other = certs.other_ca.display().to_string();
    for mode in ["verify-ca", "verify-full"] {
        let u = format!(
            "host={SERVER_NAME} hostaddr=127.0.0.1 port={} user=postgres dbname=postgres \
             sslmode={mode} sslrootcert={other}",
            c.port
        );
        let e = within(dblock::Locks::connect(&u)).await.err().unwrap();
        assert!(
            e.to_string()
                .contains("is not signed by a certificate in sslrootcert"),
            "{mode}: {e}"
        );
    }
    // verify-* without a root certificate is a configuration error, not a connection.
    let e = within(dblock::Locks::connect(&url(&c, "sslmode=verify-ca")))
        .await
        .err()
        .unwrap();
    assert!(e.is_invalid_input(), "{e}");
    assert!(e.to_string().contains("sslrootcert"), "{e}");
    let u = url(&c, "sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem");
    let e = within(dblock::Locks::connect(&u)).await.err().unwrap();
    assert!(
        e.is_invalid_input() && e.to_string().contains("/nonexistent/ca.pem"),
        "{e}"
    );
}

#[tokio::test]
async fn a_client_certificate_authenticates_where_the_server_demands_one() {
    let certs = Certs::generate(SERVER_NAME, "certuser");
    let c = tls_only_cluster(
        &certs,
        "hostssl all certuser 127.0.0.1/32 cert\nhostssl all all 127.0.0.1/32 trust",
    );
    let admin = admin_connect(&c.socket_conninfo("postgres")).await;
    admin
        .batch_execute("CREATE ROLE certuser LOGIN")
        .await
        .unwrap();
    let base = format!(
        "postgres://certuser@127.0.0.1:{}/postgres?sslmode=verify-ca&sslrootcert={}",
        c.port,
        certs.ca.display()
    );
    // The control: without the certificate the server refuses.
    let e = within(dblock::Locks::connect(&base)).await.err().unwrap();
    assert!(e.is_connection(), "{e}");
    let with = format!(
        "{base}&sslcert={}&sslkey={}",
        certs.client_cert.display(),
        certs.client_key.display()
    );
    let locks = within(dblock::Locks::connect(&with)).await.unwrap();
    let guard = within(locks.lock("cert:job")).await.unwrap();
    within(guard.release()).await.unwrap();
}

#[tokio::test]
async fn run_migrate_and_bench_reach_a_tls_only_server() {
    let certs = Certs::generate(SERVER_NAME, "certuser");
    let c = tls_only_cluster(&certs, "hostssl all all 127.0.0.1/32 trust");
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let full = format!(
        "host={SERVER_NAME} hostaddr=127.0.0.1 port={} user=postgres dbname=postgres \
         sslmode=verify-full sslrootcert={}",
        c.port,
        certs.ca.display()
    );

    let out = run(s, &["run", "--db", &full, "tls:job", "--", "true"]).await;
    assert_eq!(code(&out), 0, "{out:?}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("0001_t.sql"), "CREATE TABLE t (x INTEGER);").unwrap();
    let out = run(s, &["migrate", "--db", &full, dir.path().to_str().unwrap()]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let admin = admin_connect(&c.socket_conninfo("postgres")).await;
    admin.batch_execute("SELECT x FROM t").await.unwrap();

    let out = run(s, &["bench", "--db", &full, "--seconds", "0.2", "--json"]).await;
    assert_eq!(code(&out), 0, "{out:?}");

    // A certificate for another host name: one line, exit 69 (unavailable).
    let wrong = url(
        &c,
        &format!("sslmode=verify-full&sslrootcert={}", certs.ca.display()),
    );
    let out = run(s, &["run", "--db", &wrong, "tls:job", "--", "true"]).await;
    assert_eq!(code(&out), 69, "{out:?}");
    let line = one_line_error(&out);
    assert!(line.contains("not valid for host name 127.0.0.1"), "{line}");
    // A plain connection is refused: the control for all of the above.
    let plain = url(&c, "sslmode=disable");
    let out = run(s, &["run", "--db", &plain, "tls:job", "--", "true"]).await;
    assert_eq!(code(&out), 69, "{out:?}");
}

#[tokio::test]
async fn unix_sockets_never_use_tls_whatever_the_sslmode() {
    let certs = Certs::generate(SERVER_NAME, "certuser");
    let c = tls_only_cluster(&certs, "hostssl all all 127.0.0.1/32 trust");
    let dir = c.dir.path().display().to_string();
    let encoded: String = dir.replace('/', "%2F");
    for u in [
        format!(
            "postgres:///postgres?host={dir}&port={}&user=postgres&sslmode=require",
            c.port
        ),
        format!(
            "postgres://postgres@{encoded}:{}/postgres?sslmode=require",
            c.port
        ),
        format!(
            "host={dir} port={} user=postgres dbname=postgres sslmode=prefer",
            c.port
        ),
    ] {
        let locks = within(dblock::Locks::connect(&u))
            .await
            .unwrap_or_else(|e| panic!("{u}: {e}"));
        let guard = within(locks.lock("socket:job")).await.unwrap();
        within(guard.release()).await.unwrap();
    }
}

#[tokio::test]
async fn sslrootcert_system_trusts_the_system_roots_and_checks_the_name() {
    let certs = Certs::generate(SERVER_NAME, "certuser");
    let c = tls_only_cluster(&certs, "hostssl all all 127.0.0.1/32 trust");
    let state = tempfile::tempdir().unwrap();
    // No sslmode: `system` makes it verify-full.
    let system = format!(
        "host={SERVER_NAME} hostaddr=127.0.0.1 port={} user=postgres dbname=postgres \
         sslrootcert=system",
        c.port
    );
    let args = ["run", "--db", system.as_str(), "sys:job", "--", "true"];
    // The test's CA is in no system store: refused, saying which roots were tried.
    let out = within(
        dblock(state.path())
            .env_remove("SSL_CERT_FILE")
            .env_remove("SSL_CERT_DIR")
            .args(args)
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(code(&out), 69, "{out:?}");
    assert!(
        one_line_error(&out).contains("not signed by a certificate in the system's trusted roots"),
        "{out:?}"
    );
    // With the CA made a system root (SSL_CERT_FILE, as OpenSSL reads it): accepted.
    let out = within(
        dblock(state.path())
            .env("SSL_CERT_FILE", &certs.ca)
            .env_remove("SSL_CERT_DIR")
            .args(args)
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(code(&out), 0, "{out:?}");
    // And the name is still checked: 127.0.0.1 is not the certificate's name.
    let by_ip = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslrootcert=system",
        c.port
    );
    let out = within(
        dblock(state.path())
            .env("SSL_CERT_FILE", &certs.ca)
            .env_remove("SSL_CERT_DIR")
            .args(["run", "--db", &by_ip, "sys:job", "--", "true"])
            .output(),
    )
    .await
    .unwrap();
    assert_eq!(code(&out), 69, "{out:?}");
    assert!(
        one_line_error(&out).contains("not valid for host name 127.0.0.1"),
        "{out:?}"
    );
}
