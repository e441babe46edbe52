//! dblock through a real PgBouncer (the Debian package), in transaction and in session
//! pooling mode, each with a small pool: exclusion across processes (with its no-lock
//! control), refusal of what cannot work, deadlines that count the pooler's queue,
//! PgBouncer's own errors in its words, migrations from eight processes at once, and a
//! lost lock noticed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::postgres::Pooler;
use dblock::{Error, Scope};
use dblock_testkit::pgbouncer::{Options, PgBouncer, PoolMode};
use dblock_testkit::{PgSchema, eventually, with_params};
use tokio::process::Command;

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// A handle through `url` in the test's namespace (named: a session pooler's DISCARD
/// ALL resets the `dblock.namespace` its connect_query set).
async fn connect(url: &str, s: &PgSchema) -> dblock::Locks {
    bounded(
        10,
        dblock::Locks::builder().url(url).namespace(&s.name).build(),
    )
    .await
    .unwrap()
}

/// Bounds every await of these tests.
async fn bounded<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("did not finish within {secs} s"))
}

/// A PgBouncer in front of the test's schema (PgBouncer 1.18 refuses the `options`
/// startup parameter, so the schema is every server connection's search_path), and the
/// URL through it.
fn bouncer(s: &PgSchema, mode: PoolMode, pool: u32) -> (PgBouncer, String) {
    let b = PgBouncer::with(Options::new(mode, pool).search_path(&s.name));
    let url = with_params(&b.test_url(), &[("application_name", &s.app)]);
    (b, url)
}

/// Runs `procs` worker processes doing `iterations` read–sleep–write increments of one
/// counter file each; returns (final counter, overlapping critical sections seen).
async fn counter_run(
    url: &str,
    namespace: &str,
    procs: usize,
    iterations: u32,
    locked: bool,
) -> (u64, u32) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("counter");
    std::fs::write(&file, "0\n").unwrap();
    let mut children = Vec::new();
    for _ in 0..procs {
        let mut cmd = Command::new(WORKER);
        cmd.args(["counter", url, "the-counter", file.to_str().unwrap()])
            .arg(iterations.to_string())
            .arg("1000")
            // A session pooler's DISCARD ALL resets the search_path its connect_query
            // set, so the schema in use (the default namespace) varies by server
            // connection: name it.
            .env("DBLOCK_TEST_NAMESPACE", namespace)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if !locked {
            cmd.arg("--no-lock");
        }
        children.push(cmd.spawn().unwrap());
    }
    let mut overlaps = 0;
    for c in children {
        let out = bounded(120, c.wait_with_output()).await.unwrap();
        assert!(out.status.success(), "worker failed: {out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        overlaps += text
            .trim()
            .strip_prefix("overlaps=")
            .unwrap()
            .parse::<u32>()
            .unwrap();
    }
    let n = std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (n, overlaps)
}

async fn eight_processes_exclude_each_other_through(mode: PoolMode) {
    let s = PgSchema::new("pgb_procs").await;
    let (_b, url) = bouncer(&s, mode, 2);
    let (n, overlaps) = counter_run(&url, &s.name, 8, 15, true).await;
    assert_eq!((n, overlaps), (120, 0), "with the lock: exact, no overlap");
    // The control: the same work without the lock loses updates, so the test can fail.
    let (n, overlaps) = counter_run(&url, &s.name, 8, 15, false).await;
    eprintln!("{mode:?} pooling without the lock: counter {n} of 120, {overlaps} overlaps");
    assert!(
        n < 120 && overlaps > 0,
        "the control must race: counter {n}, overlaps {overlaps}"
    );
    assert!(
        s.advisory_of_sessions().await.is_empty(),
        "no lock left behind on a server connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_never_overlap_through_pgbouncer_in_transaction_mode() {
    eight_processes_exclude_each_other_through(PoolMode::Transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_never_overlap_through_pgbouncer_in_session_mode() {
    eight_processes_exclude_each_other_through(PoolMode::Session).await;
}

/// What cannot work through a transaction pooler is refused before anything is taken,
/// with a typed error saying why; detected without being told, or declared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_locks_are_refused_through_a_transaction_pooler() {
    let s = PgSchema::new("pgb_refuse").await;
    let (_b, url) = bouncer(&s, PoolMode::Transaction, 2);
    let locks = connect(&url, &s).await;
    assert_eq!(locks.pooler(), Pooler::Transaction, "detected");
    let direct = bounded(10, s.locks()).await;
    assert_eq!(
        direct.pooler(),
        Pooler::None,
        "a direct connection is not a pooler"
    );

    let e = bounded(10, locks.request("s").scope(Scope::Session).lock())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BehindPooler { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("session-scoped") && text.contains("pooler=session"),
        "{text}"
    );
    assert!(s.advisory_of_sessions().await.is_empty());
    // The multiplexer takes session locks: refused the same way.
    let mux = bounded(
        10,
        dblock::Locks::builder()
            .url(&url)
            .scope(Scope::Session)
            .multiplex(2)
            .build(),
    )
    .await
    .unwrap();
    let e = bounded(10, mux.try_lock("m")).await.unwrap_err();
    assert!(matches!(e, Error::BehindPooler { .. }), "{e:?}");

    // Declared in the URL, with no detection needed.
    let declared = bounded(
        10,
        dblock::Locks::connect(&format!("{url}&pooler=transaction")),
    )
    .await
    .unwrap();
    assert_eq!(declared.pooler(), Pooler::Transaction);

    // Transaction-scoped locks (the default), fenced ones included, work: exclusion is
    // kept, and the guard's transaction pins one server connection.
    let g = bounded(10, locks.request("t").fenced().lock())
        .await
        .unwrap();
    let other = connect(&url, &s).await;
    assert!(bounded(10, other.try_lock("t")).await.unwrap().is_none());
    let held = s.advisory(locks.key("t").unwrap()).await;
    assert_eq!(held.len(), 1, "{held:?}");
    bounded(10, g.release()).await.unwrap();
    let g2 = bounded(10, other.request("t").fenced().try_lock())
        .await
        .unwrap();
    assert!(g2.is_some(), "free once released");
    drop(g2);
    // Leader election (fenced, leased, transaction-scoped) through the pooler.
    let election = dblock::leader::Election::new(&locks, "leader");
    let term = bounded(10, election.campaign()).await.unwrap();
    let rival = dblock::leader::Election::new(&other, "leader");
    assert!(
        tokio::time::timeout(Duration::from_millis(500), rival.campaign())
            .await
            .is_err(),
        "one leader at a time"
    );
    bounded(10, term.resign()).await.unwrap();
    let term2 = bounded(10, rival.campaign()).await.unwrap();
    assert!(term2.token() > 0);
    drop(term2);
    assert!(
        eventually(10, &mut || async {
            s.advisory_of_sessions().await.is_empty()
        })
        .await,
        "nothing left held"
    );
}

/// Told that the pooler pools sessions, session-scoped locks work through it and keep
/// exclusion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_locks_work_through_a_session_pooler_when_declared() {
    let s = PgSchema::new("pgb_sess").await;
    let (_b, url) = bouncer(&s, PoolMode::Session, 3);
    let url = format!("{url}&pooler=session");
    let a = connect(&url, &s).await;
    let b = connect(&url, &s).await;
    assert_eq!(a.pooler(), Pooler::Session);
    let g = bounded(10, a.request("s").scope(Scope::Session).lock())
        .await
        .unwrap();
    assert!(
        bounded(10, b.request("s").scope(Scope::Session).try_lock())
            .await
            .unwrap()
            .is_none()
    );
    bounded(10, g.release()).await.unwrap();
    let g = bounded(10, b.request("s").scope(Scope::Session).try_lock())
        .await
        .unwrap();
    assert!(g.is_some());
}

/// Told that the pooler pins a session lock's server connection (`pooler=pinning`),
/// session-scoped locks work through it: PgBouncer in session mode stands in for a
/// pinning pooler (RDS Proxy, pgdog, Multigres), since it keeps a client's server
/// connection for at least as long. The locks exclude across clients and processes, and
/// are freed when the guard drops and when the holding process dies. The control: the
/// same pooler undeclared is taken to pool transactions, and the same request is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_locks_work_through_a_pinning_pooler_when_declared() {
    let s = PgSchema::new("pgb_pin").await;
    let (_b, url) = bouncer(&s, PoolMode::Session, 3);

    // The control: not declared, detected as a transaction pooler, refused.
    let undeclared = connect(&url, &s).await;
    assert_eq!(undeclared.pooler(), Pooler::Transaction);
    let e = bounded(10, undeclared.request("s").scope(Scope::Session).lock())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BehindPooler { .. }), "{e:?}");
    assert!(
        e.to_string().contains("pooler=pinning"),
        "the fix names it: {e}"
    );
    drop(undeclared);

    let pinning = format!("{url}&pooler=pinning");
    let a = connect(&pinning, &s).await;
    let b = bounded(
        10,
        dblock::Locks::builder()
            .url(&url)
            .pooler(Pooler::Pinning)
            .namespace(&s.name)
            .build(),
    )
    .await
    .unwrap();
    assert_eq!((a.pooler(), b.pooler()), (Pooler::Pinning, Pooler::Pinning));
    macro_rules! session {
        ($l:expr) => {
            $l.request("s").scope(Scope::Session)
        };
    }
    let g = bounded(10, session!(a).lock()).await.unwrap();
    assert!(bounded(10, session!(b).try_lock()).await.unwrap().is_none());
    assert_eq!(s.advisory(a.key("s").unwrap()).await.len(), 1);
    drop(g);
    let g = bounded(10, session!(b).try_lock_for(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(g.is_some(), "freed when the guard dropped");
    assert!(bounded(10, session!(a).try_lock()).await.unwrap().is_none());
    drop(g);

    // Held by another process, which then dies.
    let mut holder = Command::new(WORKER)
        .args(["hold", &pinning, "s", "--session"])
        .env("DBLOCK_TEST_NAMESPACE", &s.name)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = tokio::io::BufReader::new(holder.stdout.take().unwrap());
    let mut line = String::new();
    bounded(
        20,
        tokio::io::AsyncBufReadExt::read_line(&mut out, &mut line),
    )
    .await
    .unwrap();
    assert!(line.starts_with("held"), "{line:?}");
    assert!(
        bounded(10, session!(a).try_lock_for(Duration::from_millis(300)))
            .await
            .unwrap()
            .is_none(),
        "the other process holds it"
    );
    holder.start_kill().unwrap();
    bounded(10, holder.wait()).await.unwrap();
    let g = bounded(10, session!(a).try_lock_for(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(g.is_some(), "freed when its holder died");

    // Nothing but the session lock is kept: migrations stay refused.
    let set =
        dblock::migrate::Migrations::from_sources([("1_t.sql", "CREATE TABLE t (x int)")]).unwrap();
    let e = bounded(10, set.run(&a)).await.unwrap_err();
    assert!(matches!(e, Error::BehindPooler { .. }), "{e:?}");
}

/// A holder occupying the pooler's only server connection: a transaction-scoped lock
/// through the pooler, held for `secs`.
async fn occupy(url: &str, secs: u64) -> tokio::task::JoinHandle<()> {
    let locks = bounded(10, dblock::Locks::connect(url)).await.unwrap();
    let g = bounded(10, locks.lock("occupier")).await.unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(secs)).await;
        drop(g);
        drop(locks);
    })
}

/// With the pool saturated, a request waits in PgBouncer's queue, where the server's
/// lock_timeout does not run: the deadline is kept all the same, by the library and by
/// as `dblock run --wait` does (dblock-cli's pooler_cli test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_count_the_time_queued_in_the_pooler() {
    let s = PgSchema::new("pgb_deadline").await;
    let (_b, url) = bouncer(&s, PoolMode::Transaction, 1);
    // Built before the pool fills (building talks to the server).
    let locks = connect(&url, &s).await;
    let _holder = occupy(&url, 8).await;

    let t0 = Instant::now();
    let r = bounded(10, locks.try_lock_for("free-name", Duration::from_secs(1))).await;
    let took = t0.elapsed();
    assert!(
        matches!(r, Ok(None)),
        "not granted within the deadline: {r:?}"
    );
    eprintln!("try_lock_for(1 s) with the pool saturated returned after {took:?}");
    assert!(took < Duration::from_secs(3), "returned after {took:?}");
}

/// PgBouncer's own errors reach the caller in PgBouncer's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_errors_reach_the_caller_in_its_words() {
    let s = PgSchema::new("pgb_words").await;
    let b = PgBouncer::with(
        Options::new(PoolMode::Transaction, 1)
            .search_path(&s.name)
            .set("query_wait_timeout", "1"),
    );
    let url = with_params(&b.test_url(), &[("application_name", &s.app)]);
    let locks = connect(&url, &s).await;
    let _holder = occupy(&url, 8).await;
    let e = bounded(10, locks.lock("queued")).await.unwrap_err();
    let text = e.to_string();
    eprintln!("{text}");
    assert!(text.contains("query_wait_timeout"), "{e:?}");

    // A server PgBouncer cannot log in to: its own words, not "connection closed".
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let b = PgBouncer::with(
        Options::new(PoolMode::Transaction, 1)
            .server_port(dead_port)
            .set("server_login_retry", "1")
            .set("query_wait_timeout", "3"),
    );
    let e = bounded(20, dblock::Locks::connect(&b.test_url()))
        .await
        .unwrap_err();
    let text = e.to_string();
    eprintln!("{text}");
    assert!(
        text.contains("query_wait_timeout") || text.contains("server_login_retry"),
        "{e:?}"
    );
}

/// A lock whose server connection is terminated is reported lost, through the pooler
/// as directly, and is free for the next holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_is_noticed_through_the_pooler() {
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let s = PgSchema::new("pgb_loss").await;
        let (_b, url) = bouncer(&s, mode, 2);
        let locks = bounded(
            10,
            dblock::Locks::builder()
                .url(&url)
                .namespace(&s.name)
                .check_interval(Duration::from_millis(100))
                .build(),
        )
        .await
        .unwrap();
        let g = bounded(10, locks.lock("lossy")).await.unwrap();
        let key = locks.key("lossy").unwrap();
        assert_eq!(s.terminate_holders(key).await, 1);
        let reason = bounded(10, g.lost()).await;
        eprintln!("{mode:?}: lost: {reason}");
        let other = connect(&url, &s).await;
        let g2 = bounded(10, other.try_lock_for("lossy", Duration::from_secs(5)))
            .await
            .unwrap();
        assert!(g2.is_some(), "{mode:?}: free after the loss");
    }
}

/// Handles on the caller's sqlx pool through a transaction pooler: detected (the port
/// differs from the server's), session locks refused, transaction locks exclusive; and
/// the `xact` helpers work in the caller's transactions with no server-side prepared
/// statement (which PgBouncer 1.18 would leave on a server connection for the next
/// client: `prepared statement "sqlx_s_1" already exists`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_pool_handles_and_xact_helpers_work_through_a_transaction_pooler() {
    use dblock::postgres::xact;
    let s = PgSchema::new("pgb_sqlx").await;
    let (_b, url) = bouncer(&s, PoolMode::Transaction, 2);
    let pool = bounded(
        10,
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&url),
    )
    .await
    .unwrap();
    let locks = bounded(10, dblock::Locks::from_sqlx_pool(pool.clone()))
        .await
        .unwrap();
    assert_eq!(locks.pooler(), Pooler::Transaction, "detected by port");
    let e = bounded(10, locks.request("s").scope(Scope::Session).try_lock())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::BehindPooler { .. }), "{e:?}");
    let g = bounded(10, locks.lock("t")).await.unwrap();
    let other = connect(&url, &s).await;
    assert!(bounded(10, other.try_lock("t")).await.unwrap().is_none());
    drop(g);

    let key = locks.key("x").unwrap();
    for round in 0..6 {
        let mut tx = bounded(10, pool.begin()).await.unwrap();
        bounded(10, xact::lock(&mut tx, key, dblock::Mode::Exclusive))
            .await
            .unwrap();
        assert!(
            bounded(10, xact::try_lock(&mut tx, key, dblock::Mode::Exclusive))
                .await
                .unwrap(),
            "round {round}: re-entrant in its own transaction"
        );
        // Another client cannot take it meanwhile.
        assert!(
            bounded(10, other.try_lock("x")).await.unwrap().is_none(),
            "round {round}"
        );
        let ns = bounded(10, xact::current_namespace(&mut tx)).await.unwrap();
        assert_eq!(ns, s.name);
        bounded(10, tx.commit()).await.unwrap();
    }
    assert!(bounded(10, other.try_lock("x")).await.unwrap().is_some());

    // A fence checked in the caller's transactions, again and again (each check was a
    // prepared statement once).
    let g = bounded(10, locks.request("fenced").fenced().lock())
        .await
        .unwrap();
    let fence = g.fence().unwrap().clone();
    for round in 0..6 {
        let mut tx = bounded(10, pool.begin()).await.unwrap();
        bounded(10, fence.check_postgres(&mut tx))
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        bounded(10, tx.commit()).await.unwrap();
    }
}

/// A transaction pooler dblock was told is not there (`pooler=none`: a proxy that passes
/// the server's cancel key through unchanged is not detected) moves a connection to
/// another server session between transactions, where the statements dblock prepared on
/// the first are missing, and leaves them on the first for the next client (PgBouncer
/// 1.18 keeps no prepared statement for its clients). Neither costs a lock: the round
/// that finds a statement missing (`26000`) or already there (`42P05`) runs again as the
/// simple query it would have been, granted, and that connection prepares nothing more.
/// The controls: the lock really moved to a server session that never saw the statements
/// (another backend), and a second handle's connection met the first one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_a_pooler_loses_or_leaves_behind_cost_no_lock() {
    let s = PgSchema::new("pgb_prep").await;
    let (b, url) = bouncer(&s, PoolMode::Transaction, 2);
    let undeclared = format!("{url}&pooler=none");
    let handle = || async {
        bounded(
            10,
            dblock::Locks::builder()
                .url(&undeclared)
                .namespace(&s.name)
                .max_connections(1)
                .build(),
        )
        .await
        .unwrap()
    };
    let idle = |pid: i32| {
        let s = &s;
        async move {
            s.eventually(10, || async {
                let state: Option<String> = s
                    .admin()
                    .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
                    .await
                    .unwrap()
                    .get(0);
                state.as_deref() == Some("idle")
            })
            .await
        }
    };
    // Another client of the pooler, which holds server sessions in transactions.
    let other = || async {
        let (c, conn) = tokio_postgres::connect(&b.test_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c
    };
    // X: taken by another client's transaction, so that dblock's first round lands on Y.
    let o1 = other().await;
    o1.batch_execute("BEGIN").await.unwrap();
    let x: i32 = o1
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let locks = handle().await;
    // Taken and let go twice on Y: the statements are prepared there (the first round
    // prepares the try, the second binds it).
    let mut y = 0;
    for name in ["a", "b"] {
        let g = bounded(10, locks.lock(name)).await.unwrap();
        y = s.advisory(g.key()).await[0].0;
        drop(g);
        assert!(idle(y).await, "the transaction on Y ended");
    }
    assert_ne!(x, y);
    // Y taken by another client (the only free server session), X let go.
    let o2 = other().await;
    o2.batch_execute("BEGIN").await.unwrap();
    let o2_pid: i32 = o2
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(o2_pid, y, "the control: the other client holds Y");
    o1.batch_execute("COMMIT").await.unwrap();
    // The next round lands on X, which has none of the statements.
    let other_handle = s.locks().await;
    for (i, name) in ["c", "d", "e"].into_iter().enumerate() {
        let g = bounded(10, locks.lock(name))
            .await
            .unwrap_or_else(|e| panic!("lock {i} through the moved connection: {e}"));
        let rows = s.advisory(g.key()).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].0, x, "the control: the lock moved to X");
        assert!(
            bounded(10, other_handle.try_lock(name))
                .await
                .unwrap()
                .is_none(),
            "held"
        );
        drop(g);
        assert!(idle(x).await, "let go");
    }
    // X taken by another client, Y let go: a second handle's connection lands on Y,
    // where the first one's statements still are, and prepares its own under the same
    // names.
    let o3 = other().await;
    o3.batch_execute("BEGIN").await.unwrap();
    o2.batch_execute("COMMIT").await.unwrap();
    let second = handle().await;
    for name in ["f", "g", "h"] {
        let g = bounded(10, second.lock(name))
            .await
            .unwrap_or_else(|e| panic!("{name} on the session the first handle left: {e}"));
        let rows = s.advisory(g.key()).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(
            rows[0].0, y,
            "the control: the second handle's lock is on Y"
        );
        drop(g);
        assert!(idle(y).await, "let go");
    }
    o3.batch_execute("COMMIT").await.unwrap();
}
