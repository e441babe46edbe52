//! The crate's summary (lib.rs's first doc paragraph), its Cargo description and
//! `dblock --help` name every backend `dblock/src/target.rs` opens. The backends are read
//! from target.rs's source — each arm of `open` that hands a URL to a backend, with its
//! schemes — so a fourth backend fails this test until those texts name it. A text names
//! a backend when it contains one of the backend's schemes, in any case ("PostgreSQL"
//! names `postgresql`, "MariaDB" `mariadb`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

fn library_file(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../dblock")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Each backend `target::open` opens, as the schemes of its arm: the lines of `open`'s
/// body of the form `"s1" | "s2" => crate::BACKEND::open(…)`.
fn backends(target_rs: &str) -> Vec<Vec<String>> {
    let start = target_rs
        .find("async fn open(")
        .expect("target.rs has `async fn open(`");
    let body = &target_rs[start..];
    let end = body.find("\n}\n").expect("open's body ends");
    body[..end]
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('"') && l.contains("=> crate::") && l.contains("::open("))
        .map(|l| {
            let arm = &l[..l.find("=>").unwrap_or(0)];
            arm.split('|')
                .map(|s| s.trim().trim_matches('"').to_ascii_lowercase())
                .collect()
        })
        .collect()
}

/// The backends `text` does not name, each shown by its schemes.
fn unnamed(backends: &[Vec<String>], text: &str) -> Vec<String> {
    let text = text.to_ascii_lowercase();
    backends
        .iter()
        .filter(|schemes| !schemes.iter().any(|s| text.contains(s.as_str())))
        .map(|schemes| schemes.join("|"))
        .collect()
}

/// lib.rs's first paragraph of crate docs: its `//!` lines up to the first empty one.
fn crate_summary(lib_rs: &str) -> String {
    lib_rs
        .lines()
        .map_while(|l| l.strip_prefix("//!"))
        .map(str::trim)
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// dblock/Cargo.toml's `description`.
fn cargo_description(cargo_toml: &str) -> String {
    let line = cargo_toml
        .lines()
        .find(|l| l.starts_with("description"))
        .expect("dblock/Cargo.toml has a description");
    line.split_once('=')
        .unwrap()
        .1
        .trim()
        .trim_matches('"')
        .to_string()
}

#[test]
fn the_summary_the_description_and_help_name_every_backend_target_rs_opens() {
    let backends = backends(&library_file("src/target.rs"));
    // The parse found what target.rs opens today; a fourth arm only adds to it.
    assert!(backends.len() >= 3, "{backends:?}");
    for known in ["postgres", "mysql", "sqlite"] {
        assert!(
            backends.iter().any(|b| b.iter().any(|s| s == known)),
            "{known} in {backends:?}"
        );
    }
    // Control: the check fails a text naming two of them (the old description's).
    assert_eq!(
        unnamed(&backends, "(PostgreSQL, or an embedded SQLite file)"),
        ["mysql|mariadb"]
    );

    let summary = crate_summary(&library_file("src/lib.rs"));
    assert!(!summary.is_empty());
    assert_eq!(
        unnamed(&backends, &summary),
        Vec::<String>::new(),
        "{summary}"
    );

    let description = cargo_description(&library_file("Cargo.toml"));
    assert_eq!(
        unnamed(&backends, &description),
        Vec::<String>::new(),
        "{description}"
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dblock"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    assert_eq!(unnamed(&backends, &help), Vec::<String>::new(), "{help}");
}

/// Every scheme `target.rs` opens is in the URL lists a user reads: `dblock run --help`'s
/// `--db` and docs/cli.md's "URLs:" (which omitted `mysql://` and `mariadb://`).
#[test]
fn the_url_lists_name_every_scheme_target_rs_opens() {
    let backends = backends(&library_file("src/target.rs"));
    let schemes: Vec<&String> = backends.iter().flatten().collect();
    assert!(schemes.len() >= 5, "{schemes:?}");
    let missing = |text: &str| -> Vec<String> {
        schemes
            .iter()
            .filter(|s| !text.contains(&format!("{s}:")))
            .map(|s| s.to_string())
            .collect()
    };
    // Control: the old list.
    assert_eq!(
        missing("`postgres://…`, `postgresql://…`, `sqlite:PATH`"),
        ["mysql", "mariadb"]
    );

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dblock"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    assert_eq!(missing(&help), Vec::<String>::new(), "{help}");

    let page =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/cli.md"))
            .unwrap();
    let from = page.find("URLs:").expect("docs/cli.md lists the URLs");
    let list = &page[from..];
    let list = &list[..list.find("\n\n").unwrap_or(list.len())];
    assert_eq!(missing(list), Vec::<String>::new(), "{list}");
}
