//! Which engine a handle talks to, and the self-test before trust (issue 25 item 1): on
//! the real PostgreSQL the engine is named from the start-up parameters and the check
//! finds locks that exclude; on a throwaway cluster whose advisory-lock functions are
//! replaced by stubs that always grant (as CockroachDB's were for years), the check —
//! forced on, since the stubbed server still says it is PostgreSQL — refuses every
//! acquisition with one typed error, while a handle that trusts the server (the control)
//! lets two holders in at once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::postgres::engine::{Engine, SelfTest, Verdict};
use dblock::{Capability, Error, Locks, Scope};
use dblock_testkit::cluster::TempCluster;
use dblock_testkit::cluster::granting_stubs;
use dblock_testkit::{PgSchema, admin_connect, with_params};

/// Bounds every await of these tests.
async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("did not finish within {secs} s"))
}

/// PostgreSQL names itself in its start-up parameters (`server_version`), and is named
/// so on dblock's own connections and, from `version()`, on an sqlx pool; its locks of
/// both scopes exclude.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_is_named_and_its_locks_exclude() {
    let s = PgSchema::new("engine_pg").await;
    let shown: String = s
        .admin()
        .query_one("SHOW server_version", &[])
        .await
        .unwrap()
        .get(0);
    let locks = within(10, s.locks()).await;
    assert_eq!(
        locks.engine(),
        Some(Engine::PostgreSql {
            version: shown.clone()
        })
    );
    let found = within(10, locks.check_exclusion()).await.unwrap();
    assert_eq!(
        (found.transaction, found.session),
        (Verdict::Excludes, Verdict::Excludes)
    );
    // An sqlx pool does not show the start-up parameters: `version()` names it.
    let pool = sqlx::PgPool::connect(&s.url).await.unwrap();
    let borrowed = within(10, Locks::from_sqlx_pool(pool)).await.unwrap();
    match borrowed.engine() {
        Some(Engine::PostgreSql { version }) => {
            assert!(shown.starts_with(&version), "{version} vs {shown}")
        }
        other => panic!("{other:?}"),
    }
    let found = within(10, borrowed.check_exclusion()).await.unwrap();
    assert_eq!(found.transaction, Verdict::Excludes);
    // The embedded backend has no engine to check.
    let sqlite = dblock_testkit::SqliteDb::new();
    let embedded = sqlite.locks().await;
    assert_eq!(embedded.engine(), None);
    match embedded.check_exclusion().await {
        Err(Error::Unsupported {
            capability: Capability::ExclusionCheck,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

/// A throwaway cluster whose advisory-lock functions are stubs that always grant, made
/// the real way a server can lie: a superuser replaces `pg_catalog`'s own functions
/// (`CREATE OR REPLACE FUNCTION pg_catalog.pg_try_advisory_xact_lock(bigint) … AS
/// 'SELECT true'`; PostgreSQL lets a superuser do so without
/// `allow_system_table_mods`), so schema-qualified calls reach them too. The stubs are
/// `LANGUAGE sql` on purpose: a call to a built-in function's OID runs its C code
/// whatever `pg_proc` now says (fmgr's fast path), but the planner inlines a SQL
/// function's body, read from `pg_proc`, before anything runs — that is how the lie
/// reaches dblock's statements. Proven stubs before use: a key "taken" twice from two
/// sessions shows no row in `pg_locks`.
async fn stubbed_cluster() -> TempCluster {
    let cluster = TempCluster::start(&[]);
    let admin = admin_connect(&cluster.url()).await;
    admin
        .batch_execute(&granting_stubs("pg_catalog"))
        .await
        .unwrap();
    let other = admin_connect(&cluster.url()).await;
    admin
        .batch_execute("BEGIN; SELECT pg_catalog.pg_advisory_xact_lock(7)")
        .await
        .unwrap();
    let second: bool = other
        .query_one("SELECT pg_catalog.pg_try_advisory_xact_lock(7)", &[])
        .await
        .unwrap()
        .get(0);
    let rows: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    admin.batch_execute("ROLLBACK").await.unwrap();
    assert!(second && rows == 0, "the stubs are not in place");
    cluster
}

/// The stubbed server still says it is PostgreSQL, so a handle that trusts it (the
/// control, `self_test` left at auto) lets two holders of one name in at once; with the
/// check forced on (`self_test=always` in the URL, or the builder's `self_test`), the
/// check finds the locks do not exclude and every acquisition — each scope, try or
/// wait, one name, a semaphore, a set — is refused with one typed error that names the
/// engine and what to do, before anything is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_that_do_not_exclude_are_refused_once_the_check_runs() {
    let cluster = stubbed_cluster().await;
    // Control: trusted, the stubs grant both.
    let trusting = within(10, Locks::connect(&cluster.url())).await.unwrap();
    assert!(matches!(trusting.engine(), Some(Engine::PostgreSql { .. })));
    let first = within(10, trusting.try_lock("job")).await.unwrap();
    let second = within(10, trusting.try_lock("job")).await.unwrap();
    assert!(
        first.is_some() && second.is_some(),
        "the control should show two holders at once on the stubbed server"
    );
    drop((first, second));

    let forced_url = with_params(&cluster.url(), &[("self_test", "always")]);
    let forced = within(10, Locks::connect(&forced_url)).await.unwrap();
    let by_builder = within(
        10,
        Locks::builder()
            .url(cluster.url())
            .self_test(SelfTest::Always)
            .build(),
    )
    .await
    .unwrap();
    for locks in [&forced, &by_builder] {
        refused(within(10, locks.try_lock("job")).await.map(|_| ()));
        refused(within(10, locks.lock("job")).await.map(|_| ()));
        refused(
            within(10, locks.request("job").scope(Scope::Session).try_lock())
                .await
                .map(|_| ()),
        );
        refused(
            within(10, locks.semaphore("pool", 3).try_lock())
                .await
                .map(|_| ()),
        );
        refused(within(10, locks.try_lock_all(["a", "b"])).await.map(|_| ()));
        let found = within(10, locks.check_exclusion()).await.unwrap();
        assert_eq!(
            (found.transaction, found.session),
            (Verdict::DoesNotExclude, Verdict::DoesNotExclude)
        );
    }

    // A server whose lock functions fail, as YugabyteDB's did before advisory locks
    // (`advisory locks are not yet implemented`, 0A000): refused too, in its words.
    let admin = admin_connect(&cluster.url()).await;
    admin
        .batch_execute(
            "CREATE FUNCTION public.not_implemented() RETURNS boolean LANGUAGE plpgsql AS \
             $$BEGIN RAISE EXCEPTION 'advisory locks are not yet implemented' \
             USING ERRCODE = '0A000'; END$$; \
             CREATE OR REPLACE FUNCTION pg_catalog.pg_try_advisory_xact_lock(bigint) \
             RETURNS boolean LANGUAGE sql AS 'SELECT public.not_implemented()'",
        )
        .await
        .unwrap();
    let failing = within(10, Locks::connect(&forced_url)).await.unwrap();
    let found = within(10, failing.check_exclusion()).await.unwrap();
    match &found.transaction {
        Verdict::Unavailable { message } => {
            assert!(message.contains("not yet implemented"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    match within(10, failing.try_lock("job")).await {
        Err(Error::Unsupported {
            capability: Capability::AdvisoryLocks,
            reason,
        }) => assert!(reason.contains("not yet implemented"), "{reason}"),
        other => panic!("{:?}", other.map(|g| g.is_some())),
    }
}

fn refused(r: Result<(), Error>) {
    match r {
        Err(Error::Unsupported {
            capability: Capability::AdvisoryLocks,
            reason,
        }) => {
            assert!(reason.contains("PostgreSQL"), "names the engine: {reason}");
            assert!(reason.contains("do not exclude"), "{reason}");
            assert!(
                reason.contains("docs/connecting.md"),
                "what to do: {reason}"
            );
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
}

/// The statements a handle's connections sent, as the server logged them
/// (`log_statement = all`, each line prefixed with the session's `application_name`):
/// a simple query's text, and each statement the extended protocol executed (`execute
/// NAME: text`, logged as `execute: text`).
fn logged(cluster: &TempCluster, app: &str) -> Vec<String> {
    let log = std::fs::read_to_string(cluster.dir.path().join("server.log")).unwrap();
    let simple = format!("{app}|LOG:  statement: ");
    let extended = format!("{app}|LOG:  execute ");
    log.lines()
        .filter_map(|l| match l.strip_prefix(&simple) {
            Some(text) => Some(text.to_string()),
            None => l
                .strip_prefix(&extended)
                .and_then(|l| l.split_once(": "))
                .map(|(_, text)| format!("execute: {text}")),
        })
        .collect()
}

/// `n` cycles of a lock taken and released (waiting for the release's reply).
async fn cycles(locks: &Locks, n: usize) {
    for _ in 0..n {
        let g = within(10, locks.lock("cycle")).await.unwrap();
        within(10, g.release()).await.unwrap();
    }
}

/// PostgreSQL, recognised from its start-up parameters, pays nothing for the check: a
/// handle left at `self_test=auto` sends none of the check's statements, and the
/// messages its locks send per cycle are those of a handle with the check forced on
/// once it has run (the check runs once per handle, before the first grant — never
/// again). Counted from the server's own log of every statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgresql_pays_nothing_for_the_check() {
    let cluster = TempCluster::start(&[("log_statement", "'all'"), ("log_line_prefix", "'%a|'")]);
    let auto_url = with_params(&cluster.url(), &[("application_name", "auto")]);
    let forced_url = with_params(
        &cluster.url(),
        &[("application_name", "forced"), ("self_test", "always")],
    );
    let auto = within(10, Locks::connect(&auto_url)).await.unwrap();
    let forced = within(10, Locks::connect(&forced_url)).await.unwrap();
    cycles(&auto, 3).await;
    cycles(&forced, 3).await;
    let (auto_first, forced_first) = (logged(&cluster, "auto"), logged(&cluster, "forced"));
    cycles(&auto, 5).await;
    cycles(&forced, 5).await;
    let (auto_all, forced_all) = (logged(&cluster, "auto"), logged(&cluster, "forced"));
    let checks = |lines: &[String]| {
        lines
            .iter()
            .filter(|l| l.contains("dblock self-test"))
            .count()
    };
    assert_eq!(
        checks(&auto_all),
        0,
        "the check ran on PostgreSQL: {auto_all:#?}"
    );
    assert!(checks(&forced_first) > 0, "the forced check did not run");
    assert_eq!(
        checks(&forced_all),
        checks(&forced_first),
        "the check ran twice"
    );
    let per_lock = |all: &[String], first: &[String]| all.len() - first.len();
    assert_eq!(
        per_lock(&auto_all, &auto_first),
        per_lock(&forced_all, &forced_first),
        "five cycles sent different messages: {auto_all:#?} {forced_all:#?}"
    );
    // Per cycle: the take, its `BEGIN` and its try executed in one round (the extended
    // protocol under one `Sync`: the server logs each), and the release.
    assert_eq!(per_lock(&auto_all, &auto_first), 15, "{auto_all:#?}");
    let last = &auto_all[auto_all.len() - 3..];
    assert!(
        last[0] == "execute: BEGIN ISOLATION LEVEL READ COMMITTED"
            && last[1].starts_with("execute: SELECT pg_catalog.pg_try_advisory_xact_lock($1)")
            && last[2] == "ROLLBACK",
        "{last:#?}"
    );
    // A session-scoped lock too: its try executed as the session's statement for every
    // key.
    let before = logged(&cluster, "auto").len();
    for _ in 0..3 {
        let g = within(
            10,
            auto.request("cycle").scope(dblock::Scope::Session).lock(),
        )
        .await
        .unwrap();
        within(10, g.release()).await.unwrap();
    }
    let session = &logged(&cluster, "auto")[before..];
    assert!(
        session
            .iter()
            .filter(|l| l.starts_with("execute: SELECT pg_catalog.pg_try_advisory_lock($1)"))
            .count()
            == 3,
        "{session:#?}"
    );
}

/// Through a PgBouncer in statement pooling mode (taken for a transaction pooler: the two
/// cannot be told apart from the client), a transaction-scoped lock is refused in
/// PgBouncer's own words and leaves nothing held on the server; a session-scoped one is
/// refused before it is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_pooling_refuses_every_lock_and_leaves_nothing_held() {
    use dblock_testkit::pgbouncer::{Options, PgBouncer, PoolMode};
    let s = PgSchema::new("stmt_pool").await;
    let b = PgBouncer::with(Options::new(PoolMode::Statement, 2).search_path(&s.name));
    let url = with_params(&b.test_url(), &[("application_name", &s.app)]);
    let locks = within(10, Locks::connect(&url)).await.unwrap();
    assert_eq!(locks.pooler(), dblock::postgres::Pooler::Transaction);
    match within(10, locks.try_lock("x")).await {
        Err(Error::ConnectionLost { message }) => {
            assert!(message.contains("statement pooling"), "{message}")
        }
        other => panic!("{:?}", other.map(|g| g.is_some())),
    }
    match within(10, locks.request("x").scope(Scope::Session).try_lock()).await {
        Err(Error::BehindPooler { .. }) => {}
        other => panic!("{:?}", other.map(|g| g.is_some())),
    }
    // Nothing stayed held: a direct handle takes the name at once.
    let direct = within(10, s.locks()).await;
    assert_eq!(direct.namespace(), locks.namespace());
    assert!(within(10, direct.try_lock("x")).await.unwrap().is_some());
}
