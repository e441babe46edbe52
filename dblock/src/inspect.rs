//! What a handle can tell an operator: who holds and awaits locks
//! ([`Locks::status`]), and breaking a lock by ending its holder's session
//! ([`Locks::terminate_holders`]). Written once over the backends'
//! [`StatusSource`](crate::raw::StatusSource).

use crate::error::Error;
use crate::key::{Key, check_name};
use crate::locks::Locks;
use crate::raw::{Asked, LockStatus, Party, StatusSource};

impl Locks {
    fn status_source(&self) -> Result<&dyn StatusSource, Error> {
        self.inner.backend.status().ok_or_else(|| {
            Error::Unsupported(format!(
                "the {} backend cannot list lock holders",
                self.backend_name()
            ))
        })
    }

    /// Who holds and who awaits locks in the database: the locks named in `names`
    /// (keyed in the handle's namespace), or with `names` empty every lock the backend
    /// can list. Each row has the lock's key and, when known, its name; its holders and
    /// waiters with their process (host, pid, program), their connection, and since
    /// when they hold or wait. What each backend can show is in `docs/status.md`.
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
    /// for lock in locks.status(&["autoland:7"]).await? {
    ///     for h in &lock.holders {
    ///         println!("{} held by {}", lock.label(), h.describe());
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::Unsupported`] on a backend that
    /// cannot tell; the backend's errors when the database cannot be read.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads, and takes nothing that outlives it.
    pub async fn status(&self, names: &[&str]) -> Result<Vec<LockStatus>, Error> {
        let ns = self.namespace();
        let mut asked: Vec<Asked<'_>> = Vec::with_capacity(names.len());
        for n in names {
            check_name(n)?;
            asked.push((ns, n, Key::derive(ns, n)));
        }
        let mut rows = self.status_source()?.status(&asked).await?;
        // A name asked for is known even where the server could not show it.
        for r in &mut rows {
            if let Some((ns, name, _)) = asked.iter().find(|a| a.2 == r.key) {
                r.namespace = Some(ns.to_string());
                r.name = Some(name.to_string());
            }
        }
        Ok(rows)
    }

    /// Breaks lock `name` by ending the sessions that hold it (PostgreSQL
    /// `pg_terminate_backend`, MySQL `KILL`): the server frees the lock at once, and a
    /// dblock holder learns it lost the lock ([`LockGuard::lost`](crate::LockGuard::lost)
    /// resolves; its fencing token is then stale, so fenced writes are refused once a
    /// new holder takes a token). Returns who was ended; empty if nobody held it.
    ///
    /// A break-glass tool for a holder that is stuck: the holder's work may be cut off
    /// half done.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`]; [`Error::Unsupported`] on the embedded backend, whose
    /// locks belong to the holding process and end only with it (the error names the
    /// process); [`Error::PermissionDenied`] or the server's error when the role may not
    /// end other sessions.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe in effect: once sent, the server may end the holders whether or
    /// not the future is polled to its end.
    pub async fn terminate_holders(&self, name: &str) -> Result<Vec<Party>, Error> {
        check_name(name)?;
        let ns = self.namespace();
        self.status_source()?
            .terminate((ns, name, Key::derive(ns, name)))
            .await
    }
}
