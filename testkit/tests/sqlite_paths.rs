//! The embedded backend's identity is the file, not the spelling of its path: every way
//! of naming one database reaches one lock, across real processes; paths that cannot be
//! a database are refused before anything is created; a replaced lock file does not
//! split holders.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use dblock::{Error, Locks, LossReason};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// A worker process running `args` in `cwd`, with its stdout lines.
fn spawn(
    cwd: &Path,
    args: &[&str],
) -> (
    Child,
    tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    let mut child = Command::new(WORKER)
        .args(args)
        .current_dir(cwd)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// Starts a worker that takes `name` through `url` and keeps it; returns once it says so.
async fn holder(cwd: &Path, url: &str, name: &str) -> Child {
    let (child, mut lines) = spawn(cwd, &["hold", url, name]);
    let held = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await;
    assert!(
        matches!(&held, Ok(Ok(Some(l))) if l.starts_with("held")),
        "{held:?}"
    );
    child
}

/// Every spelling of one database — a symbolic link to the file, a symbolic link to its
/// directory, a relative path with `..` in it — is one lock, between real processes.
/// Before the fix each spelling had a lock file of its own and both processes held the
/// name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_one_database_is_one_lock_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir(root.join("real")).unwrap();
    let db = root.join("real/app.db");
    std::fs::write(&db, b"").unwrap();
    std::os::unix::fs::symlink(&db, root.join("file-link.db")).unwrap();
    std::os::unix::fs::symlink(root.join("real"), root.join("dir-link")).unwrap();
    let canonical = format!("sqlite:{}", db.display());
    let spellings = [
        format!("sqlite:{}", root.join("file-link.db").display()),
        format!("sqlite:{}", root.join("dir-link/app.db").display()),
        "sqlite:real/../real/./app.db".to_string(), // relative to the worker's cwd
        format!("sqlite://{}", db.display()),
    ];
    let here = Locks::connect(&canonical).await.unwrap();
    for (i, url) in spellings.iter().enumerate() {
        let name = format!("spelling-{i}");
        let mut child = holder(root, url, &name).await;
        assert!(
            here.try_lock(&name).await.unwrap().is_none(),
            "{url} and {canonical} must be one lock"
        );
        child.start_kill().unwrap();
        let _ = child.wait().await;
        // The holder's death frees it for the other spelling: one lock, not two files.
        let g = tokio::time::timeout(Duration::from_secs(5), here.lock(&name)).await;
        assert!(matches!(g, Ok(Ok(_))), "{url}: {g:?}");
    }
    let locks_files: Vec<_> = walk(root)
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with("-locks"))
        .collect();
    assert_eq!(
        locks_files,
        vec![root.join("real/app.db-locks")],
        "one lock file"
    );
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            out.extend(walk(&e.path()));
        } else if ft.is_file() {
            out.push(e.path());
        }
    }
    out.sort();
    out
}

/// A database file with two hard links cannot be told apart from two files by its
/// path, so it is refused (from either name) with a typed error, not given two lock
/// files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_linked_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.db");
    std::fs::write(&a, b"").unwrap();
    std::fs::hard_link(&a, dir.path().join("b.db")).unwrap();
    for name in ["a.db", "b.db"] {
        let url = format!("sqlite:{}", dir.path().join(name).display());
        match Locks::connect(&url).await {
            Err(Error::InvalidUrl { reason, .. }) => {
                assert!(reason.contains("hard links"), "{reason}")
            }
            other => panic!("{url}: {other:?}"),
        }
    }
    assert!(!dir.path().join("a.db-locks").exists());
    assert!(!dir.path().join("b.db-locks").exists());
}

/// `sqlite:` pointing at a directory (or a device) is refused, and leaves no stray
/// `DIR-locks` file behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_or_a_device_is_not_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    for url in [
        format!("sqlite:{}", sub.display()),
        format!("sqlite:{}/", sub.display()),
        "sqlite:/dev/null".to_string(),
    ] {
        let r = Locks::connect(&url).await;
        assert!(matches!(r, Err(Error::InvalidUrl { .. })), "{url}: {r:?}");
    }
    assert!(!dir.path().join("sub-locks").exists(), "no stray lock file");
    // A symbolic link to nothing: SQLite would create its target, but which spelling
    // then owns the lock file is unclear. Refused.
    std::os::unix::fs::symlink(
        dir.path().join("missing.db"),
        dir.path().join("dangling.db"),
    )
    .unwrap();
    let r = Locks::connect(&format!(
        "sqlite:{}",
        dir.path().join("dangling.db").display()
    ))
    .await;
    assert!(matches!(r, Err(Error::InvalidUrl { .. })), "{r:?}");
}

/// Asserts that a `wait` worker has not acquired its lock (says nothing) within `within`.
async fn still_waiting(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    within: Duration,
    what: impl std::fmt::Debug,
) {
    let early = tokio::time::timeout(within, lines.next_line()).await;
    assert!(
        early.is_err(),
        "{what:?}: another process got a held lock: {early:?}"
    );
}

/// Waits for a `wait` worker to say it acquired its lock, then for it to exit cleanly.
async fn acquired_then_exits(
    child: &mut Child,
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    what: impl std::fmt::Debug,
) {
    let got = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await;
    assert!(
        matches!(&got, Ok(Ok(Some(l))) if l == "acquired"),
        "{what:?}: {got:?}"
    );
    assert!(child.wait().await.unwrap().success());
}

/// How a lock file gets replaced.
#[derive(Debug, Clone, Copy)]
enum Replace {
    Delete,
    RenameOver,
}

fn replace(lock_file: &Path, how: Replace) {
    match how {
        Replace::Delete => std::fs::remove_file(lock_file).unwrap(),
        Replace::RenameOver => {
            let tmp = lock_file.with_extension("new");
            std::fs::write(&tmp, b"").unwrap();
            std::fs::rename(&tmp, lock_file).unwrap();
        }
    }
}

/// A process that opened the lock file before it was replaced, and takes a lock after,
/// takes it in the file the path names now — where a process started later sees it.
/// Before the fix it locked the orphaned file and both processes held the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_lock_file_does_not_split_later_holders() {
    for how in [Replace::Delete, Replace::RenameOver] {
        let db = dblock_testkit::SqliteDb::new();
        let early = db.locks().await; // opens the lock file now
        replace(&db.dir.path().join("locks.db-locks"), how);
        // Grants look the path up again at most every 10 ms (docs/how-it-works.md): past
        // that bound, every grant is in the new file.
        tokio::time::sleep(Duration::from_millis(25)).await;
        let g = early.lock("x").await.unwrap();
        // A process started after the replacement opens the new file: it must see `g`.
        let (mut waiter, mut lines) = spawn(db.dir.path(), &["wait", &db.url, "x"]);
        still_waiting(&mut lines, Duration::from_millis(500), how).await;
        drop(g);
        acquired_then_exits(&mut waiter, &mut lines, how).await;
    }
}

/// A lock held while its file is replaced can no longer exclude processes that open the
/// new file; its guard says so instead of claiming to hold it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_file_was_replaced_reports_itself_lost() {
    for how in [Replace::Delete, Replace::RenameOver] {
        let db = dblock_testkit::SqliteDb::new();
        let locks = db.locks().await;
        let mut g = locks.lock("held").await.unwrap();
        let mut other = locks.lock("other").await.unwrap();
        assert!(g.is_held());
        g.check().await.unwrap();
        replace(&db.dir.path().join("locks.db-locks"), how);
        assert!(!g.is_held(), "{how:?}");
        match g.check().await {
            Err(Error::LockLost {
                reason: LossReason::LockFileReplaced { path },
            }) => assert!(path.ends_with("locks.db-locks")),
            r => panic!("{how:?}: {r:?}"),
        }
        assert!(matches!(other.check().await, Err(Error::LockLost { .. })));
        assert!(matches!(g.release().await, Err(Error::LockLost { .. })));
        drop(other);
        // New grants in this process go to the new file and hold there.
        let mut again = locks.lock("held").await.unwrap();
        again.check().await.unwrap();
        assert!(again.is_held());
    }
}

/// A process spreads its keys over several open file descriptions of the lock file
/// (`sqlite/file.rs`, `Desc::file_for`): locks held through every one of them exclude
/// another process, show in `status` as this process's, and are free for that process
/// once released. Four names for each of the 8 descriptions, chosen by the rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_through_every_description_of_the_file_exclude_other_processes() {
    let db = dblock_testkit::SqliteDb::new();
    let locks = db.locks().await;
    let mut per_description = [0; 8];
    let names: Vec<String> = (0..)
        .map(|i| format!("spread:{i}"))
        .filter(|n| {
            let offset = dblock::Key::new(locks.namespace(), n)
                .unwrap()
                .file_offset();
            let d = &mut per_description[(((offset >> 1) + 1) % 8) as usize];
            *d += 1;
            *d <= 4
        })
        .take(32)
        .collect();
    let mut guards = Vec::new();
    for n in &names {
        guards.push(locks.lock(n).await.unwrap());
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let status = locks.status(&refs).await.unwrap();
    let me = std::process::id();
    for n in &names {
        let st = status
            .iter()
            .find(|s| s.name.as_deref() == Some(n.as_str()));
        assert!(
            st.is_some_and(|s| s.holders.iter().any(|h| h.pid == Some(me))),
            "{n}: {st:?}"
        );
    }
    let mut waiters = Vec::new();
    for n in &names {
        waiters.push(spawn(db.dir.path(), &["wait", &db.url, n]));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (n, (_, lines)) in names.iter().zip(&mut waiters) {
        still_waiting(lines, Duration::from_millis(1), n).await;
    }
    drop(guards);
    for (n, (mut child, mut lines)) in names.iter().zip(waiters) {
        acquired_then_exits(&mut child, &mut lines, n).await;
    }
}

/// A lock held through a file since replaced stays lost once later grants have moved
/// its part of the process's table to the new file: a held key refers to its part's
/// descriptor without a copy of its own, and the part must give it one (the old file's)
/// before it takes the new one. Had it not, the lock would claim the new file, which it
/// does not hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_in_a_replaced_file_stays_lost_after_new_grants_beside_it() {
    for how in [Replace::Delete, Replace::RenameOver] {
        let db = dblock_testkit::SqliteDb::new();
        let locks = db.locks().await;
        let mut g = locks.lock("held").await.unwrap();
        g.check().await.unwrap();
        replace(&db.dir.path().join("locks.db-locks"), how);
        // Past the bound in time on a look at the path (10 ms), then grants of 1,000
        // names: every part of the table (64) takes the new descriptor.
        tokio::time::sleep(Duration::from_millis(25)).await;
        for i in 0..1000 {
            let other = locks.lock(&format!("beside:{i}")).await.unwrap();
            assert!(
                other.is_held(),
                "{how:?}: a new grant holds in the new file"
            );
        }
        assert!(!g.is_held(), "{how:?}: the old grant claims the new file");
        assert!(
            matches!(
                g.check().await,
                Err(Error::LockLost {
                    reason: LossReason::LockFileReplaced { .. }
                })
            ),
            "{how:?}"
        );
        drop(g);
        // Its name is free in the new file, for this process and for a later one.
        let again = locks.lock("held").await.unwrap();
        assert!(again.is_held());
        drop(again);
        let (mut waiter, mut lines) = spawn(db.dir.path(), &["wait", &db.url, "held"]);
        acquired_then_exits(&mut waiter, &mut lines, how).await;
    }
}

/// A lock handed over between tasks of one process after its file was replaced is not
/// passed on in the old file: the next task gets it in the file the path names now,
/// where other processes see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_handed_over_after_its_file_was_replaced_moves_to_the_new_file() {
    for how in [Replace::Delete, Replace::RenameOver] {
        let db = dblock_testkit::SqliteDb::new();
        let locks = db.locks().await;
        let g = locks.lock("h").await.unwrap();
        let mut next = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.lock("h").await.unwrap() })
        };
        // Observed waiting behind `g`, not slept for.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut next)
                .await
                .is_err(),
            "{how:?}: the task waits while the lock is held"
        );
        replace(&db.dir.path().join("locks.db-locks"), how);
        drop(g);
        let mut got = tokio::time::timeout(Duration::from_secs(10), next)
            .await
            .unwrap()
            .unwrap();
        assert!(got.is_held(), "{how:?}: handed over in the old file");
        got.check().await.unwrap();
        // And a process started now, on the new file, sees it.
        let (mut waiter, mut lines) = spawn(db.dir.path(), &["wait", &db.url, "h"]);
        still_waiting(&mut lines, Duration::from_millis(300), how).await;
        drop(got);
        acquired_then_exits(&mut waiter, &mut lines, how).await;
    }
}
