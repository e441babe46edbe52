//! The runner, written once over [`MigrationStore`]: lock → table → records → adopt →
//! plan → apply → report, and the baseline, revert, dry run and status beside it.
//!
//! Every backend runs this same loop; what differs is only what the store does with
//! each step (see `store.rs`). Under the lock, in order: the bookkeeping table is
//! created if missing, the records are read (a migration started and never finished is
//! refused), other tools' histories are read — and, where sqlx's is kept too, sqlx's
//! lock taken and its history read again under it — then adopted or refused, the plan
//! is made, and each pending migration is applied after checking that the lock is
//! still held. Before a migration outside a transaction, sqlx migrators waiting for
//! sqlx's lock go first, and the plan is made again from what they applied.

use std::time::{Duration, Instant};

use super::adopt::{self, History};
use super::plan::{Applied, Record, Report, failed, plan, refuse_interrupted};
use super::revert::{self, targets};
use super::set::{Migration, file_name_of};
use super::sqlx_config::{SqlxConfig, check_table_name};
use super::sqlx_side::{self, SqlxHistory};
use super::store::{MigrationStore, Options, Recorded, Session, Then, Write};
use crate::error::{Capability, Error};

/// What every operation of the runner is given.
pub(crate) struct Ctx<'a> {
    pub(crate) store: &'a dyn MigrationStore,
    pub(crate) set: &'a [Migration],
    pub(crate) sqlx: SqlxConfig,
    pub(crate) sqlx_history: SqlxHistory,
    pub(crate) guards: Guards,
}

/// The protections of a run beside sqlx's migrator, each on unless a test's control
/// turns it off to show the race it prevents.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guards {
    /// Hold sqlx's lock while keeping its history.
    pub(crate) sqlx_lock: bool,
    /// Let sqlx's waiters go first before a migration outside a transaction.
    pub(crate) yield_to_sqlx: bool,
}

impl Default for Guards {
    fn default() -> Guards {
        Guards {
            sqlx_lock: true,
            yield_to_sqlx: true,
        }
    }
}

/// What is read under the lock before anything is decided.
struct Locked {
    records: Vec<Record>,
    history: History,
    /// The session keeps sqlx's history (and holds sqlx's lock).
    keeps_sqlx: bool,
}

impl Ctx<'_> {
    /// What the store is told, the sqlx table's name checked first.
    fn options(&self) -> Result<Options, Error> {
        let table = self.sqlx.table();
        check_table_name(table).map_err(|reason| Error::InvalidMigration {
            file: "sqlx.toml".into(),
            reason,
        })?;
        Ok(Options {
            sqlx_table: table.to_string(),
            sqlx_ignored: self.sqlx.ignored_chars.clone(),
        })
    }

    /// Whether no-transaction files run statement by statement (else whole).
    fn by_statement(&self) -> bool {
        self.store.transactional_ddl()
    }

    /// Under the lock: the table, the records (refusing an interrupted migration), and
    /// other tools' histories; where sqlx's history is kept too, sqlx's lock is taken
    /// and its history read again under it.
    async fn recorded(&self, s: &mut dyn Session) -> Result<Locked, Error> {
        s.ensure_table().await?;
        let records = s.records().await?;
        refuse_interrupted(self.set, &records, self.by_statement())?;
        let mut history = s.history().await?;
        let keeps_sqlx = match self.sqlx_history.keeps(&history) {
            Some(create) => {
                s.keep_sqlx_history(create, self.guards.sqlx_lock).await?;
                history = s.history().await?;
                true
            }
            None => false,
        };
        Ok(Locked {
            records,
            history,
            keeps_sqlx,
        })
    }

    /// What sqlx's history lacks of `records`, written there (when it is kept).
    async fn complete_sqlx(
        &self,
        s: &mut dyn Session,
        l: &Locked,
        records: &[Record],
    ) -> Result<(), Error> {
        if !l.keeps_sqlx {
            return Ok(());
        }
        let lacking = sqlx_side::missing(
            self.set,
            records,
            &l.history,
            self.sqlx.ignored_chars.as_ref(),
        );
        s.write(Write::ToSqlx(&lacking)).await
    }
}

/// Ends the session, then reports `res` (its error first).
async fn finish<T>(mut s: Box<dyn Session + '_>, res: Result<T, Error>) -> Result<T, Error> {
    let end = s.end(res.is_ok()).await;
    let value = res?;
    end?;
    Ok(value)
}

/// Applies the pending migrations under the migration lock.
pub(crate) async fn run(
    c: &Ctx<'_>,
    ignore_missing: bool,
    on_applied: &mut (dyn FnMut(&Applied) + Send),
) -> Result<Report, Error> {
    let opts = c.options()?;
    let mut s = c.store.lock(&opts, "a migration run").await?;
    let res = apply_pending(c, &mut *s, ignore_missing, on_applied).await;
    finish(s, res).await
}

async fn apply_pending(
    c: &Ctx<'_>,
    s: &mut dyn Session,
    ignore_missing: bool,
    on_applied: &mut (dyn FnMut(&Applied) + Send),
) -> Result<Report, Error> {
    let mut l = c.recorded(s).await?;
    let mut report = Report::default();
    'plan: loop {
        let mut records = l.records.clone();
        // Another tool's history: adopted, or refused, before anything is applied.
        let adopted = adopt::adopt(c.set, &mut records, &l.history, c.sqlx.sqlx())?;
        let pending = plan(c.set, &records, ignore_missing)?;
        s.write(Write::Adopted(&adopted)).await?;
        c.complete_sqlx(s, &l, &records).await?;
        report.adopted += adopted.len();
        for m in pending {
            if l.keeps_sqlx
                && m.no_transaction()
                && c.guards.yield_to_sqlx
                && s.yield_to_sqlx_waiters().await?
            {
                // sqlx's migrators went first: what they applied is adopted, and the
                // plan made again.
                l.records = s.records().await?;
                l.history = s.history().await?;
                continue 'plan;
            }
            // Never start a migration without the lock.
            s.check().await?;
            let duration = apply(c, s, m).await?;
            let applied = Applied {
                version: m.version(),
                name: m.name().to_string(),
                file_name: m.file_name().to_string(),
                duration,
                no_transaction: m.no_transaction(),
            };
            on_applied(&applied);
            report.applied.push(applied);
        }
        break;
    }
    // Every migration of the set is applied now: by this run, or before it (or, by
    // sqlx's migrators, while it let them go first).
    report.already_applied = c.set.len() - report.applied.len();
    Ok(report)
}

/// Applies one migration and records it: in one transaction with its row; or, outside
/// a transaction, recorded as started first.
async fn apply(c: &Ctx<'_>, s: &mut dyn Session, m: &Migration) -> Result<Duration, Error> {
    if !c.by_statement() {
        return apply_whole(s, m).await;
    }
    if m.no_transaction() {
        return apply_by_statement(s, m).await;
    }
    s.in_transaction(m.sql(), Then::Applied(m))
        .await
        .map_err(|e| failed(m, None, e))
}

/// Where DDL is not transactional: the file sent whole between its started and done
/// rows. A failure leaves the row started, and the next run refuses until someone has
/// looked: how much of the file ran cannot be known.
async fn apply_whole(s: &mut dyn Session, m: &Migration) -> Result<Duration, Error> {
    let fail = |e| failed(m, None, e);
    s.write(Write::Started(m, None)).await.map_err(fail)?;
    let t0 = Instant::now();
    s.execute(m.sql()).await.map_err(fail)?;
    let took = t0.elapsed();
    s.write(Write::Finished(m, took)).await.map_err(fail)?;
    Ok(took)
}

/// A no-transaction migration, statement by statement in autocommit: recorded as
/// started before its first statement, its progress after each, done after the last.
/// A statement that fails (the run sees exactly what ran) removes the started row and
/// names what stays applied; a run that ends otherwise leaves the row, with the
/// statements known to have completed, and the next run explains and refuses.
async fn apply_by_statement(s: &mut dyn Session, m: &Migration) -> Result<Duration, Error> {
    let statements = m.statements();
    let n = statements.len();
    let fail = |e| failed(m, None, e);
    s.write(Write::Started(m, Some(n))).await.map_err(fail)?;
    let t0 = Instant::now();
    for (i, stmt) in statements.iter().enumerate() {
        if let Err(e) = s.execute(stmt).await {
            return Err(unstart(s, m, failed(m, Some((i + 1, n)), e)).await);
        }
        s.write(Write::Progress(m, i + 1)).await.map_err(fail)?;
    }
    let took = t0.elapsed();
    // A statement of the file may have opened a transaction it did not end.
    if s.end_open_transaction().await.map_err(fail)? {
        let e = Error::InvalidMigration {
            file: m.file_name().to_string(),
            reason: "it left a transaction open (a BEGIN without its COMMIT); the open \
                     transaction was rolled back"
                .into(),
        };
        return Err(unstart(s, m, failed(m, None, e)).await);
    }
    s.write(Write::Finished(m, took)).await.map_err(fail)?;
    Ok(took)
}

/// After a failure the run saw, the started row goes (the error says what ran). If it
/// cannot (the connection broke), it stays, and the next run explains.
async fn unstart(s: &mut dyn Session, m: &Migration, e: Error) -> Error {
    if !e.is_connection() {
        let _ = s.write(Write::Unstarted(m)).await;
    }
    e
}

/// Records migrations as applied without running them, under the lock; the versions
/// recorded.
pub(crate) async fn baseline(c: &Ctx<'_>, to: Option<i64>) -> Result<Vec<i64>, Error> {
    let opts = c.options()?;
    let mut s = c.store.lock(&opts, "a migration baseline").await?;
    let res = async {
        let l = c.recorded(&mut *s).await?;
        let rows = adopt::baseline(c.set, &l.records, &l.history, to, c.sqlx.sqlx())?;
        s.write(Write::Adopted(&rows)).await?;
        let all: Vec<Record> = l.records.iter().chain(&rows).cloned().collect();
        c.complete_sqlx(&mut *s, &l, &all).await?;
        Ok(rows.iter().map(|r| r.version).collect())
    }
    .await;
    finish(s, res).await
}

/// Reverts applied migrations with their `.down.sql`, newest first, under the lock.
pub(crate) async fn revert(
    c: &Ctx<'_>,
    to: Option<i64>,
    on_reverted: &mut (dyn FnMut(&Applied) + Send),
) -> Result<Vec<Applied>, Error> {
    if !c.store.transactional_ddl() {
        return Err(Error::unsupported(
            Capability::TransactionalDdl,
            format!(
                "migrate revert is not available on {}: DDL commits as it goes, so a down \
                 migration that fails half way cannot be rolled back; revert by hand and \
                 delete its dblock_migrations row (docs/mysql.md)",
                c.store.backend()
            ),
        ));
    }
    let opts = c.options()?;
    let mut s = c.store.lock(&opts, "a migration revert").await?;
    let res = revert_locked(c, &mut *s, to, on_reverted).await;
    finish(s, res).await
}

async fn revert_locked(
    c: &Ctx<'_>,
    s: &mut dyn Session,
    to: Option<i64>,
    on_reverted: &mut (dyn FnMut(&Applied) + Send),
) -> Result<Vec<Applied>, Error> {
    let Locked {
        mut records,
        history,
        ..
    } = c.recorded(s).await?;
    let adopted = adopt::adopt(c.set, &mut records, &history, c.sqlx.sqlx())?;
    let todo = targets(c.set, &records, to)?;
    s.write(Write::Adopted(&adopted)).await?;
    let mut done = Vec::with_capacity(todo.len());
    for m in todo {
        s.check().await?;
        let duration = revert_one(s, m).await?;
        let reverted = Applied {
            version: m.version(),
            name: m.name().to_string(),
            file_name: m
                .down_file()
                .map_or(m.file_name(), file_name_of)
                .to_string(),
            duration,
            no_transaction: m.down_no_transaction(),
        };
        on_reverted(&reverted);
        done.push(reverted);
    }
    Ok(done)
}

/// One `.down.sql` with the removal of its rows: in one transaction, or statement by
/// statement for a no-transaction one.
async fn revert_one(s: &mut dyn Session, m: &Migration) -> Result<Duration, Error> {
    let down = m.down_sql().unwrap_or_default();
    if !m.down_no_transaction() {
        return s
            .in_transaction(down, Then::Reverted(m))
            .await
            .map_err(|e| revert::failed(m, None, e));
    }
    let statements = super::split::split(down);
    let n = statements.len();
    let t0 = Instant::now();
    for (i, stmt) in statements.iter().enumerate() {
        s.execute(stmt)
            .await
            .map_err(|e| revert::failed(m, Some((i + 1, n)), e))?;
    }
    let took = t0.elapsed();
    s.write(Write::Reverted(m))
        .await
        .map_err(|e| revert::failed(m, None, e))?;
    Ok(took)
}

/// What is recorded, read without the lock: the records (with a migration started and
/// never finished refused, or, while someone holds the lock, shown as being applied),
/// other tools' histories, and whether a run holds the lock now.
pub(crate) struct Unlocked {
    pub(crate) records: Vec<Record>,
    pub(crate) history: History,
    /// Someone held the migration lock when a started row was found: it is being
    /// applied. `false` when there is no started row (the lock was not looked at).
    pub(crate) running: bool,
}

/// Reads what is recorded without the lock (status, dry runs). A started row is a
/// migration being applied while someone holds the lock; with the lock free, a row
/// started in two reads either side of that look was left by a run that ended part way.
pub(crate) async fn read(c: &Ctx<'_>) -> Result<Unlocked, Error> {
    let opts = c.options()?;
    let Recorded { records, history } = c.store.read(&opts).await?;
    let first = records.unwrap_or_default();
    if !first.iter().any(Record::started) {
        return Ok(Unlocked {
            records: first,
            history,
            running: false,
        });
    }
    if c.store.lock_held().await? {
        return Ok(Unlocked {
            records: first,
            history,
            running: true,
        });
    }
    let Recorded { records, history } = c.store.read(&opts).await?;
    let records = records.unwrap_or_default();
    // A row started now and not (as it is) before: a run took the lock in between.
    let running = records.iter().filter(|r| r.started()).any(|r| {
        !first
            .iter()
            .any(|f| f.version == r.version && f.started() && f.applied_at == r.applied_at)
    });
    Ok(Unlocked {
        records,
        history,
        running,
    })
}

/// The migrations a run would apply now, after the checks a run makes.
pub(crate) async fn dry_run<'s>(
    c: &Ctx<'s>,
    ignore_missing: bool,
) -> Result<Vec<&'s Migration>, Error> {
    let Unlocked {
        mut records,
        history,
        running,
    } = read(c).await?;
    if running {
        // Being applied by the run that holds the lock: pending, as far as is committed.
        records.retain(|r| !r.started());
    }
    refuse_interrupted(c.set, &records, c.by_statement())?;
    adopt::adopt(c.set, &mut records, &history, c.sqlx.sqlx())?;
    plan(c.set, &records, ignore_missing)
}
