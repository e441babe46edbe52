//! `dblock doctor`'s checks of a PostgreSQL-protocol server (see [`crate::doctor`] for
//! the list): what the server is, how dblock reaches it, and what of its settings would
//! end holders or waits, each read as the handle's role sees it (`pg_settings` shows
//! the session's values, so per-role and per-database settings count).

use std::time::Duration;

use super::backend::{PgBackend, Source};
use super::conn::Armed;
use super::conn::pooler::{Known, Pooler};
use super::conn::wire::{QueryError, Results};
use super::engine::{Engine, Exclusion, Verdict as Found};
use super::lock::plan::WAIT_SLICE_MS;
use super::sql::{first_value, quote_ident, quote_literal};
use crate::doctor::{Check, shown_ms};
use crate::error::Error;
use crate::raw::{FENCING_TABLE, PG_FENCING_SCHEMA, shortest_lease};

/// PostgreSQL's default `max_locks_per_transaction`.
const DEFAULT_MAX_LOCKS: u64 = 64;

/// What the server tells, by statement: each one's rows (first column).
struct Facts(Results);

/// The statements, in order; [`Facts`] reads them by these indexes.
const VERSION: usize = 0;
const VERSION_NUM: usize = 1;
const SSL: usize = 2;
const MAX_LOCKS: usize = 3;
const MAX_CONNECTIONS: usize = 4;
const MAX_PREPARED: usize = 5;
const IDLE_IN_XACT: usize = 6;
const STATEMENT_TIMEOUT: usize = 7;
const LOCK_TIMEOUT: usize = 8;
const CHECK_INTERVAL: usize = 9;
const CAN_CREATE: usize = 10;
/// Then one statement per table of [`tables`], from here.
const TABLES: usize = 11;

/// dblock's tables as SQL names them, and the privileges its role needs on each.
fn tables() -> [(String, &'static [&'static str]); 3] {
    let fencing = format!("{}.{}", quote_ident(PG_FENCING_SCHEMA), FENCING_TABLE);
    let rw: &[&str] = &["SELECT", "INSERT", "UPDATE"];
    [
        (fencing, rw),
        (super::store::leader::leaders_table(), rw),
        (
            super::store::runs::table_name(),
            &["SELECT", "INSERT", "UPDATE", "DELETE"],
        ),
    ]
}

/// The statements, each answering one value (NULL where the server lacks it).
fn facts_sql() -> Vec<String> {
    let setting = |name: &str| {
        format!("SELECT (SELECT setting FROM pg_catalog.pg_settings WHERE name = '{name}')")
    };
    let mut sql = vec![
        "SELECT pg_catalog.version()".to_string(),
        "SELECT pg_catalog.current_setting('server_version_num')".to_string(),
        "SELECT coalesce((SELECT CASE WHEN ssl THEN 'on ' || coalesce(version, '') \
         ELSE 'off' END FROM pg_catalog.pg_stat_ssl WHERE pid = pg_catalog.pg_backend_pid()), \
         'unknown')"
            .to_string(),
        setting("max_locks_per_transaction"),
        setting("max_connections"),
        setting("max_prepared_transactions"),
        setting("idle_in_transaction_session_timeout"),
        setting("statement_timeout"),
        setting("lock_timeout"),
        setting("client_connection_check_interval"),
        format!(
            "SELECT coalesce((SELECT pg_catalog.has_schema_privilege(oid, 'CREATE') \
             FROM pg_catalog.pg_namespace WHERE nspname = {}), false)",
            quote_literal(PG_FENCING_SCHEMA)
        ),
    ];
    for (table, privileges) in tables() {
        let has = privileges
            .iter()
            .map(|p| format!("pg_catalog.has_table_privilege(t, '{p}')"))
            .collect::<Vec<_>>()
            .join(" AND ");
        sql.push(format!(
            "SELECT CASE WHEN t IS NULL THEN 'missing' WHEN {has} THEN 'ok' ELSE 'denied' END \
             FROM (SELECT pg_catalog.to_regclass({}) AS t) s",
            quote_literal(&table)
        ));
    }
    sql
}

impl Facts {
    fn text(&self, i: usize) -> Option<String> {
        first_value(&self.0, i)
    }

    fn number(&self, i: usize) -> Option<u64> {
        self.text(i).and_then(|v| v.trim().parse().ok())
    }
}

impl PgBackend {
    /// `dblock doctor`'s checks (see [`crate::doctor`]): one query for the server's
    /// facts, one for its timeline, and the check that its advisory locks exclude.
    pub(super) async fn diagnose(&self) -> Result<Vec<Check>, Error> {
        let armed = Armed::new(self.pinned().await?);
        // One statement at a time: an engine that lacks a view or setting answers the
        // others (the one it lacks is a value unknown, not a report lost).
        let mut facts = Vec::new();
        for sql in facts_sql() {
            match armed.conn().query(&sql).await {
                Ok(rows) => facts.push(rows.into_iter().next().unwrap_or_default()),
                Err(QueryError::Db { .. }) => facts.push(Vec::new()),
                Err(lost) => return Err(lost.into_error()),
            }
        }
        let facts = Facts(facts);
        let timeline = armed
            .conn()
            .query(
                "SELECT substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8)",
            )
            .await;
        let timeline = match timeline {
            Ok(rows) => Ok(first_value(&rows, 0).unwrap_or_default()),
            Err(QueryError::Db { code, message }) => Err((code, message)),
            Err(lost) => return Err(lost.into_error()),
        };
        armed.disarm().recycle();
        let exclusion = self.check_exclusion().await?;
        let mut checks = vec![
            server(&self.engine, &facts),
            tls(&facts, self.local(), self.pooler.0),
            pooler(self.pooler),
            advisory_locks(&exclusion, self.pooler.0, self.must_check()),
            self.tables(&facts),
            self.lock_table(&facts),
        ];
        checks.extend(timeouts(
            &facts,
            &self.role,
            (self.check_interval, self.check_timeout),
        ));
        checks.push(connection_check(&facts));
        checks.push(fencing_timeline(timeline));
        Ok(checks)
    }

    /// Whether the handle reaches its server on this host (a Unix socket or loopback),
    /// where TLS protects nothing.
    fn local(&self) -> bool {
        let host = match &self.source {
            Source::Native(p) => match p.config().get_hosts().first() {
                Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
                Some(tokio_postgres::config::Host::Unix(_)) | None => return true,
            },
            Source::Sqlx(s) => s.pool.connect_options().get_host().to_string(),
        };
        host.starts_with('/') || host == "localhost" || host == "::1" || host.starts_with("127.")
    }

    /// dblock's tables and this role's rights on them.
    fn tables(&self, facts: &Facts) -> Check {
        let role = &self.role;
        let setup = format!(
            "run `dblock setup --db OWNER_URL --grant {role}` as the schema's owner \
             (docs/cli.md, dblock setup)"
        );
        let mut missing = Vec::new();
        let mut denied = Vec::new();
        for (i, (table, _)) in tables().into_iter().enumerate() {
            match facts.text(TABLES + i).as_deref() {
                Some("ok") => {}
                Some("missing") => missing.push(table),
                _ => denied.push(table),
            }
        }
        let can_create = facts.text(CAN_CREATE).as_deref() == Some("t");
        if !denied.is_empty() {
            return Check::fail(
                "tables",
                format!(
                    "role {role} lacks rights on {}: fenced locks, leader election and \
                     `dblock run` (fenced by default) fail with a permission error",
                    denied.join(", ")
                ),
                setup,
            );
        }
        match (missing.is_empty(), can_create) {
            (true, _) => Check::ok(
                "tables",
                format!("dblock's tables exist and role {role} may use them"),
            ),
            (false, true) => Check::ok(
                "tables",
                format!(
                    "{} not created yet: role {role} may create them, and dblock does on first use",
                    missing.join(", ")
                ),
            ),
            (false, false) => Check::warn(
                "tables",
                format!(
                    "{} missing, and role {role} may not create them: fenced locks and leader \
                     election will fail until they exist",
                    missing.join(", ")
                ),
                setup,
            ),
        }
    }

    /// The server's lock table against what this handle may hold.
    fn lock_table(&self, facts: &Facts) -> Check {
        let (Some(per), Some(conns)) = (facts.number(MAX_LOCKS), facts.number(MAX_CONNECTIONS))
        else {
            return Check::ok(
                "lock-table",
                "the server does not say how large its lock table is",
            );
        };
        let prepared = facts.number(MAX_PREPARED).unwrap_or(0);
        let capacity = per * (conns + prepared);
        let (pool, mux) = match &self.source {
            Source::Native(p) => (p.max(), self.mux.as_ref().map_or(0, |m| m.width())),
            Source::Sqlx(s) => (s.pool.options().get_max_connections() as usize, 0),
        };
        let handle = match mux {
            0 => format!("this handle holds one lock per connection, up to {pool} at once"),
            n => {
                format!("this handle multiplexes session locks on {n} connections, any number each")
            }
        };
        let detail = format!(
            "{capacity} locks in all (max_locks_per_transaction {per} × (max_connections \
             {conns} + max_prepared_transactions {prepared})), shared by every session; {handle}"
        );
        let fix = "raise max_locks_per_transaction (ALTER SYSTEM SET max_locks_per_transaction \
                   = 256; it takes a restart): when the table is full every lock request on \
                   the server fails with \"out of shared memory\"";
        if capacity < pool as u64 || (mux > 0 && capacity < 10_000) {
            return Check::warn("lock-table", detail, fix);
        }
        if per < DEFAULT_MAX_LOCKS {
            return Check::warn(
                "lock-table",
                format!("{detail}; max_locks_per_transaction is below PostgreSQL's default (64)"),
                fix,
            );
        }
        Check::ok("lock-table", detail)
    }
}

/// The server, engine and version.
fn server(engine: &Engine, facts: &Facts) -> Check {
    let detail = match engine {
        Engine::PostgreSql { .. } => format!(
            "{engine} (server_version_num {})",
            facts.text(VERSION_NUM).unwrap_or_default()
        ),
        _ => format!(
            "{engine}; version(): {}",
            facts.text(VERSION).unwrap_or_default()
        ),
    };
    match engine {
        Engine::PostgreSql { .. } => Check::ok("server", detail),
        Engine::CockroachDb { .. } => Check::warn(
            "server",
            detail,
            "CockroachDB has no session-level advisory locks and no WAL timeline: use \
             transaction-scoped locks (the default); see docs/connecting.md, engines",
        ),
        _ => Check::warn(
            "server",
            detail,
            "not PostgreSQL: dblock checks once per handle that its advisory locks exclude \
             (the advisory-locks line); see docs/connecting.md, engines",
        ),
    }
}

/// Whether the connection is encrypted, as the server sees it.
fn tls(facts: &Facts, local: bool, pooler: Pooler) -> Check {
    let ssl = facts.text(SSL).unwrap_or_default();
    let seen = match pooler {
        Pooler::None | Pooler::Detect => "",
        _ => " (as the server sees its client: behind a pooler, the pooler's link)",
    };
    match (ssl.strip_prefix("on"), local) {
        (Some(version), _) => Check::ok("tls", format!("in use:{version}{seen}")),
        (None, true) => Check::ok(
            "tls",
            format!("not in use ({ssl}{seen}): the server is on this host"),
        ),
        (None, false) => Check::warn(
            "tls",
            format!(
                "not in use ({ssl}{seen}): passwords and lock names cross the network in clear"
            ),
            "add sslmode=verify-full (with sslrootcert) or sslmode=require to the URL",
        ),
    }
}

/// The pooler detected, declared or implied, and what it allows.
fn pooler((p, known): (Pooler, Known)) -> Check {
    let how = known.describe(p);
    let detail = match p {
        Pooler::None | Pooler::Detect => format!("none: {how}"),
        Pooler::Session => format!("session pooling: everything works ({how})"),
        Pooler::Pinning => {
            format!("a pinning pooler: session locks work, migrations are refused ({how})")
        }
        Pooler::Transaction => format!(
            "transaction pooling: transaction-scoped locks work; session-scoped locks, \
             multiplexing and migrations are refused ({how})"
        ),
    };
    Check::ok("pooler", detail)
}

/// Whether a lock on one connection stops a try on another, per scope.
/// `checked`: whether the handle checks its locks before trusting them (and so refuses a
/// scope found not to exclude).
fn advisory_locks(found: &Exclusion, pooler: Pooler, checked: bool) -> Check {
    let said = |v: &Found| match v {
        Found::Excludes => "exclude".to_string(),
        Found::DoesNotExclude => "DO NOT exclude".to_string(),
        Found::Unavailable { message } => format!("unavailable ({message})"),
        Found::Untested => "untested (refused behind a transaction pooler)".to_string(),
    };
    let detail = format!(
        "transaction-scoped locks {}; session-scoped locks {} (checked on two connections)",
        said(&found.transaction),
        said(&found.session)
    );
    let bad = |v: &Found| matches!(v, Found::DoesNotExclude | Found::Unavailable { .. });
    match (bad(&found.transaction), bad(&found.session)) {
        (false, false) => Check::ok("advisory-locks", detail),
        (true, _) => Check::fail(
            "advisory-locks",
            detail,
            format!(
                "{} grants locks that exclude nothing: dblock refuses them there; use \
                 PostgreSQL, or an engine version whose advisory locks exclude (and check \
                 search_path: a schema before pg_catalog may shadow the functions)",
                found.engine
            ),
        ),
        (false, true) if pooler == Pooler::Pinning => Check::fail(
            "advisory-locks",
            detail,
            "pooler=pinning was declared, but the pooler does not keep a session lock's \
             server connection (another client's try reached the holder's session): remove \
             pooler=pinning, so that session locks are refused, or make the pooler pin \
             (docs/poolers.md, pinning poolers)",
        ),
        (false, true) if !checked => Check::fail(
            "advisory-locks",
            detail,
            "dblock trusts this server's session locks without checking them: use \
             transaction-scoped locks (the default), and self_test=always in the URL so that \
             session ones are refused",
        ),
        (false, true) => Check::warn(
            "advisory-locks",
            detail,
            "use transaction-scoped locks (the default): dblock refuses session-scoped ones \
             on this server",
        ),
    }
}

/// The settings that end holders or waits, as this role's sessions have them.
/// `checking`: the handle's check interval and check timeout.
fn timeouts(facts: &Facts, role: &str, checking: (Duration, Duration)) -> Vec<Check> {
    let alter = |name: &str| {
        format!(
            "ALTER ROLE {} SET {name} = 0 (or ALTER DATABASE …; or the server's own setting)",
            quote_ident(role)
        )
    };
    let mut checks = vec![idle_in_transaction(
        facts.number(IDLE_IN_XACT).unwrap_or(0),
        checking,
        alter("idle_in_transaction_session_timeout"),
    )];
    let slice = WAIT_SLICE_MS as u64;
    match facts.number(STATEMENT_TIMEOUT) {
        Some(ms) if ms > 0 && ms <= slice => checks.push(Check::warn(
            "timeouts",
            format!(
                "statement_timeout = {}: ends a wait for a lock (each waiting statement runs up \
                 to {} s) with a timeout error",
                shown_ms(ms),
                slice / 1000
            ),
            alter("statement_timeout"),
        )),
        Some(ms) if ms > 0 => checks.push(Check::ok(
            "timeouts",
            format!(
                "statement_timeout = {}: longer than dblock's waiting statements ({} s \
                 each); it bounds your migrations' statements",
                shown_ms(ms),
                slice / 1000
            ),
        )),
        _ => checks.push(Check::ok("timeouts", "statement_timeout off")),
    }
    match facts.number(LOCK_TIMEOUT) {
        Some(ms) if ms > 0 => checks.push(Check::warn(
            "timeouts",
            format!(
                "lock_timeout = {}: a wait without a deadline (`lock`, `dblock run` without \
                 --wait) gives up after that",
                shown_ms(ms)
            ),
            alter("lock_timeout"),
        )),
        _ => checks.push(Check::ok("timeouts", "lock_timeout off")),
    }
    checks
}

/// `idle_in_transaction_session_timeout` of `ms`, against a transaction-scoped holder's
/// health check (`checking`: every interval, answered within the timeout), whose
/// statement ends each idle spell: shorter than the interval, it ends healthy holders;
/// shorter than the shortest safe lease, it ends silent ones before they can know; else
/// it is a lease on every holder.
fn idle_in_transaction(ms: u64, checking: (Duration, Duration), fix: String) -> Check {
    const NAME: &str = "timeouts";
    let t = Duration::from_millis(ms);
    let (interval, timeout) = checking;
    let lease = shortest_lease(interval, timeout);
    let shown = shown_ms(ms);
    if ms == 0 {
        return Check::ok(
            NAME,
            "idle_in_transaction_session_timeout off: transaction-scoped holders are not ended",
        );
    }
    if t <= interval + interval / 10 {
        return Check::warn(
            NAME,
            format!(
                "idle_in_transaction_session_timeout = {shown}: no longer than the handle's check interval ({interval:?}), so the server ends transaction-scoped holders (the default scope) between checks, and their locks are lost"
            ),
            format!("{fix}; or check_interval well below it"),
        );
    }
    if t < lease {
        return Check::warn(
            NAME,
            format!(
                "idle_in_transaction_session_timeout = {shown}: a lease on every transaction-scoped holder shorter than dblock's shortest safe one ({lease:?} with this check interval and timeout), so a holder cut off may not learn of the loss before the server grants the lock to another"
            ),
            format!("{fix}; or at least {lease:?}"),
        );
    }
    Check::ok(
        NAME,
        format!(
            "idle_in_transaction_session_timeout = {shown}: a lease on every transaction-scoped holder (a silent one is ended; dblock notices first)"
        ),
    )
}

/// `client_connection_check_interval` (PostgreSQL 14 and later).
fn connection_check(facts: &Facts) -> Check {
    match facts.text(CHECK_INTERVAL) {
        Some(_) => Check::ok(
            "connection-check",
            "client_connection_check_interval supported: dblock sets it, so the server ends \
             the wait of a client that vanished",
        ),
        None => Check::warn(
            "connection-check",
            format!(
                "client_connection_check_interval unsupported (server_version_num {}): a \
                 waiter whose client vanished keeps its place in line until TCP notices",
                facts.text(VERSION_NUM).unwrap_or_default()
            ),
            "upgrade to PostgreSQL 14 or later",
        ),
    }
}

/// Whether fencing tokens can carry the WAL timeline.
fn fencing_timeline(timeline: Result<String, (String, String)>) -> Check {
    let counters = "fencing tokens fall back to plain counters, which a failover to a \
                    replica missing the last rows can repeat";
    match timeline {
        Ok(t) => Check::ok(
            "fencing-timeline",
            format!(
                "fencing tokens carry the WAL timeline ({}): they rise across a failover",
                u64::from_str_radix(&t, 16).map_or(t, |n| n.to_string())
            ),
        ),
        Err((code, message)) if code == "55000" => Check::warn(
            "fencing-timeline",
            format!("a standby ({message}): fenced locks need the primary"),
            "point the URL at the primary",
        ),
        Err((code, message)) => Check::warn(
            "fencing-timeline",
            format!("{counters} ({code}: {message})"),
            match code.as_str() {
                "42501" => {
                    "GRANT EXECUTE ON FUNCTION pg_catalog.pg_walfile_name(pg_lsn), \
                            pg_catalog.pg_current_wal_lsn() TO the role"
                }
                _ => {
                    "an engine without PostgreSQL's WAL: use plain counters knowingly, or \
                      PostgreSQL"
                }
            },
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(values: &[(usize, &str)]) -> Facts {
        let mut rows: Results = vec![vec![None]; TABLES + 3];
        for (i, v) in values {
            rows[*i] = vec![Some(v.to_string())];
        }
        Facts(rows)
    }

    #[test]
    fn an_idle_timeout_is_judged_against_the_handles_health_check() {
        let checking = (Duration::from_secs(1), Duration::from_secs(2));
        let verdict = |ms| idle_in_transaction(ms, checking, "fix".into()).verdict;
        use crate::doctor::Verdict::{Ok, Warn};
        // Off; shorter than the interval (healthy holders ended); shorter than the
        // shortest safe lease (2 × 1 s + 2 s + a tenth); a lease.
        assert_eq!(
            [0, 500, 1000, 3000, 4400, 60_000].map(verdict),
            [Ok, Warn, Warn, Warn, Ok, Ok]
        );
    }

    #[test]
    fn tls_warns_only_off_this_host_and_timelines_read_as_numbers() {
        let on = facts(&[(SSL, "on TLSv1.3")]);
        let off = facts(&[(SSL, "off")]);
        use crate::doctor::Verdict;
        assert_eq!(tls(&on, false, Pooler::None).verdict, Verdict::Ok);
        assert_eq!(tls(&off, true, Pooler::None).verdict, Verdict::Ok);
        let remote = tls(&off, false, Pooler::None);
        assert_eq!(remote.verdict, Verdict::Warn);
        assert!(remote.fix.unwrap_or_default().contains("sslmode"));
        let t = fencing_timeline(Ok("0000000A".into()));
        assert!(t.detail.contains("(10)"), "{}", t.detail);
        assert_eq!(
            fencing_timeline(Err(("42883".into(), "no".into()))).verdict,
            Verdict::Warn
        );
        assert_eq!(
            fencing_timeline(Err(("55000".into(), "recovery".into()))).verdict,
            Verdict::Warn
        );
    }
}
