//! No false alarms: what docs/observability.md tells operators about dblock's lock
//! holders and postgres_exporter, checked against real holders on PostgreSQL — a
//! transaction-scoped holder is `idle in transaction` but holds no transaction id and no
//! snapshot; the documented custom query (docs/alerts/postgres_exporter-queries.yaml)
//! leaves holders out and still counts any other idle transaction (the control); the
//! documented `application_name` matcher tells dblock's connections from others.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock_testkit::PgSchema;

/// The query of `pg_tx_not_dblock` in the documented queries file.
fn documented_query() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/alerts/postgres_exporter-queries.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines().skip_while(|l| l.trim() != "query: |").skip(1);
    let mut sql = Vec::new();
    for l in lines.by_ref() {
        if !l.starts_with("    ") {
            break;
        }
        sql.push(l.trim());
    }
    assert!(!sql.is_empty(), "no query in {path}");
    sql.join(" ")
}

/// The WHERE clause of the documented query.
fn documented_filter(sql: &str) -> String {
    let at = sql.find("WHERE ").unwrap() + "WHERE ".len();
    let end = sql.find(" GROUP BY").unwrap();
    sql[at..end].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dblock_holders_are_left_out_of_the_documented_long_transaction_query() {
    let db = PgSchema::new("no_false_alarms").await;
    let locks = dblock::Locks::builder()
        .url(&db.url)
        .check_interval(Duration::from_millis(200))
        .build()
        .await
        .unwrap();
    let fenced = locks.request("deploy").fenced().lock().await.unwrap();
    let plain = locks.lock("report").await.unwrap();
    // The control: a session of the same application idle in an ordinary transaction.
    let (other, conn) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    other.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let control: i32 = other
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    let sql = documented_query();
    let filter = documented_filter(&sql);
    // Right after the grant (the request's own message) and after health checks (the
    // comment alone) alike.
    for pause in [0, 600] {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let rows = db
            .admin()
            .query(
                "SELECT pid, state, backend_xid IS NULL, backend_xmin IS NULL \
                 FROM pg_stat_activity WHERE application_name = $1 AND xact_start IS NOT NULL",
                &[&db.app],
            )
            .await
            .unwrap();
        let holders: Vec<i32> = rows
            .iter()
            .map(|r| r.get::<_, i32>(0))
            .filter(|p| *p != control)
            .collect();
        assert_eq!(holders.len(), 2, "two holders in transactions: {rows:?}");
        for r in &rows {
            let pid: i32 = r.get(0);
            let state: String = r.get(1);
            assert_eq!(state, "idle in transaction", "{pid}");
            if pid != control {
                // What postgres_exporter would count, yet harmless: no xid, no snapshot.
                assert!(
                    r.get::<_, bool>(2) && r.get::<_, bool>(3),
                    "{pid}: {rows:?}"
                );
            }
        }
        let counted: Vec<i32> = db
            .admin()
            .query(
                &format!(
                    "SELECT pid FROM pg_stat_activity WHERE ({filter}) AND application_name = $1"
                ),
                &[&db.app],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(counted, vec![control], "after {pause} ms");
    }
    // The whole documented query runs, with the columns its metrics name.
    let rows = db.admin().query(&sql, &[]).await.unwrap();
    assert!(!rows.is_empty());
    let cols: Vec<&str> = rows[0].columns().iter().map(|c| c.name()).collect();
    assert_eq!(cols, ["datname", "state", "count", "max_tx_duration"]);

    // The application_name matcher of the docs (PromQL regexes are anchored) matches
    // dblock's default application_name and not another program's.
    let matcher = r"^.+\[[0-9]+\]@.+$";
    let app = dblock::status::default_application_name();
    for (name, is_dblock) in [(app.as_str(), true), ("psql", false), ("myapp", false)] {
        let m: bool = db
            .admin()
            .query_one("SELECT $1::text ~ $2", &[&name, &matcher])
            .await
            .unwrap()
            .get(0);
        assert_eq!(m, is_dblock, "{name}");
    }
    drop((fenced, plain));
}
