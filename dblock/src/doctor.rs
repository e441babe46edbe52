//! What `dblock doctor` reports ([`Locks::doctor`](crate::Locks::doctor)): a few checks
//! of the database a handle talks to, each with a [`Verdict`] and, where something is
//! wrong, the fix. Each backend makes its own checks (its
//! [`RawLocks::diagnose`](crate::raw::RawLocks::diagnose)); the command prints them.
//!
//! The checks a PostgreSQL handle makes, by [`Check::name`]:
//!
//! | name | what it says |
//! |---|---|
//! | `server` | the server's version, and the engine behind it |
//! | `tls` | whether the connection is encrypted (as the server sees it) |
//! | `pooler` | the pooler detected, declared or implied by the host, and what it allows |
//! | `advisory-locks` | whether an advisory lock taken on one connection excludes another |
//! | `tables` | dblock's tables (fencing, leaders, runs) and this role's rights on them |
//! | `lock-table` | the server's lock table against what the handle may hold |
//! | `timeouts` | `idle_in_transaction_session_timeout`, `statement_timeout`, `lock_timeout` as this role sees them |
//! | `connection-check` | `client_connection_check_interval` support |
//! | `fencing-timeline` | whether fencing tokens carry the WAL timeline or are plain counters |

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Verdict {
    /// Nothing to do.
    Ok,
    /// Works, with a limit or a risk the operator should know of.
    Warn,
    /// Something dblock needs does not work: locks (or what the check names) will fail
    /// or not exclude.
    Fail,
}

impl Verdict {
    /// `ok`, `warn` or `fail`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Check {
    /// What was checked (the names are in the [module docs](self)).
    pub name: &'static str,
    /// How it came out.
    pub verdict: Verdict,
    /// What was found, in a line.
    pub detail: String,
    /// What to do about it, when the verdict is not [`Verdict::Ok`].
    pub fix: Option<String>,
}

impl Check {
    /// A check that came out well.
    pub(crate) fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            verdict: Verdict::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    /// A check with a verdict and its fix.
    fn with_fix(name: &'static str, verdict: Verdict, detail: String, fix: String) -> Check {
        Check {
            name,
            verdict,
            detail,
            fix: Some(fix),
        }
    }

    /// A check that warns, with its fix.
    pub(crate) fn warn(
        name: &'static str,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check::with_fix(name, Verdict::Warn, detail.into(), fix.into())
    }

    /// A check that fails, with its fix.
    pub(crate) fn fail(
        name: &'static str,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check::with_fix(name, Verdict::Fail, detail.into(), fix.into())
    }
}

/// The whole report: the backend and its checks, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Diagnosis {
    /// The backend's name (`postgres`, `mysql`, `sqlite`).
    pub backend: &'static str,
    /// The worst verdict of the checks.
    pub verdict: Verdict,
    /// The checks.
    pub checks: Vec<Check>,
}

impl Diagnosis {
    /// The report of `checks` made by `backend`.
    pub(crate) fn new(backend: &'static str, checks: Vec<Check>) -> Diagnosis {
        let verdict = checks
            .iter()
            .map(|c| c.verdict)
            .max()
            .unwrap_or(Verdict::Ok);
        Diagnosis {
            backend,
            verdict,
            checks,
        }
    }

    /// The check named `name`, if it was made.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

/// A duration in milliseconds as an operator reads it (`0` is "off").
pub(crate) fn shown_ms(ms: u64) -> String {
    match ms {
        0 => "off".to_string(),
        ms if ms % 3_600_000 == 0 => format!("{} h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{} min", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{} s", ms / 1000),
        ms => format!("{ms} ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_verdict_is_the_reports() {
        let d = Diagnosis::new(
            "postgres",
            vec![
                Check::ok("a", "x"),
                Check::warn("b", "y", "z"),
                Check::ok("c", ""),
            ],
        );
        assert_eq!(d.verdict, Verdict::Warn);
        assert_eq!(d.check("b").and_then(|c| c.fix.as_deref()), Some("z"));
        let d = Diagnosis::new(
            "postgres",
            vec![Check::fail("a", "x", "y"), Check::warn("b", "", "")],
        );
        assert_eq!(d.verdict, Verdict::Fail);
        assert_eq!(Diagnosis::new("sqlite", vec![]).verdict, Verdict::Ok);
        assert_eq!(
            [0, 250, 2000, 120_000, 7_200_000].map(shown_ms),
            ["off", "250 ms", "2 s", "2 min", "2 h"]
        );
    }
}
