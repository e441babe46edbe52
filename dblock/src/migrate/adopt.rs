//! Adopting the history another migration tool keeps, so that a database that tool
//! migrated is never migrated again.
//!
//! - **sqlx** (`_sqlx_migrations`, found through the `search_path` as sqlx finds it on
//!   PostgreSQL; in the database file on SQLite):
//!   adopted by every run, under the migration lock, before anything is applied. Each
//!   version sqlx applied that `dblock_migrations` lacks is verified against the file's
//!   SHA-384 (sqlx's checksum) and recorded as applied, with sqlx's `installed_on` and
//!   `execution_time`. If any file differs from what sqlx applied, or sqlx left a
//!   version failed (`success = false`), the run refuses and changes nothing, naming
//!   every such file; `dblock migrate baseline DIR` adopts the history with the files as
//!   they are.
//! - On PostgreSQL, **golang-migrate** (`schema_migrations` with its `dirty` column), **Flyway**
//!   (`flyway_schema_history`), **refinery** (`refinery_schema_history`) and **goose**
//!   (`goose_db_version`): their histories carry no checksums dblock can verify, so a
//!   run on a database where one of them has applied migrations and `dblock_migrations`
//!   records none refuses, changing nothing, and names the command that adopts:
//!   `dblock migrate baseline DIR --to VERSION`, with the latest version that tool
//!   applied.

use std::collections::{BTreeSet, HashSet};

use sha2::{Digest, Sha384};

use super::plan::Record;
use super::set::Migration;
use crate::error::Error;

/// sqlx's history table.
pub(crate) const SQLX_TABLE: &str = "_sqlx_migrations";

/// One row of `_sqlx_migrations`.
#[derive(Debug, Clone)]
pub(crate) struct SqlxRow {
    pub(crate) version: i64,
    pub(crate) description: String,
    /// RFC 3339, UTC.
    pub(crate) installed_on: String,
    pub(crate) success: bool,
    /// Lowercase hex.
    pub(crate) checksum: String,
    /// Nanoseconds; -1 when sqlx did not get to record it.
    pub(crate) execution_time: i64,
}

/// Another tool's history, without checksums to verify.
#[derive(Debug, Clone)]
pub(crate) struct OtherTool {
    pub(crate) tool: &'static str,
    pub(crate) table: &'static str,
    /// The latest version it applied.
    pub(crate) version: i64,
    /// It left that version half-applied (golang-migrate's `dirty`).
    pub(crate) dirty: bool,
}

/// What other tools recorded in the database.
#[derive(Debug, Clone, Default)]
pub(crate) struct History {
    pub(crate) sqlx: Vec<SqlxRow>,
    /// sqlx's history table exists (it may be empty).
    pub(crate) sqlx_table: bool,
    pub(crate) others: Vec<OtherTool>,
}

/// dblock's records set beside another tool's history.
#[derive(Debug, Default)]
pub(crate) struct Reconciled {
    /// Versions sqlx applied, the set has with the same checksum, and dblock lacks:
    /// to record as applied.
    pub(crate) adopt: Vec<Record>,
    /// Versions sqlx applied whose file differs now: records that show as edited.
    pub(crate) differing: Vec<Record>,
    /// Versions sqlx applied that the set lacks: records that show as unknown.
    pub(crate) unknown: Vec<Record>,
    /// Why the history cannot be adopted as it stands, one line a file.
    pub(crate) problems: Vec<String>,
}

/// How to read sqlx's history: its table, and how its checksums were computed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sqlx<'a> {
    /// The table, as SQL names it (sqlx.toml's `table-name`).
    pub(crate) table: &'a str,
    /// The characters sqlx.toml's `ignored-chars` leaves out of the checksum; `None`
    /// when not known (no sqlx.toml): the file's own SHA-384, or the one without
    /// whitespace and byte-order marks (the set sqlx's documentation suggests), match.
    pub(crate) ignored_chars: Option<&'a BTreeSet<char>>,
}

#[cfg(test)]
impl Sqlx<'static> {
    /// sqlx's defaults, with the checksum's ignored characters not known.
    pub(crate) const DEFAULT: Sqlx<'static> = Sqlx {
        table: SQLX_TABLE,
        ignored_chars: None,
    };
}

/// The whitespace set of sqlx's documentation (and its reference sqlx.toml).
const WHITESPACE: [char; 5] = [' ', '\t', '\r', '\n', '\u{feff}'];

/// Whether sqlx's checksum `hex` is the file's, as sqlx computes it with `ignored`.
pub(crate) fn sqlx_matches(m: &Migration, hex: &str, ignored: Option<&BTreeSet<char>>) -> bool {
    match ignored {
        Some(set) => sqlx_checksum(m.sql(), |c| set.contains(&c)) == hex,
        None => {
            m.sqlx_checksum() == hex || sqlx_checksum(m.sql(), |c| WHITESPACE.contains(&c)) == hex
        }
    }
}

/// sqlx's checksum of `sql` with the characters `ignored` picks left out: the SHA-384 of
/// what remains (sqlx's `checksum_fragments`), in lowercase hex.
pub(crate) fn sqlx_checksum(sql: &str, ignored: impl Fn(char) -> bool) -> String {
    let mut d = Sha384::new();
    for piece in sql.split(ignored) {
        d.update(piece.as_bytes());
    }
    super::set::hex(&d.finalize())
}

fn millis_of_nanos(ns: i64) -> i64 {
    if ns < 0 { 0 } else { ns / 1_000_000 }
}

/// Sets dblock's `records` beside `history`: what to adopt, what differs, what the set
/// lacks. Versions dblock already records are dblock's, whatever sqlx says.
pub(crate) fn reconcile(
    set: &[Migration],
    records: &[Record],
    history: &History,
    sqlx: Sqlx<'_>,
) -> Reconciled {
    let recorded: HashSet<i64> = records.iter().map(|r| r.version).collect();
    let mut out = Reconciled::default();
    for row in &history.sqlx {
        if recorded.contains(&row.version) {
            continue;
        }
        let found = set
            .binary_search_by_key(&row.version, Migration::version)
            .ok()
            .and_then(|i| set.get(i));
        if !row.success {
            out.problems.push(format!(
                "version {} ({}): sqlx recorded it as failed (success = false), so it may be \
                 half-applied; repair the database and the row first",
                row.version, row.description
            ));
            continue;
        }
        let record = |checksum: String, name: String| Record {
            version: row.version,
            name,
            checksum,
            applied_at: row.installed_on.clone(),
            duration_ms: millis_of_nanos(row.execution_time),
            ..Record::default()
        };
        match found {
            Some(m) if sqlx_matches(m, &row.checksum, sqlx.ignored_chars) => out
                .adopt
                .push(record(m.checksum().to_string(), m.name().to_string())),
            Some(m) => {
                out.problems.push(format!(
                    "{} differs from what sqlx applied (sqlx's checksum {}…, the file's {}…)",
                    m.file(),
                    row.checksum.get(..12).unwrap_or(&row.checksum),
                    m.sqlx_checksum().get(..12).unwrap_or_default()
                ));
                out.differing.push(record(
                    format!("sqlx:{}", row.checksum),
                    m.name().to_string(),
                ));
            }
            None => out.unknown.push(record(
                format!("sqlx:{}", row.checksum),
                row.description.replace(' ', "_"),
            )),
        }
    }
    out
}

/// The refusal of a run for `history`, if any: a sqlx history that cannot be adopted
/// as it stands, or another tool's history on a database where dblock records nothing.
pub(crate) fn refusal(
    records: &[Record],
    history: &History,
    r: &Reconciled,
    sqlx: Sqlx<'_>,
) -> Option<Error> {
    if !r.problems.is_empty() {
        return Some(Error::ForeignHistory {
            table: sqlx.table.into(),
            reason: format!(
                "sqlx's history cannot be adopted as it stands: {}",
                r.problems.join("; ")
            ),
            adopt_with: "restore the files as sqlx applied them, or accept them as they are \
                         now with `dblock migrate baseline DIR`"
                .into(),
        });
    }
    if !records.is_empty() || !history.sqlx.is_empty() {
        return None;
    }
    let other = history.others.first()?;
    let reason = if other.dirty {
        format!(
            "{} left version {} dirty (half-applied); repair it first. dblock_migrations \
             records nothing, and dblock does not re-apply what another tool applied",
            other.tool, other.version
        )
    } else {
        format!(
            "{}'s history says migrations up to version {} are applied and dblock_migrations \
             records nothing; dblock does not re-apply what another tool applied, and this \
             history has no checksums to verify the files against",
            other.tool, other.version
        )
    };
    Some(Error::ForeignHistory {
        table: other.table.into(),
        reason,
        adopt_with: format!("dblock migrate baseline DIR --to {}", other.version),
    })
}

/// Baseline's choice: the set's migrations to record as applied without running them.
/// With `to`, every migration up to that version; without, those sqlx applied (files
/// that differ included: baseline accepts them as they are).
pub(crate) fn baseline(
    set: &[Migration],
    records: &[Record],
    history: &History,
    to: Option<i64>,
    sqlx: Sqlx<'_>,
) -> Result<Vec<Record>, Error> {
    let recorded: HashSet<i64> = records.iter().map(|r| r.version).collect();
    let now = |m: &Migration| Record {
        version: m.version(),
        name: m.name().to_string(),
        checksum: m.checksum().to_string(),
        ..Record::default()
    };
    if let Some(to) = to {
        return Ok(set
            .iter()
            .filter(|m| m.version() <= to && !recorded.contains(&m.version()))
            .map(now)
            .collect());
    }
    if history.sqlx.is_empty() {
        return Err(Error::invalid_request(format!(
            "no {} to adopt from: give the latest version already applied \
             (--to VERSION), and every migration up to it is recorded as applied{}",
            sqlx.table,
            history
                .others
                .first()
                .map(|o| format!(" ({} says {})", o.tool, o.version))
                .unwrap_or_default()
        )));
    }
    let r = reconcile(set, records, history, sqlx);
    let by_version = |v: i64| {
        set.binary_search_by_key(&v, Migration::version)
            .ok()
            .and_then(|i| set.get(i))
    };
    let mut rows: Vec<Record> = r
        .adopt
        .into_iter()
        .chain(r.differing.into_iter().filter_map(|mut d| {
            // Accepted as it is now: the file's own checksum.
            d.checksum = by_version(d.version)?.checksum().to_string();
            Some(d)
        }))
        .collect();
    rows.sort_by_key(|r| r.version);
    Ok(rows)
}

/// Sets another tool's `history` beside dblock's `records`: refuses if it cannot be
/// adopted as it stands; otherwise adds to `records` what the other tool applied, and
/// returns the rows to record (see [the module](self)).
pub(crate) fn adopt(
    set: &[Migration],
    records: &mut Vec<Record>,
    history: &History,
    sqlx: Sqlx<'_>,
) -> Result<Vec<Record>, Error> {
    let r = reconcile(set, records, history, sqlx);
    if let Some(e) = refusal(records, history, &r, sqlx) {
        return Err(e);
    }
    records.extend(r.adopt.iter().cloned().chain(r.unknown));
    Ok(r.adopt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::Migrations;

    fn row(version: i64, sql: &str, success: bool) -> SqlxRow {
        SqlxRow {
            version,
            description: format!("d {version}"),
            installed_on: "2026-01-01T00:00:00.000Z".into(),
            success,
            checksum: super::super::set::hex(&Sha384::digest(sql.as_bytes())),
            execution_time: 2_000_000,
        }
    }

    #[test]
    fn sqlxs_history_is_adopted_when_every_checksum_matches_and_refused_naming_each_file_that_differs()
     {
        let set = Migrations::from_sources([
            ("m/1_a.sql", "SELECT 1;"),
            ("m/2_b.up.sql", "SELECT 2;"),
            ("m/2_b.down.sql", "SELECT -2;"),
            ("m/3_c.sql", "SELECT 3;"),
            ("m/4_d.sql", "SELECT 4;"),
        ])
        .unwrap();
        let set = set.checked().unwrap();
        let h = History {
            sqlx: vec![
                row(1, "SELECT 1;", true),
                row(2, "SELECT 2;", true),
                row(9, "x", true),
            ],
            ..History::default()
        };
        let r = reconcile(set, &[], &h, Sqlx::DEFAULT);
        assert_eq!(
            r.adopt.iter().map(|r| r.version).collect::<Vec<_>>(),
            [1, 2]
        );
        assert_eq!(
            r.adopt[0].checksum,
            set[0].checksum(),
            "dblock's checksum is recorded"
        );
        assert_eq!(r.adopt[0].duration_ms, 2);
        assert_eq!(r.unknown.iter().map(|r| r.version).collect::<Vec<_>>(), [9]);
        assert!(refusal(&[], &h, &r, Sqlx::DEFAULT).is_none());

        // Whitespace-insensitive checksums (sqlx's ignored-chars) match too.
        let ws = History {
            sqlx: vec![row(1, "SELECT1;", true)],
            ..History::default()
        };
        assert_eq!(reconcile(set, &[], &ws, Sqlx::DEFAULT).adopt.len(), 1);

        let edited = History {
            sqlx: vec![
                row(1, "SELECT 1;", true),
                row(2, "SELECT 22;", true),
                row(3, "SELECT 33;", true),
                row(4, "SELECT 4;", false),
            ],
            ..History::default()
        };
        let r = reconcile(set, &[], &edited, Sqlx::DEFAULT);
        let e = refusal(&[], &edited, &r, Sqlx::DEFAULT).unwrap();
        assert!(e.is_bad_migration_set());
        let msg = e.to_string();
        for part in [
            "m/2_b.up.sql differs",
            "m/3_c.sql differs",
            "version 4 (d 4): sqlx recorded it as failed",
            "dblock migrate baseline DIR",
        ] {
            assert!(msg.contains(part), "{part}: {msg}");
        }
        // Baseline accepts the files as they are now.
        let b = baseline(set, &[], &edited, None, Sqlx::DEFAULT).unwrap();
        assert_eq!(b.iter().map(|r| r.version).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(b[1].checksum, set[1].checksum());
        let b = baseline(set, &[], &History::default(), Some(3), Sqlx::DEFAULT).unwrap();
        assert_eq!(b.len(), 3);
        assert!(baseline(set, &[], &History::default(), None, Sqlx::DEFAULT).is_err());
    }

    #[test]
    fn other_tools_histories_are_refused_with_the_command_that_adopts_them() {
        let h = History {
            sqlx: Vec::new(),
            sqlx_table: false,
            others: vec![OtherTool {
                tool: "golang-migrate",
                table: "schema_migrations",
                version: 20240105000000,
                dirty: false,
            }],
        };
        let e = refusal(&[], &h, &Reconciled::default(), Sqlx::DEFAULT)
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("schema_migrations: golang-migrate's history"),
            "{e}"
        );
        assert!(
            e.ends_with("(to adopt it: dblock migrate baseline DIR --to 20240105000000)"),
            "{e}"
        );
        // Once dblock records anything, the other history is the past.
        let rec = Record {
            version: 1,
            name: "a".into(),
            checksum: "x".into(),
            ..Record::default()
        };
        assert!(refusal(&[rec], &h, &Reconciled::default(), Sqlx::DEFAULT).is_none());
    }
}
