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
//! bits, so a BF16 matrix takes it for all its calls or for none: where the calibration
//! ([`super::choice`]) measured it faster for one token (the call that decides a type's
//! paths), or where `GEN_KERNEL=bf16` forces it.
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

/// A product's activations rounded to bf16, in chunks of [`TOKENS`] tokens: per chunk, per
/// pair of columns, the chunk's tokens' pairs side by side (one u32 each, the even column in
/// the low half), so that a call finds a column pair's tokens at fixed offsets. A last chunk's
/// missing tokens are zero.
pub struct Acts {
    v: Vec<u32>,
    k: usize,
}

impl Acts {
    /// T rows of K values (K a multiple of 32), rounded ([`super::wide16::rounded`]) and
    /// regrouped.
    pub fn round(x: &[f32], t: usize, k: usize) -> Self {
        use super::wide16::{rounded_into, Half};
        use rayon::prelude::*;
        debug_assert!(k.is_multiple_of(32) && x.len() == t * k);
        let per_chunk = k / 2 * TOKENS;
        let mut v = vec![0u32; t.div_ceil(TOKENS) * per_chunk];
        v.par_chunks_mut(per_chunk)
            .zip(x.par_chunks(k * TOKENS))
            .for_each(|(chunk, rows)| {
                let mut row = vec![0f32; k];
                for (i, x) in rows.chunks_exact(k).enumerate() {
                    rounded_into(Half::Bf16, x, &mut row);
                    // Each value is a bf16 now: its top half. The even column low.
                    for (p, two) in row.chunks_exact(2).enumerate() {
                        let (lo, hi) = (two[0].to_bits(), two[1].to_bits());
                        chunk[p * TOKENS + i] = lo >> 16 | hi & 0xFFFF_0000;
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

/// N tokens from `token` (the start of a chunk) against the prepared groups (H pairs, as
/// [`super::amx_half::prepare`] left them for k columns), written to out + i * stride for
/// token i: its first `real` outputs.
///
/// # Safety
/// [`super::q8::Kernel::bf16_ready`]; `acts` holds token's chunk; `w` as `prepare` made it for H pairs and `acts`' k;
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
