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
//!
//! # Leaders you can watch
//!
//! A leader may publish a value for its term — its address, say — when it is elected
//! ([`Election::value`]) and change it later ([`Term::publish`]). Any process, candidate
//! or not, reads who leads now and that value ([`Locks::current_leader`]) or follows it
//! as it changes ([`Locks::observe`]), without standing:
//!
//! ```no_run
//! # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
//! // In the scheduler: publish where it listens, each time it is elected.
//! let election = dblock::leader::Election::new(&locks, "scheduler").value("10.0.3.17:8080");
//! let term = election.campaign().await?;
//! # drop(term);
//! // Anywhere else: follow the leader.
//! let mut leaders = locks.observe("scheduler");
//! loop {
//!     match leaders.changed().await? {
//!         Some(l) => println!("{} leads, at {:?}", l.holder, l.value),
//!         None => println!("no leader"),
//!     }
//! }
//! # }
//! ```
//!
//! A value is kept in the table `dblock_leaders`, beside the fencing table, and counts
//! only for the term whose fencing token it was published with: a deposed leader's write
//! is refused ([`Error::StaleToken`]) and never overwrites its successor's, and a new
//! leader shows no value until it publishes one. Observing polls the database (see
//! [`LeaderWatch`] for what a poll costs).

use std::future::Future;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::{Error, LossReason};
use crate::fencing::Fence;
use crate::guard::LockGuard;
use crate::locks::Locks;
use crate::raw::{Party, TermRecord, check_leader_value};

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

/// Who leads an election now, as any process reads it ([`Locks::current_leader`],
/// [`Locks::observe`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leading process: `host:pid` as its term's record says, or — for a holder of
    /// the name's lock with no fenced term (one not taken through an [`Election`]) — what
    /// the server shows of it ([`Party::describe`]).
    pub holder: String,
    /// The term's fencing token; `None` for a holder with no fenced term.
    pub token: Option<i64>,
    /// When the term began: the database's record of the grant (its server's clock),
    /// else when the server says the lock was taken; `None` where neither is known.
    pub since: Option<SystemTime>,
    /// What the leader published for this term ([`Election::value`],
    /// [`Term::publish`]); `None` until it publishes.
    pub value: Option<String>,
}

impl Leader {
    /// Who leads, from the holder the server shows and the record of the name's latest
    /// term (which is the holder's own unless the holder is known to be another
    /// process).
    pub(crate) fn of(holder: &Party, term: Option<TermRecord>) -> Leader {
        let same = |t: &TermRecord| match (&holder.host, holder.pid) {
            (Some(h), Some(p)) => t.holder == format!("{h}:{p}"),
            _ => true,
        };
        match term.filter(same) {
            Some(t) => Leader {
                holder: t.holder,
                token: Some(t.token),
                since: t.granted_at.or(holder.since),
                value: t.value,
            },
            None => Leader {
                holder: holder.describe(),
                token: None,
                since: holder.since,
                value: None,
            },
        }
    }
}

/// An election for one name, seen from one candidate process.
#[derive(Debug)]
pub struct Election {
    locks: Locks,
    name: String,
    lease: Duration,
    value: Option<String>,
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
            value: None,
            role: watch::Sender::new(Role::Follower),
        }
    }

    /// A value to publish each time this candidate is elected — its address, say — for
    /// any process to read ([`Locks::current_leader`], [`Locks::observe`]). Published
    /// right after the grant, before [`campaign`](Election::campaign) returns the term;
    /// change it during a term with [`Term::publish`]. At most 8 KiB of text, without
    /// NUL (checked when campaigning).
    pub fn value(mut self, value: impl Into<String>) -> Self {
        self.value = Some(value.into());
        self
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

    /// Stands for election and waits until this process leads; returns the term. With a
    /// [`value`](Election::value), publishes it for the term before returning.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::Unsupported`] for a value too long
    /// or holding NUL (before standing); connection and server errors, and the
    /// publishing's (then this process resigns: it does not lead without its value).
    ///
    /// # Cancel safety
    ///
    /// Cancelling it withdraws the candidacy; it never leaves this process leading.
    pub async fn campaign(&self) -> Result<Term, Error> {
        if let Some(v) = &self.value {
            check_leader_value(v)?;
        }
        let mut req = self.locks.request(&self.name).fenced();
        if self.locks.inner.backend.has_leases() {
            req = req.lease(self.lease);
        }
        #[cfg(feature = "metrics")]
        crate::observe::meter::leading(&self.name, false);
        let guard = req.lock().await?;
        let token = guard.fencing_token().unwrap_or(0);
        // Dropped (the term ended) if publishing fails or is cancelled.
        let term = Term {
            locks: self.locks.clone(),
            guard,
            _ended: None,
        };
        if let Some(v) = &self.value {
            term.publish(v).await?;
        }
        tracing::info!(target: "dblock::leader", name = %self.name, token, "elected leader");
        self.role.send_replace(Role::Leader { token });
        #[cfg(feature = "metrics")]
        crate::observe::meter::leading(&self.name, true);
        // The role (and the gauge) go back to Follower when the term is lost or given up.
        let role = self.role.clone();
        let lost = term.guard.lost();
        let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<()>();
        #[cfg(feature = "metrics")]
        let name = self.name.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = lost => {}
                _ = ended_rx => {}
            }
            role.send_if_modified(|r| {
                if *r == (Role::Leader { token }) {
                    *r = Role::Follower;
                    #[cfg(feature = "metrics")]
                    crate::observe::meter::leading(&name, false);
                    true
                } else {
                    false
                }
            });
        });
        Ok(Term {
            _ended: Some(ended_tx),
            ..term
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
    locks: Locks,
    guard: LockGuard,
    _ended: Option<tokio::sync::oneshot::Sender<()>>,
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

    /// Publishes `value` for this term — its address, say — replacing what it published
    /// before, for any process to read ([`Locks::current_leader`], [`Locks::observe`]).
    /// Fenced by the term's token: once another term has begun it is refused, and it
    /// never overwrites a newer term's value. The first publish on a database creates the
    /// table `dblock_leaders` (see `dblock setup` for roles that may not).
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] when a newer term has begun (this process no longer leads);
    /// [`Error::Unsupported`] for a value longer than 8 KiB or holding NUL;
    /// [`Error::PermissionDenied`] when the role may not write the table; connection and
    /// server errors.
    ///
    /// # Cancel safety
    ///
    /// One statement: cancelled, the value is published or not, and publishing it again
    /// settles which.
    pub async fn publish(&self, value: &str) -> Result<(), Error> {
        let Some(fence) = self.guard.fence() else {
            return Err(Error::unexpected("the term has no fencing token"));
        };
        self.locks.inner.backend.publish(fence, value).await
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

impl Locks {
    /// Who leads the election `name` now — the holder of its lock, with its term's token,
    /// since when, and the value it published — or `None` when nobody does. Reads; never
    /// stands for election.
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
    /// if let Some(l) = locks.current_leader("scheduler").await? {
    ///     println!("{} leads since {:?}, at {:?}", l.holder, l.since, l.value);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn current_leader(&self, name: &str) -> Result<Option<Leader>, Error> {
        let key = self.key(name)?;
        let backend = &self.inner.backend;
        let asked = [(self.namespace(), name, key)];
        let rows = backend.status(&asked).await?;
        let Some(holder) = rows
            .into_iter()
            .find(|r| r.key == key)
            .and_then(|r| r.holders.into_iter().next())
        else {
            return Ok(None);
        };
        let term = backend
            .terms(&[key], &[])
            .await?
            .into_iter()
            .find(|t| t.key == key);
        Ok(Some(Leader::of(&holder, term)))
    }

    /// Follows who leads the election `name`, without standing: see [`LeaderWatch`].
    /// Creating it reads nothing.
    pub fn observe(&self, name: &str) -> LeaderWatch {
        LeaderWatch {
            locks: self.clone(),
            name: name.to_string(),
            every: LeaderWatch::DEFAULT_INTERVAL,
            last: None,
            next_at: None,
        }
    }
}

/// Who leads an election, as it changes: made by [`Locks::observe`].
///
/// [`changed`](LeaderWatch::changed) answers at once the first time, then when the leader,
/// its term or its value differs from what it last answered;
/// [`into_stream`](LeaderWatch::into_stream) gives the same answers as a `Stream`.
///
/// It polls: every [`every`](LeaderWatch::every) (1 s unless set) it reads who holds the
/// name's lock and the record of its latest term — two small reads on a connection of the
/// handle's pool (PostgreSQL: `pg_locks` for one key and one row of the fencing table;
/// MySQL: `IS_USED_LOCK` and one row; the embedded backend: `/proc` and one row of the
/// database file). A change is seen within one interval. Polling works the same through
/// every pooler, which PostgreSQL's `LISTEN` does not.
#[derive(Debug)]
pub struct LeaderWatch {
    locks: Locks,
    name: String,
    every: Duration,
    /// What was last answered (`None`: nothing yet).
    last: Option<Option<Leader>>,
    /// When the next read may be made.
    next_at: Option<Instant>,
}

impl LeaderWatch {
    /// How often the database is read unless [`every`](LeaderWatch::every) says otherwise.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

    /// Reads the database every `interval` (at least 10 ms) instead of every second.
    pub fn every(mut self, interval: Duration) -> Self {
        self.every = interval.max(Duration::from_millis(10));
        self
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Who leads now the first time it is called; after that, waits until the leader, its
    /// term or its value differ from the last answer, and returns the new state (`None`:
    /// nobody leads).
    ///
    /// # Errors
    ///
    /// A read that failed (connection or server errors; [`Error::InvalidName`] for a bad
    /// name). The watch stays usable: the next call reads again one interval later.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a change is never lost. Cancelled, it has answered nothing, and the
    /// next call compares with the last answer it did give.
    pub async fn changed(&mut self) -> Result<Option<Leader>, Error> {
        loop {
            if let Some(at) = self.next_at {
                tokio::time::sleep_until(at).await;
            }
            self.next_at = Some(Instant::now() + self.every);
            let now = self.locks.current_leader(&self.name).await?;
            if self.last.as_ref() != Some(&now) {
                self.last = Some(now.clone());
                return Ok(now);
            }
        }
    }

    /// The answers of [`changed`](LeaderWatch::changed) as a stream: the current leader
    /// first, then each change; a failed read is an `Err` item and the stream goes on.
    /// Dropping the stream stops the polling.
    pub fn into_stream(
        self,
    ) -> impl futures_util::Stream<Item = Result<Option<Leader>, Error>> + Send + Unpin + 'static
    {
        Box::pin(futures_util::stream::unfold(self, |mut w| async move {
            let item = w.changed().await;
            Some((item, w))
        }))
    }
}
