//! F16 and BF16 weights on gen's own kernels: y = x W^T with W kept in its 16-bit type (the
//! bytes a decode step reads are the file's), widened in registers, multiplied with the
//! activations rounded to the weights' type first, as llama.cpp rounds them ([`rounded`]: its
//! `vec_dot_type` for F16 is F16, for BF16 BF16). Every product of two such values is exact in
//! f32 (11 + 11 or 8 + 8 significant bits), so the paths differ only in the order of their f32
//! sums, as llama.cpp's do.
//!
//! Layout: rows in groups of 8; within a group, column by column, the 8 rows' values side by
//! side (16 bytes), so one load and one widening give a column of 8 rows in the 8 lanes of a
//! register, and a multiply-add with one activation broadcast to every lane adds that column's
//! products to 8 rows' sums: no horizontal sums. Up to 6 tokens share each widened column. For
//! a prefill on AVX2, a group is widened to f32 once per block of tokens (`tile_f32`, see
//! matmul.rs's `WIDEN_TOKENS`), not in every call.

use half::{bf16, f16};

use super::buf::Buf;

/// Which 16-bit type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    F16,
    Bf16,
}

/// Rows in groups of 8, column-interleaved (see the module doc); the last group's padding rows
/// are zero. Rows have an even number of columns (odd widths are refused at load).
pub struct HalfTiles {
    pub ty: Half,
    bits: Buf<u16>,
    pub groups: usize,
    pub cols: usize,
}

impl HalfTiles {
    /// `rows` x `cols` values of `ty` as the file stores them (little-endian 16-bit words).
    pub fn from_raw(ty: Half, raw: &[u8], rows: usize, cols: usize) -> Self {
        use rayon::prelude::*;
        let groups = rows.div_ceil(8);
        let mut bits = super::buf::zeroed::<u16>(groups * cols * 8);
        bits.par_chunks_mut(cols * 8)
            .enumerate()
            .for_each(|(g, out)| {
                for r in 0..8.min(rows - g * 8) {
                    let row = &raw[(g * 8 + r) * cols * 2..(g * 8 + r + 1) * cols * 2];
                    for (c, v) in row.chunks_exact(2).enumerate() {
                        out[c * 8 + r] = u16::from_le_bytes([v[0], v[1]]);
                    }
                }
            });
        HalfTiles {
            ty,
            bits: bits.into(),
            groups,
            cols,
        }
    }

    /// The tiles' one buffer (what the tile cache keeps).
    pub fn buffer(&self) -> &Buf<u16> {
        &self.bits
    }

    /// Tiles of `groups` groups of 8 rows of `cols` values of `ty` held in `bits` (as
    /// [`Self::buffer`] gave them); None where the sizes disagree.
    pub fn from_buffer(ty: Half, bits: Buf<u16>, groups: usize, cols: usize) -> Option<Self> {
        (bits.len() == groups * cols * 8 && cols.is_multiple_of(2)).then_some(HalfTiles {
            ty,
            bits,
            groups,
            cols,
        })
    }

    pub fn tile(&self, g: usize) -> &[u16] {
        &self.bits[g * self.cols * 8..(g + 1) * self.cols * 8]
    }

    pub fn append(&mut self, other: HalfTiles) {
        self.bits.append(&other.bits);
        self.groups += other.groups;
    }
}

/// One 16-bit value widened.
#[inline]
pub fn widen(ty: Half, b: u16) -> f32 {
    match ty {
        Half::F16 => f16::from_bits(b).to_f32(),
        Half::Bf16 => bf16::from_bits(b).to_f32(),
    }
}

/// The activations `x` as llama.cpp multiplies them with weights of type `ty`: each rounded to
/// `ty` (to nearest, ties to even, as F16C's `vcvtps2ph` and llama.cpp's `GGML_FP32_TO_BF16`
/// round; a NaN stays a NaN; subnormals are rounded, not flushed) and widened back to f32.
/// Until 2026-12-06 gen multiplied the unrounded values: on BF16 copies of llama.cpp's
/// architecture suite that put its logits 2.7e-6 to 4.5e-6 (NMSE) from llama.cpp's, where F32
/// files agree within 5e-8.
pub fn rounded(ty: Half, x: &[f32]) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; x.len()];
    // A prefill's activations over the threads; a decode step's (a few thousand values) here.
    const PIECE: usize = 1 << 14;
    if x.len() > PIECE {
        out.par_chunks_mut(PIECE)
            .zip(x.par_chunks(PIECE))
            .for_each(|(o, x)| rounded_into(ty, x, o));
    } else {
        rounded_into(ty, x, &mut out);
    }
    out
}

/// [`rounded`] into `out` (as long as `x`), on this thread.
pub fn rounded_into(ty: Half, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
        // SAFETY: the features were just checked; the slices have the same length.
        return unsafe { rounded_avx2(ty, x, out) };
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round_one(ty, v);
    }
}

/// One value as [`rounded`] rounds it.
fn round_one(ty: Half, v: f32) -> f32 {
    match ty {
        Half::F16 => f16::from_f32(v).to_f32(),
        Half::Bf16 => bf16::from_f32(v).to_f32(),
    }
}

/// [`rounded`], 8 values at a time (the rest one by one).
///
/// # Safety
/// The CPU must have AVX2 and F16C; `out` as long as `x`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn rounded_avx2(ty: Half, x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let whole = x.len() / 8 * 8;
    let (bias, one) = (_mm256_set1_epi32(0x7fff), _mm256_set1_epi32(1));
    let top = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    for c in (0..whole).step_by(8) {
        let v = _mm256_loadu_ps(x.as_ptr().add(c));
        let r = match ty {
            Half::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
            Half::Bf16 => {
                let u = _mm256_castps_si256(v);
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(u), one);
                let up = _mm256_add_epi32(u, _mm256_add_epi32(bias, lsb));
                let r = _mm256_castsi256_ps(_mm256_and_si256(up, top));
                // A NaN keeps its top half, made quiet (bf16's own rounding does the same).
                let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
                let quiet = _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_or_si256(u, _mm256_set1_epi32(0x0040_0000)),
                    top,
                ));
                _mm256_blendv_ps(r, quiet, nan)
            }
        };
        _mm256_storeu_ps(out.as_mut_ptr().add(c), r);
    }
    for c in whole..x.len() {
        out[c] = round_one(ty, x[c]);
    }
}

/// Tokens x[0..n] (rows of `k` values, row-major) against one group of 8 rows, written to
/// out + i * stride (the first `real` rows). The portable kernel: the same products, summed
/// in the same order per row, as the SIMD ones (whose fused multiply-adds round once).
///
/// # Safety
/// `x` holds n rows of k values; `out` is valid for those writes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn scalar_tile(
    ty: Half,
    w: &[u16],
    x: *const f32,
    k: usize,
    n: usize,
    out: *mut f32,
    stride: usize,
    real: usize,
) {
    for i in 0..n {
        let xi = std::slice::from_raw_parts(x.add(i * k), k);
        // Two partial sums (even and odd columns), added at the end: as the SIMD kernels.
        let mut acc = [[0f32; 8]; 2];
        for (c, &xv) in xi.iter().enumerate() {
            for (r, a) in acc[c % 2].iter_mut().enumerate() {
                *a = widen(ty, w[c * 8 + r]).mul_add(xv, *a);
            }
        }
        let sum: Vec<f32> = (0..8).map(|r| acc[0][r] + acc[1][r]).collect();
        std::ptr::copy_nonoverlapping(sum.as_ptr(), out.add(i * stride), real);
    }
}

#[cfg(target_arch = "x86_64")]
macro_rules! half_kernels {
    ($name:ident, $features:literal) => {
        pub mod $name {
            use crate::model::cpu::q8::simd::store;
            use std::arch::x86_64::*;

            /// N tokens at x (rows of k values) against one group of 8 rows, as
            /// [`super::scalar_tile`].
            ///
            /// # Safety
            /// The CPU must support the features; x holds N rows of k values, w k * 8 values;
            /// out is valid for the writes.
            #[target_feature(enable = $features)]
            pub unsafe fn tile<const BF: bool, const N: usize>(
                w: &[u16],
                x: *const f32,
                k: usize,
                out: *mut f32,
                stride: usize,
                real: usize,
                stream: bool,
            ) {
                debug_assert!(w.len() >= k * 8 && k % 2 == 0);
                let p = w.as_ptr();
                let load = |c: usize| widen8::<BF>(p.add(c * 8));
                columns!(N, load, p, x, k, out, stride, real, stream);
            }

            /// As [`tile`], on a group already widened to f32 (k * 8 values, the same layout):
            /// the same products in the same order, so the same bits.
            ///
            /// # Safety
            /// As for [`tile`], with w of k * 8 values.
            #[target_feature(enable = $features)]
            pub unsafe fn tile_f32<const N: usize>(
                w: &[f32],
                x: *const f32,
                k: usize,
                out: *mut f32,
                stride: usize,
                real: usize,
            ) {
                debug_assert!(w.len() >= k * 8 && k % 2 == 0);
                let p = w.as_ptr();
                let load = |c: usize| _mm256_loadu_ps(p.add(c * 8));
                columns!(N, load, p, x, k, out, stride, real, false);
            }

            /// As [`tile_f32`] for two neighbouring groups (w0 and w1, k * 8 values each; rows
            /// 0..8 and 8..16 of out, the first `real` > 8 of them): each activation broadcast
            /// serves both, the weights come from memory into the multiply-adds. Every row's
            /// sums are the ones `tile_f32` makes, in the same order: the same bits.
            ///
            /// # Safety
            /// As for [`tile_f32`], out valid for `real` values a token.
            #[target_feature(enable = $features)]
            pub unsafe fn tile2_f32<const N: usize>(
                w0: &[f32],
                w1: &[f32],
                x: *const f32,
                k: usize,
                out: *mut f32,
                stride: usize,
                real: usize,
            ) {
                debug_assert!(w0.len() >= k * 8 && w1.len() >= k * 8 && k % 2 == 0);
                debug_assert!(real > 8 && real <= 16);
                let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
                let mut acc = [[_mm256_setzero_ps(); N]; 2];
                let mut odd = [[_mm256_setzero_ps(); N]; 2];
                for c in (0..k).step_by(2) {
                    for i in 0..N {
                        let b0 = _mm256_set1_ps(*x.add(i * k + c));
                        let b1 = _mm256_set1_ps(*x.add(i * k + c + 1));
                        acc[0][i] = _mm256_fmadd_ps(_mm256_loadu_ps(p0.add(c * 8)), b0, acc[0][i]);
                        acc[1][i] = _mm256_fmadd_ps(_mm256_loadu_ps(p1.add(c * 8)), b0, acc[1][i]);
                        odd[0][i] =
                            _mm256_fmadd_ps(_mm256_loadu_ps(p0.add(c * 8 + 8)), b1, odd[0][i]);
                        odd[1][i] =
                            _mm256_fmadd_ps(_mm256_loadu_ps(p1.add(c * 8 + 8)), b1, odd[1][i]);
                    }
                }
                for h in 0..2 {
                    for i in 0..N {
                        acc[h][i] = _mm256_add_ps(acc[h][i], odd[h][i]);
                    }
                }
                store(&acc[0], out, stride, 8);
                store(&acc[1], out.add(8), stride, real - 8);
            }

            /// A group's k * 8 values widened to f32 into `out`, in place.
            ///
            /// # Safety
            /// The CPU must support the features; out holds at least w.len() values.
            #[target_feature(enable = $features)]
            pub unsafe fn widen_group<const BF: bool>(w: &[u16], out: &mut [f32]) {
                debug_assert!(out.len() >= w.len() && w.len() % 8 == 0);
                for c in 0..w.len() / 8 {
                    _mm256_storeu_ps(
                        out.as_mut_ptr().add(c * 8),
                        widen8::<BF>(w.as_ptr().add(c * 8)),
                    );
                }
            }

            /// One column of a group: 8 values widened to 8 f32 lanes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn widen8<const BF: bool>(p: *const u16) -> __m256 {
                let raw = _mm_loadu_si128(p as *const __m128i);
                if BF {
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                } else {
                    _mm256_cvtph_ps(raw)
                }
            }
        }
    };
}

/// The column loop of the 256-bit kernels: `$load(c)` gives column c of the group (8 rows
/// as f32 lanes), multiplied with N tokens' activations at $x (rows of $k values).
#[cfg(target_arch = "x86_64")]
macro_rules! columns {
    ($n:ident, $load:ident, $p:ident, $x:ident, $k:ident, $out:ident, $stride:ident, $real:ident, $stream:expr) => {{
        // Two partial sums per token (even and odd columns): two independent chains of
        // multiply-adds, so a one-token call is not bound by their latency.
        let mut acc = [_mm256_setzero_ps(); $n];
        let mut odd = [_mm256_setzero_ps(); $n];
        for c in (0..$k).step_by(2) {
            if $stream && c % 4 == 0 {
                _mm_prefetch::<_MM_HINT_T0>($p.wrapping_add(c * 8 + 1024) as *const i8);
            }
            let (w0, w1) = ($load(c), $load(c + 1));
            for i in 0..$n {
                acc[i] = _mm256_fmadd_ps(w0, _mm256_set1_ps(*$x.add(i * $k + c)), acc[i]);
                odd[i] = _mm256_fmadd_ps(w1, _mm256_set1_ps(*$x.add(i * $k + c + 1)), odd[i]);
            }
        }
        for i in 0..$n {
            acc[i] = _mm256_add_ps(acc[i], odd[i]);
        }
        store(&acc, $out, $stride, $real);
    }};
}

/// Two neighbouring groups (16 rows) per call on 512-bit registers: each lane does what the
/// 256-bit kernels do for its row, in the same order (the sums are theirs bit for bit), with
/// one activation broadcast serving 16 rows.
#[cfg(target_arch = "x86_64")]
pub mod zmm {
    use std::arch::x86_64::*;

    /// One column of two groups: 8 values at p0 and 8 at p1, widened to 16 f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn widen2<const BF: bool>(p0: *const u16, p1: *const u16) -> __m512 {
        let lo = _mm_loadu_si128(p0 as *const __m128i);
        let hi = _mm_loadu_si128(p1 as *const __m128i);
        let raw = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi);
        if BF {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        } else {
            _mm512_cvtph_ps(raw)
        }
    }

    /// N tokens at x (rows of k values) against groups w0 (outputs 0..8) and w1 (8..16),
    /// written to out + i * stride, the first `real` outputs.
    ///
    /// # Safety
    /// The CPU must support the features; x holds N rows of k values, w0 and w1 k * 8 values
    /// each; out is valid for the writes.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn tile2<const BF: bool, const N: usize>(
        w0: &[u16],
        w1: &[u16],
        x: *const f32,
        k: usize,
        out: *mut f32,
        stride: usize,
        real: usize,
        stream: bool,
    ) {
        debug_assert!(w0.len() >= k * 8 && w1.len() >= k * 8 && k.is_multiple_of(2));
        let mut acc = [_mm512_setzero_ps(); N];
        let mut odd = [_mm512_setzero_ps(); N];
        let (p0, p1) = (w0.as_ptr(), w1.as_ptr());
        let load = |c: usize| widen2::<BF>(p0.add(c * 8), p1.add(c * 8));
        for c in (0..k).step_by(2) {
            if stream && c % 4 == 0 {
                _mm_prefetch::<_MM_HINT_T0>(p0.wrapping_add(c * 8 + 1024) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(p1.wrapping_add(c * 8 + 1024) as *const i8);
            }
            let (v0, v1) = (load(c), load(c + 1));
            for i in 0..N {
                acc[i] = _mm512_fmadd_ps(v0, _mm512_set1_ps(*x.add(i * k + c)), acc[i]);
                odd[i] = _mm512_fmadd_ps(v1, _mm512_set1_ps(*x.add(i * k + c + 1)), odd[i]);
            }
        }
        let mask: __mmask16 = if real >= 16 { !0 } else { (1u16 << real) - 1 };
        for i in 0..N {
            _mm512_mask_storeu_ps(out.add(i * stride), mask, _mm512_add_ps(acc[i], odd[i]));
        }
    }

    /// Two or four neighbouring groups (`ws`: one or two pairs) widened to f32 for
    /// [`tile_f32`], into `dst`: per pair, per column, the pair's 16 rows (the first group's 8,
    /// then the second's) as [`widen2`] makes them for [`tile2`] and [`tile4`], so the products
    /// are theirs.
    ///
    /// # Safety
    /// The CPU must support the features; each group holds k * 8 values.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn widen_pairs<const BF: bool>(ws: &[&[u16]], k: usize, dst: &mut Vec<__m512>) {
        debug_assert!(matches!(ws.len(), 2 | 4) && ws.iter().all(|w| w.len() >= k * 8));
        let pairs = ws.len() / 2;
        dst.clear();
        dst.reserve(pairs * k);
        for h in 0..pairs {
            let (p0, p1) = (ws[2 * h].as_ptr(), ws[2 * h + 1].as_ptr());
            for c in 0..k {
                dst.push(widen2::<BF>(p0.add(c * 8), p1.add(c * 8)));
            }
        }
    }

    /// [`tile2`] (H = 1) or [`tile4`] (H = 2) on groups widened once by [`widen_pairs`]
    /// (`wide`), the same products in the same order, so the same bits: the multiply-adds take
    /// their weights straight from L1 or L2 instead of widening every column in every call
    /// (the widening's loads, inserts and conversions held a call to about 80% of the
    /// multiply-add peak on Zen 4; from f32, all of it, in a C model of the loop).
    ///
    /// # Safety
    /// As [`tile4`]; `wide` as [`widen_pairs`] made it for H pairs of k columns.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn tile_f32<const H: usize, const N: usize>(
        wide: &[__m512],
        x: *const f32,
        k: usize,
        out: *mut f32,
        stride: usize,
        real: usize,
    ) {
        debug_assert!(N <= 6 && (H == 1 || H == 2) && wide.len() >= H * k && k.is_multiple_of(2));
        let mut sums = Sums::<H, N>::new();
        let w = wide.as_ptr();
        for c in (0..k).step_by(2) {
            let v: [__m512; H] = std::array::from_fn(|h| *w.add(h * k + c));
            let u: [__m512; H] = std::array::from_fn(|h| *w.add(h * k + c + 1));
            sums.add_columns(v, u, x, k, c);
        }
        sums.store(out, stride, real);
    }

    /// N tokens' sums over H registers of 16 rows: even and odd columns apart, added at the
    /// end (the 256-bit kernels' order, lane by lane).
    struct Sums<const H: usize, const N: usize> {
        even: [[__m512; H]; N],
        odd: [[__m512; H]; N],
    }

    impl<const H: usize, const N: usize> Sums<H, N> {
        #[inline]
        #[target_feature(enable = "avx512f")]
        fn new() -> Self {
            Sums {
                even: [[_mm512_setzero_ps(); H]; N],
                odd: [[_mm512_setzero_ps(); H]; N],
            }
        }

        /// Columns c (widened: v) and c + 1 (u) times each token's activations there (x: N
        /// rows of k values).
        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")]
        unsafe fn add_columns(
            &mut self,
            v: [__m512; H],
            u: [__m512; H],
            x: *const f32,
            k: usize,
            c: usize,
        ) {
            for i in 0..N {
                let a = _mm512_set1_ps(*x.add(i * k + c));
                let b = _mm512_set1_ps(*x.add(i * k + c + 1));
                for h in 0..H {
                    self.even[i][h] = _mm512_fmadd_ps(v[h], a, self.even[i][h]);
                    self.odd[i][h] = _mm512_fmadd_ps(u[h], b, self.odd[i][h]);
                }
            }
        }

        /// Token i's sums to out + i * stride (16 * H rows, the first `real`).
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn store(&self, out: *mut f32, stride: usize, real: usize) {
            let lanes = |r: usize| -> __mmask16 {
                if r >= 16 {
                    !0
                } else {
                    (1u16 << r) - 1
                }
            };
            for i in 0..N {
                for h in 0..H {
                    let sum = _mm512_add_ps(self.even[i][h], self.odd[i][h]);
                    let mask = lanes(real.saturating_sub(16 * h));
                    _mm512_mask_storeu_ps(out.add(i * stride + 16 * h), mask, sum);
                }
            }
        }
    }

    /// Four neighbouring groups (32 rows) per call, two 512-bit registers a column: one
    /// activation broadcast serves two multiply-adds, where [`tile2`] spends one a multiply-add
    /// and is bound by those loads (a 32-row tile measured 1.3x the 16-row one alone in L1).
    /// Each lane still does what the 256-bit kernels do for its row, in the same order (even
    /// and odd columns in two sums, added at the end), so the sums are theirs bit for bit. At
    /// most 6 tokens: 4 sums a token, 24 registers.
    ///
    /// # Safety
    /// As [`tile2`], with w[0..4] the groups of outputs 0..8, 8..16, 16..24, 24..32.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn tile4<const BF: bool, const N: usize>(
        w: [&[u16]; 4],
        x: *const f32,
        k: usize,
        out: *mut f32,
        stride: usize,
        real: usize,
        stream: bool,
    ) {
        debug_assert!(N <= 6 && w.iter().all(|w| w.len() >= k * 8) && k.is_multiple_of(2));
        // [token][half]: rows 0..16 and 16..32, even and odd columns.
        let mut sums = Sums::<2, N>::new();
        let p = w.map(|w| w.as_ptr());
        let load = |h: usize, c: usize| widen2::<BF>(p[2 * h].add(c * 8), p[2 * h + 1].add(c * 8));
        for c in (0..k).step_by(2) {
            if stream && c % 4 == 0 {
                for q in p.iter().copied() {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(c * 8 + 1024) as *const i8);
                }
            }
            let v = [load(0, c), load(1, c)];
            let u = [load(0, c + 1), load(1, c + 1)];
            sums.add_columns(v, u, x, k, c);
        }
        sums.store(out, stride, real);
    }
}

#[cfg(target_arch = "x86_64")]
half_kernels!(avx2, "avx2,fma,f16c");
#[cfg(target_arch = "x86_64")]
half_kernels!(vnni, "avx2,fma,f16c,avx512f,avx512vl");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cpu::matmul::{test_data, CpuQWeight};

    /// [`rounded`] as llama.cpp rounds, 8 values at a time and one by one: ties to even, a NaN
    /// stays a NaN, subnormals round (not flushed); BF16 by `GGML_FP32_TO_BF16`'s arithmetic,
    /// F16 as F16C's `vcvtps2ph` (which `half` uses where the CPU has it).
    #[test]
    fn activations_round_as_llama_cpp() {
        let ggml_bf16 = |x: f32| -> u16 {
            let u = x.to_bits();
            if x.is_nan() {
                return ((u >> 16) | 0x40) as u16;
            }
            ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
        };
        let special = [
            1.0f32,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            -2.5,
            f32::from_bits(0x0000_c000),
            f32::INFINITY,
            -3.0e38,
            65520.0,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            3.0e-8,
            f32::NAN,
            -0.0,
        ];
        let mut x: Vec<f32> = (0..64u32)
            .map(|i| f32::from_bits(0x3f80_0000 + i * 0x1_2345 + (i % 3) * 0x8000))
            .collect();
        // Each special value in a SIMD lane and in the one-by-one tail.
        x.extend(special);
        x.extend([0.5; 2]);
        x.extend(special);
        for ty in [Half::Bf16, Half::F16] {
            let got = rounded(ty, &x);
            for (&v, &r) in x.iter().zip(&got) {
                if v.is_nan() {
                    assert!(r.is_nan(), "{ty:?}");
                    continue;
                }
                let want = match ty {
                    Half::Bf16 => bf16::from_bits(ggml_bf16(v)).to_f32(),
                    Half::F16 => f16::from_f32(v).to_f32(),
                };
                assert_eq!(r.to_bits(), want.to_bits(), "{ty:?} {v:e}");
            }
        }
        assert_eq!(rounded(Half::Bf16, &[f32::from_bits(0x3f80_8000)])[0], 1.0);
        assert_eq!(rounded(Half::F16, &[1.0 + 1.0 / 2048.0])[0], 1.0);
        assert_eq!(rounded(Half::F16, &[65520.0])[0], f32::INFINITY);
    }

    /// Every kernel against f64 sums of the widened weights times the activations rounded to the
    /// weights' type (and far closer to those than to the sums over the unrounded activations),
    /// ragged rows, 1 to 53 tokens (from
    /// 24 the AVX2 kernel reads groups widened once per block of tokens, two groups a call
    /// where they pair, the second one ragged for 13 rows; 53 tokens of 4,096 values are two
    /// blocks; the 512-bit kernel its calls' 2 or 4 groups widened, 37 rows: 4 and 1); SIMD and
    /// scalar: the same bits; a token alone or with others: the same bits.
    #[test]
    fn half_kernels_match_the_widened_product() {
        let kernels = crate::model::cpu::q8::test_kernels();
        for (ty, id) in [(Half::F16, 1u32), (Half::Bf16, 30)] {
            let shapes = [
                (1, 13, 64),
                (3, 37, 96),
                (17, 9, 160),
                (8, 24, 32),
                (40, 37, 96),
                (30, 13, 64),
                (53, 19, 4096),
            ];
            for &(t, n, k) in &shapes {
                let w = test_data(n * k, 3 + n as u64);
                let raw: Vec<u8> = w
                    .iter()
                    .flat_map(|&v| match ty {
                        Half::F16 => f16::from_f32(v).to_bits().to_le_bytes(),
                        Half::Bf16 => bf16::from_f32(v).to_bits().to_le_bytes(),
                    })
                    .collect();
                let wide: Vec<f32> = raw
                    .chunks_exact(2)
                    .map(|b| widen(ty, u16::from_le_bytes([b[0], b[1]])))
                    .collect();
                let x = test_data(t * k, 9 + t as u64);
                let xr: Vec<f32> = x.iter().map(|&v| round_one(ty, v)).collect();
                assert_eq!(rounded(ty, &x), xr);
                let mut outs = Vec::new();
                for &kernel in &kernels {
                    let lin = CpuQWeight::from_raw(id, &raw, n, k, kernel)
                        .unwrap()
                        .unwrap();
                    let got = lin.matmul(&x, t);
                    // The largest error relative to the sum of |products|, against the rounded
                    // activations and against the unrounded ones.
                    let (mut off, mut off_unrounded) = (0f64, 0f64);
                    for i in 0..t {
                        for j in 0..n {
                            let sum = |x: &[f32]| -> f64 {
                                (0..k)
                                    .map(|c| x[i * k + c] as f64 * wide[j * k + c] as f64)
                                    .sum()
                            };
                            let (want, unrounded) = (sum(&xr), sum(&x));
                            let l1: f64 = (0..k)
                                .map(|c| (x[i * k + c] * wide[j * k + c]).abs() as f64)
                                .sum();
                            let g = got[i * n + j] as f64;
                            assert!(
                                (g - want).abs() <= 1e-6 * l1 + 1e-7,
                                "{ty:?} {kernel:?} [{i},{j}]: {g} vs {want}"
                            );
                            off = off.max((g - want).abs() / l1);
                            off_unrounded = off_unrounded.max((g - unrounded).abs() / l1);
                        }
                        let alone = lin.matmul(&x[i * k..(i + 1) * k], 1);
                        assert_eq!(
                            &got[i * n..(i + 1) * n],
                            &alone[..],
                            "{ty:?} {kernel:?} token {i}"
                        );
                    }
                    assert!(
                        off_unrounded > 10.0 * off,
                        "{ty:?} {kernel:?} t={t} k={k}: activations not rounded? \
                         {off:e} from the rounded sums, {off_unrounded:e} from the unrounded"
                    );
                    outs.push(got);
                }
                for o in &outs[1..] {
                    assert_eq!(o, &outs[0], "{ty:?}: SIMD and scalar differ");
                }
            }
        }
    }
}
