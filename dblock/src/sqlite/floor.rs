//! The benchmark's floors on the embedded backend: the cheapest correct way to do a
//! worker's lock cycle on the lock file with bare system calls, none of dblock's table,
//! line or checks. Every worker has a descriptor of its own on the lock file (its own
//! open file description, so the kernel excludes workers from each other as it would
//! processes), all opened by [`BenchFloor::open`] before anything is timed.
//!
//! - `uncontended`: `F_OFD_SETLK` write lock on the key's byte, then unlock: two system
//!   calls a cycle, the least any byte-range lock costs.
//! - `hot` (8 workers, one key): the workers take turns through an async FIFO mutex
//!   (`tokio::sync::Mutex`, so a worker waiting for its turn yields its thread rather than
//!   spinning), and the worker whose turn it is locks the byte, then unlocks it before
//!   passing the turn on: the same two system calls a cycle, the byte locked for every
//!   holder, and the cheapest correct hand-off between async tasks. A blocking
//!   `F_OFD_SETLKW` on per-worker descriptors (the kernel's own queue) is not one: it
//!   blocks a runtime thread for as long as another worker holds the byte, so a holder
//!   that awaits while holding can stall the runtime. It measured faster on the bench's
//!   loop, because the thread that unlocks takes the byte again before the woken waiter
//!   runs (few cycles are hand-offs); `docs/performance.md` gives both figures.
//!
//! With POSIX record locks (`DBLOCK_FILE_LOCKS=posix`) the same calls are `F_SETLK`;
//! workers of one process then do not exclude each other in the kernel, but the floor's
//! cycles are the same system calls.

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::sys::{self, Attempt, Flavor};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BenchCycles, BenchFloor, BenchRun, BoxFuture, CycleClock, Mode};

/// Descriptors, one per worker, opened by `open`.
pub(crate) struct Floor {
    path: PathBuf,
    files: OnceLock<Vec<File>>,
    /// Whose turn it is on the `hot` key.
    turn: tokio::sync::Mutex<()>,
}

fn fail(e: std::io::Error) -> Error {
    Error::io("the benchmark's floor", e)
}

impl Floor {
    pub(crate) fn new(path: PathBuf) -> Floor {
        Floor {
            path,
            files: OnceLock::new(),
            turn: tokio::sync::Mutex::new(()),
        }
    }

    fn open(&self, workers: usize) -> Result<(), Error> {
        let mut files = Vec::with_capacity(workers);
        for _ in 0..workers {
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&self.path)
                .map_err(fail)?;
            files.push(f);
        }
        // Opened once for the whole run (a second call keeps the first set).
        let _ = self.files.set(files);
        Ok(())
    }

    async fn cycle(&self, w: usize, key: Key, hot: bool, timed: bool) -> Result<Duration, Error> {
        let file = self
            .files
            .get()
            .and_then(|fs| fs.get(w))
            .ok_or_else(|| fail(std::io::Error::other("worker without a descriptor")))?;
        // With this process's kind of lock.
        let flavor = sys::flavor().map_err(|e| fail(std::io::Error::other(e)))?;
        let offset = key.file_offset();
        let t = CycleClock::start(timed);
        let turn = match hot {
            true => Some(self.turn.lock().await),
            false => None,
        };
        lock(file, flavor, offset).await?;
        let d = t.elapsed();
        sys::unlock(file, flavor, offset, 1).map_err(fail)?;
        drop(turn);
        Ok(d)
    }
}

/// Locks the byte at `offset`: at once, unless another process holds it (never, unless
/// something else uses the benchmark's names), then by trying again.
async fn lock(file: &File, flavor: Flavor, offset: u64) -> Result<(), Error> {
    loop {
        match sys::try_lock(file, flavor, offset, 1, Mode::Exclusive).map_err(fail)? {
            Attempt::Granted => return Ok(()),
            Attempt::Busy => tokio::task::yield_now().await,
        }
    }
}

impl BenchFloor for Floor {
    fn open(self: Arc<Self>, workers: usize) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(std::future::ready(Floor::open(&self, workers)))
    }

    fn run<'a>(
        &'a self,
        worker: usize,
        keys: &'a [Key],
        hot: bool,
        run: BenchRun,
    ) -> BoxFuture<'a, Result<BenchCycles, Error>> {
        Box::pin(
            run.drive(move |i, timed| {
                Floor::cycle(self, worker, *BenchRun::nth(keys, i), hot, timed)
            }),
        )
    }
}
