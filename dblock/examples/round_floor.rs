//! dblock's uncontended round without dblock: what the protocol and the client's layers
//! cost, apart from dblock's own work, so that `dblock bench`'s and `lock_loop`'s figures
//! can be read against them (docs/performance.md, twentieth session).
//!
//! ```text
//! cargo run --release -p dblock --example round_floor -- [HOST:PORT] [--via raw|driver|inline|handback|simple] [--workers 8] [--seconds 3]
//! ```
//!
//! Each worker opens its own session (user `postgres`, database `test`, trust
//! authentication, no TLS: the machine's test server) and, in a loop, sends what dblock
//! sends for a transaction-scoped try of one of 64 keys of its own, the last lock released
//! by the round's head — `Bind`/`Execute` of a prepared `ROLLBACK AND CHAIN`,
//! `Bind`/`Execute` of a prepared `SELECT pg_catalog.pg_try_advisory_xact_lock($1)` with
//! the key, `Close` of the portal, `Parse` of the comment naming the lock, `Sync` — and
//! reads the reply to its `ReadyForQuery`, checking the lock was granted:
//!
//! - `--via driver` (the default): through tokio-postgres (dblock's copy,
//!   `Client::send_encoded`), its connection on a task of its own — dblock's connection
//!   layer, without dblock;
//! - `--via raw`: the same bytes written and the reply read on the socket by the
//!   requesting task itself, with no connection task between;
//! - `--via inline`: through tokio-postgres, its connection polled by the requesting task
//!   itself while it awaits the reply (never between rounds: an upper bound, as nothing
//!   watches the idle connection);
//! - `--via handback`: as `inline`, with a task of its own watching the connection between
//!   rounds, woken after each round to take it back (what a connection dblock still
//!   watches while a lock is held would need);
//! - `--via simple`: pgbench's floor, `SELECT pg_advisory_xact_lock(k)` as one simple
//!   query in autocommit, over the raw socket.
//!
//! One JSON line reports the cycles a second and this process's CPU a cycle (user and
//! kernel, µs, Linux). The runtime has a thread per core, as the `dblock` program's.
//! Figures, not assertions.

use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use postgres_protocol::IsNull;
use postgres_protocol::message::{backend, frontend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// This process's user and kernel CPU time so far, in ticks of 10 ms (as `lock_loop`'s).
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let mut next = || fields.next()?.parse::<u64>().ok();
    Some((next()?, next()?))
}

#[derive(Clone, Copy, PartialEq)]
enum Via {
    Raw,
    Driver,
    Inline,
    Handback,
    Simple,
}

/// One round's messages for `key` (see the module's docs).
fn round(out: &mut BytesMut, key: i64, comment: &str) -> Result<(), Failure> {
    let none = |_: i64, _: &mut BytesMut| Ok::<_, Failure>(IsNull::No);
    frontend::bind("", "c", None::<i16>, [] as [i64; 0], none, [], out)
        .map_err(|_| "bind failed")?;
    frontend::execute("", 0, out)?;
    let int8 = |k: i64, b: &mut BytesMut| {
        b.extend_from_slice(&k.to_be_bytes());
        Ok::<_, Failure>(IsNull::No)
    };
    frontend::bind("", "l", Some(1), [key], int8, [], out).map_err(|_| "bind failed")?;
    frontend::execute("", 0, out)?;
    frontend::close(b'P', "", out)?;
    frontend::parse("", comment, [], out)?;
    frontend::sync(out);
    Ok(())
}

/// What every session prepares first: the round's two statements (one reply).
fn setup(out: &mut BytesMut) -> Result<(), Failure> {
    frontend::parse("c", "ROLLBACK AND CHAIN", [], out)?;
    let lock = "SELECT pg_catalog.pg_try_advisory_xact_lock($1)";
    frontend::parse("l", lock, [20], out)?;
    frontend::sync(out);
    Ok(())
}

/// The transaction the first round's `ROLLBACK AND CHAIN` ends.
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// Reads backend messages to the `ReadyForQuery`; the last row's first value was `t`.
async fn reply(socket: &mut TcpStream, buf: &mut BytesMut) -> Result<bool, Failure> {
    let mut granted = false;
    loop {
        while let Some(message) = backend::Message::parse(buf)? {
            match message {
                backend::Message::ReadyForQuery(_) => return Ok(granted),
                backend::Message::ErrorResponse(_) => return Err("the server refused".into()),
                // A row's body: its column count (2 bytes), the first's length (4), then it.
                backend::Message::DataRow(row) => granted = row.buffer().get(4) == Some(&b't'),
                _ => {}
            }
        }
        buf.reserve(4096);
        if socket.read_buf(buf).await? == 0 {
            return Err("the server closed the connection".into());
        }
    }
}

async fn raw_worker(addr: String, w: usize, stop: Instant, via: Via) -> Result<u64, Failure> {
    let mut socket = TcpStream::connect(&addr).await?;
    socket.set_nodelay(true)?;
    let (mut out, mut buf) = (BytesMut::new(), BytesMut::with_capacity(8192));
    frontend::startup_message([("user", "postgres"), ("database", "test")], &mut out)?;
    socket.write_all(&out.split()).await?;
    reply(&mut socket, &mut buf).await?;
    setup(&mut out)?;
    frontend::query(BEGIN, &mut out)?;
    socket.write_all(&out.split()).await?;
    reply(&mut socket, &mut buf).await?;
    reply(&mut socket, &mut buf).await?;
    let comment = format!("/* dblock ns=floor name=loop:{w} holder=round_floor */");
    let mut n = 0u64;
    while Instant::now() < stop {
        let key = (w as i64) * 1000 + (n % 64) as i64;
        match via {
            Via::Simple => {
                frontend::query(&format!("SELECT pg_advisory_xact_lock({key})"), &mut out)?
            }
            _ => round(&mut out, key, &comment)?,
        }
        socket.write_all(&out.split()).await?;
        let granted = reply(&mut socket, &mut buf).await?;
        if via != Via::Simple && !granted {
            return Err(format!("key {key} not granted").into());
        }
        buf.advance(0);
        n += 1;
    }
    Ok(n)
}

async fn driver_worker(addr: String, w: usize, stop: Instant) -> Result<u64, Failure> {
    let (host, port) = addr.rsplit_once(':').ok_or("HOST:PORT")?;
    let conninfo = format!("host={host} port={port} user=postgres dbname=test sslmode=disable");
    let (client, connection) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let mut out = BytesMut::new();
    setup(&mut out)?;
    let mut replies = client.send_encoded(out.split().freeze())?;
    while !matches!(replies.next().await?, backend::Message::ReadyForQuery(_)) {}
    client.simple_query(BEGIN).await?;
    let comment = format!("/* dblock ns=floor name=loop:{w} holder=round_floor */");
    let mut n = 0u64;
    while Instant::now() < stop {
        let key = (w as i64) * 1000 + (n % 64) as i64;
        round(&mut out, key, &comment)?;
        let mut replies = client.send_encoded(out.split().freeze())?;
        let mut granted = false;
        loop {
            match replies.next().await? {
                backend::Message::ReadyForQuery(_) => break,
                backend::Message::DataRow(row) => granted = row.buffer().get(4) == Some(&b't'),
                _ => {}
            }
        }
        if !granted {
            return Err(format!("key {key} not granted").into());
        }
        n += 1;
    }
    Ok(n)
}

/// A connection polled by whoever drives it: the requesting task during a round, the
/// watching task between rounds (`--via handback`).
struct Shared {
    /// The connection, and whether a round drives it (the watching task then leaves it
    /// alone). One lock for both: the watcher's look and its poll cannot straddle a
    /// round's start, so the round's task is always the last to register for the reply.
    state: std::sync::Mutex<State>,
    watcher: futures_util::task::AtomicWaker,
}

type Connection =
    tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>;

/// The connection, and whether a round drives it.
type State = (Pin<Box<Connection>>, bool);

use std::pin::Pin;
use std::task::Poll;

impl Shared {
    fn state(&self) -> Result<std::sync::MutexGuard<'_, State>, Failure> {
        self.state
            .lock()
            .map_err(|_| "the connection's lock was poisoned".into())
    }
}

/// Awaits a round's reply, polling the connection in this task; whether the lock was
/// granted.
async fn drive_round(
    shared: &Shared,
    replies: &mut tokio_postgres::EncodedResponses,
) -> Result<bool, Failure> {
    let mut granted = false;
    std::future::poll_fn(|cx| {
        match shared.state() {
            Ok(mut state) => {
                if state.0.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err("the connection ended".into()));
                }
            }
            Err(e) => return Poll::Ready(Err(e)),
        }
        loop {
            match replies.poll_next(cx) {
                Poll::Ready(Ok(backend::Message::ReadyForQuery(_))) => {
                    return Poll::Ready(Ok(granted));
                }
                Poll::Ready(Ok(backend::Message::DataRow(row))) => {
                    granted = row.buffer().get(4) == Some(&b't');
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await
}

/// The watching task of `--via handback`: polls the connection between rounds.
async fn watch(shared: std::sync::Arc<Shared>) {
    std::future::poll_fn(|cx| {
        shared.watcher.register(cx.waker());
        match shared.state() {
            Ok(mut state) if !state.1 => state.0.as_mut().poll(cx).map(|_| ()),
            Ok(_) => Poll::Pending,
            Err(_) => Poll::Ready(()),
        }
    })
    .await
}

/// Marks whether a round drives the connection.
fn in_round(shared: &Shared, on: bool) -> Result<(), Failure> {
    shared.state()?.1 = on;
    Ok(())
}

async fn inline_worker(addr: String, w: usize, stop: Instant, via: Via) -> Result<u64, Failure> {
    let (host, port) = addr.rsplit_once(':').ok_or("HOST:PORT")?;
    let conninfo = format!("host={host} port={port} user=postgres dbname=test sslmode=disable");
    let (client, connection) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await?;
    let shared = std::sync::Arc::new(Shared {
        state: std::sync::Mutex::new((Box::pin(connection), true)),
        watcher: futures_util::task::AtomicWaker::new(),
    });
    if via == Via::Handback {
        tokio::spawn(watch(shared.clone()));
    }
    let mut out = BytesMut::new();
    setup(&mut out)?;
    let mut replies = client.send_encoded(out.split().freeze())?;
    drive_round(&shared, &mut replies).await?;
    frontend::query(BEGIN, &mut out)?;
    let mut replies = client.send_encoded(out.split().freeze())?;
    drive_round(&shared, &mut replies).await?;
    let comment = format!("/* dblock ns=floor name=loop:{w} holder=round_floor */");
    let mut n = 0u64;
    while Instant::now() < stop {
        let key = (w as i64) * 1000 + (n % 64) as i64;
        round(&mut out, key, &comment)?;
        if via == Via::Handback {
            in_round(&shared, true)?;
        }
        let mut replies = client.send_encoded(out.split().freeze())?;
        let granted = drive_round(&shared, &mut replies).await?;
        if via == Via::Handback {
            in_round(&shared, false)?;
            shared.watcher.wake();
        }
        if !granted {
            return Err(format!("key {key} not granted").into());
        }
        n += 1;
    }
    Ok(n)
}

fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let addr = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .cloned()
        .unwrap_or_else(|| "127.0.0.1:5432".to_string());
    let via = match opt("--via").as_deref() {
        None | Some("driver") => Via::Driver,
        Some("raw") => Via::Raw,
        Some("inline") => Via::Inline,
        Some("handback") => Via::Handback,
        Some("simple") => Via::Simple,
        Some(other) => {
            return Err(format!("--via {other}: raw, driver, inline, handback or simple").into());
        }
    };
    let workers: usize = opt("--workers").map_or(Ok(8), |v| v.parse())?;
    let seconds: f64 = opt("--seconds").map_or(Ok(3.0), |v| v.parse())?;
    if workers == 0 || !(seconds > 0.0 && seconds <= 3600.0) {
        return Err("--workers must be at least 1, --seconds more than 0 and at most 3600".into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let before = cpu_ticks();
        let start = Instant::now();
        let stop = start + Duration::from_secs_f64(seconds);
        let tasks: Vec<_> = (0..workers)
            .map(|w| {
                let addr = addr.clone();
                tokio::spawn(async move {
                    match via {
                        Via::Driver => driver_worker(addr, w, stop).await,
                        Via::Inline | Via::Handback => inline_worker(addr, w, stop, via).await,
                        _ => raw_worker(addr, w, stop, via).await,
                    }
                })
            })
            .collect();
        let mut cycles = 0;
        for t in tasks {
            cycles += t.await??;
        }
        let elapsed = start.elapsed();
        let per_cycle = |ticks: u64| ticks as f64 * 10_000.0 / cycles.max(1) as f64;
        let (user, system) = match (before, cpu_ticks()) {
            (Some(b), Some(a)) => (
                format!("{:.3}", per_cycle(a.0.saturating_sub(b.0))),
                format!("{:.3}", per_cycle(a.1.saturating_sub(b.1))),
            ),
            _ => ("null".to_string(), "null".to_string()),
        };
        let name = match via {
            Via::Raw => "raw",
            Via::Driver => "driver",
            Via::Inline => "inline",
            Via::Handback => "handback",
            Via::Simple => "simple",
        };
        println!(
            "{{\"via\": \"{name}\", \"workers\": {workers}, \"ops_per_sec\": {:.1}, \"user_us\": {user}, \"system_us\": {system}}}",
            cycles as f64 / elapsed.as_secs_f64(),
        );
        Ok(())
    })
}
