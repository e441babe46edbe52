//! A role that may connect but not create objects (PostgreSQL 15's default for
//! non-owners): every lock feature that needs no table works for it, `dblock run` works
//! out of the box, fencing needs the owner's one-time `dblock setup`, and each
//! permission error names the command that fixes it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Error, Scope};
use dblock_testkit::{PgSchema, exit_code, pg_url, with_params};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn bounded<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("did not finish within {secs} s"))
}

/// `url` connecting as `user` instead.
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let rest = match rest.split_once('@') {
        Some((_, host)) => host,
        None => rest,
    };
    format!("{scheme}://{user}@{rest}")
}

async fn dblock(args: &[&str]) -> std::process::Output {
    let state = tempfile::tempdir().unwrap();
    bounded(
        60,
        dblock_testkit::dblock_command(DBLOCK, state.path())
            .args(args)
            .output(),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_create_tables_locks_and_runs_and_setup_enables_fencing() {
    let s = PgSchema::new("leastpriv").await;
    let role = format!("{}_app", s.name);
    s.admin()
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN; GRANT USAGE ON SCHEMA \"{}\" TO \"{role}\"",
            s.name
        ))
        .await
        .unwrap();
    let url = with_params(
        &as_user(&pg_url(), &role),
        &[
            (
                "options",
                &format!("-c search_path={0} -c dblock.namespace={0}", s.name),
            ),
            ("application_name", &s.app),
        ],
    );
    let owner_url = s.url.clone();

    // Every feature that needs no table.
    let locks = bounded(10, dblock::Locks::connect(&url)).await.unwrap();
    let g = bounded(10, locks.lock("a")).await.unwrap();
    assert!(bounded(10, locks.try_lock("a")).await.unwrap().is_none());
    drop(g);
    let r1 = bounded(10, locks.request("r").shared().lock())
        .await
        .unwrap();
    let r2 = bounded(10, locks.request("r").shared().try_lock())
        .await
        .unwrap();
    assert!(r2.is_some());
    drop((r1, r2));
    let sess = bounded(
        10,
        locks
            .request("s")
            .scope(Scope::Session)
            .lease(Duration::from_secs(10))
            .lock(),
    )
    .await
    .unwrap();
    bounded(10, sess.release()).await.unwrap();
    let w = bounded(10, locks.try_lock_for("w", Duration::from_millis(200)))
        .await
        .unwrap();
    assert!(w.is_some());
    drop(w);
    let mux = bounded(
        10,
        dblock::Locks::builder()
            .url(&url)
            .scope(Scope::Session)
            .multiplex(2)
            .build(),
    )
    .await
    .unwrap();
    let m = bounded(10, mux.lock("m")).await.unwrap();
    bounded(10, m.release()).await.unwrap();

    // Fencing needs the table: refused, naming the command that fixes it.
    let e = bounded(10, locks.request("f").fenced().lock())
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
    assert!(
        text.contains("dblock setup") && text.contains(&format!("--grant {role}")),
        "{text}"
    );
    // The clean-up after a failed request is sent, not awaited (as a dropped guard's
    // release is): the lock is gone within a round trip.
    assert!(
        s.eventually(10, || async { s.advisory_of_sessions().await.is_empty() })
            .await,
        "nothing left held after the refusal"
    );

    // `dblock run` works out of the box: no token, and one line saying how to get one.
    let out = dblock(&[
        "run",
        "--db",
        &url,
        "job",
        "--",
        "sh",
        "-c",
        "echo token=${DBLOCK_FENCING_TOKEN:-none}",
    ])
    .await;
    assert_eq!(exit_code(&out), 0, "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "token=none");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines().count() == 1 && err.contains("dblock setup"),
        "{err}"
    );

    // Migrations need CREATE: refused with the grant that fixes it.
    let dir =
        dblock_testkit::migrations::MigrationDir::new(&[("0001_t.sql", "CREATE TABLE t (x int);")]);
    let out = dblock(&["migrate", "--db", &url, dir.path().to_str().unwrap()]).await;
    assert_eq!(exit_code(&out), 69, "{out:?}");
    let line = dblock_testkit::one_line_error(&out);
    assert!(line.contains("GRANT CREATE ON SCHEMA"), "{line}");

    // Setup by the role itself, which may neither create the table nor grant on it:
    // refused, saying who must run it.
    let out = dblock(&["setup", "--db", &url, "--grant", &role]).await;
    assert_eq!(exit_code(&out), 69, "{out:?}");
    let line = dblock_testkit::one_line_error(&out);
    assert!(line.contains("run dblock setup as a role"), "{line}");

    // The owner's one-time setup (run twice: idempotent)…
    for _ in 0..2 {
        let out = dblock(&["setup", "--db", &owner_url, "--grant", &role]).await;
        assert_eq!(exit_code(&out), 0, "{out:?}");
    }
    // …and fencing, leader election and `dblock run`'s token work for the role.
    let locks = bounded(10, dblock::Locks::connect(&url)).await.unwrap();
    let g = bounded(10, locks.request("f").fenced().lock())
        .await
        .unwrap();
    // The first grant of the name on this timeline (a token is timeline × 2⁴⁰ + n).
    const EPOCH: i64 = 1 << 40;
    assert_eq!(g.fencing_token().map(|t| t % EPOCH), Some(1));
    drop(g);
    let election = dblock::leader::Election::new(&locks, "leader");
    let term = bounded(10, election.campaign()).await.unwrap();
    assert_eq!(term.token() % EPOCH, 1);
    assert!(bounded(10, election.leader()).await.unwrap().is_some());
    drop(term);
    let out = dblock(&[
        "run",
        "--db",
        &url,
        "job",
        "--",
        "sh",
        "-c",
        "echo token=${DBLOCK_FENCING_TOKEN:-none}",
    ])
    .await;
    assert_eq!(exit_code(&out), 0, "{out:?}");
    let token = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let n: i64 = token
        .strip_prefix("token=")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{token}"));
    assert_eq!(n % EPOCH, 1, "{token}");
    assert!(out.stderr.is_empty(), "{out:?}");

    drop(locks);
    drop(mux);
    s.admin()
        .batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await
        .unwrap();
}
