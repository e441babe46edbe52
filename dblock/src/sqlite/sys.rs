//! The system calls of the embedded backend: byte-range locks (Linux open-file-description
//! locks, or classic POSIX record locks where those are missing), and the file-system type
//! check. The only `unsafe` in dblock; each block is one FFI call on a descriptor owned by
//! a live `File`, with a fully initialised argument.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use crate::raw::Mode;

/// The environment variable that selects the kind of byte-range lock: `ofd` or `posix`.
pub(crate) const FLAVOR_ENV: &str = "DBLOCK_FILE_LOCKS";

/// Which kernel lock the embedded backend takes. Both exclude other processes alike, and
/// on Linux they conflict with each other, so processes using different flavours on one
/// file still exclude each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// Open-file-description locks (`F_OFD_SETLK`): owned by one `open()`. Linux only.
    Ofd,
    /// Classic POSIX record locks (`F_SETLK`): owned by the process, dropped when *any*
    /// descriptor of the file closes. Everywhere; the process keeps one descriptor per
    /// lock file open for as long as any lock on it is held, and never closes another.
    Posix,
}

/// Whether this platform has OFD locks.
pub(crate) const HAS_OFD: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// The flavour of this process, read once: `DBLOCK_FILE_LOCKS=ofd|posix`, else OFD locks
/// where the platform has them and POSIX locks elsewhere.
pub(crate) fn flavor() -> Result<Flavor, String> {
    static FLAVOR: OnceLock<Result<Flavor, String>> = OnceLock::new();
    FLAVOR
        .get_or_init(|| {
            let default = if HAS_OFD { Flavor::Ofd } else { Flavor::Posix };
            match std::env::var(FLAVOR_ENV) {
                Err(std::env::VarError::NotPresent) => Ok(default),
                Ok(v) if v.is_empty() => Ok(default),
                Ok(v) if v.eq_ignore_ascii_case("posix") => Ok(Flavor::Posix),
                Ok(v) if v.eq_ignore_ascii_case("ofd") && HAS_OFD => Ok(Flavor::Ofd),
                Ok(v) if v.eq_ignore_ascii_case("ofd") => Err(format!(
                    "{FLAVOR_ENV}=ofd: this platform has no open-file-description locks; \
                     use posix or leave it unset"
                )),
                Ok(v) => Err(format!(
                    "{FLAVOR_ENV}={v:?}: expected \"ofd\" or \"posix\" (or unset)"
                )),
                Err(std::env::VarError::NotUnicode(v)) => Err(format!(
                    "{FLAVOR_ENV}={v:?}: expected \"ofd\" or \"posix\" (or unset)"
                )),
            }
        })
        .clone()
}

/// Outcome of a lock attempt.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Attempt {
    Granted,
    Busy,
}

/// The lock type for `mode`: a read lock for [`Mode::Shared`], a write lock for
/// [`Mode::Exclusive`].
// The constants are `c_int` on Linux and `c_short` on macOS.
#[allow(clippy::unnecessary_cast)]
fn kind(mode: Mode) -> libc::c_short {
    match mode {
        Mode::Shared => libc::F_RDLCK as libc::c_short,
        Mode::Exclusive => libc::F_WRLCK as libc::c_short,
    }
}

/// Tries to lock `len` bytes from `offset` of `file` without waiting. The lock conflicts
/// with every other owner's (another open file description or, for POSIX locks, another
/// process); the kernel drops it when its owner goes away, however the process dies.
pub(crate) fn try_lock(
    file: &File,
    flavor: Flavor,
    offset: u64,
    len: u64,
    mode: Mode,
) -> io::Result<Attempt> {
    match setlk(file, flavor, offset, len, kind(mode), false) {
        Ok(()) => Ok(Attempt::Granted),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
            Ok(Attempt::Busy)
        }
        Err(e) => Err(e),
    }
}

/// Waits (blocking the calling thread) until `len` bytes from `offset` are locked. The
/// kernel queues waiters for conflicting locks on one range in arrival order.
pub(crate) fn lock_wait(
    file: &File,
    flavor: Flavor,
    offset: u64,
    len: u64,
    mode: Mode,
) -> io::Result<()> {
    setlk(file, flavor, offset, len, kind(mode), true)
}

/// Whether `len` bytes from `offset` could be locked in `mode` now, without locking
/// them: [`Attempt::Busy`] if another owner holds a conflicting lock on them
/// (`F_OFD_GETLK` / `F_GETLK`; this owner's own locks never conflict).
pub(crate) fn probe(
    file: &File,
    flavor: Flavor,
    offset: u64,
    len: u64,
    mode: Mode,
) -> io::Result<Attempt> {
    let cmd = match flavor {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        Flavor::Ofd => libc::F_OFD_GETLK,
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        Flavor::Ofd => return Err(io::Error::from(io::ErrorKind::Unsupported)),
        Flavor::Posix => libc::F_GETLK,
    };
    let mut fl = flock(offset, len, kind(mode))?;
    // SAFETY: the descriptor belongs to `file`, alive for the call; `fl` is a valid
    // flock the kernel reads and overwrites during the call only.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // The constants are `c_int` on Linux and `c_short` on macOS.
    #[allow(clippy::unnecessary_cast)]
    Ok(match fl.l_type == libc::F_UNLCK as libc::c_short {
        true => Attempt::Granted,
        false => Attempt::Busy,
    })
}

/// Unlocks `len` bytes from `offset` (those this owner holds; others' are untouched).
pub(crate) fn unlock(file: &File, flavor: Flavor, offset: u64, len: u64) -> io::Result<()> {
    #[allow(clippy::unnecessary_cast)]
    setlk(
        file,
        flavor,
        offset,
        len,
        libc::F_UNLCK as libc::c_short,
        false,
    )
}

fn setlk(
    file: &File,
    flavor: Flavor,
    offset: u64,
    len: u64,
    kind: libc::c_short,
    wait: bool,
) -> io::Result<()> {
    let cmd = match (flavor, wait) {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        (Flavor::Ofd, false) => libc::F_OFD_SETLK,
        #[cfg(any(target_os = "linux", target_os = "android"))]
        (Flavor::Ofd, true) => libc::F_OFD_SETLKW,
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        (Flavor::Ofd, _) => return Err(io::Error::from(io::ErrorKind::Unsupported)),
        (Flavor::Posix, false) => libc::F_SETLK,
        (Flavor::Posix, true) => libc::F_SETLKW,
    };
    let mut fl = flock(offset, len, kind)?;
    loop {
        // SAFETY: the descriptor belongs to `file`, alive for the call; `fl` is a valid
        // flock the kernel reads (and may write back) during the call only.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// The kernel's coarse monotonic clock (`CLOCK_MONOTONIC_COARSE`) now, in nanoseconds
/// (`resolution`: its resolution instead, one tick). Advanced once a tick and read from
/// the vDSO in about 3 ns against about 20 ns for the precise clock, which matters on the
/// path every lock takes. `None` where there is no such clock.
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) fn coarse_clock(resolution: bool) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec, written by the call only.
    let rc = unsafe {
        match resolution {
            true => libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts),
            false => libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts),
        }
    };
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u64::try_from(ts.tv_nsec).ok()?;
    (rc == 0).then(|| secs.saturating_mul(1_000_000_000).saturating_add(nanos))
}

/// See the Linux version: elsewhere there is none.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(crate) fn coarse_clock(_resolution: bool) -> Option<u64> {
    None
}

/// The lock file's first page, mapped shared between every process that has the file
/// open: one count per group of keys of the processes waiting in line for a key of the
/// group (see the [module docs](super#waiting-in-line)). A hint, never what excludes:
/// a count too high costs a cycle one system call, one too low lets a request pass a
/// waiter once.
pub(crate) struct LineCounts {
    base: std::ptr::NonNull<std::sync::atomic::AtomicU32>,
}

// SAFETY: the mapping is only ever accessed through atomics, from any thread.
unsafe impl Send for LineCounts {}
// SAFETY: as above.
unsafe impl Sync for LineCounts {}

/// How many counts the page holds.
pub(crate) const LINE_COUNTS: usize = 1024;
const PAGE: usize = LINE_COUNTS * 4;

/// The byte every process using a lock file holds a read lock on while it has the file
/// open, and the first to open it takes exclusively for a moment to clear counts left by
/// processes that died in line. The last byte a lock can cover; it is a key's gate only
/// for offset 2^63 − 2, one key in 2^62.
pub(crate) const USERS: u64 = i64::MAX as u64;

impl LineCounts {
    /// Maps the page (growing the file to it first), and joins the file's users,
    /// clearing the counts if there were none.
    pub(crate) fn map(file: &File, flavor: Flavor) -> io::Result<LineCounts> {
        if file.metadata()?.len() < PAGE as u64 {
            file.set_len(PAGE as u64)?;
        }
        // SAFETY: a fresh shared mapping of `PAGE` bytes of a descriptor alive for the
        // call; the file is at least that long (a file truncated under the mapping would
        // fault: the lock file is dblock's, never truncated by it).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = std::ptr::NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap"))?;
        let counts = LineCounts { base };
        if try_lock(file, flavor, USERS, 1, Mode::Exclusive)? == Attempt::Granted {
            // Nobody else has the file open: counts are left by the dead.
            for i in 0..LINE_COUNTS {
                counts
                    .count(i)
                    .store(0, std::sync::atomic::Ordering::Relaxed);
            }
        }
        // A read lock (the exclusive one just taken turns into it), held while the
        // descriptor is open.
        lock_wait(file, flavor, USERS, 1, Mode::Shared)?;
        Ok(counts)
    }

    /// The count of the group of keys `offset` is in.
    pub(crate) fn of(&self, offset: u64) -> &std::sync::atomic::AtomicU32 {
        self.count((offset >> 1) as usize % LINE_COUNTS)
    }

    fn count(&self, i: usize) -> &std::sync::atomic::AtomicU32 {
        assert!(i < LINE_COUNTS);
        // SAFETY: `i` is within the mapped page, which lives as long as `self`, is
        // aligned (page-aligned base) and is only accessed through atomics.
        unsafe { &*self.base.as_ptr().add(i) }
    }
}

impl std::fmt::Debug for LineCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LineCounts")
    }
}

impl Drop for LineCounts {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `map` made; no reference to it outlives
        // `self`.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), PAGE);
        }
    }
}

/// The argument of a lock call on `len` bytes from `offset`.
fn flock(offset: u64, len: u64, kind: libc::c_short) -> io::Result<libc::flock> {
    let out_of_range = || io::Error::new(io::ErrorKind::InvalidInput, "lock offset out of range");
    let start = libc::off_t::try_from(offset).map_err(|_| out_of_range())?;
    let len = libc::off_t::try_from(len).map_err(|_| out_of_range())?;
    // SAFETY: flock is plain old data; zeroed is a valid value (l_pid must be 0 for OFD
    // locks), and every field the call reads is set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start;
    fl.l_len = len;
    Ok(fl)
}

/// The name of the network or FUSE file system `file` lies on, if it does: byte-range
/// locks on these are unreliable (NFS without a working lock manager, CIFS, FUSE
/// file systems that ignore them).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) fn network_filesystem(file: &File) -> io::Result<Option<&'static str>> {
    // SAFETY: statfs is plain old data; zeroed is valid and the kernel overwrites it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor owned by `file`, valid pointer to `st` for the call.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // f_type's integer type differs between architectures; compare as u32 (magic
    // numbers are 32-bit).
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as u32;
    Ok(match magic {
        0x6969 => Some("NFS"),
        0x517b => Some("SMB"),
        0xff53_4d42 => Some("CIFS"),
        0xfe53_4d42 => Some("SMB2"),
        0x6573_5546 => Some("FUSE"),
        0x0102_1997 => Some("9P"),
        0x00c3_6400 => Some("Ceph"),
        0x5346_414f => Some("AFS"),
        0x7375_7245 => Some("Coda"),
        0x564c => Some("NCP"),
        _ => None,
    })
}

/// The name of the network or FUSE file system `file` lies on, if it does (by the
/// file-system type name `fstatfs` reports on macOS and the BSDs).
#[cfg(any(
    target_os = "macos",
    target_os = "ios",
    target_os = "freebsd",
    target_os = "dragonfly"
))]
pub(crate) fn network_filesystem(file: &File) -> io::Result<Option<&'static str>> {
    // SAFETY: statfs is plain old data; zeroed is valid and the kernel overwrites it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor owned by `file`, valid pointer to `st` for the call.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let name: Vec<u8> = st
        .f_fstypename
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(match name.as_slice() {
        b"nfs" => Some("NFS"),
        b"smbfs" => Some("SMB"),
        b"afpfs" => Some("AFP"),
        b"webdav" => Some("WebDAV"),
        b"fusefs" | b"macfuse" | b"osxfuse" | b"osxfusefs" => Some("FUSE"),
        _ => None,
    })
}

/// Elsewhere the type is not inspected.
#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_os = "macos",
    target_os = "ios",
    target_os = "freebsd",
    target_os = "dragonfly"
)))]
pub(crate) fn network_filesystem(_file: &File) -> io::Result<Option<&'static str>> {
    Ok(None)
}
