//! BF16 weights against a prefill chunk on `vdpbf16ps` (AVX-512 BF16), the activations rounded
//! to bf16 as llama.cpp rounds them for BF16 weights (its `vec_dot_type` for BF16 is BF16).
//!
//! gen's other paths multiply the same rounded activations ([`super::wide16::rounded`]) with
//! f32 multiply-adds, so a prefill cannot pass the f32 peak; on CPUs whose `vdpbf16ps` runs as
//! fast as `vfmadd231ps` (Zen 4: one a cycle each, measured by `cargo bench --bench ports`) one
//! instruction does 32 products where a multiply-add does 16. Each activation is rounded once
//! per product, to nearest even, as llama.cpp's `GGML_FP32_TO_BF16` does; every product of two
//! bf16 values is exact in f32, and the sums are f32, in another order than the other paths'
//! (a lane's two products at once, one sum a row): the path rounds differently in the last
//! bits, so it is taken only where the calibration ([`super::choice`])
//! measured it faster for calls of many tokens and kept that choice, or where `GEN_KERNEL=bf16`
//! forces it.
//!
//! One call: up to [`TOKENS`] tokens of one chunk against 1 to 4 groups of 8 rows, taken as
//! pairs (16 rows a register; an absent group's rows are zero) in the layout of
//! [`super::amx_half::prepare`], made once per thread and run of calls on them: a register
//! holds, for 16 rows, the values at two neighbouring columns, which is what `vdpbf16ps`
//! multiplies by a pair of activations broadcast to every lane.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::amx_half::TILE;

/// Tokens a chunk and at most a call: 12 tokens by 2 registers of 16 rows are 24 sums, with
/// the 2 weight registers and a broadcast within the 32 registers.
pub const TOKENS: usize = 12;

/// Whether this CPU has the instructions (with the 512-bit path, the base of this one).
pub fn ready() -> bool {
    is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
}

/// A product's activations rounded to bf16, in chunks of [`TOKENS`] tokens: per chunk, per
/// pair of columns, the chunk's tokens' pairs side by side (one u32 each, the even column in
/// the low half), so that a call finds a column pair's tokens at fixed offsets. A last chunk's
/// missing tokens are zero.
pub struct Acts {
    v: Vec<u32>,
    k: usize,
}

impl Acts {
    /// T rows of K values (K a multiple of 32), rounded.
    pub fn round(x: &[f32], t: usize, k: usize) -> Self {
        use rayon::prelude::*;
        debug_assert!(k.is_multiple_of(32) && x.len() == t * k);
        let per_chunk = k / 2 * TOKENS;
        let mut v = vec![0u32; t.div_ceil(TOKENS) * per_chunk];
        v.par_chunks_mut(per_chunk)
            .zip(x.par_chunks(k * TOKENS))
            .for_each(|(chunk, rows)| {
                let mut row = vec![0u32; k / 2];
                for (i, x) in rows.chunks_exact(k).enumerate() {
                    // SAFETY: the path is only taken where `ready` said so; k values in, k / 2
                    // pairs out, k a multiple of 32.
                    unsafe { round_row(x, &mut row) };
                    for (p, &pair) in row.iter().enumerate() {
                        chunk[p * TOKENS + i] = pair;
                    }
                }
            });
        Acts { v, k }
    }

    /// The chunk holding `token` (a multiple of [`TOKENS`]).
    fn chunk(&self, token: usize) -> *const u32 {
        debug_assert!(token.is_multiple_of(TOKENS));
        self.v[token / TOKENS * (self.k / 2 * TOKENS)..].as_ptr()
    }
}

/// A row of k f32 values as k / 2 pairs of bf16 values, each rounded as llama.cpp rounds:
/// to nearest, ties to even, a NaN kept a (quiet) NaN, subnormals rounded, not flushed (the
/// test's `round` is the same, one value at a time).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn round_row(x: &[f32], out: &mut [u32]) {
    debug_assert!(x.len().is_multiple_of(32) && out.len() * 2 == x.len());
    let bias = _mm512_set1_epi32(0x7fff);
    let one = _mm512_set1_epi32(1);
    let quiet = _mm512_set1_epi32(0x40);
    let word = |v: __m512| -> __m256i {
        let u = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(u), one);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let nan_bits = _mm512_or_si512(_mm512_srli_epi32::<16>(u), quiet);
        _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, nan_bits))
    };
    for c in (0..x.len()).step_by(32) {
        let lo = word(_mm512_loadu_ps(x.as_ptr().add(c)));
        let hi = word(_mm512_loadu_ps(x.as_ptr().add(c + 16)));
        let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        _mm512_storeu_si512(out.as_mut_ptr().add(c / 2) as *mut __m512i, both);
    }
}

/// N tokens from `token` (the start of a chunk) against the prepared groups (H pairs, as
/// [`super::amx_half::prepare`] left them for k columns), written to out + i * stride for
/// token i: its first `real` outputs.
///
/// # Safety
/// [`ready`]; `acts` holds token's chunk; `w` as `prepare` made it for H pairs and `acts`' k;
/// out valid for the writes.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn call<const H: usize, const N: usize>(
    w: &[u16],
    acts: &Acts,
    token: usize,
    out: *mut f32,
    stride: usize,
    real: usize,
) {
    debug_assert!((1..=2).contains(&H) && (1..=TOKENS).contains(&N));
    let k = acts.k;
    debug_assert_eq!(w.len(), k / 32 * H * TILE);
    let mut sums = [[_mm512_setzero_ps(); H]; N];
    let (wp, xp) = (w.as_ptr(), acts.chunk(token));
    for kb in 0..k / 32 {
        let block = wp.add(kb * H * TILE);
        for j in 0..16 {
            let v: [__m512bh; H] = std::array::from_fn(|h| {
                std::mem::transmute(_mm512_loadu_si512(block.add(h * TILE + j * 32) as *const _))
            });
            let pairs = xp.add((kb * 16 + j) * TOKENS);
            for (i, row) in sums.iter_mut().enumerate() {
                let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(*pairs.add(i) as i32));
                for h in 0..H {
                    row[h] = _mm512_dpbf16_ps(row[h], v[h], b);
                }
            }
        }
    }
    for (i, row) in sums.iter().enumerate() {
        for (h, s) in row.iter().enumerate() {
            let left = real.saturating_sub(16 * h);
            let mask: __mmask16 = if left >= 16 { !0 } else { (1u16 << left) - 1 };
            _mm512_mask_storeu_ps(out.add(i * stride + 16 * h), mask, *s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One value rounded to bf16 as llama.cpp rounds it: to nearest, ties to even; a NaN stays a
    /// (quiet) NaN. Subnormals are rounded, not flushed.
    pub(crate) fn round(x: f32) -> u16 {
        let u = x.to_bits();
        if x.is_nan() {
            return ((u >> 16) | 0x40) as u16;
        }
        ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
    }

    #[test]
    fn rounds_as_llama_cpp() {
        // Ties go to even, a NaN stays a NaN, subnormals round (not flushed).
        for (x, want) in [
            (1.0f32, 0x3f80u16),
            (f32::from_bits(0x3f80_8000), 0x3f80),
            (f32::from_bits(0x3f81_8000), 0x3f82),
            (f32::from_bits(0x3f80_8001), 0x3f81),
            (-2.5, 0xc020),
            (f32::from_bits(0x0000_c000), 0x0001),
            (f32::INFINITY, 0x7f80),
        ] {
            assert_eq!(round(x), want, "{x:e}");
            assert_eq!(half::bf16::from_f32(x).to_bits(), want, "{x:e}");
        }
        assert!(half::bf16::from_bits(round(f32::NAN)).is_nan());
        if !ready() {
            return;
        }
        let x: Vec<f32> = (0..64u32)
            .map(|i| f32::from_bits(0x3f80_0000 + i * 0x1_2345 + (i % 3) * 0x8000))
            .chain(
                [f32::NAN, -0.0, 1e-40, -3.0e38]
                    .into_iter()
                    .cycle()
                    .take(32),
            )
            .collect();
        let mut out = vec![0u32; x.len() / 2];
        // SAFETY: ready() above.
        unsafe { round_row(&x, &mut out) };
        for (p, pair) in out.iter().enumerate() {
            for (e, bits) in [(0, *pair as u16), (1, (*pair >> 16) as u16)] {
                let v = x[2 * p + e];
                if v.is_nan() {
                    assert!(half::bf16::from_bits(bits).is_nan());
                } else {
                    assert_eq!(bits, round(v), "{v:e}");
                }
            }
        }
    }
}
