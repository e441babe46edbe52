//! Locking semantics of the embedded backend, on real files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Error, Locks};
use dblock_testkit::SqliteDb;

/// Two handles of one process are two open file descriptions: they exclude each other
/// through the kernel, as two processes would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handles_on_one_file_exclude_each_other() {
    let db = SqliteDb::new();
    let a = db.locks().await;
    let b = db.locks().await;
    let g = a.lock("x").await.unwrap();
    assert!(b.try_lock("x").await.unwrap().is_none());
    let rs = a.request("y").shared().lock().await.unwrap();
    assert!(
        b.request("y").shared().try_lock().await.unwrap().is_some(),
        "readers share across handles"
    );
    assert!(b.try_lock("y").await.unwrap().is_none());
    drop(rs);
    let mut waiter = tokio::spawn(async move { b.lock("x").await.map(drop) });
    // Observed waiting, not slept for: it does not finish while the lock is held.
    assert!(
        tokio::time::timeout(Duration::from_millis(50), &mut waiter)
            .await
            .is_err(),
        "the waiter waits while the lock is held"
    );
    drop(g);
    let r = tokio::time::timeout(Duration::from_secs(5), waiter).await;
    assert!(matches!(r, Ok(Ok(Ok(())))), "{r:?}");
}

/// A guard keeps what its lock needs alive without the handle: with every clone of the
/// handle dropped, its locks (taken at once, and after a wait) still exclude another
/// handle, and each is released when its guard drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guards_outlive_their_handle_and_still_release() {
    let db = SqliteDb::new();
    let other = db.locks().await;
    let (now, waited) = {
        let a = db.locks().await;
        let mut now = Vec::new();
        for i in 0..16 {
            now.push(a.lock(&format!("outlive:{i}")).await.unwrap());
        }
        // One granted after a wait (the wait's own path to a guard).
        let held = other.lock("outlive:waited").await.unwrap();
        let a2 = a.clone();
        let waiting = tokio::spawn(async move { a2.lock("outlive:waited").await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        let waited = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        (now, waited)
    }; // `a` and its clone dropped: only the guards remain
    let names: Vec<String> = (0..16)
        .map(|i| format!("outlive:{i}"))
        .chain(["outlive:waited".to_string()])
        .collect();
    // Which of the names another handle can take now (each released again at once).
    let free = |names: Vec<String>| {
        let other = other.clone();
        async move {
            let mut free = Vec::new();
            for n in &names {
                free.push(other.try_lock(n).await.unwrap().is_some());
            }
            free
        }
    };
    assert_eq!(
        free(names.clone()).await,
        vec![false; 17],
        "held without the handle"
    );
    drop(now);
    drop(waited);
    assert_eq!(
        free(names).await,
        vec![true; 17],
        "released with the guards"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_file_lies_beside_the_database_and_the_namespace_is_public() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    assert_eq!(locks.namespace(), dblock::DEFAULT_NAMESPACE);
    assert_eq!(locks.backend_name(), "sqlite");
    assert!(db.dir.path().join("locks.db-locks").exists());
    let url2 = format!("sqlite://{}", db.path.display());
    let other = Locks::connect(&url2).await.unwrap();
    let _g = locks.lock("same").await.unwrap();
    assert!(
        other.try_lock("same").await.unwrap().is_none(),
        "sqlite://PATH names the same file"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_path_is_a_typed_error() {
    let r = Locks::connect("sqlite:/proc/x.db").await;
    assert!(matches!(r, Err(Error::Io { .. })), "{r:?}");
    let r = Locks::connect("sqlite:/proc/no/such/dir/x.db").await;
    assert!(matches!(r, Err(Error::InvalidUrl { .. })), "{r:?}");
    let r = Locks::connect("sqlite::memory:").await;
    assert!(matches!(r, Err(Error::InvalidUrl { .. })), "{r:?}");
    let db = SqliteDb::new();
    let locks = db.locks().await;
    assert!(matches!(
        locks.lock("").await,
        Err(Error::InvalidName { .. })
    ));
}

/// The kind of kernel lock in use is the one selected: `DBLOCK_FILE_LOCKS=posix` gives
/// classic POSIX record locks (the portable implementation, as on macOS and the BSDs),
/// otherwise Linux OFD locks. Read from the kernel's own table, /proc/locks, so that a
/// run of this suite with the switch really tests the portable implementation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kernel_lock_is_the_selected_kind() {
    use std::os::unix::fs::MetadataExt;
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let _g = locks.lock("kind").await.unwrap();
    let md = std::fs::metadata(db.dir.path().join("locks.db-locks")).unwrap();
    // /proc/locks names a file `MAJOR:MINOR:INODE`, the device numbers in hex. The
    // device must match too: an inode number is unique only within one file system, and
    // tests running beside this one (on this machine, other checkouts' suites too) lock
    // files on other file systems — an inode-only match saw their locks as ours.
    let (dev, ino) = (md.dev(), md.ino());
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let file = format!("{major:02x}:{minor:02x}:{ino}");
    // /proc/locks is read a page per read(2), each a fresh walk of the kernel's list:
    // while other processes take and drop locks between two pages, a line can show up
    // twice (the flake this test had under load: "two" OFD locks on our file) or not at
    // all. So lines are compared without their ordinal, and a reading is taken again
    // when it is not the two expected; a real extra lock shows in every reading.
    let mut ours: Vec<String> = Vec::new();
    for _ in 0..20 {
        let proc_locks = std::fs::read_to_string("/proc/locks").unwrap();
        ours = proc_locks
            .lines()
            .filter(|l| l.split_whitespace().nth(5) == Some(file.as_str()))
            .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
            .collect();
        ours.sort();
        ours.dedup();
        if ours.len() == 2 {
            break;
        }
    }
    let expected = match std::env::var("DBLOCK_FILE_LOCKS").as_deref() {
        Ok("posix") => "POSIX",
        _ => "OFDLCK",
    };
    eprintln!("kernel locks on the lock file: {ours:?}");
    // Beside the lock, every process using the file holds a read lock on its last byte
    // (2^63 − 1) while it has the file open (the backend's module docs, "Waiting in
    // line"): of the same kind.
    let users = format!("READ {} {file} {} EOF", std::process::id(), i64::MAX);
    let (users, ours): (Vec<String>, Vec<String>) = ours.into_iter().partition(|l| {
        l.ends_with(&users) || l.ends_with(&format!("READ -1 {file} {} EOF", i64::MAX))
    });
    assert_eq!(users.len(), 1, "{users:?}");
    assert_eq!(
        users[0].split_whitespace().next(),
        ours.first().and_then(|l| l.split_whitespace().next()),
        "{users:?} {ours:?}"
    );
    assert_eq!(ours.len(), 1, "{ours:?}");
    assert_eq!(
        ours[0].split_whitespace().next(),
        Some(expected),
        "{ours:?}"
    );
}

/// A second handle on the same file, opened and dropped while the first holds a lock,
/// must not drop that lock for other processes. (With POSIX record locks closing *any*
/// descriptor of the file drops all of the process's locks on it: every handle of a
/// process shares one descriptor, kept open while any lock on the file is held.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_second_handle_keeps_the_first_handles_locks() {
    use tokio::io::AsyncBufReadExt;
    let db = SqliteDb::new();
    let a = db.locks().await;
    let g = a.lock("kept").await.unwrap();
    for _ in 0..3 {
        let b = db.locks().await;
        assert!(b.try_lock("kept").await.unwrap().is_none());
        assert!(b.try_lock("b-only").await.unwrap().is_some());
        drop(b);
    }
    let mut waiter = tokio::process::Command::new(env!("CARGO_BIN_EXE_dblock-worker"))
        .args(["wait", &db.url, "kept"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(waiter.stdout.take().unwrap()).lines();
    let early = tokio::time::timeout(Duration::from_millis(500), lines.next_line()).await;
    assert!(early.is_err(), "another process got a held lock: {early:?}");
    drop(g);
    let got = tokio::time::timeout(Duration::from_secs(10), lines.next_line()).await;
    assert!(
        matches!(&got, Ok(Ok(Some(l))) if l == "acquired"),
        "{got:?}"
    );
    assert!(waiter.wait().await.unwrap().success());
}

/// A misspelt `DBLOCK_FILE_LOCKS` is a typed error when the handle is opened, not a
/// silent fallback to another kind of lock (the worker process reports the error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misspelt_lock_kind_is_an_error() {
    let db = SqliteDb::new();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_dblock-worker"))
        .args(["wait", &db.url, "x"])
        .env("DBLOCK_FILE_LOCKS", "flock")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(10), out)
        .await
        .unwrap()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("DBLOCK_FILE_LOCKS") && err.contains("Configuration"),
        "{err}"
    );
}

/// A file whose fencing tables are half made — the epoch's table there, the fencing
/// table not yet, as another process leaves it between its two statements — still gives
/// a fenced grant its token. Before, a process that found the epoch's table made
/// nothing and failed with "no such table: dblock_fencing" (seen once in 280 processes
/// of `first_contact`, on a fresh file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_made_fencing_table_does_not_fail_a_grant() {
    use sqlx::Connection;
    let db = SqliteDb::new();
    let mut conn =
        sqlx::SqliteConnection::connect(&format!("sqlite:{}?mode=rwc", db.path.display()))
            .await
            .unwrap();
    sqlx::query(
        "CREATE TABLE dblock_fencing_epoch (id INTEGER PRIMARY KEY CHECK (id = 1), \
         epoch INTEGER NOT NULL, boot TEXT NOT NULL)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let locks = db.locks().await;
    let g = locks.request("half").fenced().lock().await.unwrap();
    assert!(g.fencing_token().unwrap() > 0);
    // The grant made the missing table.
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'dblock_fencing%' ORDER BY name",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(tables, ["dblock_fencing", "dblock_fencing_epoch"]);
}

/// A fencing token never goes backwards across a power loss, though grants within a
/// boot do not wait for the disk: a power loss may roll back the last grants of a
/// boot, and the next boot's epoch starts above them. Simulated on the file as a power
/// loss leaves it: the last grant's commit rolled back and, after the reboot, another
/// boot's name. The control, the same rollback without a new boot (which cannot happen:
/// a commit rolls back only with the operating system), hands the lost token out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_token_after_a_power_loss_is_above_every_token_before_it() {
    use sqlx::Connection;
    let db = SqliteDb::new();
    let mut handed_out = 0;
    for _ in 0..3 {
        let locks = db.locks().await;
        let g = locks.request("f").fenced().lock().await.unwrap();
        let t = g.fencing_token().unwrap();
        assert!(t > handed_out, "{t} after {handed_out}");
        handed_out = t;
    }
    let path = db.dir.path().join("locks.db");
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    // Control: the last grant rolled back, in the same boot: the token comes again.
    sqlx::query("UPDATE dblock_fencing SET token = token - 1")
        .execute(&mut conn)
        .await
        .unwrap();
    let again = db.locks().await;
    let g = again.request("f").fenced().lock().await.unwrap();
    assert_eq!(
        g.fencing_token(),
        Some(handed_out),
        "the control repeats it"
    );
    drop(g);
    // The power loss: rolled back, and the machine boots again.
    sqlx::query("UPDATE dblock_fencing SET token = token - 1")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("UPDATE dblock_fencing_epoch SET boot = 'the boot before the power loss'")
        .execute(&mut conn)
        .await
        .unwrap();
    let after = db.locks().await;
    let g = after.request("f").fenced().lock().await.unwrap();
    let t = g.fencing_token().unwrap();
    assert!(
        t > handed_out,
        "{t} after {handed_out}, across the power loss"
    );
    // And one more per grant after it.
    drop(g);
    let g = after.request("f").fenced().lock().await.unwrap();
    assert_eq!(g.fencing_token(), Some(t + 1));
}

/// Another process writing to the database (here a connection holding SQLite's write
/// lock in an open transaction) holds up a fenced grant's token until it commits, and
/// the grant then succeeds: the token's statement waits as a task (SQLite's busy
/// timeout is zero on the token connection; a busy write sleeps and tries again), on
/// both kinds of runtime. The control: while the writer holds the lock, the grant has
/// not finished.
async fn a_fenced_grant_waits_out_another_write() {
    use sqlx::Connection;
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let first = locks.request("busy").fenced().lock().await.unwrap();
    let before = first.fencing_token().unwrap();
    drop(first);
    let path = db.dir.path().join("locks.db");
    let mut writer = sqlx::SqliteConnection::connect(&format!("sqlite:{}", path.display()))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut writer)
        .await
        .unwrap();
    sqlx::query("UPDATE dblock_fencing_epoch SET epoch = epoch")
        .execute(&mut writer)
        .await
        .unwrap();
    let mut grant = tokio::spawn(async move {
        let g = locks.request("busy").fenced().lock().await;
        g.map(|g| g.fencing_token())
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut grant)
            .await
            .is_err(),
        "the grant's token waits while another connection writes"
    );
    sqlx::query("COMMIT").execute(&mut writer).await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), grant)
        .await
        .expect("granted once the writer commits")
        .unwrap()
        .unwrap();
    assert_eq!(token, Some(before + 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_grant_waits_out_another_write_on_a_multi_threaded_runtime() {
    a_fenced_grant_waits_out_another_write().await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_fenced_grant_waits_out_another_write_on_a_current_thread_runtime() {
    a_fenced_grant_waits_out_another_write().await;
}

/// A long-lived handle checkpoints the write-ahead log itself every 1,000 grants (SQLite's
/// automatic checkpoint is off on the token connection, which writes on the caller's
/// thread): after 1,010 fenced grants on one handle the log holds the grants since the
/// last checkpoint, not all of them. Without the count the log keeps every grant's frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_lived_handle_checkpoints_the_log_itself() {
    let db = SqliteDb::new();
    let locks = db.locks().await;
    let mut last = 0;
    for _ in 0..1010 {
        let g = locks.request("many").fenced().lock().await.unwrap();
        let t = g.fencing_token().unwrap();
        assert!(t > last, "{t} after {last}");
        last = t;
    }
    let wal = db.dir.path().join("locks.db-wal");
    let len = std::fs::metadata(&wal).map_or(0, |m| m.len());
    assert!(
        len < 200 * (4096 + 24),
        "the log holds {} frames after 1,010 grants",
        len / 4120
    );
}
