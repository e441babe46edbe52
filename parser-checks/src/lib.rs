//! The properties every input to dblock's parsers must keep, written once: the fuzz targets
//! (`fuzz/`) call these on what the fuzzer makes, `tests/fuzz_corpus_replays.rs` on every
//! input kept in `fuzz/corpus/`, so an input a fuzzer once broke stays fixed on stable
//! Rust. Each check panics (with the input) when a property fails.
//!
//! The property tests (`tests/`) generate well-formed inputs whose meaning they know and
//! check the parsers' answers against it; these checks hold for any input at all.

use dblock::parsers;

/// An error message fit for a terminal and a log line: one line, not empty.
pub fn assert_one_line(what: &str, input: &str, message: &str) {
    assert!(
        !message.is_empty() && !message.contains(['\n', '\r']),
        "{what} of {input:?} is not one line: {message:?}"
    );
}

/// The shortest password a check looks for in output: a shorter one is found by chance
/// in any text (a password `a` "appears" in every host name with an `a`).
pub const MIN_SECRET_LEN: usize = 4;

/// Whether the password `pw`, read from `input`, may be looked for in what is shown of
/// it: long enough, and not also a part of another value of the string (a user name
/// equal to the password is shown, rightly).
fn findable(pw: &str, pairs: &[(String, String)]) -> bool {
    pw.chars().count() >= MIN_SECRET_LEN
        && !vocabulary().contains(pw)
        && !pairs.iter().any(|(k, v)| {
            // A password holding a key (`password=`) is found in the shown syntax itself.
            k.contains(pw)
                || (!k.is_empty() && pw.contains(k.as_str()))
                || (!is_secret_key(k) && (v.contains(pw) || pw.contains(v.as_str())))
        })
}

/// The words dblock's messages about connection strings are made of (a password
/// `password` is in every list of the options dblock reads).
fn vocabulary() -> &'static str {
    static V: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        let env = |_: &str| None;
        let mut v = String::new();
        for bad in [
            "bogus=1",
            "port=x",
            "sslmode=x",
            "host='x",
            "host=h x",
            "sslrootcert=system sslmode=require",
            "sslcert=x",
            "sslkey=x",
            "postgres://[::1/",
            "postgres://h/?x",
        ] {
            if let Err(e) = parsers::postgres_connection_string(bad, &env) {
                v.push_str(&e.to_string());
                v.push('\n');
            }
        }
        v
    })
}

fn is_secret_key(k: &str) -> bool {
    k.eq_ignore_ascii_case("password") || k.eq_ignore_ascii_case("sslpassword")
}

/// Any text as a database URL or libpq connection string: read without panicking;
/// refused with a one-line error; no password the parser reads from it is shown by the
/// string dblock shows, by the error, or by `Debug` of either; and what the shown
/// string says is a password is `***`.
pub fn connection_string(s: &str) {
    let shown = parsers::redact(s);
    let pairs = parsers::conninfo_pairs(s);
    let secrets: Vec<String> = match &pairs {
        Ok(p) => p
            .iter()
            .filter(|(k, v)| is_secret_key(k) && findable(v, p))
            .map(|(_, v)| v.clone())
            .collect(),
        Err(e) => {
            assert_one_line("the reason", s, e);
            Vec::new()
        }
    };
    let no_secret = |what: &str, text: &str| {
        for pw in &secrets {
            assert!(
                !text.contains(pw.as_str()),
                "{what} of {s:?} shows the password {pw:?}: {text}"
            );
        }
    };
    no_secret("the shown string", &shown);
    // Read back, the shown string's passwords are all `***` (a string cut off where it
    // could not be read ends in `…`; text glued to a quoted password stays glued to a quoted `'***'`).
    if let Ok(again) = parsers::conninfo_pairs(shown.strip_suffix('…').unwrap_or(&shown)) {
        for (k, v) in again {
            if is_secret_key(&k) {
                assert!(v.starts_with("***"), "{s:?} is shown as {shown:?}");
            }
        }
    }
    let env = |_: &str| None;
    match parsers::postgres_connection_string(s, &env) {
        Ok(p) => {
            no_secret("the shown string", &p.shown);
            no_secret("Debug of the result", &format!("{p:?}"));
            if let Some(pw) = p.config.get_password() {
                let pw = String::from_utf8_lossy(pw);
                if pairs.as_ref().is_ok_and(|pairs| findable(&pw, pairs)) {
                    assert!(!p.shown.contains(pw.as_ref()), "{s:?} shown as {}", p.shown);
                }
            }
        }
        Err(e) => error_shows_no_secret(s, &e, &no_secret),
    }
    if s.get(..8)
        .is_some_and(|h| h.eq_ignore_ascii_case("mysql://"))
        || s.get(..10)
            .is_some_and(|h| h.eq_ignore_ascii_case("mariadb://"))
    {
        mysql_url(s);
    }
    if s.get(..7)
        .is_some_and(|h| h.eq_ignore_ascii_case("sqlite:"))
        && let Err(e) = parsers::sqlite_url(s)
    {
        assert_one_line("the reason", s, &e);
    }
}

fn error_shows_no_secret(s: &str, e: &dblock::Error, no_secret: &dyn Fn(&str, &str)) {
    let display = e.to_string();
    let debug = format!("{e:?}");
    assert_one_line("the error", s, &display);
    assert_one_line("Debug of the error", s, &debug);
    no_secret("the error", &display);
    no_secret("Debug of the error", &debug);
    assert!(
        matches!(e, dblock::Error::InvalidUrl { .. }),
        "{s:?}: not InvalidUrl: {e:?}"
    );
}

/// The password of a `mysql://` URL as the WHATWG rules read it (what sqlx reads): the
/// userinfo before the last `@` of the authority, after its first `:`, percent-decoded.
/// Text before `://` holding `=` or whitespace makes a `key=value` string, not a URL:
/// it has no URL password.
fn mysql_password(s: &str) -> Option<String> {
    let i = s.find("://")?;
    if s[..i].contains(|c: char| c == '=' || c.is_whitespace()) {
        return None;
    }
    let rest = &s[i + 3..];
    let authority = &rest[..rest.find(['/', '?', '#', '\\']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    let raw = &userinfo[userinfo.find(':')? + 1..];
    Some(percent_decode(raw))
}

/// Percent-decoding as URLs do it (invalid escapes kept), lossy.
pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Any text as a MySQL URL: a one-line [`dblock::Error::InvalidUrl`] or options; the
/// password is not in what dblock shows or in the error.
pub fn mysql_url(s: &str) {
    let shown = parsers::redact(s);
    // (A "password" holding `***` is found in any redacted text.)
    let pw =
        mysql_password(s).filter(|p| p.chars().count() >= MIN_SECRET_LEN && !p.contains("***"));
    let no_secret = |what: &str, text: &str| {
        if let Some(pw) = &pw {
            // Another part equal to the password is shown rightly.
            let elsewhere = s.replacen(pw.as_str(), "", 1).contains(pw.as_str());
            assert!(
                elsewhere || !text.contains(pw.as_str()),
                "{what} of {s:?} shows the password {pw:?}: {text}"
            );
        }
    };
    no_secret("the shown string", &shown);
    if let Err(e) = parsers::mysql_url(s) {
        error_shows_no_secret(s, &e, &no_secret);
    }
}

/// What PostgreSQL's lexer takes for whitespace (`scan.l`'s `space`).
pub const PG_SPACE: &[char] = &[' ', '\t', '\n', '\r', '\x0b', '\x0c'];

/// Any text as an SQL script: split without panicking into statements that are, in
/// order, disjoint pieces of the script, trimmed and not empty, with nothing but
/// whitespace, comments and `;` between them; each piece's transaction-control reading
/// does not panic either.
pub fn statements(sql: &str) {
    let stmts = parsers::split_statements(sql);
    let base = sql.as_ptr() as usize;
    let mut at = 0;
    for st in &stmts {
        assert!(!st.is_empty(), "{sql:?}: an empty statement in {stmts:?}");
        assert_eq!(st.trim_matches(PG_SPACE), *st, "{sql:?}: untrimmed {st:?}");
        let start = st.as_ptr() as usize - base;
        assert!(
            start >= at && start + st.len() <= sql.len(),
            "{sql:?}: {st:?} is not a piece of the script after the last"
        );
        let gap = &sql[at..start];
        assert!(
            only_separators(gap),
            "{sql:?}: {gap:?} between statements was dropped"
        );
        at = start + st.len();
        let _ = parsers::transaction_control(st);
    }
    assert!(
        only_separators(&sql[at..]),
        "{sql:?}: {:?} after the last statement was dropped",
        &sql[at..]
    );
}

/// `s` from its first token: leading whitespace and comments (nested) skipped.
/// PostgreSQL's parser starts a statement there; dblock's splitter keeps the comments
/// before it (they are sent with it).
pub fn from_first_token(s: &str) -> &str {
    let mut r = s;
    loop {
        r = r.trim_start_matches(PG_SPACE);
        if let Some(x) = r.strip_prefix("--") {
            r = x.find('\n').map_or("", |n| &x[n..]);
        } else if r.starts_with("/*") {
            let b = r.as_bytes();
            let (mut depth, mut i) = (0, 0);
            while i + 1 < b.len() {
                if &b[i..i + 2] == b"/*" {
                    depth += 1;
                    i += 2;
                } else if &b[i..i + 2] == b"*/" {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            r = &r[i..];
        } else {
            return r;
        }
    }
}

/// Statements as the two splitters are compared: from the first token, trimmed of
/// PostgreSQL's whitespace (an empty one stays, to be seen).
pub fn comparable<'a>(stmts: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    stmts
        .into_iter()
        .map(|s| from_first_token(s).trim_matches(PG_SPACE).to_string())
        .collect()
}

/// [`statements`], and where `oracle` (PostgreSQL's parser splitting a script into its
/// statements' text) accepts the script, dblock's split equals it.
pub fn statements_against(sql: &str, oracle: &dyn Fn(&str) -> Result<Vec<String>, String>) {
    statements(sql);
    if let Ok(theirs) = oracle(sql) {
        let theirs = comparable(theirs.iter().map(String::as_str));
        let ours = comparable(parsers::split_statements(sql));
        assert_eq!(ours, theirs, "{sql:?} is split unlike PostgreSQL splits it");
    }
}

/// Whether `s` holds only whitespace, `;` and whole comments (what may lie between two
/// statements).
fn only_separators(s: &str) -> bool {
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches(|c: char| PG_SPACE.contains(&c) || c == ';');
        if rest.is_empty() {
            return true;
        }
        if let Some(r) = rest.strip_prefix("--") {
            rest = r.find('\n').map_or("", |n| &r[n..]);
        } else if rest.starts_with("/*") {
            let mut depth = 0;
            let b = rest.as_bytes();
            let mut i = 0;
            let mut end = None;
            while i + 1 < b.len() {
                if &b[i..i + 2] == b"/*" {
                    depth += 1;
                    i += 2;
                } else if &b[i..i + 2] == b"*/" {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        end = Some(i);
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            match end {
                Some(e) => rest = &rest[e..],
                None => return false,
            }
        } else {
            return false;
        }
    }
}

/// Any text as a migration file name: a one-line reason, or a name that, written again
/// in its layout with the version's digits, reads as the same; and the next file after
/// it parses as the next version in the same layout.
pub fn migration_file_name(file: &str) {
    use dblock::migrate::Layout;
    let f = match parsers::migration_file_name(file) {
        Ok(f) => f,
        Err(e) => return assert_one_line("the reason", file, &e),
    };
    assert!(f.version >= 0, "{file:?}: negative version {}", f.version);
    assert!(!f.name.is_empty(), "{file:?}: empty name");
    let v = format!("{:0w$}", f.version, w = f.width);
    let again = match (f.layout, f.down) {
        (Layout::Flyway, _) => format!("V{v}__{}.sql", f.name),
        (Layout::Reversible, false) => format!("{v}_{}.up.sql", f.name),
        (Layout::Reversible, true) => format!("{v}_{}.down.sql", f.name),
        _ => format!("{v}_{}.sql", f.name),
    };
    assert_eq!(again, file, "{file:?} written again differs");
    let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_709_251_199);
    match parsers::next_migration_files(f.layout, Some((f.version, f.width)), "next", now) {
        Ok(next) => {
            for n in &next {
                let g = parsers::migration_file_name(n)
                    .unwrap_or_else(|e| panic!("after {file:?}, {n:?} is refused: {e}"));
                assert_eq!(g.layout, f.layout, "after {file:?}: {n:?}");
                assert!(g.version > f.version, "after {file:?}: {n:?}");
            }
        }
        Err(e) => {
            assert_one_line("the reason", file, &e);
            assert_eq!(f.version, i64::MAX, "{file:?}: no next file: {e}");
        }
    }
}

/// The formula of [`dblock::Key`], computed here from its documentation: the first 8
/// bytes, big-endian, of SHA-256(namespace, NUL, name).
pub fn documented_key(namespace: &str, name: &str) -> i64 {
    use sha2::{Digest, Sha256};
    let mut input = namespace.as_bytes().to_vec();
    input.push(0);
    input.extend_from_slice(name.as_bytes());
    let d = Sha256::digest(&input);
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    i64::from_be_bytes(first)
}

/// A fuzz input as a namespace and a name: split at the first U+0001, else the whole
/// input is a name in the default namespace.
pub fn split_lock_input(s: &str) -> (&str, &str) {
    s.split_once('\u{1}')
        .unwrap_or((dblock::DEFAULT_NAMESPACE, s))
}

/// Any namespace and name: a key exactly when both are valid (non-empty, at most 1024
/// bytes, no NUL), equal to the documented formula; else a one-line typed error.
pub fn lock_name(namespace: &str, name: &str) {
    let valid = |s: &str, max: usize| !s.is_empty() && s.len() <= max && !s.contains('\0');
    match dblock::Key::new(namespace, name) {
        Ok(k) => {
            assert!(
                valid(namespace, dblock::MAX_NAMESPACE_LEN) && valid(name, dblock::MAX_NAME_LEN)
            );
            assert_eq!(
                k.as_i64(),
                documented_key(namespace, name),
                "{namespace:?} {name:?}"
            );
            let slot = dblock::Key::slot(namespace, name, 0).unwrap_or_else(|e| panic!("{e}"));
            assert_ne!(slot, k, "a slot key equals its name's key");
        }
        Err(e) => {
            let shown = e.to_string();
            assert_one_line("the error", name, &shown);
            match e {
                dblock::Error::InvalidNamespace { .. } => {
                    assert!(!valid(namespace, dblock::MAX_NAMESPACE_LEN))
                }
                dblock::Error::InvalidName { .. } => {
                    assert!(valid(namespace, dblock::MAX_NAMESPACE_LEN));
                    assert!(!valid(name, dblock::MAX_NAME_LEN));
                }
                other => panic!("{namespace:?} {name:?}: {other:?}"),
            }
        }
    }
}

/// Any text read back from the server as it may hold dblock's comments: read without
/// panicking; each comment found names a non-empty namespace and name; and a comment
/// dblock writes for any namespace and name, wherever it sits in the text, reads back
/// as what was written.
pub fn comments(text: &str) {
    for c in parsers::parse_comments(text) {
        assert!(
            !c.name.is_empty() && !c.namespace.is_empty(),
            "{text:?}: {c:?}"
        );
    }
    // The text as a name: what dblock writes for it reads back whole, after the text.
    if !text.is_empty() {
        let written = parsers::write_comment("ns", text, Some(dblock::Scope::Session), None);
        let read = parsers::parse_comments(&format!("SELECT 1 {written}"));
        assert_eq!(read.len(), 1, "{text:?}: {written:?} read as {read:?}");
        assert_eq!(read[0].name, text);
        assert_eq!(read[0].namespace, "ns");
        assert_eq!(read[0].scope, Some(dblock::Scope::Session));
        let (host, pid) = parsers::holder();
        assert_eq!(read[0].host.as_deref(), Some(host.as_str()));
        assert_eq!(read[0].pid, Some(pid));
    }
}
