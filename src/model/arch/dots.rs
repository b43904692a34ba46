//! dots.llm1 (rednote's dots.llm1.base and .inst): Qwen3's attention (per-head q/k RMS norms
//! before rope), leading dense layers, then experts routed as the file's
//! `expert_gating_func` says (sigmoid in the published files) with a selection bias
//! (`exp_probs_b`), weights renormalised and scaled as its keys say, beside shared experts.

use anyhow::{bail, Result};

use super::{Common, ExpertWidth};
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, Output, QkNorm, RopePairs, SharedExpert, TensorRules,
};

/// dots.llm1, as llama.cpp's `dots1` loader reads it.
pub fn dots1(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    c.whole_heads_rotate()?;
    let ff = k.usize("expert_feed_forward_length")?;
    let shared = k.usize("expert_shared_count")?;
    if shared == 0 {
        bail!("dots1.expert_shared_count is 0: dots1's layers with experts have shared ones");
    }
    let gating = c.gating(k)?;
    let mut moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        k.bool_or("expert_weights_norm", false)?,
        false,
        Need::Required,
        SharedExpert::Plain { ff: ff * shared },
    )?;
    let Some(m) = moe.as_mut() else {
        bail!("dots1.expert_count is 0: dots1 has experts past its leading dense layers");
    };
    m.gating = gating;
    m.selection_bias = Need::Optional;
    m.weights_scale = k.f32_or("expert_weights_scale", 0.0)?;
    m.dense_lead = k.usize_or("leading_dense_block_count", 0)?;
    d.moe = moe;
    Ok(d)
}
