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
