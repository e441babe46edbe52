//! Unit tests of migration sets: file names, checksums, statements.

use super::*;

fn parse_file_name(f: &str) -> Result<(i64, &str), String> {
    layout::parse(f).map(|p| (p.version, p.name))
}

#[test]
fn file_names_follow_the_rule() {
    assert_eq!(
        parse_file_name("0001_create_users.sql"),
        Ok((1, "create_users"))
    );
    assert_eq!(
        parse_file_name("20240101_add-x_2.sql"),
        Ok((20240101, "add-x_2"))
    );
    assert_eq!(parse_file_name("0_x.sql"), Ok((0, "x")));
    assert_eq!(
        parse_file_name("9223372036854775807_max.sql"),
        Ok((i64::MAX, "max"))
    );
    assert_eq!(parse_file_name("0001_create.up.sql"), Ok((1, "create")));
    for bad in [
        "create_users.sql",
        "0001-create.sql",
        "0001_.sql",
        "0001.sql",
        "0001_create users.sql",
        "0001_create.SQL",
        "0001_create.sql.bak",
        "9223372036854775808_too_big.sql",
        "_0001_x.sql",
        "0001_ünï.sql",
    ] {
        assert!(parse_file_name(bad).is_err(), "{bad}");
    }
}

#[test]
fn sqlx_sets_are_read_unchanged_with_their_pairs_and_marker() {
    let set = Migrations::from_sources([
        ("m/20240101000000_init.sql", "CREATE TABLE a (x int);"),
        ("m/20240102000000_users.up.sql", "CREATE TABLE u (x int);"),
        ("m/20240102000000_users.down.sql", "DROP TABLE u;"),
        (
            "m/20240103000000_idx.up.sql",
            "-- no-transaction\nCREATE INDEX CONCURRENTLY i ON u (x);",
        ),
        (
            "m/20240103000000_idx.down.sql",
            "-- no-transaction\nDROP INDEX CONCURRENTLY i;",
        ),
    ])
    .unwrap();
    assert_eq!(set.len(), 3, "a pair is one migration");
    let users = set.get(20240102000000).unwrap();
    assert_eq!(users.file_name(), "20240102000000_users.up.sql");
    assert_eq!(users.name(), "users");
    assert_eq!(users.down_sql(), Some("DROP TABLE u;"));
    assert_eq!(users.down_file(), Some("m/20240102000000_users.down.sql"));
    assert!(!users.no_transaction());
    let idx = set.get(20240103000000).unwrap();
    assert!(idx.no_transaction() && idx.down_no_transaction());
    assert!(idx.transaction_hazards(None).is_empty());
    assert!(set.get(20240101000000).unwrap().down_sql().is_none());
    // sqlx's checksum: SHA-384 of the SQL.
    assert_eq!(
        users.sqlx_checksum(),
        hex(&Sha384::digest(b"CREATE TABLE u (x int);"))
    );
    let e = Migrations::from_sources([("1_a.sql", ""), ("2_b.down.sql", "")])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("2_b.down.sql: a .down.sql without its migration"),
        "{e}"
    );
    assert!(matches!(
        Migrations::from_sources([("1_a.up.sql", ""), ("1_a.sql", "")]),
        Err(Error::DuplicateMigration { version: 1, .. })
    ));
    assert!(matches!(
        Migrations::from_sources([
            ("1_a.up.sql", ""),
            ("1_a.down.sql", ""),
            ("1_b.down.sql", "")
        ]),
        Err(Error::DuplicateMigration { version: 1, .. })
    ));
    let f =
        Migrations::from_sources([("V2__b.sql", "SELECT 2"), ("V10__c.sql", "SELECT 3")]).unwrap();
    assert_eq!(f.iter().map(|m| m.version()).collect::<Vec<_>>(), [2, 10]);
}

#[test]
fn the_header_marks_no_transaction_migrations() {
    assert_eq!(header("-- dblock:no-transaction\nCREATE INDEX …"), Ok(true));
    assert_eq!(header("-- dblock:no-transaction  \r\nX"), Ok(true));
    assert_eq!(header("\u{feff}-- dblock:no-transaction\nX"), Ok(true));
    assert_eq!(header("-- just a comment\nX"), Ok(false));
    // sqlx's marker, as sqlx reads it: the first bytes of the file.
    assert_eq!(header("-- no-transaction\nCREATE INDEX …"), Ok(true));
    assert_eq!(header("-- no-transaction\r\nX"), Ok(true));
    assert_eq!(header("\n-- no-transaction\nX"), Ok(false));
    assert_eq!(header("--no-transaction\nX"), Ok(false));
    assert_eq!(header(""), Ok(false));
    assert!(header("-- dblock:no-transactions\nX").is_err(), "misspelt");
    assert!(header("--dblock:no-transaction\nX").is_err(), "not exact");
    assert!(header("-- DBLOCK:NO-TRANSACTION\nX").is_err(), "not exact");
    assert!(
        header("-- about\n-- dblock:no-transaction\nX").is_err(),
        "misplaced"
    );
}

#[test]
fn sets_are_ordered_and_reject_duplicates_and_bad_files() {
    let set = Migrations::from_sources([
        ("dir/10_c.sql", "SELECT 3;"),
        ("dir/2_b.sql", "SELECT 2;"),
        ("dir/0001_a.sql", "-- dblock:no-transaction\nSELECT 1;"),
    ])
    .unwrap();
    let order: Vec<_> = set.iter().map(|m| (m.version(), m.name())).collect();
    assert_eq!(order, [(1, "a"), (2, "b"), (10, "c")]);
    assert!(set.get(1).unwrap().no_transaction());
    assert_eq!(set.get(2).unwrap().file_name(), "2_b.sql");
    assert_eq!(set.get(2).unwrap().file(), "dir/2_b.sql");
    assert!(set.get(3).is_none());
    assert_eq!(
        set.get(2).unwrap().checksum(),
        // sha256("SELECT 2;")
        hex(&Sha256::digest(b"SELECT 2;"))
    );

    match Migrations::from_sources([("0001_a.sql", ""), ("1_b.sql", "")]) {
        Err(Error::DuplicateMigration {
            version: 1,
            first,
            second,
        }) => assert_eq!((first.as_str(), second.as_str()), ("0001_a.sql", "1_b.sql")),
        other => panic!("{other:?}"),
    }
    match Migrations::from_sources([("0001_a.sql", ""), ("x.sql", "")]) {
        Err(Error::InvalidMigration { file, .. }) => assert_eq!(file, "x.sql"),
        other => panic!("{other:?}"),
    }
    let e = Migrations::from_sources([("1_a.sql", "CREATE TABLE a (x int);\nCOMMIT;")])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("1_a.sql: statement 2 is COMMIT"), "{e}");
    // Outside a transaction, the file may control its own.
    assert!(
        Migrations::from_sources([("1_a.sql", "-- dblock:no-transaction\nBEGIN; COMMIT;")]).is_ok()
    );
}

#[test]
fn an_embedded_set_with_a_problem_reports_it_on_use() {
    static FILES: &[(&str, &str)] = &[("migrations/1_a.sql", ""), ("migrations/1_b.sql", "")];
    let set = Migrations::__embedded(FILES);
    assert!(matches!(
        set.checked(),
        Err(Error::DuplicateMigration { version: 1, .. })
    ));
    static GOOD: &[(&str, &str)] = &[("migrations/1_a.sql", "SELECT 1")];
    assert_eq!(Migrations::__embedded(GOOD).checked().unwrap().len(), 1);
}
