//! A lock held on a connection of its own, pinned for the lock's life: the guard's
//! PostgreSQL half when the lock is not multiplexed.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use super::messages::Release;
use super::relay::{Baton, Relayed};
use crate::error::{Error, LossReason};
use crate::postgres::conn::wire::{CheckSql, Link, QueryError};
use crate::postgres::conn::{Armed, Conn};
use crate::postgres::sql::first_value;
use crate::raw::{BoxFuture, RawHeld, Scope};
use crate::sys::Peer;

/// A lock on a connection of its own.
pub(crate) struct Pinned {
    /// `None` once the connection was given up (a cut-off check): the lock is then lost,
    /// as `link` says.
    conn: Option<Conn>,
    link: Arc<Link>,
    /// What releases it.
    release: Release,
    /// How long a release may go unanswered before the connection is given up.
    release_timeout: Duration,
    /// This process's turn at the key, when the request stood in its line (`relay.rs`):
    /// dropped, the lock goes to the next task in line as it is, or the turn to ask.
    pub(crate) baton: Option<Baton<Pinned>>,
}

impl Pinned {
    /// The lock (or set) just granted on `conn`, released by `release`: from now on
    /// the connection is checked every interval, its checks sending `check_sql` (the
    /// lock's comment) when given.
    pub(crate) fn new(
        conn: Conn,
        release: Release,
        check_sql: Option<CheckSql>,
        release_timeout: Duration,
    ) -> Pinned {
        let link = conn.link().clone();
        link.set_watched(true);
        if let Some(sql) = check_sql {
            link.set_check_sql(sql);
        }
        Pinned {
            link,
            conn: Some(conn),
            release,
            release_timeout,
            baton: None,
        }
    }

    fn loss(&self) -> Option<LossReason> {
        self.link.loss()
    }

    async fn check(&mut self) -> Result<(), Error> {
        if let Some(reason) = self.link.loss() {
            return Err(Error::LockLost { reason });
        }
        let Some(conn) = self.conn.as_ref() else {
            return Err(Error::LockLost {
                reason: LossReason::ConnectionClosed {
                    message: "the lock's connection was given up".into(),
                },
            });
        };
        // Cancel safe: cut off mid-way, the reply is read and dropped by the connection,
        // which keeps the lock (as on a multiplexing handle's shared connections).
        let res = conn.check().await;
        match (res, self.link.loss()) {
            (_, Some(reason)) => Err(Error::LockLost { reason }),
            (Ok(_), None) => Ok(()),
            (Err(QueryError::Lost { message }), None) => Err(Error::LockLost {
                reason: LossReason::ConnectionClosed { message },
            }),
            (Err(e), None) => Err(e.into_error()),
        }
    }

    /// A duplicate of the lock's connection's socket, found among this process's
    /// descriptors by what the server says of the session (tokio-postgres exposes no
    /// descriptor): its client port and its own over TCP, its process id over a Unix
    /// socket. From now on the connection is shut down, not reused, when the lock ends.
    async fn share(&mut self) -> Result<OwnedFd, Error> {
        if let Some(reason) = self.link.loss() {
            return Err(Error::LockLost { reason });
        }
        if let Some(dup) = self.link.exported_dup() {
            return dup.map_err(|e| Error::io("duplicating the lock's socket", e));
        }
        let conn = match self.conn.as_ref() {
            Some(c @ Conn::Native(_)) => c,
            Some(Conn::Sqlx(_)) => {
                return Err(Error::unsupported(
                    crate::error::Capability::ShareWithChild,
                    "a lock on a connection borrowed from an sqlx pool cannot be shared with \
                     a child (sqlx keeps the socket); use dblock's own connections \
                     (Locks::connect)",
                ));
            }
            None => {
                return Err(Error::LockLost {
                    reason: LossReason::ConnectionClosed {
                        message: "the lock's connection was given up".into(),
                    },
                });
            }
        };
        // Cancel safe: a reply no one waits for is read and dropped by the connection.
        // The held lock's comment goes with it, so that `pg_stat_activity.query` keeps
        // naming the lock (`dblock status`).
        let sql = format!(
            "SELECT pg_catalog.inet_client_port(); SELECT pg_catalog.inet_server_port(); SELECT pg_catalog.pg_backend_pid() {}",
            self.link.check_sql()
        );
        let rows = conn.query(&sql).await.map_err(QueryError::into_error)?;
        let port = |i: usize| first_value(&rows, i).and_then(|v| v.parse::<u16>().ok());
        let peer = match (port(0), port(1)) {
            (Some(local), Some(remote)) => Peer::Tcp { local, remote },
            _ => match first_value(&rows, 2).and_then(|v| v.parse().ok()) {
                Some(pid) => Peer::UnixPid(pid),
                None => {
                    return Err(Error::unexpected(
                        "the server did not say which session this is",
                    ));
                }
            },
        };
        let fd = crate::sys::find_socket(peer).map_err(|e| {
            Error::unsupported(
                crate::error::Capability::ShareWithChild,
                format!("the lock's PostgreSQL connection cannot be shared with a child: {e}"),
            )
        })?;
        let keep = fd
            .try_clone()
            .map_err(|e| Error::io("duplicating the lock's socket", e))?;
        self.link.export(keep);
        Ok(fd)
    }

    async fn release(mut self) -> Result<(), Error> {
        if let Some(reason) = self.link.loss() {
            return Err(Error::LockLost { reason });
        }
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        // Bounded: a server that stops answering must not hold the caller (the watchdog
        // is off once the release starts). Past the bound the connection is given up,
        // which frees the lock on the server when it notices.
        let armed = Armed::new(conn);
        let res = match tokio::time::timeout(
            self.release_timeout,
            armed.conn().query(self.release.sql()),
        )
        .await
        {
            Ok(res) => res,
            Err(_) => {
                drop(armed);
                return Err(Error::LockLost {
                    reason: LossReason::Unresponsive {
                        after: self.release_timeout,
                    },
                });
            }
        };
        let conn = armed.disarm();
        match res {
            Ok(rows) => {
                // pg_advisory_unlock answers f when the session did not hold the lock.
                let held = self.release.scope() == Scope::Transaction
                    || first_value(&rows, 0).as_deref() == Some("t");
                // Shared with a child: ended for every copy, never reused.
                match conn.link().shut_down_exported() {
                    true => drop(conn),
                    false => conn.recycle(),
                }
                if held {
                    Ok(())
                } else {
                    Err(Error::LockLost {
                        reason: LossReason::ConnectionClosed {
                            message: "the session no longer held the lock (a pooler between \
                                      dblock and the server may have switched sessions)"
                                .into(),
                        },
                    })
                }
            }
            Err(e) => {
                conn.abandon();
                Err(match e {
                    QueryError::Lost { message } => Error::LockLost {
                        reason: LossReason::ConnectionClosed { message },
                    },
                    other => other.into_error(),
                })
            }
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // A task of this process waits for the lock: it is handed over as it is, still
        // held on the server, while its connection is healthy and within the window.
        if let Some(baton) = self.baton.take() {
            match self.conn.take() {
                Some(conn)
                    if baton.may_hand_over()
                        && self.link.loss().is_none()
                        && !self.link.is_exported() =>
                {
                    let next = Pinned {
                        conn: Some(conn),
                        link: self.link.clone(),
                        release: std::mem::replace(
                            &mut self.release,
                            Release::of_all(Scope::Transaction, false),
                        ),
                        release_timeout: self.release_timeout,
                        baton: None,
                    };
                    // Nobody in line after all: released below, as without a line.
                    if let Some(mut back) = baton.hand_over(next) {
                        self.conn = back.conn.take();
                        std::mem::swap(&mut self.release, &mut back.release);
                    }
                }
                conn => {
                    self.conn = conn;
                    // The release is queued first, then the next task asks the server.
                    self.release_conn();
                    drop(baton);
                }
            }
        }
        self.release_conn();
    }
}

impl Pinned {
    /// Releases the lock on the server when the guard drops: deferred to the
    /// connection, which goes back to its pool.
    fn release_conn(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.link().set_watched(false);
            // Shared with a child: ending the connection for every copy releases the
            // lock; nothing to send, and the connection is never reused.
            if conn.link().shut_down_exported() {
                drop(conn);
                return;
            }
            if conn.defer(self.release.deferred()) {
                conn.recycle();
            } else {
                conn.abandon();
            }
        }
    }
}

impl Relayed for Pinned {
    fn baton(&mut self) -> &mut Option<Baton<Pinned>> {
        &mut self.baton
    }
}

impl RawHeld for Pinned {
    fn loss(&self) -> Option<LossReason> {
        Pinned::loss(self)
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        Box::pin(self.link.lost())
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(Pinned::check(self))
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(Pinned::release(*self))
    }

    fn share(&mut self) -> BoxFuture<'_, Result<Vec<OwnedFd>, Error>> {
        Box::pin(async move { Pinned::share(self).await.map(|fd| vec![fd]) })
    }
}
