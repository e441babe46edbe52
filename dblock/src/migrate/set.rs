//! A migration set: files named by the rule, read from a directory or embedded.

use std::borrow::Cow;
use std::fmt;
use std::path::Path;

use sha2::{Digest, Sha256, Sha384};

use super::layout::{self, Kind, Layout};
use super::{files, lint, split};
use crate::Error;

/// The header line (the file's first line) of a migration that must run outside a
/// transaction, such as `CREATE INDEX CONCURRENTLY`.
pub const NO_TRANSACTION_HEADER: &str = "-- dblock:no-transaction";

/// sqlx's marker of a migration that runs outside a transaction: a file whose first
/// bytes are these (so `-- no-transaction` as its first line) is one, as for sqlx.
pub const SQLX_NO_TRANSACTION: &str = "-- no-transaction";

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
    sqlx_checksum: String,
    no_transaction: bool,
    layout: Layout,
    width: usize,
    down: Option<Down>,
}

/// The `.down.sql` of a reversible pair.
#[derive(Clone)]
struct Down {
    file: String,
    sql: Cow<'static, str>,
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
            .field("down", &self.down.as_ref().map(|d| &d.file))
            .finish_non_exhaustive()
    }
}

impl Migration {
    /// The version: the number before the first `_` of the file name.
    pub fn version(&self) -> i64 {
        self.version
    }

    /// The name: the part of the file name between the version's `_` (`__` for
    /// `V1__name.sql`) and `.sql` (`.up.sql`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the migration came from, as errors name it: the file's path for a
    /// directory, the path given to [`migrations!`](crate::migrations) for an embedded
    /// set.
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The file name alone, `VERSION_NAME.sql` (or `VERSION_NAME.up.sql`,
    /// `VVERSION__NAME.sql`).
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

    /// Whether the first line is [`NO_TRANSACTION_HEADER`] or sqlx's
    /// [`SQLX_NO_TRANSACTION`]: the migration then runs statement by statement outside a
    /// transaction.
    pub fn no_transaction(&self) -> bool {
        self.no_transaction
    }

    /// The SHA-384 of the file's SQL in lowercase hex: the checksum sqlx records in
    /// `_sqlx_migrations`, compared when dblock adopts sqlx's history.
    pub fn sqlx_checksum(&self) -> &str {
        &self.sqlx_checksum
    }

    /// The naming layout of its file.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The file of its `.down.sql`, for a reversible pair.
    pub fn down_file(&self) -> Option<&str> {
        self.down.as_ref().map(|d| d.file.as_str())
    }

    /// The SQL of its `.down.sql`, for a reversible pair: what `revert` runs.
    pub fn down_sql(&self) -> Option<&str> {
        self.down.as_ref().map(|d| &*d.sql)
    }

    /// Whether its `.down.sql` runs outside a transaction (its own header).
    pub fn down_no_transaction(&self) -> bool {
        self.down.as_ref().is_some_and(|d| d.no_transaction)
    }

    /// The statements that cannot run inside a transaction, for a migration that would
    /// run in one (none if it has a no-transaction header). `server_version_num`, when
    /// known, leaves out those that server allows (`ALTER TYPE … ADD VALUE` from 12).
    pub fn transaction_hazards(&self, server_version_num: Option<u32>) -> Vec<lint::Hazard> {
        if self.no_transaction {
            return Vec::new();
        }
        lint::hazards(&self.sql, server_version_num)
    }

    /// The statements of a no-transaction migration, as they are sent one by one.
    pub(crate) fn statements(&self) -> Vec<&str> {
        split::split(&self.sql)
    }

    fn parse(file: String, sql: Cow<'static, str>) -> Result<Migration, Error> {
        let parsed = match layout::parse(file_name_of(&file)) {
            Ok(v) => v,
            Err(reason) => return Err(invalid(&file, reason)),
        };
        let no_transaction = checked_sql(&file, &sql)?;
        let checksum = hex(&Sha256::digest(sql.as_bytes()));
        let sqlx_checksum = hex(&Sha384::digest(sql.as_bytes()));
        let (version, name, layout, width) = (
            parsed.version,
            parsed.name.to_string(),
            parsed.layout,
            parsed.width,
        );
        Ok(Migration {
            version,
            name,
            file,
            sql,
            checksum,
            sqlx_checksum,
            no_transaction,
            layout,
            width,
            down: None,
        })
    }
}

/// Whether `sql` runs outside a transaction; an error for a bad header, or for
/// transaction control in SQL that runs in one.
fn checked_sql(file: &str, sql: &str) -> Result<bool, Error> {
    let no_transaction = header(sql).map_err(|reason| invalid(file, reason))?;
    if !no_transaction {
        for (i, stmt) in split::split(sql).iter().enumerate() {
            if let Some(word) = split::transaction_control(stmt) {
                return Err(invalid(
                    file,
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
    Ok(no_transaction)
}

/// An ordered set of migrations, by ascending version.
///
/// # The file name rule
///
/// A migration file is named `VERSION_NAME.sql` (dblock's and sqlx-cli's layout):
///
/// - `VERSION`: one or more ASCII digits, leading zeros allowed (`0001`), at most
///   2^63 − 1, so timestamps (`20240101093000`) too. Migrations apply in numeric order;
///   two files with the same number (`1_a.sql`, `0001_b.sql`) are an error.
/// - one `_`, then `NAME`: one or more ASCII letters, digits, `_` or `-`.
/// - the extension `.sql`, in lowercase.
///
/// Two other layouts are read as they are:
///
/// - reversible pairs, `VERSION_NAME.up.sql` and `VERSION_NAME.down.sql` (sqlx-cli's
///   `--reversible`, golang-migrate): the `.up.sql` is the migration; the `.down.sql`
///   is kept with it ([`Migration::down_sql`]) and run only by a revert
///   (`dblock migrate revert`). A `.down.sql` without its `.up.sql` is an error.
/// - refinery's and Flyway's `VVERSION__NAME.sql` (`V3__add_email.sql`), with a whole
///   number as the version. Dotted versions (`V1.1__`), repeatable (`R__`) and undo
///   (`U…__`) migrations are refused with an error saying so.
///
/// In a directory, files not ending in `.sql` (in any case), names starting with `.`,
/// and subdirectories are ignored, except a subdirectory holding `up.sql` (diesel's
/// layout, which is refused); a `.sql` file whose name breaks the rule is an error,
/// never skipped. Only regular files (or symbolic links to them) of at most
/// [`MAX_FILE_BYTES`](super::MAX_FILE_BYTES) are read: a FIFO, a device, a socket or a
/// larger file named like a migration is refused with an error naming it, never opened
/// for reading (a FIFO would wait for a writer forever). The contents must be UTF-8.
/// The checksum is the SHA-256 of the file's bytes, so a change of line endings (a
/// `core.autocrlf` checkout) is an edit.
///
/// # The header line
///
/// A migration whose first line is exactly [`NO_TRANSACTION_HEADER`]
/// (`-- dblock:no-transaction`, trailing whitespace allowed), or whose first bytes are
/// sqlx's [`SQLX_NO_TRANSACTION`] (`-- no-transaction`), runs outside a transaction;
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
            // diesel's layout, a directory per migration holding `up.sql`, is not read:
            // refused, where skipping it would read the set as empty, all applied.
            if !lossy.starts_with('.') && path.join("up.sql").is_file() {
                return Err(invalid(
                    &shown,
                    "a directory holding up.sql is diesel's layout, which dblock does not \
                     read: rename its files to VERSION_NAME.up.sql and VERSION_NAME.down.sql \
                     beside the others"
                        .into(),
                ));
            }
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
            // Regular files only, and not too large (a FIFO or /dev/zero is refused).
            let sql = files::read(&path).map_err(|reason| invalid(&shown, reason))?;
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
        let mut ups = Vec::new();
        let mut downs = Vec::new();
        for (file, sql) in sources {
            let is_down = layout::parse(file_name_of(&file)).is_ok_and(|p| p.kind == Kind::Down);
            let m = Migration::parse(file, sql)?;
            if is_down { downs.push(m) } else { ups.push(m) }
        }
        let mut list = ups;
        // Ties broken by file, so the error names the same pair on every platform.
        list.sort_by(|a, b| (a.version, &a.file).cmp(&(b.version, &b.file)));
        downs.sort_by(|a, b| (a.version, &a.file).cmp(&(b.version, &b.file)));
        for l in [&list, &downs] {
            if let Some(w) = l.windows(2).find(|w| w[0].version == w[1].version) {
                return Err(Error::DuplicateMigration {
                    version: w[0].version,
                    first: w[0].file.clone(),
                    second: w[1].file.clone(),
                });
            }
        }
        for d in downs {
            let Ok(i) = list.binary_search_by_key(&d.version, |m| m.version) else {
                return Err(invalid(
                    &d.file,
                    format!(
                        "a .down.sql without its migration: no file has version {} (expected \
                         {}_{}.up.sql beside it)",
                        d.version, d.version, d.name
                    ),
                ));
            };
            if let Some(m) = list.get_mut(i) {
                m.down = Some(Down {
                    file: d.file,
                    sql: d.sql,
                    no_transaction: d.no_transaction,
                });
            }
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

    /// The file names of a new migration `name`, in the set's own layout (that of its
    /// latest migration): the next timestamp when versions are timestamps
    /// (`YYYYMMDDhhmmss`, UTC, never below the latest version plus one), else the latest
    /// version plus one written with as many digits; an up/down pair for a reversible
    /// set; `0001_NAME.sql` for an empty one. In `name`, anything but ASCII letters,
    /// digits, `_` and `-` becomes `_`. What `dblock migrate new` writes.
    ///
    /// ```
    /// let set = dblock::migrate::Migrations::from_sources([
    ///     ("20240101093000_init.up.sql", "CREATE TABLE t (x int);"),
    ///     ("20240101093000_init.down.sql", "DROP TABLE t;"),
    /// ])?;
    /// let files = set.new_file_names("add email")?;
    /// assert!(files[0].ends_with("_add_email.up.sql") && files[1].ends_with("_add_email.down.sql"));
    /// # Ok::<(), dblock::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidMigration`] for a name with no letter or digit, or after version
    /// 2^63 − 1.
    pub fn new_file_names(&self, name: &str) -> Result<Vec<String>, Error> {
        let last = self.list.last();
        let style = layout::Style {
            layout: last.map_or(Layout::Plain, |m| m.layout),
            last: last.map(|m| (m.version, m.width)),
        };
        layout::next_files(style, name, std::time::SystemTime::now())
            .map_err(|reason| invalid(name, reason))
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
pub(crate) fn file_name_of(file: &str) -> &str {
    file.rsplit(['/', '\\']).next().unwrap_or(file)
}

/// Whether `sql` starts with the no-transaction header; an error for a misspelt or
/// misplaced `-- dblock:` directive.
fn header(sql: &str) -> Result<bool, String> {
    let sql = sql.strip_prefix('\u{feff}').unwrap_or(sql);
    // sqlx's marker, exactly as sqlx tests it (the file's first bytes).
    let mut no_transaction = sql.starts_with(SQLX_NO_TRANSACTION);
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

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

#[cfg(test)]
#[path = "set_tests.rs"]
mod tests;
