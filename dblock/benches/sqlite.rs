//! The embedded backend's lock cycle against its floor: raw `F_OFD_SETLK` lock + unlock
//! of one byte, the same system calls with nothing around them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use criterion::{Criterion, criterion_group, criterion_main};

fn sqlite(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("locks.db").display());
    let locks = rt.block_on(dblock::Locks::connect(&url)).unwrap();
    let mut g = c.benchmark_group("sqlite");
    g.bench_function("floor: raw OFD lock+unlock", |b| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join("locks.db-locks"))
            .unwrap();
        b.iter(|| raw::cycle(&f, 12345))
    });
    g.bench_function("dblock: lock + drop (uncontended)", |b| {
        b.to_async(&rt)
            .iter(|| async { drop(locks.lock("bench:sqlite").await.unwrap()) })
    });
    g.bench_function("dblock: try_lock + drop (uncontended)", |b| {
        b.to_async(&rt)
            .iter(|| async { drop(locks.try_lock("bench:sqlite").await.unwrap()) })
    });
    g.finish();
}

/// The floor, with libc directly (benchmarks may use unsafe; the library's own
/// system calls live in one audited module).
mod raw {
    #![allow(unsafe_code)]
    use std::os::fd::AsRawFd;

    pub fn cycle(f: &std::fs::File, offset: i64) {
        for kind in [libc::F_WRLCK, libc::F_UNLCK] {
            // SAFETY: plain-old-data flock, valid descriptor for the call.
            let mut fl: libc::flock = unsafe { std::mem::zeroed() };
            fl.l_type = kind as libc::c_short;
            fl.l_whence = libc::SEEK_SET as libc::c_short;
            fl.l_start = offset;
            fl.l_len = 1;
            let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
            assert_eq!(rc, 0);
        }
    }
}

criterion_group!(benches, sqlite);
criterion_main!(benches);
