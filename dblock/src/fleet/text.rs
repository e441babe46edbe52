//! The Prometheus text exposition format (version 0.0.4): metric families written with
//! their `# HELP` and `# TYPE` lines, label values and help text escaped as the format
//! requires, so that any name a client of the database chose is carried safely.

use std::fmt::Write as _;

/// The `Content-Type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What a family's samples are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// A value that goes up and down.
    Gauge,
    /// A value that only goes up (its name ends in `_total`).
    Counter,
}

/// One metric family: a name, its help, its kind and its samples (one per label set).
#[derive(Debug, Clone, PartialEq)]
pub struct Family {
    name: String,
    help: String,
    kind: Kind,
    samples: Vec<(Vec<(String, String)>, f64)>,
}

impl Family {
    /// An empty gauge family.
    pub fn gauge(name: impl Into<String>, help: impl Into<String>) -> Family {
        Family::new(name.into(), help.into(), Kind::Gauge)
    }

    /// An empty counter family.
    pub fn counter(name: impl Into<String>, help: impl Into<String>) -> Family {
        Family::new(name.into(), help.into(), Kind::Counter)
    }

    fn new(name: String, help: String, kind: Kind) -> Family {
        Family {
            name,
            help,
            kind,
            samples: Vec::new(),
        }
    }

    /// Adds a sample with these labels (names as the format allows them; values any
    /// text).
    pub fn sample(&mut self, labels: &[(&str, &str)], value: f64) -> &mut Self {
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples.push((labels, value));
        self
    }

    /// Adds a sample and returns the family (for building one in an expression).
    pub fn with(mut self, labels: &[(&str, &str)], value: f64) -> Self {
        self.sample(labels, value);
        self
    }

    /// The family's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The family's kind.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The samples: labels and value.
    pub fn samples(&self) -> impl Iterator<Item = (&[(String, String)], f64)> {
        self.samples.iter().map(|(l, v)| (l.as_slice(), *v))
    }

    /// The value of the sample with exactly these labels, if any.
    pub fn value(&self, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|(l, _)| {
                l.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, v)| *v)
    }
}

/// `families` in the text format. A family without samples is left out; a family whose
/// name is repeated is written once, with every sample.
pub fn render(families: &[Family]) -> String {
    let mut out = String::new();
    let mut done: Vec<&str> = Vec::new();
    for f in families {
        if done.contains(&f.name.as_str()) {
            continue;
        }
        done.push(&f.name);
        let same: Vec<&Family> = families.iter().filter(|g| g.name == f.name).collect();
        if same.iter().all(|g| g.samples.is_empty()) {
            continue;
        }
        let _ = writeln!(out, "# HELP {} {}", f.name, escape_help(&f.help));
        let kind = match f.kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        };
        let _ = writeln!(out, "# TYPE {} {kind}", f.name);
        for g in same {
            for (labels, value) in &g.samples {
                out.push_str(&f.name);
                if !labels.is_empty() {
                    out.push('{');
                    for (i, (k, v)) in labels.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        let _ = write!(out, "{k}=\"{}\"", escape_label(v));
                    }
                    out.push('}');
                }
                let _ = writeln!(out, " {}", number(*value));
            }
        }
    }
    out
}

/// A label value as the format writes it: `\`, `"` and line feeds escaped.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Help text as the format writes it: `\` and line feeds escaped.
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A value as the format writes it (`+Inf`, `-Inf`, `NaN`; never an exponent Go
/// cannot read).
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_with_help_type_and_escaped_labels() {
        let fams = vec![
            Family::gauge("a_seconds", "Help with \\ and\nnewline")
                .with(&[("name", "x\"y\\z\nw")], 1.5)
                .with(&[], f64::INFINITY),
            Family::counter("b_total", "Counts").with(&[("k", "v")], 3.0),
            Family::gauge("empty", "Nothing"),
        ];
        let text = render(&fams);
        assert_eq!(
            text,
            "# HELP a_seconds Help with \\\\ and\\nnewline\n\
             # TYPE a_seconds gauge\n\
             a_seconds{name=\"x\\\"y\\\\z\\nw\"} 1.5\n\
             a_seconds +Inf\n\
             # HELP b_total Counts\n\
             # TYPE b_total counter\n\
             b_total{k=\"v\"} 3\n"
        );
        assert_eq!(fams[0].value(&[("name", "x\"y\\z\nw")]), Some(1.5));
        assert_eq!(fams[0].value(&[]), Some(f64::INFINITY));
        assert_eq!(fams[1].value(&[]), None);
        assert_eq!(number(1e21), "1000000000000000000000");
        assert_eq!(number(f64::NAN), "NaN");
    }
}
