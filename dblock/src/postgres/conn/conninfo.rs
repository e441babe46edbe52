//! Reading a PostgreSQL connection string (either form, see `crate::conninfo`) into
//! the driver's configuration and the TLS settings, with libpq's environment variables
//! and password file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::tls::{RootCert, SslMode, TlsOptions};
use crate::conninfo::{pairs, redact, shown_key};

/// The keys dblock passes to tokio-postgres as they are.
const DRIVER_KEYS: &[&str] = &[
    "user",
    "password",
    "dbname",
    "options",
    "application_name",
    "sslnegotiation",
    "host",
    "hostaddr",
    "port",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
];

/// The keys dblock reads itself.
const OWN_KEYS: &[&str] = &[
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "passfile",
    "fallback_application_name",
];

/// libpq's environment variables, each the default of one key.
const ENV_DEFAULTS: &[(&str, &str)] = &[
    ("host", "PGHOST"),
    ("hostaddr", "PGHOSTADDR"),
    ("port", "PGPORT"),
    ("user", "PGUSER"),
    ("password", "PGPASSWORD"),
    ("dbname", "PGDATABASE"),
    ("application_name", "PGAPPNAME"),
    ("sslmode", "PGSSLMODE"),
    ("sslrootcert", "PGSSLROOTCERT"),
    ("sslcert", "PGSSLCERT"),
    ("sslkey", "PGSSLKEY"),
    ("passfile", "PGPASSFILE"),
    ("connect_timeout", "PGCONNECT_TIMEOUT"),
    ("target_session_attrs", "PGTARGETSESSIONATTRS"),
    ("options", "PGOPTIONS"),
    ("channel_binding", "PGCHANNELBINDING"),
];

/// A connection string read: the driver's configuration, the TLS settings, and a
/// description fit to show (no password).
pub(crate) struct Parsed {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) tls: TlsOptions,
    pub(crate) shown: String,
}

/// Reads a connection string (either form), filling what it leaves out from `env`
/// (libpq's variables; `HOME` and `USER` too) and the password file. The error is the
/// reason, never containing a password.
pub(crate) fn parse(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Parsed, String> {
    let mut map = options(s)?;
    let host_given = map.contains_key("host") || map.contains_key("hostaddr");
    for (key, var) in ENV_DEFAULTS {
        if !map.contains_key(*key)
            && let Some(v) = env(var)
        {
            map.insert((*key).to_string(), v);
        }
    }
    let host_from_env = !host_given && (map.contains_key("host") || map.contains_key("hostaddr"));
    let home = env("HOME").map(PathBuf::from);
    let first_port = first_port(&map)?;
    let host_defaulted = libpq_defaults(&mut map, first_port, env);
    let passfile = map.remove("passfile");
    if !map.contains_key("password")
        && let Some(pw) = password_from_file(&map, passfile, home.as_deref(), first_port)
    {
        map.insert("password".into(), pw);
    }
    let tls = tls_options(&mut map, home.as_deref())?;
    let mut config = driver_config(&map)?;
    config.ssl_mode(tls.mode.driver_mode());
    let mut shown = redact(s);
    if host_from_env || host_defaulted {
        let hosts = map.get("host").or_else(|| map.get("hostaddr"));
        let from = if host_from_env {
            "from PGHOST"
        } else {
            "default"
        };
        shown = format!(
            "{shown} (host {} {from})",
            hosts.map(String::as_str).unwrap_or_default()
        );
    }
    Ok(Parsed { config, tls, shown })
}

/// The string's options, each key one dblock reads (passed on or its own).
fn options(s: &str) -> Result<HashMap<String, String>, String> {
    let mut map = HashMap::new();
    for (k, v) in pairs(s)? {
        if !DRIVER_KEYS.contains(&k.as_str()) && !OWN_KEYS.contains(&k.as_str()) {
            return Err(format!(
                "unknown connection option {:?} (dblock reads libpq's: host, port, dbname, \
                 user, password, sslmode, sslrootcert, sslcert, sslkey, passfile, \
                 application_name, target_session_attrs, connect_timeout, options, …)",
                shown_key(&k)
            ));
        }
        map.insert(k, v);
    }
    Ok(map)
}

/// The first host's port: the first of `port`'s list, else libpq's 5432.
fn first_port(map: &HashMap<String, String>) -> Result<u16, String> {
    let first = match map.get("port") {
        Some(p) => p.split(',').next().unwrap_or_default(),
        None => "",
    };
    match first {
        "" => Ok(5432),
        first => first.parse().map_err(|_| format!("invalid port {first:?}")),
    }
}

/// libpq's defaults for what the string and the environment left out: the host, the
/// user, the application's name, the connect timeout; and keepalives. Whether the host
/// was defaulted.
fn libpq_defaults(
    map: &mut HashMap<String, String>,
    first_port: u16,
    env: &dyn Fn(&str) -> Option<String>,
) -> bool {
    let mut host_defaulted = false;
    if !map.contains_key("host") && !map.contains_key("hostaddr") {
        // The local server's socket, where libpq (as packaged by Debian and most
        // distributions, or as built) looks; else TCP to localhost.
        let dir = ["/var/run/postgresql", "/tmp"]
            .into_iter()
            .find(|d| Path::new(d).join(format!(".s.PGSQL.{first_port}")).exists());
        map.insert("host".into(), dir.unwrap_or("localhost").to_string());
        host_defaulted = true;
    }
    if !map.contains_key("user")
        && let Some(u) = env("USER").or_else(|| env("LOGNAME"))
    {
        map.insert("user".into(), u);
    }
    if !map.contains_key("application_name") {
        let name = map
            .get("fallback_application_name")
            .cloned()
            .unwrap_or_else(crate::status::default_application_name);
        map.insert("application_name".into(), name);
    }
    map.remove("fallback_application_name");
    map.entry("connect_timeout".into())
        .or_insert_with(|| "10".into());
    // A dead peer must not look alive for two hours: probe idle sockets after 30 s.
    map.entry("keepalives_idle".into())
        .or_insert_with(|| "30".into());
    host_defaulted
}

/// The password the password file (`passfile`, else `~/.pgpass`) has for the first
/// host, its port, the database and the user.
fn password_from_file(
    map: &HashMap<String, String>,
    passfile: Option<String>,
    home: Option<&Path>,
    first_port: u16,
) -> Option<String> {
    let file = passfile
        .map(PathBuf::from)
        .or_else(|| home.map(|h| h.join(".pgpass")))?;
    let host = map
        .get("host")
        .and_then(|h| h.split(',').next())
        .unwrap_or_default();
    // A socket directory matches `localhost`, as in libpq.
    let host = if host.starts_with('/') || host.is_empty() {
        "localhost"
    } else {
        host
    };
    let user = map.get("user").cloned().unwrap_or_default();
    let db = map.get("dbname").cloned().unwrap_or_else(|| user.clone());
    pgpass_lookup(&file, host, first_port, &db, &user)
}

/// The TLS settings, taken out of `map`: the root certificates, the mode, the client
/// certificate and key (each with libpq's default files under `home`).
fn tls_options(
    map: &mut HashMap<String, String>,
    home: Option<&Path>,
) -> Result<TlsOptions, String> {
    let root_cert = match map.remove("sslrootcert") {
        Some(v) if v == "system" => Some(RootCert::System),
        Some(v) => Some(RootCert::File(PathBuf::from(v))),
        None => home
            .map(|h| h.join(".postgresql/root.crt"))
            .filter(|p| p.exists())
            .map(RootCert::File),
    };
    let mode = match map.remove("sslmode") {
        Some(v) => SslMode::parse(&v).ok_or_else(|| {
            format!(
                "invalid sslmode {v:?}: expected disable, allow, prefer, require, verify-ca \
                 or verify-full"
            )
        })?,
        // libpq 16: the system's roots are for public certificates, checked in full.
        None if root_cert == Some(RootCert::System) => SslMode::VerifyFull,
        None => SslMode::Prefer,
    };
    if root_cert == Some(RootCert::System) && mode != SslMode::VerifyFull {
        return Err(format!(
            "weak sslmode {:?} may not be used with sslrootcert=system (use \"verify-full\")",
            mode.as_str()
        ));
    }
    let cert = map.remove("sslcert").map(PathBuf::from);
    let key = map.remove("sslkey").map(PathBuf::from);
    let default_file = |name: &str| home.map(|h| h.join(".postgresql").join(name));
    let client_cert = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (Some(c), None) => match default_file("postgresql.key").filter(|k| k.exists()) {
            Some(k) => Some((c, k)),
            None => return Err("sslcert is given but sslkey is not".into()),
        },
        (None, Some(_)) => return Err("sslkey is given but sslcert is not".into()),
        (None, None) => match (
            default_file("postgresql.crt").filter(|p| p.exists()),
            default_file("postgresql.key").filter(|p| p.exists()),
        ) {
            (Some(c), Some(k)) => Some((c, k)),
            _ => None,
        },
    };
    Ok(TlsOptions {
        mode,
        root_cert,
        client_cert,
    })
}

/// The driver's part, written as a key=value string its parser checks. Its errors
/// name the option, never the value.
fn driver_config(map: &HashMap<String, String>) -> Result<tokio_postgres::Config, String> {
    let mut kv = String::new();
    let mut keys: Vec<&String> = map.keys().collect();
    keys.sort();
    for k in keys {
        let v = &map[k];
        kv.push_str(k);
        kv.push_str("='");
        for c in v.chars() {
            if c == '\'' || c == '\\' {
                kv.push('\\');
            }
            kv.push(c);
        }
        kv.push_str("' ");
    }
    kv.parse().map_err(|e: tokio_postgres::Error| {
        // "invalid value for option `port`" and the like.
        let mut m = e.to_string();
        if let Some(src) = std::error::Error::source(&e) {
            let s = src.to_string();
            if !m.contains(&s) {
                m = format!("{m}: {s}");
            }
        }
        m
    })
}

/// The password for a connection from a libpq password file (`host:port:db:user:pw`
/// lines, `*` matching anything, `\` escaping `:` and `\`). As libpq does, a file
/// others may read is ignored.
fn pgpass_lookup(
    file: &std::path::Path,
    host: &str,
    port: u16,
    db: &str,
    user: &str,
) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(file).ok()?;
        if !meta.is_file() || meta.permissions().mode() & 0o077 != 0 {
            return None;
        }
    }
    let text = std::fs::read_to_string(file).ok()?;
    let port = port.to_string();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = split_pgpass(line);
        let [h, p, d, u, pw] = fields.as_slice() else {
            continue;
        };
        let m = |field: &str, want: &str| field == "*" || field == want;
        if m(h, host) && m(p, &port) && m(d, db) && m(u, user) {
            return Some(pw.clone());
        }
    }
    None
}

/// The five fields of a password file line (the last takes the rest of the line).
fn split_pgpass(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        let last = fields.len() - 1;
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    fields[last].push(n);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields[last].push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conninfo::is_key_value;

    #[test]
    fn passwords_never_reach_the_shown_string() {
        for (given, shown) in [
            (
                "postgres://u:secret@h:5432/db?x=1",
                "postgres://u:***@h:5432/db?x=1",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("postgres://h:5432/db", "postgres://h:5432/db"),
            (
                "postgresql://h/db?user=u&password=secret&sslmode=require",
                "postgresql://h/db?user=u&password=***&sslmode=require",
            ),
            (
                "postgres://h/db?pass%77ord=secret",
                "postgres://h/db?pass%77ord=***",
            ),
            ("postgres://u:p%40ss:secret@h/db", "postgres://u:***@h/db"),
            (
                "host=h password=secret dbname=d",
                "host=h password=*** dbname=d",
            ),
            (
                "host=h password = 'se cret\\' x' dbname=d",
                "host=h password = *** dbname=d",
            ),
            ("host=h password='secret", "host=h…"),
            ("sqlite:/tmp/x.db", "sqlite:/tmp/x.db"),
            ("mysql://u:secret@h/db", "mysql://u:***@h/db"),
            ("postgres://u:se/cret@h/db", "postgres://u:***@h/db"),
            ("postgres://u:se?cret@h/db", "postgres://u:***@h/db"),
            (
                "postgres://u:secret@h/db?application_name=a@b&password=secret",
                "postgres://u:***@b&password=***",
            ),
        ] {
            let r = redact(given);
            assert_eq!(r, shown, "{given}");
            assert!(!r.contains("secret"), "{r}");
        }
    }

    #[test]
    fn key_value_strings_are_recognised() {
        assert!(is_key_value("host=/tmp dbname=x"));
        assert!(is_key_value("  dbname = x"));
        assert!(!is_key_value("postgres://h/db"));
        assert!(!is_key_value("sqlite:a=b"));
        assert!(!is_key_value("nonsense"));
    }

    #[cfg(feature = "postgres")]
    mod parsing {
        use super::super::*;
        use crate::postgres::conn::tls::{RootCert, SslMode};
        use tokio_postgres::config::Host;

        fn no_env(_: &str) -> Option<String> {
            None
        }

        fn hosts(p: &Parsed) -> Vec<String> {
            p.config
                .get_hosts()
                .iter()
                .map(|h| match h {
                    Host::Tcp(s) => s.clone(),
                    Host::Unix(p) => p.display().to_string(),
                })
                .collect()
        }

        #[test]
        fn unix_socket_hosts_in_every_spelling() {
            for s in [
                "postgres:///db?host=/var/run/postgresql",
                "postgres://%2Fvar%2Frun%2Fpostgresql/db",
                "postgres:///db?host=%2Fvar%2Frun%2Fpostgresql",
                "host=/var/run/postgresql dbname=db",
            ] {
                let p = parse(s, &no_env).unwrap();
                assert_eq!(hosts(&p), ["/var/run/postgresql"], "{s}");
                assert!(matches!(p.config.get_hosts()[0], Host::Unix(_)), "{s}");
                assert_eq!(p.config.get_dbname(), Some("db"), "{s}");
            }
        }

        #[test]
        fn several_hosts_with_their_ports_and_session_attrs() {
            let p = parse(
                "postgres://u@a:5433,[::1]:5434,c/db?target_session_attrs=read-write",
                &no_env,
            )
            .unwrap();
            assert_eq!(hosts(&p), ["a", "::1", "c"]);
            assert_eq!(p.config.get_ports(), [5433, 5434, 5432]);
            assert_eq!(
                p.config.get_target_session_attrs(),
                tokio_postgres::config::TargetSessionAttrs::ReadWrite
            );
        }

        #[test]
        fn the_environment_fills_what_the_string_leaves_out() {
            let env = |k: &str| {
                Some(
                    match k {
                        "PGHOST" => "envhost",
                        "PGPORT" => "6000",
                        "PGUSER" => "envuser",
                        "PGPASSWORD" => "envpw",
                        "PGDATABASE" => "envdb",
                        "PGAPPNAME" => "envapp",
                        "PGSSLMODE" => "require",
                        _ => return None,
                    }
                    .to_string(),
                )
            };
            let p = parse("postgres://", &env).unwrap();
            assert_eq!(hosts(&p), ["envhost"]);
            assert_eq!(p.config.get_ports(), [6000]);
            assert_eq!(p.config.get_user(), Some("envuser"));
            assert_eq!(p.config.get_password(), Some(&b"envpw"[..]));
            assert_eq!(p.config.get_dbname(), Some("envdb"));
            assert_eq!(p.config.get_application_name(), Some("envapp"));
            assert_eq!(p.tls.mode, SslMode::Require);
            assert!(!p.shown.contains("envpw"), "{}", p.shown);
            assert!(p.shown.contains("envhost"), "{}", p.shown);
            // The string wins over the environment.
            let p = parse("host=h port=1 user=u dbname=d sslmode=disable", &env).unwrap();
            assert_eq!(hosts(&p), ["h"]);
            assert_eq!(p.config.get_ports(), [1]);
            assert_eq!(p.config.get_user(), Some("u"));
            assert_eq!(p.config.get_dbname(), Some("d"));
            assert_eq!(p.tls.mode, SslMode::Disable);
        }

        #[test]
        fn tls_settings_follow_libpq() {
            let p = parse("postgres://h/db", &no_env).unwrap();
            assert_eq!(p.tls.mode, SslMode::Prefer);
            let p = parse("postgres://h/db?sslrootcert=system", &no_env).unwrap();
            assert_eq!(p.tls.mode, SslMode::VerifyFull);
            assert_eq!(p.tls.root_cert, Some(RootCert::System));
            let e = parse(
                "postgres://h/db?sslrootcert=system&sslmode=require",
                &no_env,
            )
            .err()
            .unwrap();
            assert!(e.contains("weak sslmode"), "{e}");
            let e = parse("postgres://h/db?sslmode=bogus", &no_env)
                .err()
                .unwrap();
            assert!(e.contains("invalid sslmode"), "{e}");
            let e = parse("postgres://h/db?sslcert=/x.crt", &no_env)
                .err()
                .unwrap();
            assert!(e.contains("sslkey"), "{e}");
            let p = parse(
                "sslmode=verify-ca sslrootcert=/ca.pem sslcert=/c.pem sslkey=/k.pem host=h",
                &no_env,
            )
            .unwrap();
            assert_eq!(p.tls.mode, SslMode::VerifyCa);
            assert_eq!(p.tls.root_cert, Some(RootCert::File("/ca.pem".into())));
            assert_eq!(p.tls.client_cert, Some(("/c.pem".into(), "/k.pem".into())));
        }

        #[test]
        fn bad_strings_are_reasons_without_secrets() {
            for s in [
                "postgres://u:hunter2@h:notaport/db",
                "postgres://h/db?password=hunter2&bogus=1",
                "host=h password=hunter2 bogus=1",
                "host=h password=hunter2 port=x",
                "host=h password='hunter2",
                "host=h hunter2",
            ] {
                let e = parse(s, &no_env)
                    .err()
                    .unwrap_or_else(|| panic!("{s} parsed"));
                assert!(!e.contains("hunter2"), "{s}: {e}");
            }
        }

        #[test]
        fn the_password_file_supplies_a_missing_password() {
            use std::os::unix::fs::PermissionsExt;
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("pgpass");
            std::fs::write(
                &file,
                "# comment\nother:*:*:*:no\nh:5432:db:u:p\\:w\\\\d\n*:*:*:u:fallback\n",
            )
            .unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
            let url = format!("postgres://u@h/db?passfile={}", file.display());
            let p = parse(&url, &no_env).unwrap();
            assert_eq!(p.config.get_password(), Some(&b"p:w\\d"[..]));
            let url = format!("postgres://u@h/otherdb?passfile={}", file.display());
            let p = parse(&url, &no_env).unwrap();
            assert_eq!(p.config.get_password(), Some(&b"fallback"[..]));
            // Through PGPASSFILE, and ~/.pgpass.
            let env_file = file.display().to_string();
            let env = move |k: &str| (k == "PGPASSFILE").then(|| env_file.clone());
            let p = parse("postgres://u@h/db", &env).unwrap();
            assert_eq!(p.config.get_password(), Some(&b"p:w\\d"[..]));
            std::fs::copy(&file, dir.path().join(".pgpass")).unwrap();
            let home = dir.path().display().to_string();
            let env = move |k: &str| (k == "HOME").then(|| home.clone());
            let p = parse("postgres://u@h/db", &env).unwrap();
            assert_eq!(p.config.get_password(), Some(&b"p:w\\d"[..]));
            // A file others can read is ignored, as libpq does.
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            let url = format!("postgres://u@h/db?passfile={}", file.display());
            let p = parse(&url, &no_env).unwrap();
            assert_eq!(p.config.get_password(), None);
        }

        #[test]
        fn debug_output_hides_passwords() {
            let p = parse("postgres://u:hunter2@h/db", &no_env).unwrap();
            let shown = format!("{:?} {}", p.config, p.shown);
            assert!(!shown.contains("hunter2"), "{shown}");
        }
    }
}
