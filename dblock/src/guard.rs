//! The guard that holds a lock, and how it reports losing it.

use std::fmt;
use std::future::Future;

use crate::error::{Error, LossReason};
use crate::fencing::Fence;
use crate::key::Key;
use crate::observe::Tally;
use crate::raw::{Grant, Held, Mode};

/// A held lock. Dropping it releases the lock at once; [`release`](LockGuard::release)
/// does the same and reports errors.
///
/// On PostgreSQL the guard pins one connection for the lock's whole life. Dropping it
/// *sends* the release (`ROLLBACK` or `pg_advisory_unlock`) immediately, without
/// waiting for the reply, so another process can take the lock within a round trip;
/// the connection then returns to dblock's pool, and the next request on it waits for
/// that reply first (a lock request that takes the connection before the release has
/// been written carries it at the head of its own message). A connection whose state
/// is in doubt is closed instead, which also releases everything it held. On
/// MySQL/MariaDB the guard likewise pins a connection, whose `RELEASE_LOCK` rides at the
/// head of the next request on it, or is sent alone at once when none comes first. On
/// the embedded backend dropping it unlocks the lock file's byte.
#[must_use = "if unused the lock is released immediately"]
#[clippy::has_significant_drop]
pub struct LockGuard {
    /// Boxed: most guards have none, and a guard is what a process holding 50,000
    /// locks keeps 50,000 of (40 bytes less each).
    fence: Option<Box<Fence>>,
    /// The backend's half: releases on drop.
    held: Held,
    /// The name, key and mode, and what tracing and metrics are told of the lock's end:
    /// dropped after `held`, so "released" follows the release being sent.
    tally: Tally,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.name())
            .field("key", &self.key())
            .field("mode", &self.mode())
            .field("fencing_token", &self.fencing_token())
            .finish()
    }
}

impl LockGuard {
    #[inline]
    pub(crate) fn new(tally: Tally, grant: Grant) -> LockGuard {
        let key = tally.key();
        LockGuard::keyed(tally, key, grant)
    }

    /// A guard whose fencing token is kept under `fence_key` (a semaphore's slot, whose
    /// token is its name's).
    #[inline]
    pub(crate) fn keyed(tally: Tally, fence_key: Key, grant: Grant) -> LockGuard {
        LockGuard {
            fence: grant
                .fence
                .map(|granted| Box::new(Fence::new(tally.name(), fence_key, granted))),
            held: grant.held,
            tally,
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &str {
        self.tally.name()
    }

    /// The lock's key.
    pub fn key(&self) -> Key {
        self.tally.key()
    }

    /// Exclusive or shared.
    pub fn mode(&self) -> Mode {
        self.tally.mode()
    }

    /// The fencing token of this grant, if one was asked for
    /// ([`Request::fenced`](crate::Request::fenced)): greater than every earlier grant's
    /// token for this name.
    pub fn fencing_token(&self) -> Option<i64> {
        self.fence.as_deref().map(Fence::token)
    }

    /// The fence of this grant, to check in the transaction that makes the writes the
    /// lock protects (see [`fencing`](crate::fencing)); `None` unless a token was asked
    /// for.
    pub fn fence(&self) -> Option<&Fence> {
        self.fence.as_deref()
    }

    /// Whether the lock is still held as far as this process knows: `false` once its
    /// connection has been seen to close or stop answering. A lock can be lost a moment
    /// before this notices; fencing tokens guard writes against that window.
    pub fn is_held(&self) -> bool {
        match self.held.loss() {
            None => true,
            Some(reason) => {
                self.tally.saw_loss(&reason);
                false
            }
        }
    }

    /// A future that resolves, with the reason, when the lock is lost; it never
    /// resolves while the lock is held. It does not borrow the guard, so it can be raced
    /// against the work the lock protects:
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
    /// # async fn work() {}
    /// let guard = locks.lock("nightly-report").await?;
    /// tokio::select! {
    ///     () = work() => guard.release().await?,
    ///     reason = guard.lost() => eprintln!("lost the lock ({reason}); stopping"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// On PostgreSQL and MySQL/MariaDB the lock's connection is watched all the time it
    /// is held: on dblock's own PostgreSQL connections a closed connection is noticed at
    /// once, a silent one within [`check_interval`](crate::Builder::check_interval) plus
    /// [`check_timeout`](crate::Builder::check_timeout); a MySQL lock's connection, and a
    /// PostgreSQL connection borrowed from an sqlx pool, are only read while a request or
    /// a check runs on them, so there a closed connection is noticed at the next check,
    /// within `check_interval`. A transaction-scoped lock that is lost takes its
    /// transaction with it. Locks of the embedded backend live as long as the process
    /// and are lost only if their lock file is replaced.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future has no effect on the lock.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        let lost = self.held.lost();
        let reporter = self.tally.loss_reporter();
        async move {
            let reason = lost.await;
            reporter.report(&reason);
            reason
        }
    }

    /// Checks with the server, now, that the lock is still held. On a connection that
    /// stops answering it returns once the connection is declared lost, within
    /// [`check_interval`](crate::Builder::check_interval) plus
    /// [`check_timeout`](crate::Builder::check_timeout).
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] when it is not, including after the runtime that drove the
    /// lock's connection has shut down (the connection went with it).
    ///
    /// # Cancel safety
    ///
    /// Cancelling the check has no effect on the lock: the check is an empty query
    /// whose reply the connection reads and drops when no one waits for it any more, on
    /// a connection of the lock's own; on a multiplexing handle's shared connection it
    /// is answered by the next message the connection's lane sends (with whatever else
    /// it sends, so that many guards' checks share a round trip), and a cancelled check's
    /// answer is dropped.
    pub async fn check(&mut self) -> Result<(), Error> {
        let r = self.held.check().await;
        if let Err(Error::LockLost { reason }) = &r {
            self.tally.saw_loss(reason);
        }
        r
    }

    /// Makes the process `cmd` starts hold this lock too: it inherits a descriptor that
    /// keeps the lock held for as long as any copy of it is open — the lock's
    /// connection's socket on PostgreSQL (dblock's own connections) and MySQL/MariaDB,
    /// the lock file's open file description on the embedded backend (OFD locks). So if
    /// this process dies, by any signal, the server (or the kernel) keeps the lock until
    /// the child, and every process the child started that kept the descriptor, has
    /// exited too: the child never runs outside the lock, however late it learns of the
    /// death. Returns the descriptor numbers the child gets (open across `exec`; tell it
    /// to leave them alone, e.g. in an environment variable, as `dblock run` does with
    /// `DBLOCK_LOCK_FD`).
    ///
    /// Works with a `tokio::process::Command` too, through its `as_std_mut()`. Call it
    /// just before spawning, and drop `cmd` once spawned: until then `cmd` holds this
    /// process's copies of the descriptors.
    ///
    /// From this call on the lock's connection is not reused: when the lock ends
    /// (released, dropped, or lost) it is shut down (`shutdown(2)`), which ends the
    /// connection — and the lock — for every copy, the child's included. Releasing the
    /// lock while the child runs therefore ends the child's hold on it too.
    ///
    /// Limits: a child that closes every descriptor it did not open (many daemons, or
    /// `closefrom`) gives the protection up, as does one that passes the socket to
    /// something that writes on it (the child must not use it). A lock lost while the
    /// child runs may stay held on the server, behind the child's copy, until this
    /// process notices the loss (then the connection is shut down) or the child exits.
    /// Not on a connection borrowed from an sqlx pool on PostgreSQL, nor where the
    /// socket cannot be told from others (behind a pooler or proxy that the server sees
    /// instead of this process, on MySQL over a Unix socket), nor with the embedded
    /// backend's POSIX record locks (macOS, the BSDs, `DBLOCK_FILE_LOCKS=posix`), which
    /// belong to the process: [`Error::Unsupported`] there, saying why.
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut guard = locks.lock("nightly-report").await?;
    /// let mut cmd = std::process::Command::new("./report.sh");
    /// let fds = guard.share_with_child(&mut cmd).await?;
    /// cmd.env("REPORT_LOCK_FDS", format!("{fds:?}"));
    /// let mut child = cmd.spawn()?;
    /// drop(cmd);
    /// child.wait()?;
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] as above; [`Error::LockLost`] when the lock is no longer
    /// held; connection errors while asking the server which connection is the lock's.
    ///
    /// # Cancel safety
    ///
    /// Cancelling it leaves the lock held and `cmd` unchanged; the connection may
    /// already be marked not to be reused.
    pub async fn share_with_child(
        &mut self,
        cmd: &mut std::process::Command,
    ) -> Result<Vec<std::os::fd::RawFd>, Error> {
        let fds = self.held.share().await?;
        Ok(crate::sys::inherit(cmd, fds))
    }

    /// Releases the lock now and waits for the database to confirm it.
    ///
    /// # Errors
    ///
    /// [`Error::LockLost`] if the lock had been lost before; connection errors. Either
    /// way the lock is no longer held.
    ///
    /// # Cancel safety
    ///
    /// Cancelling the release still releases: the connection is closed if the reply
    /// had not arrived.
    pub async fn release(self) -> Result<(), Error> {
        let LockGuard { held, tally, .. } = self;
        tally.closing();
        let r = held.release().await;
        if let Err(Error::LockLost { reason }) = &r {
            tally.saw_loss(reason);
        }
        drop(tally);
        r
    }
}

// Dropping `held` releases: each backend's half implements Drop, and so does an `Entry`.

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync_static<T: Send + Sync + 'static>() {}
    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn guards_and_futures_are_send_and_static() {
        assert_send_sync_static::<LockGuard>();
        assert_send_sync_static::<crate::Locks>();
        assert_send_sync_static::<Error>();
        #[allow(unreachable_code, unused_variables, clippy::diverging_sub_expression)]
        let _ = || {
            let locks: crate::Locks = todo!();
            assert_send(&locks.lock("x"));
            assert_send(&locks.try_lock("x"));
            let guard: LockGuard = todo!();
            assert_send(&guard.lost());
            assert_send(&guard.release());
        };
    }
}
