//! Reverting applied migrations with their `.down.sql`, newest first, under the
//! migration lock ([`Runner::revert`](super::Runner::revert)).

use std::collections::HashSet;

use super::plan::Record;
use super::set::Migration;
use crate::error::Error;

/// The migrations to revert, newest first: the latest applied one, or with `to` every
/// applied one above version `to`. Refuses before anything runs when one of them is not
/// in the set, has no `.down.sql`, or changed since it was applied.
pub(crate) fn targets<'s>(
    set: &'s [Migration],
    records: &[Record],
    to: Option<i64>,
) -> Result<Vec<&'s Migration>, Error> {
    let mut applied: Vec<&Record> = records.iter().collect();
    applied.sort_by_key(|r| std::cmp::Reverse(r.version));
    let chosen: Vec<&Record> = match to {
        None => applied.into_iter().take(1).collect(),
        Some(to) => applied.into_iter().filter(|r| r.version > to).collect(),
    };
    let mut missing = Vec::new();
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for r in chosen {
        if !seen.insert(r.version) {
            continue;
        }
        let Some(m) = set
            .binary_search_by_key(&r.version, Migration::version)
            .ok()
            .and_then(|i| set.get(i))
        else {
            missing.push(format!("{} ({})", r.version, r.name));
            continue;
        };
        if m.checksum() != r.checksum {
            return Err(Error::MigrationEdited {
                file: m.file().to_string(),
                version: m.version(),
                applied_checksum: r.checksum.clone(),
                checksum: m.checksum().to_string(),
            });
        }
        if m.down_sql().is_none() {
            return Err(Error::InvalidMigration {
                file: m.file().to_string(),
                reason: "cannot revert it: it has no .down.sql (a reversible migration is \
                         a VERSION_NAME.up.sql with its VERSION_NAME.down.sql)"
                    .into(),
            });
        }
        out.push(m);
    }
    if !missing.is_empty() {
        return Err(Error::UnknownMigrations { missing });
    }
    Ok(out)
}

/// The error of `m`'s `.down.sql` failing.
pub(crate) fn failed(m: &Migration, statement: Option<(usize, usize)>, e: Error) -> Error {
    Error::MigrationFailed {
        file: m.down_file().unwrap_or(m.file()).to_string(),
        version: m.version(),
        name: m.name().to_string(),
        statement,
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::Migrations;

    fn rec(m: &Migration) -> Record {
        Record {
            version: m.version(),
            name: m.name().into(),
            checksum: m.checksum().into(),
            ..Record::default()
        }
    }

    #[test]
    fn reverts_go_newest_first_and_refuse_up_front() {
        let set = Migrations::from_sources([
            ("1_a.up.sql", "CREATE TABLE a (x int)"),
            ("1_a.down.sql", "DROP TABLE a"),
            ("2_b.sql", "CREATE TABLE b (x int)"),
            ("3_c.up.sql", "CREATE TABLE c (x int)"),
            ("3_c.down.sql", "DROP TABLE c"),
            ("4_d.up.sql", "CREATE TABLE d (x int)"),
            ("4_d.down.sql", "DROP TABLE d"),
        ])
        .unwrap();
        let set = set.checked().unwrap();
        let v = |t: Vec<&Migration>| t.iter().map(|m| m.version()).collect::<Vec<_>>();
        let three: Vec<Record> = [0, 2, 1].iter().map(|&i| rec(&set[i])).collect();
        assert_eq!(v(targets(set, &three, None).unwrap()), [3]);
        assert_eq!(v(targets(set, &three, Some(2)).unwrap()), [3]);
        assert!(targets(set, &[], None).unwrap().is_empty());
        // 2_b has no down: refused before anything runs.
        let e = targets(set, &three, Some(0)).unwrap_err().to_string();
        assert!(
            e.starts_with("2_b.sql: cannot revert it: it has no .down.sql"),
            "{e}"
        );
        let mut edited = three.clone();
        edited[1].checksum = "x".into(); // version 3, the latest
        assert!(matches!(
            targets(set, &edited, None),
            Err(Error::MigrationEdited { version: 3, .. })
        ));
        let mut unknown = three;
        unknown.push(Record {
            version: 9,
            name: "gone".into(),
            checksum: "x".into(),
            ..Record::default()
        });
        assert!(matches!(
            targets(set, &unknown, Some(3)),
            Err(Error::UnknownMigrations { .. })
        ));
    }
}
