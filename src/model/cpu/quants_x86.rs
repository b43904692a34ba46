//! The x86 kernels of [`super::quants`], written once and instantiated per instruction set:
//! `avx2` multiplies unsigned codes by signed activation bytes with maddubs + madd, `vnni` with
//! one dpbusd. Signed codes (the IQ4 tables) go through AVX2's sign trick, or on VNNI are
//! biased by 128 and the bias removed with the activation's integer sum, exactly.

#![cfg(target_arch = "x86_64")]

use crate::model::cpu::q8::simd::{dot_s_avx2, dot_u_avx2, dot_u_vnni};

/// One token's block sums s0, s1 (the halves' integer dot products, one lane a row) folded
/// into its running sums, for the types whose activations have a scale per block (Q8_0,
/// Q8_1): the centre off with the activation sums, the block's scale times the activation
/// scale, the minimum terms. (The Q8_K types gather their sums in integers instead:
/// `int_fold`.) Written once for the 256- and 512-bit kernels, whose intrinsics come first
/// ([sub, set1, add (i32), convert, mul, fmadd, set1 (f32)]).
macro_rules! fold_sums {
    (
        [$sub:path, $set1:path, $add:path, $cvt:path, $mul:path, $fma:path, $set1f:path],
        $spec:expr, $centre:expr, $s0:ident, $s1:ident, $acc:expr,
        ($scale0:expr, $min0:expr), ($scale1:expr, $min1:expr), $da:expr, $a:expr, $slot:expr
    ) => {{
        let isum = $a.isum.add($slot * 4);
        let asum = $a.asum.add($slot * 4);
        if $spec.halves {
            if $centre != 0 {
                $s0 = $sub($s0, $set1(*isum));
                $s1 = $sub($s1, $set1(*isum.add(1)));
            }
            let f = $mul($cvt($s0), $scale0);
            let f = $fma($cvt($s1), $scale1, f);
            $acc = $fma(f, $da, $acc);
        } else {
            let mut s = $add($s0, $s1);
            if $centre != 0 {
                s = $sub(s, $set1(*isum.add(2)));
            }
            let d = $mul($scale0, $da);
            $acc = $fma($cvt(s), d, $acc);
        }
        $crate::model::cpu::quants_x86::min_terms!([$fma, $set1f], $spec, $acc, $min0, $min1, asum);
    }};
}
pub(crate) use fold_sums;

/// One token's minimum terms of a block into `$acc`: each half's (or the block's) minimum
/// times the activations' scaled sum there (`$asum`: the slot's sums, halves then whole).
/// Shared by `fold_sums` and AVX2's integer route (`gather`); the intrinsics come first
/// ([fmadd, set1 (f32)]).
macro_rules! min_terms {
    ([$fma:path, $set1f:path], $spec:expr, $acc:expr, $min0:expr, $min1:expr, $asum:expr) => {{
        if $spec.min != Min::None {
            if $spec.halves {
                $acc = $fma($min0, $set1f(*$asum), $acc);
                $acc = $fma($min1, $set1f(*$asum.add(1)), $acc);
            } else {
                $acc = $fma($min0, $set1f(*$asum.add(2)), $acc);
            }
        }
    }};
}
pub(crate) use min_terms;

/// The 8 registers of one block's codes: register c holds codes 4c..4c+4 of each row (IQ4:
/// their table values). `$load(offset)` reads the block's bytes at offset (one tile's 32, or
/// two tiles' side by side); the intrinsics of the register width follow.
macro_rules! unpack_codes {
    (
        $ty:expr, $load:ident, $table:expr,
        [$zero:path, $set1:path, $and:path, $or:path, $srl:path, $sll:path, $shuffle:path]
    ) => {{
        let spec = spec_of($ty);
        let m4 = $set1(0x0F);
        let m2 = $set1(0x03);
        let mut wv = [$zero(); 8];
        match spec.bits {
            Bits::Four | Bits::Five | Bits::Six | Bits::Lut => {
                for c in 0..4 {
                    let raw = $load(c * 32);
                    wv[c] = $and(raw, m4);
                    wv[c + 4] = $and($srl(raw, _mm_cvtsi32_si128(4)), m4);
                }
            }
            Bits::Two | Bits::Three => {
                for p in 0..2 {
                    let raw = $load(p * 32);
                    for c in 0..4 {
                        let sh = _mm_cvtsi32_si128(2 * c as i32);
                        wv[p * 4 + c] = $and($srl(raw, sh), m2);
                    }
                }
            }
        }
        match spec.bits {
            Bits::Five | Bits::Three => {
                // Bit c of each byte is register c's extra bit, moved to `to`.
                let (at, to) = if spec.bits == Bits::Five {
                    (128, 4)
                } else {
                    (64, 2)
                };
                let h = $load(at);
                let keep = $set1((1i32 << to) as i8);
                for c in 0..8i32 {
                    let moved = if c <= to {
                        $sll(h, _mm_cvtsi32_si128(to - c))
                    } else {
                        $srl(h, _mm_cvtsi32_si128(c - to))
                    };
                    wv[c as usize] = $or(wv[c as usize], $and(moved, keep));
                }
            }
            Bits::Six => {
                let keep = $set1(0x30);
                for p in 0..2 {
                    let h = $load(128 + p * 32);
                    for c in 0..4i32 {
                        // Bits 2c, 2c+1 to bits 4, 5.
                        let moved = if 2 * c <= 4 {
                            $sll(h, _mm_cvtsi32_si128(4 - 2 * c))
                        } else {
                            $srl(h, _mm_cvtsi32_si128(2 * c - 4))
                        };
                        let r = p * 4 + c as usize;
                        wv[r] = $or(wv[r], $and(moved, keep));
                    }
                }
            }
            Bits::Lut => {
                for r in wv.iter_mut() {
                    *r = $shuffle($table, *r);
                }
            }
            _ => {}
        }
        wv
    }};
}
pub(crate) use unpack_codes;

/// The integer sub-scale bytes of half `h` of a block (Q2_K's low nibbles), as `$bytes(offset)`
/// reads the rows' bytes at that offset (8, or 16 for two tiles): what the Q8_K types' sums are
/// multiplied by, in AVX2's madds and VNNI's `vpmulld`.
macro_rules! sub_scale_bytes {
    ($spec:expr, $bytes:expr, $h:expr) => {{
        let mut raw = $bytes($spec.plane_bytes() + $h * 8);
        if $spec.min == Min::Packed {
            raw = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
        }
        raw
    }};
}
pub(crate) use sub_scale_bytes;

/// One block's scale and minimum per row for sub-scale byte `h`: the super-block's `dv` times
/// the integer sub-scale, and minus `dmv` times the sub-minimum (or `dv` and `dmv` themselves
/// for types without sub-scales). `$bytes(offset)` reads the rows' bytes at that offset in the
/// block (8, or 16 for two tiles); the intrinsics of the register width follow.
macro_rules! block_scales {
    (
        $spec:expr, $h:expr, $bytes:ident, $dv:expr, $dmv:expr,
        [$u8:path, $i8:path, $zero_i:path, $cvt:path, $mul:path, $sub:path, $zero:path]
    ) => {{
        let spb = $spec.scales_per_block();
        if spb == 0 {
            ($dv, $dmv)
        } else {
            let (pb, h) = ($spec.plane_bytes(), $h.min(spb - 1));
            let raw = $bytes(pb + h * 8);
            let (sc, mn) = match $spec.min {
                Min::Packed => (
                    $u8(_mm_and_si128(raw, _mm_set1_epi8(0x0F))),
                    $u8(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F))),
                ),
                Min::Sub => ($i8(raw), $u8($bytes(pb + 8 * spb + h * 8))),
                _ => ($i8(raw), $zero_i()),
            };
            let scale = $mul($dv, $cvt(sc));
            let min = match $spec.min {
                Min::Sub | Min::Packed => $sub($zero(), $mul($dmv, $cvt(mn))),
                _ => $dmv,
            };
            (scale, min)
        }
    }};
}
pub(crate) use block_scales;

macro_rules! quant_kernels {
    (
        $name:ident, $features:literal, $dot_u:ident, $dot_lut:ident, $lut_xor:expr,
        $vnni:expr
    ) => {
        pub mod $name {
            use super::super::quants::{spec_of, Act, ActChunk, Bits, Min, Tile, TOKENS};
            use crate::model::cpu::q8::simd::{prefetch, store, widen};
            use std::arch::x86_64::*;

            /// N tokens' activations against a tile of 8 rows of type TY (a `QType` as u8),
            /// written to out + i * stride for token i (the first `real` rows).
            ///
            /// # Safety
            /// The CPU must support the features; `a` holds N tokens of as many blocks as the
            /// tile; `out` is valid for those writes.
            #[target_feature(enable = $features)]
            pub unsafe fn tile<const TY: u8, const N: usize>(
                w: Tile<'_>,
                a: ActChunk,
                out: *mut f32,
                stride: usize,
                real: usize,
                stream: bool,
            ) {
                let spec = spec_of(TY);
                let (sbb, bb) = (spec.sb_bytes(), spec.blk_bytes());
                let nb = w.buf.len() / sbb * spec.per_super;
                let buf = w.buf.as_ptr();
                let lut = spec.bits == Bits::Lut;
                // What the integer sums lose (`Spec::kernel_centre`): on VNNI the IQ4 tables
                // go in biased by 128, and the `biased` types signed against activations
                // biased by 128 (the table as it is; `corr` comes off once per super-block).
                let biased = $vnni && spec.biased();
                // AVX2 takes the centred types' centre off in 16 bits (`Spec::i16_centred`).
                let centred = !$vnni && spec.i16_centred();
                // The Q8_K types' sub-scaled sums gather in integers over a super-block
                // (`gather`): AVX2 applies the sub-scales in its madds, VNNI multiplies its
                // dpbusd sums by them. Integer sums are exact, so both make the same ones, and
                // the float operations after them are the same: the two paths give the same
                // bits.
                let int_fold = spec.act == Act::Q8K;
                let centre = if centred {
                    0
                } else {
                    spec.kernel_centre($vnni)
                };
                let mut table = [0i8; 32];
                for (i, t) in table.iter_mut().enumerate() {
                    *t = spec.lut()[i % 16] ^ if biased { 0 } else { $lut_xor };
                }
                let table = _mm256_loadu_si256(table.as_ptr() as *const __m256i);
                let mut acc = [_mm256_setzero_ps(); N];
                // Q8_K activations have one scale per super-block: the blocks' sub-scaled
                // integer sums gather here (as i32 bits) and meet that scale once per
                // super-block.
                let mut facc = [_mm256_setzero_ps(); N];
                const AHEAD: usize = super::super::q8::PREFETCH_AHEAD;
                let mut dv = _mm256_setzero_ps();
                let mut dmv = _mm256_setzero_ps();
                let mut corr = _mm256_setzero_si256();
                for b in 0..nb {
                    let base = buf.add(spec.block_at(b));
                    if stream {
                        let mut l = 0;
                        while l < bb {
                            prefetch(base.wrapping_add(AHEAD + l));
                            l += 64;
                        }
                    }
                    if b % spec.per_super == 0 {
                        let hdr = buf.add((b / spec.per_super) * sbb);
                        dv = widen(hdr as *const u16);
                        if spec.min != Min::None {
                            dmv = widen(hdr.add(16) as *const u16);
                        }
                        if biased {
                            corr = _mm256_loadu_si256(hdr.add(16) as *const __m256i);
                        }
                    }
                    let mut wv = unpack::<TY>(base, table);
                    if biased && !lut {
                        for w in wv.iter_mut() {
                            *w = _mm256_sub_epi8(*w, _mm256_set1_epi8(spec.centre as i8));
                        }
                    }
                    // Scales and minimums of this block (per half: index 0 and 1).
                    let bytes = |o: usize| _mm_loadl_epi64(base.add(o) as *const __m128i);
                    let sub = |h: usize| {
                        block_scales!(
                            spec,
                            h,
                            bytes,
                            dv,
                            dmv,
                            [
                                _mm256_cvtepu8_epi32,
                                _mm256_cvtepi8_epi32,
                                _mm256_setzero_si256,
                                _mm256_cvtepi32_ps,
                                _mm256_mul_ps,
                                _mm256_sub_ps,
                                _mm256_setzero_ps
                            ]
                        )
                    };
                    let (scale0, min0) = sub(0);
                    let (scale1, min1) = if spec.halves { sub(1) } else { (scale0, min0) };
                    let (mul0, mul1) = madd_factors::<TY>(base, int_fold && !$vnni);
                    let (isc0, isc1) = int_scales::<TY>(base, int_fold && $vnni);
                    let qb = a.qs.add(b * 256);
                    for (i, (acc, facc)) in acc.iter_mut().zip(facc.iter_mut()).enumerate() {
                        let slot = b * TOKENS + i;
                        let q = qb.add(i * 32) as *const i32;
                        let act = |g: usize| _mm256_set1_epi32(q.add(g).read_unaligned());
                        let mut s0 = _mm256_setzero_si256();
                        let mut s1 = _mm256_setzero_si256();
                        if !$vnni && (!lut || int_fold) {
                            // AVX2: sums in 16 bits, one madd a half or block (`sums16`).
                            let isum = a.isum.add((b * TOKENS + i) * 4);
                            (s0, s1) = sums16::<TY>(&wv, q, isum, (mul0, mul1), centred);
                        } else {
                            for g in 0..4 {
                                if biased {
                                    s0 = super::$dot_u(s0, act(g), wv[g]);
                                    s1 = super::$dot_u(s1, act(g + 4), wv[g + 4]);
                                } else if lut {
                                    s0 = super::$dot_lut(s0, wv[g], act(g));
                                    s1 = super::$dot_lut(s1, wv[g + 4], act(g + 4));
                                } else {
                                    s0 = super::$dot_u(s0, wv[g], act(g));
                                    s1 = super::$dot_u(s1, wv[g + 4], act(g + 4));
                                }
                            }
                        }
                        let da = _mm256_set1_ps(*a.d.add(slot));
                        if int_fold {
                            if $vnni {
                                (s0, s1) = sub_scaled::<TY>((s0, s1), (isc0, isc1));
                            }
                            let last = b % spec.per_super == spec.per_super - 1;
                            let (mins, asum) = ((min0, min1), a.asum.add(slot * 4));
                            let corr = biased.then_some(corr);
                            gather::<TY>(acc, facc, (s0, s1), mins, asum, (last, corr), (dv, da));
                            continue;
                        }
                        fold_sums!(
                            [
                                _mm256_sub_epi32,
                                _mm256_set1_epi32,
                                _mm256_add_epi32,
                                _mm256_cvtepi32_ps,
                                _mm256_mul_ps,
                                _mm256_fmadd_ps,
                                _mm256_set1_ps
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
                    }
                }
                store(&acc, out, stride, real);
            }

            /// AVX2's multipliers for a block's madds (halves 0 and 1): the Q8_K types'
            /// integer sub-scales when `int_fold` (each row's, in both 16-bit halves of its
            /// lane), else ones.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn madd_factors<const TY: u8>(
                base: *const u8,
                int_fold: bool,
            ) -> (__m256i, __m256i) {
                let spec = spec_of(TY);
                if !int_fold {
                    return (_mm256_set1_epi16(1), _mm256_set1_epi16(1));
                }
                let bytes = |o: usize| _mm_loadl_epi64(base.add(o) as *const __m128i);
                let sc16 = |h: usize| {
                    let raw = super::sub_scale_bytes!(spec, bytes, h);
                    _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(raw, raw))
                };
                let m0 = sc16(0);
                (m0, if spec.halves { sc16(1) } else { m0 })
            }

            /// VNNI's integer sub-scales of a block (halves 0 and 1), one i32 lane a row, for
            /// the Q8_K types (`int_fold`), else zeros: the values AVX2's madds take
            /// (`madd_factors`).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn int_scales<const TY: u8>(
                base: *const u8,
                int_fold: bool,
            ) -> (__m256i, __m256i) {
                let spec = spec_of(TY);
                if !int_fold {
                    return (_mm256_setzero_si256(), _mm256_setzero_si256());
                }
                let bytes = |o: usize| _mm_loadl_epi64(base.add(o) as *const __m128i);
                let sc = |h: usize| _mm256_cvtepi8_epi32(super::sub_scale_bytes!(spec, bytes, h));
                let m0 = sc(0);
                (m0, if spec.halves { sc(1) } else { m0 })
            }

            /// VNNI, Q8_K types: a block's sums (halves 0 and 1) times the integer sub-scales,
            /// in integers (AVX2 takes them in its madds).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn sub_scaled<const TY: u8>(
                (s0, s1): (__m256i, __m256i),
                (isc0, isc1): (__m256i, __m256i),
            ) -> (__m256i, __m256i) {
                if spec_of(TY).halves {
                    (_mm256_mullo_epi32(s0, isc0), _mm256_mullo_epi32(s1, isc1))
                } else {
                    let s = _mm256_mullo_epi32(_mm256_add_epi32(s0, s1), isc0);
                    (s, _mm256_setzero_si256())
                }
            }

            /// One token's block sums (halves 0 and 1) on AVX2: the maddubs results of
            /// `Spec::i16_span` registers added in 16 bits, then one madd by `mul` (the same
            /// sums as a madd each, fewer multiplies; a span of 8 leaves the second zero). The
            /// centred types take their centre off first, in 16 bits, per half or block
            /// (`isum`: the packed sums of `quants::packed_sums`); IQ4_XS's signed table values
            /// go through the sign trick.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn sums16<const TY: u8>(
                wv: &[__m256i; 8],
                q: *const i32,
                isum: *const i32,
                (mul0, mul1): (__m256i, __m256i),
                centred: bool,
            ) -> (__m256i, __m256i) {
                let spec = spec_of(TY);
                let span = spec.i16_span();
                debug_assert!(!centred || span == spec.i16_group());
                let act = |g: usize| _mm256_set1_epi32(q.add(g).read_unaligned());
                let m = |g: usize| {
                    if spec.bits == Bits::Lut {
                        let w = wv[g];
                        _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(act(g), w))
                    } else {
                        _mm256_maddubs_epi16(wv[g], act(g))
                    }
                };
                let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                let mut g = 0;
                while g < 8 {
                    let mut p = m(g);
                    for j in 1..span {
                        p = _mm256_add_epi16(p, m(g + j));
                    }
                    if centred {
                        let at = if span == 8 { 2 } else { g / 4 };
                        p = _mm256_sub_epi16(p, _mm256_set1_epi32(*isum.add(at)));
                    }
                    let s = _mm256_madd_epi16(p, if g < 4 { mul0 } else { mul1 });
                    if g < 4 {
                        s0 = _mm256_add_epi32(s0, s);
                    } else {
                        s1 = _mm256_add_epi32(s1, s);
                    }
                    g += span;
                }
                (s0, s1)
            }

            /// Q8_K types: a token's sub-scaled block sums gather in integers over the
            /// super-block (in `facc`'s bits), meeting d and the activation scale once (at the
            /// `last` block, after the bias's `corr` comes off where given); the minimum terms
            /// go into `acc` per block (`min_terms`). The 512-bit kernel does the same per lane.
            #[inline]
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            unsafe fn gather<const TY: u8>(
                acc: &mut __m256,
                facc: &mut __m256,
                (s0, s1): (__m256i, __m256i),
                (min0, min1): (__m256, __m256),
                asum: *const f32,
                (last, corr): (bool, Option<__m256i>),
                (dv, da): (__m256, __m256),
            ) {
                let spec = spec_of(TY);
                let mut isb =
                    _mm256_add_epi32(_mm256_castps_si256(*facc), _mm256_add_epi32(s0, s1));
                *facc = _mm256_castsi256_ps(isb);
                super::min_terms!(
                    [_mm256_fmadd_ps, _mm256_set1_ps],
                    spec,
                    *acc,
                    min0,
                    min1,
                    asum
                );
                if last {
                    if let Some(corr) = corr {
                        isb = _mm256_sub_epi32(isb, corr);
                    }
                    let f = _mm256_cvtepi32_ps(isb);
                    *acc = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, da), *acc);
                    *facc = _mm256_setzero_ps();
                }
            }

            /// The 8 registers of block codes at `base` (see `unpack_codes`).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn unpack<const TY: u8>(base: *const u8, table: __m256i) -> [__m256i; 8] {
                let load = |o: usize| _mm256_loadu_si256(base.add(o) as *const __m256i);
                unpack_codes!(
                    TY,
                    load,
                    table,
                    [
                        _mm256_setzero_si256,
                        _mm256_set1_epi8,
                        _mm256_and_si256,
                        _mm256_or_si256,
                        _mm256_srl_epi16,
                        _mm256_sll_epi16,
                        _mm256_shuffle_epi8
                    ]
                )
            }
        }
    };
}

quant_kernels!(avx2, "avx2,fma,f16c", dot_u_avx2, dot_s_avx2, 0, false);
quant_kernels!(
    vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    dot_u_vnni,
    dot_u_vnni,
    -128,
    true
);
