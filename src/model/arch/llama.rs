//! Llama and the architectures llama.cpp builds as Llama with small changes: Mistral 3,
//! Granite, MiniCPM, SmolLM3, Arcee, EXAONE, InternLM2, XVERSE, Maincoder, Nanbeige, Seed-OSS,
//! Deci, openPangu Embedded, Hunyuan (dense).

use anyhow::{bail, Result};

use super::{rope_sections, Common, ExpertWidth, Scaling};
use crate::model::config::{
    Activation, DecoderConfig, Keys, Need, NormKind, QkNorm, RopeFactors, RopePairs, SharedExpert,
    TensorRules,
};

/// llama.cpp's tensors for a llama: rope factors long and short for long-rope files,
/// `rope_freqs` otherwise.
fn llama_tensors(c: &Common) -> TensorRules {
    TensorRules {
        rope_factors: match c.scaling {
            Scaling::LongRope => RopeFactors::LongShort,
            _ => RopeFactors::Freqs,
        },
        ..TensorRules::LLAMA
    }
}

/// Llama 2 and 3 (3.1, 3.2 and 3.3 with their `rope_freqs`), TinyLlama, SmolLM2, Mistral 7B,
/// the DeepSeek-R1 Llama distills.
/// With experts (Mixtral and llama files with `ffn_*_exps`): the chosen weights renormalised,
/// the experts' scales applied, `ffn_gate_exps` optional.
pub fn llama(k: &Keys, c: Common) -> Result<DecoderConfig> {
    c.whole_heads_rotate()?;
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, llama_tensors(&c))?;
    d.moe = llama_experts(k, &c)?;
    Ok(d)
}

/// llama.cpp's llama graph's experts (also Mistral 3's).
fn llama_experts(k: &Keys, c: &Common) -> Result<Option<crate::model::config::MoeCfg>> {
    let (w, none) = (ExpertWidth::FeedForward, SharedExpert::None);
    c.moe(k, w, true, true, Need::Optional, none)
}

/// Granite's graph's experts (Granite MoE, MiniCPM MoE): renormalised, scales not applied,
/// `ffn_gate_exps` optional; a shared expert added where the file gives it a width (`shared`).
fn granite_experts(
    k: &Keys,
    c: &Common,
    shared: bool,
) -> Result<Option<crate::model::config::MoeCfg>> {
    let ff = k.usize_or("expert_shared_feed_forward_length", 0)?;
    let shared = match ff {
        n if shared && n > 0 => SharedExpert::Plain { ff: n },
        _ => SharedExpert::None,
    };
    c.moe(
        k,
        ExpertWidth::FeedForward,
        true,
        false,
        Need::Optional,
        shared,
    )
}

/// Ministral 3 / Devstral Small 2 (dense): Llama with YaRN's beta range and log multiplier
/// read from the file, and an attention temperature that grows with the position.
pub fn mistral3(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let beta = (
        k.f32_or("rope.scaling.yarn_beta_fast", 32.0)?,
        k.f32_or("rope.scaling.yarn_beta_slow", 1.0)?,
    );
    let log_mul = k.f32_or("rope.scaling.yarn_log_multiplier", 0.0)?;
    let temperature = k.f32_or("attention.temperature_scale", 0.0)?;
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, llama_tensors(&c))?;
    d.moe = llama_experts(k, &c)?;
    d.ropes[0] = c.rope(beta, log_mul);
    if temperature != 0.0 {
        d.attn.temperature = Some((temperature, c.n_ctx_orig as f32, 0.0));
    }
    Ok(d)
}

/// IBM Granite 3 (dense): scales on the embeddings, the residual branches, attention and
/// (dividing) the logits; rope only where `rope.scaling.finetuned` is not false.
pub fn granite(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let mut d = granite_scaled(k, &c)?;
    if !k.bool_or("rope.scaling.finetuned", true)? {
        for l in &mut d.layers {
            l.rope = None;
        }
    }
    Ok(d)
}

/// Granite MoE (Granite 3 MoE, Granite 4 tiny's dense-attention MoE): Granite's scales and
/// experts, rope on every layer (llama.cpp does not read `rope.scaling.finetuned` for it).
pub fn granitemoe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    granite_scaled(k, &c)
}

/// Granite's graph with its scales and experts.
fn granite_scaled(k: &Keys, c: &Common) -> Result<DecoderConfig> {
    let logit_scale = k.f32("logit_scale")?;
    let mut d = granite_like(k, c, logit_scale)?;
    d.moe = granite_experts(k, c, true)?;
    granite_scales(k, &mut d)?;
    Ok(d)
}

/// Granite's residual, embedding and attention scales, each where the file has one (0: none).
pub(super) fn granite_scales(k: &Keys, d: &mut DecoderConfig) -> Result<()> {
    if let Some(s) = k.f32_opt("residual_scale")?.filter(|&s| s != 0.0) {
        d.residual_scale = Some(s);
    }
    if let Some(s) = k.f32_opt("embedding_scale")?.filter(|&s| s != 0.0) {
        d.embed_scale = Some(s);
    }
    if let Some(s) = k.f32_opt("attention.scale")?.filter(|&s| s != 0.0) {
        d.attn.scale = s;
    }
    Ok(())
}

/// MiniCPM: Granite's graph with MiniCPM's defaults for its scales.
pub fn minicpm(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let logit_scale = k.f32_or("logit_scale", 256.0 / c.d_model as f32)?;
    let mut d = granite_like(k, &c, logit_scale)?;
    d.moe = granite_experts(k, &c, false)?;
    d.embed_scale = Some(k.f32_or("embedding_scale", 12.0)?);
    d.residual_scale = Some(k.f32_or("residual_scale", 1.4 / (c.n_layer as f32).sqrt())?);
    Ok(d)
}

fn granite_like(k: &Keys, c: &Common, logit_scale: f32) -> Result<DecoderConfig> {
    if logit_scale == 0.0 {
        bail!(
            "{}.logit_scale is 0: the logits would be divided by it",
            c.arch
        );
    }
    let tensors = TensorRules {
        ffn_scales: false,
        ..llama_tensors(c)
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)?;
    d.logit_scale = Some(1.0 / logit_scale);
    Ok(d)
}

/// SmolLM3: Llama without rope on every fourth layer.
pub fn smollm3(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, TensorRules::PLAIN)?;
    for (l, plan) in d.layers.iter_mut().enumerate() {
        if (l + 1) % 4 == 0 {
            plan.rope = None;
        }
    }
    Ok(d)
}

/// Arcee (AFM): an FFN of relu(up)² without a gate.
pub fn arcee(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_gate: Need::Absent,
        rope_factors: RopeFactors::Freqs,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)?;
    d.gated = false;
    d.activation = Activation::ReluSquared;
    Ok(d)
}

/// EXAONE 3: Llama with halves-paired rope.
pub fn exaone(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        rope_factors: RopeFactors::Freqs,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)
}

/// InternLM2 and XVERSE: Llama with an output layer of its own.
pub fn internlm2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        output: crate::model::config::Output::Own,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)
}

/// Maincoder: per-head RMS norms of q and k after rope.
pub fn maincoder(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: true };
    Ok(d)
}

/// Nanbeige: Llama whose layers may run in loops; gen runs the one-loop files.
pub fn nanbeige(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let loops = k.usize_or("num_loops", 1)?;
    if loops != 1 {
        bail!(
            "{}.num_loops is {loops}: looped layers are not supported",
            c.arch
        );
    }
    let tensors = TensorRules {
        ffn_bias: Need::Optional,
        ffn_scales: true,
        rope_factors: RopeFactors::Freqs,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)
}

/// Seed-OSS: Llama with halves-paired rope, whose FFN norm is stored as
/// `post_attention_norm`.
pub fn seed_oss(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_norm_name: "post_attention_norm",
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)
}

/// Deci (Llama-3.1-Nemotron): Llama with optional biases on attention's output and the FFN,
/// the FFN's weight scales not applied; files whose layers differ (no attention, or no FFN,
/// in some) are refused where the per-layer keys are read.
pub fn deci(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_scales: false,
        ..llama_tensors(&c)
    };
    c.whole_heads_rotate()?;
    c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)
}

/// openPangu Embedded: Llama with halves-paired rope and a bias on attention's output; its
/// rope factors are read but never applied by llama.cpp.
pub fn pangu_embedded(k: &Keys, c: Common) -> Result<DecoderConfig> {
    if c.scaling == Scaling::LongRope {
        bail!(
            "{}.rope.scaling.type is longrope, whose factors llama.cpp reads but does not apply \
             for this architecture: not supported",
            c.arch
        );
    }
    let tensors = TensorRules {
        wo_bias: Need::Required,
        rope_factors: RopeFactors::FreqsIgnored,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)
}

/// Hunyuan-A13B (`hunyuan-moe`): Hunyuan's attention (per-head q/k norms after halves-paired
/// rope; its loader applies no `rope.scaling.alpha`), every FFN a shared expert
/// (`expert_shared_feed_forward_length`, else `feed_forward_length` wide) beside softmax-routed
/// experts of `feed_forward_length`, the chosen weights renormalised.
pub fn hunyuan_moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: true };
    c.whole_heads_rotate()?;
    k.usize("expert_feed_forward_length")?;
    let ff = match k.usize_or("expert_shared_feed_forward_length", 0)? {
        0 => k.usize("feed_forward_length")?,
        ff => ff,
    };
    let moe = c.moe(
        k,
        ExpertWidth::FeedForward,
        true,
        false,
        Need::Required,
        SharedExpert::Plain { ff },
    )?;
    d.moe = Some(c.with_experts(moe)?);
    Ok(d)
}

/// Hunyuan dense (and Hunyuan-VL's text model): halves-paired rope, per-head RMS norms of q
/// and k after it; `rope.scaling.alpha` raises the rope base to base * alpha^(hd / (hd - 2)).
pub fn hunyuan(k: &Keys, c: Common) -> Result<DecoderConfig> {
    // Multimodal sections turn every section by the text position: the same rope.
    rope_sections(k, &c)?;
    let alpha = k.f32_or("rope.scaling.alpha", 0.0)?;
    let tensors = TensorRules {
        qk_norm: Need::Required,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: true };
    if alpha > 0.0 {
        if c.head_dim <= 2 {
            bail!(
                "{}.rope.scaling.alpha with a head width of {}",
                c.arch,
                c.head_dim
            );
        }
        let hd = c.head_dim as f32;
        d.ropes[0].base = c.rope_base * alpha.powf(hd / (hd - 2.0));
    }
    Ok(d)
}
