//! A conversation as data: an optional system message, then user and assistant turns. It is
//! what `gen chat` holds between turns, what `--messages FILE` reads and `/save` writes: a JSON
//! array of `{"role", "content"}` objects, the shape OpenAI's chat API and most tools use.
//! Files are written atomically (a temporary file beside the target, flushed, then renamed), so
//! a saved conversation is never left half-written.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::chat::Message;

/// Larger than any conversation a context window holds; bounds what a wrong file can cost.
const MAX_FILE_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Conversation {
    pub system: Option<String>,
    /// User and assistant messages in order (a user message may wait for its reply last).
    pub turns: Vec<Message>,
}

#[derive(Deserialize)]
struct Entry {
    role: String,
    /// Null or absent in an assistant turn that only calls tools.
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

/// A tool call as OpenAI writes it: `{"function": {"name": string, "arguments": string or
/// object}}` (an `id` and `"type": "function"` usually beside).
fn check_call(c: &serde_json::Value) -> Result<()> {
    let f = &c["function"];
    if !f["name"].is_string() {
        bail!("not {{\"function\": {{\"name\", \"arguments\"}}}}");
    }
    if !(f["arguments"].is_string() || f["arguments"].is_object() || f["arguments"].is_null()) {
        bail!("its arguments are neither a JSON string nor an object");
    }
    Ok(())
}

impl Conversation {
    pub fn new(system: Option<String>) -> Self {
        Self {
            system,
            turns: Vec::new(),
        }
    }

    /// Every message, the system message first, as the chat template takes them.
    pub fn messages(&self) -> Vec<Message> {
        let mut m = Vec::with_capacity(self.turns.len() + 1);
        if let Some(s) = &self.system {
            m.push(Message::new("system", s));
        }
        m.extend(self.turns.iter().cloned());
        m
    }

    pub fn push(&mut self, role: &str, content: &str) {
        self.turns.push(Message::new(role, content));
    }

    /// An assistant turn that calls tools (OpenAI-shaped `tool_calls`), with its text.
    pub fn push_calls(&mut self, content: &str, calls: Vec<serde_json::Value>) {
        self.turns.push(Message {
            tool_calls: Some(calls),
            ..Message::new("assistant", content)
        });
    }

    /// Drop the last exchange: the last user message and whatever came after it. False when
    /// there is none.
    pub fn undo(&mut self) -> bool {
        match self.turns.iter().rposition(|m| m.role == "user") {
            Some(at) => {
                self.turns.truncate(at);
                true
            }
            None => false,
        }
    }

    /// Drop the oldest exchange (its user message and the replies up to the next user message),
    /// keeping the system message and at least the last user message. False when nothing can go.
    pub fn drop_oldest(&mut self) -> bool {
        let users: Vec<usize> = self
            .turns
            .iter()
            .enumerate()
            .filter(|(_, m)| m.role == "user")
            .map(|(i, _)| i)
            .collect();
        if users.len() < 2 {
            return false;
        }
        self.turns.drain(..users[1]);
        true
    }

    /// A conversation from JSON text: an array of `{"role", "content"}`, roles `system` (first
    /// only), `user` and `assistant`. `what` names the source in errors.
    pub fn from_json(text: &str, what: &str) -> Result<Self> {
        let entries: Vec<Entry> = serde_json::from_str(text).with_context(|| {
            format!("{what} is not a JSON array of {{\"role\", \"content\"}} messages")
        })?;
        if entries.is_empty() {
            bail!("{what} holds no messages");
        }
        let mut conv = Conversation::default();
        for (i, e) in entries.into_iter().enumerate() {
            let calls = e.tool_calls.filter(|c| !c.is_empty());
            let content = match (e.content, &calls, e.role.as_str()) {
                (Some(c), _, _) => c,
                (None, Some(_), "assistant") => String::new(),
                (None, _, _) => bail!("{what}: message {i} has no \"content\""),
            };
            match e.role.as_str() {
                "system" if i == 0 => conv.system = Some(content),
                "system" => bail!("{what}: message {i} is a system message; only the first may be"),
                "user" => conv.push("user", &content),
                "assistant" => match calls {
                    Some(calls) => {
                        for (j, c) in calls.iter().enumerate() {
                            check_call(c).with_context(|| {
                                format!("{what}: message {i}'s tool call {j}")
                            })?;
                        }
                        conv.push_calls(&content, calls);
                    }
                    None => conv.push("assistant", &content),
                },
                "tool" => conv.turns.push(Message {
                    tool_call_id: e.tool_call_id,
                    name: e.name,
                    ..Message::new("tool", &content)
                }),
                other => bail!(
                    "{what}: message {i} has role {other:?}; gen knows system, user, assistant and tool"
                ),
            }
        }
        Ok(conv)
    }

    pub fn to_json(&self) -> String {
        let all: Vec<serde_json::Value> = self
            .messages()
            .iter()
            .map(|m| serde_json::to_value(m).expect("strings always serialise"))
            .collect();
        serde_json::to_string_pretty(&all).expect("strings always serialise") + "\n"
    }

    /// Read a conversation file (see [`Self::from_json`]).
    pub fn load(path: &Path) -> Result<Self> {
        let what = format!("conversation file {}", path.display());
        let meta = std::fs::metadata(path).with_context(|| format!("cannot read {what}"))?;
        if meta.len() > MAX_FILE_BYTES {
            bail!(
                "{what} is {} bytes, over the {MAX_FILE_BYTES} gen reads",
                meta.len()
            );
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {what}"))?;
        Self::from_json(&text, &what)
    }

    /// Write the conversation to `path` atomically: the old file, if any, stays whole until the
    /// new one replaces it.
    pub fn save(&self, path: &Path) -> Result<()> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = path
            .file_name()
            .with_context(|| format!("{} names no file", path.display()))?;
        let tmp = dir.join(format!(
            ".{}.{}.partial",
            name.to_string_lossy(),
            std::process::id()
        ));
        let write = || -> Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(self.to_json().as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            Ok(())
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            e.context(format!(
                "cannot save the conversation to {}",
                path.display()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv() -> Conversation {
        let mut c = Conversation::new(Some("Be brief.".into()));
        for (r, t) in [
            ("user", "a"),
            ("assistant", "A"),
            ("user", "b"),
            ("assistant", "B"),
        ] {
            c.push(r, t);
        }
        c
    }

    #[test]
    fn json_round_trips_in_the_openai_shape() {
        let c = conv();
        let json = c.to_json();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v[0]["role"], "system");
        assert_eq!(v[4]["content"], "B");
        assert_eq!(Conversation::from_json(&json, "x").unwrap(), c);
    }

    #[test]
    fn bad_files_are_one_clear_error() {
        for (text, want) in [
            ("not json", "not a JSON array"),
            ("[]", "holds no messages"),
            (r#"[{"role": "robot", "content": "x"}]"#, "role \"robot\""),
            (r#"[{"role": "user"}]"#, "no \"content\""),
            (
                r#"[{"role": "assistant", "content": null, "tool_calls": [{"function": {}}]}]"#,
                "tool call 0",
            ),
            (
                r#"[{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]"#,
                "only the first",
            ),
            (r#"{"role": "user"}"#, "not a JSON array"),
        ] {
            let err = format!("{:#}", Conversation::from_json(text, "f").unwrap_err());
            assert!(err.contains(want), "{text}: {err}");
        }
    }

    #[test]
    fn tool_calls_and_results_round_trip() {
        let text = r#"[{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "18 C"}]"#;
        let c = Conversation::from_json(text, "f").unwrap();
        assert_eq!(c.turns.len(), 3);
        let calls = c.turns[1].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(c.turns[2].tool_call_id.as_deref(), Some("call_0"));
        let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
        assert_eq!(v[1]["tool_calls"][0]["id"], "call_0");
        assert_eq!(v[2]["role"], "tool");
        assert!(v[0].get("tool_calls").is_none());
        assert_eq!(Conversation::from_json(&c.to_json(), "x").unwrap(), c);
    }

    #[test]
    fn undo_and_drop_oldest_remove_whole_exchanges() {
        let mut c = conv();
        assert!(c.undo());
        assert_eq!(c.turns.len(), 2);
        c.push("user", "c"); // awaiting its reply
        assert!(c.undo());
        assert_eq!(c.turns.len(), 2);
        let mut c = conv();
        assert!(c.drop_oldest());
        assert_eq!(c.turns[0].content, "b");
        assert_eq!(c.system.as_deref(), Some("Be brief."));
        assert!(!c.drop_oldest(), "the last exchange stays");
        assert!(!Conversation::new(None).undo());
    }

    #[test]
    fn save_is_atomic_and_leaves_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("gen-conv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.json");
        std::fs::write(&path, "old").unwrap();
        conv().save(&path).unwrap();
        assert_eq!(Conversation::load(&path).unwrap(), conv());
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // A target that cannot be written leaves the old file whole.
        let blocked = dir.join("sub");
        std::fs::create_dir_all(blocked.join("c.json")).unwrap();
        assert!(conv().save(&blocked.join("c.json")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
