//! gen's own quantized matrix kernels on the CPU: y = x W^T with W in GGUF blocks, repacked at
//! load into our layout (8-row tiles for SIMD, plain rows for the portable fallback).
//!
//! [`CpuQWeight`] is every weight type gen runs on the CPU: Q4_1 and Q8_0 (the types of the
//! default model) with their kernels here, the other quantized types through
//! [`super::quants`], F16 and BF16 through [`super::wide16`]; [`schedule`] splits every product
//! among the threads. The kernels here exist for two reasons. Accuracy: candle
//! 0.11 rounds the Q8_1 block sum to f16 twice (`f16(sum) * f16(d)`), which shifts every Q4_1
//! dot product enough to change greedy tokens within a few steps; here activations are
//! quantized exactly as llama.cpp does (`s = f16(d * sum)` with `d` in f32). Speed: one pass
//! over a multi-token input reads each weight row once for all tokens, and the dot products use
//! AVX2 (or AVX-512 VNNI) chosen at run time, with a portable scalar fallback.
//!
//! Shape legend: T = input rows (tokens), K = input width, N = output width (weight rows).
//! Blocks are 32 values: Q4_1 = {d: f16, m: f16, qs: [u8; 16]} (value = d * nibble + m),
//! Q8_0 = {d: f16, qs: [i8; 32]}, Q8_1 = {d: f16, s: f16, qs: [i8; 32]} with s = d * sum(qs).

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use rayon::prelude::*;

use super::buf::Buf;
use super::ops::SharedOut;
pub use super::q8::Kernel;
use super::q8::{quantize_block, through_f16, Call, PREFETCH_AHEAD};
use super::quants::{self, QType};
use super::wide16::{self as half_kernels, Half, HalfTiles};

#[cfg(target_arch = "x86_64")]
mod zmm;

/// `$body` with the const `$k` set to the token count `$n` (1 to 8; more counts as 8).
macro_rules! with_tokens {
    ($n:expr, $k:ident => $body:expr) => {
        const_count!($n, $k => $body; 1 2 3 4 5 6 7; 8)
    };
}

/// `$body` with the const `$k` set to `$n` (1 to [`super::bf16_dot::TOKENS`], 12).
#[cfg(target_arch = "x86_64")]
macro_rules! bf16_tokens {
    ($n:expr, $k:ident => $body:expr) => {
        const_count!($n, $k => $body; 1 2 3 4 5 6 7 8 9 10 11; 12)
    };
}

/// `$body` with the const `$t` set to the [`QType`] `$ty` as u8 (the kernels' const generic).
#[rustfmt::skip]
macro_rules! with_qtype {
    ($ty:expr, $t:ident => $body:expr) => {
        match $ty {
            QType::Q4_0 => { const $t: u8 = QType::Q4_0 as u8; $body }
            QType::Q5_0 => { const $t: u8 = QType::Q5_0 as u8; $body }
            QType::Q5_1 => { const $t: u8 = QType::Q5_1 as u8; $body }
            QType::Q2K => { const $t: u8 = QType::Q2K as u8; $body }
            QType::Q3K => { const $t: u8 = QType::Q3K as u8; $body }
            QType::Q4K => { const $t: u8 = QType::Q4K as u8; $body }
            QType::Q5K => { const $t: u8 = QType::Q5K as u8; $body }
            QType::Q6K => { const $t: u8 = QType::Q6K as u8; $body }
            QType::Iq4Nl => { const $t: u8 = QType::Iq4Nl as u8; $body }
            QType::Iq4Xs => { const $t: u8 = QType::Iq4Xs as u8; $body }
            QType::Mxfp4 => { const $t: u8 = QType::Mxfp4 as u8; $body }
        }
    };
}

const QK: usize = 32;
const Q4_1_BYTES: usize = 20;
const Q8_0_BYTES: usize = 34;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightType {
    Q4_1,
    Q8_0,
    /// Every other quantized type: [`super::quants`].
    Quant(QType),
    /// F16 and BF16: [`super::wide16`].
    Half(Half),
}

/// Rows of 32-value blocks, repacked for the kernels: each block's scale (and Q4_1's minimum,
/// or Q8_1's sum) as f32, converted from f16 once, and the packed quants apart from them, so
/// the inner loop does no f16 conversion and loads aligned runs of quants.
struct Blocks {
    /// d of every block.
    scale: Vec<f32>,
    /// Q4_1 weights: m of every block. Q8_1 activations: s = d * sum(q). Q8_0: empty.
    offset: Vec<f32>,
    /// Quants, `per_block` bytes a block: 16 (two nibbles a byte) for Q4_1, 32 for Q8.
    qs: Vec<u8>,
    per_block: usize,
    /// Blocks in a row: K / 32.
    row_blocks: usize,
}

/// One row of `Blocks`, borrowed.
#[derive(Clone, Copy)]
struct Row<'a> {
    scale: &'a [f32],
    offset: &'a [f32],
    qs: &'a [u8],
}

impl Blocks {
    fn row(&self, r: usize) -> Row<'_> {
        let (b0, b1) = (r * self.row_blocks, (r + 1) * self.row_blocks);
        Row {
            scale: &self.scale[b0..b1],
            offset: if self.offset.is_empty() {
                &[]
            } else {
                &self.offset[b0..b1]
            },
            qs: &self.qs[b0 * self.per_block..b1 * self.per_block],
        }
    }

    /// Repack GGUF blocks (`block_bytes` each: f16 d, [f16 m,] quants).
    fn from_gguf(raw: &[u8], ty: WeightType, row_blocks: usize) -> Self {
        let (block_bytes, header, per_block) = match ty {
            WeightType::Q4_1 => (Q4_1_BYTES, 4, 16),
            WeightType::Q8_0 => (Q8_0_BYTES, 2, 32),
            WeightType::Quant(_) | WeightType::Half(_) => {
                unreachable!("these types have their own tiles")
            }
        };
        let n = raw.len() / block_bytes;
        let mut b = Blocks {
            scale: Vec::with_capacity(n),
            offset: Vec::with_capacity(if ty == WeightType::Q4_1 { n } else { 0 }),
            qs: Vec::with_capacity(n * per_block),
            per_block,
            row_blocks,
        };
        for blk in raw.chunks_exact(block_bytes) {
            b.scale.push(f16_at(blk, 0));
            if ty == WeightType::Q4_1 {
                b.offset.push(f16_at(blk, 2));
            }
            b.qs.extend_from_slice(&blk[header..]);
        }
        b
    }
}

/// Weight rows in groups of 8, interleaved so one 32-byte load holds 4 quants of each of the 8
/// rows: a multiply-add of that against 4 activation quants broadcast to every lane gives the
/// 8 rows' partial dot products in the 8 lanes of a register, with no horizontal sums, and
/// each block's scales apply to 8 rows in one vector multiply.
///
/// Per group of 8 rows and per block: Q4_1 has 4 chunks of 32 bytes, chunk c holding bytes
/// 4c..4c+4 of each row's 16 (low nibbles: values 4c..4c+4, high nibbles: values 16+4c..);
/// Q8_0 has 8 chunks, chunk c holding values 4c..4c+4 of each row. Then the 8 rows' d (and m)
/// as f16, as the file has them. Rows past N (the last group's padding) are zero.
struct Tiles {
    qs: Buf<u8>,
    /// f16 bits, as in the file: widened in the kernel (one instruction per 8 rows and block),
    /// so a decode step, which reads every weight once from memory, reads 20 bytes per 32
    /// Q4_1 weights instead of 24 (34 instead of 36 for Q8_0).
    d: Buf<u16>,
    m: Buf<u16>,
    groups: usize,
    /// Blocks in a row: K / 32.
    nb: usize,
    /// Quant bytes of one block of one group: 128 (Q4_1) or 256 (Q8_0).
    per_block: usize,
}

/// One group of 8 rows of `Tiles`, borrowed.
#[derive(Clone, Copy)]
struct Tile<'a> {
    qs: &'a [u8],
    d: &'a [u16],
    m: &'a [u16],
}

impl Tiles {
    /// `rows` rows of `nb` GGUF blocks each (f16 d, [f16 m,] quants), straight into tiles, the
    /// scales' bits as the file has them. Row groups are repacked in parallel.
    fn from_gguf(raw: &[u8], ty: WeightType, rows: usize, nb: usize) -> Self {
        use rayon::prelude::*;
        let q4_1 = ty == WeightType::Q4_1;
        let (block_bytes, header, per_block) = match q4_1 {
            true => (Q4_1_BYTES, 4, 128),
            false => (Q8_0_BYTES, 2, 256),
        };
        let groups = rows.div_ceil(8);
        let mut qs = super::buf::zeroed::<u8>(groups * nb * per_block);
        let mut d = super::buf::zeroed::<u16>(groups * nb * 8);
        let mut m = super::buf::zeroed::<u16>(if q4_1 { groups * nb * 8 } else { 0 });
        let block = |row: usize, blk: usize| &raw[(row * nb + blk) * block_bytes..][..block_bytes];
        let bits = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        let real = |g: usize| 8.min(rows - g * 8);
        qs.par_chunks_mut(nb * per_block)
            .zip(d.par_chunks_mut(nb * 8))
            .enumerate()
            .for_each(|(g, (qs, d))| {
                // Block by block, so each tile block is written whole before the next.
                for (blk, (qs, d)) in qs
                    .chunks_exact_mut(per_block)
                    .zip(d.chunks_exact_mut(8))
                    .enumerate()
                {
                    for r in 0..real(g) {
                        let b = block(g * 8 + r, blk);
                        d[r] = bits(b, 0);
                        for (c, q) in b[header..].chunks_exact(4).enumerate() {
                            qs[c * 32 + r * 4..c * 32 + r * 4 + 4].copy_from_slice(q);
                        }
                    }
                }
            });
        if q4_1 {
            m.par_chunks_mut(nb * 8).enumerate().for_each(|(g, m)| {
                for r in 0..real(g) {
                    for blk in 0..nb {
                        m[blk * 8 + r] = bits(block(g * 8 + r, blk), 2);
                    }
                }
            });
        }
        Tiles {
            qs: qs.into(),
            d: d.into(),
            m: m.into(),
            groups,
            nb,
            per_block,
        }
    }

    fn tile(&self, g: usize) -> Tile<'_> {
        let nb = self.nb;
        Tile {
            qs: &self.qs[g * nb * self.per_block..(g + 1) * nb * self.per_block],
            d: &self.d[g * nb * 8..(g + 1) * nb * 8],
            m: if self.m.is_empty() {
                &[]
            } else {
                &self.m[g * nb * 8..(g + 1) * nb * 8]
            },
        }
    }

    /// Groups of `other` after ours (both hold whole groups of 8 real rows).
    fn append(&mut self, other: Tiles) {
        self.qs.append(&other.qs);
        self.d.append(&other.d);
        self.m.append(&other.m);
        self.groups += other.groups;
    }
}

/// How a weight is laid out: plain rows for the portable scalar kernel, 8-row tiles for SIMD.
enum Layout {
    Rows(Blocks),
    Tiles(Tiles),
    /// The types of [`super::quants`], in their tiles for every kernel (scalar included).
    Quant(quants::Tiles),
    /// F16 and BF16, column-interleaved.
    Half(HalfTiles),
}

/// A weight matrix (N, K) in our own CPU layout.
pub struct CpuQWeight {
    ty: WeightType,
    rows: usize, // N
    cols: usize, // K
    layout: Layout,
    /// The instruction set the layout was made for (Scalar: rows; the others: tiles).
    kernel: Kernel,
    /// The path each kind of call takes ([`Call`]): `kernel` until [`Self::set_paths`]
    /// gives the ones measured fastest on this machine ([`super::choice`]).
    paths: [Kernel; 3],
    /// The file's tensors these rows are, in order, with their row counts (several for a
    /// fused projection): what the tile cache files them under. Empty when not named.
    parts: Vec<(String, usize)>,
}

impl CpuQWeight {
    /// x: T rows of K values, row-major. Returns T rows of N values.
    pub fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        self.matmul_parts(x, t, &[self.rows])
            .pop()
            .expect("one part")
    }

    /// The product split by output columns: `widths` (summing to N) cut each token's N outputs
    /// into consecutive parts, returned as T rows of widths[i] values each. Fused projections
    /// (q, k, v) come out as separate buffers this way, with no copy after the product.
    pub fn matmul_parts(&self, x: &[f32], t: usize, widths: &[usize]) -> Vec<Vec<f32>> {
        self.matmul_parts_on(self.path(t), x, t, widths)
    }

    /// Whether path `kernel` computes this weight's products its own way: not AMX or
    /// `vdpbf16ps` where it would be the 512-bit path ([`Kernel::base`]): every type but BF16
    /// rows whose width is a multiple of 32.
    pub fn takes(&self, kernel: Kernel) -> bool {
        let bf16 = matches!(&self.layout, Layout::Half(t) if t.ty == Half::Bf16);
        kernel == kernel.base() || bf16 && self.cols.is_multiple_of(32)
    }

    /// The path a call of `t` tokens takes.
    pub fn path(&self, t: usize) -> Kernel {
        self.paths[Call::of(t) as usize]
    }

    /// The paths for one token, a few and a prefill chunk ([`Call`]'s order). Ignored where
    /// the layout cannot take them: a SIMD layout takes SIMD paths only, rows the scalar one.
    pub fn set_paths(&mut self, paths: [Kernel; 3]) {
        let simd = |k: Kernel| k != Kernel::Scalar;
        if paths.iter().all(|&p| simd(p) == simd(self.kernel)) {
            self.paths = paths;
        }
    }

    /// [`Self::matmul`] on the path `kernel` (of those the layout takes), whatever the call's
    /// kind: what [`super::choice`] times.
    pub fn matmul_on(&self, kernel: Kernel, x: &[f32], t: usize) -> Vec<f32> {
        let kernel = if (kernel == Kernel::Scalar) == (self.kernel == Kernel::Scalar) {
            kernel
        } else {
            self.kernel
        };
        self.matmul_parts_on(kernel, x, t, &[self.rows])
            .pop()
            .expect("one part")
    }

    fn matmul_parts_on(
        &self,
        kernel: Kernel,
        x: &[f32],
        t: usize,
        widths: &[usize],
    ) -> Vec<Vec<f32>> {
        let (n_rows, k) = (self.rows, self.cols);
        // AMX and `vdpbf16ps` are the 512-bit path but for BF16 products (`half_paired_parts`).
        let path = kernel;
        let kernel = kernel.base();
        debug_assert_eq!(x.len(), t * k);
        debug_assert_eq!(widths.iter().sum::<usize>(), n_rows);
        if t == 0 {
            return widths.iter().map(|_| Vec::new()).collect();
        }
        let with_sums = self.ty == WeightType::Q4_1;
        match &self.layout {
            Layout::Rows(blocks) => {
                let mut outs: Vec<Vec<f32>> = widths.iter().map(|&w| vec![0f32; t * w]).collect();
                // Quantize every input row once; every weight row reuses them.
                let act = quantize_rows(x, k, with_sums);
                // Computed as (N, T), in parallel over chunks of weight rows, then transposed.
                let mut out_nt = vec![0f32; n_rows * t];
                let chunk_rows = (n_rows / (rayon::current_num_threads() * 8)).clamp(16, 512);
                out_nt
                    .par_chunks_mut(chunk_rows * t)
                    .enumerate()
                    .for_each(|(c, out)| {
                        for (i, out_row) in out.chunks_mut(t).enumerate() {
                            let w = blocks.row(c * chunk_rows + i);
                            for (o, tt) in out_row.iter_mut().zip(0..) {
                                *o = match self.ty {
                                    WeightType::Q4_1 => dot_q4_1_q8_1_scalar(w, act.row(tt)),
                                    WeightType::Q8_0 => dot_q8_0_q8_0_scalar(w, act.row(tt)),
                                    WeightType::Quant(_) | WeightType::Half(_) => {
                                        unreachable!("own tiles")
                                    }
                                };
                            }
                        }
                    });
                let mut row0 = 0;
                for (o, &w) in outs.iter_mut().zip(widths) {
                    for n in 0..w {
                        for tt in 0..t {
                            o[tt * w + n] = out_nt[(row0 + n) * t + tt];
                        }
                    }
                    row0 += w;
                }
                outs
            }
            Layout::Tiles(tiles) => {
                let act = ActTiles::quantize(x, k, t, with_sums, kernel);
                schedule(
                    t,
                    k,
                    widths,
                    tiles.groups,
                    self.cut(kernel),
                    |g, groups, token, n, out, stride, real| {
                        let w1 = (groups == 2).then(|| tiles.tile(g + 1));
                        // SAFETY: as `schedule` promises for out; tiles and activations hold the
                        // same block count.
                        unsafe {
                            self.tile_dot(
                                kernel,
                                tiles.tile(g),
                                w1,
                                &act,
                                token,
                                n,
                                out,
                                stride,
                                real,
                            )
                        }
                    },
                )
            }
            Layout::Quant(tiles) => self.quant_parts(tiles, kernel, x, t, widths),
            #[cfg(target_arch = "x86_64")]
            Layout::Half(tiles) if path != kernel && self.takes(path) => {
                self.half_paired_parts(path, tiles, x, t, widths)
            }
            Layout::Half(tiles) => {
                let stream = t.div_ceil(TOKENS) <= STREAM_CHUNKS;
                // Rounded to the weights' type, as llama.cpp multiplies them (`rounded`; the
                // vdpbf16ps path rounds them itself, the same way).
                let x = half_kernels::rounded(tiles.ty, x);
                let xs = SharedIn(x.as_ptr());
                let mut cut = self.cut(kernel);
                let product = if kernel == Kernel::Avx2 && t >= WIDEN_TOKENS {
                    cut.span = WIDE_SPAN;
                    cut.per_call = WIDE_TOKENS;
                    PRODUCTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                } else if kernel == Kernel::Vnni && t >= WIDEN_TOKENS {
                    cut.block_kib = ZMM_WIDE_BLOCK_KIB;
                    PRODUCTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                } else {
                    0
                };
                schedule(
                    t,
                    k,
                    widths,
                    tiles.groups,
                    cut,
                    |g, groups, token, n, out, stride, real| {
                        // SAFETY: tokens token..token + n are rows of x; `schedule` promises out.
                        unsafe {
                            half_dot(
                                tiles,
                                kernel,
                                g,
                                groups,
                                xs.at(token * k),
                                k,
                                n,
                                out,
                                stride,
                                real,
                                stream,
                                product,
                            )
                        }
                    },
                )
            }
        }
    }

    /// [`Self::matmul_parts_on`] for BF16 weights on AMX ([`super::amx_half`]: the activations
    /// split into bf16 parts once, tokens in blocks whose parts, 6 bytes a value, stay in L2
    /// while the task's groups go through them) or on `vdpbf16ps` ([`super::bf16_dot`]: the
    /// activations rounded to bf16 once, the tokens in one block, since a call streams 2 bytes
    /// of activations a column for 32 rows' products, and each group is rearranged once per
    /// product).
    #[cfg(target_arch = "x86_64")]
    fn half_paired_parts(
        &self,
        path: Kernel,
        tiles: &HalfTiles,
        x: &[f32],
        t: usize,
        widths: &[usize],
    ) -> Vec<Vec<f32>> {
        use super::{amx_half, bf16_dot};
        let k = self.cols;
        if path == Kernel::Amx {
            let acts = amx_half::Parts::split(&half_kernels::rounded(tiles.ty, x), t, k);
            return self.paired_parts(tiles, t, widths, (amx_half::TOKENS, 128), |w, groups, c| {
                let (token, n, out, stride, real) = c;
                // SAFETY: the AMX path is only taken where `amx::ready` said so; `schedule`
                // promises out for tokens token..token + n, all in one chunk of 16 of `acts`.
                unsafe { amx_half::call(w, groups.div_ceil(2), &acts, token, n, out, stride, real) }
            });
        }
        let acts = bf16_dot::Acts::round(x, t, k);
        self.paired_parts(tiles, t, widths, (bf16_dot::TOKENS, 1 << 30), |w, groups, c| {
            let (token, n, out, stride, real) = c;
            // SAFETY: this path is only taken where `Kernel::bf16_ready` said so; `schedule`
            // promises out for tokens token..token + n, one chunk of `acts` from its start.
            unsafe {
                if groups > 2 {
                    bf16_tokens!(n, N => bf16_dot::call::<2, N>(w, &acts, token, out, stride, real))
                } else {
                    bf16_tokens!(n, N => bf16_dot::call::<1, N>(w, &acts, token, out, stride, real))
                }
            }
        })
    }

    /// A BF16 product whose calls take their groups as pairs in the layout of
    /// [`super::amx_half::prepare`] (AMX and `vdpbf16ps`): each call's 1 to 4 groups rearranged
    /// once per thread and run of calls on them ([`PREPARED`]), `tokens` a chunk and a call,
    /// blocks of `block_kib` ([`Cut`]); `call(prepared, groups, (token, n, out, stride, real))`.
    #[cfg(target_arch = "x86_64")]
    fn paired_parts(
        &self,
        tiles: &HalfTiles,
        t: usize,
        widths: &[usize],
        (tokens, block_kib): (usize, usize),
        call: impl Fn(&[u16], usize, (usize, usize, *mut f32, usize, usize)) + Sync,
    ) -> Vec<Vec<f32>> {
        let k = self.cols;
        let product = PRODUCTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cut = Cut {
            per_chunk: tokens,
            per_call: tokens,
            span: 4,
            block_kib,
        };
        schedule(
            t,
            k,
            widths,
            tiles.groups,
            cut,
            |g, groups, token, n, out, stride, real| {
                per_thread(&PREPARED, (product, g), |w, fresh| {
                    if fresh {
                        let ws: Vec<&[u16]> = (g..g + groups).map(|j| tiles.tile(j)).collect();
                        // SAFETY: both paths run only on CPUs with AVX-512 (`amx::ready`,
                        // `Kernel::bf16_ready`); each group holds k * 8 values, k a multiple of 32
                        // (`takes`).
                        unsafe { super::amx_half::prepare(&ws, k, w) };
                    }
                    call(w, groups, (token, n, out, stride, real))
                })
            },
        )
    }

    /// [`Self::matmul_parts_on`] for the types of [`super::quants`].
    fn quant_parts(
        &self,
        tiles: &quants::Tiles,
        kernel: Kernel,
        x: &[f32],
        t: usize,
        widths: &[usize],
    ) -> Vec<Vec<f32>> {
        let k = self.cols;
        let act = quants::Acts::quantize(x, k, t, tiles.ty, kernel);
        let stream = act.chunks <= STREAM_CHUNKS;
        // Several chunks of tokens: each row pair's unpacked blocks kept for the next
        // chunks ([`UNPACKED`]).
        let product = if act.chunks > 1 && tiles.ty.spec().keeps_unpacked() {
            PRODUCTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        } else {
            0
        };
        let mut cut = self.cut(kernel);
        if product != 0 {
            // At least 6 chunks a block of tokens, so that a kept pair serves 5 more
            // calls where the input is wide (the down projection's 2,816 values: 2
            // chunks at 48 KiB; 6 measured 6-8% faster for Q3_K, Q6_K and IQ4_XS).
            cut.block_kib = cut.block_kib.max(k * TOKENS * 6 / 1024);
        }
        schedule(
            t,
            k,
            widths,
            tiles.groups,
            cut,
            |g, groups, token, n, out, stride, real| {
                // SAFETY: as `schedule` promises for out; tiles and activations hold the
                // same block count.
                unsafe {
                    quant_dot(
                        tiles.ty,
                        kernel,
                        (g, tiles.tile(g)),
                        (groups == 2).then(|| tiles.tile(g + 1)),
                        act.chunk(token),
                        n,
                        out,
                        stride,
                        real,
                        (stream, product),
                    )
                }
            },
        )
    }

    /// How the product is cut into kernel calls. Row groups a call: two for the 512-bit
    /// kernels (`zmm`, `quants_zmm`, `wide16::zmm`), which come with the VNNI kernel choice,
    /// four for F16/BF16 there (`wide16::zmm::tile4`). Tokens a call: each unpacked weight
    /// block serves this many; VNNI comes with AVX-512VL's 32 vector registers, room for 8
    /// accumulators beside the 8 unpacked weight registers, or for 6 tokens' 4 sums in the
    /// F16/BF16 kernel (then 6 tokens a chunk, so that every call has 6). AVX2 has 16: 8
    /// tokens a call still beat 4 with their spills (Q8_K types 5-10% at 512 tokens), and 6
    /// tokens' even and odd sums fit beside F16/BF16's two widened columns (+8%). Tokens a
    /// block: see `schedule`.
    fn cut(&self, kernel: Kernel) -> Cut {
        let half = matches!(self.layout, Layout::Half(_));
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni if half => Cut {
                per_chunk: 6,
                per_call: 6,
                span: 4,
                block_kib: 48,
            },
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => Cut {
                per_chunk: TOKENS,
                per_call: 8,
                span: if matches!(self.layout, Layout::Rows(_)) {
                    1
                } else {
                    2
                },
                block_kib: 48,
            },
            Kernel::Avx2 if half => Cut {
                per_chunk: 6,
                per_call: 6,
                span: 1,
                block_kib: 192,
            },
            Kernel::Avx2 => Cut {
                per_chunk: TOKENS,
                per_call: 8,
                span: 1,
                block_kib: 48,
            },
            _ => Cut {
                per_chunk: TOKENS,
                per_call: 4,
                span: 1,
                block_kib: 48,
            },
        }
    }

    /// Tokens token..token + n (n <= 8, all in one chunk of `act`) against one group of 8
    /// rows, or with `w1` the next group too (16 rows, the 512-bit kernels), written to out +
    /// i * stride (the first `real` rows).
    ///
    /// # Safety
    /// `out` must be valid for writes of `real` floats at out + i * stride for i < n.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_dot(
        &self,
        kernel: Kernel,
        w: Tile<'_>,
        w1: Option<Tile<'_>>,
        act: &ActTiles,
        token: usize,
        n: usize,
        out: *mut f32,
        stride: usize,
        real: usize,
    ) {
        debug_assert!(n >= 1 && token % TOKENS + n <= TOKENS && act.nb == self.cols / QK);
        let a = act.chunk(token);
        let stream = act.chunks <= STREAM_CHUNKS;
        // SAFETY (all unsafe calls below): a SIMD kernel is only chosen when the CPU reports
        // its features (Kernel::detect); tiles and activations hold the same block count.
        macro_rules! call {
            ($m:ident, $f:ident) => {
                with_tokens!(n, N => unsafe { x86::$m::$f::<N>(w, a, out, stride, real, stream) })
            };
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(w1) = w1 {
            macro_rules! pair {
                ($f:ident) => {
                    with_tokens!(n, N => unsafe { zmm::$f::<N>(w, w1, a, out, stride, real, stream) })
                };
            }
            return match self.ty {
                WeightType::Q4_1 => pair!(tile_q4_1),
                WeightType::Q8_0 => pair!(tile_q8_0),
                _ => unreachable!("tiles hold Q4_1 or Q8_0"),
            };
        }
        debug_assert!(
            w1.is_none(),
            "pairs are only scheduled for the 512-bit kernels"
        );
        match (self.ty, kernel) {
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q4_1, Kernel::Avx2) => call!(avx2, tile_q4_1),
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q4_1, Kernel::Vnni) => call!(vnni, tile_q4_1),
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q8_0, Kernel::Avx2) if !act.wide.is_empty() => {
                with_tokens!(n, N => unsafe { x86::tile_q8_0_i16::<N>(w, a, out, stride, real, stream) })
            }
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q8_0, Kernel::Avx2) => call!(avx2, tile_q8_0),
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q8_0, Kernel::Vnni) => call!(vnni, tile_q8_0),
            _ => unreachable!("tiles are only built for SIMD kernels"),
        }
    }
}

/// How [`schedule`] cuts a product into kernel calls.
#[derive(Clone, Copy, Debug)]
struct Cut {
    /// Tokens a chunk: the quantized activations' layout (`TOKENS`), or any for f32 inputs.
    per_chunk: usize,
    /// Most tokens a call, within one chunk.
    per_call: usize,
    /// Most row groups a call: 1, 2 (the 512-bit kernels) or 4 (the 512-bit F16/BF16 one).
    span: usize,
    /// Tokens a block (see `schedule`), as KiB of one-byte activations: k * tokens / 1024.
    block_kib: usize,
}

/// Runs a tiled product: row groups split among the threads, each group through the tokens
/// in blocks (see below), `dot(g, groups, token, n, out, stride, real)` computing tokens
/// token..token + n (n <= `cut.per_call`, within one chunk) against row groups g..g + groups
/// (groups is 1, or 2 or 4 up to `cut.span`: only groups of one task and one part) into
/// out + i * stride, its first `real` rows. Which groups go together depends on the row
/// groups, the parts and the thread count only, never on T: a row's sums do not depend on
/// the batch. Returns T rows of widths[i] values per part.
fn schedule(
    t: usize,
    k: usize,
    widths: &[usize],
    groups: usize,
    cut: Cut,
    dot: impl Fn(usize, usize, usize, usize, *mut f32, usize, usize) + Sync,
) -> Vec<Vec<f32>> {
    let Cut {
        per_chunk,
        per_call,
        span,
        block_kib,
    } = cut;
    let chunks = t.div_ceil(per_chunk);
    // Written by the kernels before it is read: not zeroed first (that memset was 2-3% of a
    // batch run).
    let mut outs: Vec<Vec<f32>> = widths.iter().map(|&w| Vec::with_capacity(t * w)).collect();
    // Per part: its first row group, its width, where its output starts.
    let mut parts = Vec::with_capacity(widths.len());
    let mut first = 0;
    for (o, &w) in outs.iter_mut().zip(widths) {
        parts.push((first, w, SharedOut(o.as_mut_ptr())));
        first += w.div_ceil(8);
    }
    debug_assert_eq!(first, groups);
    let mut chunk = (groups / (rayon::current_num_threads() * 4)).max(1);
    chunk = chunk.next_multiple_of(span);
    let group_ranges: Vec<(usize, usize)> = (0..groups)
        .step_by(chunk)
        .map(|g| (g, (g + chunk).min(groups)))
        .collect();
    // Many tokens (a prefill): the tokens go in blocks of about `block_kib` KiB of quantized
    // activations (48), each block through all of a task's row groups while it and the
    // block's outputs sit in L2; otherwise a wide input (the down projection's, 1,536 values
    // a token) streamed from L3 once per row group. (192 KiB measured 3-4% slower on a
    // batch's prefill, 24 KiB the same as 48.) The AVX2 F16/BF16 kernel widens each group to
    // f32 once per block and thread (`WIDENED`): there 192 (f32 activations, so 768 KiB of
    // them) beat 48 by 4-6% on a 1,000-token prefill, 96 to 384 all alike.
    let per_block = (block_kib * 1024 / (k * per_chunk)).max(1);
    group_ranges.into_par_iter().for_each(|(g0, g1)| {
        for c_start in (0..chunks).step_by(per_block) {
            let mut g = g0;
            while g < g1 {
                let p = parts.partition_point(|part| part.0 <= g) - 1;
                let (pg, w, out) = parts[p];
                let col = (g - pg) * 8;
                // As many groups in one call as the kernel takes (4 or 2) where they are all
                // this task's and this part's, else one.
                let fits = |n: usize| n <= span && g + n <= g1 && col + 8 * (n - 1) < w;
                let n_groups = [4, 2].into_iter().find(|&n| fits(n)).unwrap_or(1);
                let real = (w - col).min(8 * n_groups);
                for c in c_start..(c_start + per_block).min(chunks) {
                    let in_chunk = (t - c * per_chunk).min(per_chunk);
                    let mut i0 = 0;
                    while i0 < in_chunk {
                        let n = (in_chunk - i0).min(per_call);
                        let token = c * per_chunk + i0;
                        // token + n <= T and col + real <= w, so every row written is inside
                        // this part's T x w buffer; row group g's columns are written by this
                        // task only.
                        dot(g, n_groups, token, n, out.at(token * w + col), w, real);
                        i0 += n;
                    }
                }
                g += n_groups;
            }
        }
    });
    for (o, &w) in outs.iter_mut().zip(widths) {
        // SAFETY: every token's row of every part was written above: the row groups cover each
        // part's w columns (the last one its `real` ones) and the chunks cover all T tokens;
        // f32 has no invalid bit patterns.
        unsafe { o.set_len(t * w) };
    }
    outs
}

/// The input rows, shared by the tasks of one product (read only).
#[derive(Clone, Copy)]
struct SharedIn(*const f32);
// SAFETY: the tasks only read through it, while the caller's slice is borrowed.
unsafe impl Send for SharedIn {}
unsafe impl Sync for SharedIn {}

impl SharedIn {
    fn at(self, i: usize) -> *const f32 {
        self.0.wrapping_add(i)
    }
}

/// Tokens from which the AVX2 F16/BF16 kernel reads its row groups widened to f32 once per
/// thread and run of calls on the group (`WIDENED`), instead of widening every column in every
/// call: on a CPU with one conversion every 2 cycles (Zen 1's cvtph2ps) the widening took a
/// fifth of a prefill call's time (one thread, 512 tokens: 11.3 GMAC/s with it, 14.4 with
/// weights already f32). Widened, two groups go together (`tile2_f32`: one activation broadcast
/// for 16 rows, the weights read from L1 into the multiply-adds; 18.5-19.8 GMAC/s). The
/// widening is exact and each row's products and their order are the same, so the bits are too.
/// The 512-bit kernel does the same from as many tokens (`WIDENED_ZMM`, `wide16::zmm::tile_f32`):
/// k256 F16 and BF16 prefill +18% on Zen 4.
const WIDEN_TOKENS: usize = 24;

/// Row groups a call and tokens a call of the widened AVX2 F16/BF16 kernels: 2 x 3 tokens'
/// even and odd sums are 12 of AVX2's 16 registers (4 tokens, 16 sums, spill: 12.4-13.9 GMAC/s
/// against 17.8-18.2 in the same minutes).
const WIDE_SPAN: usize = 2;
const WIDE_TOKENS: usize = 3;

/// Ids of the products that keep work per thread (the AVX2 F16/BF16 kernel's widened group,
/// the 512-bit quantized kernel's unpacked pair), so that what a thread kept for one product is
/// never taken for another's (0: none).
static PRODUCTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// The last row group this thread widened: (product, group, its k * 8 values).
    static WIDENED: std::cell::RefCell<(u64, usize, Vec<f32>)> =
        const { std::cell::RefCell::new((0, 0, Vec::new())) };
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The last groups this thread's 512-bit F16/BF16 kernel widened: (product, first group,
    /// their columns as `wide16::zmm::widen_pairs` made them).
    static WIDENED_ZMM: std::cell::RefCell<(u64, usize, Vec<std::arch::x86_64::__m512>)> =
        const { std::cell::RefCell::new((0, 0, Vec::new())) };
}

/// Tokens a block (KiB of one-byte activations, see [`Cut`]) for the 512-bit F16/BF16 kernel
/// on widened groups: so many that a prefill's groups are widened about once. The widened
/// groups stay in L2 while the f32 activations stream past; each widening is a pass over the
/// group that the multiply-adds wait for. On Zen 4 (5,632 x 1,024, 512 tokens, one thread,
/// 3 rounds): 48 KiB 43-50 GMAC/s, 192 49-53, 384 50-54, 1,536 52-56, 4,096 the same; the
/// f32 peak there is 57.
const ZMM_WIDE_BLOCK_KIB: usize = 1536;

/// One call of an F16/BF16 kernel ([`super::wide16`]); with `product` (not 0) the group (the
/// 512-bit kernel: the call's groups) is widened to f32 once per run of calls on this thread
/// (see `WIDEN_TOKENS`).
///
/// # Safety
/// x holds n rows of k values; w is a group's k * 8 values; out is valid for the writes.
#[allow(clippy::too_many_arguments)]
unsafe fn half_dot(
    tiles: &HalfTiles,
    kernel: Kernel,
    g: usize,
    groups: usize,
    x: *const f32,
    k: usize,
    n: usize,
    out: *mut f32,
    stride: usize,
    real: usize,
    stream: bool,
    product: u64,
) {
    let (ty, w) = (tiles.ty, tiles.tile(g));
    #[cfg(target_arch = "x86_64")]
    if product != 0 && kernel == Kernel::Avx2 {
        return per_thread(&WIDENED, (product, g), |wide, fresh| {
            let len = w.len();
            if fresh {
                wide.resize(len * WIDE_SPAN, 0.0);
                for j in 0..groups {
                    let (src, dst) = (tiles.tile(g + j), &mut wide[j * len..(j + 1) * len]);
                    match ty {
                        Half::F16 => half_kernels::avx2::widen_group::<false>(src, dst),
                        Half::Bf16 => half_kernels::avx2::widen_group::<true>(src, dst),
                    }
                }
            }
            let (w0, w1) = wide.split_at(len);
            match groups {
                1 => {
                    with_tokens!(n, N => half_kernels::avx2::tile_f32::<N>(w0, x, k, out, stride, real))
                }
                _ => with_tokens!(n, N => {
                    half_kernels::avx2::tile2_f32::<N>(w0, w1, x, k, out, stride, real)
                }),
            }
        });
    }
    macro_rules! by_n {
        ($m:ident, $bf:literal) => {
            with_tokens!(n, N => half_kernels::$m::tile::<$bf, N>(w, x, k, out, stride, real, stream))
        };
    }
    #[cfg(target_arch = "x86_64")]
    macro_rules! by_n2 {
        ($w1:expr, $bf:literal) => {
            with_tokens!(n, N => {
                half_kernels::zmm::tile2::<$bf, N>(w, $w1, x, k, out, stride, real, stream)
            })
        };
    }
    #[cfg(target_arch = "x86_64")]
    if product != 0 && kernel == Kernel::Vnni && groups > 1 {
        return per_thread(&WIDENED_ZMM, (product, g), |wide, fresh| {
            if fresh {
                let ws: Vec<&[u16]> = (g..g + groups).map(|j| tiles.tile(j)).collect();
                match ty {
                    Half::F16 => half_kernels::zmm::widen_pairs::<false>(&ws, k, wide),
                    Half::Bf16 => half_kernels::zmm::widen_pairs::<true>(&ws, k, wide),
                }
            }
            macro_rules! by_h {
                ($h:literal) => {
                    match n {
                        1 => half_kernels::zmm::tile_f32::<$h, 1>(wide, x, k, out, stride, real),
                        2 => half_kernels::zmm::tile_f32::<$h, 2>(wide, x, k, out, stride, real),
                        3 => half_kernels::zmm::tile_f32::<$h, 3>(wide, x, k, out, stride, real),
                        4 => half_kernels::zmm::tile_f32::<$h, 4>(wide, x, k, out, stride, real),
                        5 => half_kernels::zmm::tile_f32::<$h, 5>(wide, x, k, out, stride, real),
                        _ => half_kernels::zmm::tile_f32::<$h, 6>(wide, x, k, out, stride, real),
                    }
                };
            }
            debug_assert!(n <= 6 && matches!(groups, 2 | 4));
            if groups == 4 {
                by_h!(2)
            } else {
                by_h!(1)
            }
        });
    }
    #[cfg(target_arch = "x86_64")]
    macro_rules! by_n4 {
        ($bf:literal) => {{
            let ws = [w, tiles.tile(g + 1), tiles.tile(g + 2), tiles.tile(g + 3)];
            match n {
                1 => half_kernels::zmm::tile4::<$bf, 1>(ws, x, k, out, stride, real, stream),
                2 => half_kernels::zmm::tile4::<$bf, 2>(ws, x, k, out, stride, real, stream),
                3 => half_kernels::zmm::tile4::<$bf, 3>(ws, x, k, out, stride, real, stream),
                4 => half_kernels::zmm::tile4::<$bf, 4>(ws, x, k, out, stride, real, stream),
                5 => half_kernels::zmm::tile4::<$bf, 5>(ws, x, k, out, stride, real, stream),
                _ => half_kernels::zmm::tile4::<$bf, 6>(ws, x, k, out, stride, real, stream),
            }
        }};
    }
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Vnni && groups > 1 {
        debug_assert!(n <= 6 || groups == 2);
        return match (ty, groups) {
            (Half::F16, 4) => by_n4!(false),
            (Half::Bf16, 4) => by_n4!(true),
            (Half::F16, _) => by_n2!(tiles.tile(g + 1), false),
            (Half::Bf16, _) => by_n2!(tiles.tile(g + 1), true),
        };
    }
    debug_assert!(
        groups == 1,
        "several groups a call only for the 512-bit kernels"
    );
    match (kernel, ty) {
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, Half::F16) => by_n!(avx2, false),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, Half::Bf16) => by_n!(avx2, true),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Vnni, Half::F16) => by_n!(vnni, false),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Vnni, Half::Bf16) => by_n!(vnni, true),
        _ => half_kernels::scalar_tile(ty, w, x, k, n, out, stride, real),
    }
}

/// What this thread keeps for a product's calls on one row group (`PREPARED`, `WIDENED`,
/// `WIDENED_ZMM`, `UNPACKED`): `use_` gets it, with `fresh` true where it was kept for another
/// `key` (product, first group), so that `use_` makes it again first.
#[cfg(target_arch = "x86_64")]
fn per_thread<T: 'static, R>(
    cell: &'static std::thread::LocalKey<std::cell::RefCell<(u64, usize, Vec<T>)>>,
    key: (u64, usize),
    use_: impl FnOnce(&mut Vec<T>, bool) -> R,
) -> R {
    cell.with(|cell| {
        let (id, group, kept) = &mut *cell.borrow_mut();
        let fresh = (*id, *group) != key;
        let r = use_(kept, fresh);
        // Only once made whole (a call cut short by a panic leaves it to be made again).
        (*id, *group) = key;
        r
    })
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The groups this thread last rearranged for AMX-BF16 or `vdpbf16ps`: (product, first
    /// group, their pairs as `amx_half::prepare` made them).
    static PREPARED: std::cell::RefCell<(u64, usize, Vec<u16>)> =
        const { std::cell::RefCell::new((0, 0, Vec::new())) };
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The last row pair this thread's 512-bit quantized kernel unpacked, as `quants_zmm::tile2`
    /// keeps it: (product, first group, [`quants_zmm::KEPT`] registers a block). A product's
    /// next chunks of tokens on the same pair read it instead of unpacking again.
    static UNPACKED: std::cell::RefCell<(u64, usize, Vec<std::arch::x86_64::__m512i>)> =
        const { std::cell::RefCell::new((0, 0, Vec::new())) };
}

/// One call of a [`super::quants`] kernel: the type's instance for the kernel and token count.
/// `(g, w)`: the first row group and its tile; with `product` (not 0), a pair's unpacked
/// blocks are kept for the product's later calls on it on this thread ([`UNPACKED`]).
///
/// # Safety
/// As for the kernels: `a` holds n tokens of the tile's blocks, out valid for the writes.
#[allow(clippy::too_many_arguments)]
unsafe fn quant_dot(
    ty: QType,
    kernel: Kernel,
    (g, w): (usize, quants::Tile<'_>),
    w1: Option<quants::Tile<'_>>,
    a: quants::ActChunk,
    n: usize,
    out: *mut f32,
    stride: usize,
    real: usize,
    (stream, product): (bool, u64),
) {
    match (kernel, w1) {
        #[cfg(target_arch = "x86_64")]
        (Kernel::Vnni, Some(w1)) if product != 0 => {
            per_thread(&UNPACKED, (product, g), |kept, fresh| {
                if fresh {
                    let blocks = w.buf.len() / ty.spec().sb_bytes() * ty.spec().per_super;
                    kept.resize(blocks * super::quants_zmm::KEPT, std::mem::zeroed());
                }
                // Unfilled when fresh: the kernel fills it as it unpacks.
                let keep = Some((&mut kept[..], !fresh));
                with_qtype!(ty, TY => with_tokens!(n, N => {
                    super::quants_zmm::tile2::<TY, N>(w, w1, a, out, stride, real, stream, keep)
                }))
            })
        }
        #[cfg(target_arch = "x86_64")]
        (Kernel::Vnni, Some(w1)) => with_qtype!(ty, TY => with_tokens!(n, N => {
            super::quants_zmm::tile2::<TY, N>(w, w1, a, out, stride, real, stream, None)
        })),
        (_, Some(_)) => unreachable!("pairs are only scheduled for the VNNI kernel"),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Avx2, None) => with_qtype!(ty, TY => with_tokens!(n, N => {
            super::quants_x86::avx2::tile::<TY, N>(w, a, out, stride, real, stream)
        })),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Vnni, None) => with_qtype!(ty, TY => with_tokens!(n, N => {
            super::quants_x86::vnni::tile::<TY, N>(w, a, out, stride, real, stream)
        })),
        (Kernel::Scalar, None) => quants::scalar_tile(ty.spec(), w, a, n, out, stride, real),
        #[cfg(target_arch = "x86_64")]
        (Kernel::Amx | Kernel::Bf16, _) => {
            unreachable!("AMX and bf16 arrive as the 512-bit path (`Kernel::base`)")
        }
    }
}

/// Calls with activations of at most this many chunks (of 8 tokens) prefetch weights.
const STREAM_CHUNKS: usize = 4;

/// Tokens per chunk of `ActTiles`.
const TOKENS: usize = 8;

/// Activations quantized for the tile kernels: tokens in chunks of 8 and, within a chunk, per
/// block, the 8 tokens' 32 quants side by side (256 bytes), and their 8 scales (and Q8_1 sums,
/// or Q8_0 integer sums) side by side: one kernel call walks one contiguous run per block.
/// The last chunk's padding tokens are zero.
struct ActTiles {
    qs: Vec<u8>,
    scale: Vec<f32>,
    /// Q8_1: s = d * sum(q). Empty for Q8_0.
    offset: Vec<f32>,
    /// Q8_0: sum(q). Empty for Q8_1.
    isum: Vec<i32>,
    /// Q8_0 for the AVX2 prefill kernel (`x86::tile_q8_0_i16`), else empty: per slot, the 32
    /// quants as 16 pairs of i16, (q[4c], q[4c + 2]) and (q[4c + 1], q[4c + 3]) for c in 0..8
    /// ([`super::q8::i16_pairs`]), 64 bytes at slot * 16.
    wide: Vec<i32>,
    /// Blocks in a token's row.
    nb: usize,
    chunks: usize,
}

/// Where one token's run of a chunk starts: block b of token i of the call is at
/// qs + b * 256 + i * 32 and scale (offset, isum) + b * 8 + i.
#[derive(Clone, Copy)]
struct ActChunk {
    qs: *const u8,
    scale: *const f32,
    offset: *const f32,
    isum: *const i32,
    wide: *const i32,
}

impl ActTiles {
    /// T rows of K values into Q8_1 (`with_sums`) or Q8_0 blocks, rounded exactly as
    /// `quantize_rows` (and llama.cpp) do.
    fn quantize(x: &[f32], k: usize, t: usize, with_sums: bool, kernel: Kernel) -> Self {
        let nb = k / QK;
        let chunks = t.div_ceil(TOKENS);
        let slots = chunks * nb * TOKENS;
        let mut a = ActTiles {
            qs: vec![0; slots * QK],
            scale: vec![0.0; slots],
            offset: if with_sums {
                vec![0.0; slots]
            } else {
                Vec::new()
            },
            isum: if with_sums {
                Vec::new()
            } else {
                vec![0; slots]
            },
            wide: Vec::new(),
            nb,
            chunks,
        };
        // One chunk of 8 tokens: its quants, scales and sums (offset or isum, the other empty).
        let fill =
            |c: usize, qs: &mut [u8], scale: &mut [f32], offset: &mut [f32], isum: &mut [i32]| {
                for (i, row) in x
                    .chunks_exact(k)
                    .skip(c * TOKENS)
                    .take(TOKENS.min(t - c * TOKENS))
                    .enumerate()
                {
                    for (b, blk) in row.chunks_exact(QK).enumerate() {
                        let at = b * TOKENS + i;
                        let q = &mut qs[at * QK..at * QK + QK];
                        let (d, sum) = match kernel {
                            // SAFETY: a SIMD kernel is only chosen on CPUs with AVX2.
                            #[cfg(target_arch = "x86_64")]
                            Kernel::Avx2 | Kernel::Vnni => unsafe {
                                super::q8::x86_quantize_block(blk, q)
                            },
                            _ => quantize_block(blk, q),
                        };
                        scale[at] = through_f16(d);
                        if with_sums {
                            offset[at] = through_f16(d * sum as f32);
                        } else {
                            isum[at] = sum;
                        }
                    }
                }
            };
        let per = nb * TOKENS;
        // Chunks by index; the unused one of offset/isum gets empty slices.
        let offsets: Vec<&mut [f32]> = if with_sums {
            a.offset.chunks_mut(per).collect()
        } else {
            (0..chunks).map(|_| <&mut [f32]>::default()).collect()
        };
        let isums: Vec<&mut [i32]> = if with_sums {
            (0..chunks).map(|_| <&mut [i32]>::default()).collect()
        } else {
            a.isum.chunks_mut(per).collect()
        };
        let work =
            a.qs.chunks_mut(per * QK)
                .zip(a.scale.chunks_mut(per))
                .zip(offsets.into_iter().zip(isums))
                .enumerate()
                .collect::<Vec<_>>();
        // A prefill's tokens (T in the hundreds: milliseconds of work a layer) in parallel; a
        // decode step's few serially.
        let run = |(c, ((qs, scale), (offset, isum))): (usize, _)| fill(c, qs, scale, offset, isum);
        if t >= 64 {
            work.into_par_iter().for_each(run);
        } else {
            work.into_iter().for_each(run);
        }
        if !with_sums && kernel == Kernel::Avx2 && t >= super::q8::I16_TOKENS {
            a.wide = super::q8::i16_pairs(&a.qs);
        }
        a
    }

    /// The run of `token` (its chunk, from its place in the chunk on).
    fn chunk(&self, token: usize) -> ActChunk {
        let (c, i) = (token / TOKENS, token % TOKENS);
        debug_assert!(c < self.chunks);
        let at = c * self.nb * TOKENS + i;
        // wrapping_add: the empty one of offset/isum is never read.
        ActChunk {
            qs: self.qs.as_ptr().wrapping_add(at * QK),
            scale: self.scale.as_ptr().wrapping_add(at),
            offset: self.offset.as_ptr().wrapping_add(at),
            isum: self.isum.as_ptr().wrapping_add(at),
            wide: self.wide.as_ptr().wrapping_add(at * 16),
        }
    }
}

impl CpuQWeight {
    /// Repack a GGUF weight of a type gen's kernels run; None for other types (f32, f16, bf16).
    pub fn from_qtensor(q: &QTensor, kernel: Kernel) -> Result<Option<Self>> {
        let id = match q.dtype() {
            GgmlDType::F16 => 1,
            GgmlDType::BF16 => 30,
            GgmlDType::Q4_0 => 2,
            GgmlDType::Q4_1 => 3,
            GgmlDType::Q5_0 => 6,
            GgmlDType::Q5_1 => 7,
            GgmlDType::Q8_0 => 8,
            GgmlDType::Q2K => 10,
            GgmlDType::Q3K => 11,
            GgmlDType::Q4K => 12,
            GgmlDType::Q5K => 13,
            GgmlDType::Q6K => 14,
            _ => return Ok(None),
        };
        let (rows, cols) = q.shape().dims2()?;
        Self::from_raw(id, &q.data()?, rows, cols, kernel)
    }

    /// A weight of `rows` x `cols` in GGUF blocks of ggml type `ggml` (its number), repacked;
    /// None for a type these kernels do not run.
    pub fn from_raw(
        ggml: u32,
        raw: &[u8],
        rows: usize,
        cols: usize,
        kernel: Kernel,
    ) -> Result<Option<Self>> {
        let Some(ty) = Self::weight_type(ggml) else {
            return Ok(None);
        };
        let (block_values, block_bytes) = Self::block_of(ty);
        if !cols.is_multiple_of(block_values) {
            bail!("a weight's width {cols} is not a multiple of the block size {block_values}");
        }
        if matches!(ty, WeightType::Half(_)) && cols % 2 == 1 {
            return Ok(None); // odd widths stay with candle's product
        }
        let expected = rows * cols / block_values * block_bytes;
        if raw.len() != expected {
            bail!(
                "a {rows}x{cols} weight holds {} bytes, expected {expected}",
                raw.len()
            );
        }
        if matches!(ty, WeightType::Quant(quants::QType::Mxfp4)) && !quants::mxfp4_scales_fit(raw) {
            bail!("an MXFP4 block scale above 2^15 (byte 143): not a trained weight");
        }
        let layout = match ty {
            WeightType::Quant(q) => Layout::Quant(quants::Tiles::from_gguf(q, raw, rows, cols)),
            WeightType::Half(h) => Layout::Half(HalfTiles::from_raw(h, raw, rows, cols)),
            _ => {
                if kernel == Kernel::Scalar {
                    Layout::Rows(Blocks::from_gguf(raw, ty, cols / QK))
                } else {
                    Layout::Tiles(Tiles::from_gguf(raw, ty, rows, cols / QK))
                }
            }
        };
        Ok(Some(Self::of_layout(ty, rows, cols, layout, kernel)))
    }

    fn of_layout(
        ty: WeightType,
        rows: usize,
        cols: usize,
        layout: Layout,
        kernel: Kernel,
    ) -> CpuQWeight {
        CpuQWeight {
            ty,
            rows,
            cols,
            layout,
            kernel,
            paths: Kernel::forced_paths(kernel),
            parts: Vec::new(),
        }
    }

    /// The type of ggml type number `ggml`, on gen's kernels; None for another.
    fn weight_type(ggml: u32) -> Option<WeightType> {
        Some(match ggml {
            1 => WeightType::Half(Half::F16),
            30 => WeightType::Half(Half::Bf16),
            3 => WeightType::Q4_1,
            8 => WeightType::Q8_0,
            _ => WeightType::Quant(QType::from_ggml(ggml)?),
        })
    }

    /// Name these rows as the file's tensor `name` (the tile cache files them so).
    /// Values and bytes of one of the file's blocks of type `ty` (a 16-bit value for F16/BF16).
    fn block_of(ty: WeightType) -> (usize, usize) {
        match ty {
            WeightType::Half(_) => (1, 2),
            WeightType::Q4_1 => (QK, Q4_1_BYTES),
            WeightType::Q8_0 => (QK, Q8_0_BYTES),
            WeightType::Quant(q) => {
                let s = q.spec();
                (s.per_super * QK, s.block_bytes)
            }
        }
    }

    pub fn set_name(&mut self, name: &str) {
        self.parts = vec![(name.to_string(), self.rows)];
    }

    /// The file's tensors these rows are, with their row counts (see `parts`).
    pub fn parts(&self) -> &[(String, usize)] {
        &self.parts
    }

    /// The instruction set the layout was made for.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// The buffers the tile cache keeps of this weight, in a fixed order: each one's bytes;
    /// None for the scalar rows layout, which is not cached.
    pub fn cached_buffers(&self) -> Option<Vec<&[u8]>> {
        match &self.layout {
            Layout::Rows(_) => None,
            Layout::Tiles(t) => Some(vec![t.qs.bytes(), t.d.bytes(), t.m.bytes()]),
            Layout::Quant(t) => Some(vec![t.buffer().bytes()]),
            Layout::Half(t) => Some(vec![t.buffer().bytes()]),
        }
    }

    /// Bytes a group of 8 rows takes in each of [`Self::cached_buffers`] for a weight of ggml
    /// type `ggml` and `cols` columns on a SIMD layout; None for a type or width these
    /// kernels do not run.
    pub fn group_bytes(ggml: u32, cols: usize) -> Option<Vec<usize>> {
        Some(match Self::weight_type(ggml)? {
            WeightType::Q4_1 if cols.is_multiple_of(QK) => {
                vec![cols / QK * 128, cols / QK * 16, cols / QK * 16]
            }
            WeightType::Q8_0 if cols.is_multiple_of(QK) => vec![cols / QK * 256, cols / QK * 16, 0],
            WeightType::Quant(q) => {
                let spec = q.spec();
                let per = spec.per_super * QK;
                if !cols.is_multiple_of(per) {
                    return None;
                }
                vec![cols / per * spec.sb_bytes()]
            }
            WeightType::Half(_) if cols.is_multiple_of(2) => vec![cols * 16],
            _ => return None,
        })
    }

    /// A weight of `rows` x `cols` of ggml type `ggml` whose buffers (in the order of
    /// [`Self::cached_buffers`]) start at byte offsets `at` of the mapped tile-cache `file`,
    /// laid out for `kernel` (a SIMD path); None where that does not fit the file.
    pub fn from_cached(
        ggml: u32,
        rows: usize,
        cols: usize,
        kernel: Kernel,
        file: &std::sync::Arc<crate::format::mapped::Mapped>,
        at: &[usize],
    ) -> Option<Self> {
        let ty = Self::weight_type(ggml)?;
        let sizes = Self::group_bytes(ggml, cols)?;
        let groups = rows.div_ceil(8);
        if kernel == Kernel::Scalar && matches!(ty, WeightType::Q4_1 | WeightType::Q8_0) {
            return None;
        }
        if at.len() != sizes.len() || rows == 0 {
            return None;
        }
        let u8s = |i: usize| Buf::<u8>::mapped(file, at[i], groups * sizes[i]);
        let u16s = |i: usize| Buf::<u16>::mapped(file, at[i], groups * sizes[i] / 2);
        let layout = match ty {
            WeightType::Q4_1 | WeightType::Q8_0 => Layout::Tiles(Tiles {
                qs: u8s(0)?,
                d: u16s(1)?,
                m: u16s(2)?,
                groups,
                nb: cols / QK,
                per_block: if ty == WeightType::Q4_1 { 128 } else { 256 },
            }),
            WeightType::Quant(q) => Layout::Quant(quants::Tiles::from_buffer(
                q,
                u8s(0)?,
                groups,
                cols,
                sizes[0],
            )?),
            WeightType::Half(h) => Layout::Half(HalfTiles::from_buffer(h, u16s(0)?, groups, cols)?),
        };
        Some(Self::of_layout(ty, rows, cols, layout, kernel))
    }

    /// Row `row` of the weight matrix, widened to f32 as ggml dequantizes it (an embedding
    /// lookup when the embedding matrix is also the output layer: one copy of it in memory).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        debug_assert!(row < self.rows && out.len() == self.cols);
        match &self.layout {
            Layout::Quant(t) => t.dequantize_row(row, out),
            Layout::Half(t) => {
                let tile = t.tile(row / 8);
                for (c, o) in out.iter_mut().enumerate() {
                    *o = half_kernels::widen(t.ty, tile[c * 8 + row % 8]);
                }
            }
            Layout::Rows(b) => {
                let r = b.row(row);
                for (blk, o) in out.chunks_exact_mut(QK).enumerate() {
                    let q = &r.qs[blk * b.per_block..(blk + 1) * b.per_block];
                    for (j, o) in o.iter_mut().enumerate() {
                        *o = match self.ty {
                            WeightType::Q4_1 => {
                                let n = if j < 16 { q[j] & 0xF } else { q[j - 16] >> 4 };
                                r.scale[blk] * n as f32 + r.offset[blk]
                            }
                            _ => r.scale[blk] * q[j] as i8 as f32,
                        };
                    }
                }
            }
            Layout::Tiles(t) => {
                let tile = t.tile(row / 8);
                let r = row % 8;
                for (blk, o) in out.chunks_exact_mut(QK).enumerate() {
                    let d = f16::from_bits(tile.d[blk * 8 + r]).to_f32();
                    let q = &tile.qs[blk * t.per_block..(blk + 1) * t.per_block];
                    for (j, o) in o.iter_mut().enumerate() {
                        *o = match self.ty {
                            WeightType::Q4_1 => {
                                // Chunk c holds bytes 4c..4c+4 of each row's 16.
                                let byte = q[(j % 16) / 4 * 32 + r * 4 + j % 4];
                                let n = if j < 16 { byte & 0xF } else { byte >> 4 };
                                let m = f16::from_bits(tile.m[blk * 8 + r]).to_f32();
                                d * n as f32 + m
                            }
                            _ => d * q[j / 4 * 32 + r * 4 + j % 4] as i8 as f32,
                        };
                    }
                }
            }
        }
    }

    /// The weights' ggml type number, as the file gives it.
    pub fn ggml_type(&self) -> u32 {
        match self.ty {
            WeightType::Q4_1 => 3,
            WeightType::Q8_0 => 8,
            WeightType::Quant(q) => q.spec().ggml,
            WeightType::Half(Half::F16) => 1,
            WeightType::Half(Half::Bf16) => 30,
        }
    }

    /// The bytes the weights take in the file (what a product reads, within a few percent).
    pub fn file_bytes(&self) -> usize {
        Self::file_bytes_of(self.ggml_type(), self.rows, self.cols).unwrap_or(0)
    }

    /// The bytes of a `rows` x `cols` matrix of ggml type `ggml` in a file; None for a type
    /// these kernels do not run or a width not a whole number of its blocks.
    pub fn file_bytes_of(ggml: u32, rows: usize, cols: usize) -> Option<usize> {
        let (values, bytes) = Self::block_of(Self::weight_type(ggml)?);
        cols.is_multiple_of(values)
            .then(|| rows * cols / values * bytes)
    }

    /// Rows and columns.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The ggml type name of the weights (for reports and errors).
    pub fn type_name(&self) -> &'static str {
        match self.ty {
            WeightType::Q4_1 => "Q4_1",
            WeightType::Q8_0 => "Q8_0",
            WeightType::Quant(q) => q.spec().name,
            WeightType::Half(Half::F16) => "F16",
            WeightType::Half(Half::Bf16) => "BF16",
        }
    }

    /// Whether these weights can be stacked into one matrix ([`Self::concat`]): one type, one
    /// width, one kernel, and (tiles concatenate only so) no padding rows but in the last.
    pub fn can_concat(parts: &[&CpuQWeight]) -> bool {
        parts
            .iter()
            .all(|w| matches!(w.layout, Layout::Rows(_)) || w.rows % 8 == 0)
            && parts
                .windows(2)
                .all(|p| p[0].ty == p[1].ty && p[0].cols == p[1].cols && p[0].kernel == p[1].kernel)
    }

    /// The parts' rows stacked in order (they passed [`Self::can_concat`]), and each part's row
    /// count.
    pub fn concat(parts: impl IntoIterator<Item = CpuQWeight>) -> (CpuQWeight, Vec<usize>) {
        let mut ws = parts.into_iter();
        let mut all = ws.next().expect("at least one part");
        let mut widths = vec![all.rows];
        for w in ws {
            widths.push(w.rows);
            all.rows += w.rows;
            all.parts.extend(w.parts);
            match (&mut all.layout, w.layout) {
                (Layout::Rows(a), Layout::Rows(b)) => {
                    a.scale.extend_from_slice(&b.scale);
                    a.offset.extend_from_slice(&b.offset);
                    a.qs.extend_from_slice(&b.qs);
                }
                (Layout::Tiles(a), Layout::Tiles(b)) => a.append(b),
                (Layout::Quant(a), Layout::Quant(b)) => a.append(b),
                (Layout::Half(a), Layout::Half(b)) => a.append(b),
                _ => unreachable!("same kernel, same layout"),
            }
        }
        (all, widths)
    }

    /// x: (..., K) -> (..., N).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self
            .forward_parts(x, &[self.rows])?
            .pop()
            .expect("one part"))
    }

    /// x: (..., K) -> one (..., widths[i]) per consecutive part of the N outputs.
    pub fn forward_parts(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        let dims = x.dims().to_vec();
        let k = *dims.last().unwrap_or(&0);
        if k != self.cols {
            bail!(
                "linear layer expects width {}, got input of shape {dims:?}",
                self.cols
            );
        }
        let t = x.elem_count() / k.max(1);
        let ys = super::ops::with_f32(x, |x| self.matmul_parts(x, t, widths))?;
        ys.into_iter()
            .zip(widths)
            .map(|(y, &width)| {
                let mut out_dims = dims.clone();
                *out_dims.last_mut().unwrap() = width;
                Ok(Tensor::from_vec(y, out_dims, &Device::Cpu)?)
            })
            .collect()
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Rows of K values into Q8_1 blocks (`with_sums`: s = d * sum(q) computed in f32, then rounded
/// to f16 once, as llama.cpp does) or Q8_0 blocks, for the scalar kernels. d is kept at f16
/// precision.
fn quantize_rows(x: &[f32], k: usize, with_sums: bool) -> Blocks {
    let n = x.len() / QK;
    let mut b = Blocks {
        scale: Vec::with_capacity(n),
        offset: Vec::with_capacity(if with_sums { n } else { 0 }),
        qs: vec![0u8; n * QK],
        per_block: QK,
        row_blocks: k / QK,
    };
    for (blk, q) in x.chunks_exact(QK).zip(b.qs.chunks_exact_mut(QK)) {
        let (d, sum) = quantize_block(blk, q);
        b.scale.push(through_f16(d));
        if with_sums {
            b.offset.push(through_f16(d * sum as f32));
        }
    }
    b
}

/// Q4_1 weights against Q8_1 activations: sum over blocks of d_w*d_a*sum(q_w*q_a) + m_w*s_a.
fn dot_q4_1_q8_1_scalar(w: Row<'_>, a: Row<'_>) -> f32 {
    let mut acc = 0f32;
    for b in 0..w.scale.len() {
        let qw = &w.qs[b * 16..b * 16 + 16];
        let qa = &a.qs[b * QK..b * QK + QK];
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let lo = (qw[j] & 0x0F) as i32;
            let hi = (qw[j] >> 4) as i32;
            sumi += lo * (qa[j] as i8) as i32 + hi * (qa[j + QK / 2] as i8) as i32;
        }
        acc += w.scale[b] * a.scale[b] * sumi as f32 + w.offset[b] * a.offset[b];
    }
    acc
}

/// Q8_0 weights against Q8_0 activations.
fn dot_q8_0_q8_0_scalar(w: Row<'_>, a: Row<'_>) -> f32 {
    let mut acc = 0f32;
    for b in 0..w.scale.len() {
        let mut sumi = 0i32;
        for j in 0..QK {
            sumi += (w.qs[b * QK + j] as i8) as i32 * (a.qs[b * QK + j] as i8) as i32;
        }
        acc += w.scale[b] * a.scale[b] * sumi as f32;
    }
    acc
}

/// The x86 kernels, written once and instantiated per instruction set: `avx2` multiplies
/// unsigned by signed bytes with maddubs + madd (two instructions), `vnni` with one dpbusd.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_kernels {
    (
        $name:ident, $features:literal, $dot_u4:ident, $prep_i8:ident, $dot_i8:ident, $bias:expr,
        $avx2:expr
    ) => {
        pub mod $name {
            use super::super::{ActChunk, Tile};
            use crate::model::cpu::q8::simd::{prefetch, store, widen};
            use std::arch::x86_64::*;

            /// N tokens' activations (Q8_1) against a tile of 8 Q4_1 rows, written to
            /// out + i * stride for token i (the first `real` rows).
            ///
            /// # Safety
            /// The CPU must support the features; `a` holds N tokens of as many blocks as the
            /// tile; `out` is valid for those writes.
            #[target_feature(enable = $features)]
            pub unsafe fn tile_q4_1<const N: usize>(
                w: Tile<'_>,
                a: ActChunk,
                out: *mut f32,
                stride: usize,
                real: usize,
                stream: bool,
            ) {
                let nb = w.d.len() / 8;
                debug_assert!(w.qs.len() >= nb * 128 && w.m.len() >= nb * 8);
                let mask = _mm256_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); N];
                // Quants 128 bytes a block, scales and minimums 16 each: the same distance in
                // blocks is an eighth of the bytes for them (one line every 4 blocks).
                const AHEAD: usize = super::super::PREFETCH_AHEAD;
                for b in 0..nb {
                    let base = w.qs.as_ptr().add(b * 128);
                    if stream {
                        prefetch(base.wrapping_add(AHEAD));
                        prefetch(base.wrapping_add(AHEAD + 64));
                        if b % 4 == 0 {
                            prefetch(w.d.as_ptr().wrapping_add(b * 8 + AHEAD / 16));
                            prefetch(w.m.as_ptr().wrapping_add(b * 8 + AHEAD / 16));
                        }
                    }
                    let mut wv = [_mm256_setzero_si256(); 8];
                    for c in 0..4 {
                        let raw = _mm256_loadu_si256(base.add(c * 32) as *const __m256i);
                        wv[c] = _mm256_and_si256(raw, mask);
                        wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                    }
                    let dw = widen(w.d.as_ptr().add(b * 8));
                    let mw = widen(w.m.as_ptr().add(b * 8));
                    let qb = a.qs.add(b * 256);
                    let (sb, ob) = (a.scale.add(b * 8), a.offset.add(b * 8));
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let q = qb.add(i * 32) as *const i32;
                        let act = |g: usize| _mm256_set1_epi32(q.add(g).read_unaligned());
                        let s = if $avx2 {
                            // The 8 maddubs results added in 16 bits, then one madd: exact,
                            // as a lane's sum is at most 8 * 2 * 15 * 127 = 30,480.
                            let m = |g: usize| _mm256_maddubs_epi16(wv[g], act(g));
                            let add = |x, y| _mm256_add_epi16(x, y);
                            let p = add(add(m(0), m(1)), add(m(2), m(3)));
                            let p = add(p, add(add(m(4), m(5)), add(m(6), m(7))));
                            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
                        } else {
                            // Two independent chains of multiply-adds.
                            let mut s0 = _mm256_setzero_si256();
                            let mut s1 = _mm256_setzero_si256();
                            for g in (0..8).step_by(2) {
                                s0 = super::$dot_u4(s0, wv[g], act(g));
                                s1 = super::$dot_u4(s1, wv[g + 1], act(g + 1));
                            }
                            _mm256_add_epi32(s0, s1)
                        };
                        let s = _mm256_cvtepi32_ps(s);
                        let d = _mm256_mul_ps(dw, _mm256_set1_ps(*sb.add(i)));
                        *acc = _mm256_fmadd_ps(s, d, *acc);
                        *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*ob.add(i)), *acc);
                    }
                }
                store(&acc, out, stride, real);
            }

            /// N tokens' activations (Q8_0) against a tile of 8 Q8_0 rows, written as
            /// `tile_q4_1` writes.
            ///
            /// # Safety
            /// As for `tile_q4_1`.
            #[target_feature(enable = $features)]
            pub unsafe fn tile_q8_0<const N: usize>(
                w: Tile<'_>,
                a: ActChunk,
                out: *mut f32,
                stride: usize,
                real: usize,
                stream: bool,
            ) {
                let nb = w.d.len() / 8;
                debug_assert!(w.qs.len() >= nb * 256);
                let mut acc = [_mm256_setzero_ps(); N];
                // Quants 256 bytes a block, scales 16.
                const AHEAD: usize = super::super::PREFETCH_AHEAD;
                for b in 0..nb {
                    let base = w.qs.as_ptr().add(b * 256);
                    if stream {
                        for l in 0..4 {
                            prefetch(base.wrapping_add(AHEAD + l * 64));
                        }
                        if b % 4 == 0 {
                            prefetch(w.d.as_ptr().wrapping_add(b * 8 + AHEAD / 32));
                        }
                    }
                    let mut wv = [_mm256_setzero_si256(); 8];
                    for c in 0..8 {
                        wv[c] =
                            super::$prep_i8(_mm256_loadu_si256(base.add(c * 32) as *const __m256i));
                    }
                    let dw = widen(w.d.as_ptr().add(b * 8));
                    let qb = a.qs.add(b * 256);
                    let (sb, ib) = (a.scale.add(b * 8), a.isum.add(b * 8));
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let q = qb.add(i * 32) as *const i32;
                        let mut s0 = _mm256_setzero_si256();
                        let mut s1 = _mm256_setzero_si256();
                        for g in (0..8).step_by(2) {
                            s0 = super::$dot_i8(
                                s0,
                                wv[g],
                                _mm256_set1_epi32(q.add(g).read_unaligned()),
                            );
                            s1 = super::$dot_i8(
                                s1,
                                wv[g + 1],
                                _mm256_set1_epi32(q.add(g + 1).read_unaligned()),
                            );
                        }
                        let s = _mm256_add_epi32(s0, s1);
                        let s = _mm256_sub_epi32(s, _mm256_set1_epi32($bias * *ib.add(i)));
                        let d = _mm256_mul_ps(dw, _mm256_set1_ps(*sb.add(i)));
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
                    }
                }
                store(&acc, out, stride, real);
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::model::cpu::q8::simd::{
        dot_s_avx2 as dot_i8_avx2, dot_u_avx2 as dot_u4_avx2, dot_u_vnni as dot_i8_vnni,
        dot_u_vnni as dot_u4_vnni,
    };
    use std::arch::x86_64::*;

    /// AVX2 multiplies signed bytes through maddubs by moving w's sign onto a: |w| * ±a.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn keep_i8(w: __m256i) -> __m256i {
        w
    }

    /// VNNI takes w + 128 as unsigned bytes (flipping the top bit) and the kernel subtracts
    /// 128 * sum(a) afterwards: exact in 32-bit integers.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn bias_i8(w: __m256i) -> __m256i {
        _mm256_xor_si256(w, _mm256_set1_epi8(-128))
    }

    /// N tokens' activations (Q8_0, with [`super::ActTiles::wide`]) against a tile of 8 Q8_0
    /// rows on AVX2, written as `tile_q8_0` writes: the codes sign-extended to 16 bits once per
    /// block (their even and odd bytes of each 4, by shifts) and multiplied by the activations'
    /// i16 pairs with one madd per 16 products, where the 8-bit route takes two signs, a
    /// maddubs and a madd per 32 (all four on the same two pipes of Zen 3 and 4). The same
    /// integer sums, so the same bits.
    ///
    /// # Safety
    /// As for `tile_q8_0`; `a.wide` holds the chunk's pairs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_q8_0_i16<const N: usize>(
        w: super::Tile<'_>,
        a: super::ActChunk,
        out: *mut f32,
        stride: usize,
        real: usize,
        stream: bool,
    ) {
        use crate::model::cpu::q8::simd::{prefetch, store, widen};
        let nb = w.d.len() / 8;
        debug_assert!(w.qs.len() >= nb * 256);
        const AHEAD: usize = super::PREFETCH_AHEAD;
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..nb {
            let base = w.qs.as_ptr().add(b * 256);
            if stream {
                for l in 0..4 {
                    prefetch(base.wrapping_add(AHEAD + l * 64));
                }
            }
            let wa = a.wide.add(b * super::TOKENS * 16);
            let mut s = [_mm256_setzero_si256(); N];
            for c in 0..8 {
                let x = _mm256_loadu_si256(base.add(c * 32) as *const __m256i);
                let lo = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8);
                let hi = _mm256_srai_epi16(x, 8);
                for (i, s) in s.iter_mut().enumerate() {
                    let p = wa.add(i * 16 + 2 * c);
                    let e = _mm256_madd_epi16(lo, _mm256_set1_epi32(*p));
                    let o = _mm256_madd_epi16(hi, _mm256_set1_epi32(*p.add(1)));
                    *s = _mm256_add_epi32(*s, _mm256_add_epi32(e, o));
                }
            }
            let dw = widen(w.d.as_ptr().add(b * 8));
            let sb = a.scale.add(b * 8);
            for (i, acc) in acc.iter_mut().enumerate() {
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*sb.add(i)));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), d, *acc);
            }
        }
        store(&acc, out, stride, real);
    }

    x86_kernels!(
        avx2,
        "avx2,fma,f16c",
        dot_u4_avx2,
        keep_i8,
        dot_i8_avx2,
        0,
        true
    );
    x86_kernels!(
        vnni,
        "avx2,fma,f16c,avx512vnni,avx512vl",
        dot_u4_vnni,
        bias_i8,
        dot_i8_vnni,
        128,
        false
    );
}

#[cfg(test)]
/// A deterministic pseudo-random matrix with a spread of magnitudes and signs.
pub(crate) fn test_data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 4.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 512-bit kernels (two row groups a call, four for F16/BF16) give the 256-bit ones'
    /// bits, and the VNNI kernels the AVX2 ones': every type gen tiles, as a fused projection
    /// of parts whose widths are not multiples of 16 (so quads, pairs, single groups and
    /// ragged ends all occur, as in a fused q/k/v), 1 to 64 tokens (calls of 6 and 8 tokens
    /// and their remainders; from 16, AVX2's 16-bit route for Q8_0, `q8::I16_TOKENS`; from 24,
    /// the F16/BF16 kernels' wider blocks, `WIDEN_TOKENS`); each part of the fused product
    /// equals the part's own product, whose groups go together differently.
    #[test]
    fn paired_groups_and_parts_give_the_same_bits() {
        let kernels = crate::model::cpu::q8::test_kernels();
        #[cfg(target_arch = "x86_64")]
        if !kernels.contains(&Kernel::Vnni) {
            eprintln!("no AVX-512 VNNI here: the 512-bit kernels are not exercised");
        }
        let k = 512;
        let mut types: Vec<u32> = quants::QType::ALL.iter().map(|t| t.spec().ggml).collect();
        types.extend([1, 30, 2, 8]);
        for id in types {
            let raw = |n: usize, seed: u64| match quants::QType::from_ggml(id) {
                Some(ty) => quants::random_blocks(ty, n, k, seed),
                None if id == 1 || id == 30 => test_data(n * k, seed)
                    .iter()
                    .flat_map(|&v| match id {
                        1 => half::f16::from_f32(v).to_bits().to_le_bytes(),
                        _ => half::bf16::from_f32(v).to_bits().to_le_bytes(),
                    })
                    .collect(),
                None => {
                    let dt = if id == 2 {
                        GgmlDType::Q4_1
                    } else {
                        GgmlDType::Q8_0
                    };
                    let w = Tensor::from_vec(test_data(n * k, seed), (n, k), &Device::Cpu);
                    QTensor::quantize(&w.unwrap(), dt)
                        .unwrap()
                        .data()
                        .unwrap()
                        .to_vec()
                }
            };
            let widths = [13, 24, 40, 72];
            let raws: Vec<Vec<u8>> = widths.iter().map(|&n| raw(n, n as u64 + 5)).collect();
            for t in [1, 3, 8, 11, 13, 16, 21, 24, 45, 64] {
                let x = test_data(t * k, 40 + t as u64);
                let mut whole = Vec::new();
                for &kernel in kernels.iter().filter(|k| **k != Kernel::Scalar) {
                    let one =
                        |r: &[u8], n| CpuQWeight::from_raw(id, r, n, k, kernel).unwrap().unwrap();
                    let (fused, got_widths) =
                        CpuQWeight::concat(raws.iter().zip(widths).map(|(r, n)| one(r, n)));
                    assert_eq!(got_widths, widths);
                    let parts = fused.matmul_parts(&x, t, &widths);
                    for ((p, r), n) in parts.iter().zip(&raws).zip(widths) {
                        assert_eq!(p, &one(r, n).matmul(&x, t), "type {id} {kernel:?} t={t}");
                    }
                    whole.push((kernel, parts));
                }
                // Every SIMD path gives the same bits for every type and token count: what lets
                // the kernel choice take different paths for a decode step, a batch step and
                // a prefill chunk without a token's logits depending on its pass.
                for (kernel, parts) in &whole[1..] {
                    assert_eq!(
                        parts, &whole[0].1,
                        "type {id}: {kernel:?} vs {:?} t={t}",
                        whole[0].0
                    );
                }
            }
        }
    }

    /// A `rows` x `k` matrix of GGUF type `id` (1: F16, 30: BF16) from [`test_data`] on the
    /// 512-bit layout, and its values widened to f32.
    #[cfg(target_arch = "x86_64")]
    fn half_matrix(id: u32, rows: usize, k: usize) -> (CpuQWeight, Vec<f32>) {
        let w = test_data(rows * k, rows as u64 + k as u64);
        let raw: Vec<u8> = w
            .iter()
            .flat_map(|&v| match id {
                1 => half::f16::from_f32(v).to_bits().to_le_bytes(),
                _ => half::bf16::from_f32(v).to_bits().to_le_bytes(),
            })
            .collect();
        let m = CpuQWeight::from_raw(id, &raw, rows, k, Kernel::Vnni)
            .unwrap()
            .unwrap();
        let ty = if id == 1 { Half::F16 } else { Half::Bf16 };
        let widened = raw
            .chunks_exact(2)
            .map(|b| half_kernels::widen(ty, u16::from_le_bytes([b[0], b[1]])))
            .collect();
        (m, widened)
    }

    /// BF16 on AMX: the products of the exact bf16 parts summed in f32, so within f32 rounding
    /// of the 512-bit path's sums (relative to the sum of |w x|), for one group, a pair, and two
    /// pairs a call with a lone group at the end, ragged token counts and a wide input; the same
    /// bits run after run. F16 on the AMX path is the 512-bit path, bit for bit.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn amx_half_products_match_the_512_bit_path() {
        if !Kernel::amx_ready() {
            eprintln!("no AMX here (or Linux refused it): the AMX path is not exercised");
            return;
        }
        for id in [1u32, 30] {
            for (k, rows) in [(64, 8), (256, 16), (2048, 40), (96, 13)] {
                let (m, widened) = half_matrix(id, rows, k);
                for t in [17, 40, 100] {
                    let x = test_data(t * k, 7 + t as u64);
                    let want = m.matmul_on(Kernel::Vnni, &x, t);
                    let got = m.matmul_on(Kernel::Amx, &x, t);
                    assert_eq!(got, m.matmul_on(Kernel::Amx, &x, t));
                    assert_eq!(m.takes(Kernel::Amx), id == 30);
                    if id == 1 {
                        assert_eq!(got, want);
                        continue;
                    }
                    assert_ne!(got, want, "type {id} k={k} rows={rows} t={t}: not on AMX?");
                    for (i, (g, w0)) in got.iter().zip(&want).enumerate() {
                        let (tok, r) = (i / rows, i % rows);
                        let mag: f32 = (0..k)
                            .map(|c| (widened[r * k + c] * x[tok * k + c]).abs())
                            .sum();
                        assert!(
                            (g - w0).abs() <= mag * 1e-6,
                            "type {id} k={k} rows={rows} t={t} [{tok}, {r}]: {g} vs {w0}"
                        );
                    }
                }
            }
        }
    }

    /// BF16 on `vdpbf16ps`: the activations rounded to bf16 (as llama.cpp rounds them, and as
    /// the other paths do), every product exact, the sums f32: within f32 rounding (relative to
    /// the sum of |w x|) of the exact sum over the rounded activations, as the 512-bit path is,
    /// for one group, a pair, and two pairs a call with a lone group at the end, ragged token
    /// counts and a wide input; the same bits run after run. F16, and BF16 rows not a multiple
    /// of 32 wide, on this path are the 512-bit path, bit for bit.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn bf16_dot_products_use_rounded_activations() {
        if !Kernel::bf16_ready() {
            eprintln!("no AVX-512 BF16 here: the vdpbf16ps path is not exercised");
            return;
        }
        for id in [1u32, 30] {
            for (k, rows) in [
                (64, 8),
                (256, 16),
                (2048, 40),
                (96, 13),
                (1536, 36),
                (80, 11),
            ] {
                let (m, wide) = half_matrix(id, rows, k);
                // Rows a multiple of 32 wide only (as AMX): others stay on the 512-bit path.
                assert_eq!(m.takes(Kernel::Bf16), id == 30 && k % 32 == 0);
                for t in [1, 12, 17, 40, 100] {
                    let x = test_data(t * k, 7 + t as u64);
                    let want = m.matmul_on(Kernel::Vnni, &x, t);
                    let got = m.matmul_on(Kernel::Bf16, &x, t);
                    assert_eq!(got, m.matmul_on(Kernel::Bf16, &x, t));
                    if !m.takes(Kernel::Bf16) {
                        assert_eq!(got, want);
                        continue;
                    }
                    assert_ne!(got, want, "k={k} rows={rows} t={t}: not on vdpbf16ps?");
                    for (i, (g, w0)) in got.iter().zip(&want).enumerate() {
                        let (tok, r) = (i / rows, i % rows);
                        let xs = &x[tok * k..(tok + 1) * k];
                        let ws = &wide[r * k..(r + 1) * k];
                        let exact: f64 = ws
                            .iter()
                            .zip(xs)
                            .map(|(&w, &x)| w as f64 * half::bf16::from_f32(x).to_f64())
                            .sum();
                        let mag: f64 = ws.iter().zip(xs).map(|(&w, &x)| (w * x).abs() as f64).sum();
                        for (path, v) in [("vdpbf16ps", g), ("512-bit", w0)] {
                            assert!(
                                (*v as f64 - exact).abs() <= mag * 1e-6,
                                "{path} k={k} rows={rows} t={t} [{tok}, {r}]: {v} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn q8_1_sum_is_rounded_once_like_llama_cpp() {
        // 32 values at the top of the range: sum(q) = 32 * 127 = 4064, which f16 cannot hold
        // exactly; s must be f16(d * 4064), not f16(f16(4064) * f16(d)).
        let x = vec![1.2345f32; 32];
        let b = quantize_rows(&x, 32, true);
        let d = 1.2345f32 / 127.0;
        assert_eq!(b.offset[0], f16::from_f32(d * 4064.0).to_f32());
        assert_eq!(b.scale[0], f16::from_f32(d).to_f32());
        assert!(b.qs.iter().all(|&q| q as i8 == 127));
    }
}
