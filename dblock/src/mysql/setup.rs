//! The one-time setup on MySQL / MariaDB for users that may not create tables.
//!
//! Named locks need no privilege. Fencing tokens (and so leader election) keep the
//! latest token of each name in `dblock_fencing`, and claims of scheduled slots the
//! record of runs in `dblock_runs`, in the URL's database; dblock creates them on first
//! use when the user may, and otherwise needs them created once by a user that may, with
//! the grants for the users that use them:
//!
//! ```text
//! dblock setup --db mysql://owner@db/app --grant app_user
//! ```
//!
//! or, from code, `Locks::setup`; or the equivalent SQL:
//!
//! ```sql
//! CREATE TABLE IF NOT EXISTS app.dblock_fencing (
//!     `key` BIGINT NOT NULL PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL,
//!     token BIGINT NOT NULL, holder VARCHAR(255) NOT NULL, granted_at VARCHAR(32) NOT NULL)
//!     ENGINE=InnoDB;
//! CREATE TABLE IF NOT EXISTS app.dblock_leaders (
//!     `key` BIGINT NOT NULL PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL,
//!     token BIGINT NOT NULL, holder VARCHAR(255) NOT NULL,
//!     value TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
//!     published_at VARCHAR(32) NOT NULL) ENGINE=InnoDB;
//! CREATE TABLE IF NOT EXISTS app.dblock_runs (
//!     `key` BIGINT NOT NULL,
//!     slot VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
//!     namespace TEXT CHARACTER SET utf8mb4 NOT NULL, name TEXT CHARACTER SET utf8mb4 NOT NULL,
//!     attempt INT NOT NULL, host VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
//!     pid BIGINT NOT NULL, program VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
//!     started_at DATETIME(6) NOT NULL, finished_at DATETIME(6) NULL, exit_code INT NULL,
//!     PRIMARY KEY (`key`, slot), KEY dblock_runs_started (`key`, started_at)) ENGINE=InnoDB;
//! GRANT SELECT, INSERT, UPDATE ON app.dblock_fencing TO 'app_user'@'%';
//! GRANT SELECT, INSERT, UPDATE ON app.dblock_leaders TO 'app_user'@'%';
//! GRANT SELECT, INSERT, UPDATE, DELETE ON app.dblock_runs TO 'app_user'@'%';
//! ```
//!
//! (`dblock_leaders` keeps the values election leaders publish.)

use super::{MyBackend, map_sqlx};
use crate::error::Error;

/// MySQL error numbers of a privilege the user lacks: ER_DBACCESS_DENIED_ERROR,
/// ER_TABLEACCESS_DENIED_ERROR, ER_COLUMNACCESS_DENIED_ERROR,
/// ER_SPECIFIC_ACCESS_DENIED_ERROR.
const ACCESS_DENIED: [u16; 4] = [1044, 1142, 1143, 1227];

/// Creates dblock's tables (`dblock_fencing` and `dblock_runs` in the handle's database)
/// and grants the users in `grant_to` what fenced locks and claims of slots need on them
/// (`SELECT`, `INSERT`, `UPDATE`; and `DELETE` on the record of runs, which is pruned);
/// returns the tables as SQL names them. A user is `name` (any host, `'name'@'%'`) or
/// `name@host`. Idempotent; run it as a user that may create tables in the database and
/// grant on them. `RawLocks::setup` on MySQL/MariaDB (`Locks::setup`).
///
/// # Errors
///
/// [`Error::PermissionDenied`] when this user may not create the tables or grant on them;
/// [`Error::InvalidName`] for an empty user; connection and server errors.
///
/// # Cancel safety
///
/// Each statement stands alone: cancelled, the setup is partly done, and running it
/// again completes it.
pub(crate) async fn setup(b: &MyBackend, grant_to: &[&str]) -> Result<String, Error> {
    let fix = fix_for(&b.database);
    b.ensure_fence_table()
        .await
        .map_err(|e| owner_needed(e, &fix))?;
    // The leaders' table (values published by election leaders) beside it.
    sqlx::raw_sql(super::fence::LEADERS_DDL)
        .execute(&b.pool)
        .await
        .map_err(|e| permission(e, &fix))?;
    b.ensure_runs_table()
        .await
        .map_err(|e| owner_needed(e, &fix))?;
    let db = quote_ident(&b.database);
    for user in grant_to {
        let grantee = grantee(user)?;
        for sql in [
            format!("GRANT SELECT, INSERT, UPDATE ON {db}.dblock_fencing TO {grantee}"),
            format!("GRANT SELECT, INSERT, UPDATE ON {db}.dblock_leaders TO {grantee}"),
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {db}.dblock_runs TO {grantee}"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&b.pool)
                .await
                .map_err(|e| permission(e, &fix))?;
        }
    }
    Ok(format!(
        "{db}.dblock_fencing, {db}.dblock_leaders, {db}.dblock_runs"
    ))
}

/// `'user'@'host'` for `user@host`, `'user'@'%'` for `user`, quoted as string literals.
fn grantee(user: &str) -> Result<String, Error> {
    let (name, host) = user.rsplit_once('@').unwrap_or((user, "%"));
    if name.is_empty() || host.is_empty() || user.contains(['\\', '\'']) {
        return Err(Error::InvalidName {
            name: user.to_string(),
            reason: "a MySQL user to grant to is NAME or NAME@HOST, without quotes or backslashes",
        });
    }
    Ok(format!("{}@{}", quote_literal(name), quote_literal(host)))
}

/// A string literal of text holding no quote or backslash (checked by the caller).
fn quote_literal(s: &str) -> String {
    format!("'{s}'")
}

pub(crate) fn quote_ident(s: &str) -> String {
    format!("`{}`", s.replace('`', "``"))
}

/// What to run when the fencing table cannot be created by this user.
pub(crate) fn fix_for(database: &str) -> String {
    format!(
        "have a user that may create tables in database {database:?} run once: dblock setup \
         --db mysql://OWNER@HOST/{database} --grant USER (or the SQL in the dblock::mysql::setup \
         docs)"
    )
}

/// An sqlx error as dblock's, a missing privilege as [`Error::PermissionDenied`] with
/// `fix`.
pub(crate) fn permission(e: sqlx::Error, fix: &str) -> Error {
    let number = match &e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|m| m.number()),
        _ => None,
    };
    match number {
        Some(n) if ACCESS_DENIED.contains(&n) => {
            let e = map_sqlx(e);
            Error::PermissionDenied {
                message: e.to_string(),
                fix: fix.to_string(),
                code: e.server_code().cloned().unwrap_or_default(),
            }
        }
        _ => map_sqlx(e),
    }
}

/// A permission error with `fix`; other errors unchanged.
fn owner_needed(e: Error, fix: &str) -> Error {
    match e {
        Error::PermissionDenied { message, code, .. } => Error::PermissionDenied {
            message,
            fix: fix.to_string(),
            code,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grantees_are_quoted_literals() {
        assert_eq!(grantee("app").ok(), Some("'app'@'%'".to_string()));
        assert_eq!(
            grantee("ab@10.0.0.1").ok(),
            Some("'ab'@'10.0.0.1'".to_string())
        );
        assert!(grantee("a'b").is_err());
        assert!(grantee("a\\b").is_err());
        assert!(grantee("@h").is_err());
        assert!(grantee("u@").is_err());
    }
}
