//! Paged KV cache bookkeeping: keys and values live in fixed-size blocks of `BLOCK_SIZE` tokens
//! taken from one shared pool as a sequence grows and returned when it ends (the PagedAttention
//! layout). A batch of short and long sequences then holds memory for the tokens it has, not
//! `batch size x context window`.
//!
//! This file only decides which block holds which token, and where a token's row sits in a
//! layer's storage ([`store_row`]). The storage itself belongs to the backend that reads it:
//! f16 host memory on the CPU (`cpu::kv_store`), f32 tensors elsewhere (`device::kv_store`),
//! both laid out per layer as (kv, P, BLOCK_SIZE, hd).

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
    /// Blocks it expects to hold in the end (`expect`; 0: as many as it reserves).
    expected: usize,
    /// The run of block ids its blocks are being laid out in: its own while free, so other
    /// sequences place their runs elsewhere; a soft claim that a short pool overrides.
    claim: std::ops::Range<u32>,
}

/// Which blocks are free, and each live sequence's block table.
///
/// Blocks are handed out so that a sequence's blocks are consecutive ids wherever the pool
/// allows: attention reads a sequence's keys (and values) as one run per kv head when they
/// are, which the hardware prefetchers stream (2 KiB blocks scattered through the pool read
/// at about half the speed). A sequence that starts takes a run of free blocks long enough
/// for what it expects to hold, and grows into the next id while that is free; the rest of
/// its run is left to it while other sequences can go elsewhere. Nothing is reserved hard: a
/// pool short of blocks hands out any free one.
#[derive(Debug, Default)]
pub struct PagedKv {
    total: usize,
    /// Per block id: free or not.
    free: Vec<bool>,
    free_count: usize,
    peak: usize,
    seqs: Vec<Option<Sequence>>,
}

impl PagedKv {
    /// A pool of `blocks` blocks, all free.
    pub fn new(blocks: usize) -> Self {
        Self {
            total: blocks,
            free: vec![true; blocks],
            free_count: blocks,
            peak: 0,
            seqs: Vec::new(),
        }
    }

    pub fn usage(&self) -> KvUsage {
        KvUsage {
            block_size: BLOCK_SIZE,
            blocks_total: self.total,
            blocks_used: self.total - self.free_count,
            blocks_peak: self.peak,
        }
    }

    pub fn free_blocks(&self) -> usize {
        self.free_count
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

    /// Say how many tokens `seq` expects to hold in the end (its prompt plus the most it may
    /// generate): where its blocks go, not how many it gets, which `reserve` decides.
    pub fn expect(&mut self, seq: SeqId, tokens: usize) {
        if let Some(Some(s)) = self.seqs.get_mut(seq) {
            s.expected = blocks_for(tokens);
        }
    }

    /// End a sequence and return its blocks to the pool.
    pub fn free_sequence(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(seq).and_then(|s| s.take()) {
            self.free_count += s.blocks.len();
            for b in s.blocks {
                self.free[b as usize] = true;
            }
        }
    }

    /// Make room for `seq` to hold `tokens` tokens in all. False, with nothing taken, when the
    /// pool has too few free blocks (or the sequence is not live).
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> bool {
        let Some(Some(s)) = self.seqs.get(seq) else {
            return false;
        };
        let need = blocks_for(tokens).saturating_sub(s.blocks.len());
        if need > self.free_count {
            return false;
        }
        for left in (1..=need).rev() {
            let b = self.next_block(seq, left);
            self.free[b as usize] = false;
            self.free_count -= 1;
            self.seqs[seq]
                .as_mut()
                .expect("live, checked above")
                .blocks
                .push(b);
        }
        self.peak = self.peak.max(self.total - self.free_count);
        true
    }

    /// The free block `seq` takes next, with `left` more to take now (at least 1 block is
    /// free): the one after its last if that is free and no other sequence's run holds it,
    /// else the start of a new run.
    fn next_block(&mut self, seq: SeqId, left: usize) -> u32 {
        let s = self.seqs[seq].as_ref().expect("live");
        if let Some(&last) = s.blocks.last() {
            let next = last as usize + 1;
            if next < self.total && self.free[next] && !self.claimed_by_other(seq, next) {
                return next as u32;
            }
        }
        let want = s.expected.saturating_sub(s.blocks.len()).max(left);
        let start = self.place(seq, want);
        let s = self.seqs[seq].as_mut().expect("live");
        s.claim = start..(start as usize + want).min(self.total) as u32;
        start
    }

    /// Whether a free block lies in the run of a live sequence other than `seq`.
    fn claimed_by_other(&self, seq: SeqId, b: usize) -> bool {
        self.seqs
            .iter()
            .enumerate()
            .any(|(i, s)| i != seq && s.as_ref().is_some_and(|s| s.claim.contains(&(b as u32))))
    }

    /// Where `seq` starts a run of `want` blocks: the first stretch of free blocks outside
    /// other sequences' runs that is long enough, else the longest such stretch, else (the
    /// pool is short) the first free block.
    fn place(&self, seq: SeqId, want: usize) -> u32 {
        let mut open = self.free.clone();
        for (i, s) in self.seqs.iter().enumerate() {
            if let Some(s) = s.as_ref().filter(|_| i != seq) {
                for b in s.claim.clone() {
                    open[b as usize] = false;
                }
            }
        }
        let mut longest: Option<(usize, usize)> = None; // (start, length)
        let mut b = 0;
        while b < self.total {
            if !open[b] {
                b += 1;
                continue;
            }
            let start = b;
            while b < self.total && open[b] {
                b += 1;
            }
            if b - start >= want {
                return start as u32;
            }
            if longest.is_none_or(|(_, len)| b - start > len) {
                longest = Some((start, b - start));
            }
        }
        match longest {
            Some((start, _)) => start as u32,
            None => self.free.iter().position(|f| *f).expect("a free block") as u32,
        }
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

    /// Forget the sequence's tokens from `len` on (a conversation whose next turn diverges
    /// from what is cached there). Its blocks stay reserved; the next steps overwrite them.
    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        if let Some(Some(s)) = self.seqs.get_mut(seq) {
            s.len = s.len.min(len);
        }
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
        (from..to).map(move |p| slot(blocks, p))
    }
}

/// The storage slot of position `pos` of a sequence whose block table is `blocks`.
pub fn slot(blocks: &[u32], pos: usize) -> u32 {
    blocks[pos / BLOCK_SIZE] * BLOCK_SIZE as u32 + (pos % BLOCK_SIZE) as u32
}

/// Where token slot `slot` of kv head `head` sits in a layer's storage, as a row index: the
/// stores keep each kv head's blocks in a region of its own, (kv, P, BLOCK_SIZE, hd), so a
/// sequence in consecutive blocks is one contiguous run per head.
pub fn store_row(slot: u32, head: usize, pool_blocks: usize) -> usize {
    let (blk, r) = (slot as usize / BLOCK_SIZE, slot as usize % BLOCK_SIZE);
    (head * pool_blocks + blk) * BLOCK_SIZE + r
}

/// The storage rows of a sequence whose tokens sit at `slots`, head by head: kv * L row
/// numbers (head 0's L rows, then head 1's, ...), the order attention gathers keys in.
pub fn gather_rows(kv_heads: usize, pool_blocks: usize, slots: &[u32]) -> Vec<u32> {
    (0..kv_heads)
        .flat_map(|j| {
            slots
                .iter()
                .map(move |&s| store_row(s, j, pool_blocks) as u32)
        })
        .collect()
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

    /// Whether `blocks` are consecutive ids.
    fn one_run(blocks: &[u32]) -> bool {
        blocks.windows(2).all(|w| w[1] == w[0] + 1)
    }

    /// Sequences that grow a token at a time side by side, as a batch's do, each keep their
    /// blocks in one run when they said how long they would get: none takes the block after
    /// another's last.
    #[test]
    fn growing_side_by_side_keeps_each_sequence_in_one_run() {
        let mut kv = PagedKv::new(40);
        let prompts = [5usize, 17, 33, 1];
        let seqs: Vec<SeqId> = prompts
            .iter()
            .map(|&p| {
                let s = kv.new_sequence();
                kv.expect(s, p + 100);
                assert!(kv.reserve(s, p));
                s
            })
            .collect();
        for extra in 1..=100 {
            for (&s, &p) in seqs.iter().zip(&prompts) {
                assert!(kv.reserve(s, p + extra));
            }
        }
        for &s in &seqs {
            assert!(one_run(kv.blocks(s)), "{:?}", kv.blocks(s));
        }
        // Without being told, the first one's growth runs into the second's blocks.
        let mut blind = PagedKv::new(40);
        let (a, b) = (blind.new_sequence(), blind.new_sequence());
        assert!(blind.reserve(a, 16) && blind.reserve(b, 16) && blind.reserve(a, 17));
        assert!(!one_run(blind.blocks(a)));
        // A sequence that starts where others ended reuses their blocks as a run.
        kv.free_sequence(seqs[1]);
        kv.free_sequence(seqs[2]);
        let c = kv.new_sequence();
        kv.expect(c, 200);
        assert!(kv.reserve(c, 150));
        assert!(one_run(kv.blocks(c)), "{:?}", kv.blocks(c));
    }

    /// Runs are a preference, not a reservation: a pool too short for every run still lends
    /// every free block, a sequence's growth included.
    #[test]
    fn a_short_pool_hands_out_blocks_other_runs_wanted() {
        let mut kv = PagedKv::new(6);
        let a = kv.new_sequence();
        kv.expect(a, 6 * 16);
        assert!(kv.reserve(a, 16)); // 1 block, a run of 6 wanted
        let b = kv.new_sequence();
        kv.expect(b, 5 * 16);
        assert!(kv.reserve(b, 5 * 16), "takes the rest of a's run");
        assert_eq!(kv.free_blocks(), 0);
        assert!(!kv.reserve(a, 17), "nothing left to grow into");
        kv.free_sequence(b);
        assert!(kv.reserve(a, 6 * 16));
        assert!(one_run(kv.blocks(a)));
        let mut ids = kv.blocks(a).to_vec();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 6, "no block handed out twice");
    }
}
