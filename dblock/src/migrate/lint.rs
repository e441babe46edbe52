//! Statements that cannot run inside a transaction, found in migrations that would run
//! in one: what the dry run warns about before anything runs.

use std::fmt;

use super::split;

/// A statement of a migration without the no-transaction header that cannot run inside
/// a transaction (found by [`Migration::transaction_hazards`](super::Migration::transaction_hazards)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hazard {
    /// The statement's position in the file, from 1.
    pub statement: usize,
    /// What it is: `CREATE INDEX CONCURRENTLY`, `VACUUM`…
    pub what: &'static str,
    /// For statements that run in a transaction from some PostgreSQL version on
    /// (`ALTER TYPE … ADD VALUE`, from 12): that version's `server_version_num`.
    pub until_server_version: Option<u32>,
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "statement {} is {}, which cannot run inside a transaction",
            self.statement, self.what
        )?;
        if let Some(v) = self.until_server_version {
            write!(f, " before PostgreSQL {}", v / 10_000)?;
        }
        Ok(())
    }
}

/// The words of a statement, upper-cased, comments skipped, up to `n` of them.
fn words(stmt: &str, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = stmt;
    while out.len() < n {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix("--") {
            rest = r.split_once('\n').map_or("", |(_, after)| after);
            continue;
        }
        if let Some(r) = rest.strip_prefix("/*") {
            rest = r.split_once("*/").map_or("", |(_, after)| after);
            continue;
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            // Punctuation or a quoted name: keep it as one word of its own.
            let c = rest.chars().next();
            match c {
                None => break,
                Some('"') => {
                    let close = rest[1..].find('"').map_or(rest.len(), |i| i + 2);
                    out.push(rest[..close].to_string());
                    rest = &rest[close..];
                }
                Some(c) => {
                    out.push(c.to_string());
                    rest = &rest[c.len_utf8()..];
                }
            }
            continue;
        }
        out.push(rest[..end].to_ascii_uppercase());
        rest = &rest[end..];
    }
    out
}

/// What `stmt` is, if it cannot run inside a transaction (on some server version).
fn hazard(stmt: &str) -> Option<(&'static str, Option<u32>)> {
    let w = words(stmt, 64);
    let at = |i: usize, s: &str| w.get(i).is_some_and(|x| x == s);
    let has = |s: &str| w.iter().any(|x| x == s);
    if at(0, "CREATE") {
        let i = if at(1, "UNIQUE") { 2 } else { 1 };
        if at(i, "INDEX") && at(i + 1, "CONCURRENTLY") {
            return Some(("CREATE INDEX CONCURRENTLY", None));
        }
        if at(1, "DATABASE") {
            return Some(("CREATE DATABASE", None));
        }
        if at(1, "TABLESPACE") {
            return Some(("CREATE TABLESPACE", None));
        }
    }
    if at(0, "DROP") {
        if at(1, "INDEX") && at(2, "CONCURRENTLY") {
            return Some(("DROP INDEX CONCURRENTLY", None));
        }
        if at(1, "DATABASE") {
            return Some(("DROP DATABASE", None));
        }
        if at(1, "TABLESPACE") {
            return Some(("DROP TABLESPACE", None));
        }
    }
    if at(0, "REINDEX") && has("CONCURRENTLY") {
        return Some(("REINDEX CONCURRENTLY", None));
    }
    if at(0, "VACUUM") {
        return Some(("VACUUM", None));
    }
    if at(0, "ALTER") && at(1, "SYSTEM") {
        return Some(("ALTER SYSTEM", None));
    }
    if at(0, "ALTER") && at(1, "TABLE") && has("DETACH") && has("CONCURRENTLY") {
        return Some(("ALTER TABLE … DETACH PARTITION … CONCURRENTLY", None));
    }
    if at(0, "ALTER") && at(1, "TYPE") {
        // ALTER TYPE name ADD VALUE … (name may be qualified or quoted).
        let add = w.iter().position(|x| x == "ADD");
        if add.is_some_and(|i| at(i + 1, "VALUE")) {
            return Some(("ALTER TYPE … ADD VALUE", Some(120_000)));
        }
    }
    None
}

/// The hazards of `sql` run as one transaction; `server_version_num` (when known) drops
/// those the server allows in a transaction.
pub(crate) fn hazards(sql: &str, server_version_num: Option<u32>) -> Vec<Hazard> {
    split::split(sql)
        .iter()
        .enumerate()
        .filter_map(|(i, stmt)| {
            let (what, until) = hazard(stmt)?;
            if let (Some(until), Some(v)) = (until, server_version_num)
                && v >= until
            {
                return None;
            }
            Some(Hazard {
                statement: i + 1,
                what,
                until_server_version: until,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(sql: &str, v: Option<u32>) -> Vec<(usize, &'static str)> {
        hazards(sql, v)
            .into_iter()
            .map(|h| (h.statement, h.what))
            .collect()
    }

    #[test]
    fn statements_that_cannot_run_in_a_transaction_are_found() {
        let sql = "CREATE TABLE t (x int);\n\
                   create unique index /* c */ concurrently t_x ON t (x);\n\
                   -- CREATE INDEX CONCURRENTLY in a comment\n\
                   CREATE INDEX t_y ON t (x);\n\
                   DROP INDEX CONCURRENTLY IF EXISTS t_z;\n\
                   ALTER TYPE \"Mood\" ADD VALUE IF NOT EXISTS 'meh';\n\
                   ALTER TYPE mood RENAME VALUE 'a' TO 'b';\n\
                   vacuum analyze t;\n\
                   SELECT 'VACUUM';\n\
                   REINDEX INDEX CONCURRENTLY t_x;\n\
                   DO $$ BEGIN EXECUTE 'VACUUM'; END $$;";
        assert_eq!(
            found(sql, None),
            [
                (2, "CREATE INDEX CONCURRENTLY"),
                (4, "DROP INDEX CONCURRENTLY"),
                (5, "ALTER TYPE … ADD VALUE"),
                (7, "VACUUM"),
                (9, "REINDEX CONCURRENTLY"),
            ]
        );
        // PostgreSQL 12 and later run ADD VALUE in a transaction.
        assert_eq!(found(sql, Some(160_004)).len(), 4);
        assert_eq!(found(sql, Some(110_022)).len(), 5);
        let h = &hazards("ALTER TYPE m ADD VALUE 'x'", None)[0];
        assert_eq!(
            h.to_string(),
            "statement 1 is ALTER TYPE … ADD VALUE, which cannot run inside a transaction \
             before PostgreSQL 12"
        );
        assert!(found("CREATE INDEX i ON t (x); VACUUMX;", None).is_empty());
    }
}
