//! Paged KV cache bookkeeping: keys and values live in fixed-size blocks of `BLOCK_SIZE` tokens
//! taken from one shared pool as a sequence grows and returned when it ends (the PagedAttention
//! layout). A batch of short and long sequences then holds memory for the tokens it has, not
//! `batch size x context window`.
//!
//! This file only decides which block holds which token. The model owns the storage: per layer,
//! a (blocks * BLOCK_SIZE, kv * hd) matrix of keys and one of values, where row `slot(seq, pos)`
//! holds token `pos` of sequence `seq`.

use half::f16;
use half::slice::HalfFloatSliceExt;

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

/// Where one pass's new keys and values go in a [`KvStore`], worked out once for all layers.
pub struct WritePlan {
    slots: Vec<u32>,
    device: Option<DevicePlan>,
    /// The slots on the device, for gen's CUDA kernel.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kernel_slots: Option<candle_core::Tensor>,
}

/// For a device store: which new row each (kv head, block, place) receives (`map`, into the
/// (N * kv, hd) rows) and its row within the block (`ids`, u32::MAX where nothing comes).
struct DevicePlan {
    map: candle_core::Tensor,
    ids: candle_core::Tensor,
}

/// The keys and values themselves, per layer, in the blocks `PagedKv` hands out. Layout
/// (kv, P, BLOCK_SIZE, hd): each kv head has its own region, so a sequence whose blocks are
/// consecutive (what `PagedKv` aims for) is one contiguous run per
/// head, which the hardware prefetchers stream like an unpaged cache. On the CPU the storage is plain memory our kernels read and write in place; on other
/// devices, tensors of (P * kv * BLOCK_SIZE, hd) rows written with `slice_set` and read with
/// `index_select`.
pub enum KvStore {
    /// f16 values, as llama.cpp keeps them: half the bytes for attention to read.
    Host {
        k: Vec<Vec<f16>>,
        v: Vec<Vec<f16>>,
        kv_heads: usize,
        head_dim: usize,
    },
    Device {
        k: Vec<candle_core::Tensor>,
        v: Vec<candle_core::Tensor>,
        kv_heads: usize,
        head_dim: usize,
    },
}

impl KvStore {
    pub fn empty() -> Self {
        KvStore::Host {
            k: Vec::new(),
            v: Vec::new(),
            kv_heads: 0,
            head_dim: 0,
        }
    }

    /// `host`: the host layout (needs a CPU device); otherwise tensors on `device`.
    pub fn new(
        device: &candle_core::Device,
        host: bool,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        blocks: usize,
    ) -> candle_core::Result<Self> {
        let rows = blocks * kv_heads * BLOCK_SIZE;
        if host && device.is_cpu() {
            // Zeroed allocations: the OS hands out pages only as tokens land on them.
            let mk = || {
                (0..layers)
                    .map(|_| vec![f16::ZERO; rows * head_dim])
                    .collect()
            };
            return Ok(KvStore::Host {
                k: mk(),
                v: mk(),
                kv_heads,
                head_dim,
            });
        }
        let mk = || -> candle_core::Result<Vec<candle_core::Tensor>> {
            (0..layers)
                .map(|_| {
                    candle_core::Tensor::zeros((rows, head_dim), candle_core::DType::F32, device)
                })
                .collect()
        };
        Ok(KvStore::Device {
            k: mk()?,
            v: mk()?,
            kv_heads,
            head_dim,
        })
    }

    /// Work out where a pass's N new tokens (at cache `slots`) go, once for every layer.
    /// `kernel`: gen's CUDA kernel writes (it needs only the slots on the device).
    pub fn plan_write(
        &self,
        slots: &[u32],
        device: &candle_core::Device,
        kernel: bool,
    ) -> candle_core::Result<WritePlan> {
        let KvStore::Device { kv_heads, .. } = self else {
            return Ok(WritePlan {
                slots: slots.to_vec(),
                device: None,
                kernel_slots: None,
            });
        };
        if kernel {
            return Ok(WritePlan {
                slots: slots.to_vec(),
                device: None,
                kernel_slots: Some(candle_core::Tensor::new(slots, device)?),
            });
        }
        // One scatter per tensor writes every token of every head: the cache seen as
        // (kv * P, BLOCK_SIZE, hd), each (head, block) receiving up to `per_block` rows of a
        // source of (kv * P, per_block, hd) gathered from the new rows; (head, block) pairs
        // with nothing to receive are skipped through the index u32::MAX. candle's scatter
        // runs one thread per (head, block, value) and loops only over `per_block`, where a
        // plain scatter of N rows would loop over all N in each of hd threads.
        let (kv, p) = (*kv_heads, self.blocks());
        let mut count = vec![0usize; p];
        for &s in slots {
            count[s as usize / BLOCK_SIZE] += 1;
        }
        let per_block = count.iter().copied().max().unwrap_or(0).max(1);
        let mut map = vec![0u32; kv * p * per_block];
        let mut ids = vec![u32::MAX; kv * p * per_block];
        count.fill(0);
        for (i, &s) in slots.iter().enumerate() {
            let (blk, r) = (s as usize / BLOCK_SIZE, s as usize % BLOCK_SIZE);
            let c = count[blk];
            count[blk] += 1;
            for j in 0..kv {
                let e = (j * p + blk) * per_block + c;
                map[e] = (i * kv + j) as u32;
                ids[e] = r as u32;
            }
        }
        let hd = self.head_dim();
        let n = kv * p * per_block;
        let ids = candle_core::Tensor::from_vec(ids, (n, 1), device)?
            .broadcast_as((n, hd))?
            .contiguous()?
            .reshape((kv * p, per_block, hd))?;
        Ok(WritePlan {
            slots: slots.to_vec(),
            device: Some(DevicePlan {
                map: candle_core::Tensor::from_vec(map, n, device)?,
                ids,
            }),
            kernel_slots: None,
        })
    }

    /// Store one layer's keys and values of N tokens, (N, kv*hd) each, where `plan` says.
    /// `check` (GEN_CUDA_KERNELS=check) compares what gen's CUDA kernel wrote with its input.
    pub fn write(
        &mut self,
        layer: usize,
        keys: &candle_core::Tensor,
        values: &candle_core::Tensor,
        plan: &WritePlan,
        check: &super::decoder::KernelCheck,
    ) -> anyhow::Result<()> {
        let slots = &plan.slots;
        // GEN_CUDA_KERNELS=check: the rows the kernel should have written, kv head by kv head.
        #[cfg(feature = "cuda")]
        let check_rows =
            (plan.kernel_slots.is_some() && check.enabled()).then(|| self.gather_rows(slots));
        match self {
            KvStore::Host {
                k,
                v,
                kv_heads,
                head_dim,
            } => {
                let (kv, hd) = (*kv_heads, *head_dim);
                let p = k[layer].len() / (kv * BLOCK_SIZE * hd).max(1);
                let row = |s: u32, j: usize| {
                    let (blk, r) = (s as usize / BLOCK_SIZE, s as usize % BLOCK_SIZE);
                    ((j * p + blk) * BLOCK_SIZE + r) * hd
                };
                // Ask for every destination row first: written one after the other, each
                // write waited for its line to come from memory (most of the write's time
                // in a batch's decode step, whose new rows are nowhere in cache).
                #[cfg(target_arch = "x86_64")]
                for pool in [&k[layer], &v[layer]] {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                    for &s in slots.iter().take(64) {
                        for j in 0..kv {
                            let at = pool[row(s, j)..].as_ptr() as *const i8;
                            for off in (0..hd * 2).step_by(64) {
                                // SAFETY: a prefetch is a hint: it cannot fault.
                                unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(off)) };
                            }
                        }
                    }
                }
                for (src, dst) in [(keys, &mut k[layer]), (values, &mut v[layer])] {
                    let src = src.contiguous()?;
                    let (storage, layout) = src.storage_and_layout();
                    let candle_core::Storage::Cpu(cpu) = &*storage else {
                        anyhow::bail!("keys for the host cache are not on the host");
                    };
                    let src = &cpu.as_slice::<f32>()?[layout.start_offset()..];
                    for (i, &s) in slots.iter().enumerate() {
                        for j in 0..kv {
                            let to = row(s, j);
                            let from = (i * kv + j) * hd;
                            dst[to..to + hd].convert_from_f32_slice(&src[from..from + hd]);
                        }
                    }
                }
                Ok(())
            }
            KvStore::Device {
                k,
                v,
                kv_heads,
                head_dim,
            } => {
                let (kv, hd) = (*kv_heads, *head_dim);
                #[cfg(feature = "cuda")]
                if let Some(on_device) = &plan.kernel_slots {
                    super::cuda::kv_write(&k[layer], &v[layer], keys, values, on_device, kv, hd)?;
                    if let Some(rows) = &check_rows {
                        let rows = candle_core::Tensor::new(rows.as_slice(), keys.device())?;
                        let n = slots.len();
                        for (src, pool) in [(keys, &k[layer]), (values, &v[layer])] {
                            // (N, kv*hd) -> (kv, N, hd): the order gather_rows gives.
                            let want = src
                                .contiguous()?
                                .reshape((n, kv, hd))?
                                .transpose(0, 1)?
                                .contiguous()?
                                .reshape((kv * n, hd))?;
                            check.write(&pool.index_select(&rows, 0)?, &want)?;
                        }
                    }
                    return Ok(());
                }
                let _ = check;
                let Some(DevicePlan { map, ids }) = &plan.device else {
                    anyhow::bail!("a device cache needs a write plan made for it");
                };
                let p = k[layer].dim(0)? / (kv * BLOCK_SIZE).max(1);
                let per_block = ids.dim(1)?;
                for (src, dst) in [(keys, &k[layer]), (values, &v[layer])] {
                    let rows = src.contiguous()?.reshape((slots.len() * kv, hd))?;
                    let source = rows
                        .index_select(map, 0)?
                        .reshape((kv * p, per_block, hd))?;
                    dst.reshape((kv * p, BLOCK_SIZE, hd))?
                        .scatter_set(ids, &source, 1)?;
                }
                Ok(())
            }
        }
    }

    /// Rows of the cache to gather for a sequence whose tokens sit at `slots`, head by head:
    /// kv * L row numbers, for `gather`.
    pub fn gather_rows(&self, slots: &[u32]) -> Vec<u32> {
        let kv = self.kv_heads() as u32;
        let p = self.blocks() as u32;
        let block = BLOCK_SIZE as u32;
        (0..kv)
            .flat_map(|j| {
                slots
                    .iter()
                    .map(move |&s| (j * p + s / block) * block + s % block)
            })
            .collect()
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        match self {
            KvStore::Host {
                k,
                kv_heads,
                head_dim,
                ..
            } => k
                .first()
                .map_or(0, |k| k.len() / (kv_heads * BLOCK_SIZE * head_dim).max(1)),
            KvStore::Device { k, kv_heads, .. } => k
                .first()
                .map_or(0, |k| k.dims()[0] / (kv_heads * BLOCK_SIZE).max(1)),
        }
    }

    /// One layer's keys and values at `rows` (from `gather_rows`): (kv, L, hd) each.
    pub fn gather(
        &self,
        layer: usize,
        rows: &[u32],
        rows_on_device: Option<&candle_core::Tensor>,
        device: &candle_core::Device,
    ) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
        let kv = self.kv_heads();
        let l = rows.len() / kv.max(1);
        match self {
            KvStore::Host { k, v, head_dim, .. } => {
                let hd = *head_dim;
                let take = |pool: &[f16]| {
                    let mut out = vec![0f32; rows.len() * hd];
                    for (o, &r) in out.chunks_exact_mut(hd).zip(rows) {
                        let at = r as usize * hd;
                        pool[at..at + hd].convert_to_f32_slice(o);
                    }
                    candle_core::Tensor::from_vec(out, (kv, l, hd), device)
                };
                Ok((take(&k[layer])?, take(&v[layer])?))
            }
            KvStore::Device { k, v, head_dim, .. } => {
                let idx = match rows_on_device {
                    Some(t) => t.clone(),
                    None => candle_core::Tensor::new(rows, device)?,
                };
                let hd = *head_dim;
                Ok((
                    k[layer].index_select(&idx, 0)?.reshape((kv, l, hd))?,
                    v[layer].index_select(&idx, 0)?.reshape((kv, l, hd))?,
                ))
            }
        }
    }

    /// The CPU storage of one layer, for the fused decode kernel.
    pub fn host(&self, layer: usize) -> Option<(&[f16], &[f16])> {
        match self {
            KvStore::Host { k, v, .. } => Some((&k[layer], &v[layer])),
            KvStore::Device { .. } => None,
        }
    }

    fn kv_heads(&self) -> usize {
        match self {
            KvStore::Host { kv_heads, .. } | KvStore::Device { kv_heads, .. } => *kv_heads,
        }
    }

    fn head_dim(&self) -> usize {
        match self {
            KvStore::Host { head_dim, .. } | KvStore::Device { head_dim, .. } => *head_dim,
        }
    }

    /// One layer's cache tensors, (kv * P * BLOCK_SIZE, hd) each; None for the host store.
    pub fn device(&self, layer: usize) -> Option<(&candle_core::Tensor, &candle_core::Tensor)> {
        match self {
            KvStore::Device { k, v, .. } => Some((&k[layer], &v[layer])),
            KvStore::Host { .. } => None,
        }
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

    /// The device layout (tensors, `slice_set`, `index_select`: what a GPU runs) stores and
    /// gathers exactly what the host layout does. Exercised here with CPU tensors.
    #[test]
    fn device_and_host_stores_agree() {
        use candle_core::{Device, Tensor};
        let (layers, kv, hd, blocks) = (2, 3, 8, 6);
        let dev = Device::Cpu;
        let mut host = KvStore::new(&dev, true, layers, kv, hd, blocks).unwrap();
        let mut device = KvStore::new(&dev, false, layers, kv, hd, blocks).unwrap();
        assert!(matches!(host, KvStore::Host { .. }));
        assert!(matches!(device, KvStore::Device { .. }));
        assert_eq!((host.blocks(), device.blocks()), (blocks, blocks));
        // A sequence in blocks 4, 1, 5: 40 tokens written in two steps, crossing blocks.
        let slots: Vec<u32> = [4u32, 1, 5]
            .iter()
            .flat_map(|b| (0..16).map(move |r| b * 16 + r))
            .take(40)
            .collect();
        let n = slots.len();
        for (from, to) in [(0, 23), (23, n)] {
            let m = to - from;
            let k = Tensor::arange(0f32, (m * kv * hd) as f32, &dev)
                .unwrap()
                .reshape((m, kv * hd))
                .unwrap();
            let v = (k.clone() * -1.0).unwrap();
            for store in [&mut host, &mut device] {
                let plan = store.plan_write(&slots[from..to], &dev, false).unwrap();
                store.write(1, &k, &v, &plan, &Default::default()).unwrap();
            }
        }
        let rows = host.gather_rows(&slots);
        assert_eq!(rows, device.gather_rows(&slots));
        let (hk, hv) = host.gather(1, &rows, None, &dev).unwrap();
        let (dk, dv) = device.gather(1, &rows, None, &dev).unwrap();
        assert_eq!(hk.dims(), &[kv, n, hd]);
        for (a, b) in [(hk, dk), (hv, dv)] {
            let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(a, b);
        }
        // A decode pass of three sequences, one token each, in three blocks, one of them over
        // a value already there; then the whole pools compared.
        let scattered = [slots[5], 2 * 16 + 3, 15];
        let k = (Tensor::arange(0f32, (3 * kv * hd) as f32, &dev).unwrap() + 1000.0)
            .unwrap()
            .reshape((3, kv * hd))
            .unwrap();
        let v = (k.clone() * -1.0).unwrap();
        for store in [&mut host, &mut device] {
            let plan = store.plan_write(&scattered, &dev, false).unwrap();
            store.write(1, &k, &v, &plan, &Default::default()).unwrap();
        }
        let all: Vec<u32> = (0..(blocks * 16) as u32).collect();
        let rows = host.gather_rows(&all);
        let (hk, hv) = host.gather(1, &rows, None, &dev).unwrap();
        let (dk, dv) = device.gather(1, &rows, None, &dev).unwrap();
        for (a, b) in [(hk, dk), (hv, dv)] {
            let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(a, b);
        }
        let (k1, _) = host.host(1).unwrap();
        let at = ((blocks + 2) * 16 + 3) * hd; // kv head 1, block 2, row 3
        assert_eq!(k1[at].to_f32(), (1000 + kv * hd + hd) as f32);
        // Token 30 of the second write (index 7 of it), kv head 2, value 3 of its row.
        let (k1, _) = host.host(1).unwrap();
        let (blk, r) = (slots[30] as usize / 16, slots[30] as usize % 16);
        let at = ((2 * blocks + blk) * 16 + r) * hd + 3;
        assert_eq!(k1[at].to_f32(), ((30 - 23) * kv * hd + 2 * hd + 3) as f32);
    }
}
