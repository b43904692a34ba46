//! ERNIE 4.5 with experts (ERNIE-4.5-21B-A3B, 300B-A47B): llama's attention (q/k/v biases
//! optional; an output bias read and not used, as llama.cpp's graph leaves it out), leading
//! dense layers, then experts routed by softmax with an optional selection bias, weights
//! renormalised, beside a shared expert where the file gives it a width.

use anyhow::{bail, Result};

use super::{Common, ExpertWidth};
use crate::model::config::{
    DecoderConfig, Keys, Need, NormKind, Output, RopePairs, SharedExpert, TensorRules,
};

/// ERNIE 4.5 MoE, as llama.cpp's `ernie4_5-moe` loader reads it.
pub fn ernie4_5_moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        wo_bias: Need::Ignored,
        output: Output::TiedIfAbsent,
        ..TensorRules::PLAIN
    };
    c.whole_heads_rotate()?;
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)?;
    k.usize("expert_feed_forward_length")?;
    let step = k.usize("interleave_moe_layer_step")?;
    let lead = k.usize_or("leading_dense_block_count", 0)?;
    // llama.cpp loads experts for every layer from `lead` on, and runs them on every `step`-th:
    // a layer between would run a dense FFN it never loaded.
    if step == 0 || (lead..c.n_layer).any(|l| (l + 1) % step != 0) {
        bail!(
            "{}.interleave_moe_layer_step is {step}: every layer from {lead} on must have experts",
            c.arch
        );
    }
    let shared = match k.usize_or("expert_shared_feed_forward_length", 0)? {
        0 => SharedExpert::None,
        ff => SharedExpert::Plain { ff },
    };
    let moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        true,
        false,
        Need::Optional,
        shared,
    )?;
    let mut m = c.with_experts(moe)?;
    m.selection_bias = Need::Optional;
    m.dense_lead = lead;
    d.moe = Some(m);
    Ok(d)
}
