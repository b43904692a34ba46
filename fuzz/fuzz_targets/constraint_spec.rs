//! Schemas, grammars and regexes come from users' scripts (and, in `--batch`, from every line
//! of a file): compiling one with `gen::constraint::Spec::check` and walking it byte by byte
//! must end without a panic, a hang or unbounded memory, whatever the text.
//!
//! Input layout: the first byte's low bits pick the kind (JSON Schema, Lark grammar, regex, a
//! `--batch` JSONL line); the second says how many of the following bytes, up to 64, steer the
//! walk; the rest is the spec's text.
#![no_main]

use gen::batch_input::{parse, BatchFormat};
use gen::constraint::{walk_bytes, Spec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [kind, steer, rest @ ..] = data else {
        return;
    };
    let n = usize::from(*steer % 65).min(rest.len());
    let (picks, text) = rest.split_at(n);
    let text = String::from_utf8_lossy(text);
    let spec = match kind % 4 {
        0 => match serde_json::from_str(&text) {
            Ok(schema) => Spec::JsonSchema(schema),
            Err(_) => return,
        },
        1 => Spec::Grammar(text.into_owned()),
        2 => Spec::Regex(text.into_owned()),
        _ => {
            // A batch line: its constraint fields are checked while the line is read.
            let _ = parse(&text, BatchFormat::Jsonl);
            return;
        }
    };
    if spec.check().is_ok() {
        // An engine limit (lexer fuel, Earley items) may end the walk with an error; that is
        // an answer, not a failure. A panic, an abort or a hang is.
        if let Ok((written, _)) = walk_bytes(&spec, picks) {
            assert!(written.len() <= picks.len(), "one byte per pick at most");
        }
    }
});
