//! Splitting an SQL script into its statements, for migrations that run outside a
//! transaction (each statement is then sent on its own, since PostgreSQL runs a
//! multi-statement message as one implicit transaction, where `CREATE INDEX
//! CONCURRENTLY` is refused).
//!
//! The rules are PostgreSQL's lexical ones, as psql applies them: a `;` ends a statement
//! unless it lies in a string (`'…'` with `''`, `E'…'` with backslash escapes), a quoted
//! identifier (`"…"`), a dollar-quoted body (`$$…$$`, `$tag$…$tag$`), a comment (`--` to
//! the end of the line, `/* … */`, nested), within parentheses (a multi-action `CREATE
//! RULE`), or within the `BEGIN … END` body of a `CREATE FUNCTION` / `CREATE PROCEDURE`
//! (`BEGIN ATOMIC`) or `CREATE TRIGGER` (SQLite's trigger bodies).

/// The statements of `sql`, trimmed of PostgreSQL's whitespace, without their
/// terminating `;`; pieces holding only whitespace and comments are dropped.
pub(crate) fn split(sql: &str) -> Vec<&str> {
    let b = sql.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    let mut st = Statement::default();
    while i < b.len() {
        if b[i] == b';' && st.parens == 0 && st.body_depth == 0 {
            if st.content {
                out.push(sql[start..i].trim_matches(is_space));
            }
            st = Statement::default();
            i += 1;
            start = i;
        } else {
            i = st.scan(sql, i);
        }
    }
    if st.content {
        out.push(sql[start..].trim_matches(is_space));
    }
    out
}

/// Where the comment, string, quoted identifier or dollar-quoted body starting at `i`
/// ends, and whether it is content (a comment is not, unless unterminated: that is left
/// for the server to report, not dropped); `None` if none starts there.
fn skip_literal(b: &[u8], i: usize) -> Option<(usize, bool)> {
    match b[i] {
        b'-' if b.get(i + 1) == Some(&b'-') => match memchr(b'\n', &b[i..]) {
            Some(n) => Some((i + n + 1, false)),
            None => Some((b.len(), false)),
        },
        b'/' if b.get(i + 1) == Some(&b'*') => match skip_block_comment(b, i) {
            Some(end) => Some((end, false)),
            None => Some((b.len(), true)),
        },
        b'\'' => Some((skip_quoted(b, i, b'\'', false), true)),
        b'"' => Some((skip_quoted(b, i, b'"', false), true)),
        b'$' => Some(match dollar_tag(b, i) {
            Some(tag_end) => {
                let tag = &b[i..tag_end];
                match find(&b[tag_end..], tag) {
                    Some(n) => (tag_end + n + tag.len(), true),
                    None => (b.len(), true),
                }
            }
            None => (i + 1, true),
        }),
        _ => None,
    }
}

/// PostgreSQL's whitespace (`scan.l`'s `space`, with the vertical tab PostgreSQL 16
/// added): no other character, not even Unicode's spaces, which are identifier
/// characters to PostgreSQL (`x\u{a0}` is one name), so trimming one would change the
/// statement.
fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c')
}

/// What the scanner tracks within one statement.
#[derive(Default)]
struct Statement {
    /// Whether anything but whitespace and comments has been seen.
    content: bool,
    parens: u32,
    /// Depth of `BEGIN`/`CASE` … `END` inside a routine or trigger body.
    body_depth: u32,
    /// The statement's first words, lowercased, as far as they decide whether it
    /// defines a routine or trigger with a body.
    lead: Vec<String>,
    words: usize,
}

impl Statement {
    /// Reads what starts at `i` (anything but a `;` that ends the statement) into the
    /// statement's state; where it ends.
    fn scan(&mut self, sql: &str, i: usize) -> usize {
        let b = sql.as_bytes();
        if let Some((end, content)) = skip_literal(b, i) {
            self.content |= content;
            return end;
        }
        let c = b[i];
        if is_space(char::from(c)) {
            return i + 1;
        }
        self.content = true;
        match c {
            b'(' => self.parens += 1,
            b')' => self.parens = self.parens.saturating_sub(1),
            c if is_ident_start(c) => {
                let end = word_end(b, i);
                let word = &sql[i..end];
                if b.get(end) == Some(&b'\'') && word.eq_ignore_ascii_case("e") {
                    // E'…': backslash escapes.
                    return skip_quoted(b, end, b'\'', true);
                }
                self.word(word);
                return end;
            }
            _ => {}
        }
        i + 1
    }

    fn word(&mut self, word: &str) {
        if self.words < 4 {
            self.lead.push(word.to_ascii_lowercase());
        }
        self.words += 1;
        if self.parens > 0 || !self.has_body() {
            return;
        }
        if word.eq_ignore_ascii_case("begin") {
            self.body_depth += 1;
        } else if word.eq_ignore_ascii_case("case") {
            // CASE also ends with END; it matters only inside a body.
            if self.body_depth > 0 {
                self.body_depth += 1;
            }
        } else if word.eq_ignore_ascii_case("end") {
            self.body_depth = self.body_depth.saturating_sub(1);
        }
    }

    /// `CREATE [OR REPLACE] {FUNCTION | PROCEDURE | TRIGGER}` or
    /// `CREATE {TEMP | TEMPORARY} TRIGGER`.
    fn has_body(&self) -> bool {
        let w = |i: usize| self.lead.get(i).map(String::as_str).unwrap_or("");
        let routine = |s: &str| matches!(s, "function" | "procedure" | "trigger");
        w(0) == "create"
            && (routine(w(1))
                || (w(1) == "or" && w(2) == "replace" && routine(w(3)))
                || (matches!(w(1), "temp" | "temporary") && w(2) == "trigger"))
    }
}

/// The transaction-control statement `stmt` is, if it is one: `BEGIN`, `START
/// TRANSACTION`, `COMMIT`, `END`, `ROLLBACK` (but not `ROLLBACK TO SAVEPOINT`), `ABORT`,
/// `PREPARE TRANSACTION`.
pub(crate) fn transaction_control(stmt: &str) -> Option<String> {
    let mut words = leading_words(stmt, 2).into_iter();
    let first = words.next()?;
    let second = words.next().unwrap_or_default();
    let is = match first.as_str() {
        "begin" | "commit" | "end" | "abort" => true,
        "start" | "prepare" => second == "transaction",
        "rollback" => second != "to",
        _ => false,
    };
    is.then(|| first.to_ascii_uppercase())
}

/// Up to `n` leading words of `stmt`, lowercased, after whitespace and comments.
fn leading_words(stmt: &str, n: usize) -> Vec<String> {
    let b = stmt.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() && out.len() < n {
        match b[i] {
            b'-' if b.get(i + 1) == Some(&b'-') => {
                i = match memchr(b'\n', &b[i..]) {
                    Some(k) => i + k + 1,
                    None => b.len(),
                };
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i = skip_block_comment(b, i).unwrap_or(b.len());
            }
            c if is_space(char::from(c)) => i += 1,
            c if is_ident_start(c) => {
                let end = word_end(b, i);
                out.push(stmt[i..end].to_ascii_lowercase());
                i = end;
            }
            _ => break,
        }
    }
    out
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c >= 0x80
}

fn is_ident_cont(c: u8) -> bool {
    is_ident_start(c) || c.is_ascii_digit() || c == b'$'
}

/// The end of the identifier or keyword starting at `i`. Stops only at ASCII bytes, so
/// the result is a character boundary.
fn word_end(b: &[u8], i: usize) -> usize {
    let mut j = i;
    while j < b.len() && is_ident_cont(b[j]) {
        j += 1;
    }
    j
}

/// Past the end of the `/* … */` comment starting at `i` (comments nest); `None` if it
/// is not closed.
fn skip_block_comment(b: &[u8], i: usize) -> Option<usize> {
    let mut depth = 0u32;
    let mut j = i;
    while j < b.len() {
        if b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
            depth += 1;
            j += 2;
        } else if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
            depth -= 1;
            j += 2;
            if depth == 0 {
                return Some(j);
            }
        } else {
            j += 1;
        }
    }
    None
}

/// Past the closing `quote` of the quoted text opening at `i`; a doubled quote stands
/// for itself, and with `backslash`, so does a backslash-escaped character.
fn skip_quoted(b: &[u8], i: usize, quote: u8, backslash: bool) -> usize {
    let mut j = i + 1;
    while j < b.len() {
        if backslash && b[j] == b'\\' {
            j += 2;
        } else if b[j] == quote {
            if b.get(j + 1) == Some(&quote) {
                j += 2;
            } else {
                return j + 1;
            }
        } else {
            j += 1;
        }
    }
    b.len()
}

/// If a dollar-quote tag (`$$` or `$tag$`) opens at `i`, the index just past it.
/// (`$1` is a parameter, not a tag; a `$` inside an identifier never reaches here.)
fn dollar_tag(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    if b.get(j) == Some(&b'$') {
        return Some(j + 1);
    }
    if !b.get(j).is_some_and(|&c| is_ident_start(c)) {
        return None;
    }
    while j < b.len() && (is_ident_start(b[j]) || b[j].is_ascii_digit()) {
        j += 1;
    }
    (b.get(j) == Some(&b'$')).then_some(j + 1)
}

fn memchr(needle: u8, hay: &[u8]) -> Option<usize> {
    hay.iter().position(|&c| c == needle)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semicolons_end_statements() {
        assert_eq!(
            split("CREATE TABLE a (x int);\nCREATE TABLE b (y int) ;\n\n"),
            vec!["CREATE TABLE a (x int)", "CREATE TABLE b (y int)"]
        );
        assert_eq!(split("SELECT 1"), vec!["SELECT 1"], "no final semicolon");
        assert!(split("").is_empty());
        assert!(
            split(" ;; \n ; ").is_empty(),
            "empty statements are dropped"
        );
    }

    #[test]
    fn quotes_hide_semicolons() {
        let sql = "INSERT INTO t VALUES ('a;b', 'it''s; fine');\
                   SELECT \"odd;name\" FROM \"x\"\"y;\";\
                   SELECT E'back\\'slash;', e'\\\\';\
                   SELECT 2";
        let s = split(sql);
        assert_eq!(s.len(), 4, "{s:#?}");
        assert_eq!(s[0], "INSERT INTO t VALUES ('a;b', 'it''s; fine')");
        assert_eq!(s[1], "SELECT \"odd;name\" FROM \"x\"\"y;\"");
        assert_eq!(s[2], "SELECT E'back\\'slash;', e'\\\\'");
        assert_eq!(s[3], "SELECT 2");
    }

    #[test]
    fn a_backslash_in_a_standard_string_is_just_a_character() {
        assert_eq!(
            split(r"SELECT 'C:\'; SELECT 2"),
            vec![r"SELECT 'C:\'", "SELECT 2"]
        );
    }

    #[test]
    fn dollar_quoted_bodies_hide_semicolons() {
        let sql = "DO $$ BEGIN PERFORM 1; PERFORM 2; END $$;\n\
                   CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $fn$\n\
                   BEGIN RETURN 1; /* $$ inside */ END\n$fn$;\n\
                   SELECT $1::int, a$b$c FROM t;";
        let s = split(sql);
        assert_eq!(s.len(), 3, "{s:#?}");
        assert!(s[0].starts_with("DO $$") && s[0].ends_with("END $$"));
        assert!(s[1].ends_with("$fn$"));
        assert_eq!(s[2], "SELECT $1::int, a$b$c FROM t");
    }

    #[test]
    fn comments_hide_semicolons_and_comment_only_pieces_are_dropped() {
        let sql = "-- dblock:no-transaction\n\
                   -- a comment; with a semicolon\n\
                   CREATE INDEX CONCURRENTLY i ON t (x); /* a; /* nested; */ still; */\n\
                   DROP INDEX CONCURRENTLY IF EXISTS j; -- trailing; comment\n";
        let s = split(sql);
        assert_eq!(s.len(), 2, "{s:#?}");
        assert!(s[0].starts_with("-- dblock:no-transaction"));
        assert!(s[0].ends_with("CREATE INDEX CONCURRENTLY i ON t (x)"));
        assert!(s[1].starts_with("/* a; /* nested; */ still; */"));
        assert!(s[1].ends_with("DROP INDEX CONCURRENTLY IF EXISTS j"));
    }

    #[test]
    fn parentheses_hide_semicolons() {
        let sql = "CREATE RULE r AS ON INSERT TO t DO ALSO (INSERT INTO a VALUES (1); \
                   INSERT INTO b VALUES (2)); SELECT 1";
        let s = split(sql);
        assert_eq!(s.len(), 2, "{s:#?}");
        assert!(s[0].ends_with("VALUES (2))"));
    }

    #[test]
    fn routine_and_trigger_bodies_hide_semicolons() {
        let sql = "CREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql\n\
                   BEGIN ATOMIC SELECT CASE WHEN true THEN 1 END; SELECT 2; END;\n\
                   CREATE TRIGGER IF NOT EXISTS tr AFTER INSERT ON t BEGIN\n\
                   UPDATE c SET n = CASE WHEN n IS NULL THEN 1 ELSE n + 1 END; DELETE FROM d; END;\n\
                   CREATE TEMP TRIGGER tt AFTER DELETE ON t BEGIN SELECT 1; END;\n\
                   BEGIN; END;";
        let s = split(sql);
        assert_eq!(s.len(), 5, "{s:#?}");
        assert!(s[0].ends_with("SELECT 2; END"));
        assert!(s[1].ends_with("DELETE FROM d; END"));
        assert!(s[2].ends_with("SELECT 1; END"));
        assert_eq!(
            &s[3..],
            ["BEGIN", "END"],
            "outside a body, BEGIN is a statement"
        );
    }

    #[test]
    fn unterminated_quotes_run_to_the_end_without_panicking() {
        for sql in [
            "SELECT 'x; y",
            "SELECT \"x; y",
            "SELECT $a$ x; y",
            "/* x; y",
            "SELECT E'\\",
        ] {
            assert_eq!(split(sql).len(), 1, "{sql}");
        }
        assert_eq!(split("SELECT 'é;ü'; SELECT 'ß'").len(), 2);
    }

    #[test]
    fn transaction_control_is_recognised() {
        for s in [
            "BEGIN",
            "begin transaction isolation level serializable",
            "START TRANSACTION",
            "COMMIT",
            "-- done\nCOMMIT",
            "/* x */ END",
            "ROLLBACK",
            "ABORT",
            "PREPARE TRANSACTION 'x'",
            "BEGIN IMMEDIATE",
        ] {
            assert!(transaction_control(s).is_some(), "{s}");
        }
        for s in [
            "ROLLBACK TO SAVEPOINT a",
            "SAVEPOINT a",
            "RELEASE SAVEPOINT a",
            "CREATE TABLE begin_log (x int)",
            "SELECT 'COMMIT'",
            "PREPARE q AS SELECT 1",
            "DO $$ BEGIN COMMIT; END $$",
        ] {
            assert!(transaction_control(s).is_none(), "{s}");
        }
        assert_eq!(
            transaction_control("commit work").as_deref(),
            Some("COMMIT")
        );
    }
}
