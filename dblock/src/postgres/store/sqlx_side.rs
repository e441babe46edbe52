//! The SQL of a PostgreSQL run beside sqlx's migrator: sqlx's rows as sqlx writes them,
//! and the sessions waiting for sqlx's lock (see `migrate::sqlx_side`, and the store's
//! session in `migrate.rs`).

use crate::key::Key;
use crate::migrate::sqlx_side::SqlxEntry;
use crate::postgres::sql::quote_literal;

/// The rows, in one statement: `success` true, `installed_on` the entry's time or the
/// column's default (the transaction's start, as for sqlx).
pub(crate) fn insert(table: &str, rows: &[SqlxEntry]) -> String {
    let values: Vec<String> = rows
        .iter()
        .map(|r| {
            let at = if r.installed_on.is_empty() {
                "DEFAULT".to_string()
            } else {
                format!("{}::timestamptz", quote_literal(&r.installed_on))
            };
            format!(
                "({}, {}, {at}, TRUE, {}::bytea, {})",
                r.version,
                quote_literal(&r.description),
                // Hex digits after \x: bytea's hex input.
                quote_literal(&format!("\\x{}", r.checksum)),
                r.execution_time
            )
        })
        .collect();
    format!(
        "INSERT INTO {table} (version, description, installed_on, success, checksum, \
         execution_time) VALUES {}",
        values.join(", ")
    )
}

/// How many sessions of this database wait for advisory key `key` (exclusive or
/// shared, session or transaction) without holding it.
pub(crate) fn waiters(key: i64) -> String {
    let (classid, objid) = Key::from_i64(key).pg_locks_ids();
    format!(
        "SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND database = (SELECT oid FROM pg_catalog.pg_database \
         WHERE datname = pg_catalog.current_database()) \
         AND classid = {classid} AND objid = {objid} AND objsubid = 1"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_written_as_sqlx_writes_them() {
        let rows = [
            SqlxEntry {
                version: 20240101000000,
                description: "it's users".into(),
                checksum: "00ff".into(),
                execution_time: 1_500_000,
                installed_on: String::new(),
            },
            SqlxEntry {
                version: 2,
                description: "b".into(),
                checksum: "ab".into(),
                execution_time: 0,
                installed_on: "2026-01-01T00:00:00.000Z".into(),
            },
        ];
        assert_eq!(
            insert("_sqlx_migrations", &rows),
            "INSERT INTO _sqlx_migrations (version, description, installed_on, success, \
             checksum, execution_time) VALUES (20240101000000, E'it''s users', DEFAULT, TRUE, \
             E'\\\\x00ff'::bytea, 1500000), (2, E'b', E'2026-01-01T00:00:00.000Z'::timestamptz, \
             TRUE, E'\\\\xab'::bytea, 0)"
        );
    }
}
