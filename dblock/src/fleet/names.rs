//! Which lock names become label values: only those the operator names, so that the
//! number of series stays bounded however many names clients choose.

use std::collections::HashSet;
use std::str::FromStr;

use crate::error::Error;
use crate::key::check_name;

/// A name, or every name beginning with a prefix (`autoland:*`; `*` alone: every name).
/// Only a trailing `*` is special.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamePattern {
    text: String,
    prefix: bool,
}

impl NamePattern {
    /// Reads `pattern`: a lock name, or a prefix followed by `*`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for an empty pattern, a `*` anywhere but at the end, or a
    /// name dblock refuses (too long, NUL).
    pub fn parse(pattern: &str) -> Result<NamePattern, Error> {
        let bad = |reason: &'static str| Error::InvalidName {
            name: pattern.chars().take(80).collect(),
            reason,
        };
        if pattern.is_empty() {
            return Err(bad("a name pattern is a name, or a prefix followed by *"));
        }
        let (body, prefix) = match pattern.strip_suffix('*') {
            Some(b) => (b, true),
            None => (pattern, false),
        };
        if body.contains('*') {
            return Err(bad(
                "a name pattern may end with * (every name with that prefix) but hold no \
                 other *",
            ));
        }
        if !prefix {
            check_name(body)?;
        } else if body.contains('\0') {
            return Err(bad("a name pattern cannot hold NUL"));
        }
        Ok(NamePattern {
            text: pattern.to_string(),
            prefix,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The one name it matches, for a pattern without `*`.
    pub fn exact(&self) -> Option<&str> {
        (!self.prefix).then_some(self.text.as_str())
    }

    /// The prefix of a pattern ending in `*`.
    pub fn prefix(&self) -> Option<&str> {
        self.prefix.then(|| &self.text[..self.text.len() - 1])
    }

    /// Whether `name` matches.
    pub fn matches(&self, name: &str) -> bool {
        match self.prefix() {
            Some(p) => name.starts_with(p),
            None => name == self.text,
        }
    }
}

impl FromStr for NamePattern {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NamePattern::parse(s)
    }
}

impl std::fmt::Display for NamePattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// How lock names become the `name` label: each name matching a [`name`](Labels::name)
/// pattern is a label value of its own (at most [`max_names`](Labels::max_names) of them
/// in one scrape); names matching a [`group`](Labels::group) pattern count together under
/// the pattern (`name="autoland:*"`); every other lock — and a lock whose name the server
/// cannot show, or of another namespace than the handle's — under
/// [`OTHER`](Labels::OTHER).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels {
    names: Vec<NamePattern>,
    groups: Vec<NamePattern>,
    max_names: usize,
}

impl Default for Labels {
    fn default() -> Self {
        Labels {
            names: Vec::new(),
            groups: Vec::new(),
            max_names: Labels::DEFAULT_MAX_NAMES,
        }
    }
}

impl Labels {
    /// The label value of every lock no pattern claims.
    pub const OTHER: &'static str = "(other)";

    /// How many names may be label values of their own in one scrape unless
    /// [`max_names`](Labels::max_names) says otherwise.
    pub const DEFAULT_MAX_NAMES: usize = 100;

    /// No name a label: every lock under [`OTHER`](Labels::OTHER).
    pub fn new() -> Labels {
        Labels::default()
    }

    /// Names matching `pattern` each become a label value of their own.
    pub fn name(mut self, pattern: NamePattern) -> Self {
        self.names.push(pattern);
        self
    }

    /// Names matching `pattern` count together, under the pattern as written.
    pub fn group(mut self, pattern: NamePattern) -> Self {
        self.groups.push(pattern);
        self
    }

    /// At most `n` names become label values of their own in one scrape (the first
    /// found); the rest count under [`OTHER`](Labels::OTHER). 100 unless set.
    pub fn max_names(mut self, n: usize) -> Self {
        self.max_names = n;
        self
    }

    /// The exact names among the `name` patterns: always reported, held or not.
    pub fn exact_names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().filter_map(NamePattern::exact)
    }

    /// The groups' label values: always reported.
    pub fn group_values(&self) -> impl Iterator<Item = &str> {
        self.groups.iter().map(NamePattern::as_str)
    }

    /// The label value of a lock named `name` (in the handle's namespace; `None`: not
    /// known or another namespace's), counting the names given their own value in
    /// `own` so far.
    pub(crate) fn value_of<'a>(
        &'a self,
        name: Option<&'a str>,
        own: &mut HashSet<&'a str>,
    ) -> &'a str {
        let Some(name) = name else {
            return Labels::OTHER;
        };
        if self.names.iter().any(|p| p.matches(name))
            && (own.contains(name) || own.len() < self.max_names)
        {
            own.insert(name);
            return name;
        }
        match self.groups.iter().find(|p| p.matches(name)) {
            Some(g) => g.as_str(),
            None => Labels::OTHER,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> NamePattern {
        NamePattern::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn patterns_are_names_or_prefixes() {
        assert!(p("autoland:7").matches("autoland:7"));
        assert!(!p("autoland:7").matches("autoland:70"));
        assert!(p("autoland:*").matches("autoland:70"));
        assert!(!p("autoland:*").matches("autolan"));
        assert!(p("*").matches("anything"));
        assert_eq!(p("a*").prefix(), Some("a"));
        assert_eq!(p("a").exact(), Some("a"));
        for bad in ["", "a*b", "**", "*a*", "a\0"] {
            assert!(
                matches!(NamePattern::parse(bad), Err(Error::InvalidName { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn names_become_labels_only_when_asked_and_within_the_limit() {
        let l = Labels::new()
            .name(p("scheduler"))
            .name(p("tenant:*"))
            .group(p("autoland:*"))
            .max_names(2);
        let mut own = HashSet::new();
        assert_eq!(l.value_of(Some("scheduler"), &mut own), "scheduler");
        assert_eq!(l.value_of(Some("autoland:7"), &mut own), "autoland:*");
        assert_eq!(l.value_of(Some("nightly"), &mut own), Labels::OTHER);
        assert_eq!(l.value_of(None, &mut own), Labels::OTHER);
        assert_eq!(l.value_of(Some("tenant:1"), &mut own), "tenant:1");
        // The limit: a third name of its own counts under (other); those already given
        // a value keep it.
        assert_eq!(l.value_of(Some("tenant:2"), &mut own), Labels::OTHER);
        assert_eq!(l.value_of(Some("tenant:1"), &mut own), "tenant:1");
        assert_eq!(l.exact_names().collect::<Vec<_>>(), ["scheduler"]);
        assert_eq!(l.group_values().collect::<Vec<_>>(), ["autoland:*"]);
    }
}
