//! Every function dblock calls on PostgreSQL is `pg_catalog.`-qualified, so a role's
//! `search_path` cannot redirect it (issue 25 item 2). A role's path puts a schema of
//! shadows before `pg_catalog`: advisory-lock functions that always grant (the
//! dangerous lie) and functions named like the others dblock calls that raise (so any
//! unqualified call fails loudly). The control shows an unqualified call is redirected
//! on that role; dblock, on the same role, takes, excludes, fences, waits and reports
//! as on any other.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Key, Locks, Scope};
use dblock_testkit::cluster::granting_stubs;
use dblock_testkit::{PgSchema, admin_connect, pg_url, with_params, with_user};

/// Bounds every await of these tests.
async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("did not finish within {secs} s"))
}

/// Other functions dblock calls, with their argument and return types, shadowed by
/// ones that raise.
const RAISING: &[(&str, &str, &str)] = &[
    ("now", "", "timestamptz"),
    ("clock_timestamp", "", "timestamptz"),
    ("statement_timestamp", "", "timestamptz"),
    ("transaction_timestamp", "", "timestamptz"),
    ("set_config", "text, text, boolean", "text"),
    ("current_setting", "text", "text"),
    ("current_setting", "text, boolean", "text"),
    ("current_schema", "", "name"),
    ("current_database", "", "name"),
    ("pg_backend_pid", "", "integer"),
    ("inet_server_port", "", "integer"),
    ("inet_client_port", "", "integer"),
    ("version", "", "text"),
    ("to_regclass", "text", "regclass"),
    ("pg_current_wal_lsn", "", "pg_lsn"),
    ("pg_walfile_name", "pg_lsn", "text"),
    ("unnest", "anyarray", "SETOF anyelement"),
    ("pg_advisory_unlock_all", "", "void"),
];

/// The shadowing schema's functions.
fn shadows(schema: &str) -> String {
    let mut sql = granting_stubs(&format!("\"{schema}\""));
    for (f, args, ret) in RAISING {
        sql.push_str(&format!(
            "CREATE FUNCTION \"{schema}\".{f}({args}) RETURNS {ret} LANGUAGE plpgsql AS \
             $$BEGIN RAISE EXCEPTION 'shadowed {f}({args}) called'; END$$;"
        ));
    }
    sql
}

/// dblock on a role whose `search_path` is `shadow, pg_catalog, <the test's schema>`:
/// a lock excludes a second handle (each scope, try and wait, a semaphore, a set), a
/// fenced lock takes a token and excludes, a lease and a deadline are set, status
/// shows the holder. Control: on the same role an unqualified try is granted while the
/// lock is held, and an unqualified `now()` raises — the path does redirect calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_path_cannot_redirect_dblocks_calls() {
    let s = PgSchema::new("shadowed").await;
    let shadow = format!("{}_shadow", s.name);
    let role = format!("r_{}", s.name);
    let admin = s.admin();
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA \"{shadow}\"; {} CREATE ROLE \"{role}\" LOGIN; \
             ALTER ROLE \"{role}\" SET search_path = \"{shadow}\", pg_catalog, \"{ns}\"; \
             GRANT ALL ON SCHEMA \"{ns}\" TO \"{role}\"; \
             GRANT USAGE ON SCHEMA \"{shadow}\" TO \"{role}\"",
            shadows(&shadow),
            ns = s.name
        ))
        .await
        .unwrap();
    // The fencing table's rights, as an operator gives them (`dblock setup --grant`).
    let owner = within(10, Locks::connect(&s.url)).await.unwrap();
    within(20, owner.setup(&[role.as_str()])).await.unwrap();
    let url = with_params(
        &with_user(&pg_url(), &role),
        &[
            ("options", &format!("-c dblock.namespace={}", s.name)),
            ("application_name", &s.app),
        ],
    );
    let a = within(10, Locks::connect(&url)).await.unwrap();
    let b = within(10, Locks::connect(&url)).await.unwrap();

    // Control: the role's own unqualified calls reach the shadows.
    let held = within(10, a.lock("job")).await.unwrap();
    let role_conn = admin_connect(&url).await;
    let key = Key::new(&s.name, "job").unwrap().as_i64();
    let path: String = role_conn
        .query_one("SHOW search_path", &[])
        .await
        .unwrap()
        .get(0);
    assert!(path.trim_start_matches('"').starts_with(&shadow), "{path}");
    let redirected: bool = role_conn
        .query_one(&format!("SELECT pg_try_advisory_xact_lock({key})"), &[])
        .await
        .unwrap()
        .get(0);
    assert!(redirected, "the control: an unqualified try is redirected");
    let qualified: bool = role_conn
        .query_one(
            &format!("SELECT pg_catalog.pg_try_advisory_xact_lock({key})"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!qualified, "the real function sees the holder");
    let raised = role_conn.simple_query("SELECT now()").await.unwrap_err();
    assert!(format!("{raised:?}").contains("shadowed now"), "{raised:?}");

    // dblock is not redirected: every kind of request excludes, nothing raises.
    assert!(within(10, b.try_lock("job")).await.unwrap().is_none());
    assert!(
        within(10, b.try_lock_for("job", Duration::from_millis(200)))
            .await
            .unwrap()
            .is_none()
    );
    let rows = within(10, b.status(&["job"])).await.unwrap();
    assert_eq!(rows.iter().map(|r| r.holders.len()).sum::<usize>(), 1);
    drop(held);
    let session = within(10, a.request("s").scope(Scope::Session).lock())
        .await
        .unwrap();
    let sem = within(10, a.semaphore("sem", 1).lock()).await.unwrap();
    let set = within(10, a.lock_all(["x", "y"])).await.unwrap();
    let leased = within(
        10,
        a.request("leased").lease(Duration::from_secs(30)).lock(),
    )
    .await
    .unwrap();
    let fenced = within(20, a.request("fenced").fenced().lock())
        .await
        .unwrap();
    assert!(fenced.fencing_token().is_some());
    for name in ["s", "leased", "fenced"] {
        for scope in [Scope::Transaction, Scope::Session] {
            let got = within(10, b.request(name).scope(scope).try_lock())
                .await
                .unwrap();
            assert!(got.is_none(), "{name} {scope:?} granted twice");
        }
    }
    assert!(
        within(10, b.semaphore("sem", 1).try_lock())
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        within(10, b.try_lock_all(["y", "z"]))
            .await
            .unwrap()
            .is_none()
    );
    for g in [session, leased, fenced] {
        within(10, g.release()).await.unwrap();
    }
    drop((sem, set));
    // Released for real: the other handle takes them now.
    assert!(within(10, b.try_lock("fenced")).await.unwrap().is_some());

    drop((a, b, role_conn));
    admin
        .batch_execute(&format!(
            "DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\"; DROP SCHEMA \"{shadow}\" CASCADE"
        ))
        .await
        .unwrap();
}
