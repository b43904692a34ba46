//! Paged KV cache bookkeeping: keys and values live in fixed-size blocks of `BLOCK_SIZE` tokens
//! taken from one shared pool as a sequence grows and returned when it ends (the PagedAttention
//! layout). A batch of short and long sequences then holds memory for the tokens it has, not
//! `batch size x context window`.
//!
//! This file only decides which block holds which token. The model owns the storage: per layer,
//! a (blocks * BLOCK_SIZE, kv * hd) matrix of keys and one of values, where row `slot(seq, pos)`
//! holds token `pos` of sequence `seq`.

use super::SeqId;

/// Tokens per block.
pub const BLOCK_SIZE: usize = 16;

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_SIZE)
}

/// How much of the pool is in use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvUsage {
    pub block_size: usize,
    pub blocks_total: usize,
    pub blocks_used: usize,
    /// Most blocks in use at once since the pool was made.
    pub blocks_peak: usize,
}

#[derive(Debug, Default)]
struct Sequence {
    /// Block ids in token order: token `pos` is in `blocks[pos / BLOCK_SIZE]`.
    blocks: Vec<u32>,
    /// Tokens written so far.
    len: usize,
}

/// Which blocks are free, and each live sequence's block table.
#[derive(Debug, Default)]
pub struct PagedKv {
    total: usize,
    free: Vec<u32>,
    peak: usize,
    seqs: Vec<Option<Sequence>>,
}

impl PagedKv {
    /// A pool of `blocks` blocks, all free.
    pub fn new(blocks: usize) -> Self {
        Self {
            total: blocks,
            // Popped from the end: hand out low ids first, which keeps small runs compact.
            free: (0..blocks as u32).rev().collect(),
            peak: 0,
            seqs: Vec::new(),
        }
    }

    pub fn usage(&self) -> KvUsage {
        KvUsage {
            block_size: BLOCK_SIZE,
            blocks_total: self.total,
            blocks_used: self.total - self.free.len(),
            blocks_peak: self.peak,
        }
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Whether any sequence is live.
    pub fn is_idle(&self) -> bool {
        self.seqs.iter().all(|s| s.is_none())
    }

    /// A new, empty sequence (it holds no blocks until `reserve`).
    pub fn new_sequence(&mut self) -> SeqId {
        match self.seqs.iter().position(|s| s.is_none()) {
            Some(i) => {
                self.seqs[i] = Some(Sequence::default());
                i
            }
            None => {
                self.seqs.push(Some(Sequence::default()));
                self.seqs.len() - 1
            }
        }
    }

    /// End a sequence and return its blocks to the pool.
    pub fn free_sequence(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(seq).and_then(|s| s.take()) {
            self.free.extend(s.blocks.into_iter().rev());
        }
    }

    /// Make room for `seq` to hold `tokens` tokens in all. False, with nothing taken, when the
    /// pool has too few free blocks (or the sequence is not live).
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> bool {
        let Some(Some(s)) = self.seqs.get_mut(seq) else {
            return false;
        };
        let need = blocks_for(tokens).saturating_sub(s.blocks.len());
        if need > self.free.len() {
            return false;
        }
        for _ in 0..need {
            s.blocks.push(self.free.pop().expect("counted above"));
        }
        self.peak = self.peak.max(self.total - self.free.len());
        true
    }

    /// Tokens the sequence holds, or None when it is not live.
    pub fn len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(seq)?.as_ref().map(|s| s.len)
    }

    /// Tokens the sequence has blocks for.
    pub fn capacity(&self, seq: SeqId) -> Option<usize> {
        self.seqs
            .get(seq)?
            .as_ref()
            .map(|s| s.blocks.len() * BLOCK_SIZE)
    }

    /// Record that `n` more tokens were written.
    pub fn advance(&mut self, seq: SeqId, n: usize) {
        if let Some(Some(s)) = self.seqs.get_mut(seq) {
            s.len += n;
            debug_assert!(s.len <= s.blocks.len() * BLOCK_SIZE);
        }
    }

    /// The block table of a live sequence.
    pub fn blocks(&self, seq: SeqId) -> &[u32] {
        self.seqs
            .get(seq)
            .and_then(|s| s.as_ref())
            .map_or(&[], |s| &s.blocks)
    }

    /// Storage rows of the sequence's tokens `from..to` (which must be reserved).
    pub fn slots(&self, seq: SeqId, from: usize, to: usize) -> impl Iterator<Item = u32> + '_ {
        let blocks = self.blocks(seq);
        (from..to)
            .map(move |p| blocks[p / BLOCK_SIZE] * BLOCK_SIZE as u32 + (p % BLOCK_SIZE) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_and_go() {
        let mut kv = PagedKv::new(4);
        let a = kv.new_sequence();
        let b = kv.new_sequence();
        assert!(kv.reserve(a, 17)); // 2 blocks
        assert!(kv.reserve(b, 16)); // 1 block
        assert_eq!(kv.usage().blocks_used, 3);
        assert!(!kv.reserve(b, 40), "3 blocks needed, 1 free: nothing taken");
        assert_eq!(kv.usage().blocks_used, 3);
        assert!(kv.reserve(b, 32));
        assert_eq!(kv.free_blocks(), 0);
        // Token 17 of a is in a's second block, row 1.
        let second = kv.blocks(a)[1];
        assert_eq!(
            kv.slots(a, 16, 18).collect::<Vec<_>>(),
            vec![second * 16, second * 16 + 1]
        );
        kv.free_sequence(a);
        assert_eq!(kv.free_blocks(), 2);
        assert_eq!(kv.usage().blocks_peak, 4);
        kv.free_sequence(b);
        assert!(kv.is_idle());
        assert_eq!(kv.usage().blocks_used, 0);
        // Slots are reused.
        let c = kv.new_sequence();
        assert_eq!(c, 0);
        assert!(kv.reserve(c, 64));
    }

    #[test]
    fn reserve_is_idempotent_and_counts_tokens() {
        let mut kv = PagedKv::new(2);
        let a = kv.new_sequence();
        assert!(kv.reserve(a, 1));
        assert!(kv.reserve(a, 16));
        assert_eq!(kv.usage().blocks_used, 1);
        assert_eq!(kv.capacity(a), Some(16));
        kv.advance(a, 16);
        assert_eq!(kv.len(a), Some(16));
        assert!(!kv.reserve(7, 1), "not a live sequence");
    }
}
