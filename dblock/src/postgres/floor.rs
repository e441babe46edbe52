//! The benchmark's floor on PostgreSQL: one raw tokio-postgres connection per worker,
//! `SELECT pg_advisory_xact_lock(k)` in autocommit per cycle (one round trip), or for
//! the `hot` workload `BEGIN`; the lock; `COMMIT`, each awaited (pgbench's script).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::tls::Connector;
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BenchFloor, BoxFuture};

/// Raw connections, one per worker, opened on first use.
pub(crate) struct Floor {
    config: tokio_postgres::Config,
    /// Over the same TLS as dblock's connections: the floor pays what they pay.
    tls: Connector,
    clients: tokio::sync::Mutex<Vec<Option<Arc<tokio_postgres::Client>>>>,
}

impl Floor {
    pub(crate) fn new(config: tokio_postgres::Config, tls: Connector) -> Floor {
        Floor {
            config,
            tls,
            clients: tokio::sync::Mutex::new(Vec::new()),
        }
    }

    async fn cycle(&self, w: usize, key: Key, hot: bool) -> Result<Duration, Error> {
        let client = {
            let mut cs = self.clients.lock().await;
            if cs.len() <= w {
                cs.resize(w + 1, None);
            }
            match &cs[w] {
                Some(c) => c.clone(),
                None => {
                    let (c, conn) =
                        self.tls
                            .connect(&self.config)
                            .await
                            .map_err(|e| Error::Connect {
                                target: "the benchmark's floor".into(),
                                message: super::tls::describe(&e),
                            })?;
                    tokio::spawn(conn);
                    let c = Arc::new(c);
                    cs[w] = Some(c.clone());
                    c
                }
            }
        };
        let lost = |e: tokio_postgres::Error| Error::ConnectionLost {
            message: e.to_string(),
        };
        let sql = format!("SELECT pg_advisory_xact_lock({})", key.as_i64());
        if !hot {
            let t = Instant::now();
            client.simple_query(&sql).await.map_err(lost)?;
            return Ok(t.elapsed());
        }
        client.simple_query("BEGIN").await.map_err(lost)?;
        let t = Instant::now();
        client.simple_query(&sql).await.map_err(lost)?;
        let d = t.elapsed();
        client.simple_query("COMMIT").await.map_err(lost)?;
        Ok(d)
    }
}

impl BenchFloor for Floor {
    fn cycle(
        self: Arc<Self>,
        worker: usize,
        key: Key,
        hot: bool,
    ) -> BoxFuture<'static, Result<Duration, Error>> {
        Box::pin(async move { Floor::cycle(&self, worker, key, hot).await })
    }
}
