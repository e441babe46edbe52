//! The embedded backend: an SQLite database file, and locks that exclude across the
//! processes of one host.
//!
//! # The mechanism
//!
//! Beside the database `PATH` lies a lock file, `PATH-locks`. A lock on key `k` is a
//! byte-range lock on one byte of that file, at offset
//! [`Key::file_offset`](crate::Key::file_offset) (the key modulo 2^63 − 1): a write lock
//! for exclusive mode, a read lock for shared. On Linux these are open-file-description
//! (OFD) locks (`F_OFD_SETLK`); where those are missing (macOS, the BSDs) classic POSIX
//! record locks (`F_SETLK`), and on Linux too with `DBLOCK_FILE_LOCKS=posix` (see
//! [Platforms](#platforms)). Either way the kernel drops a lock when its holder dies,
//! however it dies: a killed holder never leaves a lock behind. The database file itself
//! is never locked this way (SQLite opens and closes it and uses POSIX locks of its own,
//! which one close would drop).
//!
//! A process opens each lock file once, with `O_CLOEXEC` so that commands started by
//! `dblock run` do not inherit its locks, and every handle of the process on that file
//! shares the descriptor. A table of held keys decides between the process's own holders
//! (a second exclusive holder waits on the table; shared holders share one read lock),
//! so two tasks never both hold a lock because they share the descriptor. A process that
//! `fork`s without `exec` shares its OFD locks with the child: don't.
//!
//! Network and FUSE file systems are refused ([`Error::UnsupportedFilesystem`]): their
//! byte-range locks may not exclude across hosts.
//!
//! # Waiting in line
//!
//! Next to each lock byte lies a *gate* byte (its neighbour: `offset ^ 1`). A request
//! first tries gate and lock byte together, in one non-blocking call, and gives the gate
//! back at once: three system calls a cycle, uncontended. When that fails, the process
//! gets in line: one thread (per process and name, named `dblock-` and the offset's low
//! 32 bits in hex) waits in the kernel for the gate (`F_OFD_SETLKW`), where the kernel
//! queues conflicting waiters in arrival order; at the head of the line it polls the
//! lock byte (50 µs, each look 50 µs later than the last, up to every 1 ms), holding the
//! gate, then gives the gate back. Whoever is at the head of the
//! line holds the gate, so a holder that releases and comes straight back, or a new
//! reader while a writer waits, fails the first try and gets in line behind it instead
//! of taking the lock again before the waiter wakes up. Within a process, a released lock
//! wakes the process's own waiters at once; the process as a whole takes its turn in the
//! line (fairness is between processes, as each one stands in line once per name).
//!
//! A blocking wait in the kernel cannot be cancelled, so a cancelled or timed-out
//! request only gives up its claim: a thread still waiting for the gate leaves the line
//! when it gets there, holding nothing meanwhile; a thread at the head of the line sees
//! the claim gone at its next look and gives the gate back; a lock granted to nobody is
//! given back at once. The next request of the process for that name and mode takes the
//! place over instead of lining up again. So a cut-off wait leaves nothing held, at most
//! one thread waiting per name, and delays others by at most one wake-up.
//!
//! Processes of older dblock versions, which knew no gate, still exclude and are
//! excluded (the lock byte is unchanged); they just do not stand in line.
//!
//! # Identity is the file, not the spelling
//!
//! Every spelling of one database must reach one lock file, or two processes both hold a
//! name. So the database path is resolved before `-locks` is appended: symbolic links
//! and `.`/`..` are resolved ([`std::fs::canonicalize`] of the file, or of its directory
//! when the file does not exist yet), so a relative path, an absolute one and a symbolic
//! link all name `/real/dir/locks.db-locks`. Paths that cannot be a database are refused
//! with [`Error::InvalidUrl`] before anything is created: a directory, a device or FIFO,
//! a symbolic link to nothing (SQLite would create its target, but where the lock file
//! belongs depends on which spelling came first), and a database file with more than
//! one hard link: from a second name there is no way back to the first, so the lock
//! files would differ — and SQLite itself names its journal and WAL files after the path,
//! so a hard-linked database is not safe for SQLite either.
//!
//! Within a process every handle on one lock file shares one open lock file: one
//! descriptor, one table of held keys. (POSIX record locks need that: closing any
//! descriptor of a file drops all of the process's locks on it.)
//!
//! A lock file replaced while in use (deleted and recreated, or renamed over) would
//! split holders again: a process with the old file open locks bytes nobody else sees.
//! So after the kernel grants a byte, the path is checked to still name the descriptor's
//! file (device and inode); if it does not, the byte is given back and the request is
//! retried on the file the path names now. That covers every grant made after the
//! replacement. Locks granted *before* it stay on the old file, where later requests no
//! longer see them: [`LockGuard::check`](crate::LockGuard::check) and
//! [`LockGuard::is_held`](crate::LockGuard::is_held) report such a lock as lost
//! ([`LossReason::LockFileReplaced`]), and fencing
//! tokens (kept in the database, not the lock file) still reject its writes.

//!
//! # Platforms
//!
//! Linux uses OFD locks; macOS, the BSDs and other Unixes POSIX record locks, which
//! belong to the process and are dropped when *any* descriptor of the file closes. The
//! process therefore keeps one descriptor per lock file open while any handle on it
//! lives and never opens a second (don't open the lock file yourself in a process that
//! holds locks in it). Set `DBLOCK_FILE_LOCKS=posix` to use them on Linux (the test
//! suite runs this way too), `ofd` to insist on OFD locks; anything else is an error
//! when a handle is opened. OFD and POSIX locks conflict with each other on Linux, so
//! processes using either exclude each other. Neither kind detects deadlocks between
//! dblock's waiters (the kernel's detection for POSIX locks sees one owner per process
//! and so reports cycles that are not there; such a report is retried). See
//! `docs/platforms.md` for what is tested where.

mod adopt;
mod bookkeeping;
pub(crate) mod fence;
mod file;
mod floor;
mod migrate;
mod queue;
mod status;
mod sys;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::{Error, LossReason};
use crate::raw::{
    BenchFloor, BoxFuture, FENCING_TABLE, FencingStore, Grant, MigrationTarget, Mode, Options,
    RawHeld, RawLocks, Req, Wait,
};

pub(crate) use file::lock_file_path;
use file::{Desc, LockFile};
use sys::Attempt;

/// Opens the backend a `sqlite:PATH` or `sqlite://PATH` URL names; the default
/// namespace with it.
pub(crate) fn open(url: &str, opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    let path = parse_url(url).map_err(|reason| Error::InvalidUrl {
        url: crate::error::redact_url(url),
        reason,
    })?;
    open_path(path, opts)
}

/// Opens the backend on the database file `path`; the default namespace with it.
pub(crate) fn open_path(
    path: PathBuf,
    opts: &Options,
) -> Result<(Box<dyn RawLocks>, String), Error> {
    Ok((
        Box::new(SqliteBackend::open(path, opts)?),
        crate::key::DEFAULT_NAMESPACE.to_string(),
    ))
}

/// The backend of a handle on an SQLite file.
pub(crate) struct SqliteBackend {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    /// The database file, resolved (see [`file`]).
    pub(crate) db_path: PathBuf,
    /// The lock file beside it, shared with every handle of this process on it.
    lock: Arc<LockFile>,
    /// The database, opened on first use (fencing tokens, migrations).
    db: tokio::sync::OnceCell<sqlx::SqlitePool>,
}

/// A key held by this process: by how many shared holders, or by one exclusive one, and
/// through which descriptor (the lock file may have been replaced since).
#[derive(Debug)]
pub(crate) struct Slot {
    readers: u32,
    writer: bool,
    desc: Arc<Desc>,
}

impl Slot {
    fn new(mode: Mode, desc: Arc<Desc>) -> Slot {
        let (readers, writer) = match mode {
            Mode::Shared => (1, false),
            Mode::Exclusive => (0, true),
        };
        Slot {
            readers,
            writer,
            desc,
        }
    }
}

/// What this process does with the keys of one lock file.
#[derive(Default)]
pub(crate) struct Table {
    /// Keys (file offsets) held.
    held: HashMap<u64, Slot>,
    /// Keys this process waits for in line, in the kernel.
    queued: HashMap<u64, queue::Queued>,
}

/// What a waiting request does next.
enum Step {
    Granted(SqliteHeld),
    /// Wait for the place in line to deliver.
    InLine(u64, queue::Receiver),
    /// Wait for something in this process to change (a release, a place in line freed).
    Local,
}

impl SqliteBackend {
    /// Resolves `db_path` to its file and opens (creating if needed) the lock file
    /// beside it, and its directory.
    fn open(db_path: PathBuf, opts: &Options) -> Result<SqliteBackend, Error> {
        let db_path = file::resolve_db_path(&db_path)?;
        let lock = LockFile::open(lock_file_path(&db_path), opts.allow_network_filesystem)?;
        Ok(SqliteBackend {
            shared: Arc::new(Shared {
                db_path,
                lock,
                db: tokio::sync::OnceCell::new(),
            }),
        })
    }

    async fn acquire(&self, req: &Req<'_>) -> Result<Option<Grant>, Error> {
        let offset = req.key.file_offset();
        let held = match self.shared.take_now(offset, req.mode)? {
            true => SqliteHeld::new(&self.shared, offset, req.mode),
            false => match self.wait(offset, req.mode, req.wait).await? {
                Some(h) => h,
                None => return Ok(None),
            },
        };
        // Armed: if the token cannot be had (or this future is dropped), `held` drops and
        // releases.
        let fence = match req.fenced {
            true => Some((
                fence::next_token(&self.shared, req).await?,
                Arc::from(FENCING_TABLE),
            )),
            false => None,
        };
        Ok(Some(Grant {
            held: Box::new(held),
            fence,
        }))
    }

    async fn wait(&self, offset: u64, mode: Mode, wait: Wait) -> Result<Option<SqliteHeld>, Error> {
        let deadline = match wait {
            Wait::Try => return Ok(None),
            w => w.deadline(),
        };
        let shared = &self.shared;
        let lf = &shared.lock;
        lf.waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = WaiterCount(lf);
        let expired = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let mut expired = std::pin::pin!(expired);
        loop {
            let notified = lf.released.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            match shared.step(offset, mode)? {
                Step::Granted(held) => return Ok(Some(held)),
                Step::Local => {
                    tokio::select! {
                        () = notified => {}
                        () = &mut expired => return Ok(None),
                    }
                }
                Step::InLine(id, rx) => {
                    // However this ends (granted, deadline, the future dropped), the
                    // claim on the place in line goes; a lock delivered to a dropped
                    // receiver is released by the channel.
                    let _claim = Claim { lf, offset, id };
                    tokio::select! {
                        r = rx => {
                            if let Ok(r) = r {
                                return r.map(Some);
                            }
                            // The place in line was given up or moved: look again.
                        }
                        () = &mut expired => return Ok(None),
                    }
                }
            }
        }
    }

    /// Waits for the exclusive lock on a raw key, not derived from a name (the
    /// migration lock): held until the returned value is dropped.
    pub(crate) async fn lock_key(&self, key: crate::Key) -> Result<SqliteHeld, Error> {
        let (offset, mode) = (key.file_offset(), Mode::Exclusive);
        if self.shared.take_now(offset, mode)? {
            return Ok(SqliteHeld::new(&self.shared, offset, mode));
        }
        // A wait without a deadline returns only with the lock (or an error).
        loop {
            if let Some(held) = self.wait(offset, mode, Wait::Forever).await? {
                return Ok(held);
            }
        }
    }
}

/// A request's claim on its process's place in line, given up when dropped.
struct Claim<'a> {
    lf: &'a LockFile,
    offset: u64,
    id: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        queue::give_up(self.lf, self.offset, self.id);
    }
}

/// Keeps the waiter count right however the wait ends.
struct WaiterCount<'a>(&'a LockFile);

impl Drop for WaiterCount<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    /// Takes the lock at `offset` now if this process's table and the file allow it.
    fn take_now(&self, offset: u64, mode: Mode) -> Result<bool, Error> {
        let mut table = self.lock.table.lock().unwrap_or_else(|p| p.into_inner());
        self.take_locked(&mut table, offset, mode)
    }

    fn take_locked(&self, table: &mut Table, offset: u64, mode: Mode) -> Result<bool, Error> {
        match (table.held.get_mut(&offset), mode) {
            // Another shared holder of this process already has the read lock: join it,
            // unless a writer of another process is at the head of the line (it holds
            // the gate), which readers must not pass.
            (Some(slot), Mode::Shared) if !slot.writer => {
                let lf = &self.lock;
                let fail = |e| Error::io(format!("cannot lock {}", lf.path.display()), e);
                let gate = queue::gate(offset);
                match sys::try_lock(&slot.desc.file, lf.flavor, gate, 1, Mode::Shared)
                    .map_err(fail)?
                {
                    Attempt::Busy => return Ok(false),
                    Attempt::Granted => {
                        sys::unlock(&slot.desc.file, lf.flavor, gate, 1).map_err(fail)?;
                    }
                }
                slot.readers += 1;
                return Ok(true);
            }
            (Some(_), _) => return Ok(false),
            (None, _) => {}
        }
        // The process is in line for it: the lock is held elsewhere, and the bytes must
        // not be touched while the line's thread works on them (locks of one owner
        // merge).
        if table.queued.contains_key(&offset) {
            return Ok(false);
        }
        let lf = &self.lock;
        let fail = |e| Error::io(format!("cannot lock {}", lf.path.display()), e);
        // A replaced file is reopened and the request retried; a path replaced again and
        // again is an error, not a loop.
        for _ in 0..8 {
            let desc = lf.current();
            // Gate and lock byte at once: free only if nobody holds the lock and nobody
            // is at the head of the line (whoever is holds the gate).
            match sys::try_lock(&desc.file, lf.flavor, queue::pair(offset), 2, mode)
                .map_err(fail)?
            {
                Attempt::Busy => return Ok(false),
                Attempt::Granted => {}
            }
            if let Err(e) = sys::unlock(&desc.file, lf.flavor, queue::gate(offset), 1) {
                let _ = sys::unlock(&desc.file, lf.flavor, queue::pair(offset), 2);
                return Err(fail(e));
            }
            if desc.is_named_by(&lf.path) {
                table.held.insert(offset, Slot::new(mode, desc));
                return Ok(true);
            }
            // The byte was granted in a file the path no longer names: nobody opening
            // the path now would see it. Give it back; use the new file.
            sys::unlock(&desc.file, lf.flavor, offset, 1).map_err(fail)?;
            lf.reopen(&desc)?;
        }
        Err(Error::io(
            format!("cannot lock {}", lf.path.display()),
            std::io::Error::other("the lock file keeps being replaced"),
        ))
    }

    /// One look at the table for a waiting request: the lock, a place in line to wait
    /// in, or nothing to do but wait for a change in this process.
    fn step(self: &Arc<Self>, offset: u64, mode: Mode) -> Result<Step, Error> {
        let lf = &self.lock;
        let mut table = lf.table.lock().unwrap_or_else(|p| p.into_inner());
        if self.take_locked(&mut table, offset, mode)? {
            return Ok(Step::Granted(SqliteHeld::new(self, offset, mode)));
        }
        if table.held.contains_key(&offset) {
            return Ok(Step::Local); // held in this process: its release wakes us
        }
        if let Some(q) = table.queued.get_mut(&offset) {
            return Ok(match queue::adopt(q, self, mode) {
                Some((id, rx)) => Step::InLine(id, rx),
                None => Step::Local,
            });
        }
        let (id, rx) = queue::join(lf, &mut table.queued, self, offset, mode)?;
        Ok(Step::InLine(id, rx))
    }

    fn release(&self, offset: u64, mode: Mode) {
        let lf = &self.lock;
        let mut table = lf.table.lock().unwrap_or_else(|p| p.into_inner());
        let empty = match table.held.get_mut(&offset) {
            Some(slot) => {
                match mode {
                    Mode::Shared => slot.readers = slot.readers.saturating_sub(1),
                    Mode::Exclusive => slot.writer = false,
                }
                slot.readers == 0 && !slot.writer
            }
            None => false,
        };
        if empty && let Some(slot) = table.held.remove(&offset) {
            // Unlocking a byte this owner holds cannot fail short of a closed
            // descriptor, which the Arc rules out. Should it fail anyway, the lock
            // stays until the process exits: never two holders.
            let _ = sys::unlock(&slot.desc.file, lf.flavor, offset, 1);
        }
        drop(table);
        if lf.waiters.load(Ordering::SeqCst) > 0 {
            lf.released.notify_waiters();
        }
    }

    /// Whether the lock at `offset` is held through the file the lock path names now:
    /// false once the lock file has been replaced under it.
    fn in_current_file(&self, offset: u64) -> bool {
        let lf = &self.lock;
        let table = lf.table.lock().unwrap_or_else(|p| p.into_inner());
        match table.held.get(&offset) {
            Some(slot) => slot.desc.is_named_by(&lf.path),
            None => false,
        }
    }

    /// The database, opened on first use: WAL, `synchronous = FULL` (a fencing token
    /// must survive a crash), a busy timeout for other processes' writes.
    pub(crate) async fn db(&self) -> Result<&sqlx::SqlitePool, Error> {
        self.db
            .get_or_try_init(|| async {
                use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
                let opts = SqliteConnectOptions::new()
                    .filename(&self.db_path)
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(Duration::from_secs(30));
                sqlx::sqlite::SqlitePoolOptions::new()
                    .max_connections(4)
                    .connect_with(opts)
                    .await
                    .map_err(|e| Error::Connect {
                        target: format!("sqlite:{}", self.db_path.display()),
                        message: e.to_string(),
                    })
            })
            .await
    }
}

impl RawLocks for SqliteBackend {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn acquire<'a>(&'a self, req: &'a Req<'a>) -> BoxFuture<'a, Result<Option<Grant>, Error>> {
        Box::pin(SqliteBackend::acquire(self, req))
    }

    fn fencing(&self) -> Option<&dyn FencingStore> {
        Some(self)
    }

    fn migrations(&self) -> Option<&dyn MigrationTarget> {
        Some(self)
    }

    fn status(&self) -> Option<&dyn crate::raw::StatusSource> {
        Some(self)
    }

    fn bench_floor(&self) -> Option<Result<Arc<dyn BenchFloor>, Error>> {
        Some(Ok(Arc::new(floor::Floor::new(
            self.shared.lock.path.clone(),
        ))))
    }
}

/// The embedded half of a guard.
pub(crate) struct SqliteHeld {
    shared: Arc<Shared>,
    offset: u64,
    mode: Mode,
    released: bool,
}

impl SqliteHeld {
    fn new(shared: &Arc<Shared>, offset: u64, mode: Mode) -> SqliteHeld {
        SqliteHeld {
            shared: shared.clone(),
            offset,
            mode,
            released: false,
        }
    }

    fn release(mut self) {
        self.released = true;
        self.shared.release(self.offset, self.mode);
    }

    /// `None` while the lock is held in the file its path names; the loss otherwise
    /// (the lock file was replaced since the grant: see [`file`]).
    fn loss(&self) -> Option<LossReason> {
        match self.shared.in_current_file(self.offset) {
            true => None,
            false => Some(LossReason::LockFileReplaced {
                path: self.shared.lock.path.clone(),
            }),
        }
    }
}

impl Drop for SqliteHeld {
    fn drop(&mut self) {
        if !self.released {
            self.shared.release(self.offset, self.mode);
        }
    }
}

/// The embedded backend's locks end only with their process, or when their lock file
/// is replaced: nothing to ask a server, no loss to wait for (a replaced file is seen
/// by `check`, `is_held` and `release`).
impl RawHeld for SqliteHeld {
    fn loss(&self) -> Option<LossReason> {
        SqliteHeld::loss(self)
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        Box::pin(std::future::pending())
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(std::future::ready(match SqliteHeld::loss(self) {
            None => Ok(()),
            Some(reason) => Err(Error::LockLost { reason }),
        }))
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        let loss = SqliteHeld::loss(&self);
        SqliteHeld::release(*self);
        Box::pin(std::future::ready(match loss {
            None => Ok(()),
            Some(reason) => Err(Error::LockLost { reason }),
        }))
    }
}

/// The database file a `sqlite:PATH` or `sqlite://PATH` URL names.
pub(crate) fn parse_url(url: &str) -> Result<PathBuf, String> {
    // `sqlite:PATH` and sqlx's `sqlite://PATH` (so `sqlite:///abs` is absolute);
    // anything after `?` (sqlx's `mode=rwc` and the like) is ignored.
    let rest = &url["sqlite:".len()..];
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let path = rest.split('?').next().unwrap_or_default();
    if path.is_empty() {
        return Err("no file path after sqlite:".into());
    }
    if path == ":memory:" || path.starts_with("file::memory:") {
        return Err("an in-memory database cannot be shared between processes".into());
    }
    Ok(PathBuf::from(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls_name_files() {
        let path = |u: &str| parse_url(u).unwrap();
        assert_eq!(path("sqlite:/tmp/a.db"), PathBuf::from("/tmp/a.db"));
        assert_eq!(path("sqlite:///tmp/a.db"), PathBuf::from("/tmp/a.db"));
        assert_eq!(path("sqlite://rel/a.db"), PathBuf::from("rel/a.db"));
        assert_eq!(path("sqlite:a.db?mode=rwc"), PathBuf::from("a.db"));
    }
}
