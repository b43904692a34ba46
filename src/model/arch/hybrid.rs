//! Hybrid models, whose layers are not all attention (each other layer keeps a recurrent state
//! per sequence: [`Mixer`]): LFM2 (gated short convolutions between attention layers, which
//! norm q and k per head) and Qwen3.5 / Qwen3-Next (three Gated DeltaNet layers before each
//! attention layer, whose output is gated and whose rope turns part of each head).

use anyhow::{bail, Result};

use super::{text_mrope, Common, ExpertWidth};
use crate::model::config::{
    Activation, DecoderConfig, DeltaNet, Keys, Mamba2, Mixer, MoeCfg, Need, NormKind, NormRule,
    Output, QkNorm, RopePairs, SharedExpert, TensorRules,
};

/// LFM2 / LFM2.5 (350M to 2.6B): layers whose `head_count_kv` is 0 are short convolutions of
/// `shortconv.l_cache` taps, the others attention with per-head q/k norms; the final norm is
/// stored as `token_embd_norm`; an optional window on the attention layers.
pub fn lfm2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let window = k.usize_or("attention.sliding_window", 0)?;
    let mut d = lfm2_layers(k, c)?;
    if window > 0 {
        let attn: Vec<bool> = d
            .layers
            .iter()
            .map(|l| l.mixer == Mixer::Attention)
            .collect();
        d.set_windows(window, &attn, None);
    }
    Ok(d)
}

/// LFM2's layers (attention or short convolution by `head_count_kv`) and tensors.
fn lfm2_layers(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let taps = k.usize("shortconv.l_cache")?;
    if taps < 2 {
        bail!(
            "{}.shortconv.l_cache is {taps}: expected 2 or more (llama.cpp's graph asserts it)",
            c.arch
        );
    }
    let tensors = TensorRules {
        qk_norm: Need::Required,
        output_norm_name: "token_embd_norm",
        // LFM2-ColBERT's projection for embeddings: not part of generation.
        ignored: &["dense_2_out.weight", "dense_2_out.bias"],
        ..TensorRules::PLAIN
    };
    let no_attention = c.no_attention.clone();
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    for (plan, none) in d.layers.iter_mut().zip(no_attention) {
        if none {
            plan.mixer = Mixer::ShortConv { taps };
            plan.rope = None;
        }
    }
    Ok(d)
}

/// LFM2 MoE (LFM2-8B-A1B, 24B-A2B): LFM2's layers without a window (its loader reads none),
/// experts past `leading_dense_block_count` chosen by `expert_gating_func` with the required
/// selection bias `exp_probs_b`, their weights renormalised; no scales applied.
pub fn lfm2moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let mut d = lfm2_layers(k, c.clone())?;
    let gating = c.gating(k)?;
    let moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        true,
        false,
        Need::Required,
        SharedExpert::None,
    )?;
    d.moe = Some(MoeCfg {
        gating,
        selection_bias: Need::Required,
        dense_lead: k.usize_or("leading_dense_block_count", 0)?,
        ..c.with_experts(moe)?
    });
    Ok(d)
}

/// Which layers are Gated DeltaNet: `attention.recurrent_layers` (one flag a block, prediction
/// blocks included), else all but every `full_attention_interval`-th (default 4).
fn recurrent_layers(k: &Keys, c: &Common) -> Result<Vec<bool>> {
    let all = c.n_layer + c.nextn;
    if let Some(flags) = k.layer_flags("attention.recurrent_layers", all)? {
        return Ok(flags[..c.n_layer].to_vec());
    }
    if k.get("attention.recurrent_layers").is_some() {
        let on = k.usize("attention.recurrent_layers")? != 0;
        return Ok(vec![on; c.n_layer]);
    }
    let every = k.usize_or("full_attention_interval", 4)?;
    if every == 0 {
        bail!("{}.full_attention_interval is 0", c.arch);
    }
    Ok((0..c.n_layer).map(|l| (l + 1) % every != 0).collect())
}

/// The DeltaNet layers' shape from the `ssm.*` keys, held to what llama.cpp's graph assumes.
fn delta_net(k: &Keys, c: &Common, grouped: bool) -> Result<DeltaNet> {
    let k_heads = k.usize("ssm.group_count")?;
    let v_heads = k.usize("ssm.time_step_rank")?;
    let k_dim = k.usize("ssm.state_size")?;
    let inner = k.usize("ssm.inner_size")?;
    let taps = k.usize("ssm.conv_kernel")?;
    if k_heads == 0 || v_heads == 0 || k_dim == 0 || taps < 2 || !v_heads.is_multiple_of(k_heads) {
        bail!(
            "{}: ssm.group_count {k_heads}, ssm.time_step_rank {v_heads}, ssm.state_size {k_dim}, \
             ssm.conv_kernel {taps}: expected value heads a multiple of key heads and 2 taps or more",
            c.arch
        );
    }
    if inner != v_heads * k_dim {
        bail!(
            "{}.ssm.inner_size {inner} is not ssm.time_step_rank {v_heads} x ssm.state_size {k_dim} \
             (llama.cpp's graph takes value heads as wide as key heads)",
            c.arch
        );
    }
    Ok(DeltaNet {
        k_heads,
        v_heads,
        k_dim,
        v_dim: k_dim,
        taps,
        grouped,
    })
}

/// What Qwen3.5 and Qwen3-Next share: DeltaNet layers among attention layers whose q projection
/// carries an output gate, per-head q/k norms before a partial rope, the FFN's norm stored as
/// `post_attention_norm`, optional q/k/v biases.
fn qwen_hybrid(k: &Keys, c: Common, grouped: bool) -> Result<DecoderConfig> {
    let recurrent = recurrent_layers(k, &c)?;
    let net = delta_net(k, &c, grouped)?;
    let tensors = TensorRules {
        qk_norm: Need::Required,
        ffn_norm_name: "post_attention_norm",
        ffn_scales: true,
        output: Output::TiedIfAbsent,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    d.attn.gated_output = true;
    for (plan, r) in d.layers.iter_mut().zip(recurrent) {
        if r {
            plan.mixer = Mixer::DeltaNet(net);
            plan.rope = None;
        }
    }
    Ok(d)
}

/// Qwen3.5 (0.8B to 27B dense): interleaved multimodal rope over `rope.dimension_sections`
/// (as text turns it), a dense FFN.
pub fn qwen35(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let m = text_mrope(k, &c, true)?;
    let mut d = qwen_hybrid(k, c, false)?;
    for r in &mut d.ropes {
        r.mrope = Some(m);
    }
    Ok(d)
}

/// The experts of Qwen3.5 MoE and Qwen3-Next: softmax routing with the chosen weights
/// renormalised (whatever the file's gating keys say: the graph fixes it), a shared expert
/// gated by sigmoid(x · gate_inp_shexp).
fn qwen_experts(k: &Keys, c: &Common, d: &mut DecoderConfig) -> Result<()> {
    let ff = match k.usize_or("expert_shared_feed_forward_length", 0)? {
        0 => k.usize_or("feed_forward_length", 0)?,
        n => n,
    };
    let moe = c.moe(
        k,
        ExpertWidth::ExpertKey,
        true,
        true,
        Need::Required,
        SharedExpert::Gated { ff },
    )?;
    d.moe = Some(MoeCfg {
        shared_scales: true,
        ..c.with_experts(moe)?
    });
    Ok(())
}

/// Qwen3.5 MoE and Qwen3.6 MoE (35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5 with experts.
pub fn qwen35moe(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let mut d = qwen35(k, c.clone())?;
    qwen_experts(k, &c, &mut d)?;
    Ok(d)
}

/// Qwen3-Next (80B-A3B): plain NEOX rope, value heads grouped by key head, experts.
pub fn qwen3next(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let mut d = qwen_hybrid(k, c.clone(), true)?;
    qwen_experts(k, &c, &mut d)?;
    Ok(d)
}

/// The Mamba-2 layers' shape from the `ssm.*` keys (`time_step_rank` is the head count).
fn mamba2_shape(k: &Keys, c: &Common) -> Result<Mamba2> {
    let m = Mamba2 {
        d_inner: k.usize("ssm.inner_size")?,
        heads: k.usize("ssm.time_step_rank")?,
        groups: k.usize("ssm.group_count")?,
        d_state: k.usize("ssm.state_size")?,
        taps: k.usize("ssm.conv_kernel")?,
    };
    let fits = m.heads > 0
        && m.groups > 0
        && m.d_state > 0
        && m.taps >= 2
        && m.d_inner.is_multiple_of(m.heads)
        && m.heads.is_multiple_of(m.groups);
    if !fits {
        bail!(
            "{}: ssm.inner_size {}, ssm.time_step_rank {}, ssm.group_count {}, ssm.state_size {}, \
             ssm.conv_kernel {}: expected heads dividing the inner size, groups dividing the heads, \
             2 taps or more",
            c.arch,
            m.d_inner,
            m.heads,
            m.groups,
            m.d_state,
            m.taps
        );
    }
    Ok(m)
}

/// Granite 4.0-H (and Bamba): layers whose `head_count_kv` is 0 are Mamba-2, the others
/// attention (rope only where `rope.scaling.finetuned`, default true: Granite 4.0-H's files
/// say false); every layer has an FFN (dense, or experts beside an optional shared one);
/// Granite's embedding, residual, attention and logit scales, each where the file has it.
pub fn granitehybrid(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let m = mamba2_shape(k, &c)?;
    if m.d_inner != 2 * c.d_model {
        bail!(
            "{}.ssm.inner_size {} is not twice the embedding width {} (llama.cpp's loader asserts it)",
            c.arch,
            m.d_inner,
            c.d_model
        );
    }
    let tensors = TensorRules {
        ffn_scales: false,
        ..TensorRules::LLAMA
    };
    let no_attention = c.no_attention.clone();
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Norm, tensors)?;
    let rope = k.bool_or("rope.scaling.finetuned", true)?;
    for (plan, none) in d.layers.iter_mut().zip(no_attention) {
        if none {
            plan.mixer = Mixer::Mamba2(m);
        }
        if none || !rope {
            plan.rope = None;
        }
    }
    let shared = match k.usize_or("expert_shared_feed_forward_length", 0)? {
        0 => SharedExpert::None,
        ff => SharedExpert::Plain { ff },
    };
    d.moe = c.moe(
        k,
        ExpertWidth::FeedForward,
        true,
        false,
        Need::Optional,
        shared,
    )?;
    if let Some(s) = k.f32_opt("logit_scale")?.filter(|&s| s != 0.0) {
        d.logit_scale = Some(1.0 / s);
    }
    super::llama::granite_scales(k, &mut d)?;
    Ok(d)
}

/// Nemotron-H (Nemotron Nano 2, Nemotron-H 8B-56B): each layer is one block on its one norm
/// (`attn_norm`): Mamba-2 where `head_count_kv` and `feed_forward_length` are both 0,
/// attention without rope where only `feed_forward_length` is, else an FFN of relu(up)²
/// without a gate. Norms are RMS with `layer_norm_rms_epsilon`, else `layer_norm_epsilon`.
pub fn nemotron_h(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let m = mamba2_shape(k, &c)?;
    let all = c.n_layer + c.nextn;
    let ff = match k.layer_counts("feed_forward_length", all)? {
        Some(v) => v,
        None => vec![k.usize_or("feed_forward_length", 0)?; all],
    };
    let kv = k
        .layer_counts("attention.head_count_kv", all)?
        .unwrap_or_else(|| vec![c.n_kv_head; all]);
    let eps = match k.f32_opt("attention.layer_norm_rms_epsilon")? {
        Some(e) => e,
        None => k.f32("attention.layer_norm_epsilon")?,
    };
    let tensors = TensorRules {
        ffn_norm: NormRule::None,
        ffn_gate: Need::Absent,
        ffn_bias: Need::Optional,
        ffn_scales: true,
        wo_bias: Need::Optional,
        ..TensorRules::PLAIN
    };
    let mut d = c.decoder(k, NormKind::Layer, RopePairs::Neox, tensors)?;
    (d.norm, d.norm_eps) = (NormKind::Rms, eps);
    d.gated = false;
    d.activation = Activation::ReluSquared;
    for (l, plan) in d.layers.iter_mut().enumerate() {
        plan.rope = None;
        match (kv[l], ff[l]) {
            (0, 0) => (plan.mixer, plan.ffn) = (Mixer::Mamba2(m), false),
            (_, 0) => plan.ffn = false,
            _ => plan.mixer = Mixer::None,
        }
    }
    Ok(d)
}
