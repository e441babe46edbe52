//! Fencing tokens and leader election on MySQL / MariaDB (`MYSQL_URL`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Error, Locks};
use dblock_testkit::MyDb;
use sqlx::mysql::MySqlPoolOptions;

const T: Duration = Duration::from_secs(10);

async fn fast_loss(db: &MyDb) -> Locks {
    Locks::builder()
        .url(&db.url)
        .check_interval(Duration::from_millis(50))
        .build()
        .await
        .unwrap()
}

/// Tokens rise with every fenced grant, across handles, and each is committed (visible
/// to another session) by the time the grant is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_rise_and_are_committed_before_the_grant() {
    let db = MyDb::new("tokens").await;
    let (a, b) = (db.locks().await, db.locks().await);
    let mut last = 0;
    for i in 0..6 {
        let locks = if i % 2 == 0 { &a } else { &b };
        let g = locks.request("f").fenced().lock().await.unwrap();
        let t = g.fencing_token().unwrap();
        assert!(t > last, "{t} after {last}");
        let sql = format!(
            "SELECT token FROM `{}`.dblock_fencing WHERE `key` = ?",
            db.name
        );
        let committed: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(g.key().as_i64())
            .fetch_one(db.admin())
            .await
            .unwrap();
        assert_eq!(committed, t, "visible to another session at once");
        last = t;
        g.release().await.unwrap();
    }
    // A plain grant does not raise the token.
    drop(a.lock("f").await.unwrap());
    let g = b.request("f").fenced().lock().await.unwrap();
    assert_eq!(g.fencing_token(), Some(last + 1));
    assert!(matches!(
        a.request("f").shared().fenced().try_lock().await,
        Err(Error::Unsupported(_))
    ));
}

/// Kleppmann's scenario: a holder loses its lock unnoticed, another takes it; the stale
/// holder's write is refused by the fence check in its transaction, the new holder's
/// passes. The control: the same stale write without the check goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holders_fenced_write_is_refused() {
    let db = MyDb::new("kleppmann").await;
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&db.url)
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE resource (id INT PRIMARY KEY, value TEXT, token BIGINT) ENGINE=InnoDB;
         INSERT INTO resource VALUES (1, '', 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let a_locks = fast_loss(&db).await;
    let a = a_locks.request("res").fenced().lock().await.unwrap();
    let a_fence = a.fence().unwrap().clone();
    // A pauses; meanwhile its session is killed and B takes the lock.
    db.kill_connection(db.holder(&db.lock_name("res")).await.unwrap())
        .await;
    tokio::time::timeout(T, a.lost()).await.unwrap();
    let b_locks = db.locks().await;
    let b = tokio::time::timeout(T, b_locks.request("res").fenced().lock())
        .await
        .unwrap()
        .unwrap();
    let b_fence = b.fence().unwrap().clone();
    assert!(b_fence.token() > a_fence.token());

    let write = |value: &'static str, token: i64| {
        sqlx::query("UPDATE resource SET value = ?, token = ? WHERE id = 1")
            .bind(value)
            .bind(token)
    };
    // B writes, checked.
    let mut tx = pool.begin().await.unwrap();
    write("B", b_fence.token()).execute(&mut *tx).await.unwrap();
    b_fence.check_mysql(&mut tx).await.unwrap();
    tx.commit().await.unwrap();
    // A resumes and writes, checked: refused.
    let mut tx = pool.begin().await.unwrap();
    write("A", a_fence.token()).execute(&mut *tx).await.unwrap();
    match a_fence.check_mysql(&mut tx).await {
        Err(Error::StaleToken { token, latest, .. }) => {
            assert_eq!((token, latest), (a_fence.token(), b_fence.token()));
        }
        other => panic!("{other:?}"),
    }
    tx.rollback().await.unwrap();
    let value: String = sqlx::query_scalar("SELECT value FROM resource WHERE id = 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(value, "B", "the stale write was refused");
    // The control: without the check, A's stale write overwrites B's.
    let mut tx = pool.begin().await.unwrap();
    write("A", a_fence.token()).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    let value: String = sqlx::query_scalar("SELECT value FROM resource WHERE id = 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        value, "A",
        "unfenced, the stale holder wins: the race is real"
    );
    drop(b);
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

/// One leader at a time; its term's token is the latest grant; when its session is
/// killed a waiting candidate takes over with a higher token, and `leader()` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_election_hands_over_when_the_leaders_session_dies() {
    let db = MyDb::new("leader").await;
    let (l1, l2) = (fast_loss(&db).await, fast_loss(&db).await);
    let e1 = dblock::leader::Election::new(&l1, "scheduler");
    let e2 = dblock::leader::Election::new(&l2, "scheduler");
    assert_eq!(e1.leader().await.unwrap(), None);
    let t1 = tokio::time::timeout(T, e1.campaign())
        .await
        .unwrap()
        .unwrap();
    let info = e2.leader().await.unwrap().unwrap();
    assert_eq!(info.token, t1.token());
    assert!(info.holder.ends_with(&format!(":{}", std::process::id())));
    let mut watch = e1.watch();
    let second = tokio::spawn(async move {
        let t = e2.campaign().await;
        (t, e2)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!second.is_finished(), "one leader at a time");
    db.kill_connection(db.holder(&db.lock_name("scheduler")).await.unwrap())
        .await;
    tokio::time::timeout(T, t1.lost()).await.unwrap();
    assert!(!t1.is_leader());
    tokio::time::timeout(T, watch.wait_for(|r| *r == dblock::leader::Role::Follower))
        .await
        .unwrap()
        .unwrap();
    let (t2, e2) = tokio::time::timeout(T, second).await.unwrap().unwrap();
    let t2 = t2.unwrap();
    assert!(t2.token() > t1.token());
    assert_eq!(e2.leader().await.unwrap().unwrap().token, t2.token());
    t2.resign().await.unwrap();
}

/// A lease frees the lock of a holder that falls silent (a SIGSTOPped process): the
/// server closes its idle session after `wait_timeout` = the lease; a live holder keeps
/// it however long it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_frees_a_paused_holders_lock() {
    use tokio::io::AsyncBufReadExt;
    let db = MyDb::new("lease").await;
    let other = db.locks().await;
    let mut holder = tokio::process::Command::new(env!("CARGO_BIN_EXE_dblock-worker"))
        .args([
            "hold",
            &db.url,
            "l",
            "--lease-ms",
            "1000",
            "--check-ms",
            "100",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(holder.stdout.take().unwrap()).lines();
    let held = tokio::time::timeout(T, lines.next_line())
        .await
        .unwrap()
        .unwrap();
    assert!(held.unwrap().starts_with("held"));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        other.try_lock("l").await.unwrap().is_none(),
        "a live holder keeps its lease"
    );
    let pid = holder.id().unwrap();
    dblock_testkit::signal(pid, "-STOP");
    let paused = std::time::Instant::now();
    let g = other.try_lock_for("l", T).await.unwrap();
    let took = paused.elapsed();
    dblock_testkit::signal(pid, "-CONT");
    eprintln!("a paused holder's lock freed after {took:?} (lease 1 s)");
    assert!(g.is_some(), "freed within the lease");
    assert!(took >= Duration::from_millis(500), "{took:?}");
    drop(g);
    let _ = holder.start_kill();
    let _ = holder.wait().await;
    // The lease is refused when it cannot be honoured.
    assert!(matches!(
        other
            .request("x")
            .lease(Duration::from_millis(500))
            .try_lock()
            .await,
        Err(Error::Unsupported(_))
    ));
}
