//! gen's CPU kernels for the GGUF types people download besides Q4_1 and Q8_0 (which keep
//! their own, older kernels in [`super::matmul`]): Q4_0, Q5_0, Q5_1, the K-quants Q2_K to Q6_K,
//! IQ4_NL and IQ4_XS.
//!
//! One design covers them all. At load, every block is decoded into the same canonical form
//! (per 32 values: 32 unsigned codes, the integer sub-scales and sub-minimums of that block or
//! of its two 16-value halves; per super-block: the f16 scale `d` and, where the type has one,
//! the f16 minimum scale) and repacked into 8-row tiles, the codes split into bit planes so that
//! one 32-byte load plus a shift and a mask gives 4 codes of each of 8 rows. No code is wider
//! than the file's: a tile is as big as the file's blocks, give or take two bytes a super-block.
//!
//! A value is `scale * (code - centre) + min`, where per type (see [`Spec`]):
//! - scale is `d` (Q4_0, Q5_0, Q5_1, IQ4_NL) or `d * sc` with an integer sub-scale `sc` per 32
//!   values (Q4_K, Q5_K, IQ4_XS) or per 16 (Q2_K, Q3_K, Q6_K);
//! - centre is a constant subtracted in integers (8 for Q4_0, 16 for Q5_0, 4 for Q3_K, 32 for
//!   Q6_K), so those dot products stay exact, as llama.cpp's (on VNNI, Q3_K, Q6_K and IQ4_XS
//!   take signed codes against activations biased by 128 instead: [`Spec::biased`]);
//! - min is `m` (Q5_1) or `-dmin * mn` with an integer sub-minimum (Q2_K, Q4_K, Q5_K);
//! - IQ4_NL and IQ4_XS map the 4-bit code through their 16-entry table first.
//!
//! Activations are quantized as llama.cpp quantizes them for each weight type ([`Act`]): Q8_0
//! blocks of 32 for Q4_0, Q5_0 and IQ4_NL, Q8_1 (with its f16 `d * sum`) for Q5_1, and Q8_K
//! (one f32 scale per 256 values, sums per 16) for the K-quants and IQ4_XS. The integer dot
//! product of a block's codes with the activation's 8-bit quants is exact; the scales apply in
//! f32 per block (per half block for the 16-value types).
//!
//! Kernels: a portable scalar one over the same tiles ([`scalar_tile`]), and AVX2 and AVX-512
//! VNNI ones (`super::quants_x86`), chosen at run time as for the older types.

use half::f16;

use super::buf::Buf;

use super::q8::{quantize_block, round_half_even, through_f16, Kernel};

/// Values in a block: the unit of tiles and activations.
pub const QK: usize = 32;
/// Tokens in a chunk of activations.
pub const TOKENS: usize = 8;

/// The weight types of this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QType {
    Q4_0 = 0,
    Q5_0 = 1,
    Q5_1 = 2,
    Q2K = 3,
    Q3K = 4,
    Q4K = 5,
    Q5K = 6,
    Q6K = 7,
    Iq4Nl = 8,
    Iq4Xs = 9,
    /// OCP's microscaling FP4 (gpt-oss's experts): per 32 values an E8M0 power of two and 4-bit
    /// E2M1 codes, run as IQ4_NL is through a table ([`MXFP4_VALUES`]).
    Mxfp4 = 10,
}

/// How a type's codes sit in a tile's planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    /// 4-bit codes as nibbles.
    Four,
    /// Nibbles plus one more bit each (16).
    Five,
    /// Nibbles plus two more bits each (16, 32).
    Six,
    /// 2-bit codes.
    Two,
    /// 2-bit codes plus one more bit each (4).
    Three,
    /// 4-bit indexes into the IQ4 table of signed values.
    Lut,
}

/// The minimum term of a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Min {
    None,
    /// `+ m`, an f16 per block (Q5_1).
    Own,
    /// `- dmin * mn`, an integer per block or half (Q4_K, Q5_K).
    Sub,
    /// As `Sub`, with `mn` in the high nibble of the sub-scale's byte (Q2_K).
    Packed,
}

/// How the activations are quantized for a type (as llama.cpp does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Blocks of 32, f16 scale amax/127.
    Q8_0,
    /// Q8_0 with the block's `f16(d * sum)`.
    Q8_1,
    /// Blocks of 256, f32 scale `max / -127` (max the value of largest magnitude).
    Q8K,
}

/// What a type is made of.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub bits: Bits,
    /// 32-value blocks per super-block (the GGUF block): 1 or 8.
    pub per_super: usize,
    /// Sub-scales (and minimums) per 16 values instead of per 32.
    pub halves: bool,
    /// Per-block integer sub-scales.
    pub sub: bool,
    pub centre: i32,
    pub min: Min,
    pub act: Act,
    /// Bytes of one GGUF super-block.
    pub block_bytes: usize,
    /// ggml's type number.
    pub ggml: u32,
    pub name: &'static str,
}

impl QType {
    pub const ALL: [QType; 11] = [
        QType::Q4_0,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q2K,
        QType::Q3K,
        QType::Q4K,
        QType::Q5K,
        QType::Q6K,
        QType::Iq4Nl,
        QType::Iq4Xs,
        QType::Mxfp4,
    ];

    pub const fn spec(self) -> Spec {
        spec_of(self as u8)
    }

    pub fn from_ggml(t: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|q| q.spec().ggml == t)
    }
}

/// The spec of type number `t` (a `QType` as u8): const, so a kernel instantiated for one type
/// folds every branch on it away.
#[allow(clippy::too_many_arguments)]
const fn s(
    bits: Bits,
    per_super: usize,
    halves: bool,
    sub: bool,
    centre: i32,
    min: Min,
    act: Act,
    block_bytes: usize,
    ggml: u32,
    name: &'static str,
) -> Spec {
    Spec {
        bits,
        per_super,
        halves,
        sub,
        centre,
        min,
        act,
        block_bytes,
        ggml,
        name,
    }
}

pub const fn spec_of(t: u8) -> Spec {
    match t {
        0 => s(
            Bits::Four,
            1,
            false,
            false,
            8,
            Min::None,
            Act::Q8_0,
            18,
            2,
            "Q4_0",
        ),
        1 => s(
            Bits::Five,
            1,
            false,
            false,
            16,
            Min::None,
            Act::Q8_0,
            22,
            6,
            "Q5_0",
        ),
        2 => s(
            Bits::Five,
            1,
            false,
            false,
            0,
            Min::Own,
            Act::Q8_1,
            24,
            7,
            "Q5_1",
        ),
        3 => s(
            Bits::Two,
            8,
            true,
            true,
            0,
            Min::Packed,
            Act::Q8K,
            84,
            10,
            "Q2_K",
        ),
        4 => s(
            Bits::Three,
            8,
            true,
            true,
            4,
            Min::None,
            Act::Q8K,
            110,
            11,
            "Q3_K",
        ),
        5 => s(
            Bits::Four,
            8,
            false,
            true,
            0,
            Min::Sub,
            Act::Q8K,
            144,
            12,
            "Q4_K",
        ),
        6 => s(
            Bits::Five,
            8,
            false,
            true,
            0,
            Min::Sub,
            Act::Q8K,
            176,
            13,
            "Q5_K",
        ),
        7 => s(
            Bits::Six,
            8,
            true,
            true,
            32,
            Min::None,
            Act::Q8K,
            210,
            14,
            "Q6_K",
        ),
        8 => s(
            Bits::Lut,
            1,
            false,
            false,
            0,
            Min::None,
            Act::Q8_0,
            18,
            20,
            "IQ4_NL",
        ),
        10 => s(
            Bits::Lut,
            1,
            false,
            false,
            0,
            Min::None,
            Act::Q8_0,
            17,
            39,
            "MXFP4",
        ),
        _ => s(
            Bits::Lut,
            8,
            false,
            true,
            0,
            Min::None,
            Act::Q8K,
            136,
            23,
            "IQ4_XS",
        ),
    }
}

/// IQ4_NL's and IQ4_XS's 16 values.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4's 16 values: E2M1's (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) doubled, as
/// ggml's table has them, its block scale halved to match ([`e8m0_half`]).
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An MXFP4 block's scale byte e as the f16 bits of 2^(e - 128) (ggml's
/// `GGML_E8M0_TO_FP32_HALF`): exact for e from 104 (2^-24, f16's least subnormal) to 143
/// (2^15); below, 0 (a block whose values are all under 2^-21 in size: ggml's quantizer gives
/// e = 0 to an all-zero block); above, f16's infinity (values past 2^15: no trained weight),
/// which the loader refuses ([`Tiles::from_gguf`] callers check [`mxfp4_scales_fit`]).
pub const fn e8m0_half(e: u8) -> u16 {
    let p = e as i32 - 128;
    if p < -24 {
        0
    } else if p < -14 {
        // Subnormal: 2^p = 2^-24 * 2^(p + 24).
        1u16 << (p + 24)
    } else if p <= 15 {
        ((p + 15) as u16) << 10
    } else {
        0x7C00
    }
}

/// Whether every block scale of MXFP4 bytes fits f16 (see [`e8m0_half`]).
pub fn mxfp4_scales_fit(raw: &[u8]) -> bool {
    raw.chunks_exact(17).all(|b| b[0] <= 143)
}

impl Spec {
    /// The 16 values a `Bits::Lut` type's codes stand for.
    pub const fn lut(&self) -> &'static [i8; 16] {
        if self.ggml == 39 {
            &MXFP4_VALUES
        } else {
            &IQ4_VALUES
        }
    }
}

impl Spec {
    /// Bytes of codes per block of 32 values of one row... times 8 rows: a tile's block.
    pub const fn plane_bytes(&self) -> usize {
        match self.bits {
            Bits::Four | Bits::Lut => 128,
            Bits::Five => 160,
            Bits::Six => 192,
            Bits::Two => 64,
            Bits::Three => 96,
        }
    }

    /// Sub-scale bytes per block and row: 2 for halves, 1 with per-block sub-scales, else 0.
    pub const fn scales_per_block(&self) -> usize {
        if !self.sub {
            0
        } else if self.halves {
            2
        } else {
            1
        }
    }

    pub const fn has_dm(&self) -> bool {
        matches!(self.min, Min::Own | Min::Sub | Min::Packed)
    }

    /// How many AVX2 maddubs results may be added in 16-bit lanes before one madd widens
    /// them, exactly. One result is, per lane, two codes times two activation bytes (within
    /// +-127). Without a centre the codes' largest value bounds it: 8 of 4-bit codes fit
    /// (30,480), 4 of 5-bit, 2 of 6-bit, 1 of the IQ4 tables (signed, through the sign trick).
    /// With one ([`Spec::i16_centred`]) the 16-bit adds may wrap: what must fit is the final
    /// sum of (code - centre) times the activations, so 8 of Q5_0's and 4 of Q6_K's. At most a
    /// half block's 4 registers for the types with sub-scales per 16 values, whose halves'
    /// sums stay apart; else a block's 8.
    pub const fn i16_span(&self) -> usize {
        let max = match self.bits {
            Bits::Two => 3,
            Bits::Three => 7,
            Bits::Four => 15,
            Bits::Five => 31,
            Bits::Six => 63,
            Bits::Lut => 127,
        };
        let max = if self.i16_centred() {
            // |code - centre| (the centres are at least half the codes' range).
            self.centre
        } else {
            max
        };
        let fit = i16::MAX as usize / (2 * 127 * max as usize);
        let mut span = self.i16_group();
        while span > fit {
            span /= 2;
        }
        span
    }

    /// Registers whose sums stay together: a half block's 4 (sub-scales per 16 values) or a
    /// block's 8.
    pub const fn i16_group(&self) -> usize {
        if self.halves {
            4
        } else {
            8
        }
    }

    /// Whether the AVX2 kernel takes the centre off in 16-bit lanes, before widening: the
    /// types with a centre (Q4_0, Q5_0, Q3_K, Q6_K). Their 16-bit lanes then hold centred
    /// sums, exact mod 2^16 however the adds wrap and exact outright since the centred sum
    /// fits, so a half block's (or a block's) maddubs results all go into one madd. The
    /// activations' integer sums come split as the lanes take them ([`Acts::quantize`]).
    pub const fn i16_centred(&self) -> bool {
        self.centre != 0 && !matches!(self.bits, Bits::Lut)
    }

    /// Whether the 512-bit kernel keeps a row pair's unpacked blocks for a prefill's later
    /// chunks of tokens (`quants_zmm::tile2`'s `keep`): the types whose codes take the most
    /// work to unpack (two planes and their merge: Q3_K, Q6_K; the table lookups: IQ4_NL,
    /// IQ4_XS), and Q5_K (two planes, and two sub-scales and minimums a block to widen).
    /// Reading 12 registers a block back from L1 or L2 costs more than unpacking the plain
    /// nibbles of Q4_0 or Q4_K (30% slower at 512 tokens on Zen 5) and was no better for Q2_K,
    /// Q5_0 or Q5_1. Q5_K measured level with and without on Zen 5, and 7% faster with on Zen 4
    /// (`cargo bench --bench matmul`, 512 tokens, one thread, alternating); Q5_1 4% slower there.
    pub const fn keeps_unpacked(&self) -> bool {
        match self.bits {
            Bits::Six | Bits::Three | Bits::Lut => true,
            Bits::Five => matches!(self.act, Act::Q8K),
            _ => false,
        }
    }

    /// The types whose sums meet one activation scale per super-block and have no minimum
    /// terms (Q3_K, Q6_K, IQ4_XS): on VNNI their codes go in signed (code - centre, or the
    /// IQ4 table's value) against activations biased by 128 (unsigned), so no integer sum of
    /// the activations comes off per block and token; what the bias adds, 128 times the codes'
    /// sum, depends on the weights alone and comes off once per super-block (`corr`).
    pub const fn biased(&self) -> bool {
        matches!(self.act, Act::Q8K) && matches!(self.min, Min::None)
    }

    /// What a kernel's integer dot products must lose per unit of the activations' sum: the
    /// centre; on VNNI (`vnni`) plus 128 for the IQ4 tables (taken as unsigned bytes, biased by
    /// 128), or nothing for the `biased` types (signed codes). Const, so the kernels' branches
    /// on it fold away; [`centre_of`] gives the same for the activations' sums.
    pub const fn kernel_centre(&self, vnni: bool) -> i32 {
        if vnni && self.biased() {
            0
        } else if vnni && matches!(self.bits, Bits::Lut) {
            self.centre + 128
        } else {
            self.centre
        }
    }

    /// A super-block's header in a tile: the 8 rows' d, then their dm (f16 bits), or for the
    /// `biased` types their i32 `corr` (see [`super_corr`]).
    pub const fn hdr_bytes(&self) -> usize {
        if self.has_dm() {
            32
        } else if self.biased() {
            48
        } else {
            16
        }
    }

    /// A block of a tile: its planes, then the 8 rows' sub-scales (per half), then their
    /// sub-minimums.
    pub const fn blk_bytes(&self) -> usize {
        let spb = self.scales_per_block();
        self.plane_bytes() + 8 * spb * if matches!(self.min, Min::Sub) { 2 } else { 1 }
    }

    /// A super-block of a tile: header and blocks.
    pub const fn sb_bytes(&self) -> usize {
        self.hdr_bytes() + self.per_super * self.blk_bytes()
    }

    /// Where block b starts in its tile (its planes).
    #[inline(always)]
    pub const fn block_at(&self, b: usize) -> usize {
        (b / self.per_super) * self.sb_bytes()
            + self.hdr_bytes()
            + (b % self.per_super) * self.blk_bytes()
    }
}

/// One 32-value block of one row, decoded.
#[derive(Clone, Copy, Default)]
struct Canon {
    /// Codes: unsigned, below 2^bits (for the IQ4 types, table indexes).
    v: [u8; QK],
    /// Sub-scale bytes per half (both the same with per-block sub-scales): i8, or Q2_K's
    /// packed scale | min << 4.
    sc: [u8; 2],
    /// Sub-minimums per half (Min::Sub).
    mn: [u8; 2],
}

fn f16_bits(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Q4_K's and Q5_K's 6-bit scale and minimum of block j from the 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q3_K's 16 6-bit scales, minus 32.
fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    let (m1, m2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let aux = [
        (a0 & m2) | ((tmp & m1) << 4),
        (a1 & m2) | (((tmp >> 2) & m1) << 4),
        ((a0 >> 4) & m2) | (((tmp >> 4) & m1) << 4),
        ((a1 >> 4) & m2) | (((tmp >> 6) & m1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = ((aux[i / 4] >> (8 * (i % 4))) & 0xFF) as i8 - 32;
    }
    out
}

/// A super-block of `ty` (its GGUF bytes) into `per_super` canonical blocks; returns the f16
/// bits of d and of the minimum's scale (dmin, Q5_1's m; 0 where the type has none).
#[inline(always)]
fn decode(ty: QType, raw: &[u8], out: &mut [Canon]) -> (u16, u16) {
    let nib = |qs: &[u8], v: &mut [u8; QK]| {
        for j in 0..16 {
            v[j] = qs[j] & 0xF;
            v[j + 16] = qs[j] >> 4;
        }
    };
    match ty {
        QType::Q4_0 | QType::Iq4Nl => {
            nib(&raw[2..18], &mut out[0].v);
            (f16_bits(raw, 0), 0)
        }
        QType::Mxfp4 => {
            nib(&raw[1..17], &mut out[0].v);
            (e8m0_half(raw[0]), 0)
        }
        QType::Q5_0 | QType::Q5_1 => {
            let (h, at) = if ty == QType::Q5_0 { (2, 6) } else { (4, 8) };
            let qh = u32::from_le_bytes([raw[h], raw[h + 1], raw[h + 2], raw[h + 3]]);
            nib(&raw[at..at + 16], &mut out[0].v);
            for (j, v) in out[0].v.iter_mut().enumerate() {
                *v |= (((qh >> j) & 1) << 4) as u8;
            }
            let m = if ty == QType::Q5_1 {
                f16_bits(raw, 2)
            } else {
                0
            };
            (f16_bits(raw, 0), m)
        }
        QType::Q2K => {
            let (scales, qs) = (&raw[0..16], &raw[16..80]);
            for (j, c) in out.iter_mut().enumerate() {
                let (n, shift) = (j / 4, 2 * (j % 4));
                for l in 0..QK {
                    c.v[l] = (qs[n * 32 + l] >> shift) & 3;
                }
                c.sc = [scales[2 * j], scales[2 * j + 1]];
            }
            (f16_bits(raw, 80), f16_bits(raw, 82))
        }
        QType::Q3K => {
            let (hm, qs) = (&raw[0..32], &raw[32..96]);
            let sc = q3k_scales(&raw[96..108]);
            for (j, c) in out.iter_mut().enumerate() {
                let (n, shift) = (j / 4, 2 * (j % 4));
                for l in 0..QK {
                    c.v[l] = ((qs[n * 32 + l] >> shift) & 3) | (((hm[l] >> j) & 1) << 2);
                }
                c.sc = [sc[2 * j] as u8, sc[2 * j + 1] as u8];
            }
            (f16_bits(raw, 108), 0)
        }
        QType::Q4K | QType::Q5K => {
            let scales = &raw[4..16];
            let (qh, qs) = if ty == QType::Q5K {
                (&raw[16..48], &raw[48..176])
            } else {
                (&raw[0..0], &raw[16..144])
            };
            for (j, c) in out.iter_mut().enumerate() {
                let (p, shift) = (j / 2, 4 * (j % 2));
                for l in 0..QK {
                    c.v[l] = (qs[p * 32 + l] >> shift) & 0xF;
                    if ty == QType::Q5K {
                        c.v[l] |= ((qh[l] >> j) & 1) << 4;
                    }
                }
                let (s, m) = scale_min_k4(j, scales);
                c.sc = [s, s];
                c.mn = [m, m];
            }
            (f16_bits(raw, 0), f16_bits(raw, 2))
        }
        QType::Q6K => {
            let (ql, qh, scales) = (&raw[0..128], &raw[128..192], &raw[192..208]);
            for (j, c) in out.iter_mut().enumerate() {
                let (n, p) = (j / 4, j % 4);
                for l in 0..QK {
                    let lo = (ql[n * 64 + l + 32 * (p % 2)] >> (4 * (p / 2))) & 0xF;
                    let hi = (qh[n * 32 + l] >> (2 * p)) & 3;
                    c.v[l] = lo | (hi << 4);
                }
                c.sc = [scales[n * 8 + 2 * p], scales[n * 8 + 2 * p + 1]];
            }
            (f16_bits(raw, 208), 0)
        }
        QType::Iq4Xs => {
            let sh = u16::from_le_bytes([raw[2], raw[3]]);
            let (sl, qs) = (&raw[4..8], &raw[8..136]);
            for (j, c) in out.iter_mut().enumerate() {
                nib(&qs[j * 16..j * 16 + 16], &mut c.v);
                let ls =
                    ((sl[j / 2] >> (4 * (j % 2))) & 0xF) | ((((sh >> (2 * j)) & 3) as u8) << 4);
                let s = (ls as i8 - 32) as u8;
                c.sc = [s, s];
            }
            (f16_bits(raw, 0), 0)
        }
    }
}

/// Weight rows of one type in groups of 8 (see the module doc), each group one run of bytes
/// read front to back: per super-block a header (the 8 rows' d and dm as f16 bits), then per
/// block its code planes (`plane_bytes`), the 8 rows' sub-scale bytes (per half) and their
/// sub-minimums. One stream per group, so the hardware prefetchers (and ours) follow one
/// sequence of addresses in a decode step, which reads every weight once from memory.
pub struct Tiles {
    pub ty: QType,
    buf: Buf<u8>,
    pub groups: usize,
    /// Blocks of 32 in a row.
    pub nb: usize,
    group_bytes: usize,
}

/// One group of 8 rows, borrowed.
#[derive(Clone, Copy)]
pub struct Tile<'a> {
    pub buf: &'a [u8],
}

impl Tile<'_> {
    fn u16_at(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.buf[at], self.buf[at + 1]])
    }
}

impl Tiles {
    /// `rows` rows of `cols` values in GGUF blocks of `ty` (rows past the last multiple of 8
    /// padded with zeros). The caller checked the sizes. Row groups are repacked in parallel.
    pub fn from_gguf(ty: QType, raw: &[u8], rows: usize, cols: usize) -> Self {
        use rayon::prelude::*;
        let spec = ty.spec();
        let nb = cols / QK;
        let nsb = nb / spec.per_super;
        let groups = rows.div_ceil(8);
        let group_bytes = nsb * spec.sb_bytes();
        let mut buf = super::buf::zeroed::<u8>(groups * group_bytes);
        // One copy of the repacking per type, every branch on the type folded away.
        let group: fn(&[u8], usize, usize, &mut [u8]) = match ty {
            QType::Q4_0 => repack_group::<0>,
            QType::Q5_0 => repack_group::<1>,
            QType::Q5_1 => repack_group::<2>,
            QType::Q2K => repack_group::<3>,
            QType::Q3K => repack_group::<4>,
            QType::Q4K => repack_group::<5>,
            QType::Q5K => repack_group::<6>,
            QType::Q6K => repack_group::<7>,
            QType::Iq4Nl => repack_group::<8>,
            QType::Iq4Xs => repack_group::<9>,
            QType::Mxfp4 => repack_group::<10>,
        };
        let row_bytes = nsb * spec.block_bytes;
        buf.par_chunks_mut(group_bytes)
            .enumerate()
            .for_each(|(g, out)| {
                let real = 8.min(rows - g * 8);
                group(
                    &raw[g * 8 * row_bytes..(g * 8 + real) * row_bytes],
                    real,
                    nsb,
                    out,
                )
            });
        Tiles {
            ty,
            buf: buf.into(),
            groups,
            nb,
            group_bytes,
        }
    }

    pub fn tile(&self, g: usize) -> Tile<'_> {
        Tile {
            buf: &self.buf[g * self.group_bytes..(g + 1) * self.group_bytes],
        }
    }

    /// The tiles' one buffer (what the tile cache keeps).
    pub fn buffer(&self) -> &Buf<u8> {
        &self.buf
    }

    /// Tiles of `groups` groups of 8 rows of `cols` values of `ty` held in `buf` (as
    /// [`Self::buffer`] gave them), `group_bytes` a group; None where the sizes disagree.
    pub fn from_buffer(
        ty: QType,
        buf: Buf<u8>,
        groups: usize,
        cols: usize,
        group_bytes: usize,
    ) -> Option<Self> {
        let spec = ty.spec();
        let nb = cols / QK;
        let fits = cols.is_multiple_of(QK * spec.per_super)
            && group_bytes == nb / spec.per_super * spec.sb_bytes()
            && buf.len() == groups * group_bytes;
        fits.then_some(Tiles {
            ty,
            buf,
            groups,
            nb,
            group_bytes,
        })
    }

    /// Groups of `other` after ours (both whole groups of 8 real rows, one type and width).
    pub fn append(&mut self, other: Tiles) {
        self.buf.append(&other.buf);
        self.groups += other.groups;
    }

    /// Bytes held: what the tiles cost in memory (and a decode step reads).
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    /// Row `row`'s values, widened (tests, and embedding lookups of these types): that row's
    /// codes and scales only, not its tile's other seven.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let t = self.tile(row / 8);
        let r = row % 8;
        let spec = self.ty.spec();
        let mut v = [0i32; QK];
        for b in 0..self.nb {
            unpack_row(spec, &t, b, r, &mut v);
            let (scale, min) = row_scales(spec, &t, b, r);
            for (l, o) in out[b * QK..(b + 1) * QK].iter_mut().enumerate() {
                let h = if spec.halves { l / 16 } else { 0 };
                *o = scale[h] * (v[l] - spec.centre) as f32 + min[h];
            }
        }
    }
}

/// One group of rows (`real` of them, 8 but for the last group; `src`: their GGUF bytes, row
/// after row, `nsb` super-blocks each) into its tile `out`, for type number `TY`.
fn repack_group<const TY: u8>(src: &[u8], real: usize, nsb: usize, out: &mut [u8]) {
    let spec = spec_of(TY);
    let ty = QType::ALL[TY as usize];
    let mut canon = [Canon::default(); 8];
    let canon = &mut canon[..spec.per_super];
    let row_bytes = nsb * spec.block_bytes;
    for r in 0..real {
        let row = &src[r * row_bytes..(r + 1) * row_bytes];
        for s in 0..nsb {
            let sb = &row[s * spec.block_bytes..(s + 1) * spec.block_bytes];
            let (d, dm) = decode(ty, sb, canon);
            let h = s * spec.sb_bytes();
            out[h + 2 * r..h + 2 * r + 2].copy_from_slice(&d.to_le_bytes());
            if spec.has_dm() {
                out[h + 16 + 2 * r..h + 18 + 2 * r].copy_from_slice(&dm.to_le_bytes());
            }
            if spec.biased() {
                let corr = super_corr(spec, canon).to_le_bytes();
                out[h + 16 + 4 * r..h + 20 + 4 * r].copy_from_slice(&corr);
            }
            for (i, c) in canon.iter().enumerate() {
                put(spec, out, s * spec.per_super + i, r, c);
            }
        }
    }
}

/// What biasing the activations by 128 adds to one row's integer sums over a super-block of a
/// `biased` type: 128 * (sum over its blocks (or halves) of sub-scale * sum of the signed
/// codes), an i32 (kept modulo 2^32: the kernels' sums wrap alike, so the difference is
/// exact). Every VNNI kernel subtracts it from the super-block's sub-scaled integer sum before
/// any float operation, so that sum is the one AVX2's kernel makes without a bias, bit for bit.
#[inline(always)]
fn super_corr(spec: Spec, canon: &[Canon]) -> i32 {
    let parts = if spec.halves { 2 } else { 1 };
    let per = QK / parts;
    let mut c: i64 = 0;
    for blk in canon {
        for (h, codes) in blk.v.chunks_exact(per).enumerate() {
            let w: i64 = codes
                .iter()
                .map(|&v| match spec.bits {
                    Bits::Lut => spec.lut()[v as usize] as i64,
                    _ => v as i64 - spec.centre as i64,
                })
                .sum();
            c += blk.sc[h] as i8 as i64 * w;
        }
    }
    (128 * c) as i32
}

/// Block b of row r of a group (`out`: the group's bytes) into its planes and scale bytes.
#[inline(always)]
fn put(spec: Spec, out: &mut [u8], b: usize, r: usize, c: &Canon) {
    let at = spec.block_at(b);
    let pb = spec.plane_bytes();
    let q = &mut out[at..at + pb];
    let v = &c.v;
    for j in 0..4 {
        let lane = r * 4 + j;
        match spec.bits {
            Bits::Four | Bits::Five | Bits::Six | Bits::Lut => {
                for cc in 0..4 {
                    q[cc * 32 + lane] = (v[4 * cc + j] & 0xF) | ((v[16 + 4 * cc + j] & 0xF) << 4);
                }
            }
            Bits::Two | Bits::Three => {
                for cc in 0..8 {
                    q[(cc / 4) * 32 + lane] |= (v[4 * cc + j] & 3) << (2 * (cc % 4));
                }
            }
        }
        match spec.bits {
            Bits::Five => {
                for cc in 0..8 {
                    q[128 + lane] |= ((v[4 * cc + j] >> 4) & 1) << cc;
                }
            }
            Bits::Three => {
                for cc in 0..8 {
                    q[64 + lane] |= ((v[4 * cc + j] >> 2) & 1) << cc;
                }
            }
            Bits::Six => {
                for cc in 0..8 {
                    q[128 + (cc / 4) * 32 + lane] |= ((v[4 * cc + j] >> 4) & 3) << (2 * (cc % 4));
                }
            }
            _ => {}
        }
    }
    let spb = spec.scales_per_block();
    for h in 0..spb {
        out[at + pb + h * 8 + r] = c.sc[h];
        if spec.min == Min::Sub {
            out[at + pb + 8 * spb + h * 8 + r] = c.mn[h];
        }
    }
}

/// Codes of block b of a tile as signed integers (IQ4: the table's values), [row][value].
pub fn unpack_scalar(spec: Spec, t: &Tile<'_>, b: usize, v: &mut [[i32; QK]; 8]) {
    for (r, row) in v.iter_mut().enumerate() {
        unpack_row(spec, t, b, r, row);
    }
}

/// Row r's codes of block b of a tile, as [`unpack_scalar`] gives them.
fn unpack_row(spec: Spec, t: &Tile<'_>, b: usize, r: usize, row: &mut [i32; QK]) {
    let at = spec.block_at(b);
    let q = &t.buf[at..at + spec.plane_bytes()];
    for (i, out) in row.iter_mut().enumerate() {
        let (c, j) = (i / 4, i % 4);
        let lane = r * 4 + j;
        let code = match spec.bits {
            Bits::Four | Bits::Five | Bits::Six | Bits::Lut => {
                let byte = q[(c % 4) * 32 + lane];
                if c < 4 {
                    byte & 0xF
                } else {
                    byte >> 4
                }
            }
            Bits::Two | Bits::Three => (q[(c / 4) * 32 + lane] >> (2 * (c % 4))) & 3,
        };
        let high = match spec.bits {
            Bits::Five => ((q[128 + lane] >> c) & 1) << 4,
            Bits::Three => ((q[64 + lane] >> c) & 1) << 2,
            Bits::Six => ((q[128 + (c / 4) * 32 + lane] >> (2 * (c % 4))) & 3) << 4,
            _ => 0,
        };
        *out = if spec.bits == Bits::Lut {
            spec.lut()[code as usize] as i32
        } else {
            (code | high) as i32
        };
    }
}

/// Block b's scale and minimum per half (index 0 only without halves) and row, in f32: the
/// values every kernel multiplies by.
pub fn block_scales(spec: Spec, t: &Tile<'_>, b: usize) -> ([[f32; 8]; 2], [[f32; 8]; 2]) {
    let mut scale = [[0f32; 8]; 2];
    let mut min = [[0f32; 8]; 2];
    for r in 0..8 {
        let (s, m) = row_scales(spec, t, b, r);
        for h in 0..2 {
            (scale[h][r], min[h][r]) = (s[h], m[h]);
        }
    }
    (scale, min)
}

/// Row r's scale and minimum of block b per half, as [`block_scales`] gives them.
fn row_scales(spec: Spec, t: &Tile<'_>, b: usize, r: usize) -> ([f32; 2], [f32; 2]) {
    let hdr = (b / spec.per_super) * spec.sb_bytes();
    let at = spec.block_at(b) + spec.plane_bytes();
    let spb = spec.scales_per_block();
    let d = f16::from_bits(t.u16_at(hdr + 2 * r)).to_f32();
    let dm = if spec.has_dm() {
        f16::from_bits(t.u16_at(hdr + 16 + 2 * r)).to_f32()
    } else {
        0.0
    };
    let (mut scale, mut min) = ([0f32; 2], [0f32; 2]);
    for h in 0..2 {
        let i = at + h.min(spb.saturating_sub(1)) * 8 + r;
        let sc = match spec.min {
            _ if spb == 0 => 1.0,
            Min::Packed => (t.buf[i] & 0xF) as f32,
            _ => t.buf[i] as i8 as f32,
        };
        scale[h] = d * sc;
        min[h] = match spec.min {
            Min::None => 0.0,
            Min::Own => dm,
            Min::Sub => -(dm * t.buf[i + 8 * spb] as f32),
            Min::Packed => -(dm * (t.buf[i] >> 4) as f32),
        };
    }
    (scale, min)
}

/// What a kernel's integer dot products of `ty`'s codes with activation bytes must lose per
/// unit of the activations' sum: the type's centre, plus 128 for the IQ4 tables on VNNI (which
/// takes them as unsigned bytes, biased by 128); none for the `biased` types on VNNI (signed
/// codes). [`Acts`] holds the sums times this.
pub fn centre_of(ty: QType, kernel: Kernel) -> i32 {
    ty.spec().kernel_centre(is_vnni(kernel))
}

/// Whether `kernel` takes `ty`'s centre off in 16-bit lanes ([`Spec::i16_centred`], AVX2).
pub fn packs_centre(ty: QType, kernel: Kernel) -> bool {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx2 {
        return ty.spec().i16_centred();
    }
    let _ = (ty, kernel);
    false
}

/// A block's activation quants summed as an AVX2 maddubs lane pairs them, times `centre`:
/// per 32-bit lane, the low 16 bits take positions 4j and 4j + 1, the high ones 4j + 2 and
/// 4j + 3. For each half, then the whole block: `centre * low` in the low 16 bits and
/// `centre * high` in the high ones (wrapped to 16 bits: the kernel subtracts them with
/// wrapping 16-bit arithmetic).
pub fn packed_sums(q: &[u8], centre: i32) -> [i32; 3] {
    let part = |from: usize, to: usize, high: usize| -> i32 {
        (from..to)
            .filter(|p| (p % 4) / 2 == high)
            .map(|p| q[p] as i8 as i32)
            .sum()
    };
    let pack = |from, to| {
        let lo = (centre * part(from, to, 0)) as u16 as u32;
        let hi = (centre * part(from, to, 1)) as u16 as u32;
        (lo | hi << 16) as i32
    };
    [pack(0, 16), pack(16, 32), pack(0, 32)]
}

/// Whether the kernel takes `ty`'s activations biased by 128 ([`Spec::biased`], on VNNI).
pub fn biased(ty: QType, kernel: Kernel) -> bool {
    is_vnni(kernel) && ty.spec().biased()
}

fn is_vnni(kernel: Kernel) -> bool {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Vnni {
        return true;
    }
    let _ = kernel;
    false
}

/// Activations quantized for these kernels: tokens in chunks of 8 and, within a chunk, per
/// block, the 8 tokens' 32 quants side by side (256 bytes); per token and block its scale, its
/// integer sums (first half, second half, whole) and those sums times the scale (for Q8_1 the
/// whole one is llama.cpp's `f16(d * sum)`). Padding tokens are zero.
pub struct Acts {
    pub qs: Vec<u8>,
    pub d: Vec<f32>,
    /// 4 per slot: the sums of the halves and of the whole block, times the kernel's centre
    /// (what its integer dot products must lose: see [`centre_of`]), or on AVX2 for the
    /// [`Spec::i16_centred`] types the same split by lane halves ([`packed_sums`]); unused.
    pub isum: Vec<i32>,
    pub asum: Vec<f32>,
    pub nb: usize,
    pub chunks: usize,
}

/// Where one token's run of a chunk starts: block b of token i of the call is at
/// qs + b * 256 + i * 32, d + b * 8 + i, isum/asum + (b * 8 + i) * 4.
#[derive(Clone, Copy)]
pub struct ActChunk {
    pub qs: *const u8,
    pub d: *const f32,
    pub isum: *const i32,
    pub asum: *const f32,
}

impl Acts {
    /// T rows of K values for `kernel`'s product with weights of type `ty`: quantized as the
    /// type's scheme says; integer sums times the kernel's centre ([`centre_of`]), or on AVX2
    /// for the [`Spec::i16_centred`] types split as its 16-bit lanes take them ([`packed_sums`]);
    /// biased by 128 where [`biased`] says so.
    pub fn quantize(x: &[f32], k: usize, t: usize, ty: QType, kernel: Kernel) -> Self {
        let act = ty.spec().act;
        let centre = centre_of(ty, kernel);
        let bias = biased(ty, kernel);
        let packed = packs_centre(ty, kernel);
        let nb = k / QK;
        let chunks = t.div_ceil(TOKENS);
        let slots = chunks * nb * TOKENS;
        let mut a = Acts {
            qs: vec![0; slots * QK],
            d: vec![0.0; slots],
            isum: vec![0; slots * 4],
            asum: vec![0.0; slots * 4],
            nb,
            chunks,
        };
        let per = nb * TOKENS;
        let fill = |c: usize, qs: &mut [u8], d: &mut [f32], isum: &mut [i32], asum: &mut [f32]| {
            for (i, row) in x
                .chunks_exact(k)
                .skip(c * TOKENS)
                .take(TOKENS.min(t - c * TOKENS))
                .enumerate()
            {
                quantize_token(row, act, kernel, |b, q, scale, sums, f| {
                    let at = b * TOKENS + i;
                    let out = &mut qs[at * QK..at * QK + QK];
                    out.copy_from_slice(q);
                    if bias {
                        out.iter_mut().for_each(|v| *v ^= 0x80);
                    }
                    d[at] = scale;
                    let isum = &mut isum[at * 4..at * 4 + 3];
                    if packed {
                        isum.copy_from_slice(&packed_sums(q, centre));
                    } else {
                        for (o, s) in isum.iter_mut().zip(sums) {
                            *o = centre * s;
                        }
                    }
                    asum[at * 4..at * 4 + 3].copy_from_slice(&f);
                });
            }
        };
        let work: Vec<_> =
            a.qs.chunks_mut(per * QK)
                .zip(a.d.chunks_mut(per))
                .zip(a.isum.chunks_mut(per * 4).zip(a.asum.chunks_mut(per * 4)))
                .enumerate()
                .collect();
        let run = |(c, ((qs, d), (isum, asum))): (usize, _)| fill(c, qs, d, isum, asum);
        if t >= 64 {
            use rayon::prelude::*;
            work.into_par_iter().for_each(run);
        } else {
            work.into_iter().for_each(run);
        }
        a
    }

    pub fn chunk(&self, token: usize) -> ActChunk {
        let (c, i) = (token / TOKENS, token % TOKENS);
        let at = c * self.nb * TOKENS + i;
        ActChunk {
            qs: self.qs.as_ptr().wrapping_add(at * QK),
            d: self.d.as_ptr().wrapping_add(at),
            isum: self.isum.as_ptr().wrapping_add(at * 4),
            asum: self.asum.as_ptr().wrapping_add(at * 4),
        }
    }
}

/// One Q8_K super-block (256 values) as llama.cpp quantizes it: the first value of largest
/// magnitude sets the scale `-127 / max`, each product rounds half to even, capped at 127.
/// Writes the 256 bytes to q; returns `1 / scale` and each 32-value block's sums of its two
/// halves. (`q8::x86_quantize_q8k` is the same with AVX2, bit for bit.)
fn quantize_q8k(sb: &[f32], q: &mut [u8]) -> (f32, [[i32; 2]; 8]) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in sb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    let (iscale, d) = if amax == 0.0 {
        (0.0, 0.0)
    } else {
        let is = -127.0 / max;
        (is, 1.0 / is)
    };
    let mut sums = [[0i32; 2]; 8];
    for ((blk, out), sum) in sb
        .chunks_exact(QK)
        .zip(q.chunks_exact_mut(QK))
        .zip(&mut sums)
    {
        for (o, &v) in out.iter_mut().zip(blk) {
            *o = (round_half_even(iscale * v) as i32).min(127) as i8 as u8;
        }
        let half = |h: &[u8]| h.iter().map(|&v| v as i8 as i32).sum::<i32>();
        *sum = [half(&out[..16]), half(&out[16..])];
    }
    (d, sums)
}

/// One token's row into blocks: `put(block, quants, scale, [sum lo, sum hi, sum], [their
/// products with the scale])`.
fn quantize_token(
    row: &[f32],
    act: Act,
    kernel: Kernel,
    mut put: impl FnMut(usize, &[u8], f32, [i32; 3], [f32; 3]),
) {
    let mut q = [0u8; QK];
    let halves = |q: &[u8]| {
        let lo: i32 = q[..16].iter().map(|&v| v as i8 as i32).sum();
        let hi: i32 = q[16..].iter().map(|&v| v as i8 as i32).sum();
        [lo, hi]
    };
    match act {
        Act::Q8_0 | Act::Q8_1 => {
            for (b, blk) in row.chunks_exact(QK).enumerate() {
                let (d, [lo, hi]) = match kernel {
                    // SAFETY: a SIMD kernel is only chosen on CPUs with AVX2.
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx2 | Kernel::Vnni => unsafe {
                        super::q8::x86_quantize_block_halves(blk, &mut q)
                    },
                    _ => {
                        let (d, _) = quantize_block(blk, &mut q);
                        (d, halves(&q))
                    }
                };
                let sum = lo + hi;
                let df = through_f16(d);
                let whole = if act == Act::Q8_1 {
                    through_f16(d * sum as f32)
                } else {
                    df * sum as f32
                };
                put(
                    b,
                    &q,
                    df,
                    [lo, hi, sum],
                    [df * lo as f32, df * hi as f32, whole],
                );
            }
        }
        Act::Q8K => {
            let mut q = [0u8; 8 * QK];
            for (s, sb) in row.chunks_exact(8 * QK).enumerate() {
                let (d, sums) = match kernel {
                    // SAFETY: a SIMD kernel is only chosen on CPUs with AVX2.
                    #[cfg(target_arch = "x86_64")]
                    Kernel::Avx2 | Kernel::Vnni => unsafe {
                        super::q8::x86_quantize_q8k(sb, &mut q)
                    },
                    _ => quantize_q8k(sb, &mut q),
                };
                for (i, [lo, hi]) in sums.into_iter().enumerate() {
                    let sum = lo + hi;
                    put(
                        s * 8 + i,
                        &q[i * QK..(i + 1) * QK],
                        d,
                        [lo, hi, sum],
                        [d * lo as f32, d * hi as f32, d * sum as f32],
                    );
                }
            }
        }
    }
}

/// The portable kernel: N tokens (from `a`) against one tile of 8 rows, written to
/// out + i * stride (the first `real` rows). The SIMD kernels compute the same integer sums and
/// apply the scales in the same order.
///
/// # Safety
/// `a` holds n tokens of the tile's block count; `out` is valid for those writes.
pub unsafe fn scalar_tile(
    spec: Spec,
    w: Tile<'_>,
    a: ActChunk,
    n: usize,
    out: *mut f32,
    stride: usize,
    real: usize,
) {
    let nb = w.buf.len() / spec.sb_bytes() * spec.per_super;
    let mut acc = [[0f32; 8]; TOKENS];
    // Q8_K: the blocks' scaled sums of a super-block, before its one activation scale.
    let per_sb = spec.act == Act::Q8K;
    let mut facc = [[0f32; 8]; TOKENS];
    let mut v = [[0i32; QK]; 8];
    for b in 0..nb {
        unpack_scalar(spec, &w, b, &mut v);
        let (scale, min) = block_scales(spec, &w, b);
        for (i, (acc, facc)) in acc.iter_mut().zip(facc.iter_mut()).enumerate().take(n) {
            let slot = b * TOKENS + i;
            let q = std::slice::from_raw_parts(a.qs.add(slot * QK), QK);
            let da = *a.d.add(slot);
            let isum = std::slice::from_raw_parts(a.isum.add(slot * 4), 3);
            let asum = std::slice::from_raw_parts(a.asum.add(slot * 4), 3);
            for (r, (acc, facc)) in acc.iter_mut().zip(facc.iter_mut()).enumerate() {
                let dot = |l0: usize, l1: usize| -> i32 {
                    (l0..l1).map(|l| v[r][l] * q[l] as i8 as i32).sum()
                };
                if spec.halves {
                    let lo = dot(0, 16) - isum[0];
                    let hi = dot(16, 32) - isum[1];
                    if per_sb {
                        *facc = (lo as f32).mul_add(scale[0][r], *facc);
                        *facc = (hi as f32).mul_add(scale[1][r], *facc);
                    } else {
                        let f = (hi as f32).mul_add(scale[1][r], lo as f32 * scale[0][r]);
                        *acc = f.mul_add(da, *acc);
                    }
                    if spec.min != Min::None {
                        *acc = min[0][r].mul_add(asum[0], *acc);
                        *acc = min[1][r].mul_add(asum[1], *acc);
                    }
                } else {
                    let s = dot(0, 32) - isum[2];
                    if per_sb {
                        *facc = (s as f32).mul_add(scale[0][r], *facc);
                    } else {
                        *acc = (s as f32).mul_add(scale[0][r] * da, *acc);
                    }
                    if spec.min != Min::None {
                        *acc = min[0][r].mul_add(asum[2], *acc);
                    }
                }
                if per_sb && b % spec.per_super == spec.per_super - 1 {
                    *acc = facc.mul_add(da, *acc);
                    *facc = 0.0;
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate().take(n) {
        std::ptr::copy_nonoverlapping(acc.as_ptr(), out.add(i * stride), real);
    }
}

#[doc(hidden)]
/// (Tests and benchmarks.) Random but valid GGUF blocks of `ty` for `rows` x `cols`: every byte random, the f16
/// scales replaced by finite ones of a realistic size.
pub fn random_blocks(ty: QType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let spec = ty.spec();
    let n = rows * cols / (spec.per_super * QK);
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut raw: Vec<u8> = (0..n * spec.block_bytes).map(|_| next() as u8).collect();
    let scale_at: &[usize] = match ty {
        QType::Q4_0 | QType::Q5_0 | QType::Iq4Nl | QType::Iq4Xs => &[0],
        QType::Q5_1 | QType::Q4K | QType::Q5K => &[0, 2],
        QType::Q2K => &[80, 82],
        QType::Q3K => &[108],
        QType::Q6K => &[208],
        // A byte scale: 2^(e - 128) of a realistic size (2^-10 to 2^-5).
        QType::Mxfp4 => &[],
    };
    if ty == QType::Mxfp4 {
        for blk in raw.chunks_exact_mut(spec.block_bytes) {
            blk[0] = 118 + (next() % 6) as u8;
        }
    }
    for blk in raw.chunks_exact_mut(spec.block_bytes) {
        for &at in scale_at {
            let v = ((next() % 1000) as f32 / 1000.0 + 0.05) * 0.02;
            let v = if ty == QType::Q5_1 && at == 2 {
                -v * 8.0
            } else {
                v
            };
            blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
        }
    }
    raw
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The SIMD Q8_K quantizer gives the scalar one's bytes, scales and sums exactly: random
    /// rows, a zero super-block, ties (products k + 0.5), a maximum whose negative comes later
    /// (the first one sets the sign), values that land on +127.
    #[test]
    fn simd_q8k_quantization_equals_scalar() {
        let simd: Vec<Kernel> = crate::model::cpu::q8::test_kernels()
            .into_iter()
            .filter(|k| *k != Kernel::Scalar)
            .collect();
        let mut rows: Vec<Vec<f32>> = (0..40)
            .map(|i| crate::model::cpu::matmul::test_data(512, 900 + i))
            .collect();
        let mut special = vec![0f32; 256];
        special.extend((0..256).map(|i| {
            if i == 7 {
                -127.0
            } else {
                (i % 64) as f32 - 31.5
            }
        }));
        rows.push(special);
        rows.push(
            (0..512)
                .map(|i| {
                    if i % 256 == 9 {
                        2.0
                    } else if i % 256 == 200 {
                        -2.0
                    } else {
                        0.01 * i as f32
                    }
                })
                .collect(),
        );
        rows.push(
            (0..512)
                .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
                .collect(),
        );
        type Put = (usize, Vec<u8>, u32, [i32; 3], [u32; 3]);
        let run = |row: &[f32], kernel: Kernel| {
            let mut got: Vec<Put> = Vec::new();
            quantize_token(row, Act::Q8K, kernel, |b, q, d, sums, scaled| {
                got.push((b, q.to_vec(), d.to_bits(), sums, scaled.map(f32::to_bits)));
            });
            got
        };
        for (r, row) in rows.iter().enumerate() {
            let want = run(row, Kernel::Scalar);
            assert_eq!(want.len(), 16);
            for &k in &simd {
                assert_eq!(run(row, k), want, "row {r}, {k:?}");
            }
        }
    }

    /// Straight from ggml's `dequantize_row_*`, one super-block of GGUF bytes to its values:
    /// written apart from [`decode`] and the tiles, so the kernels are checked against the
    /// format itself (and, for the types candle reads, this against candle).
    pub(crate) fn reference_dequant(ty: QType, raw: &[u8]) -> Vec<f32> {
        let h = |at: usize| f16::from_bits(u16::from_le_bytes([raw[at], raw[at + 1]])).to_f32();
        let mut y = Vec::new();
        match ty {
            QType::Q4_0 | QType::Iq4Nl => {
                let d = h(0);
                let map = |c: u8| {
                    if ty == QType::Q4_0 {
                        c as f32 - 8.0
                    } else {
                        IQ4_VALUES[c as usize] as f32
                    }
                };
                y.extend((0..16).map(|j| d * map(raw[2 + j] & 0xF)));
                y.extend((0..16).map(|j| d * map(raw[2 + j] >> 4)));
            }
            QType::Mxfp4 => {
                // ggml: d = 2^(e - 127) / 2, values from its doubled E2M1 table.
                let d = 2f32.powi(raw[0] as i32 - 128);
                let map = |c: u8| MXFP4_VALUES[c as usize] as f32;
                y.extend((0..16).map(|j| d * map(raw[1 + j] & 0xF)));
                y.extend((0..16).map(|j| d * map(raw[1 + j] >> 4)));
            }
            QType::Q5_0 | QType::Q5_1 => {
                let one = ty == QType::Q5_1;
                let (d, m) = (h(0), if one { h(2) } else { 0.0 });
                let o = if one { 4 } else { 2 };
                let qh = u32::from_le_bytes([raw[o], raw[o + 1], raw[o + 2], raw[o + 3]]);
                let qs = &raw[o + 4..o + 20];
                let centre = if one { 0 } else { 16 };
                let mut hi = vec![0f32; 16];
                for j in 0..16 {
                    let x0 = ((qs[j] & 0xF) as u32 | (((qh >> j) << 4) & 0x10)) as i32 - centre;
                    let x1 = ((qs[j] >> 4) as u32 | ((qh >> (j + 12)) & 0x10)) as i32 - centre;
                    y.push(x0 as f32 * d + m);
                    hi[j] = x1 as f32 * d + m;
                }
                y.extend(hi);
            }
            QType::Q2K => {
                let (d, min) = (h(80), h(82));
                let mut is = 0;
                for n in 0..2 {
                    let q = &raw[16 + n * 32..16 + n * 32 + 32];
                    for shift in [0, 2, 4, 6] {
                        for half in 0..2 {
                            let sc = raw[is];
                            is += 1;
                            let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                            for l in 0..16 {
                                y.push(dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml);
                            }
                        }
                    }
                }
            }
            QType::Q3K => {
                let d = h(108);
                let sc = q3k_scales(&raw[96..108]);
                let (hm, qs) = (&raw[0..32], &raw[32..96]);
                let (mut is, mut m) = (0, 1u8);
                for n in 0..2 {
                    let q = &qs[n * 32..n * 32 + 32];
                    for shift in [0, 2, 4, 6] {
                        for half in 0..2 {
                            let dl = d * sc[is] as f32;
                            is += 1;
                            for l in 0..16 {
                                let i = l + 16 * half;
                                let v = ((q[i] >> shift) & 3) as i32
                                    - if hm[i] & m != 0 { 0 } else { 4 };
                                y.push(dl * v as f32);
                            }
                        }
                        m <<= 1;
                    }
                }
            }
            QType::Q4K | QType::Q5K => {
                let five = ty == QType::Q5K;
                let (d, min) = (h(0), h(2));
                let scales = &raw[4..16];
                let qs = if five { &raw[48..176] } else { &raw[16..144] };
                for p in 0..4 {
                    for half in 0..2 {
                        let (sc, m) = scale_min_k4(2 * p + half, scales);
                        for l in 0..32 {
                            let mut v = (qs[p * 32 + l] >> (4 * half)) & 0xF;
                            if five && raw[16 + l] & (1 << (2 * p + half)) != 0 {
                                v += 16;
                            }
                            y.push(d * sc as f32 * v as f32 - min * m as f32);
                        }
                    }
                }
            }
            QType::Q6K => {
                let d = h(208);
                let mut out = vec![0f32; 256];
                for n in 0..2 {
                    let (ql, qh) = (&raw[n * 64..], &raw[128 + n * 32..]);
                    let sc = |i: usize| raw[192 + n * 8 + i] as i8 as f32;
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        out[n * 128 + l] = d * sc(is) * q1 as f32;
                        out[n * 128 + l + 32] = d * sc(is + 2) * q2 as f32;
                        out[n * 128 + l + 64] = d * sc(is + 4) * q3 as f32;
                        out[n * 128 + l + 96] = d * sc(is + 6) * q4 as f32;
                    }
                }
                y = out;
            }
            QType::Iq4Xs => {
                let d = h(0);
                let sh = u16::from_le_bytes([raw[2], raw[3]]);
                for ib in 0..8 {
                    let ls = ((raw[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) as i32
                        | ((((sh >> (2 * ib)) & 3) as i32) << 4);
                    let dl = d * (ls - 32) as f32;
                    let qs = &raw[8 + ib * 16..8 + ib * 16 + 16];
                    y.extend((0..16).map(|j| dl * IQ4_VALUES[(qs[j] & 0xF) as usize] as f32));
                    y.extend((0..16).map(|j| dl * IQ4_VALUES[(qs[j] >> 4) as usize] as f32));
                }
            }
        }
        y
    }

    /// The integer sums at their largest: every code at its type's maximum, then at its
    /// minimum (code bytes 0xFF, then 0x00; sub-scale bytes 0xFF, f16 scales 1) against
    /// activations all +127 or all -127, where a kernel adding too many products in 16 bits
    /// (AVX2's maddubs results, `Spec::i16_span`) would wrap by 65,536, and a centred sum
    /// (`Spec::i16_centred`) is farthest from zero: every kernel gives the f64 reference's
    /// result, Q4_1 included.
    #[test]
    fn extreme_codes_and_activations_stay_exact() {
        use crate::model::cpu::matmul::CpuQWeight;
        // Each type: ggml number, block bytes, values a block, offsets of its f16 fields, its
        // sub-scale bytes.
        type Case = (
            Option<QType>,
            u32,
            usize,
            usize,
            &'static [usize],
            Range<usize>,
        );
        use std::ops::Range;
        let mut cases: Vec<Case> = vec![(None, 3, 20, 32, &[0, 2], 0..0)];
        for ty in QType::ALL {
            let spec = ty.spec();
            let (f16s, scales): (&[usize], _) = match ty {
                QType::Q5_1 => (&[0, 2], 0..0),
                QType::Q4K | QType::Q5K => (&[0, 2], 4..16),
                QType::Q2K => (&[80, 82], 0..16),
                QType::Q3K => (&[108], 96..108),
                QType::Q6K => (&[208], 192..208),
                QType::Iq4Xs => (&[0], 2..8),
                _ => (&[0], 0..0),
            };
            let c = (Some(ty), spec.ggml, spec.block_bytes, spec.per_super * QK);
            cases.push((c.0, c.1, c.2, c.3, f16s, scales));
        }
        let (t, n, k) = (9, 16, 512);
        for (ty, ggml, bytes, per, f16s, scales) in cases {
            for fill in [0xFFu8, 0x00] {
                let mut blk = vec![fill; bytes];
                blk[scales.clone()].fill(0xFF);
                for &at in f16s {
                    blk[at..at + 2].copy_from_slice(&f16::ONE.to_bits().to_le_bytes());
                }
                let raw = blk.repeat(n * k / per);
                let row: Vec<f32> = match ty {
                    Some(ty) => reference_dequant(ty, &blk),
                    // Q4_1: d * code + m.
                    None => vec![if fill == 0 { 1.0 } else { 16.0 }; 32],
                }
                .repeat(k / per);
                for sign in [1f32, -1.0] {
                    let x = vec![sign; t * k];
                    let want: f64 = row.iter().map(|w| sign as f64 * *w as f64).sum();
                    let l1: f64 = row.iter().map(|w| w.abs() as f64).sum();
                    for kernel in crate::model::cpu::q8::test_kernels() {
                        let lin = CpuQWeight::from_raw(ggml, &raw, n, k, kernel)
                            .unwrap()
                            .expect("a type gen runs");
                        for (i, g) in lin.matmul(&x, t).into_iter().enumerate() {
                            assert!(
                                (g as f64 - want).abs() <= 2e-3 * l1,
                                "ggml type {ggml} {kernel:?} codes {fill:#x} sign {sign} output {i}: {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_hold_every_value_of_the_file() {
        for ty in QType::ALL {
            let spec = ty.spec();
            let (rows, cols) = (11, 2 * spec.per_super * QK);
            let raw = random_blocks(ty, rows, cols, 5);
            let t = Tiles::from_gguf(ty, &raw, rows, cols);
            let row_bytes = cols / (spec.per_super * QK) * spec.block_bytes;
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                let want: Vec<f32> = raw[r * row_bytes..(r + 1) * row_bytes]
                    .chunks_exact(spec.block_bytes)
                    .flat_map(|b| reference_dequant(ty, b))
                    .collect();
                t.dequantize_row(r, &mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                        "{ty:?} row {r} value {i}: {g} vs {w}"
                    );
                }
            }
            // Memory: the file's bytes, give or take the repacking of scales (and for the
            // biased types 4 bytes a row and super-block: Q3_K's 110 become 118; MXFP4's byte
            // scale is an f16: 17 become 18).
            let file = rows.div_ceil(8) * 8 * row_bytes;
            let extra = if spec.biased() {
                4 * file / spec.block_bytes
            } else if ty == QType::Mxfp4 {
                file / spec.block_bytes
            } else {
                0
            };
            assert!(
                t.bytes() <= file + file / 25 + extra,
                "{ty:?}: {} bytes for a file's {file}",
                t.bytes()
            );
        }
    }

    #[test]
    fn q8k_activations_round_as_llama_cpp() {
        // iscale = -127 / max, max the value of largest magnitude (here -3: it maps to -127);
        // d = 1 / iscale, in f32.
        let mut x: Vec<f32> = (0..256).map(|i| (i as f32 - 100.0) * 0.01).collect();
        x[7] = -3.0;
        let mut seen = Vec::new();
        quantize_token(&x, Act::Q8K, Kernel::Scalar, |b, q, d, sums, f| {
            seen.push((b, q.to_vec(), d, sums, f));
        });
        assert_eq!(seen.len(), 8);
        let iscale = -127.0f32 / -3.0;
        assert_eq!(seen[0].2, 1.0 / iscale);
        assert_eq!(seen[0].1[7] as i8, -127);
        for (b, q, d, sums, f) in &seen {
            for (l, &qv) in q.iter().enumerate() {
                let want = ((iscale * x[b * 32 + l]).round_ties_even() as i32).min(127);
                assert_eq!(qv as i8 as i32, want);
            }
            let s: i32 = q.iter().map(|&v| v as i8 as i32).sum();
            assert_eq!(sums[0] + sums[1], s);
            assert_eq!(sums[2], s);
            assert_eq!(f[2], d * s as f32);
        }
    }

    /// Every type, every kernel, against the f32 product of ggml's own dequantization, on
    /// ragged row counts (not multiples of 8) and 1 to 17 tokens. Tolerance, per output: what
    /// quantizing the activations to 8 bits can move it, sum |w_i| * 0.6 * d_a(i) (half a step,
    /// plus the f16 rounding of a Q8_0 scale), and 0.2% of sum |w_i x_i| for f32 sums and
    /// Q8_1's f16 block sums. The kernels compute the same integer sums, so SIMD and scalar
    /// agree to 1e-5 relative; and a token's outputs are the same bits whether it is computed
    /// alone or with others.
    #[test]
    fn kernels_match_ggml_dequantization() {
        use crate::model::cpu::matmul::{test_data, CpuQWeight};
        for ty in QType::ALL {
            let spec = ty.spec();
            let sb = spec.per_super * QK;
            for &(t, n, k) in &[
                (1, 13, sb),
                (3, 37, 2 * sb),
                (17, 9, 3 * sb),
                (8, 24, 2 * sb),
                // Five chunks of tokens on three row pairs: the 512-bit kernel keeps each
                // pair's unpacked blocks for the later chunks.
                (40, 48, 2 * sb),
            ] {
                let raw = random_blocks(ty, n, k, (n * 31 + k) as u64);
                let row_bytes = k / sb * spec.block_bytes;
                let w: Vec<f32> = raw
                    .chunks_exact(spec.block_bytes)
                    .flat_map(|b| reference_dequant(ty, b))
                    .collect();
                assert_eq!(w.len(), n * k);
                let x = test_data(t * k, 17 + t as u64);
                // The activation quantization step of each value, as the type's scheme has it.
                let block = if spec.act == Act::Q8K { 256 } else { 32 };
                let step: Vec<f32> = x
                    .chunks(block)
                    .flat_map(|b| {
                        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                        std::iter::repeat_n(amax / 127.0, b.len())
                    })
                    .collect();
                let mut outs: Vec<Vec<f32>> = Vec::new();
                // Per output, the sum of its products' magnitudes: what float rounding scales
                // with.
                let mut l1s = vec![0f32; t * n];
                for kernel in crate::model::cpu::q8::test_kernels() {
                    let lin = CpuQWeight::from_raw(spec.ggml, &raw, n, k, kernel)
                        .unwrap()
                        .expect("a type gen runs");
                    let got = lin.matmul(&x, t);
                    for i in 0..t {
                        for j in 0..n {
                            let (xs, ws) = (&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                            let want: f64 =
                                xs.iter().zip(ws).map(|(a, b)| *a as f64 * *b as f64).sum();
                            let l1: f32 = xs.iter().zip(ws).map(|(a, b)| (a * b).abs()).sum();
                            l1s[i * n + j] = l1;
                            let q: f32 = ws
                                .iter()
                                .zip(&step[i * k..(i + 1) * k])
                                .map(|(w, s)| w.abs() * 0.6 * s)
                                .sum();
                            let g = got[i * n + j];
                            assert!(
                                (g as f64 - want).abs() <= (q + 2e-3 * l1 + 1e-6) as f64,
                                "{ty:?} {kernel:?} t={t} n={n} k={k} [{i},{j}]: {g} vs {want} (row bytes {row_bytes})"
                            );
                        }
                    }
                    // Alone or with the others: the same bits.
                    for i in [0, t / 2, t - 1] {
                        let alone = lin.matmul(&x[i * k..(i + 1) * k], 1);
                        assert_eq!(
                            &got[i * n..(i + 1) * n],
                            &alone[..],
                            "{ty:?} {kernel:?} token {i}"
                        );
                    }
                    outs.push(got);
                }
                // The SIMD kernels against the scalar one: the same integer sums, scaled in
                // another order (the Q8_K types on every SIMD kernel sub-scaled in integers,
                // the bias of the biased types on VNNI taken off in integers too: one rounding
                // a super-block, where the scalar kernel rounds per block).
                for o in &outs[1..] {
                    for ((a, b), l1) in o.iter().zip(&outs[0]).zip(&l1s) {
                        // (Measured: at most 5e-8 of the magnitudes.)
                        let tol = if spec.act == Act::Q8K { 1e-6 * l1 } else { 0.0 };
                        assert!(
                            (a - b).abs() <= 1e-5 * (1.0 + b.abs()) + tol,
                            "{ty:?}: SIMD {a} vs scalar {b} (products' magnitudes {l1})"
                        );
                    }
                }
            }
        }
    }
}
