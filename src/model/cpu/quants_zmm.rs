//! The VNNI kernels of [`super::quants`] on 512-bit registers: two neighbouring row groups (16
//! rows) per call, each register holding the same 4 codes of both groups' 8 rows. Every lane
//! does exactly what the 256-bit kernel ([`super::quants_x86`]'s `vnni`) does for its row, in
//! the same order, so the sums are bit for bit theirs; what changes is that one activation
//! broadcast, one scale conversion and one loop step serve 16 rows instead of 8. On CPUs with
//! two 512-bit multiply-add units (Intel's server parts) that is twice the arithmetic per
//! cycle; on those that split 512-bit work in two halves (AMD Zen 4), half the instructions.

#![cfg(target_arch = "x86_64")]

use super::quants::{spec_of, Act, ActChunk, Bits, Min, Tile, TOKENS};
use super::quants_x86::{block_scales, fold_sums, sub_scale_bytes, unpack_codes};
use std::arch::x86_64::*;

/// 32 bytes at p0 (the first group's) and 32 at p1, as one register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn join(p0: *const u8, p1: *const u8) -> __m512i {
    let lo = _mm256_loadu_si256(p0 as *const __m256i);
    let hi = _mm256_loadu_si256(p1 as *const __m256i);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// 8 bytes at p0 and 8 at p1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn join8(p0: *const u8, p1: *const u8) -> __m128i {
    _mm_unpacklo_epi64(
        _mm_loadl_epi64(p0 as *const __m128i),
        _mm_loadl_epi64(p1 as *const __m128i),
    )
}

/// 8 f16 values at p0 and 8 at p1, as 16 f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn widen2(p0: *const u8, p1: *const u8) -> __m512 {
    let lo = _mm_loadu_si128(p0 as *const __m128i);
    let hi = _mm_loadu_si128(p1 as *const __m128i);
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
}

/// The block's scale and minimum per row for sub-scale byte `h` (see `block_scales`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn sub_scale<const TY: u8>(
    b0: *const u8,
    b1: *const u8,
    h: usize,
    dv: __m512,
    dmv: __m512,
) -> (__m512, __m512) {
    let bytes = |o: usize| join8(b0.add(o), b1.add(o));
    block_scales!(
        spec_of(TY),
        h,
        bytes,
        dv,
        dmv,
        [
            _mm512_cvtepu8_epi32,
            _mm512_cvtepi8_epi32,
            _mm512_setzero_si512,
            _mm512_cvtepi32_ps,
            _mm512_mul_ps,
            _mm512_sub_ps,
            _mm512_setzero_ps
        ]
    )
}

/// The integer sub-scales of a block (halves 0 and 1), one i32 lane a row (Q2_K's low
/// nibbles): what the Q8_K types' sums are multiplied by, as AVX2's madds take them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn int_scales<const TY: u8>(b0: *const u8, b1: *const u8) -> (__m512i, __m512i) {
    let spec = spec_of(TY);
    let bytes = |o: usize| join8(b0.add(o), b1.add(o));
    let sc = |h: usize| _mm512_cvtepi8_epi32(sub_scale_bytes!(spec, bytes, h));
    let m0 = sc(0);
    (m0, if spec.halves { sc(1) } else { m0 })
}

/// Registers kept a block by [`tile2`]: its 8 registers of codes, then its scales and
/// minimums (scale0, min0, scale1, min1; for the Q8_K types the scales are the integer
/// sub-scales, as i32 bits).
pub const KEPT: usize = 12;

/// N tokens' activations against two tiles of 8 rows of type TY (a `QType` as u8): w0's rows
/// are outputs 0..8, w1's 8..16, written to out + i * stride for token i (the first `real`).
///
/// `keep`: room for [`KEPT`] registers a block. Given unfilled (`false`), the unpacked codes
/// and scales are written there as they are made; given filled (`true`, by an earlier call
/// on the same two tiles), they are read from there instead of unpacked again: the next
/// chunks of a prefill's tokens on these rows skip the unpacking (the types of
/// `Spec::keeps_unpacked`). The same values either way, so the same sums.
///
/// # Safety
/// The CPU must support the features; `a` holds N tokens of as many blocks as each tile;
/// `out` is valid for those writes; `keep`, if given, holds [`KEPT`] registers for each block
/// of the tiles.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn tile2<const TY: u8, const N: usize>(
    w0: Tile<'_>,
    w1: Tile<'_>,
    a: ActChunk,
    out: *mut f32,
    stride: usize,
    real: usize,
    stream: bool,
    mut keep: Option<(&mut [__m512i], bool)>,
) {
    let spec = spec_of(TY);
    let (sbb, bb) = (spec.sb_bytes(), spec.blk_bytes());
    debug_assert_eq!(w0.buf.len(), w1.buf.len());
    let nb = w0.buf.len() / sbb * spec.per_super;
    let (buf0, buf1) = (w0.buf.as_ptr(), w1.buf.as_ptr());
    debug_assert!(keep.as_ref().is_none_or(|(k, _)| k.len() >= nb * KEPT));
    // Signed codes (the IQ4 tables) are biased by 128, as in the 256-bit VNNI kernel; the
    // `biased` types take signed codes against biased activations instead.
    let biased = spec.biased();
    let centre = spec.kernel_centre(true);
    let mut table = [0i8; 64];
    for (i, t) in table.iter_mut().enumerate() {
        *t = spec.lut()[i % 16] ^ if biased { 0 } else { -128 };
    }
    let table = _mm512_loadu_si512(table.as_ptr() as *const __m512i);
    let mut acc = [_mm512_setzero_ps(); N];
    // Q8_K types: the sub-scaled block sums gather in integers over a super-block (in `facc`'s
    // bits), as in the 256-bit kernels (`gather`): the same integers, then the same float
    // operations, so the same bits as AVX2's and VNNI's 256-bit kernels.
    let per_sb = spec.act == Act::Q8K;
    // Types whose sums meet the activation scale only once per super-block and have no minimum
    // terms (Q3_K, Q6_K, IQ4_XS) keep the running sums in `out` (read and written once per
    // super-block) instead of N registers: with 16 rows a register, 8 unpacked weight
    // registers and N partial sums, N more would not fit in 32.
    let in_out = per_sb && spec.min == Min::None;
    let mask: __mmask16 = if real >= 16 { !0 } else { (1u16 << real) - 1 };
    let mut facc = [_mm512_setzero_ps(); N];
    const AHEAD: usize = super::q8::PREFETCH_AHEAD;
    let (mut dv, mut dmv) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut corr = _mm512_setzero_si512();
    for b in 0..nb {
        let at = spec.block_at(b);
        let (b0, b1) = (buf0.add(at), buf1.add(at));
        if stream {
            let mut l = 0;
            while l < bb {
                _mm_prefetch::<_MM_HINT_T0>(b0.wrapping_add(AHEAD + l) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(b1.wrapping_add(AHEAD + l) as *const i8);
                l += 64;
            }
        }
        if b % spec.per_super == 0 {
            let hdr = (b / spec.per_super) * sbb;
            dv = widen2(buf0.add(hdr), buf1.add(hdr));
            if spec.min != Min::None {
                dmv = widen2(buf0.add(hdr + 16), buf1.add(hdr + 16));
            }
            if biased {
                corr = join(buf0.add(hdr + 16), buf1.add(hdr + 16));
            }
        }
        let slot = keep
            .as_mut()
            .map(|(kept, filled)| (&mut kept[b * KEPT..], *filled));
        let (wv, sm) = block_regs::<TY>(b0, b1, table, (dv, dmv), slot);
        let [scale0, min0, scale1, min1] = sm;
        let qb = a.qs.add(b * 256);
        for (i, (acc, facc)) in acc.iter_mut().zip(facc.iter_mut()).enumerate() {
            let slot = b * TOKENS + i;
            let q = qb.add(i * 32) as *const i32;
            let act = |g: usize| _mm512_set1_epi32(q.add(g).read_unaligned());
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for g in 0..4 {
                if biased {
                    s0 = _mm512_dpbusd_epi32(s0, act(g), wv[g]);
                    s1 = _mm512_dpbusd_epi32(s1, act(g + 4), wv[g + 4]);
                } else {
                    s0 = _mm512_dpbusd_epi32(s0, wv[g], act(g));
                    s1 = _mm512_dpbusd_epi32(s1, wv[g + 4], act(g + 4));
                }
            }
            let da = _mm512_set1_ps(*a.d.add(slot));
            if !per_sb {
                fold_sums!(
                    [
                        _mm512_sub_epi32,
                        _mm512_set1_epi32,
                        _mm512_add_epi32,
                        _mm512_cvtepi32_ps,
                        _mm512_mul_ps,
                        _mm512_fmadd_ps,
                        _mm512_set1_ps
                    ],
                    spec,
                    centre,
                    s0,
                    s1,
                    *acc,
                    (scale0, min0),
                    (scale1, min1),
                    da,
                    a,
                    slot
                );
                continue;
            }
            let sums = (s0, s1, (scale0, scale1), (min0, min1));
            let last = b % spec.per_super == spec.per_super - 1;
            let o = (in_out && last).then(|| (out.add(i * stride), mask, b < spec.per_super));
            gather16::<TY>(
                acc,
                facc,
                sums,
                a.asum.add(slot * 4),
                (last, corr),
                (dv, da),
                o,
            );
        }
    }
    if !in_out {
        store16(&acc, out, stride, mask);
    }
}

/// A block's 8 registers of codes (biased types: signed) and its scales and minimums (scale0,
/// min0, scale1, min1; the Q8_K types' scales as integer sub-scales, in i32 bits): unpacked
/// from the tiles at b0 and b1, or read back from `keep` where an earlier call filled it
/// (`(slot, true)`), or unpacked and written there (`(slot, false)`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_regs<const TY: u8>(
    b0: *const u8,
    b1: *const u8,
    table: __m512i,
    (dv, dmv): (__m512, __m512),
    keep: Option<(&mut [__m512i], bool)>,
) -> ([__m512i; 8], [__m512; 4]) {
    let spec = spec_of(TY);
    let mut wv = [_mm512_setzero_si512(); 8];
    let mut sm = [_mm512_setzero_ps(); 4];
    if let Some((kept, true)) = &keep {
        // Kept by the first call on these tiles: read back from L1 or L2.
        let k = kept.as_ptr();
        for (i, w) in wv.iter_mut().enumerate() {
            *w = _mm512_load_si512(k.add(i) as *const _);
        }
        for (i, v) in sm.iter_mut().enumerate() {
            *v = _mm512_castsi512_ps(_mm512_load_si512(k.add(8 + i) as *const _));
        }
        return (wv, sm);
    }
    wv = unpack::<TY>(b0, b1, table);
    if spec.biased() && spec.bits != Bits::Lut {
        for w in wv.iter_mut() {
            *w = _mm512_sub_epi8(*w, _mm512_set1_epi8(spec.centre as i8));
        }
    }
    let (scale0, min0) = sub_scale::<TY>(b0, b1, 0, dv, dmv);
    let (scale1, min1) = if spec.halves {
        sub_scale::<TY>(b0, b1, 1, dv, dmv)
    } else {
        (scale0, min0)
    };
    sm = [scale0, min0, scale1, min1];
    if spec.act == Act::Q8K {
        let (i0, i1) = int_scales::<TY>(b0, b1);
        sm[0] = _mm512_castsi512_ps(i0);
        sm[2] = _mm512_castsi512_ps(i1);
    }
    if let Some((kept, false)) = keep {
        let k = kept.as_mut_ptr();
        for (i, w) in wv.iter().enumerate() {
            _mm512_store_si512(k.add(i) as *mut _, *w);
        }
        for (i, v) in sm.iter().enumerate() {
            _mm512_store_si512(k.add(8 + i) as *mut _, _mm512_castps_si512(*v));
        }
    }
    (wv, sm)
}

/// Q8_K types, one token: its block sums s0, s1 times the integer sub-scales gather in
/// `facc`'s bits over the super-block; the minimum terms go into `acc` per block; at the
/// `last` block the bias's `corr` comes off (biased types) and the sum meets d and the
/// activation scale once, into `acc`, or with `in_out` (out, mask, first super-block) into
/// the running sums kept in `out`. Lane for lane the 256-bit kernels' `gather`.
#[inline]
#[allow(clippy::type_complexity)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gather16<const TY: u8>(
    acc: &mut __m512,
    facc: &mut __m512,
    (s0, s1, (sc0, sc1), (min0, min1)): (__m512i, __m512i, (__m512, __m512), (__m512, __m512)),
    asum: *const f32,
    (last, corr): (bool, __m512i),
    (dv, da): (__m512, __m512),
    in_out: Option<(*mut f32, __mmask16, bool)>,
) {
    let spec = spec_of(TY);
    let (isc0, isc1) = (_mm512_castps_si512(sc0), _mm512_castps_si512(sc1));
    let s = if spec.halves {
        _mm512_add_epi32(_mm512_mullo_epi32(s0, isc0), _mm512_mullo_epi32(s1, isc1))
    } else {
        _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), isc0)
    };
    let mut isb = _mm512_add_epi32(_mm512_castps_si512(*facc), s);
    *facc = _mm512_castsi512_ps(isb);
    super::quants_x86::min_terms!(
        [_mm512_fmadd_ps, _mm512_set1_ps],
        spec,
        *acc,
        min0,
        min1,
        asum
    );
    if !last {
        return;
    }
    if spec.biased() {
        isb = _mm512_sub_epi32(isb, corr);
    }
    let f = _mm512_cvtepi32_ps(isb);
    let dd = _mm512_mul_ps(dv, da);
    match in_out {
        Some((o, mask, first)) => {
            let sum = if first {
                _mm512_setzero_ps()
            } else {
                _mm512_maskz_loadu_ps(mask, o)
            };
            _mm512_mask_storeu_ps(o, mask, _mm512_fmadd_ps(f, dd, sum));
        }
        None => *acc = _mm512_fmadd_ps(f, dd, *acc),
    }
    *facc = _mm512_setzero_ps();
}

/// Token i's 16 sums to out + i * stride, the lanes of `mask`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn store16<const N: usize>(
    acc: &[__m512; N],
    out: *mut f32,
    stride: usize,
    mask: __mmask16,
) {
    for (i, acc) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(out.add(i * stride), mask, *acc);
    }
}

/// The 8 registers of block codes of both groups: register c holds codes 4c..4c+4 of each of
/// the 16 rows (IQ4: their table values, biased).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unpack<const TY: u8>(b0: *const u8, b1: *const u8, table: __m512i) -> [__m512i; 8] {
    let load = |o: usize| join(b0.add(o), b1.add(o));
    unpack_codes!(
        TY,
        load,
        table,
        [
            _mm512_setzero_si512,
            _mm512_set1_epi8,
            _mm512_and_si512,
            _mm512_or_si512,
            _mm512_srl_epi16,
            _mm512_sll_epi16,
            _mm512_shuffle_epi8
        ]
    )
}
