//! The generation loop: one prefill pass over the prompt, then one forward pass per new token.
//!
//! The loop knows nothing of text: a `TokenSink` receives each sampled id (and turns it into
//! text, matches stop strings, watches for Ctrl-C). Every forward pass is counted: a prompt costs
//! one pass whatever its length; a reply of N tokens ending at EOS costs N + 1 passes (the last
//! pass produced the EOS), one cut by `max_new = N` costs N.
//!
//! With speculation (`generate_with`, `--speculate lookup`) a decode pass may check several
//! tokens: it feeds the last sampled token and up to K proposals (see `speculate`), and gets one
//! row of logits per token. Row 0 is sampled as usual; while the token sampled from row i is the
//! proposal fed after it, row i + 1 is valid too and is sampled next, with no pass in between.
//! So one pass yields from 1 to K + 1 tokens, and N tokens may cost fewer than N passes.
//!
//! Each row is sampled exactly as a one-token pass's logits would be (on gen's CPU kernels the
//! rows are bit for bit those logits), with the same sampler, the same history (the accepted
//! tokens before it included) and the same random draw a plain run would use for that token.
//! Keeping a proposal exactly when the sampled token equals it is speculative sampling with a
//! draft that proposes one token for certain: the proposal is kept with the probability the
//! model gives it, and otherwise the token comes from the model's distribution with the
//! proposal removed, renormalised (the draw, conditioned on missing the proposal). The reply is
//! therefore the model's own: greedy, token for token the plain run's; sampled with a seed,
//! also token for token the plain run's, since each token consumes the same draw. Every token
//! goes through the same stop checks as without speculation, in the same order; a stop in the
//! middle of a pass's rows drops the rest.

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::model::{LanguageModel, SeqStep};
use crate::sampler::{Rows, Sampler, TokenLogprob};
use crate::speculate::{DraftStats, Drafter};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-sequence (or end-of-turn) token.
    Eos,
    /// `max_new` tokens were generated.
    MaxNew,
    /// A stop string appeared in the text.
    Stop,
    /// The reply is complete by its grammar (--json, --json-schema, --grammar, --regex):
    /// nothing may follow.
    Grammar,
    /// The context window is full.
    ContextFull,
    /// The user pressed Ctrl-C.
    Interrupted,
    /// Whoever reads our stdout closed it (e.g. `| head`).
    OutputClosed,
    /// Sampling failed for this sequence (its grammar engine hit a limit): in a batch, that
    /// reply ends with an error while the others go on.
    Failed,
    /// A batch line that only scores a continuation: nothing was generated.
    Scored,
}

impl StopReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxNew => "max-new",
            StopReason::Stop => "stop",
            StopReason::Grammar => "grammar",
            StopReason::ContextFull => "context-full",
            StopReason::Interrupted => "interrupted",
            StopReason::OutputClosed => "output-closed",
            StopReason::Failed => "error",
            StopReason::Scored => "scored",
        }
    }
}

/// What the sink wants after seeing a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop(StopReason),
}

/// Receives tokens as they are sampled.
pub trait TokenSink {
    fn on_token(&mut self, id: u32) -> Result<Flow>;

    /// Asked before each forward pass: Some(reason) ends generation before that pass.
    fn cancelled(&self) -> Option<StopReason> {
        None
    }

    /// Tokens the reply must go on with now, fed to the model as if sampled (the end marker of
    /// a thinking block whose budget is spent); asked after each token.
    fn forced(&mut self) -> Vec<u32> {
        Vec::new()
    }

    /// How a grammar (if any) applies to the next token: paused while the model thinks.
    fn gate(&self) -> Gate {
        Gate::Apply
    }
}

pub use crate::sampler::Gate;

/// Limits of one generation.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most tokens to generate (at least 1).
    pub max_new: usize,
    /// Tokens the sequence may hold in all (prompt plus reply): the context window. Reaching it
    /// ends generation with `ContextFull`.
    pub context_len: usize,
}

impl Limits {
    /// Tokens a sequence with a prompt of `prompt_len` tokens may come to hold: its room in
    /// the KV cache.
    pub fn capacity(&self, prompt_len: usize) -> usize {
        (prompt_len + self.max_new).min(self.context_len)
    }
}

/// The outcome of one generation: what was generated and what it cost.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_tokens: usize,
    /// Of the prompt's tokens, how many came from the prefix cache (a conversation's earlier
    /// turns, an earlier prompt, a prompt-cache file): the prefill pass ran over the others.
    pub reused_tokens: usize,
    /// Generated ids, EOS excluded.
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub forward_passes: usize,
    /// From the start of the prefill pass to the first sampled token.
    pub time_to_first_token: Duration,
    /// From the first sampled token to the end.
    pub decode_time: Duration,
    /// Tokens sampled in all (the reply, the EOS that ended it if one did).
    pub sampled: usize,
    /// With speculation: the most proposals per pass, and what was proposed and kept.
    pub speculation: Option<(usize, DraftStats)>,
    /// With `--logprobs`: one entry per token of `tokens`, None for a token the loop forced
    /// (a thinking block's end marker when its budget ran out) rather than sampled.
    pub logprobs: Vec<Option<TokenLogprob>>,
    /// With `--prompt-logprobs`: one entry per prompt token after the first.
    pub prompt_logprobs: Vec<TokenLogprob>,
}

impl Generation {
    /// Passes after prefill: each one sampled one token or, with speculation, several.
    pub fn decode_passes(&self) -> usize {
        self.forward_passes.saturating_sub(1)
    }

    /// Tokens the decode passes sampled (all but the prefill's).
    pub fn decode_tokens(&self) -> usize {
        self.sampled.saturating_sub(1)
    }
}

/// A prompt generation can start from: not empty, with room for a reply in the window.
fn check_fits(prompt: &[u32], limits: &Limits) -> Result<()> {
    anyhow::ensure!(!prompt.is_empty(), "the prompt has no tokens");
    anyhow::ensure!(limits.max_new > 0, "max-new must be at least 1");
    anyhow::ensure!(
        prompt.len() < limits.context_len,
        "the prompt ({} tokens) does not fit the context window ({} tokens) with room for a reply",
        prompt.len(),
        limits.context_len
    );
    Ok(())
}

/// Generate a reply to `prompt` (token ids, not empty) on a sequence of its own. Whatever
/// beginning of the prompt the model's prefix cache holds (an earlier prompt's, a conversation's
/// earlier turns, a prompt-cache file's) is taken from there and the prefill pass runs over the
/// rest; the prompt's full blocks are published for later prompts. The sequence ends with the
/// call; its published blocks stay in the cache.
pub fn generate(
    model: &mut dyn LanguageModel,
    prompt: &[u32],
    sampler: &mut Sampler,
    eos: &[u32],
    limits: &Limits,
    sink: &mut dyn TokenSink,
) -> Result<Generation> {
    generate_with(model, prompt, sampler, eos, limits, None, sink)
}

/// `generate`, with lookup speculation proposing up to `draft_max` tokens per pass when Some
/// (see the module's documentation): the same reply, in fewer passes when it copies.
pub fn generate_with(
    model: &mut dyn LanguageModel,
    prompt: &[u32],
    sampler: &mut Sampler,
    eos: &[u32],
    limits: &Limits,
    draft_max: Option<usize>,
    sink: &mut dyn TokenSink,
) -> Result<Generation> {
    check_fits(prompt, limits)?;
    let capacity = limits.capacity(prompt.len());
    // A pool with room for this sequence at least, its blocks taken up front.
    model.reserve_pool(crate::model::kv_cache::blocks_for(capacity))?;
    let seq = model.new_sequence();
    // A scored prompt is computed whole: every token's row is needed.
    let reused = match sampler.prompt_logprobs() {
        Some(_) => 0,
        None => model.attach_prefix(seq, prompt),
    };
    if !model.reserve(seq, capacity) {
        model.free_sequence(seq);
        anyhow::bail!("the KV cache has no room for {capacity} tokens");
    }
    let mut run = Run {
        model,
        seq,
        sampler,
        eos,
        limits,
        sink,
        drafter: draft_max.map(Drafter::new),
    };
    let result = run.run(prompt, reused);
    run.model.free_sequence(seq);
    result
}

/// One generation in progress.
struct Run<'a> {
    model: &'a mut dyn LanguageModel,
    seq: usize,
    sampler: &'a mut Sampler,
    eos: &'a [u32],
    limits: &'a Limits,
    sink: &'a mut dyn TokenSink,
    drafter: Option<Drafter>,
}

/// The rows of the last decode pass: `fed` its tokens (the token sampled before it, then the
/// proposals), `used` the rows sampled so far.
struct Pass {
    rows: Rows,
    fed: Vec<u32>,
    used: usize,
}

impl Run<'_> {
    fn run(&mut self, prompt: &[u32], cached: usize) -> Result<Generation> {
        let (seq, limits) = (self.seq, self.limits);
        let mut history = prompt.to_vec(); // prompt, then the reply: what repetition penalty sees
        let mut gen = Generation {
            prompt_tokens: prompt.len(),
            reused_tokens: cached,
            tokens: Vec::with_capacity(limits.max_new),
            stop: StopReason::MaxNew,
            forward_passes: 0,
            time_to_first_token: Duration::ZERO,
            decode_time: Duration::ZERO,
            sampled: 0,
            speculation: None,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
        };
        if let Some(reason) = self.sink.cancelled() {
            gen.stop = reason;
            return Ok(gen);
        }

        // Prefill: one pass over the whole prompt (what the cache does not hold of it) gives
        // the first token.
        let start = Instant::now();
        let logits = match self.sampler.prompt_logprobs() {
            Some(n) => {
                let rows = self.model.forward(&[SeqStep::score(seq, prompt, 0)])?;
                gen.prompt_logprobs = score_rows(&rows, &prompt[1..], n)?;
                rows.get(prompt.len() - 1)?
            }
            None => self
                .model
                .forward(&[SeqStep::prefill(seq, &prompt[cached..], cached)])?,
        };
        gen.forward_passes += 1;
        self.model.publish(seq, prompt);
        self.sampler.set_gate(self.sink.gate());
        let mut next = self.sampler.sample(&logits, &history)?;
        gen.sampled += 1;
        gen.time_to_first_token = start.elapsed();
        let decode_start = Instant::now();
        let mut pass: Option<Pass> = None;

        // Decode: each sampled token goes through every stop check, then is fed back at the
        // next position; a pass that checked proposals may already hold the next token's row.
        gen.stop = loop {
            if let Some(reason) = self.emit(next, &mut gen, &mut history)? {
                break reason;
            }
            let forced = self.sink.forced();
            if !forced.is_empty() {
                if let Some(p) = pass.take() {
                    self.record(&p);
                }
                match self.force(next, &forced, &mut gen, &mut history)? {
                    Ok(n) => {
                        next = n;
                        continue;
                    }
                    Err(reason) => break reason,
                }
            }
            self.sampler.set_gate(self.sink.gate());
            if let Some(p) = pass.as_mut() {
                if p.used < p.fed.len() && p.fed[p.used] == next {
                    // The proposal fed after the last row is the token sampled from it: the
                    // next row holds the logits a pass over it would give.
                    next = p.rows.sample(p.used, self.sampler, &history)?;
                    p.used += 1;
                    gen.sampled += 1;
                    continue;
                }
                self.record(p);
            }
            let mut p = self.decode(next, &history, &mut gen)?;
            next = p.rows.sample(0, self.sampler, &history)?;
            gen.sampled += 1;
            pass = Some(Pass { used: 1, ..p });
        };
        if let Some(p) = &pass {
            self.record(p);
        }
        gen.decode_time = decode_start.elapsed();
        gen.speculation = self.drafter.as_ref().map(|d| (d.max(), d.stats));
        Ok(gen)
    }

    /// The checks every sampled token goes through, in order: EOS, then (kept and sent to the
    /// sink) the sink's verdict, the grammar, max_new, the context window, Ctrl-C. Some(reason)
    /// ends the reply.
    fn emit(
        &mut self,
        next: u32,
        gen: &mut Generation,
        history: &mut Vec<u32>,
    ) -> Result<Option<StopReason>> {
        let logprob = self.sampler.take_logprob();
        if self.eos.contains(&next) {
            return Ok(Some(StopReason::Eos));
        }
        gen.tokens.push(next);
        if self.sampler.records_logprobs() {
            gen.logprobs.push(logprob);
        }
        history.push(next);
        if let Flow::Stop(reason) = self.sink.on_token(next)? {
            return Ok(Some(reason));
        }
        if self.sampler.grammar_complete() {
            return Ok(Some(StopReason::Grammar));
        }
        if gen.tokens.len() >= self.limits.max_new {
            return Ok(Some(StopReason::MaxNew));
        }
        if gen.prompt_tokens + gen.tokens.len() >= self.limits.context_len {
            return Ok(Some(StopReason::ContextFull));
        }
        Ok(self.sink.cancelled())
    }

    /// One decode pass feeding `next` (the last token of `history`) and whatever the drafter
    /// proposes after it. The proposals stop where their last row could not be used: at
    /// max_new tokens or a full context window.
    fn decode(&mut self, next: u32, history: &[u32], gen: &mut Generation) -> Result<Pass> {
        let pos = history.len() - 1;
        // Rows of rejected proposals of the last pass: forgotten, to be overwritten.
        if self.model.kv().len(self.seq) != Some(pos) {
            self.model.truncate(self.seq, pos);
        }
        let mut fed = vec![next];
        if let Some(d) = self.drafter.as_mut() {
            let room = (self.limits.max_new.saturating_sub(gen.tokens.len()))
                .min(self.limits.context_len.saturating_sub(history.len()))
                .saturating_sub(1);
            fed.extend(d.propose(history, room));
        }
        let logits = self
            .model
            .forward(&[SeqStep::decode(self.seq, &fed, pos)])?;
        gen.forward_passes += 1;
        let rows = Rows::new(&logits, self.sampler)?;
        Ok(Pass { rows, fed, used: 0 })
    }

    /// One decode pass feeding `next` (the last token of `history`) and then `forced`, each
    /// forced token going through [`Self::emit`] as if sampled; the token after them is sampled
    /// from the last row. Ok(next token) or Err(why the reply ended).
    fn force(
        &mut self,
        next: u32,
        forced: &[u32],
        gen: &mut Generation,
        history: &mut Vec<u32>,
    ) -> Result<std::result::Result<u32, StopReason>> {
        let pos = history.len() - 1;
        if self.model.kv().len(self.seq) != Some(pos) {
            self.model.truncate(self.seq, pos);
        }
        // No further than max_new and the context window allow: the last row fed is sampled.
        let room = (self.limits.max_new.saturating_sub(gen.tokens.len()))
            .min(self.limits.context_len.saturating_sub(history.len()));
        let mut fed = vec![next];
        fed.extend(forced.iter().take(room));
        let logits = self
            .model
            .forward(&[SeqStep::decode(self.seq, &fed, pos)])?;
        gen.forward_passes += 1;
        for &t in &fed[1..] {
            if let Some(reason) = self.emit(t, gen, history)? {
                return Ok(Err(reason));
            }
        }
        self.sampler.set_gate(self.sink.gate());
        let mut rows = Rows::new(&logits, self.sampler)?;
        let n = rows.sample(fed.len() - 1, self.sampler, history)?;
        gen.sampled += 1;
        Ok(Ok(n))
    }

    /// Tell the drafter how the pass's proposals went: rows used beyond the first were kept.
    fn record(&mut self, p: &Pass) {
        if let Some(d) = self.drafter.as_mut() {
            d.record(p.fed.len() - 1, p.used - 1);
        }
    }
}

/// The log-probabilities of `next` under the rows of `logits` (row i for `next[i]`), with `n`
/// alternatives each; rows past `next` are not used.
pub fn score_rows(
    logits: &candle_core::Tensor,
    next: &[u32],
    n: usize,
) -> Result<Vec<TokenLogprob>> {
    let rows = logits.narrow(0, 0, next.len())?;
    let rows = rows.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(next)
        .map(|(row, &id)| TokenLogprob::of(row, id, n))
        .collect())
}
