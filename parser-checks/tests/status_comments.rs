//! The comment that names a lock to the server (`/* dblock ns=… name=… holder=… */`), read
//! back from `pg_stat_activity` and MySQL's processlist by `dblock status`: for any
//! namespace and name, what dblock writes reads back as what was written, wherever it
//! sits in the query text; a comment the server cut off is never read as some other
//! lock; and any text at all reads without a panic.

use dblock::Scope;
use dblock::parsers::{parse_comments, write_comment};
use dblock_parser_checks as checks;
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[^\\x00]{1,30}",
        "[a-z :;%*/=]{1,20}",
        Just(" */ /* dblock ns=x name=y */".to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Written for any namespace and name, with text before and after it, a comment
    /// reads back as what was written.
    #[test]
    fn a_written_comment_reads_back_as_written(
        ns in text(), name in text(), before in "\\PC{0,20}", after in "\\PC{0,20}",
        session in any::<bool>(),
    ) {
        let scope = if session { Scope::Session } else { Scope::Transaction };
        let since = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_709_251_199_123);
        let c = write_comment(&ns, &name, Some(scope), Some(since));
        // Text the query carries around it, kept from holding a comment of its own.
        let clean = |s: &str| s.replace("/*", "/ *").replace("*/", "* /");
        let query = format!("{}SELECT pg_advisory_lock(1){c}{}", clean(&before), clean(&after));
        let read = parse_comments(&query);
        prop_assert_eq!(read.len(), 1, "{:?}", query);
        prop_assert_eq!(&read[0].namespace, &ns);
        prop_assert_eq!(&read[0].name, &name);
        prop_assert_eq!(read[0].scope, Some(scope));
        prop_assert_eq!(read[0].since, Some(since));
    }

    /// The server keeps only the first `track_activity_query_size` bytes of a query: a
    /// comment cut anywhere is skipped, never read as another lock's.
    #[test]
    fn a_comment_cut_off_anywhere_is_not_read(ns in text(), name in text(), cut in any::<prop::sample::Index>()) {
        let c = write_comment(&ns, &name, Some(Scope::Session), None);
        let mut at = cut.index(c.len());
        while !c.is_char_boundary(at) { at -= 1; }
        let read = parse_comments(&c[..at]);
        prop_assert!(read.is_empty(), "{:?} read as {:?}", &c[..at], read);
    }

    /// Any text, as the server may hand it back, reads without a panic.
    #[test]
    fn any_query_text_reads_without_panicking(s in prop_oneof![
        "\\PC{0,60}",
        "(/\\* dblock (ns|name|holder|scope|since)=[%0-9A-Fa-z+:.-]{0,8} ?){1,6}( \\*/)?",
    ]) {
        checks::comments(&s);
    }
}
