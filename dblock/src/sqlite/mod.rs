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
//! A process opens each lock file once, with `O_CLOEXEC` so that the commands it starts
//! do not inherit its locks by accident (a guard hands them on deliberately, with
//! [`LockGuard::share_with_child`](crate::LockGuard::share_with_child): the child's copy
//! of the open file description keeps the locks of this process held through it until
//! the child exits, should this process die first), and every handle of the process on
//! that file shares it. With OFD locks the process spreads its keys over 8 open file
//! descriptions of the one file (reopened through `/proc/self/fd`, so always the same
//! file; each on first use), by key, so that its threads do not all count references to
//! one open file in the kernel: a child given a lock keeps the locks of the keys that
//! share its description too (one key in 8). A table of held keys decides between the
//! process's own holders (see [One process, many tasks](#one-process-many-tasks)), so two
//! tasks never both hold a lock because they share a description. A process that `fork`s
//! without `exec` shares its OFD locks with the child: don't.
//!
//! Network and FUSE file systems are refused ([`Error::UnsupportedFilesystem`]): their
//! byte-range locks may not exclude across hosts.
//!
//! # Waiting in line
//!
//! Next to each lock byte lies a *gate* byte (its neighbour: `offset ^ 1`). A request
//! first tries gate and lock byte together, in one non-blocking call. An exclusive
//! request keeps the gate while it holds the lock if no process waits in line for a key
//! of its group, and gives both back in one call: two system calls a cycle, uncontended,
//! the least a byte-range lock costs. Waiting processes are counted per group of keys
//! (1,024 groups, by offset) in the lock file's first page, which every process maps
//! shared: reading the count is a load, not a call. With a count above zero, or in
//! shared mode, the gate goes back at once (three calls a cycle), so that the head of
//! the line can take it. The count is a hint, never what excludes: one left by a
//! process killed in line costs that group the third call until every process using the
//! file has closed it (each holds a read lock on the file's last byte, 2^63 − 1, while
//! it has the file open; the first to open it takes that byte exclusively for a moment
//! and clears the counts), and a count read a moment before a waiter raised it lets one
//! request pass that waiter once. A waiter blocked on a gate that a holder keeps cannot
//! be seen in the kernel: so a holder that gives gate and lock back while a process is
//! counted in line lets that process go first — its next request for the name stands in
//! line, and the line's thread waits until another process holds the gate or the lock
//! byte (at most 20 ms) before it asks for the gate. When the try fails, the process
//! gets in line: one thread (per process and name, named `dblock-` and the offset's low
//! 32 bits in hex) waits in the kernel for the gate (`F_OFD_SETLKW`), where the kernel
//! queues conflicting waiters in arrival order; at the head of the line it polls the
//! lock byte (50 µs, each look 50 µs later than the last, up to every 1 ms), holding the
//! gate, then gives the gate back. Whoever is at the head of the
//! line holds the gate, so a holder that releases and comes straight back, or a new
//! reader while a writer waits, fails the first try and gets in line behind it instead
//! of taking the lock again before the waiter wakes up. Within a process, a released lock
//! goes to the process's own waiters at once (see below); the process as a whole takes
//! its turn in the line (fairness is between processes, as each one stands in line once
//! per name).
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
//! # One process, many tasks
//!
//! The table of a lock file is split by key into 64 parts, each under its own mutex
//! (`table.rs`), so tasks working on different names rarely wait for each other: only
//! the kernel's own lock on the file's lock list is shared. A key held in this process
//! keeps, beside its holders, the process's tasks waiting for it, in arrival order
//! (each on a one-shot channel). A second shared holder joins the first's read lock
//! (unless another process's writer holds the gate); any other request waits behind.
//!
//! When an exclusive holder leaves and the first task behind it wants the lock
//! exclusively too, the lock is handed straight over: the byte stays locked, nothing
//! else can come between, and the hand-over costs no system call (the holder keeps the
//! gate and no process is counted in line) or one (`F_OFD_GETLK` finds the gate free:
//! no other process is at the head of the line) instead of an unlock and a new
//! acquisition — provided, too, that the path still names the file the byte is locked
//! in (the same bound in time as for a new grant). Otherwise, and whenever the
//! last holder leaves with nobody to hand to, the byte is unlocked and every task
//! behind looks again, so a process waiting in line gets the lock before this
//! process's next task, as before. Tasks behind a holder leave at once when cancelled;
//! a lock handed to a task that was cancelled meanwhile goes to the next one, or back.
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
//! retried on the file the path names now. The check is bound in time rather than made
//! per grant (a `stat` of the path cost as much as the lock): the path is looked up at
//! most every 10 ms, so every grant made more than 10 ms after the replacement is in
//! the new file. Locks granted *before* it stay on the old file, where later requests no
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
//! lives and, with POSIX locks, never opens a second (don't open the lock file yourself
//! in a process that holds locks in it); with OFD locks it keeps up to 8 (see above). Set `DBLOCK_FILE_LOCKS=posix` to use them on Linux (the test
//! suite runs this way too), `ofd` to insist on OFD locks; anything else is an error
//! when a handle is opened. OFD and POSIX locks conflict with each other on Linux, so
//! processes using either exclude each other. Neither kind detects deadlocks between
//! dblock's waiters (the kernel's detection for POSIX locks sees one owner per process
//! and so reports cycles that are not there; such a report is retried). See
//! `docs/platforms.md` for what is tested where.

mod adopt;
mod bookkeeping;
mod doctor;
pub(crate) mod fence;
mod file;
mod floor;
mod leader;
#[cfg(all(test, dblock_loom))]
mod loom_models;
mod migrate;
mod queue;
mod runs;
mod status;
mod sys;
mod table;
mod tokens;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{Error, LossReason};
use crate::raw::{
    BenchFloor, BoxFuture, Entry, FENCING_TABLE, Grant, Held, Mode, Options, RawLocks, RawTable,
    Req, Wait,
};

pub(crate) use file::lock_file_path;
use file::{Desc, LockFile, Shard};
use table::Step;

/// Opens the backend a `sqlite:PATH` or `sqlite://PATH` URL names; the default
/// namespace with it.
///
/// The file's directory must exist: a mistyped path would otherwise create a lock file
/// nobody else uses, excluding nothing. (Only the embedded default's directories are
/// created, by [`open_path`].)
pub(crate) fn open(url: &str, opts: &Options) -> Result<(Box<dyn RawLocks>, String), Error> {
    let invalid = |reason: String| Error::InvalidUrl {
        url: crate::error::redact_url(url),
        reason,
    };
    let path = parse_url(url).map_err(invalid)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        return Err(invalid(format!(
            "the directory {} does not exist (dblock creates a lock file where the path \
             says, but no directories but the default's: a mistyped path would exclude \
             nothing)",
            dir.display()
        )));
    }
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
    /// The database, opened on first use (migrations, leaders, runs; tokens where the
    /// boot is unknown), every commit waiting for the disk.
    db: tokio::sync::OnceCell<sqlx::SqlitePool>,
    /// The database again, for fencing tokens within a durable epoch: commits that do
    /// not wait for the disk (see [`fence`]), through SQLite's library on the caller's
    /// thread (see [`tokens`]).
    pub(crate) tokens: tokens::Tokens,
    /// This boot's token epoch, made durable once (see [`fence`]); `None` where the
    /// boot cannot be told apart from the last.
    epoch: tokio::sync::OnceCell<Option<i64>>,
}

/// A key held by this process: by how many shared holders, or by one exclusive one, and
/// through which descriptor (the lock file may have been replaced since); and the tasks
/// of this process waiting for it, in arrival order.
pub(crate) struct Slot {
    readers: u32,
    writer: bool,
    /// Whether the exclusive holder holds the gate too (taken with the lock byte while
    /// nobody waited in line, and kept: see the [module docs](self#waiting-in-line)).
    gate: bool,
    /// The descriptor the lock is held through: `None` for its part's current one
    /// ([`Table::desc`]), which a grant then does not clone — an `Arc` that every
    /// thread's grants count up and down moves its cache line between cores on each
    /// (8 workers on 2 cores: a tenth of a cycle). A part gives such slots a copy of
    /// its descriptor before it replaces it ([`Table::set_desc`]).
    desc: Option<Arc<Desc>>,
    behind: VecDeque<Behind>,
}

impl Slot {
    /// The descriptor the lock is held through, given its part's current one (the
    /// part's [`Table::desc`], passed apart so that a slot borrowed mutably from the part's
    /// map can still ask).
    pub(crate) fn desc_or<'a>(&'a self, current: &'a Option<Arc<Desc>>) -> Option<&'a Arc<Desc>> {
        self.desc.as_ref().or(current.as_ref())
    }

    /// A slot for a lock just granted in `desc` (`None`: its part's current descriptor),
    /// whose file the path was just seen to name.
    pub(crate) fn new(mode: Mode, desc: Option<Arc<Desc>>) -> Slot {
        let (readers, writer) = match mode {
            Mode::Shared => (1, false),
            Mode::Exclusive => (0, true),
        };
        Slot {
            readers,
            writer,
            gate: false,
            desc,
            behind: VecDeque::new(),
        }
    }
}

/// A task of this process waiting for a key this process holds: an exclusive lock may
/// be handed to it directly; dropping `tx` tells it to look again.
struct Behind {
    id: u64,
    mode: Mode,
    shared: Arc<Shared>,
    tx: tokio::sync::oneshot::Sender<Entry>,
}

/// One part of the table (see [`Shard`](super::file::Shard)).
#[derive(Default)]
pub(crate) struct Table {
    /// Keys (file offsets) held.
    held: OffsetMap<Slot>,
    /// Keys this process waits for in line, in the kernel.
    queued: OffsetMap<queue::Queued>,
    /// Keys this process gave back, gate and all, while another process waited in line
    /// (counted), and when: its next request for one waits in line until that process
    /// has taken the gate or the lock byte (see the [module docs](self#waiting-in-line)).
    yielded: OffsetMap<std::time::Instant>,
    /// The lock file's current descriptor as this part last saw it: a grant clones it
    /// under the part's mutex, instead of reading the file's shared `RwLock` (two atomic
    /// writes to one cache line that every thread of the process shares). Replaced at
    /// the part's next grant after a reopen; until then it keeps the replaced file's
    /// descriptor open (one per part at most), never a lock.
    desc: Option<Arc<file::Desc>>,
}

impl Table {
    /// Makes `desc` the part's current descriptor; the slots that held their lock
    /// through the one it replaces keep a copy of that one.
    pub(crate) fn set_desc(&mut self, desc: Arc<Desc>) {
        if let Some(old) = self.desc.replace(desc) {
            for slot in self.held.values_mut() {
                if slot.desc.is_none() {
                    slot.desc = Some(old.clone());
                }
            }
        }
    }
}

/// A map by file offset. Offsets come from SHA-256 digests, so they need no keyed hash
/// against chosen collisions; SipHash cost as much as a third of an uncontended cycle.
pub(crate) type OffsetMap<V> = crate::key::DigestMap<u64, V>;

impl SqliteBackend {
    /// Resolves `db_path` to its file and opens (creating if needed) the lock file
    /// beside it, and its directory.
    fn open(db_path: PathBuf, opts: &Options) -> Result<SqliteBackend, Error> {
        let db_path = file::resolve_db_path(&db_path)?;
        let lock = LockFile::open(lock_file_path(&db_path), opts.allow_network_filesystem)?;
        Ok(SqliteBackend {
            shared: Arc::new(Shared {
                tokens: tokens::Tokens::new(db_path.clone()),
                db_path,
                lock,
                db: tokio::sync::OnceCell::new(),
                epoch: tokio::sync::OnceCell::new(),
            }),
        })
    }

    async fn acquire(&self, req: &Req<'_>) -> Result<Option<Grant>, Error> {
        let offset = req.key.file_offset();
        // The wait and the fencing token are boxed: their futures (the line, the token's
        // statements) are large, and an uncontended, unfenced cycle would otherwise copy
        // them whole when the request's future is boxed — a fifth of its time.
        let held = match self.shared.take_now(offset, req.mode)? {
            true => self.shared.entry(offset, req.mode),
            false => match Box::pin(self.wait(offset, req.mode, req.wait)).await? {
                Some(h) => h,
                None => return Ok(None),
            },
        };
        // Armed: if the token cannot be had (or this future is dropped), `held` drops and
        // releases.
        let fence = match req.fenced {
            true => Some(crate::raw::Token {
                token: Box::pin(fence::next_token(&self.shared, req)).await?,
                table: Arc::from(FENCING_TABLE),
                lease: req.lease,
            }),
            false => None,
        };
        Ok(Some(Grant {
            held: Held::Entry(held),
            fence,
        }))
    }

    async fn wait(&self, offset: u64, mode: Mode, wait: Wait) -> Result<Option<Entry>, Error> {
        let deadline = match wait {
            Wait::Try => return Ok(None),
            w => w.deadline(),
        };
        let shared = &self.shared;
        let lf = &shared.lock;
        let shard = lf.shard(offset);
        shard.waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = WaiterCount(shard);
        let expired = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let mut expired = std::pin::pin!(expired);
        // Registered for a wake-up before the look that may find nothing to do but
        // wait for one (so none is missed); only then, as that is rare.
        let mut armed = false;
        loop {
            let notified = shard.released.notified();
            let mut notified = std::pin::pin!(notified);
            if armed {
                notified.as_mut().enable();
            }
            match shared.step(offset, mode)? {
                Step::Granted(held) => return Ok(Some(held)),
                Step::Local if !armed => armed = true,
                Step::Local => {
                    tokio::select! {
                        () = notified => {}
                        () = &mut expired => return Ok(None),
                    }
                }
                Step::Behind(id, rx) => {
                    // However this ends, the request leaves its place behind the holder;
                    // a lock handed to a dropped receiver is released by the channel.
                    let _behind = PlaceBehind { shared, offset, id };
                    tokio::select! {
                        r = rx => {
                            if let Ok(held) = r {
                                return Ok(Some(held));
                            }
                            // Released, or something else changed: look again.
                        }
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
    pub(crate) async fn lock_key(&self, key: crate::Key) -> Result<Entry, Error> {
        let (offset, mode) = (key.file_offset(), Mode::Exclusive);
        if self.shared.take_now(offset, mode)? {
            return Ok(self.shared.entry(offset, mode));
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

/// A request's place behind this process's holder, left when dropped.
struct PlaceBehind<'a> {
    shared: &'a Shared,
    offset: u64,
    id: u64,
}

impl Drop for PlaceBehind<'_> {
    fn drop(&mut self) {
        self.shared.leave(self.offset, self.id);
    }
}

/// Keeps the waiter count right however the wait ends.
struct WaiterCount<'a>(&'a Shard);

impl Drop for WaiterCount<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long the database's writers wait for each other (SQLite's busy timeout).
pub(crate) const DB_BUSY: Duration = Duration::from_secs(30);

impl Shared {
    /// The database, opened on first use: WAL, `synchronous = FULL` (what it records
    /// must survive a power loss), a busy timeout for other processes' writes.
    pub(crate) async fn db(&self) -> Result<&sqlx::SqlitePool, Error> {
        use sqlx::sqlite::SqliteSynchronous;
        self.db
            .get_or_try_init(|| self.open_db(SqliteSynchronous::Full, 4))
            .await
    }

    async fn open_db(
        &self,
        synchronous: sqlx::sqlite::SqliteSynchronous,
        connections: u32,
    ) -> Result<sqlx::SqlitePool, Error> {
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
        let opts = SqliteConnectOptions::new()
            .filename(&self.db_path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(DB_BUSY);
        // Switching a fresh file to WAL while other processes open it too can answer
        // SQLITE_BUSY at once, without the busy handler waiting: tried again, within
        // the busy timeout, as a busy write would have been.
        let started = Instant::now();
        loop {
            let opened = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(connections)
                .connect_with(opts.clone())
                .await;
            match opened {
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some("5") && started.elapsed() < DB_BUSY =>
                {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                opened => {
                    return opened.map_err(|e| Error::Connect {
                        target: format!("sqlite:{}", self.db_path.display()),
                        message: e.to_string(),
                    });
                }
            }
        }
    }
}

impl RawLocks for SqliteBackend {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn diagnose(&self) -> BoxFuture<'_, Result<Vec<crate::doctor::Check>, Error>> {
        Box::pin(std::future::ready(Ok(SqliteBackend::diagnose(self))))
    }

    fn acquire<'a>(&'a self, req: &'a Req<'a>) -> BoxFuture<'a, Result<Option<Grant>, Error>> {
        Box::pin(SqliteBackend::acquire(self, req))
    }

    /// An unfenced request whose lock this process's table and the file give at once;
    /// a try that finds it taken. Anything else (a wait, a fencing token's statements)
    /// goes through `acquire`, which tries again: one call more before a wait.
    fn acquire_now(&self, req: &Req<'_>) -> Option<Result<Option<Grant>, Error>> {
        if req.fenced {
            return None;
        }
        let offset = req.key.file_offset();
        match self.shared.take_now(offset, req.mode) {
            Err(e) => Some(Err(e)),
            Ok(true) => Some(Ok(Some(Grant {
                held: Held::Entry(self.shared.entry(offset, req.mode)),
                fence: None,
            }))),
            Ok(false) if matches!(req.wait, Wait::Try) => Some(Ok(None)),
            Ok(false) => None,
        }
    }

    fn bench_floor(&self) -> Result<Arc<dyn BenchFloor>, Error> {
        Ok(Arc::new(floor::Floor::new(self.shared.lock.path.clone())))
    }
}

impl Shared {
    /// The lock at `offset`, just granted in `mode`, as an entry of this table: what a
    /// guard keeps, and what one task hands another (behind a holder, from the line);
    /// dropped, it releases the lock (unless [`Entry::disarm`]ed).
    pub(crate) fn entry(self: &Arc<Self>, offset: u64, mode: Mode) -> Entry {
        Entry::new(self.clone(), offset, mode)
    }
}

impl Shared {
    /// A duplicate of the lock file's descriptor the lock at `offset` is held through:
    /// the same open file description, whose OFD locks live while any copy of it is
    /// open. POSIX record locks belong to the process instead, and end with it whatever
    /// its children hold.
    fn share_entry(&self, offset: u64) -> Result<std::os::fd::OwnedFd, Error> {
        if self.lock.flavor != sys::Flavor::Ofd {
            return Err(Error::unsupported(
                crate::error::Capability::ShareWithChild,
                "the embedded backend's POSIX record locks (macOS, the BSDs, or \
                 DBLOCK_FILE_LOCKS=posix) belong to the process that took them, and end with \
                 it whatever descriptors its children hold",
            ));
        }
        let desc = {
            let table = self
                .lock
                .shard(offset)
                .table
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            table
                .held
                .get(&offset)
                .and_then(|slot| slot.desc_or(&table.desc).cloned())
        };
        let Some(desc) = desc else {
            return Err(Error::LockLost {
                reason: LossReason::LockFileReplaced {
                    path: self.lock.path.clone(),
                },
            });
        };
        desc.file_for(offset)
            .try_clone()
            .map(std::os::fd::OwnedFd::from)
            .map_err(|e| Error::io("duplicating the lock file's descriptor", e))
    }

    /// `None` while the lock at `offset` is held in the file its path names; the loss
    /// otherwise (the lock file was replaced since the grant: see [`file`]).
    fn loss_of(&self, offset: u64) -> Option<LossReason> {
        match self.in_current_file(offset) {
            true => None,
            false => Some(LossReason::LockFileReplaced {
                path: self.lock.path.clone(),
            }),
        }
    }
}

/// A guard of the embedded backend keeps its lock as an entry of this table (the key's
/// byte offset): no allocation per grant. Its locks end only with their process, or
/// when their lock file is replaced: nothing to ask, no loss to wait for (a replaced
/// file is seen by `check`, `is_held` and `release`).
impl RawTable for Shared {
    fn loss(&self, entry: u64) -> Option<LossReason> {
        self.loss_of(entry)
    }

    fn lost(&self, _entry: u64) -> BoxFuture<'static, LossReason> {
        Box::pin(std::future::pending())
    }

    fn release(&self, entry: u64, mode: Mode) {
        Shared::release(self, entry, mode);
    }

    fn share(&self, entry: u64) -> Result<Vec<std::os::fd::OwnedFd>, Error> {
        self.share_entry(entry).map(|fd| vec![fd])
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
