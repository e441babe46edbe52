//! libpq's conventions, so dblock connects wherever `psql` does: its environment
//! variables, the password file, `key=value` strings, scram-sha-256 password
//! authentication, and several hosts with `target_session_attrs=read-write` across a
//! real failover (a standby made by pg_basebackup, then promoted). And no password,
//! however it was given, in any error, message or `Debug` output.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::process::Output;
use std::time::Duration;

use dblock_testkit::cluster::TempCluster;
use dblock_testkit::{admin_connect, exit_code as code, one_line_error};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("bounded: a connection attempt hung")
}

/// A password no other text contains, so finding it anywhere is a leak.
fn secret(tag: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("Pw{tag}{n}x")
}

/// A throwaway cluster where TCP connections must authenticate with scram-sha-256, and
/// a role `app` whose password is returned.
async fn scram_cluster() -> (TempCluster, String) {
    let c = TempCluster::start(&[("password_encryption", "'scram-sha-256'")]);
    std::fs::write(
        c.data_dir().join("pg_hba.conf"),
        "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n",
    )
    .unwrap();
    c.restart();
    let pw = secret("ok");
    let admin = admin_connect(&c.socket_conninfo("postgres")).await;
    admin
        // CREATE on public: `dblock run` makes its fencing table there (issue 8 part 4
        // is about roles without it; here the subject is authentication).
        .batch_execute(&format!(
            "CREATE ROLE app LOGIN PASSWORD '{pw}'; GRANT CREATE ON SCHEMA public TO app"
        ))
        .await
        .unwrap();
    // The server really stores a SCRAM verifier (the control that scram is what runs).
    let stored: String = admin
        .query_one(
            "SELECT rolpassword FROM pg_authid WHERE rolname = 'app'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(stored.starts_with("SCRAM-SHA-256$"), "{stored}");
    (c, pw)
}

/// dblock with a clean environment: no URL and no PG* variables but those given.
fn dblock(state: &std::path::Path, env: &[(&str, &str)]) -> tokio::process::Command {
    let mut c = dblock_testkit::dblock_command(DBLOCK, state);
    for (k, _) in std::env::vars() {
        if k.starts_with("PG") {
            c.env_remove(k);
        }
    }
    c.env("HOME", state);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

async fn run(state: &std::path::Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    within(dblock(state, env).args(args).output())
        .await
        .unwrap()
}

fn all_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn scram_passwords_work_from_every_source_and_never_show() {
    let (c, pw) = scram_cluster().await;
    let port = c.port.to_string();
    let wrong = secret("wrong");

    // In the URL, in the query, in a key=value string: accepted.
    for u in [
        format!("postgres://app:{pw}@127.0.0.1:{port}/postgres"),
        format!("postgres://app@127.0.0.1:{port}/postgres?password={pw}"),
        format!("host=127.0.0.1 port={port} user=app dbname=postgres password='{pw}'"),
    ] {
        let locks = within(dblock::Locks::connect(&u))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let guard = within(locks.lock("scram:job")).await.unwrap();
        within(guard.release()).await.unwrap();
        let shown = format!("{locks:?} {:?}", dblock::Locks::builder().url(&u));
        assert!(!shown.contains(&pw), "{shown}");
    }
    // The control: without a password the server refuses.
    let e = within(dblock::Locks::connect(&format!(
        "postgres://app@127.0.0.1:{port}/postgres"
    )))
    .await
    .err()
    .unwrap();
    assert!(e.is_connection(), "{e}");

    // A wrong password, wherever given, is in neither the message nor Debug.
    for u in [
        format!("postgres://app:{wrong}@127.0.0.1:{port}/postgres"),
        format!("postgres://app@127.0.0.1:{port}/postgres?sslmode=disable&password={wrong}"),
        format!("host=127.0.0.1 port={port} user=app password={wrong} dbname=postgres"),
        format!("host=127.0.0.1 port={port} user=app password='{wrong}' dbname=postgres"),
        // Invalid strings too: the parse error must not quote it either.
        format!("postgres://app:{wrong}@127.0.0.1:{port}/postgres?bogus=1"),
        format!("host=127.0.0.1 port=notaport password={wrong}"),
        format!("host=127.0.0.1 password='{wrong}"),
        format!("host=127.0.0.1 {wrong}"),
    ] {
        let e = within(dblock::Locks::connect(&u)).await.err().unwrap();
        let shown = format!("{e} {e:?}");
        assert!(!shown.contains(&wrong), "{u}: {shown}");
        let state = tempfile::tempdir().unwrap();
        let out = run(state.path(), &[], &["run", "--db", &u, "j", "--", "true"]).await;
        assert_ne!(code(&out), 0);
        one_line_error(&out);
        assert!(!all_text(&out).contains(&wrong), "{u}: {out:?}");
    }

    // PGPASSWORD, PGPASSFILE, ~/.pgpass: the CLI connects with each, and a wrong one is
    // not shown.
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let url = format!("postgres://app@127.0.0.1:{port}/postgres");
    let args = ["run", "--db", &url, "env:job", "--", "true"];
    let out = run(s, &[("PGPASSWORD", &pw)], &args).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let out = run(s, &[("PGPASSWORD", &wrong)], &args).await;
    assert_eq!(code(&out), 69, "{out:?}");
    assert!(one_line_error(&out).contains("password"), "{out:?}");
    assert!(!all_text(&out).contains(&wrong), "{out:?}");

    let passfile = s.join("passfile");
    std::fs::write(&passfile, format!("127.0.0.1:{port}:*:app:{pw}\n")).unwrap();
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = run(s, &[("PGPASSFILE", passfile.to_str().unwrap())], &args).await;
    assert_eq!(code(&out), 0, "{out:?}");
    std::fs::copy(&passfile, s.join(".pgpass")).unwrap();
    let out = run(s, &[], &args).await;
    assert_eq!(code(&out), 0, "{out:?}");
}

#[tokio::test]
async fn the_pg_variables_alone_say_where_to_connect() {
    let (c, pw) = scram_cluster().await;
    let port = c.port.to_string();
    let admin = admin_connect(&c.socket_conninfo("postgres")).await;
    admin
        .batch_execute("CREATE DATABASE appdb OWNER app")
        .await
        .unwrap();
    let state = tempfile::tempdir().unwrap();
    let s = state.path();
    let env = [
        ("PGHOST", "127.0.0.1"),
        ("PGPORT", port.as_str()),
        ("PGUSER", "app"),
        ("PGPASSWORD", pw.as_str()),
        ("PGDATABASE", "appdb"),
        ("PGAPPNAME", "dblock_env_test"),
    ];
    // While the command runs, the lock's session shows where dblock connected.
    let probe = format!(
        "psql -h {} -p {port} -U postgres -d postgres -Atc \"SELECT datname FROM \
         pg_stat_activity WHERE application_name = 'dblock_env_test' AND usename = 'app'\"",
        c.dir.path().display()
    );
    let out = run(
        s,
        &env,
        &[
            "run",
            "--db",
            "postgres://",
            "env:job",
            "--",
            "sh",
            "-c",
            &probe,
        ],
    )
    .await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l == "appdb"),
        "{out:?}"
    );
    // PGSSLMODE is read: this server has no TLS, so require fails (the control that the
    // variable is not ignored).
    let mut with_ssl = env.to_vec();
    with_ssl.push(("PGSSLMODE", "require"));
    let out = run(
        s,
        &with_ssl,
        &["run", "--db", "postgres://", "j", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 69, "{out:?}");
    assert!(one_line_error(&out).contains("TLS"), "{out:?}");
    // PGSSLROOTCERT is read: a missing file is a usage error naming it.
    with_ssl.pop();
    with_ssl.push(("PGSSLMODE", "verify-ca"));
    with_ssl.push(("PGSSLROOTCERT", "/nonexistent/root.crt"));
    let out = run(
        s,
        &with_ssl,
        &["run", "--db", "postgres://", "j", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 64, "{out:?}");
    assert!(
        one_line_error(&out).contains("/nonexistent/root.crt"),
        "{out:?}"
    );
}

/// Advisory locks held on a cluster, seen from its own socket.
async fn advisory_locks(c: &TempCluster) -> i64 {
    let admin = admin_connect(&c.socket_conninfo("postgres")).await;
    admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn after_a_failover_read_write_hosts_lead_to_the_new_primary() {
    let primary = TempCluster::start(&[]);
    let standby = TempCluster::standby_of(&primary);
    let hosts = format!("127.0.0.1:{},127.0.0.1:{}", standby.port, primary.port);

    // The control: with any session accepted, the first host, the standby, takes the
    // lock, where writers on the primary never see it.
    let any = format!("postgres://postgres@{hosts}/postgres?sslmode=disable");
    let locks = within(dblock::Locks::connect(&any)).await.unwrap();
    let guard = within(locks.lock("failover:job")).await.unwrap();
    assert_eq!(advisory_locks(&standby).await, 1);
    assert_eq!(advisory_locks(&primary).await, 0);
    within(guard.release()).await.unwrap();

    let rw = format!("{any}&target_session_attrs=read-write");
    let locks = within(dblock::Locks::connect(&rw)).await.unwrap();
    let guard = within(locks.lock("failover:job")).await.unwrap();
    assert_eq!(advisory_locks(&primary).await, 1);
    assert_eq!(advisory_locks(&standby).await, 0);
    drop(guard);

    primary.stop();
    standby.promote();
    // The same handle: its connections to the old primary are gone; the next one goes
    // to the first host that accepts writes, the promoted standby.
    let guard = within(async {
        loop {
            match locks.lock("failover:job").await {
                Ok(g) => break g,
                // A connection that died with the old primary may fail one request.
                Err(e) if e.is_connection() => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await;
    assert_eq!(advisory_locks(&standby).await, 1);
    within(guard.release()).await.unwrap();
    // And a new handle (a restarted process) too.
    let locks = within(dblock::Locks::connect(&rw)).await.unwrap();
    let guard = within(locks.lock("failover:job")).await.unwrap();
    assert_eq!(advisory_locks(&standby).await, 1);
    within(guard.release()).await.unwrap();
}
