//! Which engine a handle talks to, and the self-test before trust: that an advisory lock
//! taken on one connection stops a try on another (see [`crate::engine`] for why).
//!
//! The engine is named when the handle opens, from the start-up parameters on dblock's
//! own connections (no round trip) or `version()` in the handle's one opening query on
//! an sqlx pool. PostgreSQL is trusted; any other engine — or any, with `self_test=always`
//! in the URL or [`Builder::self_test`](crate::Builder::self_test) — is checked once per
//! handle, before its first grant, and the verdict kept: a scope whose locks do not
//! exclude is refused for the handle's life with [`Error::Unsupported`]
//! ([`Capability::AdvisoryLocks`]).

use std::hash::{BuildHasher, Hasher};

use super::backend::{PgBackend, Source};
use super::conn::pooler::Pooler;
use super::conn::wire::QueryError;
use super::conn::{Armed, Conn};
use super::sql::first_value;
use crate::error::{Capability, Error};
use crate::raw::Scope;

pub use crate::engine::{Engine, Exclusion, SelfTest, Verdict};

/// How many random keys the check tries before it concludes that the server never
/// grants a free one (a key someone else holds is vanishingly unlikely).
const KEYS_TRIED: usize = 3;

impl Source {
    /// A second connection besides one checked out: on dblock's own pool a new one
    /// outside its count (so a pool of one connection can still be checked), on an sqlx
    /// pool another of its connections.
    async fn another(&self) -> Result<Conn, Error> {
        match self {
            Source::Native(p) => p.connect_unpooled().await.map(Conn::Native),
            Source::Sqlx(_) => self.get().await,
        }
    }

    /// Gives back what [`Source::another`] gave, holding nothing: dblock's own is closed
    /// (never pooled, so the pool keeps to its size), a borrowed one recycled.
    fn put_back(conn: Conn) {
        match conn {
            // The last handle on its client: the connection ends (Terminate).
            Conn::Native(c) => drop(c),
            sqlx => sqlx.recycle(),
        }
    }
}

/// A key no one holds: random, so that two handles checking at once do not meet.
fn random_key() -> i64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as i64
}

/// Marks the check's statements for an operator reading the server's log or
/// `pg_stat_activity`.
pub(crate) const MARK: &str = "/* dblock self-test */";

/// The statement that tries `key` on its own in `scope`.
fn try_sql(scope: Scope, key: i64) -> String {
    match scope {
        Scope::Transaction => {
            format!("SELECT pg_catalog.pg_try_advisory_xact_lock({key}) {MARK}")
        }
        Scope::Session => format!("SELECT pg_catalog.pg_try_advisory_lock({key}) {MARK}"),
    }
}

/// A server error ends the check of a scope with its message; a lost connection ends
/// the check.
fn server_said(e: QueryError) -> Result<Verdict, Error> {
    match e {
        QueryError::Db { message, .. } => Ok(Verdict::Unavailable { message }),
        lost => Err(lost.into_error()),
    }
}

impl PgBackend {
    /// Checks now, whatever the engine, that advisory locks of each scope exclude (session
    /// locks only where sessions are kept: not behind a transaction pooler).
    pub(crate) async fn check_exclusion(&self) -> Result<Exclusion, Error> {
        let transaction = self.check_scope(Scope::Transaction).await?;
        let session = match self.pooler.0 {
            Pooler::Transaction => Verdict::Untested,
            _ => self.check_scope(Scope::Session).await?,
        };
        Ok(Exclusion {
            engine: self.engine.clone(),
            transaction,
            session,
        })
    }

    /// One scope's check: a random key taken on one connection (in a transaction kept
    /// open, or on the session), then tried on another, which must be refused. Both
    /// connections hold nothing afterwards.
    async fn check_scope(&self, scope: Scope) -> Result<Verdict, Error> {
        let first = Armed::new(self.source.get().await?);
        let second = Armed::new(self.source.another().await?);
        for _ in 0..KEYS_TRIED {
            let key = random_key();
            let take = match scope {
                Scope::Transaction => format!("BEGIN; {}", try_sql(scope, key)),
                Scope::Session => try_sql(scope, key),
            };
            let granted = match first.conn().query(&take).await {
                Ok(rows) => first_value(&rows, rows.len().saturating_sub(1)),
                Err(e) => return server_said(e),
            };
            let undo = match scope {
                Scope::Transaction => "ROLLBACK".to_string(),
                Scope::Session => format!("SELECT pg_catalog.pg_advisory_unlock({key})"),
            };
            if granted.as_deref() != Some("t") {
                // Held elsewhere (or never granted): end the transaction, try another key.
                first
                    .conn()
                    .query(&undo)
                    .await
                    .map_err(QueryError::into_error)?;
                continue;
            }
            let also = match second.conn().query(&try_sql(scope, key)).await {
                Ok(rows) => first_value(&rows, 0),
                Err(e) => return server_said(e),
            };
            if also.as_deref() == Some("t") && scope == Scope::Session {
                let unlock = format!("SELECT pg_catalog.pg_advisory_unlock({key})");
                second
                    .conn()
                    .query(&unlock)
                    .await
                    .map_err(QueryError::into_error)?;
            }
            first
                .conn()
                .query(&undo)
                .await
                .map_err(QueryError::into_error)?;
            first.disarm().recycle();
            Source::put_back(second.disarm());
            return Ok(match also.as_deref() {
                Some("f") => Verdict::Excludes,
                Some("t") => Verdict::DoesNotExclude,
                other => Verdict::Unavailable {
                    message: format!("a try answered {other:?}, neither true nor false"),
                },
            });
        }
        // Each try was undone: both hold nothing.
        first.disarm().recycle();
        Source::put_back(second.disarm());
        Ok(Verdict::Unavailable {
            message: format!("{KEYS_TRIED} free keys tried, none granted"),
        })
    }

    /// Whether locks on this handle wait for [`PgBackend::trust`]: any engine but
    /// PostgreSQL, or `self_test=always`.
    #[inline]
    pub(crate) fn must_check(&self) -> bool {
        self.self_test || !self.engine.trusted()
    }

    /// Refuses `scope` on an engine that cannot serve it: a scope the engine is known to
    /// lack, at once; else, on an engine that is checked, a scope its check (run once,
    /// before the handle's first grant) found not to exclude. PostgreSQL without
    /// `self_test=always` costs a field read.
    pub(crate) async fn trust(&self, scope: Scope) -> Result<(), Error> {
        if !self.must_check() {
            return Ok(());
        }
        if let Some(why) = refuses(&self.engine, scope) {
            return Err(Error::unsupported(
                Capability::AdvisoryLocks,
                format!("{}: {why}", self.engine),
            ));
        }
        if !self.self_test {
            return Ok(());
        }
        let found = self
            .exclusion
            // Boxed, and only when it runs: the check is a large future that would
            // otherwise be part of every lock request's.
            .get_or_try_init(|| Box::pin(self.check_exclusion()))
            .await?;
        let verdict = match scope {
            Scope::Transaction => &found.transaction,
            Scope::Session => &found.session,
        };
        match verdict {
            Verdict::Excludes | Verdict::Untested => Ok(()),
            refused => Err(refusal(found, scope, refused)),
        }
    }
}

/// Why `scope` is refused on `engine` whatever a check finds, if it is: CockroachDB
/// has no session-level advisory locks (only stubs that always grant; cockroach#169981).
fn refuses(engine: &Engine, scope: Scope) -> Option<&'static str> {
    match (engine, scope) {
        (Engine::CockroachDb { .. }, Scope::Session) => Some(
            "CockroachDB has no session-level advisory locks (its pg_advisory_lock \
             functions grant every caller at once); use transaction-scoped locks \
             (Scope::Transaction, the default), which CockroachDB implements since 2026",
        ),
        _ => None,
    }
}

/// The error every request of `scope` gets on a handle whose check found `verdict`.
fn refusal(found: &Exclusion, scope: Scope, verdict: &Verdict) -> Error {
    let (what, function) = match scope {
        Scope::Transaction => ("transaction-scoped", "pg_try_advisory_xact_lock"),
        Scope::Session => ("session-scoped", "pg_try_advisory_lock"),
    };
    let finding = match verdict {
        Verdict::Unavailable { message } => {
            format!("its {function} could not be used ({message})")
        }
        _ => format!(
            "a lock taken with {function} on one connection did not stop another from \
             taking it, so every caller would hold it at once"
        ),
    };
    let fix = match (scope, found.transaction.excludes()) {
        (Scope::Session, true) => {
            "use transaction-scoped locks (the default), which this server's check found to exclude"
        }
        _ => {
            "dblock refuses every such lock on this server: use PostgreSQL, or an engine \
             version whose advisory locks exclude (see docs/connecting.md, engines)"
        }
    };
    Error::unsupported(
        Capability::AdvisoryLocks,
        format!(
            "{}: {what} advisory locks do not exclude: {finding}; {fix}",
            found.engine
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cockroachdb_refuses_session_locks_up_front() {
        let crdb = Engine::CockroachDb {
            version: "v24".into(),
        };
        assert!(refuses(&crdb, Scope::Session).is_some());
        assert!(refuses(&crdb, Scope::Transaction).is_none());
        let pg = Engine::PostgreSql {
            version: "16".into(),
        };
        assert!(refuses(&pg, Scope::Session).is_none());
    }

    #[test]
    fn self_test_values_parse() {
        assert_eq!(SelfTest::parse("ALWAYS"), Ok(SelfTest::Always));
        assert_eq!(SelfTest::parse("auto"), Ok(SelfTest::Auto));
        assert!(SelfTest::parse("sometimes").is_err());
    }
}
