//! Running beside sqlx's migrator during a rolling deploy: sqlx's migration lock (its
//! key on PostgreSQL, its lock name on MySQL), whether a run keeps sqlx's history too
//! ([`SqlxHistory`]), and the rows of that history exactly as sqlx writes them.
//!
//! sqlx 0.9's migrator (`sqlx-postgres`/`sqlx-mysql` `migrate.rs`) locks the database
//! with a key it derives from `current_database()` / `DATABASE()`: CRC-32/ISO-HDLC of
//! the name times `0x3d32ad9e`, taken with a blocking `pg_advisory_lock(key)` on
//! PostgreSQL and `GET_LOCK(hex(key), -1)` on MySQL; on SQLite it takes no lock. It
//! records each migration in `_sqlx_migrations` (`version`, `description` — the file
//! name after the first `_`, without `.sql`/`.up.sql`, `_` read as a space —
//! `installed_on`, `success`, `checksum` — the SHA-384 of the file, less sqlx.toml's
//! `ignored-chars` — and `execution_time` in nanoseconds).

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use super::adopt::{History, sqlx_checksum};
use super::plan::Record;
use super::set::Migration;

/// Whether a run keeps sqlx's history (and holds sqlx's migration lock) beside its own,
/// so that instances still running sqlx's migrator during a rolling deploy and
/// instances running dblock exclude each other and never apply a migration twice (see
/// [`Runner::sqlx_history`](super::Runner::sqlx_history) and
/// `docs/adopting-sqlx-migrations.md`).
///
/// While it does, a run holds sqlx's migration lock as well as dblock's (waited for
/// holding no snapshot, as dblock's own), writes each migration it applies into sqlx's
/// history as sqlx would, writes there the migrations dblock recorded that sqlx's
/// history lacks, and, before a migration outside a transaction, lets sqlx migrators
/// waiting for that lock go first (see [the module](crate::migrate#beside-sqlxs-migrator)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SqlxHistory {
    /// Where sqlx's history table exists (found under dblock's lock): keep it. The
    /// default, so a database sqlx migrated stays safe for sqlx's instances without
    /// being asked.
    #[default]
    Auto,
    /// Always, creating sqlx's table (as sqlx would) where it is missing: for a
    /// database without one where sqlx's instances may still start, such as a new
    /// environment deployed while the fleet switches.
    Always,
    /// Never: once every instance runs dblock. sqlx's history is still read and
    /// adopted, and a revert still removes its row there.
    Off,
}

impl SqlxHistory {
    /// Whether a run keeps sqlx's history, given what is found under dblock's lock:
    /// `Some(create)` to keep it (creating the table if `create`), `None` not to.
    pub(crate) fn keeps(self, history: &History) -> Option<bool> {
        match self {
            SqlxHistory::Auto if history.sqlx_table => Some(false),
            SqlxHistory::Always => Some(!history.sqlx_table),
            _ => None,
        }
    }
}

/// The advisory key sqlx 0.9's PostgreSQL migrator locks database `database` with:
/// CRC-32/ISO-HDLC of its name times `0x3d32ad9e` (sqlx's `generate_lock_id`). Always
/// positive and even; in `pg_locks` its high 32 bits are `classid`, its low 32 bits
/// `objid` (`objsubid` 1).
///
/// ```
/// // Pinned: sqlx's formula, which must never change here.
/// assert_eq!(dblock::migrate::sqlx_lock_key("test"), 3729328775749822312);
/// assert_eq!(dblock::migrate::sqlx_lock_key("app"), 3469795979745788610);
/// ```
pub fn sqlx_lock_key(database: &str) -> i64 {
    // At most 0x3d32ad9e × (2^32 − 1) < 2^62: no overflow.
    0x3d32_ad9e_i64 * i64::from(crc32(database.as_bytes()))
}

/// The lock name sqlx 0.9's MySQL migrator takes with `GET_LOCK(name, -1)` for
/// database `database`: [`sqlx_lock_key`] in lowercase hexadecimal. Server-wide, like
/// every MySQL lock name.
///
/// ```
/// assert_eq!(dblock::migrate::sqlx_mysql_lock_name("test"), "33c13cc34135e768");
/// ```
pub fn sqlx_mysql_lock_name(database: &str) -> String {
    format!("{:x}", sqlx_lock_key(database))
}

/// CRC-32/ISO-HDLC (the "IEEE" CRC of zlib, Ethernet and sqlx's `crc::CRC_32_ISO_HDLC`).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// sqlx 0.9's `CREATE TABLE IF NOT EXISTS` of its history (each driver's
/// `ensure_migrations_table`), `table` as SQL names it (sqlx puts the configured name
/// into its SQL as it is): on PostgreSQL (`postgres`) with `TIMESTAMPTZ` and `BYTEA`,
/// on MySQL and SQLite with `TIMESTAMP` and `BLOB`.
pub(crate) fn create_table(table: &str, postgres: bool) -> String {
    let (at, now, bytes) = if postgres {
        ("TIMESTAMPTZ", "pg_catalog.now()", "BYTEA")
    } else {
        ("TIMESTAMP", "CURRENT_TIMESTAMP", "BLOB")
    };
    format!(
        "CREATE TABLE IF NOT EXISTS {table} (\
         version BIGINT PRIMARY KEY, \
         description TEXT NOT NULL, \
         installed_on {at} NOT NULL DEFAULT {now}, \
         success BOOLEAN NOT NULL, \
         checksum {bytes} NOT NULL, \
         execution_time BIGINT NOT NULL)"
    )
}

/// One row of sqlx's history, as sqlx writes it for a migration it applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SqlxEntry {
    pub(crate) version: i64,
    /// The file name after the version's `_`, without its extension, `_` as spaces.
    pub(crate) description: String,
    /// sqlx's checksum, lowercase hex.
    pub(crate) checksum: String,
    /// Nanoseconds.
    pub(crate) execution_time: i64,
    /// RFC 3339 in UTC; empty for "now" (the column's default, as sqlx leaves it).
    pub(crate) installed_on: String,
}

/// sqlx's description of a migration: its name with `_` as spaces (sqlx's
/// `file_name.splitn(2, '_')`, less the suffix, `.replace('_', " ")`).
pub(crate) fn description(m: &Migration) -> String {
    m.name().replace('_', " ")
}

/// sqlx's checksum of `m`, with the characters sqlx.toml's `ignored-chars` names left
/// out (`None`: the file as it is, sqlx's default).
pub(crate) fn checksum(m: &Migration, ignored: Option<&BTreeSet<char>>) -> String {
    match ignored {
        Some(set) if !set.is_empty() => sqlx_checksum(m.sql(), |c| set.contains(&c)),
        _ => m.sqlx_checksum().to_string(),
    }
}

/// The row sqlx would write for `m`, applied now in `took`.
pub(crate) fn entry(m: &Migration, ignored: Option<&BTreeSet<char>>, took: Duration) -> SqlxEntry {
    SqlxEntry {
        version: m.version(),
        description: description(m),
        checksum: checksum(m, ignored),
        execution_time: i64::try_from(took.as_nanos()).unwrap_or(i64::MAX),
        installed_on: String::new(),
    }
}

/// What sqlx's history lacks of what dblock records as applied (migrations of the set
/// only: the others' files, and so sqlx's checksums, are unknown): the rows to write so
/// that a sqlx migrator finds them applied, with dblock's times.
pub(crate) fn missing(
    set: &[Migration],
    records: &[Record],
    history: &History,
    ignored: Option<&BTreeSet<char>>,
) -> Vec<SqlxEntry> {
    let in_sqlx: HashSet<i64> = history.sqlx.iter().map(|r| r.version).collect();
    records
        .iter()
        .filter(|r| !r.started() && !in_sqlx.contains(&r.version))
        .filter_map(|r| {
            let i = set
                .binary_search_by_key(&r.version, Migration::version)
                .ok()?;
            let m = set.get(i)?;
            Some(SqlxEntry {
                execution_time: r.duration_ms.saturating_mul(1_000_000),
                installed_on: r.applied_at.clone(),
                ..entry(m, ignored, Duration::ZERO)
            })
        })
        .collect()
}

/// `hex` (lowercase or uppercase digits, even length) as bytes; `None` if it is not.
pub(crate) fn unhex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migrate::Migrations;
    use crate::migrate::adopt::SqlxRow;
    use crate::migrate::plan::RecordState;

    #[test]
    fn crc32_is_the_iso_hdlc_one() {
        // The check value of the CRC catalogue.
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn sqlxs_key_and_lock_name_are_pinned() {
        // Computed with Python's zlib.crc32 × 0x3d32ad9e.
        assert_eq!(sqlx_lock_key("postgres"), 368907709894077238);
        assert_eq!(sqlx_lock_key("test") % 2, 0);
        assert_eq!(sqlx_mysql_lock_name("app"), "3027310f4fd382c2");
    }

    #[test]
    fn descriptions_and_checksums_are_sqlxs() {
        let set = Migrations::from_sources([
            (
                "m/20240101000000_create_users_table.sql",
                "CREATE TABLE u (x int);\r\n",
            ),
            (
                "m/20240102000000_add-email.up.sql",
                "ALTER TABLE u ADD e text;",
            ),
            (
                "m/20240102000000_add-email.down.sql",
                "ALTER TABLE u DROP e;",
            ),
        ])
        .unwrap();
        let set = set.checked().unwrap();
        assert_eq!(description(&set[0]), "create users table");
        assert_eq!(description(&set[1]), "add-email");
        assert_eq!(checksum(&set[0], None), set[0].sqlx_checksum());
        let cr: BTreeSet<char> = ['\r'].into();
        let without_cr = sqlx_checksum("CREATE TABLE u (x int);\n", |_| false);
        assert_eq!(checksum(&set[0], Some(&cr)), without_cr);
        assert_eq!(
            checksum(&set[0], Some(&BTreeSet::new())),
            set[0].sqlx_checksum()
        );
        let e = entry(&set[1], None, Duration::from_micros(1500));
        assert_eq!((e.version, e.execution_time), (20240102000000, 1_500_000));
    }

    #[test]
    fn what_sqlx_lacks_is_what_dblock_applied_of_the_set() {
        let set = Migrations::from_sources([
            ("m/1_a.sql", "SELECT 1;"),
            ("m/2_b.sql", "SELECT 2;"),
            ("m/3_c.sql", "SELECT 3;"),
        ])
        .unwrap();
        let set = set.checked().unwrap();
        let rec = |version: i64, state| Record {
            version,
            duration_ms: 7,
            applied_at: "2026-01-01T00:00:00.000Z".into(),
            state,
            ..Record::default()
        };
        let records = [
            rec(1, RecordState::Done),
            rec(2, RecordState::Done),
            rec(3, RecordState::Started { completed: None }),
            rec(9, RecordState::Done),
        ];
        let history = History {
            sqlx: vec![SqlxRow {
                version: 1,
                description: "a".into(),
                installed_on: String::new(),
                success: true,
                checksum: set[0].sqlx_checksum().into(),
                execution_time: 1,
            }],
            sqlx_table: true,
            others: Vec::new(),
        };
        let m = missing(set, &records, &history, None);
        assert_eq!(m.len(), 1, "{m:?}");
        assert_eq!(
            (
                m[0].version,
                m[0].execution_time,
                m[0].installed_on.as_str()
            ),
            (2, 7_000_000, "2026-01-01T00:00:00.000Z")
        );
        assert_eq!(m[0].checksum, set[1].sqlx_checksum());
    }

    #[test]
    fn the_mode_decides_from_the_table() {
        let with = History {
            sqlx_table: true,
            ..History::default()
        };
        let without = History::default();
        assert_eq!(SqlxHistory::Auto.keeps(&with), Some(false));
        assert_eq!(SqlxHistory::Auto.keeps(&without), None);
        assert_eq!(SqlxHistory::Always.keeps(&without), Some(true));
        assert_eq!(SqlxHistory::Always.keeps(&with), Some(false));
        assert_eq!(SqlxHistory::Off.keeps(&with), None);
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(unhex("00ff1A"), Some(vec![0, 255, 26]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
    }
}
