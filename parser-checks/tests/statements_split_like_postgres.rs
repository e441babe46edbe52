//! dblock's statement splitter (what a migration outside a transaction sends, one
//! statement at a time) against PostgreSQL's own parser (libpg_query, through the
//! `pg_query` crate): on generated scripts full of what hides a `;` — quoted strings,
//! `E''` strings with backslash escapes, dollar-quoted bodies, quoted identifiers, nested
//! comments, parentheses, `BEGIN ATOMIC` bodies — and on real-world SQL
//! (`tests/sql/`: PostgreSQL's own catalog scripts and extension scripts), both must cut
//! the script into the same statements.
//!
//! PostgreSQL's statement starts at its first token; dblock's keeps the comments before it
//! (they are sent with it). So each is compared from its first token, trimmed of the
//! whitespace PostgreSQL knows; `dblock_parser_checks::statements` checks that what lies
//! between dblock's statements is only whitespace, comments and `;`.

use dblock::parsers::split_statements;
use dblock_parser_checks::{self as checks, PG_SPACE, comparable};
use proptest::prelude::*;

/// The statements PostgreSQL's parser finds, or its error.
fn postgres_split(sql: &str) -> Result<Vec<String>, String> {
    let stmts = pg_query::split_with_parser(sql).map_err(|e| e.to_string())?;
    Ok(comparable(stmts))
}

fn dblock_split(sql: &str) -> Vec<String> {
    comparable(split_statements(sql))
}

/// Both splits of `sql`, which PostgreSQL must parse, agree.
fn assert_splits_alike(sql: &str) -> Result<(), TestCaseError> {
    let pg = postgres_split(sql)
        .map_err(|e| TestCaseError::fail(format!("PostgreSQL refuses {sql:?}: {e}")))?;
    let ours = dblock_split(sql);
    prop_assert_eq!(&ours, &pg, "split differently: {:?}", sql);
    checks::statements(sql);
    Ok(())
}

// ---------------------------------------------------------------------------------
// Generated SQL.

/// Text that may appear inside a literal or comment: everything that could end one
/// early if misread.
fn content() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            4 => "[a-zA-Z0-9 ]{1,4}",
            2 => prop::sample::select(vec![
                ";", "'", "\"", "$", "$$", "$a$", "\\", "--", "/*", "*/", "*", "/", "-", "\n",
                "(", ")", "E'", "é", "日", "\t", "BEGIN", "END", "CASE", "\u{a0}", "%", "\r\n",
            ]).prop_map(str::to_string),
        ],
        0..8,
    )
    .prop_map(|v| v.concat())
}

/// A standard string: `'…'` with `''` for a quote; a backslash is itself.
fn standard_string(c: String) -> String {
    format!("'{}'", c.replace('\'', "''"))
}

/// An escape string: `E'…'` with `\'`, `\\` and some `''`.
fn escape_string(c: String, upper: bool) -> String {
    let mut out = String::from(if upper { "E'" } else { "e'" });
    for (i, ch) in c.chars().enumerate() {
        match ch {
            '\'' if i % 2 == 0 => out.push_str("\\'"),
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// A dollar-quoted string with a tag its content does not hold.
fn dollar_string(c: String, tag: &str) -> String {
    let delim = format!("${tag}$");
    let body = c.replace(&delim, "");
    // The body must not end in a way that joins the closing delimiter to a tag.
    format!("{delim}{body} {delim}")
}

/// A quoted identifier: `"…"` with `""` for a quote (never empty).
fn quoted_ident(c: String) -> String {
    format!("\"x{}\"", c.replace('"', "\"\""))
}

/// A comment: `/* … */` (nested, balanced) or `-- …` to the end of the line.
fn comment() -> impl Strategy<Value = String> {
    (content(), content(), 0u8..3).prop_map(|(a, b, kind)| {
        // Comment text must not open or close a comment of its own, except as nested.
        let clean = |s: &str| s.replace("/*", "/ *").replace("*/", "* /");
        let (a, b) = (clean(&a), clean(&b));
        match kind {
            0 => format!("/* {a} */"),
            1 => format!("/* {a} /* {b} */ {a} */"),
            _ => format!("-- {}\n", a.replace(['\n', '\r'], " ")),
        }
    })
}

/// Whitespace and comments between tokens.
fn gap() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(vec![" ", "  ", "\n", "\t", "\r\n", " \x0c ", " \x0b "])
            .prop_map(str::to_string),
        1 => (comment(), prop::sample::select(vec![" ", "\n"]))
            .prop_map(|(c, w)| format!(" {c}{w}")),
    ]
}

/// A character string constant (what `COMMENT … IS` takes).
fn string() -> impl Strategy<Value = String> {
    prop_oneof![
        content().prop_map(standard_string),
        (content(), any::<bool>()).prop_map(|(c, u)| escape_string(c, u)),
        content().prop_map(|c| dollar_string(c, "")),
    ]
}

fn literal() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => content().prop_map(standard_string),
        3 => (content(), any::<bool>()).prop_map(|(c, u)| escape_string(c, u)),
        3 => (content(), prop::sample::select(vec!["", "fn", "body", "a_1", "X"]))
            .prop_map(|(c, t)| dollar_string(c, t)),
        1 => content().prop_map(|c| format!("N{}", standard_string(c))),
        1 => content().prop_map(|c| format!("U&{}", standard_string(c.replace('\\', "")))),
        1 => Just("B'1010'".to_string()),
        1 => Just("X'1F'".to_string()),
        1 => Just("1.5e3".to_string()),
        1 => Just("$1".to_string()),
    ]
}

fn expr() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        3 => literal(),
        1 => content().prop_map(quoted_ident),
        1 => prop::sample::select(vec!["a", "a$b", "_x1", "t.a", "begin_at", "end_of", "\"end\""])
            .prop_map(str::to_string),
    ];
    leaf.prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            (inner.clone(), gap(), inner.clone()).prop_map(|(a, g, b)| format!("{a} ||{g}{b}")),
            inner.clone().prop_map(|a| format!("({a})")),
            (inner.clone(), inner.clone())
                .prop_map(|(a, b)| format!("CASE WHEN {a} IS NULL THEN {b} ELSE 1 END")),
            (inner.clone(), inner).prop_map(|(a, b)| format!("ARRAY[{a}, {b}]")),
        ]
    })
}

/// A statement inside a `BEGIN ATOMIC … END` body.
fn body_statement() -> impl Strategy<Value = String> {
    prop_oneof![
        expr().prop_map(|e| format!("SELECT {e}")),
        expr().prop_map(|e| format!("INSERT INTO t VALUES ({e})")),
        expr().prop_map(|e| format!("SELECT CASE WHEN true THEN {e} END")),
    ]
}

/// A statement PostgreSQL parses.
fn statement() -> impl Strategy<Value = String> {
    let plpgsql = || {
        prop::collection::vec(expr(), 1..4).prop_map(|es| {
            es.iter()
                .map(|e| format!("PERFORM {e};"))
                .collect::<Vec<_>>()
                .join(" ")
        })
    };
    prop_oneof![
        4 => (prop::collection::vec(expr(), 1..4), gap())
            .prop_map(|(es, g)| format!("SELECT{g}{} FROM t", es.join(", "))),
        2 => (expr(), gap()).prop_map(|(e, g)| format!("INSERT INTO t{g}VALUES ({e})")),
        1 => (literal(), gap()).prop_map(|(l, g)| format!("CREATE TABLE t (a text DEFAULT {l},{g}b int)")),
        1 => string().prop_map(|l| format!("COMMENT ON TABLE t IS {l}")),
        // Tags no literal inside uses (a body holding its own delimiter is not SQL).
        2 => (plpgsql(), prop::sample::select(vec!["$do$", "$outer$", "$Q1$"]))
            .prop_map(|(b, d)| format!("DO {d} BEGIN {b} END {d}")),
        2 => (plpgsql(), prop::sample::select(vec!["$fbody$", "$outer$"]), any::<bool>())
            .prop_map(|(b, d, replace)| format!(
                "CREATE {}FUNCTION f() RETURNS int LANGUAGE plpgsql AS {d} BEGIN {b} RETURN 1; END {d}",
                if replace { "OR REPLACE " } else { "" }
            )),
        2 => (prop::collection::vec(body_statement(), 1..4), any::<bool>(), gap())
            .prop_map(|(stmts, function, g)| {
                let body: String = stmts.iter().map(|s| format!("{s};{g}")).collect();
                if function {
                    format!("CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC {body}END")
                } else {
                    format!("CREATE PROCEDURE p() LANGUAGE sql BEGIN ATOMIC {body}END")
                }
            }),
        1 => expr().prop_map(|e| format!(
            "CREATE FUNCTION f() RETURNS int LANGUAGE sql RETURN CASE WHEN {e} IS NULL THEN 1 END"
        )),
        1 => (expr(), expr()).prop_map(|(a, b)| format!(
            "CREATE RULE r AS ON INSERT TO t DO ALSO (INSERT INTO a VALUES ({a}); INSERT INTO b VALUES ({b}))"
        )),
        1 => prop::sample::select(vec![
            "BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT s", "START TRANSACTION",
            "CREATE INDEX CONCURRENTLY i ON t (a)", "VACUUM t", "SET search_path = a, \"b;c\"",
            "CREATE TRIGGER tr AFTER INSERT ON t FOR EACH ROW EXECUTE FUNCTION f()",
        ]).prop_map(str::to_string),
    ]
}

/// A script: statements with whitespace, comments, empty statements and comment-only
/// pieces between them, the last `;` sometimes left out.
fn script() -> impl Strategy<Value = String> {
    (
        prop::collection::vec((gap(), statement(), gap(), 0u8..6), 1..6),
        any::<bool>(),
        gap(),
    )
        .prop_map(|(parts, last_semicolon, tail)| {
            let mut s = String::new();
            let n = parts.len();
            for (i, (before, st, after, extra)) in parts.into_iter().enumerate() {
                s.push_str(&before);
                s.push_str(&st);
                s.push_str(&after);
                if i + 1 < n || last_semicolon {
                    s.push(';');
                    match extra {
                        0 => s.push_str(";;"),
                        1 => s.push_str(" /* only a comment */ ;"),
                        2 => s.push_str(" -- a line comment ;\n"),
                        _ => {}
                    }
                } else if extra == 2 {
                    // No `;` after the last statement: a trailing line comment ends the line.
                    s.push('\n');
                }
            }
            s.push_str(&tail);
            s
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Generated scripts are cut where PostgreSQL's parser cuts them.
    #[test]
    fn generated_scripts_split_as_postgresql_splits_them(sql in script()) {
        assert_splits_alike(&sql)?;
    }
}

/// PostgreSQL's own catalog and extension scripts (`tests/sql/`, copied from the
/// PostgreSQL 15 server package: see `tests/sql/README.md`) split alike.
#[test]
fn real_world_scripts_split_as_postgresql_splits_them() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sql");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.map(|e| e.path()).unwrap_or_else(|e| panic!("{e}")))
        .filter(|p| p.extension().is_some_and(|x| x == "sql"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "the real-world scripts are missing: {files:?}"
    );
    let mut statements = 0;
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        // Extension scripts start with a psql meta-command and name their schema by a
        // placeholder `CREATE EXTENSION` fills in; neither is SQL.
        let sql: String = text
            .lines()
            .filter(|l| !l.starts_with('\\'))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
            .replace("@extschema@", "public");
        let pg = postgres_split(&sql).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let ours = dblock_split(&sql);
        assert_eq!(ours.len(), pg.len(), "{}: statement counts", f.display());
        for (a, b) in ours.iter().zip(&pg) {
            assert_eq!(a, b, "{}", f.display());
        }
        checks::statements(&sql);
        statements += pg.len();
    }
    assert!(statements > 800, "only {statements} statements compared");
}

/// Inputs on which the two splits once differed: each was a bug in dblock's splitter.
#[test]
fn scripts_that_once_split_differently_now_split_alike() {
    for sql in [
        // A vertical tab is whitespace to PostgreSQL: the piece after the last `;` holds
        // nothing (dblock sent an empty statement).
        "SELECT 1;\x0b",
        "SELECT 1;\x0b\x0b;SELECT 2",
        // A no-break space is an identifier character to PostgreSQL: trimming it off
        // changed the statement (`x\u{a0}` became `x`).
        "SELECT 1 AS x\u{a0}",
        "SELECT 1 AS x\u{a0}; SELECT 2",
    ] {
        let pg = postgres_split(sql).unwrap_or_else(|e| panic!("{sql:?}: {e}"));
        assert_eq!(dblock_split(sql), pg, "{sql:?}");
        // Compared exactly too: what is sent is the statement PostgreSQL sees.
        let exact: Vec<&str> = split_statements(sql);
        let pg_exact: Vec<String> = pg_query::split_with_parser(sql)
            .unwrap_or_else(|e| panic!("{e}"))
            .iter()
            .map(|s| s.trim_matches(PG_SPACE).to_string())
            .filter(|s| !s.is_empty())
            .collect();
        assert_eq!(exact, pg_exact, "{sql:?}");
        checks::statements(sql);
    }
}
