//! The system calls of handing a held lock to a child process (see
//! [`LockGuard::share_with_child`](crate::LockGuard::share_with_child)): finding the
//! socket of a connection a driver opened (sqlx and tokio-postgres expose no
//! descriptor), and keeping a duplicate open across `exec`. With `sqlite/sys.rs`, the
//! only `unsafe` of the library; every block says why it is sound.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};

/// Which connection's socket to look for among this process's descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    /// A TCP connection from local port `local` to remote port `remote`, as the server
    /// saw it (its client's port and its own).
    Tcp { local: u16, remote: u16 },
    /// A Unix-socket connection whose peer is process `pid` (the server process serving
    /// the connection, as on PostgreSQL).
    UnixPid(i32),
}

/// A duplicate (close-on-exec) of the one socket of this process that is `peer`'s
/// connection; an error if there is none, or more than one.
pub(crate) fn find_socket(peer: Peer) -> io::Result<OwnedFd> {
    // One socket may have several descriptors (duplicates): told apart by inode.
    let mut found: Vec<(u64, OwnedFd)> = Vec::new();
    for fd in open_descriptors()? {
        // SAFETY: `fd` is borrowed only for this iteration, during which this function
        // closes nothing; a descriptor another thread closes meanwhile makes the calls
        // below fail (EBADF) or look at whatever took its number, which the checks on
        // the duplicate below catch.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        if is_peer(fd, peer) {
            let Some(inode) = socket_inode(fd) else {
                continue;
            };
            if !found.iter().any(|(i, _)| *i == inode) {
                found.push((inode, fd.try_clone_to_owned()?));
            }
        }
    }
    let mut found: Vec<OwnedFd> = found.into_iter().map(|(_, fd)| fd).collect();
    match found.len() {
        1 => {
            let dup = found.swap_remove(0);
            // The number may have been reused between the look and the duplicate.
            match is_peer(dup_borrow(&dup), peer) {
                true => Ok(dup),
                false => Err(io::Error::other("the connection's socket changed")),
            }
        }
        0 => Err(io::Error::new(
            io::ErrorKind::NotFound,
            "no socket of this process is the connection the server describes (a pooler, \
             proxy or NAT between them?)",
        )),
        n => Err(io::Error::other(format!(
            "{n} sockets of this process match the connection the server describes"
        ))),
    }
}

fn dup_borrow(fd: &OwnedFd) -> BorrowedFd<'_> {
    use std::os::fd::AsFd;
    fd.as_fd()
}

/// This process's open descriptors: `/proc/self/fd` where there is one, else every
/// number below the descriptor limit (at most 65,536 looked at).
fn open_descriptors() -> io::Result<Vec<RawFd>> {
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        let mut fds: Vec<RawFd> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
            .collect();
        fds.sort_unstable();
        return Ok(fds);
    }
    // SAFETY: getdtablesize has no preconditions.
    let max = unsafe { libc::getdtablesize() }.clamp(0, 65_536);
    Ok((0..max).collect())
}

/// The inode of socket `fd` (what tells one socket from another, whatever descriptors
/// name it); `None` for anything that is not a socket.
fn socket_inode(fd: BorrowedFd<'_>) -> Option<u64> {
    // SAFETY: an all-zero stat is a valid value of the type.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a stat the kernel fills; `fd` is open (borrowed).
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    (rc == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFSOCK).then_some(st.st_ino as u64)
}

/// Whether `fd` is a socket connected as `peer` says.
fn is_peer(fd: BorrowedFd<'_>, peer: Peer) -> bool {
    match peer {
        Peer::Tcp { local, remote } => {
            inet_port(fd, Side::Local) == Some(local) && inet_port(fd, Side::Remote) == Some(remote)
        }
        Peer::UnixPid(pid) => unix_peer_pid(fd) == Some(pid),
    }
}

#[derive(Clone, Copy)]
enum Side {
    Local,
    Remote,
}

/// The TCP/IP port of one end of socket `fd`, if it is an IPv4 or IPv6 socket.
fn inet_port(fd: BorrowedFd<'_>, side: Side) -> Option<u16> {
    // SAFETY: an all-zero sockaddr_storage is a valid value of the type.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = (&raw mut addr).cast::<libc::sockaddr>();
    // SAFETY: `p` points to a sockaddr_storage of `len` bytes, large enough for any
    // address; the kernel writes at most `len` bytes and sets `len`.
    let rc = unsafe {
        match side {
            Side::Local => libc::getsockname(fd.as_raw_fd(), p, &mut len),
            Side::Remote => libc::getpeername(fd.as_raw_fd(), p, &mut len),
        }
    };
    if rc != 0 {
        return None;
    }
    match i32::from(addr.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is
            // large and aligned enough for.
            let sin = unsafe { &*(&raw const addr).cast::<libc::sockaddr_in>() };
            Some(u16::from_be(sin.sin_port))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, a sockaddr_in6.
            let sin6 = unsafe { &*(&raw const addr).cast::<libc::sockaddr_in6>() };
            Some(u16::from_be(sin6.sin6_port))
        }
        _ => None,
    }
}

/// The process at the other end of Unix socket `fd` (Linux `SO_PEERCRED`).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn unix_peer_pid(fd: BorrowedFd<'_>) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a ucred of `len` bytes, what SO_PEERCRED writes.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid)
}

/// Elsewhere a Unix socket's peer is not looked up.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn unix_peer_pid(_fd: BorrowedFd<'_>) -> Option<i32> {
    None
}

/// Makes the process `cmd` starts inherit `fds` (open across `exec`, at the same
/// numbers); returns the numbers. The descriptors stay open in this process as long as
/// `cmd` does (they are this process's copies until then): drop `cmd` after spawning.
pub(crate) fn inherit(cmd: &mut std::process::Command, fds: Vec<OwnedFd>) -> Vec<RawFd> {
    use std::os::unix::process::CommandExt;
    let numbers: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let raw = numbers.clone();
    let keep = std::sync::Arc::new(fds);
    // SAFETY: the closure runs in the child between fork and exec; it calls only fcntl
    // (async-signal-safe) and allocates nothing (`raw` is moved in, read only). `keep`
    // holds the descriptors open in this process until `cmd` is dropped, so the numbers
    // name them at fork.
    unsafe {
        cmd.pre_exec(move || {
            let _ = &keep;
            for &fd in &raw {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    numbers
}

/// Ends socket `fd`'s connection for every copy of it (`shutdown(2)`): closing one
/// copy does not, while a child holds another.
pub(crate) fn shutdown(fd: &OwnedFd) {
    // SAFETY: shutdown has no memory-safety preconditions; on a descriptor that is not
    // a connected socket it fails, harmlessly.
    unsafe {
        libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tcp_connection_is_found_by_its_ports_and_shut_down_for_every_copy() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let client =
            std::net::TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
        let (mut server, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        let local = client.local_addr().map(|a| a.port()).unwrap_or(0);
        let found = find_socket(Peer::Tcp {
            local,
            remote: port,
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(found.as_raw_fd(), client.as_raw_fd(), "a duplicate");
        assert!(
            find_socket(Peer::Tcp {
                local: port,
                remote: local
            })
            .is_ok(),
            "the server's end"
        );
        assert!(find_socket(Peer::Tcp { local, remote: 1 }).is_err());
        // Shut down through the duplicate: the server sees the end although the
        // original descriptor is still open.
        shutdown(&found);
        let mut buf = [0u8; 1];
        assert_eq!(server.read(&mut buf).unwrap_or(1), 0);
        drop(client);
    }
}
