//! The one-time setup for roles that may not create tables.
//!
//! Locks themselves need no privilege beyond connecting: advisory locks are open to
//! every role. Fencing tokens (and so leader election) keep the latest token of each
//! name in a table, `public.dblock_fencing`, and claims of scheduled slots keep the
//! record of runs in `public.dblock_runs` (one each per database); dblock creates them on
//! first use when the role may, and otherwise needs them created once by a role that may
//! (on PostgreSQL 15 and later only a schema's owner may create in it, `public`
//! included), with the grants for the roles that use them:
//!
//! ```text
//! dblock setup --db postgres://owner@db/app --grant app_user
//! ```
//!
//! or, from code, [`Locks::setup`](crate::Locks::setup); or the equivalent SQL, run by the
//! owner:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS public.dblock_fencing (
//!     key bigint PRIMARY KEY, namespace text NOT NULL, name text NOT NULL,
//!     token bigint NOT NULL, holder text NOT NULL, granted_at timestamptz NOT NULL);
//! CREATE TABLE IF NOT EXISTS public.dblock_leaders (
//!     key bigint PRIMARY KEY, namespace text NOT NULL, name text NOT NULL,
//!     token bigint NOT NULL, holder text NOT NULL, value text,
//!     published_at timestamptz NOT NULL);
//! CREATE TABLE IF NOT EXISTS public.dblock_runs (
//!     key bigint NOT NULL, slot text NOT NULL, namespace text NOT NULL,
//!     name text NOT NULL, attempt integer NOT NULL, host text NOT NULL,
//!     pid bigint NOT NULL, program text NOT NULL, started_at timestamptz NOT NULL,
//!     finished_at timestamptz, exit_code integer, PRIMARY KEY (key, slot));
//! CREATE INDEX IF NOT EXISTS dblock_runs_started ON public.dblock_runs (key, started_at);
//! GRANT USAGE ON SCHEMA public TO app_user;
//! GRANT SELECT, INSERT, UPDATE ON public.dblock_fencing, public.dblock_leaders TO app_user;
//! GRANT SELECT, INSERT, UPDATE, DELETE ON public.dblock_runs TO app_user;
//! ```
//!
//! (`dblock_leaders` keeps the values election leaders publish: see
//! [`Term::publish`](crate::leader::Term::publish).)
//!
//! Every permission error dblock meets on its own tables says which command fixes it
//! ([`Error::PermissionDenied`]).

use super::fence::setup_ddl;
use crate::error::{Error, ServerCode};
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::QueryError;
use crate::postgres::sql::{first_value, quote_ident, quote_literal};
use crate::raw::{FENCING_TABLE, LEADERS_TABLE, PG_FENCING_SCHEMA, RUNS_TABLE};

/// SQLSTATE insufficient_privilege.
pub(crate) const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Creates dblock's tables (`public.dblock_fencing` and `public.dblock_runs`, one each per
/// database) and grants the roles in `grant_to` what fenced locks and claims of slots
/// need on them (`USAGE` on the schema; `SELECT`, `INSERT`, `UPDATE` on the fencing
/// table, and `DELETE` too on the record of runs, which is pruned), as
/// [`Locks::setup`](crate::Locks::setup) documents; the tables, as SQL names them.
///
/// The tables are created in a transaction of their own, and each role's grants are a
/// statement of their own: cancelled, the setup is partly done, and running it again
/// completes it.
async fn setup(b: &PgBackend, grant_to: &[&str]) -> Result<String, Error> {
    let schema = PG_FENCING_SCHEMA;
    let table = format!("{}.{}", quote_ident(schema), FENCING_TABLE);
    let runs = super::runs::table_name();
    let armed = Armed::new(b.pinned().await?);
    // The leaders' table (values published by election leaders) beside it.
    let leaders = super::leader::leaders_table();
    let ddl = format!(
        "{}; {}; {}",
        super::fence::table_ddl(&table),
        super::leader::table_ddl(&leaders),
        super::runs::table_ddl(&runs)
    );
    let fix = format!(
        "run dblock setup as a role that may create tables in schema {schema:?} and grant on \
         them (its owner)"
    );
    setup_ddl(&armed, &ddl)
        .await
        .map_err(|e| owner_needed(e, &fix))?;
    for role in grant_to {
        let (grantee, name) = match role.eq_ignore_ascii_case("public") {
            true => ("PUBLIC".to_string(), "public".to_string()),
            false => (quote_ident(role), role.to_string()),
        };
        let has = |t: &str, privileges: &[&str]| {
            let (lit, tlit) = (quote_literal(&name), quote_literal(t));
            privileges
                .iter()
                .map(|p| format!("pg_catalog.has_table_privilege({lit}, {tlit}, '{p}')"))
                .collect::<Vec<_>>()
                .join(" AND ")
        };
        let sql = format!(
            "GRANT USAGE ON SCHEMA {s} TO {grantee}; \
             GRANT SELECT, INSERT, UPDATE ON {table}, {leaders} TO {grantee}; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON {runs} TO {grantee}; \
             SELECT {} AND {} AND {}",
            has(&table, &["SELECT", "INSERT", "UPDATE"]),
            has(&leaders, &["SELECT", "INSERT", "UPDATE"]),
            has(&runs, &["SELECT", "INSERT", "UPDATE", "DELETE"]),
            s = quote_ident(schema)
        );
        let rows = armed
            .conn()
            .query(&sql)
            .await
            .map_err(QueryError::into_error)
            .map_err(|e| owner_needed(e, &fix))?;
        if first_value(&rows, 3).as_deref() != Some("t") {
            // PostgreSQL only warned: the gap is dblock's finding, no server code.
            return Err(Error::PermissionDenied {
                message: format!(
                    "no privileges were granted to {name} on {table}, {leaders} and {runs}"
                ),
                fix,
                code: ServerCode::default(),
            });
        }
    }
    armed.disarm().recycle();
    Ok(format!(
        "{schema}.{FENCING_TABLE}, {schema}.{LEADERS_TABLE}, {schema}.{RUNS_TABLE}"
    ))
}

/// The command that creates and grants the fencing table for `role`.
pub(crate) fn setup_command(role: &str) -> String {
    format!(
        "have a role that may create tables in schema {:?} (its owner) run once: \
         dblock setup --db URL --grant {role} (or the SQL in the docs of dblock::Locks::setup)",
        PG_FENCING_SCHEMA
    )
}

/// A permission error, with what fixes it; other errors unchanged.
pub(crate) fn owner_needed(e: Error, fix: &str) -> Error {
    match e {
        Error::Database { code, message }
            if code.sqlstate.as_deref() == Some(INSUFFICIENT_PRIVILEGE) =>
        {
            Error::PermissionDenied {
                message,
                fix: fix.to_string(),
                code,
            }
        }
        other => other,
    }
}

impl PgBackend {
    /// [`RawLocks::setup`](crate::raw::RawLocks::setup) on PostgreSQL: see [`setup`].
    pub(crate) async fn setup_tables(&self, grant_to: &[&str]) -> Result<String, Error> {
        setup(self, grant_to).await
    }

    /// A permission error met while taking a fenced lock, with the command that fixes
    /// it; other errors unchanged.
    pub(crate) fn fencing_permission(&self, e: Error) -> Error {
        self.needs_setup(e, "fencing tokens need dblock's table")
    }

    /// A permission error met on the record of runs, with the command that fixes it;
    /// other errors unchanged.
    pub(crate) fn runs_permission(&self, e: Error) -> Error {
        self.needs_setup(e, "claims of scheduled slots need dblock's table")
    }

    /// A permission error on a table of dblock's, saying what `needs` it and naming the
    /// setup command; other errors unchanged.
    fn needs_setup(&self, e: Error, needs: &str) -> Error {
        match e {
            Error::Database { code, message }
                if code.sqlstate.as_deref() == Some(INSUFFICIENT_PRIVILEGE) =>
            {
                Error::PermissionDenied {
                    message: format!("{message} ({needs})"),
                    fix: setup_command(&self.role),
                    code,
                }
            }
            other => other,
        }
    }
}
