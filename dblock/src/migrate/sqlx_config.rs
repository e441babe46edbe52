//! sqlx's settings that decide how dblock reads sqlx's history: `sqlx.toml`'s
//! `[migrate] table-name` and `ignored-chars` (the CLI reads the file; its
//! `migrations-dir` is the CLI's default directory).

use std::collections::BTreeSet;

use super::adopt::{SQLX_TABLE, Sqlx};

/// How sqlx keeps its history on this database: what `sqlx.toml`'s `[migrate]` section
/// says, as sqlx-cli 0.9 reads it (see [`Runner::sqlx_config`](super::Runner::sqlx_config)).
///
/// ```
/// let config = dblock::migrate::SqlxConfig::new()
///     .with_table_name("app._sqlx_migrations")
///     .with_ignored_chars(['\r']);
/// assert_eq!(config.table_name.as_deref(), Some("app._sqlx_migrations"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqlxConfig {
    /// `table-name`: sqlx's history table as SQL names it, plain or schema-qualified,
    /// quotes allowed (`app._sqlx_migrations`, `"App"."History"`); `_sqlx_migrations`
    /// when `None`. sqlx puts it into its SQL as it is written, and so does dblock,
    /// after checking that it is one or two identifiers.
    pub table_name: Option<String>,
    /// `ignored-chars`: the characters sqlx leaves out of a file when it computes its
    /// checksum. `None` when not known (no `sqlx.toml`): then the file's own checksum,
    /// and the one without whitespace (`" "`, `"\t"`, `"\r"`, `"\n"`, `"\u{FEFF}"`, the set
    /// sqlx's documentation suggests), are both accepted. `Some` of an empty set: sqlx's
    /// default, the file as it is.
    pub ignored_chars: Option<BTreeSet<char>>,
}

impl SqlxConfig {
    /// sqlx's defaults, with `ignored-chars` not known.
    pub fn new() -> SqlxConfig {
        SqlxConfig::default()
    }

    /// With `table-name`.
    pub fn with_table_name(mut self, table_name: impl Into<String>) -> SqlxConfig {
        self.table_name = Some(table_name.into());
        self
    }

    /// With `ignored-chars` (an empty set: sqlx's default).
    pub fn with_ignored_chars(mut self, chars: impl IntoIterator<Item = char>) -> SqlxConfig {
        self.ignored_chars = Some(chars.into_iter().collect());
        self
    }

    /// The history table's name as SQL names it.
    pub(crate) fn table(&self) -> &str {
        self.table_name.as_deref().unwrap_or(SQLX_TABLE)
    }

    /// How the runner reads sqlx's history.
    pub(crate) fn sqlx(&self) -> Sqlx<'_> {
        Sqlx {
            table: self.table(),
            ignored_chars: self.ignored_chars.as_ref(),
        }
    }
}

/// Whether `name` is one identifier or two joined by `.`, each plain (letters, digits,
/// `_`, `$`, not starting with a digit) or quoted (`"…"` or `` `…` ``, the quote doubled
/// inside): what may be put into SQL as it is. Anything else (a `;`, a comment, a space
/// outside quotes) is refused, with the reason.
pub(crate) fn check_table_name(name: &str) -> Result<(), String> {
    let refuse = |why: &str| {
        Err(format!(
            "the sqlx history table name {name:?} is not a table name ({why}): expected \
             NAME or SCHEMA.NAME, each plain or quoted"
        ))
    };
    let mut rest = name;
    for part in 0..2 {
        let len = match identifier_len(rest) {
            Ok(n) => n,
            Err(why) => return refuse(why),
        };
        rest = &rest[len..];
        match rest.strip_prefix('.') {
            Some(more) if part == 0 => rest = more,
            Some(_) => return refuse("more than two parts"),
            None if rest.is_empty() => return Ok(()),
            None => return refuse("unexpected characters"),
        }
    }
    refuse("nothing after the dot")
}

/// The length of the identifier `s` starts with, plain or quoted.
fn identifier_len(s: &str) -> Result<usize, &'static str> {
    let Some(first) = s.chars().next() else {
        return Err("an empty part");
    };
    if first == '"' || first == '`' {
        let mut chars = s.char_indices().skip(1).peekable();
        while let Some((i, c)) = chars.next() {
            if c == first {
                if chars.peek().is_some_and(|&(_, d)| d == first) {
                    chars.next();
                    continue;
                }
                return match i {
                    1 => Err("an empty quoted name"),
                    _ => Ok(i + 1),
                };
            }
        }
        return Err("an unterminated quote");
    }
    let plain = |c: char| c.is_alphanumeric() || c == '_' || c == '$';
    if first.is_ascii_digit() || !plain(first) {
        return Err("a name starts with a letter or _");
    }
    Ok(s.find(|c: char| !plain(c)).unwrap_or(s.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_one_or_two_identifiers_plain_or_quoted() {
        for ok in [
            "_sqlx_migrations",
            "app._sqlx_migrations",
            "\"App\".\"Hist ory\"",
            "`app`.`hist`",
            "\"a\"\"b\"",
            "s$1.t_2",
        ] {
            assert_eq!(check_table_name(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "a.",
            ".a",
            "a.b.c",
            "a; DROP TABLE x",
            "a -- x",
            "\"open",
            "\"\"",
            "1abc",
            "a b",
        ] {
            assert!(check_table_name(bad).is_err(), "{bad}");
        }
    }
}
