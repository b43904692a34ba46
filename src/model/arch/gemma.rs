//! Gemma, Gemma 2 and Gemma 3 (text): embeddings scaled by sqrt(d), a GELU-gated FFN, tied
//! output; Gemma 2 and 3 add norms after attention and the FFN and sliding windows, Gemma 2
//! soft-caps scores and logits, Gemma 3 norms each head's q and k.

use anyhow::{bail, Result};

use super::{swa_layers, Common};
use crate::model::config::{
    Activation, DecoderConfig, Keys, Need, NormKind, NormRule, Output, QkNorm, RopePairs,
    TensorRules,
};

fn gemma_decoder(k: &Keys, c: &Common, tensors: TensorRules) -> Result<DecoderConfig> {
    let mut d = c.decoder(k, NormKind::Rms, RopePairs::Neox, tensors)?;
    d.embed_scale = Some((c.d_model as f32).sqrt());
    d.activation = Activation::GeluTanh;
    Ok(d)
}

/// Gemma 2 and 3 scale q by 1/sqrt(hd), and their 27B models by 1/sqrt(d / h) (gemma_pytorch).
fn gemma_attn_scale(c: &Common, layers_27b: usize) -> f32 {
    let width = match c.n_layer == layers_27b {
        true => c.d_model / c.n_head,
        false => c.head_dim,
    };
    1.0 / (width as f32).sqrt()
}

const SANDWICH: TensorRules = TensorRules {
    post_attn_norm: NormRule::Weighted { bias: Need::Absent },
    post_ffn_norm: NormRule::Weighted { bias: Need::Absent },
    ..TensorRules::PLAIN
};

/// Gemma (1).
pub fn gemma(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        output: Output::Tied,
        ..TensorRules::PLAIN
    };
    gemma_decoder(k, &c, tensors)
}

/// Gemma 2: alternating windowed and global layers, soft-capped scores and logits.
pub fn gemma2(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let swa = swa_layers(k, &c, 2)?;
    let base_swa = k.f32_or("rope.freq_base_swa", c.rope_base)?;
    let window = k.usize_or("attention.sliding_window", 4096)?;
    let attn_cap = k.f32_or("attn_logit_softcapping", 50.0)?;
    let final_cap = k.f32_or("final_logit_softcapping", 30.0)?;
    for (key, cap) in [
        ("attn_logit_softcapping", attn_cap),
        ("final_logit_softcapping", final_cap),
    ] {
        if cap <= 0.0 {
            bail!("{}.{key} is {cap}: Gemma 2 divides by it", c.arch);
        }
    }
    let tensors = TensorRules {
        output: Output::Tied,
        ..SANDWICH
    };
    let mut d = gemma_decoder(k, &c, tensors)?;
    d.attn.scale = gemma_attn_scale(&c, 46);
    d.attn.softcap = Some(attn_cap);
    d.final_softcap = Some(final_cap);
    // Windowed layers rotate at their own base, with the file's own scale (not the context's).
    let local = crate::model::rope::RopeCfg {
        base: base_swa,
        freq_scale: c.freq_scale,
        ..d.ropes[0]
    };
    d.set_windows(window, &swa, Some(local));
    Ok(d)
}

/// Gemma 3 (text, every size): five windowed layers to one global where the file has a
/// window; windowed layers rotate at base 10,000 unscaled, global ones as the file says
/// (linear scaling on the 4B, 12B and 27B).
pub fn gemma3(k: &Keys, c: Common) -> Result<DecoderConfig> {
    let tensors = TensorRules {
        qk_norm: Need::Required,
        // An embedding model's projections (EmbeddingGemma): not part of generation.
        ignored: &["dense_2.weight", "dense_3.weight"],
        ..SANDWICH
    };
    let final_cap = k.f32_or("final_logit_softcapping", 0.0)?;
    let mut d = gemma_decoder(k, &c, tensors)?;
    d.attn.scale = gemma_attn_scale(&c, 62);
    d.attn.qk_norm = QkNorm::Heads { after_rope: false };
    if final_cap > 0.0 {
        d.final_softcap = Some(final_cap);
    }
    if let Some(window) = k.usize_opt("attention.sliding_window")?.filter(|&w| w > 0) {
        let swa = swa_layers(k, &c, 6)?;
        let local = crate::model::rope::RopeCfg {
            base: k.f32_or("rope.freq_base_swa", 10_000.0)?,
            freq_scale: 1.0,
            factors: crate::model::rope::Factors::None,
            ..d.ropes[0]
        };
        d.set_windows(window, &swa, Some(local));
    }
    Ok(d)
}
