//! `--logprobs N`: each generated token's log-probability and its N most likely alternatives,
//! as the forward pass gave them (the raw logits' log-softmax: before repetition penalties,
//! temperature, top-k/top-p/min-p or a grammar's mask), in gen's shape and in OpenAI's.

use serde_json::{json, Value};

use crate::sampler::TokenLogprob;
use crate::tokenizer::Tokenizer;

/// The most alternatives `--logprobs` lists per token (OpenAI's limit).
pub const MAX_TOP: usize = 20;

/// One token as the output names it.
#[derive(Debug, Clone, PartialEq)]
struct Named {
    /// None where a server sent the entry (servers send no ids).
    id: Option<u32>,
    /// Its text (a piece of a character that spans tokens: with U+FFFD in its place).
    text: String,
    /// The bytes it stands for in the reply.
    bytes: Vec<u8>,
}

impl Named {
    fn new(id: u32, tok: &Tokenizer) -> Self {
        let bytes = tok.token_bytes(id).unwrap_or_default().to_vec();
        Self {
            id: Some(id),
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
        }
    }

    /// An entry as a server sent it (`token`, and `bytes` when it sent them).
    fn from_server(v: &Value) -> Self {
        let text = v["token"].as_str().unwrap_or("").to_string();
        let bytes = match v["bytes"].as_array() {
            Some(b) => b
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u8)
                .collect(),
            None => text.as_bytes().to_vec(),
        };
        Self {
            id: None,
            text,
            bytes,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Entry {
    token: Named,
    /// None: a token gen forced (a thinking block's end marker once its budget ran out), not
    /// sampled.
    logprob: Option<f32>,
    top: Vec<(Named, f32)>,
}

/// A reply's log-probabilities, its tokens named by a tokenizer.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs(Vec<Entry>);

impl Logprobs {
    /// `lps`: one per token of `tokens` (the generation's).
    pub fn new(lps: &[Option<TokenLogprob>], tokens: &[u32], tok: &Tokenizer) -> Self {
        Self(
            tokens
                .iter()
                .zip(lps)
                .map(|(&id, lp)| Entry {
                    token: Named::new(id, tok),
                    logprob: lp.as_ref().map(|l| l.logprob),
                    top: lp
                        .iter()
                        .flat_map(|l| &l.top)
                        .map(|&(t, v)| (Named::new(t, tok), v))
                        .collect(),
                })
                .collect(),
        )
    }

    /// A server's entries (OpenAI chat's shape: `token`, `logprob`, `bytes`, `top_logprobs`).
    pub fn from_server(entries: &[Value]) -> Self {
        let value = |v: &Value| v["logprob"].as_f64().map(|v| v as f32);
        Self(
            entries
                .iter()
                .map(|e| Entry {
                    token: Named::from_server(e),
                    logprob: value(e),
                    top: e["top_logprobs"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|t| (Named::from_server(t), value(t).unwrap_or(f32::NEG_INFINITY)))
                        .collect(),
                })
                .collect(),
        )
    }

    /// gen's shape (`--stats json`, `--batch` lines): a list, one object per token: `token`,
    /// `id` (not from a server), `logprob`, `bytes`, `top_logprobs` (`token`, `id`, `logprob`,
    /// `bytes`, most likely first).
    pub fn to_gen(&self) -> Value {
        let named = |n: &Named, lp: Option<f32>| {
            let mut v = json!({"token": n.text, "logprob": lp, "bytes": n.bytes});
            if let Some(id) = n.id {
                v["id"] = json!(id);
            }
            v
        };
        Value::Array(
            self.0
                .iter()
                .map(|e| {
                    let mut v = named(&e.token, e.logprob);
                    v["top_logprobs"] = e.top.iter().map(|(n, lp)| named(n, Some(*lp))).collect();
                    v
                })
                .collect(),
        )
    }

    /// OpenAI's chat completions `choices[].logprobs`: `{content: [{token, logprob, bytes,
    /// top_logprobs: [{token, logprob, bytes}]}], refusal: null}`.
    pub fn to_openai_chat(&self) -> Value {
        let named =
            |n: &Named, lp: Option<f32>| json!({"token": n.text, "logprob": lp, "bytes": n.bytes});
        let content: Vec<Value> = self
            .0
            .iter()
            .map(|e| {
                let mut v = named(&e.token, e.logprob);
                v["top_logprobs"] = e.top.iter().map(|(n, lp)| named(n, Some(*lp))).collect();
                v
            })
            .collect();
        json!({"content": content, "refusal": null})
    }

    /// OpenAI's (legacy) completions `choices[].logprobs`: parallel lists `tokens`,
    /// `token_logprobs`, `top_logprobs` (one object per token, alternative text to
    /// log-probability) and `text_offset` (each token's offset in the text, in characters).
    pub fn to_openai_completion(&self) -> Value {
        let mut offset = 0;
        let mut offsets = Vec::with_capacity(self.0.len());
        for e in &self.0 {
            offsets.push(offset);
            offset += e.token.text.chars().count();
        }
        let top: Vec<Value> = self
            .0
            .iter()
            .map(|e| {
                let map: serde_json::Map<String, Value> = e
                    .top
                    .iter()
                    .map(|(n, lp)| (n.text.clone(), json!(lp)))
                    .collect();
                Value::Object(map)
            })
            .collect();
        json!({
            "tokens": self.0.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
            "token_logprobs": self.0.iter().map(|e| e.logprob).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }

    /// For people (the report on stderr): a line per token, its log-probability and the
    /// alternatives.
    pub fn write_human(&self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        writeln!(
            w,
            "logprobs       token, its log-probability, then the most likely tokens"
        )?;
        for e in &self.0 {
            let lp = e
                .logprob
                .map_or("forced".to_string(), |l| format!("{l:.4}"));
            let top: Vec<String> = e
                .top
                .iter()
                .map(|(n, l)| format!("{:?} {l:.4}", n.text))
                .collect();
            writeln!(
                w,
                "  {:<16} {lp:>9}   {}",
                format!("{:?}", e.token.text),
                top.join(", ")
            )?;
        }
        Ok(())
    }
}

/// A batch line's scores of its prompt (`"prompt_logprobs"`) and of its continuation
/// (`"continuation"`), from the entries of its prompt tokens the pass computed.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptScores {
    /// The prompt's tokens from where scoring began; `leading_null`: it began at the second,
    /// and the list starts with `null` for the first (which nothing predicts), as vLLM's.
    prompt: Option<Logprobs>,
    leading_null: bool,
    continuation: Option<Logprobs>,
    continuation_logprob: f64,
}

impl PromptScores {
    /// `entries`: one per token of `ids` from position `from` on; `continuation_at`: where a
    /// continuation line's continuation starts among `ids`.
    pub fn new(
        entries: &[TokenLogprob],
        from: usize,
        continuation_at: Option<usize>,
        ids: &[u32],
        tok: &Tokenizer,
    ) -> Self {
        let named = |range: std::ops::Range<usize>| {
            let lps: Vec<Option<TokenLogprob>> = entries[range.start - from..range.end - from]
                .iter()
                .cloned()
                .map(Some)
                .collect();
            Logprobs::new(&lps, &ids[range], tok)
        };
        let split = continuation_at.unwrap_or(ids.len());
        let continuation = continuation_at.map(|c| named(c..ids.len()));
        Self {
            prompt: (from < split || continuation_at.is_none()).then(|| named(from..split)),
            leading_null: from == 1,
            continuation_logprob: continuation
                .iter()
                .flat_map(|c| &c.0)
                .filter_map(|e| e.logprob)
                .map(f64::from)
                .sum(),
            continuation,
        }
    }

    /// The prompt's scores in gen's shape (with the leading null).
    pub fn prompt_to_gen(&self) -> Option<Value> {
        let p = self.prompt.as_ref()?;
        let mut list = match p.to_gen() {
            Value::Array(a) => a,
            _ => unreachable!("to_gen gives a list"),
        };
        if self.leading_null {
            list.insert(0, Value::Null);
        }
        Some(Value::Array(list))
    }

    /// A continuation line's scores, to stand where a generated reply's would.
    pub fn continuation(&self) -> Option<&Logprobs> {
        self.continuation.as_ref()
    }
}

impl serde::Serialize for PromptScores {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        if let Some(p) = self.prompt_to_gen() {
            m.serialize_entry("prompt_logprobs", &p)?;
        }
        if let Some(c) = &self.continuation {
            m.serialize_entry("continuation_logprob", &self.continuation_logprob)?;
            m.serialize_entry("continuation_tokens", &c.0.len())?;
            m.serialize_entry("continuation_logprobs", c)?;
        }
        m.end()
    }
}

impl serde::Serialize for Logprobs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_gen().serialize(s)
    }
}
