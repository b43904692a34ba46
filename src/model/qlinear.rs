//! Quantized linear layers: y = x W^T with W stored in GGUF blocks.
//!
//! On the CPU, Q4_1 and Q8_0 weights (the types of the default model) run on our own kernels;
//! every other type and every other device goes through candle's `QMatMul`. Ours exist for two
//! reasons. Accuracy: candle 0.11 rounds the Q8_1 block sum to f16 twice (`f16(sum) * f16(d)`),
//! which shifts every Q4_1 dot product enough to change greedy tokens within a few steps;
//! here activations are quantized exactly as llama.cpp does (`s = f16(d * sum)` with `d` in f32).
//! Speed: one pass over a multi-token input reads each weight row once for all tokens, and the
//! dot products use AVX2 (or AVX-512 VNNI) chosen at run time, with a portable scalar fallback.
//!
//! Shape legend: T = input rows (tokens), K = input width, N = output width (weight rows).
//! Blocks are 32 values: Q4_1 = {d: f16, m: f16, qs: [u8; 16]} (value = d * nibble + m),
//! Q8_0 = {d: f16, qs: [i8; 32]}, Q8_1 = {d: f16, s: f16, qs: [i8; 32]} with s = d * sum(qs).

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Storage, Tensor};
use half::f16;
use rayon::prelude::*;

const QK: usize = 32;
const Q4_1_BYTES: usize = 20;
const Q8_0_BYTES: usize = 34;

/// Which dot-product implementation to use; picked once from the CPU's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU supports, unless `GEN_KERNEL=scalar` (or `avx2`) asks for a
    /// slower one.
    pub fn detect() -> Self {
        if std::env::var("GEN_KERNEL").is_ok_and(|v| v == "scalar") {
            return Kernel::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let vnni =
                is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl");
            if vnni && !std::env::var("GEN_KERNEL").is_ok_and(|v| v == "avx2") {
                return Kernel::Vnni;
            }
            return Kernel::Avx2;
        }
        Kernel::Scalar
    }

    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => "avx512-vnni",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightType {
    Q4_1,
    Q8_0,
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

/// A weight matrix (N, K) in our own CPU layout.
pub struct CpuQWeight {
    ty: WeightType,
    rows: usize, // N
    cols: usize, // K
    blocks: Blocks,
    kernel: Kernel,
}

impl CpuQWeight {
    /// x: T rows of K values, row-major. Returns T rows of N values.
    pub fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        let (n_rows, k) = (self.rows, self.cols);
        debug_assert_eq!(x.len(), t * k);
        // Quantize every input row once; every weight row reuses them.
        let act = match self.ty {
            WeightType::Q4_1 => quantize_q8_1(x, k),
            WeightType::Q8_0 => quantize_q8_0(x, k),
        };
        // Output computed as (N, T) so each weight row is read once for all T tokens, in parallel
        // over chunks of weight rows; transposed to (T, N) at the end when T > 1.
        let mut out_nt = vec![0f32; n_rows * t];
        let chunk_rows = (n_rows / (rayon::current_num_threads() * 8)).clamp(16, 512);
        out_nt
            .par_chunks_mut(chunk_rows * t)
            .enumerate()
            .for_each(|(c, out)| {
                let first = c * chunk_rows;
                for (i, out_row) in out.chunks_mut(t).enumerate() {
                    let w = self.blocks.row(first + i);
                    let mut tt = 0;
                    // Four tokens at a time share each unpacked weight block (prefill).
                    while tt + 4 <= t && self.has_dot4() {
                        let a = [
                            act.row(tt),
                            act.row(tt + 1),
                            act.row(tt + 2),
                            act.row(tt + 3),
                        ];
                        out_row[tt..tt + 4].copy_from_slice(&self.dot4(w, a));
                        tt += 4;
                    }
                    for (o, tt) in out_row[tt..].iter_mut().zip(tt..) {
                        *o = self.dot(w, act.row(tt));
                    }
                }
            });
        if t == 1 {
            return out_nt;
        }
        let mut out = vec![0f32; t * n_rows];
        for n in 0..n_rows {
            for tt in 0..t {
                out[tt * n_rows + n] = out_nt[n * t + tt];
            }
        }
        out
    }

    fn has_dot4(&self) -> bool {
        self.ty == WeightType::Q4_1 && self.kernel != Kernel::Scalar
    }

    /// The dot products of one weight row with four activation rows.
    #[inline]
    fn dot4(&self, w: Row<'_>, a: [Row<'_>; 4]) -> [f32; 4] {
        // SAFETY (all unsafe calls below): a SIMD kernel is only chosen when the CPU reports
        // its features (Kernel::detect), and rows of one matrix hold the same block count.
        match (self.ty, self.kernel) {
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q4_1, Kernel::Avx2) => unsafe { x86::avx2::dot4_q4_1_q8_1(w, a) },
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q4_1, Kernel::Vnni) => unsafe { x86::vnni::dot4_q4_1_q8_1(w, a) },
            _ => a.map(|a| self.dot(w, a)),
        }
    }

    #[inline]
    fn dot(&self, w: Row<'_>, a: Row<'_>) -> f32 {
        match (self.ty, self.kernel) {
            (WeightType::Q4_1, Kernel::Scalar) => dot_q4_1_q8_1_scalar(w, a),
            (WeightType::Q8_0, Kernel::Scalar) => dot_q8_0_q8_0_scalar(w, a),
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q4_1, Kernel::Avx2) => unsafe { x86::avx2::dot_q4_1_q8_1(w, a) },
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q8_0, Kernel::Avx2) => unsafe { x86::avx2::dot_q8_0_q8_0(w, a) },
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q4_1, Kernel::Vnni) => unsafe { x86::vnni::dot_q4_1_q8_1(w, a) },
            #[cfg(target_arch = "x86_64")]
            (WeightType::Q8_0, Kernel::Vnni) => unsafe { x86::vnni::dot_q8_0_q8_0(w, a) },
        }
    }
}

/// Several linear layers reading the same input (q, k and v; gate and up), run as one matrix
/// when our kernels apply: one quantization of the input and one parallel region instead of
/// several, which is most of the per-layer overhead of a one-token decode step.
pub enum Projections {
    Fused { linear: QLinear, widths: Vec<usize> },
    Separate(Vec<QLinear>),
}

impl Projections {
    pub fn new(parts: Vec<QLinear>) -> Self {
        let fusable = parts.iter().all(|p| matches!(p, QLinear::Cpu(_)))
            && parts.windows(2).all(|w| match (&w[0], &w[1]) {
                (QLinear::Cpu(a), QLinear::Cpu(b)) => {
                    a.ty == b.ty && a.cols == b.cols && a.kernel == b.kernel
                }
                _ => false,
            });
        if !fusable || parts.is_empty() {
            return Projections::Separate(parts);
        }
        let mut widths = Vec::new();
        let mut ws = parts.into_iter().map(|p| match p {
            QLinear::Cpu(w) => w,
            QLinear::Candle(_) | QLinear::Dense(_) => unreachable!("checked above"),
        });
        let mut all = ws.next().expect("not empty");
        widths.push(all.rows);
        for w in ws {
            widths.push(w.rows);
            all.rows += w.rows;
            all.blocks.scale.extend_from_slice(&w.blocks.scale);
            all.blocks.offset.extend_from_slice(&w.blocks.offset);
            all.blocks.qs.extend_from_slice(&w.blocks.qs);
        }
        Projections::Fused {
            linear: QLinear::Cpu(all),
            widths,
        }
    }

    /// x: (T, K) -> one (T, N_i) per projection.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(ps) => ps.iter().map(|p| p.forward(x)).collect(),
            Projections::Fused { linear, widths } => {
                let y = linear.forward(x)?;
                let last = y.rank() - 1;
                let mut at = 0;
                widths
                    .iter()
                    .map(|&w| {
                        let part = y.narrow(last, at, w)?.contiguous()?;
                        at += w;
                        Ok(part)
                    })
                    .collect()
            }
        }
    }
}

/// A linear layer: our CPU kernels where they apply, a plain matrix for unquantized weights,
/// candle's QMatMul elsewhere.
pub enum QLinear {
    Cpu(CpuQWeight),
    Candle(QMatMul),
    /// An f32, f16 or bf16 weight (N, K), kept in its own type: the input is converted to it
    /// for the multiply and the output back to the input's type.
    Dense(Tensor),
}

impl QLinear {
    pub fn new(q: QTensor, device: &Device) -> Result<Self> {
        Self::with_kernel(q, device, Kernel::detect())
    }

    pub fn with_kernel(q: QTensor, device: &Device, kernel: Kernel) -> Result<Self> {
        let ty = match q.dtype() {
            GgmlDType::Q4_1 => Some(WeightType::Q4_1),
            GgmlDType::Q8_0 => Some(WeightType::Q8_0),
            _ => None,
        };
        match (ty, device) {
            (Some(ty), Device::Cpu) => {
                let (rows, cols) = q.shape().dims2()?;
                if cols % QK != 0 {
                    bail!("a weight's width {cols} is not a multiple of the block size {QK}");
                }
                let raw = q.data()?;
                let block_bytes = if ty == WeightType::Q4_1 {
                    Q4_1_BYTES
                } else {
                    Q8_0_BYTES
                };
                let expected = rows * cols / QK * block_bytes;
                if raw.len() != expected {
                    bail!(
                        "a {rows}x{cols} weight holds {} bytes, expected {expected}",
                        raw.len()
                    );
                }
                let blocks = Blocks::from_gguf(&raw, ty, cols / QK);
                Ok(QLinear::Cpu(CpuQWeight {
                    ty,
                    rows,
                    cols,
                    blocks,
                    kernel,
                }))
            }
            _ => {
                // candle's QMatMul would widen f16 and bf16 weights to f32; keep their type.
                let dense = match q.dtype() {
                    GgmlDType::F32 => Some(DType::F32),
                    GgmlDType::F16 => Some(DType::F16),
                    GgmlDType::BF16 => Some(DType::BF16),
                    _ => None,
                };
                match dense {
                    Some(dt) => Ok(QLinear::Dense(q.dequantize(device)?.to_dtype(dt)?)),
                    None => Ok(QLinear::Candle(QMatMul::from_qtensor(q)?)),
                }
            }
        }
    }

    /// x: (..., K) -> (..., N)
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            QLinear::Candle(m) => Ok(m.forward(x)?),
            QLinear::Dense(w) => {
                let y = x.to_dtype(w.dtype())?.broadcast_matmul(&w.t()?)?;
                Ok(y.to_dtype(x.dtype())?)
            }
            QLinear::Cpu(w) => {
                let dims = x.dims().to_vec();
                let k = *dims.last().unwrap_or(&0);
                if k != w.cols {
                    bail!(
                        "linear layer expects width {}, got input of shape {dims:?}",
                        w.cols
                    );
                }
                let t = x.elem_count() / k.max(1);
                let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
                let y = {
                    let (storage, layout) = x.storage_and_layout();
                    let Storage::Cpu(cpu) = &*storage else {
                        bail!("expected a CPU tensor")
                    };
                    let all = cpu.as_slice::<f32>()?;
                    let start = layout.start_offset();
                    w.matmul(&all[start..start + t * k], t)
                };
                let mut out_dims = dims;
                *out_dims.last_mut().unwrap() = w.rows;
                Ok(Tensor::from_vec(y, out_dims, &Device::Cpu)?)
            }
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// f32 -> f16 -> f32: the precision llama.cpp stores activation scales in.
fn through_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Round to the nearest integer, ties to even, for |v| <= 2^22: adding and removing 1.5 * 2^23
/// leaves no fraction bits, so the FPU's own rounding does the work (inlined, unlike libm's
/// rintf, which showed up in profiles).
#[inline(always)]
fn round_half_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

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
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (v, q) in blk.iter().zip(q.iter_mut()) {
            let qi = round_half_even(v * id) as i8;
            *q = qi as u8;
            sum += qi as i32;
        }
        b.scale.push(through_f16(d));
        if with_sums {
            b.offset.push(through_f16(d * sum as f32));
        }
    }
    b
}

/// Quantize rows of K values into Q8_1 blocks, as llama.cpp does: d = amax / 127 (kept at f16
/// precision), q = round-half-even(x * 127 / amax), s = d * sum(q) computed in f32 and then
/// rounded to f16 once.
fn quantize_q8_1(x: &[f32], k: usize) -> Blocks {
    quantize_rows(x, k, true)
}

/// Quantize rows of K values into Q8_0 blocks: d = amax / 127 (f16), q = round(x * 127 / amax).
fn quantize_q8_0(x: &[f32], k: usize) -> Blocks {
    quantize_rows(x, k, false)
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
    ($name:ident, $features:literal, $mul_sum:ident) => {
        pub mod $name {
            use super::super::{Row, QK};
            use std::arch::x86_64::*;

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn hsum_f32(v: __m256) -> f32 {
                let lo = _mm256_castps256_ps128(v);
                let hi = _mm256_extractf128_ps(v, 1);
                let s = _mm_add_ps(lo, hi);
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                _mm_cvtss_f32(s)
            }

            /// Sum of m_w * s_a over the blocks: contiguous arrays, so it vectorises on its own.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn offsets(w: &[f32], a: &[f32]) -> f32 {
                w.iter().zip(a).map(|(x, y)| x * y).sum()
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn unpack_q4(ptr: *const u8) -> __m256i {
                let mask = _mm_set1_epi8(0x0F);
                let packed = _mm_loadu_si128(ptr as *const __m128i);
                let lo = _mm_and_si128(packed, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
                // Nibbles in the order of the activations: 16 low ones, then 16 high ones.
                _mm256_set_m128i(hi, lo)
            }

            /// # Safety
            /// The CPU must support the features; `w` and `a` must hold the same number of blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q4_1_q8_1(w: Row<'_>, a: Row<'_>) -> f32 {
                let nb = w.scale.len();
                debug_assert!(
                    a.scale.len() >= nb && a.qs.len() >= nb * QK && w.qs.len() >= nb * 16
                );
                let mut acc = _mm256_setzero_ps();
                let (wq, aq) = (w.qs.as_ptr(), a.qs.as_ptr());
                for b in 0..nb {
                    let d = w.scale.get_unchecked(b) * a.scale.get_unchecked(b);
                    let qw = unpack_q4(wq.add(b * 16));
                    let qa = _mm256_loadu_si256(aq.add(b * QK) as *const __m256i);
                    let prod = super::$mul_sum(qw, qa);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(prod), acc);
                }
                hsum_f32(acc) + offsets(w.offset, &a.offset[..nb])
            }

            /// Four activation rows against one Q4_1 weight row: each weight block is unpacked once.
            ///
            /// # Safety
            /// The CPU must support the features; every row must hold the same number of blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn dot4_q4_1_q8_1(w: Row<'_>, a: [Row<'_>; 4]) -> [f32; 4] {
                let nb = w.scale.len();
                debug_assert!(a
                    .iter()
                    .all(|a| a.scale.len() >= nb && a.qs.len() >= nb * QK));
                let mut acc = [_mm256_setzero_ps(); 4];
                let wq = w.qs.as_ptr();
                for b in 0..nb {
                    let dw = *w.scale.get_unchecked(b);
                    let qw = unpack_q4(wq.add(b * 16));
                    for i in 0..4 {
                        let ai = a.get_unchecked(i);
                        let qa = _mm256_loadu_si256(ai.qs.as_ptr().add(b * QK) as *const __m256i);
                        let prod = super::$mul_sum(qw, qa);
                        let d = _mm256_set1_ps(dw * ai.scale.get_unchecked(b));
                        acc[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(prod), acc[i]);
                    }
                }
                let mut out = [0f32; 4];
                for i in 0..4 {
                    out[i] = hsum_f32(acc[i]) + offsets(w.offset, &a[i].offset[..nb]);
                }
                out
            }

            /// # Safety
            /// The CPU must support the features; `w` and `a` must hold the same number of blocks.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q8_0_q8_0(w: Row<'_>, a: Row<'_>) -> f32 {
                let nb = w.scale.len();
                debug_assert!(
                    a.scale.len() >= nb && a.qs.len() >= nb * QK && w.qs.len() >= nb * QK
                );
                let mut acc = _mm256_setzero_ps();
                let (wq, aq) = (w.qs.as_ptr(), a.qs.as_ptr());
                for b in 0..nb {
                    let d = w.scale.get_unchecked(b) * a.scale.get_unchecked(b);
                    let qw = _mm256_loadu_si256(wq.add(b * QK) as *const __m256i);
                    let qa = _mm256_loadu_si256(aq.add(b * QK) as *const __m256i);
                    // The byte products take an unsigned operand: move w's sign onto a.
                    let prod = super::$mul_sum(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(prod), acc);
                }
                hsum_f32(acc)
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Eight lanes of sum(u8 * i8) over groups of four bytes, in two instructions.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn mul_sum_avx2(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// The same in one VNNI instruction.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    unsafe fn mul_sum_vnni(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }

    x86_kernels!(avx2, "avx2,fma", mul_sum_avx2);
    x86_kernels!(vnni, "avx2,fma,avx512vnni,avx512vl", mul_sum_vnni);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// A deterministic pseudo-random matrix with a spread of magnitudes and signs.
    fn data(n: usize, seed: u64) -> Vec<f32> {
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

    fn reference(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * n];
        for i in 0..t {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|c| x[i * k + c] as f64 * w[j * k + c] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    fn kernels() -> Vec<Kernel> {
        let mut k = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            k.push(Kernel::Avx2);
            if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                k.push(Kernel::Vnni);
            }
        }
        k
    }

    /// Every kernel against the plain f32 product of the dequantized weights, for ragged sizes
    /// (N not a multiple of the chunk, T from 1 to many). Tolerance: activation quantization to
    /// 8 bits bounds the relative error per block at about 1/254; we allow 2% of the row's scale.
    #[test]
    fn kernels_match_the_dequantized_reference() {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            for &(t, n, k) in &[
                (1, 1, 32),
                (1, 37, 64),
                (3, 130, 96),
                (17, 19, 576),
                (1, 1000, 160),
            ] {
                let w = Tensor::from_vec(data(n * k, 7 + n as u64), (n, k), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let wd = q
                    .dequantize(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let x = data(t * k, 99 + t as u64);
                let want = reference(&x, &wd, t, n, k);
                let scale = (k as f32).sqrt() * 4.0;
                let xt = Tensor::from_vec(x.clone(), (t, k), &Device::Cpu).unwrap();
                let mut outs = Vec::new();
                for kernel in kernels() {
                    let lin = QLinear::with_kernel(
                        QTensor::quantize(&w, dtype).unwrap(),
                        &Device::Cpu,
                        kernel,
                    )
                    .unwrap();
                    let got = lin.forward(&xt).unwrap();
                    assert_eq!(got.dims(), &[t, n]);
                    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - e).abs() <= 0.02 * scale,
                            "{dtype:?} {kernel:?} t={t} n={n} k={k} [{i}]: {g} vs {e}"
                        );
                    }
                    outs.push(got);
                }
                // The fast kernel computes the same integer sums: only float summation order differs.
                for o in &outs[1..] {
                    for (a, b) in o.iter().zip(&outs[0]) {
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "{dtype:?}: fast {a} vs scalar {b}"
                        );
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
        let b = quantize_q8_1(&x, 32);
        let d = 1.2345f32 / 127.0;
        assert_eq!(b.offset[0], f16::from_f32(d * 4064.0).to_f32());
        assert_eq!(b.scale[0], f16::from_f32(d).to_f32());
        assert!(b.qs.iter().all(|&q| q as i8 == 127));
    }

    #[test]
    fn rounding_matches_round_ties_even() {
        for i in -2540..=2540 {
            let v = i as f32 * 0.05;
            assert_eq!(round_half_even(v), v.round_ties_even(), "{v}");
        }
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(-3.5), -4.0);
    }

    #[test]
    fn fused_projections_equal_separate_ones() {
        let k = 64;
        let mk = |n: usize, seed: u64| {
            let w = Tensor::from_vec(data(n * k, seed), (n, k), &Device::Cpu).unwrap();
            QLinear::new(
                QTensor::quantize(&w, GgmlDType::Q4_1).unwrap(),
                &Device::Cpu,
            )
            .unwrap()
        };
        let x = Tensor::from_vec(data(3 * k, 5), (3, k), &Device::Cpu).unwrap();
        let separate: Vec<Vec<f32>> = [(32, 1), (8, 2), (8, 3)]
            .iter()
            .map(|&(n, s)| {
                mk(n, s)
                    .forward(&x)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        let fused = Projections::new(vec![mk(32, 1), mk(8, 2), mk(8, 3)]);
        assert!(matches!(fused, Projections::Fused { .. }));
        let outs = fused.forward(&x).unwrap();
        for (o, s) in outs.iter().zip(&separate) {
            assert_eq!(&o.flatten_all().unwrap().to_vec1::<f32>().unwrap(), s);
        }
    }

    #[test]
    fn three_d_inputs_and_zero_rows_work() {
        let (n, k) = (8, 64);
        let w = Tensor::from_vec(data(n * k, 3), (n, k), &Device::Cpu).unwrap();
        let lin = QLinear::new(
            QTensor::quantize(&w, GgmlDType::Q8_0).unwrap(),
            &Device::Cpu,
        )
        .unwrap();
        let x = Tensor::zeros((2, 3, k), DType::F32, &Device::Cpu).unwrap();
        let y = lin.forward(&x).unwrap();
        assert_eq!(y.dims(), &[2, 3, n]);
        assert!(y
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| *v == 0.0));
    }
}
