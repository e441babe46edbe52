//! The one-time setup for roles that may not create tables.
//!
//! Locks themselves need no privilege beyond connecting: advisory locks are open to
//! every role. Fencing tokens (and so leader election) keep the latest token of each
//! name in a table, `dblock_fencing`, in the schema in use; dblock creates it on first
//! use when the role may, and otherwise needs it created once by a role that may (on
//! PostgreSQL 15 and later only a schema's owner may create in it, `public` included),
//! with the grants for the roles that take fenced locks:
//!
//! ```text
//! dblock setup --db postgres://owner@db/app --schema public --grant app_user
//! ```
//!
//! or, from code, [`setup`]; or the equivalent SQL, run by the owner:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS public.dblock_fencing (
//!     key bigint PRIMARY KEY, namespace text NOT NULL, name text NOT NULL,
//!     token bigint NOT NULL, holder text NOT NULL, granted_at timestamptz NOT NULL);
//! GRANT USAGE ON SCHEMA public TO app_user;
//! GRANT SELECT, INSERT, UPDATE ON public.dblock_fencing TO app_user;
//! ```
//!
//! Every permission error dblock meets on its own table says which command fixes it
//! ([`Error::PermissionDenied`]).

use super::{Armed, PgBackend, QueryError, quote_ident};
use crate::locks::Backend;
use crate::{Error, Locks};

/// SQLSTATE insufficient_privilege.
pub(crate) const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Creates dblock's fencing table in `schema` (the handle's schema in use if `None`)
/// and grants the roles in `grant_to` what fenced locks need on it (`USAGE` on the
/// schema; `SELECT`, `INSERT`, `UPDATE` on the table). Idempotent; run it as a role
/// that may create tables in the schema (its owner). `PUBLIC` is a valid grantee.
///
/// # Errors
///
/// [`Error::PermissionDenied`] when this role may not create the table or grant on it;
/// [`Error::Unsupported`] on the embedded backend, which needs no setup; connection and
/// server errors.
///
/// # Cancel safety
///
/// The table is created in a transaction of its own, and each grant is a statement of
/// its own: cancelled, the setup is partly done, and running it again completes it.
pub async fn setup(locks: &Locks, schema: Option<&str>, grant_to: &[&str]) -> Result<(), Error> {
    let b = match &locks.inner.backend {
        Backend::Postgres(b) => b,
        #[cfg(feature = "sqlite")]
        Backend::Sqlite(_) => {
            return Err(Error::Unsupported(
                "the embedded backend needs no setup: its tables are created in the lock file"
                    .into(),
            ));
        }
    };
    let schema = match schema.or(b.schema.as_deref()) {
        Some(s) => s.to_string(),
        None => {
            return Err(Error::Unsupported(
                "no schema given, and no schema of the search_path exists".into(),
            ));
        }
    };
    let table = format!("{}.{}", quote_ident(&schema), crate::fencing::TABLE);
    let armed = Armed::new(b.pinned().await?);
    let ddl = crate::fencing::pg_table_ddl(&table);
    let fix = |e: Error| {
        owner_needed(
            e,
            &format!(
                "run dblock setup as a role that may create tables in schema {schema:?} \
                 and grant on them (its owner)"
            ),
        )
    };
    crate::migrate::pg::own_ddl(&armed, &ddl)
        .await
        .map_err(fix)?;
    for role in grant_to {
        let grantee = match role.eq_ignore_ascii_case("public") {
            true => "PUBLIC".to_string(),
            false => quote_ident(role),
        };
        let sql = format!(
            "GRANT USAGE ON SCHEMA {s} TO {grantee}; \
             GRANT SELECT, INSERT, UPDATE ON {table} TO {grantee}",
            s = quote_ident(&schema)
        );
        armed
            .conn()
            .query(&sql)
            .await
            .map_err(QueryError::into_error)
            .map_err(fix)?;
    }
    armed.disarm().recycle();
    Ok(())
}

/// The command that creates and grants the fencing table for `role`.
pub(crate) fn setup_command(schema: &str, role: &str) -> String {
    format!(
        "have a role that may create tables in schema {schema:?} (its owner) run once: \
         dblock setup --db URL --schema {schema} --grant {role} \
         (or the SQL in the dblock::postgres::setup docs)"
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
    /// A permission error met while taking a fenced lock, with the command that fixes
    /// it; other errors unchanged.
    pub(crate) fn fencing_permission(&self, e: Error) -> Error {
        let schema = self.schema.as_deref().unwrap_or("public");
        match e {
            Error::Database {
                code: Some(c),
                message,
            } if c == INSUFFICIENT_PRIVILEGE => Error::PermissionDenied {
                message: format!("{message} (fencing tokens need dblock's table)"),
                fix: setup_command(schema, &self.role),
            },
            other => other,
        }
    }
}
