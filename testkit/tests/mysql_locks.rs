//! Named locks on MySQL / MariaDB (`MYSQL_URL`): the shared semantics, and each trap of
//! `GET_LOCK` with a test of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use dblock::{Error, Locks};
use dblock_testkit::{MyDb, semantics};
use sqlx::mysql::MySqlPoolOptions;

const T: Duration = Duration::from_secs(10);

/// A handle on `db` whose held locks are checked every `interval`.
async fn checked_every(db: &MyDb, interval: Duration) -> Locks {
    Locks::builder()
        .url(&db.url)
        .check_interval(interval)
        .build()
        .await
        .unwrap()
}

/// The lock name is the documented one, and the server shows it held by the guard's
/// own connection: in `IS_USED_LOCK`, and in MariaDB's `METADATA_LOCK_INFO` (the
/// plugin is loaded for the test) or MySQL's `performance_schema.metadata_locks`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_lock_name_is_what_the_server_shows() {
    let db = MyDb::new("name").await;
    let locks = db.locks().await;
    let name = db.lock_name("autoland:7");
    assert_eq!(
        name,
        dblock::mysql::lock_name(&db.name, locks.key("autoland:7").unwrap())
    );
    assert!(name.len() <= 64 && name.starts_with("dblock:"), "{name}");
    assert_eq!(db.holder(&name).await, None);
    let g = locks.lock("autoland:7").await.unwrap();
    let holder = db.holder(&name).await.expect("IS_USED_LOCK shows a holder");

    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(db.admin())
        .await
        .unwrap();
    let shown: Vec<(u64, String)> = if version.contains("MariaDB") {
        let loaded: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PLUGINS \
             WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE'",
        )
        .fetch_one(db.admin())
        .await
        .unwrap();
        if loaded == 0 {
            // Another test may be installing it at the same moment: either succeeds.
            let _ = sqlx::raw_sql("INSTALL SONAME 'metadata_lock_info'")
                .execute(db.admin())
                .await;
        }
        sqlx::query_as(
            "SELECT CAST(THREAD_ID AS UNSIGNED), TABLE_SCHEMA \
             FROM information_schema.METADATA_LOCK_INFO \
             WHERE LOCK_TYPE = 'User lock' AND TABLE_SCHEMA = ?",
        )
        .bind(&name)
        .fetch_all(db.admin())
        .await
        .unwrap()
    } else {
        sqlx::query_as(
            "SELECT t.PROCESSLIST_ID, m.OBJECT_NAME FROM performance_schema.metadata_locks m \
             JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID \
             WHERE m.OBJECT_TYPE = 'USER LEVEL LOCK' AND m.OBJECT_NAME = ?",
        )
        .bind(&name)
        .fetch_all(db.admin())
        .await
        .unwrap()
    };
    assert_eq!(shown, vec![(holder, name.clone())], "on {version}");
    g.release().await.unwrap();
    assert_eq!(db.holder(&name).await, None, "released and confirmed");
}

/// `GET_LOCK` is re-entrant per session; two guards of one process must still exclude
/// each other, each on a session of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_guards_of_one_process_exclude_each_other() {
    let db = MyDb::new("reentrant").await;
    let locks = db.locks().await;
    let name = db.lock_name("r");
    let g = locks.lock("r").await.unwrap();
    let first = db.holder(&name).await.unwrap();
    assert!(locks.try_lock("r").await.unwrap().is_none(), "same handle");
    let other = db.locks().await;
    assert!(
        other.try_lock("r").await.unwrap().is_none(),
        "another handle"
    );
    assert!(
        locks
            .try_lock_for("r", Duration::from_millis(200))
            .await
            .unwrap()
            .is_none(),
        "a wait too"
    );
    assert_eq!(
        db.holder(&name).await,
        Some(first),
        "still the first session"
    );
    drop(g);
    let again = tokio::time::timeout(T, locks.lock("r"))
        .await
        .unwrap()
        .unwrap();
    let second = db.holder(&name).await.unwrap();
    // The first connection may be reused from the pool, but it holds the lock once:
    // one release frees it.
    again.release().await.unwrap();
    assert_eq!(db.holder(&name).await, None, "one release undoes one grant");
    let _ = second;
}

/// `GET_LOCK` counts whole seconds: a 150 ms deadline must still end the wait after
/// 150 ms, not a second (MariaDB would round 0.15 up to 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_second_deadlines_are_honoured() {
    let db = MyDb::new("subsec").await;
    let locks = db.locks().await;
    let _g = locks.lock("s").await.unwrap();
    for ms in [1u64, 50, 150, 400] {
        let t = Instant::now();
        let r = locks
            .try_lock_for("s", Duration::from_millis(ms))
            .await
            .unwrap();
        let took = t.elapsed();
        assert!(r.is_none());
        assert!(
            took >= Duration::from_millis(ms),
            "{ms} ms: gave up early, {took:?}"
        );
        // Not a timing benchmark: the bound only tells "the deadline" from "a second".
        assert!(
            took < Duration::from_millis(ms + 800),
            "{ms} ms deadline took {took:?}: rounded up to seconds?"
        );
    }
}

/// `KILL CONNECTION` of the holder's session is noticed: `lost()` resolves, `is_held`
/// turns false, `release` reports the loss, and the lock is free for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_is_noticed_as_a_lost_lock() {
    let db = MyDb::new("lost").await;
    let locks = checked_every(&db, Duration::from_millis(50)).await;
    let name = db.lock_name("l");
    let mut g = locks.lock("l").await.unwrap();
    g.check().await.unwrap();
    assert!(g.is_held());
    let lost = g.lost();
    db.kill_connection(db.holder(&name).await.unwrap()).await;
    let reason = tokio::time::timeout(T, lost).await.expect("loss noticed");
    eprintln!("lost: {reason}");
    assert!(!g.is_held());
    assert!(matches!(g.check().await, Err(Error::LockLost { .. })));
    assert!(matches!(g.release().await, Err(Error::LockLost { .. })));
    let other = db.locks().await;
    assert!(
        other.try_lock("l").await.unwrap().is_some(),
        "free for others"
    );
}

/// `check()` asks the server, so a loss is reported even before the periodic check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_a_loss_at_once() {
    let db = MyDb::new("check").await;
    let locks = checked_every(&db, Duration::from_secs(3600)).await;
    let name = db.lock_name("k");
    let mut g = locks.lock("k").await.unwrap();
    db.kill_connection(db.holder(&name).await.unwrap()).await;
    assert!(matches!(g.check().await, Err(Error::LockLost { .. })));
    assert!(!g.is_held());
}

/// A guard nobody asks anything of is still checked once it is a check interval old:
/// its task starts then (the handle's keeper starts it; a lock dropped sooner never has
/// one), so a killed connection is noticed with no `check()` call. The control: the same
/// kill under an hour-long interval goes unnoticed in the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_never_checked_by_hand_is_checked_after_an_interval() {
    let db = MyDb::new("keeper").await;
    for (interval, noticed) in [
        (Duration::from_millis(100), true),
        (Duration::from_secs(3600), false),
    ] {
        let locks = checked_every(&db, interval).await;
        let name = db.lock_name("k");
        let g = locks.lock("k").await.unwrap();
        let lost = g.lost();
        db.kill_connection(db.holder(&name).await.unwrap()).await;
        let within = Duration::from_secs(3);
        let seen = tokio::time::timeout(within, lost).await.is_ok();
        assert_eq!(
            seen, noticed,
            "interval {interval:?}: loss noticed within {within:?}"
        );
        assert_eq!(g.is_held(), !noticed);
    }
}

/// A guard dropped before its task was ever needed: its `lost()` resolves (the lock is
/// no longer held), the lock is free at once for another handle, and an explicit
/// `release` of another such guard answers as the server does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_released_or_dropped_before_its_first_check() {
    let db = MyDb::new("early").await;
    let locks = checked_every(&db, Duration::from_secs(3600)).await;
    let other = db.locks().await;
    let g = locks.lock("k").await.unwrap();
    let lost = g.lost();
    drop(g);
    tokio::time::timeout(T, lost)
        .await
        .expect("lost() resolves once dropped");
    let deadline = Instant::now() + T;
    loop {
        if other.try_lock("k").await.unwrap().is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dropped guard's lock is freed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let g = locks.lock("r").await.unwrap();
    g.release().await.unwrap();
    assert!(
        other.try_lock("r").await.unwrap().is_some(),
        "released at once"
    );
}

/// A handle on the caller's sqlx pool excludes dblock's own connections and returns its
/// connections holding nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_on_an_sqlx_pool_takes_the_same_locks() {
    let db = MyDb::new("pool").await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(3)
        .connect(&db.url)
        .await
        .unwrap();
    let from_pool = Locks::from_sqlx_mysql_pool(pool.clone()).await.unwrap();
    assert_eq!(from_pool.backend_name(), "mysql");
    let own = db.locks().await;
    let g = from_pool.lock("p").await.unwrap();
    assert!(own.try_lock("p").await.unwrap().is_none());
    g.release().await.unwrap();
    let g = own.lock("p").await.unwrap();
    assert!(from_pool.try_lock("p").await.unwrap().is_none());
    drop(g);
    assert!(db.eventually_free(&db.lock_name("p"), 10).await);
    semantics::tasks_of_one_process_exclude_each_other(&from_pool, |l| l.request("t")).await;
    // No pooled connection still holds a lock.
    let held: i64 = sqlx::query_scalar("SELECT COUNT(IS_USED_LOCK(?))")
        .bind(db.lock_name("t"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(held, 0);
}

/// Long names map to a lock name within MySQL's 64 characters; bad URLs are typed
/// errors. (Bad names and unreachable servers: `every_backend_locks.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_names_fit_and_bad_urls_are_typed_errors() {
    let db = MyDb::new("bad").await;
    let locks = db.locks().await;
    let long = "é".repeat(500);
    let g = locks.try_lock(&long).await.unwrap().unwrap();
    assert!(db.lock_name(&long).len() <= 64);
    assert!(db.holder(&db.lock_name(&long)).await.is_some());
    drop(g);
    for url in [
        "mysql://root@127.0.0.1:3306",
        "mariadb://root@127.0.0.1:notaport/test",
    ] {
        assert!(
            matches!(Locks::connect(url).await, Err(Error::InvalidUrl { .. })),
            "{url}"
        );
    }
}

/// A check holds the fencing row until its transaction ends: the next fenced grant
/// waits for the checked transaction to commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_transaction_orders_the_next_grant_after_it() {
    let db = MyDb::new("order").await;
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&db.url)
        .await
        .unwrap();
    let locks = db.locks().await;
    let g = locks.request("o").fenced().lock().await.unwrap();
    let fence = g.fence().unwrap().clone();
    let mut tx = pool.begin().await.unwrap();
    fence.check_mysql(&mut tx).await.unwrap();
    g.release().await.unwrap();
    let next = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.request("o").fenced().lock().await })
    };
    // The next grant's increment waits on the checked row (its INSERT stays running on
    // the server), not on the named lock, which is free.
    let waiting = dblock_testkit::eventually(10, &mut || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE DB = ? AND INFO LIKE 'INSERT INTO dblock_fencing%'",
        )
        .bind(&db.name)
        .fetch_one(db.admin())
        .await
        .unwrap();
        n > 0
    })
    .await;
    assert!(waiting, "the next grant waits for the checked transaction");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!next.is_finished());
    tx.commit().await.unwrap();
    let g2 = tokio::time::timeout(T, next)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(g2.fencing_token(), Some(fence.token() + 1));
}

/// A lease shorter than the checks can honour is refused, not silently shortened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_too_short_to_honour_is_refused() {
    let db = MyDb::new("shortlease").await;
    let locks = db.locks().await;
    assert!(matches!(
        locks
            .request("x")
            .lease(Duration::from_millis(500))
            .try_lock()
            .await,
        Err(Error::InvalidRequest { .. })
    ));
    assert_eq!(db.holder(&db.lock_name("x")).await, None);
}

/// A `socket=` URL (sqlx's spelling) connects over the server's Unix socket and takes
/// the same locks as TCP connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_url_takes_the_same_locks() {
    let db = MyDb::new("socket").await;
    let socket: String = sqlx::query_scalar("SELECT @@socket")
        .fetch_one(db.admin())
        .await
        .unwrap();
    let url = format!("{}?socket={socket}", db.url);
    let over_socket = Locks::connect(&url).await.unwrap();
    let g = over_socket.lock("s").await.unwrap();
    let holder = db.holder(&db.lock_name("s")).await.expect("held");
    let (host,): (String,) =
        sqlx::query_as("SELECT HOST FROM information_schema.PROCESSLIST WHERE ID = ?")
            .bind(holder)
            .fetch_one(db.admin())
            .await
            .unwrap();
    assert_eq!(host, "localhost", "a socket connection, not TCP ({host})");
    let over_tcp = db.locks().await;
    assert!(over_tcp.try_lock("s").await.unwrap().is_none());
    g.release().await.unwrap();
    assert!(over_tcp.try_lock("s").await.unwrap().is_some());
}

/// TLS as sqlx's MySQL driver spells it in the URL (`ssl-mode`, `ssl-ca`), against a
/// throwaway MariaDB that refuses plain TCP: verified connections take locks; a plain
/// one, an unknown CA and a name the certificate does not carry are refused as
/// connect errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_urls_are_verified_and_plain_ones_refused() {
    use dblock_testkit::mariadb_server::TempMariaDb;
    use dblock_testkit::tls::Certs;
    let certs = Certs::generate("localhost", "root");
    let server = tokio::task::block_in_place(|| TempMariaDb::start_tls(&certs));
    let ca = certs.ca.display();
    let verified = server.url(
        "localhost",
        &format!("ssl-mode=verify_identity&ssl-ca={ca}"),
    );
    let a = Locks::connect(&verified).await.unwrap();
    let g = a.lock("t").await.unwrap();
    let b = Locks::connect(&server.url("localhost", &format!("ssl-mode=verify_ca&ssl-ca={ca}")))
        .await
        .unwrap();
    assert!(
        b.try_lock("t").await.unwrap().is_none(),
        "one lock over TLS"
    );
    g.release().await.unwrap();
    assert!(b.try_lock("t").await.unwrap().is_some());
    let other = certs.other_ca.display();
    for (url, why) in [
        (server.url("localhost", "ssl-mode=disabled"), "plain TCP"),
        (
            server.url("localhost", &format!("ssl-mode=verify_ca&ssl-ca={other}")),
            "an unknown CA",
        ),
        (
            server.url(
                "127.0.0.1",
                &format!("ssl-mode=verify_identity&ssl-ca={ca}"),
            ),
            "a name the certificate lacks",
        ),
    ] {
        let r = Locks::connect(&url).await;
        assert!(
            matches!(r, Err(Error::Connect { .. })),
            "{why}: {:?}",
            r.err()
        );
    }
}
