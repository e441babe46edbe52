//! Leader election: among the processes that stand for a name, one leads.
//!
//! A leader is the holder of an exclusive, fenced lock on the election's name; the other
//! candidates wait for that lock. Each term carries the grant's fencing token, so work
//! done by a leader that lost its term without noticing can be refused (see
//! [`fencing`](crate::fencing)): two leaders may briefly *believe* they lead, but never
//! both succeed with fenced writes.
//!
//! ```no_run
//! # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
//! # async fn do_leader_work(_token: i64) {}
//! let election = dblock::leader::Election::new(&locks, "scheduler");
//! loop {
//!     let term = election.campaign().await?; // waits until this process leads
//!     tokio::select! {
//!         () = do_leader_work(term.token()) => {}
//!         reason = term.lost() => eprintln!("no longer the leader: {reason}"),
//!     }
//! }
//! # }
//! ```
//!
//! # How fast a candidate takes over
//!
//! - The leader resigns or its process exits, however it exits (even SIGKILL): at once —
//!   the server (or, on the embedded backend, the kernel) frees the lock as soon as the
//!   leader's connection (or process) is gone, and a waiting candidate's request is
//!   granted within a round trip.
//! - The leader's connection is terminated (`pg_terminate_backend`, a server restart):
//!   at once, likewise.
//! - The leader falls silent — its host cut off, its process paused: within the
//!   election's [lease](Election::lease) (10 s unless set), enforced by the server,
//!   which ends a lock session that has been idle that long. A live leader's session is
//!   never idle that long: dblock checks it every
//!   [`check_interval`](crate::Builder::check_interval) (1 s).
//!
//! The deposed leader learns of the loss ([`Term::lost`]) at once when its connection is
//! closed, within `check_interval + check_timeout` (6 s by default) when it is silently
//! cut off, and only when it resumes if it was paused — which is why its writes must be
//! fenced. On the embedded backend a leader's term ends only with its process.

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Error, LossReason};
use crate::fencing::Fence;
use crate::guard::LockGuard;
use crate::locks::Locks;

/// This candidate's role, as [`Election::watch`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// Not leading (standing or not).
    Follower,
    /// Leading, in the term with this fencing token.
    Leader {
        /// The term's fencing token.
        token: i64,
    },
}

/// The latest leader elected for a name, from the fencing table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderInfo {
    /// `host:pid` of the process that was elected.
    pub holder: String,
    /// The term's fencing token.
    pub token: i64,
    /// When it was elected, as the database wrote it.
    pub elected_at: String,
}

/// An election for one name, seen from one candidate process.
#[derive(Debug)]
pub struct Election {
    locks: Locks,
    name: String,
    lease: Duration,
    role: watch::Sender<Role>,
}

impl Election {
    /// An election for `name` on `locks`'s database. Creating it changes nothing; call
    /// [`campaign`](Election::campaign) to stand.
    pub fn new(locks: &Locks, name: &str) -> Election {
        Election {
            locks: locks.clone(),
            name: name.to_string(),
            lease: Duration::from_secs(10),
            role: watch::Sender::new(Role::Follower),
        }
    }

    /// How long the server keeps a silent leader's term before freeing it for a
    /// candidate (PostgreSQL and MySQL/MariaDB; see the [module docs](self)). Ten seconds unless set; at
    /// least what [`Request::lease`](crate::Request::lease) requires of the handle's
    /// checks, so that a leader cut off learns it lost its term before another is elected.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Stands for election and waits until this process leads; returns the term.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancelling it withdraws the candidacy; it never leaves this process leading.
    pub async fn campaign(&self) -> Result<Term, Error> {
        let mut req = self.locks.request(&self.name).fenced();
        if self.locks.inner.backend.has_leases() {
            req = req.lease(self.lease);
        }
        let guard = req.lock().await?;
        let token = guard.fencing_token().unwrap_or(0);
        tracing::info!(target: "dblock::leader", name = %self.name, token, "elected leader");
        self.role.send_replace(Role::Leader { token });
        // The role goes back to Follower when the term is lost or given up.
        let role = self.role.clone();
        let lost = guard.lost();
        let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            tokio::select! {
                _ = lost => {}
                _ = ended_rx => {}
            }
            role.send_if_modified(|r| {
                if *r == (Role::Leader { token }) {
                    *r = Role::Follower;
                    true
                } else {
                    false
                }
            });
        });
        Ok(Term {
            guard,
            _ended: ended_tx,
        })
    }

    /// Campaigns, runs `work` while this process leads, and stands again when the term
    /// ends — for ever. `work` gets the term's [`Fence`]; when the term is lost, `work`'s
    /// future is dropped (that is how it is told to stop), and if `work` returns, the
    /// process resigns and stands again.
    ///
    /// # Errors
    ///
    /// The first error of a campaign.
    ///
    /// # Cancel safety
    ///
    /// Cancelling it drops the running `work` and resigns.
    pub async fn run<F, Fut>(&self, mut work: F) -> Result<std::convert::Infallible, Error>
    where
        F: FnMut(Fence) -> Fut,
        Fut: Future<Output = ()>,
    {
        loop {
            let term = self.campaign().await?;
            let fence = match term.guard.fence() {
                Some(f) => f.clone(),
                None => return Err(Error::unexpected("the term has no fencing token")),
            };
            tokio::select! {
                () = work(fence) => {
                    let _ = term.resign().await;
                }
                _ = term.lost() => {}
            }
        }
    }

    /// This candidate's role, now and as it changes.
    pub fn watch(&self) -> watch::Receiver<Role> {
        self.role.subscribe()
    }

    /// The latest leader elected for this name, by any process: who, its token, and
    /// since when. It may have ended its term since, if no candidate has taken over.
    ///
    /// # Errors
    ///
    /// Connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// A read; cancelling it has no effect.
    pub async fn leader(&self) -> Result<Option<LeaderInfo>, Error> {
        let key = self.locks.key(&self.name)?;
        let latest = self.locks.inner.backend.latest_grant(key).await?;
        Ok(latest.map(|g| LeaderInfo {
            holder: g.holder,
            token: g.token,
            elected_at: g.granted_at,
        }))
    }
}

/// A leader's term: leadership lasts as long as this lives and the lock holds.
#[derive(Debug)]
#[must_use = "if unused the term ends at once"]
pub struct Term {
    guard: LockGuard,
    _ended: tokio::sync::oneshot::Sender<()>,
}

impl Term {
    /// The term's fencing token: greater than every earlier term's.
    pub fn token(&self) -> i64 {
        self.guard.fencing_token().unwrap_or(0)
    }

    /// The term's fence, to check in writes made as leader.
    pub fn fence(&self) -> Option<&Fence> {
        self.guard.fence()
    }

    /// Whether this process still leads, as far as it knows.
    pub fn is_leader(&self) -> bool {
        self.guard.is_held()
    }

    /// Resolves when the term is lost (see [`LockGuard::lost`]).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future has no effect on the term: leadership is kept, and a new
    /// call resolves when it is lost.
    pub fn lost(&self) -> impl Future<Output = LossReason> + Send + 'static {
        self.guard.lost()
    }

    /// Gives up leadership now; a waiting candidate takes over.
    ///
    /// # Errors
    ///
    /// As [`LockGuard::release`].
    ///
    /// # Cancel safety
    ///
    /// As [`LockGuard::release`]: leadership ends either way.
    pub async fn resign(self) -> Result<(), Error> {
        tracing::info!(
            target: "dblock::leader",
            name = self.guard.name(),
            token = self.token(),
            "resigned leadership"
        );
        self.guard.release().await
    }
}
