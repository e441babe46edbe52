//! The application's side of fencing, on any backend: a table the test's "resource"
//! lives in, a log leaders append to, and writes checked by a [`dblock::Fence`] in the
//! writing transaction — with the backend's own check (`check_postgres`,
//! `check_mysql`, `check_sqlite`). Used by the tests and by the worker processes.

use sqlx::{AssertSqlSafe, Connection};

/// A small pool on the test's database (its schema, its database, its file).
pub enum AppDb {
    Pg(sqlx::PgPool),
    My(sqlx::MySqlPool),
    Lite(sqlx::SqlitePool),
}

/// What a checked write came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Committed (checked and current, or not checked at all).
    Written,
    /// The check found a newer grant: rolled back.
    Rejected,
    /// Anything else went wrong (the text of the error): rolled back.
    Failed(String),
}

impl AppDb {
    /// Connects to the database a dblock test URL names (`postgres://`, `mysql://`,
    /// `mariadb://`, `sqlite:`).
    pub async fn connect(url: &str) -> AppDb {
        let r = if url.starts_with("postgres") {
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect(url)
                .await
                .map(AppDb::Pg)
        } else if let Some(rest) = url
            .strip_prefix("mysql://")
            .or_else(|| url.strip_prefix("mariadb://"))
        {
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(2)
                .connect(&format!("mysql://{rest}"))
                .await
                .map(AppDb::My)
        } else {
            let opts = <sqlx::sqlite::SqliteConnectOptions as std::str::FromStr>::from_str(url)
                .unwrap_or_else(|e| panic!("{url}: {e}"))
                .create_if_missing(true);
            sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(2)
                .connect_with(opts)
                .await
                .map(AppDb::Lite)
        };
        r.unwrap_or_else(|e| panic!("the test's database at {url}: {e}"))
    }

    /// Creates (empty) `resource (id, value, token)` with row 1 = ('initial', 0), and
    /// `leader_log (id, token)`.
    pub async fn setup(&self) {
        let (serial, engine) = match self {
            AppDb::Pg(_) => ("bigserial PRIMARY KEY", ""),
            AppDb::My(_) => ("BIGINT AUTO_INCREMENT PRIMARY KEY", " ENGINE=InnoDB"),
            AppDb::Lite(_) => ("INTEGER PRIMARY KEY AUTOINCREMENT", ""),
        };
        let ddl = [
            "DROP TABLE IF EXISTS resource".to_string(),
            "DROP TABLE IF EXISTS leader_log".to_string(),
            format!("CREATE TABLE resource (id INT PRIMARY KEY, value TEXT, token BIGINT){engine}"),
            "INSERT INTO resource VALUES (1, 'initial', 0)".to_string(),
            format!("CREATE TABLE leader_log (id {serial}, token BIGINT NOT NULL){engine}"),
        ];
        for sql in ddl {
            self.exec(&sql).await;
        }
    }

    async fn exec(&self, sql: &str) {
        let sql = AssertSqlSafe(sql.to_string());
        match self {
            AppDb::Pg(p) => sqlx::raw_sql(sql).execute(p).await.map(drop),
            AppDb::My(p) => sqlx::raw_sql(sql).execute(p).await.map(drop),
            AppDb::Lite(p) => sqlx::raw_sql(sql).execute(p).await.map(drop),
        }
        .unwrap();
    }

    /// Sets the resource's value (and the token it was written with), in a transaction
    /// checked by `fence` unless `fence` is `None`.
    pub async fn write_resource(
        &self,
        value: &str,
        token: i64,
        fence: Option<&dblock::Fence>,
    ) -> Outcome {
        self.checked(
            "UPDATE resource SET value = ?, token = ? WHERE id = 1",
            Some(value),
            token,
            fence,
        )
        .await
    }

    /// Appends `token` to the leaders' log, checked by `fence` unless `None`.
    pub async fn log_term(&self, token: i64, fence: Option<&dblock::Fence>) -> Outcome {
        self.checked(
            "INSERT INTO leader_log (token) VALUES (?)",
            None,
            token,
            fence,
        )
        .await
    }

    /// The resource's value.
    pub async fn value(&self) -> String {
        let q = "SELECT value FROM resource WHERE id = 1";
        match self {
            AppDb::Pg(p) => sqlx::query_scalar(q).fetch_one(p).await,
            AppDb::My(p) => sqlx::query_scalar(q).fetch_one(p).await,
            AppDb::Lite(p) => sqlx::query_scalar(q).fetch_one(p).await,
        }
        .unwrap()
    }

    /// The leaders' log, in the order written.
    pub async fn leader_log(&self) -> Vec<i64> {
        let q = "SELECT token FROM leader_log ORDER BY id";
        match self {
            AppDb::Pg(p) => sqlx::query_scalar(q).fetch_all(p).await,
            AppDb::My(p) => sqlx::query_scalar(q).fetch_all(p).await,
            AppDb::Lite(p) => sqlx::query_scalar(q).fetch_all(p).await,
        }
        .unwrap()
    }

    /// The token committed for `key` in dblock's fencing table, read on a connection of
    /// this pool (not the lock's): `None` before the first fenced grant.
    pub async fn committed_token(&self, key: dblock::Key) -> Option<i64> {
        let k = key.as_i64();
        let r = match self {
            AppDb::Pg(p) => {
                sqlx::query_scalar("SELECT token FROM public.dblock_fencing WHERE key = $1")
                    .bind(k)
                    .fetch_optional(p)
                    .await
            }
            AppDb::My(p) => {
                sqlx::query_scalar("SELECT token FROM dblock_fencing WHERE `key` = ?")
                    .bind(k)
                    .fetch_optional(p)
                    .await
            }
            AppDb::Lite(p) => {
                sqlx::query_scalar("SELECT token FROM dblock_fencing WHERE key = ?")
                    .bind(k)
                    .fetch_optional(p)
                    .await
            }
        };
        r.unwrap()
    }

    async fn checked(
        &self,
        sql: &str,
        value: Option<&str>,
        token: i64,
        fence: Option<&dblock::Fence>,
    ) -> Outcome {
        let r: Result<Outcome, String> = match self {
            AppDb::Pg(p) => {
                let sql = numbered(sql);
                async {
                    let mut tx = p.begin().await.map_err(|e| e.to_string())?;
                    let mut q = sqlx::query(AssertSqlSafe(sql));
                    if let Some(v) = value {
                        q = q.bind(v);
                    }
                    q.bind(token)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    let verdict = match fence {
                        Some(f) => f.check_postgres(&mut tx).await,
                        None => Ok(()),
                    };
                    match verdict {
                        Ok(()) => tx.commit().await.map(|_| Outcome::Written),
                        Err(e) => tx.rollback().await.map(|_| verdict_of(e)),
                    }
                    .map_err(|e| e.to_string())
                }
                .await
            }
            AppDb::My(p) => {
                async {
                    let mut tx = p.begin().await.map_err(|e| e.to_string())?;
                    let mut q = sqlx::query(AssertSqlSafe(sql.to_string()));
                    if let Some(v) = value {
                        q = q.bind(v);
                    }
                    q.bind(token)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    let verdict = match fence {
                        Some(f) => f.check_mysql(&mut tx).await,
                        None => Ok(()),
                    };
                    match verdict {
                        Ok(()) => tx.commit().await.map(|_| Outcome::Written),
                        Err(e) => tx.rollback().await.map(|_| verdict_of(e)),
                    }
                    .map_err(|e| e.to_string())
                }
                .await
            }
            AppDb::Lite(p) => {
                async {
                    let mut conn = p.acquire().await.map_err(|e| e.to_string())?;
                    // IMMEDIATE: the write lock from the start, as check_sqlite asks.
                    let mut tx = conn
                        .begin_with("BEGIN IMMEDIATE")
                        .await
                        .map_err(|e| e.to_string())?;
                    let mut q = sqlx::query(AssertSqlSafe(sql.to_string()));
                    if let Some(v) = value {
                        q = q.bind(v);
                    }
                    q.bind(token)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    let verdict = match fence {
                        Some(f) => f.check_sqlite(&mut tx).await,
                        None => Ok(()),
                    };
                    match verdict {
                        Ok(()) => tx.commit().await.map(|_| Outcome::Written),
                        Err(e) => tx.rollback().await.map(|_| verdict_of(e)),
                    }
                    .map_err(|e| e.to_string())
                }
                .await
            }
        };
        r.unwrap_or_else(Outcome::Failed)
    }
}

fn verdict_of(e: dblock::Error) -> Outcome {
    match e {
        dblock::Error::StaleToken { .. } => Outcome::Rejected,
        other => Outcome::Failed(other.to_string()),
    }
}

/// `?` placeholders numbered for PostgreSQL (`$1`, `$2`, …).
fn numbered(sql: &str) -> String {
    let mut n = 0;
    let mut out = String::new();
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(c);
        }
    }
    out
}
