//! Semaphores (`Locks::semaphore`) across real OS processes and in one, on PostgreSQL,
//! MySQL/MariaDB and the embedded SQLite file: one source, every backend.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::process::Stdio;
use std::time::{Duration, Instant};

use dblock::Locks;
use dblock_testkit::TestDb;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// `procs` worker processes, started at once, each taking a slot of a semaphore of
/// `limit` `iterations` times (or, unlocked, not); the most holders any of them saw
/// inside at once.
async fn most_inside_at_once(url: &str, procs: usize, limit: u32, locked: bool) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    for _ in 0..procs {
        let mut cmd = Command::new(WORKER);
        cmd.args(["semaphore", url, "exports", &limit.to_string(), "8", "20"])
            .arg(dir.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if !locked {
            cmd.arg("--no-lock");
        }
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
        assert!(
            matches!(&ready, Ok(Ok(Some(l))) if l == "ready"),
            "{ready:?}"
        );
        children.push((child, lines));
    }
    // Every process is connected and waiting: start them together.
    for (child, _) in &mut children {
        child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"go\n")
            .await
            .unwrap();
    }
    let mut most = 0;
    for (mut child, mut lines) in children {
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .expect("the worker finishes")
            .unwrap()
            .unwrap();
        most = most.max(line.strip_prefix("max=").unwrap().parse().unwrap());
        assert!(child.wait().await.unwrap().success());
    }
    most
}

/// 8 processes, a semaphore of 3: never more than 3 inside, and 3 are reached; the
/// control (the same processes without the semaphore) has more than 3 inside at once.
async fn eight_processes_never_exceed_a_limit_of_three(db: &TestDb) {
    let url = db.url();
    let most = most_inside_at_once(url, 8, 3, true).await;
    assert_eq!(most, 3, "at most 3 inside at once, and 3 reached");
    let control = most_inside_at_once(url, 8, 3, false).await;
    eprintln!("without the semaphore: {control} inside at once");
    assert!(control > 3, "the control must exceed the limit: {control}");
}

async fn spawn_reporting(
    args: &[&str],
) -> (
    Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut child = Command::new(WORKER)
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// The number after `prefix ` on the next line.
async fn next_number(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    prefix: &str,
    within: Duration,
) -> Option<u32> {
    let line = tokio::time::timeout(within, lines.next_line()).await.ok()?;
    let line = line.unwrap()?;
    line.strip_prefix(prefix)?.trim().parse().ok()
}

/// Three processes hold the three slots; a fourth waits. A holder killed with SIGKILL
/// releases nothing itself: the server (or the kernel) frees its slot, and the waiter
/// gets that slot.
async fn a_killed_holder_frees_its_slot_for_a_waiter(db: &TestDb) {
    let url = db.url();
    let mut holders = Vec::new();
    let mut slots = BTreeSet::new();
    for _ in 0..3 {
        let (child, mut lines) = spawn_reporting(&["hold-slot", url, "exports", "3"]).await;
        let slot = next_number(&mut lines, "held", Duration::from_secs(30))
            .await
            .expect("a slot is free for each of three holders");
        slots.insert(slot);
        holders.push((child, slot));
    }
    assert_eq!(slots, BTreeSet::from([0, 1, 2]), "each holds its own slot");
    let (mut waiter, mut wl) = spawn_reporting(&["wait-slot", url, "exports", "3"]).await;
    let early = next_number(&mut wl, "acquired", Duration::from_millis(700)).await;
    assert_eq!(early, None, "no slot is free while three are held");
    let (mut victim, freed) = holders.remove(1);
    let killed = Instant::now();
    victim.start_kill().unwrap(); // SIGKILL
    let got = next_number(&mut wl, "acquired", Duration::from_secs(20)).await;
    eprintln!(
        "waiter got slot {got:?} {:?} after the holder's SIGKILL",
        killed.elapsed()
    );
    assert_eq!(
        got,
        Some(freed),
        "the waiter takes the killed holder's slot"
    );
    let _ = victim.wait().await;
    assert!(waiter.wait().await.unwrap().success());
}

/// Takes every slot of `name` (limit `limit`) with `try_lock`, or says it could not.
async fn all_slots_free(locks: &Locks, name: &str, limit: u32) -> bool {
    let mut guards = Vec::new();
    for _ in 0..limit {
        match locks.semaphore(name, limit).try_lock().await.unwrap() {
            Some(g) => guards.push(g),
            None => return false,
        }
    }
    for g in guards {
        g.release().await.unwrap();
    }
    true
}

/// With every slot held, `try_lock` answers `None`, a deadline wait gives up no earlier
/// than its deadline, a cancelled wait ends; none of them leaves a slot held. A deadline
/// wait gets a slot freed in time.
async fn try_deadline_and_cancel_leave_no_slot_held(db: &TestDb) {
    let url = db.url();
    let locks = Locks::connect(url).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(locks.semaphore("s", 3).try_lock().await.unwrap().unwrap());
    }
    let slots: BTreeSet<u32> = held.iter().map(|g| g.slot()).collect();
    assert_eq!(slots, BTreeSet::from([0, 1, 2]));
    assert_eq!(held[0].limit(), 3);
    assert_eq!(held[0].name(), "s");
    assert!(locks.semaphore("s", 3).try_lock().await.unwrap().is_none());
    let t = Instant::now();
    let r = locks
        .semaphore("s", 3)
        .try_lock_for(Duration::from_millis(300))
        .await
        .unwrap();
    assert!(r.is_none());
    assert!(t.elapsed() >= Duration::from_millis(300), "waited it out");
    let cancelled =
        tokio::time::timeout(Duration::from_millis(300), locks.semaphore("s", 3).lock()).await;
    assert!(cancelled.is_err(), "the wait is still waiting when dropped");

    // A waiter with a deadline gets a slot freed in time.
    let mut waiter = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .semaphore("s", 3)
                .try_lock_for(Duration::from_secs(20))
                .await
        })
    };
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut waiter)
            .await
            .is_err(),
        "the waiter waits while every slot is held"
    );
    let freed = held.pop().unwrap();
    let freed_slot = freed.slot();
    freed.release().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("granted within its deadline")
        .unwrap()
        .unwrap()
        .expect("a slot");
    assert_eq!(got.slot(), freed_slot);
    got.release().await.unwrap();
    for g in held {
        g.release().await.unwrap();
    }
    // Nothing the refused, timed-out or cancelled requests did is left held.
    let free = dblock_testkit::eventually(5, &mut || all_slots_free(&locks, "s", 3)).await;
    assert!(free, "every slot is free again");
}

/// A holder with limit m takes one of the first m slots: with the three slots of a
/// limit-3 semaphore held, a limit-2 request is refused and a limit-5 one gets slot 3
/// or 4.
async fn holders_with_a_smaller_limit_fit_in_the_first_slots(db: &TestDb) {
    let url = db.url();
    let locks = Locks::connect(url).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(locks.semaphore("m", 3).try_lock().await.unwrap().unwrap());
    }
    assert!(locks.semaphore("m", 2).try_lock().await.unwrap().is_none());
    let wider = locks.semaphore("m", 5).try_lock().await.unwrap().unwrap();
    assert!(wider.slot() >= 3, "slot {}", wider.slot());
    assert_eq!(
        wider.key(),
        locks.slot_keys("m", 5).unwrap()[wider.slot() as usize]
    );
    for bad in [0, dblock::MAX_SEMAPHORE_LIMIT + 1] {
        assert!(matches!(
            locks.semaphore("m", bad).try_lock().await,
            Err(dblock::Error::InvalidRequest { .. })
        ));
    }
}

/// Fenced slots: each grant's token is greater than every earlier grant's of the name,
/// whichever slot it holds.
async fn fenced_slots_get_rising_tokens_per_name(db: &TestDb) {
    let url = db.url();
    let locks = Locks::connect(url).await.unwrap();
    let mut tokens = Vec::new();
    let mut held = Vec::new();
    for _ in 0..3 {
        let g = locks
            .semaphore("f", 3)
            .fenced()
            .try_lock()
            .await
            .unwrap()
            .unwrap();
        tokens.push(g.fencing_token().unwrap());
        assert_eq!(g.fence().unwrap().key(), locks.key("f").unwrap());
        held.push(g);
    }
    held.remove(0).release().await.unwrap();
    let g = locks
        .semaphore("f", 3)
        .fenced()
        .try_lock_for(Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    tokens.push(g.fencing_token().unwrap());
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "strictly rising: {tokens:?}"
    );
}

dblock_testkit::every_backend!(
    eight_processes_never_exceed_a_limit_of_three,
    a_killed_holder_frees_its_slot_for_a_waiter,
    try_deadline_and_cancel_leave_no_slot_held,
    holders_with_a_smaller_limit_fit_in_the_first_slots,
    fenced_slots_get_rising_tokens_per_name,
);

/// What PostgreSQL itself shows: a held slot is one advisory lock on that slot's key
/// (the one statement that tries every slot takes no other), a waiter waits on one
/// slot at a time, a slot whose holder's session is terminated is reported lost and
/// goes to the waiter, and nothing is left once the guards are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_slot_is_one_advisory_lock_and_its_loss_is_reported() {
    let db = dblock_testkit::PgSchema::new("sem_pg_locks").await;
    let locks = db.locks().await;
    let first = locks.semaphore("x", 3).lock().await.unwrap();
    let rows = db.advisory_of_sessions().await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(db.advisory(first.key()).await.len(), 1);
    let others = [
        locks.semaphore("x", 3).lock().await.unwrap(),
        locks.semaphore("x", 3).lock().await.unwrap(),
    ];
    let mut waiter = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.semaphore("x", 3).lock().await })
    };
    let one_waiting = db
        .eventually(10, || async {
            let rows = db.advisory_of_sessions().await;
            rows.iter().filter(|r| r.2).count() == 3 && rows.iter().filter(|r| !r.2).count() == 1
        })
        .await;
    assert!(one_waiting, "{:?}", db.advisory_of_sessions().await);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut waiter)
            .await
            .is_err()
    );
    let lost = first.lost();
    assert_eq!(db.terminate_holders(first.key()).await, 1);
    let reason = tokio::time::timeout(Duration::from_secs(10), lost).await;
    assert!(reason.is_ok(), "the loss is reported");
    assert!(!first.is_held());
    let got = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter gets the freed slot")
        .unwrap()
        .unwrap();
    assert_eq!(got.slot(), first.slot());
    drop((first, others, got));
    let none = db
        .eventually(10, || async { db.advisory_of_sessions().await.is_empty() })
        .await;
    assert!(none, "{:?}", db.advisory_of_sessions().await);
}

/// The other ways PostgreSQL takes a slot: session-scoped (the slot is unlocked, not
/// rolled back), on a multiplexing handle (slots tried one by one on shared
/// connections), and on connections borrowed from an sqlx pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_session_scoped_multiplexed_and_sqlx_handles_keep_the_limit() {
    let db = dblock_testkit::PgSchema::new("sem_pg_handles").await;
    let session = Locks::builder()
        .url(&db.url)
        .scope(dblock::Scope::Session)
        .build()
        .await
        .unwrap();
    let mux = Locks::builder()
        .url(&db.url)
        .scope(dblock::Scope::Session)
        .multiplex(2)
        .build()
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let borrowed = Locks::from_sqlx_pool(pool).await.unwrap();
    for (what, locks) in [("session", session), ("mux", mux), ("sqlx", borrowed)] {
        let name = format!("h-{what}");
        let a = locks.semaphore(&name, 2).try_lock().await.unwrap().unwrap();
        let b = locks.semaphore(&name, 2).try_lock().await.unwrap().unwrap();
        assert_ne!(a.slot(), b.slot(), "{what}");
        assert!(
            locks
                .semaphore(&name, 2)
                .try_lock()
                .await
                .unwrap()
                .is_none(),
            "{what}: both slots held"
        );
        let r = locks
            .semaphore(&name, 2)
            .try_lock_for(Duration::from_millis(200))
            .await
            .unwrap();
        assert!(r.is_none(), "{what}: a deadline wait gives up");
        let freed = b.slot();
        b.release().await.unwrap();
        let c = locks.semaphore(&name, 2).lock().await.unwrap();
        assert_eq!(c.slot(), freed, "{what}");
        assert_eq!(
            db.advisory_of_sessions()
                .await
                .iter()
                .filter(|r| r.2)
                .count(),
            2,
            "{what}"
        );
        a.release().await.unwrap();
        c.release().await.unwrap();
        let none = db
            .eventually(10, || async { db.advisory_of_sessions().await.is_empty() })
            .await;
        assert!(none, "{what}: {:?}", db.advisory_of_sessions().await);
    }
}

/// Bounds an await.
async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("finishes within 10 s")
}

/// Through PgBouncer in transaction mode a slot is a transaction-scoped lock like any
/// other: the limit holds and a freed slot is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_slots_work_through_a_transaction_pooler() {
    use dblock_testkit::pgbouncer::{Options, PgBouncer, PoolMode};
    let db = dblock_testkit::PgSchema::new("sem_pgb").await;
    let bouncer = PgBouncer::with(Options::new(PoolMode::Transaction, 4).search_path(&db.name));
    let url = dblock_testkit::with_params(&bouncer.test_url(), &[("application_name", &db.app)]);
    let connect = Locks::builder().url(&url).namespace(&db.name).build();
    let locks = tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(locks.pooler(), dblock::postgres::Pooler::Transaction);
    let a = bounded(locks.semaphore("p", 2).try_lock())
        .await
        .unwrap()
        .unwrap();
    let b = bounded(locks.semaphore("p", 2).try_lock())
        .await
        .unwrap()
        .unwrap();
    assert_ne!(a.slot(), b.slot());
    assert!(
        bounded(locks.semaphore("p", 2).try_lock())
            .await
            .unwrap()
            .is_none()
    );
    let freed = a.slot();
    a.release().await.unwrap();
    let c = bounded(locks.semaphore("p", 2).try_lock_for(Duration::from_secs(5)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.slot(), freed);
    drop((b, c));
}
