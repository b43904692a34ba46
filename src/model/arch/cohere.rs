//! Command R (35B), Command R+ (104B) and Command R7B (`cohere2`): LayerNorms with weights only, attention and
//! the FFN side by side on one normalised input, tied output, logits multiplied by a scale.

use anyhow::Result;

use super::{swa_layers, Common};
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, NormRule, Output, QkNorm, RopePairs, TensorRules,
};

const COHERE: TensorRules = TensorRules {
    ffn_norm: NormRule::None,
    output: Output::Tied,
    ..TensorRules::PLAIN
};

/// Command R: rope on every layer; from 64 layers on (Command R+), q and k go through
/// per-head LayerNorms with weights of their own before rope.
pub fn command_r(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let plus = c.n_layer >= 64;
    let tensors = TensorRules {
        qk_norm: if plus { Need::Required } else { Need::Absent },
        ..COHERE
    };
    let logit_scale = k.f32_or("logit_scale", 0.0)?;
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Norm, tensors)?;
    d.parallel = true;
    if plus {
        d.attn.qk_norm = QkNorm::EachHead;
    }
    if logit_scale != 0.0 {
        d.logit_scale = Some(logit_scale);
    }
    Ok(d)
}

/// Command R7B: three windowed layers with rope to one global layer without it.
pub fn cohere2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let swa = swa_layers(k, &c, 4)?;
    let window = k.usize("attention.sliding_window")?;
    let logit_scale = k.f32("logit_scale")?;
    let tensors = TensorRules {
        ffn_scales: true,
        ..COHERE
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Norm, tensors)?;
    d.parallel = true;
    d.logit_scale = Some(logit_scale);
    d.set_windows(window, &swa, None);
    for plan in &mut d.layers {
        if plan.window.is_none() {
            plan.rope = None;
        }
    }
    Ok(d)
}
