//! The JSON Lines a batch run writes (local or remote): one object per prompt, in input order,
//! each as soon as it and every prompt before it are done.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

use anyhow::Result;
use serde::Serialize;

use crate::batch_input::LineError;

/// One line of output.
#[derive(Serialize)]
pub(crate) struct Line<'a> {
    pub index: usize,
    pub id: &'a Option<serde_json::Value>,
    pub line: usize,
    /// Which completion of its prompt this is, when the prompt asked several (`--n`, `"n"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub choice: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
    /// Of the prompt tokens, how many came from the prefix cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// With a grammar: whether the reply completed it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub complete: Option<bool>,
    /// The reply's thinking, kept out of `text` (a chat template with a thinking block).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<&'a str>,
    /// Of `tokens`, those inside the thinking block.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<usize>,
    /// With --tools: the calls the reply made (OpenAI's shape); `text` stays as generated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// With --tools: the text outside the calls (OpenAI's `content`).
    #[serde(skip)]
    pub content: Option<String>,
    /// The line's API by its `url` (OpenAI's shape: a chat or a text completion); None: as
    /// `--chat` says.
    #[serde(skip)]
    pub chat: Option<bool>,
    /// With --logprobs: one entry per generated token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<crate::logprobs::Logprobs>,
    /// With --prompt-logprobs, "prompt_logprobs" or "continuation": the prompt's scores.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub scores: Option<crate::logprobs::PromptScores>,
}

/// The shape of each output line (`--batch-output`).
#[derive(Debug, Clone)]
pub(crate) enum Shape {
    /// gen's own (see the README): index, id, line, text or error, tokens, stop, timings.
    Gen,
    /// OpenAI's Batch API output: `custom_id`, `response` {status_code, body} or `error`.
    /// `chat`: the bodies are chat completions; `model`: what they name.
    OpenAi { chat: bool, model: String },
}

impl Shape {
    pub fn render(&self, l: &Line<'_>) -> Result<String> {
        let Shape::OpenAi { chat, model } = self else {
            return Ok(serde_json::to_string(l)?);
        };
        let chat = &l.chat.unwrap_or(*chat);
        let custom_id =
            l.id.clone()
                .unwrap_or_else(|| format!("line-{}", l.line).into());
        let request_id = format!("gen-{}", l.index);
        let stop = l.stop.unwrap_or("");
        let failed = l.error.is_some() || matches!(stop, "interrupted" | "error" | "output-closed");
        let out = if failed {
            let (code, message) = match l.error {
                Some(e) => ("gen_error", e.to_string()),
                None => (
                    "interrupted",
                    format!("the run ended before this reply did (stop: {stop})"),
                ),
            };
            serde_json::json!({
                "id": format!("batch_req_{}", l.index),
                "custom_id": custom_id,
                "response": null,
                "error": {"code": code, "message": message},
            })
        } else {
            let calls = l.tool_calls.as_ref().filter(|c| !c.is_empty());
            let finish = match (stop, calls) {
                (_, Some(_)) => "tool_calls",
                ("max-new" | "scored", _) => "length",
                _ => "stop",
            };
            let text = l.text.unwrap_or("");
            // A continuation line: its continuation's scores stand where a reply's would.
            let scored = l.scores.as_ref().and_then(|s| s.continuation());
            let choice = if *chat {
                let content = match (&l.content, calls) {
                    (Some(c), Some(_)) if c.is_empty() => serde_json::Value::Null,
                    (Some(c), _) => c.as_str().into(),
                    (None, _) => text.into(),
                };
                let mut message = serde_json::json!({"role": "assistant", "content": content});
                if let Some(r) = l.reasoning {
                    message["reasoning_content"] = r.into();
                }
                if let Some(c) = calls {
                    message["tool_calls"] = c.clone().into();
                }
                let logprobs = scored.or(l.logprobs.as_ref()).map(|p| p.to_openai_chat());
                serde_json::json!({"index": l.choice.unwrap_or(0), "message": message, "logprobs": logprobs, "finish_reason": finish})
            } else {
                let logprobs = scored
                    .or(l.logprobs.as_ref())
                    .map(|p| p.to_openai_completion());
                serde_json::json!({"index": l.choice.unwrap_or(0), "text": text, "logprobs": logprobs, "finish_reason": finish})
            };
            let mut choice = choice;
            if let Some(p) = l.scores.as_ref().and_then(|s| s.prompt_to_gen()) {
                choice["prompt_logprobs"] = p;
            }
            let (p, c) = (l.prompt_tokens.unwrap_or(0), l.tokens.unwrap_or(0));
            let mut usage = serde_json::json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
            if let Some(r) = l.reasoning_tokens {
                usage["completion_tokens_details"] = serde_json::json!({"reasoning_tokens": r});
            }
            if let Some(cached) = l.cached_tokens {
                usage["prompt_tokens_details"] = serde_json::json!({"cached_tokens": cached});
            }
            serde_json::json!({
                "id": format!("batch_req_{}", l.index),
                "custom_id": custom_id,
                "response": {
                    "status_code": 200,
                    "request_id": request_id,
                    "body": {
                        "id": request_id,
                        "object": if *chat { "chat.completion" } else { "text_completion" },
                        "model": model,
                        "choices": [choice],
                        "usage": usage,
                    },
                },
                "error": null,
            })
        };
        Ok(out.to_string())
    }
}

/// The items an earlier output (`--resume FILE`) holds complete: gen's lines by (index, id),
/// OpenAI's by custom_id. Lines with an error, an interrupted or failed reply, and a last line
/// cut short by a crash do not count; nothing in FILE is changed.
pub(crate) struct Done {
    by_index: BTreeSet<(usize, String)>,
    by_custom_id: BTreeSet<String>,
    pub count: usize,
}

/// Whether standard output is the file at `path` (as with `--resume OUT >> OUT`).
fn stdout_is(path: &std::path::Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata("/dev/stdout"), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        false
    }
}

impl Done {
    pub fn read(path: &std::path::Path) -> Result<Self> {
        use anyhow::Context;
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            // Nothing written yet: nothing to skip (the first run of `--resume OUT >> OUT`).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        // A run that died mid-line left OUT without its last newline: when the new lines go
        // to the end of OUT, end that fragment first so the first new line stays whole.
        if !text.is_empty() && !text.ends_with('\n') && stdout_is(path) {
            let mut out = std::io::stdout().lock();
            out.write_all(b"\n").and_then(|()| out.flush())?;
        }
        let mut done = Done {
            by_index: BTreeSet::new(),
            by_custom_id: BTreeSet::new(),
            count: 0,
        };
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if let Some(custom) = v.get("custom_id") {
                let ok = v["error"].is_null() && v["response"]["status_code"] == 200;
                // With several completions a prompt, each is its own line: its choice index.
                let choice = v["response"]["body"]["choices"][0]["index"]
                    .as_u64()
                    .unwrap_or(0);
                if ok && done.by_custom_id.insert(format!("{custom}#{choice}")) {
                    done.count += 1;
                }
                continue;
            }
            let complete = v["text"].is_string()
                && v.get("error").is_none()
                && !matches!(
                    v["stop"].as_str(),
                    Some("interrupted" | "error" | "output-closed") | None
                );
            if let (true, Some(index)) = (complete, v["index"].as_u64()) {
                let id = v
                    .get("id")
                    .cloned()
                    .unwrap_or(serde_json::Value::Null)
                    .to_string();
                if done.by_index.insert((index as usize, id)) {
                    done.count += 1;
                }
            }
        }
        Ok(done)
    }

    /// Whether the item at `index` with this `id` is already complete.
    pub fn holds(&self, index: usize, e: &crate::batch_input::Entry) -> bool {
        let id_text = e.id.clone().unwrap_or(serde_json::Value::Null).to_string();
        let custom =
            e.id.clone()
                .unwrap_or_else(|| format!("line-{}", e.line).into())
                .to_string();
        let custom = format!("{custom}#{}", e.choice);
        self.by_index.contains(&(index, id_text)) || self.by_custom_id.contains(&custom)
    }
}

/// Writes lines to stdout in index order: each as soon as every line before it is out.
pub(crate) struct Writer {
    pub next: usize,
    pub total: usize,
    pub ready: BTreeMap<usize, String>,
    pub written: usize,
    pub failed: usize,
    /// Whoever reads stdout has gone: stop writing (and generating).
    pub closed: bool,
    /// Indices never written here (`--resume`: the output already holds them complete).
    skipped: BTreeSet<usize>,
    pub shape: Shape,
}

impl Writer {
    pub fn new(total: usize, shape: Shape) -> Self {
        Self {
            next: 0,
            total,
            ready: BTreeMap::new(),
            written: 0,
            failed: 0,
            closed: false,
            skipped: BTreeSet::new(),
            shape,
        }
    }

    /// How the run ends: interrupted (Ctrl-C), with failed items (exit 1), or done.
    pub fn outcome(&self) -> super::Outcome {
        if crate::interrupt::requested() {
            super::Outcome::Interrupted
        } else if self.failed > 0 {
            super::Outcome::PromptsFailed {
                failed: self.failed,
                total: self.total,
            }
        } else {
            super::Outcome::Done
        }
    }

    /// Write one reply's line (in the run's shape) once every line before it is out.
    pub fn reply(&mut self, line: &Line<'_>) -> Result<()> {
        let json = self.shape.render(line)?;
        self.put(line.index, json)
    }

    /// Index `index` is done elsewhere: lines after it need not wait for it.
    pub fn skip(&mut self, index: usize) -> Result<()> {
        self.skipped.insert(index);
        self.flush()
    }

    pub fn error(&mut self, index: usize, e: LineError) -> Result<()> {
        self.failed += 1;
        let line = Line {
            index,
            id: &e.id,
            line: e.line,
            choice: None,
            text: None,
            error: Some(&e.message),
            prompt_tokens: None,
            cached_tokens: None,
            tokens: None,
            stop: None,
            passes: None,
            ttft_ms: None,
            wait_ms: None,
            seed: None,
            complete: None,
            chat: None,
            reasoning: None,
            reasoning_tokens: None,
            tool_calls: None,
            content: None,
            logprobs: None,
            scores: None,
        };
        let json = self.shape.render(&line)?;
        self.put(index, json)
    }

    pub fn put(&mut self, index: usize, json: String) -> Result<()> {
        debug_assert!(index < self.total);
        self.ready.insert(index, json);
        self.flush()
    }

    fn flush(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        let stdout = std::io::stdout();
        let mut w = stdout.lock();
        loop {
            if self.skipped.remove(&self.next) {
                self.next += 1;
                continue;
            }
            let Some(json) = self.ready.remove(&self.next) else {
                break;
            };
            let wrote = writeln!(w, "{json}").and_then(|_| w.flush());
            match wrote {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                    self.closed = true;
                    return Ok(());
                }
                Err(e) => return Err(anyhow::Error::new(e).context("cannot write to stdout")),
            }
            self.next += 1;
            self.written += 1;
        }
        Ok(())
    }
}
