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

use std::collections::HashSet;

use sha2::{Digest, Sha384};

use super::{Migration, Record};
use crate::Error;

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

/// Whether sqlx's checksum `hex` is the file's: its SHA-384, or that of the file with
/// whitespace and byte-order marks left out (sqlx's `ignored-chars` setting, as its
/// documentation suggests it).
pub(crate) fn sqlx_matches(m: &Migration, hex: &str) -> bool {
    if m.sqlx_checksum() == hex {
        return true;
    }
    let mut d = Sha384::new();
    for piece in m
        .sql()
        .split([' ', '\t', '\r', '\n', '\u{feff}'])
        .filter(|p| !p.is_empty())
    {
        d.update(piece.as_bytes());
    }
    super::set::hex(&d.finalize()) == hex
}

fn millis_of_nanos(ns: i64) -> i64 {
    if ns < 0 { 0 } else { ns / 1_000_000 }
}

/// Sets dblock's `records` beside `history`: what to adopt, what differs, what the set
/// lacks. Versions dblock already records are dblock's, whatever sqlx says.
pub(crate) fn reconcile(set: &[Migration], records: &[Record], history: &History) -> Reconciled {
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
        };
        match found {
            Some(m) if sqlx_matches(m, &row.checksum) => out
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
pub(crate) fn refusal(records: &[Record], history: &History, r: &Reconciled) -> Option<Error> {
    if !r.problems.is_empty() {
        return Some(Error::ForeignHistory {
            table: SQLX_TABLE.into(),
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
pub(crate) fn baseline_records(
    set: &[Migration],
    records: &[Record],
    history: &History,
    to: Option<i64>,
) -> Result<Vec<Record>, Error> {
    let recorded: HashSet<i64> = records.iter().map(|r| r.version).collect();
    let now = |m: &Migration| Record {
        version: m.version(),
        name: m.name().to_string(),
        checksum: m.checksum().to_string(),
        applied_at: String::new(),
        duration_ms: 0,
    };
    if let Some(to) = to {
        return Ok(set
            .iter()
            .filter(|m| m.version() <= to && !recorded.contains(&m.version()))
            .map(now)
            .collect());
    }
    if history.sqlx.is_empty() {
        return Err(Error::Unsupported(format!(
            "no {SQLX_TABLE} to adopt from: give the latest version already applied \
             (--to VERSION), and every migration up to it is recorded as applied{}",
            history
                .others
                .first()
                .map(|o| format!(" ({} says {})", o.tool, o.version))
                .unwrap_or_default()
        )));
    }
    let r = reconcile(set, records, history);
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

#[cfg(feature = "postgres")]
pub(crate) mod pg {
    //! Reading other tools' histories on PostgreSQL, and recording adopted rows.

    use super::{History, OtherTool, SQLX_TABLE, SqlxRow};
    use crate::Error;
    use crate::migrate::pg::{self, q};
    use crate::migrate::{MIGRATION_LOCK_KEY, Migration, Record};
    use crate::postgres::{Armed, PgBackend, first_value, quote_literal};

    /// What other tools recorded, read through the session's `search_path` as those
    /// tools find their tables.
    pub(crate) async fn history(armed: &Armed) -> Result<History, Error> {
        let mut h = History::default();
        let found = q(
            armed,
            "SELECT concat_ws(',', \
               CASE WHEN to_regclass('_sqlx_migrations') IS NOT NULL THEN 'sqlx' END, \
               CASE WHEN EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = \
                 coalesce(to_regclass('schema_migrations'), 0) AND attname = 'dirty' \
                 AND NOT attisdropped) THEN 'golang-migrate' END, \
               CASE WHEN to_regclass('flyway_schema_history') IS NOT NULL THEN 'flyway' END, \
               CASE WHEN to_regclass('refinery_schema_history') IS NOT NULL THEN 'refinery' END, \
               CASE WHEN to_regclass('goose_db_version') IS NOT NULL THEN 'goose' END)",
        )
        .await?;
        let found = first_value(&found, 0).unwrap_or_default();
        for tool in found.split(',').filter(|t| !t.is_empty()) {
            match tool {
                "sqlx" => h.sqlx = sqlx_rows(armed).await?,
                "golang-migrate" => {
                    let rows = q(
                        armed,
                        "SELECT version::text || ' ' || dirty::text FROM schema_migrations \
                         ORDER BY version DESC LIMIT 1",
                    )
                    .await?;
                    if let Some(v) = first_value(&rows, 0) {
                        let (version, dirty) = v.split_once(' ').unwrap_or((&v, "false"));
                        if let Ok(version) = version.parse() {
                            h.others.push(OtherTool {
                                tool: "golang-migrate",
                                table: "schema_migrations",
                                version,
                                dirty: dirty == "true",
                            });
                        }
                    }
                }
                "flyway" => {
                    latest(
                        armed,
                        &mut h,
                        "Flyway",
                        "flyway_schema_history",
                        "SELECT max(version::numeric)::bigint::text FROM flyway_schema_history \
                     WHERE success AND version ~ '^[0-9]{1,18}$'",
                    )
                    .await?
                }
                "refinery" => {
                    latest(
                        armed,
                        &mut h,
                        "refinery",
                        "refinery_schema_history",
                        "SELECT max(version)::text FROM refinery_schema_history",
                    )
                    .await?
                }
                "goose" => {
                    latest(
                        armed,
                        &mut h,
                        "goose",
                        "goose_db_version",
                        "SELECT max(version_id)::text FROM goose_db_version WHERE is_applied \
                     AND version_id > 0",
                    )
                    .await?
                }
                _ => {}
            }
        }
        Ok(h)
    }

    async fn latest(
        armed: &Armed,
        h: &mut History,
        tool: &'static str,
        table: &'static str,
        sql: &str,
    ) -> Result<(), Error> {
        let rows = q(armed, sql).await?;
        if let Some(version) = first_value(&rows, 0).and_then(|v| v.parse().ok()) {
            h.others.push(OtherTool {
                tool,
                table,
                version,
                dirty: false,
            });
        }
        Ok(())
    }

    async fn sqlx_rows(armed: &Armed) -> Result<Vec<SqlxRow>, Error> {
        // One text column per row, the description last (it may hold anything).
        let rows = q(
            armed,
            &format!(
                "SELECT concat_ws(E'\\t', version, success, encode(checksum, 'hex'), \
                 execution_time, to_char(installed_on AT TIME ZONE 'UTC', \
                 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), description) \
                 FROM {SQLX_TABLE} ORDER BY version"
            ),
        )
        .await?;
        rows.first()
            .map(|rows| rows.iter().map(|r| parse(r.as_deref())).collect())
            .unwrap_or(Ok(Vec::new()))
    }

    fn parse(row: Option<&str>) -> Result<SqlxRow, Error> {
        let bad = || Error::Database {
            code: None,
            message: format!("unexpected row in {SQLX_TABLE}: {row:?}"),
        };
        let mut f = row.ok_or_else(bad)?.splitn(6, '\t');
        let mut next = || f.next().ok_or_else(bad);
        Ok(SqlxRow {
            version: next()?.parse().map_err(|_| bad())?,
            success: next()? == "t",
            checksum: next()?.to_string(),
            execution_time: next()?.parse().map_err(|_| bad())?,
            installed_on: next()?.to_string(),
            description: next()?.to_string(),
        })
    }

    /// [`history`] on a connection of its own, without the lock (status, dry runs).
    pub(crate) async fn history_unlocked(b: &PgBackend) -> Result<History, Error> {
        let armed = Armed::new(b.pinned().await?);
        let h = history(&armed).await?;
        armed.disarm().recycle();
        Ok(h)
    }

    /// `Runner::baseline` on PostgreSQL: under the migration lock (waited for without a
    /// snapshot), the table, then the rows. On any failure the connection is abandoned
    /// (its `Armed` drops), which releases the lock.
    pub(crate) async fn baseline(
        b: &PgBackend,
        set: &[Migration],
        to: Option<i64>,
    ) -> Result<Vec<i64>, Error> {
        b.refuse_behind_pooler("a migration baseline", pg::POOLER_FIX)?;
        let table = pg::table(b)?;
        let armed = Armed::new(b.pinned().await?);
        pg::wait_for_lock(&armed, None).await?;
        q(&armed, &pg::create_table(&table)).await?;
        let records = pg::read_records(&armed, &table).await?;
        let h = history(&armed).await?;
        let rows = super::baseline_records(set, &records, &h, to)?;
        record(&armed, &table, &rows).await?;
        let unlocked = q(
            &armed,
            &format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"),
        )
        .await?;
        if first_value(&unlocked, 0).as_deref() == Some("t") {
            armed.disarm().recycle();
        }
        Ok(rows.iter().map(|r| r.version).collect())
    }

    /// Records `rows` as applied in dblock's `table`, in one statement (all or none).
    pub(crate) async fn record(armed: &Armed, table: &str, rows: &[Record]) -> Result<(), Error> {
        if rows.is_empty() {
            return Ok(());
        }
        let values: Vec<String> = rows
            .iter()
            .map(|r| {
                let at = if r.applied_at.is_empty() {
                    "now()".to_string()
                } else {
                    format!("{}::timestamptz", quote_literal(&r.applied_at))
                };
                format!(
                    "({}, {}, {}, {at}, {})",
                    r.version,
                    quote_literal(&r.name),
                    quote_literal(&r.checksum),
                    r.duration_ms
                )
            })
            .collect();
        q(
            armed,
            &format!(
                "INSERT INTO {table} (version, name, checksum, applied_at, duration_ms) VALUES {}",
                values.join(", ")
            ),
        )
        .await?;
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn sqlx_rows_parse_with_any_description() {
            let r = parse(Some(
                "20240101000000\tt\tab01\t1500000\t2026-05-01T12:00:00.123Z\tinit\tx",
            ))
            .unwrap();
            assert_eq!(
                (r.version, r.success, r.checksum.as_str()),
                (20240101000000, true, "ab01")
            );
            assert_eq!(
                (r.execution_time, r.description.as_str()),
                (1_500_000, "init\tx")
            );
            assert!(parse(Some("1\tf")).is_err());
        }
    }
}

#[cfg(feature = "sqlite")]
pub(crate) mod sqlite {
    //! sqlx's history in an SQLite database (the same table, `checksum` a BLOB), and
    //! baseline there.

    use sqlx::pool::PoolConnection;
    use sqlx::{Row, Sqlite};

    use super::{History, SQLX_TABLE, SqlxRow};
    use crate::Error;
    use crate::migrate::sqlite::{CREATE_TABLE, connection, lock, map, read_records};
    use crate::migrate::{Migration, Record};
    use crate::sqlite::SqliteBackend;

    /// `_sqlx_migrations`, if the database has it (SQLite has no other tool's table
    /// dblock reads).
    pub(crate) async fn history(conn: &mut PoolConnection<Sqlite>) -> Result<History, Error> {
        let exists: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
        )
        .fetch_one(&mut **conn)
        .await
        .map_err(map)?;
        if exists == 0 {
            return Ok(History::default());
        }
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT version, description, \
             coalesce(strftime('%Y-%m-%dT%H:%M:%fZ', installed_on), ''), \
             success, lower(hex(checksum)), execution_time FROM {SQLX_TABLE} ORDER BY version"
        )))
        .fetch_all(&mut **conn)
        .await
        .map_err(map)?;
        let sqlx = rows
            .iter()
            .map(|r| {
                Ok(SqlxRow {
                    version: r.try_get(0).map_err(map)?,
                    description: r.try_get(1).map_err(map)?,
                    installed_on: r.try_get(2).map_err(map)?,
                    success: r.try_get(3).map_err(map)?,
                    checksum: r.try_get(4).map_err(map)?,
                    execution_time: r.try_get(5).map_err(map)?,
                })
            })
            .collect::<Result<_, Error>>()?;
        Ok(History {
            sqlx,
            others: Vec::new(),
        })
    }

    /// [`history`] without the lock (status, dry runs).
    pub(crate) async fn history_unlocked(b: &SqliteBackend) -> Result<History, Error> {
        history(&mut connection(b).await?).await
    }

    /// Records `rows` as applied, in one statement (all or none).
    pub(crate) async fn record(
        conn: &mut PoolConnection<Sqlite>,
        rows: &[Record],
    ) -> Result<(), Error> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut q = sqlx::QueryBuilder::<Sqlite>::new(
            "INSERT INTO dblock_migrations (version, name, checksum, applied_at, duration_ms) ",
        );
        q.push_values(rows, |mut b, r| {
            b.push_bind(r.version)
                .push_bind(r.name.clone())
                .push_bind(r.checksum.clone())
                .push("coalesce(nullif(")
                .push_bind_unseparated(r.applied_at.clone())
                .push_unseparated(", ''), strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))")
                .push_bind(r.duration_ms);
        });
        q.build().execute(&mut **conn).await.map_err(map)?;
        Ok(())
    }

    /// `Runner::baseline` on SQLite: under the migration lock, the table, then the rows.
    pub(crate) async fn baseline(
        b: &SqliteBackend,
        set: &[Migration],
        to: Option<i64>,
    ) -> Result<Vec<i64>, Error> {
        let _lock = lock(b).await?;
        let mut conn = connection(b).await?;
        sqlx::raw_sql(CREATE_TABLE)
            .execute(&mut *conn)
            .await
            .map_err(map)?;
        let records = read_records(&mut conn).await?;
        let h = history(&mut conn).await?;
        let rows = super::baseline_records(set, &records, &h, to)?;
        record(&mut conn, &rows).await?;
        Ok(rows.iter().map(|r| r.version).collect())
    }
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
            others: Vec::new(),
        };
        let r = reconcile(set, &[], &h);
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
        assert!(refusal(&[], &h, &r).is_none());

        // Whitespace-insensitive checksums (sqlx's ignored-chars) match too.
        let ws = History {
            sqlx: vec![row(1, "SELECT1;", true)],
            others: Vec::new(),
        };
        assert_eq!(reconcile(set, &[], &ws).adopt.len(), 1);

        let edited = History {
            sqlx: vec![
                row(1, "SELECT 1;", true),
                row(2, "SELECT 22;", true),
                row(3, "SELECT 33;", true),
                row(4, "SELECT 4;", false),
            ],
            others: Vec::new(),
        };
        let r = reconcile(set, &[], &edited);
        let e = refusal(&[], &edited, &r).unwrap();
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
        let b = baseline_records(set, &[], &edited, None).unwrap();
        assert_eq!(b.iter().map(|r| r.version).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(b[1].checksum, set[1].checksum());
        let b = baseline_records(set, &[], &History::default(), Some(3)).unwrap();
        assert_eq!(b.len(), 3);
        assert!(baseline_records(set, &[], &History::default(), None).is_err());
    }

    #[test]
    fn other_tools_histories_are_refused_with_the_command_that_adopts_them() {
        let h = History {
            sqlx: Vec::new(),
            others: vec![OtherTool {
                tool: "golang-migrate",
                table: "schema_migrations",
                version: 20240105000000,
                dirty: false,
            }],
        };
        let e = refusal(&[], &h, &Reconciled::default())
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
            applied_at: String::new(),
            duration_ms: 0,
        };
        assert!(refusal(&[rec], &h, &Reconciled::default()).is_none());
    }
}
