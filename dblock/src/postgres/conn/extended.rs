//! A round under one `Sync`: its statements in the extended protocol, the last one the
//! session's prepared statement, written at once and answered with one reply.
//!
//! The head (the statements ahead of the last, with those deferred on the connection
//! carried at their head, as a simple query would have them: `ROLLBACK AND CHAIN`,
//! `BEGIN …`, a carried `pg_advisory_unlock`, a wait's settings) is bound and executed a
//! statement at a time — the common ones ([`FIXED`], [`KEYED`]) as the session's
//! prepared statements, the rest parsed unnamed; then the last statement (parsed under
//! its name first, the first time) is bound and executed and its portal closed; then one
//! `Sync`. The server runs them in order as
//! it runs a simple query's statements, stops at the first error (skipping to the
//! `Sync`), and flushes its answer once, at the `ReadyForQuery` — one write each way, as
//! a simple query, without the parse, analysis and planning of each statement.
//!
//! tokio-postgres's published API ends every extended-protocol request in a `Sync` of
//! its own; dblock's copy adds `Client::send_encoded` (vendor/tokio-postgres/PATCH.md).

use bytes::BytesMut;
use postgres_protocol::message::backend;
use postgres_protocol::message::frontend;
use tokio_postgres::EncodedResponses;

use super::wire::{Message, QueryError, split_key};

/// The name of a session's prepared statement `id`.
pub(crate) struct Name([u8; 16], usize);

impl Name {
    pub(crate) fn of(id: u32) -> Name {
        // "dblock" and at most ten digits fit in sixteen bytes; the digits written by
        // hand, as this runs every round (the formatting machinery cost more).
        let mut bytes = *b"dblock0000000000";
        let mut digits = [0u8; 10];
        let (mut n, mut len) = (id, 0);
        loop {
            digits[len] = b'0' + (n % 10) as u8;
            len += 1;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        for (to, from) in bytes[6..6 + len].iter_mut().zip(digits[..len].iter().rev()) {
            *to = *from;
        }
        Name(bytes, 6 + len)
    }

    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(self.0.get(..self.1).unwrap_or_default()).unwrap_or_default()
    }
}

/// A round's last statement, as [`encode`] sends it.
pub(crate) struct Last<'a> {
    /// The session's statement for it.
    pub(crate) name: Name,
    /// Its text, to parse under `name` in this round; `None` if the session has it.
    pub(crate) parse: Option<&'a str>,
    /// Its one parameter (an `int8`), for a statement that serves every key. Such a
    /// statement's comment names no lock (`status::write_holder_mark`: only that the
    /// session is this process's), and the round sends no other: a try's name shows in
    /// `pg_stat_activity.query` from the held lock's first health check (`conn/driver.rs`,
    /// within one check interval of the grant), which sends it; a lock let go before then
    /// never costs the server a `Parse` of it.
    pub(crate) key: Option<i64>,
}

/// The statements that open a round (see `Message`, `Deferred::carried_by`), prepared
/// once a session: a round's head is then bound and executed, not parsed each time.
const FIXED: [(&str, &str); 3] = [
    (Message::CHAIN, "dblock_chain"),
    (Message::BEGIN, "dblock_begin"),
    ("ROLLBACK", "dblock_rollback"),
];

/// The statements of one key that may go ahead of a round (a session-scoped lock's
/// release, carried by the next request), prepared once a session with the key as their
/// parameter, as [`FIXED`] is. Spelt as the lock layer's `Release::of_one` spells them
/// (this layer knows nothing of locks): its unit test
/// `a_session_release_is_bound_as_the_sessions_own_statement` holds the two together.
const KEYED: [(&str, &str); 2] = [
    ("SELECT pg_catalog.pg_advisory_unlock(", "dblock_unlock"),
    (
        "SELECT pg_catalog.pg_advisory_unlock_shared(",
        "dblock_unlock_shared",
    ),
];

/// The session's statement for a head statement, and its key if it takes one.
pub(crate) fn fixed_for(statement: &str) -> Option<(&'static str, Option<i64>)> {
    if let Some((_, name)) = FIXED.iter().find(|f| f.0 == statement) {
        return Some((name, None));
    }
    let (prefix, key, rest) = split_key(statement)?;
    let (_, name) = KEYED.iter().find(|k| k.0 == prefix && rest.is_empty())?;
    Some((name, Some(key)))
}

/// Whether a round's head may use the session's [`FIXED`] and [`KEYED`] statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fixed {
    /// The session has them: bound by name.
    Have,
    /// Parsed in this round, after the head (which parses its own).
    Parse,
}

/// The type of a [`Last::key`] (`int8`).
const INT8: u32 = 20;

/// Encodes a round: each statement of `head` bound and executed (the session's own for
/// it if `fixed` is [`Fixed::Have`], else parsed unnamed first; [`Fixed::Parse`] parses
/// the session's after the head); then the [`Last`] statement (parsed under its name
/// first if asked), bound and executed, its portal closed; then one `Sync`. Results
/// come back as text, as a simple query's.
/// `None` if a statement cannot be encoded (a NUL in it, which no simple query could
/// carry either).
///
/// Written into `buf` (emptied first), the connection's own buffer: once the round before
/// was written to the socket and let go, its room is used again, and a round allocates
/// nothing for its message.
pub(crate) fn encode<'a>(
    buf: &mut BytesMut,
    head: impl Iterator<Item = &'a str>,
    fixed: Fixed,
    last: &Last<'_>,
) -> Option<bytes::Bytes> {
    buf.clear();
    buf.reserve(160 + last.parse.map_or(0, str::len));
    for statement in head {
        match (fixed, fixed_for(statement)) {
            (Fixed::Have, Some((name, key))) => bind(buf, name, key)?,
            _ => {
                frontend::parse("", statement, [], buf).ok()?;
                bind(buf, "", None)?;
            }
        }
        frontend::execute("", 0, buf).ok()?;
    }
    if fixed == Fixed::Parse {
        for (text, name) in FIXED {
            frontend::parse(name, text, [], buf).ok()?;
        }
        for (prefix, name) in KEYED {
            let text = format!("{prefix}$1)");
            frontend::parse(name, &text, [INT8], buf).ok()?;
        }
    }
    if let Some(text) = last.parse {
        let types = last.key.map(|_| INT8);
        frontend::parse(last.name.as_str(), text, types, buf).ok()?;
    }
    bind(buf, last.name.as_str(), last.key)?;
    frontend::execute("", 0, buf).ok()?;
    // The portal closed: left open until the next round, it would keep its snapshot, and
    // a held lock would hold back every other session's `VACUUM` and `CREATE INDEX
    // CONCURRENTLY` (a simple query drops its portal when its statement ends).
    frontend::close(b'P', "", buf).ok()?;
    frontend::sync(buf);
    Some(buf.split().freeze())
}

/// A `Bind` of `statement` to the unnamed portal: `key` its one parameter (binary), if
/// any; results as text.
fn bind(buf: &mut BytesMut, statement: &str, key: Option<i64>) -> Option<()> {
    frontend::bind(
        "",
        statement,
        key.map(|_| 1),
        key,
        |key, buf| {
            buf.extend_from_slice(&key.to_be_bytes());
            Ok(postgres_protocol::IsNull::No)
        },
        [],
        buf,
    )
    .ok()
}

/// What the reply to an [`encode`]d round showed.
pub(crate) struct Read {
    /// The statements that completed (the head's, then the last).
    pub(crate) completed: usize,
    /// The `Bind`s that completed (a statement's comes before its rows).
    pub(crate) binds: usize,
    /// The error that ended the round.
    pub(crate) error: Option<QueryError>,
}

impl Read {
    /// Whether the last statement of a round of `head` statements was bound: every
    /// `Parse` ahead of it completed.
    pub(crate) fn bound(&self, head: usize) -> bool {
        self.binds > head
    }

    /// Whether the error came after a round of `head` statements ran its head and before
    /// its last statement was bound: a named `Parse` refused, or the `Bind` of a statement
    /// the session does not have — never the lock statement's own.
    pub(crate) fn failed_between(&self, head: usize) -> bool {
        self.error.is_some() && self.completed == head && self.binds == head
    }

    /// Whether the error came at the round's first `Bind`, before anything ran.
    pub(crate) fn failed_first(&self) -> bool {
        self.error.is_some() && self.completed == 0 && self.binds == 0
    }
}

/// Reads the reply to an [`encode`]d round: `row(i, value)` for each row of
/// statement `i` (its first column), to the `ReadyForQuery` or the error that ends it.
///
/// Not cancel safe by itself: dropped mid-way, the round's state on the session is
/// unknown; its callers arm an abandon before awaiting it (the connection is then closed).
pub(crate) async fn read(
    responses: &mut EncodedResponses,
    mut row: impl FnMut(usize, Option<&str>),
) -> Read {
    let mut out = Read {
        completed: 0,
        binds: 0,
        error: None,
    };
    loop {
        match responses.next().await {
            Ok(backend::Message::BindComplete) => out.binds += 1,
            Ok(backend::Message::DataRow(body)) => {
                let mut ranges = body.ranges();
                let value = match fallible_first(&mut ranges) {
                    Some(Some(range)) => body
                        .buffer()
                        .get(range)
                        .and_then(|b| std::str::from_utf8(b).ok()),
                    _ => None,
                };
                row(out.completed, value);
            }
            Ok(backend::Message::CommandComplete(_) | backend::Message::EmptyQueryResponse) => {
                out.completed += 1;
            }
            Ok(backend::Message::ReadyForQuery(_)) => return out,
            Ok(_) => {}
            Err(e) => {
                out.error = Some(QueryError::from_driver(e));
                return out;
            }
        }
    }
}

/// The first item of a row's column ranges.
fn fallible_first(
    ranges: &mut backend::DataRowRanges<'_>,
) -> Option<Option<std::ops::Range<usize>>> {
    use fallible_iterator::FallibleIterator;
    ranges.next().ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_and_read_back() {
        assert_eq!(Name::of(0).as_str(), "dblock0");
        assert_eq!(Name::of(7).as_str(), "dblock7");
        assert_eq!(Name::of(10).as_str(), "dblock10");
        assert_eq!(Name::of(256).as_str(), "dblock256");
        assert_eq!(Name::of(u32::MAX).as_str(), "dblock4294967295");
    }

    /// A round written into the connection's buffer is the same round, whatever the
    /// buffer held: the room of a round still being sent, or what a round that could not
    /// be encoded (a NUL) left half-written.
    #[test]
    fn a_reused_buffer_writes_the_same_round() {
        let last = Last {
            name: Name::of(1),
            parse: None,
            key: Some(-7),
        };
        let fresh = encode(
            &mut BytesMut::new(),
            ["ROLLBACK AND CHAIN"].into_iter(),
            Fixed::Have,
            &last,
        );
        let mut buf = BytesMut::new();
        let held = encode(
            &mut buf,
            ["ROLLBACK AND CHAIN"].into_iter(),
            Fixed::Have,
            &last,
        );
        assert!(
            encode(
                &mut buf,
                ["SELECT 1", "a\0b"].into_iter(),
                Fixed::Have,
                &last
            )
            .is_none()
        );
        let again = encode(
            &mut buf,
            ["ROLLBACK AND CHAIN"].into_iter(),
            Fixed::Have,
            &last,
        );
        assert!(fresh.is_some());
        assert_eq!(held, fresh);
        assert_eq!(again, fresh);
        drop(held);
        let after = encode(
            &mut buf,
            ["ROLLBACK AND CHAIN"].into_iter(),
            Fixed::Have,
            &last,
        );
        assert_eq!(after, fresh);
    }

    /// A round's messages: per head statement `P`, `B`, `E` (`B`, `E` for one the session
    /// has prepared); the fixed statements' and the last's `P` only when asked; then `B`,
    /// `E`, `C` (its portal), and one `S` — a keyed statement's comment never sent.
    #[test]
    fn a_round_is_its_statements_then_one_sync() {
        let kinds = |bytes: &[u8]| {
            let mut kinds = String::new();
            let mut at = 0;
            while at < bytes.len() {
                kinds.push(char::from(bytes[at]));
                let len = u32::from_be_bytes([
                    bytes[at + 1],
                    bytes[at + 2],
                    bytes[at + 3],
                    bytes[at + 4],
                ]) as usize;
                at += 1 + len;
            }
            kinds
        };
        let last = |parse, key| Last {
            name: Name::of(3),
            parse,
            key,
        };
        let first = encode(
            &mut BytesMut::new(),
            ["ROLLBACK AND CHAIN"].into_iter(),
            Fixed::Parse,
            &last(Some("SELECT 1"), None),
        );
        // The head parsed, the fixed statements parsed after it, then the last's.
        assert_eq!(kinds(&first.unwrap_or_default()), "PBEPPPPPPBECS");
        // Then bound: a head statement the session has, and one it has not.
        let then = encode(
            &mut BytesMut::new(),
            ["ROLLBACK", "BEGIN"].into_iter(),
            Fixed::Have,
            &last(None, None),
        );
        assert_eq!(kinds(&then.unwrap_or_default()), "BEPBEBECS");
        // A statement for every key: parsed the first time, then bound with the key;
        // nothing after its portal's `Close` but the `Sync`.
        let keyed = encode(
            &mut BytesMut::new(),
            ["ROLLBACK AND CHAIN"].into_iter(),
            Fixed::Have,
            &last(Some("SELECT f($1)"), Some(-7)),
        );
        assert_eq!(kinds(&keyed.unwrap_or_default()), "BEPBECS");
        let keyed = encode(
            &mut BytesMut::new(),
            ["ROLLBACK AND CHAIN"].into_iter(),
            Fixed::Have,
            &last(None, Some(-7)),
        );
        assert_eq!(kinds(&keyed.unwrap_or_default()), "BEBECS");
        // A session-scoped release carried ahead: bound with its key.
        let released = encode(
            &mut BytesMut::new(),
            ["SELECT pg_catalog.pg_advisory_unlock(-3)", "SELECT 1"].into_iter(),
            Fixed::Have,
            &last(None, None),
        );
        assert_eq!(kinds(&released.unwrap_or_default()), "BEPBEBECS");
        assert_eq!(
            fixed_for("SELECT pg_catalog.pg_advisory_unlock_shared(-3)"),
            Some(("dblock_unlock_shared", Some(-3)))
        );
        assert_eq!(
            fixed_for("SELECT pg_catalog.pg_advisory_unlock(-3) /* x */"),
            None
        );
        assert_eq!(
            fixed_for("ROLLBACK AND CHAIN"),
            Some(("dblock_chain", None))
        );
        assert!(
            encode(
                &mut BytesMut::new(),
                ["a\0b"].into_iter(),
                Fixed::Have,
                &last(None, None)
            )
            .is_none()
        );
    }
}
