//! The task that runs one of dblock's own connections: its I/O, the statements
//! deferred to it, and the health checks while the connection is watched.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use tokio_postgres::Client;

use super::outbox::{Outbox, send_if_there};
use super::wire::{Link, LostOnDrop, QueryError};
use crate::error::LossReason;

/// Runs a connection: its I/O, and while it is watched ([`Link::set_watched`]), a
/// health check every interval. Marks the link lost when the connection ends or a
/// check goes unanswered for `timeout`; returning drops the socket, which ends the
/// server session.
///
/// One hand-written poll rather than a `select!` loop: it runs twice per exchange (to
/// write the request, to read the reply), so it does no more than it must each time —
/// no future is built or registered anew, and the timers are polled only while they
/// can matter.
pub(crate) async fn drive(
    connection: tokio_postgres::Connection<tokio_postgres::Socket, super::tls::Stream>,
    client: Weak<Client>,
    link: Arc<Link>,
    outbox: Arc<Outbox>,
    interval: Duration,
    timeout: Duration,
) {
    let _dropped = LostOnDrop(link.clone());
    type Ping = Pin<Box<dyn Future<Output = Result<(), QueryError>> + Send>>;
    let mut connection = std::pin::pin!(connection);
    // A check in flight, and when it fails if still unanswered.
    let mut ping: Option<(Ping, Pin<Box<tokio::time::Sleep>>)> = None;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let lost = std::future::poll_fn(|cx| {
        if let Poll::Ready(closed) =
            outbox.poll_task(cx, |sql| send_if_there(|| client.upgrade(), sql))
        {
            return Poll::Ready(closed);
        }
        if let Poll::Ready(end) = connection.as_mut().poll(cx) {
            let message = match end {
                Ok(()) => "closed by dblock".to_string(),
                Err(e) => QueryError::from_driver(e).into_message(),
            };
            return Poll::Ready(LossReason::ConnectionClosed { message });
        }
        loop {
            if let Some((p, overdue)) = &mut ping {
                match p.as_mut().poll(cx) {
                    Poll::Ready(res) => {
                        ping = None;
                        if let Err(QueryError::Lost { message }) = res {
                            link.mark_lost(LossReason::ConnectionClosed { message });
                        }
                    }
                    // Failed the moment its deadline passes, not at the next tick.
                    Poll::Pending => {
                        if overdue.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(LossReason::Unresponsive { after: timeout });
                        }
                    }
                }
            }
            if tick.poll_tick(cx).is_pending() {
                return Poll::Pending;
            }
            // A tick: check the connection if it is watched and no check is out.
            if !link.watched() || ping.is_some() {
                continue;
            }
            if let Some(c) = client.upgrade() {
                // The empty query, or a comment: the same to the server.
                let sql = link.check_sql();
                let p: Ping = Box::pin(async move {
                    c.simple_query(&sql)
                        .await
                        .map(|_| ())
                        .map_err(QueryError::from_driver)
                });
                let overdue = Box::pin(tokio::time::sleep(timeout));
                ping = Some((p, overdue));
            }
        }
    })
    .await;
    link.mark_lost(lost);
}
