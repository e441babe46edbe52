//! The file name layouts a migration directory may use: dblock's and sqlx-cli's
//! `VERSION_NAME.sql`, reversible pairs `VERSION_NAME.up.sql` / `VERSION_NAME.down.sql`
//! (sqlx-cli and golang-migrate), and refinery's / Flyway's `VVERSION__NAME.sql`; and
//! the name of the next file in a directory's own layout (`dblock migrate new`).

use std::time::{SystemTime, UNIX_EPOCH};

/// What a file is to its migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The migration (`.sql`, or the `.up.sql` of a pair).
    Up,
    /// The `.down.sql` of a pair: what reverts it.
    Down,
}

/// The naming layout of a file, and so of a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Layout {
    /// `VERSION_NAME.sql`: dblock's own, and sqlx-cli's simple migrations.
    Plain,
    /// `VERSION_NAME.up.sql` with `VERSION_NAME.down.sql`: sqlx-cli's reversible
    /// migrations, golang-migrate's files.
    Reversible,
    /// `VVERSION__NAME.sql`: refinery's and Flyway's versioned migrations.
    Flyway,
}

/// A file name, understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileName<'a> {
    pub(crate) version: i64,
    pub(crate) name: &'a str,
    pub(crate) kind: Kind,
    pub(crate) layout: Layout,
    /// How many digits the version was written with (`0007` → 4).
    pub(crate) width: usize,
}

const RULE: &str = "expected VERSION_NAME.sql (digits, one underscore, then letters, digits, \
                    _ or -, e.g. 0001_create_users.sql), VERSION_NAME.up.sql with \
                    VERSION_NAME.down.sql, or VVERSION__NAME.sql";

/// The file name `file_name` understood, or what is wrong with it.
pub(crate) fn parse(file_name: &str) -> Result<FileName<'_>, String> {
    let Some(stem) = file_name.strip_suffix(".sql") else {
        return Err(format!("the extension must be .sql in lowercase; {RULE}"));
    };
    if let Some(rest) = stem.strip_prefix('V') {
        return flyway(rest);
    }
    if stem.starts_with(['R', 'U']) && stem.contains("__") {
        return Err(format!(
            "refinery/Flyway {} migrations are not supported: dblock applies each \
             migration once, in version order; {RULE}",
            if stem.starts_with('R') {
                "repeatable (R__)"
            } else {
                "undo or unversioned (U…__)"
            }
        ));
    }
    let (stem, kind, layout) = if let Some(s) = stem.strip_suffix(".up") {
        (s, Kind::Up, Layout::Reversible)
    } else if let Some(s) = stem.strip_suffix(".down") {
        (s, Kind::Down, Layout::Reversible)
    } else {
        (stem, Kind::Up, Layout::Plain)
    };
    let digits = stem.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(format!(
            "the name does not start with a version number; {RULE}"
        ));
    }
    let (number, rest) = stem.split_at(digits);
    let Some(name) = rest.strip_prefix('_') else {
        return Err(format!("no underscore after the version number; {RULE}"));
    };
    Ok(FileName {
        version: version(number)?,
        name: checked_name(name)?,
        kind,
        layout,
        width: digits,
    })
}

/// `VERSION__NAME` after the `V`.
fn flyway(rest: &str) -> Result<FileName<'_>, String> {
    let Some((number, name)) = rest.split_once("__") else {
        return Err(format!("no double underscore after the version; {RULE}"));
    };
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "the version {number:?} is not a whole number (dotted Flyway versions such as \
             V1.1 or V1_1 are not supported: dblock's versions are integers); {RULE}"
        ));
    }
    Ok(FileName {
        version: version(number)?,
        name: checked_name(name)?,
        kind: Kind::Up,
        layout: Layout::Flyway,
        width: number.len(),
    })
}

fn version(number: &str) -> Result<i64, String> {
    number
        .parse::<i64>()
        .map_err(|_| format!("the version {number} is larger than 2^63 - 1"))
}

fn checked_name(name: &str) -> Result<&str, String> {
    if name.is_empty() {
        return Err(format!("nothing after the underscore; {RULE}"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(format!("{c:?} is not allowed in the name; {RULE}"));
    }
    Ok(name)
}

/// Whether a version reads as a UTC timestamp `YYYYMMDDhhmmss`, as sqlx-cli and
/// golang-migrate write them by default.
fn is_timestamp(version: i64) -> bool {
    let s = version.to_string();
    if s.len() != 14 {
        return false;
    }
    let n = |r: std::ops::Range<usize>| s.get(r).and_then(|x| x.parse::<u32>().ok());
    matches!(
        (n(0..4), n(4..6), n(6..8), n(8..10), n(10..12), n(12..14)),
        (
            Some(1970..=9999),
            Some(1..=12),
            Some(1..=31),
            Some(0..=23),
            Some(0..=59),
            Some(0..=60)
        )
    )
}

/// The UTC time `t` as `YYYYMMDDhhmmss`.
fn timestamp(t: SystemTime) -> i64 {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (rem / 3600, rem / 60 % 60, rem % 60);
    let hms = i64::try_from(h * 10_000 + m * 100 + s).unwrap_or(0);
    ((year * 100 + month) * 100 + day) * 1_000_000 + hms
}

/// A name as a file name may carry it: anything but letters, digits, `_` and `-`
/// becomes `_` (as sqlx-cli turns spaces into underscores).
fn file_name_part(name: &str) -> String {
    let s: String = name
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    s.trim_matches('_').to_string()
}

/// What the directory's existing files say about how the next one is named.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Style {
    pub(crate) layout: Layout,
    /// The greatest version, and the number of digits its file name used.
    pub(crate) last: Option<(i64, usize)>,
}

/// The file names (one, or an up/down pair) of a new migration `name` after the
/// directory's existing ones, in their layout: the next timestamp if versions are
/// timestamps (never below the last one plus one), else the last version plus one, with
/// as many digits as the last; `0001_NAME.sql` in an empty directory.
pub(crate) fn next_files(style: Style, name: &str, now: SystemTime) -> Result<Vec<String>, String> {
    let name = file_name_part(name);
    if name.is_empty() {
        return Err("the name needs at least one letter or digit".into());
    }
    let (version, width) = match style.last {
        None => (1, 4),
        Some((last, width)) => {
            let next = last
                .checked_add(1)
                .ok_or("the last version is 2^63 - 1: no version follows it")?;
            if is_timestamp(last) {
                (timestamp(now).max(next), 14)
            } else {
                (next, width)
            }
        }
    };
    let v = format!("{version:0width$}");
    Ok(match style.layout {
        Layout::Plain => vec![format!("{v}_{name}.sql")],
        Layout::Reversible => vec![format!("{v}_{name}.up.sql"), format!("{v}_{name}.down.sql")],
        Layout::Flyway => vec![format!("V{v}__{name}.sql")],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn v(f: &str) -> Option<(i64, &str, Kind, Layout)> {
        parse(f).ok().map(|p| (p.version, p.name, p.kind, p.layout))
    }

    #[test]
    fn the_layouts_of_sqlx_golang_migrate_and_flyway_are_understood() {
        use Kind::*;
        use Layout::*;
        assert_eq!(v("0001_users.sql"), Some((1, "users", Up, Plain)));
        assert_eq!(
            v("20240101093000_add_x.up.sql"),
            Some((20240101093000, "add_x", Up, Reversible))
        );
        assert_eq!(
            v("20240101093000_add_x.down.sql"),
            Some((20240101093000, "add_x", Down, Reversible))
        );
        assert_eq!(v("V12__add-y_z.sql"), Some((12, "add-y_z", Up, Flyway)));
        assert_eq!(parse("V0012__a.sql").unwrap().width, 4);
        for bad in [
            "V1.1__a.sql",
            "V1_1__a.sql",
            "V__a.sql",
            "V1_a.sql",
            "R__refresh_views.sql",
            "U2__undo.sql",
            "1_a.UP.sql",
            "1_a.sideways.sql",
            "1_.up.sql",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let e = parse("V1.1__a.sql").unwrap_err();
        assert!(e.contains("dotted Flyway versions"), "{e}");
    }

    #[test]
    fn timestamps_are_recognised_and_written_in_utc() {
        assert!(is_timestamp(20240229235959));
        assert!(!is_timestamp(20241301000000), "month 13");
        assert!(!is_timestamp(1));
        assert!(!is_timestamp(2024010100000), "13 digits");
        // 2024-02-29 23:59:59 UTC
        let t = UNIX_EPOCH + Duration::from_secs(1_709_251_199);
        assert_eq!(timestamp(t), 20240229235959);
        assert_eq!(timestamp(UNIX_EPOCH), 19700101000000);
    }

    #[test]
    fn the_next_file_follows_the_directorys_own_naming() {
        let now = UNIX_EPOCH + Duration::from_secs(1_709_251_199);
        let next = |layout, last| next_files(Style { layout, last }, "Add users  email!", now);
        assert_eq!(
            next(Layout::Plain, None).unwrap(),
            ["0001_Add_users__email.sql"]
        );
        assert_eq!(
            next(Layout::Plain, Some((41, 4))).unwrap(),
            ["0042_Add_users__email.sql"]
        );
        assert_eq!(
            next(Layout::Reversible, Some((20230101000000, 14))).unwrap(),
            [
                "20240229235959_Add_users__email.up.sql",
                "20240229235959_Add_users__email.down.sql"
            ]
        );
        // A timestamp in the future (a clock behind): still after the last.
        assert_eq!(
            next(Layout::Flyway, Some((20990101000000, 14))).unwrap(),
            ["V20990101000001__Add_users__email.sql"]
        );
        assert_eq!(
            next(Layout::Flyway, Some((7, 1))).unwrap(),
            ["V8__Add_users__email.sql"]
        );
        assert!(
            next_files(
                Style {
                    layout: Layout::Plain,
                    last: None
                },
                " !! ",
                now
            )
            .is_err()
        );
        assert!(next(Layout::Plain, Some((i64::MAX, 19))).is_err());
    }
}
