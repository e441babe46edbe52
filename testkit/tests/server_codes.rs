//! `Error::sqlstate()` and `Error::native_code()` say what each server said, on real
//! servers: PostgreSQL's SQLSTATE, MySQL's error number beside the SQLSTATE it sent,
//! SQLite's result code and no SQLSTATE (it has none). Before, MySQL's errors answered
//! PostgreSQL's codes (a MySQL permission error said 42501, its deadlock 40P01).
//! PostgreSQL's deadlock (40P01 both ways): `postgres_locks.rs`,
//! `a_deadlock_between_transactions_is_a_typed_error`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use dblock::Error;
use dblock::migrate::Migrations;
use dblock_testkit::testdb::within;
use dblock_testkit::{MyDb, PgSchema, TestDb, pg_url, with_params};

/// The same failure on every backend — a migration inserting into a table that does not
/// exist — carries that backend's codes, and no other's.
async fn a_server_error_carries_the_backends_own_codes(db: &TestDb) {
    let locks = db.locks().await;
    let set = Migrations::from_sources([("0001_nowhere.sql", "INSERT INTO nowhere VALUES (1);")])
        .unwrap();
    let e = within(60, "migrate", set.run(&locks)).await.unwrap_err();
    assert!(matches!(e, Error::MigrationFailed { .. }), "{e:?}");
    let (sqlstate, native) = match db.backend() {
        // undefined_table; PostgreSQL has no code but the SQLSTATE.
        "postgres" => (Some("42P01"), Some("42P01")),
        // ER_NO_SUCH_TABLE, sent with SQLSTATE 42S02.
        "mysql" => (Some("42S02"), Some("1146")),
        // SQLITE_ERROR; SQLite has no SQLSTATE.
        "sqlite" => (None, Some("1")),
        other => panic!("no expectation for {other}"),
    };
    assert_eq!(e.sqlstate(), sqlstate, "{e:?}");
    assert_eq!(e.native_code(), native, "{e:?}");
    // The message shows the code as the backend's own client would.
    let shown = match (native, sqlstate) {
        (Some(n), Some(s)) if n != s => format!("database error {n} ({s}):"),
        (Some(n), _) => format!("database error {n}:"),
        _ => unreachable!(),
    };
    assert!(e.to_string().contains(&shown), "{e}");
}

dblock_testkit::every_backend!(own_database: a_server_error_carries_the_backends_own_codes);

/// A role that may neither create dblock's table nor write to it (nobody granted it):
/// a fenced lock is `Error::PermissionDenied` with PostgreSQL's insufficient_privilege,
/// 42501.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_permission_error_is_42501() {
    let s = PgSchema::new("codes_perm").await;
    let role = format!("{}_ro", s.name);
    // PostgreSQL 15's default: only the owner may create in `public`.
    s.admin()
        .batch_execute(&format!(
            "DROP ROLE IF EXISTS \"{role}\"; CREATE ROLE \"{role}\" LOGIN; \
             GRANT USAGE ON SCHEMA \"{0}\" TO \"{role}\"",
            s.name
        ))
        .await
        .unwrap();
    let base = pg_url();
    let (scheme, rest) = base.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, h)| h);
    let url = with_params(
        &format!("{scheme}://{role}@{host}"),
        &[("application_name", &s.app)],
    );
    let locks = within(10, "connect", dblock::Locks::connect(&url))
        .await
        .unwrap();
    let e = within(10, "fenced", locks.request("f").fenced().lock())
        .await
        .unwrap_err();
    drop(locks);
    let _ = s
        .admin()
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await;
    assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
    assert_eq!(e.sqlstate(), Some("42501"), "{e:?}");
    assert_eq!(e.native_code(), Some("42501"), "{e:?}");
}

/// A MySQL user that may not create dblock's table: `Error::PermissionDenied` with
/// MySQL's own error number (ER_TABLEACCESS_DENIED_ERROR, 1142) and the SQLSTATE it sent
/// (42000) — not PostgreSQL's 42501.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mysql_permission_error_is_mysqls_own() {
    let db = MyDb::new("codes_perm").await;
    let user = format!("dblc{}", std::process::id());
    let url = db.read_only_user(&user).await;
    let locks = within(10, "connect", dblock::Locks::connect(&url))
        .await
        .unwrap();
    let e = within(10, "setup", locks.setup(&[])).await.unwrap_err();
    drop(locks);
    db.drop_user(&user).await;
    assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
    assert_eq!(e.native_code(), Some("1142"), "{e:?}");
    assert_eq!(e.sqlstate(), Some("42000"), "{e:?}");
}
