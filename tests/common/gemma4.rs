//! Gemma 4 files written as Google's converter lays them out (llama.cpp's
//! conversion/gemma.py), with random weights and the 128-token vocabulary of the suite's
//! Gemma 3 file: llama.cpp's suite writes none (its saver skips the architecture).

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::{data, suite};

/// What a written file has.
pub struct Shape {
    /// Per layer: windowed (true) or global.
    pub swa: &'static [bool],
    /// Layers at the end reading an earlier layer's cache.
    pub shared: usize,
    /// Per-layer input width (0: none).
    pub per_layer: usize,
    /// The global layers have no `attn_v` (v is k's projection).
    pub k_eq_v: bool,
    /// Experts beside the dense FFN on every layer but the first (0: none).
    pub experts: usize,
}

pub const D: usize = 128;
pub const HEADS: usize = 4;
pub const HD_FULL: usize = 64;
pub const HD_SWA: usize = 32;
pub const FF: usize = 192;
pub const WINDOW: usize = 8;
/// Norm weights are this plus or minus 0.2. Near 1, Gemma 4's layers (v normed, attention
/// unscaled) carry the f16 rounding of gen's cache and of llama.cpp's GELU table (f16 in and
/// out) up to 2e-6 NMSE, whose source was checked: with both emulated, position 0 agreed to
/// 5e-11. At a quarter, as the suite's files are (weights of 0.1), that noise is 1e-8 to 2e-7
/// while leaving out v's norm or the layer output factor costs 1e-2 and more.
pub const NORM: f32 = 0.25;

pub const E2B_LIKE: Shape = Shape {
    swa: &[true, true, false, true, false, true, false],
    shared: 2,
    per_layer: 16,
    k_eq_v: true,
    experts: 0,
};

pub const DENSE_LIKE: Shape = Shape {
    swa: &[true, true, false, true, true, false],
    shared: 0,
    per_layer: 0,
    k_eq_v: false,
    experts: 0,
};

/// 26B-A4B-like: the dense-like layers with experts beside their FFN (two of four chosen).
pub const MOE_LIKE: Shape = Shape {
    experts: 4,
    ..DENSE_LIKE
};
pub const FF_EXPERT: usize = 64;

/// Random values in [offset - a, offset + a): a matrix in type `ty`, anything else F32.
fn tensor(dims: &[usize], seed: u64, a: f32, offset: f32, ty: GgmlDType) -> QTensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = data(n, seed, a).into_iter().map(|x| x + offset).collect();
    let t = Tensor::from_vec(v, dims, &Device::Cpu).unwrap();
    let ty = if dims.len() >= 2 { ty } else { GgmlDType::F32 };
    QTensor::quantize(&t, ty).unwrap()
}

/// Write a Gemma 4 file of `s` at `to`, its matrices in type `ty`, its vocabulary from the
/// suite's Gemma 3 file.
pub fn write(s: &Shape, seed: u64, ty: GgmlDType, to: &Path) {
    let from = suite::dir().join("seed-1/gemma3-dense.gguf");
    let mut f = std::fs::File::open(&from).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .filter(|(k, v)| {
            !k.starts_with("gemma3.")
                && *k != "general.architecture"
                && !matches!(v, gguf_file::Value::Array(a) if a.is_empty())
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let vocab = match &content.metadata["tokenizer.ggml.tokens"] {
        gguf_file::Value::Array(a) => a.len(),
        other => panic!("tokens: {other:?}"),
    };
    let n = s.swa.len();
    let kv_of = |l: usize| if s.swa[l] { 2u32 } else { 1 };
    let hd_of = |l: usize| if s.swa[l] { HD_SWA } else { HD_FULL };
    let ff_of = |l: usize| if l >= n - s.shared { 2 * FF } else { FF };
    use gguf_file::Value as V;
    let u = |x: usize| V::U32(x as u32);
    let arr = |xs: Vec<V>| V::Array(xs);
    let keys: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("gemma4".into())),
        ("gemma4.context_length", u(256)),
        ("gemma4.embedding_length", u(D)),
        ("gemma4.block_count", u(n)),
        (
            "gemma4.feed_forward_length",
            arr((0..n).map(|l| u(ff_of(l))).collect()),
        ),
        ("gemma4.attention.head_count", u(HEADS)),
        (
            "gemma4.attention.head_count_kv",
            arr((0..n).map(|l| V::U32(kv_of(l))).collect()),
        ),
        ("gemma4.attention.key_length", u(HD_FULL)),
        ("gemma4.attention.value_length", u(HD_FULL)),
        ("gemma4.attention.key_length_swa", u(HD_SWA)),
        ("gemma4.attention.value_length_swa", u(HD_SWA)),
        ("gemma4.rope.dimension_count", u(HD_FULL)),
        ("gemma4.rope.dimension_count_swa", u(HD_SWA)),
        ("gemma4.rope.freq_base", V::F32(1_000_000.0)),
        ("gemma4.rope.freq_base_swa", V::F32(10_000.0)),
        ("gemma4.attention.layer_norm_rms_epsilon", V::F32(1e-6)),
        ("gemma4.attention.sliding_window", u(WINDOW)),
        (
            "gemma4.attention.sliding_window_pattern",
            arr(s.swa.iter().map(|&b| V::Bool(b)).collect()),
        ),
        ("gemma4.attention.shared_kv_layers", u(s.shared)),
        ("gemma4.embedding_length_per_layer_input", u(s.per_layer)),
    ];
    let keys = keys.into_iter().chain(match s.experts {
        0 => vec![],
        e => vec![
            ("gemma4.expert_count", u(e)),
            ("gemma4.expert_used_count", u(2)),
            ("gemma4.expert_feed_forward_length", u(FF_EXPERT)),
        ],
    });
    md.extend(keys.into_iter().map(|(k, v)| (k.to_string(), v)));
    md.sort_by(|a, b| a.0.cmp(&b.0));

    let mut ts: Vec<(String, QTensor)> = Vec::new();
    // The global layers turn a quarter of their pairs; the rest have factor 1e30.
    let turning = HD_FULL / 8;
    let freqs: Vec<f32> = (0..HD_FULL / 2)
        .map(|i| if i < turning { 1.0 } else { 1e30 })
        .collect();
    let freqs = Tensor::from_vec(freqs, HD_FULL / 2, &Device::Cpu).unwrap();
    ts.push((
        "rope_freqs.weight".into(),
        QTensor::quantize(&freqs, GgmlDType::F32).unwrap(),
    ));
    let mut k = seed * 1000;
    let mut add = |name: String, dims: &[usize], a: f32, offset: f32| {
        k += 1;
        ts.push((name, tensor(dims, k, a, offset, ty)));
    };
    add("token_embd.weight".into(), &[vocab, D], 1.0, 0.0);
    add("output_norm.weight".into(), &[D], 0.2, NORM);
    if s.per_layer > 0 {
        let all = n * s.per_layer;
        add(
            "per_layer_token_embd.weight".into(),
            &[vocab, all],
            1.0,
            0.0,
        );
        add("per_layer_model_proj.weight".into(), &[all, D], 0.2, 0.0);
        add(
            "per_layer_proj_norm.weight".into(),
            &[s.per_layer],
            0.2,
            NORM,
        );
    }
    for l in 0..n {
        let p = |t: &str| format!("blk.{l}.{t}.weight");
        let (kv, hd, ff) = (kv_of(l) as usize, hd_of(l), ff_of(l));
        let wa = 1.0 / (D as f32).sqrt() * 1.7;
        add(p("attn_norm"), &[D], 0.2, NORM);
        add(p("attn_q"), &[HEADS * hd, D], wa, 0.0);
        add(p("attn_k"), &[kv * hd, D], wa, 0.0);
        if s.swa[l] || !s.k_eq_v {
            add(p("attn_v"), &[kv * hd, D], wa, 0.0);
        }
        add(p("attn_output"), &[D, HEADS * hd], wa, 0.0);
        add(p("attn_q_norm"), &[hd], 0.2, NORM);
        add(p("attn_k_norm"), &[hd], 0.2, NORM);
        add(p("post_attention_norm"), &[D], 0.2, NORM);
        add(p("layer_output_scale"), &[1], 0.3, 0.7);
        add(p("ffn_norm"), &[D], 0.2, NORM);
        add(p("ffn_gate"), &[ff, D], wa, 0.0);
        add(p("ffn_up"), &[ff, D], wa, 0.0);
        add(p("ffn_down"), &[D, ff], 1.7 / (ff as f32).sqrt(), 0.0);
        add(p("post_ffw_norm"), &[D], 0.2, NORM);
        // Per-tensor scales, which llama.cpp's Gemma 4 graph applies.
        for t in ["attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down"] {
            add(format!("blk.{l}.{t}.scale"), &[1], 0.3, 1.0);
        }
        if s.experts > 0 && l > 0 {
            let (e, fe) = (s.experts, FF_EXPERT);
            add(p("ffn_gate_inp"), &[e, D], wa, 0.0);
            add(format!("blk.{l}.ffn_gate_inp.scale"), &[D], 0.2, 1.0);
            add(p("pre_ffw_norm_2"), &[D], 0.2, NORM);
            add(p("post_ffw_norm_1"), &[D], 0.2, NORM);
            add(p("post_ffw_norm_2"), &[D], 0.2, NORM);
            add(p("ffn_gate_exps"), &[e, fe, D], wa, 0.0);
            add(p("ffn_up_exps"), &[e, fe, D], wa, 0.0);
            add(
                p("ffn_down_exps"),
                &[e, D, fe],
                1.7 / (fe as f32).sqrt(),
                0.0,
            );
            add(format!("blk.{l}.ffn_down_exps.scale"), &[e], 0.3, 1.0);
        }
        if s.per_layer > 0 {
            add(p("inp_gate"), &[s.per_layer, D], wa, 0.0);
            add(p("proj"), &[D, s.per_layer], 0.4, 0.0);
            add(p("post_norm"), &[D], 0.2, NORM);
        }
    }
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(to).unwrap());
    gguf_file::write(&mut w, &md_refs, &t_refs).unwrap();
}
