//! Tiny random-weight models (the small Qwen2 shape, widths multiples of 256) with every
//! matrix in one GGUF type: the files `quant_types.rs` and `one_answer.rs` run. IQ4_NL and
//! IQ4_XS, which candle cannot write, are quantized here (a plain nearest-value quantizer: the
//! format, not the quality, is under test); F16 and BF16 are rounded here; the other types by
//! candle's quantizers.

use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;

use super::{data, write_gguf};

const D: usize = super::SMALL_QWEN2.d;
const HEADS: usize = super::SMALL_QWEN2.heads;
const KV: usize = super::SMALL_QWEN2.kv;
const HD: usize = super::SMALL_QWEN2.hd;
const FF: usize = super::SMALL_QWEN2.ff;
pub const VOCAB: usize = 64;

/// Every type gen runs on its own kernels, by ggml number: F16 and BF16, then the quantized.
pub const TYPES: [(u32, &str); 15] = [
    (1, "F16"),
    (30, "BF16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (20, "IQ4_NL"),
    (23, "IQ4_XS"),
    (39, "MXFP4"),
];
const LAYERS: usize = super::SMALL_QWEN2.layers;

const IQ4: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn nearest_iq4(v: f32) -> u8 {
    (0..16)
        .min_by(|&a, &b| {
            (IQ4[a] as f32 - v)
                .abs()
                .total_cmp(&(IQ4[b] as f32 - v).abs())
        })
        .unwrap() as u8
}

/// 32 values to an IQ4 block's nibbles (value j in the low nibble of byte j, j + 16 in the
/// high one) at scale d, and the values those nibbles stand for.
fn iq4_block(x: &[f32], d: f32) -> ([u8; 16], Vec<f32>) {
    let mut qs = [0u8; 16];
    let mut back = vec![0f32; 32];
    for j in 0..32 {
        let i = if d == 0.0 { 8 } else { nearest_iq4(x[j] / d) };
        qs[j % 16] |= i << (4 * (j / 16));
        back[j] = d * IQ4[i as usize] as f32;
    }
    (qs, back)
}

/// A matrix (rows, cols) in ggml type `ty`: its GGUF bytes and the values they hold.
pub fn quantize(w: &[f32], rows: usize, cols: usize, ty: u32) -> (Vec<u8>, Vec<f32>) {
    let candle = match ty {
        2 => Some(GgmlDType::Q4_0),
        3 => Some(GgmlDType::Q4_1),
        6 => Some(GgmlDType::Q5_0),
        7 => Some(GgmlDType::Q5_1),
        8 => Some(GgmlDType::Q8_0),
        10 => Some(GgmlDType::Q2K),
        11 => Some(GgmlDType::Q3K),
        12 => Some(GgmlDType::Q4K),
        13 => Some(GgmlDType::Q5K),
        14 => Some(GgmlDType::Q6K),
        _ => None,
    };
    if let Some(dt) = candle {
        let t = Tensor::from_vec(w.to_vec(), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dt).unwrap();
        let back = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
        return (q.data().unwrap().to_vec(), back.to_vec1().unwrap());
    }
    let mut raw = Vec::new();
    let mut back = Vec::new();
    match ty {
        1 | 30 => {
            for &v in w {
                let (bits, b) = match ty {
                    1 => (f16::from_f32(v).to_bits(), f16::from_f32(v).to_f32()),
                    _ => (
                        half::bf16::from_f32(v).to_bits(),
                        half::bf16::from_f32(v).to_f32(),
                    ),
                };
                raw.extend(bits.to_le_bytes());
                back.push(b);
            }
        }
        20 => {
            for blk in w.chunks_exact(32) {
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let (qs, b) = iq4_block(blk, d.to_f32());
                raw.extend(d.to_bits().to_le_bytes());
                raw.extend(qs);
                back.extend(b);
            }
        }
        23 => {
            for sb in w.chunks_exact(256) {
                let amax: Vec<f32> = sb
                    .chunks_exact(32)
                    .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
                    .collect();
                let top = amax.iter().fold(0f32, |m, v| m.max(*v));
                let d = f16::from_f32(top / (127.0 * 31.0));
                let df = d.to_f32();
                let (mut sh, mut sl) = (0u16, [0u8; 4]);
                let mut qs = Vec::new();
                for (j, b) in sb.chunks_exact(32).enumerate() {
                    let s = if df == 0.0 {
                        0
                    } else {
                        (amax[j] / (127.0 * df)).round().clamp(-32.0, 31.0) as i32
                    };
                    let ls = (s + 32) as u16;
                    sl[j / 2] |= ((ls & 0xF) as u8) << (4 * (j % 2));
                    sh |= (ls >> 4) << (2 * j);
                    let (q, bk) = iq4_block(b, df * s as f32);
                    qs.extend(q);
                    back.extend(bk);
                }
                raw.extend(d.to_bits().to_le_bytes());
                raw.extend(sh.to_le_bytes());
                raw.extend(sl);
                raw.extend(qs);
            }
        }
        39 => {
            // As ggml's quantize_row_mxfp4_ref: e = floor(log2(amax)) - 2 + 127, the scale
            // 2^(e - 128) against E2M1's values doubled, each value to the nearest.
            const E2M1: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
            for blk in w.chunks_exact(32) {
                let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                let e = if amax > 0.0 {
                    (amax.log2().floor() - 2.0 + 127.0) as u8
                } else {
                    0
                };
                let d = 2f32.powi(e as i32 - 128);
                let mut qs = [0u8; 16];
                let mut b = [0f32; 32];
                for (j, &x) in blk.iter().enumerate() {
                    let i = (0..16u8)
                        .min_by(|&a, &c| {
                            let da = (x / d - E2M1[a as usize] as f32).abs();
                            let dc = (x / d - E2M1[c as usize] as f32).abs();
                            da.total_cmp(&dc)
                        })
                        .unwrap();
                    qs[j % 16] |= i << (4 * (j / 16));
                    b[j] = d * E2M1[i as usize] as f32;
                }
                raw.push(e);
                raw.extend(qs);
                back.extend(b);
            }
        }
        _ => panic!("type {ty}"),
    }
    (raw, back)
}

/// The model with its matrices in type `ty` (ggml's number; 0: f32, given as the values `quantize` gave back
/// for the same type), written to `path`; returns the widened matrices for the f32 twin.
pub fn write_model(
    path: &Path,
    ty: u32,
    widened: Option<&[(String, Vec<f32>)]>,
) -> Vec<(String, Vec<f32>)> {
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = Vec::new();
    let mut values = Vec::new();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut seed = 7;
    let mut vector = |name: String, n: usize, around: f32, tensors: &mut Vec<_>| {
        seed += 1;
        let v: Vec<f32> = data(n, seed, 0.2).iter().map(|x| x + around).collect();
        tensors.push((name, vec![n as u64], 0, f32_bytes(&v)));
    };
    let mut mseed = 100;
    let mut matrix = |name: String, rows: usize, cols: usize, tensors: &mut Vec<_>| {
        mseed += 1;
        let w = data(rows * cols, mseed, 1.0 / (cols as f32).sqrt() * 1.7);
        match widened {
            Some(ws) => {
                let v = &ws.iter().find(|(n, _)| *n == name).unwrap().1;
                tensors.push((name, vec![cols as u64, rows as u64], 0, f32_bytes(v)));
            }
            None => {
                let (raw, back) = quantize(&w, rows, cols, ty);
                values.push((name.clone(), back));
                tensors.push((name, vec![cols as u64, rows as u64], ty, raw));
            }
        }
    };
    let emb = data(VOCAB * D, 3, 1.0);
    tensors.push((
        "token_embd.weight".into(),
        vec![D as u64, VOCAB as u64],
        0,
        f32_bytes(&emb),
    ));
    for l in 0..LAYERS {
        let p = format!("blk.{l}");
        vector(format!("{p}.attn_norm.weight"), D, 1.0, &mut tensors);
        vector(format!("{p}.ffn_norm.weight"), D, 1.0, &mut tensors);
        vector(format!("{p}.attn_q.bias"), HEADS * HD, 0.0, &mut tensors);
        vector(format!("{p}.attn_k.bias"), KV * HD, 0.0, &mut tensors);
        vector(format!("{p}.attn_v.bias"), KV * HD, 0.0, &mut tensors);
        matrix(format!("{p}.attn_q.weight"), HEADS * HD, D, &mut tensors);
        matrix(format!("{p}.attn_k.weight"), KV * HD, D, &mut tensors);
        matrix(format!("{p}.attn_v.weight"), KV * HD, D, &mut tensors);
        matrix(
            format!("{p}.attn_output.weight"),
            D,
            HEADS * HD,
            &mut tensors,
        );
        matrix(format!("{p}.ffn_gate.weight"), FF, D, &mut tensors);
        matrix(format!("{p}.ffn_up.weight"), FF, D, &mut tensors);
        matrix(format!("{p}.ffn_down.weight"), D, FF, &mut tensors);
    }
    vector("output_norm.weight".into(), D, 1.0, &mut tensors);
    matrix("output.weight".into(), VOCAB, D, &mut tensors);
    let meta = super::qwen2_meta(&super::SMALL_QWEN2);
    write_gguf(path, &meta, &tensors);
    values
}

/// Experts in [`write_moe_model`]'s model: 8 of width 256, 2 used a token.
pub const EXPERTS: usize = 8;

/// A Qwen2 MoE model of the small shape: every FFN 8 routed experts (2 used) and a gated
/// shared expert, every matrix (experts stacked 3-D, as files hold them) in type `ty`; the
/// routers f32, as real files keep them.
pub fn write_moe_model(path: &Path, ty: u32) {
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = Vec::new();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut seed = 500;
    let mut next = || {
        seed += 1;
        seed
    };
    let ffe = 256;
    let mut add = |name: String, dims: Vec<usize>, ty: u32, a: f32, around: f32, seed: u64| {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = data(n, seed, a).iter().map(|x| x + around).collect();
        let gguf_dims: Vec<u64> = dims.iter().rev().map(|&d| d as u64).collect();
        let raw = match ty {
            0 => f32_bytes(&v),
            _ => quantize(&v, n / dims[dims.len() - 1], dims[dims.len() - 1], ty).0,
        };
        tensors.push((name, gguf_dims, ty, raw));
    };
    add("token_embd.weight".into(), vec![VOCAB, D], 0, 1.0, 0.0, 3);
    let w = |cols: usize| 1.0 / (cols as f32).sqrt() * 1.7;
    for l in 0..LAYERS {
        let p = format!("blk.{l}");
        for n in ["attn_norm", "ffn_norm"] {
            add(format!("{p}.{n}.weight"), vec![D], 0, 0.2, 1.0, next());
        }
        for (n, rows) in [
            ("attn_q", HEADS * HD),
            ("attn_k", KV * HD),
            ("attn_v", KV * HD),
        ] {
            add(format!("{p}.{n}.bias"), vec![rows], 0, 0.2, 0.0, next());
            add(
                format!("{p}.{n}.weight"),
                vec![rows, D],
                ty,
                w(D),
                0.0,
                next(),
            );
        }
        add(
            format!("{p}.attn_output.weight"),
            vec![D, HEADS * HD],
            ty,
            w(D),
            0.0,
            next(),
        );
        add(
            format!("{p}.ffn_gate_inp.weight"),
            vec![EXPERTS, D],
            0,
            0.5,
            0.0,
            next(),
        );
        for n in ["ffn_gate_exps", "ffn_up_exps"] {
            add(
                format!("{p}.{n}.weight"),
                vec![EXPERTS, ffe, D],
                ty,
                w(D),
                0.0,
                next(),
            );
        }
        add(
            format!("{p}.ffn_down_exps.weight"),
            vec![EXPERTS, D, ffe],
            ty,
            w(ffe),
            0.0,
            next(),
        );
        add(
            format!("{p}.ffn_gate_inp_shexp.weight"),
            vec![D],
            0,
            0.5,
            0.0,
            next(),
        );
        for n in ["ffn_gate_shexp", "ffn_up_shexp"] {
            add(
                format!("{p}.{n}.weight"),
                vec![FF, D],
                ty,
                w(D),
                0.0,
                next(),
            );
        }
        add(
            format!("{p}.ffn_down_shexp.weight"),
            vec![D, FF],
            ty,
            w(FF),
            0.0,
            next(),
        );
    }
    add("output_norm.weight".into(), vec![D], 0, 0.2, 1.0, 9);
    add("output.weight".into(), vec![VOCAB, D], ty, w(D), 0.0, 10);
    let mut meta: Vec<(&'static str, super::Meta)> = Vec::new();
    for (k, v) in super::qwen2_meta(&super::SMALL_QWEN2) {
        let k: &'static str = match k.strip_prefix("qwen2.") {
            Some(rest) => Box::leak(format!("qwen2moe.{rest}").into_boxed_str()),
            None => k,
        };
        let v = match (k, v) {
            ("general.architecture", _) => super::Meta::Str("qwen2moe".into()),
            (_, v) => v,
        };
        meta.push((k, v));
    }
    meta.push(("qwen2moe.expert_count", super::Meta::U32(EXPERTS as u32)));
    meta.push(("qwen2moe.expert_used_count", super::Meta::U32(2)));
    meta.push((
        "qwen2moe.expert_feed_forward_length",
        super::Meta::U32(ffe as u32),
    ));
    meta.push((
        "qwen2moe.expert_shared_feed_forward_length",
        super::Meta::U32(FF as u32),
    ));
    write_gguf(path, &meta, &tensors);
}

pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let tok = dir.join("tokenizer.json");
    std::fs::write(&tok, super::tokenizer_json(VOCAB).to_string()).unwrap();
    dir
}
