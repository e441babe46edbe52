//! Any bytes, as text, through the check `dblock_parser_checks::comments`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        dblock_parser_checks::comments(s);
    }
});
