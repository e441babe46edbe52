//! The embedded backend: an SQLite database file, and locks that exclude across the
//! processes of one host.
//!
//! # The mechanism
//!
//! Beside the database `PATH` lies a lock file, `PATH-locks`. A lock on key `k` is a
//! Linux open-file-description (OFD) byte-range lock on one byte of that file, at offset
//! [`Key::file_offset`](crate::Key::file_offset) (the key modulo 2^63 − 1): a write lock
//! for exclusive mode, a read lock for shared. OFD locks conflict between separate
//! `open()`s whatever process made them, and the kernel drops them when the last
//! descriptor of the open closes, which is when the process dies, however it dies: a
//! killed holder never leaves a lock behind. The database file itself is never locked
//! this way (SQLite opens and closes it and uses POSIX locks of its own, which one
//! close would drop).
//!
//! Each handle opens the lock file once, with `O_CLOEXEC` so that commands started by
//! `dblock run` do not inherit its locks. Within the process, a table of held keys
//! decides between the handle's own holders (a second exclusive holder waits on the
//! table; shared holders share one read lock), so two tasks never both hold a lock
//! because they share the descriptor. A process that `fork`s without `exec` shares its
//! locks with the child: don't.
//!
//! Waiting for a lock held by another process polls (every 1 ms, backing off to
//! 4 ms): a blocking `F_OFD_SETLKW` cannot be cancelled, and a cancelled or timed-out
//! wait must leave nothing behind. A lock released inside the process wakes its
//! waiters at once.
//!
//! Network and FUSE file systems are refused ([`Error::UnsupportedFilesystem`]): their
//! byte-range locks may not exclude across hosts.

pub(crate) mod fence;
mod floor;
mod migrate;
mod sys;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::{Error, LossReason};
use crate::raw::{
    BenchFloor, BoxFuture, FENCING_TABLE, FencingStore, Grant, MigrationTarget, Mode, Options,
    RawHeld, RawLocks, Req, Wait,
};

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

const POLL_FIRST: Duration = Duration::from_millis(1);
const POLL_MAX: Duration = Duration::from_millis(4);

/// The backend of a handle on an SQLite file.
pub(crate) struct SqliteBackend {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) db_path: PathBuf,
    lock_path: PathBuf,
    file: File,
    /// Keys (file offsets) held through `file`, by this process.
    table: Mutex<HashMap<u64, Slot>>,
    /// Tasks waiting for a lock; releases notify only when there are some.
    waiters: AtomicUsize,
    released: Notify,
    /// The database, opened on first use (fencing tokens, migrations).
    db: tokio::sync::OnceCell<sqlx::SqlitePool>,
}

#[derive(Debug, Default)]
struct Slot {
    readers: u32,
    writer: bool,
}

impl SqliteBackend {
    /// Opens (creating if needed) the lock file beside `db_path`, and its directory.
    fn open(db_path: PathBuf, opts: &Options) -> Result<SqliteBackend, Error> {
        let lock_path = lock_file_path(&db_path);
        if let Some(dir) = lock_path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("cannot create directory {}", dir.display()), e))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(|e| Error::io(format!("cannot open lock file {}", lock_path.display()), e))?;
        if !opts.allow_network_filesystem {
            let fs = sys::network_filesystem(&file)
                .map_err(|e| Error::io(format!("cannot inspect {}", lock_path.display()), e))?;
            if let Some(filesystem) = fs {
                return Err(Error::UnsupportedFilesystem {
                    path: lock_path,
                    filesystem,
                });
            }
        }
        Ok(SqliteBackend {
            shared: Arc::new(Shared {
                db_path,
                lock_path,
                file,
                table: Mutex::new(HashMap::new()),
                waiters: AtomicUsize::new(0),
                released: Notify::new(),
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
        shared.waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = WaiterCount(shared);
        let mut poll = POLL_FIRST;
        loop {
            let notified = shared.released.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if shared.take_now(offset, mode)? {
                return Ok(Some(SqliteHeld::new(shared, offset, mode)));
            }
            let now = Instant::now();
            let mut wake = now + poll;
            if let Some(d) = deadline {
                if now >= d {
                    return Ok(None);
                }
                wake = wake.min(d);
            }
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
            poll = (poll * 2).min(POLL_MAX);
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

/// Keeps the waiter count right however the wait ends.
struct WaiterCount<'a>(&'a Shared);

impl Drop for WaiterCount<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    /// Takes the lock at `offset` now if this process's table and the file allow it.
    fn take_now(&self, offset: u64, mode: Mode) -> Result<bool, Error> {
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        match (table.get_mut(&offset), mode) {
            // Another shared holder of this process already has the read lock.
            (Some(slot), Mode::Shared) if !slot.writer => {
                slot.readers += 1;
                Ok(true)
            }
            (Some(_), _) => Ok(false),
            (None, _) => match sys::try_lock(&self.file, offset, mode) {
                Ok(true) => {
                    let slot = match mode {
                        Mode::Shared => Slot {
                            readers: 1,
                            writer: false,
                        },
                        Mode::Exclusive => Slot {
                            readers: 0,
                            writer: true,
                        },
                    };
                    table.insert(offset, slot);
                    Ok(true)
                }
                Ok(false) => Ok(false),
                Err(e) => Err(Error::io(
                    format!("cannot lock {}", self.lock_path.display()),
                    e,
                )),
            },
        }
    }

    fn release(&self, offset: u64, mode: Mode) {
        let mut table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let empty = match table.get_mut(&offset) {
            Some(slot) => {
                match mode {
                    Mode::Shared => slot.readers = slot.readers.saturating_sub(1),
                    Mode::Exclusive => slot.writer = false,
                }
                slot.readers == 0 && !slot.writer
            }
            None => false,
        };
        if empty {
            table.remove(&offset);
            // Unlocking a byte this description holds cannot fail short of a closed
            // descriptor, which the Arc rules out. Should it fail anyway, the lock stays
            // until the process exits: never two holders.
            let _ = sys::unlock(&self.file, offset);
        }
        drop(table);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.released.notify_waiters();
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

    fn bench_floor(&self) -> Option<Result<Arc<dyn BenchFloor>, Error>> {
        Some(Ok(Arc::new(floor::Floor::new(
            self.shared.lock_path.clone(),
        ))))
    }
}

/// The lock file beside a database: `PATH-locks`.
pub(crate) fn lock_file_path(db_path: &Path) -> PathBuf {
    let mut s = db_path.as_os_str().to_os_string();
    s.push("-locks");
    PathBuf::from(s)
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
}

/// The embedded backend's locks end only with their process: never lost, nothing to
/// check, released at once.
impl RawHeld for SqliteHeld {
    fn loss(&self) -> Option<LossReason> {
        None
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        Box::pin(std::future::pending())
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        SqliteHeld::release(*self);
        Box::pin(std::future::ready(Ok(())))
    }
}

impl Drop for SqliteHeld {
    fn drop(&mut self) {
        if !self.released {
            self.shared.release(self.offset, self.mode);
        }
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
