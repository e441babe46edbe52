//! Losing a lock on PostgreSQL — a restarted server, a silent backend (noticed by `lost()`,
//! and a `release()` that returns within the bound), a session-scoped lease, a lease behind a
//! network that falls silent, a guard that outlives its runtime. (Fencing, leases and elections on every backend: every_backend_fencing.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::{Error, Locks, LossReason, Scope};
use dblock_testkit::cluster::TempCluster;
use dblock_testkit::testdb::within;
use dblock_testkit::{PgSchema, signal};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// A restarted server ends every lock; every holder is told; tokens keep rising.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_tells_every_holder_and_tokens_keep_rising() {
    let cluster = TempCluster::start(&[]);
    let locks = Locks::connect(&cluster.url()).await.unwrap();
    let a = locks.request("a").fenced().lock().await.unwrap();
    let b = locks
        .request("b")
        .scope(Scope::Session)
        .fenced()
        .lock()
        .await
        .unwrap();
    let c = locks.request("c").lock().await.unwrap();
    let (ta, tb) = (a.fencing_token().unwrap(), b.fencing_token().unwrap());
    let lost = [a.lost(), b.lost(), c.lost()];
    cluster.restart();
    for (i, l) in lost.into_iter().enumerate() {
        let r = tokio::time::timeout(Duration::from_secs(10), l).await;
        assert!(
            matches!(r, Ok(LossReason::ConnectionClosed { .. })),
            "holder {i}: {r:?}"
        );
    }
    assert!(!a.is_held() && !b.is_held() && !c.is_held());
    assert!(matches!(c.release().await, Err(Error::LockLost { .. })));
    drop((a, b));
    // The same handle goes on, on new connections; and so does a new client.
    let a2 = locks.request("a").fenced().lock().await.unwrap();
    assert!(a2.fencing_token().unwrap() > ta);
    drop(a2);
    let fresh = Locks::connect(&cluster.url()).await.unwrap();
    let b2 = fresh.request("b").fenced().lock().await.unwrap();
    assert!(b2.fencing_token().unwrap() > tb);
}

/// A server that stops answering (its backend stopped) is noticed by the active check,
/// without any traffic of the holder's own, within check_interval + check_timeout (not at
/// the first tick after the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_loss_is_detected_within_interval_plus_timeout() {
    let s = PgSchema::new("silent_bound").await;
    // With these, checking only on ticks declared the loss after 2.95 s: over the bound.
    let (interval, timeout) = (Duration::from_millis(1000), Duration::from_millis(1500));
    let locks = Locks::builder()
        .url(&s.url)
        .check_interval(interval)
        .check_timeout(timeout)
        .build()
        .await
        .unwrap();
    let g = locks.lock("v").await.unwrap();
    let pid = s.advisory(g.key()).await[0].0;
    // Just after a check has completed: the worst case.
    tokio::time::sleep(interval + Duration::from_millis(50)).await;
    signal(pid, "-STOP");
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(5), g.lost()).await;
    let took = t.elapsed();
    signal(pid, "-CONT");
    assert!(matches!(r, Ok(LossReason::Unresponsive { .. })), "{r:?}");
    assert!(!g.is_held());
    eprintln!(
        "declared lost after {took:?} (bound {:?})",
        interval + timeout
    );
    // The bound, with a margin for a loaded machine's scheduling.
    assert!(
        took < interval + timeout + Duration::from_millis(250),
        "{took:?}"
    );
}

/// A lease frees the lock of a holder that falls silent (here: a paused process),
/// enforced by the server; a live holder keeps it however long it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_frees_a_paused_holders_lock() {
    let s = PgSchema::new("lease").await;
    let other = s.locks().await;
    // The transaction scope (the default): every_backend_fencing.rs.
    for scope in ["session"] {
        let mut args = vec![
            "hold",
            s.url.as_str(),
            "l",
            "--lease-ms",
            "600",
            "--check-ms",
            "100",
        ];
        if scope == "session" {
            args.push("--session");
        }
        let mut holder = Command::new(WORKER)
            .args(&args)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
        let held = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .unwrap()
            .unwrap();
        assert!(held.unwrap().starts_with("held"));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            other.try_lock("l").await.unwrap().is_none(),
            "{scope}: a live holder keeps its lease"
        );
        let pid = holder.id().unwrap();
        signal(pid, "-STOP");
        let paused = Instant::now();
        let g = other
            .try_lock_for("l", Duration::from_secs(10))
            .await
            .unwrap();
        let took = paused.elapsed();
        signal(pid, "-CONT");
        eprintln!("{scope}: a paused holder's lock freed after {took:?} (lease 600ms)");
        assert!(g.is_some(), "{scope}: freed within the lease");
        assert!(
            took >= Duration::from_millis(450) && took < Duration::from_secs(3),
            "{scope}: {took:?}"
        );
        drop(g);
        let _ = holder.start_kill();
        let _ = holder.wait().await;
    }
}

/// release() on a server that stops answering returns within check_timeout, reporting
/// the loss, instead of waiting for TCP to give up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_on_a_silent_server_is_bounded() {
    let s = PgSchema::new("silent_release").await;
    let locks = Locks::builder()
        .url(&s.url)
        .check_interval(Duration::from_millis(100))
        .check_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let g = locks.lock("w").await.unwrap();
    let pid = s.advisory(g.key()).await[0].0;
    signal(pid, "-STOP");
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(4), g.release()).await;
    signal(pid, "-CONT");
    let r = r.expect("release returned");
    assert!(
        matches!(
            r,
            Err(Error::LockLost {
                reason: LossReason::Unresponsive { .. }
            })
        ),
        "{r:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

/// A guard whose connection's runtime has shut down reports the lock lost:
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

/// [`dblock_testkit::silent_holder_race`] on schema `s`; `terminate`: free the lock on the
/// server at once (the holder's backend terminated) instead of waiting for the lease.
async fn silent_holder_race(
    s: &PgSchema,
    holder: &Locks,
    guard: dblock::LockGuard,
    proxy: &dblock_testkit::SilentProxy,
    name: &str,
    terminate: bool,
) -> (Duration, Duration) {
    let key = holder.key(name).unwrap();
    let other = Locks::connect(&s.url).await.unwrap();
    let free_now = async {
        if terminate {
            assert_eq!(s.terminate_holders(key).await, 1);
        }
    };
    dblock_testkit::silent_holder_race(guard, proxy, &other, name, free_now).await
}

/// With a lease, a holder cut off by a silent network learns that it lost the
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
            Err(Error::InvalidRequest { reason }) => assert!(reason.contains("lease"), "{reason}"),
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
