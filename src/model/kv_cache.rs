//! Paged KV cache bookkeeping: keys and values live in fixed-size blocks of `BLOCK_SIZE` tokens
//! taken from one shared pool as a sequence grows and returned when it ends (the PagedAttention
//! layout). A batch of short and long sequences then holds memory for the tokens it has, not
//! `batch size x context window`.
//!
//! Blocks a prompt's prefill filled can be shared: the prefix cache ([`PagedKv::publish`],
//! [`PagedKv::attach_prefix`]) lets a later prompt that begins with the same tokens take them
//! by reference instead of computing them again.
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
    /// Blocks live sequences hold.
    pub blocks_used: usize,
    /// Most blocks in use at once since the pool was made.
    pub blocks_peak: usize,
    /// Blocks of the prefix cache no sequence holds: free for the taking, least recently used
    /// first, and reused as they are by a prompt that begins with their tokens.
    pub blocks_cached: usize,
}

/// A published block: its tokens and where it sits in the chain of blocks before it.
#[derive(Debug, Clone)]
struct Entry {
    key: u64,
    parent: u64,
    tokens: [u32; BLOCK_SIZE],
    /// When it was last released (for eviction, least recent first).
    stamp: u64,
}

/// The key of the chain before a sequence's first block.
const ROOT: u64 = 0x9e37_79b9_7f4a_7c15;

/// The key of a block of `tokens` after the chain `parent`: an FNV-1a-style mix of the parent's
/// key and the token ids, finished with a 64-bit avalanche. Keys only find candidates: a match
/// also compares the candidate's tokens and its parent's key.
pub fn chain_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0xcbf2_9ce4_8422_2325;
    for &t in tokens {
        h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
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
    /// Chain keys of its first blocks, the ones taken from the cache or published: those
    /// blocks are never written again.
    keys: Vec<u64>,
}

/// Which blocks are free, each live sequence's block table, and the prefix cache.
///
/// Blocks are handed out so that a sequence's blocks are consecutive ids wherever the pool
/// allows: attention reads a sequence's keys (and values) as one run per kv head when they
/// are, which the hardware prefetchers stream (2 KiB blocks scattered through the pool read
/// at about half the speed). A sequence that starts takes a run of free blocks long enough
/// for what it expects to hold, and grows into the next id while that is free; the rest of
/// its run is left to it while other sequences can go elsewhere. Nothing is reserved hard: a
/// pool short of blocks hands out any free one.
///
/// Prefix cache: a full block whose keys and values a prompt's prefill computed can be
/// published under the chain of token ids up to its end (vLLM's hash chain: a key of the
/// parent's key and the block's tokens). A sequence whose prompt begins with published blocks
/// takes them by reference ([`PagedKv::attach_prefix`]) and prefills only the rest; a published
/// block is never written again (a sequence's partly filled last block is always its own). A
/// published block that no sequence holds stays in the cache, free to be taken: new blocks
/// come from never-published ones first, then from the cache, least recently released first.
#[derive(Debug)]
pub struct PagedKv {
    total: usize,
    /// Per block id: how many live sequences hold it.
    refs: Vec<u32>,
    /// Per block id: its prefix-cache entry, when published.
    entries: Vec<Option<Entry>>,
    /// Published blocks no sequence holds, by (stamp, id): the first is evicted first.
    idle: std::collections::BTreeSet<(u64, u32)>,
    /// Published blocks by chain key.
    index: std::collections::HashMap<u64, u32>,
    clock: u64,
    /// Blocks no sequence holds and the cache does not keep.
    plain_free: usize,
    peak: usize,
    seqs: Vec<Option<Sequence>>,
    caching: bool,
}

impl Default for PagedKv {
    fn default() -> Self {
        Self::new(0)
    }
}

impl PagedKv {
    /// A pool of `blocks` blocks, all free, with the prefix cache on.
    pub fn new(blocks: usize) -> Self {
        Self {
            total: blocks,
            refs: vec![0; blocks],
            entries: vec![None; blocks],
            idle: Default::default(),
            index: Default::default(),
            clock: 0,
            plain_free: blocks,
            peak: 0,
            seqs: Vec::new(),
            caching: true,
        }
    }

    /// Turn the prefix cache on or off (off: nothing is published or looked up, and what was
    /// published is forgotten).
    pub fn set_prefix_cache(&mut self, on: bool) {
        self.caching = on;
        if !on {
            for b in 0..self.total {
                if self.entries[b].is_some() {
                    self.unpublish(b as u32);
                }
            }
        }
    }

    pub fn prefix_cache(&self) -> bool {
        self.caching
    }

    pub fn usage(&self) -> KvUsage {
        KvUsage {
            block_size: BLOCK_SIZE,
            blocks_total: self.total,
            blocks_used: self.total - self.free_blocks(),
            blocks_peak: self.peak,
            blocks_cached: self.idle.len(),
        }
    }

    /// Blocks a sequence can take: free ones and cached ones no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.plain_free + self.idle.len()
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

    /// End a sequence and give back its blocks: published ones stay in the cache. Its last
    /// block is released first, so it is evicted first: a chain loses its tail before its
    /// beginning, never the other way (a block whose predecessor is gone is unreachable).
    pub fn free_sequence(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.get_mut(seq).and_then(|s| s.take()) {
            for b in s.blocks.into_iter().rev() {
                self.release(b);
            }
        }
    }

    /// One holder less for block `b`.
    fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "block {b} released more often than taken");
        *r -= 1;
        if *r > 0 {
            return;
        }
        match &mut self.entries[b as usize] {
            Some(e) => {
                self.clock += 1;
                e.stamp = self.clock;
                self.idle.insert((e.stamp, b));
            }
            None => self.plain_free += 1,
        }
    }

    /// Forget block `b`'s cache entry (it is held by nobody, or about to be rewritten).
    fn unpublish(&mut self, b: u32) {
        if let Some(e) = self.entries[b as usize].take() {
            if self.index.get(&e.key) == Some(&b) {
                self.index.remove(&e.key);
            }
            if self.refs[b as usize] == 0 {
                self.idle.remove(&(e.stamp, b));
                self.plain_free += 1;
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
        if need > self.free_blocks() {
            return false;
        }
        for left in (1..=need).rev() {
            if self.plain_free == 0 {
                // Room comes from the cache: the least recently released block goes.
                let &(_, b) = self.idle.first().expect("free_blocks counted it");
                self.unpublish(b);
            }
            let b = self.next_block(seq, left);
            debug_assert!(self.refs[b as usize] == 0 && self.entries[b as usize].is_none());
            self.refs[b as usize] = 1;
            self.plain_free -= 1;
            self.seqs[seq]
                .as_mut()
                .expect("live, checked above")
                .blocks
                .push(b);
        }
        self.peak = self.peak.max(self.total - self.free_blocks());
        true
    }

    /// Whether block `b` is free and not kept by the cache.
    fn is_plain_free(&self, b: usize) -> bool {
        self.refs[b] == 0 && self.entries[b].is_none()
    }

    /// The free block `seq` takes next, with `left` more to take now (at least 1 block is
    /// plainly free): the one after its last if that is free and no other sequence's run
    /// holds it, else the start of a new run.
    fn next_block(&mut self, seq: SeqId, left: usize) -> u32 {
        let s = self.seqs[seq].as_ref().expect("live");
        if let Some(&last) = s.blocks.last() {
            let next = last as usize + 1;
            if next < self.total && self.is_plain_free(next) && !self.claimed_by_other(seq, next) {
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
        let mut open: Vec<bool> = (0..self.total).map(|b| self.is_plain_free(b)).collect();
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
            None => (0..self.total)
                .find(|&b| self.is_plain_free(b))
                .expect("a free block") as u32,
        }
    }

    /// The published blocks `tokens` begins with, in order: the chain of full blocks, at most
    /// `(tokens.len() - 1) / BLOCK_SIZE` of them (a prompt keeps at least one token to prefill,
    /// whose logits give its first reply token).
    pub fn lookup(&self, tokens: &[u32]) -> Vec<u32> {
        self.chain(tokens, tokens.len().saturating_sub(1) / BLOCK_SIZE)
    }

    /// The published blocks `tokens` begins with, up to `max` of them.
    pub fn chain(&self, tokens: &[u32], max: usize) -> Vec<u32> {
        let mut found = Vec::new();
        if !self.caching {
            return found;
        }
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(BLOCK_SIZE).take(max) {
            let key = chain_key(parent, chunk);
            let Some(&b) = self.index.get(&key) else {
                break;
            };
            match &self.entries[b as usize] {
                Some(e) if e.parent == parent && e.tokens[..] == *chunk => found.push(b),
                _ => break,
            }
            parent = key;
        }
        found
    }

    /// Put the first `blocks` full blocks of `tokens` in the cache, as a prefill over them
    /// would publish them, for keys and values that come from elsewhere (a prompt-cache file):
    /// per block, the id whose contents the caller must write now, or None where the cache
    /// holds that block already. Only never-published free blocks are used (nothing cached is
    /// evicted for this): fewer than `blocks` come back when the pool has fewer.
    pub fn adopt(&mut self, tokens: &[u32], blocks: usize) -> Vec<Option<u32>> {
        let mut out = Vec::new();
        if !self.caching {
            return out;
        }
        let mut parent = ROOT;
        let mut b = 0;
        for chunk in tokens.chunks_exact(BLOCK_SIZE).take(blocks) {
            let key = chain_key(parent, chunk);
            let known = self.index.get(&key).is_some_and(|&c| {
                let e = self.entries[c as usize].as_ref().expect("indexed");
                e.parent == parent && e.tokens[..] == *chunk
            });
            if known {
                out.push(None);
            } else {
                while b < self.total && !self.is_plain_free(b) {
                    b += 1;
                }
                if b == self.total || self.index.contains_key(&key) {
                    break;
                }
                self.clock += 1;
                self.entries[b] = Some(Entry {
                    key,
                    parent,
                    tokens: chunk.try_into().expect("a block of tokens"),
                    stamp: self.clock,
                });
                self.index.insert(key, b as u32);
                self.idle.insert((self.clock, b as u32));
                self.plain_free -= 1;
                out.push(Some(b as u32));
            }
            parent = key;
        }
        out
    }

    /// Give the new, empty sequence `seq` the published blocks its `tokens` begin with (see
    /// [`lookup`](Self::lookup)); returns how many tokens it now holds (a multiple of
    /// BLOCK_SIZE). Its next step starts there.
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        let found = self.lookup(tokens);
        self.attach(seq, found)
    }

    /// Give the new, empty sequence `seq` the blocks `found` (what [`lookup`](Self::lookup)
    /// just returned, nothing published or evicted since); returns the tokens it now holds.
    pub fn attach(&mut self, seq: SeqId, found: Vec<u32>) -> usize {
        let Some(Some(s)) = self.seqs.get(seq) else {
            return 0;
        };
        if !s.blocks.is_empty() || found.is_empty() {
            return 0;
        }
        for &b in &found {
            if self.refs[b as usize] == 0 {
                let stamp = self.entries[b as usize].as_ref().expect("published").stamp;
                self.idle.remove(&(stamp, b));
            }
            self.refs[b as usize] += 1;
        }
        let keys: Vec<u64> = found
            .iter()
            .map(|&b| self.entries[b as usize].as_ref().expect("published").key)
            .collect();
        let len = found.len() * BLOCK_SIZE;
        let s = self.seqs[seq].as_mut().expect("live");
        s.len = len;
        s.blocks = found;
        s.keys = keys;
        self.peak = self.peak.max(self.total - self.free_blocks());
        len
    }

    /// Publish the full blocks of `seq` that hold `tokens` (its first tokens, every one of
    /// them computed by a prefill step: the keys and values a prompt's prefill gives are what
    /// another prompt's would). A block whose chain another block already publishes stays the
    /// sequence's own. Blocks published before are left as they are.
    pub fn publish(&mut self, seq: SeqId, tokens: &[u32]) {
        if !self.caching {
            return;
        }
        let Some(Some(s)) = self.seqs.get(seq) else {
            return;
        };
        let full = tokens.len().min(s.len) / BLOCK_SIZE;
        let from = s.keys.len();
        for i in from..full {
            let s = self.seqs[seq].as_ref().expect("live");
            let parent = s.keys.last().copied().unwrap_or(ROOT);
            let chunk = &tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let key = chain_key(parent, chunk);
            let b = s.blocks[i];
            if !self.index.contains_key(&key) && self.refs[b as usize] == 1 {
                self.index.insert(key, b);
                self.entries[b as usize] = Some(Entry {
                    key,
                    parent,
                    tokens: chunk.try_into().expect("a block of tokens"),
                    stamp: 0,
                });
            }
            self.seqs[seq].as_mut().expect("live").keys.push(key);
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

    /// Forget the sequence's tokens from `len` on. Its own blocks stay reserved and the next
    /// steps overwrite them. Blocks from the cache or published (never written again) that
    /// held tokens from `len` on are given back whole, with every block after them: the
    /// sequence then holds fewer tokens than `len` (a multiple of BLOCK_SIZE; see `len`) and
    /// `reserve` must make room again.
    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        let Some(Some(s)) = self.seqs.get_mut(seq) else {
            return;
        };
        s.len = s.len.min(len);
        let keep = s.len / BLOCK_SIZE;
        if s.keys.len() > keep {
            s.len = keep * BLOCK_SIZE;
            s.keys.truncate(keep);
            let gone = s.blocks.split_off(keep);
            for b in gone.into_iter().rev() {
                self.release(b);
            }
        }
    }

    /// Record that `n` more tokens were written.
    pub fn advance(&mut self, seq: SeqId, n: usize) {
        if let Some(Some(s)) = self.seqs.get_mut(seq) {
            s.len += n;
            debug_assert!(s.len <= s.blocks.len() * BLOCK_SIZE);
            debug_assert!(
                s.len - n >= s.keys.len() * BLOCK_SIZE,
                "a published block written"
            );
        }
    }

    /// How many live sequences hold block `b` (0: free or only cached).
    pub fn holders(&self, b: u32) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    /// Whether block `b` is published (its contents never change while it is).
    /// The chain key block `b` is published under, if it is.
    pub fn block_key(&self, b: u32) -> Option<u64> {
        self.entries.get(b as usize)?.as_ref().map(|e| e.key)
    }

    pub fn is_published(&self, b: u32) -> bool {
        self.entries.get(b as usize).is_some_and(|e| e.is_some())
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

/// That `len` bytes of saved cache are `blocks` blocks of `block_bytes` each (what a store's
/// `write_blocks` takes).
pub fn check_block_data(len: usize, blocks: usize, block_bytes: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        len == blocks * block_bytes,
        "{len} bytes of cache for {blocks} blocks of {block_bytes} bytes"
    );
    Ok(())
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

    /// A sequence `tokens` long, reserved, written and its full blocks published, as a prompt's
    /// prefill leaves it.
    fn prefilled(kv: &mut PagedKv, tokens: &[u32]) -> SeqId {
        let s = kv.new_sequence();
        let reused = kv.attach_prefix(s, tokens);
        assert!(kv.reserve(s, tokens.len()));
        kv.advance(s, tokens.len() - reused);
        kv.publish(s, tokens);
        s
    }

    fn ids(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    /// Two prompts sharing 35 tokens share their first two blocks by reference; each has its
    /// own blocks after; when both end, the published blocks stay cached, the rest are free.
    #[test]
    fn shared_prefix_blocks_are_taken_by_reference_and_released_to_the_cache() {
        let mut kv = PagedKv::new(16);
        let a_tokens = ids(0..40);
        let a = prefilled(&mut kv, &a_tokens);
        assert!(kv.is_published(kv.blocks(a)[0]) && kv.is_published(kv.blocks(a)[1]));
        assert!(
            !kv.is_published(kv.blocks(a)[2]),
            "a partly filled block is never published"
        );
        let mut b_tokens = ids(0..35);
        b_tokens.extend(100..120);
        let b = kv.new_sequence();
        assert_eq!(kv.attach_prefix(b, &b_tokens), 32);
        assert_eq!(kv.len(b), Some(32));
        assert_eq!(kv.blocks(b)[..], kv.blocks(a)[..2]);
        assert_eq!(kv.holders(kv.blocks(a)[0]), 2);
        assert!(kv.reserve(b, b_tokens.len()));
        assert!(
            !kv.blocks(a).contains(&kv.blocks(b)[2]),
            "b writes into its own blocks"
        );
        kv.advance(b, b_tokens.len() - 32);
        kv.publish(b, &b_tokens);
        assert_eq!(kv.usage().blocks_used, 3 + 2);
        kv.free_sequence(a);
        assert_eq!(kv.holders(kv.blocks(b)[0]), 1);
        let shared = kv.blocks(b)[..2].to_vec();
        kv.free_sequence(b);
        for b in shared {
            assert_eq!(kv.holders(b), 0, "every reference returned");
        }
        let u = kv.usage();
        // a's 2 published blocks and b's 1 (its third; 51 tokens: blocks 0-2 full).
        assert_eq!((u.blocks_used, u.blocks_cached), (0, 3));
        assert_eq!(kv.free_blocks(), 16);
    }

    /// A match stops at the first block that differs, matches whole chains only (the same
    /// tokens after another beginning are not a match) and leaves at least one token of the
    /// prompt to prefill.
    #[test]
    fn lookups_follow_the_chain_and_leave_a_token_to_prefill() {
        let mut kv = PagedKv::new(16);
        let a = prefilled(&mut kv, &ids(0..48));
        kv.free_sequence(a);
        assert_eq!(
            kv.lookup(&ids(0..48)).len(),
            2,
            "47 tokens may come from the cache"
        );
        assert_eq!(kv.lookup(&ids(0..49)).len(), 3);
        assert_eq!(kv.lookup(&ids(0..16)).len(), 0);
        assert_eq!(kv.lookup(&ids(0..17)).len(), 1);
        let mut other = ids(0..16);
        other[3] = 999;
        other.extend(16..49);
        assert!(
            kv.lookup(&other).is_empty(),
            "block 2 follows another block 1"
        );
        let mut tail = ids(0..32);
        tail.push(7);
        tail.extend(33..49);
        assert_eq!(kv.lookup(&tail).len(), 2);
        kv.set_prefix_cache(false);
        assert!(kv.lookup(&ids(0..49)).is_empty());
        assert_eq!(kv.usage().blocks_cached, 0);
        assert_eq!(kv.free_blocks(), 16);
    }

    /// When the pool has no never-published block left, room comes from the cache, least
    /// recently released first; an evicted block is no longer found.
    #[test]
    fn the_cache_gives_room_least_recently_released_first() {
        let mut kv = PagedKv::new(4);
        let a = prefilled(&mut kv, &ids(0..32)); // 2 blocks, both published
        kv.free_sequence(a);
        let b = prefilled(&mut kv, &ids(100..132));
        kv.free_sequence(b); // released after a's
        assert_eq!(kv.usage().blocks_cached, 4);
        let c = kv.new_sequence();
        assert!(kv.reserve(c, 16));
        assert_eq!(kv.usage().blocks_cached, 3);
        assert_eq!(
            kv.lookup(&ids(0..33)).len(),
            1,
            "a's last block went first: its first is still found"
        );
        assert_eq!(
            kv.lookup(&ids(100..133)).len(),
            2,
            "b's blocks are still there"
        );
        // Taking a cached block back makes it busy: it is not evicted under a sequence.
        let d = kv.new_sequence();
        assert_eq!(kv.attach_prefix(d, &ids(100..133)), 32);
        assert!(kv.reserve(d, 33));
        assert!(
            !kv.reserve(c, 17),
            "the pool is full: only held blocks are left"
        );
        assert_eq!(kv.usage().blocks_cached, 0);
        kv.free_sequence(c);
        kv.free_sequence(d);
        assert!(kv.is_idle());
        assert_eq!(kv.free_blocks(), 4);
    }

    /// Two sequences that prefilled the same prompt in one pass: the first to publish owns the
    /// cache entries, the other's blocks stay its own and are plain free when it ends.
    #[test]
    fn a_second_copy_of_a_chain_is_not_published() {
        let mut kv = PagedKv::new(8);
        let t = ids(0..33);
        let (a, b) = (kv.new_sequence(), kv.new_sequence());
        for s in [a, b] {
            assert!(kv.reserve(s, t.len()));
            kv.advance(s, t.len());
        }
        kv.publish(a, &t);
        kv.publish(b, &t);
        assert!(kv.blocks(b)[..2].iter().all(|&x| !kv.is_published(x)));
        kv.free_sequence(a);
        kv.free_sequence(b);
        assert_eq!(kv.usage().blocks_cached, 2);
        assert_eq!(kv.lookup(&t).len(), 2);
    }

    /// Truncating into blocks from the cache gives them back (they are never written); the
    /// sequence reserves again and writes into blocks of its own.
    #[test]
    fn truncating_into_shared_blocks_gives_them_back() {
        let mut kv = PagedKv::new(8);
        let a = prefilled(&mut kv, &ids(0..40));
        let b = kv.new_sequence();
        assert_eq!(kv.attach_prefix(b, &ids(0..40)), 32);
        assert!(kv.reserve(b, 40));
        let shared = kv.blocks(a)[1];
        kv.truncate(b, 20);
        // Tokens 16..20 were in the shared block: forgotten with it.
        assert_eq!((kv.len(b), kv.capacity(b)), (Some(16), Some(16)));
        assert_eq!(kv.holders(shared), 1);
        assert!(kv.reserve(b, 40));
        assert!(!kv.blocks(b)[1..].contains(&shared));
        assert_eq!(kv.blocks(b)[0], kv.blocks(a)[0]);
        kv.advance(b, 24);
        kv.free_sequence(a);
        kv.free_sequence(b);
        assert_eq!(kv.free_blocks(), 8);
    }
}
