//! Any bytes, as a namespace and a name (split at the first U+0001, else the default
//! namespace), through `dblock_parser_checks::lock_name`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let (ns, name) = dblock_parser_checks::split_lock_input(s);
        dblock_parser_checks::lock_name(ns, name);
    }
});
