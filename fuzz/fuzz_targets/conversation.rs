//! Conversation files (`--messages FILE`, `/load FILE` in `gen chat`) come from users and other
//! tools: `gen::conversation::Conversation::from_json` on any text must give a conversation
//! or an error, never a panic or a hang. A conversation it gives holds at least one message,
//! its turns are user and assistant messages only, it survives `/save` (`to_json`) and a
//! reload unchanged, and `/undo` and the drop of the oldest exchange keep it well-formed.
//!
//! Input layout: the file's bytes (not UTF-8 is refused by the file read before; here it is
//! replaced, so the parser sees every input).
#![no_main]

use gen::conversation::Conversation;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let conv = match Conversation::from_json(&text, "conversation file f.json") {
        Ok(conv) => conv,
        Err(e) => {
            let message = format!("{e:#}");
            assert!(message.starts_with("conversation file f.json"), "{message}");
            return;
        }
    };
    assert!(!conv.messages().is_empty());
    assert!(conv
        .turns
        .iter()
        .all(|m| m.role == "user" || m.role == "assistant"));
    let again =
        Conversation::from_json(&conv.to_json(), "saved").expect("a saved conversation loads");
    assert_eq!(again, conv);

    let users = conv.turns.iter().filter(|m| m.role == "user").count();
    let mut shorter = conv.clone();
    if shorter.drop_oldest() {
        assert!(users >= 2);
        assert_eq!(shorter.system, conv.system);
        assert_eq!(shorter.turns.first().map(|m| m.role.as_str()), Some("user"));
        assert!(shorter.turns.len() < conv.turns.len());
    } else {
        assert!(users < 2);
        assert_eq!(shorter, conv);
    }
    let mut undone = conv.clone();
    if undone.undo() {
        assert!(users >= 1);
        assert_eq!(
            undone.turns.iter().filter(|m| m.role == "user").count(),
            users - 1
        );
    } else {
        assert_eq!(users, 0);
    }
});
