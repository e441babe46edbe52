//! The benchmark's floor on the embedded backend: per worker, a descriptor of its own
//! on the lock file, and `F_OFD_SETLK` lock + unlock of the key's byte, bypassing the
//! process's table.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::sys::{self, Attempt};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BenchFloor, BoxFuture, Mode};

/// Descriptors, one per worker, opened on first use.
pub(crate) struct Floor {
    path: PathBuf,
    files: Mutex<Vec<Option<Arc<std::fs::File>>>>,
}

impl Floor {
    pub(crate) fn new(path: PathBuf) -> Floor {
        Floor {
            path,
            files: Mutex::new(Vec::new()),
        }
    }

    async fn cycle(&self, w: usize, key: Key) -> Result<Duration, Error> {
        let file = {
            let mut fs = self.files.lock().unwrap_or_else(|p| p.into_inner());
            if fs.len() <= w {
                fs.resize(w + 1, None);
            }
            match &fs[w] {
                Some(f) => f.clone(),
                None => {
                    let f = std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(&self.path)
                        .map_err(|e| Error::io("the benchmark's floor", e))?;
                    let f = Arc::new(f);
                    fs[w] = Some(f.clone());
                    f
                }
            }
        };
        // With this process's kind of lock.
        let flavor = sys::flavor()
            .map_err(|e| Error::io("the benchmark's floor", std::io::Error::other(e)))?;
        let t = Instant::now();
        loop {
            match sys::try_lock(&file, flavor, key.file_offset(), 1, Mode::Exclusive) {
                Ok(Attempt::Granted) => break,
                Ok(Attempt::Busy) => tokio::task::yield_now().await,
                Err(e) => return Err(Error::io("the benchmark's floor", e)),
            }
        }
        let d = t.elapsed();
        sys::unlock(&file, flavor, key.file_offset(), 1)
            .map_err(|e| Error::io("the benchmark's floor", e))?;
        Ok(d)
    }
}

impl BenchFloor for Floor {
    fn cycle(
        self: Arc<Self>,
        worker: usize,
        key: Key,
        _hot: bool,
    ) -> BoxFuture<'static, Result<Duration, Error>> {
        Box::pin(async move { Floor::cycle(&self, worker, key).await })
    }
}
