//! Connection health on dblock's own connections: the bounds within which a dead peer
//! is noticed.
//!
//! | situation | noticed by | bound (defaults) |
//! |-----------|------------|------------------|
//! | a held lock's connection goes silent | a check every [`check_interval`](crate::Builder::check_interval), failed after [`check_timeout`](crate::Builder::check_timeout) | 1 s + 5 s |
//! | an idle pooled connection, before it carries a request | a check when it has been idle for `check_interval` or longer (a connection used more recently goes out unchecked: no round trip on the hot path) | `check_timeout` (5 s), then a new connection |
//! | a request or a wait on a peer gone without a FIN (host down, cable cut, NAT state dropped) | TCP keepalives after 30 s of silence, and `TCP_USER_TIMEOUT` | 30 s + 30 s |
//! | opening a connection | `connect_timeout` | 10 s |
//! | a wait with a deadline (`try_lock_for`) | the deadline, then 2 s for the server's answer | deadline + 2 s |
//!
//! The TCP settings apply unless the URL sets them (`keepalives_idle`,
//! `keepalives_interval`, `keepalives_retries`, `tcp_user_timeout`). The kernel's
//! keepalives cannot tell a server that is busy from one that is gone only when
//! something between answers for it (a proxy that stops forwarding but keeps its
//! sockets open); then only the application-level checks above apply, and a wait with
//! no deadline lasts until that proxy closes the connection.

use std::time::Duration;

/// How long the peer may leave sent data unacknowledged (and, on Linux, keepalive
/// probes unanswered) before the kernel drops the connection.
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Time between keepalive probes once the first is unanswered.
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Unanswered keepalive probes before the connection is dropped (where
/// `TCP_USER_TIMEOUT` does not govern them).
pub(crate) const KEEPALIVE_RETRIES: u32 = 3;

/// The TCP settings above, where the URL left them unset.
pub(crate) fn apply(config: &mut tokio_postgres::Config) {
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVE_RETRIES);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_peers_are_bounded_unless_the_url_says_otherwise() {
        let mut c: tokio_postgres::Config = "postgres://u@h/db"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        apply(&mut c);
        assert_eq!(c.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        assert_eq!(c.get_keepalives_interval(), Some(KEEPALIVE_INTERVAL));
        assert_eq!(c.get_keepalives_retries(), Some(KEEPALIVE_RETRIES));
        assert!(c.get_keepalives());
        let mut c: tokio_postgres::Config = "postgres://u@h/db?tcp_user_timeout=7"
            .parse()
            .unwrap_or_else(|e| panic!("{e}"));
        apply(&mut c);
        assert_eq!(c.get_tcp_user_timeout(), Some(&Duration::from_secs(7)));
    }
}
