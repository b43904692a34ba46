//! The prompts of a batch run (`--batch FILE`): one prompt per line of plain text, or JSON
//! Lines with a `prompt` and optional per-prompt settings.
//!
//! Every problem is tied to its line: a bad line becomes that prompt's error, and the others
//! still run.

use serde::Deserialize;

use crate::constraint::Spec;

/// How to read the batch file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BatchFormat {
    /// JSON Lines when the first non-blank line starts with `{`, plain text otherwise.
    Auto,
    /// Each non-blank line is a prompt.
    Text,
    /// Each non-blank line is a JSON object with a "prompt".
    Jsonl,
}

/// One prompt of the batch, with what it overrides of the command line.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Entry {
    /// 1-based line number in the input.
    pub line: usize,
    pub id: Option<serde_json::Value>,
    pub prompt: String,
    /// A conversation instead of a prompt (`"messages"`: `[{"role", "content"}, ...]`), rendered
    /// through the chat template with the opening of the assistant's turn.
    pub messages: Option<crate::conversation::Conversation>,
    pub max_new: Option<usize>,
    pub temperature: Option<f64>,
    /// OpenAI's `presence_penalty` and `frequency_penalty` for this line.
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
    /// What the reply must be: `"json": true` (or `"any"`), `"json_schema": {...}`,
    /// `"grammar": "..."` or `"regex": "..."`, already checked. None: as on the command line;
    /// Some(None): no constraint for this line (`"json": false`).
    pub constraint: Option<Option<Spec>>,
    /// An OpenAI batch line's API by its `url`: Some(true) for `/v1/chat/completions` (a
    /// `prompt` goes through the chat template, the output line is a chat completion),
    /// Some(false) for `/v1/completions` (raw text, a text completion), whatever `--chat` says;
    /// None: as `--chat` says.
    pub chat: Option<bool>,
    /// `"n"`: how many completions of this prompt (None: as `--n` says).
    pub n: Option<usize>,
    /// Which of the line's completions this is (0-based; see [`expand`]).
    pub choice: usize,
    /// `"continuation"`: text to score after the prompt (its tokens' log-probabilities),
    /// generating nothing.
    pub continuation: Option<String>,
    /// `"prompt_logprobs"`: score the prompt's tokens too, with this many alternatives each.
    pub prompt_logprobs: Option<usize>,
    /// `"logprobs"`: the reply's log-probabilities, with this many alternatives each.
    pub logprobs: Option<usize>,
}

/// Most completions one prompt may ask for (`--n`, `"n"`).
pub const MAX_N: usize = 128;

/// Each entry as many times as it asks completions (its `"n"`, else `default_n`), numbered by
/// `choice`; errors stay one each. With a `"seed"`, completion j samples with seed + j, so the
/// completions differ and each is the same stream on every run.
pub fn expand(
    entries: Vec<Result<Entry, LineError>>,
    default_n: usize,
) -> Vec<Result<Entry, LineError>> {
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        match e {
            Ok(e) => {
                let n = e.n.unwrap_or(default_n);
                for choice in 0..n {
                    let mut c = e.clone();
                    c.n = Some(n);
                    c.choice = choice;
                    c.seed = e.seed.map(|s| s.wrapping_add(choice as u64));
                    out.push(Ok(c));
                }
            }
            Err(e) => out.push(Err(e)),
        }
    }
    out
}

/// A line that could not be read as a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct LineError {
    pub line: usize,
    /// The line's "id" when it could be read.
    pub id: Option<serde_json::Value>,
    pub message: String,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// A JSONL line as written. Fields not listed here are ignored, so records may carry data of
/// their own.
#[derive(Deserialize)]
struct Record {
    #[serde(default)]
    id: Option<serde_json::Value>,
    prompt: Option<serde_json::Value>,
    #[serde(default)]
    messages: Option<serde_json::Value>,
    #[serde(default)]
    max_new: Option<serde_json::Value>,
    #[serde(default)]
    temperature: Option<serde_json::Value>,
    #[serde(default)]
    presence_penalty: Option<serde_json::Value>,
    #[serde(default)]
    frequency_penalty: Option<serde_json::Value>,
    #[serde(default)]
    seed: Option<serde_json::Value>,
    #[serde(default)]
    n: Option<serde_json::Value>,
    #[serde(default)]
    stop: Option<serde_json::Value>,
    #[serde(default)]
    json: Option<serde_json::Value>,
    /// An OpenAI batch line's `url` (carried over by `from_openai_batch`).
    #[serde(default)]
    url: Option<serde_json::Value>,
    #[serde(default)]
    json_schema: Option<serde_json::Value>,
    #[serde(default)]
    grammar: Option<serde_json::Value>,
    #[serde(default)]
    regex: Option<serde_json::Value>,
    #[serde(default)]
    continuation: Option<serde_json::Value>,
    #[serde(default)]
    prompt_logprobs: Option<serde_json::Value>,
    #[serde(default)]
    logprobs: Option<serde_json::Value>,
}

/// An OpenAI Batch API input line (`custom_id`, `method`, `url`, `body`) as gen's own fields:
/// `custom_id` is the id, the body's `prompt` or `messages`, `max_tokens` (or
/// `max_completion_tokens`), `temperature`, `seed` and `stop` carry over. Other lines pass as
/// they are.
fn from_openai_batch(value: serde_json::Value) -> Result<serde_json::Value, String> {
    let (Some(custom_id), Some(body)) = (value.get("custom_id"), value.get("body")) else {
        return Ok(value);
    };
    let body = body
        .as_object()
        .ok_or("\"body\" of a batch request must be an object")?;
    if let Some(url) = value.get("url").and_then(|u| u.as_str()) {
        if !url.ends_with("/completions") {
            return Err(format!(
                "batch request url {url:?}: gen runs /v1/completions and /v1/chat/completions"
            ));
        }
    }
    let mut line = serde_json::Map::new();
    line.insert("id".into(), custom_id.clone());
    if let Some(url) = value.get("url").filter(|u| !u.is_null()) {
        line.insert("url".into(), url.clone());
    }
    for (from, to) in [
        ("prompt", "prompt"),
        ("messages", "messages"),
        ("max_tokens", "max_new"),
        ("max_completion_tokens", "max_new"),
        ("temperature", "temperature"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("n", "n"),
    ] {
        if let Some(v) = body.get(from).filter(|v| !v.is_null()) {
            line.insert(to.into(), v.clone());
        }
    }
    openai_logprobs(body, &mut line)?;
    Ok(serde_json::Value::Object(line))
}

/// A line's scoring fields: `"continuation"` (a string, not empty), `"prompt_logprobs"` and
/// `"logprobs"` (alternatives per token, 0 to 20).
fn parse_scoring(r: &Record) -> Result<(Option<String>, Option<usize>, Option<usize>), String> {
    use serde_json::Value;
    let continuation = match &r.continuation {
        None | Some(Value::Null) => None,
        Some(Value::String(c)) if !c.is_empty() => Some(c.clone()),
        Some(_) => return Err("\"continuation\" must be a string, not empty".into()),
    };
    let top = crate::logprobs::MAX_TOP as u64;
    let count = |v: &Option<Value>, name: &str| match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= top => Ok(Some(n as usize)),
            _ => Err(format!("\"{name}\" must be an integer from 0 to {top}")),
        },
    };
    let prompt_logprobs = count(&r.prompt_logprobs, "prompt_logprobs")?;
    let logprobs = count(&r.logprobs, "logprobs")?;
    Ok((continuation, prompt_logprobs, logprobs))
}

/// OpenAI's log-probability fields as gen's: chat's `"logprobs": true` with `"top_logprobs":
/// N`, or completions' `"logprobs": N`, become `"logprobs"`; completions' `"echo": true` scores
/// the prompt too (`"prompt_logprobs"`, with as many alternatives), and with `"max_tokens": 0`
/// only the prompt.
fn openai_logprobs(
    body: &serde_json::Map<String, serde_json::Value>,
    line: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), String> {
    use serde_json::Value;
    let top = body.get("top_logprobs").filter(|v| !v.is_null()).cloned();
    let n = match body.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(top.unwrap_or(Value::from(0))),
        Some(v @ Value::Number(_)) => Some(v.clone()),
        Some(_) => return Err("\"logprobs\" must be true, false or a number".into()),
    };
    let echo = body.get("echo").is_some_and(|e| e == &Value::Bool(true));
    if echo {
        line.insert(
            "prompt_logprobs".into(),
            n.clone().unwrap_or(Value::from(0)),
        );
    }
    if let Some(n) = n {
        line.insert("logprobs".into(), n);
    }
    Ok(())
}

/// A line's constraint fields, compiled once here so a bad one fails its line before the
/// model loads.
fn parse_constraint(r: &Record) -> Result<Option<Option<Spec>>, String> {
    use serde_json::Value;
    let given = [&r.json, &r.json_schema, &r.grammar, &r.regex]
        .iter()
        .filter(|v| !matches!(v, None | Some(Value::Null)))
        .count();
    if given > 1 {
        return Err("give one of \"json\", \"json_schema\", \"grammar\" and \"regex\"".into());
    }
    let (spec, field) = match (&r.json, &r.json_schema, &r.grammar, &r.regex) {
        (Some(Value::Bool(false)), ..) => return Ok(Some(None)),
        (Some(Value::Bool(true)), ..) => (Spec::json_object(), "json"),
        (Some(Value::String(k)), ..) if k == "object" => (Spec::json_object(), "json"),
        (Some(Value::String(k)), ..) if k == "any" => (Spec::AnyJson, "json"),
        (Some(v), ..) if !v.is_null() => {
            return Err("\"json\" must be true, false, \"object\" or \"any\"".into())
        }
        (_, Some(v @ (Value::Object(_) | Value::Bool(_))), ..) => {
            (Spec::JsonSchema(v.clone()), "json_schema")
        }
        (_, Some(v), ..) if !v.is_null() => {
            return Err("\"json_schema\" must be a JSON Schema (an object)".into())
        }
        (_, _, Some(Value::String(g)), _) => (Spec::Grammar(g.clone()), "grammar"),
        (_, _, Some(v), _) if !v.is_null() => return Err("\"grammar\" must be a string".into()),
        (_, _, _, Some(Value::String(rx))) => (Spec::Regex(rx.clone()), "regex"),
        (_, _, _, Some(v)) if !v.is_null() => return Err("\"regex\" must be a string".into()),
        _ => return Ok(None),
    };
    spec.check().map_err(|e| format!("\"{field}\": {e:#}"))?;
    Ok(Some(Some(spec)))
}

/// Split the input into prompts, in order. Blank lines are skipped.
pub fn parse(input: &str, format: BatchFormat) -> Vec<Result<Entry, LineError>> {
    let lines = input
        .split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
        .filter(|(_, l)| !l.trim().is_empty());
    let jsonl = match format {
        BatchFormat::Jsonl => true,
        BatchFormat::Text => false,
        BatchFormat::Auto => input
            .lines()
            .find(|l| !l.trim().is_empty())
            .is_some_and(|l| l.trim_start().starts_with('{')),
    };
    if !jsonl {
        return lines
            .map(|(line, l)| {
                Ok(Entry {
                    line,
                    id: None,
                    prompt: l.to_string(),
                    ..Entry::default()
                })
            })
            .collect();
    }
    lines.map(|(line, l)| parse_record(line, l)).collect()
}

fn parse_record(line: usize, text: &str) -> Result<Entry, LineError> {
    let fail = |id: Option<serde_json::Value>, message: String| LineError { line, id, message };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| fail(None, format!("not valid JSON ({e})")))?;
    if !value.is_object() {
        return Err(fail(
            None,
            "expected a JSON object like {\"prompt\": \"...\"}".into(),
        ));
    }
    let value = from_openai_batch(value).map_err(|m| fail(None, m))?;
    let r: Record = serde_json::from_value(value).map_err(|e| fail(None, e.to_string()))?;
    let constraint = parse_constraint(&r);
    let scoring = parse_scoring(&r);
    let id = match r.id {
        None | Some(serde_json::Value::Null) => None,
        Some(v @ (serde_json::Value::String(_) | serde_json::Value::Number(_))) => Some(v),
        Some(_) => return Err(fail(None, "\"id\" must be a string or a number".into())),
    };
    let fail = |message: &str| fail(id.clone(), message.to_string());
    let constraint = constraint.map_err(|e| fail(&e))?;
    let (prompt, messages) = match (r.prompt, r.messages) {
        (Some(_), Some(_)) => return Err(fail("give \"prompt\" or \"messages\", not both")),
        (Some(serde_json::Value::String(p)), None) => (p, None),
        (Some(_), None) => return Err(fail("\"prompt\" must be a string")),
        (None, Some(m)) => {
            let conv = crate::conversation::Conversation::from_json(&m.to_string(), "\"messages\"")
                .map_err(|e| fail(&format!("{e:#}")))?;
            (String::new(), Some(conv))
        }
        (None, None) => return Err(fail("no \"prompt\" field (or \"messages\")")),
    };
    // 0 only where the prompt is scored: a line that scores and generates nothing.
    let scores_prompt = !matches!(r.prompt_logprobs, None | Some(serde_json::Value::Null));
    let max_new = match r.max_new {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 || scores_prompt => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => {
                return Err(fail(
                    "\"max_new\" must be an integer of at least 1 (0 with \"prompt_logprobs\")",
                ))
            }
        },
    };
    let temperature = match r.temperature {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => match v.as_f64() {
            Some(t) if t.is_finite() && t >= 0.0 => Some(t),
            _ => return Err(fail("\"temperature\" must be a number, 0 or more")),
        },
    };
    let penalty = |v: Option<serde_json::Value>, name: &str| match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (-2.0..=2.0).contains(&x) => Ok(Some(x as f32)),
            _ => Err(fail(&format!("\"{name}\" must be a number in [-2, 2]"))),
        },
    };
    let presence_penalty = penalty(r.presence_penalty, "presence_penalty")?;
    let frequency_penalty = penalty(r.frequency_penalty, "frequency_penalty")?;
    let seed = match r.seed {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(s) => Some(s),
            None => return Err(fail("\"seed\" must be a non-negative integer")),
        },
    };
    let stop = match r.stop {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(vec![s]),
        Some(serde_json::Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    serde_json::Value::String(s) => out.push(s),
                    _ => return Err(fail("\"stop\" must be a string or a list of strings")),
                }
            }
            Some(out)
        }
        Some(_) => return Err(fail("\"stop\" must be a string or a list of strings")),
    };
    if stop
        .as_ref()
        .is_some_and(|s| s.iter().any(|s| s.is_empty()))
    {
        return Err(fail("a \"stop\" string is empty"));
    }
    let n = match r.n {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=MAX_N as u64).contains(&n) => Some(n as usize),
            _ => return Err(fail(&format!("\"n\" must be an integer from 1 to {MAX_N}"))),
        },
    };
    let chat = match r.url {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(u)) if u.ends_with("/chat/completions") => Some(true),
        Some(serde_json::Value::String(u)) if u.ends_with("/completions") => Some(false),
        Some(_) => {
            return Err(fail(
                "\"url\" must be /v1/completions or /v1/chat/completions",
            ))
        }
    };
    let (continuation, prompt_logprobs, logprobs) = scoring.map_err(|e| fail(&e))?;
    if continuation.is_some() && max_new.is_some() {
        return Err(fail(
            "a line with \"continuation\" scores it and generates nothing: drop \"max_new\"",
        ));
    }
    Ok(Entry {
        continuation,
        prompt_logprobs,
        logprobs,
        line,
        id,
        prompt,
        messages,
        max_new,
        temperature,
        presence_penalty,
        frequency_penalty,
        seed,
        stop,
        constraint,
        chat,
        n,
        choice: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_one_prompt_per_non_blank_line() {
        let got = parse("first\r\n\n  \nsecond line\nthird", BatchFormat::Auto);
        let got: Vec<(usize, String)> = got
            .into_iter()
            .map(|e| e.map(|e| (e.line, e.prompt)).unwrap())
            .collect();
        assert_eq!(
            got,
            vec![
                (1, "first".to_string()),
                (4, "second line".into()),
                (5, "third".into())
            ]
        );
    }

    #[test]
    fn jsonl_fields_and_multi_line_prompts() {
        let input = "\n{\"prompt\": \"a\\nb\", \"id\": \"x1\", \"max_new\": 5, \"temperature\": 0, \"seed\": 9, \"stop\": [\"\\n\\n\"], \"extra\": true}\n{\"prompt\": \"c\", \"id\": 7, \"stop\": \"END\"}\n";
        let got = parse(input, BatchFormat::Auto);
        assert_eq!(got.len(), 2);
        let a = got[0].as_ref().unwrap();
        assert_eq!(a.line, 2);
        assert_eq!(a.prompt, "a\nb");
        assert_eq!(a.id, Some(serde_json::json!("x1")));
        assert_eq!(
            (a.max_new, a.temperature, a.seed),
            (Some(5), Some(0.0), Some(9))
        );
        assert_eq!(a.stop, Some(vec!["\n\n".to_string()]));
        let c = got[1].as_ref().unwrap();
        assert_eq!((c.line, c.id.clone()), (3, Some(serde_json::json!(7))));
        assert_eq!(c.stop, Some(vec!["END".to_string()]));
        assert_eq!(c.max_new, None);
    }

    #[test]
    fn bad_lines_name_their_line_and_do_not_spoil_the_rest() {
        let input = [
            r#"{"prompt": "ok"}"#,
            r#"{"prompt": "ok", "max_new": 0}"#,
            r#"{"prompt": 3}"#,
            r#"{"id": "no-prompt"}"#,
            r#"{"prompt": "x""#,
            r#"["prompt"]"#,
            r#"{"prompt": "x", "temperature": -1}"#,
            r#"{"prompt": "x", "stop": [1]}"#,
            r#"{"prompt": "x", "seed": -4}"#,
            r#"{"prompt": "x", "id": {"a": 1}}"#,
            r#"{"prompt": "last"}"#,
        ]
        .join("\n");
        let got = parse(&input, BatchFormat::Jsonl);
        assert_eq!(got.len(), 11);
        assert!(got[0].is_ok() && got[10].is_ok());
        for (i, r) in got.iter().enumerate().take(10).skip(1) {
            let e = r.as_ref().unwrap_err();
            assert_eq!(e.line, i + 1);
            assert!(
                e.to_string().starts_with(&format!("line {}: ", i + 1)),
                "{e}"
            );
        }
        assert_eq!(
            got[3].as_ref().unwrap_err().id,
            Some(serde_json::json!("no-prompt")),
            "the id of a bad line is kept when it can be read"
        );
        assert!(got[4]
            .as_ref()
            .unwrap_err()
            .message
            .contains("not valid JSON"));
    }

    #[test]
    fn openai_batch_lines_become_gen_lines() {
        let input = [
            r#"{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "temperature": 0}}"#,
            r#"{"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "seed": 4, "stop": "\n"}}"#,
            r#"{"custom_id": "r3", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}"#,
        ]
        .join("\n");
        let got = parse(&input, BatchFormat::Auto);
        let a = got[0].as_ref().unwrap();
        assert_eq!(a.id, Some(serde_json::json!("r1")));
        assert_eq!((a.max_new, a.temperature), (Some(7), Some(0.0)));
        assert_eq!(a.messages.as_ref().unwrap().messages()[0].content, "hi");
        let b = got[1].as_ref().unwrap();
        assert_eq!((b.prompt.as_str(), b.seed), ("Once", Some(4)));
        assert_eq!(b.stop, Some(vec!["\n".to_string()]));
        let c = got[2].as_ref().unwrap_err();
        assert!(c.message.contains("embeddings"), "{c}");
    }

    #[test]
    fn openai_logprobs_and_echo_become_gen_fields() {
        let input = [
            r#"{"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 3}}"#,
            r#"{"custom_id": "e", "url": "/v1/completions", "body": {"prompt": "Once", "echo": true, "max_tokens": 0, "logprobs": 2}}"#,
            r#"{"custom_id": "f", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": false, "top_logprobs": 3}}"#,
            r#"{"prompt": "x", "max_new": 0}"#,
            r#"{"prompt": "x", "logprobs": 21}"#,
        ]
        .join("\n");
        let got = parse(&input, BatchFormat::Auto);
        let c = got[0].as_ref().unwrap();
        assert_eq!((c.logprobs, c.prompt_logprobs), (Some(3), None));
        let e = got[1].as_ref().unwrap();
        assert_eq!(
            (e.logprobs, e.prompt_logprobs, e.max_new),
            (Some(2), Some(2), Some(0))
        );
        let f = got[2].as_ref().unwrap();
        assert_eq!((f.logprobs, f.prompt_logprobs), (None, None));
        assert!(got[3]
            .as_ref()
            .unwrap_err()
            .message
            .contains("prompt_logprobs"));
        assert!(got[4]
            .as_ref()
            .unwrap_err()
            .message
            .contains("from 0 to 20"));
    }

    #[test]
    fn format_can_be_forced() {
        let text = parse("{not json, but a prompt}", BatchFormat::Text);
        assert_eq!(text[0].as_ref().unwrap().prompt, "{not json, but a prompt}");
        assert!(parse("plain", BatchFormat::Jsonl)[0].is_err());
        assert!(parse("", BatchFormat::Auto).is_empty());
    }

    /// What the fuzz target (fuzz/fuzz_targets/batch_input.rs) checks, on a few thousand
    /// deterministic random inputs drawn from JSON-heavy text, so every `cargo test` covers it.
    #[test]
    fn random_inputs_give_one_result_per_line_in_order() {
        let alphabet: Vec<&str> = vec![
            "{",
            "}",
            "[",
            "]",
            "\"",
            ":",
            ",",
            "\n",
            "\r",
            " ",
            "\\",
            "prompt",
            "id",
            "max_new",
            "temperature",
            "seed",
            "stop",
            "0",
            "-1",
            "1e999",
            "3.5",
            "null",
            "true",
            "x",
            "é",
            "\u{0}",
            "\\u0000",
            "\\n",
        ];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..3000 {
            let len = next() % 40;
            let text: String = (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect();
            for format in [BatchFormat::Auto, BatchFormat::Text, BatchFormat::Jsonl] {
                let got = parse(&text, format);
                let non_blank = text.split('\n').filter(|l| !l.trim().is_empty()).count();
                assert_eq!(got.len(), non_blank, "{text:?}");
                let lines: Vec<usize> = got
                    .iter()
                    .map(|r| match r {
                        Ok(e) => e.line,
                        Err(e) => e.line,
                    })
                    .collect();
                assert!(lines.windows(2).all(|w| w[0] < w[1]), "{text:?}");
            }
        }
    }
}
