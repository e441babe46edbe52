//! The alerting rules shipped in docs/alerts: valid (`promtool check rules`), firing and
//! staying quiet as their unit tests say (`promtool test rules`: a stuck lock alerts, a
//! lock whose long holds are usual does not), and written against the metric names the
//! exporter serves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

fn alerts() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/alerts"))
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .current_dir(alerts())
        .args(args)
        .output()
        .expect("promtool (the Debian package `prometheus`; .ci/run installs it)");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}: {said}");
    said
}

#[test]
fn the_shipped_rules_are_valid_and_pass_their_unit_tests() {
    let said = promtool(&["check", "rules", "dblock.rules.yml"]);
    assert!(said.contains("SUCCESS: 5 rules found"), "{said}");
    let said = promtool(&["test", "rules", "dblock.rules.test.yml"]);
    assert!(said.contains("SUCCESS"), "{said}");
}

#[test]
fn the_rules_read_the_metrics_the_exporter_serves() {
    use dblock::fleet::{
        JOB_LAST_SUCCESS, LEADER_PRESENT, LONGEST_HOLD, OLDEST_WAIT, SCRAPE_SUCCESS,
    };
    let rules = std::fs::read_to_string(alerts().join("dblock.rules.yml")).unwrap();
    for name in [
        LONGEST_HOLD,
        OLDEST_WAIT,
        LEADER_PRESENT,
        JOB_LAST_SUCCESS,
        SCRAPE_SUCCESS,
    ] {
        assert!(rules.contains(name), "no rule reads {name}");
    }
    // And no rule reads a dblock metric the exporter does not serve.
    let served = [
        LONGEST_HOLD,
        OLDEST_WAIT,
        LEADER_PRESENT,
        JOB_LAST_SUCCESS,
        SCRAPE_SUCCESS,
        dblock::fleet::SCRAPE_DURATION,
    ];
    for word in rules.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("dblock_") {
            assert!(served.contains(&word), "{word} is read but not served");
        }
    }
}
