//! `dblock run` and `dblock migrate` through a real PgBouncer: a deadline that counts
//! the pooler's queue, and eight migrate processes at once on a fresh database.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock_testkit::pgbouncer::{Options, PgBouncer, PoolMode};
use dblock_testkit::{PgSchema, admin_connect, pg_url, with_params};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// Bounds every await of these tests.
async fn bounded<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("did not finish within {secs} s"))
}

/// With PgBouncer's only server connection taken, `dblock run --wait 1s` waits in
/// PgBouncer's queue, where the server's lock_timeout does not run: it exits 75 after
/// about a second, without running the command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_wait_counts_the_time_queued_in_the_pooler() {
    let s = PgSchema::new("pgb_cli_wait").await;
    let b = PgBouncer::with(Options::new(PoolMode::Transaction, 1).search_path(&s.name));
    let url = with_params(&b.test_url(), &[("application_name", &s.app)]);
    // The only server connection, held in a transaction for 8 s.
    let holder = admin_connect(&url).await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(8)).await;
        let _ = holder.batch_execute("ROLLBACK").await;
    });
    let state = tempfile::tempdir().unwrap();
    let marker = state.path().join("ran");
    let t0 = Instant::now();
    let out = bounded(
        20,
        dblock_testkit::dblock_command(DBLOCK, state.path())
            .args(["run", "--db", &url, "--wait", "1s", "free-name", "--"])
            .args(["touch", marker.to_str().unwrap()])
            .output(),
    )
    .await
    .unwrap();
    let took = t0.elapsed();
    eprintln!("dblock run --wait 1s with the pool saturated exited after {took:?}");
    assert_eq!(dblock_testkit::exit_code(&out), 75, "{out:?}");
    assert!(!marker.exists(), "the command must not run");
    assert!(took < Duration::from_secs(5), "exited after {took:?}");
    release.abort();
}

/// A database of the test's own (migrations take the database-wide migration key).
struct TempDb {
    name: String,
}

impl TempDb {
    async fn new(tag: &str) -> TempDb {
        let name = format!("dblock_{tag}_{}", std::process::id());
        let admin = admin_connect(&pg_url()).await;
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await
            .unwrap();
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        TempDb { name }
    }

    async fn admin(&self) -> tokio_postgres::Client {
        let base: tokio_postgres::Config = pg_url().parse().unwrap();
        let host = match base.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".into(),
        };
        let port = base.get_ports().first().copied().unwrap_or(5432);
        let user = base.get_user().unwrap_or("postgres");
        admin_connect(&format!("postgres://{user}@{host}:{port}/{}", self.name)).await
    }

    async fn drop_now(self) {
        let admin = admin_connect(&pg_url()).await;
        let _ = admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await;
    }
}

/// Eight `dblock migrate` at once on a fresh database through PgBouncer: through a
/// transaction pooler each is refused, saying why, and nothing is applied; through a
/// session pooler (declared) every migration — the one outside a transaction too — is
/// applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_migrate_processes_through_pgbouncer() {
    let files: Vec<(String, String)> = vec![
        (
            "0001_log.sql".into(),
            "CREATE TABLE migration_log (file text NOT NULL);\n\
             INSERT INTO migration_log VALUES ('0001');\n"
                .into(),
        ),
        (
            "0002_items.sql".into(),
            "CREATE TABLE items (id bigint PRIMARY KEY, v text);\n\
             INSERT INTO migration_log VALUES ('0002');\n"
                .into(),
        ),
        (
            "0003_index.sql".into(),
            "-- dblock:no-transaction\nCREATE INDEX CONCURRENTLY items_v ON items (v);\n\
             INSERT INTO migration_log VALUES ('0003');\n"
                .into(),
        ),
    ];
    let dir = dblock_testkit::migrations::MigrationDir::new(&files);
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let db = TempDb::new(&format!("pgb_mig_{mode:?}").to_lowercase()).await;
        let b = PgBouncer::start(mode, 2);
        let mut url = b.url(&db.name);
        if mode == PoolMode::Session {
            url.push_str("?pooler=session");
        }
        let state = tempfile::tempdir().unwrap();
        let mut children = Vec::new();
        for _ in 0..8 {
            children.push(
                dblock_testkit::dblock_command(DBLOCK, state.path())
                    .args(["migrate", "--db", &url, dir.path().to_str().unwrap()])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
            );
        }
        let mut outs = Vec::new();
        for c in children {
            outs.push(bounded(120, c.wait_with_output()).await.unwrap());
        }
        let admin = db.admin().await;
        let logged: Vec<String> = match admin
            .query("SELECT file FROM migration_log ORDER BY file", &[])
            .await
        {
            Ok(rows) => rows.iter().map(|r| r.get(0)).collect(),
            Err(_) => Vec::new(),
        };
        match mode {
            PoolMode::Transaction | PoolMode::Statement => {
                for out in &outs {
                    assert_eq!(dblock_testkit::exit_code(out), 64, "{out:?}");
                    let line = dblock_testkit::one_line_error(out);
                    assert!(line.contains("pooler"), "{line}");
                }
                assert!(logged.is_empty(), "nothing applied: {logged:?}");
            }
            PoolMode::Session => {
                for out in &outs {
                    assert_eq!(dblock_testkit::exit_code(out), 0, "{out:?}");
                }
                assert_eq!(logged, ["0001", "0002", "0003"], "each exactly once");
            }
        }
        drop(admin);
        drop(b);
        db.drop_now().await;
    }
}
