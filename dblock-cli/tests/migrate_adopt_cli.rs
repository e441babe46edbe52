//! `dblock migrate` on other tools' directories and databases, and on directories with
//! things in them that are not migration files, run as real processes:
//!
//! ```text
//! dblock migrate [--db URL] DIR [--dry-run]        sqlx-cli directories as they are
//! dblock migrate baseline [--db URL] DIR [--to V]  adopt another tool's history
//! dblock migrate revert [--db URL] DIR [--to V]    run .down.sql files
//! dblock migrate new NAME [DIR]                    the next file, in DIR's naming
//! ```
//!
//! Every invocation is bounded: a hang fails the test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::Duration;

use dblock_testkit::adoption::{MIGRATIONS, OwnDatabase, sqlx_migrate, sqlx_shaped_set, version};
use dblock_testkit::migrations::MigrationDir;
use dblock_testkit::{SqliteDb, exit_code as code, one_line_error};
use tokio::process::Command;

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");
const BOUND: Duration = Duration::from_secs(60);

fn dblock(state: &std::path::Path) -> Command {
    dblock_testkit::dblock_command(DBLOCK, state)
}

/// Runs `cmd` to its end, failing the test if it takes longer than [`BOUND`] (the
/// process is killed when the future is dropped).
async fn bounded(mut cmd: Command) -> Output {
    match tokio::time::timeout(BOUND, cmd.output()).await {
        Ok(out) => out.unwrap(),
        Err(_) => panic!("dblock did not finish within {BOUND:?}: {cmd:?}"),
    }
}

async fn dblock_args(args: &[&str]) -> Output {
    let state = tempfile::tempdir().unwrap();
    let mut c = dblock(state.path());
    c.args(args);
    bounded(c).await
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

fn dir_arg(d: &MigrationDir) -> &str {
    d.path().to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_named_like_a_migration_is_refused_instead_of_waited_on() {
    let db = SqliteDb::new();
    let d = MigrationDir::new(&[("0001_a.sql", "CREATE TABLE a (x INTEGER);")]);
    let fifo = d.file("0002_b.sql");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    for args in [
        vec!["migrate", "status", "--db", &db.url, dir_arg(&d)],
        vec!["migrate", "--db", &db.url, dir_arg(&d)],
        vec!["migrate", "--db", &db.url, dir_arg(&d), "--dry-run"],
    ] {
        // Today's code opened the FIFO for reading and waited for a writer forever.
        let out = dblock_args(&args).await;
        assert_eq!(code(&out), 65, "{args:?}: {out:?}");
        let err = one_line_error(&out);
        assert!(
            err.contains("0002_b.sql: refused: it is a FIFO (named pipe)"),
            "{args:?}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_to_dev_zero_or_an_oversized_file_is_refused_instead_of_read() {
    let db = SqliteDb::new();
    let d = MigrationDir::new(&[("0001_a.sql", "CREATE TABLE a (x INTEGER);")]);
    std::os::unix::fs::symlink("/dev/zero", d.file("0002_zero.sql")).unwrap();
    // Under a 2 GB address-space limit, so that today's code (which read /dev/zero until
    // memory ran out) fails this test quickly instead of exhausting the machine.
    let limited = |args: &[&str]| {
        let state = tempfile::tempdir().unwrap();
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("ulimit -v 2000000; exec \"$@\"")
            .arg("sh")
            .arg(DBLOCK)
            .args(args)
            .env_remove("DBLOCK_DATABASE_URL")
            .env_remove("DATABASE_URL")
            .env("XDG_STATE_HOME", state.path())
            .kill_on_drop(true);
        (c, state)
    };
    let (c, _state) = limited(&["migrate", "status", "--db", &db.url, dir_arg(&d)]);
    let out = bounded(c).await;
    assert_eq!(code(&out), 65, "{out:?}");
    let err = one_line_error(&out);
    assert!(
        err.contains("0002_zero.sql: refused: it is a character device"),
        "{err}"
    );

    // A regular file over the limit (sparse: no disk is used) is refused by its size.
    std::fs::remove_file(d.file("0002_zero.sql")).unwrap();
    let big = std::fs::File::create(d.file("0002_big.sql")).unwrap();
    big.set_len(dblock::migrate::MAX_FILE_BYTES + 1).unwrap();
    let (c, _state) = limited(&["migrate", "--db", &db.url, dir_arg(&d)]);
    let out = bounded(c).await;
    assert_eq!(code(&out), 65, "{out:?}");
    let err = one_line_error(&out);
    assert!(
        err.contains("0002_big.sql: refused: 67108865 bytes or more, larger than the limit"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dry_run_lists_what_runs_outside_a_transaction_and_warns_before_anything_runs() {
    let db = OwnDatabase::new("cli_dry_run").await;
    let d = MigrationDir::new(&[
        ("20240101000000_t.sql", "CREATE TABLE t (x int, y int);"),
        (
            "20240102000000_t_x.sql",
            "-- no-transaction\nCREATE INDEX CONCURRENTLY t_x ON t (x);",
        ),
        (
            "20240103000000_t_y.up.sql",
            "CREATE INDEX CONCURRENTLY t_y ON t (y);\nVACUUM t;",
        ),
        ("20240103000000_t_y.down.sql", "DROP INDEX t_y;"),
    ]);
    let out = dblock_args(&["migrate", "--db", &db.url, dir_arg(&d), "--dry-run"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(
        stdout(&out),
        "pending  20240101000000_t.sql\n\
         pending  20240102000000_t_x.sql  (no transaction)\n\
         pending  20240103000000_t_y.up.sql\n\
         3 pending (1 outside a transaction), 0 already applied (dry run: nothing changed)\n"
    );
    let err = stderr(&out);
    for w in [
        "dblock: warning: 20240103000000_t_y.up.sql: statement 1 is CREATE INDEX CONCURRENTLY, \
         which cannot run inside a transaction; make `-- no-transaction`",
        "dblock: warning: 20240103000000_t_y.up.sql: statement 2 is VACUUM",
    ] {
        assert!(err.contains(w), "{w}: {err}");
    }
    assert!(!err.contains("t_x.sql"), "the marked file is fine: {err}");
    assert!(
        !db.has("dblock_migrations").await,
        "a dry run changes nothing"
    );
    // The run warns too, before it starts; then fails on that file, naming it.
    let out = dblock_args(&["migrate", "--db", &db.url, dir_arg(&d)]).await;
    assert_eq!(code(&out), 69, "{out:?}");
    let err = stderr(&out);
    assert!(
        err.starts_with("dblock: warning: 20240103000000_t_y.up.sql"),
        "{err}"
    );
    assert!(
        err.contains("migration ") && err.contains("20240103000000_t_y.up.sql failed"),
        "{err}"
    );
    db.drop().await;
}

/// Eight `dblock migrate` processes at once on a database sqlx migrated (all but the
/// last five files): everything sqlx applied is adopted, the five are applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_processes_adopt_what_sqlx_applied_and_apply_the_rest_once() {
    let db = OwnDatabase::new("cli_adopt").await;
    let d = MigrationDir::new(&sqlx_shaped_set());
    sqlx_migrate(&db.url, d.path(), Some(version(MIGRATIONS - 6)))
        .await
        .unwrap();
    let status = dblock_args(&["migrate", "status", "--db", &db.url, dir_arg(&d)]).await;
    assert_eq!(code(&status), 0, "{status:?}");
    let text = stdout(&status);
    assert!(
        text.ends_with(&format!(
            "{} applied, 5 pending, 0 edited, 0 unknown\n",
            MIGRATIONS - 5
        )),
        "{text}"
    );
    assert!(
        text.contains("(by sqlx; adopted by the next run)"),
        "{text}"
    );

    let mut runs = Vec::new();
    for _ in 0..8 {
        let state = tempfile::tempdir().unwrap();
        let mut c = dblock(state.path());
        c.args(["migrate", "--db", &db.url, dir_arg(&d)]);
        runs.push(tokio::spawn(async move {
            let _state = state;
            bounded(c).await
        }));
    }
    let mut outs = Vec::new();
    for r in runs {
        outs.push(r.await.unwrap());
    }
    let mut applied = Vec::new();
    for out in &outs {
        assert_eq!(code(out), 0, "{out:?}");
        applied.extend(
            stdout(out)
                .lines()
                .filter_map(|l| l.strip_prefix("applied  "))
                .map(|l| l.split_whitespace().next().unwrap().to_string()),
        );
    }
    applied.sort();
    assert_eq!(applied.len(), 5, "{applied:?}");
    let adopting: Vec<&Output> = outs
        .iter()
        .filter(|o| {
            stdout(o).contains(&format!(
                "({} adopted from _sqlx_migrations)",
                MIGRATIONS - 5
            ))
        })
        .collect();
    assert_eq!(adopting.len(), 1, "one process adopts, under the lock");
    let twice: i64 = db
        .one("SELECT count(*) FROM (SELECT file FROM migration_log GROUP BY file HAVING count(*) > 1) x")
        .await;
    assert_eq!(twice, 0);
    let status = dblock_args(&["migrate", "status", "--db", &db.url, dir_arg(&d)]).await;
    assert_eq!(code(&status), 0, "{status:?}");
    assert!(
        stdout(&status).ends_with(&format!(
            "{MIGRATIONS} applied, 0 pending, 0 edited, 0 unknown\n"
        )),
        "{}",
        stdout(&status)
    );
    db.drop().await;
}

/// A rolling deploy from sqlx to dblock, on a fresh database: four `dblock migrate
/// --sqlx-history always` processes and four instances still running sqlx's migrator,
/// at once. Every one succeeds, each migration runs once, both histories end complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dblock_processes_and_sqlx_migrators_at_once_apply_each_migration_once() {
    let db = OwnDatabase::new("cli_beside_sqlx").await;
    let files: Vec<(String, String)> = sqlx_shaped_set()
        .into_iter()
        .filter(|(_, sql)| !sql.starts_with("-- no-transaction"))
        .collect();
    let d = MigrationDir::new(&files);
    let mut runs = Vec::new();
    for _ in 0..4 {
        let state = tempfile::tempdir().unwrap();
        let mut c = dblock(state.path());
        c.args([
            "migrate",
            "--db",
            &db.url,
            "--sqlx-history",
            "always",
            dir_arg(&d),
        ]);
        runs.push(tokio::spawn(async move {
            let _state = state;
            bounded(c).await
        }));
    }
    let mut sqlx_runs = Vec::new();
    for _ in 0..4 {
        let (url, dir) = (db.url.clone(), d.path().to_path_buf());
        sqlx_runs.push(tokio::spawn(
            async move { sqlx_migrate(&url, &dir, None).await },
        ));
    }
    for r in runs {
        let out = r.await.unwrap();
        assert_eq!(code(&out), 0, "{out:?}");
    }
    for r in sqlx_runs {
        r.await.unwrap().unwrap();
    }
    let twice: i64 = db
        .one("SELECT count(*) FROM (SELECT file FROM migration_log GROUP BY file HAVING count(*) > 1) x")
        .await;
    assert_eq!(twice, 0);
    let logged: i64 = db.one("SELECT count(*) FROM migration_log").await;
    assert_eq!(
        logged as usize,
        files.len()
            - files
                .iter()
                .filter(|(f, _)| f.ends_with(".down.sql"))
                .count()
    );
    let dblock_versions = db.versions("dblock_migrations").await;
    assert_eq!(dblock_versions.len(), MIGRATIONS - 6);
    assert_eq!(db.versions("_sqlx_migrations").await, dblock_versions);
    // A value the option does not know is a usage error.
    let out = dblock_args(&[
        "migrate",
        "--db",
        &db.url,
        "--sqlx-history",
        "sometimes",
        dir_arg(&d),
    ])
    .await;
    assert_eq!(code(&out), 64, "{out:?}");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_file_exits_65_naming_it_and_the_command_that_adopts() {
    let db = OwnDatabase::new("cli_edited").await;
    let files = sqlx_shaped_set();
    let d = MigrationDir::new(&files);
    sqlx_migrate(&db.url, d.path(), Some(version(5)))
        .await
        .unwrap();
    let (file, sql) = &files[2];
    d.write(file, &format!("{sql}-- edited after sqlx applied it\n"));
    let dir = dir_arg(&d);
    for args in [
        vec!["migrate", "--db", &db.url, dir],
        vec!["migrate", "--db", &db.url, dir, "--dry-run"],
    ] {
        let out = dblock_args(&args).await;
        assert_eq!(code(&out), 65, "{out:?}");
        let err = one_line_error(&out);
        assert!(
            err.contains(&format!("{dir}/{file} differs from what sqlx applied")),
            "{err}"
        );
        assert!(
            err.contains(&format!("`dblock migrate baseline {dir}`)")),
            "{err}"
        );
    }
    let status = dblock_args(&["migrate", "status", "--db", &db.url, dir]).await;
    assert_eq!(code(&status), 65, "{status:?}");
    assert!(
        stdout(&status).contains(&format!("edited   {file}")),
        "{}",
        stdout(&status)
    );
    assert!(!db.has("dblock_migrations").await, "nothing changed");

    let out = dblock_args(&["migrate", "baseline", "--db", &db.url, dir]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let text = stdout(&out);
    assert!(
        text.contains(&format!(
            "adopted  {file}  (differs from what sqlx applied: accepted as it is now)"
        )),
        "{text}"
    );
    assert!(
        text.ends_with("6 adopted: recorded as applied without running them\n"),
        "{text}"
    );
    let out = dblock_args(&["migrate", "--db", &db.url, dir]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(
        stdout(&out).ends_with(&format!("{} applied, 6 already applied\n", MIGRATIONS - 6)),
        "{}",
        stdout(&out)
    );
    // Revert the last two with their .down.sql files; only pairs can be reverted.
    let out = dblock_args(&["migrate", "revert", "--db", &db.url, dir]).await;
    assert_eq!(code(&out), 65, "{out:?}");
    assert!(one_line_error(&out).contains("cannot revert it: it has no .down.sql"));
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_writes_the_next_file_in_the_directorys_own_naming() {
    let names = |d: &MigrationDir| {
        let mut v: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // dblock's numbered files.
    let d = MigrationDir::new(&[("0001_a.sql", ""), ("0002_b.sql", "")]);
    let out = dblock_args(&["migrate", "new", "add users email", dir_arg(&d)]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(
        names(&d),
        ["0001_a.sql", "0002_b.sql", "0003_add_users_email.sql"]
    );
    assert_eq!(
        stdout(&out),
        format!("{}\n", d.file("0003_add_users_email.sql").display())
    );
    // sqlx-cli's reversible timestamped pairs: a pair, stamped now (after the last).
    let d = MigrationDir::new(&[
        ("20240101093000_init.up.sql", "CREATE TABLE t (x int);"),
        ("20240101093000_init.down.sql", "DROP TABLE t;"),
    ]);
    let out = dblock_args(&["migrate", "new", "add-index", dir_arg(&d)]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let new: Vec<String> = names(&d)
        .into_iter()
        .filter(|n| n.contains("add-index"))
        .collect();
    assert_eq!(new.len(), 2, "{new:?}");
    assert!(new[0].ends_with("_add-index.down.sql") && new[1].ends_with("_add-index.up.sql"));
    let stamp: i64 = new[0][..14].parse().unwrap();
    assert!(stamp > 20240101093000 && new[0].len() == "20240101093000_add-index.down.sql".len());
    // The set still reads, with the new pair in it.
    assert_eq!(
        dblock::migrate::Migrations::from_dir(d.path())
            .unwrap()
            .len(),
        2
    );
    // Flyway's.
    let d = MigrationDir::new(&[("V1__a.sql", ""), ("V2__b.sql", "")]);
    let out = dblock_args(&["migrate", "new", "c", dir_arg(&d)]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(names(&d), ["V1__a.sql", "V2__b.sql", "V3__c.sql"]);
    // A directory that does not exist yet.
    let root = tempfile::tempdir().unwrap();
    let fresh = root.path().join("migrations");
    let out = dblock_args(&["migrate", "new", "init", fresh.to_str().unwrap()]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(fresh.join("0001_init.sql").is_file());
    // A name with nothing usable in it.
    let out = dblock_args(&["migrate", "new", "!!", fresh.to_str().unwrap()]).await;
    assert_eq!(code(&out), 65, "{out:?}");
}
