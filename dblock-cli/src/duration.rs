//! DURATION arguments: `500ms`, `30s`, `5m`, `1h`, `1.5s`.

use std::time::Duration;

/// Parses a duration: a non-negative number (decimals allowed) followed by `ms`, `s`,
/// `m` or `h`, with no space.
pub fn parse(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("{s:?} has no unit: write e.g. 500ms, 30s, 5m or 1h"))?;
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "{s:?} does not start with a number: write e.g. 500ms, 30s, 5m"
        ));
    }
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{num:?} in {s:?} is not a number"))?;
    let scale = match unit {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {s:?}: use ms, s, m or h"
            ));
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || secs > 1e9 {
        return Err(format!("{s:?} is too long"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_the_contract() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn bad_durations_say_why() {
        for bad in ["", "30", "s", "-1s", "5 m", "5x", "1..2s", "1e999h"] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
