//! Support for the migration tests: the seed's six start-up scripts, migration
//! directories on disk, and an administrator's view of the bookkeeping.

use std::path::{Path, PathBuf};

use dblock::Key;
use dblock::migrate::MIGRATION_LOCK_KEY;

use crate::PgSchema;

/// The six subsystems of the seed, each owning an operational table it creates at
/// start-up.
pub const SUBSYSTEMS: [&str; 6] = [
    "cron_state",
    "inbound_spine",
    "email_sends",
    "function_dlq",
    "observer_checkpoints",
    "cdc_outbox_sink",
];

/// The migration lock as a [`Key`].
pub fn migration_key() -> Key {
    Key::from_i64(MIGRATION_LOCK_KEY)
}

/// One subsystem's idempotent start-up script, in the seed's shape: a table (with a
/// sequence, so new rows in `pg_class` and `pg_type`), indexes, row-level security and
/// a policy.
pub fn seed_script(subsystem: &str) -> String {
    let t = format!("_app_{subsystem}");
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (\n\
         \x20   id bigserial PRIMARY KEY,\n\
         \x20   tenant text NOT NULL DEFAULT current_setting('app.tenant', true),\n\
         \x20   key text NOT NULL,\n\
         \x20   state jsonb NOT NULL DEFAULT '{{}}',\n\
         \x20   updated_at timestamptz NOT NULL DEFAULT now()\n\
         );\n\
         CREATE UNIQUE INDEX IF NOT EXISTS {t}_key ON {t} (tenant, key);\n\
         CREATE INDEX IF NOT EXISTS {t}_updated ON {t} (updated_at);\n\
         ALTER TABLE {t} ENABLE ROW LEVEL SECURITY;\n\
         DROP POLICY IF EXISTS {t}_tenant ON {t};\n\
         CREATE POLICY {t}_tenant ON {t} USING (tenant = current_setting('app.tenant', true));\n"
    )
}

/// The seed's scripts as a migration set, `0001_cron_state.sql` … `0006_cdc_outbox_sink.sql`;
/// each also appends its file name to `migration_log`, so that a migration applied twice
/// shows.
pub fn seed_set() -> Vec<(String, String)> {
    SUBSYSTEMS
        .iter()
        .enumerate()
        .map(|(i, sub)| {
            let file = format!("{:04}_{sub}.sql", i + 1);
            let sql = format!(
                "{}CREATE TABLE IF NOT EXISTS migration_log (file text NOT NULL, \
                 at timestamptz NOT NULL DEFAULT clock_timestamp());\n\
                 INSERT INTO migration_log (file) VALUES ('{file}');\n",
                seed_script(sub)
            );
            (file, sql)
        })
        .collect()
}

/// Three migrations, the second outside a transaction with a statement that runs for 30
/// seconds between two that create tables (`first_done`, `never_ran`): for runs ended
/// part way through it.
pub fn with_a_slow_no_transaction_migration(db: &crate::TestDb) -> Vec<(String, String)> {
    vec![
        ("0001_t.sql".into(), "CREATE TABLE t (x INT);".into()),
        (
            "0002_slow.sql".into(),
            format!(
                "-- dblock:no-transaction\nCREATE TABLE first_done (x INT);\n{};\n\
                 CREATE TABLE never_ran (x INT);\n",
                db.sleep_statement(30)
            ),
        ),
        (
            "0003_after.sql".into(),
            "CREATE TABLE after (x INT);".into(),
        ),
    ]
}

/// A directory of migration files of a test's own.
pub struct MigrationDir {
    pub dir: tempfile::TempDir,
}

impl MigrationDir {
    pub fn new<F: AsRef<str>, S: AsRef<str>>(files: &[(F, S)]) -> MigrationDir {
        let d = MigrationDir {
            dir: tempfile::tempdir().unwrap(),
        };
        for (f, s) in files {
            d.write(f.as_ref(), s.as_ref());
        }
        d
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn write(&self, name: &str, sql: &str) {
        std::fs::write(self.file(name), sql).unwrap();
    }

    pub fn remove(&self, name: &str) {
        std::fs::remove_file(self.file(name)).unwrap();
    }

    pub fn set(&self) -> dblock::migrate::Migrations {
        dblock::migrate::Migrations::from_dir(self.path()).unwrap()
    }
}

impl PgSchema {
    /// The versions recorded in the schema's `dblock_migrations`; empty if it does not
    /// exist.
    pub async fn applied_versions(&self) -> Vec<i64> {
        if !self.has_relation("dblock_migrations").await {
            return Vec::new();
        }
        self.admin()
            .query(
                &format!(
                    "SELECT version FROM \"{}\".dblock_migrations ORDER BY version",
                    self.name
                ),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Whether the schema has a table, index, sequence… of this name.
    pub async fn has_relation(&self, name: &str) -> bool {
        let row = self
            .admin()
            .query_one(
                "SELECT to_regclass(quote_ident($1) || '.' || quote_ident($2)) IS NOT NULL",
                &[&self.name, &name],
            )
            .await
            .unwrap();
        row.get(0)
    }

    /// How many rows a table of the schema has.
    pub async fn count(&self, table: &str) -> i64 {
        self.admin()
            .query_one(
                &format!("SELECT count(*) FROM \"{}\".{table}", self.name),
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// Drops everything in the schema: an empty database again.
    pub async fn empty(&self) {
        self.admin()
            .batch_execute(&format!(
                "DROP SCHEMA \"{0}\" CASCADE; CREATE SCHEMA \"{0}\"",
                self.name
            ))
            .await
            .unwrap();
    }

    /// The migration lock, held or awaited by the test's own sessions (other tests'
    /// sessions may take it meanwhile: the key is database-wide).
    pub async fn migration_lock_of_sessions(&self) -> Vec<(i32, String, bool)> {
        let (classid, objid) = migration_key().pg_locks_ids();
        self.admin()
            .query(
                "SELECT l.pid, l.mode, l.granted FROM pg_locks l JOIN pg_stat_activity a \
                 ON a.pid = l.pid WHERE l.locktype = 'advisory' AND a.application_name = $1 \
                 AND l.classid = $2::int8::oid AND l.objid = $3::int8::oid AND l.objsubid = 1",
                &[&self.app, &(classid as i64), &(objid as i64)],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    }
}

/// What the migration tests written once for every backend ask of a test's database:
/// SQL run as an administrator would, in the test's schema or database.
impl crate::TestDb {
    /// Runs `sql` (one or more statements) in the test's schema or database.
    pub async fn exec(&self, sql: &str) {
        if let Err(e) = self.try_exec(sql).await {
            panic!("{sql}: {e}");
        }
    }

    /// [`TestDb::exec`], the database's error returned (for controls that race).
    pub async fn try_exec(&self, sql: &str) -> Result<(), String> {
        match self {
            crate::TestDb::Postgres(s) => {
                let client = crate::admin_connect(&s.url).await;
                client.batch_execute(sql).await.map_err(|e| e.to_string())
            }
            crate::TestDb::MySql(d) => {
                let mut conn = <sqlx::MySqlConnection as sqlx::Connection>::connect(&d.url)
                    .await
                    .map_err(|e| e.to_string())?;
                let res = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                    .execute(&mut conn)
                    .await;
                let _ = sqlx::Connection::close(conn).await;
                res.map(drop).map_err(|e| e.to_string())
            }
            crate::TestDb::Sqlite(d) => {
                let mut conn = sqlite_connect(&d.path).await.map_err(|e| e.to_string())?;
                let res = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
                    .execute(&mut conn)
                    .await;
                let _ = sqlx::Connection::close(conn).await;
                res.map(drop).map_err(|e| e.to_string())
            }
        }
    }

    /// The one integer `sql` answers (a count, a version), in the test's schema or
    /// database.
    pub async fn scalar(&self, sql: &str) -> i64 {
        let all = self.scalars(sql).await;
        assert_eq!(all.len(), 1, "{sql}: {all:?}");
        all[0]
    }

    /// The integers of the first column of `sql`'s rows, in the test's schema or
    /// database.
    pub async fn scalars(&self, sql: &str) -> Vec<i64> {
        match self {
            crate::TestDb::Postgres(s) => {
                s.admin()
                    .batch_execute(&format!("SET search_path = \"{}\"", s.name))
                    .await
                    .unwrap();
                let rows = s.admin().query(sql, &[]).await.unwrap();
                rows.iter()
                    .map(|row| {
                        row.try_get::<_, i64>(0)
                            .or_else(|_| row.try_get::<_, i32>(0).map(i64::from))
                            .unwrap()
                    })
                    .collect()
            }
            crate::TestDb::MySql(d) => {
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&d.url)
                    .await
                    .unwrap();
                let n = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                pool.close().await;
                n
            }
            crate::TestDb::Sqlite(d) => {
                let mut conn = sqlite_connect(&d.path).await.unwrap();
                let n = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
                    .fetch_all(&mut conn)
                    .await
                    .unwrap();
                let _ = sqlx::Connection::close(conn).await;
                n
            }
        }
    }

    /// Whether the test's schema or database has a table of this name.
    pub async fn has_table(&self, name: &str) -> bool {
        let sql = match self {
            crate::TestDb::Postgres(s) => format!(
                "SELECT count(*) FROM pg_tables WHERE schemaname = '{}' AND tablename = '{name}'",
                s.name
            ),
            crate::TestDb::MySql(_) => format!(
                "SELECT COUNT(*) FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{name}'"
            ),
            crate::TestDb::Sqlite(_) => format!(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '{name}'"
            ),
        };
        self.scalar(&sql).await > 0
    }

    /// The versions `dblock_migrations` records as done, in order (empty if it does not
    /// exist).
    pub async fn done_versions(&self) -> Vec<i64> {
        self.versions_where("dblock_migrations", "coalesce(state, 'done') = 'done'")
            .await
    }

    /// The versions of `table` (a history table) where `condition` holds, in order.
    pub async fn versions_where(&self, table: &str, condition: &str) -> Vec<i64> {
        if !self.has_table(table).await {
            return Vec::new();
        }
        self.scalars(&format!(
            "SELECT version FROM {table} WHERE {condition} ORDER BY version"
        ))
        .await
    }

    /// A statement that runs for `secs` seconds on this backend (SQLite has no sleep:
    /// a count long enough).
    pub fn sleep_statement(&self, secs: u32) -> String {
        match self {
            crate::TestDb::Postgres(_) => format!("SELECT pg_sleep({secs})"),
            crate::TestDb::MySql(_) => format!("DO SLEEP({secs})"),
            crate::TestDb::Sqlite(_) => format!(
                "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c \
                 WHERE n < {}) SELECT count(*) FROM c",
                u64::from(secs) * 10_000_000
            ),
        }
    }

    /// Whether migrations here run in a transaction with their row (PostgreSQL,
    /// SQLite), no-transaction ones statement by statement; on MySQL every file is
    /// sent whole between a started and a done row.
    pub fn transactional_ddl(&self) -> bool {
        !matches!(self, crate::TestDb::MySql(_))
    }
}

/// A connection to the SQLite database file at `path`, created if missing (as dblock
/// creates it), waiting for other writers as dblock does.
async fn sqlite_connect(path: &Path) -> Result<sqlx::SqliteConnection, sqlx::Error> {
    use sqlx::ConnectOptions;
    sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .busy_timeout(std::time::Duration::from_secs(30))
        .connect()
        .await
}
