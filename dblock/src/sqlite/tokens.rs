//! The connection fencing tokens are written through: SQLite's library called on the
//! requesting task's own thread, for the two short statements of a grant and for the
//! opening and checkpoints, which may wait for the disk (a multi-threaded runtime is told
//! first: see [`blocking`]).
//!
//! A grant through sqlx's connection (a thread of its own, a pool's checks as the
//! connection was taken and put back) spent about 1.5 ms of a one-shot `dblock run`'s
//! 4 ms in handing work to that thread and back; the statements themselves take tens of
//! microseconds. A statement here never waits inside SQLite: the busy timeout is zero,
//! and a write that finds another process writing sleeps (as a task) and tries again,
//! within [`DB_BUSY`] as SQLite's own busy handler would.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use super::DB_BUSY;
use crate::error::{Error, ServerCode};

/// How long the write-ahead log may grow, in frames, before an opening checkpoints it.
/// Nobody holds the log's index open between one-shot processes (`dblock run`), so each
/// opening rebuilds the index from the whole log, a few microseconds a frame; and this
/// connection closes without SQLite's checkpoint on close (its `fsync`s sat between
/// COMMAND's exit and `dblock run`'s), leaving the log as it is. SQLite's own bound, a
/// checkpoint at 1,000 frames, let the log reach 4 MB.
const WAL_FRAMES: u64 = 32;

/// A frame of the log: a page of the default 4 KiB and its 24-byte header.
const FRAME_BYTES: u64 = 4096 + 24;

/// After how many grants a long-lived connection checkpoints the log (SQLite's own
/// automatic checkpoint, which would wait for the disk inside a grant on the caller's
/// thread, is off).
const CHECKPOINT_EVERY: u32 = 1000;

/// The token connection of a handle: opened on first use, and again after a failure
/// that may have broken it.
pub(crate) struct Tokens {
    db_path: PathBuf,
    conn: tokio::sync::Mutex<Option<Conn>>,
}

struct Conn {
    db: Connection,
    /// Grants written since the last checkpoint.
    writes: u32,
}

impl Tokens {
    pub(crate) fn new(db_path: PathBuf) -> Tokens {
        Tokens {
            db_path,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// Runs `f` on the open connection (opening it first if needed), again while it
    /// finds the database busy with another process's write, until [`DB_BUSY`] has
    /// passed. `what` names the work in an error.
    pub(crate) async fn read<T>(
        &self,
        what: &str,
        f: impl Fn(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, Error> {
        self.run(what, false, f).await
    }

    /// As [`Tokens::read`], for a grant's write: counted, and every [`CHECKPOINT_EVERY`]
    /// writes the log is checkpointed. The write stands if the checkpoint fails: the
    /// connection is closed, and the next opening checkpoints.
    pub(crate) async fn write<T>(
        &self,
        what: &str,
        f: impl Fn(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, Error> {
        self.run(what, true, f).await
    }

    async fn run<T>(
        &self,
        what: &str,
        counted: bool,
        f: impl Fn(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, Error> {
        let mut slot = self.conn.lock().await;
        if slot.is_none() {
            let db = blocking(|| open(&self.db_path)).map_err(|e| failed(what, &e))?;
            *slot = Some(Conn { db, writes: 0 });
        }
        let started = Instant::now();
        let mut pause = Duration::from_micros(100);
        loop {
            let Some(conn) = slot.as_mut() else {
                return Err(Error::unexpected("the token connection is not open"));
            };
            match f(&conn.db) {
                Err(e) if is_busy(&e) && started.elapsed() < DB_BUSY => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
                Err(e) => {
                    if broken(&e) {
                        *slot = None;
                    }
                    return Err(failed(what, &e));
                }
                Ok(v) => {
                    if counted {
                        conn.writes += 1;
                        if conn.writes >= CHECKPOINT_EVERY {
                            conn.writes = 0;
                            if blocking(|| checkpoint(&conn.db)).is_err() {
                                *slot = None;
                            }
                        }
                    }
                    return Ok(v);
                }
            }
        }
    }
}

/// `e`, from the work `what` names, as dblock's error.
fn failed(what: &str, e: &rusqlite::Error) -> Error {
    let code = match e {
        rusqlite::Error::SqliteFailure(f, _) => {
            ServerCode::numbered(Some(f.extended_code.to_string()), None)
        }
        _ => ServerCode::default(),
    };
    Error::Database {
        code,
        message: format!("{what}: {e}"),
    }
}

/// Another process is writing (or recovering the log): worth trying again.
fn is_busy(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy)
}

/// A failure that is not the database's answer to a statement: the connection may be
/// unusable.
fn broken(e: &rusqlite::Error) -> bool {
    use rusqlite::ErrorCode::*;
    matches!(
        e.sqlite_error_code(),
        Some(
            DatabaseCorrupt
                | NotADatabase
                | SystemIoFailure
                | CannotOpen
                | FileLockingProtocolFailed
                | DiskFull
                | OutOfMemory
        )
    )
}

/// Runs `f`, which may wait for the disk, on this thread: a multi-threaded runtime is
/// told first (its other tasks move to another thread meanwhile); a current-thread
/// runtime has nobody else to run. Not handed to a thread of its own: on the machines
/// measured, waking a thread that waits took up to 3 ms, longer than the work.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Opens the database for tokens: WAL, `synchronous = NORMAL` (see [`super::fence`]),
/// the log bounded (see [`WAL_FRAMES`]), then a busy timeout of zero for the grants.
fn open(path: &Path) -> rusqlite::Result<Connection> {
    let db = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    db.busy_timeout(DB_BUSY)?;
    // Closing leaves the log to the next opening's bound: SQLite's checkpoint on close
    // would wait for the disk inside whatever drops the handle.
    db.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
        true,
    )?;
    // Switching a fresh file to WAL while other processes open it too can answer
    // SQLITE_BUSY at once, without the busy handler waiting: tried again, within the
    // busy timeout, as a busy write would have been.
    let started = Instant::now();
    loop {
        let mode = db.query_row("PRAGMA journal_mode = WAL", [], |r| r.get::<_, String>(0));
        match mode {
            Err(e) if is_busy(&e) && started.elapsed() < DB_BUSY => {
                std::thread::sleep(Duration::from_millis(10));
            }
            r => {
                r?;
                break;
            }
        }
    }
    // The log's file is cut back whenever SQLite starts the log over, so that its size
    // tells how long the log is.
    db.execute_batch(
        "PRAGMA synchronous = NORMAL; PRAGMA journal_size_limit = 0; \
         PRAGMA wal_autocheckpoint = 0",
    )?;
    let mut wal = path.as_os_str().to_os_string();
    wal.push("-wal");
    if std::fs::metadata(&wal).map_or(0, |m| m.len() / FRAME_BYTES) > WAL_FRAMES {
        // Not a reason to refuse the grant: a log another process is checkpointing, or
        // one this could not copy, is bounded by a later opening.
        let _ = checkpoint(&db);
    }
    db.busy_timeout(Duration::ZERO)?;
    Ok(db)
}

/// Copies the log into the database as far as no reader needs it (never waiting for
/// one: a later checkpoint copies the rest).
fn checkpoint(db: &Connection) -> rusqlite::Result<()> {
    db.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
        .optional()
        .map(drop)
}
