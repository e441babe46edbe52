//! The benchmark's floor on MySQL / MariaDB: `SELECT GET_LOCK(n, S)` then
//! `SELECT RELEASE_LOCK(n)`, each awaited, on one raw connection per worker.

use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::MySqlConnectOptions;
use sqlx::{ConnectOptions, MySqlConnection};
use tokio::time::Instant;

use super::{FOREVER_SECS, lock_name, map_sqlx};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BenchFloor, BoxFuture};

type Raw = Arc<tokio::sync::Mutex<MySqlConnection>>;

pub(crate) struct Floor {
    options: MySqlConnectOptions,
    database: Arc<str>,
    conns: tokio::sync::Mutex<Vec<Option<Raw>>>,
}

impl Floor {
    pub(crate) fn new(options: MySqlConnectOptions, database: Arc<str>) -> Floor {
        Floor {
            options,
            database,
            conns: tokio::sync::Mutex::new(Vec::new()),
        }
    }

    async fn cycle(&self, w: usize, key: Key) -> Result<Duration, Error> {
        let conn = {
            let mut cs = self.conns.lock().await;
            if cs.len() <= w {
                cs.resize(w + 1, None);
            }
            match &cs[w] {
                Some(c) => c.clone(),
                None => {
                    let c = self.options.connect().await.map_err(|e| Error::Connect {
                        target: "the benchmark's floor".into(),
                        message: e.to_string(),
                    })?;
                    let c = Arc::new(tokio::sync::Mutex::new(c));
                    cs[w] = Some(c.clone());
                    c
                }
            }
        };
        let mut conn = conn.lock().await;
        let name = lock_name(&self.database, key);
        let t = Instant::now();
        let got: Option<i64> = sqlx::query_scalar("SELECT CAST(GET_LOCK(?, ?) AS SIGNED)")
            .bind(&name)
            .bind(FOREVER_SECS)
            .fetch_one(&mut *conn)
            .await
            .map_err(map_sqlx)?;
        let d = t.elapsed();
        if got != Some(1) {
            return Err(Error::Unsupported(format!(
                "the floor's GET_LOCK answered {got:?}"
            )));
        }
        sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&name)
            .execute(&mut *conn)
            .await
            .map_err(map_sqlx)?;
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
