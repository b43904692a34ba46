//! MiniMax-M2 (230B-A10B; `minimax-m2`): RMS norms of the whole q and k projections before
//! partial rotary pairing halves, then every FFN experts gated by the file's
//! `expert_gating_func` (sigmoid in the published files), chosen by the probabilities plus
//! `exp_probs_b`, renormalised.

use anyhow::Result;

use super::{Common, ExpertWidth};
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, Output, QkNorm, RopePairs, SharedExpert, TensorRules,
};

/// MiniMax-M2, as llama.cpp's `minimax-m2` loader reads it.
pub fn minimax_m2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        output: Output::Own,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Whole;
    k.usize("expert_feed_forward_length")?;
    let moe = c.moe(
        k,
        ExpertWidth::FeedForward,
        true,
        false,
        Need::Required,
        SharedExpert::None,
    )?;
    let mut m = c.with_experts(moe)?;
    m.gating = c.gating(k)?;
    m.selection_bias = Need::Required;
    d.moe = Some(m);
    Ok(d)
}
