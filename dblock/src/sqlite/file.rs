//! Which lock file a database path means, and the one open lock file per file per
//! process. The rules are in the [module docs](super#identity-is-the-file-not-the-spelling).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::Error;

use super::sys::{self, Flavor};

/// Resolves a database path to the one name of its file (see the module docs), refusing
/// paths that cannot be a database.
pub(crate) fn resolve_db_path(db_path: &Path) -> Result<PathBuf, Error> {
    let refuse = |reason: String| Error::InvalidUrl {
        url: format!("sqlite:{}", db_path.display()),
        reason,
    };
    let dir = match db_path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    match std::fs::symlink_metadata(db_path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(&dir)
                .map_err(|e| Error::io(format!("cannot create directory {}", dir.display()), e))?;
            let name = db_path
                .file_name()
                .ok_or_else(|| refuse("the path names no file".into()))?;
            let dir = std::fs::canonicalize(&dir)
                .map_err(|e| Error::io(format!("cannot resolve directory {}", dir.display()), e))?;
            Ok(dir.join(name))
        }
        Err(e) => Err(Error::io(
            format!("cannot inspect {}", db_path.display()),
            e,
        )),
        Ok(_) => {
            let md = match std::fs::metadata(db_path) {
                Ok(md) => md,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(refuse(
                        "a symbolic link to a file that does not exist; \
                         create the database file or name it directly"
                            .into(),
                    ));
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("cannot inspect {}", db_path.display()),
                        e,
                    ));
                }
            };
            if md.is_dir() {
                return Err(refuse("a directory, not a database file".into()));
            }
            if !md.is_file() {
                return Err(refuse("not a regular file".into()));
            }
            if md.nlink() > 1 {
                return Err(refuse(format!(
                    "the database file has {} hard links; one file reached by several \
                     names would get one lock file per name (and SQLite one journal per \
                     name), so dblock refuses it",
                    md.nlink()
                )));
            }
            std::fs::canonicalize(db_path)
                .map_err(|e| Error::io(format!("cannot resolve {}", db_path.display()), e))
        }
    }
}

/// The lock file beside a (resolved) database: `PATH-locks`.
pub(crate) fn lock_file_path(db_path: &Path) -> PathBuf {
    let mut s = db_path.as_os_str().to_os_string();
    s.push("-locks");
    PathBuf::from(s)
}

/// How many open file descriptions of one lock file a process locks its keys through
/// (OFD locks; one with POSIX record locks, which belong to the process). The kernel
/// counts a reference to the open file up and down in every `fcntl` of a process with
/// more than one thread, so with one description the tasks of two threads moved its
/// counter between cores on each call: `fdget`/`fput` were a fifth of 8 workers' time
/// on 2 cores, a tenth with 8 descriptions (2026-12-06, `perf record`).
const FILES: usize = 8;

/// One open descriptor of a lock file, with the file's identity, and the other open file
/// descriptions of the same file that keys are spread over ([`Desc::file_for`]).
#[derive(Debug)]
pub(crate) struct Desc {
    pub(crate) file: File,
    /// Open file descriptions 1.. of the file (0 is `file`), each opened on first use;
    /// `None` where that failed, whose keys then use `file` (for as long as the `Desc`
    /// lives: a key's description never changes while it could be locked). Empty with
    /// POSIX record locks.
    more: Box<[std::sync::OnceLock<Option<File>>]>,
    dev: u64,
    ino: u64,
    /// The counts of processes in line, shared through the file (see [`sys::LineCounts`]).
    line: sys::LineCounts,
}

impl Desc {
    fn open(path: &Path, flavor: Flavor) -> std::io::Result<Desc> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)?;
        let md = file.metadata()?;
        let line = sys::LineCounts::map(&file, flavor)?;
        let more = match flavor {
            Flavor::Ofd => (1..FILES).map(|_| std::sync::OnceLock::new()).collect(),
            Flavor::Posix => Box::default(),
        };
        Ok(Desc {
            file,
            more,
            dev: md.dev(),
            ino: md.ino(),
            line,
        })
    }

    /// The open file description the key at `offset` is locked through: one of
    /// [`FILES`], by the key's pair (gate and lock byte share one, as they must: locks
    /// of one description merge, and another's would conflict). The pair that holds
    /// [`sys::USERS`], locked through `file` by [`sys::LineCounts::map`], falls to `file`
    /// too. Keys never share bytes, so locks through different descriptions of the
    /// process never meet.
    pub(crate) fn file_for(&self, offset: u64) -> &File {
        let i = ((offset >> 1).wrapping_add(1) % FILES as u64) as usize;
        match i.checked_sub(1).and_then(|i| self.more.get(i)) {
            Some(more) => more.get_or_init(|| reopen(&self.file)).as_ref(),
            None => None,
        }
        .unwrap_or(&self.file)
    }

    /// The count of processes in line for keys of `offset`'s group: 0 when nobody
    /// waits for a key like it (see the [module docs](super#waiting-in-line)).
    pub(crate) fn line(&self, offset: u64) -> &std::sync::atomic::AtomicU32 {
        self.line.of(offset)
    }

    /// Whether `path` still names this descriptor's file.
    pub(crate) fn is_named_by(&self, path: &Path) -> bool {
        match std::fs::metadata(path) {
            Ok(md) => md.dev() == self.dev && md.ino() == self.ino,
            Err(_) => false,
        }
    }
}

/// A new open file description of `file`'s file, whatever its path names now
/// (`/proc/self/fd/N` names the open file itself); `None` where that cannot be had
/// (no `/proc`): the caller then uses `file`.
fn reopen(file: &File) -> Option<File> {
    use std::os::fd::AsRawFd;
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()
}

/// A lock file as this process uses it: shared by every handle on it.
pub(crate) struct LockFile {
    pub(crate) path: PathBuf,
    pub(crate) flavor: Flavor,
    network_fs: Option<&'static str>,
    /// The descriptor new requests lock through, and those the path named before it
    /// (kept open while locks on them are held: see [`LockFile::reopen`]). Read by
    /// every acquisition, written only when the file is replaced.
    current: RwLock<Arc<Desc>>,
    /// Descriptors never to be closed while this file is in use (POSIX locks).
    spares: Mutex<Vec<File>>,
    /// When the path was last seen to name `current`'s file, in nanoseconds of `clock`
    /// (see [`LockFile::still_named`]); 0 after a reopen is decided.
    checked: AtomicU64,
    clock: Clock,
    /// The address of `current`'s descriptor, for telling without the lock whether a
    /// descriptor is still current (set under `current`'s write lock).
    current_at: AtomicUsize,
    /// What this process does with the keys of this file, in [`SHARDS`] parts by key.
    shards: Box<[Shard]>,
}

impl LockFile {
    /// The network or FUSE file system the lock file is on, if it is (see
    /// [`sys::network_filesystem`]).
    pub(crate) fn network_fs(&self) -> Option<&'static str> {
        self.network_fs
    }
}

/// How long after a lock file is replaced (deleted, or renamed over) a grant may still
/// be made in the old file: the path is looked up again at most this often on the
/// path every lock takes, instead of once per grant (a `stat` of the path cost as much
/// as the lock itself). `docs/how-it-works.md` documents the bound.
pub(crate) const REPLACED_BOUND: Duration = Duration::from_millis(10);

/// The clock [`LockFile::still_named`] keeps [`REPLACED_BOUND`] by, read on every grant:
/// the kernel's coarse clock where there is one with a tick of at most half the bound (a
/// sixth of the precise clock's cost), trusting a look for the bound less one tick of
/// that clock — a coarse reading lags the time by up to a tick, so the bound still holds
/// as documented — else [`Instant`].
struct Clock {
    /// A look this many nanoseconds old (by this clock) or more is looked again.
    trust: u64,
    /// `None`: the coarse clock.
    born: Option<Instant>,
}

impl Clock {
    fn new() -> Clock {
        let bound = REPLACED_BOUND.as_nanos() as u64;
        match (sys::coarse_clock(false), sys::coarse_clock(true)) {
            // A tick of up to half the bound (a kernel of 200 Hz or more).
            (Some(_), Some(tick)) if tick <= bound / 2 => Clock {
                trust: bound.saturating_sub(tick),
                born: None,
            },
            _ => Clock {
                trust: bound,
                born: Some(Instant::now()),
            },
        }
    }

    /// Nanoseconds now, never 0 (which `checked` keeps for "look again"), but when the
    /// clock cannot be read: 0, so that the path is looked up.
    fn now(&self) -> u64 {
        match self.born {
            // Plus one, so that a reading at time 0 is not "never".
            Some(born) => born.elapsed().as_nanos() as u64 + 1,
            None => sys::coarse_clock(false).unwrap_or(0),
        }
    }
}

/// How many parts the table of a lock file has. Requests for different keys meet on one
/// mutex only when their keys fall in one part, so tasks working on keys of their own
/// rarely wait for each other (with one mutex for the whole table, 8 workers on 2 cores
/// did 0.42× the raw `fcntl` rate).
const SHARDS: usize = 64;

/// One part of a lock file's table: the keys whose offset falls in it, and the tasks
/// waiting for a change to them. Aligned to keep two parts off one cache line.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Shard {
    /// Keys (file offsets) of this part that this process holds or waits for (loom's
    /// mutex in the models: `sqlite/loom_models.rs`).
    pub(crate) table: crate::sync::Mutex<super::Table>,
    /// Tasks waiting for a change to a key of this part; notified only when there are
    /// some.
    pub(crate) waiters: AtomicUsize,
    pub(crate) released: Notify,
}

impl std::fmt::Debug for LockFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockFile")
            .field("path", &self.path)
            .finish()
    }
}

/// The process's open lock files, by path (after resolution).
static OPEN: Mutex<Vec<(PathBuf, Weak<LockFile>)>> = Mutex::new(Vec::new());

impl LockFile {
    /// The process's lock file at `path` (resolved), opened (and created) if no handle
    /// of this process has it open.
    pub(crate) fn open(
        path: PathBuf,
        allow_network_filesystem: bool,
    ) -> Result<Arc<LockFile>, Error> {
        let flavor = sys::flavor().map_err(Error::configuration)?;
        let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|(_, w)| w.strong_count() > 0);
        let found = open
            .iter()
            .find(|(p, _)| *p == path)
            .and_then(|(_, w)| w.upgrade());
        let lf = match found {
            Some(lf) => lf,
            None => {
                let desc = Desc::open(&path, flavor).map_err(|e| {
                    Error::io(format!("cannot open lock file {}", path.display()), e)
                })?;
                let network_fs = sys::network_filesystem(&desc.file)
                    .map_err(|e| Error::io(format!("cannot inspect {}", path.display()), e))?;
                let desc = Arc::new(desc);
                let lf = Arc::new(LockFile {
                    path: path.clone(),
                    flavor,
                    network_fs,
                    current_at: AtomicUsize::new(Arc::as_ptr(&desc) as usize),
                    current: RwLock::new(desc),
                    spares: Mutex::new(Vec::new()),
                    checked: AtomicU64::new(0),
                    clock: Clock::new(),
                    shards: (0..SHARDS).map(|_| Shard::default()).collect(),
                });
                open.push((path, Arc::downgrade(&lf)));
                lf
            }
        };
        drop(open);
        if let (Some(filesystem), false) = (lf.network_fs, allow_network_filesystem) {
            return Err(Error::UnsupportedFilesystem {
                path: lf.path.clone(),
                filesystem,
            });
        }
        Ok(lf)
    }

    /// The descriptor new requests lock through.
    pub(crate) fn current(&self) -> Arc<Desc> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether `desc` is the current descriptor (a load, no lock): set under the
    /// write lock of `current` with the descriptor it names, so a descriptor read as
    /// current was current when this was called (a kept `Arc` is never freed, so its
    /// address is never another's).
    pub(crate) fn is_current(&self, desc: &Arc<Desc>) -> bool {
        self.current_at.load(Ordering::Acquire) == Arc::as_ptr(desc) as usize
    }

    /// Whether the path still names `desc`'s file, as far as a grant needs to know: a
    /// descriptor no longer current is not; the current one is looked up by path if
    /// the last look is [`REPLACED_BOUND`] old or more, and trusted otherwise.
    pub(crate) fn still_named(&self, desc: &Arc<Desc>) -> bool {
        let now = self.clock.now();
        let last = self.checked.load(Ordering::Relaxed);
        if last != 0 && now != 0 && now.saturating_sub(last) < self.clock.trust {
            return self.current_at.load(Ordering::Acquire) == Arc::as_ptr(desc) as usize;
        }
        let named = desc.is_named_by(&self.path);
        if named {
            let current = self.current.read().unwrap_or_else(|p| p.into_inner());
            if Arc::ptr_eq(&current, desc) {
                self.checked.store(now, Ordering::Relaxed);
            }
        }
        named
    }

    /// Makes the next [`LockFile::still_named`] look the path up: a check of a held
    /// lock found the file replaced.
    pub(crate) fn recheck(&self) {
        self.checked.store(0, Ordering::Relaxed);
    }

    /// The part of the table that holds `offset`. A lock byte and its gate (the other
    /// byte of its pair) fall in one part, so that everything touching a pair's bytes
    /// is done under one mutex.
    pub(crate) fn shard(&self, offset: u64) -> &Shard {
        &self.shards[(offset >> 1) as usize % SHARDS]
    }

    /// The path no longer names `stale`'s file: opens the file it names now (creating it
    /// if it was deleted) and makes that the descriptor new requests use. Descriptors of
    /// the old file stay open while locks on it are held (their holders keep an `Arc`).
    pub(crate) fn reopen(&self, stale: &Arc<Desc>) -> Result<(), Error> {
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&current, stale) {
            return Ok(()); // another request reopened it already
        }
        let desc = Desc::open(&self.path, self.flavor).map_err(|e| {
            Error::io(
                format!("cannot reopen lock file {}", self.path.display()),
                e,
            )
        })?;
        if desc.dev == current.dev && desc.ino == current.ino {
            // The path names our file again (renamed back). Never close a second
            // descriptor of a file holding POSIX locks: keep it.
            self.spares
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(desc.file);
            return Ok(());
        }
        *current = Arc::new(desc);
        self.current_at
            .store(Arc::as_ptr(&current) as usize, Ordering::Release);
        // The new descriptor was opened by the path just now.
        self.checked.store(self.clock.now(), Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Clock, REPLACED_BOUND, sys};

    /// The clock of the replaced-file bound: never 0, never backwards, and a look it
    /// trusts is never older than the bound in real time, whichever clock it is.
    #[test]
    fn the_replaced_file_clock_keeps_the_bound() {
        let clock = Clock::new();
        let bound = REPLACED_BOUND.as_nanos() as u64;
        match clock.born {
            None => {
                let tick = sys::coarse_clock(true).unwrap_or(u64::MAX);
                assert!(clock.trust.saturating_add(tick) <= bound);
                assert!(
                    clock.trust >= bound / 2,
                    "a lookup at least every half bound"
                );
            }
            Some(_) => assert_eq!(clock.trust, bound),
        }
        let first = clock.now();
        let mut last = first;
        let start = std::time::Instant::now();
        while start.elapsed() < 3 * REPLACED_BOUND {
            let now = clock.now();
            assert!(now != 0 && now >= last);
            last = now;
        }
        // Three bounds of real time moved the clock past what it trusts.
        assert!(
            last - first >= clock.trust,
            "{} < {}",
            last - first,
            clock.trust
        );
    }
}
