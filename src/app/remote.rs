//! Wiring of runs on a server (`--endpoint`): one prompt streamed to stdout, or a batch with
//! `--concurrency` requests in flight, written exactly as a local batch writes (input order, as
//! soon as possible, per-item errors, `--resume`, `--batch-output`).

use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;

use super::jsonl::{Done, Line, Writer};
use super::{read_prompt, stdout_is_terminal, Outcome};
use crate::batch_input::{Entry, LineError};
use crate::chat::{self, Message};
use crate::cli::{BatchConfig, Config, RemoteConfig, StatsFormat};
use crate::interrupt;
use crate::output::TextOut;
use crate::remote::{Endpoint, Params, Prompt, Reply};

/// What a remote run reports: what the client can know. Forward passes and load time happen on
/// the server, and are not guessed.
#[derive(Debug, Serialize)]
struct RemoteReport {
    endpoint: String,
    model: String,
    prompts: usize,
    failed: usize,
    concurrency: usize,
    /// From the server's `usage`; null when it did not say.
    prompt_tokens: Option<usize>,
    generated_tokens: Option<usize>,
    /// Single prompt: from sending the request to the first text.
    ttft_s: Option<f64>,
    /// Generated tokens per second (a batch: all together, over the whole run).
    decode_tok_s: Option<f64>,
    total_s: f64,
    /// Tries beyond the first, over all requests.
    retries: u32,
    stop_reason: Option<String>,
    forward_passes: Option<usize>,
    /// Single prompt: the thinking the server kept apart (`reasoning_content`).
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<String>,
    /// Single prompt with --tools: the calls the server parsed.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<serde_json::Value>>,
    /// Single prompt with --logprobs: the server's, in gen's shape (no ids: servers send none).
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<crate::logprobs::Logprobs>,
}

impl RemoteReport {
    /// To `--stats-file` where asked, and to stderr unless -q (or, `to_stderr` false, the
    /// reader of stdout went away).
    fn write(&self, cfg: &Config, to_stderr: bool) -> Result<()> {
        if let Some(path) = &cfg.stats_file {
            crate::report::save_json(path, self)?;
        }
        if cfg.quiet || !to_stderr {
            return Ok(());
        }
        let format = cfg.stats;
        let mut w = std::io::stderr().lock();
        if format == StatsFormat::Json {
            serde_json::to_writer(&mut w, self)?;
            writeln!(w)?;
            return Ok(());
        }
        let n = |v: Option<usize>| v.map_or("?".to_string(), |v| v.to_string());
        writeln!(w)?;
        writeln!(w, "model          {} at {}", self.model, self.endpoint)?;
        if self.prompts > 1 || self.failed > 0 {
            writeln!(
                w,
                "prompts        {} ({} failed), up to {} requests at once",
                self.prompts, self.failed, self.concurrency
            )?;
        }
        let stop = self
            .stop_reason
            .as_ref()
            .map_or(String::new(), |s| format!(", stop: {s}"));
        writeln!(
            w,
            "tokens         {} prompt, {} generated (the server's count){stop}",
            n(self.prompt_tokens),
            n(self.generated_tokens)
        )?;
        writeln!(w, "forward passes on the server (not known here)")?;
        if let Some(t) = self.ttft_s {
            writeln!(
                w,
                "first token    {:.1} ms (request to first text)",
                t * 1000.0
            )?;
        }
        let rate = self.decode_tok_s.map_or("?".into(), |r| format!("{r:.1}"));
        writeln!(
            w,
            "decode         {rate} tok/s; total {:.2} s; {} retries",
            self.total_s, self.retries
        )?;
        if let Some(calls) = &self.tool_calls {
            writeln!(w, "tool calls     {}", crate::tool_calls::describe(calls))?;
        }
        if let Some(l) = &self.logprobs {
            l.write_human(&mut w)?;
        }
        Ok(())
    }
}

fn endpoint(rc: &RemoteConfig) -> Result<Endpoint> {
    Endpoint::new(&rc.url, rc.key.clone(), rc.model.clone(), rc.policy.clone())
}

fn params(cfg: &Config) -> Params {
    Params {
        sampling: cfg.sampling.clone(),
        max_tokens: cfg.max_new,
        stop: cfg.stops.clone(),
        ignore_eos: cfg.ignore_eos,
        tools: cfg.tools.clone(),
        tool_choice: cfg.tool_choice.as_ref().map(|c| match c {
            crate::tool_calls::Choice::Required => serde_json::json!("required"),
            crate::tool_calls::Choice::Named(n) => {
                serde_json::json!({"type": "function", "function": {"name": n}})
            }
        }),
        enable_thinking: cfg.reasoning.enable_thinking(),
        logprobs: cfg.logprobs,
    }
}

/// One prompt, its reply streamed to stdout as the server sends it.
pub fn run_one(cfg: &Config, rc: &RemoteConfig) -> Result<Outcome> {
    let messages: Option<Vec<Message>> = match &cfg.messages {
        Some(path) => Some(crate::conversation::Conversation::load(path)?.messages()),
        None => None,
    };
    let text = match &messages {
        Some(_) => String::new(),
        None => read_prompt(&cfg.prompt)?,
    };
    if messages.is_none() && text.trim().is_empty() {
        return Err(super::Usage(
            "the prompt is empty: give one with --prompt, --prompt-file or on standard input"
                .into(),
        )
        .into());
    }
    let messages = messages.or_else(|| {
        cfg.chat
            .then(|| chat::one_shot(cfg.system.as_deref(), &text))
    });
    let ep = endpoint(rc)?;
    let prompt = match &messages {
        Some(m) => Prompt::Messages(m),
        None => Prompt::Text(&text),
    };
    let stdout = std::io::stdout();
    let mut out = TextOut::new(stdout.lock());
    if cfg.echo {
        out.write(&text)?;
    }
    let mut on_text =
        |t: &str| -> bool { !interrupt::requested() && out.write(t).unwrap_or(false) };
    let reply = ep.complete(&prompt, &params(cfg), false, &mut on_text)?;
    if !out.is_closed() && stdout_is_terminal() {
        out.write("\n")?;
    }
    drop(out);
    // The thinking the server kept apart, on stderr (dim on a terminal), after the answer:
    // the stream gives it first, but stdout is the answer's alone.
    if !reply.reasoning.is_empty() && !cfg.quiet {
        let r = reply.reasoning.trim_end();
        match super::stderr_colour() {
            true => eprintln!("\x1b[2m{r}\x1b[0m"),
            false => eprintln!("{r}"),
        }
    }
    if !cfg.quiet || cfg.stats_file.is_some() {
        let decode = reply.total.saturating_sub(reply.ttft).as_secs_f64();
        RemoteReport {
            endpoint: rc.url.clone(),
            model: ep.model.clone(),
            prompts: 1,
            failed: 0,
            concurrency: 1,
            prompt_tokens: reply.prompt_tokens,
            generated_tokens: reply.tokens,
            ttft_s: Some(reply.ttft.as_secs_f64()),
            decode_tok_s: reply
                .tokens
                .filter(|_| decode > 0.0)
                .map(|n| n.saturating_sub(1) as f64 / decode),
            total_s: reply.total.as_secs_f64(),
            retries: reply.attempts.saturating_sub(1),
            stop_reason: Some(reply.stop.clone()),
            forward_passes: None,
            reasoning: (!reply.reasoning.is_empty()).then(|| reply.reasoning.clone()),
            tool_calls: cfg.tools.as_ref().map(|_| reply.tool_calls.clone()),
            logprobs: cfg
                .logprobs
                .map(|_| crate::logprobs::Logprobs::from_server(&reply.logprobs)),
        }
        .write(cfg, true)?;
    }
    Ok(if reply.stop == "interrupted" {
        Outcome::Interrupted
    } else {
        Outcome::Done
    })
}

/// One item of a remote batch.
struct Job {
    index: usize,
    entry: Entry,
    messages: Option<Vec<Message>>,
    params: Params,
}

/// A batch on the server: `--concurrency` workers take items in input order; the main thread
/// writes each line once every line before it is out.
pub fn run_batch(cfg: &Config, bc: &BatchConfig, rc: &RemoteConfig) -> Result<Outcome> {
    let entries = super::batch::read_entries(cfg, bc)?;
    let total = entries.len();
    let ep = Arc::new(endpoint(rc)?);
    let mut out = Writer::new(total, super::batch::shape(cfg, ep.model.clone()));
    let done = cfg.resume.as_deref().map(Done::read).transpose()?;
    let mut jobs = VecDeque::new();
    for (index, entry) in entries.into_iter().enumerate() {
        match entry.and_then(|e| job(cfg, index, e)) {
            Ok(j) if done.as_ref().is_some_and(|d| d.holds(index, &j.entry)) => out.skip(index)?,
            Ok(j) => jobs.push_back(j),
            Err(e) => {
                if !cfg.quiet {
                    eprintln!("gen: prompt {} ({e})", index + 1);
                }
                out.error(index, e)?;
            }
        }
    }
    if let (Some(d), false) = (&done, cfg.quiet) {
        eprintln!(
            "gen: resuming: {} items already complete, {} to run",
            d.count,
            jobs.len()
        );
    }
    let start = Instant::now();
    let queued = jobs.len();
    let queue = Arc::new(Mutex::new(jobs));
    let (tx, rx) = mpsc::channel::<(Job, Result<Reply>)>();
    let workers: Vec<_> = (0..rc.concurrency.min(queued.max(1)))
        .map(|_| {
            let (queue, tx, ep) = (queue.clone(), tx.clone(), ep.clone());
            std::thread::spawn(move || work(&ep, &queue, &tx))
        })
        .collect();
    drop(tx);
    let mut tally = Tally::default();
    let progress = (std::io::stderr().is_terminal() && !cfg.quiet)
        .then(|| indicatif::ProgressBar::new(total as u64));
    for (job, result) in rx {
        tally.write(&mut out, cfg, job, result)?;
        if let Some(bar) = &progress {
            bar.set_position(out.written as u64);
        }
    }
    for w in workers {
        let _ = w.join();
    }
    // Items no worker started (Ctrl-C came first).
    let left: Vec<Job> = queue
        .lock()
        .map(|mut q| q.drain(..).collect())
        .unwrap_or_default();
    for job in left {
        let reply = Reply {
            stop: "interrupted".into(),
            ..Reply::default()
        };
        tally.write(&mut out, cfg, job, Ok(reply))?;
    }
    if let Some(bar) = &progress {
        bar.finish_and_clear();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let failed = out.failed;
    if (!cfg.quiet && !out.closed) || cfg.stats_file.is_some() {
        RemoteReport {
            endpoint: rc.url.clone(),
            model: ep.model.clone(),
            prompts: total,
            failed,
            concurrency: rc.concurrency,
            prompt_tokens: tally.prompt_tokens,
            generated_tokens: tally.tokens,
            ttft_s: None,
            decode_tok_s: tally
                .tokens
                .filter(|_| elapsed > 0.0)
                .map(|n| n as f64 / elapsed),
            total_s: elapsed,
            retries: tally.retries,
            stop_reason: None,
            forward_passes: None,
            reasoning: None,
            tool_calls: None,
            logprobs: None,
        }
        .write(cfg, !out.closed)?;
    }
    Ok(out.outcome())
}

fn job(cfg: &Config, index: usize, entry: Entry) -> Result<Job, LineError> {
    if entry.messages.is_none() && entry.prompt.trim().is_empty() {
        return Err(LineError {
            line: entry.line,
            id: entry.id.clone(),
            message: "the prompt is empty".into(),
        });
    }
    if entry.constraint.is_some() {
        return Err(LineError {
            line: entry.line,
            id: entry.id.clone(),
            message: "json/json_schema/grammar/regex run on local models only".into(),
        });
    }
    if entry.continuation.is_some() || entry.prompt_logprobs.is_some() {
        return Err(LineError {
            line: entry.line,
            id: entry.id.clone(),
            message: "continuation and prompt_logprobs (scoring a prompt) run on local models only"
                .into(),
        });
    }
    let messages = match &entry.messages {
        Some(c) => Some(c.messages()),
        None => entry
            .chat
            .unwrap_or(cfg.chat)
            .then(|| chat::one_shot(cfg.system.as_deref(), &entry.prompt)),
    };
    let mut p = params(cfg);
    p.max_tokens = entry.max_new.unwrap_or(cfg.max_new);
    p.logprobs = entry.logprobs.or(cfg.logprobs);
    if let Some(t) = entry.temperature {
        p.sampling.temperature = t;
    }
    p.sampling.presence_penalty = entry
        .presence_penalty
        .unwrap_or(p.sampling.presence_penalty);
    p.sampling.frequency_penalty = entry
        .frequency_penalty
        .unwrap_or(p.sampling.frequency_penalty);
    // As locally: item i samples with seed + i unless it brings its own.
    p.sampling.seed = entry
        .seed
        .unwrap_or_else(|| cfg.sampling.seed.wrapping_add(index as u64));
    if let Some(stop) = &entry.stop {
        p.stop = stop.clone();
    }
    Ok(Job {
        index,
        entry,
        messages,
        params: p,
    })
}

/// A worker: take the next item, run it, send the result, until the queue is empty or Ctrl-C.
fn work(ep: &Endpoint, queue: &Mutex<VecDeque<Job>>, tx: &mpsc::Sender<(Job, Result<Reply>)>) {
    loop {
        if interrupt::requested() {
            return;
        }
        let Some(job) = queue.lock().ok().and_then(|mut q| q.pop_front()) else {
            return;
        };
        let prompt = match &job.messages {
            Some(m) => Prompt::Messages(m),
            None => Prompt::Text(&job.entry.prompt),
        };
        // A batch holds each reply until it is done, so a stream cut midway can start over.
        let result = ep.complete(&prompt, &job.params, true, &mut |_| !interrupt::requested());
        if tx.send((job, result)).is_err() {
            return;
        }
    }
}

#[derive(Default)]
struct Tally {
    prompt_tokens: Option<usize>,
    tokens: Option<usize>,
    retries: u32,
}

impl Tally {
    fn write(
        &mut self,
        out: &mut Writer,
        cfg: &Config,
        job: Job,
        result: Result<Reply>,
    ) -> Result<()> {
        let e = &job.entry;
        let reply = match result {
            Ok(r) => r,
            Err(err) => {
                let message = format!("{err:#}");
                if !cfg.quiet {
                    eprintln!("gen: prompt {} (line {}: {message})", job.index + 1, e.line);
                }
                return out.error(
                    job.index,
                    LineError {
                        line: e.line,
                        id: e.id.clone(),
                        message,
                    },
                );
            }
        };
        let add = |a: Option<usize>, b: Option<usize>| match (a, b) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.prompt_tokens = add(self.prompt_tokens, reply.prompt_tokens);
        self.tokens = add(self.tokens, reply.tokens);
        self.retries += reply.attempts.saturating_sub(1);
        let ms = |d: Duration| (d.as_secs_f64() * 1e5).round() / 100.0;
        let sampled = job.params.sampling.temperature > 0.0;
        out.reply(&Line {
            index: job.index,
            id: &e.id,
            line: e.line,
            choice: (e.n.unwrap_or(1) > 1).then_some(e.choice),
            text: Some(&reply.text),
            error: None,
            prompt_tokens: reply.prompt_tokens,
            cached_tokens: None,
            tokens: reply.tokens,
            stop: Some(&reply.stop),
            passes: None,
            ttft_ms: (reply.attempts > 0).then(|| ms(reply.ttft)),
            wait_ms: None,
            seed: sampled.then_some(job.params.sampling.seed),
            complete: None,
            chat: e.chat,
            reasoning: (!reply.reasoning.is_empty()).then_some(reply.reasoning.as_str()),
            reasoning_tokens: None,
            tool_calls: cfg.tools.as_ref().map(|_| reply.tool_calls.clone()),
            content: cfg.tools.as_ref().map(|_| reply.text.clone()),
            logprobs: job
                .params
                .logprobs
                .map(|_| crate::logprobs::Logprobs::from_server(&reply.logprobs)),
            scores: None,
        })
    }
}
