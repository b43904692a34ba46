//! A stand-in model for the loop tests: deterministic, instant, and it records every pass.

use anyhow::Result;
use candle_core::{Device, Tensor};
use gen::generate::{Flow, StopReason, TokenSink};
use gen::model::{check_batch, LanguageModel, ModelInfo, PagedKv, SeqStep};

pub const VOCAB: usize = 64;
pub const EOS: u32 = 0;

/// Predicts `len + 1` while the sequence is shorter than `eos_at`, then EOS (0), for every row
/// (`len`: the sequence's length through that row's token). Keeps real block tables, so the
/// loops' reservations are checked like a real model's.
pub struct Counting {
    pub info: ModelInfo,
    pub eos_at: usize,
    kv: PagedKv,
    /// Every pass: (sequence, pos, tokens) of each of its steps.
    pub passes: Vec<Vec<(usize, usize, usize)>>,
}

impl Counting {
    pub fn new(eos_at: usize, context_len: usize) -> Self {
        let info = ModelInfo {
            arch: "test".into(),
            name: "counting".into(),
            context_len,
            vocab_size: VOCAB,
        };
        Self {
            info,
            eos_at,
            kv: PagedKv::new(0),
            passes: Vec::new(),
        }
    }

    /// (pos, tokens) of every step, in order.
    pub fn steps(&self) -> Vec<(usize, usize)> {
        self.passes
            .iter()
            .flatten()
            .map(|&(_, pos, t)| (pos, t))
            .collect()
    }
}

impl LanguageModel for Counting {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn kv(&self) -> &PagedKv {
        &self.kv
    }
    fn kv_mut(&mut self) -> &mut PagedKv {
        &mut self.kv
    }
    fn reserve_pool(&mut self, blocks: usize) -> Result<()> {
        if self.kv.usage().blocks_total < blocks {
            assert!(self.kv.is_idle(), "the pool grows only while idle");
            self.kv = PagedKv::new(blocks);
        }
        Ok(())
    }
    fn kv_bytes_per_token(&self) -> usize {
        8
    }
    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        check_batch(&self.kv, batch, self.info.context_len)?;
        let mut rows = Vec::new();
        let mut pass = Vec::new();
        for step in batch {
            self.kv.advance(step.seq, step.tokens.len());
            pass.push((step.seq, step.pos, step.tokens.len()));
            // One row per token of a decode step (a sequence of that token's length), the last
            // token's for a prompt chunk.
            let end = step.pos + step.tokens.len();
            for len in (end + 1 - step.logit_rows())..=end {
                let next = if len < self.eos_at {
                    len + 1
                } else {
                    EOS as usize
                };
                let mut row = vec![0f32; VOCAB];
                row[next % VOCAB] = 1.0;
                rows.extend(row);
            }
        }
        self.passes.push(pass);
        let n = rows.len() / VOCAB;
        Ok(Tensor::from_vec(rows, (n, VOCAB), &Device::Cpu)?)
    }
}

/// A token sink for the loop tests: records what it saw, and asks for a stop (a stop string)
/// or a cancel (Ctrl-C) after so many tokens.
#[derive(Default)]
pub struct Collect {
    pub seen: Vec<u32>,
    pub stop_after: Option<usize>,
    pub cancel_after: Option<usize>,
}

impl TokenSink for Collect {
    fn on_token(&mut self, id: u32) -> Result<Flow> {
        self.seen.push(id);
        Ok(match self.stop_after {
            Some(n) if self.seen.len() >= n => Flow::Stop(StopReason::Stop),
            _ => Flow::Continue,
        })
    }
    fn cancelled(&self) -> Option<StopReason> {
        match self.cancel_after {
            Some(n) if self.seen.len() >= n => Some(StopReason::Interrupted),
            _ => None,
        }
    }
}
