//! `sqlx.toml` in the current directory, read as sqlx-cli 0.9 reads it: its `[migrate]`
//! section's `table-name` (sqlx's history table, for adoption), `ignored-chars` (what
//! sqlx leaves out of a file's checksum) and `migrations-dir` (the directory when none
//! is given; sqlx-cli's default is `migrations`). Other sections are sqlx's own and
//! not read. As in sqlx, an unknown key of `[migrate]` is an error: a misspelt
//! `table-name` would otherwise leave sqlx's history unseen and every migration it
//! applied to be applied again.

use std::path::{Path, PathBuf};

use dblock::migrate::SqlxConfig;

/// The file sqlx-cli reads, in the current directory.
pub const FILE: &str = "sqlx.toml";

/// sqlx's default directory of migrations.
const DEFAULT_DIR: &str = "migrations";

/// What `sqlx.toml` says, or sqlx's defaults when there is none.
#[derive(Debug, Default)]
pub struct SqlxToml {
    /// How sqlx keeps its history: `None` without a file (the library then accepts
    /// either checksum, as before there was a file to read).
    pub config: Option<SqlxConfig>,
    /// `migrations-dir`, if set.
    pub migrations_dir: Option<PathBuf>,
}

impl SqlxToml {
    /// Reads `sqlx.toml` from the current directory, if it is there.
    pub fn read() -> Result<SqlxToml, dblock::Error> {
        let path = Path::new(FILE);
        match std::fs::read_to_string(path) {
            Ok(text) => parse(&text).map_err(|reason| dblock::Error::InvalidMigration {
                file: FILE.into(),
                reason,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(SqlxToml::default()),
            Err(e) => Err(dblock::Error::InvalidMigration {
                file: FILE.into(),
                reason: format!("cannot read it: {e}"),
            }),
        }
    }

    /// The directory of migrations when none is given: `migrations-dir`, else
    /// `migrations`.
    pub fn dir(&self) -> PathBuf {
        self.migrations_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR))
    }
}

/// The keys of sqlx 0.9's `[migrate]` (`sqlx_core::config::migrate::Config`).
const MIGRATE_KEYS: [&str; 5] = [
    "create-schemas",
    "table-name",
    "migrations-dir",
    "ignored-chars",
    "defaults",
];

fn parse(text: &str) -> Result<SqlxToml, String> {
    let doc: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| format!("not valid TOML: {}", e.message()))?;
    let Some(migrate) = doc.get("migrate") else {
        // A file without [migrate]: sqlx's defaults, the checksum as the file is.
        return Ok(SqlxToml {
            config: Some(SqlxConfig::new().with_ignored_chars([])),
            migrations_dir: None,
        });
    };
    let migrate = migrate.as_table().ok_or("[migrate] must be a table")?;
    if let Some(key) = migrate.keys().find(|k| !MIGRATE_KEYS.contains(&k.as_str())) {
        return Err(format!(
            "unknown key {key:?} in [migrate] (sqlx 0.9 knows {})",
            MIGRATE_KEYS.join(", ")
        ));
    }
    let string = |key: &str| -> Result<Option<String>, String> {
        match migrate.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| format!("[migrate] {key} must be a string")),
        }
    };
    let mut config = SqlxConfig::new().with_ignored_chars(ignored_chars(migrate)?);
    if let Some(name) = string("table-name")? {
        config = config.with_table_name(name);
    }
    Ok(SqlxToml {
        config: Some(config),
        migrations_dir: string("migrations-dir")?.map(PathBuf::from),
    })
}

/// `ignored-chars`: an array of one-character strings (sqlx reads each as a `char`).
fn ignored_chars(migrate: &toml::Table) -> Result<Vec<char>, String> {
    let Some(v) = migrate.get("ignored-chars") else {
        return Ok(Vec::new());
    };
    let bad = || "[migrate] ignored-chars must be an array of one-character strings".to_string();
    let mut out = Vec::new();
    for item in v.as_array().ok_or_else(bad)? {
        let s = item.as_str().ok_or_else(bad)?;
        let mut chars = s.chars();
        match (chars.next(), chars.next()) {
            (Some(c), None) => out.push(c),
            _ => return Err(format!("{}: {s:?} is not one character", bad())),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlx_tomls_migrate_section_is_read_as_sqlx_reads_it() {
        // sqlx-core 0.9's reference file, [migrate] as it ships.
        let t = parse(
            r#"
[common]
database-url-var = "FOO_DATABASE_URL"

[migrate]
table-name = "foo._sqlx_migrations"
migrations-dir = "foo/migrations"
ignored-chars = [" ", "\t", "\r", "\n", "\uFEFF"]

[migrate.defaults]
migration-type = "reversible"
migration-versioning = "sequential"
"#,
        )
        .unwrap();
        let c = t.config.unwrap();
        assert_eq!(c.table_name.as_deref(), Some("foo._sqlx_migrations"));
        assert_eq!(
            c.ignored_chars.unwrap().into_iter().collect::<String>(),
            "\t\n\r \u{feff}"
        );
        assert_eq!(t.migrations_dir, Some(PathBuf::from("foo/migrations")));

        // No [migrate]: sqlx's defaults, with the checksum of the file as it is.
        let t = parse("[common]\n").unwrap();
        assert_eq!(t.dir(), PathBuf::from("migrations"));
        assert_eq!(t.config.unwrap().ignored_chars, Some(Default::default()));

        for (bad, says) in [
            (
                "[migrate]\ntable_name = \"x\"\n",
                "unknown key \"table_name\"",
            ),
            (
                "[migrate]\nignored-chars = [\"ab\"]\n",
                "is not one character",
            ),
            ("[migrate]\nignored-chars = \"\\r\"\n", "must be an array"),
            ("[migrate]\ntable-name = 3\n", "must be a string"),
            ("[migrate\n", "not valid TOML"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
