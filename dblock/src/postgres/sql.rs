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
pub(crate) fn i64_text(k: i64, buf: &mut [u8; 20]) -> &str {
    let mut n = k.unsigned_abs();
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
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
        for k in [0, 1, -1, 42, -5686219459067394536, i64::MAX, i64::MIN] {
            assert_eq!(i64_text(k, &mut buf), k.to_string());
        }
    }

    #[test]
    fn literals_and_identifiers_are_quoted() {
        assert_eq!(quote_literal(r"a'b\c"), r"E'a''b\\c'");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    }
}
