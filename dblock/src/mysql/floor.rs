//! The benchmark's floor on MySQL / MariaDB: the cheapest correct way to do dblock's
//! cycle — take a named lock, hold it across a round trip, release it — issued directly.
//!
//! One raw connection per worker, every one opened by `open` before anything is timed.
//! A cycle is one message: the release of the lock the worker still holds from its last
//! cycle and the next acquisition, as one multi-statement query
//! (`DO RELEASE_LOCK('old'); SELECT GET_LOCK('new', S)`), so the lock is held from one
//! round trip to the next, as a caller of dblock holds it, and each cycle costs one
//! round trip; `settle` releases what a worker holds when its timed run ends.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::mysql::MySqlConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, MySqlConnection, Row};
use tokio::sync::Mutex;

use super::{FOREVER_SECS, map_sqlx, name_in, name_prefix};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BenchCycles, BenchFloor, BenchRun, BoxFuture, CycleClock};

struct Slot {
    conn: MySqlConnection,
    /// The lock this worker still holds from its last cycle.
    held: Option<String>,
}

pub(crate) struct Floor {
    options: MySqlConnectOptions,
    /// The database's part of every lock name.
    prefix: String,
    slots: Mutex<Vec<Arc<Mutex<Slot>>>>,
    transport: OnceLock<String>,
}

impl Floor {
    pub(crate) fn new(options: MySqlConnectOptions, database: Arc<str>) -> Floor {
        Floor {
            options,
            prefix: name_prefix(&database),
            slots: Mutex::new(Vec::new()),
            transport: OnceLock::new(),
        }
    }

    async fn connect(&self) -> Result<MySqlConnection, Error> {
        self.options.connect().await.map_err(|e| Error::Connect {
            target: "the benchmark's floor".into(),
            message: e.to_string(),
        })
    }

    /// Opens a connection for each of `workers` workers (those already open stay).
    async fn open(&self, workers: usize) -> Result<(), Error> {
        let mut slots = self.slots.lock().await;
        while slots.len() < workers {
            let mut conn = self.connect().await?;
            if self.transport.get().is_none() {
                let cipher: Option<(String, String)> =
                    sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
                        .fetch_optional(&mut conn)
                        .await
                        .map_err(map_sqlx)?;
                let tls = cipher.is_some_and(|(_, c)| !c.is_empty());
                let _ = self.transport.set(match tls {
                    true => "TLS".into(),
                    false => "plain (no TLS)".into(),
                });
            }
            slots.push(Arc::new(Mutex::new(Slot { conn, held: None })));
        }
        Ok(())
    }

    async fn slot(&self, w: usize) -> Result<Arc<Mutex<Slot>>, Error> {
        self.slots
            .lock()
            .await
            .get(w)
            .cloned()
            .ok_or_else(|| Error::unexpected(format!("the floor has no connection {w}")))
    }

    async fn cycle(&self, w: usize, key: Key, timed: bool) -> Result<Duration, Error> {
        let slot = self.slot(w).await?;
        let mut s = slot.lock().await;
        let name = name_in(&self.prefix, key);
        // Lock names are `dblock:` and hex digits: safe to write into the text.
        let sql = match s.held.take() {
            Some(old) => format!(
                "DO RELEASE_LOCK('{old}'); SELECT CAST(GET_LOCK('{name}', {FOREVER_SECS}) AS SIGNED)"
            ),
            None => format!("SELECT CAST(GET_LOCK('{name}', {FOREVER_SECS}) AS SIGNED)"),
        };
        let t = CycleClock::start(timed);
        let row = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_one(&mut s.conn)
            .await
            .map_err(map_sqlx)?;
        let d = t.elapsed();
        let got: Option<i64> = row.try_get(0).map_err(map_sqlx)?;
        if got != Some(1) {
            return Err(Error::unexpected(format!(
                "the floor's GET_LOCK answered {got:?}"
            )));
        }
        s.held = Some(name);
        Ok(d)
    }

    async fn settle(&self, w: usize) -> Result<(), Error> {
        let slot = self.slot(w).await?;
        let mut s = slot.lock().await;
        if let Some(old) = s.held.take() {
            sqlx::raw_sql(AssertSqlSafe(format!("DO RELEASE_LOCK('{old}')")))
                .execute(&mut s.conn)
                .await
                .map_err(map_sqlx)?;
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
