//! The one-time setup for roles that may not create tables.
//!
//! Locks themselves need no privilege beyond connecting: advisory locks are open to
//! every role. Fencing tokens (and so leader election) keep the latest token of each
//! name in a table, `public.dblock_fencing` (one per database); dblock creates it on
//! first use when the role may, and otherwise needs it created once by a role that may
//! (on PostgreSQL 15 and later only a schema's owner may create in it, `public`
//! included), with the grants for the roles that take fenced locks:
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
//! GRANT USAGE ON SCHEMA public TO app_user;
//! GRANT SELECT, INSERT, UPDATE ON public.dblock_fencing, public.dblock_leaders TO app_user;
//! ```
//!
//! (`dblock_leaders` keeps the values election leaders publish: see
//! [`Term::publish`](crate::leader::Term::publish).)
//!
//! Every permission error dblock meets on its own table says which command fixes it
//! ([`Error::PermissionDenied`]).

use super::fence::setup_ddl;
use crate::error::Error;
use crate::postgres::backend::PgBackend;
use crate::postgres::conn::Armed;
use crate::postgres::conn::wire::QueryError;
use crate::postgres::sql::{first_value, quote_ident, quote_literal};
use crate::raw::{FENCING_TABLE, PG_FENCING_SCHEMA};

/// SQLSTATE insufficient_privilege.
pub(crate) const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Creates dblock's fencing table (`public.dblock_fencing`, one per database) and grants
/// the roles in `grant_to` what fenced locks need on it (`USAGE` on the schema;
/// `SELECT`, `INSERT`, `UPDATE` on the table), as [`Locks::setup`](crate::Locks::setup)
/// documents; the table, as SQL names it.
///
/// The table is created in a transaction of its own, and each grant is a statement of
/// its own: cancelled, the setup is partly done, and running it again completes it.
async fn setup(b: &PgBackend, grant_to: &[&str]) -> Result<String, Error> {
    let schema = PG_FENCING_SCHEMA;
    let table = format!("{}.{}", quote_ident(schema), FENCING_TABLE);
    let armed = Armed::new(b.pinned().await?);
    // The leaders' table (values published by election leaders) beside it.
    let leaders = super::leader::leaders_table();
    let ddl = format!(
        "{}; {}",
        super::fence::table_ddl(&table),
        super::leader::table_ddl(&leaders)
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
        let lit = quote_literal(&name);
        let tlit = quote_literal(&table);
        let llit = quote_literal(&leaders);
        let sql = format!(
            "GRANT USAGE ON SCHEMA {s} TO {grantee}; \
             GRANT SELECT, INSERT, UPDATE ON {table}, {leaders} TO {grantee}; \
             SELECT has_table_privilege({lit}, {tlit}, 'SELECT') \
             AND has_table_privilege({lit}, {tlit}, 'INSERT') \
             AND has_table_privilege({lit}, {tlit}, 'UPDATE') \
             AND has_table_privilege({lit}, {llit}, 'SELECT') \
             AND has_table_privilege({lit}, {llit}, 'INSERT') \
             AND has_table_privilege({lit}, {llit}, 'UPDATE')",
            s = quote_ident(schema)
        );
        let rows = armed
            .conn()
            .query(&sql)
            .await
            .map_err(QueryError::into_error)
            .map_err(|e| owner_needed(e, &fix))?;
        if first_value(&rows, 2).as_deref() != Some("t") {
            return Err(Error::PermissionDenied {
                message: format!("no privileges were granted to {name} on {table}"),
                fix,
            });
        }
    }
    armed.disarm().recycle();
    Ok(format!("{schema}.{FENCING_TABLE}"))
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
        Error::Database {
            code: Some(c),
            message,
        } if c == INSUFFICIENT_PRIVILEGE => Error::PermissionDenied {
            message,
            fix: fix.to_string(),
        },
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
        match e {
            Error::Database {
                code: Some(c),
                message,
            } if c == INSUFFICIENT_PRIVILEGE => Error::PermissionDenied {
                message: format!("{message} (fencing tokens need dblock's table)"),
                fix: setup_command(&self.role),
            },
            other => other,
        }
    }
}
