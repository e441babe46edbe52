//! `dblock exporter --db URL --listen ADDR`: the fleet's view over HTTP — `/metrics` in
//! the Prometheus text format and `/`, the page of who holds what — both from
//! `dblock::fleet` (one read of the server per request, within `--deadline`). Only the
//! serving is here: parse, bind, answer.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use clap::Args;
use dblock::fleet::{Exporter, Labels, NamePattern, page, text};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::{EXIT_UNAVAILABLE, EXIT_USAGE, exit_code, one_line};

#[derive(Args, Debug)]
pub struct ExporterArgs {
    /// Database URL (as for `run`).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Namespace the patterns' names are keyed in (as for `run`).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,

    /// Address to serve on: HOST:PORT (127.0.0.1:9188; 0.0.0.0:9188 for every
    /// interface).
    #[arg(long, value_name = "ADDR")]
    listen: String,

    /// Names that become `name` labels of their own: NAME, or PREFIX* for every name
    /// with that prefix (repeatable). Other locks count under name="(other)".
    #[arg(long = "name", value_name = "PATTERN", value_parser = pattern)]
    names: Vec<NamePattern>,

    /// Names counted together under one label, the pattern itself (name="autoland:*";
    /// repeatable).
    #[arg(long = "group", value_name = "PATTERN", value_parser = pattern)]
    groups: Vec<NamePattern>,

    /// Jobs run once per slot (`dblock run --once-per`) whose last successful run to
    /// report, by exact NAME (repeatable).
    #[arg(long = "job", value_name = "NAME")]
    jobs: Vec<String>,

    /// Elections to report (leader present, since when): NAME or PREFIX* (repeatable).
    #[arg(long = "election", value_name = "PATTERN", value_parser = pattern)]
    elections: Vec<NamePattern>,

    /// At most N names become labels of their own in one scrape.
    #[arg(long, value_name = "N", default_value_t = Labels::DEFAULT_MAX_NAMES)]
    max_names: usize,

    /// The longest a scrape may take, reading the server included.
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse, default_value = "5s")]
    deadline: Duration,

    /// How often the page at / reloads itself.
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse, default_value = "5s")]
    refresh: Duration,
}

fn pattern(s: &str) -> Result<NamePattern, String> {
    NamePattern::parse(s).map_err(|e| e.to_string())
}

/// What every request shares.
struct State {
    exporter: Exporter,
    refresh: Duration,
    /// The last scrape's outcome: 0 none yet, 1 ok, 2 failed (said once per change).
    last: AtomicU8,
}

pub async fn exporter(args: ExporterArgs) -> u8 {
    if args.deadline.is_zero() || args.refresh.is_zero() {
        errln!("dblock: --deadline and --refresh must be more than 0");
        return EXIT_USAGE;
    }
    // HOST:PORT, refused before anything is opened when it cannot be one.
    if !args
        .listen
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
    {
        errln!(
            "dblock: --listen {} is not HOST:PORT (say 127.0.0.1:9188)",
            crate::status::quoted(&args.listen)
        );
        return EXIT_USAGE;
    }
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            errln!(
                "dblock: cannot listen on {}: {e}",
                crate::status::shown(&args.listen)
            );
            return EXIT_UNAVAILABLE;
        }
    };
    crate::notice::embedded_default(args.db.as_deref());
    let mut builder = dblock::Locks::builder().max_connections(4);
    if let Some(url) = &args.db {
        builder = builder.url(url);
    }
    if let Some(ns) = &args.namespace {
        builder = builder.namespace(ns);
    }
    // A bad URL or namespace is refused now; a server that is down is reported by each
    // scrape until it is up.
    let exporter = match builder.clone().build().await {
        Ok(locks) => Exporter::new(&locks),
        Err(e) if exit_code(&e) == EXIT_USAGE => {
            errln!("dblock: {}", one_line(&e));
            return EXIT_USAGE;
        }
        Err(e) => {
            errln!(
                "dblock: exporter: cannot read the database yet ({}); serving, and trying \
                 again at each scrape",
                one_line(&e)
            );
            Exporter::connecting(builder)
        }
    };
    let mut labels = Labels::new().max_names(args.max_names);
    for p in args.names {
        labels = labels.name(p);
    }
    for p in args.groups {
        labels = labels.group(p);
    }
    let state = Arc::new(State {
        exporter: exporter
            .labels(labels)
            .elections(args.elections)
            .jobs(args.jobs)
            .deadline(args.deadline),
        refresh: args.refresh,
        last: AtomicU8::new(0),
    });
    let at = listener
        .local_addr()
        .map_or_else(|_| args.listen.clone(), |a| a.to_string());
    errln!("dblock: exporter serving http://{at}/ (metrics at /metrics)");
    serve(listener, state).await
}

/// Accepts connections until SIGINT or SIGTERM; each is served on a task of its own.
async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) -> u8 {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        errln!("dblock: cannot watch for SIGINT and SIGTERM");
        return EXIT_UNAVAILABLE;
    };
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                // Out of descriptors, a connection reset before it was accepted: go on.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = int.recv() => return 0,
            _ = term.recv() => return 0,
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(state.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                // A client that sends no request does not keep a task for ever.
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service);
            let _: Result<(), _> = conn.await;
        });
    }
}

async fn answer(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let head = req.method() == Method::HEAD;
    if req.method() != Method::GET && !head {
        return Ok(reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "only GET and HEAD\n".into(),
            head,
        ));
    }
    let path = req.uri().path();
    let (kind, body) = match path {
        "/metrics" => {
            let scraped = scrape(&state).await;
            (text::CONTENT_TYPE, scraped.text())
        }
        "/" => {
            let scraped = scrape(&state).await;
            (
                "text/html; charset=utf-8",
                page::render(&scraped, state.refresh),
            )
        }
        _ => {
            return Ok(reply(
                StatusCode::NOT_FOUND,
                "text/plain; charset=utf-8",
                "not found: / (who holds what) and /metrics\n".into(),
                head,
            ));
        }
    };
    Ok(reply(StatusCode::OK, kind, body, head))
}

/// One scrape, its failure (or recovery) said on stderr once per change.
async fn scrape(state: &State) -> dblock::fleet::Scraped {
    let scraped = state.exporter.scrape().await;
    let now = if scraped.ok() { 1 } else { 2 };
    let before = state.last.swap(now, Ordering::Relaxed);
    match (before, scraped.error()) {
        (b, Some(e)) if b != 2 => {
            errln!(
                "dblock: exporter: scrape failed: {}",
                crate::status::shown(e)
            )
        }
        (2, None) => errln!("dblock: exporter: scrapes succeed again"),
        _ => {}
    }
    scraped
}

fn reply(status: StatusCode, kind: &str, body: String, head: bool) -> Response<Full<Bytes>> {
    let len = body.len();
    let body = if head {
        Bytes::new()
    } else {
        Bytes::from(body)
    };
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    let h = r.headers_mut();
    let pairs = [
        ("content-type", kind.to_string()),
        ("content-length", len.to_string()),
        ("cache-control", "no-store".to_string()),
        ("x-content-type-options", "nosniff".to_string()),
        // No script may run on the page, whatever a lock name holds.
        (
            "content-security-policy",
            "default-src 'none'; style-src 'unsafe-inline'".to_string(),
        ),
    ];
    for (k, v) in pairs {
        if let Ok(v) = hyper::header::HeaderValue::from_str(&v) {
            h.insert(k, v);
        }
    }
    r
}
