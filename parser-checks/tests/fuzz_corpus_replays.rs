//! Every input kept in the fuzz targets' corpus (`fuzz/corpus/TARGET/`: the seeds, what
//! the fuzzers found worth keeping, and each input that once broke a parser) through the
//! very check its target runs, on stable Rust, on every `cargo test --workspace`: an
//! input a fuzzer once broke stays fixed without a nightly toolchain in CI. (The
//! `duration` target's corpus is replayed by the CLI's own tests, where its parser lives.)

use std::path::{Path, PathBuf};

use dblock_parser_checks as checks;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

fn pg_oracle(sql: &str) -> Result<Vec<String>, String> {
    pg_query::split_with_parser(sql)
        .map(|v| v.into_iter().map(str::to_string).collect())
        .map_err(|e| e.to_string())
}

/// The check each target runs, by target name.
fn check(target: &str, s: &str) {
    match target {
        "connection_string" => checks::connection_string(s),
        "mysql_url" => checks::mysql_url(s),
        "statements" => checks::statements_against(s, &pg_oracle),
        "migration_file_name" => checks::migration_file_name(s),
        "lock_name" => {
            let (ns, name) = checks::split_lock_input(s);
            checks::lock_name(ns, name);
        }
        "status_comments" => checks::comments(s),
        other => panic!("fuzz target {other} has no replay here: add it"),
    }
}

#[test]
fn every_fuzz_target_has_a_corpus_that_replays() {
    let targets = fuzz_dir().join("fuzz_targets");
    let mut names: Vec<String> = std::fs::read_dir(&targets)
        .unwrap_or_else(|e| panic!("{}: {e}", targets.display()))
        .map(|e| e.unwrap_or_else(|e| panic!("{e}")).path())
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_string()))
        .collect();
    names.sort();
    assert!(names.len() >= 7, "fuzz targets: {names:?}");
    let mut replayed = 0;
    for target in names.iter().filter(|t| *t != "duration") {
        let dir = fuzz_dir().join("corpus").join(target);
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            // The targets take UTF-8 only, as the parsers do (`&str`).
            if let Ok(s) = std::str::from_utf8(&data) {
                let caught = std::panic::catch_unwind(|| check(target, s));
                assert!(
                    caught.is_ok(),
                    "{target}: {} fails its check",
                    path.display()
                );
            }
            n += 1;
        }
        assert!(n >= 5, "{target}: only {n} inputs in {}", dir.display());
        replayed += n;
    }
    assert!(replayed > 50, "only {replayed} inputs replayed");
}
