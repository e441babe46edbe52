//! Any bytes, as a DURATION argument, through the CLI's own parser and its check.
#![no_main]

#[path = "../../dblock-cli/src/duration.rs"]
mod duration;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        duration::check(s);
    }
});
