//! The system calls of the embedded backend: Linux open-file-description byte-range
//! locks, and the file-system type check. The only `unsafe` in dblock; each block is one
//! FFI call on a descriptor owned by a live `File`, with a fully initialised argument.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::raw::Mode;

/// Tries to lock the byte at `offset` of `file` (non-blocking `F_OFD_SETLK`): a read lock
/// for [`Mode::Shared`], a write lock for [`Mode::Exclusive`]. The lock belongs to this
/// open file description: it conflicts with every other description, in this process
/// or another, and the kernel drops it when the description's last descriptor closes.
/// `Ok(false)` when another description holds a conflicting lock.
pub(crate) fn try_lock(file: &File, offset: u64, mode: Mode) -> io::Result<bool> {
    let kind = match mode {
        Mode::Shared => libc::F_RDLCK,
        Mode::Exclusive => libc::F_WRLCK,
    };
    match setlk(file, offset, kind) {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Unlocks the byte at `offset`.
pub(crate) fn unlock(file: &File, offset: u64) -> io::Result<()> {
    setlk(file, offset, libc::F_UNLCK)
}

fn setlk(file: &File, offset: u64, kind: libc::c_int) -> io::Result<()> {
    let start = libc::off_t::try_from(offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "lock offset out of range"))?;
    // SAFETY: flock is plain old data; zeroed is a valid value (l_pid must be 0 for OFD
    // locks), and every field the call reads is set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start;
    fl.l_len = 1;
    loop {
        // SAFETY: the descriptor belongs to `file`, alive for the call; `fl` is a valid
        // flock the kernel reads (and may write back) during the call only.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// The name of the network or FUSE file system `file` lies on, if it does: byte-range
/// locks on these are unreliable (NFS without a working lock manager, CIFS, FUSE
/// file systems that ignore them).
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
