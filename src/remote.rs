//! A client for OpenAI-compatible servers (vLLM, SGLang, TGI, llama.cpp's llama-server, ...):
//! `--endpoint URL` runs the same prompts there instead of on a local model.
//!
//! One request per prompt, streamed (server-sent events) so the first token's time is measured
//! here: `/v1/completions` for raw prompts, `/v1/chat/completions` for conversations (the server
//! applies its template). Failures that may pass (no connection, a cut stream, 408, 429, 5xx) are
//! retried with exponential backoff and jitter, honouring Retry-After; every request has a
//! timeout. gen's sampling flags map onto the API: temperature, top_p, seed, stop, max_tokens, and
//! top_k, min_p and repetition_penalty as the extensions vLLM and llama.cpp's server accept.

use std::io::{BufReader, Read};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

use crate::chat::Message;
use crate::sampler::SamplingParams;

/// How hard to try.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Tries per request, the first included.
    pub attempts: u32,
    /// The first wait; each retry doubles it (with jitter), up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Most time one try may take, connection to last byte; also the longest silence.
    pub timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            attempts: 5,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            timeout: Duration::from_secs(600),
        }
    }
}

/// A server and the model on it.
pub struct Endpoint {
    /// The base URL, without a trailing slash (`http://host:8000/v1`).
    base: String,
    key: Option<String>,
    pub model: String,
    agent: ureq::Agent,
    pub policy: Policy,
}

/// What to send.
pub enum Prompt<'a> {
    Text(&'a str),
    Messages(&'a [Message]),
}

/// The request's settings besides the prompt.
#[derive(Debug, Clone)]
pub struct Params {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// --ignore-eos, as vLLM and llama.cpp's server read it.
    pub ignore_eos: bool,
    /// --tools: OpenAI's `tools`, sent as they are (chat prompts).
    pub tools: Option<Value>,
    /// --tool-choice, as OpenAI's `tool_choice` (`"required"`, or a function by name).
    pub tool_choice: Option<Value>,
    /// --reasoning on|off: `chat_template_kwargs.enable_thinking`, as vLLM and llama.cpp's
    /// server read it (chat prompts).
    pub enable_thinking: Option<bool>,
    /// --logprobs N: asked as OpenAI's API asks them (completions' `logprobs: N`, chat's
    /// `logprobs: true` with `top_logprobs: N`).
    pub logprobs: Option<usize>,
}

/// One completed (or cut) reply.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    pub text: String,
    /// The server's finish_reason, mapped to gen's stop names (`max-new`, `eos`, ...).
    pub stop: String,
    /// From the server's `usage` (or llama.cpp's `timings`), when it said.
    pub prompt_tokens: Option<usize>,
    pub tokens: Option<usize>,
    /// From sending the request to the first text, of the try that succeeded.
    pub ttft: Duration,
    pub total: Duration,
    pub attempts: u32,
    /// The thinking the server kept apart (`reasoning_content`, or vLLM's `reasoning`).
    pub reasoning: String,
    /// The calls the server parsed (`tool_calls`, OpenAI's shape), assembled from the stream.
    pub tool_calls: Vec<Value>,
    /// With `logprobs`: the server's entries, one per token, in OpenAI chat's shape (`token`,
    /// `logprob`, `bytes`, `top_logprobs`), whichever shape it sent.
    pub logprobs: Vec<Value>,
}

/// Why a try failed, and whether another may succeed.
#[derive(Debug)]
pub enum Failure {
    Retry {
        why: String,
        after: Option<Duration>,
    },
    Fatal(String),
    /// Ctrl-C (or the reader went away) during the stream: what came so far is in the reply.
    Stopped,
}

impl Endpoint {
    /// Connect to `base` (an OpenAI-compatible base URL); `model: None` takes the first model
    /// the server lists at `GET /models`.
    pub fn new(
        base: &str,
        key: Option<String>,
        model: Option<String>,
        policy: Policy,
    ) -> Result<Self> {
        let base = base.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("--endpoint {base}: give an http:// or https:// URL, such as http://localhost:8000/v1");
        }
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(policy.timeout.min(Duration::from_secs(30)))
            .timeout_read(policy.timeout)
            .timeout(policy.timeout)
            .build();
        let mut ep = Self {
            base,
            key,
            model: String::new(),
            agent,
            policy,
        };
        ep.model = match model {
            Some(m) => m,
            None => ep.first_model()?,
        };
        Ok(ep)
    }

    fn first_model(&self) -> Result<String> {
        let url = format!("{}/models", self.base);
        let mut last = String::new();
        for attempt in 0..self.policy.attempts {
            let mut req = self.agent.get(&url);
            if let Some(k) = &self.key {
                req = req.set("Authorization", &format!("Bearer {k}"));
            }
            match classify(req.call()) {
                Ok(resp) => {
                    let body: Value = serde_json::from_reader(resp.into_reader())
                        .map_err(|e| anyhow!("{url}: the model list is not JSON: {e}"))?;
                    return body["data"][0]["id"]
                        .as_str()
                        .map(str::to_string)
                        .ok_or_else(|| {
                            anyhow!("{url} lists no model; name one with --remote-model")
                        });
                }
                Err(Failure::Retry { why, after }) => {
                    last = why;
                    if attempt + 1 < self.policy.attempts {
                        std::thread::sleep(self.backoff(attempt, after));
                    }
                }
                Err(Failure::Fatal(why)) => bail!("{url}: {why}"),
                Err(Failure::Stopped) => bail!("interrupted"),
            }
        }
        bail!("{url}: {last} (after {} tries)", self.policy.attempts)
    }

    /// The wait before retry number `attempt + 1`: the server's Retry-After if it gave one,
    /// otherwise exponential with full jitter.
    fn backoff(&self, attempt: u32, after: Option<Duration>) -> Duration {
        // The server knows best when it will have room (the header is capped at an hour).
        if let Some(a) = after {
            return a;
        }
        let exp = self
            .policy
            .backoff
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.policy.max_backoff);
        // Half fixed, half random, so many clients retrying together spread out.
        let jitter = jitter_fraction();
        exp / 2 + exp.mul_f64(jitter / 2.0)
    }

    /// Run one prompt, streaming. `on_text` gets each piece of text as it arrives and returns
    /// false to stop reading (Ctrl-C, a closed stdout); `retry_after_text`: whether a stream
    /// cut after some text may be retried from the start (a batch holds text until done; a
    /// terminal has shown it).
    pub fn complete(
        &self,
        prompt: &Prompt<'_>,
        params: &Params,
        retry_after_text: bool,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Reply> {
        let (url, body) = self.request(prompt, params);
        let start = Instant::now();
        let mut last = String::new();
        for attempt in 0..self.policy.attempts {
            let mut reply = Reply {
                attempts: attempt + 1,
                ..Reply::default()
            };
            let mut shown = false;
            let mut sink = |t: &str| {
                shown = true;
                on_text(t)
            };
            let tried = Instant::now();
            match self.try_once(&url, &body, &mut reply, tried, &mut sink) {
                Ok(()) | Err(Failure::Stopped) => {
                    reply.total = start.elapsed();
                    return Ok(reply);
                }
                Err(Failure::Fatal(why)) => bail!("{why}"),
                Err(Failure::Retry { why, after }) => {
                    if shown && !retry_after_text {
                        bail!("{why} (after part of the reply was written)");
                    }
                    last = why;
                    if attempt + 1 < self.policy.attempts {
                        std::thread::sleep(self.backoff(attempt, after));
                    }
                }
            }
        }
        bail!("{last} (after {} tries)", self.policy.attempts)
    }

    fn request(&self, prompt: &Prompt<'_>, p: &Params) -> (String, Value) {
        let s = &p.sampling;
        let mut body = json!({
            "model": self.model,
            "max_tokens": p.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
        });
        // Extensions vLLM and llama.cpp's server read; sent only when they do something.
        if s.top_k > 0 {
            body["top_k"] = json!(s.top_k);
        }
        if s.min_p > 0.0 {
            body["min_p"] = json!(s.min_p);
        }
        if s.repeat_penalty != 1.0 {
            body["repetition_penalty"] = json!(s.repeat_penalty);
            body["repeat_penalty"] = json!(s.repeat_penalty);
            body["repeat_last_n"] = json!(s.repeat_last_n);
        }
        if s.presence_penalty != 0.0 {
            body["presence_penalty"] = json!(s.presence_penalty);
        }
        if s.frequency_penalty != 0.0 {
            body["frequency_penalty"] = json!(s.frequency_penalty);
        }
        if !p.stop.is_empty() {
            body["stop"] = json!(p.stop);
        }
        if p.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        let chat = matches!(prompt, Prompt::Messages(_));
        match (p.logprobs, chat) {
            (Some(n), false) => body["logprobs"] = json!(n),
            (Some(n), true) => {
                body["logprobs"] = json!(true);
                body["top_logprobs"] = json!(n);
            }
            (None, _) => {}
        }
        match prompt {
            Prompt::Text(t) => {
                body["prompt"] = json!(t);
                (format!("{}/completions", self.base), body)
            }
            Prompt::Messages(m) => {
                // With their tool calls and results, as the OpenAI API takes them.
                body["messages"] = json!(m);
                if let Some(t) = &p.tools {
                    body["tools"] = t.clone();
                }
                if let Some(c) = &p.tool_choice {
                    body["tool_choice"] = c.clone();
                }
                if let Some(on) = p.enable_thinking {
                    body["chat_template_kwargs"] = json!({"enable_thinking": on});
                }
                (format!("{}/chat/completions", self.base), body)
            }
        }
    }

    fn try_once(
        &self,
        url: &str,
        body: &Value,
        reply: &mut Reply,
        start: Instant,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> std::result::Result<(), Failure> {
        let mut req = self
            .agent
            .post(url)
            .set("Content-Type", "application/json")
            .set("Accept", "text/event-stream");
        if let Some(k) = &self.key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        let resp = classify(req.send_string(&body.to_string()))?;
        read_events(resp.into_reader(), reply, start, on_text)
    }
}

/// Read a streamed reply (server-sent events, as OpenAI-compatible servers send them) from an
/// HTTP response body into `reply`: its text (each piece also to `on_text`, which returns false
/// to stop reading), finish reason and token counts. Ends at `data: [DONE]` or at the end of
/// the body; an event that is not JSON, a body cut before the reply ended or one that is not
/// UTF-8 is a failure a retry may fix, an `error` event one it will not. Needs no server: the
/// fuzz target `sse` calls it on any bytes.
pub fn read_events(
    body: impl Read,
    reply: &mut Reply,
    start: Instant,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> std::result::Result<(), Failure> {
    reply.text.clear();
    reply.reasoning.clear();
    reply.tool_calls.clear();
    reply.logprobs.clear();
    let mut done = false;
    for line in event_lines(BufReader::new(body)) {
        let line = line.map_err(|e| Failure::Retry {
            why: format!("the stream broke: {e}"),
            after: None,
        })?;
        // Server-sent events: `data: ...` lines; comments (`:`), ids and blank lines pass.
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let data = data.trim();
        if data == "[DONE]" {
            done = true;
            break;
        }
        let event: Value = serde_json::from_str(data).map_err(|e| Failure::Retry {
            why: format!(
                "the server sent an event that is not JSON ({e}): {}",
                clip(data)
            ),
            after: None,
        })?;
        if let Some(err) = event.get("error") {
            return Err(Failure::Fatal(format!(
                "the server says: {}",
                error_text(err)
            )));
        }
        take_usage(&event, reply);
        let Some(choice) = event["choices"].get(0) else {
            continue;
        };
        let piece = choice["text"]
            .as_str()
            .or_else(|| choice["delta"]["content"].as_str())
            .unwrap_or("");
        if !piece.is_empty() {
            if reply.text.is_empty() {
                reply.ttft = start.elapsed();
            }
            reply.text.push_str(piece);
            if !on_text(piece) {
                reply.stop = "interrupted".into();
                return Err(Failure::Stopped);
            }
        }
        let delta = &choice["delta"];
        if let Some(r) = delta["reasoning_content"]
            .as_str()
            .or_else(|| delta["reasoning"].as_str())
        {
            if reply.text.is_empty() && reply.reasoning.is_empty() {
                reply.ttft = start.elapsed();
            }
            reply.reasoning.push_str(r);
        }
        if let Some(calls) = delta["tool_calls"].as_array() {
            take_tool_calls(calls, &mut reply.tool_calls);
        }
        take_logprobs(&choice["logprobs"], &mut reply.logprobs);
        if let Some(f) = choice["finish_reason"].as_str() {
            reply.stop = finish_name(f).into();
        }
    }
    if !done && reply.stop.is_empty() {
        return Err(Failure::Retry {
            why: "the stream ended before the reply did".into(),
            after: None,
        });
    }
    if reply.stop.is_empty() {
        reply.stop = "eos".into();
    }
    Ok(())
}

/// A response, or why not, sorted into what a retry may fix and what it will not.
fn classify(
    r: std::result::Result<ureq::Response, ureq::Error>,
) -> std::result::Result<ureq::Response, Failure> {
    match r {
        Ok(resp) => Ok(resp),
        Err(ureq::Error::Status(code, resp)) => {
            let after = resp
                .header("Retry-After")
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(|s| Duration::from_secs_f64(s.min(3600.0)));
            let body = resp.into_string().unwrap_or_default();
            let said = serde_json::from_str::<Value>(&body)
                .ok()
                .map(|v| error_text(v.get("error").unwrap_or(&v)))
                .unwrap_or_else(|| clip(&body));
            let why = format!("HTTP {code}: {said}");
            if code == 408 || code == 429 || code >= 500 {
                Err(Failure::Retry { why, after })
            } else {
                Err(Failure::Fatal(why))
            }
        }
        Err(ureq::Error::Transport(t)) => Err(Failure::Retry {
            why: t.to_string(),
            after: None,
        }),
    }
}

/// A streamed chunk's log-probabilities, added to `out` as chat entries: chat's (and
/// llama.cpp's server's) `{content: [...]}` as they are; the completions API's parallel lists
/// (`tokens`, `token_logprobs`, `top_logprobs` as objects of token to value) turned into them.
fn take_logprobs(lp: &Value, out: &mut Vec<Value>) {
    if let Some(content) = lp["content"].as_array() {
        out.extend(content.iter().cloned());
        return;
    }
    let Some(tokens) = lp["tokens"].as_array() else {
        return;
    };
    let entry = |t: &str, v: &Value| json!({"token": t, "logprob": v, "bytes": t.as_bytes()});
    for (i, t) in tokens.iter().enumerate() {
        let t = t.as_str().unwrap_or("");
        let mut top: Vec<(&String, &Value)> = lp["top_logprobs"][i]
            .as_object()
            .map(|m| m.iter().collect())
            .unwrap_or_default();
        top.sort_by(|a, b| {
            let f = |v: &Value| v.as_f64().unwrap_or(f64::NEG_INFINITY);
            f(b.1).total_cmp(&f(a.1))
        });
        let mut e = entry(t, &lp["token_logprobs"][i]);
        e["top_logprobs"] = top.into_iter().map(|(k, v)| entry(k, v)).collect();
        out.push(e);
    }
}

fn take_usage(event: &Value, reply: &mut Reply) {
    let num = |v: &Value| v.as_u64().map(|n| n as usize);
    if let Some(u) = event.get("usage").filter(|u| u.is_object()) {
        reply.prompt_tokens = num(&u["prompt_tokens"]).or(reply.prompt_tokens);
        reply.tokens = num(&u["completion_tokens"]).or(reply.tokens);
    }
    // llama.cpp's server also reports its own counts.
    if let Some(t) = event.get("timings").filter(|t| t.is_object()) {
        reply.prompt_tokens = reply.prompt_tokens.or(num(&t["prompt_n"]));
        reply.tokens = reply.tokens.or(num(&t["predicted_n"]));
    }
}

/// OpenAI's finish reasons in gen's words.
fn finish_name(f: &str) -> &str {
    match f {
        "length" => "max-new",
        "stop" | "eos" => "eos",
        other => other,
    }
}

/// Streamed pieces of tool calls (`delta.tool_calls`: by `index`, the id, type and name once,
/// the arguments in pieces) added to the calls so far.
fn take_tool_calls(pieces: &[Value], calls: &mut Vec<Value>) {
    for p in pieces {
        let i = p["index"].as_u64().map_or(calls.len(), |i| i as usize);
        if i > calls.len() + 64 {
            continue; // a hostile index: not a call of this reply
        }
        while calls.len() <= i {
            calls.push(
                json!({"id": "", "type": "function", "function": {"name": "", "arguments": ""}}),
            );
        }
        let c = &mut calls[i];
        if let Some(id) = p["id"].as_str() {
            c["id"] = json!(id);
        }
        let f = &p["function"];
        if let Some(name) = f["name"].as_str() {
            let name = format!("{}{name}", c["function"]["name"].as_str().unwrap_or(""));
            c["function"]["name"] = json!(name);
        }
        if let Some(args) = f["arguments"].as_str() {
            let all = format!(
                "{}{args}",
                c["function"]["arguments"].as_str().unwrap_or("")
            );
            c["function"]["arguments"] = json!(all);
        }
    }
}

fn error_text(err: &Value) -> String {
    match err {
        Value::String(s) => clip(s),
        v => v["message"]
            .as_str()
            .map(clip)
            .unwrap_or_else(|| clip(&v.to_string())),
    }
}

/// An event stream's lines, each as soon as it ends: the stream format ends a line with LF,
/// CRLF or a lone CR. A line that is not UTF-8 is an error.
fn event_lines(mut r: impl std::io::BufRead) -> impl Iterator<Item = std::io::Result<String>> {
    let mut after_cr = false;
    let mut ended = false;
    std::iter::from_fn(move || {
        if ended {
            return None;
        }
        let mut line = Vec::new();
        loop {
            let byte = match r.fill_buf() {
                Ok([]) => {
                    ended = true;
                    return (!line.is_empty()).then(|| utf8(line));
                }
                Ok(buf) => buf[0],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    ended = true;
                    return Some(Err(e));
                }
            };
            r.consume(1);
            match byte {
                b'\n' if after_cr && line.is_empty() => after_cr = false,
                b'\n' | b'\r' => {
                    after_cr = byte == b'\r';
                    return Some(utf8(line));
                }
                b => {
                    after_cr = false;
                    line.push(b);
                }
            }
        }
    })
}

fn utf8(line: Vec<u8>) -> std::io::Result<String> {
    String::from_utf8(line).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "a line that is not UTF-8")
    })
}

/// At most 200 characters of `s`, on one line.
fn clip(s: &str) -> String {
    let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    match one.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &one[..i]),
        None => one,
    }
}

/// A number in [0, 1) that differs between calls and processes (no RNG crate needed for jitter).
fn jitter_fraction() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_apis_logprobs_become_chat_entries() {
        let mut out = Vec::new();
        // The completions API's parallel lists, its alternatives an unordered object.
        let legacy = json!({"tokens": [" a", "b"], "token_logprobs": [-0.5, -1.0],
            "top_logprobs": [{" x": -2.0, " a": -0.5}, {"b": -1.0}], "text_offset": [0, 2]});
        take_logprobs(&legacy, &mut out);
        let chat = json!({"content": [{"token": "c", "logprob": -0.1, "bytes": [99], "top_logprobs": []}]});
        take_logprobs(&chat, &mut out);
        take_logprobs(&Value::Null, &mut out);
        assert_eq!(out.len(), 3);
        assert_eq!(out[0]["token"], " a");
        assert_eq!(out[0]["bytes"], json!([32, 97]));
        let tops: Vec<&str> = out[0]["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["token"].as_str().unwrap())
            .collect();
        assert_eq!(tops, [" a", " x"], "most likely first");
        assert_eq!(out[2], chat["content"][0]);
    }

    #[test]
    fn event_lines_end_at_lf_crlf_or_a_lone_cr() {
        let lines = |b: &[u8]| -> Vec<String> {
            event_lines(std::io::Cursor::new(b.to_vec()))
                .map(|l| l.unwrap())
                .collect()
        };
        assert_eq!(lines(b"a\nb\n\nc"), ["a", "b", "", "c"]);
        assert_eq!(lines(b"a\r\nb\r\n\r\nc\r\n"), ["a", "b", "", "c"]);
        assert_eq!(lines(b"a\rb\r\rc"), ["a", "b", "", "c"]);
        assert_eq!(
            lines(b"data: 1\r\rdata: 2\n\r\n"),
            ["data: 1", "", "data: 2", ""]
        );
        assert!(event_lines(std::io::Cursor::new(b"\xff\n".to_vec()))
            .next()
            .unwrap()
            .is_err());
        // A stream whose events end in lone CRs gives the reply, as one ending in LFs does.
        let body = "data: {\"choices\":[{\"text\":\"Hi\",\"finish_reason\":\"stop\"}]}\r\rdata: [DONE]\r\r";
        let mut reply = Reply::default();
        let mut seen = String::new();
        read_events(body.as_bytes(), &mut reply, Instant::now(), &mut |t| {
            seen.push_str(t);
            true
        })
        .unwrap();
        assert_eq!((reply.text.as_str(), seen.as_str()), ("Hi", "Hi"));
    }

    #[test]
    fn a_server_error_is_one_short_line() {
        let long = "line one\nline two ".repeat(100);
        for err in [
            Value::String(long.clone()),
            serde_json::json!({ "message": long }),
        ] {
            let said = error_text(&err);
            assert!(
                !said.contains('\n') && said.chars().count() <= 203,
                "{said}"
            );
        }
    }

    #[test]
    fn finish_reasons_and_clipping() {
        assert_eq!(finish_name("length"), "max-new");
        assert_eq!(finish_name("stop"), "eos");
        assert_eq!(finish_name("tool_calls"), "tool_calls");
        let long = "x ".repeat(300);
        assert!(clip(&long).len() <= 204);
        assert_eq!(clip("a\n b"), "a b");
    }

    #[test]
    fn event_streams_give_the_reply_or_a_failure() {
        let read = |body: &str| {
            let mut reply = Reply::default();
            let mut pieces = Vec::new();
            let r = read_events(body.as_bytes(), &mut reply, Instant::now(), &mut |t| {
                pieces.push(t.to_string());
                true
            });
            (r, reply, pieces)
        };
        let (r, reply, pieces) = read(
            ": ping\n\ndata: {\"choices\":[{\"text\":\"Once\"}]}\n\n\
             data:{\"choices\":[{\"delta\":{\"content\":\" upon\"},\"finish_reason\":\"length\"}]}\r\n\
             data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\
             data: [DONE]\n",
        );
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(
            (reply.text.as_str(), reply.stop.as_str()),
            ("Once upon", "max-new")
        );
        assert_eq!((reply.prompt_tokens, reply.tokens), (Some(3), Some(2)));
        assert_eq!(pieces, ["Once", " upon"]);
        let (r, ..) = read("data: {\"choices\":[{\"text\":\"cut\"}]}\n");
        assert!(matches!(r, Err(Failure::Retry { why, .. }) if why.contains("ended before")));
        let (r, ..) = read("data: <html>502</html>\n");
        assert!(matches!(r, Err(Failure::Retry { why, .. }) if why.contains("not JSON")));
        let (r, ..) = read("data: {\"error\": {\"message\": \"overloaded\"}}\n");
        assert!(matches!(r, Err(Failure::Fatal(why)) if why.contains("overloaded")));
    }

    #[test]
    fn backoff_grows_with_jitter_and_honours_retry_after() {
        let ep = Endpoint {
            base: "http://127.0.0.1:1/v1".into(),
            key: None,
            model: "m".into(),
            agent: ureq::agent(),
            policy: Policy {
                backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(1),
                ..Policy::default()
            },
        };
        for attempt in 0..8 {
            let d = ep.backoff(attempt, None);
            let cap = Duration::from_millis(100 * (1 << attempt)).min(Duration::from_secs(1));
            assert!(d >= cap / 2 && d <= cap, "attempt {attempt}: {d:?}");
        }
        assert_eq!(
            ep.backoff(0, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn streamed_reasoning_and_tool_calls_are_assembled() {
        let body = "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"Let me \"}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"see.\"}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\"}}]}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\": \\\"Paris\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n\
             data: [DONE]\n\n";
        let mut reply = Reply::default();
        read_events(body.as_bytes(), &mut reply, Instant::now(), &mut |_| true).unwrap();
        assert_eq!(reply.reasoning, "Let me see.");
        assert_eq!(reply.stop, "tool_calls");
        assert_eq!(reply.tool_calls.len(), 1);
        assert_eq!(reply.tool_calls[0]["id"], "c1");
        assert_eq!(reply.tool_calls[0]["function"]["name"], "get_weather");
        assert_eq!(
            reply.tool_calls[0]["function"]["arguments"],
            "{\"city\": \"Paris\"}"
        );
        assert_eq!(reply.text, "");
    }

    #[test]
    fn requests_carry_the_sampling_flags() {
        let ep = Endpoint {
            base: "http://h/v1".into(),
            key: None,
            model: "m".into(),
            agent: ureq::agent(),
            policy: Policy::default(),
        };
        let params = Params {
            sampling: SamplingParams {
                temperature: 0.5,
                top_k: 7,
                min_p: 0.1,
                seed: 3,
                ..SamplingParams::default()
            },
            max_tokens: 9,
            stop: vec!["\n".into()],
            ignore_eos: false,
            tools: None,
            tool_choice: None,
            enable_thinking: Some(false),
            logprobs: Some(2),
        };
        let (url, body) = ep.request(&Prompt::Text("hi"), &params);
        assert_eq!(url, "http://h/v1/completions");
        assert_eq!(body["prompt"], "hi");
        assert_eq!(
            (body["logprobs"].clone(), body.get("top_logprobs")),
            (json!(2), None)
        );
        assert_eq!(
            (body["max_tokens"].clone(), body["top_k"].clone()),
            (json!(9), json!(7))
        );
        assert_eq!(
            (body["seed"].clone(), body["stop"].clone()),
            (json!(3), json!(["\n"]))
        );
        assert!(body.get("repetition_penalty").is_none());
        let msgs = [Message::new("user", "yo")];
        let (url, body) = ep.request(&Prompt::Messages(&msgs), &params);
        assert_eq!(url, "http://h/v1/chat/completions");
        assert_eq!(body["messages"][0]["content"], "yo");
        assert!(body["messages"][0].get("tool_calls").is_none());
        assert_eq!(body["chat_template_kwargs"]["enable_thinking"], false);
        assert!(body.get("tools").is_none());
        assert_eq!(
            (body["logprobs"].clone(), body["top_logprobs"].clone()),
            (json!(true), json!(2))
        );
    }
}
