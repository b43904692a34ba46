//! The generation loop: one prefill pass over the prompt, then one forward pass per new token.
//!
//! The loop knows nothing of text: a `TokenSink` receives each sampled id (and turns it into
//! text, matches stop strings, watches for Ctrl-C). Every forward pass is counted: a prompt costs
//! one pass whatever its length; a reply of N tokens ending at EOS costs N + 1 passes (the last
//! pass produced the EOS), one cut by `max_new = N` costs N.

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::model::{LanguageModel, SeqStep};
use crate::sampler::Sampler;

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
}

/// Limits of one generation.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most tokens to generate (at least 1).
    pub max_new: usize,
    /// Tokens the sequence may hold in all (prompt plus reply): the context window. Reaching it
    /// ends generation with `ContextFull`.
    pub context_len: usize,
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
}

impl Generation {
    /// Passes after prefill: each one sampled one token (the last may have been EOS).
    pub fn decode_passes(&self) -> usize {
        self.forward_passes.saturating_sub(1)
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
    check_fits(prompt, limits)?;
    let capacity = (prompt.len() + limits.max_new).min(limits.context_len);
    // A pool with room for this sequence at least, its blocks taken up front.
    model.reserve_pool(crate::model::kv_cache::blocks_for(capacity))?;
    let seq = model.new_sequence();
    let reused = model.kv_mut().attach_prefix(seq, prompt);
    if !model.reserve(seq, capacity) {
        model.free_sequence(seq);
        anyhow::bail!("the KV cache has no room for {capacity} tokens");
    }
    let result = run_loop(model, seq, reused, prompt, sampler, eos, limits, sink);
    model.free_sequence(seq);
    result
}

#[allow(clippy::too_many_arguments)]
fn run_loop(
    model: &mut dyn LanguageModel,
    seq: usize,
    cached: usize,
    prompt: &[u32],
    sampler: &mut Sampler,
    eos: &[u32],
    limits: &Limits,
    sink: &mut dyn TokenSink,
) -> Result<Generation> {
    let mut history = prompt.to_vec(); // prompt, then the reply: what repetition penalty sees
    let mut gen = Generation {
        prompt_tokens: prompt.len(),
        reused_tokens: cached,
        tokens: Vec::with_capacity(limits.max_new),
        stop: StopReason::MaxNew,
        forward_passes: 0,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
    };
    if let Some(reason) = sink.cancelled() {
        gen.stop = reason;
        return Ok(gen);
    }

    // Prefill: one pass over the whole prompt (what the cache does not hold of it) gives the
    // first token.
    let start = Instant::now();
    let logits = model.forward(&[SeqStep::prefill(seq, &prompt[cached..], cached)])?;
    gen.forward_passes += 1;
    model.kv_mut().publish(seq, prompt);
    let mut next = sampler.sample(&logits, &history)?;
    gen.time_to_first_token = start.elapsed();
    let decode_start = Instant::now();
    let mut pos = prompt.len();

    // Decode: one pass per new token, fed back at the next position.
    gen.stop = loop {
        if eos.contains(&next) {
            break StopReason::Eos;
        }
        gen.tokens.push(next);
        history.push(next);
        if let Flow::Stop(reason) = sink.on_token(next)? {
            break reason;
        }
        if sampler.grammar_complete() {
            break StopReason::Grammar;
        }
        if gen.tokens.len() >= limits.max_new {
            break StopReason::MaxNew;
        }
        if prompt.len() + gen.tokens.len() >= limits.context_len {
            break StopReason::ContextFull;
        }
        if let Some(reason) = sink.cancelled() {
            break reason;
        }
        let logits = model.forward(&[SeqStep::decode(seq, &[next], pos)])?;
        gen.forward_passes += 1;
        pos += 1;
        next = sampler.sample(&logits, &history)?;
    };
    gen.decode_time = decode_start.elapsed();
    Ok(gen)
}
