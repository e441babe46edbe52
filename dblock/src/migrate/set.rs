//! A migration set: files named by the rule, read from a directory or embedded.

use std::borrow::Cow;
use std::fmt;
use std::path::Path;

use sha2::{Digest, Sha256};

use super::split;
use crate::Error;

/// The header line (the file's first line) of a migration that must run outside a
/// transaction, such as `CREATE INDEX CONCURRENTLY`.
pub const NO_TRANSACTION_HEADER: &str = "-- dblock:no-transaction";

/// One migration: a version, a name, and the SQL that applies it.
///
/// Built by [`Migrations::from_dir`], [`Migrations::from_sources`] or
/// [`migrations!`](crate::migrations).
#[derive(Clone)]
pub struct Migration {
    version: i64,
    name: String,
    file: String,
    sql: Cow<'static, str>,
    checksum: String,
    no_transaction: bool,
}

impl fmt::Debug for Migration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Migration")
            .field("version", &self.version)
            .field("name", &self.name)
            .field("file", &self.file)
            .field("checksum", &self.checksum)
            .field("no_transaction", &self.no_transaction)
            .finish_non_exhaustive()
    }
}

impl Migration {
    /// The version: the number before the first `_` of the file name.
    pub fn version(&self) -> i64 {
        self.version
    }

    /// The name: the part of the file name between the first `_` and `.sql`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the migration came from, as errors name it: the file's path for a
    /// directory, the path given to [`migrations!`](crate::migrations) for an embedded
    /// set.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The file name alone, `VERSION_NAME.sql`.
    pub fn file_name(&self) -> &str {
        file_name_of(&self.file)
    }

    /// The SQL, exactly as in the file.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The SHA-256 of the file's bytes, in lowercase hex: what the bookkeeping table
    /// records, and compares on every run.
    pub fn checksum(&self) -> &str {
        &self.checksum
    }

    /// Whether the first line is [`NO_TRANSACTION_HEADER`]: the migration then runs
    /// statement by statement outside a transaction.
    pub fn no_transaction(&self) -> bool {
        self.no_transaction
    }

    /// The statements of a no-transaction migration, as they are sent one by one.
    pub(crate) fn statements(&self) -> Vec<&str> {
        split::split(&self.sql)
    }

    fn parse(file: String, sql: Cow<'static, str>) -> Result<Migration, Error> {
        let (version, name) = match parse_file_name(file_name_of(&file)) {
            Ok(v) => v,
            Err(reason) => return Err(invalid(&file, reason)),
        };
        let no_transaction = header(&sql).map_err(|reason| invalid(&file, reason))?;
        if !no_transaction {
            for (i, stmt) in split::split(&sql).iter().enumerate() {
                if let Some(word) = split::transaction_control(stmt) {
                    return Err(invalid(
                        &file,
                        format!(
                            "statement {} is {word}: a migration runs in a transaction of its \
                             own, all or nothing, and transaction control would break that; \
                             remove it, or make {NO_TRANSACTION_HEADER:?} the first line",
                            i + 1
                        ),
                    ));
                }
            }
        }
        let checksum = hex(&Sha256::digest(sql.as_bytes()));
        Ok(Migration {
            version,
            name: name.to_string(),
            file,
            sql,
            checksum,
            no_transaction,
        })
    }
}

/// An ordered set of migrations, by ascending version.
///
/// # The file name rule
///
/// A migration file is named `VERSION_NAME.sql`:
///
/// - `VERSION`: one or more ASCII digits, leading zeros allowed (`0001`), at most
///   2^63 − 1. Migrations apply in numeric order; two files with the same number
///   (`1_a.sql`, `0001_b.sql`) are an error.
/// - one `_`, then `NAME`: one or more ASCII letters, digits, `_` or `-`.
/// - the extension `.sql`, in lowercase.
///
/// In a directory, files not ending in `.sql` (in any case), names starting with `.`,
/// and subdirectories are ignored; a `.sql` file whose name breaks the rule is an error,
/// never skipped. The contents must be UTF-8. The checksum is the SHA-256 of the file's
/// bytes, so a change of line endings (a `core.autocrlf` checkout) is an edit.
///
/// # The header line
///
/// A migration whose first line is exactly [`NO_TRANSACTION_HEADER`]
/// (`-- dblock:no-transaction`, trailing whitespace allowed) runs outside a transaction;
/// see [`migrate`](crate::migrate#migrations-outside-a-transaction). Any other first
/// line starting `-- dblock:`, and a `-- dblock:` line anywhere else, is an error (a
/// misspelt header would otherwise run the file in a transaction).
///
/// A migration without the header must not contain transaction control (`BEGIN`,
/// `COMMIT`, `ROLLBACK`, `END`, `START TRANSACTION`…): it already runs in a transaction
/// of its own, with its bookkeeping row.
#[derive(Clone, Debug, Default)]
pub struct Migrations {
    list: Vec<Migration>,
    /// A problem found in an embedded set, reported when the set is used.
    problem: Option<Problem>,
}

/// A problem of an embedded set, kept to be reported as an [`Error`] on use.
#[derive(Clone, Debug)]
enum Problem {
    Invalid {
        file: String,
        reason: String,
    },
    Duplicate {
        version: i64,
        first: String,
        second: String,
    },
}

impl Problem {
    fn into_error(self) -> Error {
        match self {
            Problem::Invalid { file, reason } => Error::InvalidMigration { file, reason },
            Problem::Duplicate {
                version,
                first,
                second,
            } => Error::DuplicateMigration {
                version,
                first,
                second,
            },
        }
    }

    fn from_error(e: Error) -> Problem {
        match e {
            Error::DuplicateMigration {
                version,
                first,
                second,
            } => Problem::Duplicate {
                version,
                first,
                second,
            },
            Error::InvalidMigration { file, reason } => Problem::Invalid { file, reason },
            other => Problem::Invalid {
                file: String::new(),
                reason: other.to_string(),
            },
        }
    }
}

impl Migrations {
    /// The migrations in directory `dir`, named by [the rule](Migrations#the-file-name-rule).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidMigration`] naming the file (or the directory, when it cannot be
    /// read) for a malformed name, contents that are not UTF-8 or a bad header;
    /// [`Error::DuplicateMigration`] naming both files of a repeated version.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Migrations, Error> {
        let dir = dir.as_ref();
        let cannot = |e: std::io::Error| Error::InvalidMigration {
            file: dir.display().to_string(),
            reason: format!("cannot read the migrations directory: {e}"),
        };
        let mut sources = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(cannot)? {
            let entry = entry.map_err(cannot)?;
            let path = entry.path();
            let shown = path.display().to_string();
            let lossy = entry.file_name().to_string_lossy().into_owned();
            if lossy.starts_with('.') || !lossy.to_ascii_lowercase().ends_with(".sql") {
                continue;
            }
            // Follows symbolic links: a linked file is a migration, a directory is not.
            let meta = std::fs::metadata(&path).map_err(|e| Error::InvalidMigration {
                file: shown.clone(),
                reason: format!("cannot read: {e}"),
            })?;
            if meta.is_dir() {
                continue;
            }
            if entry.file_name().to_str().is_none() {
                return Err(invalid(&shown, "the file name is not UTF-8".into()));
            }
            let bytes = std::fs::read(&path).map_err(|e| Error::InvalidMigration {
                file: shown.clone(),
                reason: format!("cannot read: {e}"),
            })?;
            let sql = String::from_utf8(bytes)
                .map_err(|e| invalid(&shown, format!("the contents are not UTF-8 ({e})")))?;
            sources.push((shown, Cow::Owned(sql)));
        }
        Migrations::build(sources)
    }

    /// A set from `(file, sql)` pairs: `file` is a file name following [the
    /// rule](Migrations#the-file-name-rule), or a path ending in one.
    ///
    /// ```
    /// let set = dblock::migrate::Migrations::from_sources([
    ///     ("0002_add_email.sql", "ALTER TABLE users ADD COLUMN email text;"),
    ///     ("0001_create_users.sql", "CREATE TABLE users (id bigint PRIMARY KEY);"),
    /// ])?;
    /// assert_eq!(set.iter().map(|m| m.version()).collect::<Vec<_>>(), [1, 2]);
    /// # Ok::<(), dblock::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Migrations::from_dir`].
    pub fn from_sources<F, S>(
        sources: impl IntoIterator<Item = (F, S)>,
    ) -> Result<Migrations, Error>
    where
        F: Into<String>,
        S: Into<Cow<'static, str>>,
    {
        Migrations::build(
            sources
                .into_iter()
                .map(|(f, s)| (f.into(), s.into()))
                .collect(),
        )
    }

    /// What [`migrations!`](crate::migrations) expands to. A problem the macro did not
    /// catch at compile time is kept and reported by the first use of the set.
    #[doc(hidden)]
    pub fn __embedded(files: &'static [(&'static str, &'static str)]) -> Migrations {
        let sources = files
            .iter()
            .map(|&(f, s)| (f.to_string(), Cow::Borrowed(s)))
            .collect();
        match Migrations::build(sources) {
            Ok(set) => set,
            Err(e) => Migrations {
                list: Vec::new(),
                problem: Some(Problem::from_error(e)),
            },
        }
    }

    fn build(sources: Vec<(String, Cow<'static, str>)>) -> Result<Migrations, Error> {
        let mut list = sources
            .into_iter()
            .map(|(file, sql)| Migration::parse(file, sql))
            .collect::<Result<Vec<_>, _>>()?;
        // Ties broken by file, so the error names the same pair on every platform.
        list.sort_by(|a, b| (a.version, &a.file).cmp(&(b.version, &b.file)));
        if let Some(w) = list.windows(2).find(|w| w[0].version == w[1].version) {
            return Err(Error::DuplicateMigration {
                version: w[0].version,
                first: w[0].file.clone(),
                second: w[1].file.clone(),
            });
        }
        Ok(Migrations {
            list,
            problem: None,
        })
    }

    /// The set itself, or the problem an embedded set was built with.
    pub(crate) fn checked(&self) -> Result<&[Migration], Error> {
        match &self.problem {
            Some(p) => Err(p.clone().into_error()),
            None => Ok(&self.list),
        }
    }

    /// The migrations, by ascending version.
    pub fn iter(&self) -> std::slice::Iter<'_, Migration> {
        self.list.iter()
    }

    /// How many migrations the set has.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether the set has none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The migration with this version.
    pub fn get(&self, version: i64) -> Option<&Migration> {
        self.list
            .binary_search_by_key(&version, |m| m.version)
            .ok()
            .and_then(|i| self.list.get(i))
    }
}

impl<'a> IntoIterator for &'a Migrations {
    type Item = &'a Migration;
    type IntoIter = std::slice::Iter<'a, Migration>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

fn invalid(file: &str, reason: String) -> Error {
    Error::InvalidMigration {
        file: file.to_string(),
        reason,
    }
}

/// The last component of a path (both separators accepted, for embedded paths).
fn file_name_of(file: &str) -> &str {
    file.rsplit(['/', '\\']).next().unwrap_or(file)
}

/// `(version, name)` of a file name following the rule, or what is wrong with it.
pub(crate) fn parse_file_name(file_name: &str) -> Result<(i64, &str), String> {
    const RULE: &str = "expected VERSION_NAME.sql: digits, one underscore, then letters, \
                        digits, _ or - (e.g. 0001_create_users.sql)";
    let Some(stem) = file_name.strip_suffix(".sql") else {
        return Err(format!("the extension must be .sql in lowercase; {RULE}"));
    };
    let digits = stem.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(format!(
            "the name does not start with a version number; {RULE}"
        ));
    }
    let (number, rest) = stem.split_at(digits);
    let Some(name) = rest.strip_prefix('_') else {
        return Err(format!("no underscore after the version number; {RULE}"));
    };
    if name.is_empty() {
        return Err(format!("nothing after the underscore; {RULE}"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(format!("{c:?} is not allowed in the name; {RULE}"));
    }
    let version = number
        .parse::<i64>()
        .map_err(|_| format!("the version {number} is larger than 2^63 - 1"))?;
    Ok((version, name))
}

/// Whether `sql` starts with the no-transaction header; an error for a misspelt or
/// misplaced `-- dblock:` directive.
fn header(sql: &str) -> Result<bool, String> {
    let sql = sql.strip_prefix('\u{feff}').unwrap_or(sql);
    let mut no_transaction = false;
    for (i, line) in sql.lines().enumerate() {
        let squeezed: String = line
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect::<String>()
            .to_ascii_lowercase();
        if !squeezed.starts_with("--dblock:") {
            continue;
        }
        if i > 0 {
            return Err(format!(
                "line {}: a -- dblock: header belongs on the first line",
                i + 1
            ));
        }
        if line.trim_end() != NO_TRANSACTION_HEADER {
            return Err(format!(
                "unknown header {:?}: the only one is {NO_TRANSACTION_HEADER:?}",
                line.trim_end()
            ));
        }
        no_transaction = true;
    }
    Ok(no_transaction)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for bad in [
            "create_users.sql",
            "0001-create.sql",
            "0001_.sql",
            "0001.sql",
            "0001_create users.sql",
            "0001_create.up.sql",
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
    fn the_header_marks_no_transaction_migrations() {
        assert_eq!(header("-- dblock:no-transaction\nCREATE INDEX …"), Ok(true));
        assert_eq!(header("-- dblock:no-transaction  \r\nX"), Ok(true));
        assert_eq!(header("\u{feff}-- dblock:no-transaction\nX"), Ok(true));
        assert_eq!(header("-- just a comment\nX"), Ok(false));
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
            Migrations::from_sources([("1_a.sql", "-- dblock:no-transaction\nBEGIN; COMMIT;")])
                .is_ok()
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
}
