//! DeepSeek-style mixtures of experts with ordinary attention: leading dense layers, then
//! routed experts beside shared ones whose width is `expert_shared_count` experts' — DeepSeek-MoE
//! (`deepseek`: DeepSeek-MoE 16B, llama's attention, softmax gating, weights scaled by
//! `expert_weights_scale`) and dots.llm1 (`dots1`: Qwen3's attention with per-head q/k norms,
//! the file's `expert_gating_func` (sigmoid in the published files) with a selection bias
//! (`exp_probs_b`), weights renormalised and scaled as its keys say). DeepSeek-V2/V3's
//! latent attention (`deepseek2`) is not here: refused as an architecture. Ling 2.0
//! (`bailingmoe2`) routes the same way, with fused q/k/v and shared experts of their own width.

use anyhow::{bail, Result};

use super::{rope_sections, swa_layers, Common, ExpertWidth};
use crate::model::config::{
    DecoderConfig, Gating, Keys, MoeCfg, Need, NormKind, NormRule, Output, QkNorm, RopeFactors,
    RopePairs, SharedExpert, TensorRules,
};

/// The experts past `leading_dense_block_count`, with `expert_shared_count` shared ones and
/// the chosen weights scaled by `expert_weights_scale`, as these loaders read them: the shared
/// ones as wide as `shared_ff` each (the experts' width where None).
fn experts_with(
    k: &Keys,
    c: &Common,
    norm: bool,
    gating: Gating,
    shared_ff: Option<usize>,
) -> Result<MoeCfg> {
    let ff = shared_ff.unwrap_or(k.usize("expert_feed_forward_length")?);
    let shared = k.usize("expert_shared_count")?;
    if shared == 0 {
        bail!(
            "{}.expert_shared_count is 0: its layers with experts have shared ones",
            c.arch
        );
    }
    let moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        norm,
        false,
        Need::Required,
        SharedExpert::Plain { ff: ff * shared },
    )?;
    let mut m = c.with_experts(moe)?;
    m.gating = gating;
    m.weights_scale = k.f32_or("expert_weights_scale", 0.0)?;
    m.dense_lead = k.usize_or("leading_dense_block_count", 0)?;
    Ok(m)
}

/// [`experts_with`] shared experts as wide as the routed ones.
fn experts(k: &Keys, c: &Common, norm: bool, gating: Gating) -> Result<MoeCfg> {
    experts_with(k, c, norm, gating, None)
}

/// Ling 2.0 (Ling-mini-2.0 16B-A1.4B, Ling-flash-2.0; `bailingmoe2`), as llama.cpp's loader reads
/// it: q, k and v in one matrix without biases, per-head q/k norms before rope (partial rotary
/// pairing halves), its own output layer; leading dense layers, then experts gated by the
/// file's `expert_gating_func` with an optional selection bias, group-limited where the file
/// says, beside `expert_shared_count` shared ones of `expert_shared_feed_forward_length` (else
/// the experts' width). Its multi-token prediction layers are skipped.
pub fn bailingmoe2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qkv_bias: Need::Absent,
        fused_qkv: true,
        qk_norm: Need::Required,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    let gating = c.gating(k)?;
    let shared_ff = match k.usize_or("expert_shared_feed_forward_length", 0)? {
        0 => None,
        ff => Some(ff),
    };
    let norm = k.bool_or("expert_weights_norm", false)?;
    let mut m = experts_with(k, &c, norm, gating, shared_ff)?;
    m.selection_bias = Need::Optional;
    d.moe = Some(m);
    Ok(d)
}

/// DeepSeek-MoE (16B), as llama.cpp's `deepseek` loader reads it: llama's attention (q/k/v
/// biases optional, no rope factors), softmax gating, weights not renormalised.
pub fn deepseek(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        output: Output::TiedIfAbsent,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)?;
    d.moe = Some(experts(k, &c, false, Gating::Softmax)?);
    Ok(d)
}

/// dots.llm1, as llama.cpp's `dots1` loader reads it.
pub fn dots1(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    c.whole_heads_rotate()?;
    let gating = c.gating(k)?;
    let mut m = experts(k, &c, k.bool_or("expert_weights_norm", false)?, gating)?;
    m.selection_bias = Need::Optional;
    d.moe = Some(m);
    Ok(d)
}

/// GLM-4.5, GLM-4.5-Air, GLM-4.6 (`glm4moe`), as llama.cpp's `glm4moe` loader reads it: q/k/v
/// biases, per-head q/k norms where the file has them, partial rotary pairing halves (with
/// multimodal rope sections or without: text positions turn every section alike); the FFN
/// norm under the name `post_attention_norm`; leading dense layers, then sigmoid-gated experts
/// (unless the file says otherwise) with a selection bias beside shared experts. Its
/// multi-token prediction block is skipped (`nextn_predict_layers`).
pub fn glm4moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    rope_sections(k, &c)?;
    let tensors = TensorRules {
        qk_norm: Need::Optional,
        ffn_norm_name: "post_attention_norm",
        output: Output::TiedIfAbsent,
        ..TensorRules::PLAIN
    };
    debug_assert!(matches!(tensors.ffn_norm, NormRule::Weighted { .. }));
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    // llama.cpp reads "none" (0, or no key) as sigmoid for this family.
    let gating = match k.usize_or("expert_gating_func", 0)? {
        0 => Gating::Sigmoid,
        _ => c.gating(k)?,
    };
    let mut m = experts(k, &c, k.bool_or("expert_weights_norm", false)?, gating)?;
    m.selection_bias = Need::Required;
    d.moe = Some(m);
    Ok(d)
}

/// K-EXAONE / EXAONE MoE (`exaone-moe`), as llama.cpp's loader reads it: per-head q/k norms,
/// rope (with `rope_freqs` where the file has them) on the windowed layers only, three of four
/// windowed by `attention.sliding_window` (all at the full layers' base: llama.cpp's graph
/// passes it to both); leading dense layers, then experts by the file's `expert_gating_func`
/// with an optional selection bias beside one shared expert of
/// `expert_shared_feed_forward_length` (else the experts' width). Its prediction layers are
/// skipped.
pub fn exaone_moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        output: Output::Own,
        rope_factors: RopeFactors::Freqs,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    c.whole_heads_rotate()?;
    let swa = swa_layers(k, &c, 4)?;
    let window = k.usize("attention.sliding_window")?;
    d.set_windows(window, &swa, None);
    d.rope_on_windows_only();
    let ff = k.usize("expert_feed_forward_length")?;
    let shared = match k.usize_or("expert_shared_feed_forward_length", 0)? {
        0 => ff,
        n => n,
    };
    let moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        k.bool_or("expert_weights_norm", false)?,
        false,
        Need::Required,
        SharedExpert::Plain { ff: shared },
    )?;
    let mut m = c.with_experts(moe)?;
    m.gating = c.gating(k)?;
    m.selection_bias = Need::Optional;
    m.weights_scale = k.f32_or("expert_weights_scale", 0.0)?;
    m.dense_lead = k.usize_or("leading_dense_block_count", 0)?;
    d.moe = Some(m);
    Ok(d)
}
