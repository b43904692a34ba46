//! Qwen (the first), Qwen2/2.5 and Qwen3 (dense).

use anyhow::Result;

use super::Common;
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, Output, QkNorm, RopePairs, TensorRules,
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
