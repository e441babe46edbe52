//! `dblock status` on the embedded backend, read from `/proc` (Linux) with nothing
//! added to the lock path: the kernel lists each open file's byte-range locks in
//! `/proc/PID/fdinfo/FD` (OFD locks report no pid to `F_OFD_GETLK`, but the fdinfo of
//! the holding descriptor is in its process's directory), and a process waiting in line
//! has a thread named `dblock-` and the low 32 bits of the lock's offset (see
//! [`queue`](super::queue)). Names come from the names asked for and the fencing table
//! (fenced grants record theirs); other locks show as their byte offset. Processes
//! whose `/proc` entries this user may not read are not seen.
//!
//! `release --force` is refused: a byte-range lock belongs to the open file of the
//! process that holds it and ends only with it; the refusal names the process.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::SqliteBackend;
use crate::error::Error;
use crate::key::Key;
use crate::raw::{Asked, BoxFuture, LockStatus, Mode, Party, StatusSource};

impl StatusSource for SqliteBackend {
    fn status<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>> {
        Box::pin(self.lock_status(asked))
    }

    fn terminate<'a>(&'a self, asked: Asked<'a>) -> BoxFuture<'a, Result<Vec<Party>, Error>> {
        Box::pin(async move {
            let rows = self.lock_status(&[asked]).await?;
            let holders: Vec<String> = rows
                .iter()
                .flat_map(|l| l.holders.iter())
                .map(Party::describe)
                .collect();
            if holders.is_empty() {
                return Ok(Vec::new());
            }
            let pids: Vec<String> = rows
                .iter()
                .flat_map(|l| l.holders.iter())
                .filter_map(|p| p.pid.map(|p| p.to_string()))
                .collect();
            Err(Error::unsupported(
                crate::error::Capability::EndHolders,
                format!(
                    "the embedded backend's lock {:?} belongs to the process holding it ({}), \
                     and ends only when that process releases it or exits; dblock does not \
                     signal processes: end it yourself if you mean to (kill {})",
                    asked.1,
                    holders.join(", "),
                    pids.join(" ")
                ),
            ))
        })
    }

    fn status_all<'a>(
        &'a self,
        asked: &'a [Asked<'a>],
    ) -> BoxFuture<'a, Result<Vec<LockStatus>, Error>> {
        Box::pin(self.lock_status_of(asked, true))
    }
}

/// A byte-range lock found in a process's fdinfo.
struct Found {
    pid: u32,
    offset: u64,
    mode: Mode,
    /// Seen as one byte of a pair held together (an exclusive holder keeps the gate
    /// with the lock byte): the lock byte is this one or its neighbour.
    paired: bool,
}

impl SqliteBackend {
    async fn lock_status(&self, asked: &[Asked<'_>]) -> Result<Vec<LockStatus>, Error> {
        self.lock_status_of(asked, asked.is_empty()).await
    }

    /// The locks of `asked`, and with `all` every lock held in the file too (those asked
    /// for under their keys, the others under their byte offsets).
    async fn lock_status_of(
        &self,
        asked: &[Asked<'_>],
        all: bool,
    ) -> Result<Vec<LockStatus>, Error> {
        let path = self.shared.lock.path.clone();
        let (found, waiting) = tokio::task::spawn_blocking(move || scan(&path))
            .await
            .map_err(|e| Error::io("reading /proc", std::io::Error::other(e.to_string())))?
            .map_err(|e| Error::io("reading /proc", e))?;
        let wanted: Vec<u64> = asked.iter().map(|a| a.2.file_offset()).collect();
        // Offsets some process waits in line for (by their low 32 bits): a lock byte
        // whose neighbour is such a place in line is that waiter's gate, not a lock.
        let gate_of = |f: &Found| {
            waiting
                .iter()
                .any(|w| w.0 == f.pid && w.1 == (f.offset ^ 1) as u32)
        };
        let mut locks: BTreeMap<u64, LockStatus> = BTreeMap::new();
        // A holder's child that inherited its lock file descriptor (`dblock run`'s
        // COMMAND: see `LockGuard::share_with_child`) shows the same lock: it shares the
        // holder's, it does not hold one of its own.
        let inherited = |f: &Found| {
            inherited_from(f.pid, |p| {
                found
                    .iter()
                    .any(|o| o.pid == p && o.offset == f.offset && o.mode == f.mode)
            })
        };
        for f in found.iter().filter(|f| !gate_of(f) && !inherited(f)) {
            if !all && !wanted.contains(&f.offset) {
                continue;
            }
            let key = asked
                .iter()
                .find(|a| a.2.file_offset() == f.offset)
                .map_or(Key::from_i64(f.offset as i64), |a| a.2);
            let lock = locks.entry(f.offset).or_insert_with(|| LockStatus {
                key,
                namespace: None,
                name: None,
                slot: None,
                holders: Vec::new(),
                waiters: Vec::new(),
            });
            lock.holders.push(party(f.pid, f.mode, None));
        }
        for (pid, low, since) in &waiting {
            let at = locks
                .keys()
                .copied()
                .find(|o| *o as u32 == *low)
                .or_else(|| wanted.iter().copied().find(|o| *o as u32 == *low));
            let Some(offset) = at else { continue };
            let key = asked
                .iter()
                .find(|a| a.2.file_offset() == offset)
                .map_or(Key::from_i64(offset as i64), |a| a.2);
            let lock = locks.entry(offset).or_insert_with(|| LockStatus {
                key,
                namespace: None,
                name: None,
                slot: None,
                holders: Vec::new(),
                waiters: Vec::new(),
            });
            lock.waiters.push(party(*pid, Mode::Exclusive, *since));
        }
        self.names_from_fencing(&mut locks).await;
        keep_one_of_each_pair(&found, &wanted, &mut locks);
        let mut out: Vec<LockStatus> = locks.into_values().collect();
        for l in &mut out {
            l.waiters.sort_by_key(|w| w.since);
        }
        Ok(out)
    }

    /// Names (and keys) of fenced locks, from the fencing table, if it exists.
    async fn names_from_fencing(&self, locks: &mut BTreeMap<u64, LockStatus>) {
        if locks.values().all(|l| l.name.is_some()) {
            return;
        }
        let Ok(db) = self.shared.db().await else {
            return;
        };
        let rows: Result<Vec<(i64, String, String)>, _> =
            sqlx::query_as("SELECT key, namespace, name FROM dblock_fencing")
                .fetch_all(db)
                .await;
        for (k, ns, name) in rows.unwrap_or_default() {
            let key = Key::from_i64(k);
            if Key::derive(&ns, &name) != key {
                continue;
            }
            if let Some(l) = locks.get_mut(&key.file_offset()) {
                l.key = key;
                l.namespace = Some(ns);
                l.name = Some(name);
            }
        }
    }
}

/// Of a pair of bytes held together, one is the lock and the other its gate: keeps the
/// one asked for, else the one the fencing table names, else the pair's first.
fn keep_one_of_each_pair(found: &[Found], wanted: &[u64], locks: &mut BTreeMap<u64, LockStatus>) {
    let paired = found.iter().filter(|f| f.paired && f.offset % 2 == 0);
    for o in paired.map(|f| f.offset) {
        let (even, odd) = (o, o + 1);
        let chosen =
            |x: u64| wanted.contains(&x) || locks.get(&x).is_some_and(|l| l.name.is_some());
        let drop = match (chosen(even), chosen(odd)) {
            (false, true) => even,
            _ => odd,
        };
        if !wanted.contains(&drop) {
            locks.remove(&drop);
        }
    }
}

/// Whether an ancestor of process `pid` (its parent, theirs, …) is one `holds`.
fn inherited_from(pid: u32, holds: impl Fn(u32) -> bool) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        match parent_of(p) {
            Some(parent) if parent > 1 => {
                if holds(parent) {
                    return true;
                }
                p = parent;
            }
            _ => return false,
        }
    }
    false
}

/// The parent of process `pid`, from `/proc/PID/stat` (the field after the command
/// name, which may itself hold spaces and parentheses).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

fn party(pid: u32, mode: Mode, since: Option<SystemTime>) -> Party {
    let program = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim_end().to_string());
    Party {
        mode,
        host: Some(crate::status::host().to_string()),
        pid: Some(pid),
        program,
        since,
        ..Party::default()
    }
}

/// What `/proc` shows: the single-byte locks on the lock file at `path` (pid, offset,
/// mode), and each thread waiting in line (pid, low 32 bits of the offset, since when).
#[allow(clippy::type_complexity)]
fn scan(path: &Path) -> std::io::Result<(Vec<Found>, Vec<(u32, u32, Option<SystemTime>)>)> {
    let md = std::fs::metadata(path)?;
    let (dev, ino) = (md.dev(), md.ino());
    let mut found = Vec::new();
    let mut waiting = Vec::new();
    let boot = boot_time();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        // Descriptors of the lock file, and the locks listed under them.
        if let Ok(fds) = std::fs::read_dir(dir.join("fd")) {
            for fd in fds.flatten() {
                let Ok(m) = std::fs::metadata(fd.path()) else {
                    continue;
                };
                if m.dev() != dev || m.ino() != ino {
                    continue;
                }
                let info = dir.join("fdinfo").join(fd.file_name());
                let Ok(text) = std::fs::read_to_string(info) else {
                    continue;
                };
                for line in text.lines().filter_map(|l| l.strip_prefix("lock:")) {
                    if let Some((start, len, mode)) = parse_lock_line(line, ino) {
                        for offset in start..start + len {
                            let paired = len == 2;
                            found.push(Found {
                                pid,
                                offset,
                                mode,
                                paired,
                            });
                        }
                    }
                }
            }
        }
        // Threads waiting in line.
        if let Ok(tasks) = std::fs::read_dir(dir.join("task")) {
            for t in tasks.flatten() {
                let Ok(comm) = std::fs::read_to_string(t.path().join("comm")) else {
                    continue;
                };
                let Some(hex) = comm.trim_end().strip_prefix("dblock-") else {
                    continue;
                };
                let Ok(low) = u32::from_str_radix(hex, 16) else {
                    continue;
                };
                let since = std::fs::read_to_string(t.path().join("stat"))
                    .ok()
                    .and_then(|s| started(&s, boot));
                waiting.push((pid, low, since));
            }
        }
    }
    // One process seen twice (OFD locks shared by a fork) shows once.
    found.sort_by_key(|f| (f.offset, f.pid));
    found.dedup_by_key(|f| (f.offset, f.pid));
    Ok((found, waiting))
}

/// A `/proc/…/fdinfo` lock line (after `lock:`) on inode `ino`, granted, one byte long
/// or an aligned pair (lock byte and gate): its first byte, length and mode.
fn parse_lock_line(line: &str, ino: u64) -> Option<(u64, u64, Mode)> {
    // `1: OFDLCK  ADVISORY  WRITE -1 00:2d:1234 100 100`; blocked requests show `->`.
    let t: Vec<&str> = line.split_whitespace().collect();
    if t.contains(&"->") || t.len() < 8 {
        return None;
    }
    let mode = match t[3] {
        "WRITE" => Mode::Exclusive,
        "READ" => Mode::Shared,
        _ => return None,
    };
    let file_ino: u64 = t[5].rsplit(':').next()?.parse().ok()?;
    let (start, end): (u64, u64) = (t[6].parse().ok()?, t[7].parse().ok()?);
    let len = match end.checked_sub(start)? {
        0 => 1,
        1 if start % 2 == 0 => 2,
        _ => return None,
    };
    (file_ino == ino).then_some((start, len, mode))
}

/// The system's boot time (`btime` in `/proc/stat`).
fn boot_time() -> Option<SystemTime> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

/// When a thread started, from its `stat` (field 22, in clock ticks since boot; Linux
/// reports these at USER_HZ, 100 a second).
fn started(stat: &str, boot: Option<SystemTime>) -> Option<SystemTime> {
    // The command name (field 2) may hold spaces: count from after its `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    Some(boot? + Duration::from_millis(ticks * 10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_lock_lines_are_read() {
        let ino = 1234;
        assert_eq!(
            parse_lock_line("\t1: OFDLCK  ADVISORY  WRITE -1 00:2d:1234 100 100", ino),
            Some((100, 1, Mode::Exclusive))
        );
        assert_eq!(
            parse_lock_line("1: POSIX  ADVISORY  READ 42 08:02:1234 7 7", ino),
            Some((7, 1, Mode::Shared))
        );
        // A lock byte held with its gate.
        assert_eq!(
            parse_lock_line("1: OFDLCK ADVISORY WRITE -1 00:2d:1234 4 5", ino),
            Some((4, 2, Mode::Exclusive))
        );
        // Another file, a longer or unaligned range, a blocked request.
        assert_eq!(
            parse_lock_line("1: OFDLCK ADVISORY WRITE -1 00:2d:99 1 1", ino),
            None
        );
        assert_eq!(
            parse_lock_line("1: OFDLCK ADVISORY WRITE -1 00:2d:1234 5 6", ino),
            None
        );
        assert_eq!(
            parse_lock_line("1: OFDLCK ADVISORY WRITE -1 00:2d:1234 4 7", ino),
            None
        );
        assert_eq!(
            parse_lock_line("1: -> OFDLCK ADVISORY WRITE -1 00:2d:1234 4 4", ino),
            None
        );
    }

    #[test]
    fn a_thread_start_is_read_from_its_stat() {
        let boot = Some(SystemTime::UNIX_EPOCH);
        let stat = "7 (dblock-0a (x)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 250 20";
        assert_eq!(
            started(stat, boot),
            Some(SystemTime::UNIX_EPOCH + Duration::from_millis(2500))
        );
    }
}
