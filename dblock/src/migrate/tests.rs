//! Unit tests of the migration runner's pure parts.

use std::time::Duration;

use super::plan::{Record, RecordState, failed, interrupted, plan};
use super::status::status_of;
use super::*;

#[test]
fn the_lock_comes_first_and_the_ddl_is_carried_through_byte_for_byte() {
    let ddl = "-- leading comment\nCREATE TABLE IF NOT EXISTS t (x int);\n\
               DO $$ BEGIN PERFORM 1; END $$;\r\n\tCREATE INDEX IF NOT EXISTS i ON t (x)";
    let sql = lock_prefixed(ddl);
    let first = "SELECT pg_catalog.pg_advisory_xact_lock(4918577646357138689);\n";
    assert!(sql.starts_with(first), "{sql}");
    assert_eq!(&sql[first.len()..], ddl, "the caller's DDL, unaltered");
    // The prefix is one complete statement, whatever the script starts with.
    let stmts = split::split(&sql);
    assert_eq!(
        stmts[0],
        "SELECT pg_catalog.pg_advisory_xact_lock(4918577646357138689)"
    );
    assert_eq!(lock_prefixed(""), first);
}

#[test]
fn the_key_reads_dblockm_and_shows_in_pg_locks_as_documented() {
    assert_eq!(&MIGRATION_LOCK_KEY.to_be_bytes()[..7], b"DBLOCKM");
    assert_eq!(MIGRATION_LOCK_KEY.to_be_bytes()[7], 1, "version byte");
    assert_eq!(
        crate::Key::from_i64(MIGRATION_LOCK_KEY).pg_locks_ids(),
        (1_145_195_599, 1_129_008_385)
    );
}

#[test]
fn start_up_scripts_with_transaction_control_are_refused() {
    assert!(check_script("CREATE TABLE a (x int); CREATE INDEX i ON a (x);").is_ok());
    let e = check_script("CREATE TABLE a (x int); COMMIT; CREATE TABLE b (y int)")
        .unwrap_err()
        .to_string();
    assert!(e.contains("statement 2 is COMMIT"), "{e}");
}

fn rec(version: i64, checksum: &str) -> Record {
    Record {
        version,
        name: format!("n{version}"),
        checksum: checksum.into(),
        applied_at: "2026-01-01T00:00:00.000Z".into(),
        duration_ms: 5,
        state: RecordState::Done,
    }
}

#[test]
fn plans_apply_what_is_pending_and_refuse_edits_and_unknown_versions() {
    let set = Migrations::from_sources([
        ("1_a.sql", "SELECT 1"),
        ("2_b.sql", "SELECT 2"),
        ("3_c.sql", "SELECT 3"),
    ])
    .unwrap();
    let set = set.checked().unwrap();
    let sum = |v: usize| set[v - 1].checksum().to_string();
    let versions = |p: Vec<&Migration>| p.iter().map(|m| m.version()).collect::<Vec<_>>();
    assert_eq!(versions(plan(set, &[], false).unwrap()), [1, 2, 3]);
    // An out-of-order pending migration (merged late) is applied too.
    let recs = [rec(1, &sum(1)), rec(3, &sum(3))];
    assert_eq!(versions(plan(set, &recs, false).unwrap()), [2]);

    match plan(set, &[rec(1, &sum(1)), rec(2, "beef")], false) {
        Err(Error::MigrationEdited {
            file, version: 2, ..
        }) => assert_eq!(file, "2_b.sql"),
        other => panic!("{other:?}"),
    }
    let recs = [rec(1, &sum(1)), rec(7, "x")];
    match plan(set, &recs, false) {
        Err(Error::UnknownMigrations { missing }) => assert_eq!(missing, ["7 (n7)"]),
        other => panic!("{other:?}"),
    }
    assert_eq!(versions(plan(set, &recs, true).unwrap()), [2, 3]);

    let st = status_of(
        set,
        vec![rec(1, &sum(1)), rec(2, "beef"), rec(7, "x")],
        false,
    );
    let states: Vec<_> = st.entries.iter().map(|e| (e.version, e.state)).collect();
    assert_eq!(
        states,
        [
            (1, State::Applied),
            (2, State::Edited),
            (3, State::Pending),
            (7, State::Unknown)
        ]
    );
    assert!(st.would_refuse());
    assert_eq!(st.count(State::Pending), 1);
    assert_eq!(st.entries[3].name, "n7");
    assert_eq!(st.entries[0].duration, Some(Duration::from_millis(5)));
}

#[test]
fn a_failure_outside_a_transaction_says_which_statement() {
    let set = Migrations::from_sources([
        (
            "dir/0004_idx.sql",
            "-- dblock:no-transaction\nSELECT 1; SELECT 2;",
        ),
        ("dir/0005_cic.sql", "CREATE INDEX CONCURRENTLY i ON t (x)"),
        (
            "dir/0006_cic.sql",
            "-- dblock:no-transaction\ncreate unique index\n concurrently u ON t (x);",
        ),
    ])
    .unwrap();
    let e = failed(
        set.get(4).unwrap(),
        Some((2, 2)),
        Error::Database {
            code: crate::error::ServerCode::sqlstate("42P01"),
            message: "relation \"t\" does not exist".into(),
        },
    );
    assert_eq!(e.sqlstate(), Some("42P01"));
    assert_eq!(
        e.to_string(),
        "migration dir/0004_idx.sql failed at statement 2 of 2 (outside a transaction: \
         statement 1 stays applied): database error 42P01: relation \"t\" does not exist"
    );
    let e = failed(
        set.get(5).unwrap(),
        None,
        Error::Database {
            code: crate::error::ServerCode::sqlstate("25001"),
            message: "CREATE INDEX CONCURRENTLY cannot run inside a transaction block".into(),
        },
    );
    assert!(
        e.to_string()
            .contains("hint: make \"-- dblock:no-transaction\""),
        "{e}"
    );
    // A failed index build outside a transaction leaves an INVALID index: said so, and
    // "no statement before it ran" rather than "none of it was applied".
    let e = failed(
        set.get(6).unwrap(),
        Some((1, 1)),
        Error::Database {
            code: crate::error::ServerCode::sqlstate("23505"),
            message: "could not create unique index \"u\"".into(),
        },
    );
    let text = e.to_string();
    assert!(
        text.contains("(outside a transaction: no statement before it ran)"),
        "{text}"
    );
    assert!(text.contains("may have left an INVALID index"), "{text}");
    // Not said of a statement that builds nothing concurrently.
    let e = failed(
        set.get(4).unwrap(),
        Some((1, 2)),
        Error::Database {
            code: crate::error::ServerCode::sqlstate("42P01"),
            message: "x".into(),
        },
    );
    assert!(!e.to_string().contains("INVALID"), "{e}");
}

#[test]
fn an_interrupted_migration_is_explained_with_what_ran_and_what_to_do() {
    let set = Migrations::from_sources([
        ("m/1_t.sql", "CREATE TABLE t (x int);"),
        (
            "m/2_idx.sql",
            "-- dblock:no-transaction\nCREATE INDEX CONCURRENTLY t_x ON t (x);\n\
             CREATE INDEX CONCURRENTLY t_y ON t (y);\nCREATE INDEX CONCURRENTLY t_z ON t (z);\n",
        ),
    ])
    .unwrap();
    let set = set.checked().unwrap();
    let started = |completed| Record {
        state: RecordState::Started { completed },
        ..rec(2, set[1].checksum())
    };
    let e = interrupted(set, &started(Some(1)), true);
    assert!(
        matches!(
            &e,
            Error::MigrationInterrupted {
                version: 2,
                progress: Some((1, 3)),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.is_bad_migration_set());
    let msg = e.to_string();
    for part in [
        "m/2_idx.sql: was started at 2026-01-01T00:00:00.000Z outside a transaction",
        "Statement 1 of 3 completed; statement 2 (CREATE INDEX CONCURRENTLY t_y ON t (y)) was \
         running, and may have been applied",
        "statement 3 did not run",
        "UPDATE dblock_migrations SET state = 'done' WHERE version = 2",
        "DELETE FROM dblock_migrations WHERE version = 2",
        "docs/migrations.md",
    ] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
    let msg = interrupted(set, &started(Some(0)), true).to_string();
    assert!(
        msg.contains("None of its statements is known to have completed; statement 1"),
        "{msg}"
    );
    assert!(msg.contains("statements 2 to 3 did not run"), "{msg}");
    // Sent whole (MySQL): nothing is known of its progress.
    let e = interrupted(set, &started(None), false);
    assert!(matches!(
        &e,
        Error::MigrationInterrupted { progress: None, .. }
    ));
    assert!(e.to_string().contains("part of it may be applied"), "{e}");
    assert!(e.to_string().contains("docs/mysql.md"), "{e}");
    // In a status: interrupted when nobody holds the lock, being applied when a run does.
    let recs = vec![rec(1, set[0].checksum()), started(Some(1))];
    let st = status_of(set, recs.clone(), false);
    assert_eq!(st.entries[1].state, State::Interrupted);
    assert_eq!(st.entries[1].progress, Some((1, 3)));
    assert!(st.entries[1].no_transaction && !st.entries[0].no_transaction);
    assert_eq!(status_of(set, recs, true).entries[1].state, State::Applying);
}

#[allow(dead_code)]
fn futures_are_send(locks: &Locks, set: &Migrations) {
    fn send<T: Send>(_: T) {}
    send(set.run(locks));
    send(set.runner(locks).on_applied(|_| {}).run());
    send(set.runner(locks).dry_run());
    send(set.runner(locks).status());
    send(set.runner(locks).server_version_num());
    send(set.runner(locks).baseline(None));
    send(set.runner(locks).on_applied(|_| {}).revert(None));
    send(locks.run_script(""));
    #[cfg(feature = "postgres")]
    {
        let pool: Option<sqlx::PgPool> = None;
        if let Some(p) = &pool {
            send(run_script(p, ""));
        }
    }
}
