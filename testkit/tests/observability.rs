//! What dblock tells tracing subscribers and metrics recorders, on real locks: a grant,
//! "held elsewhere", a timeout, a release and a loss, each with its fields and counts.
//!
//! The subscriber and the recorder are installed for the test's own thread only
//! (`tracing::subscriber::set_default`, `metrics::set_default_local_recorder`), and each
//! test runs on a current-thread runtime, so every event dblock emits from the caller's
//! futures lands here and no other test's does.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dblock::leader::Role;
use dblock::{Error, Locks};
use dblock_testkit::{PgSchema, SqliteDb, TestDb};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

// ---------------------------------------------------------------------------------
// A subscriber that keeps dblock's events, each with the fields of its enclosing spans.

#[derive(Debug, Clone)]
struct Ev {
    level: Level,
    target: String,
    message: String,
    fields: BTreeMap<String, String>,
}

impl Ev {
    fn get(&self, field: &str) -> &str {
        self.fields
            .get(field)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("no field {field} in {self:?}"))
    }

    fn micros(&self, field: &str) -> u64 {
        self.get(field).parse().unwrap()
    }
}

#[derive(Default)]
struct State {
    next: u64,
    spans: HashMap<u64, BTreeMap<String, String>>,
    stack: Vec<u64>,
    events: Vec<Ev>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<State>>);

impl Capture {
    fn events(&self) -> Vec<Ev> {
        self.0.lock().unwrap().events.clone()
    }

    fn with_message(&self, message: &str) -> Vec<Ev> {
        self.events()
            .into_iter()
            .filter(|e| e.message == message)
            .collect()
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}"));
    }
}

impl Subscriber for Capture {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("dblock")
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut st = self.0.lock().unwrap();
        st.next += 1;
        let id = st.next;
        let mut fields = BTreeMap::new();
        span.record(&mut Fields(&mut fields));
        st.spans.insert(id, fields);
        Id::from_u64(id)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut st = self.0.lock().unwrap();
        if let Some(f) = st.spans.get_mut(&span.into_u64()) {
            values.record(&mut Fields(f));
        }
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut st = self.0.lock().unwrap();
        let mut fields = BTreeMap::new();
        for id in &st.stack {
            if let Some(f) = st.spans.get(id) {
                fields.extend(f.clone());
            }
        }
        event.record(&mut Fields(&mut fields));
        let message = fields.remove("message").unwrap_or_default();
        st.events.push(Ev {
            level: *event.metadata().level(),
            target: event.metadata().target().into(),
            message,
            fields,
        });
    }

    fn enter(&self, span: &Id) {
        self.0.lock().unwrap().stack.push(span.into_u64());
    }

    fn exit(&self, span: &Id) {
        let mut st = self.0.lock().unwrap();
        if let Some(i) = st.stack.iter().rposition(|s| *s == span.into_u64()) {
            st.stack.remove(i);
        }
    }
}

// ---------------------------------------------------------------------------------
// Metrics, as the recorder holds them.

/// A metric: its name, its labels (sorted) and its value.
type Metric = (String, Vec<(String, String)>, DebugValue);

struct Metrics(Vec<Metric>);

impl Metrics {
    fn take(snap: &Snapshotter) -> Metrics {
        Metrics(
            snap.snapshot()
                .into_vec()
                .into_iter()
                .map(|(ck, _, _, v)| {
                    let key = ck.key();
                    let mut labels: Vec<(String, String)> = key
                        .labels()
                        .map(|l| (l.key().to_string(), l.value().to_string()))
                        .collect();
                    labels.sort();
                    (key.name().to_string(), labels, v)
                })
                .collect(),
        )
    }

    fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        let mut want: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        want.sort();
        self.0
            .iter()
            .find(|(n, l, _)| n == name && *l == want)
            .map(|(_, _, v)| v)
    }

    /// A counter's value; 0 when it was never incremented.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.find(name, labels) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(v) => panic!("{name} is not a counter: {v:?}"),
        }
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self.find(name, labels) {
            Some(DebugValue::Gauge(g)) => g.into_inner(),
            v => panic!("{name} {labels:?} is not a gauge: {v:?}"),
        }
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match self.find(name, labels) {
            Some(DebugValue::Histogram(h)) => h.iter().map(|v| v.into_inner()).collect(),
            None => Vec::new(),
            Some(v) => panic!("{name} is not a histogram: {v:?}"),
        }
    }

    /// Every counter named `name`, whatever its labels, added up.
    fn total(&self, name: &str) -> u64 {
        self.0
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, _, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    }
}

const BOUND: Duration = Duration::from_secs(20);

async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {BOUND:?}"))
}

// ---------------------------------------------------------------------------------

/// One lock's life on `url`: granted, "held elsewhere", timed out, released; then a
/// shared grant dropped (where there is a shared mode). Every step is an event with the lock's name, key and mode,
/// and a count under its `backend` and `mode` labels.
async fn a_locks_life_is_traced_and_counted(url: &str, backend: &str, shared: bool) {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let cap = Capture::default();
    let _tracing = tracing::subscriber::set_default(cap.clone());

    let locks = bounded("connect", Locks::connect(url)).await.unwrap();
    let key = locks.key("job:1").unwrap().as_i64().to_string();
    let ex = [("backend", backend), ("mode", "exclusive")];
    let sh = [("backend", backend), ("mode", "shared")];

    // (One snapshot, at the end: taking one resets the recorder's values.)
    let guard = bounded("lock", locks.lock("job:1")).await.unwrap();

    let busy = bounded("try_lock", locks.try_lock("job:1")).await.unwrap();
    assert!(busy.is_none(), "held by the guard");
    let late = bounded(
        "try_lock_for",
        locks.try_lock_for("job:1", Duration::from_millis(50)),
    )
    .await
    .unwrap();
    assert!(late.is_none(), "held by the guard");
    bounded("release", guard.release()).await.unwrap();
    if shared {
        let reader = bounded("shared lock", locks.request("job:1").shared().lock())
            .await
            .unwrap();
        drop(reader);
    }

    let m = Metrics::take(&snap);
    assert_eq!(m.counter("dblock_locks_acquired_total", &ex), 1);
    assert_eq!(
        m.counter("dblock_locks_acquired_total", &sh),
        u64::from(shared)
    );
    assert_eq!(m.counter("dblock_locks_not_obtained_total", &ex), 1);
    assert_eq!(m.counter("dblock_locks_timed_out_total", &ex), 1);
    assert_eq!(m.counter("dblock_locks_released_total", &ex), 1);
    assert_eq!(
        m.counter("dblock_locks_released_total", &sh),
        u64::from(shared)
    );
    assert_eq!(m.total("dblock_locks_lost_total"), 0);
    assert_eq!(m.total("dblock_lock_errors_total"), 0);
    assert_eq!(m.gauge("dblock_locks_held", &ex), 0.0);
    assert_eq!(m.samples("dblock_lock_wait_seconds", &ex).len(), 1);
    if shared {
        assert_eq!(m.gauge("dblock_locks_held", &sh), 0.0);
        assert_eq!(m.samples("dblock_lock_wait_seconds", &sh).len(), 1);
    }
    let held = m.samples("dblock_lock_held_seconds", &ex);
    assert_eq!(held.len(), 1, "{held:?}");

    let requested = cap.with_message("lock requested");
    assert_eq!(requested.len(), 3 + usize::from(shared), "{requested:#?}");
    for e in &requested {
        assert_eq!(e.target, "dblock::lock");
        assert_eq!(e.level, Level::DEBUG);
        assert_eq!(e.get("name"), "job:1");
        assert_eq!(e.get("key"), key);
        assert_eq!(e.get("backend"), backend);
        assert_eq!(e.get("namespace"), locks.namespace());
    }
    let waits: Vec<&str> = requested.iter().map(|e| e.get("wait")).collect();
    assert_eq!(waits[..3], ["forever", "try", "until"]);
    let granted = cap.with_message("lock granted");
    let modes: Vec<&str> = granted.iter().map(|e| e.get("mode")).collect();
    assert_eq!(
        modes,
        ["exclusive", "shared"][..1 + usize::from(shared)],
        "{granted:#?}"
    );
    granted.iter().for_each(|e| {
        e.micros("wait_us");
    });
    let busy = cap.with_message("lock not obtained: held elsewhere");
    assert_eq!(busy.len(), 1);
    assert_eq!(busy[0].get("name"), "job:1");
    let late = cap.with_message("lock not obtained: timed out");
    assert_eq!(late.len(), 1);
    assert!(
        late[0].micros("wait_us") >= 50_000,
        "waited its deadline: {:?}",
        late[0]
    );
    let released = cap.with_message("lock released");
    assert_eq!(released.len(), 1 + usize::from(shared), "{released:#?}");
    assert_eq!(released[0].get("name"), "job:1");
    assert_eq!(released[0].get("key"), key);
    assert_eq!(released[0].get("mode"), "exclusive");
    if shared {
        assert_eq!(released[1].get("mode"), "shared");
    }
    assert!(released[0].micros("held_us") >= (held[0] * 1e6) as u64 / 2);
    assert!(cap.with_message("lock lost").is_empty());
}

#[tokio::test]
async fn postgres_a_locks_life_is_traced_and_counted() {
    let db = TestDb::postgres("obs_life").await;
    a_locks_life_is_traced_and_counted(db.url(), "postgres", true).await;
}

#[tokio::test]
async fn sqlite_a_locks_life_is_traced_and_counted() {
    let db = TestDb::sqlite("obs_life").await;
    a_locks_life_is_traced_and_counted(db.url(), "sqlite", true).await;
}

#[tokio::test]
async fn mysql_a_locks_life_is_traced_and_counted() {
    let db = TestDb::mysql("obs_life").await;
    a_locks_life_is_traced_and_counted(db.url(), "mysql", false).await;
}

/// A released guard whose `lost()` future is still awaited is not reported lost, even
/// where the backend's loss future resolves because the lock was released.
async fn a_release_is_not_reported_as_a_loss(url: &str) -> bool {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let cap = Capture::default();
    let _tracing = tracing::subscriber::set_default(cap.clone());

    let locks = bounded("connect", Locks::connect(url)).await.unwrap();
    let guard = bounded("lock", locks.lock("term")).await.unwrap();
    // As an election's watcher does: the loss future runs in a task of its own.
    let watcher = tokio::spawn(guard.lost());
    tokio::task::yield_now().await;
    bounded("release", guard.release()).await.unwrap();
    // Whether the backend's loss future resolves on release differs by backend; when
    // it does, it does at once.
    let resolved = tokio::time::timeout(Duration::from_millis(500), watcher)
        .await
        .is_ok();

    let m = Metrics::take(&snap);
    assert_eq!(
        m.total("dblock_locks_lost_total"),
        0,
        "resolved: {resolved}"
    );
    assert_eq!(m.total("dblock_locks_released_total"), 1);
    assert!(
        cap.with_message("lock lost").is_empty(),
        "{:#?}",
        cap.events()
    );
    resolved
}

#[tokio::test]
async fn postgres_a_release_is_not_reported_as_a_loss() {
    let db = TestDb::postgres("obs_release").await;
    a_release_is_not_reported_as_a_loss(db.url()).await;
}

#[tokio::test]
async fn mysql_a_release_is_not_reported_as_a_loss() {
    let db = TestDb::mysql("obs_release").await;
    // MySQL's loss future resolves when its lock task ends, on release: the case the
    // guard's "closing" state is for.
    assert!(a_release_is_not_reported_as_a_loss(db.url()).await);
}

/// A lock lost on the server (its backend terminated) is reported once — a warning
/// with the name and the reason, one count — however many ways the holder sees it.
#[tokio::test]
async fn postgres_a_lost_lock_is_reported_once_wherever_it_is_seen() {
    let s = PgSchema::new("obs_lost").await;
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let cap = Capture::default();
    let _tracing = tracing::subscriber::set_default(cap.clone());

    let locks = s.locks().await;
    let mut guard = bounded("lock", locks.lock("job:9")).await.unwrap();
    let lost = guard.lost();
    assert_eq!(s.terminate_holders(guard.key()).await, 1);
    let reason = bounded("lost()", lost).await;
    assert!(!guard.is_held());
    assert!(matches!(
        bounded("check", guard.check()).await,
        Err(Error::LockLost { .. })
    ));
    assert!(matches!(
        bounded("release", guard.release()).await,
        Err(Error::LockLost { .. })
    ));

    let lost = cap.with_message("lock lost");
    assert_eq!(lost.len(), 1, "{lost:#?}");
    assert_eq!(lost[0].level, Level::WARN);
    assert_eq!(lost[0].get("name"), "job:9");
    assert_eq!(lost[0].get("mode"), "exclusive");
    assert_eq!(lost[0].get("reason"), reason.to_string());
    assert!(cap.with_message("lock released").is_empty());
    let m = Metrics::take(&snap);
    let ex = [("backend", "postgres"), ("mode", "exclusive")];
    assert_eq!(m.counter("dblock_locks_lost_total", &ex), 1);
    assert_eq!(m.counter("dblock_locks_released_total", &ex), 0);
    assert_eq!(m.gauge("dblock_locks_held", &ex), 0.0);
    assert_eq!(m.samples("dblock_lock_held_seconds", &ex).len(), 1);
}

/// On the embedded backend a lock is lost when its lock file is replaced: seen by
/// `is_held`, reported once. Also: the opt-in `group` label, and an election's events.
#[tokio::test]
async fn sqlite_a_lost_lock_and_a_group_label_and_an_election() {
    let db = SqliteDb::new();
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let cap = Capture::default();
    let _tracing = tracing::subscriber::set_default(cap.clone());

    let locks = Locks::builder()
        .url(&db.url)
        .metrics_group(|name| name.split_once(':').map(|(kind, _)| kind))
        .build()
        .await
        .unwrap();
    let guard = bounded("lock", locks.lock("tenant:42")).await.unwrap();
    let other = bounded("lock", locks.lock("ungrouped")).await.unwrap();
    std::fs::remove_file(db.dir.path().join("locks.db-locks")).unwrap();
    assert!(!guard.is_held());
    assert!(!guard.is_held());
    drop(guard);
    drop(other);

    let lost = cap.with_message("lock lost");
    assert_eq!(lost.len(), 1, "once, however often it is seen: {lost:#?}");
    assert_eq!(lost[0].get("name"), "tenant:42");
    assert!(lost[0].get("reason").contains("locks.db-locks"), "{lost:?}");
    let m = Metrics::take(&snap);
    let grouped = [
        ("backend", "sqlite"),
        ("mode", "exclusive"),
        ("group", "tenant"),
    ];
    let plain = [("backend", "sqlite"), ("mode", "exclusive")];
    assert_eq!(m.counter("dblock_locks_acquired_total", &grouped), 1);
    assert_eq!(m.counter("dblock_locks_lost_total", &grouped), 1);
    assert_eq!(m.counter("dblock_locks_released_total", &grouped), 0);
    assert_eq!(m.counter("dblock_locks_acquired_total", &plain), 1);
    // `other` lost its lock too, but nothing asked: a guard ends as released unless its
    // loss was seen (checking at every drop would cost the embedded backend a stat).
    assert_eq!(m.counter("dblock_locks_lost_total", &plain), 0);
    assert_eq!(m.counter("dblock_locks_released_total", &plain), 1);
    assert_eq!(m.gauge("dblock_locks_held", &grouped), 0.0);
    assert_eq!(m.gauge("dblock_locks_held", &plain), 0.0);

    let election = dblock::leader::Election::new(&locks, "scheduler");
    let leading = [("election", "scheduler")];
    let term = bounded("campaign", election.campaign()).await.unwrap();
    let token = term.token();
    // Kubernetes' convention: a 0/1 gauge per election.
    let m = Metrics::take(&snap);
    assert_eq!(m.gauge("dblock_election_is_leader", &leading), 1.0);
    bounded("resign", term.resign()).await.unwrap();
    let mut w = election.watch();
    bounded("the term's end", w.wait_for(|r| *r == Role::Follower))
        .await
        .unwrap();
    let m = Metrics::take(&snap);
    assert_eq!(m.gauge("dblock_election_is_leader", &leading), 0.0);
    let elected = cap.with_message("elected leader");
    assert_eq!(elected.len(), 1);
    assert_eq!(elected[0].target, "dblock::leader");
    assert_eq!(elected[0].get("name"), "scheduler");
    assert_eq!(elected[0].get("token"), token.to_string());
    assert_eq!(cap.with_message("resigned leadership").len(), 1);
}

/// A semaphore's slot is observed as a lock on the semaphore's name, keyed by the slot.
#[tokio::test]
async fn sqlite_a_semaphore_slot_is_traced_and_counted() {
    let db = SqliteDb::new();
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let cap = Capture::default();
    let _tracing = tracing::subscriber::set_default(cap.clone());

    let locks = db.locks().await;
    let slot = bounded("semaphore", locks.semaphore("exports", 2).lock())
        .await
        .unwrap();
    let key = slot.key().as_i64().to_string();
    drop(slot);

    let granted = cap.with_message("lock granted");
    assert_eq!(granted.len(), 1, "{granted:#?}");
    assert_eq!(granted[0].get("name"), "exports");
    let released = cap.with_message("lock released");
    assert_eq!(released.len(), 1, "{released:#?}");
    assert_eq!(released[0].get("key"), key, "the slot's key");
    let m = Metrics::take(&snap);
    let ex = [("backend", "sqlite"), ("mode", "exclusive")];
    assert_eq!(m.counter("dblock_locks_acquired_total", &ex), 1);
    assert_eq!(m.counter("dblock_locks_released_total", &ex), 1);
    assert_eq!(m.gauge("dblock_locks_held", &ex), 0.0);
}

/// A `lock_all` set is observed as one lock under its first name (in key order): one
/// acquisition, one held lock while it is held, one release.
#[tokio::test]
async fn sqlite_a_lock_set_is_traced_and_counted_as_one() {
    let db = SqliteDb::new();
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let cap = Capture::default();
    let _tracing = tracing::subscriber::set_default(cap.clone());

    let locks = db.locks().await;
    let set = bounded("lock_all", locks.lock_all(["pin:a", "pin:b", "pin:c"]))
        .await
        .unwrap();
    let first = set.names().next().unwrap().to_string();
    let ex = [("backend", "sqlite"), ("mode", "exclusive")];
    let m = Metrics::take(&snap);
    assert_eq!(m.counter("dblock_locks_acquired_total", &ex), 1);
    assert_eq!(m.gauge("dblock_locks_held", &ex), 1.0);
    // (A snapshot takes what changed since the last one.)
    bounded("release", set.release()).await.unwrap();

    let granted = cap.with_message("lock granted");
    assert_eq!(granted.len(), 1, "{granted:#?}");
    assert_eq!(granted[0].get("name"), first);
    assert_eq!(cap.with_message("lock released").len(), 1);
    let m = Metrics::take(&snap);
    assert_eq!(m.counter("dblock_locks_released_total", &ex), 1);
    assert_eq!(
        m.gauge("dblock_locks_held", &ex),
        -1.0,
        "and its −1 at the release"
    );
}
