//! Wiring of a batch run (`--batch FILE`): read and check every prompt, run them through the
//! continuous-batching loop, write one JSON line per prompt in input order as soon as it and
//! every prompt before it are done, and report on stderr.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Result;

use super::jsonl::{Done, Line, Shape, Writer};
use super::{read_prompt, Outcome, Session};
use crate::batch::{self, BatchOptions, BatchSink, Outcome as SeqOutcome, Request};
use crate::batch_input::{self, Entry, LineError};
use crate::cli::{BatchConfig, Config, PromptSource, StatsFormat};
use crate::constraint::{Grammars, MaskStats, Spec};
use crate::generate::{Flow, StopReason};
use crate::interrupt;
use crate::model::kv_cache::{blocks_for, BLOCK_SIZE};
use crate::output::StopMatcher;
use crate::report::BatchReport;
use crate::sampler::{Sampler, SamplingParams};
use crate::tokenizer::TextStream;

/// A prompt ready to run, with what its output line needs.
struct Prepared {
    index: usize,
    entry: Entry,
    ids: Vec<u32>,
    max_new: usize,
    sampling: SamplingParams,
    constraint: Option<Spec>,
    /// Where the reply starts, when the chat template has a thinking block.
    start: Option<super::thinking::Start>,
    /// Where its scores start (see `batch::Request::score_from`), with the alternatives each.
    score: Option<(usize, usize)>,
    /// A continuation line: its prompt's own tokens (the continuation's follow).
    prompt_len: usize,
}

/// The batch's prompts, each as many times as it asks completions: the lines of `--batch`'s
/// input, or with `--n K` and no `--batch`, the one prompt (or `--messages` conversation).
pub(crate) fn read_entries(
    cfg: &Config,
    bc: &BatchConfig,
) -> Result<Vec<std::result::Result<Entry, LineError>>> {
    let entries = if bc.one_prompt {
        let entry = match &cfg.messages {
            Some(path) => Entry {
                messages: Some(crate::conversation::Conversation::load(path)?),
                line: 1,
                ..Entry::default()
            },
            None => Entry {
                prompt: read_prompt(&cfg.prompt)?,
                line: 1,
                ..Entry::default()
            },
        };
        if entry.messages.is_none() && entry.prompt.trim().is_empty() {
            return Err(super::Usage(
                "the prompt is empty: give one with --prompt, --prompt-file or on standard input"
                    .into(),
            )
            .into());
        }
        vec![Ok(entry)]
    } else {
        let source = match &bc.file {
            Some(p) => PromptSource::File(p.clone()),
            None => PromptSource::Stdin,
        };
        let input = read_prompt(&source)?;
        let entries = batch_input::parse(&input, bc.format);
        if entries.is_empty() {
            anyhow::bail!(
                "no prompts in {}: write one prompt per line",
                bc.file
                    .as_ref()
                    .map_or("standard input".to_string(), |p| p.display().to_string())
            );
        }
        entries
    };
    Ok(batch_input::expand(entries, cfg.n))
}

pub fn run(cfg: &Config, bc: &BatchConfig) -> Result<Outcome> {
    let entries = read_entries(cfg, bc)?;
    let total = entries.len();
    let Some(mut session) = Session::open(cfg)? else {
        return Ok(Outcome::Interrupted);
    };

    // Check every prompt before any compute; a bad one becomes its error line.
    let mut out = Writer::new(total, shape(cfg, session.loaded.model.info().name.clone()));
    let done = cfg.resume.as_deref().map(Done::read).transpose()?;
    let mut prepared = Vec::new();
    for (index, entry) in entries.into_iter().enumerate() {
        if let (Some(done), Ok(e)) = (&done, &entry) {
            if done.holds(index, e) {
                out.skip(index)?;
                continue;
            }
        }
        match entry.and_then(|e| prepare(&session, cfg, index, e)) {
            Ok(p) => prepared.push(p),
            Err(e) => {
                if !cfg.quiet {
                    eprintln!("gen: prompt {} ({e})", index + 1);
                }
                out.error(index, e)?;
            }
        }
    }

    let batch_size = bc
        .batch_size
        .unwrap_or(if session.device.is_cpu() { 8 } else { 64 });
    // Each sequence holds at most its prompt, its reply, and the token being fed.
    let longest = prepared
        .iter()
        .map(|p| blocks_for((p.ids.len() + p.max_new).min(session.context_len) + 1))
        .max()
        .unwrap_or(1);
    let pool_blocks = bc
        .kv_blocks
        .unwrap_or(longest * batch_size.min(prepared.len().max(1)));
    let eos = if cfg.ignore_eos {
        Vec::new()
    } else {
        session.loaded.tokenizer.eos_ids().to_vec()
    };
    let (requests, ran) = requests(&session, cfg, prepared, pool_blocks, &eos, &mut out)?;

    let tool_format = session.tool_format(cfg);
    let loaded = &mut session.loaded;
    let tokenizer = &loaded.tokenizer;
    let progress = (std::io::stderr().is_terminal() && !cfg.quiet).then(|| {
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} prompts, {msg} [{elapsed_precise}]",
            )
            .expect("a valid template"),
        );
        bar.set_position(out.written as u64);
        bar
    });
    let mut sink = Sink {
        texts: ran
            .iter()
            .map(|p| {
                Ok(SeqText {
                    stream: tokenizer.stream(),
                    stops: StopMatcher::new(
                        p.entry.stop.clone().unwrap_or_else(|| cfg.stops.clone()),
                    ),
                    text: String::new(),
                    stopped: false,
                    thinking: p
                        .start
                        .map(|s| {
                            super::thinking::Thinking::new(
                                s,
                                tokenizer,
                                cfg.reasoning_budget,
                                false,
                            )
                        })
                        .transpose()?,
                })
            })
            .collect::<Result<_>>()?,
        ran: &ran,
        out: &mut out,
        progress: progress.as_ref(),
        quiet: cfg.quiet,
        masks: Vec::new(),
        tokens: 0,
        started: std::time::Instant::now(),
        tool_format,
        logprobs: cfg.logprobs.is_some(),
        tokenizer,
    };
    let opts = BatchOptions {
        batch_size,
        context_len: session.context_len,
        pool_blocks,
        eos,
        prefix_cache: cfg.prefix_cache,
        speculate: cfg.speculate.map(|(_, k)| k),
    };
    let stats = if requests.is_empty() {
        batch::BatchStats::default()
    } else {
        batch::run(loaded.model.as_mut(), requests, &opts, &mut sink)?
    };
    if let Some(bar) = &progress {
        bar.finish_and_clear();
    }
    let masks = std::mem::take(&mut sink.masks);
    let closed = out.closed;
    let failed = out.failed;

    if !cfg.quiet || cfg.stats_file.is_some() {
        let end = if closed {
            "output-closed"
        } else if crate::interrupt::requested() {
            "interrupted"
        } else {
            "done"
        };
        let report = BatchReport::new(
            loaded.model.info().name.as_str(),
            &session.device_name,
            session.load_s,
            total,
            failed,
            batch_size,
            &stats,
            loaded.model.kv_bytes_per_token() * BLOCK_SIZE,
        )
        .with_load_times(session.load_times)
        .with_end(if end == "done" { total } else { out.written }, end)
        .with_kernels(loaded.model.kernel_paths())
        .with_constraints(&masks)
        .with_speculation(cfg.speculate.map(|(_, k)| k), &stats);
        if let Some(path) = &cfg.stats_file {
            crate::report::save_json(path, &report)?;
        }
        if !cfg.quiet {
            let mut err = std::io::stderr().lock();
            match cfg.stats {
                StatsFormat::Human => report.write_human(&mut err)?,
                StatsFormat::Json => report.write_json(&mut err)?,
            }
        }
    }
    Ok(out.outcome())
}

/// The requests to run, with the prompts they came from. A prompt the pool cannot hold even
/// alone fails now (its error line is written) rather than wait forever.
fn requests(
    session: &Session,
    cfg: &Config,
    prepared: Vec<Prepared>,
    pool_blocks: usize,
    eos: &[u32],
    out: &mut Writer,
) -> Result<(Vec<Request>, Vec<Prepared>)> {
    let grammars = if prepared.iter().any(|p| p.constraint.is_some()) {
        Some(Grammars::new(&session.loaded.tokenizer, eos)?)
    } else {
        None
    };
    let mut requests = Vec::new();
    let mut ran = Vec::new();
    for p in prepared {
        let need = blocks_for((p.ids.len() + p.max_new).min(session.context_len) + 1);
        if need > pool_blocks {
            let e = LineError {
                line: p.entry.line,
                id: p.entry.id.clone(),
                message: format!(
                    "needs {need} KV cache blocks of {BLOCK_SIZE} tokens, over --kv-blocks \
                     {pool_blocks}"
                ),
            };
            if !cfg.quiet {
                eprintln!("gen: prompt {} ({e})", p.index + 1);
            }
            out.error(p.index, e)?;
            continue;
        }
        let mut sampler = Sampler::new(p.sampling.clone())
            .with_logprobs(p.entry.logprobs.or(cfg.logprobs))
            .with_prompt_logprobs(p.score.map(|(_, n)| n));
        if let (Some(spec), Some(g)) = (&p.constraint, &grammars) {
            sampler = sampler.with_constraint(g.constraint(spec)?);
        }
        requests.push(Request {
            prompt: p.ids.clone(),
            max_new: p.max_new,
            sampler,
            score_from: p.score.map(|(from, _)| from),
        });
        ran.push(p);
    }
    Ok((requests, ran))
}

/// The output lines' shape for this run (`--batch-output`); `model`: what OpenAI's shape names.
pub(crate) fn shape(cfg: &Config, model: String) -> Shape {
    match cfg.batch_output {
        crate::cli::BatchOutput::Gen => Shape::Gen,
        crate::cli::BatchOutput::Openai => Shape::OpenAi {
            chat: cfg.chat,
            model,
        },
    }
}

fn prepare(
    session: &Session,
    cfg: &Config,
    index: usize,
    entry: Entry,
) -> Result<Prepared, LineError> {
    let fail = |e: anyhow::Error| LineError {
        line: entry.line,
        id: entry.id.clone(),
        message: format!("{e:#}"),
    };
    if entry.messages.is_none() && entry.prompt.trim().is_empty() {
        return Err(fail(anyhow::anyhow!("the prompt is empty")));
    }
    let max_new = match entry.continuation {
        Some(_) => 0,
        None => entry.max_new.unwrap_or(cfg.max_new),
    };
    let (mut ids, start) = match &entry.messages {
        Some(conv) => session.conversation(cfg, &conv.messages(), max_new.max(1)),
        None => session.prompt_as(
            cfg,
            &entry.prompt,
            max_new.max(1),
            entry.chat.unwrap_or(cfg.chat),
        ),
    }
    .map_err(fail)?;
    let prompt_len = ids.len();
    if let Some(c) = &entry.continuation {
        ids.extend(session.loaded.tokenizer.encode(c, false).map_err(fail)?);
        if ids.len() >= session.context_len {
            return Err(fail(anyhow::anyhow!(
                "the prompt and its continuation ({} tokens) do not fit the context window ({} tokens)",
                ids.len(),
                session.context_len
            )));
        }
    }
    let prompt_top = entry.prompt_logprobs.or(cfg.prompt_logprobs);
    let score = match (prompt_top, &entry.continuation) {
        (Some(n), _) => Some((1, n)),
        (None, Some(_)) => Some((prompt_len, entry.logprobs.or(cfg.logprobs).unwrap_or(0))),
        (None, None) => None,
    };
    let mut sampling = cfg.sampling.clone();
    if let Some(t) = entry.temperature {
        sampling.temperature = t;
    }
    sampling.presence_penalty = entry.presence_penalty.unwrap_or(sampling.presence_penalty);
    sampling.frequency_penalty = entry
        .frequency_penalty
        .unwrap_or(sampling.frequency_penalty);
    // Prompt i samples with seed + i: the same stream whatever else is in the batch, and the
    // first prompt samples as a single run with the same --seed would.
    sampling.seed = entry
        .seed
        .unwrap_or_else(|| cfg.sampling.seed.wrapping_add(index as u64));
    sampling.validate().map_err(fail)?;
    let constraint = match &entry.constraint {
        Some(own) => own.clone(),
        None => session.constraint(cfg).map_err(fail)?,
    };
    Ok(Prepared {
        index,
        entry,
        ids,
        max_new,
        sampling,
        constraint,
        start,
        score,
        prompt_len,
    })
}

/// A sequence's text as it streams in: detokenized, and cut at a stop string.
struct SeqText<'t> {
    stream: TextStream<'t>,
    stops: StopMatcher,
    text: String,
    stopped: bool,
    /// Some: the reply may think first; its thinking is kept apart from `text`.
    thinking: Option<super::thinking::Thinking>,
}

struct Sink<'a, 't> {
    texts: Vec<SeqText<'t>>,
    ran: &'a [Prepared],
    out: &'a mut Writer,
    progress: Option<&'a indicatif::ProgressBar>,
    quiet: bool,
    /// What each finished reply's grammar cost.
    masks: Vec<(&'static str, MaskStats)>,
    tokens: usize,
    started: std::time::Instant,
    /// With --tools: the format of the replies' calls.
    tool_format: Option<crate::tool_calls::Format>,
    /// With --logprobs: the replies' log-probabilities are written, their tokens named by it.
    logprobs: bool,
    tokenizer: &'t crate::tokenizer::Tokenizer,
}

impl BatchSink for Sink<'_, '_> {
    fn on_token(&mut self, index: usize, id: u32) -> Result<Flow> {
        self.tokens += 1;
        let t = &mut self.texts[index];
        let mut piece = t.stream.push(id)?;
        if let Some(th) = t.thinking.as_mut() {
            piece = th.push(&piece);
        }
        let release = t.stops.push(&piece);
        t.text.push_str(&release.text);
        if release.stopped {
            t.stopped = true;
            return Ok(Flow::Stop(StopReason::Stop));
        }
        Ok(Flow::Continue)
    }

    fn on_done(&mut self, index: usize, o: SeqOutcome) -> Result<()> {
        let t = &mut self.texts[index];
        let mut rest = t.stream.finish();
        if let Some(th) = t.thinking.as_mut() {
            rest = th.finish_with(&rest);
        }
        if !t.stopped {
            let release = t.stops.push(&rest);
            t.text.push_str(&release.text);
            t.text.push_str(&t.stops.finish());
        }
        let p = &self.ran[index];
        let mut complete = None;
        if let (Some(spec), Some(stats)) = (&p.constraint, o.mask) {
            self.masks.push((spec.kind(), stats));
            complete = Some(!super::warn_incomplete(o.stop, Some(p.entry.line)));
        }
        let ms = |d: Duration| (d.as_secs_f64() * 1e5).round() / 100.0;
        let calls = self
            .tool_format
            .map(|f| crate::tool_calls::parse(f, &t.text));
        let line = Line {
            index: p.index,
            id: &p.entry.id,
            line: p.entry.line,
            choice: (p.entry.n.unwrap_or(1) > 1).then_some(p.entry.choice),
            text: Some(&t.text),
            error: o.error.as_deref(),
            prompt_tokens: Some(o.prompt_tokens),
            cached_tokens: Some(o.cached_tokens),
            tokens: Some(o.tokens.len()),
            stop: Some(o.stop.as_str()),
            passes: Some(o.passes),
            ttft_ms: Some(ms(o.time_to_first_token)),
            wait_ms: Some(ms(o.wait)),
            seed: (!p.sampling.is_greedy()).then_some(p.sampling.seed),
            complete,
            chat: p.entry.chat,
            reasoning: t.thinking.as_ref().map(|th| th.text.as_str()),
            reasoning_tokens: t.thinking.as_ref().map(|th| th.tokens),
            tool_calls: calls.as_ref().map(|p| p.openai_calls(0)),
            content: calls.map(|p| p.content),
            logprobs: (self.logprobs || p.entry.logprobs.is_some())
                .then(|| crate::logprobs::Logprobs::new(&o.logprobs, &o.tokens, self.tokenizer)),
            scores: p.score.map(|(from, _)| {
                crate::logprobs::PromptScores::new(
                    &o.prompt_logprobs,
                    from,
                    p.entry.continuation.as_ref().map(|_| p.prompt_len),
                    &p.ids,
                    self.tokenizer,
                )
            }),
        };
        let json = self.out.shape.render(&line)?;
        t.text = String::new();
        if let Some(e) = &o.error {
            self.out.failed += 1;
            if !self.quiet {
                eprintln!("gen: prompt {} (line {}: {e})", p.index + 1, p.entry.line);
            }
        }
        self.out.put(p.index, json)?;
        if let Some(bar) = self.progress {
            bar.set_position(self.out.written as u64);
            let s = self.started.elapsed().as_secs_f64();
            if s > 0.0 {
                bar.set_message(format!("{:.1} tok/s", self.tokens as f64 / s));
            }
        }
        Ok(())
    }

    fn forced(&mut self, index: usize) -> Vec<u32> {
        self.texts[index]
            .thinking
            .as_mut()
            .map_or_else(Vec::new, super::thinking::Thinking::forced)
    }

    fn gate(&self, index: usize) -> crate::sampler::Gate {
        self.texts[index]
            .thinking
            .as_ref()
            .map_or(crate::sampler::Gate::Apply, super::thinking::Thinking::gate)
    }

    fn cancelled(&self) -> Option<StopReason> {
        if self.out.closed {
            return Some(StopReason::OutputClosed);
        }
        interrupt::requested().then_some(StopReason::Interrupted)
    }
}
