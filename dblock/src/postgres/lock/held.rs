//! A lock held on a connection of its own, pinned for the lock's life: the guard's
//! PostgreSQL half when the lock is not multiplexed.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use super::plan::{release_sql, release_statements};
use crate::error::{Error, LossReason};
use crate::postgres::conn::wire::{Link, QueryError, Release};
use crate::postgres::conn::{Armed, Conn};
use crate::postgres::sql::first_value;
use crate::raw::{BoxFuture, RawHeld, Req, Scope};

/// A lock on a connection of its own.
pub(crate) struct Pinned {
    /// `None` once the connection was given up (a cut-off check): the lock is then lost,
    /// as `link` says.
    conn: Option<Conn>,
    link: Arc<Link>,
    /// The release statement (no allocation for a transaction-scoped lock's).
    release: Cow<'static, str>,
    /// How many statements `release` is.
    release_statements: usize,
    scope: Scope,
    /// How long a release may go unanswered before the connection is given up.
    release_timeout: Duration,
}

impl Pinned {
    pub(crate) fn new(conn: Conn, req: &Req<'_>, release_timeout: Duration) -> Pinned {
        Pinned {
            link: conn.link().clone(),
            conn: Some(conn),
            release: release_sql(req.scope, req.mode, req.key, req.lease.is_some()),
            release_statements: release_statements(req.scope, req.lease.is_some()),
            scope: req.scope,
            release_timeout,
        }
    }

    /// A grant of several keys on one connection, released by `release`
    /// (`statements` statements; a session unlock answering `t` first).
    pub(crate) fn with_release(
        conn: Conn,
        scope: Scope,
        release: Cow<'static, str>,
        statements: usize,
        release_timeout: Duration,
    ) -> Pinned {
        Pinned {
            link: conn.link().clone(),
            conn: Some(conn),
            release,
            release_statements: statements,
            scope,
            release_timeout,
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
        let res =
            match tokio::time::timeout(self.release_timeout, armed.conn().query(&self.release))
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
                let held = self.scope == Scope::Transaction
                    || first_value(&rows, 0).as_deref() == Some("t");
                conn.recycle();
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
        if let Some(conn) = self.conn.take() {
            conn.link().set_holding(false);
            let release = match self.scope {
                // The lock's transaction is open: a request may chain it.
                Scope::Transaction => Release::Rollback { chain: true },
                Scope::Session => Release::Unlock {
                    sql: std::mem::take(&mut self.release),
                    statements: self.release_statements,
                },
            };
            if conn.send_release(release) {
                conn.recycle();
            } else {
                conn.abandon();
            }
        }
    }
}

impl RawHeld for Pinned {
    fn loss(&self) -> Option<LossReason> {
        Pinned::loss(self)
    }

    fn lost(&self) -> BoxFuture<'static, LossReason> {
        Box::pin(self.link.watch())
    }

    fn check(&mut self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(Pinned::check(self))
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), Error>> {
        Box::pin(Pinned::release(*self))
    }
}
