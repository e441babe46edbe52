//! Reading a migration file: regular files only, and at most [`MAX_FILE_BYTES`].
//!
//! A directory entry named like a migration can be anything: a FIFO, whose `open` waits
//! for a writer that never comes (it hung `dblock migrate` and `status` forever), or a
//! symbolic link to `/dev/zero`, read until memory ran out. Both are refused, naming the
//! file and what it is.

use std::fs::{File, FileType};
use std::io::Read;
use std::path::Path;

/// The largest migration file dblock reads: 64 MiB. A larger file is refused (data
/// belongs in `COPY` or a loader, not in a migration).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// What a file type is, for an error that says what was refused.
fn kind(t: FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Opens without waiting: on a FIFO, `O_NONBLOCK` makes `open` return at once instead of
/// waiting for a writer (on a regular file it changes nothing).
fn open(path: &Path) -> std::io::Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC);
    }
    options.open(path)
}

/// The contents of the regular file at `path` (symbolic links followed), or why it was
/// refused.
pub(crate) fn read(path: &Path) -> Result<String, String> {
    // Checked before opening (a device may act on open) and again on the opened file
    // (the entry may have been replaced between the two).
    let before = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    if !before.is_file() {
        return Err(refused(kind(before.file_type())));
    }
    let file = open(path).map_err(|e| format!("cannot read: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err(refused(kind(meta.file_type())));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::new();
    // The limit holds even if the file grows while it is read.
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|e| format!("the contents are not UTF-8 ({e})"))
}

fn refused(what: &str) -> String {
    format!("refused: it is {what}; migrations are read from regular files only")
}

fn too_large(len: u64) -> String {
    format!(
        "refused: {len} bytes or more, larger than the limit of {MAX_FILE_BYTES} bytes for a \
         migration file"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_refused_without_reading_them() {
        let e = read(Path::new("/dev/zero")).unwrap_err();
        assert!(e.contains("a character device"), "{e}");
        let e = read(Path::new("/")).unwrap_err();
        assert!(e.contains("a directory"), "{e}");
    }
}
