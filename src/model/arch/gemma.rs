//! Gemma, Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(d), a GELU-gated FFN, tied
//! output; Gemma 2 and 3 add norms after attention and the FFN and sliding windows, Gemma 2
//! soft-caps scores and logits, Gemma 3 norms each head's q and k; Gemma 4's layers differ
//! in shape and may share their cache.

use anyhow::{bail, Context, Result};

use super::{swa_layers, Common, ExpertWidth};
use crate::model::config::{
    Activation, DecoderConfig, HeadShape, Keys, Need, NormKind, NormRule, Output, QkNorm,
    RopeFactors, RopePairs, SharedExpert, TensorRules,
};

fn gemma_decoder(k: &Keys, c: &Common, tensors: TensorRules) -> Result<DecoderConfig> {
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.embed_scale = Some((c.d_model as f32).sqrt());
    d.activation = Activation::GeluTanh;
    Ok(d)
}

/// Gemma 2 and 3 scale q by 1/sqrt(hd), and their 27B models by 1/sqrt(d / h) (gemma_pytorch).
fn gemma_attn_scale(c: &Common, layers_27b: usize) -> f32 {
    let width = match c.n_layer == layers_27b {
        true => c.d_model / c.n_head,
        false => c.head_dim,
    };
    1.0 / (width as f32).sqrt()
}

const SANDWICH: TensorRules = TensorRules {
    post_attn_norm: NormRule::Weighted { bias: Need::Absent },
    post_ffn_norm: NormRule::Weighted { bias: Need::Absent },
    ..TensorRules::PLAIN
};

/// Gemma (1).
pub fn gemma(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        output: Output::Tied,
        ..TensorRules::PLAIN
    };
    gemma_decoder(k, &c, tensors)
}

/// Gemma 2: alternating windowed and global layers, soft-capped scores and logits.
pub fn gemma2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let swa = swa_layers(k, &c, 2)?;
    let base_swa = k.f32_or("rope.freq_base_swa", c.rope_base)?;
    let window = k.usize_or("attention.sliding_window", 4096)?;
    let attn_cap = k.f32_or("attn_logit_softcapping", 50.0)?;
    let final_cap = k.f32_or("final_logit_softcapping", 30.0)?;
    for (key, cap) in [
        ("attn_logit_softcapping", attn_cap),
        ("final_logit_softcapping", final_cap),
    ] {
        if cap <= 0.0 {
            bail!("{}.{key} is {cap}: Gemma 2 divides by it", c.arch);
        }
    }
    let tensors = TensorRules {
        output: Output::Tied,
        ..SANDWICH
    };
    let mut d = gemma_decoder(k, &c, tensors)?;
    d.attn.scale = gemma_attn_scale(&c, 46);
    d.attn.softcap = Some(attn_cap);
    d.final_softcap = Some(final_cap);
    // Windowed layers rotate at their own base, with the file's own scale (not the context's).
    let local = crate::model::rope::RopeCfg {
        base: base_swa,
        freq_scale: c.freq_scale,
        ..d.ropes[0]
    };
    d.set_windows(window, &swa, Some(local));
    Ok(d)
}

/// Gemma 3 (text, every size): five windowed layers to one global where the file has a
/// window; windowed layers rotate at base 10,000 unscaled, global ones as the file says
/// (linear scaling on the 4B, 12B and 27B).
pub fn gemma3(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        // An embedding model's projections (EmbeddingGemma): not part of generation.
        ignored: &["dense_2.weight", "dense_3.weight"],
        ..SANDWICH
    };
    let final_cap = k.f32_or("final_logit_softcapping", 0.0)?;
    let mut d = gemma_decoder(k, &c, tensors)?;
    d.attn.scale = gemma_attn_scale(&c, 62);
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    if final_cap > 0.0 {
        d.final_softcap = Some(final_cap);
    }
    if let Some(window) = k.usize_opt("attention.sliding_window")?.filter(|&w| w > 0) {
        let swa = swa_layers(k, &c, 6)?;
        let local = crate::model::rope::RopeCfg {
            base: k.f32_or("rope.freq_base_swa", 10_000.0)?,
            freq_scale: 1.0,
            factors: crate::model::rope::Factors::None,
            ..d.ropes[0]
        };
        d.set_windows(window, &swa, Some(local));
    }
    Ok(d)
}

/// Gemma 4 (31B, E2B, E4B, and 26B-A4B's experts beside a dense FFN): windowed and global
/// layers of their own head widths and kv heads, q/k norms per head and v normed without
/// weights, attention unscaled, v taken from k's projection where a layer has no `attn_v`, the
/// global layers' partial rotation through `rope_freqs`, the last `shared_kv_layers` reading
/// the cache of the last earlier layer of their kind, per-layer inputs (E2B, E4B) and output
/// factors, and logits soft-capped (at 30 where the file does not say).
pub fn gemma4(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let n = c.n_layer;
    let swa = k
        .layer_flags("attention.sliding_window_pattern", n)?
        .with_context(|| {
            format!(
                "{}.attention.sliding_window_pattern (one flag per layer) is missing",
                c.arch
            )
        })?;
    let window = k.usize("attention.sliding_window")?;
    let hd_swa = k.usize("attention.key_length_swa")?;
    if k.usize("attention.value_length_swa")? != hd_swa {
        bail!(
            "{}: value_length_swa differs from key_length_swa, which Gemma 4 requires equal",
            c.arch
        );
    }
    let rot_swa = k.usize_or("rope.dimension_count_swa", c.n_rot)?;
    if rot_swa == 0 || rot_swa > hd_swa || rot_swa % 2 != 0 {
        bail!("{}.rope.dimension_count_swa {rot_swa} must be even and at most the windowed layers' head width {hd_swa}", c.arch);
    }
    let shared = k.usize_or("attention.shared_kv_layers", 0)?;
    let kv_start = n.checked_sub(shared).filter(|&s| shared == 0 || s >= 2).with_context(|| {
        format!("{}.attention.shared_kv_layers {shared} leaves fewer than 2 of {n} layers their own cache", c.arch)
    })?;
    let tensors = TensorRules {
        qk_norm: Need::Required,
        // llama.cpp's loader creates no q/k/v biases for Gemma 4, and its graph applies the
        // FFN's per-tensor scales.
        qkv_bias: Need::Absent,
        ffn_scales: true,
        values: Need::Optional,
        layer_out_scale: Need::Optional,
        rope_factors: RopeFactors::FreqsRequired,
        ..SANDWICH
    };
    let mut d = gemma_decoder(k, &c, tensors)?;
    d.attn.scale = 1.0;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    d.attn.v_norm = true;
    d.final_softcap = Some(k.f32_or("final_logit_softcapping", 30.0)?).filter(|&f| f != 0.0);
    d.per_layer_input = k.usize("embedding_length_per_layer_input")?;
    // 26B-A4B: softmax-routed GELU experts, their weights renormalised, beside each layer's
    // dense FFN.
    d.moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        true,
        true,
        Need::Required,
        SharedExpert::Beside,
    )?;
    let local = crate::model::rope::RopeCfg {
        n_rot: rot_swa,
        base: k.f32_or("rope.freq_base_swa", 10_000.0)?,
        freq_scale: 1.0,
        factors: crate::model::rope::Factors::None,
        ..d.ropes[0]
    };
    d.set_windows(window, &swa, Some(local));
    for (l, plan) in d.layers.iter_mut().enumerate() {
        let kv_heads = c.kv_heads.get(l).copied().unwrap_or(c.n_kv_head);
        let dim = if swa[l] { hd_swa } else { c.head_dim };
        if kv_heads == 0 || c.n_head % kv_heads != 0 {
            bail!(
                "{}: layer {l} has {kv_heads} kv heads for {} heads",
                c.arch,
                c.n_head
            );
        }
        plan.heads = HeadShape {
            heads: c.n_head,
            kv_heads,
            dim,
        };
        if l >= kv_start {
            plan.kv_from = Some(kv_start - if swa[l] { 2 } else { 1 });
        }
    }
    for l in kv_start..n {
        let from = d.layers[l].kv_from.expect("set above");
        let (a, b) = (&d.layers[l], &d.layers[from]);
        if a.heads != b.heads || a.window != b.window {
            bail!(
                "{}: layer {l} would read layer {from}'s cache, which is of another kind",
                c.arch
            );
        }
    }
    Ok(d)
}
