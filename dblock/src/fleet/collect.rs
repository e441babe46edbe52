//! One scrape: the server read once within a deadline, then each [`Collector`] turning
//! what was read (and what it reads itself) into metric families, and the exporter's own
//! families saying whether and how fast that went.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::OnceCell;

use super::names::{Labels, NamePattern};
use super::text::{Family, render};
use crate::error::{Error, WaitingFor};
use crate::key::Key;
use crate::leader::Leader;
use crate::locks::{Builder, Locks};
use crate::raw::{Asked, LockStatus, Party};
use crate::status::age;

/// Locks held now, per `name` label (a semaphore's slots count one each).
pub const LOCKS_HELD: &str = "dblock_server_locks_held";
/// Requests waiting now, per `name` label.
pub const LOCK_WAITERS: &str = "dblock_server_lock_waiters";
/// How long the longest current hold has lasted, per `name` label.
pub const LONGEST_HOLD: &str = "dblock_server_lock_longest_hold_seconds";
/// How long the oldest current wait has lasted, per `name` label.
pub const OLDEST_WAIT: &str = "dblock_server_lock_oldest_wait_seconds";
/// 1 while someone leads the election `election`, else 0.
pub const LEADER_PRESENT: &str = "dblock_server_election_leader_present";
/// When the current leader's term began (Unix time), per `election`; only while one leads.
pub const LEADER_SINCE: &str = "dblock_server_election_leader_since_timestamp_seconds";
/// When each job run once per slot last succeeded (Unix time), per `name`, as the record
/// of runs has it ([`RunsCollector`]); 0 when the record holds no success of the name
/// (it never succeeded, or its successes were pruned). The alert rules' "last night's job
/// did not run" reads it. (The label is `name`, not `job`: Prometheus gives every scraped
/// series a `job` label of its own.)
pub const JOB_LAST_SUCCESS: &str = "dblock_server_job_last_success_timestamp_seconds";
/// 1 if the last scrape read the server within its deadline and every collector
/// succeeded, else 0.
pub const SCRAPE_SUCCESS: &str = "dblock_exporter_scrape_success";
/// How long the scrape took.
pub const SCRAPE_DURATION: &str = "dblock_exporter_scrape_duration_seconds";
/// Scrapes that failed since the exporter started.
pub const SCRAPE_FAILURES: &str = "dblock_exporter_scrape_failures_total";
/// 1 if the collector `collector` succeeded in the last scrape, else 0.
pub const COLLECTOR_SUCCESS: &str = "dblock_exporter_collector_success";

/// What [`Collector::collect`] returns.
pub type CollectFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<Family>, Error>> + Send + 'a>>;

/// Turns one scrape's view of the server into metric families: the built-in ones report
/// locks and elections; add your own with [`Exporter::collector`].
///
/// ```no_run
/// use dblock::fleet::{CollectFuture, Collector, Family, Scrape};
///
/// /// How many locks the server shows, whatever their names.
/// struct AllLocks;
///
/// impl Collector for AllLocks {
///     fn name(&self) -> &str {
///         "all_locks"
///     }
///
///     fn collect<'a>(&'a self, scrape: &'a Scrape) -> CollectFuture<'a> {
///         Box::pin(async move {
///             let n = scrape.status().len() as f64;
///             Ok(vec![Family::gauge("my_locks_listed", "Locks the server lists").with(&[], n)])
///         })
///     }
/// }
/// ```
pub trait Collector: Send + Sync {
    /// The collector's name: the `collector` label of `dblock_exporter_collector_success`.
    fn name(&self) -> &str;

    /// The families of this scrape. It may read the server itself through
    /// [`Scrape::locks`], within the scrape's deadline. An error fails the scrape
    /// (`dblock_exporter_scrape_success 0`) but not the other collectors.
    fn collect<'a>(&'a self, scrape: &'a Scrape) -> CollectFuture<'a>;
}

/// When a holder took a lock or a waiter began to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Since {
    /// As the server (or the party's own comment) says.
    Known(SystemTime),
    /// Not known to the server (the embedded backend's holders, MySQL's): when the
    /// exporter first saw it — a lower bound on its age.
    FirstSeen(SystemTime),
}

impl Since {
    /// The time.
    pub fn time(self) -> SystemTime {
        match self {
            Since::Known(t) | Since::FirstSeen(t) => t,
        }
    }
}

/// What one scrape read: the handle, when, and every lock the server shows (with the
/// names the labels ask for).
#[derive(Debug)]
pub struct Scrape {
    locks: Locks,
    labels: Labels,
    at: SystemTime,
    status: Vec<LockStatus>,
    first_seen: HashMap<String, SystemTime>,
}

impl Scrape {
    /// The handle the exporter reads with.
    pub fn locks(&self) -> &Locks {
        &self.locks
    }

    /// How lock names become label values.
    pub fn labels(&self) -> &Labels {
        &self.labels
    }

    /// When the server was read.
    pub fn at(&self) -> SystemTime {
        self.at
    }

    /// Every lock the server shows, as [`Locks::status`] with no names (the names the
    /// labels give exactly are named where the backend could not otherwise).
    pub fn status(&self) -> &[LockStatus] {
        &self.status
    }

    /// When `party` of `lock` took it (`holder`) or began to wait.
    pub fn since(&self, lock: &LockStatus, party: &Party, holder: bool) -> Option<Since> {
        match party.since {
            Some(t) => Some(Since::Known(t)),
            None => self
                .first_seen
                .get(&party_id(lock.key, party, holder))
                .map(|t| Since::FirstSeen(*t)),
        }
    }

    /// The lock's name if it is in the handle's namespace (what labels are given for).
    pub fn name_in_namespace<'a>(&self, lock: &'a LockStatus) -> Option<&'a str> {
        match (&lock.namespace, &lock.name) {
            (Some(ns), Some(n)) if ns == self.locks.namespace() => Some(n),
            _ => None,
        }
    }
}

/// A party of a lock, as far as the server identifies it across scrapes.
fn party_id(key: Key, p: &Party, holder: bool) -> String {
    format!(
        "{}/{holder}/{:?}/{:?}/{:?}/{:?}",
        key.as_i64(),
        p.connection,
        p.pid,
        p.host,
        p.mode
    )
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Locks held and awaited, the longest hold and the oldest wait, per `name` label.
#[derive(Debug, Default)]
pub struct LockCollector;

#[derive(Default)]
struct Tally {
    held: u64,
    waiters: u64,
    longest_hold: Duration,
    oldest_wait: Duration,
}

impl Collector for LockCollector {
    fn name(&self) -> &str {
        "locks"
    }

    fn collect<'a>(&'a self, scrape: &'a Scrape) -> CollectFuture<'a> {
        Box::pin(async move { Ok(lock_families(scrape)) })
    }
}

fn lock_families(scrape: &Scrape) -> Vec<Family> {
    let labels = scrape.labels();
    let mut by: BTreeMap<&str, Tally> = BTreeMap::new();
    // Always reported, so that an alert on them has a series to read.
    for v in labels
        .exact_names()
        .chain(labels.group_values())
        .chain([Labels::OTHER])
    {
        by.entry(v).or_default();
    }
    let mut own = HashSet::new();
    for l in scrape.status() {
        let value = labels.value_of(scrape.name_in_namespace(l), &mut own);
        let t = by.entry(value).or_default();
        t.held += u64::from(!l.holders.is_empty());
        t.waiters += l.waiters.len() as u64;
        for h in &l.holders {
            if let Some(s) = scrape.since(l, h, true) {
                t.longest_hold = t.longest_hold.max(age(s.time(), scrape.at()));
            }
        }
        for w in &l.waiters {
            if let Some(s) = scrape.since(l, w, false) {
                t.oldest_wait = t.oldest_wait.max(age(s.time(), scrape.at()));
            }
        }
    }
    let mut held = Family::gauge(
        LOCKS_HELD,
        "Locks held now, as the server shows them (a semaphore's slots one each)",
    );
    let mut waiters = Family::gauge(LOCK_WAITERS, "Requests waiting for a lock now");
    let mut hold = Family::gauge(
        LONGEST_HOLD,
        "How long the longest current hold has lasted (0 when none; where the server does \
         not know, since the exporter first saw it)",
    );
    let mut wait = Family::gauge(
        OLDEST_WAIT,
        "How long the oldest current wait has lasted (0 when none)",
    );
    for (name, t) in &by {
        let l = [("name", *name)];
        held.sample(&l, t.held as f64);
        waiters.sample(&l, t.waiters as f64);
        hold.sample(&l, t.longest_hold.as_secs_f64());
        wait.sample(&l, t.oldest_wait.as_secs_f64());
    }
    vec![held, waiters, hold, wait]
}

/// Per election (the names its patterns give, in the handle's namespace): whether a
/// leader is present and since when.
#[derive(Debug)]
pub struct ElectionCollector {
    elections: Vec<NamePattern>,
    max: usize,
}

impl ElectionCollector {
    /// Reports the elections named by `elections`: each exact name always (present or
    /// not), and each fenced name matching a prefix (at most
    /// [`Labels::DEFAULT_MAX_NAMES`]).
    pub fn new(elections: Vec<NamePattern>) -> ElectionCollector {
        ElectionCollector {
            elections,
            max: Labels::DEFAULT_MAX_NAMES,
        }
    }
}

impl Collector for ElectionCollector {
    fn name(&self) -> &str {
        "elections"
    }

    fn collect<'a>(&'a self, scrape: &'a Scrape) -> CollectFuture<'a> {
        Box::pin(self.families(scrape))
    }
}

impl ElectionCollector {
    async fn families(&self, scrape: &Scrape) -> Result<Vec<Family>, Error> {
        let locks = scrape.locks();
        let ns = locks.namespace();
        let mut names: BTreeMap<String, Key> = BTreeMap::new();
        let mut keys = Vec::new();
        let mut prefixes = Vec::new();
        for p in &self.elections {
            match (p.exact(), p.prefix()) {
                (Some(n), _) => {
                    let k = locks.key(n)?;
                    names.insert(n.to_string(), k);
                    keys.push(k);
                }
                (None, Some(prefix)) => prefixes.push((ns, prefix)),
                (None, None) => {}
            }
        }
        let terms = locks.inner.backend.terms(&keys, &prefixes).await?;
        for t in &terms {
            if t.namespace == ns
                && !names.contains_key(&t.name)
                && names.len() < self.max + keys.len()
            {
                names.insert(t.name.clone(), t.key);
            }
        }
        let mut present = Family::gauge(
            LEADER_PRESENT,
            "1 while someone leads the election (holds its lock), else 0",
        );
        let mut since = Family::gauge(
            LEADER_SINCE,
            "When the current leader's term began, in seconds since the Unix epoch",
        );
        for (name, key) in &names {
            let l = [("election", name.as_str())];
            let held = scrape
                .status()
                .iter()
                .find(|s| s.key == *key)
                .and_then(|s| s.holders.first().map(|h| (s, h)));
            let Some((lock, holder)) = held else {
                present.sample(&l, 0.0);
                continue;
            };
            present.sample(&l, 1.0);
            let term = terms.iter().find(|t| t.key == *key).cloned();
            let leader = Leader::of(holder, term);
            let began = leader
                .since
                .or_else(|| scrape.since(lock, holder, true).map(Since::time));
            if let Some(t) = began {
                since.sample(&l, unix_secs(t));
            }
        }
        Ok(vec![present, since])
    }
}

/// Reports when each named job run once per slot ([`jobs`](crate::jobs)) last succeeded,
/// from the record of runs ([`Locks::runs`]): [`JOB_LAST_SUCCESS`] per `name`. One read
/// of the record per job per scrape (its [`RUNS_KEPT`](crate::jobs::RUNS_KEPT) newest
/// claims); the table is made by `dblock setup`, or by the first claim.
pub struct RunsCollector {
    jobs: Vec<String>,
}

impl RunsCollector {
    /// Reports the jobs named `jobs` (each name as given to `dblock run --once-per`).
    pub fn new(jobs: Vec<String>) -> RunsCollector {
        RunsCollector { jobs }
    }
}

impl Collector for RunsCollector {
    fn name(&self) -> &str {
        "runs"
    }

    fn collect<'a>(&'a self, scrape: &'a Scrape) -> CollectFuture<'a> {
        Box::pin(async move {
            let mut last = Family::gauge(
                JOB_LAST_SUCCESS,
                "When the job's last successful run finished, in seconds since the Unix \
                 epoch (0: the record of runs holds no success)",
            );
            for job in &self.jobs {
                let runs = scrape.locks().runs(job, crate::jobs::RUNS_KEPT).await?;
                let latest = runs
                    .iter()
                    .filter(|r| r.outcome() == crate::jobs::Outcome::Succeeded)
                    .filter_map(|r| r.finished)
                    .max();
                last.sample(&[("name", job.as_str())], latest.map_or(0.0, unix_secs));
            }
            Ok(vec![last])
        })
    }
}

/// Where the exporter's handle comes from.
enum Source {
    Ready(Locks),
    /// Built on the first scrape that can, so that an exporter started while its server
    /// is down reports that instead of failing to start.
    Connecting(Box<Builder>, OnceCell<Locks>),
}

/// The fleet's view as metrics: each [`scrape`](Exporter::scrape) reads the server
/// once, within a [deadline](Exporter::deadline), and reports locks (per the
/// [labels](Exporter::labels)), elections (per the [patterns](Exporter::elections)) and
/// whatever [collectors](Exporter::collector) are added. A slow or failed read is
/// reported (`dblock_exporter_scrape_success 0`), never an error. `dblock exporter`
/// serves it over HTTP.
pub struct Exporter {
    source: Source,
    labels: Labels,
    deadline: Duration,
    collectors: Vec<Box<dyn Collector>>,
    /// The elections named exactly: asked for by name, so that every backend shows their
    /// locks.
    elections: Vec<String>,
    /// When each party was first seen (for backends that do not say), pruned each scrape.
    seen: Mutex<HashMap<String, SystemTime>>,
    failures: AtomicU64,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter")
            .field("labels", &self.labels)
            .field("deadline", &self.deadline)
            .field(
                "collectors",
                &self.collectors.iter().map(|c| c.name()).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Exporter {
    /// The deadline of a scrape unless [`deadline`](Exporter::deadline) says otherwise.
    pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);

    /// An exporter reading with `locks`, reporting locks (no name a label yet).
    pub fn new(locks: &Locks) -> Exporter {
        Exporter::from_source(Source::Ready(locks.clone()))
    }

    /// An exporter whose handle `builder` builds on the first scrape that can: a server
    /// down when the exporter starts is a failed scrape, retried at the next.
    pub fn connecting(builder: Builder) -> Exporter {
        Exporter::from_source(Source::Connecting(Box::new(builder), OnceCell::new()))
    }

    fn from_source(source: Source) -> Exporter {
        Exporter {
            source,
            labels: Labels::new(),
            deadline: Exporter::DEFAULT_DEADLINE,
            collectors: vec![Box::new(LockCollector)],
            elections: Vec::new(),
            seen: Mutex::new(HashMap::new()),
            failures: AtomicU64::new(0),
        }
    }

    /// How lock names become labels.
    pub fn labels(mut self, labels: Labels) -> Self {
        self.labels = labels;
        self
    }

    /// Reports the elections these patterns name ([`ElectionCollector`]).
    pub fn elections(mut self, elections: Vec<NamePattern>) -> Self {
        if elections.is_empty() {
            return self;
        }
        self.elections.extend(
            elections
                .iter()
                .filter_map(|p| p.exact().map(str::to_string)),
        );
        self.collector(ElectionCollector::new(elections))
    }

    /// Reports when the jobs named `jobs` last succeeded ([`RunsCollector`]).
    pub fn jobs(self, jobs: Vec<String>) -> Self {
        if jobs.is_empty() {
            return self;
        }
        self.collector(RunsCollector::new(jobs))
    }

    /// The longest a scrape may take, reading included (5 s unless set).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Adds a collector; each scrape runs them in the order added.
    pub fn collector(mut self, collector: impl Collector + 'static) -> Self {
        self.collectors.push(Box::new(collector));
        self
    }

    /// The handle, built now if it must be.
    async fn handle(&self) -> Result<&Locks, Error> {
        match &self.source {
            Source::Ready(l) => Ok(l),
            Source::Connecting(b, cell) => cell.get_or_try_init(|| (**b).clone().build()).await,
        }
    }

    /// Reads the server once (within the deadline) and collects; never fails: what went
    /// wrong is in the result, and in its metrics.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn scrape(&self) -> Scraped {
        let started = tokio::time::Instant::now();
        let work = self.read_and_collect();
        let (scrape, families, ran, error) = match tokio::time::timeout(self.deadline, work).await {
            Ok(Ok((scrape, families, ran, error))) => (Some(scrape), families, ran, error),
            Ok(Err(e)) => (None, Vec::new(), Vec::new(), Some(e.to_string())),
            Err(_) => {
                let e = Error::Timeout {
                    waiting_for: WaitingFor::ServerReply,
                    after: Some(self.deadline),
                };
                (None, Vec::new(), Vec::new(), Some(e.to_string()))
            }
        };
        let took = started.elapsed();
        let ok = error.is_none();
        if !ok {
            self.failures.fetch_add(1, Ordering::Relaxed);
        }
        let mut own = vec![
            Family::gauge(
                SCRAPE_SUCCESS,
                "1 if the last scrape read the server within its deadline and every collector \
                 succeeded",
            )
            .with(&[], f64::from(u8::from(ok))),
            Family::gauge(SCRAPE_DURATION, "How long the last scrape took")
                .with(&[], took.as_secs_f64()),
            Family::counter(
                SCRAPE_FAILURES,
                "Scrapes that failed (server unreachable, too slow, a collector's error) since \
                 the exporter started",
            )
            .with(&[], self.failures.load(Ordering::Relaxed) as f64),
        ];
        let mut per = Family::gauge(
            COLLECTOR_SUCCESS,
            "1 if the collector succeeded in the last scrape",
        );
        for c in &self.collectors {
            let did = ran.iter().any(|(n, ok)| n == c.name() && *ok);
            per.sample(&[("collector", c.name())], f64::from(u8::from(did)));
        }
        own.push(per);
        let mut all = families;
        all.extend(own);
        Scraped {
            families: all,
            scrape,
            error,
            took,
        }
    }

    /// The read, then every collector: (what was read, families, which collectors
    /// succeeded, the first collector's error).
    async fn read_and_collect(
        &self,
    ) -> Result<(Scrape, Vec<Family>, Vec<(String, bool)>, Option<String>), Error> {
        let locks = self.handle().await?;
        let ns = locks.namespace();
        let mut exact: Vec<&str> = self.labels.exact_names().collect();
        exact.extend(self.elections.iter().map(String::as_str));
        let mut asked: Vec<Asked<'_>> = Vec::with_capacity(exact.len());
        for n in exact {
            asked.push((ns, n, locks.key(n)?));
        }
        let mut status = locks.inner.backend.status_all(&asked).await?;
        // A name asked for is known even where the server could not show it.
        for r in &mut status {
            if let Some((ns, name, _)) = asked.iter().find(|a| a.2 == r.key) {
                r.namespace.get_or_insert_with(|| ns.to_string());
                r.name.get_or_insert_with(|| name.to_string());
            }
        }
        let at = SystemTime::now();
        let first_seen = self.remember(&status, at);
        let scrape = Scrape {
            locks: locks.clone(),
            labels: self.labels.clone(),
            at,
            status,
            first_seen,
        };
        let mut families = Vec::new();
        let mut ran = Vec::new();
        let mut error = None;
        for c in &self.collectors {
            match c.collect(&scrape).await {
                Ok(f) => {
                    families.extend(f);
                    ran.push((c.name().to_string(), true));
                }
                Err(e) => {
                    ran.push((c.name().to_string(), false));
                    error.get_or_insert_with(|| format!("collector {}: {e}", c.name()));
                }
            }
        }
        Ok((scrape, families, ran, error))
    }

    /// When each party in `status` was first seen, as of `at`: kept for those seen
    /// again, forgotten for those gone.
    fn remember(&self, status: &[LockStatus], at: SystemTime) -> HashMap<String, SystemTime> {
        let mut seen = match self.seen.lock() {
            Ok(s) => s,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut now = HashMap::new();
        for l in status {
            let parties = l
                .holders
                .iter()
                .map(|p| (p, true))
                .chain(l.waiters.iter().map(|p| (p, false)));
            for (p, holder) in parties {
                let id = party_id(l.key, p, holder);
                let first = seen.get(&id).copied().unwrap_or(at);
                now.insert(id, first);
            }
        }
        *seen = now.clone();
        now
    }
}

/// A scrape's outcome: the families (the exporter's own included), what was read (for
/// the page), and what went wrong.
#[derive(Debug)]
pub struct Scraped {
    families: Vec<Family>,
    scrape: Option<Scrape>,
    error: Option<String>,
    took: Duration,
}

impl Scraped {
    /// Every family, in the text format.
    pub fn text(&self) -> String {
        render(&self.families)
    }

    /// Every family.
    pub fn families(&self) -> &[Family] {
        &self.families
    }

    /// The family named `name`, if reported.
    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.iter().find(|f| f.name() == name)
    }

    /// What was read, when the server was read.
    pub fn scrape(&self) -> Option<&Scrape> {
        self.scrape.as_ref()
    }

    /// Whether everything was read and collected.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// What went wrong, as one line.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// How long the scrape took.
    pub fn took(&self) -> Duration {
        self.took
    }
}
