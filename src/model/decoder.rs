//! The decoder-only transformer behind every family gen runs: llama (Llama 2/3, SmolLM2,
//! TinyLlama, Mistral), Qwen2/2.5, Qwen3, Phi-3 and Gemma 3. They share one forward pass; what
//! differs is data ([`Family`] and [`DecoderConfig`], read from the GGUF metadata): the rotary
//! pairing, biases on q/k/v, RMS norms of each head's q and k, norms after attention and after
//! the FFN (Gemma's "sandwich"), the FFN activation, a scale on the embeddings, the attention
//! scale, fused q/k/v and gate/up matrices, and per-layer sliding windows and rope bases.
//!
//! Shape legend: T = new tokens of a step, L = tokens in the cache after the step, C = capacity of
//! a sequence's cache, d = embedding width, h = query heads, kv = key/value heads, g = h / kv,
//! hd = head width, ff = FFN width, V = vocabulary.
//!
//! A pass runs every token of every step of the batch through each linear layer together (N
//! rows, so each weight is read once per pass), and attention per step against that step's own
//! sequence in the paged KV cache. A step's result does not depend on what else is in the batch.
//!
//! N (below) = tokens of all steps of a pass.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device, Tensor};

use super::checkpoint::Checkpoint;
use super::kv_cache::{KvStore, PagedKv, BLOCK_SIZE};
use super::profile::Profile;
use super::qlinear::{DeviceWeights, Projections, QLinear};
use super::{LanguageModel, ModelInfo, SeqStep};

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
                super::SUPPORTED_ARCHS.join(", ")
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

struct Layer {
    attn_norm: Tensor, // (d)
    /// q (h*hd, d), k (kv*hd, d), v (kv*hd, d): three matrices, or one of (h+2kv)*hd rows.
    qkv: Projections,
    qkv_bias: Option<[Tensor; 3]>,     // (h*hd), (kv*hd), (kv*hd)
    qk_norm: Option<(Tensor, Tensor)>, // (hd), (hd)
    wo: QLinear,                       // (d, h*hd)
    post_attn_norm: Option<Tensor>,    // (d)
    ffn_norm: Tensor,                  // (d)
    gate_up: Projections,              // gate (ff, d), up (ff, d); or one of 2ff rows
    w_down: QLinear,                   // (d, ff)
    post_ffn_norm: Option<Tensor>,     // (d)
    /// Index into the pass's attention views (one per distinct window) and rope tables.
    view: usize,
    rope: usize,
}

pub struct Decoder {
    info: ModelInfo,
    cfg: DecoderConfig,
    device: Device,
    /// Attention through our CPU kernels over the f16 host cache; false off the CPU, or with
    /// GEN_ATTENTION=candle, which runs the device path (gathered keys, candle's matrix
    /// products, an f32 cache) on the CPU so tests can check what a GPU runs.
    host_kernels: bool,
    embedding: QTensor, // (V, d)
    layers: Vec<Layer>,
    out_norm: Tensor, // (d)
    output: QLinear,  // (V, d)
    /// Distinct sliding windows (`None`: whole context) and rope bases among the layers.
    windows: Vec<Option<usize>>,
    rope_bases: Vec<f32>,
    kv: PagedKv,
    store: KvStore,
    profile: Profile,
    /// gen's CUDA kernels for the cache write and one-token attention.
    kernels: KernelMode,
    check: KernelCheck,
}

/// Where one step's queries find their keys for one kind of layer: CPU one-token steps read
/// the pages through the fused kernel; the others get their rows gathered.
enum StepKeys {
    /// A one-token step, through the fused decode kernel (CPU).
    Fused,
    /// A prompt chunk, through our causal prefill kernel (CPU), reading the cache in place.
    Prefill { window: Option<usize> },
    Gathered {
        rows: Vec<u32>,
        on_device: Option<Tensor>,
        mask: Option<Tensor>,
    },
    /// A one-token step off the CPU: attended with every other such step of the pass at once
    /// ([`DeviceDecode`]), row `usize` of its output.
    Batched(usize),
}

/// A one-token step off the CPU, as [`DeviceDecode`] takes it: its row among the N, its block
/// table, positions in its cache (its own included), the first position it may see, and the
/// cache rows of its keys (kv head by kv head) for candle's path.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct DeviceStep<'a> {
    at: usize,
    table: &'a [u32],
    end: usize,
    lo: usize,
    rows: Vec<u32>,
}

/// The one-token steps of a pass off the CPU, for one kind of layer, attended together: through
/// gen's CUDA kernel reading the paged cache in place, or through candle's operations on keys
/// gathered from the cache in one go, padded to the longest, a handful of launches for the
/// whole batch instead of a handful per step.
struct DeviceDecode {
    /// For the CUDA kernel.
    #[cfg(feature = "cuda")]
    meta: Option<super::cuda::DecodeMeta>,
    /// For candle's path: None when the kernel alone runs.
    gathered: Option<Gathered>,
    steps: usize,
}

/// The one-token steps' keys for candle's operations.
struct Gathered {
    /// Rows of q (N, h, hd) that are one-token steps, in order; None when all N are.
    q_rows: Option<Tensor>,
    /// B * kv * lmax cache rows: per step, per kv head, its keys from the first it may see
    /// on, padded by repeating its last key.
    rows: Tensor,
    /// (B, 1, lmax): 0 where a step has a key, -inf on its padding; None when none is padded.
    mask: Option<Tensor>,
    lmax: usize,
}

impl DeviceDecode {
    fn new(
        n: usize,
        steps: &[DeviceStep<'_>],
        kv: usize,
        kernels: KernelMode,
        device: &Device,
    ) -> Result<Self> {
        let b = steps.len();
        let gathered = (kernels != KernelMode::On)
            .then(|| Gathered::new(n, steps, kv, device))
            .transpose()?;
        #[cfg(feature = "cuda")]
        let meta = (kernels != KernelMode::Off)
            .then(|| {
                let info: Vec<_> = steps.iter().map(|s| (s.at, s.table, s.end, s.lo)).collect();
                super::cuda::DecodeMeta::new(&info, device)
            })
            .transpose()?;
        Ok(Self {
            #[cfg(feature = "cuda")]
            meta,
            gathered,
            steps: b,
        })
    }

    /// q: (N, h, hd); pools: (kv * P * BLOCK_SIZE, hd). Returns (B, h * hd).
    fn attend(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        cfg: &DecoderConfig,
        scale: f64,
        check: &KernelCheck,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(meta) = &self.meta {
            let y = super::cuda::decode_attention(
                q,
                k_pool,
                v_pool,
                meta,
                cfg.n_kv_head,
                scale as f32,
            )?;
            if let Some(g) = &self.gathered {
                let want = g.attend(q, k_pool, v_pool, cfg, scale, self.steps)?;
                check.attention(&y, &want)?;
            }
            return Ok(y);
        }
        let _ = check;
        self.gathered
            .as_ref()
            .context("one-token steps with neither kernel nor gathered keys")?
            .attend(q, k_pool, v_pool, cfg, scale, self.steps)
    }
}

impl Gathered {
    fn new(n: usize, steps: &[DeviceStep<'_>], kv: usize, device: &Device) -> Result<Self> {
        let b = steps.len();
        let lmax = steps.iter().map(|s| s.rows.len() / kv).max().unwrap_or(0);
        let mut rows = Vec::with_capacity(b * kv * lmax);
        let mut mask = vec![0f32; b * lmax];
        let mut padded = false;
        for (i, s) in steps.iter().enumerate() {
            let l = s.rows.len() / kv;
            for head in s.rows.chunks_exact(l) {
                rows.extend_from_slice(head);
                rows.extend(std::iter::repeat_n(head[l - 1], lmax - l));
            }
            mask[i * lmax + l..(i + 1) * lmax].fill(f32::NEG_INFINITY);
            padded |= l < lmax;
        }
        let in_order = b == n && steps.iter().enumerate().all(|(i, s)| s.at == i);
        let q_rows: Vec<u32> = steps.iter().map(|s| s.at as u32).collect();
        Ok(Self {
            q_rows: (!in_order)
                .then(|| Tensor::new(q_rows.as_slice(), device))
                .transpose()?,
            rows: Tensor::new(rows.as_slice(), device)?,
            mask: padded
                .then(|| Tensor::from_vec(mask, (b, 1, lmax), device))
                .transpose()?,
            lmax,
        })
    }

    fn attend(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        cfg: &DecoderConfig,
        scale: f64,
        b: usize,
    ) -> Result<Tensor> {
        let (h, kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let (l, g) = (self.lmax, h / kv);
        let q = match &self.q_rows {
            Some(r) => q.index_select(r, 0)?,
            None => q.clone(),
        };
        // Heads sharing a kv head sit next to each other: (B * kv, g, hd).
        let q = q.reshape((b * kv, g, hd))?;
        let keys = k_pool
            .index_select(&self.rows, 0)?
            .reshape((b * kv, l, hd))?;
        let values = v_pool
            .index_select(&self.rows, 0)?
            .reshape((b * kv, l, hd))?;
        let att = (q.matmul(&keys.t()?)? * scale)?; // (B * kv, g, L)
        let att = match &self.mask {
            Some(m) => att
                .reshape((b, kv * g, l))?
                .broadcast_add(m)?
                .reshape((b * kv, g, l))?,
            None => att,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        Ok(att.matmul(&values)?.reshape((b, h * hd))?)
    }
}

/// Whether gen's CUDA kernels run (see [`super::cuda`]): on a CUDA device, for shapes they
/// serve, with GEN_CUDA_KERNELS=1 (`On`) or `check`; always `Off` without the cuda feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelMode {
    Off,
    On,
    /// On, and compared with candle's operations.
    Check,
}

impl KernelMode {
    fn for_device(device: &Device, host_kernels: bool, cfg: &DecoderConfig) -> Self {
        #[cfg(feature = "cuda")]
        if !host_kernels
            && device.is_cuda()
            && super::cuda::supported(cfg.n_head, cfg.n_kv_head, cfg.head_dim)
        {
            return match std::env::var(super::cuda::ENV).as_deref() {
                Ok("1") => KernelMode::On,
                Ok("check") => KernelMode::Check,
                _ => KernelMode::Off,
            };
        }
        let _ = (device, host_kernels, cfg);
        KernelMode::Off
    }
}

/// GEN_CUDA_KERNELS=check: the largest differences between gen's kernels and candle's
/// operations over a run, printed to stderr when the model is dropped.
#[derive(Default)]
pub struct KernelCheck {
    on: bool,
    attention: std::cell::Cell<(f32, usize)>,
    write: std::cell::Cell<(f32, usize)>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl KernelCheck {
    fn new(on: bool) -> Self {
        Self {
            on,
            attention: Default::default(),
            write: Default::default(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.on
    }

    fn attention(&self, got: &Tensor, want: &Tensor) -> Result<()> {
        Self::note(&self.attention, got, want)
    }

    pub(crate) fn write(&self, got: &Tensor, want: &Tensor) -> Result<()> {
        Self::note(&self.write, got, want)
    }

    fn note(cell: &std::cell::Cell<(f32, usize)>, got: &Tensor, want: &Tensor) -> Result<()> {
        let diff = (got - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let (worst, calls) = cell.get();
        // NaN counts as the worst of all.
        cell.set((
            if diff.is_nan() || diff > worst {
                diff
            } else {
                worst
            },
            calls + 1,
        ));
        Ok(())
    }
}

impl Drop for KernelCheck {
    fn drop(&mut self) {
        if self.on {
            let (a, an) = self.attention.get();
            let (w, wn) = self.write.get();
            eprintln!(
                "cuda kernel check: attention largest |difference| {a:e} over {an} calls; \
                 kv write {w:e} over {wn} calls"
            );
        }
    }
}

impl Decoder {
    pub fn from_checkpoint(ckpt: &Checkpoint, device: &Device) -> Result<Self> {
        let cfg = DecoderConfig::from_gguf(&ckpt.metadata, &ckpt.arch)?;
        let family = cfg.family;
        let name = ckpt.name.clone();
        if ckpt.has_tensor("rope_factors_long.weight") || ckpt.has_tensor("rope_freqs.weight") {
            bail!("the model has rope scaling factors (a long-context variant): not supported yet");
        }
        let tensor = |n: &str| -> Result<QTensor> {
            ckpt.tensor(n, device)
                .with_context(|| format!("reading tensor {n}"))
        };
        let host_kernels =
            device.is_cpu() && std::env::var("GEN_ATTENTION").map_or(true, |v| v != "candle");
        // Our CPU kernels on the CPU; off it (or running its path on the CPU), as the size says.
        let weights = if host_kernels {
            DeviceWeights::Quantized
        } else {
            DeviceWeights::choose(ckpt.parameter_count())
        };
        let embedding = tensor("token_embd.weight")?;
        let (vocab_size, emb_width) = embedding.shape().dims2()?;
        if emb_width != cfg.d_model {
            bail!(
                "token_embd.weight is {vocab_size}x{emb_width}, expected width {}",
                cfg.d_model
            );
        }
        let vector = |n: &str, len: usize| -> Result<Tensor> {
            let t = tensor(n)?.dequantize(device)?;
            if t.dims() != [len] {
                bail!("{n} has shape {:?}, expected [{len}]", t.dims());
            }
            Ok(t)
        };
        let mut windows: Vec<Option<usize>> = Vec::new();
        let mut rope_bases: Vec<f32> = Vec::new();
        let mut layers = Vec::new();
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            let mm = |n: &str, rows: Option<usize>, cols: usize| -> Result<(QLinear, usize)> {
                let q = tensor(&format!("{p}.{n}.weight"))?;
                let dims = q.shape().dims().to_vec();
                if dims.len() != 2 || rows.is_some_and(|r| r != dims[0]) || dims[1] != cols {
                    bail!(
                        "{p}.{n}.weight has shape {dims:?}, expected [{}, {cols}]",
                        rows.map_or("_".into(), |r| r.to_string())
                    );
                }
                Ok((QLinear::for_device(q, device, weights)?, dims[0]))
            };
            let (d, h, kv, hd) = (cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim);
            let qkv = if ckpt.has_tensor(&format!("{p}.attn_qkv.weight")) {
                let (w, _) = mm("attn_qkv", Some((h + 2 * kv) * hd), d)?;
                Projections::Fused {
                    linear: w,
                    widths: vec![h * hd, kv * hd, kv * hd],
                }
            } else {
                let (wq, _) = mm("attn_q", Some(h * hd), d)?;
                let (wk, _) = mm("attn_k", Some(kv * hd), d)?;
                let (wv, _) = mm("attn_v", Some(kv * hd), d)?;
                Projections::new(vec![wq, wk, wv])
            };
            let qkv_bias = family
                .qkv_bias()
                .then(|| -> Result<[Tensor; 3]> {
                    Ok([
                        vector(&format!("{p}.attn_q.bias"), h * hd)?,
                        vector(&format!("{p}.attn_k.bias"), kv * hd)?,
                        vector(&format!("{p}.attn_v.bias"), kv * hd)?,
                    ])
                })
                .transpose()?;
            let qk_norm = family
                .qk_norm()
                .then(|| -> Result<(Tensor, Tensor)> {
                    Ok((
                        vector(&format!("{p}.attn_q_norm.weight"), hd)?,
                        vector(&format!("{p}.attn_k_norm.weight"), hd)?,
                    ))
                })
                .transpose()?;
            let (wo, _) = mm("attn_output", Some(d), h * hd)?;
            // Phi-3 keeps gate and up in one matrix, gate first.
            let (gate_up, ff) = if ckpt.has_tensor(&format!("{p}.ffn_gate.weight")) {
                let (w_gate, ff) = mm("ffn_gate", None, d)?;
                let (w_up, _) = mm("ffn_up", Some(ff), d)?;
                (Projections::new(vec![w_gate, w_up]), ff)
            } else if family == Family::Phi3 {
                let (w, rows) = mm("ffn_up", None, d)?;
                if rows % 2 != 0 {
                    bail!("{p}.ffn_up.weight holds gate and up, but has an odd number of rows ({rows})");
                }
                let ff = rows / 2;
                let fused = Projections::Fused {
                    linear: w,
                    widths: vec![ff, ff],
                };
                (fused, ff)
            } else {
                bail!("tensor {p}.ffn_gate.weight is missing");
            };
            let (w_down, _) = mm("ffn_down", Some(d), ff)?;
            let sandwich = |n: &str| -> Result<Option<Tensor>> {
                family
                    .sandwich_norms()
                    .then(|| vector(&format!("{p}.{n}.weight"), d))
                    .transpose()
            };
            let window = cfg.layer_window(i);
            let view = index_of(&mut windows, window);
            let rope = index_of(&mut rope_bases, cfg.layer_rope_base(i));
            layers.push(Layer {
                attn_norm: vector(&format!("{p}.attn_norm.weight"), d)?,
                qkv,
                qkv_bias,
                qk_norm,
                wo,
                post_attn_norm: sandwich("post_attention_norm")?,
                ffn_norm: vector(&format!("{p}.ffn_norm.weight"), d)?,
                gate_up,
                w_down,
                post_ffn_norm: sandwich("post_ffw_norm")?,
                view,
                rope,
            });
        }
        let out_norm = vector("output_norm.weight", cfg.d_model)?;
        // Tied embeddings (SmolLM2, Gemma, small Qwens): the output layer is the embedding matrix.
        let output = if ckpt.has_tensor("output.weight") {
            let q = tensor("output.weight")?;
            if q.shape().dims() != [vocab_size, cfg.d_model] {
                bail!(
                    "output.weight has shape {:?}, expected [{vocab_size}, {}]",
                    q.shape().dims(),
                    cfg.d_model
                );
            }
            QLinear::for_device(q, device, weights)?
        } else {
            QLinear::for_device(tensor("token_embd.weight")?, device, weights)?
        };
        let kernels = KernelMode::for_device(device, host_kernels, &cfg);
        let info = ModelInfo {
            arch: family.arch().into(),
            name,
            context_len: cfg.context_len,
            vocab_size,
        };
        Ok(Self {
            info,
            cfg,
            device: device.clone(),
            host_kernels,
            embedding,
            layers,
            out_norm,
            output,
            windows,
            rope_bases,
            kv: PagedKv::new(0),
            store: KvStore::empty(),
            profile: Profile::from_env(),
            kernels,
            check: KernelCheck::new(kernels == KernelMode::Check),
        })
    }

    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The rows of `x` (N, d) through every layer, then the output layer for the last token of
    /// each step: (batch, V).
    fn forward_batch(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        let n = super::check_batch(&self.kv, batch, self.cfg.context_len)?;
        let cfg = &self.cfg;
        let (h, kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let g = h / kv;
        let dev = &self.device;
        let cpu = self.host_kernels;
        self.profile.start(n == batch.len());

        // Per token: id, position, and the cache row it is written to.
        let mut ids = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        // Per step: where its tokens start among the N rows.
        let mut starts = Vec::with_capacity(batch.len());
        for step in batch {
            starts.push(ids.len());
            let end = step.pos + step.tokens.len();
            ids.extend_from_slice(step.tokens);
            positions.extend(step.pos..end);
            slots.extend(self.kv.slots(step.seq, step.pos, end));
        }
        // Per window (one view for the whole context, one per sliding window): how each step
        // reaches its keys. Steps attended through candle's matrix multiplies (all of them off
        // the CPU; prompt chunks on it) get the cache rows they may see, and a mask.
        let mut views: Vec<Vec<StepKeys>> = Vec::with_capacity(self.windows.len());
        // The fused CPU kernel's one-token steps, per window.
        let mut fused: Vec<Vec<DecodeStep<'_>>> = Vec::new();
        // Off the CPU: the one-token steps attended together, per window.
        let mut device_decode: Vec<Option<DeviceDecode>> = Vec::new();
        for &window in &self.windows {
            let mut keys = Vec::with_capacity(batch.len());
            let mut decode = Vec::new();
            let mut batched = Vec::new();
            for (step, &at) in batch.iter().zip(&starts) {
                let t = step.tokens.len();
                let end = step.pos + t;
                // The first position the step's first query may see.
                let lo = window.map_or(0, |w| (step.pos + 1).saturating_sub(w));
                if cpu && t == 1 {
                    decode.push((at, self.kv.blocks(step.seq), end, lo));
                    keys.push(StepKeys::Fused);
                    continue;
                }
                if cpu {
                    keys.push(StepKeys::Prefill { window });
                    continue;
                }
                if t == 1 {
                    // Candle's path gathers the keys; the kernel reads the block table.
                    let rows = if self.kernels == KernelMode::On {
                        Vec::new()
                    } else {
                        let slots: Vec<u32> = self.kv.slots(step.seq, lo, end).collect();
                        self.store.gather_rows(&slots)
                    };
                    keys.push(StepKeys::Batched(batched.len()));
                    batched.push(DeviceStep {
                        at,
                        table: self.kv.blocks(step.seq),
                        end,
                        lo,
                        rows,
                    });
                    continue;
                }
                let slots: Vec<u32> = self.kv.slots(step.seq, lo, end).collect();
                let rows = self.store.gather_rows(&slots);
                let on_device = (!cpu)
                    .then(|| Tensor::new(rows.as_slice(), dev))
                    .transpose()?;
                let mask = (t > 1)
                    .then(|| attention_mask(t, step.pos, lo, window, g, dev))
                    .transpose()?;
                keys.push(StepKeys::Gathered {
                    rows,
                    on_device,
                    mask,
                });
            }
            views.push(keys);
            fused.push(decode);
            device_decode.push(
                (!batched.is_empty())
                    .then(|| DeviceDecode::new(n, &batched, kv, self.kernels, dev))
                    .transpose()?,
            );
        }
        let write = self
            .store
            .plan_write(&slots, dev, self.kernels != KernelMode::Off)?;
        // Passes mixing batched one-token steps with prompt chunks (off the CPU): per window,
        // where each step's rows sit in [batched output; the chunks' outputs], to put them back
        // in the order of the steps. Uploaded here, before the layers queue any work, so the
        // copy never waits for the device.
        let orders = views
            .iter()
            .zip(&device_decode)
            .map(|(keys, d)| -> Result<Option<Tensor>> {
                let Some(d) = d.as_ref().filter(|d| d.steps < batch.len()) else {
                    return Ok(None);
                };
                let mut order = Vec::with_capacity(n);
                let mut part_rows = 0;
                for (step, k) in batch.iter().zip(keys) {
                    if let StepKeys::Batched(i) = k {
                        order.push(*i as u32);
                    } else {
                        let t = step.tokens.len();
                        order.extend((0..t).map(|r| (d.steps + part_rows + r) as u32));
                        part_rows += t;
                    }
                }
                Ok(Some(Tensor::new(order.as_slice(), dev)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let ropes = self
            .rope_bases
            .iter()
            .map(|&base| rope_tables(hd, base, &positions, dev)) // (N, hd/2) each
            .collect::<Result<Vec<_>>>()?;

        // The same tables as host slices, for the CPU path's rope.
        let host_ropes = if cpu {
            ropes
                .iter()
                .map(|(c, s)| {
                    Ok((
                        c.flatten_all()?.to_vec1::<f32>()?,
                        s.flatten_all()?.to_vec1::<f32>()?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let ids = Tensor::new(ids.as_slice(), dev)?;
        let mut x = self.embedding.embedding(&ids)?; // (N, d)
        if cfg.family.scales_embeddings() {
            x = (x * (cfg.d_model as f32).sqrt() as f64)?;
        }
        // Only each step's last token needs logits: the output layer skips the others. Like every
        // input of the pass, uploaded before the layers queue work (a copy from ordinary host
        // memory may wait for the device to finish what is queued).
        let last_rows = (n != batch.len())
            .then(|| {
                let last: Vec<u32> = batch
                    .iter()
                    .zip(&starts)
                    .map(|(s, &at)| (at + s.tokens.len() - 1) as u32)
                    .collect();
                Tensor::new(last.as_slice(), dev)
            })
            .transpose()?;
        let scale = cfg.attn_scale;
        self.profile.mark(dev, "prepare, embed");
        // On the CPU, each residual add comes with the norm that follows it (one fused pass):
        // the input of the next layer's attention, normalised, waits here.
        let mut normed: Option<Tensor> = None;
        for (l, layer) in self.layers.iter().enumerate() {
            let xn = match normed.take() {
                Some(xn) => xn,
                None => candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?,
            };
            let [mut q, mut k, mut v]: [Tensor; 3] = layer
                .qkv
                .forward(&xn)?
                .try_into()
                .expect("three projections");
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                q = q.broadcast_add(bq)?;
                k = k.broadcast_add(bk)?;
                v = v.broadcast_add(bv)?;
            }
            self.profile.mark(dev, "q/k/v");
            let (q, k) = if cpu {
                // Token-major all the way: (N, heads, hd) is what the projections give and
                // what the attention kernels and the cache take.
                let (mut q, mut k) = (q.reshape((n, h, hd))?, k.reshape((n, kv, hd))?);
                if let Some((qn, kn)) = &layer.qk_norm {
                    q = candle_nn::ops::rms_norm(&q, qn, cfg.rms_eps)?;
                    k = candle_nn::ops::rms_norm(&k, kn, cfg.rms_eps)?;
                }
                let (cos, sin) = &host_ropes[layer.rope];
                let interleaved = matches!(cfg.family.rope(), Rope::Interleaved);
                (
                    super::host::rope(&q, cos, sin, interleaved)?,
                    super::host::rope(&k, cos, sin, interleaved)?.reshape((n, kv * hd))?,
                )
            } else {
                let heads_first = |t: Tensor, heads: usize| -> Result<Tensor> {
                    Ok(t.reshape((n, heads, hd))?
                        .transpose(0, 1)?
                        .contiguous()?
                        .unsqueeze(0)?)
                };
                let (mut q, mut k) = (heads_first(q, h)?, heads_first(k, kv)?); // (1, h|kv, N, hd)
                if let Some((qn, kn)) = &layer.qk_norm {
                    q = candle_nn::ops::rms_norm(&q, qn, cfg.rms_eps)?;
                    k = candle_nn::ops::rms_norm(&k, kn, cfg.rms_eps)?;
                }
                let (cos, sin) = &ropes[layer.rope];
                let (q, k) = match cfg.family.rope() {
                    Rope::Interleaved => (
                        candle_nn::rotary_emb::rope_i(&q, cos, sin)?,
                        candle_nn::rotary_emb::rope_i(&k, cos, sin)?,
                    ),
                    Rope::Halves => (
                        candle_nn::rotary_emb::rope(&q, cos, sin)?,
                        candle_nn::rotary_emb::rope(&k, cos, sin)?,
                    ),
                };
                let q = q.squeeze(0)?.transpose(0, 1)?.contiguous()?; // (N, h, hd)
                let k = k.squeeze(0)?.transpose(0, 1)?.reshape((n, kv * hd))?; // (N, kv*hd)
                (q, k)
            };
            self.profile.mark(dev, "rope");
            self.store.write(l, &k, &v, &write, &self.check)?;
            self.profile.mark(dev, "kv write");

            let decode = &fused[layer.view];
            let fused_out = if decode.is_empty() {
                None
            } else {
                let (k_pool, v_pool) = self.store.host(l).context("a host KV cache")?;
                Some(decode_attention_cpu(
                    &q,
                    k_pool,
                    v_pool,
                    decode,
                    cfg,
                    scale as f32,
                )?)
            };
            let batched_out = match &device_decode[layer.view] {
                Some(d) => {
                    let (k_pool, v_pool) = self.store.device(l).context("a device KV cache")?;
                    Some((
                        d.attend(&q, k_pool, v_pool, cfg, scale, &self.check)?,
                        d.steps,
                    ))
                }
                None => None,
            };
            let y = if decode.len() == batch.len() {
                fused_out.expect("every step is a CPU decode step") // (N, h*hd)
            } else if let Some((out, _)) = batched_out.as_ref().filter(|(_, b)| *b == batch.len()) {
                out.clone() // every step is a one-token step, in order: (N, h*hd)
            } else {
                let mut parts = Vec::with_capacity(batch.len());
                let mut fused_rows = 0..decode.len();
                for ((step, &at), keys) in batch.iter().zip(&starts).zip(&views[layer.view]) {
                    let t = step.tokens.len();
                    let (rows, on_device, mask) = match keys {
                        StepKeys::Gathered {
                            rows,
                            on_device,
                            mask,
                        } => (rows, on_device, mask),
                        StepKeys::Prefill { window } => {
                            let (k_pool, v_pool) = self.store.host(l).context("a host KV cache")?;
                            let blocks = self.kv.blocks(step.seq);
                            let span = (at, step.pos, t, *window);
                            parts.push(prefill_attention_cpu(
                                &q,
                                span,
                                blocks,
                                k_pool,
                                v_pool,
                                cfg,
                                scale as f32,
                            )?);
                            continue;
                        }
                        StepKeys::Fused => {
                            let f = fused_out.as_ref().expect("a CPU decode step");
                            let row = fused_rows.next().expect("one row per decode step");
                            parts.push(f.narrow(0, row, 1)?);
                            continue;
                        }
                        StepKeys::Batched(_) => continue,
                    };
                    let (keys, values) = self.store.gather(l, rows, on_device.as_ref(), dev)?; // (kv, L, hd)
                                                                                               // Heads sharing a kv head sit next to each other: fold them into the row
                                                                                               // axis so the cache is used as is, never repeated.
                    let qs = q
                        .narrow(0, at, t)?
                        .transpose(0, 1)?
                        .contiguous()?
                        .reshape((kv, g * t, hd))?;
                    let att = (qs.matmul(&keys.t()?)? * scale)?; // (kv, g*T, L)
                    let att = match mask {
                        Some(m) => att.broadcast_add(m)?,
                        None => att,
                    };
                    let att = candle_nn::ops::softmax_last_dim(&att)?;
                    let y = att.matmul(&values)?; // (kv, g*T, hd)
                    parts.push(
                        y.reshape((h, t, hd))?
                            .transpose(0, 1)?
                            .reshape((t, h * hd))?,
                    );
                }
                match (batched_out, &orders[layer.view]) {
                    (Some((out, _)), Some(order)) => {
                        parts.insert(0, out);
                        Tensor::cat(&parts, 0)?.index_select(order, 0)?
                    }
                    _ => Tensor::cat(&parts, 0)?,
                }
            };
            self.profile.mark(dev, "attention");
            let mut o = layer.wo.forward(&y)?;
            if let Some(w) = &layer.post_attn_norm {
                o = candle_nn::ops::rms_norm(&o, w, cfg.rms_eps)?;
            }
            let xn;
            (x, xn) = if cpu {
                super::host::add_rms_norm(&x, &o, &layer.ffn_norm, cfg.rms_eps)?
            } else {
                let x = (x + o)?;
                let xn = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
                (x, xn)
            };
            self.profile.mark(dev, "attn out, add, norm");
            let [gate, up]: [Tensor; 2] = layer
                .gate_up
                .forward(&xn)?
                .try_into()
                .expect("two projections");
            self.profile.mark(dev, "gate/up");
            let act = match cfg.family.activation() {
                Activation::Silu if cpu => super::host::silu_mul(&gate, &up)?,
                Activation::Silu => (candle_nn::ops::silu(&gate)? * up)?,
                Activation::GeluTanh => (gate.gelu()? * up)?,
            };
            self.profile.mark(dev, "activation");
            let mut o = layer.w_down.forward(&act)?;
            if let Some(w) = &layer.post_ffn_norm {
                o = candle_nn::ops::rms_norm(&o, w, cfg.rms_eps)?;
            }
            match self.layers.get(l + 1).filter(|_| cpu) {
                Some(next) => {
                    let xn;
                    (x, xn) = super::host::add_rms_norm(&x, &o, &next.attn_norm, cfg.rms_eps)?;
                    normed = Some(xn);
                }
                None => x = (x + o)?,
            }
            self.profile.mark(dev, "down, add, norm");
        }
        for step in batch {
            self.kv.advance(step.seq, step.tokens.len());
        }
        let last = match &last_rows {
            Some(rows) => x.index_select(rows, 0)?,
            None => x,
        };
        let last = candle_nn::ops::rms_norm(&last, &self.out_norm, cfg.rms_eps)?;
        let logits = self.output.forward(&last)?.to_dtype(DType::F32)?;
        self.profile.mark(dev, "norm, logits");
        Ok(logits)
    }
}

/// A one-token step as the fused CPU kernel sees it: its row among the N, its block table,
/// tokens in the cache, the first position it may see.
type DecodeStep<'a> = (usize, &'a [u32], usize, usize);

/// The index of `v` in `list`, added if new.
fn index_of<T: PartialEq>(list: &mut Vec<T>, v: T) -> usize {
    match list.iter().position(|x| *x == v) {
        Some(i) => i,
        None => {
            list.push(v);
            list.len() - 1
        }
    }
}

/// One query token per step against its sequence's pages, on the CPU. q: (N, h, hd); pools:
/// (kv, P, BLOCK_SIZE, hd); `steps`: (row of q, block table, tokens in the cache, first position
/// attended). Returns
/// (steps, h*hd).
/// A step's T queries (rows at..at+T of q: (N, h, hd), at positions pos..pos+T) against its
/// sequence's pages, causal, within `window` positions if given, on the CPU. Returns (T, h*hd).
fn prefill_attention_cpu(
    q: &Tensor,
    (at, pos, t, window): (usize, usize, usize, Option<usize>),
    blocks: &[u32],
    k: &[half::f16],
    v: &[half::f16],
    cfg: &DecoderConfig,
    scale: f32,
) -> Result<Tensor> {
    let width = cfg.n_head * cfg.head_dim;
    let y = super::host::with_f32(q, |q| {
        super::attention::causal_prefill_attention(
            &q[at * width..][..t * width],
            blocks,
            pos,
            t,
            window,
            k,
            v,
            BLOCK_SIZE,
            cfg.n_head,
            cfg.n_kv_head,
            cfg.head_dim,
            scale,
        )
    })?;
    Ok(Tensor::from_vec(y, (t, width), &Device::Cpu)?)
}

fn decode_attention_cpu(
    q: &Tensor,
    k: &[half::f16],
    v: &[half::f16],
    steps: &[DecodeStep<'_>],
    cfg: &DecoderConfig,
    scale: f32,
) -> Result<Tensor> {
    let width = cfg.n_head * cfg.head_dim;
    let y = super::host::with_f32(q, |q| {
        let seqs: Vec<super::attention::PagedQuery<'_>> = steps
            .iter()
            .map(|&(row, blocks, len, from)| super::attention::PagedQuery {
                q: &q[row * width..(row + 1) * width],
                blocks,
                len,
                from,
            })
            .collect();
        super::attention::paged_decode_attention(
            &seqs,
            k,
            v,
            BLOCK_SIZE,
            cfg.n_head,
            cfg.n_kv_head,
            cfg.head_dim,
            scale,
        )
    })?;
    Ok(Tensor::from_vec(y, (steps.len(), width), &Device::Cpu)?)
}

/// cos and sin of the rotation angles of each token's position: (N, hd/2) each. Computed per
/// pass (N * hd/2 values) rather than tabled for the whole context, whose length comes from the
/// file and may be huge.
fn rope_tables(
    head_dim: usize,
    base: f32,
    positions: &[usize],
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for f in &inv_freq {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    let n = positions.len();
    Ok((
        Tensor::from_vec(cos, (n, half), device)?,
        Tensor::from_vec(sin, (n, half), device)?,
    ))
}

/// Additive mask for T new tokens at positions pos.. attending to the cached tokens lo..pos+T
/// (L = pos + T - lo of them), repeated for the g query heads folded into each kv head's rows:
/// (g*T, L). A query sees the keys at or before it, and with a window only the last `window`
/// of those (itself included).
fn attention_mask(
    t: usize,
    pos: usize,
    lo: usize,
    window: Option<usize>,
    g: usize,
    device: &Device,
) -> Result<Tensor> {
    let l = pos + t - lo;
    let mut m = vec![0f32; g * t * l];
    for gi in 0..g {
        for i in 0..t {
            let query = pos + i;
            let row = &mut m[(gi * t + i) * l..(gi * t + i + 1) * l];
            for (j, v) in row.iter_mut().enumerate() {
                let key = lo + j;
                let visible = key <= query && window.is_none_or(|w| query - key < w);
                if !visible {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }
    Ok(Tensor::from_vec(m, (g * t, l), device)?)
}

impl LanguageModel for Decoder {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv(&self) -> &PagedKv {
        &self.kv
    }

    fn kv_mut(&mut self) -> &mut PagedKv {
        &mut self.kv
    }

    fn reserve_pool(&mut self, blocks: usize) -> Result<()> {
        if self.kv.usage().blocks_total >= blocks {
            return Ok(());
        }
        if !self.kv.is_idle() {
            bail!("the KV cache pool can only grow while no sequence is live");
        }
        self.store = KvStore::empty(); // the old pool goes before the new one is made
        self.store = KvStore::new(
            &self.device,
            self.host_kernels,
            self.cfg.n_layer,
            self.cfg.n_kv_head,
            self.cfg.head_dim,
            blocks,
        )?;
        self.kv = PagedKv::new(blocks);
        Ok(())
    }

    fn kv_bytes_per_token(&self) -> usize {
        // f16 in the host cache, f32 on other devices (see KvStore).
        let bytes = if self.host_kernels { 2 } else { 4 };
        2 * self.cfg.n_layer * self.cfg.n_kv_head * self.cfg.head_dim * bytes
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        self.forward_batch(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_mask_hides_the_future_per_group() {
        let m = attention_mask(2, 3, 0, None, 2, &Device::Cpu).unwrap();
        let m = m.to_vec2::<f32>().unwrap();
        assert_eq!(m.len(), 4);
        for (r, row) in m.iter().enumerate() {
            let i = r % 2;
            for (j, v) in row.iter().enumerate() {
                let visible = j <= 3 + i;
                assert_eq!(*v == 0.0, visible, "row {r} col {j}");
            }
        }
    }

    #[test]
    fn window_mask_shows_each_query_its_last_w_tokens() {
        // Queries at 5, 6, 7 with a window of 3; the first sees 3..=5, so keys start at lo = 3.
        let m = attention_mask(3, 5, 3, Some(3), 1, &Device::Cpu).unwrap();
        let visible: Vec<Vec<usize>> = m
            .to_vec2::<f32>()
            .unwrap()
            .iter()
            .map(|row| {
                (0..row.len())
                    .filter(|&j| row[j] == 0.0)
                    .map(|j| j + 3)
                    .collect()
            })
            .collect();
        assert_eq!(visible, [vec![3, 4, 5], vec![4, 5, 6], vec![5, 6, 7]]);
    }

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
