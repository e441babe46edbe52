//! The parsers of what users and servers hand dblock — connection strings, migration
//! file names, SQL split into statements, the comments read back from the server —
//! reachable from outside the crate for the property tests, the differential test of the
//! statement splitter and the fuzz targets (`parser-checks/`, `fuzz/`).
//!
//! **Not an API**: hidden from the documentation, with no stability promise. Each
//! function is the crate's own parser, called exactly as the crate calls it; none adds
//! logic of its own.

use std::time::SystemTime;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::Error;
use crate::migrate::Layout;

/// The `(key, value)` pairs of a PostgreSQL connection string of either form, in order.
pub fn conninfo_pairs(s: &str) -> Result<Vec<(String, String)>, String> {
    crate::conninfo::pairs(s)
}

/// A connection string (of any backend) as every message shows it: passwords hidden.
pub fn redact(s: &str) -> String {
    crate::error::redact_url(s)
}

/// Whether `s` is a libpq `key=value` string (what [`Locks::connect`](crate::Locks::connect)
/// then opens as PostgreSQL).
pub fn is_key_value(s: &str) -> bool {
    crate::conninfo::is_key_value(s)
}

/// A PostgreSQL connection string read: what dblock's own connections are configured
/// with. `Debug` shows all of it (the driver's configuration hides its password).
#[cfg(feature = "postgres")]
#[derive(Debug)]
pub struct PgConnectionString {
    /// The driver's configuration.
    pub config: tokio_postgres::Config,
    /// The string as messages show it.
    pub shown: String,
    /// The TLS settings (`Debug` of dblock's own, defaults resolved).
    pub tls: String,
    /// dblock's `pooler=` parameter, if given.
    pub pooler: Option<crate::postgres::Pooler>,
}

/// Reads a PostgreSQL connection string as [`Locks::connect`](crate::Locks::connect)
/// does before it connects, with `env` standing for the process environment (libpq's
/// variables, `HOME`, `USER`).
///
/// # Errors
///
/// [`Error::InvalidUrl`], exactly as `Locks::connect` returns it.
#[cfg(feature = "postgres")]
pub fn postgres_connection_string(
    s: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PgConnectionString, Error> {
    let (parsed, pooler) = crate::postgres::read_connection_string(s, env)?;
    Ok(PgConnectionString {
        config: parsed.config,
        shown: parsed.shown,
        tls: format!("{:?}", parsed.tls),
        pooler,
    })
}

/// Reads a `mysql://` or `mariadb://` URL as [`Locks::connect`](crate::Locks::connect)
/// does before it connects. (The options are sqlx's, whose `Debug` shows the password:
/// dblock never formats them.)
///
/// # Errors
///
/// [`Error::InvalidUrl`], exactly as `Locks::connect` returns it.
#[cfg(feature = "mysql")]
pub fn mysql_url(s: &str) -> Result<sqlx::mysql::MySqlConnectOptions, Error> {
    crate::mysql::read_url(s)
}

/// The database file a `sqlite:` URL names.
#[cfg(feature = "sqlite")]
pub fn sqlite_url(s: &str) -> Result<std::path::PathBuf, String> {
    crate::sqlite::parse_url(s)
}

/// The statements of an SQL script, as a migration outside a transaction sends them.
pub fn split_statements(sql: &str) -> Vec<&str> {
    crate::migrate::split::split(sql)
}

/// The transaction-control statement `stmt` is, if it is one (`BEGIN`, `COMMIT`, …).
pub fn transaction_control(stmt: &str) -> Option<String> {
    crate::migrate::split::transaction_control(stmt)
}

/// A migration file name, understood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationFileName {
    /// The version.
    pub version: i64,
    /// The name after the version.
    pub name: String,
    /// Whether it is the `.down.sql` of a pair.
    pub down: bool,
    /// Its layout.
    pub layout: Layout,
    /// How many digits the version was written with.
    pub width: usize,
}

/// A migration file name read by the rule of every layout dblock reads.
pub fn migration_file_name(file_name: &str) -> Result<MigrationFileName, String> {
    use crate::migrate::layout::{Kind, parse};
    parse(file_name).map(|f| MigrationFileName {
        version: f.version,
        name: f.name.to_string(),
        down: f.kind == Kind::Down,
        layout: f.layout,
        width: f.width,
    })
}

/// The file names `dblock migrate new NAME` writes after a directory whose greatest
/// version is `last` (with the digits it was written with), in `layout`, at `now`.
pub fn next_migration_files(
    layout: Layout,
    last: Option<(i64, usize)>,
    name: &str,
    now: SystemTime,
) -> Result<Vec<String>, String> {
    crate::migrate::layout::next_files(crate::migrate::layout::Style { layout, last }, name, now)
}

/// A dblock comment read back from the server (`pg_stat_activity.query`, MySQL's
/// processlist).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Comment {
    /// The lock's namespace.
    pub namespace: String,
    /// The lock's name.
    pub name: String,
    /// The holder's host.
    pub host: Option<String>,
    /// The holder's process id.
    pub pid: Option<u32>,
    /// The lock's scope.
    pub scope: Option<crate::Scope>,
    /// Since when it is held.
    pub since: Option<SystemTime>,
}

/// Every whole dblock comment in `text`.
pub fn parse_comments(text: &str) -> Vec<Comment> {
    crate::status::parse_comments(text)
        .into_iter()
        .map(|c| Comment {
            namespace: c.namespace,
            name: c.name,
            host: c.host,
            pid: c.pid,
            scope: c.scope,
            since: c.since,
        })
        .collect()
}

/// The comment a request for `name` in `namespace` carries to the server.
pub fn write_comment(
    namespace: &str,
    name: &str,
    scope: Option<crate::Scope>,
    since: Option<SystemTime>,
) -> String {
    let mut s = String::new();
    crate::status::write_comment(&mut s, namespace, name, scope, since);
    s
}

/// This process's `holder=` value as a comment carries it, read back: (host, pid).
pub fn holder() -> (String, u32) {
    (crate::status::host().to_string(), std::process::id())
}
