//! Phi-2, Phi-3 (Phi-3.5-mini, Phi-4-mini, with long-rope factors and partial rotary) and
//! Phi-3.5-MoE.

use anyhow::Result;

use super::{Common, ExpertWidth};
use crate::model::config::{
    Activation, DecoderConfig, Keys, Need, NormKind, NormRule, Output, RopeFactors, RopePairs,
    SharedExpert, TensorRules,
};

/// Phi-2: LayerNorms with biases, attention and a GELU FFN (no gate, biases everywhere) side
/// by side on one normalised input, an output layer with a bias.
pub fn phi2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let ln = NormRule::Weighted {
        bias: Need::Required,
    };
    let tensors = TensorRules {
        attn_norm: ln,
        ffn_norm: NormRule::None,
        output_norm: ln,
        wo_bias: Need::Required,
        ffn_gate: Need::Absent,
        ffn_bias: Need::Required,
        output: Output::Own,
        output_bias: Need::Required,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    d.parallel = true;
    d.gated = false;
    d.activation = Activation::GeluTanh;
    Ok(d)
}

/// Phi-3, Phi-3.5 and Phi-4-mini: gate and up in one matrix, long-rope factors (long ones
/// when the context window in use exceeds the original context). llama.cpp runs Phi-3's
/// sliding window as full attention, and so does gen.
pub fn phi3(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_gate: Need::Absent,
        fused_gate_up: true,
        rope_factors: RopeFactors::LongShort,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)
}

/// Phi-3.5-MoE (`phimoe`), as llama.cpp's loader and its Phi-3 graph run it: Phi-3's attention
/// and long-rope factors, RMS norms with biases (llama.cpp norms by RMS and adds the bias),
/// biases on attention's output and on the output layer, and every FFN softmax-routed experts
/// of `feed_forward_length`, the chosen weights renormalised.
pub fn phimoe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let biased = NormRule::Weighted {
        bias: Need::Required,
    };
    let tensors = TensorRules {
        attn_norm: biased,
        ffn_norm: biased,
        output_norm: biased,
        wo_bias: Need::Required,
        output: Output::Own,
        output_bias: Need::Required,
        rope_factors: RopeFactors::LongShort,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    let moe = c.moe(
        k,
        ExpertWidth::FeedForward,
        true,
        false,
        Need::Required,
        SharedExpert::None,
    )?;
    d.moe = Some(c.with_experts(moe)?);
    Ok(d)
}
