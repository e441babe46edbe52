//! Who holds a lock and who waits for it: the rows
//! [`Locks::status`](crate::Locks::status) returns, their JSON shape, and how dblock's
//! connections say who they are.
//!
//! # How names are recovered
//!
//! A server knows locks by key, not by name. dblock tells it the name without an extra
//! round trip: each PostgreSQL acquisition (one message) ends with a comment,
//!
//! ```text
//! SELECT pg_advisory_xact_lock(-5686219459067394536) /* dblock ns=public name=autoland:7 holder=ci-7:4242 scope=transaction */
//! ```
//!
//! which `pg_stat_activity.query` shows while the request waits, and the connection's
//! health check, while the lock is held, is that comment alone (with `since=`, the
//! grant's time), so the holder's `query` keeps naming its lock. (A try on dblock's own
//! connection runs as a prepared statement that serves every key: its comment is sent
//! alone right after it, so its holder shows the comment alone from the grant on.)
//! Values are percent-encoded (`%`, `*`, space, `;` and control characters), so no name
//! can end the comment early. `dblock status` believes a comment only if the name in it
//! hashes to the key the server shows. See `docs/status.md` for what each backend shows.

use std::fmt::Write as _;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::key::Key;
pub use crate::raw::{LockStatus, Party};
use crate::raw::{Mode, Scope};

impl Party {
    /// `program[pid]@host (connection N)`, or what of it is known.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        if self.program.is_some() || self.pid.is_some() {
            s.push_str(self.program.as_deref().unwrap_or("?"));
        }
        if let Some(pid) = self.pid {
            let _ = write!(s, "[{pid}]");
        }
        if let Some(h) = &self.host {
            let _ = write!(s, "@{h}");
        }
        match (self.connection, s.is_empty()) {
            (Some(c), true) => {
                let _ = write!(s, "connection {c}");
            }
            (Some(c), false) => {
                let _ = write!(s, " (connection {c})");
            }
            (None, true) => s.push_str("an unknown process"),
            (None, false) => {}
        }
        s
    }
}

impl LockStatus {
    /// The lock's name, or `key:<key>` when the name is not known.
    pub fn label(&self) -> String {
        match &self.name {
            Some(n) => n.clone(),
            None => format!("key:{}", self.key),
        }
    }
}

/// How a database shows the lock of a key to someone looking for it with its own tools:
/// what `dblock key` prints, from [`Key::shown_on`](crate::Key::shown_on).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShownAs {
    /// Where the server lists it: `"pg_locks"` (PostgreSQL), `"mysql"` (a named lock).
    pub listed_in: &'static str,
    /// What identifies it there: `classid=… objid=… objsubid=1`, or the lock's name.
    pub id: String,
    /// What the identity depends on, if anything: `(database app)`.
    pub context: Option<String>,
    /// A query that shows it (and who holds it) on that server.
    pub query: String,
}

/// What `dblock status --json` prints: the locks [`Locks::status`](crate::Locks::status)
/// returned, the backend and the time they were read. With the cargo feature `serde` it
/// serializes to the stable shape `docs/status.md` documents —
/// `{"version":1,"backend":…,"now_ms":…,"locks":[…]}`, each lock as [`LockStatus`]
/// serializes, each party with `for_ms`, its age against `now` — which fields are only
/// ever added to (`version` changes if one ever changes meaning).
#[derive(Debug, Clone, Copy)]
pub struct Report<'a> {
    backend: &'a str,
    locks: &'a [LockStatus],
    now: SystemTime,
}

impl<'a> Report<'a> {
    /// The report of `locks`, read from `backend` ([`Locks::backend_name`](crate::Locks::backend_name))
    /// at `now`.
    pub fn new(backend: &'a str, locks: &'a [LockStatus], now: SystemTime) -> Report<'a> {
        Report {
            backend,
            locks,
            now,
        }
    }

    /// The backend the locks were read from.
    pub fn backend(&self) -> &'a str {
        self.backend
    }

    /// The locks.
    pub fn locks(&self) -> &'a [LockStatus] {
        self.locks
    }

    /// When they were read.
    pub fn now(&self) -> SystemTime {
        self.now
    }
}

/// The JSON version of [`Report`]'s shape.
#[cfg(feature = "serde")]
const REPORT_VERSION: u32 = 1;

#[cfg(feature = "serde")]
impl serde::Serialize for Report<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        /// A party, with its age at the report's time.
        #[derive(serde::Serialize)]
        struct PartyAt<'a> {
            #[serde(flatten)]
            party: &'a Party,
            for_ms: Option<u128>,
        }
        /// A lock, its parties with their ages: [`LockStatus`]'s fields.
        #[derive(serde::Serialize)]
        struct LockAt<'a> {
            key: Key,
            namespace: &'a Option<String>,
            name: &'a Option<String>,
            slot: Option<u32>,
            holders: Vec<PartyAt<'a>>,
            waiters: Vec<PartyAt<'a>>,
        }
        #[derive(serde::Serialize)]
        struct Shape<'a> {
            version: u32,
            backend: &'a str,
            now_ms: u128,
            locks: Vec<LockAt<'a>>,
        }
        fn at(parties: &[Party], now: SystemTime) -> Vec<PartyAt<'_>> {
            parties
                .iter()
                .map(|party| PartyAt {
                    party,
                    for_ms: party.since.map(|t| age(t, now).as_millis()),
                })
                .collect()
        }
        let now = self.now;
        Shape {
            version: REPORT_VERSION,
            backend: self.backend,
            now_ms: unix_ms(now),
            locks: self
                .locks
                .iter()
                .map(|l| LockAt {
                    key: l.key,
                    namespace: &l.namespace,
                    name: &l.name,
                    slot: l.slot,
                    holders: at(&l.holders, now),
                    waiters: at(&l.waiters, now),
                })
                .collect(),
        }
        .serialize(s)
    }
}

/// How long ago `since` was, at `now` (zero for a time ahead of `now`: clocks differ).
pub fn age(since: SystemTime, now: SystemTime) -> Duration {
    now.duration_since(since).unwrap_or_default()
}

/// An age as `dblock status` and the exporter's page show it: `41.2s`, `3m10s`, `2h05m`.
pub fn age_text(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{:.1}s", d.as_secs_f64()),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// `s` as it may be shown to an operator — on a terminal or a web page: control
/// characters (a newline, an escape sequence's ESC, C1 controls), line and paragraph
/// separators and the invisible or reordering format characters (bidirectional
/// overrides, zero-width characters) are written `\u{..}`, and a backslash `\\`, so a
/// name chosen by any client of the database shows as one line that shows what it is.
pub fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    fn hidden(c: char) -> bool {
        c.is_control()
            || matches!(
                c,
                '\\'
                    | '\u{061c}'
                    | '\u{200b}'..='\u{200f}'
                    | '\u{2028}'..='\u{202e}'
                    | '\u{2060}'..='\u{206f}'
                    | '\u{feff}'
                    | '\u{fff9}'..='\u{fffb}'
            )
    }
    if !s.chars().any(hidden) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if hidden(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `"exclusive"` or `"shared"`.
pub fn mode_str(m: Mode) -> &'static str {
    match m {
        Mode::Exclusive => "exclusive",
        Mode::Shared => "shared",
    }
}

/// `"transaction"` or `"session"`.
pub fn scope_str(s: Scope) -> &'static str {
    match s {
        Scope::Transaction => "transaction",
        Scope::Session => "session",
    }
}

pub(crate) fn unix_ms(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis()
}

pub(crate) fn from_unix_ms(ms: f64) -> Option<SystemTime> {
    (ms.is_finite() && ms >= 0.0).then(|| UNIX_EPOCH + Duration::from_micros((ms * 1000.0) as u64))
}

// ---------------------------------------------------------------------------------
// Who this process is.

/// This process's program: the file name of its executable.
pub(crate) fn program() -> &'static str {
    static P: OnceLock<String> = OnceLock::new();
    P.get_or_init(|| {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .or_else(|| {
                std::env::args_os().next().map(|a| {
                    let a = a.to_string_lossy().into_owned();
                    a.rsplit('/').next().unwrap_or_default().to_string()
                })
            })
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "unknown".into())
    })
}

/// This host's name.
pub(crate) fn host() -> &'static str {
    let id = crate::raw::holder_id();
    id.rsplit_once(':').map_or(id, |(h, _)| h)
}

/// The longest `application_name` PostgreSQL keeps (NAMEDATALEN − 1 bytes).
const MAX_APPLICATION_NAME: usize = 63;

/// The `application_name` dblock's own PostgreSQL connections give when neither the
/// builder, the URL nor `PGAPPNAME` names one: `program[pid]@host` (cut to 63 bytes,
/// the program first), so that `pg_stat_activity` says which process a connection
/// belongs to.
pub fn default_application_name() -> String {
    let pid = std::process::id();
    let tail = format!("[{pid}]@{}", host());
    let room = MAX_APPLICATION_NAME.saturating_sub(tail.len()).max(1);
    let mut s = cut(program(), room).to_string();
    s.push_str(&tail);
    cut(&s, MAX_APPLICATION_NAME).to_string()
}

/// `s` cut to at most `n` bytes, at a character boundary.
fn cut(s: &str, n: usize) -> &str {
    let mut end = s.len().min(n);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `program[pid]@host` read back: (program, pid, host).
pub(crate) fn parse_application_name(s: &str) -> Option<(String, u32, String)> {
    let (left, host) = s.rsplit_once("]@")?;
    let (program, pid) = left.rsplit_once('[')?;
    Some((program.to_string(), pid.parse().ok()?, host.to_string()))
}

// ---------------------------------------------------------------------------------
// The comment.

/// What the comment marker begins with.
pub(crate) const MARK: &str = "/* dblock ";

/// Appends ` /* dblock ns=… name=… holder=… scope=… [since=…] */` to `out`.
pub(crate) fn write_comment(
    out: &mut String,
    namespace: &str,
    name: &str,
    scope: Option<Scope>,
    since: Option<SystemTime>,
) {
    out.push(' ');
    out.push_str(MARK);
    out.push_str("ns=");
    encode(out, namespace);
    out.push_str(" name=");
    encode(out, name);
    out.push_str(" holder=");
    out.push_str(holder_encoded());
    if let Some(s) = scope {
        out.push_str(" scope=");
        out.push_str(scope_str(s));
    }
    if let Some(t) = since {
        let _ = write!(out, " since={}", unix_ms(t));
    }
    out.push_str(" */");
}

/// The comment of a statement that serves every name (a PostgreSQL session's prepared
/// try, its key a parameter): `/* dblock holder=HOST:PID */`, this process's, with no
/// name — so that `pg_stat_activity.query` shows the session as dblock's (and whose) from
/// the grant on, until the held lock's first health check names the lock. Not a lock's
/// comment to [`parse_comments`], which needs a name.
pub(crate) fn write_holder_mark(out: &mut String) {
    out.push(' ');
    out.push_str(MARK);
    out.push_str("holder=");
    out.push_str(holder_encoded());
    out.push_str(" */");
}

/// What a held lock's connection sends as its health check: the request's comment
/// (`comment`, as [`write_comment`] wrote it, without `since=`) with the time of the
/// grant, `since`, added; an empty query to the server.
pub(crate) fn label(comment: &str, since: SystemTime) -> std::sync::Arc<str> {
    let body = comment.trim_start();
    let body = body.strip_suffix(" */").unwrap_or(body);
    let mut s = String::with_capacity(body.len() + 24);
    s.push_str(body);
    let _ = write!(s, " since={} */", unix_ms(since));
    std::sync::Arc::from(s)
}

/// Percent-encodes what could end a comment, start a nested one (`*`), split the
/// comment's fields (space) or statements (`;`), or is a control character. Runs of
/// other bytes are copied whole (every byte encoded is ASCII, so runs end at character
/// boundaries).
fn encode(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        if matches!(b, b'%' | b'*' | b' ' | b';' | 0x7f) || b < 0x20 {
            out.push_str(&s[start..i]);
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 15)]));
            start = i + 1;
        }
    }
    out.push_str(&s[start..]);
}

/// This process's `holder=` value, encoded once.
fn holder_encoded() -> &'static str {
    static H: OnceLock<String> = OnceLock::new();
    H.get_or_init(|| {
        let mut s = String::new();
        encode(&mut s, crate::raw::holder_id());
        s
    })
}

fn decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// One comment read back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Comment {
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) host: Option<String>,
    pub(crate) pid: Option<u32>,
    pub(crate) scope: Option<Scope>,
    pub(crate) since: Option<SystemTime>,
}

impl Comment {
    /// The key the comment's name has.
    pub(crate) fn key(&self) -> Key {
        Key::derive(&self.namespace, &self.name)
    }
}

/// Every whole dblock comment in `text` (a comment cut off by the server's
/// `track_activity_query_size` is skipped).
pub(crate) fn parse_comments(text: &str) -> Vec<Comment> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(MARK) {
        rest = &rest[at + MARK.len()..];
        let Some(end) = rest.find(" */") else { break };
        let body = &rest[..end];
        rest = &rest[end..];
        let mut c = Comment::default();
        let mut ok = (false, false);
        for field in body.split(' ') {
            let Some((k, v)) = field.split_once('=') else {
                continue;
            };
            let Some(v) = decode(v) else { continue };
            match k {
                "ns" => {
                    c.namespace = v;
                    ok.0 = true;
                }
                "name" => {
                    c.name = v;
                    ok.1 = true;
                }
                "holder" => {
                    if let Some((h, p)) = v.rsplit_once(':') {
                        c.host = Some(h.to_string());
                        c.pid = p.parse().ok();
                    }
                }
                "scope" => {
                    c.scope = match v.as_str() {
                        "transaction" => Some(Scope::Transaction),
                        "session" => Some(Scope::Session),
                        _ => None,
                    }
                }
                "since" => c.since = v.parse::<f64>().ok().and_then(from_unix_ms),
                _ => {}
            }
        }
        if ok == (true, true) && !c.name.is_empty() && !c.namespace.is_empty() {
            out.push(c);
        }
    }
    out
}

/// The comment in `text` whose name hashes to `key`, if any; else one whose name has
/// `key` as a semaphore slot's key, with the slot (a slot's request names its
/// semaphore).
pub(crate) fn comment_for(text: &str, key: Key) -> Option<(Comment, Option<u32>)> {
    let comments = parse_comments(text);
    if let Some(c) = comments.iter().find(|c| c.key() == key) {
        return Some((c.clone(), None));
    }
    comments.into_iter().find_map(|c| {
        let slot = slot_of(&c.namespace, &c.name, key)?;
        Some((c, Some(slot)))
    })
}

/// Which slot of the semaphore `(namespace, name)` has `key`, if any (of the
/// [`MAX_SEMAPHORE_LIMIT`](crate::key::MAX_SEMAPHORE_LIMIT) a semaphore may have).
///
/// A listing asks this of every lock whose holder's comment names another lock (a lock
/// set's session names one of its locks), so a semaphore's slot keys are derived once
/// per name and kept, for the [`SLOT_NAMES_KEPT`] names asked of most recently, instead
/// of up to 1,024 hashes per lock listed.
pub(crate) fn slot_of(namespace: &str, name: &str, key: Key) -> Option<u32> {
    use std::collections::HashMap;
    use std::sync::{Arc, LazyLock, Mutex};
    type Slots = Arc<HashMap<Key, u32>>;
    static KEPT: LazyLock<Mutex<HashMap<(String, String), Slots>>> =
        LazyLock::new(Default::default);
    let id = (namespace.to_string(), name.to_string());
    // A poisoned cache is only a cache: derive the keys again.
    let cached = KEPT.lock().ok().and_then(|kept| kept.get(&id).cloned());
    let slots = cached.unwrap_or_else(|| {
        let slots: Slots = Arc::new(
            (0..crate::key::MAX_SEMAPHORE_LIMIT)
                .map(|i| (Key::derive_slot(namespace, name, i), i))
                .collect(),
        );
        if let Ok(mut kept) = KEPT.lock() {
            if kept.len() >= SLOT_NAMES_KEPT {
                kept.clear();
            }
            kept.insert(id, slots.clone());
        }
        slots
    });
    slots.get(&key).copied()
}

/// How many semaphore names' slot keys [`slot_of`] keeps (each about 16 KiB).
const SLOT_NAMES_KEPT: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_found_by_its_key_and_a_stranger_is_not() {
        let last = crate::key::MAX_SEMAPHORE_LIMIT - 1;
        for _ in 0..2 {
            // twice: derived, then kept
            assert_eq!(
                slot_of("ns", "exports", Key::derive_slot("ns", "exports", 0)),
                Some(0)
            );
            assert_eq!(
                slot_of("ns", "exports", Key::derive_slot("ns", "exports", last)),
                Some(last)
            );
            assert_eq!(slot_of("ns", "exports", Key::derive("ns", "exports")), None);
            assert_eq!(
                slot_of("ns2", "exports", Key::derive_slot("ns", "exports", 3)),
                None
            );
        }
        // More names than are kept: still right after the cache is cleared.
        for i in 0..(SLOT_NAMES_KEPT + 3) {
            let name = format!("n{i}");
            assert_eq!(
                slot_of("ns", &name, Key::derive_slot("ns", &name, 7)),
                Some(7)
            );
        }
    }

    #[test]
    fn a_name_cannot_end_the_comment_early() {
        for name in [
            "a*/b",
            "/*x",
            "a b;c",
            "100%",
            "tab\there",
            "ünï ✓",
            "x*/; DROP",
        ] {
            let mut s = String::from("SELECT 1");
            write_comment(&mut s, "pub lic", name, Some(Scope::Session), None);
            // One comment, closed only at its end.
            assert_eq!(s.matches("*/").count(), 1, "{s}");
            assert!(s.ends_with(" */"), "{s}");
            assert_eq!(s.matches("/*").count(), 1, "{s}");
            assert!(!s[8..].contains(';'), "{s}");
            let c = parse_comments(&s);
            assert_eq!(c.len(), 1, "{s}");
            assert_eq!(c[0].name, name);
            assert_eq!(c[0].namespace, "pub lic");
            assert_eq!(c[0].scope, Some(Scope::Session));
            assert_eq!(c[0].pid, Some(std::process::id()));
            assert_eq!(
                comment_for(&s, Key::derive("pub lic", name)),
                Some((c[0].clone(), None))
            );
            assert_eq!(
                comment_for(&s, Key::derive_slot("pub lic", name, 3)),
                Some((c[0].clone(), Some(3)))
            );
            assert_eq!(comment_for(&s, Key::from_i64(1)), None);
        }
    }

    #[test]
    fn a_label_is_the_comment_with_the_grant_time() {
        let mut s = String::from("SELECT 1");
        write_comment(&mut s, "public", "a b", Some(Scope::Transaction), None);
        let l = label(&s[s.find(MARK).unwrap_or_default()..], SystemTime::now());
        assert!(l.starts_with(MARK) && l.ends_with(" */"), "{l}");
        let c = parse_comments(&l);
        assert_eq!(c.len(), 1, "{l}");
        assert_eq!(c[0].name, "a b");
        assert!(c[0].since.is_some(), "{l}");
    }

    /// The mark of a statement shared by every name is one comment of dblock's, with
    /// this process as holder, that names no lock: never taken for a lock's comment,
    /// even beside one.
    #[test]
    fn the_holder_mark_is_dblocks_and_names_no_lock() {
        let mut s = String::from("SELECT pg_catalog.pg_try_advisory_xact_lock($1)");
        write_holder_mark(&mut s);
        let at = s.find(MARK).unwrap_or_default();
        assert!(at > 0 && s.ends_with(" */"), "{s}");
        assert_eq!(s[at..].matches("*/").count(), 1, "{s}");
        assert!(s.ends_with(&format!(":{} */", std::process::id())), "{s}");
        assert!(parse_comments(&s).is_empty(), "{s}");
        write_comment(&mut s, "public", "n", None, None);
        let c = parse_comments(&s);
        assert_eq!(c.len(), 1, "{s}");
        assert_eq!(c[0].name, "n");
    }

    #[test]
    fn a_cut_off_comment_is_skipped() {
        let mut s = String::new();
        write_comment(&mut s, "public", "n", None, Some(SystemTime::now()));
        assert_eq!(parse_comments(&s).len(), 1);
        assert!(parse_comments(&s[..s.len() - 3]).is_empty());
    }

    #[test]
    fn the_application_name_fits_and_reads_back() {
        let a = default_application_name();
        assert!(a.len() <= MAX_APPLICATION_NAME, "{a}");
        let (_, pid, host) = parse_application_name(&a).unwrap_or_default();
        assert_eq!(pid, std::process::id());
        assert_eq!(host, self::host());
        assert_eq!(
            parse_application_name("my app[12]@h:1"),
            Some(("my app".into(), 12, "h:1".into()))
        );
        assert_eq!(parse_application_name("psql"), None);
    }

    /// The shape `docs/status.md` documents: the same keys at every level as its
    /// example, strings escaped by JSON (a name with a quote and a newline), a key as a
    /// signed number, absent values `null`, ages against the report's time.
    #[cfg(feature = "serde")]
    #[test]
    fn a_report_serializes_to_the_documented_shape() {
        use serde_json::Value;
        let since = UNIX_EPOCH + Duration::from_millis(1_000);
        let l = LockStatus {
            key: Key::from_i64(-3),
            namespace: Some("public".into()),
            name: Some("a\"b\n".into()),
            slot: Some(1),
            holders: vec![Party {
                mode: Mode::Exclusive,
                scope: Some(Scope::Transaction),
                host: Some("h".into()),
                pid: Some(7),
                program: Some("p".into()),
                connection: Some(81234),
                client: Some("10.0.0.1:5".into()),
                since: Some(since),
            }],
            waiters: vec![Party {
                mode: Mode::Shared,
                ..Party::default()
            }],
        };
        let now = UNIX_EPOCH + Duration::from_millis(3_500);
        let locks = [l];
        let text = serde_json::to_string(&Report::new("postgres", &locks, now)).unwrap();
        assert!(!text.contains('\n'), "one line: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["version"], 1);
        assert_eq!(v["backend"], "postgres");
        assert_eq!(v["now_ms"], 3_500);
        let lock = &v["locks"][0];
        assert_eq!(lock["key"], -3);
        assert_eq!(lock["name"], "a\"b\n");
        assert_eq!(lock["slot"], 1);
        let h = &lock["holders"][0];
        assert_eq!(h["mode"], "exclusive");
        assert_eq!(h["scope"], "transaction");
        assert_eq!(h["since_ms"], 1_000);
        assert_eq!(h["for_ms"], 2_500);
        let w = &lock["waiters"][0];
        assert_eq!(w["mode"], "shared");
        for absent in ["scope", "host", "pid", "since_ms", "for_ms"] {
            assert!(w[absent].is_null(), "{absent}: {w}");
        }

        // The documented example, read from the page, has exactly these keys.
        let page =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/status.md"))
                .unwrap();
        let example = page
            .split("```json\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .unwrap();
        let doc: Value = serde_json::from_str(example).unwrap();
        fn keys(v: &Value) -> Vec<&str> {
            let mut k: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
            k.sort_unstable();
            k
        }
        assert_eq!(keys(&v), keys(&doc));
        assert_eq!(keys(lock), keys(&doc["locks"][0]));
        assert_eq!(keys(h), keys(&doc["locks"][0]["holders"][0]));
        assert_eq!(keys(w), keys(h));
        // A lock serializes alone as in the report, without the ages.
        let alone = serde_json::to_value(&locks[0]).unwrap();
        assert_eq!(keys(&alone), keys(lock));
        let mut party_keys = keys(h);
        party_keys.retain(|k| *k != "for_ms");
        assert_eq!(keys(&alone["holders"][0]), party_keys);
    }
}
