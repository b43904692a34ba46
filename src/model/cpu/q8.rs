//! What gen's quantized CPU kernels share: the choice of instruction set ([`Kernel`]) and
//! llama.cpp's 8-bit quantization of one block of activations (Q8_0, and Q8_1's sums), bit for
//! bit, portable and AVX2.

use half::f16;

/// Which dot-product implementation to use; picked once from the CPU's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// AMX tile multiplies for BF16 products of many tokens ([`super::amx_half`], which
    /// rounds differently from the 512-bit kernel); everywhere else it is [`Kernel::Vnni`]
    /// ([`Kernel::base`]), whose layouts it takes. Never the rule by instruction set: chosen by
    /// measurement ([`super::choice`]) or by `GEN_KERNEL=amx`.
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// `vdpbf16ps` for BF16 products of many tokens, on activations rounded to bf16 as
    /// llama.cpp rounds them ([`super::bf16_dot`]); elsewhere [`Kernel::Vnni`], as AMX. Chosen
    /// by measurement or by `GEN_KERNEL=bf16`, never by rule.
    #[cfg(target_arch = "x86_64")]
    Bf16,
}

impl Kernel {
    /// The fastest kernel this CPU supports, unless `GEN_KERNEL=scalar` (or `avx2`) asks for a
    /// slower one.
    pub fn detect() -> Self {
        if std::env::var("GEN_KERNEL").is_ok_and(|v| v == "scalar") {
            return Kernel::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            // The VNNI kernels also run on 512-bit registers (`quants_zmm`): byte operations
            // there need AVX-512BW, which every CPU with AVX-512 VNNI has.
            let vnni = is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw");
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
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => "amx",
            #[cfg(target_arch = "x86_64")]
            Kernel::Bf16 => "avx512-bf16",
        }
    }

    /// The kernel whose weight layout and activations this path takes: AMX and `vdpbf16ps`
    /// run on the 512-bit path's.
    pub fn base(self) -> Kernel {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx | Kernel::Bf16 => Kernel::Vnni,
            k => k,
        }
    }

    /// Whether this CPU can take the AMX path (its base, [`Kernel::Vnni`], and AMX, which Linux
    /// lets this process use).
    pub fn amx_ready() -> bool {
        #[cfg(target_arch = "x86_64")]
        if Kernel::detect() == Kernel::Vnni {
            return super::amx::ready();
        }
        false
    }

    /// Whether this CPU can take the `vdpbf16ps` path (its base, [`Kernel::Vnni`], and AVX-512
    /// BF16).
    pub fn bf16_ready() -> bool {
        #[cfg(target_arch = "x86_64")]
        if Kernel::detect() == Kernel::Vnni {
            return has_bf16_dot();
        }
        false
    }

    /// The paths for one token, a few and a prefill chunk where `GEN_KERNEL` forces them, on
    /// a matrix laid out for `layout`: `amx` forces AMX for every call (where the CPU has it;
    /// else the 512-bit path), `bf16` the `vdpbf16ps` path likewise, so a token's products do
    /// not change with the size of its pass. `GEN_KERNEL=ONE/FEW/CHUNK` (say
    /// `avx2/avx512/bf16`) forces a path per kind of call ([`Call`]), as a measured choice may
    /// mix them: what the tests run to check that every mix the CPU offers gives the same
    /// bits. A path the CPU or the layout cannot take is the layout's own.
    pub fn forced_paths(layout: Kernel) -> [Kernel; 3] {
        let forced = std::env::var("GEN_KERNEL").unwrap_or_default();
        match Self::per_call(&forced) {
            Some(names) => names.map(|n| Self::forced_one(n, layout)),
            None => [Self::forced_one(&forced, layout); 3],
        }
    }

    /// The three names of a `GEN_KERNEL=ONE/FEW/CHUNK` value, or None for another value.
    fn per_call(forced: &str) -> Option<[&str; 3]> {
        let mut parts = forced.split('/');
        let names = [parts.next()?, parts.next()?, parts.next()?];
        parts.next().is_none().then_some(names)
    }

    /// The path `GEN_KERNEL`'s `name` asks for on a matrix laid out for `layout`: `avx2`,
    /// `avx512`, `amx` or `bf16` where the CPU and layout can take it, else the layout's own.
    fn forced_one(name: &str, layout: Kernel) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if layout == Kernel::Vnni {
            return match name {
                "avx2" => Kernel::Avx2,
                "amx" if super::amx::ready() => Kernel::Amx,
                "bf16" if has_bf16_dot() => Kernel::Bf16,
                _ => Kernel::Vnni,
            };
        }
        let _ = name;
        layout
    }

    /// Whether paths `a` and `b` give the same bits for every product of a matrix that takes
    /// them ([`super::matmul::CpuQWeight::takes`]): the AVX2 and 512-bit kernels do for every
    /// type (the same integer sums, then the same float operations in the same order); AMX and
    /// `vdpbf16ps` sum BF16 products in another order, so they agree only with themselves.
    pub fn agrees(a: Kernel, b: Kernel) -> bool {
        let class = |k: Kernel| match k {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => Kernel::Vnni,
            k => k,
        };
        class(a) == class(b)
    }
}

/// Whether this CPU has the instructions of the `vdpbf16ps` path ([`super::bf16_dot`]), with
/// the 512-bit path, the base of that one. (Asked here, where the paths are chosen, so that
/// `bf16_dot`, which builds on `wide16` and through it on this module, is not needed here.)
#[cfg(target_arch = "x86_64")]
fn has_bf16_dot() -> bool {
    is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
}

/// The kinds of call a path is chosen for, by the tokens a product multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Call {
    /// One token: a decode step, bound by reading the weights.
    One = 0,
    /// 2 to [`FEW`] tokens: a batch's decode step, a speculative check.
    Few = 1,
    /// More: a prefill chunk, bound by arithmetic.
    Many = 2,
}

/// The most tokens a [`Call::Few`] call has.
pub const FEW: usize = 16;

impl Call {
    pub const ALL: [Call; 3] = [Call::One, Call::Few, Call::Many];

    pub fn of(tokens: usize) -> Self {
        match tokens {
            0 | 1 => Call::One,
            2..=FEW => Call::Few,
            _ => Call::Many,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Call::One => "one",
            Call::Few => "few",
            Call::Many => "chunk",
        }
    }

    /// A token count of this kind.
    pub fn sample_tokens(self) -> usize {
        self.sample().0
    }

    pub fn from_name(s: &str) -> Option<Self> {
        Call::ALL.into_iter().find(|c| c.name() == s)
    }

    /// Tokens a timed call multiplies, and the weight bytes it reads at most (a decode step
    /// streams weights from memory, so it reads more than any cache holds; a chunk is
    /// arithmetic, a few matrices tell).
    pub fn sample(self) -> (usize, usize) {
        match self {
            Call::One => (1, 48 << 20),
            Call::Few => (4, 48 << 20),
            Call::Many => (64, 4 << 20),
        }
    }
}

/// How far ahead of the block it works on (in bytes of quants) a kernel called for a few
/// tokens asks for weights: the tile's next blocks, then the next tile's (tiles of a task are
/// consecutive in memory). A decode step streams every weight from memory once, with little
/// arithmetic per byte, and the hardware prefetchers restart at each 4 KiB page; asking ~2 KiB
/// ahead, two cache lines a block, took a batch-size-8 decode pass's Q4_1 products from ~4.9
/// to ~4.3 ms and single-sequence decode 10-20% up (1,536-3,072 measured alike; 4,096 and
/// more, and whole tiles at a time, slower). Prefill calls, which reuse each tile for many
/// tokens, do not ask.
pub const PREFETCH_AHEAD: usize = 2048;

/// Tokens from which AVX2 multiplies Q8_0 weights by the activations in 16 bits
/// (`matmul::x86::tile_q8_0_i16`): `vpmaddwd` on the codes sign-extended once per block and
/// the activations' i16 pairs ([`i16_pairs`]), 16 products an instruction, instead of the sign
/// trick's two `vpsignb`, a `vpmaddubsw` and a `vpmaddwd` for 32, which share the same two pipes
/// on Zen 3 and 4 (one on Zen 1). Below it (a decode step) the codes would be widened for too
/// few tokens.
pub const I16_TOKENS: usize = 16;

/// Activation quants in 32-byte slots as the 16-bit kernel reads them: per 4 quants q0..q3,
/// the words (q0, q2) and (q1, q3), each sign-extended to i16, the first in the low half. A
/// code register's 4 bytes a row split the same way by shifts (even bytes: left 8 then
/// arithmetic right 8; odd: arithmetic right 8), so one `vpmaddwd` adds a row's two products.
pub fn i16_pairs(qs: &[u8]) -> Vec<i32> {
    use rayon::prelude::*;
    let pair = |lo: u8, hi: u8| {
        (lo as i8 as i16 as u16 as u32 | (hi as i8 as i16 as u16 as u32) << 16) as i32
    };
    let mut wide = vec![0i32; qs.len() / 2];
    let fill = |(q, w): (&[u8], &mut [i32])| {
        for (g, w) in q.chunks_exact(4).zip(w.chunks_exact_mut(2)) {
            w[0] = pair(g[0], g[2]);
            w[1] = pair(g[1], g[3]);
        }
    };
    qs.par_chunks(1 << 14)
        .zip(wide.par_chunks_mut(1 << 13))
        .for_each(fill);
    wide
}

/// f32 -> f16 -> f32: the precision llama.cpp stores activation scales in.
pub fn through_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Round to the nearest integer, ties to even, for |v| <= 2^22: adding and removing 1.5 * 2^23
/// leaves no fraction bits, so the FPU's own rounding does the work (inlined, unlike libm's
/// rintf, which showed up in profiles).
#[inline(always)]
pub fn round_half_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// One block of 32 values to 8 bits, as llama.cpp does: d = amax / 127, q = round-half-even(x *
/// 127 / amax). Returns d (before any f16 rounding) and sum(q).
#[inline]
pub fn quantize_block(blk: &[f32], q: &mut [u8]) -> (f32, i32) {
    let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (v, q) in blk.iter().zip(q.iter_mut()) {
        let qi = round_half_even(v * id) as i8;
        *q = qi as u8;
        sum += qi as i32;
    }
    (d, sum)
}

/// [`quantize_block`] with AVX2, bit for bit: the same amax, the same products
/// rounded half to even, the same integer sum.
///
/// # Safety
/// The CPU must have AVX2; blk and q hold 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn x86_quantize_block(blk: &[f32], q: &mut [u8]) -> (f32, i32) {
    let (d, [lo, hi]) = x86_quantize_block_halves(blk, q);
    (d, lo + hi)
}

/// [`x86_quantize_block`] returning the integer sums of the two 16-value halves.
///
/// # Safety
/// The CPU must have AVX2; blk and q hold 32 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn x86_quantize_block_halves(blk: &[f32], q: &mut [u8]) -> (f32, [i32; 2]) {
    use std::arch::x86_64::*;
    assert!(blk.len() >= 32 && q.len() >= 32);
    let p = blk.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_andnot_ps(sign, v[0]);
    for x in &v[1..] {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *x));
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    let amax = _mm_cvtss_f32(m);
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let mut r = [_mm256_setzero_si256(); 4];
    for (r, x) in r.iter_mut().zip(v) {
        *r = _mm256_cvtps_epi32(_mm256_round_ps(
            _mm256_mul_ps(x, id),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        ));
    }
    // i32 -> i8 in two packing steps; the packs work within 128-bit lanes, so the 4-byte
    // groups come out as 0 2 4 6 1 3 5 7 and one permute puts them back in order.
    let lo = _mm256_packs_epi32(r[0], r[1]);
    let hi = _mm256_packs_epi32(r[2], r[3]);
    let bytes = _mm256_packs_epi16(lo, hi);
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
    // The halves' sums side by side: two horizontal adds leave each half's partial sums in
    // lanes 0 and 1 of both 128-bit lanes.
    let h = _mm256_hadd_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    let h = _mm256_hadd_epi32(h, h);
    let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    (d, [_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s)])
}

/// The Q8_K quantization of one super-block of 256 values with AVX2, bit for bit the scalar
/// one in `quants` (for finite values): the first value of largest magnitude sets the scale
/// `-127 / max`, each product rounds half to even, capped at 127. Writes the 256 bytes to q
/// and returns `1 / scale` and each 32-value block's sums of its two halves.
///
/// # Safety
/// The CPU must have AVX2; sb and q hold 256 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn x86_quantize_q8k(sb: &[f32], q: &mut [u8]) -> (f32, [[i32; 2]; 8]) {
    use std::arch::x86_64::*;
    assert!(sb.len() >= 256 && q.len() >= 256);
    let p = sb.as_ptr();
    let sign = _mm256_set1_ps(-0.0);
    // |v| for values 8c..8c + 8 (a macro, not a closure: closures do not take on the
    // function's target features and stay calls).
    macro_rules! abs {
        ($c:expr) => {
            _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add($c * 8)))
        };
    }
    // Four running maxima, so that the 32 steps do not wait on each other.
    let mut m = [_mm256_setzero_ps(); 4];
    for c in 0..32 {
        // |v| first: a NaN there leaves m as it was, as the scalar scan skips it.
        m[c % 4] = _mm256_max_ps(abs!(c), m[c % 4]);
    }
    let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    if amax == 0.0 {
        q[..256].fill(0);
        return (0.0, [[0; 2]; 8]);
    }
    // The first value of that magnitude, found 8 at a time.
    let target = _mm256_set1_ps(amax);
    let mut first = 256;
    for c in 0..32 {
        let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs!(c), target));
        if hit != 0 {
            first = c * 8 + hit.trailing_zeros() as usize;
            break;
        }
    }
    // amax is one of them: first < 256.
    let is = -127.0 / sb[..256][first];
    let iscale = _mm256_set1_ps(is);
    let cap = _mm256_set1_epi32(127);
    let flip = _mm256_set1_epi8(-128);
    let mut sums = [[0i32; 2]; 8];
    for (b, sum) in sums.iter_mut().enumerate() {
        let mut r = [_mm256_setzero_si256(); 4];
        for (j, r) in r.iter_mut().enumerate() {
            let v = _mm256_mul_ps(iscale, _mm256_loadu_ps(p.add(b * 32 + j * 8)));
            *r = _mm256_min_epi32(_mm256_cvtps_epi32(v), cap);
        }
        let lo = _mm256_packs_epi32(r[0], r[1]);
        let hi = _mm256_packs_epi32(r[2], r[3]);
        let bytes = _mm256_packs_epi16(lo, hi);
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr().add(b * 32) as *mut __m256i, bytes);
        // Each half's sum: the bytes made unsigned (+128 each) summed 8 at a time by sad, the
        // two eights of each 128-bit lane added, 16 * 128 taken off.
        let s = _mm256_sad_epu8(_mm256_xor_si256(bytes, flip), _mm256_setzero_si256());
        let s = _mm256_add_epi64(s, _mm256_srli_si256::<8>(s));
        *sum = [
            _mm256_cvtsi256_si32(s) - 2048,
            _mm256_extract_epi32::<4>(s) - 2048,
        ];
    }
    (1.0 / is, sums)
}

/// Small steps every x86 matrix kernel takes; inlined into each (their features are a subset
/// of every kernel's).
///
/// # Safety
/// Each needs the CPU features it enables, and pointers valid for the reads or writes it
/// makes (`store`: `real` floats at out + i * stride for each of the N tokens).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::missing_safety_doc)]
pub mod simd {
    use std::arch::x86_64::*;

    /// acc + per lane, sum over 4 bytes of u8 * i8 (the u8 below 64, so maddubs cannot saturate).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_u_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(u, s);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    pub unsafe fn dot_u_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, u, s)
    }

    /// Signed codes times signed bytes on AVX2: |w| * (a with w's sign).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_s_avx2(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// Ask for the cache line holding `at` (a hint: it never faults, wherever `at`
    /// points).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn prefetch<T>(at: *const T) {
        _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
    }

    /// 8 f16 values (bits) at `at` as 8 f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen(at: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
    }

    /// Token i's 8 sums to out + i * stride, the first `real` of them.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn store<const N: usize>(
        acc: &[__m256; N],
        out: *mut f32,
        stride: usize,
        real: usize,
    ) {
        if real == 8 {
            for (i, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(i * stride), *acc);
            }
        } else {
            let mut buf = [0f32; 8];
            for (i, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(buf.as_mut_ptr(), *acc);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), out.add(i * stride), real);
            }
        }
    }
}

/// (Tests.) Every kernel this CPU runs, the portable one first.
#[cfg(test)]
pub(crate) fn test_kernels() -> Vec<Kernel> {
    let mut k = vec![Kernel::Scalar];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        k.push(Kernel::Avx2);
        if is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw")
        {
            k.push(Kernel::Vnni);
        }
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cpu::matmul::test_data as data;

    /// The AVX2 quantizer gives the scalar one's bytes, scale and sum (and each half's sum)
    /// exactly, ties and zero blocks included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_quantization_equals_scalar() {
        if !is_x86_feature_detected!("avx2") || !is_x86_feature_detected!("fma") {
            return;
        }
        let mut blocks: Vec<Vec<f32>> = (0..200).map(|i| data(32, 11 + i)).collect();
        blocks.push(vec![0.0; 32]);
        // amax 127 makes the factor exactly 1: every other value is a tie, k + 0.5.
        blocks.push(
            (0..32)
                .map(|i| if i == 0 { 127.0 } else { i as f32 - 15.5 })
                .collect(),
        );
        blocks.push((0..32).map(|i| if i == 3 { -1e-30 } else { 0.0 }).collect());
        for (i, blk) in blocks.iter().enumerate() {
            let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
            let want = quantize_block(blk, &mut a);
            // SAFETY: checked above.
            let got = unsafe { x86_quantize_block(blk, &mut b) };
            assert_eq!(got, want, "block {i}");
            assert_eq!(a, b, "block {i}");
            // SAFETY: checked above.
            let (d, halves) = unsafe { x86_quantize_block_halves(blk, &mut b) };
            let sum = |q: &[u8]| q.iter().map(|&v| v as i8 as i32).sum::<i32>();
            assert_eq!(
                (d, halves),
                (want.0, [sum(&a[..16]), sum(&a[16..])]),
                "block {i}"
            );
        }
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
}
