//! What a lock cycle on the embedded file allocates (issue 21: a grant costs what its
//! two system calls cost, not a `malloc` and a `free` besides). Its own test binary, for
//! its own allocator.
//!
//! A grant allocates nothing of its own. A request that somebody observes (tracing, or
//! the `metrics` feature, which this workspace's tests build dblock with) boxes its
//! observation, one allocation a request (`request.rs`); a build without either, like the
//! `dblock` program's, allocates nothing in a cycle (callgrind: no `malloc` a cycle).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use dblock_testkit::SqliteDb;

/// The system allocator, counting the allocations of the thread that asks for them.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; counting touches only
// a thread-local cell, which allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// Allocations in `n` rounds of `cycle` on this thread's runtime.
fn counted<F: std::future::Future<Output = ()>>(
    rt: &tokio::runtime::Runtime,
    n: u64,
    mut cycle: impl FnMut() -> F,
) -> u64 {
    rt.block_on(async {
        let before = allocations();
        for _ in 0..n {
            cycle().await;
        }
        allocations() - before
    })
}

#[test]
fn a_lock_and_its_release_on_the_embedded_file_allocate_only_for_their_observation() {
    // A runtime on this thread: every allocation of the cycle is counted here.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = SqliteDb::new();
    let locks = rt.block_on(db.locks());
    let cycle = || async {
        let guard = locks.lock("alloc-free").await.unwrap();
        drop(guard);
    };
    // The first cycles fill what the handle keeps (the key of the name, the table's
    // entries); after them, only the observation's box is left (a guard's boxed half
    // made it two before).
    counted(&rt, 100, cycle);
    let n = 1_000;
    let locked = counted(&rt, n, cycle);
    let tries = counted(&rt, n, || async {
        drop(locks.try_lock("alloc-free").await.unwrap().unwrap());
    });
    let shared = counted(&rt, n, || async {
        drop(locks.request("alloc-free").shared().lock().await.unwrap());
    });
    for (what, got) in [("lock", locked), ("try_lock", tries), ("shared", shared)] {
        assert!(got <= n, "{what} + drop: {got} allocations in {n} cycles");
    }

    // The control: one allocation more a cycle (a name made each time) is seen.
    let mut i = 0u64;
    let named = counted(&rt, n, || {
        i += 1;
        let name = format!("alloc-{}", i % 4);
        let locks = &locks;
        async move { drop(locks.lock(&name).await.unwrap()) }
    });
    assert!(
        named > n,
        "the counter missed an allocation a cycle: {named} in {n} cycles"
    );
}
