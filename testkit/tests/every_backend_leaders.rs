//! Leaders you can watch, on PostgreSQL, MySQL/MariaDB and the embedded SQLite file from
//! this one source: a leader in a process of its own publishes a value (its address)
//! and changes it; a process that never stands reads who leads and follows each change;
//! a deposed leader's value never replaces its successor's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;

use dblock::Error;
use dblock::leader::{Election, Leader};
use dblock_testkit::TestDb;
use dblock_testkit::testdb::within;
use futures_util::StreamExt;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const WORKER: &str = env!("CARGO_BIN_EXE_dblock-worker");

/// A leader in a process of its own: `dblock-worker lead URL NAME VALUE`, once elected.
struct Lead {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    token: i64,
}

impl Lead {
    async fn start(url: &str, name: &str, value: &str) -> Lead {
        let mut child = Command::new(WORKER)
            .args(["lead", url, name, value])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = within(30, "the worker's term", lines.next_line())
            .await
            .unwrap()
            .unwrap();
        let token = line.strip_prefix("leader ").unwrap().parse().unwrap();
        Lead {
            child,
            lines,
            token,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap()
    }

    async fn publish(&mut self, value: &str) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin
            .write_all(format!("publish {value}\n").as_bytes())
            .await
            .unwrap();
        within(10, "the worker's publish", self.lines.next_line())
            .await
            .unwrap()
            .unwrap()
    }
}

/// A process that never stands sees the leader another process elected, with its value,
/// and follows it — a new value, the leader's death, a successor without a value — as a
/// stream of changes.
async fn a_leader_publishes_a_value_that_any_process_reads_and_follows(db: &TestDb) {
    let locks = db.locks().await;
    assert_eq!(locks.current_leader("scheduler").await.unwrap(), None);
    let mut first = Lead::start(db.url(), "scheduler", "10.0.3.17:8080").await;
    let now = locks.current_leader("scheduler").await.unwrap().unwrap();
    assert_eq!(now.value.as_deref(), Some("10.0.3.17:8080"), "{now:?}");
    assert_eq!(now.token, Some(first.token));
    assert!(
        now.holder.ends_with(&format!(":{}", first.pid())),
        "{now:?} vs pid {}",
        first.pid()
    );
    assert!(now.since.is_some(), "{now:?}");

    let mut changes = locks
        .observe("scheduler")
        .every(Duration::from_millis(50))
        .into_stream();
    let seen: Option<Leader> = within(20, "the first answer", changes.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        seen.as_ref(),
        Some(&now),
        "the first answer is the state now"
    );

    assert_eq!(first.publish("10.0.3.17:9090").await, "published");
    let seen = within(20, "the new value", changes.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(seen.value.as_deref(), Some("10.0.3.17:9090"));
    assert_eq!(seen.token, Some(first.token), "the same term");

    // The leader dies: nobody leads.
    first.child.kill().await.unwrap();
    let seen = within(20, "no leader", changes.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(seen, None);

    // A successor that publishes nothing: its term shows no value (not its
    // predecessor's).
    let second = Lead::start(db.url(), "scheduler", "-").await;
    assert!(second.token > first.token);
    let seen = within(20, "the successor", changes.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(seen.token, Some(second.token));
    assert_eq!(seen.value, None, "{seen:?}");
    assert!(seen.holder.ends_with(&format!(":{}", second.pid())));
}

/// A leader whose term ended (its session ended from outside; on the embedded backend its
/// lock file replaced) cannot publish over its successor's value: refused with
/// `StaleToken`, and readers keep the successor's. The control: the successor's own
/// publish, in its term, succeeds.
async fn a_deposed_leader_cannot_publish_over_its_successor(db: &TestDb) {
    let mut a = Lead::start(db.url(), "deposed", "a:1").await;
    db.end_holder("deposed").await;
    let locks = db.locks().await;
    let b = Election::new(&locks, "deposed").value("b:1");
    let b_term = within(30, "B's campaign", b.campaign()).await.unwrap();
    assert!(b_term.token() > a.token);

    let refused = a.publish("a:2").await;
    assert!(
        refused.starts_with("error StaleToken")
            && refused.contains(&format!("token: {}", a.token))
            && refused.contains(&format!("latest: {}", b_term.token())),
        "a deposed leader published: {refused}"
    );
    let now = locks.current_leader("deposed").await.unwrap().unwrap();
    assert_eq!(now.value.as_deref(), Some("b:1"));
    // The control: a current term publishes.
    b_term.publish("b:2").await.unwrap();
    let now = db
        .locks()
        .await
        .current_leader("deposed")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(now.value.as_deref(), Some("b:2"));
    assert_eq!(now.token, Some(b_term.token()));
}

/// A value no backend can keep alike is refused before the candidate stands, and
/// nothing is left held.
async fn a_bad_value_is_refused_before_standing(db: &TestDb) {
    let locks = db.locks().await;
    for bad in ["x".repeat(8193), "a\0b".to_string()] {
        let e = Election::new(&locks, "bad-value").value(bad.clone());
        match within(10, "campaign", e.campaign()).await {
            Err(Error::InvalidRequest { reason: m }) => assert!(m.contains("8192 bytes"), "{m}"),
            other => panic!("{} bytes accepted: {other:?}", bad.len()),
        }
    }
    assert!(
        locks.try_lock("bad-value").await.unwrap().is_some(),
        "nothing held"
    );
    // The longest value allowed is kept whole, non-ASCII included.
    let long: String = "é".repeat(4096);
    let term = Election::new(&locks, "long-value")
        .value(long.clone())
        .campaign()
        .await
        .unwrap();
    let now = locks.current_leader("long-value").await.unwrap().unwrap();
    assert_eq!(now.value.as_deref(), Some(long.as_str()));
    drop(term);
}

dblock_testkit::every_backend!(
    a_leader_publishes_a_value_that_any_process_reads_and_follows,
    a_deposed_leader_cannot_publish_over_its_successor,
    a_bad_value_is_refused_before_standing,
);
