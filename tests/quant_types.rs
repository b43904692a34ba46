//! Every GGUF weight type gen runs, end to end: a tiny random-weight model (widths multiples of
//! 256, so the K-quants apply) written by this test with every matrix in one type, loaded
//! through gen's loader onto its CPU kernels, against the same model with those matrices
//! widened to f32 (run through plain f32 products). The only difference between the two is
//! the 8-bit quantization of the activations that the quantized kernels make, as llama.cpp
//! does: logits agree within 3% of their scale (measured: 0.9-1.6%) and greedy picks agree.
//!
//! IQ4_NL and IQ4_XS, which candle cannot read, are quantized by this test itself (a plain
//! nearest-value quantizer: the format, not the quality, is under test); the other types by
//! candle's quantizers. A type gen does not run is refused with one line naming the tensor,
//! its type and the types gen runs, before any weight is read.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{data, write_gguf};
use half::f16;

const D: usize = common::SMALL_QWEN2.d;
const HEADS: usize = common::SMALL_QWEN2.heads;
const KV: usize = common::SMALL_QWEN2.kv;
const HD: usize = common::SMALL_QWEN2.hd;
const FF: usize = common::SMALL_QWEN2.ff;
const VOCAB: usize = 64;
const LAYERS: usize = common::SMALL_QWEN2.layers;

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
fn quantize(w: &[f32], rows: usize, cols: usize, ty: u32) -> (Vec<u8>, Vec<f32>) {
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
        _ => panic!("type {ty}"),
    }
    (raw, back)
}

/// The model with its matrices in type `ty` (0: f32, given as the values `quantize` gave back
/// for the same type), written to `path`; returns the widened matrices for the f32 twin.
fn write_model(
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
    let meta = common::qwen2_meta(&common::SMALL_QWEN2);
    write_gguf(path, &meta, &tensors);
    values
}

fn scratch() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("quant_types");
    std::fs::create_dir_all(&dir).unwrap();
    let tok = dir.join("tokenizer.json");
    std::fs::write(&tok, common::tokenizer_json(VOCAB).to_string()).unwrap();
    dir
}

/// Logits of a prefill of 5 tokens, then 6 one-token steps.
fn logits(path: &Path, tokenizer: &Path) -> Vec<Vec<f32>> {
    let tokens: Vec<u32> = (0..11).map(|i| (i * 13 + 5) % VOCAB as u32).collect();
    common::gen_logits(path, Some(tokenizer), &tokens, 5)
}

#[test]
fn every_type_runs_and_agrees_with_its_widened_twin() {
    let dir = scratch();
    let tok = dir.join("tokenizer.json");
    let types = [
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
    ];
    for (ty, name) in types {
        let q = dir.join(format!("{name}.gguf"));
        let f = dir.join(format!("{name}-f32.gguf"));
        let widened = write_model(&q, ty, None);
        write_model(&f, 0, Some(&widened));
        let (got, want) = (logits(&q, &tok), logits(&f, &tok));
        let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 1.0, "{name}: logits too flat to compare ({scale})");
        let mut same_pick = 0;
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let diff = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 0.03 * scale,
                "{name} step {step}: logits differ by {diff} (scale {scale})"
            );
            same_pick += (common::argmax(g) == common::argmax(w)) as usize;
        }
        assert!(
            same_pick >= got.len() - 1,
            "{name}: greedy picks agree at {same_pick} of {} steps",
            got.len()
        );
        // Through the binary too: it loads and generates.
        let out = common::gen()
            .args([
                "--prompt",
                "w5 w9 w17",
                "-n",
                "4",
                "-t",
                "0",
                "--ignore-eos",
                "--stats",
                "json",
            ])
            .arg("--model")
            .arg(&q)
            .arg("--tokenizer")
            .arg(&tok)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            common::text(&out.stderr)
        );
        let _ = std::fs::remove_file(&q);
        let _ = std::fs::remove_file(&f);
    }
}

#[test]
fn a_type_gen_does_not_run_is_refused_in_one_line_naming_it() {
    let dir = scratch();
    let path = dir.join("iq2xxs.gguf");
    write_model(&path, 20, None);
    // Turn the first matrix into IQ2_XXS (type 16): same file otherwise.
    let mut bytes = std::fs::read(&path).unwrap();
    let name = b"blk.0.attn_q.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    // n_dims (4 bytes), two dims (16 bytes), then the type.
    bytes[at + 20..at + 24].copy_from_slice(&16u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let out = common::gen()
        .args(["--prompt", "w5", "-n", "2"])
        .arg("--model")
        .arg(&path)
        .arg("--tokenizer")
        .arg(dir.join("tokenizer.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = common::one_error_line(&out);
    for want in [
        "blk.0.attn_q.weight",
        "IQ2_XXS",
        "gen does not run",
        "Q4_K",
        "IQ4_XS",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    assert!(!line.to_lowercase().contains("candle"), "{line}");
}
