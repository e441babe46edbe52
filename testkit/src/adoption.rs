//! Support for the tests of other tools' directories and histories: a database of a
//! test's own (migrations take a database-wide key), a migration set shaped like real
//! sqlx-cli sets, and sqlx's own migrator to write `_sqlx_migrations` exactly as sqlx
//! does.

use std::path::Path;

use tokio_postgres::Client;

use crate::PgDatabase;

/// A [`PgDatabase`] with an administrator's connection kept open and the queries the
/// adoption tests ask of it. Dropped like a `PgDatabase` (when the test passed; left for
/// inspection when it failed).
pub struct OwnDatabase {
    /// The database's URL: `pg_url()` with the database name replaced.
    pub url: String,
    /// An administrator's connection to it (closed before the database is dropped).
    admin: Client,
    db: PgDatabase,
}

/// `base` with its database (the path) replaced by `db`, query string kept.
pub fn with_database(base: &str, db: &str) -> String {
    let (head, query) = match base.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (base, None),
    };
    // scheme://authority/path: the path starts at the first '/' after "//".
    let start = head.find("//").map_or(0, |i| i + 2);
    let root = match head[start..].find('/') {
        Some(i) => &head[..start + i],
        None => head,
    };
    match query {
        Some(q) => format!("{root}/{db}?{q}"),
        None => format!("{root}/{db}"),
    }
}

impl OwnDatabase {
    pub async fn new(tag: &str) -> OwnDatabase {
        let db = PgDatabase::new(tag).await;
        let admin = db.admin().await;
        OwnDatabase {
            url: db.url.clone(),
            admin,
            db,
        }
    }

    pub fn admin(&self) -> &Client {
        &self.admin
    }

    pub async fn locks(&self) -> dblock::Locks {
        dblock::Locks::connect(&self.url).await.unwrap()
    }

    /// A scalar of type `T` from `sql`.
    pub async fn one<T>(&self, sql: &str) -> T
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        self.admin.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// Whether a relation of this name is visible.
    pub async fn has(&self, relation: &str) -> bool {
        self.admin
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&relation])
            .await
            .unwrap()
            .get(0)
    }

    /// The versions `table` records, in order (empty if it does not exist).
    pub async fn versions(&self, table: &str) -> Vec<i64> {
        if !self.has(table).await {
            return Vec::new();
        }
        self.admin
            .query(
                &format!("SELECT version FROM {table} ORDER BY version"),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Drops the database (terminating what is still connected).
    pub async fn drop(self) {
        let OwnDatabase { admin, db, .. } = self;
        std::mem::drop(admin);
        std::mem::drop(db);
    }
}

/// Applies `dir` with sqlx's own migrator (`Migrator::run`, what services call at
/// start-up), up to version `to` or all of it: `_sqlx_migrations` then holds exactly
/// sqlx's rows.
pub async fn sqlx_migrate(url: &str, dir: &Path, to: Option<i64>) -> Result<(), String> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let migrator = sqlx::migrate::Migrator::new(dir)
        .await
        .map_err(|e| e.to_string())?;
    let res = match to {
        Some(v) => migrator.run_to(v, &pool).await,
        None => migrator.run(&pool).await,
    };
    pool.close().await;
    res.map_err(|e| e.to_string())
}

/// [`sqlx_migrate`] on an SQLite database file (created if missing).
pub async fn sqlx_migrate_sqlite(path: &Path, dir: &Path, to: Option<i64>) -> Result<(), String> {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true);
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .map_err(|e| e.to_string())?;
    let migrator = sqlx::migrate::Migrator::new(dir)
        .await
        .map_err(|e| e.to_string())?;
    let res = match to {
        Some(v) => migrator.run_to(v, &pool).await,
        None => migrator.run(&pool).await,
    };
    pool.close().await;
    res.map_err(|e| e.to_string())
}

/// [`sqlx_migrate`] on any backend's test database: sqlx's own migrator
/// (`Migrator::run`), up to version `to`, writing sqlx's history as sqlx does.
pub async fn sqlx_migrate_on(
    db: &crate::TestDb,
    dir: &Path,
    to: Option<i64>,
) -> Result<(), String> {
    let migrator = sqlx::migrate::Migrator::new(dir)
        .await
        .map_err(|e| e.to_string())?;
    run_migrator(db, &migrator, to).await
}

/// What `sqlx migrate run` (sqlx-cli 0.9) does when run in directory `cwd`: reads
/// `cwd/sqlx.toml` with sqlx's own parser, resolves its `migrations-dir` (relative to
/// `cwd`) with its `ignored-chars`, creates its `create-schemas`, and applies the
/// migrations up to `to` recording them in its `table-name`, through sqlx's migrator.
pub async fn sqlx_cli_migrate(
    db: &crate::TestDb,
    cwd: &Path,
    to: Option<i64>,
) -> Result<(), String> {
    use sqlx::_unstable::config::Config;
    use sqlx::migrate::{Migrator, ResolveWith};
    let config = Config::try_from_path(cwd.join("sqlx.toml")).map_err(|e| format!("{e:?}"))?;
    let dir = cwd.join(config.migrate.migrations_dir());
    let mut migrator = Migrator::new(ResolveWith(dir, config.migrate.to_resolve_config()))
        .await
        .map_err(|e| e.to_string())?;
    migrator.dangerous_set_table_name(config.migrate.table_name().to_string());
    for schema in &config.migrate.create_schemas {
        migrator.create_schema(schema.to_string());
    }
    run_migrator(db, &migrator, to).await
}

/// Runs sqlx's `migrator` on the test's database, up to `to`, on a pool of one.
async fn run_migrator(
    db: &crate::TestDb,
    migrator: &sqlx::migrate::Migrator,
    to: Option<i64>,
) -> Result<(), String> {
    macro_rules! on {
        ($pool:expr) => {{
            let pool = $pool.map_err(|e| e.to_string())?;
            let res = match to {
                Some(v) => migrator.run_to(v, &pool).await,
                None => migrator.run(&pool).await,
            };
            pool.close().await;
            res.map_err(|e| e.to_string())
        }};
    }
    fn one<DB: sqlx::Database>() -> sqlx::pool::PoolOptions<DB> {
        sqlx::pool::PoolOptions::new().max_connections(1)
    }
    match db {
        crate::TestDb::Postgres(s) => on!(one::<sqlx::Postgres>().connect(&s.url).await),
        crate::TestDb::MySql(d) => on!(one::<sqlx::MySql>().connect(&d.url).await),
        crate::TestDb::Sqlite(d) => on!(one::<sqlx::Sqlite>()
            .connect_with(
                sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(&d.path)
                    .create_if_missing(true)
            )
            .await),
    }
}

/// The first version of [`sqlx_shaped_set`].
pub const FIRST: i64 = 20230105090000;

/// How many migrations (up files) [`sqlx_shaped_set`] has.
pub const MIGRATIONS: usize = 48;

/// The migration of [`sqlx_shaped_set`] that reads and edits sqlx's history table.
pub const READS_SQLX_HISTORY: usize = 30;

/// The version of the `i`th migration (from 0): timestamps a day and some minutes
/// apart, as `sqlx migrate add` writes them.
pub fn version(i: usize) -> i64 {
    // 2023-01-05 09:00 plus i days (20 a month, so the dates stay valid) and i
    // minutes.
    let day = 5 + (i % 20) as i64;
    let month = 1 + (i / 20) as i64;
    let minute = (i % 60) as i64;
    ((2023 * 100 + month) * 100 + day) * 1_000_000 + 9 * 10_000 + minute * 100
}

/// A migration set shaped like the real ones sqlx-cli users keep, as `(file, sql)`:
///
/// - [`MIGRATIONS`] timestamped migrations (`20230105090000_create_accounts.sql`…), most
///   of them tables with sequences, indexes, foreign keys, enum types (with an
///   `ALTER TYPE … ADD VALUE` later), functions with `$$` bodies and triggers;
/// - a block of six consecutive no-transaction migrations (sqlx's `-- no-transaction`
///   first line), each one `CREATE INDEX CONCURRENTLY` (as sqlx requires: it sends the
///   file as one message), without `IF NOT EXISTS`, so that one applied twice fails;
/// - every seventh migration a reversible pair (`.up.sql` / `.down.sql`);
/// - migration [`READS_SQLX_HISTORY`] reads and edits `_sqlx_migrations` (guarded, as it
///   must be to run on a database sqlx never touched);
/// - every migration that runs in a transaction appends its file name to
///   `migration_log`, so one applied twice shows.
pub fn sqlx_shaped_set() -> Vec<(String, String)> {
    let mut files = Vec::new();
    for i in 0..MIGRATIONS {
        let v = version(i);
        let log = |file: &str| format!("INSERT INTO migration_log (file) VALUES ('{file}');\n");
        let (name, body) = match i {
            0 => (
                "create_accounts".to_string(),
                "CREATE TABLE migration_log (file text NOT NULL, \
                 at timestamptz NOT NULL DEFAULT clock_timestamp());\n\
                 CREATE TYPE account_state AS ENUM ('active', 'closed');\n\
                 CREATE TABLE accounts (\n    id bigserial PRIMARY KEY,\n    \
                 email text NOT NULL UNIQUE,\n    state account_state NOT NULL DEFAULT 'active',\n    \
                 created_at timestamptz NOT NULL DEFAULT now()\n);\n"
                    .to_string(),
            ),
            20..=25 => (
                format!("index_t{:02}_concurrently", i - 20 + 1),
                format!(
                    "-- no-transaction\n-- Built without blocking writes; sqlx sends the file as \
                     one message, so one statement.\n\
                     CREATE INDEX CONCURRENTLY t{0:02}_note_idx ON t{0:02} (note);\n",
                    i - 20 + 1
                ),
            ),
            12 => (
                "add_state_suspended".to_string(),
                "ALTER TYPE account_state ADD VALUE IF NOT EXISTS 'suspended';\n".to_string(),
            ),
            17 => (
                "touch_trigger".to_string(),
                "CREATE FUNCTION touch() RETURNS trigger LANGUAGE plpgsql AS $$\nBEGIN\n    \
                 NEW.updated_at := now(); -- a semicolon in the body\n    RETURN NEW;\nEND;\n$$;\n\
                 CREATE TRIGGER accounts_touch BEFORE UPDATE ON accounts FOR EACH ROW \
                 EXECUTE FUNCTION touch();\n\
                 ALTER TABLE accounts ADD COLUMN updated_at timestamptz;\n"
                    .to_string(),
            ),
            READS_SQLX_HISTORY => (
                "note_sqlx_history".to_string(),
                "CREATE TABLE history_notes (note text NOT NULL);\n\
                 -- Reads and edits sqlx's history where there is one, as teams do to repair it.\n\
                 DO $$\nBEGIN\n    IF to_regclass('_sqlx_migrations') IS NOT NULL THEN\n        \
                 INSERT INTO history_notes SELECT 'sqlx rows: ' || count(*) FROM _sqlx_migrations;\n        \
                 UPDATE _sqlx_migrations SET description = description || ' (noted)' \
                 WHERE version = 20230105090000;\n    \
                 ELSE\n        INSERT INTO history_notes VALUES ('no sqlx history');\n    \
                 END IF;\nEND\n$$;\n"
                    .to_string(),
            ),
            // Tables t01..t19 first, then more tables and changes.
            _ => {
                let t = i;
                (
                    format!("create_t{t:02}"),
                    format!(
                        "CREATE TABLE t{t:02} (\n    id bigserial PRIMARY KEY,\n    \
                         account_id bigint REFERENCES accounts (id),\n    note text,\n    \
                         body jsonb NOT NULL DEFAULT '{{}}'\n);\n\
                         CREATE INDEX t{t:02}_account ON t{t:02} (account_id);\n\
                         COMMENT ON TABLE t{t:02} IS 'table {t}; with a semicolon';\n"
                    ),
                )
            }
        };
        let reversible = i % 7 == 3 && !(20..=25).contains(&i);
        let no_tx = (20..=25).contains(&i);
        let ext = if reversible { ".up.sql" } else { ".sql" };
        let file = format!("{v}_{name}{ext}");
        let sql = if no_tx {
            body
        } else {
            format!("{body}{}", log(&file))
        };
        files.push((file, sql));
        if reversible {
            let down = if name.starts_with("create_t") {
                format!("DROP TABLE t{i:02};\n")
            } else {
                "SELECT 1;\n".to_string()
            };
            files.push((format!("{v}_{name}.down.sql"), down));
        }
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_get_the_database_replaced() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/test", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgres://u:p@h/test?sslmode=disable", "x"),
            "postgres://u:p@h/x?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://h:5432", "x"),
            "postgres://h:5432/x"
        );
    }

    #[test]
    fn the_fixture_is_shaped_as_promised() {
        let set = dblock::migrate::Migrations::from_sources(sqlx_shaped_set()).unwrap();
        assert_eq!(set.len(), MIGRATIONS);
        assert_eq!(set.iter().filter(|m| m.no_transaction()).count(), 6);
        assert!(set.iter().filter(|m| m.down_sql().is_some()).count() >= 5);
        assert_eq!(set.iter().next().unwrap().version(), FIRST);
        let versions: Vec<i64> = set.iter().map(|m| m.version()).collect();
        assert!(versions.windows(2).all(|w| w[0] < w[1]));
    }
}
