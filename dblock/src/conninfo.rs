//! PostgreSQL connection strings read as libpq reads them, and shown without passwords.
//!
//! Both forms libpq takes: URLs (`postgres://user:pw@host1:5432,host2/db?sslmode=require`,
//! `postgres:///db?host=/var/run/postgresql`, `postgres://%2Fvar%2Frun%2Fpostgresql/db`)
//! and `key=value` strings (`host=db.internal dbname=app password='a b'`). What the
//! string leaves out comes from libpq's environment variables (`PGHOST`, `PGPORT`,
//! `PGUSER`, `PGPASSWORD`, `PGDATABASE`, `PGAPPNAME`, `PGSSLMODE`, `PGSSLROOTCERT`,
//! `PGSSLCERT`, `PGSSLKEY`, `PGPASSFILE`, `PGCONNECT_TIMEOUT`, `PGTARGETSESSIONATTRS`,
//! `PGOPTIONS`, `PGCHANNELBINDING`), then from the password file (`passfile`, else
//! `PGPASSFILE`, else `~/.pgpass`), then from libpq's defaults: the Unix socket of the
//! local server if there is one (else `localhost`), port 5432, the operating-system user.
//!
//! A password, wherever it was given, never leaves this module except inside the
//! driver's configuration (whose `Debug` hides it): [`redact`] is how every message
//! shows a connection string.
//!
//! This file is the syntax shared by every use — recognising and redacting a string, and
//! reading its `key = value` pairs; reading one into a driver configuration is
//! PostgreSQL's (`postgres/conn/conninfo.rs`).

/// Keys whose values are secret wherever they appear.
const SECRET_KEYS: &[&str] = &["password", "sslpassword"];

/// Whether `key`'s value is hidden: a secret key in any case. libpq's keys are
/// lower case, but `PASSWORD=…` is refused as an unknown option in an error that shows
/// the string, and its value is still the password its writer meant.
fn is_secret(key: &str) -> bool {
    SECRET_KEYS.iter().any(|k| k.eq_ignore_ascii_case(key))
}

/// Whether `s` is a `key=value` connection string (its first word is `key=`).
pub(crate) fn is_key_value(s: &str) -> bool {
    let t = s.trim_start();
    let key_len = t
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(t.len());
    key_len > 0 && t[key_len..].trim_start().starts_with('=')
}

/// What follows `postgres://` or `postgresql://` (any case).
fn url_rest(s: &str) -> Option<&str> {
    ["postgresql://", "postgres://"].iter().find_map(|p| {
        s.get(..p.len())
            .filter(|head| head.eq_ignore_ascii_case(p))
            .map(|_| &s[p.len()..])
    })
}

/// A connection string as it may be shown: every password replaced by `***`. Anything
/// that cannot be read is cut off where reading failed, so a secret in a malformed
/// string is not shown either.
pub(crate) fn redact(s: &str) -> String {
    if let Some(rest) = url_rest(s) {
        let head = &s[..s.len() - rest.len()];
        return format!("{head}{}", redact_url_rest(rest));
    }
    if is_key_value(s) {
        return redact_key_value(s);
    }
    // Another URL (sqlite:, mysql:, or a mistyped scheme): a `user:pw@` part and
    // `password=` are hidden.
    let shown = match s.find("://") {
        Some(i) => format!("{}{}", &s[..i + 3], redact_url_rest(&s[i + 3..])),
        None => s.to_string(),
    };
    // Whatever holds an `=` may also be read as `key=value` pairs, as `pairs` reads it
    // (`host\0=h password=…` or `x:// = h password=…` is refused for its odd first key,
    // and that error must not show the password); a URL reads as one pair, unchanged.
    if shown.contains('=') {
        redact_key_value(&shown)
    } else {
        shown
    }
}

/// A `key=value` string with every secret value replaced by `***`, cut off (`…`) where
/// it cannot be read.
fn redact_key_value(s: &str) -> String {
    let mut out = String::new();
    let mut shown_to = 0;
    let mut p = KvParser::new(s);
    loop {
        match p.next_pair() {
            Ok(Some(pair)) => {
                if is_secret(&pair.key) {
                    out.push_str(&s[shown_to..pair.value_start]);
                    // A quoted value with text glued after its closing quote stays
                    // quoted, so that the shown string reads as the same pairs (bare,
                    // `***` would take the glued text into the value).
                    let glued = s[pair.value_end..]
                        .chars()
                        .next()
                        .is_some_and(|c| !c.is_whitespace());
                    match s[pair.value_start..].starts_with('\'') && glued {
                        true => out.push_str("'***'"),
                        false => out.push_str("***"),
                    }
                    shown_to = pair.value_end;
                }
            }
            Ok(None) => {
                out.push_str(&s[shown_to..]);
                return out;
            }
            Err(_) => {
                out.push_str(&s[shown_to..p.last_good]);
                out.push('…');
                return out;
            }
        }
    }
}

/// The part of a URL after `scheme://`, with the userinfo password and any
/// `password=` query parameter replaced.
fn redact_url_rest(rest: &str) -> String {
    // The query's secrets first, on the URL as written.
    let rest = match rest.split_once('?') {
        Some((head, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some((k, _)) if is_secret(&percent_decode(k)) => {
                        format!("{k}=***")
                    }
                    _ => kv.to_string(),
                })
                .collect();
            format!("{head}?{}", params.join("&"))
        }
        None => rest.to_string(),
    };
    // Then the userinfo, which ends at the last `@` — of the whole URL when the host
    // part has a `:`, so that a password with an unencoded `/` or `?` cannot escape.
    // (An `@` in a query value then over-redacts, which is harmless.)
    let host_part_end = rest.find(['/', '?']).unwrap_or(rest.len());
    match rest.rfind('@') {
        Some(at) if at < host_part_end || rest[..host_part_end].contains(':') => {
            match rest[..at].find(':') {
                Some(colon) if colon < host_part_end => {
                    format!("{}:***{}", &rest[..colon], &rest[at..])
                }
                _ => rest,
            }
        }
        _ => rest,
    }
}

/// Percent-decodes `s`; invalid escapes stay as they are. Non-UTF-8 results are
/// replaced lossily (only paths may need raw bytes, and those are UTF-8 here).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        // Two hex digits exactly: `u8::from_str_radix` would also take a sign (`%+a`).
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).and_then(|&c| char::from(c).to_digit(16)),
                b.get(i + 2).and_then(|&c| char::from(c).to_digit(16)),
            )
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One `key = value` of a `key=value` string, with where its value lies in the string.
struct KvPair {
    key: String,
    value: String,
    value_start: usize,
    value_end: usize,
}

/// libpq's `key=value` syntax: pairs separated by whitespace, spaces allowed around
/// `=`, values either bare (backslash escapes the next character) or in single quotes
/// (backslash escapes `'` and `\`).
struct KvParser<'a> {
    s: &'a str,
    pos: usize,
    /// Where the last pair read in full ended.
    last_good: usize,
}

impl<'a> KvParser<'a> {
    fn new(s: &'a str) -> Self {
        KvParser {
            s,
            pos: 0,
            last_good: 0,
        }
    }

    fn peek(&self) -> Option<char> {
        self.s[self.pos..].chars().next()
    }

    fn skip_ws(&mut self) {
        while let Some(c) = self.peek().filter(|c| c.is_whitespace()) {
            self.pos += c.len_utf8();
        }
    }

    fn next_pair(&mut self) -> Result<Option<KvPair>, String> {
        self.skip_ws();
        if self.pos >= self.s.len() {
            return Ok(None);
        }
        let key_start = self.pos;
        while let Some(c) = self.peek().filter(|c| !c.is_whitespace() && *c != '=') {
            self.pos += c.len_utf8();
        }
        let key = self.s[key_start..self.pos].to_string();
        self.skip_ws();
        if self.peek() != Some('=') {
            // Not shown: a word without `=` may be a password that lost its key.
            return Err("a word lacks \"=\" (expected key=value pairs)".into());
        }
        self.pos += 1;
        self.skip_ws();
        let value_start = self.pos;
        let mut value = String::new();
        if self.peek() == Some('\'') {
            self.pos += 1;
            loop {
                match self.peek() {
                    None => {
                        return Err(format!(
                            "unterminated quoted value of {:?}",
                            shown_key(&key)
                        ));
                    }
                    Some('\'') => {
                        self.pos += 1;
                        break;
                    }
                    Some('\\') => {
                        self.pos += 1;
                        if let Some(c) = self.peek() {
                            value.push(c);
                            self.pos += c.len_utf8();
                        }
                    }
                    Some(c) => {
                        value.push(c);
                        self.pos += c.len_utf8();
                    }
                }
            }
        } else {
            while let Some(c) = self.peek().filter(|c| !c.is_whitespace()) {
                self.pos += c.len_utf8();
                if c == '\\' {
                    if let Some(c2) = self.peek() {
                        value.push(c2);
                        self.pos += c2.len_utf8();
                    }
                } else {
                    value.push(c);
                }
            }
        }
        let value_end = self.pos;
        self.last_good = self.pos;
        Ok(Some(KvPair {
            key,
            value,
            value_start,
            value_end,
        }))
    }
}

/// A key as an error may show it: keys are not secret, but a value mistaken for a key
/// (a missing `=`) might be, so only short identifier-like keys are shown.
pub(crate) fn shown_key(key: &str) -> String {
    if key.len() <= 40 && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        key.to_string()
    } else {
        "(a key)".to_string()
    }
}

/// The pairs of a URL, in order: userinfo, hosts and ports, database, then the query.
pub(crate) fn url_pairs(rest: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let (before_query, query) = match rest.find('?') {
        Some(q) => (&rest[..q], Some(&rest[q + 1..])),
        None => (rest, None),
    };
    let (authority, path) = match before_query.find('/') {
        Some(i) => (&before_query[..i], Some(&before_query[i + 1..])),
        None => (before_query, None),
    };
    let hostport = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let (user, password) = match userinfo.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (userinfo, None),
            };
            if !user.is_empty() {
                pairs.push(("user".into(), percent_decode(user)));
            }
            if let Some(p) = password {
                pairs.push(("password".into(), percent_decode(p)));
            }
            &authority[at + 1..]
        }
        None => authority,
    };
    if !hostport.is_empty() {
        let mut hosts = Vec::new();
        let mut ports = Vec::new();
        for chunk in hostport.split(',') {
            let (host, port) = if let Some(v6) = chunk.strip_prefix('[') {
                let end = v6
                    .find(']')
                    .ok_or("an IPv6 host in [ ] lacks its closing ]")?;
                let after = &v6[end + 1..];
                let port = match after.strip_prefix(':') {
                    Some(p) => p,
                    None if after.is_empty() => "",
                    None => return Err("unexpected text after an IPv6 host in [ ]".into()),
                };
                (&v6[..end], port)
            } else {
                match chunk.split_once(':') {
                    Some((h, p)) => (h, p),
                    None => (chunk, ""),
                }
            };
            hosts.push(percent_decode(host));
            ports.push(percent_decode(port));
        }
        if hosts.iter().any(|h| !h.is_empty()) {
            pairs.push(("host".into(), hosts.join(",")));
        }
        if ports.iter().any(|p| !p.is_empty()) {
            pairs.push(("port".into(), ports.join(",")));
        }
    }
    if let Some(db) = path.filter(|p| !p.is_empty()) {
        pairs.push(("dbname".into(), percent_decode(db)));
    }
    for kv in query
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
    {
        let (k, v) = kv.split_once('=').ok_or("a query parameter lacks \"=\"")?;
        pairs.push((percent_decode(k), percent_decode(v)));
    }
    Ok(pairs)
}

/// The pairs of a connection string of either form, in order.
pub(crate) fn pairs(s: &str) -> Result<Vec<(String, String)>, String> {
    if let Some(rest) = url_rest(s) {
        return url_pairs(rest);
    }
    let mut p = KvParser::new(s);
    let mut out = Vec::new();
    while let Some(pair) = p.next_pair()? {
        out.push((pair.key, pair.value));
    }
    Ok(out)
}
