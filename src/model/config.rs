//! What sets the families gen runs apart, as data: llama (Llama 2/3, SmolLM2, TinyLlama,
//! Mistral), Qwen2/2.5, Qwen3, Phi-3 and Gemma 3 share one forward pass; [`Family`] and
//! [`DecoderConfig`] (read from the GGUF metadata) say what differs: the rotary pairing, biases
//! on q/k/v, RMS norms of each head's q and k, norms after attention and after the FFN (Gemma's
//! "sandwich"), the FFN activation, a scale on the embeddings, the attention scale, and
//! per-layer sliding windows and rope bases.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;

/// Families gen can run, by GGUF `general.architecture` (see [`Family`]).
pub const SUPPORTED_ARCHS: &[&str] = &["llama", "qwen2", "qwen3", "phi3", "gemma3"];

/// A model family: its GGUF `general.architecture` and the operations that set it apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma3,
}

/// How rotary embeddings pair a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    /// Neighbours (2i, 2i + 1): llama.cpp's NORM, for llama GGUFs, whose converter permutes the
    /// q/k rows (and so does gen's safetensors loader, see `checkpoint`).
    Interleaved,
    /// The two halves of a head (i, i + hd/2): llama.cpp's NEOX, Hugging Face's rotate-half.
    Halves,
}

/// The FFN's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (Hugging Face's `gelu_pytorch_tanh`, ggml's `gelu`).
    GeluTanh,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Phi3,
        Family::Gemma3,
    ];

    /// The GGUF `general.architecture` of the family.
    pub fn arch(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Phi3 => "phi3",
            Family::Gemma3 => "gemma3",
        }
    }

    pub fn from_arch(arch: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.arch() == arch)
    }

    pub fn rope(self) -> Rope {
        match self {
            Family::Llama => Rope::Interleaved,
            Family::Qwen2 | Family::Qwen3 | Family::Phi3 | Family::Gemma3 => Rope::Halves,
        }
    }

    pub fn activation(self) -> Activation {
        match self {
            Family::Gemma3 => Activation::GeluTanh,
            _ => Activation::Silu,
        }
    }

    /// q and k projections carry biases (Qwen2).
    pub fn qkv_bias(self) -> bool {
        self == Family::Qwen2
    }

    /// Each head's q and k go through an RMS norm over hd before rope (Qwen3, Gemma 3).
    pub fn qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Gemma3)
    }

    /// Attention's and the FFN's outputs are normed before the residual add (Gemma 3).
    pub fn sandwich_norms(self) -> bool {
        self == Family::Gemma3
    }

    /// Embeddings are multiplied by sqrt(d) (Gemma).
    pub fn scales_embeddings(self) -> bool {
        self == Family::Gemma3
    }
}

/// Hyper-parameters read from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    pub family: Family,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    /// Rope base of layers that attend to the whole context.
    pub rope_base: f32,
    /// Rope base of sliding-window layers (Gemma 3's local layers: 10,000).
    pub rope_base_local: f32,
    /// A sliding-window layer's query attends to itself and the `window - 1` tokens before it.
    pub sliding_window: Option<usize>,
    /// With a window: in each run of `swa_pattern` layers the last one is global, the others
    /// local (Gemma 3: 6); 1 puts the window on every layer.
    pub swa_pattern: usize,
    /// Factor on q·k before the softmax.
    pub attn_scale: f64,
    pub context_len: usize,
}

/// Gemma 3's local layers use this rope base whatever the file says (as llama.cpp does).
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;
/// Gemma 3: five local layers, then one global.
const GEMMA3_SWA_PATTERN: usize = 6;

impl DecoderConfig {
    pub fn from_gguf(md: &HashMap<String, gguf_file::Value>, arch: &str) -> Result<Self> {
        let family = Family::from_arch(arch).with_context(|| {
            format!(
                "architecture {arch:?} is not supported (supported: {})",
                SUPPORTED_ARCHS.join(", ")
            )
        })?;
        let get_u = |key: &str| -> Result<usize> {
            let full = format!("{arch}.{key}");
            let v = md
                .get(&full)
                .with_context(|| format!("metadata key {full} is missing"))?;
            let n = match v {
                gguf_file::Value::U32(n) => *n as u64,
                gguf_file::Value::I32(n) if *n >= 0 => *n as u64,
                gguf_file::Value::U64(n) => *n,
                gguf_file::Value::I64(n) if *n >= 0 => *n as u64,
                other => {
                    bail!("metadata key {full} should be a non-negative integer, found {other:?}")
                }
            };
            usize::try_from(n).with_context(|| format!("metadata key {full} is too large"))
        };
        let get_f = |key: &str| -> Option<f32> {
            md.get(&format!("{arch}.{key}"))
                .and_then(|v| v.to_f32().ok())
        };
        let n_layer = get_u("block_count")?;
        let d_model = get_u("embedding_length")?;
        let n_head = get_u("attention.head_count")?;
        let n_kv_head = get_u("attention.head_count_kv").unwrap_or(n_head);
        let context_len = get_u("context_length")?;
        if n_head == 0 || n_kv_head == 0 || d_model == 0 || n_layer == 0 || context_len == 0 {
            bail!("metadata gives a zero size (layers {n_layer}, width {d_model}, heads {n_head}/{n_kv_head}, context {context_len})");
        }
        if n_head % n_kv_head != 0 {
            bail!("{arch}.attention.head_count ({n_head}) is not a multiple of head_count_kv ({n_kv_head})");
        }
        let head_dim = match get_u("attention.key_length") {
            Ok(k) => k,
            Err(_) => {
                if d_model % n_head != 0 {
                    bail!("{arch}.embedding_length ({d_model}) is not a multiple of head_count ({n_head})");
                }
                d_model / n_head
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            bail!("head width {head_dim} must be even and non-zero for rotary embeddings");
        }
        if let Ok(v) = get_u("attention.value_length") {
            if v != head_dim {
                bail!("{arch}.attention.value_length {v} differs from key_length {head_dim}; gen needs them equal");
            }
        }
        // What gen does not implement is refused rather than run wrongly.
        if let Ok(rot) = get_u("rope.dimension_count") {
            if rot != head_dim {
                bail!("{arch}.rope.dimension_count {rot} is not the head width {head_dim}: partial rotary embeddings are not supported");
            }
        }
        if let Some(kind) = md
            .get(&format!("{arch}.rope.scaling.type"))
            .and_then(|v| v.to_string().ok())
        {
            if kind != "none" {
                bail!("{arch}.rope.scaling.type is {kind:?}: scaled rotary embeddings are not supported yet");
            }
        }
        for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if get_f(key).is_some_and(|c| c > 0.0) {
                bail!("{arch}.{key} is set: logit soft-capping is not supported");
            }
        }
        let rope_base = get_f("rope.freq_base").unwrap_or(10_000.0);
        let window = get_u("attention.sliding_window").ok().filter(|&w| w > 0);
        let (sliding_window, swa_pattern, rope_base_local) = match family {
            Family::Gemma3 => (
                window,
                GEMMA3_SWA_PATTERN,
                get_f("rope.freq_base_swa").unwrap_or(GEMMA3_LOCAL_ROPE_BASE),
            ),
            Family::Phi3 => (window, 1, rope_base),
            // llama-family GGUFs (Mistral 7B v0.1 among them) are run without a window, as
            // llama.cpp does; Qwen2/3 GGUFs carry none.
            Family::Llama | Family::Qwen2 | Family::Qwen3 => (None, 1, rope_base),
        };
        let attn_scale = match get_f("attention.scale") {
            Some(s) if s > 0.0 => s as f64,
            // Gemma 3 27B scales by d / h rather than hd (llama.cpp; gemma_pytorch's config).
            _ if family == Family::Gemma3 && n_layer == 62 => {
                1.0 / ((d_model / n_head) as f64).sqrt()
            }
            _ => 1.0 / (head_dim as f64).sqrt(),
        };
        Ok(Self {
            family,
            n_layer,
            d_model,
            n_head,
            n_kv_head,
            head_dim,
            rms_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_base,
            rope_base_local,
            sliding_window,
            swa_pattern,
            attn_scale,
            context_len,
        })
    }

    /// The sliding window of layer `l`, or `None` where it attends to the whole context.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        let w = self.sliding_window?;
        let p = self.swa_pattern;
        (p <= 1 || l % p < p - 1).then_some(w)
    }

    pub fn layer_rope_base(&self, l: usize) -> f32 {
        match self.layer_window(l) {
            Some(_) => self.rope_base_local,
            None => self.rope_base,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(arch: &str, extra: &[(&str, gguf_file::Value)]) -> HashMap<String, gguf_file::Value> {
        use gguf_file::Value::U32;
        let mut md: HashMap<String, gguf_file::Value> = [
            ("block_count", U32(12)),
            ("embedding_length", U32(64)),
            ("attention.head_count", U32(4)),
            ("context_length", U32(128)),
        ]
        .into_iter()
        .map(|(k, v)| (format!("{arch}.{k}"), v))
        .collect();
        for (k, v) in extra {
            md.insert(format!("{arch}.{k}"), v.clone());
        }
        md
    }

    #[test]
    fn gemma3_layers_are_five_local_then_one_global() {
        use gguf_file::Value::{F32, U32};
        let cfg = DecoderConfig::from_gguf(
            &md(
                "gemma3",
                &[
                    ("attention.sliding_window", U32(8)),
                    ("rope.freq_base", F32(1e6)),
                ],
            ),
            "gemma3",
        )
        .unwrap();
        let global: Vec<usize> = (0..12).filter(|&l| cfg.layer_window(l).is_none()).collect();
        assert_eq!(global, [5, 11]);
        assert_eq!(cfg.layer_window(0), Some(8));
        assert_eq!(cfg.layer_rope_base(4), 10_000.0);
        assert_eq!(cfg.layer_rope_base(5), 1e6);
        assert_eq!(cfg.attn_scale, 1.0 / 4.0); // hd = 64 / 4 = 16

        // llama never gets a window; phi3 gets one on every layer.
        let llama = DecoderConfig::from_gguf(
            &md("llama", &[("attention.sliding_window", U32(8))]),
            "llama",
        )
        .unwrap();
        assert!((0..12).all(|l| llama.layer_window(l).is_none()));
        let phi =
            DecoderConfig::from_gguf(&md("phi3", &[("attention.sliding_window", U32(8))]), "phi3")
                .unwrap();
        assert!((0..12).all(|l| phi.layer_window(l) == Some(8)));
    }

    #[test]
    fn unimplemented_options_are_refused() {
        use gguf_file::Value::{String as S, F32, U32};
        for (arch, extra, expect) in [
            (
                "llama",
                ("rope.scaling.type", S("yarn".into())),
                "rope.scaling.type",
            ),
            ("phi3", ("rope.dimension_count", U32(8)), "partial rotary"),
            (
                "gemma3",
                ("final_logit_softcapping", F32(30.0)),
                "soft-capping",
            ),
        ] {
            let err = DecoderConfig::from_gguf(&md(arch, &[(extra.0, extra.1)]), arch)
                .unwrap_err()
                .to_string();
            assert!(err.contains(expect), "{arch}: {err}");
        }
        let err = DecoderConfig::from_gguf(&md("gpt2", &[]), "gpt2")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"gpt2\" is not supported") && err.contains("gemma3"),
            "{err}"
        );
    }
}
