//! Leaders' values on MySQL / MariaDB: `dblock_leaders` in the handle's database, one
//! row per election name (keyed like the fencing table), written by the leader of the
//! term it names and read by anyone with the fencing table's record of the latest term.
//! Created on the first publish (as the fencing table is), or by `dblock setup`; its
//! DDL is beside the fencing table's (`fence::LEADERS_DDL`).

use sqlx::MySqlPool;

use super::{MyBackend, map_sqlx};
use crate::error::Error;
use crate::key::Key;
use crate::raw::{BoxFuture, Fence, LeaderStore, TermRecord, check_leader_value, terms_condition};
use crate::status::from_unix_ms;

/// ER_NO_SUCH_TABLE.
const NO_SUCH_TABLE: u16 = 1146;

/// A term's grant time (the fencing table's `granted_at`, written as UTC text) in
/// microseconds since the Unix epoch: arithmetic on a `DATETIME`, whatever the
/// session's time zone.
const GRANTED_US: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', \
     STR_TO_DATE(f.granted_at, '%Y-%m-%dT%H:%i:%s.%fZ'))";

fn no_such_table(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|m| m.number() == NO_SUCH_TABLE),
        _ => false,
    }
}

impl LeaderStore for MyBackend {
    fn publish<'a>(&'a self, fence: &'a Fence, value: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(publish(self, fence, value))
    }

    fn terms<'a>(
        &'a self,
        keys: &'a [Key],
        prefixes: &'a [(&'a str, &'a str)],
    ) -> BoxFuture<'a, Result<Vec<TermRecord>, Error>> {
        Box::pin(terms(&self.pool, keys, prefixes))
    }
}

async fn publish(b: &MyBackend, fence: &Fence, value: &str) -> Result<(), Error> {
    check_leader_value(value)?;
    let fix = super::setup::fix_for(&b.database);
    // The term's record, which the value is written beside; a newer term (or none) is
    // refused. A newer term granted after this read is still safe: its value is written
    // with its greater token, which this write never overwrites, and readers take a
    // value only with the token of the latest term.
    let term: Option<(String, String, String, i64)> =
        sqlx::query_as("SELECT namespace, name, holder, token FROM dblock_fencing WHERE `key` = ?")
            .bind(fence.key().as_i64())
            .fetch_optional(&b.pool)
            .await
            .map_err(|e| super::setup::permission(e, &fix))?;
    let (namespace, name, holder) = match term {
        Some((ns, name, holder, token)) if token == fence.token() => (ns, name, holder),
        other => {
            return Err(Error::StaleToken {
                name: fence.name().to_string(),
                token: fence.token(),
                latest: other.map_or(0, |t| t.3),
            });
        }
    };
    // Each column is taken only from a term at least as new as the row's; the token last,
    // so the conditions above it see the row's old one.
    let upsert = "INSERT INTO dblock_leaders \
         (`key`, namespace, name, token, holder, value, published_at) \
         VALUES (?, ?, ?, ?, ?, ?, DATE_FORMAT(UTC_TIMESTAMP(3), '%Y-%m-%dT%H:%i:%s.%fZ')) \
         ON DUPLICATE KEY UPDATE \
         namespace = IF(VALUES(token) >= token, VALUES(namespace), namespace), \
         name = IF(VALUES(token) >= token, VALUES(name), name), \
         holder = IF(VALUES(token) >= token, VALUES(holder), holder), \
         value = IF(VALUES(token) >= token, VALUES(value), value), \
         published_at = IF(VALUES(token) >= token, VALUES(published_at), published_at), \
         token = GREATEST(token, VALUES(token))";
    let mut created = false;
    loop {
        let done = sqlx::query(upsert)
            .bind(fence.key().as_i64())
            .bind(&namespace)
            .bind(&name)
            .bind(fence.token())
            .bind(&holder)
            .bind(value)
            .execute(&b.pool)
            .await;
        match done {
            Ok(_) => return Ok(()),
            Err(e) if no_such_table(&e) && !created => {
                sqlx::raw_sql(super::fence::LEADERS_DDL)
                    .execute(&b.pool)
                    .await
                    .map_err(|e| super::setup::permission(e, &fix))?;
                created = true;
            }
            Err(e) => return Err(super::setup::permission(e, &fix)),
        }
    }
}

/// One term row: key, namespace, name, holder, token, granted (µs), value.
type Row = (
    i64,
    String,
    String,
    String,
    i64,
    Option<i64>,
    Option<String>,
);

async fn terms(
    pool: &MySqlPool,
    keys: &[Key],
    prefixes: &[(&str, &str)],
) -> Result<Vec<TermRecord>, Error> {
    let Some(cond) = terms_condition(keys.len(), prefixes.len(), "`key`", "LEFT(f.name, ?)") else {
        return Ok(Vec::new());
    };
    let select = |value: &str, join: &str| {
        format!(
            "SELECT f.`key`, f.namespace, f.name, f.holder, f.token, {GRANTED_US}, {value} \
             FROM dblock_fencing f{join} WHERE {cond} ORDER BY f.`key`"
        )
    };
    let run = |sql: String| async move {
        let mut q = sqlx::query_as::<_, Row>(sqlx::AssertSqlSafe(sql));
        for k in keys {
            q = q.bind(k.as_i64());
        }
        for (ns, prefix) in prefixes {
            q = q
                .bind(*ns)
                .bind(prefix.chars().count() as i64)
                .bind(*prefix);
        }
        q.fetch_all(pool).await
    };
    let joined = select(
        "l.value",
        " LEFT JOIN dblock_leaders l ON l.`key` = f.`key` AND l.token = f.token",
    );
    let rows = match run(joined).await {
        Ok(rows) => rows,
        // No leaders' table yet: the terms without values; no fencing table: no terms.
        Err(e) if no_such_table(&e) => match run(select("CAST(NULL AS CHAR)", "")).await {
            Ok(rows) => rows,
            Err(e) if no_such_table(&e) => return Ok(Vec::new()),
            Err(e) => return Err(map_sqlx(e)),
        },
        Err(e) => return Err(map_sqlx(e)),
    };
    // The server compares text by its collation (case- and trailing-space-insensitive,
    // as a rule): only exact matches count, and only names that hash to their key.
    Ok(rows
        .into_iter()
        .filter(|r| {
            let key = Key::from_i64(r.0);
            Key::derive(&r.1, &r.2) == key
                && (keys.contains(&key)
                    || prefixes
                        .iter()
                        .any(|(ns, p)| r.1 == *ns && r.2.starts_with(p)))
        })
        .map(
            |(key, namespace, name, holder, token, us, value)| TermRecord {
                key: Key::from_i64(key),
                namespace,
                name,
                holder,
                token,
                granted_at: us.and_then(|us| from_unix_ms(us as f64 / 1000.0)),
                value,
            },
        )
        .collect())
}
