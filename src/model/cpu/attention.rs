//! Attention on the CPU against each sequence's pages of the f16 KV cache.
//!
//! Decode (one new token per sequence): one fused pass over the cache per kv head for all the
//! query heads that share it: scores, softmax and the weighted sum of values, with no
//! intermediate tensors. The decode step's attention cost grows with the context, so this is
//! what keeps decode fast after a long prompt.
//!
//! Prefill (a prompt's tokens at once): causal attention in tiles of 4 queries, keys transposed
//! once per kv head, only the keys each query may see, and one pass over the values per tile.
//! (Off the CPU, attention goes through candle's matrix multiplies instead.)
//!
//! Shape legend: h = query heads, kv = key/value heads (h = g * kv; query head i reads kv head
//! i / g), L = tokens in the cache, hd = head width.

use half::f16;
use rayon::prelude::*;

/// One step's query token and where its sequence's keys and values are.
pub struct PagedQuery<'a> {
    /// (h, hd)
    pub q: &'a [f32],
    /// Block table: token `p` is row `p % block` of block `blocks[p / block]` of the pools.
    pub blocks: &'a [u32],
    /// Tokens in the cache, the query's own included.
    pub len: usize,
    /// First position attended: 0, or `len - window` under a sliding window.
    pub from: usize,
}

/// Every step's query against its own sequence: pools are (kv, P, block, hd). Returns
/// (steps, h*hd). One parallel region for the whole batch, over (step, kv head) pairs: each
/// task serves the g query heads that share its kv head, so each cached row is read (and
/// converted from f16) once per group rather than once per query head.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<'s>(
    steps: &[PagedQuery<'_>],
    k_pool: &[f16],
    v_pool: &[f16],
    block: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: impl Into<Scoring<'s>>,
) -> Vec<f32> {
    let args = (block, heads, kv_heads, head_dim, scale.into());
    decode_with(steps, k_pool, v_pool, args, avx2_available())
}

/// How a query's scores are formed: scale·(q·k), then, with a soft cap c, c·tanh(s / c)
/// (Gemma 2), before the softmax; with sinks (gpt-oss), head i's softmax has exp(sinks[i])
/// in its denominator beside its keys' (llama.cpp's `soft_max_ext` with sinks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scoring<'a> {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub sinks: Option<&'a [f32]>,
}

impl From<f32> for Scoring<'static> {
    fn from(scale: f32) -> Self {
        Self {
            scale,
            softcap: None,
            sinks: None,
        }
    }
}

impl Scoring<'_> {
    /// The soft cap over a row of scaled scores, where there is one.
    fn cap(&self, row: &mut [f32]) {
        if let Some(c) = self.softcap {
            for s in row {
                *s = c * (*s / c).tanh();
            }
        }
    }

    /// Query head `head`'s row of scaled scores capped and turned into exp(s - max); returns
    /// 1 / their sum, the head's sink term included where there is one (as though the sink
    /// were one more score: exp(sink - max) with max over the scores alone, the same ratio
    /// as ggml's max over both).
    fn weights(&self, row: &mut [f32], head: usize, avx2: bool) -> f32 {
        self.cap(row);
        let sink = self.sinks.map(|s| {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            (s[head] - max).exp()
        });
        let sum = softmax_unnormalised(row, avx2);
        1.0 / (sum + sink.unwrap_or(0.0))
    }
}

/// `paged_decode_attention` with the SIMD choice made by the caller (tests run both).
fn decode_with(
    steps: &[PagedQuery<'_>],
    k_pool: &[f16],
    v_pool: &[f16],
    (block, heads, kv_heads, head_dim, scale): (usize, usize, usize, usize, Scoring<'_>),
    avx2: bool,
) -> Vec<f32> {
    debug_assert!(kv_heads > 0 && heads.is_multiple_of(kv_heads));
    let g = heads / kv_heads;
    let pool_blocks = k_pool.len() / (kv_heads * block * head_dim).max(1);
    let mut out = vec![0f32; steps.len() * heads * head_dim];
    if out.is_empty() {
        return out;
    }
    // Query heads j*g..(j+1)*g read kv head j: their rows of q and of the output are adjacent.
    let width = g * head_dim;
    // Scratch for the scores, made once per rayon job rather than once per task: with gen's
    // single malloc arena, tasks allocating side by side contend for its lock.
    out.par_chunks_mut(width)
        .enumerate()
        .for_each_init(Vec::new, |buf, (i, o)| {
            let (step, j) = (&steps[i / kv_heads], i % kv_heads);
            let group = Group {
                q: &step.q[j * width..(j + 1) * width],
                hd: head_dim,
                blocks: step.blocks,
                len: step.len,
                from: step.from.min(step.len),
                block,
                pool_blocks,
                j,
                scale,
            };
            match avx2 && head_dim.is_multiple_of(8) {
                // SAFETY: only when the CPU has AVX2, FMA and F16C, and hd is a multiple of 8.
                #[cfg(target_arch = "x86_64")]
                true => unsafe { group.run_avx2(k_pool, v_pool, o, buf) },
                _ => group.run(k_pool, v_pool, o),
            }
        });
    out
}

/// Whether the AVX2 attention code may run: decided once per process, since every layer of
/// every pass asks (reading GEN_KERNEL each time took a lock and an allocation).
fn avx2_available() -> bool {
    super::ops::simd_available()
}

/// Most query heads the AVX2 decode kernel serves in one pass over a block's rows: its
/// registers hold one accumulator per query and key row (or 8 columns), and 4 queries x 2
/// rows measured faster than 8 x 1. Larger groups go in near-equal chunks, each over the
/// block while it is still in L1.
const MAX_GROUP: usize = 4;

/// Blocks of the cache the AVX2 decode kernel asks the CPU to fetch ahead of the one it works
/// on: a sequence's blocks are scattered through the pool, where hardware prefetchers do not
/// follow them. (2 measured as good as 4 and better than 1.)
const PREFETCH: usize = 2;

/// The query heads of one kv head against that kv head's cached rows.
struct Group<'a> {
    /// (g, hd): the group's queries.
    q: &'a [f32],
    hd: usize,
    blocks: &'a [u32],
    len: usize,
    from: usize,
    block: usize,
    /// Blocks in the pool, and the kv head the group reads.
    pool_blocks: usize,
    j: usize,
    scale: Scoring<'a>,
}

impl Group<'_> {
    /// Per cached block of this kv head, from position `from` on: where its first attended
    /// row starts (in values) and how many rows it has.
    fn runs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let hd = self.hd;
        self.blocks
            .iter()
            .enumerate()
            .take_while(|(b, _)| b * self.block < self.len)
            .filter(|(b, _)| (b + 1) * self.block > self.from)
            .map(move |(b, &id)| {
                let first = b * self.block;
                let skip = self.from.saturating_sub(first);
                let base = ((self.j * self.pool_blocks + id as usize) * self.block + skip) * hd;
                (base, (self.len - first).min(self.block) - skip)
            })
    }

    /// Each cached block's attended rows of `pool` in order, with where they start among the
    /// attended positions, asking the CPU for the blocks PREFETCH ahead as it goes.
    #[cfg(target_arch = "x86_64")]
    fn prefetched<'p>(&'p self, pool: &'p [f16]) -> impl Iterator<Item = (usize, &'p [f16])> + 'p {
        let hd = self.hd;
        let mut ahead = self.runs();
        for (base, rows) in ahead.by_ref().take(PREFETCH) {
            x86::prefetch(&pool[base..base + rows * hd]);
        }
        let mut p = 0;
        self.runs().map(move |(base, rows)| {
            if let Some((base, rows)) = ahead.next() {
                x86::prefetch(&pool[base..base + rows * hd]);
            }
            p += rows;
            (p - rows, &pool[base..base + rows * hd])
        })
    }

    /// Portable: plain loops, one query head at a time.
    fn run(&self, k_pool: &[f16], v_pool: &[f16], o: &mut [f32]) {
        let hd = self.hd;
        let mut scores = Vec::with_capacity(self.len - self.from);
        for (qi, (q, o)) in self
            .q
            .chunks_exact(hd)
            .zip(o.chunks_exact_mut(hd))
            .enumerate()
        {
            scores.clear();
            for (base, n) in self.runs() {
                for r in 0..n {
                    let at = base + r * hd;
                    scores.push(dot_f16(q, &k_pool[at..at + hd]) * self.scale.scale);
                }
            }
            if scores.is_empty() {
                continue;
            }
            let head = self.j * (self.q.len() / hd) + qi;
            let inv = self.scale.weights(&mut scores, head, false);
            let mut p = 0;
            for (base, n) in self.runs() {
                for r in 0..n {
                    let at = base + r * hd;
                    let w = scores[p] * inv;
                    p += 1;
                    for (o, x) in o.iter_mut().zip(&v_pool[at..at + hd]) {
                        *o += w * x.to_f32();
                    }
                }
            }
        }
    }

    /// AVX2, block by block of the cache: each block's key rows are scored against all the
    /// group's queries while they sit in L1, then (after a vectorised softmax per query) each
    /// block's value rows are added into all the queries' outputs, so every row is read from
    /// memory once per group. Queries go MAX_GROUP or fewer at a time (one accumulator per
    /// query and key row, or per query and 8 columns, in registers). hd must be a multiple
    /// of 8.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, k_pool: &[f16], v_pool: &[f16], o: &mut [f32], buf: &mut Vec<f32>) {
        let hd = self.hd;
        let g = self.q.len() / hd;
        let n = self.len - self.from;
        if n == 0 || g == 0 {
            return;
        }
        // Near-equal chunks: g = 8 as 4 + 4, g = 5 as 3 + 2.
        let size = g.div_ceil(g.div_ceil(MAX_GROUP));
        let chunks = || (0..g).step_by(size).map(move |q0| (q0, size.min(g - q0)));
        // Scores (g, n), one row per query, then each query's 1 / (sum of its weights).
        // Every score is written before it is read; the sums are set by the softmax.
        buf.clear();
        buf.resize(g * n + g, 0.0);
        let (scores, inv) = buf.split_at_mut(g * n);
        for (p, keys) in self.prefetched(k_pool) {
            for (q0, c) in chunks() {
                let q = &self.q[q0 * hd..(q0 + c) * hd];
                let s = &mut scores[q0 * n..(q0 + c) * n];
                // <queries, key rows per step>
                match c {
                    1 => x86::block_scores::<1, 4>(q, keys, self.scale.scale, s, p),
                    2 => x86::block_scores::<2, 4>(q, keys, self.scale.scale, s, p),
                    3 => x86::block_scores::<3, 2>(q, keys, self.scale.scale, s, p),
                    4 => x86::block_scores::<4, 2>(q, keys, self.scale.scale, s, p),
                    _ => unreachable!("chunks of at most MAX_GROUP = 4 queries"),
                }
            }
        }
        for (qi, (inv, row)) in inv.iter_mut().zip(scores.chunks_exact_mut(n)).enumerate() {
            *inv = self.scale.weights(row, self.j * g + qi, true);
        }
        for (p, vals) in self.prefetched(v_pool) {
            for (q0, c) in chunks() {
                let w = &scores[q0 * n..(q0 + c) * n];
                let o = &mut o[q0 * hd..(q0 + c) * hd];
                // <queries, 8-lane columns per pass>
                match c {
                    1 => x86::block_weighted::<1, 8>(w, p, vals, o),
                    2 => x86::block_weighted::<2, 4>(w, p, vals, o),
                    3 => x86::block_weighted::<3, 2>(w, p, vals, o),
                    4 => x86::block_weighted::<4, 2>(w, p, vals, o),
                    _ => unreachable!("chunks of at most MAX_GROUP = 4 queries"),
                }
            }
        }
        for (o, &inv) in o.chunks_exact_mut(hd).zip(inv.iter()) {
            for x in o {
                *x *= inv;
            }
        }
    }
}

/// Tokens per task of the prefill kernel: a task serves these tokens' queries of every query
/// head that shares one kv head (QT x g queries), so each key and value is loaded once for all
/// of them.
const QT: usize = 4;
/// Keys per panel: each kv head's keys are gathered, transposed, into panels of KT keys x hd
/// (dimension-major), so the score kernel reads one contiguous 64-byte row per dimension.
/// (A plain (hd, L) transpose put the rows of a dimension L * 4 bytes apart: at lengths near
/// a multiple of 1,024 every row fell in the same L1 set.)
const KT: usize = 16;
/// Queries per chunk of the score and value passes: the 512-bit kernels take it 8 queries at a
/// time against two registers of keys (two panels) or of value columns, 16 accumulators (16
/// queries against one register each needed a broadcast for every multiply-add, 5-8% slower
/// at 400-1,000 tokens on Zen 5); the AVX2 ones take the chunk in pieces of `QR_AVX2`. (6 at a
/// time on 512-bit registers was bound by reading the panels from L2 for each piece.)
const QR: usize = 16;
/// Queries per register tile of the AVX2 kernels: 6 queries x 2 registers of keys (or of
/// value columns) = 12 accumulators, plus the 2 loaded registers and a broadcast.
const QR_AVX2: usize = 6;

/// Causal attention of a step's T new tokens (positions pos..pos+T) against its sequence's
/// pages, on the CPU. q: (T, h*hd). Returns (T, h*hd).
///
/// Keys of each kv head are gathered once into transposed panels, values into f32 rows; then
/// one task per (kv head, QT tokens) scores its QT x g queries 6 at a time against the panels
/// (broadcasts and fused multiply-adds, no horizontal sums), only up to the last key a query
/// of the task may see; softmax per query over exactly its keys (a vectorised exp); one pass
/// over the values per 6 queries and 16 columns; results written in place. Nothing of size
/// T x L is allocated.
#[allow(clippy::too_many_arguments)]
pub fn causal_prefill_attention<'s>(
    q: &[f32],
    blocks: &[u32],
    pos: usize,
    t: usize,
    window: Option<usize>,
    k_pool: &[f16],
    v_pool: &[f16],
    block: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: impl Into<Scoring<'s>>,
) -> Vec<f32> {
    let args = (block, heads, kv_heads, head_dim, scale.into());
    prefill_with(
        q,
        blocks,
        (pos, t, window),
        k_pool,
        v_pool,
        args,
        avx2_available(),
    )
}

/// `causal_prefill_attention` with the SIMD choice made by the caller (tests run both).
#[allow(clippy::too_many_arguments)]
fn prefill_with(
    q: &[f32],
    blocks: &[u32],
    (pos, t, window): (usize, usize, Option<usize>),
    k_pool: &[f16],
    v_pool: &[f16],
    (block, heads, kv_heads, head_dim, scoring): (usize, usize, usize, usize, Scoring<'_>),
    avx2: bool,
) -> Vec<f32> {
    use half::slice::HalfFloatSliceExt;
    let scale = scoring.scale;
    let hd = head_dim;
    let l = pos + t;
    let g = heads / kv_heads;
    let panels = l.div_ceil(KT);
    let pool_blocks = k_pool.len() / (kv_heads * block * hd).max(1);
    let avx2 = avx2 && hd % 8 == 0;
    // Per kv head: keys as panels (panels, hd, KT), values as rows (panels * KT, hd); zero
    // past L. In parallel over panels.
    let gathered: Vec<(Vec<f32>, Vec<f32>)> = (0..kv_heads)
        .map(|j| {
            let mut kp = vec![0f32; panels * hd * KT];
            let mut v = vec![0f32; panels * KT * hd];
            kp.par_chunks_mut(hd * KT)
                .zip(v.par_chunks_mut(KT * hd))
                .enumerate()
                .for_each_init(
                    || vec![0f32; hd],
                    |row, (pi, (panel, vals))| {
                        for r in 0..KT.min(l - pi * KT) {
                            let p = pi * KT + r;
                            let at = ((j * pool_blocks + blocks[p / block] as usize) * block
                                + p % block)
                                * hd;
                            k_pool[at..at + hd].convert_to_f32_slice(row);
                            for (d, x) in row.iter().enumerate() {
                                panel[d * KT + r] = *x;
                            }
                            v_pool[at..at + hd]
                                .convert_to_f32_slice(&mut vals[r * hd..(r + 1) * hd]);
                        }
                    },
                );
            (kp, v)
        })
        .collect();
    let mut out = vec![0f32; t * heads * hd];
    // Each task writes only the rows of its own (kv head, tokens).
    let dst = super::ops::SharedOut(out.as_mut_ptr());
    let tiles = t.div_ceil(QT);
    // Scratch once per rayon job (see decode_with).
    let scratch = || (Vec::new(), Vec::new());
    (0..kv_heads * tiles)
        .into_par_iter()
        .for_each_init(scratch, |(scores, inv), task| {
            let (j, tile) = (task / tiles, task % tiles);
            let (kp, v) = &gathered[j];
            let t0 = tile * QT;
            let nt = (t - t0).min(QT);
            // Token tt of the tile sees keys first(tt)..seen(tt): from the start of the context,
            // or of its sliding window (keys less than `window` positions back), to itself.
            let seen = |tt: usize| pos + t0 + tt + 1;
            let first = |tt: usize| window.map_or(0, |w| seen(tt).saturating_sub(w));
            // Scores from the first panel any query of the tile needs: (nt * g, width), query
            // qi = tt * g + head.
            let p0 = first(0) / KT;
            let k0 = p0 * KT;
            let width = seen(nt - 1).div_ceil(KT) * KT - k0;
            let nq = nt * g;
            // Where query qi's row starts, in q and in the output alike: (T, h, hd).
            let row_at = |qi: usize| ((t0 + qi / g) * heads + j * g + qi % g) * hd;
            let query = |qi: usize| &q[row_at(qi)..row_at(qi) + hd];
            // Scores past a query's keys are zeroed below, before the values pass reads them.
            scores.clear();
            scores.resize(nq * width, 0.0);
            inv.clear();
            inv.resize(nq, 0.0);
            for c0 in (0..nq).step_by(QR) {
                let c = (nq - c0).min(QR);
                // Keys up to the last one the chunk's last query sees.
                let upto = seen((c0 + c - 1) / g).div_ceil(KT) - p0;
                let qs: [&[f32]; QR] = std::array::from_fn(|i| query(c0 + i.min(c - 1)));
                let qs = &qs[..c];
                let rows = &mut scores[c0 * width..(c0 + c) * width];
                let panels = &kp[p0 * hd * KT..(p0 + upto) * hd * KT];
                match avx2 {
                    // SAFETY: AVX2, FMA and F16C are present and hd is a multiple of 8.
                    #[cfg(target_arch = "x86_64")]
                    true => unsafe { x86::panel_scores(qs, panels, width, scale, rows) },
                    _ => {
                        for (qq, qv) in qs.iter().enumerate() {
                            for pi in 0..upto {
                                let panel = &panels[pi * hd * KT..(pi + 1) * hd * KT];
                                for r in 0..KT {
                                    rows[qq * width + pi * KT + r] =
                                        (0..hd).map(|d| qv[d] * panel[d * KT + r]).sum::<f32>()
                                            * scale;
                                }
                            }
                        }
                    }
                }
                // Softmax per query over the keys it sees; the others get weight 0, so one pass
                // over the values serves the whole chunk.
                for qq in 0..c {
                    let tt = (c0 + qq) / g;
                    let row = &mut rows[qq * width..(qq + 1) * width];
                    let (a, b) = (first(tt) - k0, seen(tt) - k0);
                    let head = j * g + (c0 + qq) % g;
                    inv[c0 + qq] = scoring.weights(&mut row[a..b], head, avx2);
                    row[..a].fill(0.0);
                    row[b..].fill(0.0);
                }
            }
            // Weighted sums of the values, written to each query's row of the output.
            let vals = &v[k0 * hd..(k0 + width) * hd];
            for c0 in (0..nq).step_by(QR) {
                let c = (nq - c0).min(QR);
                let span = seen((c0 + c - 1) / g) - k0;
                // Inside `out` (t * heads * hd); each query's row is this task's alone.
                let outs: [*mut f32; QR] =
                    std::array::from_fn(|i| dst.at(row_at(c0 + i.min(c - 1))));
                let outs = &outs[..c];
                let w = &scores[c0 * width..(c0 + c) * width];
                match avx2 {
                    // SAFETY: AVX2 and FMA are present; each pointer is valid for hd writes (its row of
                    // `out`) that no other task makes.
                    #[cfg(target_arch = "x86_64")]
                    true => unsafe {
                        x86::weighted_sums(w, width, &vals[..span * hd], hd, &inv[c0..c0 + c], outs)
                    },
                    _ => {
                        for (qq, &o) in outs.iter().enumerate() {
                            // SAFETY: o is this query's row of `out`, hd values no other task
                            // touches, and `out` outlives the parallel region.
                            let o = unsafe { std::slice::from_raw_parts_mut(o, hd) };
                            for (p, row) in vals[..span * hd].chunks_exact(hd).enumerate() {
                                let wt = w[qq * width + p] * inv[c0 + qq];
                                for (o, x) in o.iter_mut().zip(row) {
                                    *o += wt * x;
                                }
                            }
                        }
                    }
                }
            }
        });
    out
}

/// Replace row by exp(row - max(row)); returns the sum. (`row` is not empty.)
fn softmax_unnormalised(row: &mut [f32], avx2: bool) -> f32 {
    match avx2 {
        // SAFETY: only when the CPU has AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        true => unsafe { x86::softmax_unnormalised(row) },
        _ => {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let mut sum = 0f32;
            for s in row.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            sum
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::model::cpu::ops::x86::exp_nonpositive;
    use std::arch::x86_64::*;

    /// Whether the prefill's score and value passes run on 512-bit registers (AVX-512F, and
    /// the 256-bit kernels allowed: not under GEN_KERNEL=avx2 or scalar). Decided once.
    fn wide() -> bool {
        static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *WIDE.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && std::env::var("GEN_KERNEL").map_or(true, |v| v != "avx2" && v != "scalar")
        })
    }

    /// The prefill's score and value passes on 512-bit registers: a panel's 16 keys, or 16 of a
    /// value row's columns, in one register where the 256-bit kernels use two. Every lane does
    /// what the 256-bit kernels do for its key or column, in the same order: the same bits,
    /// with half the instructions (and on CPUs with two 512-bit FMA units, twice the rate).
    mod zmm {
        use std::arch::x86_64::*;

        /// `$body` with the const `$n` set to `$count` (1 to 16).
        macro_rules! by_count {
            ($count:expr, $n:ident => $body:expr) => {
                const_count!($count, $n => $body; 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15; 16)
            };
        }

        /// As `super::panel_scores`.
        #[target_feature(enable = "avx2,fma,avx512f")]
        pub unsafe fn panel_scores(
            queries: &[&[f32]],
            panels: &[f32],
            width: usize,
            scale: f32,
            scores: &mut [f32],
        ) {
            by_count!(queries.len(), N => panel_scores_n::<N>(queries, panels, width, scale, scores))
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")]
        unsafe fn panel_scores_n<const NQ: usize>(
            queries: &[&[f32]],
            panels: &[f32],
            width: usize,
            scale: f32,
            scores: &mut [f32],
        ) {
            const KT: usize = super::super::KT;
            const { assert!(KT == 16) };
            let hd = queries[0].len();
            let n = panels.len() / (hd * KT);
            assert!(queries.len() == NQ && scores.len() >= NQ * width && n * KT <= width);
            // The queries side by side per dimension, so that one pointer and constant
            // offsets reach all of them (16 pointers do not fit in the registers).
            const MAX_HD: usize = 512;
            assert!(hd <= MAX_HD);
            let mut packed = [0f32; 16 * MAX_HD];
            for (qq, q) in queries.iter().enumerate() {
                for (d, &x) in q.iter().enumerate() {
                    packed[d * 16 + qq] = x;
                }
            }
            // Two panels (32 keys) a pass for up to 8 queries: 16 accumulators, and two key
            // loads and 8 broadcasts for 16 multiply-adds a dimension (one panel against 16
            // queries took a load and 16 broadcasts for 16). Each score still sums over the
            // dimensions in order, as before.
            let mut pi = 0;
            while pi < n {
                let pair = if pi + 2 <= n { 2 } else { 1 };
                for q0 in (0..NQ).step_by(8) {
                    let nq = (NQ - q0).min(8);
                    let at = scores.as_mut_ptr().add(q0 * width + pi * KT);
                    let panel = panels.as_ptr().add(pi * hd * KT);
                    let qd = packed.as_ptr().add(q0);
                    match pair {
                        2 => {
                            by_count!(nq, Q => scores_pass::<Q, 2>(qd, panel, hd, scale, at, width))
                        }
                        _ => {
                            by_count!(nq, Q => scores_pass::<Q, 1>(qd, panel, hd, scale, at, width))
                        }
                    }
                }
                pi += pair;
            }
        }

        /// Q queries (their dimension d at qd + d * 16) against P consecutive panels from
        /// `panel`, times `scale`, to at + qq * width (16 * P scores each).
        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")]
        unsafe fn scores_pass<const Q: usize, const P: usize>(
            qd: *const f32,
            panel: *const f32,
            hd: usize,
            scale: f32,
            at: *mut f32,
            width: usize,
        ) {
            const KT: usize = super::super::KT;
            let mut acc = [[_mm512_setzero_ps(); P]; Q];
            for d in 0..hd {
                let mut kv = [_mm512_setzero_ps(); P];
                for (p, kv) in kv.iter_mut().enumerate() {
                    *kv = _mm512_loadu_ps(panel.add((p * hd + d) * KT));
                }
                let q = qd.add(d * 16);
                for (qq, acc) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*q.add(qq));
                    for (acc, kv) in acc.iter_mut().zip(&kv) {
                        *acc = _mm512_fmadd_ps(b, *kv, *acc);
                    }
                }
            }
            let sv = _mm512_set1_ps(scale);
            for (qq, acc) in acc.iter().enumerate() {
                for (p, acc) in acc.iter().enumerate() {
                    _mm512_storeu_ps(at.add(qq * width + p * KT), _mm512_mul_ps(*acc, sv));
                }
            }
        }

        /// As `super::weighted_sums`: 32 columns (two registers, the last 8 or 16 columns in
        /// one) for up to 8 queries a pass: two value loads and 8 broadcasts for 16
        /// multiply-adds a row. Each output still sums over the rows in order.
        #[target_feature(enable = "avx2,fma,avx512f")]
        pub unsafe fn weighted_sums(
            w: &[f32],
            width: usize,
            v: &[f32],
            hd: usize,
            inv: &[f32],
            out: &[*mut f32],
        ) {
            let nq = out.len();
            assert!(nq <= 16 && inv.len() == nq && w.len() >= nq * width);
            let rows = v.len() / hd;
            // Columns c..c + 16 (or the last 8) as a load mask.
            let mask = |c: usize| -> __mmask16 {
                match hd - c {
                    0 => 0,
                    1..=8 => 0x00FF,
                    _ => 0xFFFF,
                }
            };
            let mut c0 = 0;
            while c0 < hd {
                let m0 = mask(c0);
                let c1 = c0 + if m0 == 0xFFFF { 16 } else { 8 };
                let m1 = if c1 < hd { mask(c1) } else { 0 };
                for q0 in (0..nq).step_by(8) {
                    let n = (nq - q0).min(8);
                    let wq = w.as_ptr().add(q0 * width);
                    let (inv, out) = (&inv[q0..q0 + n], &out[q0..q0 + n]);
                    let cols = (v.as_ptr().add(c0), hd, rows, c0);
                    if m1 == 0 {
                        by_count!(n, Q => values_pass::<Q, 1>(wq, width, cols, [m0, 0], inv, out));
                    } else {
                        by_count!(n, Q => values_pass::<Q, 2>(wq, width, cols, [m0, m1], inv, out));
                    }
                }
                c0 = c1
                    + if m1 == 0xFFFF {
                        16
                    } else if m1 == 0 {
                        0
                    } else {
                        8
                    };
            }
        }

        /// Q queries' weights (query qq's at wq + qq * width) times P registers of value
        /// columns (`masks`; from vc = v + c0, `rows` rows of hd), times inv[qq], to
        /// out[qq] + c0.
        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")]
        unsafe fn values_pass<const Q: usize, const P: usize>(
            wq: *const f32,
            width: usize,
            (vc, hd, rows, c0): (*const f32, usize, usize, usize),
            masks: [__mmask16; 2],
            inv: &[f32],
            out: &[*mut f32],
        ) {
            let mut acc = [[_mm512_setzero_ps(); P]; Q];
            for p in 0..rows {
                let mut x = [_mm512_setzero_ps(); P];
                for (k, x) in x.iter_mut().enumerate() {
                    *x = _mm512_maskz_loadu_ps(masks[k], vc.add(p * hd + 16 * k));
                }
                for (qq, acc) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*wq.add(qq * width + p));
                    for (acc, x) in acc.iter_mut().zip(&x) {
                        *acc = _mm512_fmadd_ps(b, *x, *acc);
                    }
                }
            }
            for (qq, acc) in acc.iter().enumerate() {
                let iv = _mm512_set1_ps(inv[qq]);
                for (k, acc) in acc.iter().enumerate() {
                    let o = out[qq].add(c0 + 16 * k);
                    _mm512_mask_storeu_ps(o, masks[k], _mm512_mul_ps(*acc, iv));
                }
            }
        }
    }

    /// Scores of up to QR queries against key panels (each (hd, KT), dimension-major), times
    /// `scale`, into scores[qq * width + p] for p < panels * KT.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn panel_scores(
        queries: &[&[f32]],
        panels: &[f32],
        width: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        if wide() {
            return zmm::panel_scores(queries, panels, width, scale, scores);
        }
        for (i, qs) in queries.chunks(super::QR_AVX2).enumerate() {
            let scores = &mut scores[i * super::QR_AVX2 * width..];
            match qs.len() {
                1 => panel_scores_n::<1>(qs, panels, width, scale, scores),
                2 => panel_scores_n::<2>(qs, panels, width, scale, scores),
                3 => panel_scores_n::<3>(qs, panels, width, scale, scores),
                4 => panel_scores_n::<4>(qs, panels, width, scale, scores),
                5 => panel_scores_n::<5>(qs, panels, width, scale, scores),
                _ => panel_scores_n::<6>(qs, panels, width, scale, scores),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn panel_scores_n<const NQ: usize>(
        queries: &[&[f32]],
        panels: &[f32],
        width: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        const { assert!(super::KT == 16) };
        let hd = queries[0].len();
        let n = panels.len() / (hd * super::KT);
        assert!(queries.len() == NQ && scores.len() >= NQ * width && n * super::KT <= width);
        let qp: [*const f32; NQ] = std::array::from_fn(|qq| queries[qq].as_ptr());
        let sv = _mm256_set1_ps(scale);
        for pi in 0..n {
            let panel = panels.as_ptr().add(pi * hd * super::KT);
            let mut acc = [[_mm256_setzero_ps(); 2]; NQ];
            for d in 0..hd {
                let k0v = _mm256_loadu_ps(panel.add(d * super::KT));
                let k1v = _mm256_loadu_ps(panel.add(d * super::KT + 8));
                for (acc, q) in acc.iter_mut().zip(&qp) {
                    let b = _mm256_broadcast_ss(&*q.add(d));
                    acc[0] = _mm256_fmadd_ps(b, k0v, acc[0]);
                    acc[1] = _mm256_fmadd_ps(b, k1v, acc[1]);
                }
            }
            for (qq, acc) in acc.iter().enumerate() {
                let at = scores.as_mut_ptr().add(qq * width + pi * super::KT);
                _mm256_storeu_ps(at, _mm256_mul_ps(acc[0], sv));
                _mm256_storeu_ps(at.add(8), _mm256_mul_ps(acc[1], sv));
            }
        }
    }

    /// Scores of G queries (q: (G, hd)) against one block's key rows (f16, (rows, hd)), times
    /// `scale`, into columns p..p + rows of scores (G, n). Each key vector is converted from
    /// f16 once for all G queries.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn block_scores<const G: usize, const R: usize>(
        q: &[f32],
        keys: &[half::f16],
        scale: f32,
        scores: &mut [f32],
        p: usize,
    ) {
        let hd = q.len() / G;
        let n = scores.len() / G;
        let rows = keys.len() / hd;
        assert!(q.len() == G * hd && hd.is_multiple_of(8) && p + rows <= n);
        let mut r = 0;
        while r + R <= rows {
            let s = dots::<G, R>(q, &keys[r * hd..(r + R) * hd], scale);
            for qq in 0..G {
                for rr in 0..R {
                    *scores.get_unchecked_mut(qq * n + p + r + rr) = s[qq * R + rr];
                }
            }
            r += R;
        }
        while r < rows {
            let s = dots::<G, 1>(q, &keys[r * hd..(r + 1) * hd], scale);
            for (qq, s) in s.iter().take(G).enumerate() {
                *scores.get_unchecked_mut(qq * n + p + r) = *s;
            }
            r += 1;
        }
    }

    /// scale * (q[qq] . keys[r]) for G queries (q: (G, hd)) and R consecutive key rows (f16,
    /// (R, hd)), at [qq * R + r]: G * R independent accumulator chains, each key vector
    /// converted once, then one horizontal reduction for all of them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots<const G: usize, const R: usize>(
        q: &[f32],
        keys: &[half::f16],
        scale: f32,
    ) -> [f32; 8] {
        const { assert!(G * R <= 8) };
        let hd = q.len() / G;
        debug_assert!(keys.len() == R * hd && hd.is_multiple_of(8));
        let (pq, pk) = (q.as_ptr(), keys.as_ptr() as *const u16);
        let mut acc = [[_mm256_setzero_ps(); R]; G];
        let mut d = 0;
        while d < hd {
            let mut kv = [_mm256_setzero_ps(); R];
            for (r, kv) in kv.iter_mut().enumerate() {
                *kv = _mm256_cvtph_ps(_mm_loadu_si128(pk.add(r * hd + d) as *const __m128i));
            }
            for (qq, acc) in acc.iter_mut().enumerate() {
                let qv = _mm256_loadu_ps(pq.add(qq * hd + d));
                for (a, kv) in acc.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(qv, *kv, *a);
                }
            }
            d += 8;
        }
        let mut all = [_mm256_setzero_ps(); 8];
        for (qq, acc) in acc.iter().enumerate() {
            all[qq * R..(qq + 1) * R].copy_from_slice(acc);
        }
        // Pairwise sums: after two rounds, lane i of each 128-bit half holds half of vector
        // i's sum (i < 4 in `lo`, i >= 4 in `hi`).
        let lo = _mm256_hadd_ps(
            _mm256_hadd_ps(all[0], all[1]),
            _mm256_hadd_ps(all[2], all[3]),
        );
        let mut out = [0f32; 8];
        if G * R <= 4 {
            let s = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
            _mm_storeu_ps(out.as_mut_ptr(), _mm_mul_ps(s, _mm_set1_ps(scale)));
        } else {
            let hi = _mm256_hadd_ps(
                _mm256_hadd_ps(all[4], all[5]),
                _mm256_hadd_ps(all[6], all[7]),
            );
            let s = _mm256_add_ps(
                _mm256_permute2f128_ps(lo, hi, 0x20),
                _mm256_permute2f128_ps(lo, hi, 0x31),
            );
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(s, _mm256_set1_ps(scale)));
        }
        out
    }

    /// o[qq] += sum over one block's rows r of w[qq][p + r] * v[r], for G queries: w (G, n),
    /// v (rows, hd) in f16, o (G, hd). 8 * LANES columns per pass over the rows (which stay in
    /// L1), then 8; each value vector is converted once for all G queries.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn block_weighted<const G: usize, const LANES: usize>(
        w: &[f32],
        p: usize,
        v: &[half::f16],
        o: &mut [f32],
    ) {
        let hd = o.len() / G;
        let n = w.len() / G;
        let rows = v.len() / hd;
        assert!(o.len() == G * hd && hd.is_multiple_of(8) && p + rows <= n);
        let mut c0 = 0;
        while c0 + 8 * LANES <= hd {
            columns::<G, LANES>(w, n, p, v, rows, c0, o);
            c0 += 8 * LANES;
        }
        while c0 < hd {
            columns::<G, 1>(w, n, p, v, rows, c0, o);
            c0 += 8;
        }
    }

    /// One pass of `block_weighted`: columns c0..c0 + 8 * LANES, accumulated in registers.
    /// The caller checks the bounds.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn columns<const G: usize, const LANES: usize>(
        w: &[f32],
        n: usize,
        p: usize,
        v: &[half::f16],
        rows: usize,
        c0: usize,
        o: &mut [f32],
    ) {
        let hd = o.len() / G;
        let (pw, pv, po) = (w.as_ptr().add(p), v.as_ptr() as *const u16, o.as_mut_ptr());
        let mut acc = [[_mm256_setzero_ps(); LANES]; G];
        for (qq, acc) in acc.iter_mut().enumerate() {
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_loadu_ps(po.add(qq * hd + c0 + c * 8));
            }
        }
        for r in 0..rows {
            let row = pv.add(r * hd + c0);
            let mut b = [_mm256_setzero_ps(); G];
            for (qq, b) in b.iter_mut().enumerate() {
                *b = _mm256_set1_ps(*pw.add(qq * n + r));
            }
            for c in 0..LANES {
                let x = _mm256_cvtph_ps(_mm_loadu_si128(row.add(c * 8) as *const __m128i));
                for (acc, b) in acc.iter_mut().zip(&b) {
                    acc[c] = _mm256_fmadd_ps(*b, x, acc[c]);
                }
            }
        }
        for (qq, acc) in acc.iter().enumerate() {
            for (c, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(po.add(qq * hd + c0 + c * 8), *acc);
            }
        }
    }

    /// Ask for every cache line `data` touches to be brought into L2 (hint T1: on an EPYC it
    /// measured faster on cold caches than fetching into L1, and as fast on warm ones).
    #[inline]
    pub fn prefetch(data: &[half::f16]) {
        let at = data.as_ptr() as *const i8;
        let skew = at as usize % 64;
        let first = at.wrapping_sub(skew);
        for off in (0..skew + std::mem::size_of_val(data)).step_by(64) {
            // SAFETY: a prefetch is a hint: it cannot fault and changes no memory.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(first.wrapping_add(off)) };
        }
    }

    /// Replace row by exp(row - max(row)); returns the sum.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax_unnormalised(row: &mut [f32]) -> f32 {
        // The maximum 8 lanes at a time (a NaN score is passed over, as f32::max does), then
        // across the lanes and the last 1..7 values.
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            m = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr()), m);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let max = lanes
            .iter()
            .chain(chunks.remainder())
            .fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mv = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        let mut chunks = row.chunks_exact_mut(8);
        for c in &mut chunks {
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
        // The last 1..7 values through the same vector exp, padded with -inf (exp 0).
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let mut buf = [f32::NEG_INFINITY; 8];
            buf[..rest.len()].copy_from_slice(rest);
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv));
            _mm256_storeu_ps(buf.as_mut_ptr(), e);
            rest.copy_from_slice(&buf[..rest.len()]);
            sum = _mm256_add_ps(sum, e);
        }
        let mut buf = [0f32; 8];
        _mm256_storeu_ps(buf.as_mut_ptr(), sum);
        buf.iter().sum()
    }

    /// For each of up to QR queries: out[qq][..hd] = inv[qq] * sum over rows p of v of
    /// w[qq * width + p] * v[p] (v: rows of hd, a multiple of 8). Each 16 columns of a value
    /// row are loaded once for all the queries.
    ///
    /// # Safety
    /// AVX2 and FMA; each out pointer valid for hd writes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sums(
        w: &[f32],
        width: usize,
        v: &[f32],
        hd: usize,
        inv: &[f32],
        out: &[*mut f32],
    ) {
        debug_assert!(v.len().is_multiple_of(hd) && v.len() / hd <= width);
        debug_assert!(w.len() >= out.len() * width && inv.len() == out.len());
        if wide() {
            return zmm::weighted_sums(w, width, v, hd, inv, out);
        }
        for (i, (out, inv)) in out
            .chunks(super::QR_AVX2)
            .zip(inv.chunks(super::QR_AVX2))
            .enumerate()
        {
            let w = &w[i * super::QR_AVX2 * width..];
            match out.len() {
                1 => weighted_sums_n::<1>(w, width, v, hd, inv, out),
                2 => weighted_sums_n::<2>(w, width, v, hd, inv, out),
                3 => weighted_sums_n::<3>(w, width, v, hd, inv, out),
                4 => weighted_sums_n::<4>(w, width, v, hd, inv, out),
                5 => weighted_sums_n::<5>(w, width, v, hd, inv, out),
                _ => weighted_sums_n::<6>(w, width, v, hd, inv, out),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted_sums_n<const NQ: usize>(
        w: &[f32],
        width: usize,
        v: &[f32],
        hd: usize,
        inv: &[f32],
        out: &[*mut f32],
    ) {
        assert!(out.len() == NQ && inv.len() == NQ && w.len() >= NQ * width);
        let rows = v.len() / hd;
        let mut c0 = 0;
        while c0 < hd {
            // 16 columns (two registers) at a time, 8 for an odd last one.
            let two = hd - c0 >= 16;
            let mut acc = [[_mm256_setzero_ps(); 2]; NQ];
            for p in 0..rows {
                let row = v.as_ptr().add(p * hd + c0);
                let x0 = _mm256_loadu_ps(row);
                let x1 = if two {
                    _mm256_loadu_ps(row.add(8))
                } else {
                    _mm256_setzero_ps()
                };
                for (qq, acc) in acc.iter_mut().enumerate() {
                    let b = _mm256_broadcast_ss(w.get_unchecked(qq * width + p));
                    acc[0] = _mm256_fmadd_ps(b, x0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(b, x1, acc[1]);
                }
            }
            for (qq, acc) in acc.iter().enumerate() {
                let iv = _mm256_set1_ps(inv[qq]);
                let at = out[qq].add(c0);
                _mm256_storeu_ps(at, _mm256_mul_ps(acc[0], iv));
                if two {
                    _mm256_storeu_ps(at.add(8), _mm256_mul_ps(acc[1], iv));
                }
            }
            c0 += if two { 16 } else { 8 };
        }
    }
}

/// q . k with k in f16: the portable path.
fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    q.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Plain attention in f64, one head at a time.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        h: usize,
        kv: usize,
        c: usize,
        l: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f32> {
        let g = h / kv;
        let mut out = vec![0f32; h * hd];
        for i in 0..h {
            let j = i / g;
            let s: Vec<f64> = (0..l)
                .map(|t| {
                    (0..hd)
                        .map(|d| q[i * hd + d] as f64 * k[(j * c + t) * hd + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                out[i * hd + d] = (0..l)
                    .map(|t| e[t] / z * v[(j * c + t) * hd + d] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// Values the f16 cache holds exactly, so the reference sees what the kernels see.
    fn data16(n: usize, seed: u32) -> Vec<f32> {
        data(n, seed)
            .into_iter()
            .map(|x| f16::from_f32(x).to_f32())
            .collect()
    }

    /// One query per (len, from) span, each with its q, over one block table.
    fn queries<'a>(
        spans: &[(usize, usize)],
        qs: &'a [Vec<f32>],
        blocks: &'a [u32],
    ) -> Vec<PagedQuery<'a>> {
        spans
            .iter()
            .zip(qs)
            .map(|(&(len, from), q)| PagedQuery {
                q,
                blocks,
                len,
                from,
            })
            .collect()
    }

    /// Lay a contiguous (kv, L, hd) cache out in scattered blocks of `block` rows, in f16.
    fn paged(
        cache: &[f32],
        kv: usize,
        l: usize,
        hd: usize,
        block: usize,
        blocks: &[u32],
    ) -> Vec<f16> {
        let p_blocks = *blocks.iter().max().unwrap() as usize + 1;
        // Junk where no token lives.
        let mut pool: Vec<f16> = data(kv * p_blocks * block * hd, 77)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        for p in 0..l {
            let (id, r) = (blocks[p / block] as usize, p % block);
            for j in 0..kv {
                let src = &cache[(j * l + p) * hd..(j * l + p + 1) * hd];
                let at = ((j * p_blocks + id) * block + r) * hd;
                for (d, x) in pool[at..at + hd].iter_mut().zip(src) {
                    *d = f16::from_f32(*x);
                }
            }
        }
        pool
    }

    #[test]
    fn matches_plain_attention_on_ragged_sizes() {
        for &(h, kv, l, hd, block) in &[
            (9, 3, 1, 64, 16),
            (9, 3, 37, 64, 16),
            (4, 1, 10, 12, 4),
            (4, 2, 23, 256, 4),
            (2, 2, 3, 7, 2),
        ] {
            let k = data16(kv * l * hd, 2);
            let v = data16(kv * l * hd, 3);
            let n_blocks = l.div_ceil(block);
            // Distinct, out of order, with gaps: as a pool hands them out after churn.
            let blocks: Vec<u32> = (0..n_blocks as u32).rev().map(|b| b * 2 + 1).collect();
            let (kp, vp) = (
                paged(&k, kv, l, hd, block, &blocks),
                paged(&v, kv, l, hd, block, &blocks),
            );
            let scale = 1.0 / (hd as f32).sqrt();
            // Two steps of one batch: different queries, different lengths, same pages.
            let (q1, q2) = (data(h * hd, 1), data(h * hd, 9));
            let steps = [
                PagedQuery {
                    q: &q1,
                    blocks: &blocks,
                    len: l,
                    from: 0,
                },
                PagedQuery {
                    q: &q2,
                    blocks: &blocks,
                    len: l.div_ceil(2),
                    from: 0,
                },
            ];
            for avx2 in [false, avx2_available()] {
                let got = decode_with(&steps, &kp, &vp, (block, h, kv, hd, scale.into()), avx2);
                let want1 = reference(&q1, &k, &v, h, kv, l, l, hd, scale);
                let want2 = reference(&q2, &k, &v, h, kv, l, l.div_ceil(2), hd, scale);
                for (a, b) in got.iter().zip(want1.iter().chain(&want2)) {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "avx2 {avx2} h={h} kv={kv} l={l}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn causal_prefill_matches_plain_attention_on_ragged_sizes() {
        // (h, kv, pos, t, hd, block, window), through the portable and the AVX2 code (which
        // leaves hd 7 to the portable one).
        for &(h, kv, pos, t, hd, block, window) in &[
            (9, 3, 0, 37, 64, 16, None),
            (9, 3, 21, 6, 64, 16, None),
            (4, 1, 0, 1, 8, 4, None),
            (4, 2, 5, 9, 256, 4, None),
            (2, 2, 3, 5, 7, 2, None),
            (4, 2, 0, 45, 8, 4, Some(5)),
            (4, 2, 30, 19, 64, 16, Some(17)),
            (2, 1, 2, 9, 7, 2, Some(3)),
            // Groups of 5, 8 and 12 query heads: a task's queries go 6 at a time, so chunks
            // hold parts of two tokens.
            (10, 2, 7, 11, 64, 16, None),
            (8, 1, 0, 23, 16, 4, Some(9)),
            (12, 1, 3, 9, 256, 16, None),
            (8, 2, 40, 7, 24, 16, Some(20)),
            // Gemma 4's global layers: heads of 512.
            (8, 1, 4, 21, 512, 16, None),
        ] {
            let l = pos + t;
            let k = data16(kv * l * hd, 2);
            let v = data16(kv * l * hd, 3);
            let n_blocks = l.div_ceil(block);
            let blocks: Vec<u32> = (0..n_blocks as u32).rev().map(|b| b * 2 + 1).collect();
            let (kp, vp) = (
                paged(&k, kv, l, hd, block, &blocks),
                paged(&v, kv, l, hd, block, &blocks),
            );
            let q = data(t * h * hd, 5);
            let scale = 1.0 / (hd as f32).sqrt();
            // Keys from..to of each kv head, as a contiguous cache.
            let span = |c: &[f32], from: usize, to: usize| -> Vec<f32> {
                (0..kv)
                    .flat_map(|j| c[(j * l + from) * hd..(j * l + to) * hd].to_vec())
                    .collect()
            };
            for avx2 in [false, avx2_available()] {
                let args = (block, h, kv, hd, scale.into());
                let got = prefill_with(&q, &blocks, (pos, t, window), &kp, &vp, args, avx2);
                for tt in 0..t {
                    let to = pos + tt + 1;
                    let from = window.map_or(0, |w| to.saturating_sub(w));
                    let n = to - from;
                    let qt = &q[tt * h * hd..(tt + 1) * h * hd];
                    let (ks, vs) = (span(&k, from, to), span(&v, from, to));
                    let want = reference(qt, &ks, &vs, h, kv, n, n, hd, scale);
                    for (a, b) in got[tt * h * hd..(tt + 1) * h * hd].iter().zip(&want) {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "avx2 {avx2} h={h} kv={kv} pos={pos} t={t} hd={hd} window {window:?} \
                             token {tt}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// Query heads sharing a kv head in groups of 1 to 12 (so also in chunks), head widths
    /// 64, 256 and 512 (Gemma 4's global layers), lengths that end mid-block and windows that start mid-block or on a block
    /// boundary: the grouped AVX2 kernel and the portable one against the f64 reference.
    #[test]
    fn grouped_query_heads_match_plain_attention() {
        let (kv, l, block) = (2, 53, 16);
        // (len, from) per step of one batch.
        let spans = [(53, 0), (37, 0), (53, 20), (40, 32), (1, 0), (33, 31)];
        for g in [1, 3, 4, 5, 8, 12] {
            for hd in [64, 256, 512] {
                let h = g * kv;
                let k = data16(kv * l * hd, 2);
                let v = data16(kv * l * hd, 3);
                let blocks: Vec<u32> = (0..l.div_ceil(block) as u32).rev().map(|b| b * 3).collect();
                let (kp, vp) = (
                    paged(&k, kv, l, hd, block, &blocks),
                    paged(&v, kv, l, hd, block, &blocks),
                );
                let scale = 1.0 / (hd as f32).sqrt();
                let qs: Vec<Vec<f32>> = (0..spans.len())
                    .map(|i| data(h * hd, 11 + i as u32))
                    .collect();
                let steps = queries(&spans, &qs, &blocks);
                // Rows from..to of each kv head, as a contiguous cache.
                let span = |c: &[f32], from: usize, to: usize| -> Vec<f32> {
                    (0..kv)
                        .flat_map(|j| c[(j * l + from) * hd..(j * l + to) * hd].to_vec())
                        .collect()
                };
                for avx2 in [false, avx2_available()] {
                    let got = decode_with(&steps, &kp, &vp, (block, h, kv, hd, scale.into()), avx2);
                    for (i, (&(len, from), q)) in spans.iter().zip(&qs).enumerate() {
                        let (ks, vs) = (span(&k, from, len), span(&v, from, len));
                        let n = len - from;
                        let want = reference(q, &ks, &vs, h, kv, n, n, hd, scale);
                        let got = &got[i * h * hd..(i + 1) * h * hd];
                        for (x, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                (a - b).abs() < 1e-5,
                                "avx2 {avx2} g={g} hd={hd} len={len} from={from} head {}: \
                                 {a} vs {b}",
                                x / hd
                            );
                        }
                    }
                }
            }
        }
    }

    /// A query's output is the same bits alone or beside others (a speculative check's
    /// queries, windowed).
    #[test]
    fn a_query_alone_or_beside_others_gives_the_same_bits() {
        let (kv, l, block, hd, g) = (2, 53, 16, 128, 1);
        let h = g * kv;
        let k = data16(kv * l * hd, 2);
        let v = data16(kv * l * hd, 3);
        let blocks: Vec<u32> = (0..l.div_ceil(block) as u32).collect();
        let (kp, vp) = (
            paged(&k, kv, l, hd, block, &blocks),
            paged(&v, kv, l, hd, block, &blocks),
        );
        let spans: Vec<(usize, usize)> = (41..49).map(|len| (len, len - 32)).collect();
        let qs: Vec<Vec<f32>> = (0..spans.len())
            .map(|i| data(h * hd, 11 + i as u32))
            .collect();
        let steps = queries(&spans, &qs, &blocks);
        for avx2 in [false, avx2_available()] {
            let args = (block, h, kv, hd, Scoring::from(0.1));
            let all = decode_with(&steps, &kp, &vp, args, avx2);
            for (i, st) in steps.iter().enumerate() {
                let one = decode_with(std::slice::from_ref(st), &kp, &vp, args, avx2);
                let got = &all[i * h * hd..(i + 1) * h * hd];
                assert!(
                    got.iter()
                        .zip(&one)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "avx2 {avx2}: query {i} (len {}, from {})",
                    st.len,
                    st.from
                );
            }
        }
    }

    /// A sliding window: only positions from..len count, whichever block they start in.
    #[test]
    fn a_window_attends_to_the_last_positions_only() {
        let (h, kv, l, hd, block) = (4, 2, 37, 8, 4);
        let k = data16(kv * l * hd, 2);
        let v = data16(kv * l * hd, 3);
        let blocks: Vec<u32> = (0..l.div_ceil(block) as u32).rev().collect();
        let (kp, vp) = (
            paged(&k, kv, l, hd, block, &blocks),
            paged(&v, kv, l, hd, block, &blocks),
        );
        let q = data(h * hd, 5);
        // The window's keys and values alone, as a contiguous cache of w rows.
        let tail = |c: &[f32], from: usize| -> Vec<f32> {
            (0..kv)
                .flat_map(|j| c[(j * l + from) * hd..(j * l + l) * hd].to_vec())
                .collect()
        };
        for from in [1, 6, 8, 36] {
            let steps = [PagedQuery {
                q: &q,
                blocks: &blocks,
                len: l,
                from,
            }];
            let got = paged_decode_attention(&steps, &kp, &vp, block, h, kv, hd, 0.3);
            let w = l - from;
            let want = reference(&q, &tail(&k, from), &tail(&v, from), h, kv, w, w, hd, 0.3);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "from {from}: {a} vs {b}");
            }
            let all = paged_decode_attention(
                &[PagedQuery {
                    from: 0,
                    ..steps[0]
                }],
                &kp,
                &vp,
                block,
                h,
                kv,
                hd,
                0.3,
            );
            assert!(
                all.iter().zip(&got).any(|(a, b)| (a - b).abs() > 1e-3),
                "from {from}"
            );
        }
    }
}
