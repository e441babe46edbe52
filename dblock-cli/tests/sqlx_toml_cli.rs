//! `sqlx.toml`, read from the current directory as sqlx-cli 0.9 reads it: `[migrate]
//! table-name` (plain or schema-qualified) for adoption, every `ignored-chars` set, and
//! `dblock migrate` with no DIR using `migrations-dir` (else `migrations/`). The
//! projects are laid out as sqlx-cli 0.9 writes them (`sqlx migrate add` file names and
//! bodies), and sqlx's history is written by sqlx's own migrator from the same
//! `sqlx.toml`, parsed by sqlx itself (`dblock_testkit::adoption::sqlx_cli_migrate`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use dblock_testkit::adoption::sqlx_cli_migrate;
use dblock_testkit::{SqliteDb, TestDb, exit_code as code};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

/// `dblock migrate ARGS… --db URL`, run in `cwd`, with no DIR.
async fn migrate_in(cwd: &Path, url: &str, args: &[&str]) -> Output {
    let state = tempfile::tempdir().unwrap();
    let run = dblock_testkit::dblock_command(DBLOCK, state.path())
        .current_dir(cwd)
        .arg("migrate")
        .args(args)
        .args(["--db", url])
        .output();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("dblock migrate hung")
        .unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// A project as sqlx-cli 0.9 leaves it: `sqlx.toml` (`toml`), and in `dir` the files
/// `sqlx migrate add` names (`VERSION_DESCRIPTION.sql`, `-r` pairs), with their bodies
/// as `(file, sql)`.
fn project(toml: &str, dir: &str, files: &[(&str, &str)]) -> tempfile::TempDir {
    let p = tempfile::tempdir().unwrap();
    std::fs::write(p.path().join("sqlx.toml"), toml).unwrap();
    let dir = p.path().join(dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (f, sql) in files {
        std::fs::write(dir.join(f), sql).unwrap();
    }
    p
}

/// Three migrations, the first saved with Windows line endings (what `ignored-chars =
/// ["\r"]` is for), each logging itself so that one applied twice shows.
const FILES: [(&str, &str); 4] = [
    (
        "20240105093012_create_accounts.sql",
        "-- Add migration script here\r\nCREATE TABLE accounts (id INT);\r\n\
         CREATE TABLE log (f VARCHAR(16));\r\nINSERT INTO log VALUES ('accounts');\r\n",
    ),
    (
        "20240105093533_add_orders.up.sql",
        "-- Add up migration script here\nCREATE TABLE orders (id INT);\n\
         INSERT INTO log VALUES ('orders');\n",
    ),
    (
        "20240105093533_add_orders.down.sql",
        "-- Add down migration script here\nDROP TABLE orders;\n",
    ),
    (
        "20240106101500_add_invoices.sql",
        "-- Add migration script here\nCREATE TABLE invoices (id INT);\n\
         INSERT INTO log VALUES ('invoices');\n",
    ),
];

/// The history table each backend's test names: schema-qualified on PostgreSQL (in a
/// schema sqlx creates, `create-schemas`), database-qualified on SQLite (`main.`), plain
/// on MySQL.
fn table_name(db: &TestDb) -> (&'static str, &'static str) {
    match db {
        TestDb::Postgres(_) => ("history.app_migrations", "create-schemas = [\"history\"]\n"),
        TestDb::Sqlite(_) => ("main.app_migrations", ""),
        TestDb::MySql(_) => ("app_migrations", ""),
    }
}

/// sqlx applied the first two; `dblock migrate` with no DIR, in the project, finds the
/// files in `migrations-dir`, adopts what sqlx recorded in `table-name` (checksums
/// computed as sqlx.toml's `ignored-chars` says) and applies the third, once. On the
/// old code `dblock migrate` without DIR was a usage error, and given the directory it
/// saw no sqlx history and applied everything again.
async fn sqlx_tomls_table_directory_and_checksum_setting_are_honoured(db: &TestDb) {
    let (table, schemas) = table_name(db);
    let toml = format!(
        "[migrate]\n{schemas}table-name = \"{table}\"\nmigrations-dir = \"db/migrations\"\n\
         ignored-chars = [\"\\r\"]\n"
    );
    let p = project(&toml, "db/migrations", &FILES);
    sqlx_cli_migrate(db, p.path(), Some(20240105093533))
        .await
        .unwrap();
    assert!(
        !db.has_table("_sqlx_migrations").await,
        "sqlx used the configured table"
    );

    let out = migrate_in(p.path(), db.url(), &["status"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let text = stdout(&out);
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("(by sqlx; adopted by the next run)"))
            .count(),
        2,
        "{text}"
    );
    assert!(
        text.contains("pending  20240106101500_add_invoices.sql"),
        "{text}"
    );

    let out = migrate_in(p.path(), db.url(), &[]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let text = stdout(&out);
    assert!(
        text.contains("applied  20240106101500_add_invoices.sql"),
        "{text}"
    );
    assert!(
        text.contains(&format!("(2 adopted from {table})")),
        "{text}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM log").await,
        3,
        "nothing applied twice"
    );
    assert_eq!(db.done_versions().await.len(), 3);
}

dblock_testkit::every_backend!(own_database: sqlx_tomls_table_directory_and_checksum_setting_are_honoured);

/// Each `ignored-chars` set sqlx accepts is the one dblock checks sqlx's checksums with:
/// adopted under the set sqlx used, refused (naming the file) under another. On the old
/// code only the full whitespace set was accepted, whatever sqlx.toml said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ignored_chars_set_is_the_one_checksums_are_compared_with() {
    let sets: [&str; 5] = [
        "[]",
        "[\"\\r\"]",
        "[\"\\t\"]",
        "[\" \", \"\\t\", \"\\r\", \"\\n\", \"\\uFEFF\"]",
        "[\";\", \"-\"]",
    ];
    for (i, set) in sets.iter().enumerate() {
        let toml = |chars: &str| format!("[migrate]\nignored-chars = {chars}\n");
        let p = project(&toml(set), "migrations", &FILES);
        let db = TestDb::Sqlite(SqliteDb::new());
        sqlx_cli_migrate(&db, p.path(), None).await.unwrap();
        let out = migrate_in(p.path(), db.url(), &[]).await;
        assert_eq!(code(&out), 0, "{set}: {out:?}");
        assert!(
            stdout(&out).contains("(3 adopted from _sqlx_migrations)"),
            "{set}: {out:?}"
        );

        // The same history read with another set: the file whose checksum differs is named.
        let other = sets[(i + 1) % sets.len()];
        let p2 = project(&toml(other), "migrations", &FILES);
        let db2 = TestDb::Sqlite(SqliteDb::new());
        sqlx_cli_migrate(&db2, p.path(), None).await.unwrap();
        let out = migrate_in(p2.path(), db2.url(), &[]).await;
        assert_eq!(code(&out), 65, "{set} read as {other}: {out:?}");
        assert!(
            stderr(&out).contains("differs from what sqlx applied"),
            "{out:?}"
        );
        assert!(!db2.has_table("dblock_migrations").await || db2.done_versions().await.is_empty());
    }
}

/// A `sqlx.toml` dblock cannot read as sqlx would is refused before anything runs,
/// naming the file and what is wrong: a misspelt key would otherwise leave sqlx's
/// history unseen and every migration applied again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlx_toml_that_cannot_be_read_as_sqlx_reads_it_is_refused() {
    for (toml, says) in [
        (
            "[migrate]\ntable_name = \"h\"\n",
            "unknown key \"table_name\" in [migrate]",
        ),
        (
            "[migrate]\ntable-name = \"h; DROP TABLE x\"\n",
            "is not a table name",
        ),
        (
            "[migrate]\nignored-chars = [\"\\r\\n\"]\n",
            "is not one character",
        ),
    ] {
        let p = project(toml, "migrations", &FILES);
        let db = SqliteDb::new();
        let out = migrate_in(p.path(), &db.url, &[]).await;
        assert_eq!(code(&out), 65, "{toml}: {out:?}");
        let err = stderr(&out);
        assert!(
            err.starts_with("dblock: sqlx.toml: ") && err.contains(says),
            "{toml}: {err}"
        );
        assert!(!db.path.exists(), "nothing was opened: {toml}");
    }
}

/// Without `sqlx.toml` the directory is sqlx-cli's default, `migrations/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sqlx_toml_the_directory_is_migrations() {
    let p = project("", "migrations", &FILES);
    std::fs::remove_file(p.path().join("sqlx.toml")).unwrap();
    let db = SqliteDb::new();
    let out = migrate_in(p.path(), &db.url, &[]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(
        stdout(&out).contains("3 applied, 0 already applied"),
        "{out:?}"
    );
    std::fs::remove_dir_all(p.path().join("migrations")).unwrap();
    let out = migrate_in(p.path(), &db.url, &[]).await;
    assert_eq!(code(&out), 65, "{out:?}");
    assert!(
        stderr(&out).contains("migrations: cannot read the migrations directory"),
        "{out:?}"
    );
}
