//! What the README promises a new user about installing dblock and running its tests,
//! checked against the files that make it true (issue 22: `cargo install --path
//! dblock-cli` as written ignored `Cargo.lock`; a release build carried debug info, a
//! 90 MB binary; the feature list omitted `tls` and `mysql`; the suite's needs were
//! under-stated).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

fn repo_file(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every `cargo install` of dblock's program in the README and docs/ builds the tested
/// dependency versions (`--locked`).
#[test]
fn installing_the_program_uses_the_tested_lock_file() {
    let mut pages = vec![("README.md".to_string(), repo_file("README.md"))];
    for entry in
        std::fs::read_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs")).unwrap()
    {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "md") {
            pages.push((
                p.display().to_string(),
                std::fs::read_to_string(&p).unwrap(),
            ));
        }
    }
    let mut installs = 0;
    for (page, text) in &pages {
        for line in text.lines() {
            if line.contains("cargo install") && line.contains("dblock-cli") {
                installs += 1;
                assert!(line.contains("--locked"), "{page}: {line}");
            }
        }
    }
    assert!(installs >= 1, "the README says how to install the program");
}

/// `cargo install` builds with the release profile: it carries no debug info (line
/// tables and all made the installed `dblock` 90 MB).
#[test]
fn a_release_build_carries_no_debug_info() {
    let workspace: toml::Table = repo_file("Cargo.toml").parse().unwrap();
    let release = workspace
        .get("profile")
        .and_then(|p| p.get("release"))
        .and_then(|r| r.as_table());
    if let Some(release) = release {
        for key in ["debug", "split-debuginfo"] {
            let v = release.get(key);
            let none = match v {
                None => true,
                Some(toml::Value::Boolean(b)) => !b,
                Some(toml::Value::Integer(0)) => true,
                Some(toml::Value::String(s)) => s == "none",
                Some(_) => false,
            };
            assert!(none, "[profile.release] {key} = {v:?}");
        }
        assert_ne!(
            release.get("strip").and_then(|s| s.as_str()),
            Some("none"),
            "[profile.release] strip"
        );
    }
}

/// The README's install line and features table, and lib.rs's table, name every cargo
/// feature of the library.
#[test]
fn the_readme_names_every_feature_of_the_library() {
    let manifest: toml::Table = repo_file("dblock/Cargo.toml").parse().unwrap();
    let features: Vec<&str> = manifest["features"]
        .as_table()
        .unwrap()
        .keys()
        .map(String::as_str)
        .filter(|f| *f != "default")
        .collect();
    assert!(features.contains(&"mysql") && features.contains(&"tls"));
    let readme = repo_file("README.md");
    let install_line = readme
        .lines()
        .find(|l| l.starts_with("dblock = ") && l.contains("features"))
        .expect("the README's dependency line lists the features");
    let lib = repo_file("dblock/src/lib.rs");
    for f in &features {
        let word = format!("{f},");
        let last = format!("{f} ");
        assert!(
            install_line.contains(&word)
                || install_line.contains(&last)
                || install_line.ends_with(f),
            "the README's dependency line names `{f}`: {install_line}"
        );
        let row = format!("| `{f}`");
        assert!(
            readme.contains(&row),
            "the README's feature table has `{f}`"
        );
        assert!(
            lib.contains(&format!("//! {row}")),
            "lib.rs's feature table has `{f}`"
        );
    }
}

/// The README says what `cargo test --workspace` needs: every package `.ci/run`
/// installs when it is missing, and the servers it starts.
#[test]
fn the_readme_names_what_the_suite_needs() {
    let ci = repo_file(".ci/run");
    let mut needs: Vec<String> = Vec::new();
    for line in ci.lines() {
        if let Some((_, after)) = line.split_once("apt-get install") {
            needs.extend(
                after
                    .split_whitespace()
                    .take_while(|w| !w.starts_with('>') && *w != "&&")
                    .filter(|w| !w.starts_with('-'))
                    .map(str::to_string),
            );
        }
    }
    assert!(needs.iter().any(|p| p == "pgbouncer"), "{needs:?}");
    needs.extend(["PostgreSQL", "MariaDB", "pg_basebackup"].map(String::from));
    // The README's paragraph on the suite, up to the next heading.
    let readme = repo_file("README.md");
    let from = readme
        .find("The test suite runs against real servers")
        .expect("the README's paragraph on the test suite");
    let paragraph = &readme[from..];
    let paragraph = &paragraph[..paragraph.find("\n#").unwrap_or(paragraph.len())];
    let paragraph = paragraph.to_ascii_lowercase();
    for need in &needs {
        assert!(
            paragraph.contains(&need.to_ascii_lowercase()),
            "the README's paragraph on the suite names {need}"
        );
    }
}
