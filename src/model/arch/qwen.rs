//! Qwen (the first), Qwen2/2.5, Qwen3, and their mixtures of experts (Qwen2 MoE / Qwen1.5-MoE,
//! Qwen3 MoE).

use anyhow::Result;

use super::{Common, ExpertWidth};
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, Output, QkNorm, RopePairs, SharedExpert, TensorRules,
};

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
