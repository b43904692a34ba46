//! `--batch` files come from users' scripts: `gen::batch_input::parse` on any text, in any
//! format, must return one result per non-blank line, in order, with that line's number,
//! without panicking.
//!
//! Input layout: the first byte's low bits pick the format (auto, text, JSONL); the rest is
//! the file.
#![no_main]

use gen::batch_input::{parse, BatchFormat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let format = match flags % 3 {
        0 => BatchFormat::Auto,
        1 => BatchFormat::Text,
        _ => BatchFormat::Jsonl,
    };
    let text = String::from_utf8_lossy(rest);
    let got = parse(&text, format);
    let non_blank = text.split('\n').filter(|l| !l.trim().is_empty()).count();
    assert_eq!(got.len(), non_blank);
    let mut last = 0;
    for r in &got {
        let line = match r {
            Ok(e) => e.line,
            Err(e) => e.line,
        };
        assert!(line > last, "line numbers must increase");
        last = line;
    }
});
