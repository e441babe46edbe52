//! Fencing tokens on PostgreSQL's own terms: one counter per (namespace, name) whatever
//! schema a handle uses, the fencing table created under the migration lock within a
//! request's deadline, and a fenced request that fails leaving no lock behind. (Fencing
//! on every backend: `every_backend_fencing.rs`; across a failover: `failover.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Error, Locks};
use dblock_testkit::testdb::within;
use dblock_testkit::{PgDatabase, PgSchema, eventually};

async fn side_conn(url: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    c
}

/// A fenced transaction-scoped request that fails after its bridging session lock was
/// granted (here: its deadline passes while it waits for a previous holder's fenced
/// write to commit) must not leave that session lock on a pooled connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fenced_request_leaves_no_lock_behind() {
    let s = PgSchema::new("fenced_leak").await;
    let locks = s.locks().await;
    let key = locks.key("x").unwrap();
    locks
        .request("x")
        .fenced()
        .lock()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    for attempt in ["deadline", "try"] {
        // A previous holder's fenced write, not yet committed: FOR SHARE on the row.
        let side = side_conn(&s.url).await;
        side.batch_execute(&format!(
            "BEGIN; SELECT token FROM \"{}\".dblock_fencing WHERE key = {} FOR SHARE",
            dblock::fencing::PG_SCHEMA,
            key.as_i64()
        ))
        .await
        .unwrap();
        let r = match attempt {
            "deadline" => {
                locks
                    .request("x")
                    .fenced()
                    .try_lock_for(Duration::from_millis(300))
                    .await
            }
            _ => locks.request("x").fenced().try_lock().await,
        };
        assert!(
            matches!(r, Ok(None)),
            "{attempt}: not obtained while the row is held: {r:?}"
        );
        side.batch_execute("COMMIT").await.unwrap();
        let clean = eventually(5, &mut || async { s.advisory(key).await.is_empty() }).await;
        assert!(
            clean,
            "{attempt}: lock left behind: {:?}",
            s.advisory(key).await
        );
        let other = s.locks().await;
        assert!(other.try_lock("x").await.unwrap().is_some(), "{attempt}");
    }
}

/// One namespace used through handles whose schemas differ keeps one counter
/// per name: a later grant's token is greater, and the earlier holder's fence is stale.
#[tokio::test]
async fn one_namespace_used_from_two_schemas_has_one_token_counter() {
    let a = PgSchema::new("fence_a").await;
    let b = PgSchema::new("fence_b").await;
    // One namespace, set on both handles; each handle's schema in use is its own.
    let ns = format!("{}_shared", a.name);
    let la = Locks::builder().url(&a.url).namespace(&ns).build();
    let lb = Locks::builder().url(&b.url).namespace(&ns).build();
    let la = within(10, "connect a", la).await.unwrap();
    let lb = within(10, "connect b", lb).await.unwrap();

    let ga = within(10, "fenced lock a", la.request("ledger").fenced().lock())
        .await
        .unwrap();
    let fence_a = ga.fence().unwrap().clone();
    drop(ga);
    let gb = within(10, "fenced lock b", lb.request("ledger").fenced().lock())
        .await
        .unwrap();
    let fence_b = gb.fence().unwrap().clone();
    assert!(
        fence_b.token() > fence_a.token(),
        "tokens must rise per (namespace, name) whatever the schema: {} then {}",
        fence_a.token(),
        fence_b.token()
    );

    // The stale holder's check fails, wherever its connection's search_path points.
    let pool = sqlx::PgPool::connect(&a.url).await.unwrap();
    let mut tx = within(10, "begin", pool.begin()).await.unwrap();
    let r = within(10, "check stale", fence_a.check_postgres(&mut tx)).await;
    assert!(
        matches!(r, Err(Error::StaleToken { .. })),
        "a's token {} after b's grant {}: {r:?}",
        fence_a.token(),
        fence_b.token()
    );
    drop(tx);
    let mut tx = within(10, "begin", pool.begin()).await.unwrap();
    within(10, "check fresh", fence_b.check_postgres(&mut tx))
        .await
        .unwrap();
    drop(tx);
    drop(gb);
    pool.close().await;
}

/// dblock creates its fencing table under a set-up lock of its own, not the migration
/// lock, so a fenced try_lock on a fresh database is granted at once behind a running
/// migration instead of failing (or waiting for it) — issue 22's first-contact failure.
#[tokio::test]
async fn a_fenced_try_lock_is_granted_behind_a_running_migration() {
    let db = PgDatabase::new("fence_migr").await;
    // A "migration" holds the migration lock, in this database only.
    let migrator = db.admin().await;
    migrator
        .batch_execute(&format!(
            "SELECT pg_advisory_lock({})",
            dblock::migrate::MIGRATION_LOCK_KEY
        ))
        .await
        .unwrap();
    let locks = within(10, "connect", Locks::connect(&db.url))
        .await
        .unwrap();
    let g = within(
        10,
        "a fenced try_lock behind a running migration",
        locks.request("job").fenced().try_lock(),
    )
    .await
    .unwrap()
    .expect("free");
    // The first grant of the name on this timeline (a token is timeline × 2⁴⁰ + n).
    assert_eq!(g.fencing_token().map(|t| t % (1 << 40)), Some(1));
    drop(g);
    // A deadline of its own is met too, and the migration still holds its lock.
    let g = within(
        10,
        "a fenced try_lock_for behind a running migration",
        locks
            .request("job")
            .fenced()
            .try_lock_for(Duration::from_millis(500)),
    )
    .await
    .unwrap()
    .expect("free");
    assert_eq!(g.fencing_token().map(|t| t % (1 << 40)), Some(2));
    let held: Vec<tokio_postgres::Row> = migrator
        .query(
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(held.len(), 1, "the migration kept its lock throughout");
}

/// A writer paused between its fenced check and its commit holds the name's fencing row
/// (`FOR SHARE`), which the next fenced grant must wait for. With a lease the check
/// bounds the transaction's idle time by it, so the server ends the paused writer's
/// session: the next holder is granted within the lease (plus slack) and the paused
/// write never lands. The control, the same check without the bound, keeps the next
/// holder waiting past the lease (the race the CI run of stop 33 hit: a paused leader
/// never replaced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_paused_after_its_check_delays_the_next_grant_no_longer_than_its_lease() {
    use std::process::Stdio;
    use std::time::Instant;

    use dblock_testkit::appdb::AppDb;
    use dblock_testkit::signal;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    let lease = Duration::from_millis(1500);
    for bounded in [true, false] {
        let s = PgSchema::new("paused_check").await;
        let app = AppDb::connect(&s.url).await;
        app.setup().await;
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_dblock-worker"));
        cmd.args(["check-pause", &s.url, "res", &lease.as_millis().to_string()]);
        if !bounded {
            cmd.arg("--unbounded");
        }
        let mut writer = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(writer.stdout.take().unwrap()).lines();
        let checked = within(20, "checked", lines.next_line())
            .await
            .unwrap()
            .unwrap();
        let token: i64 = checked.strip_prefix("checked ").unwrap().parse().unwrap();
        let pid = writer.id().unwrap();
        signal(pid, "-STOP");
        let paused = Instant::now();
        let other = s.locks().await;
        let got = other
            .request("res")
            .fenced()
            .try_lock_for(lease + Duration::from_secs(3))
            .await
            .unwrap();
        let took = paused.elapsed();
        eprintln!("bounded={bounded}: next grant {got:?} after {took:?}");
        let next = got.as_ref().and_then(|g| g.fencing_token());
        drop(got);
        signal(pid, "-CONT");
        let mut stdin = writer.stdin.take().unwrap();
        stdin.write_all(b"go\n").await.unwrap();
        let verdict = within(20, "verdict", lines.next_line())
            .await
            .unwrap()
            .unwrap();
        let _ = writer.wait().await;
        if bounded {
            let next = next.expect("granted once the paused writer's session was ended");
            assert!(next > token, "{next} after {token}");
            assert!(
                verdict.starts_with("failed"),
                "the paused write must not land: {verdict}"
            );
            assert_eq!(app.value().await, "initial");
        } else {
            assert_eq!(
                next, None,
                "control: the unbounded check keeps the next grant waiting past the lease"
            );
            assert_eq!(verdict, "committed", "control");
        }
    }
}
