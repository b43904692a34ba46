//! Qwen (the first), Qwen2/2.5, Qwen3, and their mixtures of experts (Qwen2 MoE / Qwen1.5-MoE,
//! Qwen3 MoE); the text models of Qwen3-VL (dense and MoE), which differ from them in how
//! multimodal rope turns text ([`TextMrope`]) and in scales they leave unused. (Qwen2-VL's is
//! not run: llama.cpp 0c1e57098's loader reads no norm epsilon for it and norms with 0.)

use anyhow::Result;

use super::{text_mrope, Common, ExpertWidth};
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, Output, QkNorm, RopePairs, SharedExpert, TensorRules,
};
use crate::model::rope::TextMrope;

/// Qwen (1): q, k and v with their biases in one matrix, its own output layer.
pub fn qwen(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qkv_bias: Need::Required,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)
}

/// Qwen2 and Qwen2.5: q/k/v biases, an optional bias on the output layer.
pub fn qwen2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        output_bias: Need::Optional,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)
}

/// Qwen3: per-head RMS norms of q and k before rope; the FFN's weight scales applied.
pub fn qwen3(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        ffn_scales: true,
        // A reranker's classification head: not part of generation.
        ignored: &["cls.output.weight"],
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    Ok(d)
}

/// Qwen3 MoE (Qwen3-30B-A3B, 235B-A22B; Qwen3-Coder-30B-A3B): Qwen3's attention, every FFN
/// routed experts, the chosen weights renormalised, the experts' scales applied.
pub fn qwen3moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let mut d = qwen3(k, c.clone())?;
    d.tensors.ignored = &[];
    d.moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        true,
        true,
        Need::Required,
        SharedExpert::None,
    )?;
    Ok(d)
}

/// Qwen2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, routed experts whose
/// weights are not renormalised, and a shared expert gated by sigmoid(x · gate_inp_shexp).
pub fn qwen2moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    let ff = match k.usize_or("expert_shared_feed_forward_length", 0)? {
        0 => k.usize_or("feed_forward_length", 0)?,
        n => n,
    };
    let shared = SharedExpert::Gated { ff };
    d.moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        false,
        false,
        Need::Required,
        shared,
    )?;
    Ok(d)
}

/// Every rotary embedding of `d` turned as multimodal rope turns text.
fn with_mrope(mut d: DecoderConfig, m: TextMrope) -> DecoderConfig {
    for r in &mut d.ropes {
        r.mrope = Some(m);
    }
    d
}

/// Qwen3-VL's text model (2B to 32B): Qwen3 with interleaved M-RoPE, the FFN's scales read and
/// not applied (llama.cpp's graph passes none). Its deepstack layers add the vision encoder's
/// features to the first layers' outputs; a text token has none (llama.cpp pads its embedding
/// with zeros there), so `n_deepstack_layers` changes nothing for text.
pub fn qwen3vl(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let m = text_mrope(k, &c, true)?;
    c.whole_heads_rotate()?;
    let mut d = qwen3(k, c)?;
    d.tensors.ffn_scales = false;
    Ok(with_mrope(d, m))
}

/// Qwen3-VL MoE's text model (30B-A3B, 235B-A22B): Qwen3 MoE with interleaved M-RoPE, the
/// experts' scales read and not applied.
pub fn qwen3vlmoe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let m = text_mrope(k, &c, true)?;
    c.whole_heads_rotate()?;
    let mut d = qwen3moe(k, c)?;
    if let Some(moe) = &mut d.moe {
        moe.scales = false;
    }
    Ok(with_mrope(d, m))
}
