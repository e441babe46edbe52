//! Every public async function of the library — a `pub async fn`, or a `pub fn` returning
//! a future (`impl Future`, `BoxFuture`), or such a method of a public trait — has a
//! `# Cancel safety` section in its doc comment, stating what dropping it does. Read
//! from the source, so a new function without one fails the build's tests. Items hidden
//! from the docs (`#[doc(hidden)]`) and `pub(crate)` ones are not public and not checked.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

/// Whether a function signature (the text from `fn` to its body or `;`) returns a future.
fn returns_future(signature: &str) -> bool {
    let Some((_, ret)) = signature.split_once("->") else {
        return false;
    };
    let ret = ret.trim_start();
    ret.starts_with("BoxFuture")
        || ret.starts_with("impl Future")
        || ret.starts_with("impl std::future::Future")
        || ret.starts_with("impl core::future::Future")
        || ret.starts_with("Pin<Box<dyn Future")
        || ret.starts_with("std::pin::Pin<Box<dyn std::future::Future")
}

/// The public async functions of `source` that lack the section: `(line, signature)`.
fn lacking(source: &str) -> (usize, Vec<(usize, String)>) {
    let lines: Vec<&str> = source.lines().collect();
    let mut checked = 0;
    let mut missing = Vec::new();
    // Brace depth at which each open `pub trait` body sits: its methods are public.
    let mut depth = 0usize;
    let mut trait_bodies: Vec<usize> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let in_pub_trait = trait_bodies.last().is_some_and(|&d| d == depth);
        let is_fn = t.starts_with("pub async fn ")
            || t.starts_with("pub fn ")
            || (in_pub_trait && (t.starts_with("fn ") || t.starts_with("async fn ")));
        if is_fn {
            // The signature, to the body's brace or the declaration's semicolon.
            let mut signature = String::new();
            for l in &lines[i..lines.len().min(i + 20)] {
                signature.push_str(l.trim());
                signature.push(' ');
                if l.contains('{') || l.trim_end().ends_with(';') {
                    break;
                }
            }
            let signature = signature
                .split_once('{')
                .map_or(signature.as_str(), |(s, _)| s)
                .to_string();
            if t.contains("async fn ") || returns_future(&signature) {
                // The attributes and doc comment above it.
                let above: Vec<&str> = lines[..i]
                    .iter()
                    .rev()
                    .map(|l| l.trim_start())
                    .take_while(|l| l.starts_with("///") || l.starts_with("#["))
                    .collect();
                let hidden = above.iter().any(|l| l.starts_with("#[doc(hidden)]"));
                if !hidden {
                    checked += 1;
                    if !above.contains(&"/// # Cancel safety") {
                        missing.push((i + 1, signature.trim().to_string()));
                    }
                }
            }
        }
        if t.starts_with("pub trait ") && t.contains('{') {
            trait_bodies.push(depth + 1);
        }
        // Braces in strings and comments are rare enough in this crate's signatures and
        // trait bodies that counting every one is close enough for finding trait bodies.
        let code = t.split("//").next().unwrap_or("");
        depth += code.matches('{').count();
        depth = depth.saturating_sub(code.matches('}').count());
        while trait_bodies.last().is_some_and(|&d| d > depth) {
            trait_bodies.pop();
        }
    }
    (checked, missing)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_public_async_fn_says_what_cancelling_it_does() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut checked = 0;
    let mut missing = Vec::new();
    for f in &files {
        let (n, lacking) = lacking(&std::fs::read_to_string(f).unwrap());
        checked += n;
        for (line, signature) in lacking {
            let shown = f.strip_prefix(&src).unwrap_or(f).display().to_string();
            missing.push(format!("src/{shown}:{line}: {signature}"));
        }
    }
    // The scan found the crate's async API (it has dozens of such functions).
    assert!(checked >= 30, "only {checked} public async functions found");
    assert!(
        missing.is_empty(),
        "public async functions without a `# Cancel safety` section:\n{}",
        missing.join("\n")
    );
}

/// Control: the scan reports what it should, and only that.
#[test]
fn the_scan_finds_a_missing_section() {
    let source = r#"
/// Documented.
///
/// # Cancel safety
///
/// Nothing happens.
pub async fn good() {}

/// Undocumented.
pub async fn bad_async() {}

/// Returns a future.
pub fn bad_future(&self) -> impl Future<Output = ()> + Send {
    async {}
}

/// Not async.
pub fn plain() -> u32 {
    1
}

pub(crate) async fn internal() {}

#[doc(hidden)]
pub async fn hidden() {}

/// A public trait.
pub trait T {
    /// Its method.
    fn boxed(&self) -> BoxFuture<'_, ()>;
}
"#;
    let (checked, missing) = lacking(source);
    let names: Vec<&str> = missing
        .iter()
        .map(|(_, s)| s.split('(').next().unwrap_or(""))
        .collect();
    assert_eq!(
        names,
        ["pub async fn bad_async", "pub fn bad_future", "fn boxed"]
    );
    assert_eq!(checked, 4);
}
