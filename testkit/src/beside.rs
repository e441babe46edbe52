//! Support for the tests of dblock beside sqlx's migrator (a rolling deploy from one to
//! the other): sqlx's history as the server has it, the rows sqlx's own code would
//! write for a directory, sqlx's migration lock as the server shows it, a gate that
//! holds a run at a chosen migration, and a migration set any backend runs.

use std::path::Path;

use sqlx::Row;

use crate::TestDb;

/// One row of sqlx's history: version, description, success, checksum (hex),
/// execution time (ns).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlxRow {
    pub version: i64,
    pub description: String,
    pub success: bool,
    pub checksum: String,
    pub execution_time: i64,
}

/// What sqlx's own code makes of `dir` (sqlx's `Migrator::new`): each up migration's
/// (version, description, checksum in hex), in order.
pub async fn sqlx_expects(dir: &Path) -> Vec<(i64, String, String)> {
    let m = sqlx::migrate::Migrator::new(dir).await.unwrap();
    m.iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| (m.version, m.description.to_string(), hex(&m.checksum)))
        .collect()
}

/// sqlx's history through sqlx's MySQL and SQLite drivers, as [`SqlxRow`]s.
const SQLX_ROWS: &str = "SELECT version, description, success, lower(hex(checksum)), \
                         execution_time FROM _sqlx_migrations ORDER BY version";

/// A row of sqlx's history read through one of sqlx's drivers, columns in
/// [`SqlxRow`]'s order.
fn sqlx_row<R: Row>(r: &R) -> SqlxRow
where
    usize: sqlx::ColumnIndex<R>,
    i64: for<'a> sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    bool: for<'a> sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    String: for<'a> sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    SqlxRow {
        version: r.get(0),
        description: r.get(1),
        success: r.get(2),
        checksum: r.get(3),
        execution_time: r.get(4),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl TestDb {
    /// sqlx's history (`_sqlx_migrations`) in the test's schema or database, in order;
    /// empty if there is none.
    pub async fn sqlx_rows(&self) -> Vec<SqlxRow> {
        if !self.has_table("_sqlx_migrations").await {
            return Vec::new();
        }
        match self {
            TestDb::Postgres(s) => s
                .admin()
                .query(
                    &format!(
                        "SELECT version, description, success, encode(checksum, 'hex'), \
                         execution_time FROM \"{}\"._sqlx_migrations ORDER BY version",
                        s.name
                    ),
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| SqlxRow {
                    version: r.get(0),
                    description: r.get(1),
                    success: r.get(2),
                    checksum: r.get(3),
                    execution_time: r.get(4),
                })
                .collect(),
            TestDb::MySql(d) => {
                let pool = mysql_pool(&d.url).await;
                let rows = sqlx::query(SQLX_ROWS).fetch_all(&pool).await.unwrap();
                pool.close().await;
                rows.iter().map(sqlx_row).collect()
            }
            TestDb::Sqlite(d) => {
                let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&d.path);
                let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
                let rows = sqlx::query(SQLX_ROWS).fetch_all(&pool).await.unwrap();
                pool.close().await;
                rows.iter().map(sqlx_row).collect()
            }
        }
    }

    /// The database's name, as sqlx's migrator reads it (`current_database()`,
    /// `DATABASE()`): what sqlx derives its lock from.
    pub async fn database_name(&self) -> String {
        match self {
            TestDb::Postgres(s) => s
                .admin()
                .query_one("SELECT current_database()", &[])
                .await
                .unwrap()
                .get(0),
            TestDb::MySql(d) => d.name.clone(),
            TestDb::Sqlite(_) => String::new(),
        }
    }

    /// Holds sqlx's migration lock for this database as sqlx's migrator takes it,
    /// on a connection of its own, until the returned holder is dropped (or released).
    pub async fn hold_sqlx_lock(&self) -> SqlxLockHolder {
        let db = self.database_name().await;
        match self {
            TestDb::Postgres(s) => {
                let c = crate::admin_connect(&s.url).await;
                c.execute(
                    "SELECT pg_advisory_lock($1)",
                    &[&dblock::migrate::sqlx_lock_key(&db)],
                )
                .await
                .unwrap();
                SqlxLockHolder::Postgres(c)
            }
            TestDb::MySql(d) => {
                let mut c = <sqlx::MySqlConnection as sqlx::Connection>::connect(&d.url)
                    .await
                    .unwrap();
                let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 10)")
                    .bind(dblock::migrate::sqlx_mysql_lock_name(&db))
                    .fetch_one(&mut c)
                    .await
                    .unwrap();
                assert_eq!(got, Some(1));
                SqlxLockHolder::MySql(c)
            }
            TestDb::Sqlite(_) => SqlxLockHolder::None,
        }
    }

    /// Whether sqlx's migration lock is held right now, as the server shows it (by
    /// the key or name dblock computes for sqlx).
    pub async fn sqlx_lock_held(&self) -> bool {
        let db = self.database_name().await;
        match self {
            TestDb::Postgres(s) => {
                let key = dblock::Key::from_i64(dblock::migrate::sqlx_lock_key(&db));
                s.advisory(key).await.iter().any(|(_, _, granted)| *granted)
            }
            TestDb::MySql(d) => d
                .holder(&dblock::migrate::sqlx_mysql_lock_name(&db))
                .await
                .is_some(),
            TestDb::Sqlite(_) => false,
        }
    }

    /// How many sessions wait for sqlx's migration lock (PostgreSQL).
    pub async fn sqlx_lock_waiters(&self) -> usize {
        let db = self.database_name().await;
        match self {
            TestDb::Postgres(s) => {
                let key = dblock::Key::from_i64(dblock::migrate::sqlx_lock_key(&db));
                s.advisory(key).await.iter().filter(|(_, _, g)| !*g).count()
            }
            _ => 0,
        }
    }
}

impl TestDb {
    /// An empty database again (the schema, or the MySQL database, dropped and made
    /// anew), for a control's next round.
    pub async fn reset(&self) {
        match self {
            TestDb::Postgres(s) => s.empty().await,
            TestDb::MySql(d) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE `{0}`; CREATE DATABASE `{0}`",
                    d.name
                )))
                .execute(d.admin())
                .await
                .unwrap();
            }
            TestDb::Sqlite(d) => {
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", d.path.display()));
                }
            }
        }
    }

    /// A session of the test's own on its database that has run `sql` (say, taken a
    /// lock) and stays open until the returned value is dropped.
    pub async fn admin_session(&self, sql: &str) -> AdminSession {
        match self {
            TestDb::Postgres(s) => {
                let c = crate::admin_connect(&s.url).await;
                c.batch_execute(sql).await.unwrap();
                AdminSession::Postgres(c)
            }
            TestDb::MySql(d) => {
                let mut c = <sqlx::MySqlConnection as sqlx::Connection>::connect(&d.url)
                    .await
                    .unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                    .execute(&mut c)
                    .await
                    .unwrap();
                AdminSession::MySql(c)
            }
            TestDb::Sqlite(_) => AdminSession::None,
        }
    }
}

/// A session of the test's own (see [`TestDb::admin_session`]); dropping it ends the
/// session.
pub enum AdminSession {
    Postgres(tokio_postgres::Client),
    MySql(sqlx::MySqlConnection),
    None,
}

/// sqlx's migration lock, held by the test.
pub enum SqlxLockHolder {
    Postgres(tokio_postgres::Client),
    MySql(sqlx::MySqlConnection),
    /// SQLite: sqlx takes no lock.
    None,
}

async fn mysql_pool(url: &str) -> sqlx::MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .unwrap()
}

/// How sqlx's migrators and dblock's runners that ran at once ended.
pub struct Outcomes {
    pub sqlx: Vec<Result<(), String>>,
    pub dblock: Vec<Result<dblock::migrate::Report, dblock::Error>>,
}

impl Outcomes {
    /// Every runner's error, sqlx's first.
    pub fn failures(&self) -> Vec<String> {
        let sqlx = self.sqlx.iter().filter_map(|r| r.as_ref().err().cloned());
        let dblock = self
            .dblock
            .iter()
            .filter_map(|r| r.as_ref().err().map(|e| e.to_string()));
        sqlx.chain(dblock).collect()
    }
}

/// A gate: a migration whose SQL waits (inside its transaction) until the test opens
/// the gate, so that the test can line sessions up behind a run while it holds its
/// locks. PostgreSQL: advisory key [`Gate::KEY`] of the test's own database.
pub struct Gate {
    holder: Option<tokio_postgres::Client>,
    admin: tokio_postgres::Client,
}

impl Gate {
    /// The gate's advisory key (the test's database is its own).
    pub const KEY: i64 = 0x6761_7465; // "gate"

    /// The migration SQL that waits at the gate.
    pub const SQL: &'static str = "SELECT pg_advisory_xact_lock_shared(1734440037);\n";

    /// Closes the gate on `url`'s database.
    pub async fn closed(url: &str) -> Gate {
        let holder = crate::admin_connect(url).await;
        holder
            .execute("SELECT pg_advisory_lock($1)", &[&Gate::KEY])
            .await
            .unwrap();
        Gate {
            holder: Some(holder),
            admin: crate::admin_connect(url).await,
        }
    }

    /// How many sessions wait at the gate.
    pub async fn waiting(&self) -> i64 {
        self.admin
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND objid = $1::int8::oid AND classid = 0 AND objsubid = 1",
                &[&Gate::KEY],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// Opens the gate: whoever waits goes on.
    pub fn open(&mut self) {
        self.holder = None;
    }
}

/// Twelve timestamped migrations any backend runs, shaped like a real service's first
/// months (tables with foreign keys and indexes, a column added, a backfill, a
/// reversible pair, a view); each logs its file name into `migration_log`, so one
/// applied twice shows, and none may be applied twice (tables without `IF NOT EXISTS`).
pub fn portable_set() -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = Vec::new();
    let mut add = |i: usize, name: &str, body: String, reversible: Option<&str>| {
        let v = 20240105090000_i64 + (i as i64) * 1_000_000;
        let ext = if reversible.is_some() {
            ".up.sql"
        } else {
            ".sql"
        };
        let file = format!("{v}_{name}{ext}");
        let sql = format!("{body}INSERT INTO migration_log (file) VALUES ('{file}');\n");
        files.push((file, sql));
        if let Some(down) = reversible {
            files.push((format!("{v}_{name}.down.sql"), down.to_string()));
        }
    };
    add(
        0,
        "create_accounts",
        "CREATE TABLE migration_log (file VARCHAR(200) NOT NULL);\n\
         CREATE TABLE accounts (id BIGINT PRIMARY KEY, email VARCHAR(200) NOT NULL);\n\
         CREATE UNIQUE INDEX accounts_email ON accounts (email);\n"
            .into(),
        None,
    );
    for i in 1..10 {
        let down = format!("DROP TABLE t{i:02};\n");
        add(
            i,
            &format!("create_t{i:02}"),
            format!(
                "CREATE TABLE t{i:02} (id BIGINT PRIMARY KEY, account_id BIGINT \
                 REFERENCES accounts (id), note VARCHAR(100));\n\
                 CREATE INDEX t{i:02}_account ON t{i:02} (account_id);\n\
                 INSERT INTO t{i:02} (id, note) VALUES (1, 'seeded; with a semicolon');\n"
            ),
            (i % 4 == 2).then_some(down.as_str()),
        );
    }
    add(
        10,
        "add_accounts_name",
        "ALTER TABLE accounts ADD COLUMN name VARCHAR(100);\n\
         UPDATE accounts SET name = email;\n"
            .into(),
        None,
    );
    add(
        11,
        "notes_view",
        "CREATE VIEW notes AS SELECT id, note FROM t01;\n".into(),
        None,
    );
    files
}

/// The versions of the up migrations of a set of files, in order.
pub fn up_versions(files: &[(String, String)]) -> Vec<i64> {
    let mut v: Vec<i64> = files
        .iter()
        .filter(|(f, _)| !f.ends_with(".down.sql"))
        .map(|(f, _)| f.split('_').next().unwrap().parse().unwrap())
        .collect();
    v.sort();
    v
}
