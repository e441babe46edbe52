//! The SQL of a fencing token on PostgreSQL: the statement that takes a name's next
//! token, and the epoch (the server's live timeline) it carries. A leaf: the plan, the
//! multiplexer and the fencing table's code all write tokens with it.

use crate::postgres::sql::quote_literal;
use crate::raw::{Req, holder_id};

/// The epoch of a fenced grant: the server's *live* timeline ID times 2⁴⁰, so that the
/// tokens a promoted replica hands out exceed every token of the timeline before it.
///
/// The live timeline, not the last checkpoint's: `pg_control_checkpoint()` goes on
/// saying the old timeline after a promotion until the next checkpoint completes
/// (PostgreSQL promotes without waiting for one, and measured on PostgreSQL 15 it still
/// said the old timeline seconds after `pg_ctl promote` returned). The name of the WAL
/// segment being written, `pg_walfile_name(pg_current_wal_lsn())`, begins with the
/// timeline the server writes on (`GetWALInsertionTimeLine()`), set before a promoted
/// server accepts its first write; its first 8 hex digits are the timeline. Both
/// functions are executable by every role; on a standby they fail (as would the write).
///
/// Multiplied, not shifted: a timeline of 2²³ or more fails the grant ("bigint out of
/// range") instead of wrapping to a small token.
pub(crate) const EPOCH_SQL: &str = "(('x' || pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))\
     ::bit(32)::bigint * 1099511627776)";

/// SQLSTATEs of a server without [`EPOCH_SQL`]'s functions (or forbidding them): the
/// function is missing (42883), not supported (0A000), or not permitted (42501). There,
/// fenced grants keep the plain counter. Any other error (55000 on a standby, say) is
/// taken as a server that has them.
pub(crate) const NO_EPOCH_CODES: [&str; 3] = ["42883", "0A000", "42501"];

/// The statement that takes the next token of a name, returning it: one row, or none if
/// `cond` (a `WHERE` clause, say `pg_try_advisory_lock(k)`) is false.
///
/// With `epoch`, the token is the greater of the name's last token plus one and
/// [`EPOCH_SQL`] plus one: it rises by one per grant within a timeline, jumps above every
/// token of the old timeline after a promotion, and never falls (a restore onto a lower
/// timeline keeps counting from the row). Tokens from before (plain counters, below
/// 2⁴⁰) stay below. The epoch is read in this same statement: no extra round trip.
pub(crate) fn next_token_sql(table: &str, req: &Req<'_>, cond: &str, epoch: bool) -> String {
    let first = if epoch {
        format!("{EPOCH_SQL} + 1")
    } else {
        "1".to_string()
    };
    let next = if epoch {
        "greatest(f.token + 1, EXCLUDED.token)"
    } else {
        "f.token + 1"
    };
    format!(
        "INSERT INTO {table} AS f (key, namespace, name, token, holder, granted_at) \
         SELECT {k}, {ns}, {name}, {first}, {holder}, pg_catalog.now() {cond}\
         ON CONFLICT (key) DO UPDATE SET token = {next}, \
         holder = EXCLUDED.holder, granted_at = EXCLUDED.granted_at RETURNING token",
        k = req.fence_key().as_i64(),
        ns = quote_literal(req.namespace),
        name = quote_literal(req.name),
        holder = quote_literal(holder_id()),
    )
}
