//! Fencing tokens, leases and leader election on every backend — PostgreSQL,
//! MySQL/MariaDB and the embedded SQLite file — from this one source (`every_backend!`),
//! with real faults: ended sessions, paused processes, SIGKILL. The application's
//! writes are checked with the backend's own `Fence::check_*` (testkit `AppDb`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::leader::{Election, Role};
use dblock::{Error, Locks};
use dblock_testkit::appdb::{AppDb, Outcome};
use dblock_testkit::testdb::within;
use dblock_testkit::{TestDb, signal};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// Tokens rise with every fenced grant, across handles; each is committed (visible to
/// another session) by the time the grant is returned; a plain grant does not raise
/// it; shared fenced requests are refused.
async fn fencing_tokens_rise_and_are_committed_before_the_grant(db: &TestDb) {
    let (a, b) = (db.locks().await, db.locks().await);
    let app = AppDb::connect(db.url()).await;
    let mut last = 0;
    for i in 0..6 {
        let locks = if i % 2 == 0 { &a } else { &b };
        let g = locks.request("f").fenced().lock().await.unwrap();
        let t = g.fencing_token().unwrap();
        assert!(t > last, "{t} after {last}");
        assert_eq!(
            app.committed_token(g.key()).await,
            Some(t),
            "visible to another session at once"
        );
        last = t;
        g.release().await.unwrap();
    }
    drop(a.lock("f").await.unwrap());
    let g = b.request("f").fenced().lock().await.unwrap();
    assert_eq!(g.fencing_token(), Some(last + 1));
    g.release().await.unwrap();
    assert!(matches!(
        a.request("f").shared().fenced().try_lock().await,
        Err(Error::InvalidRequest { .. })
    ));
}

/// Kleppmann's scenario, with a real process: holder A pauses (SIGSTOP), its lock is
/// taken from it (its session ended), B takes the lock and writes; A wakes and writes.
/// Returns A's verdict and the resource's final value.
async fn kleppmann(db: &TestDb, fenced: bool) -> (String, String) {
    let app = AppDb::connect(db.url()).await;
    app.setup().await;
    let mut cmd = Command::new(WORKER);
    cmd.args(["kleppmann", db.url(), "res"]);
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
    let held = within(10, "A holds", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    let t_a: i64 = held.strip_prefix("held ").unwrap().parse().unwrap();
    let pid = a.id().unwrap();
    signal(pid, "-STOP");
    db.end_holder("res").await;
    let locks = db.locks().await;
    let b = within(
        10,
        "B gets the lock A lost",
        locks.request("res").fenced().lock(),
    )
    .await
    .unwrap();
    let fence_b = b.fence().unwrap().clone();
    assert!(
        fence_b.token() > t_a,
        "B's {} after A's {t_a}",
        fence_b.token()
    );
    assert_eq!(
        app.write_resource("B", fence_b.token(), Some(&fence_b))
            .await,
        Outcome::Written
    );
    signal(pid, "-CONT");
    a.stdin.take().unwrap().write_all(b"go\n").await.unwrap();
    let verdict = within(10, "A's verdict", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    let _ = a.wait().await;
    drop(b);
    (verdict, app.value().await)
}

/// The stale holder's fenced write is refused and B's work stands; the control without
/// the check loses B's work.
async fn a_paused_holder_that_lost_its_lock_cannot_overwrite_the_next_holders_work(db: &TestDb) {
    let (verdict, value) = kleppmann(db, true).await;
    assert_eq!(verdict, "rejected", "the stale holder's fenced write");
    assert_eq!(value, "B", "B's work stands");
    let (verdict, value) = kleppmann(db, false).await;
    assert_eq!(
        (verdict.as_str(), value.as_str()),
        ("written", "A"),
        "the control must lose B's work"
    );
}

/// A lease frees the lock of a holder that falls silent (a paused process), enforced by
/// the server; a live holder keeps it however long it holds. The embedded backend has
/// no leases — a lock ends with its process, however long that is paused — and the
/// test shows that instead.
async fn a_lease_frees_a_paused_holders_lock(db: &TestDb) {
    let other = db.locks().await;
    let lease_ms = 1000u64;
    let mut holder = Command::new(WORKER)
        .args(["hold", db.url(), "l", "--lease-ms", &lease_ms.to_string()])
        .args(["--check-ms", "100"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    let held = within(10, "held", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    assert!(held.starts_with("held"));
    tokio::time::sleep(Duration::from_millis(2 * lease_ms + 500)).await;
    assert!(
        other.try_lock("l").await.unwrap().is_none(),
        "a live holder keeps its lease"
    );
    let pid = holder.id().unwrap();
    signal(pid, "-STOP");
    let paused = Instant::now();
    let wait = if db.has_leases() {
        10_000
    } else {
        3 * lease_ms
    };
    let g = other
        .try_lock_for("l", Duration::from_millis(wait))
        .await
        .unwrap();
    let took = paused.elapsed();
    signal(pid, "-CONT");
    if db.has_leases() {
        eprintln!("a paused holder's lock freed after {took:?} (lease {lease_ms} ms)");
        assert!(g.is_some(), "freed within the lease");
        assert!(
            took >= Duration::from_millis(lease_ms / 2) && took < Duration::from_secs(4),
            "{took:?}"
        );
    } else {
        assert!(g.is_none(), "without leases a paused holder keeps its lock");
    }
    drop(g);
    let _ = holder.start_kill();
    let _ = holder.wait().await;
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
                .args(["candidate", url, "leader-election"])
                .args([check_ms.to_string(), lease_ms.to_string()])
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

/// Whether a write of an older term was committed after one of a newer term.
fn inverted(log: &[i64]) -> bool {
    log.windows(2).any(|w| w[1] < w[0])
}

fn token_of(line: &str) -> i64 {
    line["leader ".len()..].parse().unwrap()
}

/// A leader killed with SIGKILL is replaced at once; so is a leader whose session is
/// ended, which is told (where the backend tells: not the embedded one, whose locks end
/// only with their process). No older term's write lands after a newer one's.
async fn a_new_leader_takes_over_at_once_when_the_leader_dies_or_is_cut_off(db: &TestDb) {
    let app = AppDb::connect(db.url()).await;
    app.setup().await;
    let mut c = Candidates::start(db.url(), 3, 200, 8000, &[]);
    let (first, line, _) = c.next("leader ", None, Duration::from_secs(10)).await;
    let t1 = token_of(&line);
    assert!(db.until_waiting("leader-election", 2).await, "two wait");
    let killed = Instant::now();
    c.children[first].start_kill().unwrap();
    let (second, line, at) = c.next("leader ", Some(first), Duration::from_secs(5)).await;
    let t2 = token_of(&line);
    let mut newest = t2;
    eprintln!("after SIGKILL: new leader in {:?}", at - killed);
    assert!(at - killed < Duration::from_secs(1), "{:?}", at - killed);
    assert!(t2 > t1);
    if db.tells_loss() {
        assert!(db.until_waiting("leader-election", 1).await, "one waits");
        let cut = Instant::now();
        db.end_holder("leader-election").await;
        let (_, _, told) = c.next("lost", None, Duration::from_secs(5)).await;
        let (third, line, at) = c
            .next("leader ", Some(second), Duration::from_secs(5))
            .await;
        eprintln!(
            "after the session ended: old leader told in {:?}, new leader ({third}) in {:?}",
            told - cut,
            at - cut
        );
        assert!(at - cut < Duration::from_secs(1), "{:?}", at - cut);
        assert!(token_of(&line) > t2);
        newest = token_of(&line);
    }
    // Polled, not slept for: the newest leader's writes arrive.
    let wrote = dblock_testkit::eventually(10, &mut || async {
        app.leader_log().await.contains(&newest)
    })
    .await;
    let log = app.leader_log().await;
    assert!(wrote, "the newest leader wrote: {log:?}");
    assert!(
        !inverted(&log),
        "an older term wrote after a newer: {log:?}"
    );
}

/// A leader paused past its lease is replaced; when it wakes and keeps writing, fencing
/// refuses its writes. The control without fencing shows both leaders' writes landing.
/// (No leases on the embedded backend: the paused leader stays leader, nobody else is.)
async fn a_paused_leader_is_replaced_within_its_lease_and_fenced_off(db: &TestDb) {
    let app = AppDb::connect(db.url()).await;
    for fenced in [true, false] {
        app.setup().await;
        let extra: &[&str] = if fenced {
            &["--stubborn"]
        } else {
            &["--stubborn", "--no-fence"]
        };
        let lease = Duration::from_millis(1500);
        let mut c = Candidates::start(db.url(), 2, 200, lease.as_millis() as u64, extra);
        let (first, _, _) = c.next("leader ", None, Duration::from_secs(10)).await;
        assert!(
            db.until_waiting("leader-election", 1).await,
            "the other waits"
        );
        let pid = c.children[first].id().unwrap();
        signal(pid, "-STOP");
        let paused = Instant::now();
        if !db.has_leases() {
            tokio::time::sleep(lease * 2).await;
            assert_eq!(db.holders("leader-election").await, 1);
            assert_eq!(db.waiting("leader-election").await, 1, "still one leader");
            signal(pid, "-CONT");
            return;
        }
        let (_, _, at) = c
            .next("leader ", Some(first), lease + Duration::from_secs(5))
            .await;
        let took = at - paused;
        eprintln!("fenced={fenced}: new leader {took:?} after the pause (lease {lease:?})");
        // The idle timer starts at the leader's last check, up to a check interval
        // (200 ms) before the pause; MySQL counts whole seconds (the lease rounds up).
        assert!(
            took >= lease - Duration::from_millis(300),
            "early: {took:?}"
        );
        assert!(took < lease + Duration::from_secs(2), "late: {took:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        signal(pid, "-CONT");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let log = app.leader_log().await;
        if fenced {
            c.next("rejected ", None, Duration::from_secs(5)).await;
            assert!(
                !inverted(&log),
                "fencing kept the deposed leader out: {log:?}"
            );
        } else {
            assert!(inverted(&log), "the control must let it write: {log:?}");
        }
        for ch in c.children.iter_mut() {
            let _ = ch.start_kill();
        }
    }
}

/// `Election::watch` and `leader()` report leadership; a second candidate waits while
/// the first leads and takes over when it resigns.
async fn leadership_changes_are_observable(db: &TestDb) {
    // A 5 s lease needs checks that notice a silent connection sooner than the defaults.
    let locks: Locks = db
        .builder()
        .check_timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let e = Election::new(&locks, "obs").lease(Duration::from_secs(5));
    let mut w = e.watch();
    assert_eq!(*w.borrow(), Role::Follower);
    assert_eq!(e.leader().await.unwrap(), None);
    let term = within(10, "campaign", e.campaign()).await.unwrap();
    within(10, "watch", w.changed()).await.unwrap();
    let token = term.token();
    assert_eq!(*w.borrow(), Role::Leader { token });
    let info = e.leader().await.unwrap().unwrap();
    assert_eq!(info.token, term.token());
    assert!(info.holder.ends_with(&format!(":{}", std::process::id())));
    let other = Election::new(&locks, "obs");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), other.campaign())
            .await
            .is_err(),
        "one leader at a time"
    );
    term.resign().await.unwrap();
    within(10, "watch", w.changed()).await.unwrap();
    assert_eq!(*w.borrow(), Role::Follower);
    let t2 = within(5, "the other's campaign", other.campaign())
        .await
        .unwrap();
    assert!(t2.token() > token);
    let seen = dblock_testkit::eventually(5, &mut || async {
        e.leader().await.unwrap().map(|l| l.token) == Some(t2.token())
    })
    .await;
    assert!(seen, "leader() names the new term");
}

dblock_testkit::every_backend!(
    fencing_tokens_rise_and_are_committed_before_the_grant,
    a_paused_holder_that_lost_its_lock_cannot_overwrite_the_next_holders_work,
    a_lease_frees_a_paused_holders_lock,
    a_new_leader_takes_over_at_once_when_the_leader_dies_or_is_cut_off,
    a_paused_leader_is_replaced_within_its_lease_and_fenced_off,
    leadership_changes_are_observable,
);
