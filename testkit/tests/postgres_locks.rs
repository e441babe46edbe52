//! Locking semantics against a real PostgreSQL: each test in a schema (and so a lock
//! namespace) of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use dblock::{Error, Key, Locks, Mode, Scope};
use dblock_testkit::testdb::within;
use dblock_testkit::{PgDatabase, pg_url, with_params};
use dblock_testkit::{PgSchema, eventually, semantics};
use tokio::time::timeout;

/// The hub seed's test in the session scope (the default scope, and the other
/// backends: every_backend_locks.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exclusive_lock_has_one_holder_at_a_time_in_the_session_scope() {
    let s = PgSchema::new("seed").await;
    let session = Locks::builder()
        .url(&s.url)
        .scope(Scope::Session)
        .build()
        .await
        .unwrap();
    semantics::an_exclusive_lock_has_one_holder_at_a_time(&session).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_matches_the_documented_sql_formula() {
    let s = PgSchema::new("keysql").await;
    for (ns, name) in [
        ("public", "autoland:7"),
        ("tenant_a", "diffusion:3:src/lib.rs"),
        ("ns", "ünïcødé ✓ 'quoted'"),
    ] {
        let row = s
            .admin()
            .query_one(
                "SELECT ('x' || left(encode(sha256(convert_to($1, 'UTF8') || '\\x00'::bytea \
                 || convert_to($2, 'UTF8')), 'hex'), 16))::bit(64)::bigint",
                &[&ns, &name],
            )
            .await
            .unwrap();
        let from_sql: i64 = row.get(0);
        assert_eq!(
            from_sql,
            Key::new(ns, name).unwrap().as_i64(),
            "({ns}, {name})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_namespace_setting_gives_the_default_namespace_and_it_appears_in_pg_locks() {
    let s = PgSchema::new("ns").await;
    let locks = s.locks().await;
    assert_eq!(locks.namespace(), s.name);
    let g = locks.lock("job").await.unwrap();
    assert_eq!(g.key(), Key::new(&s.name, "job").unwrap());
    let rows = s.advisory(g.key()).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].1, "ExclusiveLock");
    assert!(rows[0].2);
    drop(g);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_schemas_never_collide_but_a_shared_namespace_does() {
    let a = PgSchema::new("nsa").await;
    let b = PgSchema::new("nsb").await;
    let la = a.locks().await;
    let lb = b.locks().await;
    let _ga = la.lock("same-name").await.unwrap();
    assert!(
        lb.try_lock("same-name").await.unwrap().is_some(),
        "another schema's lock of the same name is another lock"
    );
    let shared_a = dblock::Locks::builder()
        .url(&a.url)
        .namespace("common")
        .build()
        .await
        .unwrap();
    let shared_b = dblock::Locks::builder()
        .url(&b.url)
        .namespace("common")
        .build()
        .await
        .unwrap();
    let _g = shared_a.lock("same-name").await.unwrap();
    assert!(
        shared_b.try_lock("same-name").await.unwrap().is_none(),
        "one namespace, one lock, whatever the schema"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_gives_up_and_stops_waiting_on_the_server() {
    let s = PgSchema::new("deadline").await;
    let holder = s.locks().await;
    // Waiting on the server takes another handle (another process): a task of the
    // holder's own handle waits behind it in the process (the relay, tested below).
    let locks = s.locks().await;
    for scope in [Scope::Transaction, Scope::Session] {
        let g = holder.lock("d").await.unwrap();
        let t = Instant::now();
        let r = locks
            .request("d")
            .scope(scope)
            .try_lock_for(Duration::from_millis(300))
            .await
            .unwrap();
        assert!(r.is_none(), "{scope:?}");
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{scope:?} waited the deadline"
        );
        // Only the holder is left in pg_locks: the waiter's server-side wait ended too.
        let rows = s.advisory(g.key()).await;
        assert_eq!(
            rows.iter().filter(|r| !r.2).count(),
            0,
            "{scope:?}: {rows:?}"
        );
        // And a deadline met in time gets the lock.
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                locks
                    .request("d")
                    .scope(scope)
                    .try_lock_for(Duration::from_secs(10))
                    .await
            })
        };
        // Queued on the server before the holder lets go (observed, not slept for).
        let key = g.key();
        assert!(
            s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
                .await,
            "{scope:?}: the waiter queues"
        );
        drop(g);
        assert!(waiter.await.unwrap().unwrap().is_some(), "{scope:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_common_semantics_hold_in_the_session_scope() {
    let s = PgSchema::new("common").await;
    for scope in [Scope::Session] {
        let locks = Locks::builder()
            .url(&s.url)
            .scope(scope)
            .build()
            .await
            .unwrap();
        semantics::try_lock_reports_a_held_lock_as_none(&locks).await;
        semantics::shared_holders_coexist_and_exclude_an_exclusive_one(&locks).await;
        semantics::tasks_of_one_process_exclude_each_other(&locks, |l| l.request("counter")).await;
    }
}

/// Dropping a guard sends the release at once: the other session gets the lock although
/// the dropping handle is never used again (a queued rollback would never be sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_guard_releases_without_further_use_of_its_handle() {
    let s = PgSchema::new("drop").await;
    for scope in [Scope::Transaction, Scope::Session] {
        let a = s.locks().await;
        let b = s.locks().await;
        let g = a.request("d").scope(scope).lock().await.unwrap();
        let waiter =
            tokio::spawn(async move { b.request("d").scope(scope).lock().await.map(drop) });
        let key = g.key();
        assert!(
            s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
                .await,
            "{scope:?}: the waiter queues"
        );
        let dropped = Instant::now();
        drop(g);
        let r = tokio::time::timeout(Duration::from_secs(5), waiter).await;
        assert!(
            matches!(r, Ok(Ok(Ok(())))),
            "{scope:?}: the waiter got the lock: {r:?}"
        );
        eprintln!("{scope:?}: handoff after drop in {:?}", dropped.elapsed());
        // `a` is kept alive, unused, until here.
        drop(a);
    }
}

/// A guard dropped just before the next request on its connection (one pooled
/// connection, nothing awaited in between) has its release carried in that request's
/// message: the old lock is released before the new request runs, and every kind of
/// request reads its own results, not the release's. (One thread, so the connection's
/// task cannot send the release on its own in between.)
#[tokio::test(flavor = "current_thread")]
async fn a_release_carried_by_the_next_request_still_goes_first() {
    let s = PgSchema::new("carried").await;
    // Checks quick enough for a 2 s lease (see Request::lease).
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(1)
        .check_interval(Duration::from_millis(200))
        .check_timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let other = s.locks().await;
    let held_elsewhere = other.lock("busy").await.unwrap();
    let granted = || async {
        let rows = s.advisory_of_sessions().await;
        rows.iter().filter(|r| r.2).count()
    };
    // The guards whose releases are carried: each kind of release.
    let take_a = |kind: usize| {
        let r = locks.request("a");
        match kind {
            0 => r,
            1 => r.scope(Scope::Session),
            2 => r.scope(Scope::Session).shared(),
            _ => r.scope(Scope::Session).lease(Duration::from_secs(2)),
        }
        .lock()
    };
    for round in 0..4 {
        for kind in 0..4 {
            let at = format!("round {round}, release kind {kind}");
            drop(take_a(kind).await.unwrap());
            let b = locks.try_lock("b").await.unwrap().expect("b is free");
            // Released and awaited, not dropped: a dropped guard's release is sent
            // without waiting, and the count below must not race it.
            other
                .try_lock("a")
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{at}: a was released"))
                .release()
                .await
                .unwrap();
            assert!(
                other.try_lock("b").await.unwrap().is_none(),
                "{at}: b is held"
            );
            // `busy` (held elsewhere) and b: a is gone.
            assert_eq!(granted().await, 2, "{at}");
            drop(b);
            // A try for a lock held elsewhere reads its own `f`, not the release's result.
            drop(take_a(kind).await.unwrap());
            assert!(locks.try_lock("busy").await.unwrap().is_none(), "{at}");
            // A try that failed leaves a ROLLBACK to be carried, too.
            drop(take_a(kind).await.unwrap());
            let b = locks.try_lock("b").await.unwrap().expect("b is free again");
            drop(b);
            drop(take_a(kind).await.unwrap());
            let waited = locks
                .try_lock_for("b", Duration::from_secs(5))
                .await
                .unwrap();
            drop(waited.expect("b is free"));
            // A session-scoped request after a carried release leaves no transaction
            // open.
            drop(take_a(kind).await.unwrap());
            let sess = locks
                .request("c")
                .scope(Scope::Session)
                .try_lock()
                .await
                .unwrap()
                .expect("c is free");
            let holder = s.advisory(sess.key()).await;
            assert_eq!(holder.len(), 1, "{at}: {holder:?}");
            let state = s
                .sessions()
                .await
                .into_iter()
                .find(|(pid, _)| *pid == holder[0].0);
            assert_eq!(state.map(|s| s.1).as_deref(), Some("idle"), "{at}");
            assert_eq!(granted().await, 2, "{at}: busy and c");
            sess.release().await.unwrap();
            // A session-scoped request that fails on the server (its lock_timeout) does
            // not undo the release it carried.
            drop(take_a(kind).await.unwrap());
            let r = locks
                .request("busy")
                .scope(Scope::Session)
                .try_lock_for(Duration::from_millis(20))
                .await
                .unwrap();
            assert!(r.is_none(), "{at}");
            other
                .try_lock("a")
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{at}: a was released by the failed request's message"))
                .release()
                .await
                .unwrap();
            assert_eq!(granted().await, 1, "{at}: busy alone");
            drop(take_a(kind).await.unwrap());
            let f = locks.request("f").fenced().lock().await.unwrap();
            assert!(f.fencing_token().is_some(), "{at}");
            assert_eq!(granted().await, 2, "{at}: busy and f");
            drop(f);
        }
    }
    // The leased lock's carried release reset idle_session_timeout: its connection
    // outlives the lease, idle.
    let s = &s;
    let pid_of = |g: dblock::LockGuard| async move { s.advisory(g.key()).await[0].0 };
    drop(take_a(3).await.unwrap());
    let before = pid_of(locks.lock("p").await.unwrap()).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let after = pid_of(locks.lock("p").await.unwrap()).await;
    assert_eq!(
        before, after,
        "the connection was ended by a leftover lease"
    );
    drop(held_elsewhere);
    let clean = s
        .eventually(10, || async {
            s.advisory_of_sessions().await.is_empty()
                && s.sessions().await.iter().all(|(_, st)| st == "idle")
        })
        .await;
    assert!(clean, "left behind: {:?}", s.advisory_of_sessions().await);
}

/// A held transaction-scoped lock holds no snapshot (READ COMMITTED whatever the
/// server's default isolation), also when its transaction was begun by a carried
/// `ROLLBACK AND CHAIN` of the previous lock's, and after a failed request whose
/// `ROLLBACK` is carried as a plain one.
#[tokio::test(flavor = "current_thread")]
async fn a_held_lock_holds_no_snapshot_even_when_its_transaction_is_chained() {
    let s = PgSchema::new("snapshot").await;
    // The schema's own URL, with the isolation default added to its options.
    let url = dblock_testkit::with_params(
        &dblock_testkit::pg_url(),
        &[
            (
                "options",
                &format!(
                    "-c search_path={0} -c dblock.namespace={0} \
                     -c default_transaction_isolation=serializable",
                    s.name
                ),
            ),
            ("application_name", &s.app),
        ],
    );
    let locks = Locks::builder()
        .url(&url)
        .max_connections(1)
        .build()
        .await
        .unwrap();
    let other = s.locks().await;
    let busy = other.lock("busy").await.unwrap();
    let snapshot_of = |key: Key| {
        let s = &s;
        async move {
            let pid = s.advisory(key).await[0].0;
            let row = s
                .admin()
                .query_one(
                    "SELECT backend_xmin IS NOT NULL, state FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .unwrap();
            (row.get::<_, bool>(0), row.get::<_, String>(1))
        }
    };
    for round in 0..3 {
        let g = locks.lock("a").await.unwrap();
        assert_eq!(
            snapshot_of(g.key()).await,
            (false, "idle in transaction".into()),
            "{round}"
        );
        // Chained: the dropped guard's ROLLBACK AND CHAIN begins this one's transaction.
        drop(g);
        let g2 = locks.lock("b").await.unwrap();
        assert_eq!(
            snapshot_of(g2.key()).await,
            (false, "idle in transaction".into()),
            "{round}: chained"
        );
        assert!(other.try_lock("a").await.unwrap().is_some(), "{round}");
        // A try that timed out on the server (an error) leaves a plain ROLLBACK.
        drop(g2);
        let r = locks
            .try_lock_for("busy", Duration::from_millis(20))
            .await
            .unwrap();
        assert!(r.is_none(), "{round}");
        let g3 = locks.lock("c").await.unwrap();
        assert_eq!(
            snapshot_of(g3.key()).await,
            (false, "idle in transaction".into()),
            "{round}: after a failed request"
        );
        drop(g3);
    }
    drop(busy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_scoped_holder_is_idle_in_transaction_and_a_session_one_is_idle() {
    let s = PgSchema::new("states").await;
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(1)
        .build()
        .await
        .unwrap();
    let g = locks.lock("x").await.unwrap();
    let states = s.sessions().await;
    assert_eq!(states.len(), 1, "{states:?}");
    assert_eq!(states[0].1, "idle in transaction");
    drop(g);
    let g = locks
        .request("x")
        .scope(Scope::Session)
        .lock()
        .await
        .unwrap();
    assert_eq!(s.sessions().await[0].1, "idle");
    g.release().await.unwrap();
    assert!(s.advisory_of_sessions().await.is_empty());
}

/// Cancel safety: acquisitions dropped at many points (in the pool, while connecting,
/// while waiting, just as the lock is granted) leave no lock held, no waiter on the
/// server, and no pooled connection holding a lock or an open transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_acquisitions_leave_nothing_held_and_no_dirty_connection() {
    let s = PgSchema::new("cancel").await;
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(6)
        .build()
        .await
        .unwrap();
    let holder_handle = s.locks().await;
    let held = holder_handle.lock("contended").await.unwrap();
    let delays_us = [
        0u64, 10, 50, 100, 200, 300, 500, 700, 1000, 1500, 2000, 3000, 5000, 8000, 20000,
    ];
    let mut granted = 0;
    for round in 0..3 {
        for (i, &us) in delays_us.iter().enumerate() {
            let d = Duration::from_micros(us);
            // Waiting for a held lock: always cancelled mid-wait.
            let r = tokio::time::timeout(d, locks.lock("contended")).await;
            assert!(r.is_err(), "the held lock cannot be granted");
            // A free lock: cancelled anywhere from before sending to after the grant.
            let scope = if i % 2 == 0 {
                Scope::Transaction
            } else {
                Scope::Session
            };
            let name = format!("free-{round}-{i}");
            if let Ok(g) = tokio::time::timeout(d, locks.request(&name).scope(scope).lock()).await {
                granted += 1;
                drop(g.unwrap());
            }
            // A fresh handle: cancelled while connecting, too.
            let fresh = tokio::time::timeout(d, async {
                let l = Locks::connect(&s.url).await.unwrap();
                l.lock(&name).await.map(drop)
            })
            .await;
            drop(fresh);
        }
    }
    eprintln!(
        "{granted} of {} free-lock acquisitions completed before cancellation",
        3 * delays_us.len()
    );
    // No cancelled waiter is left waiting on the server: only the holder remains.
    let key = holder_handle.key("contended").unwrap();
    let settled = eventually(10, &mut || async {
        let rows = s.advisory(key).await;
        rows.len() == 1 && rows[0].2
    })
    .await;
    assert!(
        settled,
        "waiters left on the server: {:?}",
        s.advisory(key).await
    );
    drop(held);
    drop(holder_handle);
    // Nothing held, no session in a transaction.
    let clean = eventually(10, &mut || async {
        s.advisory_of_sessions().await.is_empty()
            && s.sessions().await.iter().all(|(_, st)| st == "idle")
    })
    .await;
    assert!(
        clean,
        "left behind: locks {:?}, sessions {:?}",
        s.advisory_of_sessions().await,
        s.sessions().await
    );
    // Every pooled connection is fit for use: all six at once, each name free.
    let mut gs = Vec::new();
    for i in 0..6 {
        gs.push(
            locks
                .try_lock(&format!("after-{i}"))
                .await
                .unwrap()
                .expect("free"),
        );
    }
    drop(gs);
    assert!(
        locks.try_lock("contended").await.unwrap().is_some(),
        "the holder's drop released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_learns_that_its_backend_was_terminated() {
    let s = PgSchema::new("terminated").await;
    let locks = s.locks().await;
    for scope in [Scope::Transaction, Scope::Session] {
        let g = locks.request("t").scope(scope).lock().await.unwrap();
        assert!(g.is_held());
        let lost = g.lost();
        assert_eq!(s.terminate_holders(g.key()).await, 1);
        let reason = tokio::time::timeout(Duration::from_secs(5), lost).await;
        assert!(reason.is_ok(), "{scope:?}: told of the loss");
        assert!(!g.is_held());
        assert!(
            matches!(g.release().await, Err(Error::LockLost { .. })),
            "{scope:?}"
        );
        // The handle goes on working with a new connection.
        assert!(
            locks
                .request("t")
                .scope(scope)
                .try_lock()
                .await
                .unwrap()
                .is_some()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_connection_is_terminated_gets_connection_lost() {
    let s = PgSchema::new("waitlost").await;
    // The waiter on a handle of its own, so that it waits on the server.
    let locks = s.locks().await;
    let g = s.locks().await.lock("w").await.unwrap();
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("w").await })
    };
    let key = g.key();
    assert!(
        eventually(5, &mut || async {
            s.advisory(key).await.iter().any(|r| !r.2)
        })
        .await
    );
    for (pid, _, granted) in s.advisory(key).await {
        if !granted {
            s.admin()
                .query("SELECT pg_terminate_backend($1)", &[&pid])
                .await
                .unwrap();
        }
    }
    let r = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(r, Err(Error::ConnectionLost { .. })), "{r:?}");
    drop(g);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_a_connect_error() {
    let r = Locks::connect("postgres://postgres@127.0.0.1:1/test").await;
    match r {
        Err(e @ Error::Connect { .. }) => assert!(e.is_connection()),
        other => panic!("{other:?}"),
    }
    let missing = dblock_testkit::with_database(&dblock_testkit::pg_url(), "no_such_database_here");
    let r = Locks::connect(&missing).await;
    assert!(matches!(r, Err(Error::Connect { .. })), "{r:?}");
    for bad in [
        "mysql://root@localhost",
        "postgres://h:notaport/x",
        "sqlite::memory:",
    ] {
        assert!(
            matches!(Locks::connect(bad).await, Err(Error::InvalidUrl { .. })),
            "{bad}"
        );
    }
}

/// The hub seed's own use: a lock inside the caller's sqlx transaction, released with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_inside_a_sqlx_transaction_ends_with_the_transaction() {
    use dblock::postgres::xact;
    let s = PgSchema::new("xact").await;
    let pool = sqlx::PgPool::connect(&s.url).await.unwrap();
    let locks = s.locks().await;
    let key = locks.key("autoland:7").unwrap();
    let mut tx = pool.begin().await.unwrap();
    xact::lock(&mut tx, key, Mode::Exclusive).await.unwrap();
    assert!(
        locks.try_lock("autoland:7").await.unwrap().is_none(),
        "held by the transaction"
    );
    let mut tx2 = pool.begin().await.unwrap();
    assert!(
        !xact::try_lock(&mut tx2, key, Mode::Exclusive)
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    assert!(
        xact::try_lock(&mut tx2, key, Mode::Exclusive)
            .await
            .unwrap(),
        "free after commit"
    );
    tx2.rollback().await.unwrap();
    assert_eq!(
        xact::current_namespace(&mut pool.acquire().await.unwrap())
            .await
            .unwrap(),
        s.name
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_transactions_is_a_typed_error() {
    use dblock::postgres::xact;
    let s = PgSchema::new("deadlock").await;
    let pool = sqlx::PgPool::connect(&s.url).await.unwrap();
    let (a, b) = (
        Key::new(&s.name, "a").unwrap(),
        Key::new(&s.name, "b").unwrap(),
    );
    let mut t1 = pool.begin().await.unwrap();
    let mut t2 = pool.begin().await.unwrap();
    xact::lock(&mut t1, a, Mode::Exclusive).await.unwrap();
    xact::lock(&mut t2, b, Mode::Exclusive).await.unwrap();
    let (r1, r2) = tokio::join!(
        xact::lock(&mut t1, b, Mode::Exclusive),
        xact::lock(&mut t2, a, Mode::Exclusive)
    );
    let deadlocks = [&r1, &r2]
        .iter()
        .filter(|r| matches!(r, Err(Error::Deadlock { .. })))
        .count();
    assert_eq!(deadlocks, 1, "{r1:?} {r2:?}");
    let e = r1.as_ref().err().or(r2.as_ref().err());
    assert_eq!(e.and_then(|e| e.sqlstate()), Some("40P01"));
    // PostgreSQL's own code is its SQLSTATE.
    assert_eq!(e.and_then(|e| e.native_code()), Some("40P01"));
}

/// A full lock table is a typed error with the server's hint, not a hang. On a
/// throwaway cluster: a full table fails every lock request on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lock_table_is_a_typed_error() {
    use dblock::postgres::xact;
    let cluster =
        dblock_testkit::cluster::TempCluster::start(&[("max_locks_per_transaction", "10")]);
    let pool = sqlx::PgPool::connect(&cluster.url()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let mut err = None;
    for i in 0..100_000 {
        if let Err(e) = xact::lock(
            &mut tx,
            Key::new("public", &format!("k{i}")).unwrap(),
            Mode::Exclusive,
        )
        .await
        {
            err = Some((i, e));
            break;
        }
    }
    let (n, e) = err.expect("the lock table filled up");
    assert!(
        matches!(e, Error::LockTableFull { .. }),
        "after {n} locks: {e:?}"
    );
    assert!(e.to_string().contains("max_locks_per_transaction"), "{e}");
}

/// A handle on the caller's sqlx pool keeps every promise of one on its own connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_on_a_sqlx_pool_keeps_the_same_semantics() {
    let s = PgSchema::new("sqlxpool").await;
    for scope in [Scope::Transaction, Scope::Session] {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&s.url)
            .await
            .unwrap();
        let locks = Locks::builder()
            .sqlx_pool(pool.clone())
            .scope(scope)
            .build()
            .await
            .unwrap();
        assert_eq!(locks.namespace(), s.name);
        semantics::an_exclusive_lock_has_one_holder_at_a_time(&locks).await;
        semantics::try_lock_reports_a_held_lock_as_none(&locks).await;
        semantics::a_deadline_wait_gives_up_or_gets_the_lock(&locks).await;
        semantics::shared_holders_coexist_and_exclude_an_exclusive_one(&locks).await;
        semantics::tasks_of_one_process_exclude_each_other(&locks, |l| l.request("counter")).await;

        // Dropping releases without any further use of the handle.
        let other = s.locks().await;
        let g = locks.lock("d").await.unwrap();
        let waiter = tokio::spawn(async move { other.lock("d").await.map(drop) });
        let key = g.key();
        assert!(
            s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
                .await,
            "{scope:?}: the waiter queues"
        );
        drop(g);
        let r = tokio::time::timeout(Duration::from_secs(5), waiter).await;
        assert!(matches!(r, Ok(Ok(Ok(())))), "{scope:?}: {r:?}");

        // Cancelled waits stop waiting on the server and leave no lock held.
        let holder = s.locks().await;
        let held = holder.lock("c").await.unwrap();
        for us in [0u64, 100, 1000, 5000, 20_000] {
            let r = tokio::time::timeout(Duration::from_micros(us), locks.lock("c")).await;
            assert!(r.is_err());
        }
        let key = held.key();
        let settled = eventually(10, &mut || async {
            let rows = s.advisory(key).await;
            rows.len() == 1 && rows[0].2
        })
        .await;
        assert!(
            settled,
            "{scope:?}: waiters left: {:?}",
            s.advisory(key).await
        );
        drop(held);

        // A terminated connection is noticed by its guard.
        let g = locks.lock("t").await.unwrap();
        let lost = g.lost();
        s.terminate_holders(g.key()).await;
        assert!(
            tokio::time::timeout(Duration::from_secs(5), lost)
                .await
                .is_ok(),
            "{scope:?}"
        );
        drop(g);
        pool.close().await;
    }
}

/// All of dblock's connections in use: a request waits at most acquire_timeout for one,
/// then fails with a typed timeout (the lock's own deadline is a separate matter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_a_typed_timeout() {
    let s = PgSchema::new("pooltimeout").await;
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    let g = locks.lock("a").await.unwrap();
    let t = Instant::now();
    let r = locks.lock("b").await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(r.unwrap_err().is_connection());
    assert!(t.elapsed() >= Duration::from_millis(200));
    // A request with a deadline of its own waits no longer than that for a connection
    // either: a try not at all.
    let t = Instant::now();
    let r = locks.try_lock("b").await;
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    drop(g);
    assert!(
        eventually(5, &mut || async {
            locks.try_lock("b").await.unwrap().is_some()
        })
        .await
    );
}

/// A server-side lock_timeout ending a wait without a deadline is a lock-wait timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_lock_timeout_is_a_lock_wait_timeout() {
    let s = PgSchema::new("server_lt").await;
    let holder = s.locks().await;
    let _g = holder.lock("t").await.unwrap();
    let admin = s.admin();
    // A role whose sessions have lock_timeout set, as an administrator might.
    let role = format!("r_{}", s.name);
    admin.batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN; ALTER ROLE \"{role}\" SET lock_timeout = '200ms'; GRANT ALL ON SCHEMA \"{}\" TO \"{role}\"", s.name)).await.unwrap();
    // The role put into the URL structurally, whoever DATABASE_URL's user is.
    let url = dblock_testkit::with_user(&s.url, &role);
    let waiter = Locks::connect(&url).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), waiter.lock("t"))
        .await
        .expect("the role's lock_timeout ends the wait");
    let e = r.unwrap_err();
    assert!(e.is_lock_wait_timeout(), "{e:?}");
    drop(waiter);
    drop(_g);
    admin
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await
        .unwrap();
}

/// A deadline or lease longer than the server's largest timeout (2³¹ − 1 ms,
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

/// The default namespace does not depend on search_path or on which schemas
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

/// A process holds `startup` and migrates with CREATE INDEX CONCURRENTLY while
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

/// The query a session last sent, as `pg_stat_activity` shows it.
/// A handle of one connection on `s` declared behind a session pooler: never dblock's
/// own session straight to the server, so its rounds are simple queries, their
/// statements in the session's text.
async fn declared_behind_a_pooler(s: &PgSchema) -> Locks {
    Locks::builder()
        .url(&s.url)
        .pooler(dblock::postgres::Pooler::Session)
        .max_connections(1)
        .build()
        .await
        .unwrap()
}

async fn last_query(s: &PgSchema, pid: i32) -> String {
    s.admin()
        .query_one("SELECT query FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .unwrap()
        .get(0)
}

/// A free name costs one statement, a try (no `lock_timeout`, nothing else): the wait's
/// machinery is set up only when the try finds the name busy. The control: a busy
/// name's request does wait, in a round that sets the slice's `lock_timeout`. Both are
/// named in `dblock status`, the holder granted by a try too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_name_costs_one_try_and_a_busy_one_sets_up_its_wait() {
    let s = PgSchema::new("tryfirst").await;
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(4)
        .check_interval(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    // The simple query's text shows the round's statements: on a connection that is not
    // dblock's own session straight to the server (declared behind a pooler here).
    let pooled = declared_behind_a_pooler(&s).await;
    for scope in [Scope::Transaction, Scope::Session] {
        let g = pooled.request("free").scope(scope).lock().await.unwrap();
        let pid = s.advisory(g.key()).await[0].0;
        let sent = last_query(&s, pid).await;
        let statements: Vec<&str> = sent
            .split("; ")
            .filter(|st| !st.starts_with("BEGIN") && !st.starts_with("ROLLBACK"))
            .collect();
        assert_eq!(statements.len(), 1, "{scope:?}: {sent}");
        assert!(
            statements[0].contains("SELECT pg_catalog.pg_try_advisory_"),
            "{scope:?}: {sent}"
        );
        assert!(!sent.contains("lock_timeout"), "{scope:?}: {sent}");
        g.release().await.unwrap();
        // On dblock's own session the same try runs as the session's prepared statement,
        // its key bound (`conn/extended.rs`): the session shows that statement, or, from
        // the held lock's first health check, the comment alone.
        let g = locks.request("free").scope(scope).lock().await.unwrap();
        let pid = s.advisory(g.key()).await[0].0;
        let sent = last_query(&s, pid).await;
        assert!(
            sent.starts_with("SELECT pg_catalog.pg_try_advisory_")
                && sent.contains("($1) /* dblock holder=")
                || sent.starts_with("/* dblock "),
            "{scope:?}: {sent}"
        );
        assert!(!sent.contains("lock_timeout"), "{scope:?}: {sent}");
        assert!(
            s.eventually(10, || async {
                let sent = last_query(&s, pid).await;
                sent.starts_with("/* dblock ") && sent.contains("name=free")
            })
            .await,
            "{scope:?}: never named"
        );
        let st = locks.status(&["free"]).await.unwrap();
        assert_eq!(st.len(), 1, "{st:?}");
        assert_eq!(st[0].name.as_deref(), Some("free"));
        assert_eq!(st[0].holders.len(), 1, "{st:?}");
        g.release().await.unwrap();
    }
    // The control: a busy name waits, its round setting up the wait.
    let other = s.locks().await;
    let held = other.lock("busy").await.unwrap();
    let key = held.key();
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("busy").await.map(|g| g.key()) })
    };
    let waiting = s
        .eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
        .await;
    assert!(waiting, "the second request never waited on the server");
    let pid = s.advisory(key).await.iter().find(|r| !r.2).unwrap().0;
    let sent = last_query(&s, pid).await;
    // It waits (its slice is the session's lock_timeout, set once, see the next test)
    // and says since when: the try came first.
    assert!(
        sent.contains("SELECT pg_catalog.pg_advisory_xact_lock("),
        "{sent}"
    );
    assert!(sent.contains(" since="), "{sent}");
    let st = locks.status(&["busy"]).await.unwrap();
    assert_eq!(st[0].name.as_deref(), Some("busy"));
    assert_eq!((st[0].holders.len(), st[0].waiters.len()), (1, 1), "{st:?}");
    drop(held);
    let got = timeout(Duration::from_secs(10), waiter).await.unwrap();
    assert_eq!(got.unwrap().unwrap(), key);
}

/// A wait slice set once as the session's `lock_timeout` (so that a name taken in turn
/// sends no `lock_timeout` of its own each time) stays with lock requests: the same
/// connection used for anything else — a migration here — has the server's own
/// `lock_timeout` back. The control: the lock request's session did have the slice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_wait_slice_never_reaches_other_work_on_its_connection() {
    let s = PgSchema::new("sessslice").await;
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(1)
        .build()
        .await
        .unwrap();
    let other = s.locks().await;
    let held = other.lock("busy").await.unwrap();
    let key = held.key();
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("busy").await.map(|g| g.key()) })
    };
    assert!(
        s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
            .await
    );
    let pid = s.advisory(key).await.iter().find(|r| !r.2).unwrap().0;
    // The waiting round's message sets no lock_timeout: the session has it.
    let sent = last_query(&s, pid).await;
    assert!(
        sent.contains("SELECT pg_catalog.pg_advisory_xact_lock("),
        "{sent}"
    );
    assert!(!sent.contains("lock_timeout"), "{sent}");
    drop(held);
    let got = timeout(Duration::from_secs(10), waiter).await.unwrap();
    assert_eq!(got.unwrap().unwrap(), key);
    // A hot name's next request waits at once, on the session's slice.
    let g = locks.lock("busy").await.unwrap();
    drop(g);
    let set = dblock::migrate::Migrations::from_sources([(
        "1_seen.sql",
        "CREATE TABLE seen AS SELECT current_setting('lock_timeout') AS v, pg_backend_pid() AS pid",
    )])
    .unwrap();
    set.run(&locks).await.unwrap();
    let row = s
        .admin()
        .query_one(&format!("SELECT v, pid FROM \"{}\".seen", s.name), &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(1), pid, "the same connection");
    assert_eq!(
        row.get::<_, String>(0),
        "0",
        "the server's own lock_timeout"
    );
}

/// The pid of the session holding advisory key `key` (granted), if one does.
async fn holder_pid(s: &PgSchema, key: Key) -> Option<i32> {
    s.advisory(key).await.into_iter().find(|r| r.2).map(|r| r.0)
}

/// Tasks of one handle waiting for one name: the lock goes from one to the next as it
/// is, held on the server by the same session throughout (no release, no round trip),
/// while exclusion holds against every other session. Control: tasks of two handles
/// (as two processes) hand it over through the server — another session holds it next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_of_one_handle_hand_a_lock_over_without_letting_go_on_the_server() {
    let s = PgSchema::new("relay").await;
    let locks = s.locks().await;
    let other = s.locks().await;
    let key = locks.key("relay").unwrap();

    let first = locks.lock("relay").await.unwrap();
    let pid = holder_pid(&s, key).await.expect("held on the server");
    // Each task sends its guard on as it gets it (in the order they get it).
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..3 {
        let (locks, tx) = (locks.clone(), tx.clone());
        tokio::spawn(async move { tx.send(locks.lock("relay").await.unwrap()) });
    }
    // Behind a task of its own handle, a waiter does not wait on the server.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(s.advisory(key).await.len(), 1, "one session: the holder");
    drop(first);
    for _ in 0..3 {
        let mut g = timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("handed over")
            .unwrap();
        assert_eq!(holder_pid(&s, key).await, Some(pid), "handed over as it is");
        assert!(
            other.try_lock("relay").await.unwrap().is_none(),
            "still excluded elsewhere"
        );
        g.check().await.unwrap();
        drop(g);
    }
    // The last holder had nobody to hand to: released on the server.
    let mut free = || async { holder_pid(&s, key).await.is_none() };
    assert!(dblock_testkit::eventually(10, &mut free).await);
    assert!(other.try_lock("relay").await.unwrap().is_some());

    // Control: a waiter of another handle gets the lock through the server.
    let held = locks.lock("relay").await.unwrap();
    let pid = holder_pid(&s, key).await.expect("held");
    let waiter = tokio::spawn({
        let other = other.clone();
        async move { other.lock("relay").await.unwrap() }
    });
    until_waiting(s.admin(), key, 1).await;
    drop(held);
    let g = waiter.await.unwrap();
    assert_ne!(holder_pid(&s, key).await, Some(pid), "another session");
    drop(g);
}

/// A process whose tasks keep asking for a name keeps the server's grant for them only
/// for a few milliseconds: another process's waiter gets the lock while they go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_that_keeps_handing_a_lock_over_still_lets_another_process_in() {
    let s = PgSchema::new("relayfair").await;
    let busy = s.locks().await;
    let other = s.locks().await;
    let askers = Askers::start(&busy, "fair").await;
    // The other process gets in while the four tasks never stop asking.
    for _ in 0..3 {
        let g = other
            .try_lock_for("fair", Duration::from_secs(20))
            .await
            .unwrap();
        assert!(
            g.is_some(),
            "another process starved behind a handle's own tasks"
        );
        let before = askers.handed();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            askers.handed(),
            before,
            "excluded while the other process holds"
        );
        drop(g);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    askers.stop().await;
}

/// Four tasks of one handle that keep taking a name, holding it 200 µs each time.
struct Askers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Askers {
    /// Starts them on `locks`, and returns once they have had `name` 20 times.
    async fn start(locks: &Locks, name: &'static str) -> Askers {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let handed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let (locks, stop, handed) = (locks.clone(), stop.clone(), handed.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let g = locks.lock(name).await.unwrap();
                    handed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_micros(200)).await;
                    drop(g);
                }
            }));
        }
        let askers = Askers {
            stop,
            handed,
            tasks,
        };
        let mut going = || async { askers.handed() > 20 };
        assert!(eventually(10, &mut going).await);
        askers
    }

    /// How many times they have had it.
    fn handed(&self) -> u64 {
        self.handed.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
    }
}

/// `Builder::hand_over` sets the window: with a long one, a lock goes from task to task
/// of a handle without ever being let go on the server — another process's waiter,
/// queued on the server ahead of all of them, never gets it meanwhile. Control: with
/// `Duration::ZERO` every hand-off goes through the server, so that waiter gets it
/// first, ahead of the handle's own tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hand_over_window_decides_whether_a_lock_is_let_go_between_a_handles_tasks() {
    let s = PgSchema::new("relaywindow").await;
    let other = s.locks().await;
    for (window, kept) in [(Duration::from_secs(600), true), (Duration::ZERO, false)] {
        let locks = Locks::builder()
            .url(&s.url)
            .hand_over(window)
            .build()
            .await
            .unwrap();
        let key = locks.key("window").unwrap();
        let first = locks.lock("window").await.unwrap();
        let waiter = tokio::spawn({
            let other = other.clone();
            async move { other.lock("window").await.unwrap() }
        });
        until_waiting(s.admin(), key, 1).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..3 {
            let (locks, tx) = (locks.clone(), tx.clone());
            tokio::spawn(async move { tx.send(locks.lock("window").await.unwrap()) });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(first);
        if kept {
            for _ in 0..3 {
                let g = timeout(Duration::from_secs(20), rx.recv())
                    .await
                    .expect("handed over")
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                assert!(
                    !waiter.is_finished(),
                    "never let go on the server between the handle's tasks"
                );
                drop(g);
            }
            let g = timeout(Duration::from_secs(20), waiter)
                .await
                .expect("the other process next")
                .unwrap();
            drop(g);
        } else {
            let g = timeout(Duration::from_secs(20), waiter)
                .await
                .expect("the other process first, in the server's order")
                .unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(rx.try_recv().is_err(), "excluded while the other holds");
            drop(g);
            for _ in 0..3 {
                let g = timeout(Duration::from_secs(20), rx.recv())
                    .await
                    .expect("each task in turn")
                    .unwrap();
                drop(g);
            }
        }
        let mut free = || async { holder_pid(&s, key).await.is_none() };
        assert!(eventually(10, &mut free).await, "nothing left held");
    }
}

/// Control for the test above: with a window that never ends, another process starves
/// while a handle's tasks keep asking — what the 5-ms default prevents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_that_never_ends_starves_another_process() {
    let s = PgSchema::new("relaystarve").await;
    let busy = Locks::builder()
        .url(&s.url)
        .hand_over(Duration::from_secs(600))
        .build()
        .await
        .unwrap();
    let other = s.locks().await;
    let askers = Askers::start(&busy, "starve").await;
    let before = askers.handed();
    let g = other
        .try_lock_for("starve", Duration::from_millis(500))
        .await
        .unwrap();
    assert!(
        g.is_none(),
        "the handle's tasks kept the lock to themselves"
    );
    assert!(
        askers.handed() > before,
        "they went on meanwhile (from {before} to {})",
        askers.handed()
    );
    askers.stop().await;
    // Once they stop, the other process gets in.
    assert!(
        other
            .try_lock_for("starve", Duration::from_secs(20))
            .await
            .unwrap()
            .is_some()
    );
}

/// A task waiting in line behind its own handle's holder: a deadline ends its wait, a
/// cancelled one leaves at once, and neither leaves anything held — the holder's drop
/// releases the lock on the server. A holder whose connection was lost hands nothing
/// over: the next task asks the server and holds a lock of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_the_line_or_losing_the_holder_leaves_nothing_held() {
    let s = PgSchema::new("relayleave").await;
    let locks = s.locks().await;
    let other = s.locks().await;
    let key = locks.key("leave").unwrap();

    let g = locks.lock("leave").await.unwrap();
    let late = locks
        .try_lock_for("leave", Duration::from_millis(50))
        .await
        .unwrap();
    assert!(late.is_none(), "its deadline ended the wait in line");
    let cancelled = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("leave").await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    cancelled.abort();
    assert!(cancelled.await.unwrap_err().is_cancelled());
    drop(g);
    let mut free = || async { holder_pid(&s, key).await.is_none() };
    assert!(
        dblock_testkit::eventually(10, &mut free).await,
        "released on the server with nobody left in line"
    );
    assert!(other.try_lock("leave").await.unwrap().is_some());

    // The holder's session is ended while a task waits in line behind it.
    let g = locks.lock("leave").await.unwrap();
    let pid = holder_pid(&s, key).await.expect("held");
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("leave").await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.admin()
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    let lost = timeout(Duration::from_secs(20), g.lost()).await;
    assert!(lost.is_ok(), "the holder learns of its loss");
    drop(g);
    let g2 = timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter asks the server in its turn")
        .unwrap();
    let mut g2 = g2;
    g2.check().await.unwrap();
    let now = holder_pid(&s, key).await.expect("held on the server");
    assert_ne!(now, pid, "a session of its own");
    assert!(other.try_lock("leave").await.unwrap().is_none());
    drop(g2);
}

/// A hot name's transaction-scoped wait runs prepared (`conn/prepared.rs`): its first
/// round waits at once
/// (the name was found busy lately) with no time in its comment, so its statement is the
/// same each time; the session prepares it the second time and from then on binds and
/// executes it, what goes ahead of it (its `BEGIN`, the last grant's `ROLLBACK AND
/// CHAIN` or `pg_advisory_unlock`) under the same `Sync`, in either scope. What must not
/// change: the waiter is shown waiting and named, is
/// granted when the holder lets go, holds the lock (in a transaction, for transaction
/// scope: another handle's try fails) and lets it go on release. The control: the first
/// such waits on the connection are simple queries, the head and the statement together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_names_wait_runs_prepared_and_is_held_named_and_let_go_as_before() {
    let s = PgSchema::new("prepwait").await;
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(1)
        .build()
        .await
        .unwrap();
    let other = s.locks().await;
    for (scope, name) in [(Scope::Transaction, "hot"), (Scope::Session, "hot-s")] {
        let mut simple = 0;
        let mut prepared = None;
        for _ in 0..20 {
            let held = other.lock(name).await.unwrap();
            let key = held.key();
            let waiter = {
                let locks = locks.clone();
                let name = name.to_string();
                tokio::spawn(async move { locks.request(&name).scope(scope).lock().await })
            };
            assert!(
                s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
                    .await,
                "{scope:?}: the request never waited on the server"
            );
            let pid = s.advisory(key).await.iter().find(|r| !r.2).unwrap().0;
            let sent = last_query(&s, pid).await;
            // Asked on the other handle, as an operator's `dblock status` would be: the
            // waiter's handle has its one connection busy waiting.
            let st = other.status(&[name]).await.unwrap();
            assert_eq!(st[0].name.as_deref(), Some(name), "{scope:?}: {st:?}");
            assert_eq!(
                (st[0].holders.len(), st[0].waiters.len()),
                (1, 1),
                "{scope:?}: {st:?}; the waiter sent {sent}"
            );
            drop(held);
            let g = timeout(Duration::from_secs(10), waiter)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            // (A session-scoped wait's simple query is its statement alone, as its
            // prepared form shows: there, every wait after the first two is prepared.)
            if sent.starts_with("SELECT pg_catalog.pg_advisory_")
                && (scope == Scope::Transaction || simple >= 2)
            {
                prepared = Some((g, pid, sent));
                break;
            }
            simple += 1;
            drop(g);
        }
        let (g, pid, sent) = prepared.unwrap_or_else(|| {
            panic!("{scope:?}: the hot name's wait never ran prepared in 20 waits")
        });
        assert!(
            simple >= 1,
            "{scope:?}: the first wait ran prepared: nothing was seen before it"
        );
        assert!(sent.contains(&format!("name={name} ")), "{sent}");
        assert!(!sent.contains(" since="), "{sent}");
        assert!(
            !sent.contains("BEGIN") && !sent.contains("ROLLBACK"),
            "{sent}"
        );
        // Granted, held by the waiter's session.
        let rows = s.advisory(g.key()).await;
        assert_eq!(rows.len(), 1, "{scope:?}: {rows:?}");
        assert_eq!((rows[0].0, rows[0].2), (pid, true), "{scope:?}: {rows:?}");
        assert!(
            other.try_lock(name).await.unwrap().is_none(),
            "{scope:?}: another handle took a name held through a prepared wait"
        );
        if scope == Scope::Transaction {
            // In a transaction of its own, not the statement's implicit one.
            let state: String = s
                .admin()
                .query_one("SELECT state FROM pg_stat_activity WHERE pid = $1", &[&pid])
                .await
                .unwrap()
                .get(0);
            assert_eq!(state, "idle in transaction", "{sent}");
        }
        g.release().await.unwrap();
        assert!(
            other.try_lock(name).await.unwrap().is_some(),
            "{scope:?}: not let go on release"
        );
    }
}

/// A try taken again and again runs as the session's one prepared try statement, its key
/// bound, its head under the same `Sync`, and nothing else — its comment is not sent
/// (`conn/extended.rs`): `pg_stat_activity` shows the prepared statement, marked as this
/// process's and naming no lock (on a handle whose health checks never come), the lock is held in a transaction that holds no
/// snapshot, and is let go on release, every time. Then a handle whose checks come
/// every 50 ms: the first check names the held lock, in `pg_stat_activity` and in
/// `status` asked for every lock. The control: a connection declared behind a pooler
/// sends the same try as a simple query, its statement in the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_taken_again_and_again_runs_prepared_named_and_holds_no_snapshot() {
    let s = PgSchema::new("tryprep").await;
    // Checks an hour apart: none comes while the test runs (the first tick passes at
    // once, before any lock is held).
    let locks = Locks::builder()
        .url(&s.url)
        .max_connections(1)
        .check_interval(Duration::from_secs(3600))
        .build()
        .await
        .unwrap();
    let other = s.locks().await;
    for i in 0..6 {
        let g = locks.lock("free").await.unwrap();
        let pid = s.advisory(g.key()).await[0].0;
        let sent = last_query(&s, pid).await;
        // Prepared, its key bound, no comment sent with it: its text's own mark says
        // whose session it is, and names no lock.
        assert!(
            sent.starts_with("SELECT pg_catalog.pg_try_advisory_xact_lock($1) /* dblock holder=")
                && sent.ends_with(&format!(":{} */", std::process::id()))
                && !sent.contains("name="),
            "time {i}: {sent}"
        );
        let row = s
            .admin()
            .query_one(
                "SELECT state, backend_xmin IS NULL FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap();
        let (state, no_snapshot): (String, bool) = (row.get(0), row.get(1));
        assert_eq!(
            state, "idle in transaction",
            "time {i}: held in a transaction"
        );
        assert!(no_snapshot, "time {i}: a held lock keeps a snapshot");
        assert!(
            other.try_lock("free").await.unwrap().is_none(),
            "time {i}: held"
        );
        drop(g);
        // Let go, and the other handle's probe let go of too before the next time (held
        // when the next request comes, the name would be busy, and waited for).
        assert!(
            s.eventually(10, || async {
                match other.try_lock("free").await.unwrap() {
                    Some(probe) => probe.release().await.is_ok(),
                    None => false,
                }
            })
            .await,
            "time {i}: let go on release"
        );
    }
    // Named by the held lock's first health check: the comment alone, with the grant's
    // time, and `status` of every lock (no name asked for) reads the name from it.
    let checked = Locks::builder()
        .url(&s.url)
        .max_connections(1)
        .check_interval(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    let g = checked.lock("free").await.unwrap();
    let pid = s.advisory(g.key()).await[0].0;
    assert!(
        s.eventually(10, || async {
            let sent = last_query(&s, pid).await;
            sent.starts_with("/* dblock ")
                && sent.contains(" name=free ")
                && sent.contains(" since=")
        })
        .await,
        "never named: {}",
        last_query(&s, pid).await
    );
    // Read by another handle: `checked`'s one connection holds the lock.
    let st = other.status(&[]).await.unwrap();
    let row = st.iter().find(|l| l.key == g.key()).unwrap();
    assert_eq!(row.name.as_deref(), Some("free"), "{st:?}");
    assert_eq!(row.holders.len(), 1, "{st:?}");
    g.release().await.unwrap();
    // The control: on a connection that is not dblock's own session straight to the
    // server (declared behind a pooler), the same try is a simple query, its statement in
    // the session's text.
    let pooled = declared_behind_a_pooler(&s).await;
    for _ in 0..3 {
        let g = pooled.lock("free").await.unwrap();
        let pid = s.advisory(g.key()).await[0].0;
        let sent = last_query(&s, pid).await;
        assert!(
            sent.contains("pg_catalog.pg_try_advisory_xact_lock("),
            "{sent}"
        );
        g.release().await.unwrap();
    }
}

/// A connection that prepared a hot name's wait still ends its session when its handle is
/// dropped: nothing in the connection's shared state keeps its client (a `Parse` awaited
/// between rounds would have, and with it the session, open until the process exits). The
/// control: the session is there before the drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_that_prepared_a_wait_ends_its_session_when_dropped() {
    let s = PgSchema::new("prepclose").await;
    let app = format!("{}-waiter", s.app);
    let url = with_params(
        &pg_url(),
        &[
            (
                "options",
                &format!("-c search_path={0} -c dblock.namespace={0}", s.name),
            ),
            ("application_name", &app),
        ],
    );
    let locks = Locks::builder()
        .url(&url)
        .max_connections(1)
        .build()
        .await
        .unwrap();
    let other = s.locks().await;
    // Waited for three times: the first after a try (its comment has the time), then
    // seen, then prepared (its `Parse` sent) — and not again, so that no later round on
    // the connection reads the `Parse`'s reply.
    for _ in 0..3 {
        let held = other.lock("hot").await.unwrap();
        let key = held.key();
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.lock("hot").await.map(drop) })
        };
        assert!(
            s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
                .await
        );
        drop(held);
        timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
    let sessions = || async {
        let n: i64 = s
            .admin()
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1 || '%'",
                &[&app],
            )
            .await
            .unwrap()
            .get(0);
        n
    };
    assert_eq!(
        sessions().await,
        1,
        "the control: the waiter's session is there"
    );
    drop(locks);
    assert!(
        s.eventually(10, || async { sessions().await == 0 }).await,
        "the dropped handle's session is still open"
    );
}
