//! Any bytes, as an SQL script, through `dblock_parser_checks::statements_against`, with
//! PostgreSQL's own parser (libpg_query) as the oracle wherever it accepts the script.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        dblock_parser_checks::statements_against(s, &|sql| {
            pg_query::split_with_parser(sql)
                .map(|v| v.into_iter().map(str::to_string).collect())
                .map_err(|e| e.to_string())
        });
    }
});
