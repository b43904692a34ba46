//! Continuous batching: many prompts, each generated as by `generate`, with the steps of up to
//! `batch_size` sequences run in the same forward pass.
//!
//! Each pass: admit waiting prompts while there is a free slot and room in the KV cache pool
//! (their prefill joins the pass), give every running sequence room for its next token
//! (preempting the youngest when the pool is short), run one pass over all the steps, sample
//! one token per sequence. A sequence that ends frees its slot and blocks at once, so the next
//! prompt starts at the next pass, not when the whole wave is done.
//!
//! With speculation (`BatchOptions::speculate`) each running sequence's decode step may carry
//! proposals from its own drafter, checked in the same pass as the other steps; the step gets
//! one row of logits per token, sampled in order as `generate` does (see there).
//!
//! Results do not depend on the batch: a step's logits are computed as if it ran alone (see
//! `model`), and each prompt has its own sampler. A preempted sequence loses its cache and is
//! resumed later with two passes: a prefill over its prompt (what the prefix cache does not
//! hold of it), then one decode step over its reply so far, whose tokens are computed as when
//! they were generated; nothing it generated is lost, and its reply goes on as it would have.
//!
//! Prompts that begin alike share KV blocks through the prefix cache (`model::kv_cache`): a
//! prompt starts from the blocks of its beginning that earlier prompts published, and one that
//! would share more with a prompt starting in the same pass waits one pass for its blocks.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::DType;

use crate::generate::{Flow, StopReason};
use crate::model::kv_cache::blocks_for;
use crate::model::{LanguageModel, SeqId, SeqStep};
use crate::sampler::Sampler;
use crate::speculate::{DraftStats, Drafter};

/// One prompt of a batch.
pub struct Request {
    pub prompt: Vec<u32>,
    /// Tokens to generate; 0 (with `score_from`) scores the prompt and generates nothing.
    pub max_new: usize,
    pub sampler: Sampler,
    /// Score the prompt's tokens from this position on (1: all but the first; the length of
    /// a line's own prompt: its continuation), each given those before it, with
    /// `sampler.prompt_logprobs()` alternatives. The tokens before it may come from the prefix
    /// cache; the rows from there on are computed as a prompt chunk, so the scores are what a
    /// prompt ending at each token would give.
    pub score_from: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct BatchOptions {
    /// Most sequences in one pass.
    pub batch_size: usize,
    /// Tokens a sequence may hold (prompt plus reply); reaching it ends with `ContextFull`.
    pub context_len: usize,
    /// Blocks of the KV cache pool.
    pub pool_blocks: usize,
    /// Token ids that end a reply (empty: never).
    pub eos: Vec<u32>,
    /// Share prompt beginnings through the prefix cache (see `model::kv_cache`).
    pub prefix_cache: bool,
    /// Lookup speculation: the most tokens proposed per sequence and pass (None: off).
    pub speculate: Option<usize>,
}

/// How one prompt's generation went.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub prompt_tokens: usize,
    /// Of its prompt's tokens, how many came from the prefix cache when it started.
    pub cached_tokens: usize,
    /// Generated ids, EOS excluded.
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// Forward passes this sequence took part in.
    pub passes: usize,
    /// From the start of the pass with its prefill to its first token.
    pub time_to_first_token: Duration,
    /// From the start of the batch to the start of that pass.
    pub wait: Duration,
    /// Times it was preempted for lack of KV cache blocks.
    pub preempted: usize,
    /// What its grammar cost, if it had one.
    pub mask: Option<crate::constraint::MaskStats>,
    /// Why sampling failed, with stop `Failed` (its grammar engine hit a limit).
    pub error: Option<String>,
    /// What its drafter proposed and what was kept (zeros without speculation).
    pub drafts: DraftStats,
    /// With `--logprobs`: one entry per token of `tokens` (None: forced, not sampled).
    pub logprobs: Vec<Option<crate::sampler::TokenLogprob>>,
    /// With `score_from`: one entry per prompt token from there on.
    pub prompt_logprobs: Vec<crate::sampler::TokenLogprob>,
}

/// Receives tokens and finished sequences; `index` is the request's position.
pub trait BatchSink {
    fn on_token(&mut self, index: usize, id: u32) -> Result<Flow>;
    fn on_done(&mut self, index: usize, outcome: Outcome) -> Result<()>;

    /// Tokens sequence `index` must go on with now, fed as if sampled (the end marker of a
    /// thinking block whose budget is spent); asked after each of its tokens.
    fn forced(&mut self, _index: usize) -> Vec<u32> {
        Vec::new()
    }

    /// How sequence `index`'s grammar (if any) applies to its next token: paused while it
    /// thinks.
    fn gate(&self, _index: usize) -> crate::sampler::Gate {
        crate::sampler::Gate::Apply
    }
    /// Asked before each pass: Some(reason) ends every sequence.
    fn cancelled(&self) -> Option<StopReason> {
        None
    }
}

/// What the whole batch cost.
#[derive(Debug, Clone, Default)]
pub struct BatchStats {
    pub forward_passes: usize,
    /// Passes the prompts would have taken one at a time (the sum of each one's passes).
    pub solo_passes: usize,
    pub generated_tokens: usize,
    pub prompt_tokens: usize,
    /// Of the prompt tokens, how many came from the prefix cache.
    pub cached_tokens: usize,
    pub preemptions: usize,
    pub blocks_total: usize,
    pub blocks_peak: usize,
    /// All blocks were back in the pool at the end.
    pub blocks_returned: bool,
    pub elapsed: Duration,
    /// Tokens sampled by the passes (EOS included): with speculation, more than the passes
    /// each sequence took part in.
    pub sampled_tokens: usize,
    /// What the drafters proposed and what was kept, all sequences together.
    pub drafts: DraftStats,
}

struct Seq {
    index: usize,
    /// Prompt, then the reply so far.
    history: Vec<u32>,
    prompt_len: usize,
    max_new: usize,
    sampler: Sampler,
    /// Its KV cache while running, with how many of `history`'s tokens it holds.
    slot: Option<SeqId>,
    cached: usize,
    /// What its next step computes.
    phase: Phase,
    /// Prompt tokens the prefix cache gave it when it first started.
    reused: Option<usize>,
    passes: usize,
    preempted: usize,
    wait: Option<Duration>,
    ttft: Option<Duration>,
    error: Option<String>,
    drafter: Option<Drafter>,
    /// Proposals fed after its next token in this pass.
    proposals: Vec<u32>,
    /// Tokens forced after its last sampled one in this pass (see [`BatchSink::forced`]):
    /// the next pass feeds them, as a resumed reply is fed.
    forced: usize,
    /// Its reply's log-probabilities (with `--logprobs`).
    logprobs: Vec<Option<crate::sampler::TokenLogprob>>,
    /// Where its prompt's scores start (see [`Request::score_from`]), and the scores once its
    /// prompt pass computed them.
    score_from: Option<usize>,
    prompt_logprobs: Option<Vec<crate::sampler::TokenLogprob>>,
}

/// Where a running sequence is. Its prompt's tokens are computed by a prefill step and its
/// reply's by decode steps, always, so a reply does not depend on the batch, the prefix
/// cache or a preemption (see `model::StepKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Its prompt, after what the prefix cache gave it.
    Prompt,
    /// Resumed after a preemption: its reply so far, as one decode step of several tokens
    /// (each computed as when it was generated); the last one's logits give the next token.
    Reply,
    /// Its last token, and any proposals after it.
    Decode,
}

impl Seq {
    /// What it feeds the next pass.
    fn fed(&self) -> Vec<u32> {
        match self.phase {
            Phase::Prompt => self.history[self.cached..self.prompt_len].to_vec(),
            Phase::Reply | Phase::Decode => {
                [&self.history[self.cached..], &self.proposals[..]].concat()
            }
        }
    }

    /// Whether its prompt pass is to score the prompt (once: not again after a preemption).
    fn scoring(&self) -> bool {
        self.phase == Phase::Prompt && self.score_from.is_some() && self.prompt_logprobs.is_none()
    }

    /// The part of its prompt the prefix cache may give it: all of it, or what comes before
    /// the first token scored (whose row must be computed).
    fn reusable(&self) -> &[u32] {
        let end = match self.prompt_logprobs {
            None => self.score_from.unwrap_or(self.prompt_len),
            Some(_) => self.prompt_len,
        };
        &self.history[..end.min(self.prompt_len)]
    }

    /// Its step of the next pass, feeding `tokens` (from [`Seq::fed`]).
    fn step<'t>(&self, tokens: &'t [u32]) -> SeqStep<'t> {
        let seq = self.slot.expect("running");
        match self.phase {
            Phase::Prompt if self.scoring() => SeqStep::score(seq, tokens, self.cached),
            Phase::Prompt => SeqStep::prefill(seq, tokens, self.cached),
            Phase::Reply | Phase::Decode => SeqStep::decode(seq, tokens, self.cached),
        }
    }

    fn outcome(self, stop: StopReason) -> Outcome {
        Outcome {
            prompt_tokens: self.prompt_len,
            cached_tokens: self.reused.unwrap_or(0),
            tokens: self.history[self.prompt_len..].to_vec(),
            stop,
            passes: self.passes,
            time_to_first_token: self.ttft.unwrap_or_default(),
            wait: self.wait.unwrap_or_default(),
            preempted: self.preempted,
            mask: self.sampler.constraint().map(|c| c.stats()),
            error: self.error,
            drafts: self.drafter.map(|d| d.stats).unwrap_or_default(),
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs.unwrap_or_default(),
        }
    }
}

/// Generate a reply to every request. Requests must have a non-empty prompt shorter than
/// `context_len` and `max_new >= 1`.
pub fn run(
    model: &mut dyn LanguageModel,
    requests: Vec<Request>,
    opts: &BatchOptions,
    sink: &mut dyn BatchSink,
) -> Result<BatchStats> {
    check_requests(&requests, opts)?;
    model.reserve_pool(opts.pool_blocks)?;
    model.kv_mut().set_prefix_cache(opts.prefix_cache);
    let start = Instant::now();
    let mut stats = BatchStats {
        blocks_total: model.kv_usage().blocks_total,
        ..Default::default()
    };
    let mut waiting: VecDeque<Seq> = requests
        .into_iter()
        .enumerate()
        .map(|(index, r)| Seq::new(index, r, opts))
        .collect();
    let mut running: Vec<Seq> = Vec::with_capacity(opts.batch_size);
    let mut halt: Option<StopReason> = None;

    loop {
        if let Some(reason) = sink.cancelled() {
            halt = Some(reason);
        }
        if halt.is_some() {
            break;
        }
        admit(model, &mut waiting, &mut running, opts)?;
        if running.is_empty() {
            break;
        }
        for s in running.iter_mut() {
            s.proposals = propose(s, opts.context_len);
        }
        make_room(model, &mut waiting, &mut running, &mut stats);

        let fed: Vec<Vec<u32>> = running.iter().map(Seq::fed).collect();
        let steps: Vec<SeqStep<'_>> = running
            .iter()
            .zip(&fed)
            .map(|(s, tokens)| s.step(tokens))
            .collect();
        let pass_start = Instant::now();
        let logits = model.forward(&steps)?;
        stats.forward_passes += 1;

        // Two transfers from the device at most, whatever the batch size: the argmax of every
        // row for the greedy sequences, the logits themselves for the others.
        let argmax = if running.iter().any(|s| s.sampler.is_plain_argmax()) {
            crate::model::cpu::ops::argmax_rows(&logits)?
        } else {
            Vec::new()
        };
        let mut rows = if running
            .iter()
            .all(|s| s.sampler.is_plain_argmax() && !s.scoring())
        {
            Vec::new()
        } else {
            logits.to_dtype(DType::F32)?.to_vec2::<f32>()?
        };
        let mut ended = Vec::new();
        let mut at = 0;
        for (i, s) in running.iter_mut().enumerate() {
            // Its rows: the prompt chunk's last token, or its next token and each proposal
            // (a resumed reply: its last token's only).
            let n = steps[i].logit_rows();
            let scored = s.scoring();
            if scored {
                s.prompt_logprobs = Some(score_prompt(s, &rows[at..at + n]));
            }
            let first = if s.phase == Phase::Reply || scored {
                n - 1
            } else {
                0
            };
            let range = at + first..at + n;
            at += n;
            s.passes += 1;
            let sampled = stats.sampled_tokens;
            if scored && s.max_new == 0 {
                let seq = s.slot.expect("running");
                model.publish(seq, &s.history[..s.prompt_len]);
                ended.push((i, StopReason::Scored));
                continue;
            }
            if s.phase == Phase::Prompt {
                // Its prefill computed these: later prompts may begin with them.
                let seq = s.slot.expect("running");
                model.publish(seq, &s.history[..s.prompt_len]);
                s.cached = s.prompt_len;
                if s.history.len() > s.prompt_len {
                    // Resumed: its next token is known; its reply goes back in next.
                    s.phase = Phase::Reply;
                    continue;
                }
            }
            s.phase = Phase::Decode;
            let rows = Pass {
                argmax: argmax.get(range.clone()).unwrap_or_default(),
                host: rows.get_mut(range).unwrap_or_default(),
            };
            let stop = take_tokens(s, rows, opts, &mut stats, sink)?;
            if s.ttft.is_none() && stats.sampled_tokens > sampled {
                s.wait = Some(pass_start - start);
                s.ttft = Some(pass_start.elapsed());
            }
            match stop {
                Some(StopReason::OutputClosed) => {
                    halt = Some(StopReason::OutputClosed);
                    ended.push((i, StopReason::OutputClosed));
                }
                Some(reason) => ended.push((i, reason)),
                None => {
                    // The cache holds every token but the last sampled (and those forced
                    // after it); rejected proposals' keys and values are forgotten, to be
                    // overwritten. Forced tokens go in with the last sampled one, as one step
                    // whose last row gives the next token.
                    s.cached = s.history.len() - 1 - s.forced;
                    if std::mem::take(&mut s.forced) > 0 {
                        s.phase = Phase::Reply;
                    }
                    let seq = s.slot.expect("running");
                    if model.kv().len(seq).is_some_and(|l| l > s.cached) {
                        model.truncate(seq, s.cached);
                    }
                }
            }
        }
        for (row, reason) in ended.into_iter().rev() {
            let s = running.remove(row);
            finish(model, s, reason, &mut stats, sink)?;
        }
    }

    // Whatever is left was cut short by Ctrl-C or a closed stdout.
    let reason = halt.unwrap_or(StopReason::Interrupted);
    for s in running.drain(..).chain(waiting.drain(..)) {
        finish(model, s, reason, &mut stats, sink)?;
    }
    let usage = model.kv_usage();
    stats.blocks_peak = usage.blocks_peak;
    stats.blocks_returned = usage.blocks_used == 0;
    stats.elapsed = start.elapsed();
    Ok(stats)
}

/// The scores of a sequence's prompt tokens from its `score_from` on, from the rows its
/// scoring step got (row i: the logits after its prompt token `cached + i`).
fn score_prompt(s: &Seq, rows: &[Vec<f32>]) -> Vec<crate::sampler::TokenLogprob> {
    let from = s.score_from.expect("a scoring sequence");
    debug_assert!(
        s.cached < from,
        "the row before the first scored token was computed"
    );
    let top = s.sampler.prompt_logprobs().unwrap_or(0);
    (from..s.prompt_len)
        .map(|p| crate::sampler::TokenLogprob::of(&rows[p - 1 - s.cached], s.history[p], top))
        .collect()
}

/// A pass's rows of one sequence: their argmax (greedy sequences) or the logits themselves.
struct Pass<'r> {
    argmax: &'r [u32],
    host: &'r mut [Vec<f32>],
}

/// What a running sequence's drafter proposes after its next token (none for a prefill step
/// or a resumed reply):
/// never more than its last row could use, at max_new or a full context window.
fn propose(s: &mut Seq, context_len: usize) -> Vec<u32> {
    let Some(d) = s.drafter.as_mut().filter(|_| s.phase == Phase::Decode) else {
        return Vec::new();
    };
    let generated = s.history.len() - s.prompt_len;
    let room = s
        .max_new
        .saturating_sub(generated)
        .min(context_len.saturating_sub(s.history.len()))
        .saturating_sub(1);
    d.propose(&s.history, room)
}

/// Sample a sequence's rows of the pass in order, each token through every stop check as
/// `generate` does: the next row is used while the token sampled is the proposal fed after
/// it. Some(reason) when the sequence ends.
fn take_tokens(
    s: &mut Seq,
    rows: Pass<'_>,
    opts: &BatchOptions,
    stats: &mut BatchStats,
    sink: &mut dyn BatchSink,
) -> Result<Option<StopReason>> {
    let mut used = 0;
    let stop = loop {
        s.sampler.set_gate(sink.gate(s.index));
        let next = if s.sampler.is_plain_argmax() {
            rows.argmax[used]
        } else {
            match s.sampler.sample_row(&mut rows.host[used], &s.history) {
                Ok(id) => id,
                // Only this reply fails; the others go on.
                Err(e) => {
                    s.error = Some(format!("{e:#}"));
                    break Some(StopReason::Failed);
                }
            }
        };
        used += 1;
        stats.sampled_tokens += 1;
        let logprob = s.sampler.take_logprob();
        if opts.eos.contains(&next) {
            break Some(StopReason::Eos);
        }
        s.history.push(next);
        if s.sampler.records_logprobs() {
            s.logprobs.push(logprob);
        }
        stats.generated_tokens += 1;
        match sink.on_token(s.index, next)? {
            Flow::Stop(reason) => break Some(reason),
            Flow::Continue if s.sampler.grammar_complete() => break Some(StopReason::Grammar),
            Flow::Continue if s.history.len() - s.prompt_len >= s.max_new => {
                break Some(StopReason::MaxNew)
            }
            Flow::Continue if s.history.len() >= opts.context_len => {
                break Some(StopReason::ContextFull)
            }
            Flow::Continue => {}
        }
        let forced = sink.forced(s.index);
        if !forced.is_empty() {
            if let Some(reason) = force(s, &forced, opts, stats, sink)? {
                break Some(reason);
            }
            break None;
        }
        if s.proposals.get(used - 1) != Some(&next) {
            break None;
        }
    };
    if let Some(d) = s.drafter.as_mut() {
        d.record(s.proposals.len(), used - 1);
    }
    s.proposals.clear();
    Ok(stop)
}

/// `forced` tokens after a sequence's last, each through the stop checks a sampled token
/// goes through; `s.forced` counts those taken. Some(reason) when the sequence ends.
fn force(
    s: &mut Seq,
    forced: &[u32],
    opts: &BatchOptions,
    stats: &mut BatchStats,
    sink: &mut dyn BatchSink,
) -> Result<Option<StopReason>> {
    for &t in forced {
        s.history.push(t);
        if s.sampler.records_logprobs() {
            s.logprobs.push(None);
        }
        s.forced += 1;
        stats.generated_tokens += 1;
        if let Flow::Stop(reason) = sink.on_token(s.index, t)? {
            return Ok(Some(reason));
        }
        if s.history.len() - s.prompt_len >= s.max_new {
            return Ok(Some(StopReason::MaxNew));
        }
        if s.history.len() >= opts.context_len {
            return Ok(Some(StopReason::ContextFull));
        }
    }
    Ok(None)
}

/// Start waiting sequences while a slot is free and the pool has room for their prefill and
/// one more token. The oldest waiting sequence goes first; none jumps the queue. A prompt
/// begins with what the prefix cache holds of it; one that would share more with a prompt
/// starting in this same pass (whose blocks are published after it) waits for the next pass.
fn admit(
    model: &mut dyn LanguageModel,
    waiting: &mut VecDeque<Seq>,
    running: &mut Vec<Seq>,
    opts: &BatchOptions,
) -> Result<()> {
    let first_new = running.len();
    while running.len() < opts.batch_size {
        let Some(s) = waiting.front() else { break };
        let need = s.history.len() + 1;
        let kv = model.kv();
        // Only its prompt: the blocks of its reply (after a preemption) hold what decode
        // steps computed, not what a prefill over them would.
        let found = kv.lookup(s.reusable());
        // Blocks it takes from what is free: new ones, and cached ones nobody holds.
        let taken =
            blocks_for(need) - found.len() + found.iter().filter(|&&b| kv.holders(b) == 0).count();
        if kv.prefix_cache() && running.len() > first_new {
            let later = running[first_new..]
                .iter()
                .map(|r| shared_blocks(&r.history[..r.prompt_len], s.reusable()))
                .max()
                .unwrap_or(0);
            if later > found.len() {
                break;
            }
        }
        if taken > kv.free_blocks() {
            if running.is_empty() {
                // Nothing will ever free more: this one can never run.
                let s = waiting.pop_front().expect("front exists");
                let usage = model.kv_usage();
                anyhow::bail!(
                    "prompt {} needs {} KV cache blocks, the pool has {}",
                    s.index + 1,
                    blocks_for(need),
                    usage.blocks_total
                );
            }
            break;
        }
        let mut s = waiting.pop_front().expect("front exists");
        let seq = model.new_sequence();
        // Where its blocks go: a run with room for the whole reply, if the pool has one.
        model.expect_tokens(seq, (s.prompt_len + s.max_new).min(opts.context_len));
        let reused = model.attach(seq, found);
        let ok = model.reserve(seq, s.history.len());
        debug_assert!(ok, "checked above");
        s.reused.get_or_insert(reused.min(s.prompt_len));
        s.slot = Some(seq);
        s.cached = reused;
        s.phase = Phase::Prompt;
        running.push(s);
    }
    Ok(())
}

impl Seq {
    /// A request, waiting to start.
    fn new(index: usize, r: Request, opts: &BatchOptions) -> Self {
        Seq {
            index,
            prompt_len: r.prompt.len(),
            history: r.prompt,
            max_new: r.max_new,
            sampler: r.sampler,
            slot: None,
            cached: 0,
            phase: Phase::Prompt,
            reused: None,
            passes: 0,
            preempted: 0,
            wait: None,
            ttft: None,
            error: None,
            drafter: opts.speculate.map(Drafter::new),
            proposals: Vec::new(),
            forced: 0,
            logprobs: Vec::new(),
            score_from: r.score_from,
            prompt_logprobs: None,
        }
    }
}

/// What `run` requires of its requests and options.
fn check_requests(requests: &[Request], opts: &BatchOptions) -> Result<()> {
    anyhow::ensure!(opts.batch_size > 0, "the batch size must be at least 1");
    for (i, r) in requests.iter().enumerate() {
        anyhow::ensure!(
            !r.prompt.is_empty()
                && r.prompt.len() < opts.context_len
                && (r.max_new > 0 || r.score_from.is_some()),
            "request {i} has an empty prompt, one that fills the context, or max-new 0"
        );
        if let Some(from) = r.score_from {
            anyhow::ensure!(
                (1..=r.prompt.len()).contains(&from),
                "request {i} scores from position {from} of {}",
                r.prompt.len()
            );
        }
    }
    Ok(())
}

/// Full blocks two token sequences begin with alike, as the prefix cache would share them
/// (at most (len - 1) / BLOCK_SIZE of `b`'s).
fn shared_blocks(a: &[u32], b: &[u32]) -> usize {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    common.min(b.len().saturating_sub(1)) / crate::model::kv_cache::BLOCK_SIZE
}

/// Give each running sequence blocks for the tokens it feeds this pass. When the pool is
/// short, the youngest running sequence gives its blocks back and waits at the head of the
/// queue (it may be the one that needed room).
fn make_room(
    model: &mut dyn LanguageModel,
    waiting: &mut VecDeque<Seq>,
    running: &mut Vec<Seq>,
    stats: &mut BatchStats,
) {
    let mut i = 0;
    while i < running.len() {
        let s = &running[i];
        if model.reserve(
            s.slot.expect("running"),
            s.history.len() + s.proposals.len(),
        ) {
            i += 1;
            continue;
        }
        let mut victim = running.pop().expect("not empty");
        model.free_sequence(victim.slot.take().expect("running"));
        victim.cached = 0;
        victim.proposals.clear();
        victim.preempted += 1;
        stats.preemptions += 1;
        waiting.push_front(victim);
    }
}

fn finish(
    model: &mut dyn LanguageModel,
    mut s: Seq,
    reason: StopReason,
    stats: &mut BatchStats,
    sink: &mut dyn BatchSink,
) -> Result<()> {
    if let Some(seq) = s.slot.take() {
        model.free_sequence(seq);
    }
    stats.solo_passes += s.passes;
    stats.prompt_tokens += s.prompt_len;
    stats.cached_tokens += s.reused.unwrap_or(0);
    if let Some(d) = &s.drafter {
        stats.drafts.add(&d.stats);
    }
    sink.on_done(s.index, s.outcome(reason))
}
