//! `dblock status` (who holds and awaits locks) and `dblock release NAME --force` (end
//! the holder's session), and the one-line description of a holder that `dblock run`
//! prints while it waits.

use std::time::{Duration, SystemTime};

use clap::Args;
use dblock::status::{LockStatus, Party, age, mode_str, scope_str};

use crate::{EXIT_USAGE, exit_code, one_line};

/// `s` as it may reach an operator's terminal: see [`dblock::status::shown`] (control,
/// separator and invisible or reordering characters written `\u{..}`, a backslash `\\`).
pub(crate) fn shown(s: &str) -> std::borrow::Cow<'_, str> {
    dblock::status::shown(s)
}

/// [`shown`], quoted: `"name"` (a quote inside written `\"`).
pub(crate) fn quoted(s: &str) -> String {
    format!("\"{}\"", shown(s).replace('"', "\\\""))
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Database URL (as for `run`).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Namespace the NAMEs are keyed in (as for `run`).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,

    /// Print the documented JSON shape (docs/status.md) instead of text.
    #[arg(long)]
    json: bool,

    /// Print again every 2 seconds until interrupted.
    #[arg(long)]
    watch: bool,

    /// Only these locks (by name); without NAMEs, every lock the database shows. Names
    /// that begin with `-` go after `--` (`dblock status -- -a b`).
    #[arg(value_name = "NAME")]
    names: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ReleaseArgs {
    /// Database URL (as for `run`).
    #[arg(long, value_name = "URL")]
    db: Option<String>,

    /// Namespace the NAME is keyed in (as for `run`).
    #[arg(long, value_name = "NS")]
    namespace: Option<String>,

    /// End the holder's database session (required: the holder loses the lock).
    #[arg(long)]
    force: bool,

    /// The lock name (one that begins with `-` goes after `--`).
    #[arg(value_name = "NAME")]
    name: String,
}

pub(crate) async fn open(db: Option<&str>, namespace: Option<&str>) -> Result<dblock::Locks, u8> {
    crate::notice::embedded_default(db);
    let mut builder = dblock::Locks::builder().max_connections(2);
    if let Some(url) = db {
        builder = builder.url(url);
    }
    if let Some(ns) = namespace {
        builder = builder.namespace(ns);
    }
    builder.build().await.map_err(|e| {
        errln!("dblock: {}", one_line(&e));
        exit_code(&e)
    })
}

pub async fn status(args: StatusArgs) -> u8 {
    let locks = match open(args.db.as_deref(), args.namespace.as_deref()).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
    loop {
        let rows = match locks.status(&names).await {
            Ok(r) => r,
            Err(e) => {
                errln!("dblock: {}", one_line(&e));
                return exit_code(&e);
            }
        };
        let now = SystemTime::now();
        if args.json {
            let report = dblock::status::Report::new(locks.backend_name(), &rows, now);
            match serde_json::to_string(&report) {
                Ok(json) => outln!("{json}"),
                Err(e) => {
                    errln!("dblock: cannot write the status as JSON: {e}");
                    return crate::EXIT_UNEXPECTED;
                }
            }
        } else {
            if args.watch {
                // Clear the screen, cursor home.
                outln!("\x1b[2J\x1b[H{} locks, {:?}", locks.backend_name(), now);
            }
            print_text(&rows, now);
        }
        if !args.watch {
            return 0;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

fn print_text(rows: &[LockStatus], now: SystemTime) {
    if rows.is_empty() {
        outln!("no locks held or awaited");
        return;
    }
    for l in rows {
        outln!("{}", lock_line(l));
        for h in &l.holders {
            outln!("  held by   {}", party_line(h, now));
        }
        for w in &l.waiters {
            outln!("  waiting   {}", party_line(w, now));
        }
    }
}

/// `exports (slot 1 of a semaphore)  (namespace public, key K)`; every name escaped.
fn lock_line(l: &LockStatus) -> String {
    let slot = match l.slot {
        Some(i) => format!(" (slot {i} of a semaphore)"),
        None => String::new(),
    };
    match (&l.name, &l.namespace) {
        (Some(n), Some(ns)) => format!(
            "{}{slot}  (namespace {}, key {})",
            shown(n),
            shown(ns),
            l.key
        ),
        (Some(n), None) => format!("{}{slot}  (key {})", shown(n), l.key),
        _ => format!(
            "key {}  (name unknown: not taken by dblock, or not shown)",
            l.key
        ),
    }
}

/// `program[pid]@host (connection N) from ADDR, exclusive, transaction, for 12s`, what
/// the server reported escaped.
fn party_line(p: &Party, now: SystemTime) -> String {
    let mut s = shown(&p.describe()).into_owned();
    if let Some(c) = &p.client {
        s.push_str(&format!(" from {}", shown(c)));
    }
    s.push_str(&format!(", {}", mode_str(p.mode)));
    if let Some(scope) = p.scope {
        s.push_str(&format!(", {}", scope_str(scope)));
    }
    if let Some(t) = p.since {
        s.push_str(&format!(", for {}", show_age(age(t, now))));
    }
    s
}

pub(crate) fn show_age(d: Duration) -> String {
    dblock::status::age_text(d)
}

/// Who holds `name` — its slots, for a `semaphore` — as one phrase
/// (`dblock[42]@ci-7 (connection 9), for 3.0s`), escaped, if the backend can tell within
/// a second.
pub async fn holders_of(locks: &dblock::Locks, name: &str, semaphore: bool) -> Option<String> {
    let rows = tokio::time::timeout(Duration::from_secs(1), locks.status(&[name]))
        .await
        .ok()?
        .ok()?;
    let now = SystemTime::now();
    let held: Vec<String> = rows
        .iter()
        .filter(|l| l.slot.is_some() == semaphore)
        .flat_map(|l| l.holders.iter())
        .map(|h| {
            let mut s = shown(&h.describe()).into_owned();
            if let Some(t) = h.since {
                s.push_str(&format!(", for {}", show_age(age(t, now))));
            }
            s
        })
        .collect();
    (!held.is_empty()).then(|| held.join("; "))
}

pub async fn release(args: ReleaseArgs) -> u8 {
    let name = quoted(&args.name);
    if !args.force {
        // The hint is a command to paste: the name as the shell needs it.
        errln!(
            "dblock: release {name} would end the database session of whoever holds it, \
             which loses the lock mid-work; pass --force if that is what you mean \
             (`dblock status {}{}` shows the holder)",
            if args.name.starts_with('-') {
                "-- "
            } else {
                ""
            },
            shell_word(&args.name)
        );
        return EXIT_USAGE;
    }
    let locks = match open(args.db.as_deref(), args.namespace.as_deref()).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    // What each session held before it is ended: the slot of a semaphore of this name,
    // and how many locks in all (a lock set is one session on PostgreSQL).
    let before = locks.status(&[]).await.unwrap_or_default();
    let slots = locks.status(&[&args.name]).await.unwrap_or_default();
    match locks.terminate_holders(&args.name).await {
        Ok(ended) if ended.is_empty() => {
            outln!("lock {name} is not held: nothing ended");
            0
        }
        Ok(ended) => {
            for p in &ended {
                let held = |l: &&LockStatus| {
                    p.connection.is_some() && l.holders.iter().any(|h| h.connection == p.connection)
                };
                let what = match slots.iter().filter(held).find_map(|l| l.slot) {
                    Some(i) => format!("slot {i} of semaphore {name}"),
                    None => format!("lock {name}"),
                };
                let others = before.iter().filter(held).count().saturating_sub(1);
                let others = match others {
                    0 => String::new(),
                    1 => " and 1 other lock".to_string(),
                    n => format!(" and {n} other locks"),
                };
                outln!(
                    "ended {}, which held {what}{others}",
                    party_line(p, SystemTime::now())
                );
            }
            0
        }
        Err(e) => {
            errln!("dblock: {}", one_line(&e));
            exit_code(&e)
        }
    }
}

/// `s` as one shell word: as it is when it is plain, else in single quotes (a quote
/// inside written `'\''`), escaped for the terminal either way.
fn shell_word(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/@+=,%".contains(c));
    match plain {
        true => s.to_string(),
        false => format!("'{}'", shown(s).replace('\'', "'\\''")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A character a terminal might act on, or that hides or reorders text.
    fn unsafe_char(c: char) -> bool {
        c.is_control()
            || matches!(
                c,
                '\u{061c}'
                    | '\u{200b}'..='\u{200f}'
                    | '\u{2028}'..='\u{202e}'
                    | '\u{2060}'..='\u{206f}'
                    | '\u{feff}'
                    | '\u{fff9}'..='\u{fffb}'
            )
    }

    /// Undoes [`shown`]: what an operator reads is exactly the name.
    fn unshown(s: &str) -> String {
        let mut out = String::new();
        let mut it = s.chars().peekable();
        while let Some(c) = it.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match it.next() {
                Some('\\') => out.push('\\'),
                Some('u') => {
                    assert_eq!(it.next(), Some('{'), "{s}");
                    let hex: String = it.by_ref().take_while(|&c| c != '}').collect();
                    let n = u32::from_str_radix(&hex, 16).unwrap_or(u32::MAX);
                    out.push(char::from_u32(n).unwrap_or('\u{fffd}'));
                }
                other => panic!("a lone backslash before {other:?} in {s:?}"),
            }
        }
        out
    }

    fn random_text(rng: &mut fastrand::Rng) -> String {
        const NASTY: &[char] = &[
            '\n', '\r', '\t', '\x1b', '\x07', '\x08', '\x7f', '\u{85}', '\u{9b}', '\u{202e}',
            '\u{2028}', '\u{2029}', '\u{200b}', '\u{2066}', '\u{feff}', '\\', '"', '\'', ' ', '[',
            ']', '@', ';', '*', '/', '%', 'é', '✓', '👀',
        ];
        let len = rng.usize(1..40);
        (0..len)
            .map(|_| match rng.u8(0..4) {
                0 => NASTY[rng.usize(..NASTY.len())],
                1 => rng.char('\u{1}'..='\u{7f}'),
                2 => rng.char(..),
                _ => rng.alphanumeric(),
            })
            .collect()
    }

    #[test]
    fn any_text_is_shown_as_one_safe_line_that_reads_back() {
        let seed = std::env::var("DBLOCK_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fastrand::u64(..));
        let mut rng = fastrand::Rng::with_seed(seed);
        for case in 0..50_000 {
            let name = random_text(&mut rng);
            for out in [shown(&name).into_owned(), quoted(&name), shell_word(&name)] {
                assert!(
                    !out.chars().any(unsafe_char),
                    "seed {seed} case {case}: {name:?} printed as {out:?}"
                );
            }
            assert_eq!(unshown(&shown(&name)), name, "seed {seed} case {case}");
            let mut p = Party::default();
            p.program = Some(name.clone());
            p.host = Some(name.clone());
            p.client = Some(name.clone());
            let line = party_line(&p, SystemTime::now());
            assert!(
                !line.chars().any(unsafe_char),
                "seed {seed} case {case}: {line:?}"
            );
        }
    }

    #[test]
    fn plain_names_print_as_they_are() {
        for n in ["autoland:7", "exports", "ünï ✓", "a b"] {
            assert_eq!(shown(n), n);
        }
        assert_eq!(shown("a\nb\x1b[2J"), "a\\u{a}b\\u{1b}[2J");
        assert_eq!(quoted("say \"hi\""), "\"say \\\"hi\\\"\"");
        assert_eq!(shell_word("nightly-report"), "nightly-report");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
    }
}
