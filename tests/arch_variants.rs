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
            out.push((
                name.clone(),
                Some(vector(vec![1.0; info.shape.elem_count()])),
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
        .map(|(n, t)| {
            (
                n.as_str(),
                t.as_ref()
                    .map(|t| vector(t.dequantize(&Device::Cpu).unwrap().to_vec1().unwrap())),
            )
        })
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
    let dir = suite::dir();
    let src = dir.join("seed-1/qwen2-dense.gguf");
    let file = scratch("qwen2-yarn.gguf");
    let edit = [
        ("qwen2.rope.scaling.type", s("yarn")),
        ("qwen2.rope.scaling.factor", f(4.0)),
        ("qwen2.rope.scaling.original_context_length", u(16)),
    ];
    let sh = sharp(&src);
    suite::rewrite(&src, &file, &edit, tensors(&sh, vec![]));
    let plain = scratch("qwen2-plain.gguf");
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
