//! The x86 kernels of [`super::quants`], written once and instantiated per instruction set:
//! `avx2` multiplies unsigned codes by signed activation bytes with maddubs + madd, `vnni` with
//! one dpbusd. Signed codes (the IQ4 tables) go through AVX2's sign trick, or on VNNI are
//! biased by 128 and the bias removed with the activation's integer sum, exactly.

#![cfg(target_arch = "x86_64")]

use crate::model::cpu::q8::simd::{dot_s_avx2, dot_u_avx2, dot_u_vnni};

macro_rules! quant_kernels {
    ($name:ident, $features:literal, $dot_u:ident, $dot_lut:ident, $lut_xor:expr, $lut_bias:expr) => {
        pub mod $name {
            use super::super::quants::{
                spec_of, Act, ActChunk, Bits, Min, Tile, IQ4_VALUES, TOKENS,
            };
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
                let pb = spec.plane_bytes();
                let (sbb, bb) = (spec.sb_bytes(), spec.blk_bytes());
                let nb = w.buf.len() / sbb * spec.per_super;
                let buf = w.buf.as_ptr();
                let spb = spec.scales_per_block();
                let lut = spec.bits == Bits::Lut;
                // Signed codes are biased on VNNI: the activation sums come times 128 more
                // (`centre_of`).
                let centre = spec.centre + if lut { $lut_bias } else { 0 };
                let mut table = [0i8; 32];
                for (i, t) in table.iter_mut().enumerate() {
                    *t = IQ4_VALUES[i % 16] ^ $lut_xor;
                }
                let table = _mm256_loadu_si256(table.as_ptr() as *const __m256i);
                let mut acc = [_mm256_setzero_ps(); N];
                // Q8_K activations have one scale per super-block: the blocks' scaled sums
                // gather here and meet that scale once per super-block.
                let per_sb = spec.act == Act::Q8K;
                let mut facc = [_mm256_setzero_ps(); N];
                const AHEAD: usize = super::super::q8::PREFETCH_AHEAD;
                let mut dv = _mm256_setzero_ps();
                let mut dmv = _mm256_setzero_ps();
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
                    }
                    let wv = unpack::<TY>(base, table);
                    // Scales and minimums of this block (per half: index 0 and 1).
                    let sc_at = |h: usize| base.add(pb + h * 8);
                    let mn_at = |h: usize| base.add(pb + 8 * spb + h * 8);
                    let bytes = |p: *const u8| _mm_loadl_epi64(p as *const __m128i);
                    let sub = |h: usize| -> (__m256, __m256) {
                        if spb == 0 {
                            return (dv, dmv);
                        }
                        let raw = bytes(sc_at(h.min(spb - 1)));
                        let (sc, mn) = match spec.min {
                            Min::Packed => (
                                _mm256_cvtepu8_epi32(_mm_and_si128(raw, _mm_set1_epi8(0x0F))),
                                _mm256_cvtepu8_epi32(_mm_and_si128(
                                    _mm_srli_epi16(raw, 4),
                                    _mm_set1_epi8(0x0F),
                                )),
                            ),
                            Min::Sub => (
                                _mm256_cvtepi8_epi32(raw),
                                _mm256_cvtepu8_epi32(bytes(mn_at(h.min(spb - 1)))),
                            ),
                            _ => (_mm256_cvtepi8_epi32(raw), _mm256_setzero_si256()),
                        };
                        let scale = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(sc));
                        let min = match spec.min {
                            Min::Sub | Min::Packed => _mm256_sub_ps(
                                _mm256_setzero_ps(),
                                _mm256_mul_ps(dmv, _mm256_cvtepi32_ps(mn)),
                            ),
                            _ => dmv,
                        };
                        (scale, min)
                    };
                    let (scale0, min0) = sub(0);
                    let (scale1, min1) = if spec.halves { sub(1) } else { (scale0, min0) };
                    let qb = a.qs.add(b * 256);
                    for (i, (acc, facc)) in acc.iter_mut().zip(facc.iter_mut()).enumerate() {
                        let slot = b * TOKENS + i;
                        let q = qb.add(i * 32) as *const i32;
                        let act = |g: usize| _mm256_set1_epi32(q.add(g).read_unaligned());
                        let mut s0 = _mm256_setzero_si256();
                        let mut s1 = _mm256_setzero_si256();
                        for g in 0..4 {
                            if lut {
                                s0 = super::$dot_lut(s0, wv[g], act(g));
                                s1 = super::$dot_lut(s1, wv[g + 4], act(g + 4));
                            } else {
                                s0 = super::$dot_u(s0, wv[g], act(g));
                                s1 = super::$dot_u(s1, wv[g + 4], act(g + 4));
                            }
                        }
                        let da = _mm256_set1_ps(*a.d.add(slot));
                        let isum = a.isum.add(slot * 4);
                        let asum = a.asum.add(slot * 4);
                        if spec.halves {
                            if centre != 0 {
                                s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(*isum));
                                s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(*isum.add(1)));
                            }
                            if per_sb {
                                *facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), scale0, *facc);
                                *facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), scale1, *facc);
                            } else {
                                let f = _mm256_mul_ps(_mm256_cvtepi32_ps(s0), scale0);
                                let f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), scale1, f);
                                *acc = _mm256_fmadd_ps(f, da, *acc);
                            }
                            if spec.min != Min::None {
                                *acc = _mm256_fmadd_ps(min0, _mm256_set1_ps(*asum), *acc);
                                *acc = _mm256_fmadd_ps(min1, _mm256_set1_ps(*asum.add(1)), *acc);
                            }
                        } else {
                            let mut s = _mm256_add_epi32(s0, s1);
                            if centre != 0 {
                                s = _mm256_sub_epi32(s, _mm256_set1_epi32(*isum.add(2)));
                            }
                            if per_sb {
                                *facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale0, *facc);
                            } else {
                                let d = _mm256_mul_ps(scale0, da);
                                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
                            }
                            if spec.min != Min::None {
                                *acc = _mm256_fmadd_ps(min0, _mm256_set1_ps(*asum.add(2)), *acc);
                            }
                        }
                        if per_sb && b % spec.per_super == spec.per_super - 1 {
                            *acc = _mm256_fmadd_ps(*facc, da, *acc);
                            *facc = _mm256_setzero_ps();
                        }
                    }
                }
                store(&acc, out, stride, real);
            }

            /// The 8 registers of block codes at `base`: register c holds codes 4c..4c+4 of
            /// each of the 8 rows (IQ4: their table values, biased on VNNI).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn unpack<const TY: u8>(base: *const u8, table: __m256i) -> [__m256i; 8] {
                let spec = spec_of(TY);
                let m4 = _mm256_set1_epi8(0x0F);
                let m2 = _mm256_set1_epi8(0x03);
                let mut wv = [_mm256_setzero_si256(); 8];
                match spec.bits {
                    Bits::Four | Bits::Five | Bits::Six | Bits::Lut => {
                        for c in 0..4 {
                            let raw = _mm256_loadu_si256(base.add(c * 32) as *const __m256i);
                            wv[c] = _mm256_and_si256(raw, m4);
                            wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                        }
                    }
                    Bits::Two | Bits::Three => {
                        for p in 0..2 {
                            let raw = _mm256_loadu_si256(base.add(p * 32) as *const __m256i);
                            for c in 0..4 {
                                let sh = _mm_cvtsi32_si128(2 * c as i32);
                                wv[p * 4 + c] = _mm256_and_si256(_mm256_srl_epi16(raw, sh), m2);
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
                        let h = _mm256_loadu_si256(base.add(at) as *const __m256i);
                        let keep = _mm256_set1_epi8((1i32 << to) as i8);
                        for c in 0..8i32 {
                            let moved = if c <= to {
                                _mm256_sll_epi16(h, _mm_cvtsi32_si128(to - c))
                            } else {
                                _mm256_srl_epi16(h, _mm_cvtsi32_si128(c - to))
                            };
                            wv[c as usize] =
                                _mm256_or_si256(wv[c as usize], _mm256_and_si256(moved, keep));
                        }
                    }
                    Bits::Six => {
                        let keep = _mm256_set1_epi8(0x30);
                        for p in 0..2 {
                            let h = _mm256_loadu_si256(base.add(128 + p * 32) as *const __m256i);
                            for c in 0..4i32 {
                                // Bits 2c, 2c+1 to bits 4, 5.
                                let moved = if 2 * c <= 4 {
                                    _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - 2 * c))
                                } else {
                                    _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c - 4))
                                };
                                let r = p * 4 + c as usize;
                                wv[r] = _mm256_or_si256(wv[r], _mm256_and_si256(moved, keep));
                            }
                        }
                    }
                    Bits::Lut => {
                        for r in wv.iter_mut() {
                            *r = _mm256_shuffle_epi8(table, *r);
                        }
                    }
                    _ => {}
                }
                wv
            }
        }
    };
}

quant_kernels!(avx2, "avx2,fma,f16c", dot_u_avx2, dot_s_avx2, 0, 0);
quant_kernels!(
    vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    dot_u_vnni,
    dot_u_vnni,
    -128,
    128
);
