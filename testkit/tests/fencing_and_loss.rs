//! Losing a lock, fencing stale holders, and electing one leader — with real faults:
//! terminated backends, a restarted server, paused processes, SIGKILL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::{Error, Locks, LossReason, Scope};
use dblock_testkit::cluster::TempCluster;
use dblock_testkit::{PgSchema, eventually, signal};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// Kleppmann's scenario: holder A pauses, loses its lock, B takes it and writes; A wakes
/// and writes. Returns A's verdict and the resource's final value.
async fn kleppmann(s: &PgSchema, fenced: bool) -> (String, String) {
    s.admin()
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS \"{0}\".resource (id int PRIMARY KEY, value text, token bigint);
             DELETE FROM \"{0}\".resource; INSERT INTO \"{0}\".resource VALUES (1, 'initial', 0);",
            s.name
        ))
        .await
        .unwrap();
    let mut cmd = Command::new(WORKER);
    cmd.args(["kleppmann", &s.url, "res"]);
    if !fenced {
        cmd.arg("--no-fence");
    }
    let mut a = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(a.stdout.take().unwrap()).lines();
    let held = lines.next_line().await.unwrap().unwrap();
    let t_a: i64 = held.strip_prefix("held ").unwrap().parse().unwrap();
    let pid = a.id().unwrap();

    // A pauses; meanwhile its lock is lost (its backend is terminated).
    signal(pid, "-STOP");
    let locks = s.locks().await;
    let key = locks.key("res").unwrap();
    assert_eq!(s.terminate_holders(key).await, 1);

    // B takes the lock and does its work, fenced.
    let b = tokio::time::timeout(
        Duration::from_secs(10),
        locks.request("res").fenced().lock(),
    )
    .await
    .expect("B gets the lock A lost")
    .unwrap();
    let fence_b = b.fence().unwrap().clone();
    assert!(
        fence_b.token() > t_a,
        "B's token {} after A's {t_a}",
        fence_b.token()
    );
    let pool = sqlx::PgPool::connect(&s.url).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("UPDATE resource SET value = 'B', token = $1 WHERE id = 1")
        .bind(fence_b.token())
        .execute(&mut *tx)
        .await
        .unwrap();
    fence_b.check_postgres(&mut tx).await.unwrap();
    tx.commit().await.unwrap();

    // A wakes and writes as if it still held the lock.
    signal(pid, "-CONT");
    let mut stdin = a.stdin.take().unwrap();
    stdin.write_all(b"go\n").await.unwrap();
    let verdict = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let _ = a.wait().await;
    let value: String = s
        .admin()
        .query_one(
            &format!("SELECT value FROM \"{}\".resource WHERE id = 1", s.name),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    drop(b);
    (verdict, value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_that_lost_its_lock_cannot_overwrite_the_next_holders_work() {
    let s = PgSchema::new("kleppmann").await;
    let (verdict, value) = kleppmann(&s, true).await;
    assert_eq!(
        verdict, "rejected",
        "the stale holder's fenced write is refused"
    );
    assert_eq!(value, "B", "B's work stands");
    // The control: the same run without the fence check overwrites B's work.
    let (verdict, value) = kleppmann(&s, false).await;
    assert_eq!(
        (verdict.as_str(), value.as_str()),
        ("written", "A"),
        "the control must lose B's work"
    );
}

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
    for scope in ["transaction", "session"] {
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

struct Candidates {
    children: Vec<Child>,
    events: mpsc::UnboundedReceiver<(usize, String, Instant)>,
    /// Events received but not yet asked for: lines of different candidates may arrive
    /// in any order (a new leader's line before the old leader's "lost").
    backlog: Vec<(usize, String, Instant)>,
}

impl Candidates {
    fn start(url: &str, n: usize, check_ms: u64, lease_ms: u64, extra: &[&str]) -> Candidates {
        let (tx, events) = mpsc::unbounded_channel();
        let mut children = Vec::new();
        for i in 0..n {
            let mut child = Command::new(WORKER)
                .args([
                    "candidate",
                    url,
                    "leader-election",
                    &check_ms.to_string(),
                    &lease_ms.to_string(),
                ])
                .args(extra)
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            let tx = tx.clone();
            tokio::spawn(async move {
                while let Ok(Some(l)) = lines.next_line().await {
                    let _ = tx.send((i, l, Instant::now()));
                }
            });
            children.push(child);
        }
        Candidates {
            children,
            events,
            backlog: Vec::new(),
        }
    }

    /// The next event whose line starts with `prefix`, from any candidate but `not`.
    async fn next(
        &mut self,
        prefix: &str,
        not: Option<usize>,
        within: Duration,
    ) -> (usize, String, Instant) {
        let wanted =
            |(i, l, _): &(usize, String, Instant)| l.starts_with(prefix) && Some(*i) != not;
        if let Some(k) = self.backlog.iter().position(wanted) {
            return self.backlog.remove(k);
        }
        let end = Instant::now() + within;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.events.recv()).await {
                Ok(Some(e)) if wanted(&e) => return e,
                Ok(Some(e)) => self.backlog.push(e),
                other => panic!("no {prefix:?} within {within:?}: {other:?}"),
            }
        }
    }
}

async fn leader_log(s: &PgSchema) -> Vec<i64> {
    s.admin()
        .query(
            &format!("SELECT token FROM \"{}\".leader_log ORDER BY id", s.name),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Whether a write of an older term was committed after one of a newer term.
fn inverted(log: &[i64]) -> bool {
    let mut max = i64::MIN;
    for &t in log {
        if t < max {
            return true;
        }
        max = max.max(t);
    }
    false
}

async fn log_table(s: &PgSchema) {
    s.admin()
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS \"{0}\".leader_log (id bigserial PRIMARY KEY, token bigint NOT NULL);
             TRUNCATE \"{0}\".leader_log;",
            s.name
        ))
        .await
        .unwrap();
}

/// A leader killed with SIGKILL, or whose connection is terminated, is replaced at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_takes_over_at_once_when_the_leader_dies_or_is_cut_off() {
    let s = PgSchema::new("election").await;
    log_table(&s).await;
    let mut c = Candidates::start(&s.url, 3, 200, 2000, &[]);
    let (first, line, _) = c.next("leader ", None, Duration::from_secs(10)).await;
    let t1: i64 = line[7..].parse().unwrap();
    let locks = s.locks().await;
    let key = locks.key("leader-election").unwrap();
    // The other two candidates queue on the server (observed, not slept for).
    let queued = |n: usize| {
        let s = &s;
        move || async move { s.advisory(key).await.iter().filter(|r| !r.2).count() == n }
    };
    assert!(s.eventually(10, queued(2)).await, "two candidates wait");

    // SIGKILL: the server frees the lock when the socket closes.
    let killed = Instant::now();
    c.children[first].start_kill().unwrap();
    let (second, line, at) = c.next("leader ", Some(first), Duration::from_secs(5)).await;
    let t2: i64 = line[7..].parse().unwrap();
    eprintln!("after SIGKILL: new leader in {:?}", at - killed);
    assert!(
        at - killed < Duration::from_secs(1),
        "took {:?}",
        at - killed
    );
    assert!(t2 > t1);

    // The leader's connection terminated: it is told, and another candidate takes over.
    assert!(
        s.eventually(10, queued(1)).await,
        "the third candidate waits"
    );
    let cut = Instant::now();
    assert_eq!(s.terminate_holders(key).await, 1);
    let (_, _, told) = c.next("lost", None, Duration::from_secs(5)).await;
    let (third, line, at) = c
        .next("leader ", Some(second), Duration::from_secs(5))
        .await;
    eprintln!(
        "after termination: old leader told in {:?}, new leader ({third}) in {:?}",
        told - cut,
        at - cut
    );
    assert!(at - cut < Duration::from_secs(1));
    assert!(line[7..].parse::<i64>().unwrap() > t2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = leader_log(&s).await;
    assert!(!log.is_empty(), "leaders wrote");
    assert!(
        !inverted(&log),
        "no older term's write after a newer one: {log:?}"
    );
}

/// A leader paused past its lease is replaced; when it wakes and keeps writing, fencing
/// refuses its writes. The control without fencing shows both leaders' writes landing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_is_replaced_within_its_lease_and_fenced_off() {
    let s = PgSchema::new("paused_leader").await;
    for fenced in [true, false] {
        log_table(&s).await;
        let extra: &[&str] = if fenced {
            &["--stubborn"]
        } else {
            &["--stubborn", "--no-fence"]
        };
        let lease = Duration::from_millis(1500);
        let mut c = Candidates::start(&s.url, 2, 200, lease.as_millis() as u64, extra);
        let (first, _, _) = c.next("leader ", None, Duration::from_secs(10)).await;
        // The other candidate queues on the server (observed, not slept for).
        let key = s.locks().await.key("leader-election").unwrap();
        assert!(
            s.eventually(10, || async { s.advisory(key).await.iter().any(|r| !r.2) })
                .await,
            "fenced={fenced}: the other candidate waits"
        );
        let pid = c.children[first].id().unwrap();
        signal(pid, "-STOP");
        let paused = Instant::now();
        let (_, _, at) = c
            .next("leader ", Some(first), lease + Duration::from_secs(5))
            .await;
        let took = at - paused;
        eprintln!("fenced={fenced}: new leader {took:?} after the leader paused (lease {lease:?})");
        // The server's idle timer starts at the leader's last check, up to one check
        // interval (200 ms) before the pause.
        assert!(
            took >= lease - Duration::from_millis(300),
            "not before the lease: {took:?}"
        );
        assert!(
            took < lease + Duration::from_secs(2),
            "within the lease: {took:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        signal(pid, "-CONT");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let log = leader_log(&s).await;
        if fenced {
            c.next("rejected ", None, Duration::from_secs(5)).await;
            assert!(
                !inverted(&log),
                "fencing kept the deposed leader out: {log:?}"
            );
        } else {
            assert!(
                inverted(&log),
                "the control must let the deposed leader write: {log:?}"
            );
        }
        for ch in c.children.iter_mut() {
            let _ = ch.start_kill();
        }
    }
}

/// Election::watch and leader() report leadership.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leadership_changes_are_observable() {
    use dblock::leader::{Election, Role};
    let s = PgSchema::new("observe").await;
    // A 5 s lease needs checks that notice a silent connection sooner than the defaults.
    let locks = dblock::Locks::builder()
        .url(&s.url)
        .check_timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let e = Election::new(&locks, "obs").lease(Duration::from_secs(5));
    let mut w = e.watch();
    assert_eq!(*w.borrow(), Role::Follower);
    assert_eq!(e.leader().await.unwrap(), None);
    let term = e.campaign().await.unwrap();
    w.changed().await.unwrap();
    assert_eq!(
        *w.borrow(),
        Role::Leader {
            token: term.token()
        }
    );
    let info = e.leader().await.unwrap().unwrap();
    assert_eq!(info.token, term.token());
    assert!(info.holder.ends_with(&format!(":{}", std::process::id())));
    // A second candidate waits while the first leads.
    let other = Election::new(&locks, "obs");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), other.campaign())
            .await
            .is_err()
    );
    term.resign().await.unwrap();
    w.changed().await.unwrap();
    assert_eq!(*w.borrow(), Role::Follower);
    let t2 = tokio::time::timeout(Duration::from_secs(5), other.campaign())
        .await
        .unwrap()
        .unwrap();
    assert!(
        eventually(5, &mut || async {
            e.leader().await.unwrap().map(|l| l.token) == Some(t2.token())
        })
        .await
    );
}

/// SQLite: fenced writes to the same database file refuse a stale token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_writes_on_sqlite_refuse_a_stale_token() {
    let db = dblock_testkit::SqliteDb::new();
    let locks = db.locks().await;
    let old = locks.request("r").fenced().lock().await.unwrap();
    let stale = old.fence().unwrap().clone();
    drop(old);
    let new = locks.request("r").fenced().lock().await.unwrap();
    let pool = sqlx::SqlitePool::connect(&format!("sqlite:{}", db.path.display()))
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert!(matches!(
        stale.check_sqlite(&mut tx).await,
        Err(Error::StaleToken { .. })
    ));
    new.fence().unwrap().check_sqlite(&mut tx).await.unwrap();
    tx.rollback().await.unwrap();
}
