//! The `migrations!` macro of [dblock](https://docs.rs/dblock), re-exported there as
//! `dblock::migrations!`: use it through dblock, not from this crate.

use std::path::Path;

use proc_macro::{Delimiter, Literal, TokenStream, TokenTree};

/// Embeds a directory of migrations in the binary at compile time, as a
/// [`dblock::migrate::Migrations`](https://docs.rs/dblock/latest/dblock/migrate/struct.Migrations.html).
///
/// (A proc-macro crate cannot run its own examples: this one is compiled and run as
/// dblock's `examples/migrate.rs` and its migration tests.)
///
/// ```text
/// // `migrations/` beside the crate's Cargo.toml; `migrations!()` means the same.
/// let set: dblock::migrate::Migrations = dblock::migrations!("migrations");
/// set.run(&locks).await?;
/// ```
///
/// The path is relative to the directory of the crate's `Cargo.toml`. Every `.sql` file
/// in it is embedded with `include_str!`, and the [file name
/// rule](https://docs.rs/dblock/latest/dblock/migrate/struct.Migrations.html#the-file-name-rule)
/// and unique versions are checked now: a malformed name or a repeated version is a
/// compile error naming the file. Headers and contents are checked when the set is first
/// used, and a problem found then is reported by that use as an error.
///
/// **Editing** an embedded file rebuilds the crate (cargo tracks `include_str!`), but
/// **adding** a file does not: cargo cannot know of a file nothing includes yet. Add a
/// build script to the crate that names the directory:
///
/// ```text
/// // build.rs
/// fn main() {
///     println!("cargo:rerun-if-changed=migrations");
/// }
/// ```
#[proc_macro]
pub fn migrations(input: TokenStream) -> TokenStream {
    match expand(input) {
        Ok(tokens) => tokens,
        Err(message) => compile_error(&message),
    }
}

fn compile_error(message: &str) -> TokenStream {
    format!(
        "::core::compile_error!({})",
        Literal::string(&format!("dblock::migrations!: {message}"))
    )
    .parse()
    .unwrap_or_default()
}

fn expand(input: TokenStream) -> Result<TokenStream, String> {
    let rel = directory_argument(input)?;
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .ok_or("CARGO_MANIFEST_DIR is not set: the macro must be compiled by cargo")?;
    let dir = Path::new(&root).join(&rel);
    let cannot = |e: std::io::Error| format!("cannot read the directory {}: {e}", dir.display());
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(cannot)? {
        let entry = entry.map_err(cannot)?;
        let file_name = entry.file_name();
        let lossy = file_name.to_string_lossy();
        if lossy.starts_with('.') || !lossy.to_ascii_lowercase().ends_with(".sql") {
            continue;
        }
        let path = entry.path();
        let shown = format!("{}/{lossy}", rel.trim_end_matches('/'));
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => continue,
            // A FIFO would hang the compiler in include_str!, a device fill its memory.
            Ok(m) if !m.is_file() => {
                return Err(format!(
                    "{shown}: refused: not a regular file (a FIFO, device or socket); \
                     migrations are read from regular files only"
                ));
            }
            _ => {}
        }
        let Some(name) = file_name.to_str() else {
            return Err(format!("{shown}: the file name is not UTF-8"));
        };
        let version = parse_file_name(name).map_err(|reason| format!("{shown}: {reason}"))?;
        // A pair shares its version: duplicates are looked for among ups and downs apart.
        let Some(abs) = path.to_str() else {
            return Err(format!("{}: the path is not UTF-8", path.display()));
        };
        files.push((version, shown, abs.to_string()));
    }
    files.sort();
    if let Some(w) = files.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!(
            "{} and {} have the same version {}; each version must be unique",
            w[0].1, w[1].1, w[0].0.0
        ));
    }
    let mut items = String::new();
    for (_, shown, abs) in &files {
        items.push_str(&format!(
            "({}, ::core::include_str!({})),",
            Literal::string(shown),
            Literal::string(abs)
        ));
    }
    format!("::dblock::migrate::Migrations::__embedded(&[{items}])")
        .parse()
        .map_err(|e| format!("{e}"))
}

/// The directory argument: one string literal, or nothing for `"migrations"`.
fn directory_argument(input: TokenStream) -> Result<String, String> {
    const EXPECTED: &str =
        "expected one string literal: the directory, relative to the crate's Cargo.toml";
    let mut tokens: Vec<TokenTree> = input.into_iter().collect();
    // A literal passed on by a macro_rules! macro arrives wrapped in an invisible group.
    while let [TokenTree::Group(g)] = tokens.as_slice() {
        if g.delimiter() != Delimiter::None {
            break;
        }
        tokens = g.stream().into_iter().collect();
    }
    match tokens.as_slice() {
        [] => Ok("migrations".to_string()),
        [TokenTree::Literal(lit)] => string_literal(&lit.to_string()).ok_or(EXPECTED.to_string()),
        _ => Err(EXPECTED.to_string()),
    }
}

/// The value of a string literal's source text: `"…"` with the common escapes, or a raw
/// string; `None` for anything else.
fn string_literal(src: &str) -> Option<String> {
    if let Some(raw) = src.strip_prefix('r') {
        let hashes = raw.len() - raw.trim_start_matches('#').len();
        let body = raw.get(hashes..raw.len().checked_sub(hashes)?)?;
        return Some(body.strip_prefix('"')?.strip_suffix('"')?.to_string());
    }
    let body = src.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next()? {
            '\\' => '\\',
            '"' => '"',
            '\'' => '\'',
            'n' => '\n',
            't' => '\t',
            '0' => '\0',
            _ => return None,
        });
    }
    Some(out)
}

/// The version of a file name following dblock's rule, and whether it is the
/// `.down.sql` of a pair; or what is wrong with it.
///
/// Kept in step with `dblock::migrate`'s own check (which runs again on the embedded
/// set): `VERSION_NAME.sql`, `VERSION_NAME.up.sql` / `.down.sql` or `VVERSION__NAME.sql`,
/// VERSION one or more ASCII digits (at most 2^63 − 1), NAME one or more ASCII letters,
/// digits, `_` or `-`.
fn parse_file_name(file_name: &str) -> Result<(i64, bool), String> {
    const RULE: &str = "expected VERSION_NAME.sql (digits, one underscore, then letters, \
                        digits, _ or -, e.g. 0001_create_users.sql), VERSION_NAME.up.sql \
                        with VERSION_NAME.down.sql, or VVERSION__NAME.sql";
    let stem = file_name
        .strip_suffix(".sql")
        .ok_or(format!("the extension must be .sql in lowercase; {RULE}"))?;
    let (number, name, down) = if let Some(rest) = stem.strip_prefix('V') {
        let (number, name) = rest.split_once("__").unwrap_or(("", ""));
        (number, name, false)
    } else {
        let (stem, down) = match (stem.strip_suffix(".up"), stem.strip_suffix(".down")) {
            (Some(s), _) => (s, false),
            (_, Some(s)) => (s, true),
            _ => (stem, false),
        };
        let digits = stem.bytes().take_while(u8::is_ascii_digit).count();
        let (number, rest) = stem.split_at(digits);
        (number, rest.strip_prefix('_').unwrap_or_default(), down)
    };
    let well_formed = !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit())
        && !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !well_formed {
        return Err(RULE.to_string());
    }
    number
        .parse::<i64>()
        .map(|v| (v, down))
        .map_err(|_| format!("the version {number} is larger than 2^63 - 1"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn file_names_follow_dblocks_rule() {
        assert_eq!(parse_file_name("0001_create_users.sql"), Ok((1, false)));
        assert_eq!(
            parse_file_name("20240101_add-x_2.sql"),
            Ok((20240101, false))
        );
        assert_eq!(parse_file_name("7_a.up.sql"), Ok((7, false)));
        assert_eq!(parse_file_name("7_a.down.sql"), Ok((7, true)));
        assert_eq!(parse_file_name("V12__a_b.sql"), Ok((12, false)));
        for bad in [
            "create_users.sql",
            "0001-create.sql",
            "0001_.sql",
            "0001.sql",
            "0001_a b.sql",
            "0001_a.sideways.sql",
            "V1.1__a.sql",
            "V1_a.sql",
            "0001_a.SQL",
            "99999999999999999999_big.sql",
        ] {
            assert!(parse_file_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn string_literals_are_read() {
        assert_eq!(string_literal("\"migrations\"").unwrap(), "migrations");
        assert_eq!(string_literal("\"a\\\\b\\\"c\"").unwrap(), "a\\b\"c");
        assert_eq!(string_literal("r\"x\\y\"").unwrap(), "x\\y");
        assert_eq!(string_literal("r#\"x\"y\"#").unwrap(), "x\"y");
        assert!(string_literal("42").is_none());
        assert!(string_literal("\"\\u{41}\"").is_none());
    }
}
