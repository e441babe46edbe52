//! What a handle can do for an operator: tell who holds and awaits locks
//! ([`Locks::status`]), break a lock by ending its holder's session
//! ([`Locks::terminate_holders`]), and the one-time setup of dblock's tables for roles
//! that may not create them ([`Locks::setup`]), and the checks `dblock doctor` prints
//! ([`Locks::doctor`]). Written once over the raw interface
//! ([`StatusSource`](crate::raw::StatusSource), [`RawLocks::setup`](crate::raw::RawLocks::setup)).

use crate::doctor::Diagnosis;
use crate::error::Error;
use crate::key::{Key, check_name};
use crate::locks::Locks;
use crate::raw::{Asked, LockStatus, Party};

impl Locks {
    /// Checks the database this handle talks to, as `dblock doctor` prints it: the
    /// server, engine and version, TLS, the pooler, whether advisory locks exclude,
    /// dblock's tables and this role's rights on them, the server's lock table against
    /// what the handle may hold, the settings that would end holders or waits,
    /// `client_connection_check_interval`, and whether fencing tokens carry the WAL
    /// timeline (see [`doctor`](crate::doctor) for each check). What does not apply to a
    /// backend is not checked.
    ///
    /// ```no_run
    /// # async fn demo(locks: dblock::Locks) -> Result<(), dblock::Error> {
    /// let report = locks.doctor().await?;
    /// for c in &report.checks {
    ///     println!("{:<5} {}: {}", c.verdict.as_str(), c.name, c.detail);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The backend's errors when the database cannot be asked at all (a check that
    /// cannot be made is a line of the report, not an error).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: what it takes to test that locks exclude is released when the
    /// future is dropped (its connections are closed), and nothing else is written.
    pub async fn doctor(&self) -> Result<Diagnosis, Error> {
        let checks = self.inner.backend.diagnose().await?;
        Ok(Diagnosis::new(self.inner.backend.name(), checks))
    }

    /// Who holds and who awaits locks in the database: the locks named in `names`
    /// (keyed in the handle's namespace) — a name's own lock and, if it is a
    /// [semaphore](Locks::semaphore), its slots (rows with [`LockStatus::slot`] set,
    /// under the semaphore's name) — or with `names` empty every lock the backend can
    /// list. Each row has the lock's key and, when known, its name; its holders and
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
    /// [`Error::InvalidName`] for a bad name; the backend's errors when the database
    /// cannot be read.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads, and takes nothing that outlives it.
    pub async fn status(&self, names: &[&str]) -> Result<Vec<LockStatus>, Error> {
        let ns = self.namespace();
        // Each name's key, then the keys of every slot a semaphore of that name may
        // have (the limit is the holders' to choose, so all of them are asked for).
        let slots = crate::MAX_SEMAPHORE_LIMIT as usize;
        let mut asked: Vec<Asked<'_>> = Vec::with_capacity(names.len() * (1 + slots));
        let mut slot_of = std::collections::HashMap::new();
        for n in names {
            check_name(n)?;
            asked.push((ns, n, Key::derive(ns, n)));
        }
        for n in names {
            for i in 0..crate::MAX_SEMAPHORE_LIMIT {
                let key = Key::derive_slot(ns, n, i);
                slot_of.insert(key, i);
                asked.push((ns, n, key));
            }
        }
        let mut rows = self.inner.backend.status(&asked).await?;
        // A name asked for is known even where the server could not show it.
        for r in &mut rows {
            if let Some((ns, name, key)) = asked.iter().find(|a| a.2 == r.key) {
                r.namespace = Some(ns.to_string());
                r.name = Some(name.to_string());
                r.slot = slot_of.get(key).copied();
            }
        }
        Ok(rows)
    }

    /// Breaks lock `name` — and, if `name` is a [semaphore](Locks::semaphore), each of
    /// its held slots — by ending the sessions that hold it (PostgreSQL
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
        let source = &self.inner.backend;
        // The slots of a semaphore of this name that someone holds now.
        let held_slots: Vec<Key> = self
            .status(&[name])
            .await?
            .into_iter()
            .filter(|r| r.slot.is_some() && !r.holders.is_empty())
            .map(|r| r.key)
            .collect();
        let mut ended = source.terminate((ns, name, Key::derive(ns, name))).await?;
        for key in held_slots {
            ended.extend(source.terminate((ns, name, key)).await?);
        }
        Ok(ended)
    }

    /// The one-time setup for roles that may not create dblock's tables: creates the
    /// fencing table, the leaders' table and the record of runs (claims of scheduled
    /// slots, see [`jobs`](crate::jobs)) and grants the roles in `grant_to` what fenced
    /// locks, leader election (with published values) and claims need on them; returns
    /// the tables, as SQL names them, separated by `, `. Idempotent. Run it as a role that
    /// may create the tables and grant on them. `dblock setup --db URL --grant ROLE` runs
    /// it.
    ///
    /// On PostgreSQL the tables are `public.dblock_fencing` and `public.dblock_runs` (one
    /// each per database; on PostgreSQL 15 and later only a schema's owner may create in
    /// it, `public` included), and the grants are `USAGE` on the schema, `SELECT`,
    /// `INSERT`, `UPDATE` on the fencing table, and those and `DELETE` (the record is
    /// pruned) on the record of runs; `PUBLIC` is a valid grantee. The equivalent SQL,
    /// run by the owner:
    ///
    /// ```sql
    /// CREATE TABLE IF NOT EXISTS public.dblock_fencing (
    ///     key bigint PRIMARY KEY, namespace text NOT NULL, name text NOT NULL,
    ///     token bigint NOT NULL, holder text NOT NULL, granted_at timestamptz NOT NULL);
    /// CREATE TABLE IF NOT EXISTS public.dblock_leaders (
    ///     key bigint PRIMARY KEY, namespace text NOT NULL, name text NOT NULL,
    ///     token bigint NOT NULL, holder text NOT NULL, value text,
    ///     published_at timestamptz NOT NULL);
    /// CREATE TABLE IF NOT EXISTS public.dblock_runs (
    ///     key bigint NOT NULL, slot text NOT NULL, namespace text NOT NULL,
    ///     name text NOT NULL, attempt integer NOT NULL, host text NOT NULL,
    ///     pid bigint NOT NULL, program text NOT NULL, started_at timestamptz NOT NULL,
    ///     finished_at timestamptz, exit_code integer, PRIMARY KEY (key, slot));
    /// CREATE INDEX IF NOT EXISTS dblock_runs_started ON public.dblock_runs (key, started_at);
    /// GRANT USAGE ON SCHEMA public TO app_user;
    /// GRANT SELECT, INSERT, UPDATE ON public.dblock_fencing, public.dblock_leaders TO app_user;
    /// GRANT SELECT, INSERT, UPDATE, DELETE ON public.dblock_runs TO app_user;
    /// ```
    ///
    /// (`dblock_leaders` keeps the values election leaders publish,
    /// [`Term::publish`](crate::leader::Term::publish).) On MySQL/MariaDB the tables are
    /// `dblock_fencing`, `dblock_leaders` and `dblock_runs` in the URL's database, with the
    /// same grants (see [`mysql`](crate::mysql)'s setup).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), dblock::Error> {
    /// let owner = dblock::Locks::connect("postgres://owner@db/app").await?;
    /// let table = owner.setup(&["app_user"]).await?;
    /// println!("{table} ready");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::PermissionDenied`] when this role may not create the tables or grant on
    /// them (checked: PostgreSQL only warns when a grant gives nothing);
    /// [`Error::Unsupported`] on a backend with nothing to set up (the embedded backend
    /// creates its tables on first use); connection and server errors.
    ///
    /// # Cancel safety
    ///
    /// The tables are created in a transaction of their own (PostgreSQL; on MySQL a
    /// statement each), and each grant is a statement of its own: cancelled, the setup is
    /// partly done, and running it again completes it.
    pub async fn setup(&self, grant_to: &[&str]) -> Result<String, Error> {
        self.inner.backend.setup(grant_to).await
    }
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Locks {
    /// The PostgreSQL-protocol engine this handle talks to (PostgreSQL, CockroachDB,
    /// YugabyteDB, or another), as named when it opened — from the server's start-up
    /// parameters on dblock's own connections, from `version()` on an sqlx pool; `None`
    /// on the MySQL and embedded backends. See
    /// [`postgres::engine`](crate::postgres::engine).
    pub fn engine(&self) -> Option<crate::postgres::engine::Engine> {
        self.inner.backend.engine()
    }

    /// Checks now, whatever the engine, that an advisory lock taken on one connection
    /// stops a try on another: a transaction-scoped one, and a session-scoped one unless
    /// the handle is behind a transaction pooler ([`Verdict::Untested`] then). Uses two
    /// connections at once (on dblock's own connections the second is opened outside
    /// the pool's count; an sqlx pool must have two to give). Both hold nothing
    /// afterwards. Handles on engines other than PostgreSQL run this check on their own
    /// once, before their first grant (and PostgreSQL's too with `self_test=always`);
    /// this runs it again, for a report (`dblock doctor`).
    ///
    /// [`Verdict::Untested`]: crate::postgres::engine::Verdict::Untested
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] ([`Capability::ExclusionCheck`](crate::Capability::ExclusionCheck))
    /// on the MySQL and embedded backends; connection errors. A server that refuses the
    /// lock functions is a [`Verdict::Unavailable`](crate::postgres::engine::Verdict::Unavailable),
    /// not an error.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a connection whose check is cut off is closed, which ends whatever
    /// its session held.
    pub async fn check_exclusion(&self) -> Result<crate::postgres::engine::Exclusion, Error> {
        self.inner.backend.check_exclusion().await
    }
}
