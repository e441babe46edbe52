//! Reverting on PostgreSQL: the lock waited for without a snapshot, then each
//! `.down.sql` with the deletion of its rows (dblock's, and sqlx's if sqlx's table
//! exists, so that a later run does not adopt it again) in one transaction, or
//! statement by statement for a no-transaction `.down.sql`.

use std::time::Instant;

use super::adopt;
use super::bookkeeping::{self as pg, q};
use crate::error::Error;
use crate::migrate::adopt::SQLX_TABLE;
use crate::migrate::plan::{Applied, MIGRATION_LOCK_KEY};
use crate::migrate::revert::{failed, targets};
use crate::migrate::set::{Migration, file_name_of};
use crate::migrate::split::split;
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::sql::first_value;

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
    let history = adopt::history(&armed).await?;
    let adopted = crate::migrate::adopt::adopt_or_refuse(set, &mut records, &history)?;
    let todo = targets(set, &records, to)?;
    adopt::record(&armed, &table, &adopted).await?;
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
