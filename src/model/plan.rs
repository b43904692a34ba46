//! The plan of one forward pass: what every backend needs to know about a batch of steps,
//! whatever the device, worked out once before any layer runs. Plain data.
//!
//! N = tokens of all steps of the pass. Per token: its id, its position in its sequence, and
//! the cache slot its keys and values are written to. Per step: where its tokens start among
//! the N rows, its block table, and for each distinct sliding window of the model (one entry,
//! `None`, for layers that see the whole context) the first position its first query may see.

use std::ops::Range;

use super::kv_cache::{slot, PagedKv};
use super::{SeqStep, StepKind};

/// One step of the pass as the backends see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan<'a> {
    /// Its first token's row among the N.
    pub at: usize,
    /// Its first token's position in its sequence.
    pub pos: usize,
    /// Its tokens (T).
    pub len: usize,
    /// Its sequence's block table (token `p` is in block `blocks[p / BLOCK_SIZE]`).
    pub blocks: &'a [u32],
    /// Per window (as [`PassPlan::windows`]): the first position its first query may see.
    pub lo: Vec<usize>,
    pub kind: StepKind,
}

impl StepPlan<'_> {
    /// Positions in the cache after the step (its own tokens included).
    pub fn end(&self) -> usize {
        self.pos + self.len
    }

    /// The positions its queries may see under window `w`: from the first query's first
    /// visible key through its last token.
    pub fn keys(&self, w: usize) -> Range<usize> {
        self.lo[w]..self.end()
    }

    /// The cache slots of its sequence's positions `range`.
    pub fn slots(&self, range: Range<usize>) -> impl Iterator<Item = u32> + '_ {
        range.map(|p| slot(self.blocks, p))
    }
}

/// One query of the decode kernel: a token of a decode step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeQuery<'a> {
    /// Its row among the N.
    pub row: usize,
    pub blocks: &'a [u32],
    /// Positions it sees the end of: its own position + 1.
    pub end: usize,
    /// Per window: the first position it may see.
    pub lo: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PassPlan<'a> {
    /// Per token (N): id, position, cache slot.
    pub ids: Vec<u32>,
    pub positions: Vec<usize>,
    pub slots: Vec<u32>,
    pub steps: Vec<StepPlan<'a>>,
    /// The model's distinct sliding windows (`None`: the whole context); a layer's index into
    /// this list is its view.
    pub windows: &'a [Option<usize>],
}

impl<'a> PassPlan<'a> {
    /// The plan of `batch` (checked by `check_batch`: every step's room is reserved) against
    /// the block tables of `kv`.
    pub fn new(kv: &'a PagedKv, batch: &[SeqStep<'_>], windows: &'a [Option<usize>]) -> Self {
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut ids = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        let mut steps = Vec::with_capacity(batch.len());
        for step in batch {
            let end = step.pos + step.tokens.len();
            steps.push(StepPlan {
                at: ids.len(),
                pos: step.pos,
                len: step.tokens.len(),
                blocks: kv.blocks(step.seq),
                lo: windows
                    .iter()
                    .map(|w| w.map_or(0, |w| (step.pos + 1).saturating_sub(w)))
                    .collect(),
                kind: step.kind,
            });
            ids.extend_from_slice(step.tokens);
            positions.extend(step.pos..end);
            slots.extend(kv.slots(step.seq, step.pos, end));
        }
        Self {
            ids,
            positions,
            slots,
            steps,
            windows,
        }
    }

    /// Tokens in the pass (N).
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// Whether every step is one token (a decode pass).
    pub fn all_single(&self) -> bool {
        self.tokens() == self.steps.len()
    }

    /// The rows among the N that get logits, in step order: a prompt chunk's last token, every
    /// token of a decode step. None when that is every row.
    pub fn logit_rows(&self) -> Option<Vec<u32>> {
        let rows: Vec<u32> = self
            .steps
            .iter()
            .flat_map(|s| match s.kind {
                StepKind::Prefill => (s.at + s.len - 1)..(s.at + s.len),
                StepKind::Decode | StepKind::Score => s.at..(s.at + s.len),
            })
            .map(|r| r as u32)
            .collect();
        (rows.len() < self.tokens()).then_some(rows)
    }

    /// Each query the decode kernel serves, in row order: every token of the decode steps,
    /// as a one-token step at its position would be.
    pub fn decode_queries(&self) -> Vec<DecodeQuery<'a>> {
        self.steps
            .iter()
            .filter(|s| s.kind == StepKind::Decode)
            .flat_map(|s| {
                (0..s.len).map(move |i| DecodeQuery {
                    row: s.at + i,
                    blocks: s.blocks,
                    end: s.pos + i + 1,
                    lo: self
                        .windows
                        .iter()
                        .map(|w| w.map_or(0, |w| (s.pos + i + 1).saturating_sub(w)))
                        .collect(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kv_cache::BLOCK_SIZE;

    /// Two sequences in one pool: a prompt chunk of 20 tokens after 3 cached ones, and a
    /// one-token step at position 40; the model has a whole-context view and an 8-token window.
    #[test]
    fn a_mixed_pass_is_laid_out_token_by_token_and_step_by_step() {
        let mut kv = PagedKv::new(8);
        let (a, b) = (kv.new_sequence(), kv.new_sequence());
        assert!(kv.reserve(a, 23) && kv.reserve(b, 41));
        kv.advance(a, 3);
        kv.advance(b, 40);
        let prompt: Vec<u32> = (100..120).collect();
        let batch = [
            SeqStep::prefill(a, &prompt, 3),
            SeqStep::decode(b, &[7], 40),
        ];
        let windows = [None, Some(8)];
        let plan = PassPlan::new(&kv, &batch, &windows);
        assert_eq!(plan.tokens(), 21);
        assert!(!plan.all_single());
        assert_eq!(plan.ids[..20], prompt[..]);
        assert_eq!(plan.ids[20], 7);
        assert_eq!(plan.positions[0], 3);
        assert_eq!(plan.positions[19], 22);
        assert_eq!(plan.positions[20], 40);
        // Slots follow the block tables: token p of a sequence is in blocks[p / 16], row p % 16.
        let slot = |blocks: &[u32], p: usize| blocks[p / BLOCK_SIZE] * 16 + (p % 16) as u32;
        assert_eq!(plan.slots[0], slot(kv.blocks(a), 3));
        assert_eq!(plan.slots[19], slot(kv.blocks(a), 22));
        assert_eq!(plan.slots[20], slot(kv.blocks(b), 40));
        let (sa, sb) = (&plan.steps[0], &plan.steps[1]);
        assert_eq!((sa.at, sa.pos, sa.len, sa.end()), (0, 3, 20, 23));
        assert_eq!((sb.at, sb.pos, sb.len, sb.end()), (20, 40, 1, 41));
        assert_eq!(sa.blocks, kv.blocks(a));
        // Whole context: from 0. Window 8: the first query (at 3) sees 0..=3; the step at 40
        // sees 33..=40.
        assert_eq!((sa.keys(0), sa.keys(1)), (0..23, 0..23));
        assert_eq!((sb.keys(0), sb.keys(1)), (0..41, 33..41));
        assert_eq!(plan.logit_rows(), Some(vec![19, 20]));
    }

    #[test]
    fn a_decode_pass_needs_no_row_selection() {
        let mut kv = PagedKv::new(4);
        let seqs: Vec<_> = (0..3).map(|_| kv.new_sequence()).collect();
        for &s in &seqs {
            assert!(kv.reserve(s, 5));
            kv.advance(s, 4);
        }
        let toks = [[1u32], [2], [3]];
        let batch: Vec<SeqStep<'_>> = seqs
            .iter()
            .zip(&toks)
            .map(|(&seq, t)| SeqStep::decode(seq, t, 4))
            .collect();
        let plan = PassPlan::new(&kv, &batch, &[None]);
        assert!(plan.all_single());
        assert_eq!(plan.logit_rows(), None);
        assert_eq!(plan.ids, [1, 2, 3]);
        assert_eq!(
            plan.steps.iter().map(|s| s.at).collect::<Vec<_>>(),
            [0, 1, 2]
        );
    }
}
