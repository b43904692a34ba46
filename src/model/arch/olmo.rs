//! OLMo, OLMo 2 (and OLMo 3's windowed layers), EXAONE 4 and GLM-4: decoders whose norms sit
//! after attention and the FFN (OLMo's have no weights at all); OLMoE.

use anyhow::Result;

use super::{rope_sections, swa_layers, Common, ExpertWidth};
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, NormRule, Output, QkNorm, RopeFactors, RopePairs,
    SharedExpert, TensorRules,
};
use crate::model::rope::{Factors, RopeCfg};

const POST_NORMS: TensorRules = TensorRules {
    attn_norm: NormRule::None,
    ffn_norm: NormRule::None,
    post_attn_norm: NormRule::Weighted { bias: Need::Absent },
    post_ffn_norm: NormRule::Weighted { bias: Need::Absent },
    ..TensorRules::PLAIN
};

/// OLMo: LayerNorms without weights or biases, q/k/v clamped where the file says.
pub fn olmo(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let clamp = k.f32_or("attention.clamp_kqv", 0.0)?;
    let tensors = TensorRules {
        attn_norm: NormRule::Plain,
        ffn_norm: NormRule::Plain,
        output_norm: NormRule::Plain,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Norm, tensors)?;
    if clamp > 0.0 {
        d.attn.clamp = Some(clamp);
    }
    Ok(d)
}

/// OLMo 2 (and OLMo 3): norms after attention and the FFN only, q and k normed over the whole
/// projection; with a window, every fourth layer global and the windowed ones rotating
/// without the file's scaling.
pub fn olmo2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        output: Output::Own,
        ..POST_NORMS
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Whole;
    if let Some(window) = k.usize_opt("attention.sliding_window")?.filter(|&w| w > 0) {
        let swa = swa_layers(k, &c, 4)?;
        let local = RopeCfg {
            factors: Factors::None,
            ..RopeCfg::plain(c.n_rot, c.rope_base)
        };
        d.set_windows(window, &swa, Some(local));
    }
    Ok(d)
}

/// EXAONE 4: OLMo 2's post-norms with per-head q/k norms and `rope_freqs`; the 32B's windowed
/// layers (three of four, window 4,096 unless the file says) are the only ones that rotate.
pub fn exaone4(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        rope_factors: RopeFactors::Freqs,
        ..POST_NORMS
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    if c.n_layer == 64 {
        let swa = swa_layers(k, &c, 4)?;
        let window = k.usize_or("attention.sliding_window", 4096)?;
        d.set_windows(window, &swa, None);
        d.rope_on_windows_only();
    }
    Ok(d)
}

/// GLM-4 (0414): norms before and after attention and the FFN, gate and up in one matrix.
/// Rope pairs halves when the file gives multimodal rope sections (text positions make that
/// plain halves-paired rope), neighbours otherwise.
pub fn glm4(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let sections = rope_sections(k, &c)?;
    let mrope = sections.len() >= 2 && sections[0] > 0 && sections[1] > 0;
    let tensors = TensorRules {
        post_attn_norm: NormRule::Weighted { bias: Need::Absent },
        post_ffn_norm: NormRule::Weighted { bias: Need::Absent },
        ffn_gate: Need::Absent,
        fused_gate_up: true,
        ..TensorRules::PLAIN
    };
    let pairs = if mrope {
        RopePairs::Neox
    } else {
        RopePairs::Norm
    };
    c.decoder(k, NormKind::Rms, pairs, tensors)
}

/// ChatGLM 3 and GLM-4 9B (`chatglm`): Llama with q/k/v biases where the file has them,
/// gate and up in one matrix and no output bias on attention.
pub fn chatglm(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        ffn_gate: Need::Absent,
        fused_gate_up: true,
        ..TensorRules::PLAIN
    };
    c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)
}

/// OLMoE: norms before attention and the FFN, q and k normed over the whole projection (as
/// OLMo 2), every FFN routed experts of `feed_forward_length`, their weights as the softmax
/// gives them.
pub fn olmoe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Whole;
    let (w, none) = (ExpertWidth::FeedForward, SharedExpert::None);
    let moe = c.moe(k, w, false, false, Need::Required, none)?;
    d.moe = Some(c.with_experts(moe)?);
    Ok(d)
}
