//! The benchmark's floor on PostgreSQL: the cheapest correct way to do the work of
//! dblock's cycle, issued directly on raw tokio-postgres connections, one per worker,
//! all opened before anything is timed.
//!
//! dblock's cycle (transaction scope, the default) takes a lock, holds it across a
//! round trip (the reply reaches the caller, who then lets it go), and releases it by
//! ending the lock's transaction. The floor does exactly that with the fewest
//! messages: each cycle is **one simple-protocol message and one round trip**,
//! `BEGIN; SELECT pg_advisory_xact_lock(k)`, whose reply says the lock is held; the
//! release rides at the head of the worker's next message, which is then
//! `ROLLBACK AND CHAIN; SELECT pg_advisory_xact_lock(k)` (PostgreSQL 12+; `ROLLBACK;
//! BEGIN; …` before), and the last one is sent on its own when the worker stops. The
//! `hot` workload (one key, every worker) is the same loop: each hand-off is the holder's
//! one message, release and next request together — no statement awaited on its own.
//!
//! It leaves out what dblock adds for its guarantees (`ISOLATION LEVEL READ COMMITTED`
//! whatever the session's default, a `SET LOCAL lock_timeout` that slices long waits),
//! and it connects over the same TLS as dblock's connections, which [`Floor::open`]
//! checks on both sides (`pg_stat_ssl`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures_util::StreamExt;
use tokio_postgres::Client;

use crate::error::Error;
use crate::key::Key;
use crate::postgres::conn::pool::Pool;
use crate::postgres::conn::tls::Connector;
use crate::postgres::sql::i64_text;
use crate::raw::{BenchCycles, BenchFloor, BenchRun, BoxFuture, CycleClock};

/// Raw connections, one per worker, opened by [`Floor::open`].
pub(crate) struct Floor {
    config: tokio_postgres::Config,
    /// The same TLS as dblock's connections: the floor pays what they pay.
    tls: Connector,
    /// dblock's own pool, to check that its connections use the floor's transport.
    pool: Pool,
    workers: Mutex<Vec<Arc<Worker>>>,
    transport: OnceLock<String>,
}

struct Worker {
    client: Client,
    /// Whether the server has `ROLLBACK AND CHAIN` (12+).
    chain: bool,
    /// Whether a transaction holding this worker's last lock is open.
    holding: AtomicBool,
}

fn lost(e: tokio_postgres::Error) -> Error {
    Error::ConnectionLost {
        message: e.to_string(),
    }
}

/// Sends `sql` as one simple-protocol message and reads its reply to the end without
/// keeping it; returns the first column of the last row, if any.
async fn run(client: &Client, sql: &str) -> Result<Option<String>, Error> {
    let stream = client.simple_query_raw(sql).await.map_err(lost)?;
    let mut stream = std::pin::pin!(stream);
    let mut last = None;
    while let Some(m) = stream.next().await {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m.map_err(lost)? {
            last = r.get(0).map(str::to_string);
        }
    }
    Ok(last)
}

impl Floor {
    pub(crate) fn new(config: tokio_postgres::Config, tls: Connector, pool: Pool) -> Floor {
        Floor {
            config,
            tls,
            pool,
            workers: Mutex::new(Vec::new()),
            transport: OnceLock::new(),
        }
    }

    async fn connect(&self) -> Result<Worker, Error> {
        let (client, conn) = self
            .tls
            .connect(&self.config)
            .await
            .map_err(|e| Error::Connect {
                target: "the benchmark's floor".into(),
                message: crate::postgres::conn::tls::describe(&e),
            })?;
        let major: u32 = conn
            .parameter("server_version")
            .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        tokio::spawn(conn);
        Ok(Worker {
            client,
            chain: major >= 12,
            holding: AtomicBool::new(false),
        })
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Worker>>> {
        self.workers.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn open(&self, workers: usize) -> Result<(), Error> {
        while self.list().len() < workers {
            let w = Arc::new(self.connect().await?);
            self.list().push(w);
        }
        if self.transport.get().is_none() {
            const SSL: &str =
                "SELECT ssl FROM pg_catalog.pg_stat_ssl WHERE pid = pg_catalog.pg_backend_pid()";
            let first = self.list().first().cloned();
            let floor = match first {
                Some(w) => run(&w.client, SSL).await?,
                None => return Ok(()),
            };
            let conn = self.pool.get_until(None).await?;
            let dblock = conn.query(SSL).await.map_err(|e| e.into_error());
            conn.recycle();
            let dblock = crate::postgres::sql::first_value(&dblock?, 0);
            if floor != dblock {
                return Err(Error::configuration(format!(
                    "the benchmark's floor and dblock's connections reach the server differently \
                     (TLS: floor {floor:?}, dblock {dblock:?}); they must compare like with like"
                )));
            }
            let _ = self.transport.set(match floor.as_deref() {
                Some("t") => "TLS".to_string(),
                _ => "no TLS".to_string(),
            });
        }
        Ok(())
    }

    fn worker(&self, w: usize) -> Result<Arc<Worker>, Error> {
        self.list()
            .get(w)
            .cloned()
            .ok_or_else(|| Error::unexpected(format!("the floor's worker {w} was not opened")))
    }

    async fn cycle(&self, w: usize, key: Key, timed: bool) -> Result<Duration, Error> {
        let worker = self.worker(w)?;
        let mut kbuf = [0u8; 20];
        let k = i64_text(key.as_i64(), &mut kbuf);
        let head = match (worker.holding.load(Ordering::Relaxed), worker.chain) {
            (false, _) => "BEGIN; ",
            (true, true) => "ROLLBACK AND CHAIN; ",
            (true, false) => "ROLLBACK; BEGIN; ",
        };
        let mut sql = String::with_capacity(64);
        for part in [head, "SELECT pg_catalog.pg_advisory_xact_lock(", k, ")"] {
            sql.push_str(part);
        }
        let t = CycleClock::start(timed);
        // Whatever the outcome, a transaction may be open: the next message ends it.
        worker.holding.store(true, Ordering::Relaxed);
        run(&worker.client, &sql).await?;
        Ok(t.elapsed())
    }

    async fn settle(&self, w: usize) -> Result<(), Error> {
        let worker = self.worker(w)?;
        if worker.holding.swap(false, Ordering::Relaxed) {
            run(&worker.client, "ROLLBACK").await?;
        }
        Ok(())
    }
}

impl BenchFloor for Floor {
    fn open(self: Arc<Self>, workers: usize) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(async move { Floor::open(&self, workers).await })
    }

    fn run<'a>(
        &'a self,
        worker: usize,
        keys: &'a [Key],
        _hot: bool,
        run: BenchRun,
    ) -> BoxFuture<'a, Result<BenchCycles, Error>> {
        Box::pin(
            run.drive(move |i, timed| Floor::cycle(self, worker, *BenchRun::nth(keys, i), timed)),
        )
    }

    fn settle(self: Arc<Self>, worker: usize) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(async move { Floor::settle(&self, worker).await })
    }

    fn transport(&self) -> Option<String> {
        self.transport.get().cloned()
    }
}
