//! Every migration file layout dblock reads — dblock's and sqlx-cli's `VERSION_NAME.sql`,
//! sqlx-cli's reversible pairs and golang-migrate's `VERSION_NAME.up.sql`/`.down.sql`,
//! refinery's and Flyway's `VVERSION__NAME.sql` — generated with a known meaning, as file
//! names and as real directories: each reads as what it says. diesel's
//! directory-per-migration layout, which dblock does not read, is refused, never read as
//! an empty set. Any file name at all is a migration or a one-line reason, and any file
//! contents are read back byte for byte or refused.

use std::path::Path;

use dblock::Error;
use dblock::migrate::{Layout, Migrations};
use dblock::parsers::{MigrationFileName, migration_file_name};
use dblock_parser_checks as checks;
use proptest::prelude::*;

/// A file name as a layout writes it, and its meaning.
fn file_name() -> impl Strategy<Value = (String, MigrationFileName)> {
    (
        0u8..4,
        prop_oneof![
            0i64..100_000,
            19_700_101_000_000i64..29_991_231_235_959,
            Just(i64::MAX)
        ],
        0usize..6,
        "[A-Za-z0-9_-]{1,30}",
    )
        .prop_map(|(kind, version, pad, name)| {
            let width = version.to_string().len() + pad;
            let v = format!("{version:0width$}");
            let (file, layout, down) = match kind {
                0 => (format!("{v}_{name}.sql"), Layout::Plain, false),
                1 => (format!("{v}_{name}.up.sql"), Layout::Reversible, false),
                2 => (format!("{v}_{name}.down.sql"), Layout::Reversible, true),
                _ => (format!("V{v}__{name}.sql"), Layout::Flyway, false),
            };
            (
                file,
                MigrationFileName {
                    version,
                    name,
                    down,
                    layout,
                    width,
                },
            )
        })
    // `1_x.up.sql` is a pair's file, never a plain migration named `x.up`, and a
    // plain name cannot end in `.up`/`.down` (a dot is not a name character), so
    // every generated name has exactly one reading — except a Flyway name, which may
    // itself hold `__`: `V1__a__b.sql` is version 1, name `a__b`.
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Each generated file name reads as what it says.
    #[test]
    fn each_layouts_file_names_read_as_what_they_say((file, want) in file_name()) {
        let got = migration_file_name(&file).map_err(|e| TestCaseError::fail(format!("{file}: {e}")))?;
        prop_assert_eq!(got, want, "{}", file);
        checks::migration_file_name(&file);
    }

    /// Any text as a file name: a migration that reads back as itself, or a one-line
    /// reason.
    #[test]
    fn any_file_name_is_a_migration_or_a_one_line_reason(
        file in prop_oneof![
            "\\PC{0,30}",
            "[VRU]?[0-9]{0,21}[_.]{0,3}[a-zA-Z0-9_.é -]{0,12}(\\.(up|down|UP))?\\.(sql|SQL)",
        ]
    ) {
        checks::migration_file_name(&file);
    }
}

/// A directory of migrations in one layout: versions, names and the files written.
fn directory() -> impl Strategy<Value = (Layout, Vec<(i64, String)>)> {
    (
        prop_oneof![
            Just(Layout::Plain),
            Just(Layout::Reversible),
            Just(Layout::Flyway)
        ],
        prop::collection::btree_map(
            prop_oneof![1i64..10_000, 20_000_101_000_000i64..20_991_231_235_959],
            "[a-z][a-z0-9_]{0,15}",
            1..12,
        ),
    )
        .prop_map(|(l, m)| (l, m.into_iter().collect()))
}

fn write(dir: &Path, layout: Layout, migrations: &[(i64, String)], width: usize) -> Vec<String> {
    let mut written = Vec::new();
    for (v, name) in migrations {
        let v = format!("{v:0width$}");
        let files = match layout {
            Layout::Plain => vec![format!("{v}_{name}.sql")],
            Layout::Reversible => {
                vec![format!("{v}_{name}.up.sql"), format!("{v}_{name}.down.sql")]
            }
            _ => vec![format!("V{v}__{name}.sql")],
        };
        for f in files {
            let sql = format!("-- {f}\nCREATE TABLE \"{name}\" (id int);\n");
            std::fs::write(dir.join(&f), sql).unwrap_or_else(|e| panic!("{f}: {e}"));
            written.push(f);
        }
    }
    written
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// A directory written in sqlx-cli's, golang-migrate's or Flyway's layout reads as
    /// its migrations, in version order, with their layout and (for pairs) their reverts.
    #[test]
    fn a_directory_in_each_layout_reads_as_its_migrations(
        (layout, migrations) in directory(),
        width in prop_oneof![Just(4usize), Just(6), Just(14)],
    ) {
        let tmp = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        write(tmp.path(), layout, &migrations, width);
        let set = Migrations::from_dir(tmp.path()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let got: Vec<(i64, String)> = set.iter().map(|m| (m.version(), m.name().to_string())).collect();
        prop_assert_eq!(&got, &migrations);
        for m in set.iter() {
            prop_assert_eq!(m.layout(), layout);
            prop_assert_eq!(m.down_file().is_some(), layout == Layout::Reversible);
            if let Some(down) = m.down_sql() {
                prop_assert!(down.contains(".down.sql"), "{}", down);
            }
        }
        // The next file `dblock migrate new` writes follows the directory's own layout.
        let next = set.new_file_names("next one").map_err(|e| TestCaseError::fail(e.to_string()))?;
        for f in &next {
            let parsed = migration_file_name(f).map_err(|e| TestCaseError::fail(format!("{f}: {e}")))?;
            prop_assert_eq!(parsed.layout, layout, "{}", f);
            prop_assert!(parsed.version > migrations.last().map_or(0, |m| m.0), "{}", f);
        }
    }

    /// diesel's layout (`YYYY-MM-DD-HHMMSS_name/up.sql` and `down.sql`) is refused with an
    /// error naming a migration directory, never read as a set with nothing to apply.
    #[test]
    fn a_diesel_directory_is_refused_not_read_as_empty(
        names in prop::collection::btree_set("[a-z][a-z0-9_]{0,12}", 1..5),
        with_down in any::<bool>(),
    ) {
        let tmp = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (i, name) in names.iter().enumerate() {
            let dir = tmp.path().join(format!("2024-01-0{}-093000_{name}", i + 1));
            std::fs::create_dir(&dir).map_err(|e| TestCaseError::fail(e.to_string()))?;
            std::fs::write(dir.join("up.sql"), "CREATE TABLE t (id int);")
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            if with_down {
                std::fs::write(dir.join("down.sql"), "DROP TABLE t;")
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        match Migrations::from_dir(tmp.path()) {
            Err(Error::InvalidMigration { file, reason }) => {
                prop_assert!(file.contains("2024-01-0"), "{}", file);
                prop_assert!(reason.contains("diesel"), "{}", reason);
                prop_assert!(!reason.contains('\n'), "{}", reason);
            }
            other => prop_assert!(false, "a diesel directory gave {:?}", other.map(|s| s.len())),
        }
    }

    /// Any file contents: UTF-8 is read back byte for byte; anything else is refused
    /// with a one-line error naming the file.
    #[test]
    fn any_file_contents_are_read_whole_or_refused(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let tmp = tempfile::tempdir().map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Kept clear of transaction control and headers, which have rules of their own.
        let bytes: Vec<u8> = bytes.into_iter().map(|b| if b.is_ascii_alphabetic() { b'x' } else { b }).collect();
        std::fs::write(tmp.path().join("0001_x.sql"), &bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        match (Migrations::from_dir(tmp.path()), std::str::from_utf8(&bytes)) {
            (Ok(set), Ok(text)) => {
                let m = set.iter().next().ok_or_else(|| TestCaseError::fail("no migration"))?;
                prop_assert_eq!(m.sql(), text);
            }
            (Err(Error::InvalidMigration { file, reason }), Err(_)) => {
                prop_assert!(file.ends_with("0001_x.sql"), "{}", file);
                prop_assert!(reason.contains("UTF-8") && !reason.contains('\n'), "{}", reason);
            }
            (got, utf8) => prop_assert!(false, "{:?} (UTF-8: {})", got.map(|s| s.len()), utf8.is_ok()),
        }
    }
}
