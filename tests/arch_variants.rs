//! Every kind of rotary embedding in use, and the attention and scaling variants the suite's
//! files exercise too weakly to tell apart, against llama.cpp on files written for them: the
//! suite's random-weight models (`.ci/llama-archs`) rewritten with the metadata and factor
//! tensors of each variant (rope scalings run on 80 token ids, positions far past the 16- to
//! 32-token "original contexts" written here, where scaling changes the result; Llama 3's
//! factors past position 2,048, where they start to matter), compared with the logits
//! llama.cpp's reader computes on the same file within NMSE 1e-6 (a hundredth of llama.cpp's
//! own bar between its backends).
//!
//! Each case also checks that the variant matters: the file with the scaling removed gives
//! logits far from llama.cpp's on the scaled file, so a gen that ignored the keys would fail.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::suite::{self, gen_logits, llama_logits, nmse, NMSE_F32};

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("arch_variants");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// 80 ids from the suite's 40, twice (positions 0..80).
fn ids(dir: &Path) -> Vec<u32> {
    let base = suite::ids(dir);
    base.iter().chain(base.iter()).copied().collect()
}

fn vector(values: Vec<f32>) -> QTensor {
    let n = values.len();
    QTensor::quantize(
        &Tensor::from_vec(values, n, &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap()
}

/// Llama 3's rope frequency factors as its converter computes them (convert_hf_to_gguf.py's
/// `rope_freqs` for `rope_type: llama3`).
fn llama3_factors(
    n_rot: usize,
    base: f32,
    factor: f32,
    low: f32,
    high: f32,
    orig: f32,
) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (orig / low, orig / high);
    (0..n_rot / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f32 / n_rot as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// gen against llama.cpp on `file` with a context of `n_ctx`, and (when given) `plain`, the
/// same model without the variant, must be far from llama.cpp's scaled logits: a hundred
/// times gen's own distance from them, so a gen that ignored the variant would fail.
fn check(dir: &Path, file: &Path, plain: Option<&Path>, n_ctx: usize) -> f64 {
    check_on(dir, file, plain, n_ctx, &ids(dir))
}

fn check_on(dir: &Path, file: &Path, plain: Option<&Path>, n_ctx: usize, ids: &[u32]) -> f64 {
    let want = llama_logits(dir, file, ids, n_ctx);
    let (decoded, mixed) = gen_logits(file, ids, 50, n_ctx).unwrap();
    let (e, e_mixed) = (nmse(&want, &decoded), nmse(&want[49..], &mixed));
    eprintln!(
        "{}: NMSE {e:.2e}, prefill + decode {e_mixed:.2e}",
        file.display()
    );
    assert!(
        e <= NMSE_F32 && e_mixed <= NMSE_F32,
        "{}: {e:.2e} / {e_mixed:.2e}",
        file.display()
    );
    if let Some(plain) = plain {
        let (other, _) = gen_logits(plain, ids, 50, n_ctx).unwrap();
        let apart = nmse(&want, &other);
        eprintln!("  without the variant: {apart:.2e}");
        assert!(
            apart > 100.0 * e.max(e_mixed),
            "{}: the variant hardly changes the logits ({apart:.2e})",
            file.display()
        );
    }
    e
}

/// The suite's models multiply every projection by a random per-tensor scale near 0.1 (and
/// Gemma's q/k norms have random weights as small), which leaves attention nearly uniform and
/// its output a small part of the residual, so positions hardly change the logits. For these
/// tests the scales are dropped and the q/k norm weights set to one: rotary embeddings then
/// decide what each token attends to, and that shows in the logits.
fn sharp(src: &Path) -> Vec<(String, Option<QTensor>)> {
    let content = gguf_file::Content::read(&mut std::fs::File::open(src).unwrap()).unwrap();
    let mut out = Vec::new();
    for (name, info) in &content.tensor_infos {
        if name.ends_with(".scale") {
            out.push((name.clone(), None));
        } else if name.ends_with("attn_q_norm.weight") || name.ends_with("attn_k_norm.weight") {
            let ones = Tensor::ones(info.shape.dims(), candle_core::DType::F32, &Device::Cpu);
            out.push((
                name.clone(),
                Some(QTensor::quantize(&ones.unwrap(), GgmlDType::F32).unwrap()),
            ));
        }
    }
    out
}

/// `sharp(src)` and `more` together, as `rewrite` takes them.
fn tensors<'a>(
    sharp: &'a [(String, Option<QTensor>)],
    more: Vec<(&'a str, Option<QTensor>)>,
) -> Vec<(&'a str, Option<QTensor>)> {
    let mut all: Vec<(&str, Option<QTensor>)> = sharp
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_ref().map(copy)))
        .collect();
    all.extend(more);
    all
}

fn s(v: &str) -> Option<Value> {
    Some(Value::String(v.into()))
}
fn f(v: f32) -> Option<Value> {
    Some(Value::F32(v))
}
fn u(v: u32) -> Option<Value> {
    Some(Value::U32(v))
}

#[test]
fn llama3_rope_frequency_factors_as_llama_3_2_publishes_them() {
    let dir = suite::dir();
    let src = dir.join("seed-1/llama-dense.gguf");
    // Llama 3.2's settings: base 500,000; factor 32, low 1, high 4, original context 8,192.
    let factors = llama3_factors(128, 500_000.0, 32.0, 1.0, 4.0, 8192.0);
    assert!(factors.contains(&32.0) && factors.contains(&1.0));
    let file = scratch("llama3-rope-freqs.gguf");
    let edit = [
        ("llama.rope.freq_base", f(500_000.0)),
        ("llama.context_length", u(131_072)),
    ];
    let sh = sharp(&src);
    let t = tensors(&sh, vec![("rope_freqs.weight", Some(vector(factors)))]);
    suite::rewrite(&src, &file, &edit, t);
    let plain = scratch("llama3-no-rope-freqs.gguf");
    suite::rewrite(
        &src,
        &plain,
        &edit,
        tensors(&sh, vec![("rope_freqs.weight", None)]),
    );
    // The factors change only pairs whose wavelength exceeds 8,192 / 4 = 2,048 positions, so
    // the run goes past position 2,048.
    let base = suite::ids(&dir);
    let long: Vec<u32> = base.iter().cycle().take(2_600).copied().collect();
    check_on(&dir, &file, Some(&plain), 2_816, &long);
}

#[test]
fn yarn_past_the_original_context() {
    let edit = [
        ("qwen2.rope.scaling.type", s("yarn")),
        ("qwen2.rope.scaling.factor", f(4.0)),
        ("qwen2.rope.scaling.original_context_length", u(16)),
    ];
    edited("qwen2-dense", "qwen2-yarn", &edit);
}

/// Seed 1's suite file `stem` sharpened, with `edit` on one copy (`name`) and not on another:
/// gen agrees with llama.cpp on the first, and the second is far from it.
fn edited(stem: &str, name: &str, edit: &[(&str, Option<Value>)]) {
    let dir = suite::dir();
    let src = dir.join(format!("seed-1/{stem}.gguf"));
    let file = scratch(&format!("{name}.gguf"));
    let sh = sharp(&src);
    suite::rewrite(&src, &file, edit, tensors(&sh, vec![]));
    let plain = scratch(&format!("{name}-plain.gguf"));
    suite::rewrite(&src, &plain, &[], tensors(&sh, vec![]));
    check(&dir, &file, Some(&plain), 256);
}

#[test]
fn yarn_with_mistral_3s_beta_range_log_multiplier_and_temperature() {
    let dir = suite::dir();
    let src = dir.join("seed-1/mistral3-dense.gguf");
    let file = scratch("mistral3-yarn.gguf");
    let edit = [
        ("mistral3.rope.scaling.type", s("yarn")),
        ("mistral3.rope.scaling.factor", f(8.0)),
        ("mistral3.rope.scaling.original_context_length", u(16)),
        ("mistral3.rope.scaling.yarn_beta_fast", f(16.0)),
        ("mistral3.rope.scaling.yarn_beta_slow", f(2.0)),
        ("mistral3.rope.scaling.yarn_log_multiplier", f(0.1)),
        ("mistral3.attention.temperature_scale", f(0.2)),
    ];
    // Without the random rope_freqs, so the YaRN angles are what is tested.
    let sh = sharp(&src);
    suite::rewrite(
        &src,
        &file,
        &edit,
        tensors(&sh, vec![("rope_freqs.weight", None)]),
    );
    let plain = scratch("mistral3-plain.gguf");
    suite::rewrite(
        &src,
        &plain,
        &[],
        tensors(&sh, vec![("rope_freqs.weight", None)]),
    );
    check(&dir, &file, Some(&plain), 256);
}

#[test]
fn linear_scaling_on_gemma_3s_global_layers_only() {
    let dir = suite::dir();
    let src = dir.join("seed-1/gemma3-dense.gguf");
    let file = scratch("gemma3-linear.gguf");
    let edit = [
        ("gemma3.rope.scaling.type", s("linear")),
        ("gemma3.rope.scaling.factor", f(8.0)),
        ("gemma3.rope.freq_base", f(1_000_000.0)),
    ];
    let sh = sharp(&src);
    suite::rewrite(&src, &file, &edit, tensors(&sh, vec![]));
    let plain = scratch("gemma3-unscaled.gguf");
    suite::rewrite(&src, &plain, &edit[2..], tensors(&sh, vec![]));
    check(&dir, &file, Some(&plain), 256);
}

#[test]
fn long_rope_takes_long_factors_past_the_original_context_and_short_ones_within() {
    let dir = suite::dir();
    let src = dir.join("seed-1/phi3-dense.gguf");
    let file = scratch("phi3-longrope.gguf");
    let edit = [
        ("phi3.rope.scaling.type", s("longrope")),
        ("phi3.rope.scaling.original_context_length", u(256)),
        ("phi3.rope.scaling.attn_factor", f(1.19)),
    ];
    suite::rewrite(&src, &file, &edit, tensors(&sharp(&src), vec![]));
    // A context of 512 > 256 takes the long factors, one of 256 the short ones (llama.cpp
    // rounds its context up to a multiple of 256 before comparing): both agree with
    // llama.cpp at the same context, and differ from each other.
    let e = check(&dir, &file, None, 512).max(check(&dir, &file, None, 256));
    let ids = ids(&dir);
    let (long, _) = gen_logits(&file, &ids, 50, 512).unwrap();
    let (short, _) = gen_logits(&file, &ids, 50, 256).unwrap();
    assert!(
        nmse(&long, &short) > 100.0 * e,
        "{:.2e}",
        nmse(&long, &short)
    );
}

#[test]
fn partial_rotary_turns_only_the_first_dimensions() {
    let dir = suite::dir();
    let src = dir.join("seed-1/phi2-dense.gguf");
    let file = scratch("phi2-partial.gguf");
    let sh = sharp(&src);
    suite::rewrite(
        &src,
        &file,
        &[("phi2.rope.dimension_count", u(32))],
        tensors(&sh, vec![]),
    );
    let plain = scratch("phi2-whole.gguf");
    suite::rewrite(&src, &plain, &[], tensors(&sh, vec![]));
    check(&dir, &file, Some(&plain), 256);
}

/// A suite model of `arch` sharpened, with `edit` on one copy and `plain` on another: gen
/// agrees with llama.cpp on the first, and the second is far from it.
fn variant(arch: &str, edit: &[(&str, Option<Value>)], plain: &[(&str, Option<Value>)]) {
    let dir = suite::dir();
    let src = dir.join(format!("seed-1/{arch}-dense.gguf"));
    let sh = sharp(&src);
    let file = scratch(&format!("{arch}-variant.gguf"));
    suite::rewrite(&src, &file, edit, tensors(&sh, vec![]));
    let without = scratch(&format!("{arch}-without.gguf"));
    suite::rewrite(&src, &without, plain, tensors(&sh, vec![]));
    check(&dir, &file, Some(&without), 256);
}

#[test]
fn gemma2_soft_caps_on_scores_and_logits() {
    variant(
        "gemma2",
        &[
            ("gemma2.attn_logit_softcapping", f(1.5)),
            ("gemma2.final_logit_softcapping", f(3.0)),
        ],
        &[
            ("gemma2.attn_logit_softcapping", f(1e6)),
            ("gemma2.final_logit_softcapping", f(1e6)),
        ],
    );
}

#[test]
fn gemma3_final_soft_cap() {
    variant(
        "gemma3",
        &[("gemma3.final_logit_softcapping", f(2.0))],
        &[("gemma3.final_logit_softcapping", f(0.0))],
    );
}

#[test]
fn granites_embedding_residual_attention_and_logit_scales() {
    variant(
        "granite",
        &[
            ("granite.embedding_scale", f(2.0)),
            ("granite.residual_scale", f(0.5)),
            ("granite.attention.scale", f(0.03)),
            ("granite.logit_scale", f(4.0)),
        ],
        &[
            ("granite.embedding_scale", None),
            ("granite.residual_scale", None),
            ("granite.attention.scale", None),
            ("granite.logit_scale", f(1.0)),
        ],
    );
}

#[test]
fn cohere2s_logit_scale_and_parallel_blocks() {
    variant(
        "cohere2",
        &[("cohere2.logit_scale", f(0.25))],
        &[("cohere2.logit_scale", f(1.0))],
    );
}

#[test]
fn olmos_clamped_q_k_v() {
    variant(
        "olmo",
        &[("olmo.attention.clamp_kqv", f(0.5))],
        &[("olmo.attention.clamp_kqv", None)],
    );
}

/// A (rows, cols) F32 table, as llama.cpp's {cols, rows} tensor.
fn table(rows: usize, cols: usize, value: impl Fn(usize, usize) -> f32) -> QTensor {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| value(i / cols, i % cols))
        .collect();
    QTensor::quantize(
        &Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap()
}

/// Command R+ (64 layers and more): q and k go through per-head LayerNorms before rope, each
/// head with weights of its own. The suite's two-layer Command R model, sharpened and grown
/// to 64 layers (its two layers repeated), with such weights, different per head; the same
/// file with every weight one is the model without them.
#[test]
fn command_r_plus_per_head_q_and_k_layernorms() {
    let dir = suite::dir();
    let src = dir.join("seed-1/command-r-dense.gguf");
    let per_head = |head: usize, i: usize| {
        if head.is_multiple_of(2) {
            0.2 + (i % 7) as f32 * 0.3
        } else {
            1.5 - (i % 5) as f32 * 0.4
        }
    };
    let file = scratch("command-r-plus.gguf");
    command_r_plus(&src, &file, &per_head);
    let ones = scratch("command-r-plus-ones.gguf");
    command_r_plus(&src, &ones, &|_, _| 1.0);
    check(&dir, &file, Some(&ones), 256);
}

/// `src` (a two-layer Command R) grown to 64 layers without its weight scales, with q/k norm
/// weights `weights(head, i)`, written to `to`.
fn command_r_plus(src: &Path, to: &Path, weights: &dyn Fn(usize, usize) -> f32) {
    let content = gguf_file::Content::read(&mut std::fs::File::open(src).unwrap()).unwrap();
    let key = |k: &str| {
        content.metadata[&format!("command-r.{k}")]
            .to_u32()
            .unwrap() as usize
    };
    let (h, kv, hd) = (
        key("attention.head_count"),
        key("attention.head_count_kv"),
        key("attention.key_length"),
    );
    let mut reader = std::fs::File::open(src).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut grown: Vec<(String, Option<QTensor>)> = Vec::new();
    for l in 0..64 {
        for name in &names {
            let Some(rest) = name.strip_prefix(&format!("blk.{}.", l % 2)) else {
                continue;
            };
            let dropped = rest.ends_with(".scale") || rest.ends_with(".input_scale");
            if l >= 2 && !dropped {
                let t = content.tensor(&mut reader, name, &Device::Cpu).unwrap();
                grown.push((format!("blk.{l}.{rest}"), Some(t)));
            } else if l < 2 && dropped {
                grown.push((name.to_string(), None));
            }
        }
        grown.push((
            format!("blk.{l}.attn_q_norm.weight"),
            Some(table(h, hd, weights)),
        ));
        grown.push((
            format!("blk.{l}.attn_k_norm.weight"),
            Some(table(kv, hd, weights)),
        ));
    }
    let (names, ts): (Vec<String>, Vec<Option<QTensor>>) = grown.into_iter().unzip();
    let tensors: Vec<(&str, Option<QTensor>)> = names.iter().map(String::as_str).zip(ts).collect();
    suite::rewrite(src, to, &[("command-r.block_count", u(64))], tensors);
}

#[test]
fn gpt_neox_parallel_residual() {
    variant(
        "gptneox",
        &[("gptneox.use_parallel_residual", Some(Value::Bool(true)))],
        &[("gptneox.use_parallel_residual", Some(Value::Bool(false)))],
    );
}

/// Hunyuan's `rope.scaling.alpha` raises the rope base (base * alpha^(hd / (hd - 2))).
#[test]
fn hunyuan_rope_alpha() {
    variant(
        "hunyuan-dense",
        &[("hunyuan-dense.rope.scaling.alpha", f(1000.0))],
        &[],
    );
}

/// Hunyuan-A13B's loader applies no `rope.scaling.alpha` (llama.cpp reads the key for every
/// architecture, and only Hunyuan dense and Hunyuan-VL raise their base by it): with the rope
/// made to matter, gen agrees with llama.cpp on a file that has it, and is far from the same
/// file with the raised base gen would take for Hunyuan dense.
#[test]
fn hunyuan_moe_ignores_rope_alpha() {
    let dir = suite::dir();
    let src = dir.join("seed-1/hunyuan-moe-moe.gguf");
    let sh = sharp(&src);
    let file = scratch("hunyuan-moe-alpha.gguf");
    let alpha = [("hunyuan-moe.rope.scaling.alpha", f(1000.0))];
    suite::rewrite(&src, &file, &alpha, tensors(&sh, vec![]));
    let e = check(&dir, &file, None, 256);
    // 1000^(128 / 126) times the suite's base, as Hunyuan dense would turn it.
    let raised = scratch("hunyuan-moe-raised-base.gguf");
    let base = 10_000.0 * 1000f32.powf(128.0 / 126.0);
    let edit = [("hunyuan-moe.rope.freq_base", f(base))];
    suite::rewrite(&src, &raised, &edit, tensors(&sh, vec![]));
    let want = llama_logits(&dir, &file, &ids(&dir), 256);
    let (other, _) = gen_logits(&raised, &ids(&dir), 50, 256).unwrap();
    let apart = nmse(&want, &other);
    eprintln!("with the raised base: {apart:.2e}");
    assert!(apart > 100.0 * e, "the base hardly matters ({apart:.2e})");
}

/// StableLM 2 12B's layers have no FFN norm: attention and the FFN read one normalised input,
/// side by side. The suite's StableLM without its FFN norms, against the same with them.
#[test]
fn stablelm_without_ffn_norms_runs_side_by_side() {
    let dir = suite::dir();
    let src = dir.join("seed-1/stablelm-dense.gguf");
    let sh = sharp(&src);
    let content = gguf_file::Content::read(&mut std::fs::File::open(&src).unwrap()).unwrap();
    let norms: Vec<&str> = content
        .tensor_infos
        .keys()
        .filter(|n| n.contains(".ffn_norm."))
        .map(String::as_str)
        .collect();
    assert!(!norms.is_empty());
    let file = scratch("stablelm-side-by-side.gguf");
    let drop = norms.iter().map(|n| (*n, None)).collect();
    suite::rewrite(&src, &file, &[], tensors(&sh, drop));
    let with = scratch("stablelm-sequential.gguf");
    suite::rewrite(&src, &with, &[], tensors(&sh, vec![]));
    check(&dir, &file, Some(&with), 256);
}

/// An f32 tensor of `shape` with random values up to `a` in size.
fn random_f32(shape: Vec<usize>, seed: u64, a: f32) -> QTensor {
    let count: usize = shape.iter().product();
    let t = Tensor::from_vec(common::data(count, seed, a), shape, &Device::Cpu).unwrap();
    QTensor::quantize(&t, GgmlDType::F32).unwrap()
}

/// The suite's files with experts have two, both used, so nothing is chosen. Here each layer
/// gets eight experts (a router, and gate/up/down stacks of random weights as large as the
/// suite's, with scales where the file has them) of which each token uses two: the softmax,
/// the top two, their weights renormalised or not as the family says, the scales applied or
/// not, the shared expert. The same file with all eight used must be far from llama.cpp's.
fn experts_choose(arch: &str) {
    experts_choose_with(arch, "", &[]);
}

/// [`experts_choose`] with `edit` on both copies (`tag` in their names).
fn experts_choose_with(arch: &str, tag: &str, edit: &[(&str, Option<Value>)]) {
    let dir = suite::dir();
    let src = dir.join(format!("seed-1/{arch}-moe.gguf"));
    let content = gguf_file::Content::read(&mut std::fs::File::open(&src).unwrap()).unwrap();
    let n_layer = content.metadata[&format!("{arch}.block_count")]
        .to_u32()
        .unwrap() as usize;
    let amplitude = |name: &str| -> f32 {
        let t = content
            .tensor(&mut std::fs::File::open(&src).unwrap(), name, &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap();
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().fold(0f32, |a, b| a.max(b.abs()))
    };
    let n = 8;
    let mut names: Vec<String> = Vec::new();
    let mut made: Vec<QTensor> = Vec::new();
    for l in 0..n_layer {
        for (i, part) in [
            "ffn_gate_inp",
            "ffn_gate_exps",
            "ffn_up_exps",
            "ffn_down_exps",
            "exp_probs_b",
            // Gate and up as one stack (Qwen3.5 MoE's and Qwen3-Next's files).
            "ffn_gate_up_exps",
        ]
        .iter()
        .enumerate()
        {
            // Biases on the router and each expert (gpt-oss), or for choosing them
            // (`exp_probs_b`, dots.llm1): (E) or (E, width).
            let name = format!("blk.{l}.{part}.bias");
            if let Some(info) = content.tensor_infos.get(&name) {
                let mut shape = info.shape.dims().to_vec();
                shape[0] = n;
                let a = if i == 0 || i == 4 {
                    1.0
                } else {
                    amplitude(&name)
                };
                made.push(random_f32(shape, (l * 10 + i) as u64 + 55, a));
                names.push(name);
            }
            let name = format!("blk.{l}.{part}.weight");
            let Some(info) = content.tensor_infos.get(&name) else {
                continue;
            };
            let dims = info.shape.dims().to_vec();
            let shape: Vec<usize> = match dims.as_slice() {
                [_, rows, cols] => vec![n, *rows, *cols],
                [_, cols] => vec![n, *cols],
                d => panic!("{name}: {d:?}"),
            };
            let a = if i == 0 { 2.0 } else { amplitude(&name) };
            made.push(random_f32(shape, (l * 10 + i) as u64 + 7, a));
            names.push(name);
            for (j, what) in ["scale", "input_scale"].iter().enumerate() {
                let name = format!("blk.{l}.{part}.{what}");
                if i > 0 && content.tensor_infos.contains_key(&name) {
                    names.push(name);
                    made.push(vector(common::data(n, (l * 10 + i + j) as u64 + 99, 1.0)));
                }
            }
        }
    }
    let file = scratch(&format!("{arch}{tag}-8-experts.gguf"));
    let plain = scratch(&format!("{arch}{tag}-8-experts-all-used.gguf"));
    let count = format!("{arch}.expert_count");
    let used = format!("{arch}.expert_used_count");
    for (to, k) in [(&file, 2), (&plain, 8)] {
        let tensors: Vec<(&str, Option<QTensor>)> = names
            .iter()
            .zip(&made)
            .map(|(n, t)| {
                let t = QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), GgmlDType::F32);
                (n.as_str(), Some(t.unwrap()))
            })
            .collect();
        suite::rewrite(
            &src,
            to,
            &[
                &[(count.as_str(), u(n as u32)), (used.as_str(), u(k))][..],
                edit,
            ]
            .concat(),
            tensors,
        );
    }
    check(&dir, &file, Some(&plain), 256);
}

#[test]
fn qwen3moe_experts_choose_two_of_eight() {
    experts_choose("qwen3moe");
}

#[test]
fn qwen2moe_experts_choose_two_of_eight_beside_the_gated_shared_one() {
    experts_choose("qwen2moe");
}

#[test]
fn olmoe_experts_choose_two_of_eight() {
    experts_choose("olmoe");
}

#[test]
fn mixtral_style_llama_experts_choose_two_of_eight() {
    experts_choose("llama");
}

#[test]
fn granitemoe_experts_choose_two_of_eight_beside_the_shared_one() {
    experts_choose("granitemoe");
}

/// dots.llm1 as published: sigmoid gating, the choice by the sigmoids plus `exp_probs_b`, the
/// weights unbiased, beside the shared expert, after a leading dense layer.
#[test]
fn dots1_experts_choose_two_of_eight_by_biased_sigmoids() {
    experts_choose("dots1");
}

/// dots.llm1 with its other keys set: softmax gating, the weights renormalised and scaled.
#[test]
fn dots1_softmax_gating_renormalised_and_scaled() {
    let edit = [
        ("dots1.expert_gating_func", u(1)),
        ("dots1.expert_weights_norm", Some(Value::Bool(true))),
        ("dots1.expert_weights_scale", f(2.5)),
    ];
    experts_choose_with("dots1", "-softmax", &edit);
}

/// DeepSeek-MoE: softmax, the weights scaled by `expert_weights_scale`, beside the shared
/// expert, after a leading dense layer.
#[test]
fn deepseek_experts_choose_two_of_eight_their_weights_scaled() {
    experts_choose_with(
        "deepseek",
        "-scaled",
        &[("deepseek.expert_weights_scale", f(2.5))],
    );
}

/// gpt-oss: the top two of the biased router logits, weighted by their softmax; every
/// expert's biases.
#[test]
fn gpt_oss_experts_choose_two_of_eight_by_their_biased_logits() {
    experts_choose("gpt-oss");
}

/// gpt-oss's YaRN (as its files have it: factor 32 from 4,096 tokens, here 4 from 16) on
/// every layer, its windowed layers at their own rope base.
#[test]
fn gpt_oss_yarn_and_the_windowed_layers_own_rope_base() {
    let edit = [
        ("gpt-oss.rope.scaling.type", s("yarn")),
        ("gpt-oss.rope.scaling.factor", f(4.0)),
        ("gpt-oss.rope.scaling.original_context_length", u(16)),
        ("gpt-oss.rope.freq_base_swa", f(500.0)),
    ];
    edited("gpt-oss-moe", "gpt-oss-yarn", &edit);
}

/// GLM-4.5: experts chosen by biased sigmoids beside the shared one, after a dense layer.
#[test]
fn glm4moe_experts_choose_two_of_eight_by_biased_sigmoids() {
    experts_choose("glm4moe");
}

/// GLM-4.5's partial rotary (half the head, as its files have it), pairs of halves with
/// multimodal rope sections and without them.
#[test]
fn glm4moe_partial_rotary_with_and_without_sections() {
    let sections = |v: [i32; 4]| Some(Value::Array(v.iter().map(|&x| Value::I32(x)).collect()));
    let halves = [
        ("glm4moe.rope.dimension_count", u(64)),
        ("glm4moe.rope.dimension_sections", sections([16, 16, 0, 0])),
    ];
    edited("glm4moe-moe", "glm4moe-partial-halves", &halves);
    let no_sections = [
        ("glm4moe.rope.dimension_count", u(64)),
        ("glm4moe.rope.dimension_sections", None),
    ];
    edited("glm4moe-moe", "glm4moe-partial-no-sections", &no_sections);
}

/// Hunyuan-A13B: softmax routing renormalised, beside the shared expert every layer has.
#[test]
fn hunyuan_moe_experts_choose_two_of_eight_beside_the_shared_one() {
    experts_choose("hunyuan-moe");
}

/// MiniMax-M2 as published: sigmoid gating with the selection bias, renormalised, after
/// whole-projection q/k norms and half of each head rotating.
#[test]
fn minimax_m2_experts_choose_two_of_eight_by_biased_sigmoids() {
    let half = [("minimax-m2.rope.dimension_count", u(64))];
    experts_choose_with("minimax-m2", "-half-rotary", &half);
}

/// K-EXAONE: a window of 8 on every other layer (the suite's two layers are both windowed by
/// the default pattern of four), the full layer turning nothing, eight experts of which two
/// chosen by biased sigmoids beside the shared one, after the leading dense layer.
#[test]
fn exaone_moe_experts_choose_with_windowed_and_unrotated_layers() {
    let edit = [
        ("exaone-moe.attention.sliding_window", u(8)),
        ("exaone-moe.attention.sliding_window_pattern", u(2)),
    ];
    experts_choose_with("exaone-moe", "-windows", &edit);
}

/// Phi-3.5-MoE: softmax routing, the two chosen renormalised, around RMS norms with biases.
#[test]
fn phimoe_experts_choose_two_of_eight() {
    experts_choose("phimoe");
}

/// ERNIE 4.5 with experts: softmax routing, the two chosen renormalised, the selection bias
/// (`exp_probs_b`) where the file has one, beside the shared expert.
/// LFM2 MoE: short convolutions beside attention, experts chosen by the file's gating with a
/// selection bias, renormalised.
#[test]
fn lfm2moe_experts_choose_two_of_eight() {
    experts_choose("lfm2moe");
}

/// Qwen3.5 MoE and Qwen3-Next: DeltaNet beside gated attention, gate and up of each expert in
/// one stack, softmax routing renormalised beside the gated shared expert.
#[test]
fn qwen35moe_and_qwen3next_experts_choose_two_of_eight() {
    experts_choose("qwen35moe");
    experts_choose("qwen3next");
}

#[test]
fn ernie4_5_moe_experts_choose_two_of_eight() {
    experts_choose("ernie4_5-moe");
}

/// Group-limited routing (DeepSeek-V3, Ling 2.0): eight experts in four groups of two, a token
/// choosing its two among the two groups whose best two score highest. Against llama.cpp, and
/// far from the same file routed without groups.
#[test]
fn experts_choose_within_their_best_groups() {
    let groups = [
        ("dots1.expert_group_count", u(4)),
        ("dots1.expert_group_used_count", u(2)),
    ];
    experts_choose_with("dots1", "-groups", &groups);
    let dir = suite::dir();
    let grouped = scratch("dots1-groups-8-experts.gguf");
    let ungrouped = scratch("dots1-groups-removed.gguf");
    let removed = [
        ("dots1.expert_group_count", None),
        ("dots1.expert_group_used_count", None),
    ];
    suite::rewrite(&grouped, &ungrouped, &removed, Vec::new());
    let want = llama_logits(&dir, &grouped, &ids(&dir), 256);
    let (other, _) = gen_logits(&ungrouped, &ids(&dir), 50, 256).unwrap();
    let apart = nmse(&want, &other);
    eprintln!("without groups: {apart:.2e}");
    assert!(
        apart > 1e-4,
        "groups hardly change the choice ({apart:.2e})"
    );
}

/// Routing settings llama.cpp would run differently or not at all are refused in one line that
/// names the key: an ERNIE 4.5 layer after the dense ones left without experts (llama.cpp loads
/// no dense FFN there), gating 0 (its graph aborts) and 4 (square root of softplus), and as
/// many expert groups as experts (llama.cpp's loader asserts).
#[test]
fn unsupported_routing_is_refused_in_one_line() {
    let dir = suite::dir();
    let cases: [(&str, &str, Option<Value>); 4] = [
        ("ernie4_5-moe", "interleave_moe_layer_step", u(3)),
        ("dots1", "expert_gating_func", u(0)),
        ("dots1", "expert_gating_func", u(4)),
        ("qwen3moe", "expert_group_count", u(2)),
    ];
    for (arch, key, value) in cases {
        let src = dir.join(format!("seed-1/{arch}-moe.gguf"));
        let file = scratch(&format!("{arch}-{key}-refused.gguf"));
        let full = format!("{arch}.{key}");
        suite::rewrite(&src, &file, &[(full.as_str(), value)], Vec::new());
        let e = match gen_logits(&file, &ids(&dir), 20, 256) {
            Ok(_) => panic!("{full}: ran"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.contains(&full) && !e.contains('\n'), "{full}: {e}");
    }
}

/// Qwen3-VL's interleaved multimodal rope on text: the suite's sections ([32, 32, 32, 32] of
/// 64 pairs) turn every pair, so here [8, 8, 8, 8] deals pairs 24-31 and 56-63 to the fourth
/// section, which a text token's position does not turn (against llama.cpp, and far from the
/// file where they turn), and the published [24, 20, 20, 0] (pairs 61 and 62 still) agrees.
#[test]
fn qwen3vl_text_rope_leaves_the_fourth_sections_pairs_still() {
    let sections = |v: [i32; 4]| Some(Value::Array(v.iter().map(|&x| Value::I32(x)).collect()));
    let quarters = [("qwen3vl.rope.dimension_sections", sections([8, 8, 8, 8]))];
    edited("qwen3vl-dense", "qwen3vl-sections-8", &quarters);
    let dir = suite::dir();
    for stem in ["qwen3vl-dense", "qwen3vlmoe-moe"] {
        let arch = stem.split('-').next().unwrap();
        let src = dir.join(format!("seed-1/{stem}.gguf"));
        let file = scratch(&format!("{stem}-published-sections.gguf"));
        let key = format!("{arch}.rope.dimension_sections");
        let edit = [(key.as_str(), sections([24, 20, 20, 0]))];
        suite::rewrite(&src, &file, &edit, tensors(&sharp(&src), vec![]));
        check(&dir, &file, None, 256);
    }
}

/// A GLM-4.5 file ending in a multi-token prediction block (`nextn_predict_layers` 1: a
/// third block holding a layer's tensors and the `nextn.*` ones), which llama.cpp skips: gen
/// skips it too and agrees; as a plain block it would change the logits.
#[test]
fn glm4moe_skips_its_multi_token_prediction_block() {
    skips_its_prediction_block("glm4moe", &[], 1);
}

/// Ling 2.0's prediction block, which also holds a `layer_output_norm`.
#[test]
fn bailingmoe2_skips_its_multi_token_prediction_block() {
    skips_its_prediction_block("bailingmoe2", &["layer_output_norm"], 1);
}

/// K-EXAONE's prediction block, whose FFN is dense (as its first layer's).
#[test]
fn exaone_moe_skips_its_multi_token_prediction_block() {
    skips_its_prediction_block("exaone-moe", &[], 0);
}

/// `{arch}-moe` with a third block (layer `from`'s tensors, the `nextn.*` ones and `norms`,
/// vectors of the width) marked as a prediction block: against llama.cpp, and (where the block
/// copies the last layer) far from the file where the block runs as a layer.
fn skips_its_prediction_block(arch: &str, norms: &[&str], from: usize) {
    let dir = suite::dir();
    let src = dir.join(format!("seed-1/{arch}-moe.gguf"));
    let mut f = std::fs::File::open(&src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut extra: Vec<(String, QTensor)> = Vec::new();
    // A layer's tensors without the per-tensor scales, which llama.cpp reads for the trunk's
    // layers only (as real files have them).
    for name in content
        .tensor_infos
        .keys()
        .filter(|n| n.starts_with(&format!("blk.{from}.")) && !n.contains("scale"))
    {
        let t = content.tensor(&mut f, name, &Device::Cpu).unwrap();
        extra.push((name.replacen(&format!("blk.{from}."), "blk.2.", 1), t));
    }
    let d = 256;
    extra.push((
        "blk.2.nextn.eh_proj.weight".into(),
        random_f32(vec![d, 2 * d], 3, 0.05),
    ));
    let vectors = ["nextn.enorm", "nextn.hnorm"].iter().chain(norms);
    for (i, n) in vectors.enumerate() {
        extra.push((
            format!("blk.2.{n}.weight"),
            random_f32(vec![d], 4 + i as u64, 1.0),
        ));
    }
    let file = scratch(&format!("{arch}-mtp.gguf"));
    let (count, nextn) = (
        format!("{arch}.block_count"),
        format!("{arch}.nextn_predict_layers"),
    );
    let edit = [(count.as_str(), u(3)), (nextn.as_str(), u(1))];
    // llama.cpp's loader miscounts a shared `rope_freqs` in a skipped block ("too many tensors
    // created"): without it.
    let tensors = extra
        .iter()
        .map(|(n, t)| (n.as_str(), Some(copy(t))))
        .chain((from == 0).then_some(("rope_freqs.weight", None)))
        .collect();
    suite::rewrite(&src, &file, &edit, tensors);
    let e = check(&dir, &file, None, 256);
    if from != 1 {
        return;
    }
    // The same three blocks run as layers: far from it.
    let plain = scratch(&format!("{arch}-three-layers.gguf"));
    let tensors: Vec<(&str, Option<QTensor>)> = extra
        .iter()
        .filter(|(n, _)| !n.contains("nextn") && !norms.iter().any(|m| n.contains(m)))
        .map(|(n, t)| (n.as_str(), Some(copy(t))))
        .collect();
    suite::rewrite(&src, &plain, &[(count.as_str(), u(3))], tensors);
    let want = llama_logits(&dir, &file, &ids(&dir), 256);
    let (other, _) = gen_logits(&plain, &ids(&dir), 50, 256).unwrap();
    let apart = nmse(&want, &other);
    assert!(apart > 100.0 * e, "three layers are as near ({apart:.2e})");
}

/// llama.cpp's Ling 2.0 loader reads q, k and v only as one `attn_qkv`: a file with them apart
/// is refused in one line naming the missing tensor.
#[test]
fn bailingmoe2_with_q_k_v_apart_is_refused() {
    let dir = suite::dir();
    let src = dir.join("seed-1/bailingmoe2-moe.gguf");
    let file = scratch("bailingmoe2-qkv-apart.gguf");
    let parts: Vec<(String, QTensor)> = ["attn_q", "attn_k", "attn_v"]
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                format!("blk.0.{n}.weight"),
                random_f32(vec![256, 256], 30 + i as u64, 0.05),
            )
        })
        .collect();
    let gone: Vec<String> = ["attn_qkv.weight", "attn_qkv.scale", "attn_qkv.input_scale"]
        .iter()
        .map(|n| format!("blk.0.{n}"))
        .collect();
    let tensors: Vec<(&str, Option<QTensor>)> = parts
        .iter()
        .map(|(n, t)| (n.as_str(), Some(copy(t))))
        .chain(gone.iter().map(|n| (n.as_str(), None)))
        .collect();
    suite::rewrite(&src, &file, &[], tensors);
    let e = match gen_logits(&file, &ids(&dir), 20, 256) {
        Ok(_) => panic!("ran"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("blk.0.attn_qkv.weight") && !e.contains('\n'),
        "{e}"
    );
}

/// Ling 2.0 as published: half of each head rotates, eight experts in four groups of which a
/// token's two come from the best two, sigmoid-gated with a selection bias, beside the shared
/// expert, after a leading dense layer.
#[test]
fn bailingmoe2_experts_choose_within_groups_with_partial_rotary() {
    let edit = [
        ("bailingmoe2.rope.dimension_count", u(64)),
        ("bailingmoe2.expert_group_count", u(4)),
        ("bailingmoe2.expert_group_used_count", u(2)),
        ("bailingmoe2.expert_weights_norm", Some(Value::Bool(true))),
        ("bailingmoe2.expert_weights_scale", f(2.5)),
    ];
    experts_choose_with("bailingmoe2", "-published", &edit);
}

/// A copy of an f32 tensor (QTensor is not Clone).
fn copy(t: &QTensor) -> QTensor {
    QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), GgmlDType::F32).unwrap()
}
