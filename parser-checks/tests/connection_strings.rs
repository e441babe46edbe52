//! Connection strings — PostgreSQL URLs and libpq `key=value` strings with percent-encoding,
//! IPv6, Unix sockets and several hosts; MySQL URLs — generated with a known meaning:
//! each reads as exactly what it says, and no password reaches what dblock shows, the
//! error, or `Debug` of either. Strings broken after the password, and any text at all,
//! parse or are refused with a one-line error.

use dblock::parsers;
use dblock_parser_checks as checks;
use proptest::prelude::*;
use tokio_postgres::config::Host as PgHost;

#[derive(Debug, Clone)]
enum Host {
    Name(String),
    V6(String),
    /// A Unix socket directory (the only host of its string).
    Socket(String),
}

#[derive(Debug, Clone, Copy)]
enum Form {
    /// `postgres://user:pw@…`
    Url,
    /// `postgres://…?password=pw`
    UrlQuery,
    /// `user='…' password='…' …`
    KeyValue,
}

#[derive(Debug, Clone)]
struct Conn {
    form: Form,
    scheme: &'static str,
    user: Option<String>,
    password: String,
    hosts: Vec<(Host, Option<u16>)>,
    dbname: Option<String>,
    app: Option<String>,
    sslmode: Option<&'static str>,
}

/// A password no other part of the string contains: it starts with a mark no generated
/// user, host or name has, and is long enough not to be met by chance.
fn password() -> impl Strategy<Value = String> {
    "[ -~éß日\u{a0}\t]{6,24}".prop_map(|s| format!("Pw§{s}"))
}

/// Text as users put it in user and database names and application names.
fn text() -> impl Strategy<Value = String> {
    "[a-z0-9_ @:/?#&=%,.'\\\\-]{1,12}|[a-z]{1,8}"
}

fn host() -> impl Strategy<Value = Host> {
    prop_oneof![
        "[a-z][a-z0-9-]{0,10}(\\.[a-z]{2,5}){0,2}".prop_map(Host::Name),
        "(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})(\\.(25[0-5]|2[0-4][0-9]|1?[0-9]{1,2})){3}"
            .prop_map(Host::Name),
        prop_oneof![
            Just("::1"),
            Just("fe80::1"),
            Just("2001:db8::42"),
            Just("::ffff:10.0.0.1")
        ]
        .prop_map(|s| Host::V6(s.to_string())),
    ]
}

fn socket() -> impl Strategy<Value = Host> {
    prop_oneof![
        Just("/var/run/postgresql".to_string()),
        Just("/tmp".to_string()),
        "/[a-z]{1,6}( [a-z]{1,4})?/[a-z.]{1,8}",
    ]
    .prop_map(Host::Socket)
}

fn conn() -> impl Strategy<Value = Conn> {
    let hosts = prop_oneof![
        3 => prop::collection::vec((host(), prop::option::of(1u16..)), 1..4),
        1 => (socket(), prop::option::of(1u16..)).prop_map(|h| vec![h]),
    ];
    (
        prop_oneof![Just(Form::Url), Just(Form::UrlQuery), Just(Form::KeyValue)],
        prop_oneof![Just("postgres"), Just("postgresql"), Just("PostgreSQL")],
        prop::option::of(text()),
        password(),
        hosts,
        prop::option::of(text()),
        prop::option::of(text()),
        prop::option::of(prop_oneof![
            Just("disable"),
            Just("allow"),
            Just("prefer"),
            Just("require")
        ]),
    )
        .prop_map(
            |(form, scheme, user, password, hosts, dbname, app, sslmode)| Conn {
                form,
                scheme,
                user,
                password,
                hosts,
                dbname,
                app,
                sslmode,
            },
        )
}

/// Percent-encodes all but URL-unreserved characters.
fn enc(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A libpq value: quoted, with `'` and `\` escaped.
fn quote(s: &str) -> String {
    let mut out = String::from("'");
    for c in s.chars() {
        if c == '\'' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('\'');
    out
}

impl Conn {
    /// The string, and where its password's text ends in it.
    fn render(&self) -> (String, usize) {
        match self.form {
            Form::Url | Form::UrlQuery => self.url(),
            Form::KeyValue => self.key_value(),
        }
    }

    fn url(&self) -> (String, usize) {
        let mut s = format!("{}://", self.scheme);
        let mut pw_end = 0;
        let in_userinfo = matches!(self.form, Form::Url);
        if self.user.is_some() || in_userinfo {
            s.push_str(&enc(self.user.as_deref().unwrap_or("")));
            if in_userinfo {
                s.push(':');
                s.push_str(&enc(&self.password));
                s.push('@');
                pw_end = s.len();
            } else {
                s.push('@');
            }
        }
        let mut query = Vec::new();
        let socket = self.hosts.iter().any(|(h, _)| matches!(h, Host::Socket(_)));
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|(h, port)| {
                let port = port.map(|p| format!(":{p}")).unwrap_or_default();
                match h {
                    Host::Name(n) => format!("{}{port}", enc(n)),
                    Host::V6(a) => format!("[{a}]{port}"),
                    Host::Socket(d) => format!("{}{port}", enc(d)),
                }
            })
            .collect();
        // A socket directory half the time in the query (`?host=/dir`), as libpq's docs show.
        if socket && self.password.len().is_multiple_of(2) {
            if let (Host::Socket(d), port) = &self.hosts[0] {
                query.push(format!("host={}", enc(d)));
                if let Some(p) = port {
                    query.push(format!("port={p}"));
                }
            }
        } else {
            s.push_str(&hosts.join(","));
        }
        s.push('/');
        if let Some(db) = &self.dbname {
            s.push_str(&enc(db));
        }
        if let Some(a) = &self.app {
            query.push(format!("application_name={}", enc(a)));
        }
        if let Some(m) = self.sslmode {
            query.push(format!("sslmode={m}"));
        }
        if matches!(self.form, Form::UrlQuery) {
            query.push(format!("password={}", enc(&self.password)));
        }
        if !query.is_empty() {
            s.push('?');
            s.push_str(&query.join("&"));
        }
        if matches!(self.form, Form::UrlQuery) {
            pw_end = s.len();
        }
        (s, pw_end)
    }

    fn key_value(&self) -> (String, usize) {
        // The password first, so that a string broken after it keeps it a password.
        let mut s = format!("password = {}", quote(&self.password));
        let pw_end = s.len();
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|(h, _)| match h {
                Host::Name(n) | Host::V6(n) | Host::Socket(n) => n.clone(),
            })
            .collect();
        s.push_str(&format!(" host={}", quote(&hosts.join(","))));
        if self.hosts.iter().any(|(_, p)| p.is_some()) {
            let ports: Vec<String> = self
                .hosts
                .iter()
                .map(|(_, p)| p.map(|p| p.to_string()).unwrap_or_default())
                .collect();
            s.push_str(&format!("\tport={}", ports.join(",")));
        }
        for (k, v) in [
            ("user", &self.user),
            ("dbname", &self.dbname),
            ("application_name", &self.app),
        ] {
            if let Some(v) = v {
                s.push_str(&format!(" {k}= {}", quote(v)));
            }
        }
        if let Some(m) = self.sslmode {
            s.push_str(&format!("  sslmode ={m}"));
        }
        (s, pw_end)
    }
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn secret_forms(pw: &str) -> Vec<String> {
    vec![pw.to_string(), enc(pw), quote(pw)]
}

fn assert_hidden(pw: &str, what: &str, text: &str) -> Result<(), TestCaseError> {
    for form in secret_forms(pw) {
        prop_assert!(
            !text.contains(&form),
            "{} shows the password {:?}: {}",
            what,
            form,
            text
        );
    }
    // Not even the part after the mark.
    prop_assert!(
        !text.contains(&pw["Pw§".len()..]),
        "{} shows the password: {}",
        what,
        text
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    /// Each generated string reads as what it says, and no password is shown.
    #[test]
    fn a_connection_string_reads_as_what_it_says_and_hides_its_password(c in conn()) {
        let (s, _) = c.render();
        let p = parsers::postgres_connection_string(&s, &no_env)
            .map_err(|e| TestCaseError::fail(format!("{s:?} refused: {e}")))?;
        let cfg = &p.config;
        prop_assert_eq!(cfg.get_password(), Some(c.password.as_bytes()), "{}", s);
        prop_assert_eq!(cfg.get_user(), c.user.as_deref(), "{}", s);
        prop_assert_eq!(cfg.get_dbname(), c.dbname.as_deref(), "{}", s);
        if let Some(a) = &c.app {
            prop_assert_eq!(cfg.get_application_name(), Some(a.as_str()), "{}", s);
        }
        let hosts: Vec<String> = cfg.get_hosts().iter().map(|h| match h {
            PgHost::Tcp(n) => n.clone(),
            PgHost::Unix(p) => p.display().to_string(),
        }).collect();
        let want: Vec<String> = c.hosts.iter().map(|(h, _)| match h {
            Host::Name(n) | Host::V6(n) | Host::Socket(n) => n.clone(),
        }).collect();
        prop_assert_eq!(&hosts, &want, "{}", s);
        for (h, (model, _)) in cfg.get_hosts().iter().zip(&c.hosts) {
            prop_assert_eq!(
                matches!(h, PgHost::Unix(_)),
                matches!(model, Host::Socket(_)),
                "{}", s
            );
        }
        if c.hosts.iter().any(|(_, p)| p.is_some()) {
            let ports: Vec<u16> = c.hosts.iter().map(|(_, p)| p.unwrap_or(5432)).collect();
            prop_assert_eq!(cfg.get_ports(), &ports[..], "{}", s);
        }
        assert_hidden(&c.password, "the shown string", &p.shown)?;
        assert_hidden(&c.password, "Debug of the result", &format!("{p:?}"))?;
        assert_hidden(&c.password, "redact", &parsers::redact(&s))?;
        checks::connection_string(&s);
    }

    /// A string broken anywhere after its password (a character dropped, doubled or
    /// replaced by one that means something to the syntax) still never shows the
    /// password: it parses, or is refused with a one-line `InvalidUrl` that hides it.
    #[test]
    fn a_string_broken_after_its_password_still_hides_it(
        c in conn(),
        at in any::<prop::sample::Index>(),
        op in 0u8..3,
        ch in prop::sample::select(vec!['/', '?', '&', '=', ',', ':', '[', ']', '@', '%', ' ', '\'', '\\', '#', 'x', '9', '\n']),
    ) {
        let (s, pw_end) = c.render();
        prop_assume!(pw_end < s.len());
        let mut cut = pw_end + at.index(s.len() - pw_end);
        while !s.is_char_boundary(cut) { cut += 1; }
        let mut m = s[..cut].to_string();
        let rest = &s[cut..];
        let next = rest.chars().next().map_or(0, char::len_utf8);
        match op {
            0 => m.push_str(&rest[next..]),
            1 => { m.push(ch); m.push_str(rest); }
            _ => { m.push(ch); m.push_str(&rest[next..]); }
        }
        match parsers::postgres_connection_string(&m, &no_env) {
            Ok(p) => {
                assert_hidden(&c.password, "the shown string", &p.shown)?;
                assert_hidden(&c.password, "Debug of the result", &format!("{p:?}"))?;
            }
            Err(e) => {
                let (display, debug) = (e.to_string(), format!("{e:?}"));
                prop_assert!(matches!(e, dblock::Error::InvalidUrl { .. }), "{:?}: {:?}", m, e);
                prop_assert!(!display.contains('\n') && !debug.contains('\n'), "{:?}: {}", m, display);
                assert_hidden(&c.password, "the error", &display)?;
                assert_hidden(&c.password, "Debug of the error", &debug)?;
            }
        }
        checks::connection_string(&m);
    }

    /// Any text, and text made of what connection strings are made of, parses or is
    /// refused with a one-line error, hiding whatever password the parser reads in it.
    #[test]
    fn any_text_parses_or_is_refused_on_one_line(
        s in prop_oneof![
            "\\PC{0,40}",
            "(postgres|postgresql|mysql|mariadb|sqlite)://[a-zA-Z0-9:@/?&=%,\\[\\]. '\\\\#-]{0,40}",
            "(([a-z_]{1,12}|password|PASSWORD|Password) ?= ?('[^']{0,10}'?|[a-z0-9\\\\ ]{0,8}) ){0,4}",
        ]
    ) {
        checks::connection_string(&s);
    }
}

/// A MySQL URL with a known meaning.
fn mysql() -> impl Strategy<Value = (String, String, String, Option<u16>, String, String)> {
    (
        prop_oneof![Just("mysql"), Just("mariadb")],
        "[a-z][a-z0-9_]{0,8}",
        password(),
        prop_oneof![
            "[a-z][a-z0-9-]{0,10}(\\.[a-z]{2,5}){0,2}",
            Just("127.0.0.1".to_string()),
            Just("[::1]".to_string()),
        ],
        prop::option::of(1u16..),
        "[a-z][a-z0-9_]{0,10}",
    )
        .prop_map(|(scheme, user, pw, host, port, db)| {
            let port_s = port.map(|p| format!(":{p}")).unwrap_or_default();
            let url = format!(
                "{scheme}://{user}:{}@{host}{port_s}/{db}?ssl-mode=disabled",
                enc(&pw)
            );
            (url, user, pw, port, host, db)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// A MySQL URL reads as what it says; what dblock shows of it hides the password.
    #[test]
    fn a_mysql_url_reads_as_what_it_says_and_hides_its_password(
        (url, user, pw, port, host, db) in mysql()
    ) {
        let o = parsers::mysql_url(&url).map_err(|e| TestCaseError::fail(format!("{url}: {e}")))?;
        prop_assert_eq!(o.get_username(), user.as_str());
        prop_assert_eq!(o.get_host(), host.as_str());
        prop_assert_eq!(o.get_port(), port.unwrap_or(3306));
        prop_assert_eq!(o.get_database(), Some(db.as_str()));
        prop_assert_eq!(dblock::mysql::database_of_url(&url).ok(), Some(db.clone()));
        assert_hidden(&pw, "the shown string", &parsers::redact(&url))?;
        checks::mysql_url(&url);
    }

    /// Broken after its password, a MySQL URL parses or is refused on one line, hiding it.
    #[test]
    fn a_mysql_url_broken_after_its_password_still_hides_it(
        (url, _, pw, _, _, _) in mysql(),
        at in any::<prop::sample::Index>(),
        ch in prop::sample::select(vec!['/', '?', '&', '=', ':', '[', ']', '@', '%', ' ', '#', '\\', 'x']),
    ) {
        let start = url.find('@').map_or(0, |a| a + 1);
        let cut = start + at.index(url.len() - start);
        let m = format!("{}{ch}{}", &url[..cut], &url[cut..]);
        assert_hidden(&pw, "the shown string", &parsers::redact(&m))?;
        if let Err(e) = parsers::mysql_url(&m) {
            let display = e.to_string();
            prop_assert!(!display.contains('\n'), "{}", display);
            assert_hidden(&pw, "the error", &display)?;
            assert_hidden(&pw, "Debug of the error", &format!("{e:?}"))?;
        }
        checks::mysql_url(&m);
    }
}

/// Found by `any_text_parses_or_is_refused_on_one_line`: `PASSWORD=…` (libpq's keys are
/// lower case) was refused as an unknown option in an error that showed its value.
#[test]
fn a_password_given_under_a_key_in_capitals_is_hidden_in_the_error() {
    for s in [
        "PASSWORD=hunter2 host=h",
        "host=h Password = 'hunter2'",
        "postgres://h/db?PASSWORD=hunter2",
        "postgres://h/db?SslPassword=hunter2",
    ] {
        let e = match parsers::postgres_connection_string(s, &no_env) {
            Ok(_) => panic!("{s:?} parsed"),
            Err(e) => e,
        };
        assert!(!e.to_string().contains("hunter2"), "{s:?}: {e}");
        assert!(!format!("{e:?}").contains("hunter2"), "{s:?}: {e:?}");
        assert!(!parsers::redact(s).contains("hunter2"), "{s:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// A URL's values percent-decode as URLs do: `%` and two hex digits is a byte, and
    /// anything else after `%` is kept as written (never `%+1`, which `u8::from_str_radix`
    /// would read as 1).
    #[test]
    fn url_values_percent_decode_as_urls_do(v in "[a-zA-Z0-9%+ -]{0,16}") {
        let s = format!("postgres://h/db?application_name={v}");
        let pairs = parsers::conninfo_pairs(&s).map_err(TestCaseError::fail)?;
        let got = pairs.iter().find(|(k, _)| k == "application_name").map(|(_, v)| v.clone());
        prop_assert_eq!(got, Some(checks::percent_decode(&v)), "{}", s);
    }
}

/// Found by the `connection_string` fuzz target: a string whose first key holds a
/// character no key has (here NUL) was read as `key=value` pairs and refused for that
/// key, but not recognised as such a string when shown, so the error showed its password.
#[test]
fn a_key_value_string_with_an_odd_first_key_hides_its_password() {
    for s in [
        "host\0=h password=hunter2 dbname=d",
        "h\u{11}ost=h password='hunter2'",
        "-x=1 password=hunter2",
        // Found next: a first key that looks like a URL's scheme.
        "hostpostgresql:// = h  password = 'hunter2' sslmode=verify-full",
    ] {
        let e = match parsers::postgres_connection_string(s, &no_env) {
            Ok(_) => panic!("{s:?} parsed"),
            Err(e) => e,
        };
        assert!(!e.to_string().contains("hunter2"), "{s:?}: {e}");
        assert!(!parsers::redact(s).contains("hunter2"), "{s:?}");
    }
}
