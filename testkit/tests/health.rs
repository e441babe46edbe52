//! Connection health on PostgreSQL: a peer that goes silent without a FIN, simulated by a
//! small TCP proxy in the test that stops forwarding on the connections it has (keeping
//! their sockets open) while new connections pass as usual; and a held lock's check, cut
//! off mid-way, on every kind of connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use dblock::{Locks, Scope};
use dblock_testkit::testdb::within;
use dblock_testkit::{PgSchema, pg_url};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Forwards 127.0.0.1:port to the tests' PostgreSQL. `freeze()` makes every connection
/// open so far swallow what it gets, both ways, without closing.
struct Proxy {
    port: u16,
    flags: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start() -> Proxy {
        let base: tokio_postgres::Config = pg_url().parse().unwrap();
        let target = match base.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => {
                format!("{h}:{}", base.get_ports().first().copied().unwrap_or(5432))
            }
            _ => "127.0.0.1:5432".to_string(),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let flags: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let f = flags.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&target).await else {
                    continue;
                };
                let on = Arc::new(AtomicBool::new(true));
                f.lock().unwrap().push(on.clone());
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, on.clone()));
                tokio::spawn(pipe(sr, cw, on));
            }
        });
        Proxy { port, flags, task }
    }

    fn freeze(&self) {
        for f in self.flags.lock().unwrap().iter() {
            f.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    on: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                // Frozen: read and dropped, so the kernel keeps acknowledging and the
                // other side sees nothing amiss at the TCP level.
                if on.load(Ordering::SeqCst) && to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// An idle pooled connection whose peer went silent is checked before it carries the
/// next lock request: the request goes out on a new connection and is granted, instead
/// of waiting for ever for an answer that cannot come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_gone_silent_is_checked_before_it_carries_a_request() {
    let s = PgSchema::new("health_idle").await;
    let proxy = Proxy::start().await;
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}?options=-c%20dblock.namespace%3D{}&application_name={}",
        pg_url()
            .parse::<tokio_postgres::Config>()
            .unwrap()
            .get_user()
            .unwrap_or("postgres"),
        proxy.port,
        pg_url()
            .parse::<tokio_postgres::Config>()
            .unwrap()
            .get_dbname()
            .unwrap_or("test"),
        s.name,
        s.app
    );
    let check = Duration::from_millis(200);
    let locks = tokio::time::timeout(
        Duration::from_secs(10),
        dblock::Locks::builder()
            .url(&url)
            .check_interval(check)
            .check_timeout(Duration::from_millis(500))
            .build(),
    )
    .await
    .unwrap()
    .unwrap();
    let g = locks.lock("a").await.unwrap();
    g.release().await.unwrap();
    proxy.freeze();
    // Idle for longer than the check interval: the connection is due for a check.
    tokio::time::sleep(check * 2).await;
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(20), locks.lock("a")).await;
    let took = t0.elapsed();
    let g = r
        .unwrap_or_else(|_| panic!("lock() hung on the silent connection"))
        .unwrap();
    eprintln!("granted on a new connection after {took:?} (check timeout 500 ms)");
    assert_eq!(s.advisory(locks.key("a").unwrap()).await.len(), 1);
    g.release().await.unwrap();
}

/// Cancelling `check` leaves the lock held, on every kind of connection alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_check_keeps_the_lock() {
    let s = PgSchema::new("check_cancel").await;
    let pool = sqlx::PgPool::connect(&s.url).await.unwrap();
    let handles = [
        ("pinned", Locks::connect(&s.url).await.unwrap()),
        (
            "sqlx",
            Locks::builder()
                .sqlx_pool(pool)
                .namespace(&s.name)
                .build()
                .await
                .unwrap(),
        ),
        (
            "multiplexed",
            Locks::builder()
                .url(&s.url)
                .scope(Scope::Session)
                .multiplex(2)
                .build()
                .await
                .unwrap(),
        ),
    ];
    let other = Locks::connect(&s.url).await.unwrap();
    for (kind, locks) in &handles {
        let name = format!("checked-{kind}");
        let mut g = within(10, "lock", locks.lock(&name)).await.unwrap();
        let mut cut_off = 0;
        for round in 0..5 {
            // Polled once (the check is sent), then dropped before its reply.
            let mut check = Box::pin(g.check());
            match futures_poll_once(check.as_mut()).await {
                None => cut_off += 1,
                // Answered within the one poll (a fast server, another worker thread
                // driving the connection): not a cancellation, but it must be an answer.
                Some(r) => r.unwrap_or_else(|e| panic!("{kind}, round {round}: {e}")),
            }
            drop(check);
            assert!(
                g.is_held(),
                "{kind}, round {round}: still held after a cancelled check"
            );
            within(10, "check", g.check())
                .await
                .unwrap_or_else(|e| panic!("{kind}, round {round}: {e}"));
            let r = within(10, "try_lock elsewhere", other.try_lock(&name))
                .await
                .unwrap();
            assert!(r.is_none(), "{kind}, round {round}: nobody else gets it");
        }
        assert!(cut_off > 0, "{kind}: no check was cut off mid-way");
        within(10, "release", g.release())
            .await
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
}

/// Polls `f` once: `Some(output)` if it finished at once.
async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}
