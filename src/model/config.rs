//! What a decoder computes, as plain data: the hyper-parameters every architecture shares, and
//! the few choices that set one apart (norms, rotary embeddings per layer, attention scaling and
//! soft-capping, the FFN's shape and activation, parallel or sequential blocks, scales on the
//! residual and the logits, sliding windows) plus which tensors a file may hold
//! ([`TensorRules`]). [`super::arch`] fills it in, one architecture at a time, from a file's
//! metadata read as llama.cpp reads it ([`Keys`]); the weights loader and both backends only
//! read it.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value;

pub use super::rope::{RopeCfg, RopePairs};

/// How a norm normalises: llama.cpp's LLM_NORM_RMS or LLM_NORM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// x / sqrt(mean(x²) + eps)
    Rms,
    /// (x - mean) / sqrt(var + eps)
    Layer,
}

/// The FFN's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (Hugging Face's `gelu_pytorch_tanh`, ggml's `gelu`).
    GeluTanh,
    /// relu(x)² (Arcee, Nemotron, Jais 2).
    ReluSquared,
    /// gpt-oss's clamped SwiGLU (ggml's `swiglu_oai`, always gated): with g = min(gate, 7)
    /// and u = clamp(up, -7, 7), g·sigmoid(1.702·g)·(u + 1).
    SwigluOai,
}

/// gpt-oss's SwiGLU constants, as llama.cpp's graph fixes them (alpha, limit).
pub const SWIGLU_OAI: (f32, f32) = (1.702, 7.0);

/// How q and k are normalised before (or after) rope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Each head over its hd values, weights of hd (Qwen3, Gemma 3); `after_rope` for
    /// Hunyuan and Maincoder.
    Heads {
        after_rope: bool,
    },
    /// The whole projection (h*hd or kv*hd) at once (OLMo 2).
    Whole,
    /// Each head over its hd values before rope, with weights of its own: (h, hd) and
    /// (kv, hd) (Command R+, StableLM 2).
    EachHead,
}

/// Whether a tensor may, must or must not be in the file, and whether it is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Not read: a file holding it is refused.
    Absent,
    /// Read and used when present.
    Optional,
    /// Must be present.
    Required,
    /// Read by llama.cpp but never used by its graph: accepted and ignored alike.
    Ignored,
}

impl Need {
    pub fn allowed(self) -> bool {
        self != Need::Absent
    }
}

/// A norm's tensors: none (no norm at that place), a norm without weights, or weights (and
/// maybe a bias).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormRule {
    None,
    Plain,
    Weighted {
        bias: Need,
    },
    /// Weighted where the file has the weight, no norm where it has not (StableLM's FFN
    /// norm: without it, the FFN reads attention's normalised input, side by side).
    WeightedIfPresent {
        bias: Need,
    },
}

/// Where the output layer's matrix comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// `output.weight`, or the embedding matrix when the file has none.
    TiedIfAbsent,
    /// Always the embedding matrix (`output.weight` is refused).
    Tied,
    /// `output.weight` must be present.
    Own,
}

/// Per-layer rope frequency factors a file may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeFactors {
    None,
    /// `rope_freqs.weight` (Llama 3), used when present.
    Freqs,
    /// `rope_freqs.weight`, which must be there (Gemma 4's global layers' partial rotation).
    FreqsRequired,
    /// `rope_freqs.weight` accepted but not used (Refact).
    FreqsIgnored,
    /// `rope_factors_long.weight` / `rope_factors_short.weight` (long-rope: Phi-3.5/4).
    LongShort,
}

/// Which tensors an architecture reads, as llama.cpp's loader for it creates them. A file
/// holding any other tensor is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRules {
    pub attn_norm: NormRule,
    pub post_attn_norm: NormRule,
    pub ffn_norm: NormRule,
    /// The FFN norm's tensor: `ffn_norm`, or `post_attention_norm` where a family stores it
    /// under that name (Seed-OSS).
    pub ffn_norm_name: &'static str,
    /// The final norm's tensor: `output_norm`, or `token_embd_norm` (LFM2's files).
    pub output_norm_name: &'static str,
    pub post_ffn_norm: NormRule,
    pub output_norm: NormRule,
    /// Biases of q, k and v (of the fused `attn_qkv`, or one each): llama.cpp reads q/k/v as
    /// three matrices or one fused matrix, whichever the file holds.
    pub qkv_bias: Need,
    /// q, k and v only as one `attn_qkv` matrix (the family's loader creates no others).
    pub fused_qkv: bool,
    /// `attn_v`: Required, or Optional where v is k as projected when absent (Gemma 4).
    pub values: Need,
    /// `layer_output_scale`: one factor on a layer's output (Gemma 4), where it may be.
    pub layer_out_scale: Need,
    /// `attn_q_norm` / `attn_k_norm`, read as [`Attn::qk_norm`] says.
    pub qk_norm: Need,
    pub wo_bias: Need,
    /// `ffn_gate`; absent where the FFN is not gated, or gate and up are one matrix.
    pub ffn_gate: Need,
    /// `ffn_up` holds gate and up, gate first (Phi-3, GLM-4).
    pub fused_gate_up: bool,
    pub ffn_bias: Need,
    /// Whether the FFN's per-tensor `.scale` factors are applied (llama.cpp applies them for
    /// llama, qwen3, mistral3, cohere2 and a few more; the others ignore them).
    pub ffn_scales: bool,
    pub output: Output,
    pub output_bias: Need,
    pub rope_factors: RopeFactors,
    /// Other tensors llama.cpp reads but does not use for text generation (a reranker's
    /// head, an embedding model's projections).
    pub ignored: &'static [&'static str],
}

impl TensorRules {
    /// llama.cpp's llama: RMS norms with weights, q/k/v (fused or not, biases optional), an
    /// optional output bias on attention, a gated FFN with optional biases.
    pub const LLAMA: TensorRules = TensorRules {
        attn_norm: NormRule::Weighted { bias: Need::Absent },
        post_attn_norm: NormRule::None,
        ffn_norm: NormRule::Weighted { bias: Need::Absent },
        ffn_norm_name: "ffn_norm",
        output_norm_name: "output_norm",
        post_ffn_norm: NormRule::None,
        output_norm: NormRule::Weighted { bias: Need::Absent },
        qkv_bias: Need::Optional,
        fused_qkv: false,
        values: Need::Required,
        layer_out_scale: Need::Absent,
        qk_norm: Need::Absent,
        wo_bias: Need::Optional,
        ffn_gate: Need::Required,
        fused_gate_up: false,
        ffn_bias: Need::Optional,
        ffn_scales: true,
        output: Output::TiedIfAbsent,
        output_bias: Need::Absent,
        rope_factors: RopeFactors::Freqs,
        ignored: &[],
    };

    /// The common core of llama-like loaders: q/k/v (biases optional), no other biases, no
    /// rope factors, FFN scales not applied.
    pub const PLAIN: TensorRules = TensorRules {
        wo_bias: Need::Absent,
        ffn_bias: Need::Absent,
        ffn_scales: false,
        rope_factors: RopeFactors::None,
        ..TensorRules::LLAMA
    };
}

/// Attention's arithmetic beyond q·k and softmax.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attn {
    /// Factor on q·k (llama.cpp's kq_scale, or the factor some families put on q instead).
    pub scale: f32,
    /// Scores become c·tanh(s / c) after scaling (Gemma 2).
    pub softcap: Option<f32>,
    /// q, k and v are clamped to [-c, c] after their biases (OLMo).
    pub clamp: Option<f32>,
    pub qk_norm: QkNorm,
    /// Mistral 3's temperature: q *= 1 + scale·ln(1 + floor((pos + offset) / floor_scale)).
    pub temperature: Option<(f32, f32, f32)>,
    /// `attn_sinks` (gpt-oss): one learned logit per query head that joins every softmax's
    /// denominator and takes no value (llama.cpp's `soft_max_ext` with sinks).
    pub sinks: bool,
    /// The q projection holds, per head, its query and then a gate: attention's output is
    /// times sigmoid(gate) before the output projection (Qwen3.5, Qwen3-Next).
    pub gated_output: bool,
    /// v is RMS-normed per head, without weights, before the cache (Gemma 4).
    pub v_norm: bool,
}

/// One layer's plan: what mixes its tokens, and for attention the window its queries see and
/// its rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPlan {
    /// A query attends to itself and the `window - 1` tokens before it; None: everything.
    pub window: Option<usize>,
    /// Index into [`DecoderConfig::ropes`]; None: no rotary embedding on this layer.
    pub rope: Option<usize>,
    pub mixer: Mixer,
    /// Whether the layer has an FFN after its mixer (Nemotron-H's layers have one or the other).
    pub ffn: bool,
    /// Its attention's heads (the model's own on most architectures; Gemma 4's windowed and
    /// global layers differ in width and in kv heads).
    pub heads: HeadShape,
    /// An attention layer that keeps no keys and values of its own but reads this earlier
    /// layer's (Gemma 4's last `shared_kv_layers`): its q only is computed.
    pub kv_from: Option<usize>,
}

/// An attention layer's heads: `heads` query heads over `kv_heads` key/value heads, each
/// `dim` wide (keys and values alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
}

/// What mixes a layer's tokens: attention over the paged KV cache, or a recurrent block whose
/// state per sequence the model keeps beside the cache ([`super::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    Attention,
    /// None: the layer is its FFN alone, on the layer's one norm (Nemotron-H's MLP layers).
    None,
    /// LFM2's gated short convolution: `shortconv.in_proj` gives b, c and x (d each), the
    /// channels of b·x are convolved causally over the last `taps` tokens (`shortconv.conv`,
    /// (d, taps)), times c, then `shortconv.out_proj`. State: the last taps - 1 values of b·x.
    ShortConv {
        taps: usize,
    },
    /// Gated DeltaNet (Qwen3.5, Qwen3-Next): see [`DeltaNet`].
    DeltaNet(DeltaNet),
    /// Mamba-2 (Granite 4.0-H, Mamba-2): see [`Mamba2`].
    Mamba2(Mamba2),
}

impl Mixer {
    /// Floats of state one sequence keeps for a layer of this kind (d: the model's width).
    pub fn state_floats(&self, d: usize) -> usize {
        match *self {
            Mixer::Attention | Mixer::None => 0,
            Mixer::ShortConv { taps } => (taps - 1) * d,
            Mixer::DeltaNet(n) => n.conv_floats() + n.v_heads * n.k_dim * n.v_dim,
            Mixer::Mamba2(m) => (m.taps - 1) * m.conv_channels() + m.d_inner * m.d_state,
        }
    }
}

/// A Mamba-2 layer's shape: `heads` heads of d_inner / heads channels, each with a state of
/// d_state per channel, B and C shared by the heads of each of `groups` groups, a causal
/// convolution of `taps` over x, B and C.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mamba2 {
    pub d_inner: usize,
    pub heads: usize,
    pub groups: usize,
    pub d_state: usize,
    pub taps: usize,
}

impl Mamba2 {
    /// The convolved channels: x (d_inner), then B and C (groups · d_state each).
    pub fn conv_channels(&self) -> usize {
        self.d_inner + 2 * self.groups * self.d_state
    }
}

/// A Gated DeltaNet layer's shape: `k_heads` query/key heads of `k_dim`, `v_heads` value heads
/// of `v_dim` (a multiple of the key heads, each key head serving v_heads / k_heads of them),
/// and a causal convolution of `taps` over the q, k and v channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNet {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub taps: usize,
    /// Value head j reads key head j / (v_heads / k_heads) (Qwen3-Next), not j mod k_heads
    /// (Qwen3.5, whose converter tiles the value heads); Qwen3-Next's `ssm_ba` also holds b
    /// and a grouped by key head, and its graph applies no scale to the block's products.
    pub grouped: bool,
}

impl DeltaNet {
    /// The convolved channels: q and k (k_heads · k_dim each), then v (v_heads · v_dim).
    pub fn conv_channels(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    pub fn conv_floats(&self) -> usize {
        (self.taps - 1) * self.conv_channels()
    }
}

/// A mixture-of-experts FFN on every layer, as llama.cpp's `build_moe_ffn` runs it for the
/// family: a router picks `n_used` of `n_expert` experts per token by the softmax of its
/// logits, each expert is a gated FFN of width `ff`, and the token's output is the sum of the
/// chosen experts' outputs times their weights (in the order chosen), plus a shared expert's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeCfg {
    pub n_expert: usize,
    pub n_used: usize,
    /// Each routed expert's FFN width (the file's tensors must have it).
    pub ff: usize,
    /// The chosen experts' weights divided by their sum (the sum clamped below at 2^-14).
    pub norm_weights: bool,
    /// `ffn_{gate,up,down}_exps.scale` applied after each product (read and ignored otherwise).
    pub scales: bool,
    /// The shared expert's `ffn_{gate,up,down}_shexp.scale` applied likewise (Qwen3.5 MoE,
    /// Qwen3-Next); read and ignored otherwise.
    pub shared_scales: bool,
    /// `ffn_gate_exps`: Required, or Optional (an expert without it is act(up)).
    pub gate: Need,
    pub shared: SharedExpert,
    /// How the router's logits become the chosen experts and their weights.
    pub gating: Gating,
    /// Biases on the router and on each expert's gate, up and down (gpt-oss): the router's
    /// added to its logits, each expert's after its product.
    pub biases: bool,
    /// `exp_probs_b`: a bias added to the probabilities for choosing the experts only, their
    /// weights staying unbiased (dots.llm1, DeepSeek-V3 style): read where it may be.
    pub selection_bias: Need,
    /// The chosen weights times this, where it is neither 0 nor 1 (`expert_weights_scale`).
    pub weights_scale: f32,
    /// Layers before this one have a dense FFN (`leading_dense_block_count`).
    pub dense_lead: usize,
    /// Group-limited routing (`expert_group_count`, `expert_group_used_count`): the experts
    /// in this many equal groups, a token choosing only among those of its best groups.
    pub groups: Option<ExpertGroups>,
}

/// DeepSeek-V3-style groups of experts: a group scores the sum of its two highest selection
/// probabilities, and a token's experts come from its `used` best groups alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertGroups {
    pub count: usize,
    pub used: usize,
}

/// A router's gating (llama.cpp's `expert_gating_func` as the family's graph passes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert, the top k of those probabilities, their weights as they are
    /// (or renormalised).
    Softmax,
    /// Top k of the raw logits, then a softmax over those k alone (gpt-oss).
    SoftmaxWeight,
    /// The sigmoid of each logit, the top k of those, their weights as they are (or
    /// renormalised).
    Sigmoid,
}

/// An expert every token goes through, beside the routed ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedExpert {
    None,
    /// Added as it is (Granite MoE), FFN width `ff`.
    Plain {
        ff: usize,
    },
    /// Times sigmoid(x · `ffn_gate_inp_shexp`) (Qwen2 MoE), FFN width `ff`.
    Gated {
        ff: usize,
    },
    /// The layer's own dense FFN (`ffn_gate`, `ffn_up`, `ffn_down`) beside the experts
    /// (Gemma 4): the dense one reads the FFN norm of the residual and is normed after by
    /// `post_ffw_norm_1`; the experts read `pre_ffw_norm_2` of it and are normed after by
    /// `post_ffw_norm_2`; the router reads the residual RMS-normed without weights, times
    /// 1/sqrt(d) and `ffn_gate_inp.scale`. A layer without `ffn_gate_inp` is dense.
    Beside,
}

/// Hyper-parameters and graph choices of a decoder, read from a file's metadata.
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    /// GGUF `general.architecture`.
    pub arch: String,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub context_len: usize,
    pub norm: NormKind,
    pub norm_eps: f32,
    /// Embeddings are multiplied by this (Gemma: sqrt(d); Granite: embedding_scale).
    pub embed_scale: Option<f32>,
    pub attn: Attn,
    /// `x + attn(n) + ffn(n)` from one normalised input (Phi-2, Cohere), else sequential.
    pub parallel: bool,
    /// Whether the FFN has a gate (act(gate)·up) or not (act(up)).
    pub gated: bool,
    pub activation: Activation,
    /// Attention's and the FFN's outputs are multiplied by this before their residual adds.
    pub residual_scale: Option<f32>,
    /// Logits are multiplied by this (Cohere; Granite's 1/logit_scale).
    pub logit_scale: Option<f32>,
    /// Logits become c·tanh(l / c) (Gemma 2).
    pub final_softcap: Option<f32>,
    pub layers: Vec<LayerPlan>,
    pub ropes: Vec<RopeCfg>,
    pub rope_pairs: RopePairs,
    pub tensors: TensorRules,
    /// Some: every layer's FFN is a mixture of experts.
    pub moe: Option<MoeCfg>,
    /// Gemma 4's per-layer input width (`embedding_length_per_layer_input`; 0: none).
    pub per_layer_input: usize,
    /// Multi-token prediction blocks after the last layer (GLM-4.5's): their tensors are
    /// accepted and not read, as llama.cpp skips them unless asked to speculate with them.
    pub mtp_blocks: usize,
}

impl DecoderConfig {
    /// The sliding window of layer `l`, or `None` where it attends to the whole context.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        self.layers[l].window
    }

    /// Whether any layer keeps a recurrent state per sequence (a hybrid model).
    pub fn recurrent(&self) -> bool {
        self.layers
            .iter()
            .any(|l| l.mixer.state_floats(self.d_model) > 0)
    }

    /// The layer whose cache layer `l` reads: its own, or the one it shares.
    pub fn cache_layer(&self, l: usize) -> usize {
        self.layers[l].kv_from.unwrap_or(l)
    }

    /// Per layer, the shape of its own keys and values in the cache: (kv heads, width), or
    /// (0, 0) for a layer keeping none (no attention, or another layer's cache read).
    pub fn kv_layout(&self) -> Vec<(usize, usize)> {
        self.layers
            .iter()
            .map(|l| match (l.mixer, l.kv_from) {
                (Mixer::Attention, None) => (l.heads.kv_heads, l.heads.dim),
                _ => (0, 0),
            })
            .collect()
    }

    /// Floats of keys and values one token keeps in the cache, over every layer.
    pub fn kv_floats_per_token(&self) -> usize {
        self.kv_layout().iter().map(|(kv, hd)| 2 * kv * hd).sum()
    }

    /// The rotary embedding of layer `l`, if it has one.
    pub fn layer_rope(&self, l: usize) -> Option<&RopeCfg> {
        self.layers[l].rope.map(|r| &self.ropes[r])
    }
}

/// A file's metadata as one architecture reads it: `name` in calls means `ARCH.name`.
/// Lenient in integer and float widths (llama.cpp wants exactly u32 / f32, and refuses the
/// rest), strict in meaning: a value that is there but unusable is an error naming the key.
pub struct Keys<'a> {
    md: &'a HashMap<String, Value>,
    pub arch: &'a str,
}

impl<'a> Keys<'a> {
    pub fn new(md: &'a HashMap<String, Value>, arch: &'a str) -> Self {
        Self { md, arch }
    }

    fn full(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.md.get(&self.full(key))
    }

    /// A key without the architecture prefix (`general.name`, Apertus's `xielu.*`).
    pub fn get_global(&self, key: &str) -> Option<&'a Value> {
        self.md.get(key)
    }

    fn as_u64(&self, key: &str, v: &Value) -> Result<u64> {
        Ok(match v {
            Value::U8(n) => *n as u64,
            Value::U16(n) => *n as u64,
            Value::U32(n) => *n as u64,
            Value::U64(n) => *n,
            Value::I8(n) if *n >= 0 => *n as u64,
            Value::I16(n) if *n >= 0 => *n as u64,
            Value::I32(n) if *n >= 0 => *n as u64,
            Value::I64(n) if *n >= 0 => *n as u64,
            // A per-layer array whose layers all agree is that value (llama.cpp's saver
            // collapses uniform arrays; a converter may not).
            Value::Array(a) if !a.is_empty() => {
                let first = self.as_u64(key, &a[0])?;
                for x in &a[1..] {
                    if self.as_u64(key, x)? != first {
                        bail!(
                            "{} differs between layers: gen runs only models whose layers are alike",
                            self.full(key)
                        );
                    }
                }
                first
            }
            other => bail!(
                "metadata key {} should be a non-negative integer, found {}",
                self.full(key),
                short(other)
            ),
        })
    }

    /// An integer key, if present.
    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = self.as_u64(key, v)?;
        usize::try_from(n)
            .map(Some)
            .with_context(|| format!("metadata key {} is too large", self.full(key)))
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?
            .with_context(|| format!("metadata key {} is missing", self.full(key)))
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.usize_opt(key)?.unwrap_or(default))
    }

    /// A float key, if present (a per-layer array whose layers agree counts as one value).
    pub fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let f = match v {
            Value::Array(a) if !a.is_empty() => {
                let vals: Vec<f32> = a.iter().filter_map(|x| x.to_f32().ok()).collect();
                if vals.len() != a.len() || vals.iter().any(|x| *x != vals[0]) {
                    bail!(
                        "{} differs between layers: gen runs only models whose layers are alike",
                        self.full(key)
                    );
                }
                vals[0]
            }
            Value::F32(f) => *f,
            Value::F64(f) => *f as f32,
            other => bail!(
                "metadata key {} should be a number, found {}",
                self.full(key),
                short(other)
            ),
        };
        if !f.is_finite() {
            bail!("metadata key {} is {f}", self.full(key));
        }
        Ok(Some(f))
    }

    pub fn f32(&self, key: &str) -> Result<f32> {
        self.f32_opt(key)?
            .with_context(|| format!("metadata key {} is missing", self.full(key)))
    }

    pub fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        Ok(self.f32_opt(key)?.unwrap_or(default))
    }

    pub fn bool(&self, key: &str) -> Result<bool> {
        if self.get(key).is_none() {
            bail!("metadata key {} is missing", self.full(key));
        }
        self.bool_or(key, false)
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => bail!(
                "metadata key {} should be true or false, found {}",
                self.full(key),
                short(other)
            ),
        }
    }

    pub fn string_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => bail!(
                "metadata key {} should be a string, found {}",
                self.full(key),
                short(other)
            ),
        }
    }

    /// A per-layer array of counts, or None when absent or a scalar.
    pub fn layer_counts(&self, key: &str, n_layer: usize) -> Result<Option<Vec<usize>>> {
        let Some(Value::Array(a)) = self.get(key) else {
            return Ok(None);
        };
        if a.len() < n_layer {
            bail!(
                "metadata key {} has {} entries for {n_layer} layers",
                self.full(key),
                a.len()
            );
        }
        a.iter()
            .map(|v| Ok(self.as_u64(key, v)? as usize))
            .collect::<Result<Vec<usize>>>()
            .map(Some)
    }

    /// A per-layer flag array (u32/i32/bool; 1 or true: set), or None when absent or a scalar.
    pub fn layer_flags(&self, key: &str, n_layer: usize) -> Result<Option<Vec<bool>>> {
        let Some(Value::Array(a)) = self.get(key) else {
            return Ok(None);
        };
        if a.len() != n_layer {
            bail!(
                "metadata key {} has {} entries for {n_layer} layers",
                self.full(key),
                a.len()
            );
        }
        a.iter()
            .map(|v| match v {
                Value::Bool(b) => Ok(*b),
                other => Ok(self.as_u64(key, other)? != 0),
            })
            .collect::<Result<Vec<bool>>>()
            .map(Some)
    }
}

/// A value in a message: short, whatever it holds.
fn short(v: &Value) -> String {
    let s = format!("{v:?}");
    match s.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s,
    }
}
