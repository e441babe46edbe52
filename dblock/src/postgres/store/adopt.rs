//! Reading other tools' histories on PostgreSQL, and recording adopted rows (see
//! `migrate::adopt`).

use super::bookkeeping::q;
use crate::error::Error;
use crate::migrate::adopt::{History, OtherTool, SqlxRow};
use crate::migrate::plan::Record;
use crate::postgres::conn::Armed;
use crate::postgres::sql::{first_value, quote_literal};

/// What other tools recorded, read through the session's `search_path` as those
/// tools find their tables; sqlx's in `sqlx_table` (its name as SQL writes it).
pub(crate) async fn history(armed: &Armed, sqlx_table: &str) -> Result<History, Error> {
    let mut h = History::default();
    let found = q(
        armed,
        &format!(
            "SELECT pg_catalog.concat_ws(',', \
           CASE WHEN pg_catalog.to_regclass({}) IS NOT NULL THEN 'sqlx' END, \
           CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = \
             coalesce(pg_catalog.to_regclass('schema_migrations'), 0) AND attname = 'dirty' \
             AND NOT attisdropped) THEN 'golang-migrate' END, \
           CASE WHEN pg_catalog.to_regclass('flyway_schema_history') IS NOT NULL THEN 'flyway' END, \
           CASE WHEN pg_catalog.to_regclass('refinery_schema_history') IS NOT NULL THEN 'refinery' END, \
           CASE WHEN pg_catalog.to_regclass('goose_db_version') IS NOT NULL THEN 'goose' END)",
            quote_literal(sqlx_table)
        ),
    )
    .await?;
    let found = first_value(&found, 0).unwrap_or_default();
    for tool in found.split(',').filter(|t| !t.is_empty()) {
        match tool {
            "sqlx" => {
                h.sqlx = sqlx_rows(armed, sqlx_table).await?;
                h.sqlx_table = true;
            }
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
            "flyway" => latest(
                armed,
                &mut h,
                "Flyway",
                "flyway_schema_history",
                "SELECT pg_catalog.max(version::numeric)::bigint::text FROM flyway_schema_history \
                 WHERE success AND version ~ '^[0-9]{1,18}$'",
            )
            .await?,
            "refinery" => {
                latest(
                    armed,
                    &mut h,
                    "refinery",
                    "refinery_schema_history",
                    "SELECT pg_catalog.max(version)::text FROM refinery_schema_history",
                )
                .await?
            }
            "goose" => latest(
                armed,
                &mut h,
                "goose",
                "goose_db_version",
                "SELECT pg_catalog.max(version_id)::text FROM goose_db_version WHERE is_applied \
                 AND version_id > 0",
            )
            .await?,
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

async fn sqlx_rows(armed: &Armed, table: &str) -> Result<Vec<SqlxRow>, Error> {
    // One text column per row, the description last (it may hold anything).
    let rows = q(
        armed,
        &format!(
            "SELECT pg_catalog.concat_ws(E'\\t', version, success, pg_catalog.encode(checksum, 'hex'), \
             execution_time, pg_catalog.to_char(installed_on AT TIME ZONE 'UTC', \
             'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), description) \
             FROM {table} ORDER BY version"
        ),
    )
    .await?;
    rows.first()
        .map(|rows| rows.iter().map(|r| parse(r.as_deref())).collect())
        .unwrap_or(Ok(Vec::new()))
}

fn parse(row: Option<&str>) -> Result<SqlxRow, Error> {
    let bad = || Error::unexpected(format!("unexpected row in sqlx's history: {row:?}"));
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

/// Records `rows` as applied in dblock's `table`, in one statement (all or none).
pub(crate) async fn record(armed: &Armed, table: &str, rows: &[Record]) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let values: Vec<String> = rows
        .iter()
        .map(|r| {
            let at = if r.applied_at.is_empty() {
                "pg_catalog.now()".to_string()
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
