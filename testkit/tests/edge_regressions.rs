//! Regressions for the defects of issue 9 ("correctness at the edges"): each test failed
//! on the code before its fix. Real PostgreSQL (DATABASE_URL), real connections; every
//! await bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Error, Locks, Scope};
use dblock_testkit::{PgDatabase, PgSchema, pg_url, with_params};
use tokio::time::timeout;

/// Bounds an await: a bug fails the test instead of hanging it.
async fn within<F: std::future::Future>(secs: u64, what: &str, f: F) -> F::Output {
    match timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: still waiting after {secs} s"),
    }
}

/// Item 1: one namespace used through handles whose schemas differ keeps one counter
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

/// Item 2: creating the fencing table waits for the database-wide migration lock; a
/// fenced try_lock must not wait for it past its own deadline (here: none at all).
#[tokio::test]
async fn a_fenced_try_lock_gives_up_at_its_deadline_behind_a_running_migration() {
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
    let started = std::time::Instant::now();
    let r = within(
        10,
        "a fenced try_lock behind a running migration",
        locks.request("job").fenced().try_lock(),
    )
    .await;
    assert!(
        matches!(r, Err(Error::Timeout { .. })),
        "a fenced try_lock that cannot create the fencing table says so: {r:?}"
    );
    // A deadline of its own is honoured too: it waits about that long, not forever.
    let r = within(
        10,
        "a fenced try_lock_for behind a running migration",
        locks
            .request("job")
            .fenced()
            .try_lock_for(Duration::from_millis(500)),
    )
    .await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(started.elapsed() >= Duration::from_millis(500));
    // Control: once the migration ends, the same request succeeds.
    migrator
        .batch_execute(&format!(
            "SELECT pg_advisory_unlock({})",
            dblock::migrate::MIGRATION_LOCK_KEY
        ))
        .await
        .unwrap();
    let g = within(
        10,
        "fenced try_lock",
        locks.request("job").fenced().try_lock(),
    )
    .await
    .unwrap()
    .expect("free");
    // The first grant of the name on this timeline (a token is timeline × 2⁴⁰ + n).
    assert_eq!(g.fencing_token().map(|t| t % (1 << 40)), Some(1));
}

/// Item 7: a deadline or lease longer than the server's largest timeout (2³¹ − 1 ms,
/// about 24.8 days) works; before, the server refused the setting.
#[tokio::test]
async fn waits_and_leases_beyond_the_servers_timeout_limit_work() {
    let s = PgSchema::new("long_waits").await;
    let locks = within(10, "connect", Locks::connect(&s.url)).await.unwrap();
    let long = Duration::from_secs(597 * 3600);
    for scope in [Scope::Transaction, Scope::Session] {
        let g = within(
            10,
            "try_lock_for 597h",
            locks.request("free").scope(scope).try_lock_for(long),
        )
        .await
        .unwrap_or_else(|e| panic!("{scope:?}: {e}"));
        assert!(g.is_some(), "{scope:?}: a free lock is granted");
        drop(g);
        let g = within(
            10,
            "lease 597h",
            locks.request("free").scope(scope).lease(long).lock(),
        )
        .await
        .unwrap_or_else(|e| panic!("{scope:?}: {e}"));
        drop(g);
        let g = within(
            10,
            "fenced try_lock_for 597h",
            locks
                .request("fenced")
                .scope(scope)
                .fenced()
                .try_lock_for(long),
        )
        .await
        .unwrap_or_else(|e| panic!("{scope:?}: {e}"));
        assert!(g.is_some());
    }
    // A long wait that must actually wait is granted when the holder lets go.
    let other = within(10, "connect", Locks::connect(&s.url)).await.unwrap();
    let held = within(10, "lock", other.lock("busy")).await.unwrap();
    let key = locks.key("busy").unwrap();
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move { locks.try_lock_for("busy", long).await }
    });
    assert!(
        s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
            .await,
        "the waiter queues on the server"
    );
    drop(held);
    let got = within(10, "the long waiter", waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(got.is_some());
}

/// Item 8: a guard whose connection's runtime has shut down reports the lock lost:
/// `is_held()` false, `lost()` resolves, `check()` says LockLost.
#[test]
fn a_guard_outliving_its_runtime_reports_the_lock_lost() {
    let main = tokio::runtime::Runtime::new().unwrap();
    let s = main.block_on(PgSchema::new("rt_gone"));
    for sqlx in [false, true] {
        let name = format!("held-{sqlx}");
        let first = tokio::runtime::Runtime::new().unwrap();
        let mut guard = first.block_on(async {
            let locks = if sqlx {
                let pool = sqlx::PgPool::connect(&s.url).await.unwrap();
                Locks::builder()
                    .sqlx_pool(pool)
                    .namespace(&s.name)
                    .build()
                    .await
                    .unwrap()
            } else {
                Locks::connect(&s.url).await.unwrap()
            };
            within(10, "lock", locks.lock(&name)).await.unwrap()
        });
        assert!(guard.is_held());
        drop(first);
        main.block_on(async {
            // The session went with the runtime: another handle is granted the name.
            let other = Locks::connect(&s.url).await.unwrap();
            let g = within(
                20,
                "the name, once the first runtime is gone",
                other.try_lock_for(&name, Duration::from_secs(15)),
            )
            .await
            .unwrap();
            assert!(g.is_some(), "sqlx={sqlx}: the server freed the lock");
            assert!(
                !guard.is_held(),
                "sqlx={sqlx}: the old guard must not say it holds a lock another has"
            );
            let reason = within(5, "lost()", guard.lost()).await;
            eprintln!("sqlx={sqlx}: lost: {reason}");
            let r = within(5, "check()", guard.check()).await;
            assert!(matches!(r, Err(Error::LockLost { .. })), "{r:?}");
            drop(g);
        });
        drop(guard);
    }
}

/// Item 6: cancelling `check` leaves the lock held, on every kind of connection alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_check_keeps_the_lock() {
    let s = PgSchema::new("check_cancel").await;
    let pool = sqlx::PgPool::connect(&s.url).await.unwrap();
    let handles = [
        ("pinned", Locks::connect(&s.url).await.unwrap()),
        (
            "sqlx",
            Locks::builder()
                .sqlx_pool(pool)
                .namespace(&s.name)
                .build()
                .await
                .unwrap(),
        ),
        (
            "multiplexed",
            Locks::builder()
                .url(&s.url)
                .scope(Scope::Session)
                .multiplex(2)
                .build()
                .await
                .unwrap(),
        ),
    ];
    let other = Locks::connect(&s.url).await.unwrap();
    for (kind, locks) in &handles {
        let name = format!("checked-{kind}");
        let mut g = within(10, "lock", locks.lock(&name)).await.unwrap();
        let mut cut_off = 0;
        for round in 0..5 {
            // Polled once (the check is sent), then dropped before its reply.
            let mut check = Box::pin(g.check());
            match futures_poll_once(check.as_mut()).await {
                None => cut_off += 1,
                // Answered within the one poll (a fast server, another worker thread
                // driving the connection): not a cancellation, but it must be an answer.
                Some(r) => r.unwrap_or_else(|e| panic!("{kind}, round {round}: {e}")),
            }
            drop(check);
            assert!(
                g.is_held(),
                "{kind}, round {round}: still held after a cancelled check"
            );
            within(10, "check", g.check())
                .await
                .unwrap_or_else(|e| panic!("{kind}, round {round}: {e}"));
            let r = within(10, "try_lock elsewhere", other.try_lock(&name))
                .await
                .unwrap();
            assert!(r.is_none(), "{kind}, round {round}: nobody else gets it");
        }
        assert!(cut_off > 0, "{kind}: no check was cut off mid-way");
        within(10, "release", g.release())
            .await
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
}

/// Polls `f` once: `Some(output)` if it finished at once.
async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// Item 10: the default namespace does not depend on search_path or on which schemas
/// exist: two processes of one database that name no namespace exclude each other.
#[tokio::test]
async fn handles_with_different_search_paths_key_a_name_alike() {
    let a = PgSchema::new("sp_a").await;
    let b = PgSchema::new("sp_b").await;
    // Plain URLs: no dblock.namespace, only search_path differs (and with "$user", as
    // by default, whether a schema named after the role exists).
    let url_a = with_params(
        &pg_url(),
        &[("options", &format!("-c search_path={}", a.name))],
    );
    let url_b = with_params(
        &pg_url(),
        &[("options", &format!("-c search_path=\"$user\",{}", b.name))],
    );
    let la = within(10, "connect", Locks::connect(&url_a)).await.unwrap();
    let lb = within(10, "connect", Locks::connect(&url_b)).await.unwrap();
    assert_eq!(la.namespace(), dblock::DEFAULT_NAMESPACE);
    assert_eq!(la.namespace(), lb.namespace());
    // A name of this test's own in the shared default namespace.
    let name = format!("{}-deploy", a.name);
    let g = within(10, "lock", la.lock(&name)).await.unwrap();
    let r = within(10, "try_lock", lb.try_lock(&name)).await.unwrap();
    assert!(r.is_none(), "both handles mean the same lock");
    drop(g);
    let r = within(
        10,
        "try_lock",
        lb.try_lock_for(&name, Duration::from_secs(5)),
    )
    .await
    .unwrap();
    assert!(r.is_some(), "control: free once released");

    // The setting dblock.namespace names it explicitly, from the URL (or database/role).
    let set = within(10, "connect", Locks::connect(&a.url)).await.unwrap();
    assert_eq!(set.namespace(), a.name);
    let url_ns = with_params(&pg_url(), &[("options", "-c dblock.namespace=billing")]);
    let billing = within(10, "connect", Locks::connect(&url_ns))
        .await
        .unwrap();
    assert_eq!(billing.namespace(), "billing");
    // The builder's namespace wins over the setting.
    let built = Locks::builder()
        .url(&url_ns)
        .namespace("other")
        .build()
        .await
        .unwrap();
    assert_eq!(built.namespace(), "other");
}

/// Behind a proxy that falls silent, when does the holder learn of the loss, and when
/// is another handle granted the lock? Returns (learned, granted), measured from the
/// moment of silence. `free` frees the lock on the server (None: the lease does).
async fn silent_holder_race(
    s: &PgSchema,
    holder: &Locks,
    guard: dblock::LockGuard,
    proxy: &dblock_testkit::SilentProxy,
    name: &str,
    terminate: bool,
) -> (Duration, Duration) {
    let lost = guard.lost();
    let lost = tokio::spawn(async move {
        lost.await;
        tokio::time::Instant::now()
    });
    let key = holder.key(name).unwrap();
    let silent_at = tokio::time::Instant::now();
    proxy.silence();
    if terminate {
        assert_eq!(s.terminate_holders(key).await, 1);
    }
    let other = Locks::connect(&s.url).await.unwrap();
    let g = within(60, "the lock, for another handle", other.lock(name))
        .await
        .unwrap();
    let granted = tokio::time::Instant::now() - silent_at;
    let learned = within(60, "the silent holder's lost()", lost)
        .await
        .unwrap()
        - silent_at;
    drop(g);
    drop(guard);
    (learned, granted)
}

/// Item 5: with a lease, a holder cut off by a silent network learns that it lost the
/// lock before the server can grant it to another. A lease too short for that (2 s
/// with the default checks, as in the report) is refused; an accepted one is proved
/// behind a proxy that stops forwarding without closing. The control shows the
/// detector catching a holder that believes it holds a lock another has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_holder_learns_of_the_loss_before_anyone_else_is_granted_the_lock() {
    let s = PgSchema::new("silent_lease").await;
    let target = dblock_testkit::tcp_host_port(&s.url);
    for scope in [Scope::Transaction, Scope::Session] {
        // The report's configuration: lease(2s), checks every 1 s, 5 s to answer.
        let proxy = dblock_testkit::SilentProxy::start(target.clone()).await;
        let via = dblock_testkit::with_host_port(&s.url, "127.0.0.1", proxy.port);
        let holder = within(10, "connect", Locks::connect(&via)).await.unwrap();
        let name = format!("report-{scope:?}");
        let r = within(
            10,
            "lease 2s",
            holder
                .request(&name)
                .scope(scope)
                .lease(Duration::from_secs(2))
                .lock(),
        )
        .await;
        match r {
            Err(Error::Unsupported(why)) => assert!(why.contains("lease"), "{why}"),
            Ok(g) => {
                let (learned, granted) =
                    silent_holder_race(&s, &holder, g, &proxy, &name, false).await;
                panic!(
                    "{scope:?}: lease(2s) with the default checks was accepted: the holder \
                     learned of the loss {learned:?} after the silence, another was granted \
                     the lock after {granted:?}"
                );
            }
            Err(e) => panic!("{scope:?}: {e}"),
        }

        // An accepted configuration: checks every 200 ms, 1 s to answer, lease 2 s.
        let holder = within(
            10,
            "connect",
            Locks::builder()
                .url(&via)
                .check_interval(Duration::from_millis(200))
                .check_timeout(Duration::from_secs(1))
                .build(),
        )
        .await
        .unwrap();
        let g = within(
            10,
            "lease 2s",
            holder
                .request(&name)
                .scope(scope)
                .lease(Duration::from_secs(2))
                .lock(),
        )
        .await
        .unwrap();
        let (learned, granted) = silent_holder_race(&s, &holder, g, &proxy, &name, false).await;
        eprintln!("{scope:?}: learned {learned:?}, granted {granted:?}");
        assert!(
            learned < granted,
            "{scope:?}: the holder learned of the loss after {learned:?}, another was \
             granted the lock after {granted:?}"
        );
        drop(proxy);
    }

    // Control: the same detector, with the lock freed on the server at once (the
    // holder's backend terminated) while the holder is cut off, sees the holder learn
    // late — the race the lease bound prevents.
    let proxy = dblock_testkit::SilentProxy::start(target.clone()).await;
    let via = dblock_testkit::with_host_port(&s.url, "127.0.0.1", proxy.port);
    let holder = within(
        10,
        "connect",
        Locks::builder()
            .url(&via)
            .check_interval(Duration::from_millis(200))
            .check_timeout(Duration::from_secs(1))
            .build(),
    )
    .await
    .unwrap();
    let g = within(10, "lock", holder.lock("control")).await.unwrap();
    let (learned, granted) = silent_holder_race(&s, &holder, g, &proxy, "control", true).await;
    eprintln!("control: learned {learned:?}, granted {granted:?}");
    assert!(
        learned > granted,
        "control: the detector must see a holder that learns late ({learned:?} vs {granted:?})"
    );
}

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// Waits (bounded) until `n` sessions wait for advisory key `key` in database `db`.
async fn until_waiting(admin: &tokio_postgres::Client, key: dblock::Key, n: usize) {
    let (classid, objid) = key.pg_locks_ids();
    let waiting = || async {
        let rows = admin
            .query(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND classid = $1::int8::oid AND objid = $2::int8::oid AND objsubid = 1",
                &[&(classid as i64), &(objid as i64)],
            )
            .await
            .unwrap();
        rows.len() == n
    };
    let mut waiting = waiting;
    assert!(
        dblock_testkit::eventually(20, &mut waiting).await,
        "{n} waiters queued on the server"
    );
}

/// Item 9: a process holds `startup` and migrates with CREATE INDEX CONCURRENTLY while
/// four other processes wait for `startup`. The waiters must not hold the index build
/// up for good (they used to: each blocked inside pg_advisory_xact_lock holds a snapshot
/// the build waits for, while they wait for the lock its process holds). Control: the
/// same with four plain `SELECT pg_advisory_lock` waiters deadlocks until cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cic_migration_under_a_lock_that_others_wait_for_finishes() {
    let db = PgDatabase::new("cic").await;
    let admin = db.admin().await;
    admin
        .batch_execute(
            "CREATE TABLE notes (id int, x int); \
             INSERT INTO notes SELECT g, g FROM generate_series(1, 1000) g",
        )
        .await
        .unwrap();
    let locks = within(10, "connect", Locks::connect(&db.url))
        .await
        .unwrap();
    let key = locks.key("startup").unwrap();

    // Control: plain waiters (no dblock) deadlock the index build, until it is cut off.
    let startup = within(10, "startup", locks.lock("startup")).await.unwrap();
    let mut plain = Vec::new();
    for _ in 0..4 {
        let c = dblock_testkit::admin_connect(&db.url).await;
        let wait = tokio::spawn(async move {
            let r = c
                .batch_execute(&format!("SELECT pg_advisory_lock({})", key.as_i64()))
                .await;
            drop(c);
            r
        });
        plain.push(wait);
    }
    until_waiting(&admin, key, 4).await;
    let builder = dblock_testkit::admin_connect(&db.url).await;
    builder
        .batch_execute("SET statement_timeout = '6s'")
        .await
        .unwrap();
    let r = within(
        30,
        "the control's index build",
        builder.batch_execute("CREATE INDEX CONCURRENTLY notes_ctrl ON notes (x)"),
    )
    .await;
    let code = r.as_ref().err().and_then(|e| e.code()).cloned();
    assert_eq!(
        code,
        Some(tokio_postgres::error::SqlState::QUERY_CANCELED),
        "control: with plain waiters the build waits for them until cut off: {r:?}"
    );
    drop(startup);
    for w in plain {
        within(10, "a plain waiter", w).await.unwrap().unwrap();
    }
    admin
        .batch_execute("DROP INDEX IF EXISTS notes_ctrl")
        .await
        .unwrap();

    // The scenario: dblock's waiters, in processes of their own.
    let startup = within(10, "startup", locks.lock("startup")).await.unwrap();
    let mut waiters = Vec::new();
    for _ in 0..4 {
        let child = tokio::process::Command::new(WORKER)
            .args(["wait", &db.url, "startup"])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        waiters.push(child);
    }
    until_waiting(&admin, key, 4).await;
    let dir = dblock_testkit::migrations::MigrationDir::new(&[(
        "0001_index_x.sql",
        "-- dblock:no-transaction\nCREATE INDEX CONCURRENTLY notes_x ON notes (x);\n",
    )]);
    let set = dir.set();
    let started = std::time::Instant::now();
    let report = match timeout(Duration::from_secs(30), set.run(&locks)).await {
        Ok(r) => r.unwrap(),
        Err(_) => panic!(
            "the CIC migration is still waiting after 30 s for the snapshots of the \
             processes waiting for the lock its own process holds"
        ),
    };
    eprintln!(
        "CIC migration under a held lock with 4 waiting processes: {:?}",
        started.elapsed()
    );
    assert_eq!(report.applied.len(), 1);
    drop(startup);
    for w in waiters {
        let out = within(20, "a waiting process", w.wait_with_output())
            .await
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "acquired");
    }
}
