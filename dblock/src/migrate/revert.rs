//! Reverting applied migrations with their `.down.sql`, newest first, under the
//! migration lock ([`Runner::revert`](super::Runner::revert)).

use std::collections::HashSet;

use super::{Migration, Record};
use crate::Error;

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
fn failed(m: &Migration, statement: Option<(usize, usize)>, e: Error) -> Error {
    Error::MigrationFailed {
        file: m.down_file().unwrap_or(m.file()).to_string(),
        version: m.version(),
        name: m.name().to_string(),
        statement,
        source: Box::new(e),
    }
}

#[cfg(feature = "postgres")]
pub(crate) mod pg {
    //! Reverting on PostgreSQL: the lock waited for without a snapshot, then each
    //! `.down.sql` with the deletion of its rows (dblock's, and sqlx's if sqlx's table
    //! exists, so that a later run does not adopt it again) in one transaction, or
    //! statement by statement for a no-transaction `.down.sql`.

    use std::time::Instant;

    use super::{failed, targets};
    use crate::Error;
    use crate::migrate::adopt::{self, SQLX_TABLE};
    use crate::migrate::pg::{self, q};
    use crate::migrate::set::file_name_of;
    use crate::migrate::split::split;
    use crate::migrate::{Applied, MIGRATION_LOCK_KEY, Migration};
    use crate::postgres::{Armed, PgBackend, first_value};

    pub(crate) async fn revert(
        b: &PgBackend,
        set: &[Migration],
        to: Option<i64>,
        on_reverted: &mut (dyn FnMut(&Applied) + Send),
    ) -> Result<Vec<Applied>, Error> {
        b.refuse_behind_pooler("a migration revert", pg::POOLER_FIX)?;
        let table = pg::table(b)?;
        let armed = Armed::new(b.pinned().await?);
        pg::wait_for_lock(&armed, None).await?;
        q(&armed, &pg::create_table(&table)).await?;
        let mut records = pg::read_records(&armed, &table).await?;
        let history = adopt::pg::history(&armed).await?;
        let adopted = crate::migrate::adopt_or_refuse(set, &mut records, &history)?;
        let todo = targets(set, &records, to)?;
        adopt::pg::record(&armed, &table, &adopted).await?;
        let sqlx = !history.sqlx.is_empty()
            || first_value(
                &q(
                    &armed,
                    &format!("SELECT to_regclass('{SQLX_TABLE}') IS NOT NULL"),
                )
                .await?,
                0,
            )
            .as_deref()
                == Some("t");
        let mut done = Vec::new();
        for m in todo {
            let mut delete = format!("DELETE FROM {table} WHERE version = {}", m.version());
            if sqlx {
                delete.push_str(&format!(
                    "; DELETE FROM {SQLX_TABLE} WHERE version = {}",
                    m.version()
                ));
            }
            let down = m.down_sql().unwrap_or_default();
            let t0 = Instant::now();
            if m.down_no_transaction() {
                let statements = split(down);
                let n = statements.len();
                for (i, stmt) in statements.iter().enumerate() {
                    q(&armed, stmt)
                        .await
                        .map_err(|e| failed(m, Some((i + 1, n)), e))?;
                }
                q(&armed, &delete).await.map_err(|e| failed(m, None, e))?;
            } else {
                let fail = |e| failed(m, None, e);
                q(&armed, "BEGIN ISOLATION LEVEL READ COMMITTED")
                    .await
                    .map_err(fail)?;
                q(&armed, down).await.map_err(fail)?;
                q(&armed, &format!("{delete}; COMMIT"))
                    .await
                    .map_err(fail)?;
            }
            let reverted = Applied {
                version: m.version(),
                name: m.name().to_string(),
                file_name: m
                    .down_file()
                    .map_or(m.file_name(), file_name_of)
                    .to_string(),
                duration: t0.elapsed(),
                no_transaction: m.down_no_transaction(),
            };
            on_reverted(&reverted);
            done.push(reverted);
        }
        let unlocked = q(
            &armed,
            &format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"),
        )
        .await?;
        if first_value(&unlocked, 0).as_deref() == Some("t") {
            armed.disarm().recycle();
        }
        Ok(done)
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
            applied_at: String::new(),
            duration_ms: 0,
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
            applied_at: String::new(),
            duration_ms: 0,
        });
        assert!(matches!(
            targets(set, &unknown, Some(3)),
            Err(Error::UnknownMigrations { .. })
        ));
    }
}
