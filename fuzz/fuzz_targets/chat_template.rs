//! Chat templates come from model files: `gen::chat::ChatTemplate::render` on any source must
//! return (Ok or Err) promptly, without panicking or exhausting memory.
//!
//! Input layout: template source, then optionally a 0 byte and the user message; the first
//! byte's low bits pick a system message and the generation prompt.
#![no_main]

use gen::chat::{one_shot, ChatTemplate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let (source, user) = match rest.iter().position(|&b| b == 0) {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest, &b"Hello"[..]),
    };
    let source = String::from_utf8_lossy(source).into_owned();
    let user = String::from_utf8_lossy(user);
    let system = (flags & 1 != 0).then_some("Be brief.");
    let template = ChatTemplate::new(source, "<s>".into(), "</s>".into());
    let _ = template.render(&one_shot(system, &user), flags & 2 != 0);
});
