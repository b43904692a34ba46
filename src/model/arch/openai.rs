//! gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases on every projection and a
//! learned sink per head, windowed and full layers alternating (the windowed ones first, each
//! at its own rope base), YaRN; every FFN a mixture of experts whose router has a bias and
//! picks the top k of its raw logits, weighted by their softmax, each expert a clamped SwiGLU
//! with biases after its products.

use anyhow::Result;

use super::{swa_layers, Common, ExpertWidth};
use crate::model::config::{
    Activation, DecoderConfig, Gating, Keys, Need, NormKind, NormRule, Output, RopePairs,
    SharedExpert, TensorRules,
};

/// gpt-oss, as llama.cpp's `openai-moe` loader reads it.
pub fn gpt_oss(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        // The FFN's norm, under the name the converter gives it.
        ffn_norm_name: "post_attention_norm",
        wo_bias: Need::Required,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    debug_assert!(matches!(tensors.ffn_norm, NormRule::Weighted { .. }));
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    // Read as an array or a number by llama.cpp, and required.
    k.usize("expert_feed_forward_length")?;
    d.attn.scale = 1.0 / (c.n_rot as f32).sqrt();
    d.attn.sinks = true;
    d.activation = Activation::SwigluOai;
    let moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        false,
        false,
        Need::Required,
        SharedExpert::None,
    )?;
    let mut m = c.with_experts(moe)?;
    m.gating = Gating::SoftmaxWeight;
    m.biases = true;
    d.moe = Some(m);
    let window = k.usize("attention.sliding_window")?;
    let swa = swa_layers(k, &c, 2)?;
    // Windowed layers rotate at `rope.freq_base_swa` (else the full layers' base), with the
    // file's own scale.
    let local = crate::model::rope::RopeCfg {
        base: k.f32_or("rope.freq_base_swa", c.rope_base)?,
        freq_scale: c.freq_scale,
        ..d.ropes[0]
    };
    d.set_windows(window, &swa, Some(local));
    Ok(d)
}
