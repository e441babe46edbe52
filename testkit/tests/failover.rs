//! Issue 14.1: fencing tokens keep rising across a PostgreSQL failover, on a real primary
//! and a real streaming replica (throwaway clusters), with grants the replica never got.

use std::time::Duration;

use dblock::{Error, Locks};
use dblock_testkit::cluster::TempCluster;
use dblock_testkit::{PgDatabase, admin_connect, eventually, with_user};

/// 2⁴⁰: a token is `timeline × 2⁴⁰ + n` (see `docs/locks-and-loss.md`).
const EPOCH: i64 = 1 << 40;

/// Bounds an await: a hung step fails the test with its name.
async fn within<T>(secs: u64, what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer in {secs} s"))
}

/// What a counter without an epoch hands out: the shape of dblock's fencing upsert
/// before the timeline was added (`token = token + 1`), on a table of its own.
async fn plain_counter(admin: &tokio_postgres::Client) -> i64 {
    within(
        10,
        "plain counter",
        admin.query_one(
            "INSERT INTO plain_counter AS f VALUES (1, 1) \
             ON CONFLICT (k) DO UPDATE SET token = f.token + 1 RETURNING token",
            &[],
        ),
    )
    .await
    .unwrap()
    .get(0)
}

async fn one_text(admin: &tokio_postgres::Client, sql: &str) -> String {
    within(10, sql, admin.query_one(sql, &[]))
        .await
        .unwrap()
        .get(0)
}

/// The timeline a server writes on, and the one its last checkpoint names.
async fn timelines(admin: &tokio_postgres::Client) -> (i64, i64) {
    let row = within(
        10,
        "timelines",
        admin.query_one(
            "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint, \
             (SELECT timeline_id FROM pg_control_checkpoint())::bigint",
            &[],
        ),
    )
    .await
    .unwrap();
    (row.get(0), row.get(1))
}

/// The scenario repmgr and Synapse users met: an asynchronous replica that lacks the last
/// committed grants is promoted after the primary dies. Every token the promoted server
/// hands out is greater than every token the old primary handed out; the deposed
/// holder's token fails `check_postgres` there. Control: a plain counter, run beside
/// every grant, goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_rising_across_a_failover_that_lost_the_latest_grants() {
    let primary = TempCluster::start(&[]);
    let p_admin = admin_connect(&primary.url()).await;
    p_admin
        .batch_execute("CREATE TABLE plain_counter (k int PRIMARY KEY, token bigint NOT NULL)")
        .await
        .unwrap();
    let standby = TempCluster::standby_of(&primary);
    let s_admin = admin_connect(&standby.url()).await;
    let old = within(10, "connect", Locks::connect(&primary.url()))
        .await
        .unwrap();

    // Grants the standby receives.
    let mut handed_out = Vec::new();
    let mut plain_old = Vec::new();
    for _ in 0..3 {
        let g = within(10, "lock", old.request("ledger").fenced().lock())
            .await
            .unwrap();
        handed_out.push(g.fencing_token().unwrap());
        plain_old.push(plain_counter(&p_admin).await);
    }
    let upto = one_text(&p_admin, "SELECT pg_current_wal_lsn()::text").await;
    assert!(
        eventually(30, &mut || {
            let (s, upto) = (&s_admin, &upto);
            async move {
                s.query_one(
                    "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
                    &[upto],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
            }
        })
        .await,
        "the standby replays the first grants"
    );
    // Cut the standby off (asynchronous replication: the primary goes on committing).
    // Pausing replay would not do: a promotion replays the WAL already received.
    for sql in [
        "ALTER SYSTEM SET primary_conninfo = ''",
        "SELECT pg_reload_conf()",
    ] {
        s_admin.batch_execute(sql).await.unwrap();
    }
    assert!(
        eventually(30, &mut || {
            let p = &p_admin;
            async move {
                p.query_one("SELECT count(*) FROM pg_stat_replication", &[])
                    .await
                    .map(|r| r.get::<_, i64>(0) == 0)
                    .unwrap_or(false)
            }
        })
        .await,
        "the standby's receiver stops"
    );

    // Grants the standby never receives; the last one is still held when the primary dies.
    let mut deposed = None;
    for i in 0..5 {
        let g = within(10, "lock", old.request("ledger").fenced().lock())
            .await
            .unwrap();
        handed_out.push(g.fencing_token().unwrap());
        plain_old.push(plain_counter(&p_admin).await);
        if i == 4 {
            deposed = Some(g);
        }
    }
    let deposed = deposed.unwrap();
    let deposed_fence = deposed.fence().cloned().unwrap();
    let old_max = *handed_out.iter().max().unwrap();
    assert_eq!(old_max, deposed_fence.token());
    assert!(
        handed_out.windows(2).all(|w| w[0] < w[1]),
        "rising on one primary: {handed_out:?}"
    );

    // The primary dies; the standby is promoted.
    primary.stop();
    standby.promote();
    let (live, checkpointed) = timelines(&s_admin).await;
    eprintln!(
        "just after promotion: live timeline {live}, last checkpoint's timeline {checkpointed}"
    );
    assert_eq!(live, 2, "the live timeline is the promotion's at once");

    // The replica really lacks the last grants: its row is behind the deposed holder's.
    let row: i64 = within(
        10,
        "row",
        s_admin.query_one(
            "SELECT token FROM public.dblock_fencing WHERE name = 'ledger'",
            &[],
        ),
    )
    .await
    .unwrap()
    .get(0);
    assert!(row < old_max, "the replica lacks grants: {row} < {old_max}");
    // Control: the plain counter goes back — it hands out a number already handed out.
    let plain_new = plain_counter(&s_admin).await;
    let plain_old_max = *plain_old.iter().max().unwrap();
    assert!(
        plain_new <= plain_old_max,
        "the control must go back: {plain_new} after {plain_old:?}"
    );
    assert!(plain_old.contains(&plain_new), "a number handed out twice");

    // dblock's tokens do not.
    let new = within(10, "connect", Locks::connect(&standby.url()))
        .await
        .unwrap();
    let mut new_tokens = Vec::new();
    for _ in 0..3 {
        let g = within(10, "lock", new.request("ledger").fenced().lock())
            .await
            .unwrap();
        new_tokens.push(g.fencing_token().unwrap());
    }
    assert!(
        new_tokens.iter().all(|&t| t > old_max),
        "every new token above every old one: {new_tokens:?} vs {handed_out:?}"
    );
    assert_eq!(new_tokens[0] / EPOCH, 2, "the epoch is the new timeline");

    // The deposed holder's check on the new primary refuses its token.
    let pool = sqlx::PgPool::connect(&standby.url()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let r = within(10, "check", deposed_fence.check_postgres(&mut tx)).await;
    assert!(
        matches!(r, Err(Error::StaleToken { token, latest, .. })
            if token == old_max && latest == *new_tokens.last().unwrap()),
        "{r:?}"
    );
    drop(tx);
    drop(deposed);
}

/// Tokens handed out before this release (plain counters) stay below the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_from_plain_counters_stay_below_new_tokens() {
    let db = PgDatabase::new("fence_compat").await;
    let locks = within(10, "connect", Locks::connect(&db.url))
        .await
        .unwrap();
    let first = within(10, "lock", locks.request("job").fenced().lock())
        .await
        .unwrap();
    let t = first.fencing_token().unwrap();
    assert!(t > EPOCH, "{t}");
    assert_eq!(t % EPOCH, 1, "the first grant on the timeline");
    drop(first);
    // A row as an older dblock left it: a plain counter.
    let admin = db.admin().await;
    admin
        .batch_execute("UPDATE public.dblock_fencing SET token = 41")
        .await
        .unwrap();
    let g = within(10, "lock", locks.request("job").fenced().lock())
        .await
        .unwrap();
    let t = g.fencing_token().unwrap();
    assert!(t > 41 && t / EPOCH >= 1, "{t}");
    drop(g);
    let g = within(10, "lock", locks.request("job").fenced().lock())
        .await
        .unwrap();
    assert_eq!(g.fencing_token(), Some(t + 1), "then one more per grant");
}

/// A server that does not let the role read the timeline (a platform without those
/// functions, say) keeps plain counters instead of failing every fenced grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_timeline_functions_tokens_are_plain_counters() {
    let db = PgDatabase::new("fence_noepoch").await;
    let admin = db.admin().await;
    let role = format!("{}_r", db.name);
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN; \
             GRANT CREATE, USAGE ON SCHEMA public TO \"{role}\"; \
             REVOKE EXECUTE ON FUNCTION pg_walfile_name(pg_lsn) FROM PUBLIC"
        ))
        .await
        .unwrap();
    let locks = within(10, "connect", Locks::connect(&with_user(&db.url, &role)))
        .await
        .unwrap();
    for want in 1..=3 {
        let g = within(10, "lock", locks.request("job").fenced().lock())
            .await
            .unwrap();
        assert_eq!(g.fencing_token(), Some(want));
    }
    drop(locks);
    // Control: the same role with the function gets timeline tokens.
    admin
        .batch_execute("GRANT EXECUTE ON FUNCTION pg_walfile_name(pg_lsn) TO PUBLIC")
        .await
        .unwrap();
    let locks = within(10, "connect", Locks::connect(&with_user(&db.url, &role)))
        .await
        .unwrap();
    let g = within(10, "lock", locks.request("job").fenced().lock())
        .await
        .unwrap();
    assert!(g.fencing_token().unwrap() > EPOCH);
    drop(g);
    drop(locks);
    let _ = admin
        .batch_execute(&format!(
            "REASSIGN OWNED BY \"{role}\" TO postgres; DROP OWNED BY \"{role}\"; \
             DROP ROLE \"{role}\""
        ))
        .await;
}
