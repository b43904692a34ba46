//! The architectures gen runs, each read from a file's metadata exactly as llama.cpp's loader
//! for it reads it (llama.cpp's `src/models/*.cpp`): one small function per architecture,
//! in one file per family, that starts from what every architecture reads ([`Common`]) and sets
//! what its own keys and graph say. Anything llama.cpp would compute that gen does not is
//! refused here, before a tensor is read, with one line naming the key.
//!
//! Adding an architecture: write its function (the keys its llama.cpp loader reads, its
//! [`TensorRules`], what its graph does differently), and add a line to [`ARCHS`]. A block gen
//! has no operation for (ALiBi, learned positions) is a new field of [`DecoderConfig`] and a
//! few lines in `super::layer` and the backends; a recurrent layer is a [`Mixer`] (`hybrid`).
//! Experts: [`Common::moe`] says how the family routes them; a file with experts whose
//! architecture does not is refused.

mod cohere;
mod deepseek;
mod ernie;
mod gemma;
mod gpt;
mod hybrid;
mod llama;
mod minimax;
mod olmo;
mod openai;
mod phi;
mod qwen;

use anyhow::{bail, Result};

use super::config::{
    Activation, Attn, DecoderConfig, ExpertGroups, Gating, HeadShape, Keys, LayerPlan, Mixer,
    MoeCfg, Need, NormKind, QkNorm, RopeCfg, RopePairs, SharedExpert, TensorRules,
};
use super::rope::{yarn_mscale, Factors, TextMrope};

/// Reads one architecture's configuration.
type Build = fn(&Keys, Common) -> Result<DecoderConfig>;

/// Every architecture gen runs: GGUF `general.architecture` and its reader.
pub const ARCHS: &[(&str, Build)] = &[
    ("llama", llama::llama),
    ("mistral3", llama::mistral3),
    ("granite", llama::granite),
    ("granitemoe", llama::granitemoe),
    ("minicpm", llama::minicpm),
    ("smollm3", llama::smollm3),
    ("arcee", llama::arcee),
    ("exaone", llama::exaone),
    ("internlm2", llama::internlm2),
    ("xverse", llama::internlm2),
    ("maincoder", llama::maincoder),
    ("nanbeige", llama::nanbeige),
    ("seed_oss", llama::seed_oss),
    ("deci", llama::deci),
    ("pangu-embedded", llama::pangu_embedded),
    ("hunyuan-dense", llama::hunyuan),
    ("hunyuan_vl", llama::hunyuan),
    ("hunyuan-moe", llama::hunyuan_moe),
    ("minimax-m2", minimax::minimax_m2),
    ("qwen", qwen::qwen),
    ("qwen2", qwen::qwen2),
    ("qwen3", qwen::qwen3),
    ("qwen2moe", qwen::qwen2moe),
    ("qwen3moe", qwen::qwen3moe),
    ("qwen3vl", qwen::qwen3vl),
    ("qwen3vlmoe", qwen::qwen3vlmoe),
    ("gemma", gemma::gemma),
    ("gemma2", gemma::gemma2),
    ("gemma3", gemma::gemma3),
    ("gemma4", gemma::gemma4),
    ("phi2", phi::phi2),
    ("phi3", phi::phi3),
    ("olmo", olmo::olmo),
    ("olmo2", olmo::olmo2),
    ("olmoe", olmo::olmoe),
    ("gpt-oss", openai::gpt_oss),
    ("dots1", deepseek::dots1),
    ("deepseek", deepseek::deepseek),
    ("glm4moe", deepseek::glm4moe),
    ("bailingmoe2", deepseek::bailingmoe2),
    ("exaone-moe", deepseek::exaone_moe),
    ("phimoe", phi::phimoe),
    ("ernie4_5-moe", ernie::ernie4_5_moe),
    ("exaone4", olmo::exaone4),
    ("glm4", olmo::glm4),
    ("chatglm", olmo::chatglm),
    ("command-r", cohere::command_r),
    ("cohere2", cohere::cohere2),
    ("starcoder2", gpt::starcoder2),
    ("orion", gpt::orion),
    ("nemotron", gpt::nemotron),
    ("jais2", gpt::jais2),
    ("plamo", gpt::plamo),
    ("gptneox", gpt::gptneox),
    ("codeshell", gpt::codeshell),
    ("stablelm", gpt::stablelm),
    ("lfm2", hybrid::lfm2),
    ("lfm2moe", hybrid::lfm2moe),
    ("qwen35", hybrid::qwen35),
    ("qwen35moe", hybrid::qwen35moe),
    ("qwen3next", hybrid::qwen3next),
    ("granitehybrid", hybrid::granitehybrid),
    ("nemotron_h", hybrid::nemotron_h),
    // Nemotron 3's architecture name: its files without experts are Nemotron-H's layers (its
    // experts, relu² ones chosen by biased sigmoids through latent projections, are refused).
    ("nemotron_h_moe", hybrid::nemotron_h),
];

/// The names of [`ARCHS`], for messages.
pub fn supported() -> Vec<&'static str> {
    ARCHS.iter().map(|(a, _)| *a).collect()
}

/// The configuration of a file whose `general.architecture` is `arch`, from its metadata.
pub fn from_gguf(
    md: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
    arch: &str,
) -> Result<DecoderConfig> {
    let Some((_, build)) = ARCHS.iter().find(|(a, _)| *a == arch) else {
        bail!(
            "architecture {arch:?} is not supported (supported: {})",
            supported().join(", ")
        );
    };
    let keys = Keys::new(md, arch);
    let common = Common::read(&keys)?;
    let n_expert = common.n_expert;
    let no_attention = common.no_attention.clone();
    let mut cfg = build(&keys, common)?;
    for (l, (plan, &none)) in cfg.layers.iter().zip(&no_attention).enumerate() {
        if none && plan.mixer == Mixer::Attention {
            bail!("{arch}: layer {l} has no attention heads, which a {arch} layer needs");
        }
    }
    if n_expert > 0 && cfg.moe.is_none() {
        bail!(
            "{arch}.expert_count is {n_expert}: mixture-of-experts {arch} files are not supported"
        );
    }
    cfg.check()?;
    cfg.set_context_window(cfg.context_len);
    Ok(cfg)
}

/// Where a family's experts take their FFN width from, as llama.cpp's loader for it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertWidth {
    /// `feed_forward_length` (Mixtral-style llama, Granite MoE, OLMoE).
    FeedForward,
    /// `expert_feed_forward_length`, else `feed_forward_length / expert_used_count` (Qwen MoE).
    ExpertKey,
}

/// How the file scales its rotary embeddings (`rope.scaling.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaling {
    None,
    Linear,
    Yarn,
    LongRope,
}

/// What llama.cpp reads for every architecture (llama_model_base::load_hparams).
#[derive(Debug, Clone)]
pub struct Common {
    pub arch: String,
    pub context_len: usize,
    pub d_model: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    pub scaling: Scaling,
    /// 1 / `rope.scaling.factor` (1 where the factor is 0 or absent).
    pub freq_scale: f32,
    /// `rope.scaling.attn_factor`.
    pub rope_attn_factor: f32,
    /// `rope.scaling.original_context_length` (default: the context length).
    pub n_ctx_orig: usize,
    /// `expert_count` (0: a dense model); an architecture that runs experts says how
    /// ([`Common::moe`]), the others refuse a file with them.
    pub n_expert: usize,
    /// Multi-token prediction blocks after the `n_layer` that run (`nextn_predict_layers`).
    pub nextn: usize,
    /// Layers whose per-layer head count is 0: a hybrid's layers without attention.
    pub no_attention: Vec<bool>,
    /// `attention.head_count_kv` per layer where the file gives an array (else empty).
    pub kv_heads: Vec<usize>,
}

/// A head count key as a value alike on every layer that has heads, and the per-layer values
/// when it is an array (`default`: where the key is absent; None: 0).
fn layer_heads(
    k: &Keys,
    key: &str,
    n_layer: usize,
    default: Option<usize>,
) -> Result<(usize, Vec<usize>)> {
    let Some(per_layer) = k.layer_counts(key, n_layer)? else {
        return Ok((k.usize_or(key, default.unwrap_or(0))?, Vec::new()));
    };
    let mut value = 0;
    for &n in per_layer.iter().filter(|&&n| n > 0) {
        let may_differ = key == "attention.head_count_kv" && PER_LAYER_HEADS.contains(&k.arch);
        if value != 0 && n != value && !may_differ {
            bail!(
                "{}.{key} differs between layers: gen runs only models whose layers are alike",
                k.arch
            );
        }
        if value == 0 {
            value = n;
        }
    }
    Ok((value, per_layer))
}

/// The architectures whose layers may differ in kv heads (each layer's own count is in
/// [`Common::kv_heads`]; the others are refused where their counts differ).
const PER_LAYER_HEADS: &[&str] = &["gemma4"];

/// The architectures whose files may end in multi-token prediction blocks, skipped.
const MTP_ARCHS: &[&str] = &[
    "glm4moe",
    "bailingmoe2",
    "exaone-moe",
    "qwen35",
    "qwen35moe",
    "qwen3next",
];

impl Common {
    fn read(k: &Keys) -> Result<Self> {
        let context_len = k.usize("context_length")?;
        let d_model = k.usize("embedding_length")?;
        let n_layer_all = k.usize("block_count")?;
        // Multi-token prediction layers (the file's last blocks) are llama.cpp's only for
        // speculation, loaded on request: the families that have them skip them, as
        // llama.cpp does by default; elsewhere they are refused.
        let nextn = k.usize_opt("nextn_predict_layers")?.unwrap_or(0);
        if nextn > 0 && !(MTP_ARCHS.contains(&k.arch) && nextn < n_layer_all) {
            bail!(
                "{}.nextn_predict_layers is {nextn}: multi-token prediction layers are not supported",
                k.arch
            );
        }
        let n_layer = n_layer_all - nextn;
        // llama.cpp reads Hunyuan's `expert_count` of 1 as no experts.
        let one_is_none = matches!(k.arch, "hunyuan-dense" | "hunyuan_vl");
        let n_expert = k
            .usize_opt("expert_count")?
            .filter(|&n| n > 0 && !(one_is_none && n == 1))
            .unwrap_or(0);
        if !k.bool_or("attention.causal", true)? {
            bail!(
                "{}.attention.causal is false: an encoder, not a text generator",
                k.arch
            );
        }
        // 0: none; u32::MAX: llama.cpp's "unspecified" (-1), as its saver writes it.
        let pooling = k.usize_opt("pooling_type")?;
        if let Some(p) = pooling.filter(|&p| p != 0 && p != u32::MAX as usize) {
            bail!(
                "{}.pooling_type is {p}: an embedding model, not a text generator",
                k.arch
            );
        }
        if let Some(out) = k
            .usize_opt("embedding_length_out")?
            .filter(|&o| o != 0 && o != d_model)
        {
            bail!(
                "{}.embedding_length_out {out} differs from embedding_length {d_model}: not supported",
                k.arch
            );
        }
        // Per-layer head counts: alike on every layer with attention, 0 on a hybrid's layers
        // without (whose architecture says what they are instead).
        let (n_head, heads_h) = layer_heads(k, "attention.head_count", n_layer_all, None)?;
        let (n_kv_head, heads_kv) =
            layer_heads(k, "attention.head_count_kv", n_layer_all, Some(n_head))?;
        let no_attention: Vec<bool> = (0..n_layer)
            .map(|l| heads_h.get(l) == Some(&0) || heads_kv.get(l) == Some(&0))
            .collect();
        if n_head == 0 || n_kv_head == 0 || d_model == 0 || n_layer == 0 || context_len == 0 {
            bail!("metadata gives a zero size (layers {n_layer}, width {d_model}, heads {n_head}/{n_kv_head}, context {context_len})");
        }
        if n_head % n_kv_head != 0 {
            bail!(
                "{}.attention.head_count ({n_head}) is not a multiple of head_count_kv ({n_kv_head})",
                k.arch
            );
        }
        let head_dim = match k.usize_opt("attention.key_length")? {
            Some(hd) => hd,
            None if d_model % n_head == 0 => d_model / n_head,
            None => bail!(
                "{}.embedding_length ({d_model}) is not a multiple of head_count ({n_head})",
                k.arch
            ),
        };
        let value_dim = k.usize_or("attention.value_length", d_model / n_head)?;
        if value_dim != head_dim {
            bail!(
                "{}.attention.value_length {value_dim} differs from key_length {head_dim}: not supported",
                k.arch
            );
        }
        let n_rot = k.usize_or("rope.dimension_count", head_dim)?;
        if n_rot == 0 || n_rot > head_dim || n_rot % 2 != 0 {
            bail!(
                "{}.rope.dimension_count {n_rot} must be even and at most the head width {head_dim}",
                k.arch
            );
        }
        let scaling = match k.string_opt("rope.scaling.type")?.unwrap_or("linear") {
            "none" => Scaling::None,
            "linear" => Scaling::Linear,
            "yarn" => Scaling::Yarn,
            "longrope" => Scaling::LongRope,
            other => bail!(
                "{}.rope.scaling.type {other:?} is not one llama.cpp knows (none, linear, yarn, longrope)",
                k.arch
            ),
        };
        let factor = match k.f32_opt("rope.scaling.factor")? {
            Some(f) => f,
            None => k.f32_or("rope.scale_linear", 0.0)?,
        };
        if factor < 0.0 {
            bail!("{}.rope.scaling.factor is {factor}", k.arch);
        }
        Ok(Self {
            arch: k.arch.to_string(),
            context_len,
            d_model,
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            n_rot,
            rope_base: k.f32_or("rope.freq_base", 10_000.0)?,
            scaling,
            freq_scale: if factor == 0.0 { 1.0 } else { 1.0 / factor },
            rope_attn_factor: k.f32_or("rope.scaling.attn_factor", 1.0)?,
            n_ctx_orig: k.usize_or("rope.scaling.original_context_length", context_len)?,
            n_expert,
            nextn,
            no_attention,
            kv_heads: heads_kv,
        })
    }

    /// The rotary embedding of full-attention layers, resolved as llama.cpp's context does
    /// (llama-context.cpp), with YaRN's beta range and log multiplier where the architecture
    /// reads them (defaults 32, 1, 0).
    pub fn rope(&self, beta: (f32, f32), yarn_log_mul: f32) -> RopeCfg {
        let mut freq_scale = self.freq_scale;
        if self.scaling == Scaling::None {
            freq_scale = 1.0;
        }
        let ext_factor = if self.scaling == Scaling::Yarn {
            1.0
        } else {
            0.0
        };
        let mut attn_factor = 1.0;
        if ext_factor != 0.0 {
            let factor = 1.0 / freq_scale;
            attn_factor = if yarn_log_mul != 0.0 {
                yarn_mscale(factor, 1.0) / yarn_mscale(factor, yarn_log_mul)
            } else {
                yarn_mscale(factor, 1.0)
            };
            // ggml multiplies by this again inside the rope.
            attn_factor *= 1.0 / (1.0 + 0.1 * factor.ln());
        }
        attn_factor *= self.rope_attn_factor;
        RopeCfg {
            n_rot: self.n_rot,
            base: self.rope_base,
            freq_scale,
            ext_factor,
            attn_factor,
            beta_fast: beta.0,
            beta_slow: beta.1,
            n_ctx_orig: self.n_ctx_orig,
            // The file's factors, where it has them: long-rope's long or short ones as the
            // context window decides (set_context_window), or its `rope_freqs`.
            factors: Factors::Long,
            mrope: None,
        }
    }

    /// A llama-like decoder from these parameters: `norm` norms with the epsilon of the key
    /// llama.cpp reads for that kind, rope (pairs `pairs`) on every layer without a window,
    /// a gated SiLU FFN, sequential blocks, attention scaled by 1/sqrt(hd), and `tensors`.
    pub fn decoder(
        &self,
        k: &Keys,
        norm: NormKind,
        pairs: RopePairs,
        tensors: TensorRules,
    ) -> Result<DecoderConfig> {
        let norm_eps = match norm {
            NormKind::Rms => k.f32("attention.layer_norm_rms_epsilon")?,
            NormKind::Layer => k.f32("attention.layer_norm_epsilon")?,
        };
        Ok(DecoderConfig {
            arch: self.arch.clone(),
            n_layer: self.n_layer,
            d_model: self.d_model,
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
            context_len: self.context_len,
            norm,
            norm_eps,
            embed_scale: None,
            attn: Attn {
                scale: 1.0 / (self.head_dim as f32).sqrt(),
                softcap: None,
                clamp: None,
                qk_norm: QkNorm::None,
                temperature: None,
                sinks: false,
                gated_output: false,
                v_norm: false,
            },
            parallel: false,
            gated: true,
            activation: Activation::Silu,
            residual_scale: None,
            logit_scale: None,
            final_softcap: None,
            layers: vec![
                LayerPlan {
                    window: None,
                    rope: Some(0),
                    mixer: Mixer::Attention,
                    ffn: true,
                    heads: HeadShape {
                        heads: self.n_head,
                        kv_heads: self.n_kv_head,
                        dim: self.head_dim,
                    },
                    kv_from: None,
                };
                self.n_layer
            ],
            ropes: vec![self.rope((32.0, 1.0), 0.0)],
            rope_pairs: pairs,
            tensors,
            moe: None,
            per_layer_input: 0,
            mtp_blocks: self.nextn,
        })
    }

    /// The mixture of experts of a file with `expert_count` above 0 (None for a dense one), as
    /// llama.cpp's graph for the family runs it: `ff` each expert's width, `norm_weights`,
    /// `scales`, `gate` and `shared` as [`MoeCfg`] says.
    pub fn moe(
        &self,
        k: &Keys,
        width: ExpertWidth,
        norm_weights: bool,
        scales: bool,
        gate: Need,
        shared: SharedExpert,
    ) -> Result<Option<MoeCfg>> {
        if self.n_expert == 0 {
            return Ok(None);
        }
        let n_used = k.usize_or("expert_used_count", 0)?;
        if n_used == 0 || n_used > self.n_expert || self.n_expert > 1024 {
            bail!(
                "{}.expert_used_count is {n_used} of {} experts: expected 1 to {}",
                self.arch,
                self.n_expert,
                self.n_expert.min(1024)
            );
        }
        let groups = self.expert_groups(k)?;
        let n_ff = k.usize_or("feed_forward_length", 0)?;
        let ff = match width {
            ExpertWidth::FeedForward => n_ff,
            ExpertWidth::ExpertKey => match k.usize_or("expert_feed_forward_length", 0)? {
                0 => n_ff / n_used,
                n => n,
            },
        };
        if ff == 0 {
            bail!("{}: the experts' FFN width is 0", self.arch);
        }
        Ok(Some(MoeCfg {
            n_expert: self.n_expert,
            n_used,
            ff,
            norm_weights,
            scales,
            shared_scales: false,
            gate,
            shared,
            gating: Gating::Softmax,
            biases: false,
            selection_bias: Need::Absent,
            weights_scale: 0.0,
            dense_lead: 0,
            groups,
        }))
    }

    /// `moe` of a family whose layers (past any leading dense ones) all have experts: a file
    /// without any is refused.
    pub fn with_experts(&self, moe: Option<MoeCfg>) -> Result<MoeCfg> {
        moe.ok_or_else(|| {
            anyhow::anyhow!(
                "{}.expert_count is 0: this architecture's layers have experts",
                self.arch
            )
        })
    }

    /// `expert_group_count` and `expert_group_used_count`, which llama.cpp reads for every
    /// architecture, held to what its loader asserts (fewer groups than experts; above one
    /// group: the experts split evenly, between 1 and count - 1 used) and to two experts a
    /// group at least (each group scores its best two).
    fn expert_groups(&self, k: &Keys) -> Result<Option<ExpertGroups>> {
        let count = k.usize_or("expert_group_count", 0)?;
        let used = k.usize_or("expert_group_used_count", 0)?;
        let arch = &self.arch;
        if count >= self.n_expert {
            bail!(
                "{arch}.expert_group_count is {count}: expected fewer groups than the {} experts",
                self.n_expert
            );
        }
        if count <= 1 {
            return Ok(None);
        }
        if !self.n_expert.is_multiple_of(count) || self.n_expert / count < 2 {
            bail!(
                "{arch}.expert_group_count is {count}: {} experts do not make groups of two or \
                 more alike",
                self.n_expert
            );
        }
        if used == 0 || used >= count {
            bail!(
                "{arch}.expert_group_used_count is {used}: expected 1 to {}",
                count - 1
            );
        }
        Ok(Some(ExpertGroups { count, used }))
    }

    /// `expert_gating_func` as llama.cpp's graph takes it for the families that read it:
    /// 1 softmax, 2 sigmoid, 3 softmax over the chosen logits; anything else (0, llama.cpp's
    /// "none", on which its graph aborts; 4, the square root of softplus) refused.
    pub fn gating(&self, k: &Keys) -> Result<Gating> {
        match k.usize_or("expert_gating_func", 0)? {
            1 => Ok(Gating::Softmax),
            2 => Ok(Gating::Sigmoid),
            3 => Ok(Gating::SoftmaxWeight),
            g => bail!(
                "{}.expert_gating_func is {g}: gen routes by softmax (1), sigmoid (2) or a softmax of the chosen logits (3)",
                self.arch
            ),
        }
    }

    /// llama.cpp refuses llama-family files whose rotary width is not the head width.
    pub fn whole_heads_rotate(&self) -> Result<()> {
        if self.n_rot != self.head_dim {
            bail!(
                "{}.rope.dimension_count {} is not the head width {}: {} rotates whole heads",
                self.arch,
                self.n_rot,
                self.head_dim,
                self.arch
            );
        }
        Ok(())
    }
}

/// `rope.dimension_sections` (multimodal rope's split of the rotary dimensions), empty when
/// absent. With text positions, every section turns by the same position: the rope of
/// halves-paired rotation.
pub fn rope_sections(k: &Keys, c: &Common) -> Result<Vec<i64>> {
    use candle_core::quantized::gguf_file::Value;
    match k.get("rope.dimension_sections") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.to_i32()
                    .map(|x| x as i64)
                    .or_else(|_| v.to_u32().map(|x| x as i64))
            })
            .collect::<std::result::Result<Vec<i64>, _>>()
            .map_err(|e| anyhow::anyhow!("{}.rope.dimension_sections: {e}", c.arch)),
        Some(_) => bail!("{}.rope.dimension_sections should be an array", c.arch),
        None => Ok(Vec::new()),
    }
}

/// Multimodal rope as it turns text (`rope.dimension_sections`, required, as llama.cpp's
/// Qwen2-VL and Qwen3-VL loaders require it): at most four sections, the first three not all
/// 0, their sum at most a head's width (ggml asserts both). `interleaved`: Qwen3-VL's IMROPE.
pub fn text_mrope(k: &Keys, c: &Common, interleaved: bool) -> Result<TextMrope> {
    let key = format!("{}.rope.dimension_sections", c.arch);
    let v = rope_sections(k, c)?;
    if v.is_empty() {
        bail!("{key} is missing: multimodal rope needs its sections");
    }
    let mut sections = [0u32; 4];
    for (i, &x) in v.iter().enumerate() {
        match (sections.get_mut(i), u32::try_from(x)) {
            (Some(slot), Ok(x)) => *slot = x,
            _ => bail!("{key} is {v:?}: expected at most four sections of 0 or more"),
        }
    }
    let sum: usize = sections.iter().map(|&x| x as usize).sum();
    if sections[..3].iter().all(|&x| x == 0) || sum > c.head_dim {
        bail!(
            "{key} is {v:?}: the first three all 0, or more than the head's {}",
            c.head_dim
        );
    }
    Ok(TextMrope {
        sections,
        interleaved,
    })
}

/// Which layers have a sliding window, from `attention.sliding_window_pattern` as llama.cpp's
/// `load_swa_pattern` reads it: a per-layer array (1: windowed), or a number n (or
/// `default_pattern` when absent): every n-th layer attends to everything, the others through
/// the window (n = 0: all windowed, 1: none). Windowed layers whose head or rotary width
/// (`key_length_swa`, `value_length_swa`, `rope.dimension_count_swa`) differs from the others'
/// are refused.
pub fn swa_layers(k: &Keys, c: &Common, default_pattern: usize) -> Result<Vec<bool>> {
    for (key, full) in [
        ("attention.key_length_swa", c.head_dim),
        ("attention.value_length_swa", c.head_dim),
        ("rope.dimension_count_swa", c.n_rot),
    ] {
        if let Some(v) = k.usize_opt(key)?.filter(|&v| v != full) {
            bail!(
                "{}.{key} {v} differs from the full-attention layers' {full}: not supported",
                k.arch
            );
        }
    }
    if let Some(flags) = k.layer_flags("attention.sliding_window_pattern", c.n_layer)? {
        return Ok(flags);
    }
    let n = k.usize_or("attention.sliding_window_pattern", default_pattern)?;
    Ok((0..c.n_layer).map(|l| n == 0 || l % n < n - 1).collect())
}

impl DecoderConfig {
    /// Only the windowed layers rotate (EXAONE 4's 32B, K-EXAONE): the others lose their rope.
    pub fn rope_on_windows_only(&mut self) {
        for plan in &mut self.layers {
            if plan.window.is_none() {
                plan.rope = None;
            }
        }
    }

    /// Put `window` on the layers `swa` marks; with `local_rope`, those layers rotate by it.
    pub fn set_windows(&mut self, window: usize, swa: &[bool], local_rope: Option<RopeCfg>) {
        let local = local_rope.map(|r| {
            self.ropes.push(r);
            self.ropes.len() - 1
        });
        for (plan, &windowed) in self.layers.iter_mut().zip(swa) {
            if windowed {
                plan.window = Some(window);
                if let (Some(r), Some(_)) = (local, plan.rope) {
                    plan.rope = Some(r);
                }
            }
        }
    }

    /// What the rest of gen takes for granted.
    fn check(&self) -> Result<()> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!(
                "head width {} must be even and non-zero for rotary embeddings",
                self.head_dim
            );
        }
        if self.layers.iter().any(|l| l.window == Some(0)) {
            bail!("{}: a sliding window of 0 tokens", self.arch);
        }
        if self.norm_eps <= 0.0 {
            bail!("{}: a norm epsilon of {}", self.arch, self.norm_eps);
        }
        Ok(())
    }

    /// Use long-rope's long factors when the context window in use exceeds the original
    /// context, its short ones otherwise (llama.cpp's `get_rope_factors`, on its context
    /// rounded up to a multiple of 256 as llama.cpp rounds it).
    pub fn set_context_window(&mut self, window: usize) {
        let window = window.div_ceil(256) * 256;
        for r in &mut self.ropes {
            if matches!(r.factors, Factors::Long | Factors::Short) {
                r.factors = if window > r.n_ctx_orig {
                    Factors::Long
                } else {
                    Factors::Short
                };
            }
        }
    }
}
