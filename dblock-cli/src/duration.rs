//! DURATION arguments: `500ms`, `30s`, `5m`, `1h`, `1.5s`, and combinations such as
//! `1h30m` or `2 min 10 s`, read by jiff's "friendly" duration parser (ISO 8601's
//! `PT30S` too).

use std::time::Duration;

use jiff::fmt::friendly::SpanParser;

/// The longest duration accepted (about 31 years): anything longer is a typo, and a
/// deadline that far out would overflow the clock's arithmetic on some platforms.
const MAX: Duration = Duration::from_secs(1_000_000_000);

static PARSER: SpanParser = SpanParser::new();

/// Parses a non-negative duration: a number (decimals allowed) and a unit — `ms`, `s`,
/// `m`, `h` or their longer spellings — possibly several (`1h30m`). The error is one
/// line naming the input and the spellings accepted.
pub fn parse(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let fail = |why: &str| {
        format!("{t:?} is not a duration{why}: write e.g. 500ms, 30s, 1.5s, 5m, 1h or 1h30m")
    };
    // A bare number reads as seconds in some tools and milliseconds in others: refused.
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(fail(" (it has no unit)"));
    }
    if t.starts_with('-') {
        return Err(fail(" (it is negative)"));
    }
    let d = PARSER.parse_unsigned_duration(t).map_err(|_| fail(""))?;
    if d > MAX {
        return Err(format!("{t:?} is too long (at most {}s)", MAX.as_secs()));
    }
    Ok(d)
}

/// What any text must give: a duration within bounds, or a one-line error. Called by
/// the property tests, the fuzz target (`fuzz/fuzz_targets/duration.rs`, which includes
/// this file) and the replay of its corpus.
#[cfg(any(test, fuzzing))]
pub fn check(s: &str) {
    match parse(s) {
        Ok(d) => assert!(d <= MAX, "{s:?} gave {d:?}"),
        Err(e) => assert!(!e.is_empty() && !e.contains(['\n', '\r']), "{s:?}: {e:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn durations_read_like_the_contract() {
        for (s, want) in [
            ("500ms", Duration::from_millis(500)),
            ("30s", Duration::from_secs(30)),
            ("5m", Duration::from_secs(300)),
            ("1h", Duration::from_secs(3600)),
            ("1.5s", Duration::from_millis(1500)),
            ("0s", Duration::ZERO),
            ("0ms", Duration::ZERO),
            (" 10s ", Duration::from_secs(10)),
            ("1h30m", Duration::from_secs(5400)),
            ("2 min 10 s", Duration::from_secs(130)),
            ("0.25h", Duration::from_secs(900)),
        ] {
            assert_eq!(parse(s), Ok(want), "{s:?}");
        }
    }

    #[test]
    fn bad_durations_say_why_on_one_line() {
        for bad in [
            "",
            "30",
            "1.5",
            "s",
            "-1s",
            "5x",
            "1..2s",
            "1e999h",
            "NaNs",
            "infs",
            "ms5",
            "5 m x",
            "99999999999h",
        ] {
            match parse(bad) {
                Ok(d) => panic!("{bad:?} accepted as {d:?}"),
                Err(e) => {
                    assert!(!e.contains('\n'), "{bad:?}: {e}");
                    assert!(e.contains(&format!("{:?}", bad.trim())), "{bad:?}: {e}");
                }
            }
        }
        assert!(parse("30").unwrap_err().contains("no unit"));
        assert!(parse("-1s").unwrap_err().contains("negative"));
        assert!(
            parse("40000y").is_err(),
            "years are not a unit of time here"
        );
        assert!(parse("1000000001s").unwrap_err().contains("too long"));
        assert_eq!(parse("1000000000s"), Ok(MAX));
    }

    const UNITS: [(&str, u64); 4] = [
        ("h", 3_600_000_000_000),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
    ];

    /// A number of unit `UNITS[u]` (in thousandths when `frac`), written and meant.
    fn spelled_in(u: usize, frac: bool) -> impl Strategy<Value = (String, Duration)> {
        let (unit, nanos_per) = UNITS[u];
        let thousandths = if frac { 0u32..1000 } else { 0u32..1 };
        (0u64..100_000, thousandths).prop_map(move |(whole, f)| {
            let text = if frac {
                format!("{whole}.{f:03}{unit}")
            } else {
                format!("{whole}{unit}")
            };
            // Thousandths are exact in every unit (a millisecond's are microseconds).
            let nanos = u128::from(whole) * u128::from(nanos_per)
                + u128::from(f) * u128::from(nanos_per) / 1000;
            let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
            let sub = u32::try_from(nanos % 1_000_000_000).unwrap_or(0);
            (text, Duration::new(secs, sub))
        })
    }

    /// A duration written in one of the promised spellings.
    fn spelled() -> impl Strategy<Value = (String, Duration)> {
        (0..UNITS.len(), any::<bool>()).prop_flat_map(|(u, frac)| spelled_in(u, frac))
    }

    /// Two spans in falling units, the first whole (`1h30m`, `2m0.5s`): jiff's rule.
    fn two_spans() -> impl Strategy<Value = ((String, Duration), (String, Duration))> {
        (0..UNITS.len() - 1)
            .prop_flat_map(|a| (Just(a), a + 1..UNITS.len(), any::<bool>()))
            .prop_flat_map(|(a, b, frac)| (spelled_in(a, false), spelled_in(b, frac)))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Every promised spelling reads as the duration it writes, exactly.
        #[test]
        fn every_promised_spelling_reads_as_what_it_says((text, want) in spelled()) {
            prop_assert_eq!(parse(&text), Ok(want), "{}", text);
        }

        /// Two spans written one after the other add up (`1h30m`).
        #[test]
        fn spans_written_together_add_up((a, b) in two_spans()) {
            let joined = format!("{}{}", a.0, b.0);
            let want = a.1 + b.1;
            if want <= MAX {
                prop_assert_eq!(parse(&joined), Ok(want), "{}", joined);
            }
        }

        /// Any text whatever gives a duration within bounds or a one-line error: never a
        /// panic.
        #[test]
        fn any_text_is_a_duration_or_a_one_line_error(s in ".{0,24}") {
            check(&s);
        }

        /// Text built from the characters durations are made of, the hard cases for a
        /// parser: accepted only within bounds, else a one-line error.
        #[test]
        fn duration_like_text_is_a_duration_or_a_one_line_error(s in "[0-9.+ -]{0,6}(ms|s|m|h|min|sec|x|)[0-9. ]{0,4}(ms|s|m|h|)") {
            check(&s);
        }
    }

    /// Every input kept in the fuzz target's corpus (`fuzz/corpus/duration/`), replayed
    /// on stable Rust so an input a fuzzer once broke stays fixed.
    #[test]
    fn the_fuzz_corpus_replays() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/duration");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if let Ok(s) = std::str::from_utf8(&data) {
                check(s);
            }
            n += 1;
        }
        assert!(n >= 10, "only {n} inputs in {}", dir.display());
    }
}
