//! One lease rule on every backend, here on MySQL/MariaDB: a lease must let a holder cut
//! off from the server learn of the loss before the server (its `wait_timeout`, whole
//! seconds) can end the holder's session and grant the lock to another.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use dblock::{Error, Locks};
use dblock_testkit::testdb::within;
use dblock_testkit::{MyDb, SilentProxy};

/// `mysql://user@host:port/db` routed through `127.0.0.1:port`.
fn via(url: &str, port: u16) -> String {
    let start = url
        .find('@')
        .map_or(url.find("://").unwrap() + 3, |i| i + 1);
    let end = start + url[start..].find('/').unwrap();
    format!("{}127.0.0.1:{port}{}", &url[..start], &url[end..])
}

/// The server's host and port of `url`.
fn target(url: &str) -> (String, u16) {
    let start = url
        .find('@')
        .map_or(url.find("://").unwrap() + 3, |i| i + 1);
    let end = start + url[start..].find('/').unwrap();
    let (host, port) = url[start..end]
        .rsplit_once(':')
        .unwrap_or((&url[start..end], "3306"));
    (host.to_string(), port.parse().unwrap())
}

/// [`dblock_testkit::silent_holder_race`] on `db`; `kill`: free the lock on the server
/// at once (its session killed) instead of waiting for the lease.
async fn silent_holder_race(
    db: &MyDb,
    guard: dblock::LockGuard,
    proxy: &SilentProxy,
    name: &str,
    kill: bool,
) -> (Duration, Duration) {
    let holder = db.holder(&db.lock_name(name)).await.expect("held");
    let other = db.locks().await;
    let free_now = async {
        if kill {
            db.kill_connection(holder).await;
        }
    };
    dblock_testkit::silent_holder_race(guard, proxy, &other, name, free_now).await
}

/// The report's configuration — lease 2 s with the default checks (every 1 s, 5 s to
/// answer) — is refused: it let another holder in 4 s before the old one was told. An
/// accepted one (checks every 200 ms, 1 s to answer, lease 2 s) is proved behind a proxy
/// that stops forwarding without closing: the holder is told before anyone else is
/// granted. The control shows the detector catching a holder told late, when the
/// server frees the lock at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_holder_learns_of_the_loss_before_anyone_else_is_granted_the_lock() {
    let db = MyDb::new("my_silent_lease").await;
    let target = target(&db.url);

    let proxy = SilentProxy::start(target.clone()).await;
    let holder = within(10, "connect", Locks::connect(&via(&db.url, proxy.port)))
        .await
        .unwrap();
    for lease in [Duration::from_secs(2), Duration::from_millis(7_600)] {
        let r = within(10, "lease", holder.request("report").lease(lease).lock()).await;
        match r {
            Err(Error::InvalidRequest { reason }) => assert!(reason.contains("lease"), "{reason}"),
            Ok(g) => {
                let (learned, granted) = silent_holder_race(&db, g, &proxy, "report", false).await;
                panic!(
                    "lease({lease:?}) with the default checks was accepted: the holder learned \
                     of the loss {learned:?} after the silence, another was granted the lock \
                     after {granted:?}"
                );
            }
            Err(e) => panic!("{e}"),
        }
    }
    // The shortest the rule allows with the default checks is accepted.
    let g = within(
        10,
        "lease 7.7 s",
        holder
            .request("report")
            .lease(Duration::from_millis(7_700))
            .lock(),
    )
    .await
    .unwrap();
    drop(g);
    drop(proxy);

    let checks = |url: String| {
        Locks::builder()
            .url(url)
            .check_interval(Duration::from_millis(200))
            .check_timeout(Duration::from_secs(1))
            .build()
    };
    let proxy = SilentProxy::start(target.clone()).await;
    let holder = within(10, "connect", checks(via(&db.url, proxy.port)))
        .await
        .unwrap();
    let g = within(
        10,
        "lease 2 s",
        holder
            .request("accepted")
            .lease(Duration::from_secs(2))
            .lock(),
    )
    .await
    .unwrap();
    let (learned, granted) = silent_holder_race(&db, g, &proxy, "accepted", false).await;
    eprintln!("lease 2 s, checks 200 ms / 1 s: learned {learned:?}, granted {granted:?}");
    assert!(
        learned < granted,
        "the holder learned of the loss after {learned:?}, another was granted the lock \
         after {granted:?}"
    );
    drop(proxy);

    // Control: the lock freed on the server at once while the holder is cut off.
    let proxy = SilentProxy::start(target).await;
    let holder = within(10, "connect", checks(via(&db.url, proxy.port)))
        .await
        .unwrap();
    let g = within(10, "lock", holder.lock("control")).await.unwrap();
    let (learned, granted) = silent_holder_race(&db, g, &proxy, "control", true).await;
    eprintln!("control: learned {learned:?}, granted {granted:?}");
    assert!(
        learned > granted,
        "control: the detector must see a holder that learns late ({learned:?} vs {granted:?})"
    );
}
