//! BF16 weights against many tokens on AMX-BF16 tile multiplies, the products exact.
//!
//! AMX multiplies bf16 by bf16 and adds in f32. Each activation is split into three bf16 parts
//! whose sum is it exactly (hi: its top 8 significant bits; mid: the next 8 of what is left; lo:
//! the rest, at most 8 bits). Every product of a part and a weight is exact in f32, and the f32
//! sums round as any f32 sum does: in another order than the 512-bit kernel's, so the path
//! rounds differently in the last bits and is chosen, and kept, by measurement
//! ([`super::choice`]). Since 2026-12-06 the activations of every F16/BF16 product are rounded
//! to the weights' type first, as llama.cpp rounds them ([`super::wide16::rounded`]), so for
//! BF16 mid and lo are zero: one tile multiply of the three would do (not done yet; no AMX
//! machine to measure it on that day).
//!
//! F16 weights would take two bf16 parts each (11 significant bits: 8, then at most 3), six
//! tile multiplies where BF16 takes three: on the Xeon of 2026-12-06 (family 6 model 207) that
//! prefilled the k256 F16 file at 554 tok/s against the 512-bit kernel's 651, so F16 stays there.
//!
//! One call: 16 tokens (an A tile's rows) against 1 to 4 groups of 8 rows, taken as pairs (a B
//! tile's 16 columns; an absent group's rows are zero) whose weights are rearranged for AMX once
//! per thread and run of calls on them ([`prepare`]).

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;

use super::amx::{configure_with, Config};

/// Tokens a call.
pub const TOKENS: usize = 16;

/// A product's activations as three bf16 parts, each T' x K row-major (T rounded up to
/// [`TOKENS`], the padding rows zero), so that 16 tokens' 32 columns are an A tile.
pub struct Parts {
    v: Vec<u16>,
    t_pad: usize,
    k: usize,
}

impl Parts {
    /// T rows of K values (K a multiple of 32), split.
    pub fn split(x: &[f32], t: usize, k: usize) -> Self {
        use rayon::prelude::*;
        let t_pad = t.next_multiple_of(TOKENS);
        let mut v = vec![0u16; 3 * t_pad * k];
        let (hi, rest) = v.split_at_mut(t_pad * k);
        let (mid, lo) = rest.split_at_mut(t_pad * k);
        hi[..t * k]
            .par_chunks_mut(k)
            .zip(mid[..t * k].par_chunks_mut(k))
            .zip(lo[..t * k].par_chunks_mut(k))
            .zip(x.par_chunks(k))
            .for_each(|(((h, m), l), x)| {
                // SAFETY: AMX-BF16 is only used on CPUs with AVX-512 (`amx::ready`); the four
                // rows have k values each, k a multiple of 16.
                unsafe { split_row(x, h, m, l) }
            });
        Parts { v, t_pad, k }
    }

    /// Part p's row for `token`.
    fn at(&self, p: usize, token: usize) -> *const u16 {
        self.v[(p * self.t_pad + token) * self.k..].as_ptr()
    }
}

/// One row's parts: hi the value truncated to bf16, mid the remainder truncated, lo the rest.
/// Each subtraction is exact (the remainder of a truncation holds fewer bits than the value).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split_row(x: &[f32], hi: &mut [u16], mid: &mut [u16], lo: &mut [u16]) {
    let top = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let word = |v: __m512i| _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v));
    for c in (0..x.len()).step_by(16) {
        let v = _mm512_castps_si512(_mm512_loadu_ps(x.as_ptr().add(c)));
        let h = _mm512_and_si512(v, top);
        let r = _mm512_castps_si512(_mm512_sub_ps(
            _mm512_castsi512_ps(v),
            _mm512_castsi512_ps(h),
        ));
        let m = _mm512_and_si512(r, top);
        let l = _mm512_castps_si512(_mm512_sub_ps(
            _mm512_castsi512_ps(r),
            _mm512_castsi512_ps(m),
        ));
        _mm256_storeu_si256(hi.as_mut_ptr().add(c) as *mut __m256i, word(h));
        _mm256_storeu_si256(mid.as_mut_ptr().add(c) as *mut __m256i, word(m));
        _mm256_storeu_si256(lo.as_mut_ptr().add(c) as *mut __m256i, word(l));
    }
}

/// u16 values of one B tile (for [`prepare`]'s users: a pair's 32 columns).
pub(super) const TILE: usize = 16 * 32;

/// The BF16 weights of a call's groups (`ws`: 1 to 4 groups of 8 rows, k columns each, as
/// [`super::wide16::HalfTiles`] lays them out) as B tiles, into `out`: per block of 32 columns,
/// per pair of groups, 16 rows of 64 bytes, row j holding each of the pair's 16 rows' values at
/// the block's columns 2j and 2j + 1.
///
/// # Safety
/// The CPU must have AVX-512 (`amx::ready`); each group holds k * 8 values, k a multiple of 32.
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
pub unsafe fn prepare(ws: &[&[u16]], k: usize, out: &mut Vec<u16>) {
    let pairs = ws.len().div_ceil(2);
    out.clear();
    out.resize(k / 32 * pairs * TILE, 0);
    // Position 2n + e of a pair's half (group) takes column e, row n: the group's two columns
    // lie as column 2j's 8 rows, then column 2j + 1's.
    let mut idx = [0u16; 32];
    for (p, i) in idx.iter_mut().enumerate() {
        let (half, q) = (p / 16, p % 16);
        *i = (half * 16 + (q % 2) * 8 + q / 2) as u16;
    }
    let idx = _mm512_loadu_si512(idx.as_ptr() as *const __m512i);
    let dst = out.as_mut_ptr();
    for kb in 0..k / 32 {
        for p in 0..pairs {
            let tile = dst.add((kb * pairs + p) * TILE);
            for j in 0..16 {
                let col = (kb * 32 + 2 * j) * 8;
                let load = |g: usize| match ws.get(g) {
                    Some(w) => _mm256_loadu_si256(w.as_ptr().add(col) as *const __m256i),
                    None => _mm256_setzero_si256(),
                };
                let both =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load(2 * p)), load(2 * p + 1));
                let row = _mm512_permutexvar_epi16(idx, both);
                _mm512_storeu_si512(tile.add(j * 32) as *mut __m512i, row);
            }
        }
    }
}

/// n tokens (at most [`TOKENS`]) from `token` against the prepared groups (`pairs` pairs, as
/// [`prepare`] left them), written to out + i * stride for token i: its first `real` outputs.
///
/// # Safety
/// AMX-BF16 ready ([`super::amx::ready`]); `acts` holds token..token + 16 (padding included);
/// `w` as [`prepare`] made it for `acts`' k; out valid for the writes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn call(
    w: &[u16],
    pairs: usize,
    acts: &Parts,
    token: usize,
    n: usize,
    out: *mut f32,
    stride: usize,
    real: usize,
) {
    debug_assert!((1..=TOKENS).contains(&n) && (1..=2).contains(&pairs));
    let k = acts.k;
    debug_assert_eq!(w.len(), k / 32 * pairs * TILE);
    // C: tmm0 and tmm1 (a pair each), n rows of 16 f32; A: tmm2, n rows of 32 bf16; B: tmm4
    // and tmm5 (a pair each), 16 rows of 64 bytes.
    configure_with(2 << 8 | n as u32, || {
        let mut c = Config::new();
        for t in [0, 1, 2] {
            c.set(t, n, 64);
        }
        c.set(4, 16, 64);
        c.set(5, 16, 64);
        c
    });
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        options(nostack, nomem, preserves_flags)
    );
    let a_stride = k * 2;
    let (b_stride, wp) = (64usize, w.as_ptr());
    for kb in 0..k / 32 {
        let b = wp.add(kb * pairs * TILE);
        asm!("tileloadd tmm4, [{b} + {s}]", b = in(reg) b, s = in(reg) b_stride,
            options(nostack, readonly, preserves_flags));
        if pairs == 2 {
            asm!("tileloadd tmm5, [{b} + {s}]", b = in(reg) b.add(TILE), s = in(reg) b_stride,
                options(nostack, readonly, preserves_flags));
        }
        for p in 0..3 {
            let a = acts.at(p, token).add(kb * 32);
            asm!("tileloadd tmm2, [{a} + {s}]", a = in(reg) a, s = in(reg) a_stride,
                options(nostack, readonly, preserves_flags));
            asm!(
                "tdpbf16ps tmm0, tmm2, tmm4",
                options(nostack, nomem, preserves_flags)
            );
            if pairs == 2 {
                asm!(
                    "tdpbf16ps tmm1, tmm2, tmm5",
                    options(nostack, nomem, preserves_flags)
                );
            }
        }
    }
    let mut sums = Sums([[0f32; 32]; TOKENS]);
    let s = sums.0.as_mut_ptr() as *mut f32;
    asm!("tilestored [{c} + {s}], tmm0", c = in(reg) s, s = in(reg) 128usize,
        options(nostack, preserves_flags));
    if pairs == 2 {
        asm!("tilestored [{c} + {s}], tmm1", c = in(reg) s.add(16), s = in(reg) 128usize,
            options(nostack, preserves_flags));
    }
    for (i, row) in sums.0.iter().take(n).enumerate() {
        std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(i * stride), real);
    }
}

/// The call's sums: 16 tokens of 32 outputs.
#[repr(C, align(64))]
struct Sums([[f32; 32]; TOKENS]);
