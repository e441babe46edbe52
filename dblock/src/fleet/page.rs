//! The page at `/`: the table `dblock status` prints — name, holder, since, waiters — as
//! plain HTML that refreshes itself and reads on a phone. No script: the refresh is a
//! `<meta http-equiv="refresh">`. Every name, and whatever else a server reports, is
//! HTML-escaped and shown as [`status::shown`](crate::status::shown) shows it to a
//! terminal: names are chosen by any client of the database.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::collect::{Scraped, Since};
use crate::raw::{LockStatus, Party};
use crate::status::{age, age_text, mode_str, scope_str, shown};

/// The most locks the page lists (the rest are counted).
pub const MAX_ROWS: usize = 500;

/// The page of `scraped`, reloading itself every `refresh`.
pub fn render(scraped: &Scraped, refresh: Duration) -> String {
    let mut out = String::with_capacity(4096);
    let secs = refresh.as_secs().max(1);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta http-equiv=\"refresh\" content=\"{secs}\">\
         <meta name=\"color-scheme\" content=\"light dark\">\
         <title>dblock: who holds what</title><style>{STYLE}</style></head><body>\n\
         <header><h1>Who holds what</h1>"
    );
    match scraped.scrape() {
        Some(s) => {
            let _ = write!(
                out,
                "<p class=\"meta\">{} · namespace <b>{}</b> · read {} · {} ms</p>",
                s.locks().backend_name(),
                html(s.locks().namespace()),
                clock(s.at()),
                scraped.took().as_millis()
            );
        }
        None => out.push_str("<p class=\"meta\">not read</p>"),
    }
    out.push_str("</header>\n");
    if let Some(e) = scraped.error() {
        let _ = writeln!(
            out,
            "<p class=\"error\" role=\"alert\" id=\"error\">The database could not be read: {}</p>",
            html(e)
        );
    }
    if let Some(s) = scraped.scrape() {
        let mut rows: Vec<&LockStatus> = s
            .status()
            .iter()
            .filter(|l| !l.holders.is_empty() || !l.waiters.is_empty())
            .collect();
        // Named locks first, by name; then the rest by key.
        rows.sort_by(|a, b| {
            (a.name.is_none(), &a.name, a.slot, a.key.as_i64()).cmp(&(
                b.name.is_none(),
                &b.name,
                b.slot,
                b.key.as_i64(),
            ))
        });
        if rows.is_empty() {
            out.push_str("<p id=\"empty\">No locks held or awaited.</p>\n");
        } else {
            out.push_str(
                "<table id=\"locks\"><thead><tr><th>Name</th><th>Holder</th><th>Since</th>\
                 <th>Waiters</th></tr></thead><tbody>\n",
            );
            for l in rows.iter().take(MAX_ROWS) {
                row(&mut out, s, l);
            }
            out.push_str("</tbody></table>\n");
            if rows.len() > MAX_ROWS {
                let _ = writeln!(
                    out,
                    "<p>and {} more locks (see <code>dblock status</code>)</p>",
                    rows.len() - MAX_ROWS
                );
            }
        }
    }
    let _ = write!(
        out,
        "<footer>Refreshes every {secs} s · <a href=\"metrics\">metrics</a> · \
         ≥ marks a time the server does not record: since this page's exporter first saw \
         it.</footer>\n</body></html>\n"
    );
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0 auto;max-width:72rem;\
padding:.75rem;line-height:1.35}h1{font-size:1.3rem;margin:.2rem 0}.meta{color:#777;margin:0 0 .8rem}\
.error{background:#fdd;color:#600;padding:.5rem;border-radius:.3rem}\
table{border-collapse:collapse;width:100%}th,td{text-align:left;vertical-align:top;\
padding:.4rem .5rem;border-bottom:1px solid #8884;overflow-wrap:anywhere}\
.name{font-weight:600;font-family:ui-monospace,monospace}.ns,.key{color:#777;font-size:.85em}\
ul{margin:0;padding-left:1rem}.n{font-weight:600}footer{color:#777;font-size:.85em;margin-top:1rem}\
@media (max-width:40rem){thead{display:none}table,tbody,tr,td{display:block;width:auto}\
tr{border:1px solid #8886;border-radius:.4rem;margin:0 0 .6rem;padding:.2rem}\
td{border:0;padding:.2rem .4rem}td::before{content:attr(data-label);display:block;\
font-size:.75em;color:#777;text-transform:uppercase}}";

fn row(out: &mut String, s: &super::collect::Scrape, l: &LockStatus) {
    out.push_str("<tr>");
    // Name.
    out.push_str("<td data-label=\"Name\">");
    match &l.name {
        Some(n) => {
            let _ = write!(out, "<span class=\"name\">{}</span>", html(n));
            if let Some(i) = l.slot {
                let _ = write!(out, " <span class=\"key\">slot {i}</span>");
            }
            if let Some(ns) = &l.namespace {
                let _ = write!(out, " <span class=\"ns\">{}</span>", html(ns));
            }
        }
        None => {
            let _ = write!(out, "<span class=\"key\">key {}</span>", l.key);
        }
    }
    out.push_str("</td>");
    // Holders and since when.
    out.push_str("<td data-label=\"Holder\">");
    if l.holders.is_empty() {
        out.push('—');
    }
    for (i, h) in l.holders.iter().enumerate() {
        if i > 0 {
            out.push_str("<br>");
        }
        out.push_str(&party(h));
    }
    out.push_str("</td><td data-label=\"Since\">");
    if l.holders.is_empty() {
        out.push('—');
    }
    for (i, h) in l.holders.iter().enumerate() {
        if i > 0 {
            out.push_str("<br>");
        }
        out.push_str(&since(s.since(l, h, true), s.at()));
    }
    // Waiters, longest first.
    let _ = write!(
        out,
        "</td><td data-label=\"Waiters\"><span class=\"n\">{}</span>",
        l.waiters.len()
    );
    if !l.waiters.is_empty() {
        out.push_str("<ul>");
        for w in &l.waiters {
            let _ = write!(
                out,
                "<li>{}, for {}</li>",
                party(w),
                since(s.since(l, w, false), s.at())
            );
        }
        out.push_str("</ul>");
    }
    out.push_str("</td></tr>\n");
}

/// `program[pid]@host (connection N) from ADDR, exclusive, transaction`, escaped.
fn party(p: &Party) -> String {
    let mut s = html(&p.describe());
    if let Some(c) = &p.client {
        let _ = write!(s, " from {}", html(c));
    }
    let _ = write!(s, ", {}", mode_str(p.mode));
    if let Some(scope) = p.scope {
        let _ = write!(s, ", {}", scope_str(scope));
    }
    s
}

/// `<time datetime=…>12m03s</time>`, marked `≥` when only first seen.
fn since(s: Option<Since>, now: SystemTime) -> String {
    match s {
        None => "—".into(),
        Some(s) => {
            let t = s.time();
            let (mark, title) = match s {
                Since::Known(_) => ("", "since"),
                _ => ("≥ ", "first seen by the exporter at"),
            };
            format!(
                "<time datetime=\"{}\" title=\"{title} {}\">{mark}{}</time>",
                iso(t),
                iso(t),
                age_text(age(t, now))
            )
        }
    }
}

/// `s` escaped for HTML text and attribute values, after [`shown`].
pub(crate) fn html(s: &str) -> String {
    let s = shown(s);
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `05:30:12 UTC`.
fn clock(t: SystemTime) -> String {
    let s = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    format!(
        "{:02}:{:02}:{:02} UTC",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60
    )
}

/// `2026-12-04T05:30:12Z`.
fn iso(t: SystemTime) -> String {
    let s = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let (y, m, d) = civil_from_days((s / 86_400) as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60
    )
}

/// The proleptic Gregorian date of day `z` since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_html_and_shown_safely() {
        assert_eq!(
            html("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
        // Controls and reordering characters are written out, not obeyed.
        assert_eq!(html("a\u{202e}b\nc"), "a\\u{202e}b\\u{a}c");
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_791), (2026, 12, 4));
        assert_eq!(
            iso(UNIX_EPOCH + Duration::from_secs(1_796_361_012)),
            "2026-12-04T05:10:12Z"
        );
        assert_eq!(age_text(Duration::from_secs(190)), "3m10s");
    }
}
