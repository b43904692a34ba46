//! The Q4_1 and Q8_0 tile kernels on 512-bit registers: two neighbouring row groups (16 rows)
//! per call, each lane doing what the 256-bit VNNI kernel (`x86_kernels!`) does for its row,
//! in the same order, so the sums are theirs bit for bit (see `quants_zmm` for why).

use super::{ActChunk, Tile, PREFETCH_AHEAD};
use crate::model::cpu::quants_zmm::{join, store16, widen2};
use std::arch::x86_64::*;

/// Prefetches block b's weights of both tiles (`bytes` of codes a block), and their scales
/// (and minimums) every 4 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn prefetch2(w0: &Tile<'_>, w1: &Tile<'_>, b: usize, bytes: usize) {
    for w in [w0, w1] {
        let base = w.qs.as_ptr().add(b * bytes);
        for l in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH_AHEAD + l) as *const i8);
        }
        if b.is_multiple_of(4) {
            let ahead = b * 8 + PREFETCH_AHEAD * 8 / bytes;
            _mm_prefetch::<_MM_HINT_T0>(w.d.as_ptr().wrapping_add(ahead) as *const i8);
            if !w.m.is_empty() {
                _mm_prefetch::<_MM_HINT_T0>(w.m.as_ptr().wrapping_add(ahead) as *const i8);
            }
        }
    }
}

/// N tokens' activations (Q8_1) against two tiles of 8 Q4_1 rows: w0's rows are outputs
/// 0..8, w1's 8..16, written to out + i * stride for token i (the first `real`).
///
/// # Safety
/// The CPU must support the features; `a` holds N tokens of as many blocks as each tile;
/// `out` is valid for those writes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile_q4_1<const N: usize>(
    w0: Tile<'_>,
    w1: Tile<'_>,
    a: ActChunk,
    out: *mut f32,
    stride: usize,
    real: usize,
    stream: bool,
) {
    let nb = w0.d.len() / 8;
    debug_assert!(w1.d.len() == w0.d.len() && w0.qs.len() >= nb * 128);
    let mask = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        if stream {
            prefetch2(&w0, &w1, b, 128);
        }
        let (p0, p1) = (w0.qs.as_ptr().add(b * 128), w1.qs.as_ptr().add(b * 128));
        let mut wv = [_mm512_setzero_si512(); 8];
        for c in 0..4 {
            let raw = join(p0.add(c * 32), p1.add(c * 32));
            wv[c] = _mm512_and_si512(raw, mask);
            wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
        }
        let half = |v: &[u16]| v.as_ptr().add(b * 8) as *const u8;
        let dw = widen2(half(w0.d), half(w1.d));
        let mw = widen2(half(w0.m), half(w1.m));
        let qb = a.qs.add(b * 256);
        let (sb, ob) = (a.scale.add(b * 8), a.offset.add(b * 8));
        for (i, acc) in acc.iter_mut().enumerate() {
            let q = qb.add(i * 32) as *const i32;
            let act = |g: usize| _mm512_set1_epi32(q.add(g).read_unaligned());
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for g in (0..8).step_by(2) {
                s0 = _mm512_dpbusd_epi32(s0, wv[g], act(g));
                s1 = _mm512_dpbusd_epi32(s1, wv[g + 1], act(g + 1));
            }
            let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(*sb.add(i)));
            *acc = _mm512_fmadd_ps(s, d, *acc);
            *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*ob.add(i)), *acc);
        }
    }
    store16(&acc, out, stride, lanes(real));
}

/// N tokens' activations (Q8_0) against two tiles of 8 Q8_0 rows, written as `tile_q4_1`
/// writes. The signed codes go in biased by 128 (as unsigned bytes) and 128 times the
/// activations' integer sum comes off: exact.
///
/// # Safety
/// As for `tile_q4_1`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn tile_q8_0<const N: usize>(
    w0: Tile<'_>,
    w1: Tile<'_>,
    a: ActChunk,
    out: *mut f32,
    stride: usize,
    real: usize,
    stream: bool,
) {
    let nb = w0.d.len() / 8;
    debug_assert!(w1.d.len() == w0.d.len() && w0.qs.len() >= nb * 256);
    let bias = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        if stream {
            prefetch2(&w0, &w1, b, 256);
        }
        let (p0, p1) = (w0.qs.as_ptr().add(b * 256), w1.qs.as_ptr().add(b * 256));
        let wv: [__m512i; 8] =
            std::array::from_fn(|c| _mm512_xor_si512(join(p0.add(c * 32), p1.add(c * 32)), bias));
        let half = |v: &[u16]| v.as_ptr().add(b * 8) as *const u8;
        let dw = widen2(half(w0.d), half(w1.d));
        let qb = a.qs.add(b * 256);
        let (sb, ib) = (a.scale.add(b * 8), a.isum.add(b * 8));
        for (i, acc) in acc.iter_mut().enumerate() {
            let q = qb.add(i * 32) as *const i32;
            let act = |g: usize| _mm512_set1_epi32(q.add(g).read_unaligned());
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for g in (0..8).step_by(2) {
                s0 = _mm512_dpbusd_epi32(s0, wv[g], act(g));
                s1 = _mm512_dpbusd_epi32(s1, wv[g + 1], act(g + 1));
            }
            let s = _mm512_add_epi32(s0, s1);
            let s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * *ib.add(i)));
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(*sb.add(i)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, *acc);
        }
    }
    store16(&acc, out, stride, lanes(real));
}

/// The store mask of the first `real` of 16 outputs.
fn lanes(real: usize) -> __mmask16 {
    if real >= 16 {
        !0
    } else {
        (1u16 << real) - 1
    }
}
