//! Small pieces of SQL text: quoting, a key in decimal, the first value of a result.

use super::conn::wire::Results;

/// The first column of the first row of statement `i`.
pub(crate) fn first_value(rows: &Results, i: usize) -> Option<String> {
    rows.get(i)?.first()?.clone()
}

/// `s` as an SQL string literal, safe whatever `standard_conforming_strings` says.
pub(crate) fn quote_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 3);
    out.push_str("E'");
    for c in s.chars() {
        match c {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// `s` as an SQL identifier.
pub(crate) fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `k` in decimal, written into `buf`: a key's text without the formatting machinery.
/// Two digits a step, from a table: a key has 19 digits mostly, and a digit a step was
/// 2.4 % of a PostgreSQL lock cycle's client instructions (callgrind, `cycle_profile`).
pub(crate) fn i64_text(k: i64, buf: &mut [u8; 20]) -> &str {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839\
        4041424344454647484950515253545556575859\
        6061626364656667686970717273747576777879\
        8081828384858687888990919293949596979899";
    let mut n = k.unsigned_abs();
    let mut at = buf.len();
    while n >= 100 {
        let pair = (n % 100) as usize * 2;
        n /= 100;
        at -= 2;
        buf[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if n >= 10 {
        let pair = n as usize * 2;
        at -= 2;
        buf[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        at -= 1;
        buf[at] = b'0' + n as u8;
    }
    if k < 0 {
        at -= 1;
        buf[at] = b'-';
    }
    // Only ASCII digits and '-' were written.
    std::str::from_utf8(&buf[at..]).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_written_in_decimal() {
        let mut buf = [0u8; 20];
        for k in [0, 1, -1, 9, 10, -10, 42, 99, 100, -101, 999, 1000, 12345] {
            assert_eq!(i64_text(k, &mut buf), k.to_string());
        }
        for k in [-5686219459067394536, i64::MAX, i64::MIN, i64::MIN + 1] {
            assert_eq!(i64_text(k, &mut buf), k.to_string());
        }
        // Every length from 1 to 19 digits, both signs, odd and even digit counts.
        let mut k: i64 = 7;
        while let Some(next) = k.checked_mul(10) {
            for v in [k, -k, k - 1, -(k - 1), k + 3] {
                assert_eq!(i64_text(v, &mut buf), v.to_string());
            }
            k = next + 3;
        }
    }

    #[test]
    fn literals_and_identifiers_are_quoted() {
        assert_eq!(quote_literal(r"a'b\c"), r"E'a''b\\c'");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }
}
