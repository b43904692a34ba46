//! Decoders with LayerNorms that carry biases: StarCoder 2, Orion, Nemotron, Jais 2, GPT-NeoX
//! (Pythia), CodeShell, StableLM; and PLaMo's single-norm parallel blocks.

use anyhow::Result;

use super::Common;
use crate::model::config::{
    Activation, DecoderConfig, Keys, Need, NormKind, NormRule, Output, QkNorm, RopePairs,
    TensorRules,
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

/// GPT-NeoX (Pythia): biases everywhere, a GELU FFN, its own output layer; with
/// `use_parallel_residual`, attention and the FFN both read the layer's input, each through
/// its own norm.
pub fn gptneox(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let parallel = k.bool("use_parallel_residual")?;
    let tensors = TensorRules {
        qkv_bias: Need::Required,
        wo_bias: Need::Required,
        ffn_bias: Need::Required,
        output: Output::Own,
        ..BIASED
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    d.gated = false;
    d.activation = Activation::GeluTanh;
    d.parallel = parallel;
    Ok(d)
}

/// CodeShell: StarCoder 2's block with its own output layer (a file must hold the token
/// embeddings, which llama.cpp would otherwise take from the output layer).
pub fn codeshell(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        wo_bias: Need::Required,
        ffn_bias: Need::Required,
        output: Output::Own,
        ..BIASED
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    d.gated = false;
    d.activation = Activation::GeluTanh;
    Ok(d)
}

/// StableLM (2): LayerNorms with biases, q and k through per-head LayerNorms with weights of
/// their own where the file has them, a gated SiLU FFN; a layer without an FFN norm runs
/// attention and the FFN side by side on one normalised input (StableLM 2 12B).
pub fn stablelm(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_norm: NormRule::WeightedIfPresent {
            bias: Need::Optional,
        },
        ffn_gate: Need::Required,
        qk_norm: Need::Optional,
        output: Output::Own,
        ..BIASED
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::EachHead;
    Ok(d)
}
