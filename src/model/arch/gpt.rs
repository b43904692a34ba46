//! Decoders with LayerNorms that carry biases: StarCoder 2, Orion, Nemotron, Jais 2; and
//! PLaMo's single-norm parallel blocks.

use anyhow::Result;

use super::Common;
use crate::model::config::{
    Activation, DecoderConfig, Keys, Need, NormKind, NormRule, Output, RopePairs, TensorRules,
};

const LN: NormRule = NormRule::Weighted {
    bias: Need::Required,
};

/// LayerNorms with biases everywhere, an FFN of act(up) without a gate.
const BIASED: TensorRules = TensorRules {
    attn_norm: LN,
    ffn_norm: LN,
    output_norm: LN,
    ffn_gate: Need::Absent,
    ..TensorRules::PLAIN
};

/// StarCoder 2: GELU FFN, biases on the attention output and the FFN.
pub fn starcoder2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        wo_bias: Need::Required,
        ffn_bias: Need::Required,
        ..BIASED
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    d.gated = false;
    d.activation = Activation::GeluTanh;
    Ok(d)
}

/// Nemotron (Minitron): relu² FFN, optional biases, its own output layer.
pub fn nemotron(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        wo_bias: Need::Optional,
        ffn_bias: Need::Optional,
        output: Output::Own,
        ..BIASED
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    d.gated = false;
    d.activation = Activation::ReluSquared;
    Ok(d)
}

/// Jais 2: relu² FFN with biases.
pub fn jais2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        wo_bias: Need::Required,
        ffn_bias: Need::Required,
        ..BIASED
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    d.gated = false;
    d.activation = Activation::ReluSquared;
    Ok(d)
}

/// Orion: LayerNorms with biases around a gated SiLU FFN, its own output layer.
pub fn orion(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_gate: Need::Required,
        output: Output::Own,
        ..BIASED
    };
    c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)
}

/// PLaMo: one RMS norm feeding attention and the FFN side by side; rope over the whole head
/// whatever `rope.dimension_count` says.
pub fn plamo(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_norm: NormRule::None,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.parallel = true;
    d.ropes[0].n_rot = c.head_dim;
    Ok(d)
}
