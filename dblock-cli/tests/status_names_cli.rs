//! What `dblock status` and `dblock release` say of semaphores and lock sets, and that
//! every name they (and `dblock run`) print reaches the operator's terminal as one line
//! with no control character or escape sequence in it, whatever a client named a lock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Output;
use std::time::Duration;

use dblock_testkit::{MyDb, PgSchema, SqliteDb, exit_code as code};

const DBLOCK: &str = env!("CARGO_BIN_EXE_dblock");

async fn dblock(state: &std::path::Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    dblock_testkit::dblock_output(DBLOCK, state, env, args).await
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A character a terminal acts on, or that hides or reorders what follows.
fn unsafe_char(c: char) -> bool {
    (c.is_control() && c != '\n')
        || matches!(
            c,
            '\u{061c}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{feff}'
        )
}

fn assert_safe(what: &str, s: &str) {
    if let Some(line) = s.lines().find(|l| l.chars().any(unsafe_char)) {
        panic!("{what}: a control character reaches the terminal in {line:?}");
    }
}

/// `s` as dblock shows it (its documented escaping: `\u{..}` and `\\`).
fn shown(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if unsafe_char(c) || c == '\n' || c == '\u{fff9}' => {
                out.push_str(&format!("\\u{{{:x}}}", c as u32))
            }
            c => out.push(c),
        }
    }
    out
}

/// Two holders of the semaphore "exports" (limit 2), each on a connection of its own,
/// show under the semaphore's name, each slot with its holder, asked for by name and in
/// the full listing; `release --force exports` ends both and says which slot each held.
/// Before, `status exports` said "no locks held or awaited" and the listing showed
/// "name unknown".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_release_show_a_semaphores_slots_under_its_name() {
    let pg = PgSchema::new("cli_status_sem").await;
    let my = MyDb::new("cli_status_sem").await;
    let sqlite = SqliteDb::new();
    let state = tempfile::tempdir().unwrap();
    for url in [pg.url.as_str(), my.url.as_str(), sqlite.url.as_str()] {
        let a = dblock::Locks::connect(url).await.unwrap();
        let b = dblock::Locks::connect(url).await.unwrap();
        let ga = a.semaphore("exports", 2).lock().await.unwrap();
        let gb = b.semaphore("exports", 2).lock().await.unwrap();
        let ns = a.namespace().to_string();
        let out = dblock(state.path(), &[], &["status", "--db", url, "exports"]).await;
        assert_eq!(code(&out), 0, "{url}: {out:?}");
        let listing = text(&out.stdout);
        for slot in [ga.slot(), gb.slot()] {
            let line = format!("exports (slot {slot} of a semaphore)  (namespace {ns}, key ");
            assert!(listing.contains(&line), "{url}: {line} in\n{listing}");
        }
        assert_eq!(listing.matches("  held by   ").count(), 2, "{listing}");
        // The whole database: PostgreSQL names the slots from their requests' comments.
        if url == pg.url {
            let out = dblock(state.path(), &[], &["status", "--db", url]).await;
            let listing = text(&out.stdout);
            let mine = listing
                .lines()
                .filter(|l| l.contains(&format!("(namespace {ns}, key ")))
                .filter(|l| l.starts_with("exports (slot "))
                .count();
            assert_eq!(mine, 2, "{listing}");
        }
        let out = dblock(
            state.path(),
            &[],
            &["release", "--db", url, "exports", "--force"],
        )
        .await;
        if url == sqlite.url {
            // The embedded backend's locks end only with their process: refused, named.
            assert_eq!(code(&out), 64, "{out:?}");
            assert!(text(&out.stderr).contains(&std::process::id().to_string()));
            continue;
        }
        assert_eq!(code(&out), 0, "{url}: {out:?}");
        let said = text(&out.stdout);
        for slot in [ga.slot(), gb.slot()] {
            let line = format!("which held slot {slot} of semaphore \"exports\"");
            assert!(said.contains(&line), "{url}: {line} in\n{said}");
        }
        for g in [ga, gb] {
            let lost = tokio::time::timeout(Duration::from_secs(10), g.lost()).await;
            assert!(lost.is_ok(), "{url}: the holder was told");
        }
    }
}

/// Ending the session that holds a 200-name lock set says how many locks went with it.
/// Before, `release --force h0` said only "which held lock h0".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_says_how_many_locks_the_ended_session_held() {
    let pg = PgSchema::new("cli_release_set").await;
    let state = tempfile::tempdir().unwrap();
    let locks = pg.locks().await;
    let names: Vec<String> = (0..200).map(|i| format!("h{i}")).collect();
    let set = locks
        .lock_all(names.iter().map(String::as_str))
        .await
        .unwrap();
    let out = dblock(
        state.path(),
        &[],
        &["release", "--db", &pg.url, "h0", "--force"],
    )
    .await;
    assert_eq!(code(&out), 0, "{out:?}");
    let said = text(&out.stdout);
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(
        said.contains("which held lock \"h0\" and 199 other locks"),
        "{said}"
    );
    let lost = tokio::time::timeout(Duration::from_secs(10), set.lost()).await;
    assert!(lost.is_ok(), "the set's holder was told");
}

/// Names a client could choose, with newlines, escape sequences, C1 controls,
/// bidirectional overrides and backslashes in them (from a seed printed on failure).
fn random_names(seed: u64, n: usize) -> Vec<String> {
    const NASTY: &[char] = &[
        '\n', '\r', '\t', '\x1b', '\x07', '\x08', '\x7f', '\u{85}', '\u{9b}', '\u{202e}',
        '\u{2028}', '\u{200b}', '\u{2066}', '\u{feff}', '\\', '"', '\'', ' ', '[', '*', '/', ';',
        '%', 'é', '✓',
    ];
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut names: Vec<String> = (0..n)
        .map(|i| {
            let len = rng.usize(1..24);
            let mut s: String = (0..len)
                .map(|_| match rng.u8(0..3) {
                    0 => NASTY[rng.usize(..NASTY.len())],
                    1 => rng.char('\u{1}'..='\u{7f}'),
                    _ => rng.alphanumeric(),
                })
                .collect();
            // Distinct, and at least one control character in every other name.
            s.push_str(&format!("{i}"));
            if i % 2 == 0 {
                s.insert(0, '\x1b');
            }
            s
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Every name a client chose prints as one line that shows it escaped, in `status`
/// (asked for, and the full listing), the refused `run`, its wait notice and timeout,
/// and the hint of `release` without `--force`. Before, a name with a newline or an
/// escape sequence reached the terminal as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_from_any_client_print_as_one_safe_line() {
    let seed = std::env::var("DBLOCK_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    eprintln!("names from seed {seed} (DBLOCK_FUZZ_SEED={seed} to replay)");
    let state = tempfile::tempdir().unwrap();

    // The embedded file: 150 names held (fenced, so the full listing knows them).
    let sqlite = SqliteDb::new();
    let locks = sqlite.locks().await;
    let names = random_names(seed, 150);
    let mut held = Vec::new();
    for n in &names {
        held.push(locks.request(n).fenced().lock().await.unwrap());
    }
    let out = dblock(state.path(), &[], &["status", "--db", &sqlite.url]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    let listing = text(&out.stdout);
    assert_safe(&format!("seed {seed}: status"), &listing);
    assert_eq!(listing.lines().count(), 2 * names.len(), "seed {seed}");
    for n in &names {
        let line = format!("{}  (namespace public, key ", shown(n));
        assert!(listing.contains(&line), "seed {seed}: {line:?}");
    }

    // PostgreSQL (names from the requests' comments) and MySQL (names asked for).
    let pg = PgSchema::new("cli_names").await;
    let my = MyDb::new("cli_names").await;
    for (url, few) in [(&pg.url, 8), (&my.url, 8)] {
        // Checked every 50 ms: on PostgreSQL a lock a try granted is named by its
        // comment from its first health check on.
        let locks = dblock_testkit::checked_often(url).await;
        let ns = locks.namespace().to_string();
        let names = random_names(seed ^ 1, few);
        let mut held = Vec::new();
        for n in &names {
            held.push(locks.lock(n).await.unwrap());
        }
        if *url == pg.url {
            let named = dblock_testkit::eventually(10, &mut || async {
                let st = locks.status(&[]).await.unwrap_or_default();
                names
                    .iter()
                    .all(|n| st.iter().any(|l| l.name.as_deref() == Some(n.as_str())))
            })
            .await;
            assert!(named, "seed {seed}: not every lock named");
        }
        let mut args = vec!["status", "--db", url.as_str()];
        if *url == my.url {
            // After `--`, as a user gives names: any of them may begin with '-'.
            args.push("--");
            args.extend(names.iter().map(String::as_str));
        }
        let out = dblock(state.path(), &[], &args).await;
        assert_eq!(code(&out), 0, "{out:?}");
        let listing = text(&out.stdout);
        assert_safe(&format!("seed {seed}: status on {url}"), &listing);
        let mine: Vec<&str> = listing
            .lines()
            .filter(|l| l.contains(&format!("  (namespace {ns}, key ")))
            .collect();
        assert_eq!(mine.len(), names.len(), "seed {seed}: {listing}");
        for n in &names {
            let line = format!("{}  (namespace {ns}, key ", shown(n));
            assert!(
                mine.iter().any(|l| l.starts_with(&line)),
                "seed {seed}: {line:?}"
            );
        }
    }

    // One line on stderr for the refused run, the notice and timeout of a wait, and the
    // release hint — for some of the embedded names.
    for (i, n) in names.iter().take(12).enumerate() {
        let out = dblock(
            state.path(),
            &[],
            &[
                "run",
                "--db",
                &sqlite.url,
                "--no-wait",
                "--",
                n,
                "--",
                "true",
            ],
        )
        .await;
        assert_eq!(code(&out), 75, "{out:?}");
        let err = text(&out.stderr);
        assert_safe(&format!("seed {seed}: refused run"), &err);
        assert_eq!(err.lines().count(), 1, "seed {seed}: {err:?}");
        let out = dblock(
            state.path(),
            &[],
            &["release", "--db", &sqlite.url, "--", n],
        )
        .await;
        assert_eq!(code(&out), 64, "{out:?}");
        let err = text(&out.stderr);
        assert_safe(&format!("seed {seed}: release hint"), &err);
        assert_eq!(err.lines().count(), 1, "seed {seed}: {err:?}");
        if i >= 3 {
            continue;
        }
        let out = dblock(
            state.path(),
            &[("DBLOCK_WAIT_NOTICE", "1")],
            &[
                "run",
                "--db",
                &sqlite.url,
                "--wait",
                "1300ms",
                "--",
                n,
                "--",
                "true",
            ],
        )
        .await;
        assert_eq!(code(&out), 75, "{out:?}");
        let err = text(&out.stderr);
        assert_safe(&format!("seed {seed}: wait notice"), &err);
        assert_eq!(
            err.lines().count(),
            2,
            "seed {seed}: notice, timeout: {err:?}"
        );
    }
    drop(held);
}

/// A name that begins with '-' is given after a first `--`, as options end in every
/// POSIX tool: `run -- -NAME -- COMMAND`, `status -- -NAME`, `release -- -NAME`; the hint
/// `release` prints is a command that parses. Before, `status` and `release` took such
/// a name for an option (CI saw it from a fuzzed name) and `run` could not be given one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_begins_with_a_dash_goes_after_a_double_dash() {
    let state = tempfile::tempdir().unwrap();
    let sqlite = SqliteDb::new();
    let db = sqlite.url.as_str();
    let out = dblock(
        state.path(),
        &[],
        &[
            "run",
            "--db",
            db,
            "--",
            "-job",
            "--",
            "sh",
            "-c",
            "printf %s \"$DBLOCK_NAME\"",
        ],
    )
    .await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert_eq!(text(&out.stdout), "-job", "COMMAND ran under the name");

    let locks = sqlite.locks().await;
    let held = locks.lock("-job").await.unwrap();
    let out = dblock(
        state.path(),
        &[],
        &["run", "--db", db, "--no-wait", "--", "-job", "--", "true"],
    )
    .await;
    assert_eq!(code(&out), 75, "the same lock, held: {out:?}");
    let out = dblock(state.path(), &[], &["status", "--db", db, "--", "-job"]).await;
    assert_eq!(code(&out), 0, "{out:?}");
    assert!(text(&out.stdout).starts_with("-job  (namespace"), "{out:?}");
    let out = dblock(state.path(), &[], &["release", "--db", db, "--", "-job"]).await;
    assert_eq!(code(&out), 64, "{out:?}");
    assert!(
        text(&out.stderr).contains("`dblock status -- -job` shows the holder"),
        "{out:?}"
    );
    drop(held);

    // Without the first `--`, a leading '-' is an option: refused with usage (64), and a
    // missing NAME says how to give one.
    for args in [
        &["run", "--db", db, "-job", "--", "true"][..],
        &["run", "--db", db, "--", "true"][..],
        &["run", "--db", db, "--", "--", "true"][..],
    ] {
        let out = dblock(state.path(), &[], args).await;
        assert_eq!(code(&out), 64, "{args:?}: {out:?}");
        assert_eq!(text(&out.stderr).lines().count(), 1, "{out:?}");
    }
    let out = dblock(state.path(), &[], &["run", "--db", db, "--", "true"]).await;
    assert!(
        text(&out.stderr).contains("dblock run [OPTIONS] -- NAME -- COMMAND"),
        "{out:?}"
    );
}
