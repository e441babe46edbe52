//! The name → key function (SHA-256 of namespace, NUL, name).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use criterion::{Criterion, criterion_group, criterion_main};
use std::hint::black_box;

fn key(c: &mut Criterion) {
    c.bench_function("Key::new, 10-byte name", |b| {
        b.iter(|| dblock::Key::new(black_box("public"), black_box("autoland:7")))
    });
    let long = "x".repeat(200);
    c.bench_function("Key::new, 200-byte name", |b| {
        b.iter(|| dblock::Key::new(black_box("public"), black_box(&long)))
    });
}

criterion_group!(benches, key);
criterion_main!(benches);
