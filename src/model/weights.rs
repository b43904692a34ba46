//! A decoder's weights, read from a checkpoint as its [`TensorRules`] say and checked against
//! its configuration: the embedding matrix, each layer's norms, projections, biases and
//! per-tensor scales, the final norm and the output layer, the rope frequency factors. Every
//! tensor of the file is accounted for: used, ignored where llama.cpp ignores it, or the file
//! is refused naming it. Both backends read the result; neither owns it.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;

use anyhow::{bail, Context, Result};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use super::config::{
    DecoderConfig, DeltaNet, Mamba2, Mixer, MoeCfg, Need, NormRule, Output, QkNorm, RopeFactors,
    SharedExpert,
};
use super::cpu::matmul::{CpuQWeight, Kernel};
use super::cpu::tile_cache::{self, TileCache};
use super::qlinear::{DeviceWeights, Projections, QLinear};
use crate::format::checkpoint::Checkpoint;

/// A norm's weight and bias (either may be absent: then that part is skipped).
#[derive(Clone)]
pub struct Norm {
    pub weight: Option<Tensor>, // (len)
    pub bias: Option<Tensor>,   // (len)
}

/// What follows one output of a product: a per-tensor scale and a bias, in llama.cpp's order
/// for that place (attention: scale, then bias; the FFN: bias, then scale).
#[derive(Default)]
pub struct Affine {
    pub scale: Option<f32>,
    pub bias: Option<Tensor>,
    pub bias_first: bool,
}

impl Affine {
    pub fn is_identity(&self) -> bool {
        self.scale.is_none() && self.bias.is_none()
    }

    /// y (N, width) through the scale and the bias.
    pub fn apply(&self, y: Tensor) -> Result<Tensor> {
        let scale = |y: Tensor| -> Result<Tensor> {
            Ok(match self.scale {
                Some(s) => (y * s as f64)?,
                None => y,
            })
        };
        let bias = |y: Tensor| -> Result<Tensor> {
            Ok(match &self.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            })
        };
        if self.bias_first {
            scale(bias(y)?)
        } else {
            bias(scale(y)?)
        }
    }
}

/// A dense FFN: act(gate)·up (or act(up)), then down, each product followed by its scale
/// and bias.
pub struct Mlp {
    /// gate (ff, d) and up (ff, d), or one of 2ff rows, or up alone (an FFN without a gate).
    pub gate_up: Projections,
    pub gate_up_post: Vec<Affine>,
    pub w_down: QLinear, // (d, ff)
    pub down_post: Affine,
}

impl Mlp {
    /// Whether it has a gate (two input products, or one holding both).
    pub fn gated(&self) -> bool {
        self.gate_up_post.len() == 2
    }
}

/// A layer's FFN: one dense FFN, or a mixture of experts ([`super::config::MoeCfg`]).
pub enum Ffn {
    /// A layer without an FFN (its mixer alone).
    None,
    Dense(Mlp),
    Moe(Box<Moe>),
}

impl Ffn {
    /// Every dense FFN in it: itself, or each expert and the shared one.
    pub fn mlps(&self) -> Vec<&Mlp> {
        match self {
            Ffn::None => Vec::new(),
            Ffn::Dense(m) => vec![m],
            Ffn::Moe(m) => m.experts.iter().chain(&m.shared).collect(),
        }
    }

    pub fn mlps_mut(&mut self) -> Vec<&mut Mlp> {
        match self {
            Ffn::None => Vec::new(),
            Ffn::Dense(m) => vec![m],
            Ffn::Moe(m) => m.experts.iter_mut().chain(m.shared.as_mut()).collect(),
        }
    }
}

/// A mixture-of-experts FFN's weights.
pub struct Moe {
    /// The router (E, d), f32 on the host: each token's logits are summed in one fixed order,
    /// so the experts a token gets never depend on what else is in its pass.
    pub router: Vec<f32>,
    /// Each routed expert's FFN (its `.scale`s in the Affines where the family applies them).
    pub experts: Vec<Mlp>,
    pub shared: Option<Mlp>,
    /// Qwen2 MoE's gate of the shared expert (d), on the host.
    pub shared_gate: Option<Vec<f32>>,
    /// The router's bias (E), added to its logits (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// `exp_probs_b` (E): added to the probabilities to choose the experts, not to weigh them.
    pub selection_bias: Option<Vec<f32>>,
    /// Gemma 4's form ([`SharedExpert::Beside`]).
    pub beside: Option<Beside>,
}

/// What Gemma 4's experts beside a dense FFN add: the router's input scale (d, host), the
/// experts' norms before and after, and the dense FFN's norm after.
pub struct Beside {
    pub router_scale: Vec<f32>,
    pub experts_in: Norm,
    pub experts_out: Norm,
    pub dense_out: Norm,
}

/// Gemma 4's per-layer input, for every layer at once: a second embedding of each token
/// (`per_layer_token_embd`, (V, layers·width)) and a projection of its embedding
/// (`per_layer_model_proj`) with a norm of `width` (`per_layer_proj_norm`).
pub struct PerLayerInput {
    pub table: QTensor,
    pub proj: QLinear,
    pub norm: Norm,
    pub width: usize,
}

/// A layer's use of its per-layer input: gelu(`inp_gate` x) times the input, through `proj`
/// and `post_norm`, added to the layer's output.
pub struct PerLayerGate {
    pub gate: QLinear,
    pub proj: QLinear,
    pub post_norm: Norm,
}

pub struct Layer {
    /// Gemma 4's per-layer input gate, and the factor on the layer's output.
    pub per_layer: Option<PerLayerGate>,
    pub out_scale: Option<f32>,
    pub attn_norm: Option<Norm>,
    /// What mixes its tokens: attention, or a recurrent block.
    pub mixer: MixerWeights,
    pub post_attn_norm: Option<Norm>,
    pub ffn_norm: Option<Norm>,
    pub ffn: Ffn,
    pub post_ffn_norm: Option<Norm>,
    /// Index into [`Weights::windows`] (the pass plan's key ranges).
    pub view: usize,
}

/// A layer's token mixer ([`super::config::Mixer`]).
pub enum MixerWeights {
    /// A layer without a mixer (its FFN alone).
    None,
    Attention(Box<AttnWeights>),
    ShortConv(Box<ShortConvWeights>),
    DeltaNet(Box<DeltaNetWeights>),
    Mamba2(Box<Mamba2Weights>),
}

impl MixerWeights {
    /// Its matrices.
    pub fn linears(&self) -> Vec<&QLinear> {
        match self {
            MixerWeights::None => Vec::new(),
            MixerWeights::Attention(a) => {
                let mut v = a.qkv.linears();
                v.push(&a.wo);
                v
            }
            MixerWeights::ShortConv(c) => vec![&c.in_proj, &c.out_proj],
            MixerWeights::DeltaNet(n) => {
                let mut v = n.proj.linears();
                v.push(&n.out);
                v
            }
            MixerWeights::Mamba2(m) => vec![&m.in_proj, &m.out],
        }
    }

    pub fn linears_mut(&mut self) -> Vec<&mut QLinear> {
        match self {
            MixerWeights::None => Vec::new(),
            MixerWeights::Attention(a) => {
                let a = &mut **a;
                let mut v = a.qkv.linears_mut();
                v.push(&mut a.wo);
                v
            }
            MixerWeights::ShortConv(c) => {
                let c = &mut **c;
                vec![&mut c.in_proj, &mut c.out_proj]
            }
            MixerWeights::DeltaNet(n) => {
                let n = &mut **n;
                let mut v = n.proj.linears_mut();
                v.push(&mut n.out);
                v
            }
            MixerWeights::Mamba2(m) => {
                let m = &mut **m;
                vec![&mut m.in_proj, &mut m.out]
            }
        }
    }
}

/// An attention block's weights.
pub struct AttnWeights {
    /// q (h*hd, d), k (kv*hd, d), v (kv*hd, d): three matrices, or one of (h+2kv)*hd rows.
    pub qkv: Projections,
    pub qkv_post: [Affine; 3],
    /// q's and k's norm weights: (hd) each per head, or the whole projection's.
    pub qk_norm: Option<(Norm, Norm)>,
    pub wo: QLinear, // (d, h*hd)
    pub wo_post: Affine,
    /// Each query head's attention sink (h), on the host (gpt-oss).
    pub sinks: Option<Vec<f32>>,
}

/// LFM2's short convolution block.
pub struct ShortConvWeights {
    /// (3d, d): b, c and x.
    pub in_proj: QLinear,
    /// Per channel, its `taps` weights, oldest token first: (d, taps), on the host.
    pub conv: Vec<f32>,
    pub out_proj: QLinear, // (d, d)
}

/// A Mamba-2 block.
pub struct Mamba2Weights {
    /// z, xBC and dt: (2·d_inner + 2·groups·d_state + heads, d).
    pub in_proj: QLinear,
    pub in_post: Affine,
    /// Per channel of xBC, its `taps` weights oldest first, and its bias: host.
    pub conv: Vec<f32>,
    pub conv_bias: Option<Vec<f32>>,
    /// Per head: dt's bias, A (-exp(A_log) as stored) and D.
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    pub d: Vec<f32>,
    /// The grouped norm's weights (d_inner), host.
    pub norm: Vec<f32>,
    pub out: QLinear, // (d, d_inner)
    pub out_post: Affine,
}

/// A Gated DeltaNet block (Qwen3.5's linear attention).
pub struct DeltaNetWeights {
    /// Four products of the layer's input: q, k and v of every head (the convolution's
    /// channels, conv_channels), the output gate z (v_heads * v_dim), and beta's and alpha's
    /// logits (v_heads each).
    pub proj: Projections,
    /// Their `.scale`s, where the family applies them.
    pub proj_post: Vec<Affine>,
    /// Per channel, its `taps` weights, oldest token first: (conv_channels, taps), host.
    pub conv: Vec<f32>,
    /// Per value head: the time step's bias and A (the decay is -exp(A_log)·softplus(a + dt),
    /// A = -exp(A_log) as the file stores it).
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    /// The output norm's weights (v_dim), shared by every head, host.
    pub norm: Vec<f32>,
    pub out: QLinear, // (d, v_heads * v_dim)
    pub out_post: Affine,
}

pub struct Weights {
    pub embedding: Embedding,
    pub layers: Vec<Layer>,
    pub out_norm: Option<Norm>,
    pub output: QLinear, // (V, d)
    pub output_bias: Option<Tensor>,
    pub per_layer_input: Option<PerLayerInput>,
    /// Distinct sliding windows (`None`: whole context) among the layers.
    pub windows: Vec<Option<usize>>,
    /// `rope_freqs`, and long-rope's long and short factors (n_rot / 2 each).
    pub rope_freqs: Option<Vec<f32>>,
    pub rope_long: Option<Vec<f32>>,
    pub rope_short: Option<Vec<f32>>,
    pub vocab_size: usize,
    /// Where loading them went: reading the file, and the rest (repacking into gen's tiles,
    /// or widening for a device).
    pub times: super::LoadTimes,
}

/// Where token embeddings come from.
pub enum Embedding {
    /// Their own matrix (V, d), rows widened by candle on lookup.
    Table(QTensor),
    /// The output layer's matrix, on gen's CPU kernels (tied embeddings): rows widened from
    /// its tiles, bit for bit what candle would give, and one copy of the matrix in memory
    /// instead of two (Gemma 3 270M's is 178 MB).
    Output,
}

/// Reads a checkpoint's tensors onto one device, quantized weights kept as `kind` says, and
/// remembers which it read.
struct Reader<'a> {
    ckpt: &'a Checkpoint,
    device: &'a Device,
    kind: DeviceWeights,
    read: RefCell<BTreeSet<String>>,
    /// Time spent reading tensors from the file.
    reading: Cell<std::time::Duration>,
    /// Matrices repacked by an earlier run, when there is a usable cache.
    tiles: &'a TileCache,
}

impl Reader<'_> {
    fn has(&self, n: &str) -> bool {
        self.ckpt.has_tensor(n)
    }

    fn tensor(&self, n: &str) -> Result<QTensor> {
        self.read.borrow_mut().insert(n.to_string());
        self.timed(|| self.ckpt.tensor(n, self.device))
            .with_context(|| format!("reading tensor {n}"))
    }

    /// `f`, a read from the file, with its time added to `reading`.
    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let t0 = std::time::Instant::now();
        let out = f();
        self.reading.set(self.reading.get() + t0.elapsed());
        out
    }

    /// A norm's weight or a bias: `len` values, widened.
    fn vector(&self, n: &str, len: usize) -> Result<Tensor> {
        let t = self.tensor(n)?.dequantize(self.device)?;
        if t.elem_count() != len || t.dims().iter().filter(|&&d| d != 1).count() > 1 {
            bail!("{n} has shape {:?}, expected [{len}]", t.dims());
        }
        Ok(t.reshape(len)?)
    }

    /// [`Self::vector`]'s values as f32 on the host (sinks, a router's bias).
    fn host_vector(&self, n: &str, len: usize) -> Result<Vec<f32>> {
        let v = self.vector(n, len)?.to_dtype(candle_core::DType::F32)?;
        Ok(v.to_device(&Device::Cpu)?.to_vec1()?)
    }

    /// A (rows, cols) tensor's values on the host, row by row (a convolution's taps).
    fn host_table(&self, n: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
        let t = self
            .table_if(n, rows, cols, Need::Required)?
            .expect("a required tensor");
        Ok(t.to_dtype(candle_core::DType::F32)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?)
    }

    /// A small (rows, cols) table of values (per-head norm weights) that `need` says may,
    /// must or must not be there.
    fn table_if(&self, n: &str, rows: usize, cols: usize, need: Need) -> Result<Option<Tensor>> {
        let present = match need {
            Need::Absent => false,
            Need::Optional => self.has(n),
            Need::Required => true,
            Need::Ignored => return self.vector_if(n, rows * cols, need),
        };
        if !present {
            return Ok(None);
        }
        let t = self.tensor(n)?.dequantize(self.device)?;
        if t.dims() != [rows, cols] {
            bail!("{n} has shape {:?}, expected [{rows}, {cols}]", t.dims());
        }
        Ok(Some(t))
    }

    /// A vector that `need` says may, must or must not be there (Ignored: read, not used).
    fn vector_if(&self, n: &str, len: usize, need: Need) -> Result<Option<Tensor>> {
        match need {
            Need::Absent => Ok(None),
            Need::Required => self.vector(n, len).map(Some),
            Need::Optional => self.has(n).then(|| self.vector(n, len)).transpose(),
            Need::Ignored => {
                self.ignore(n);
                Ok(None)
            }
        }
    }

    /// A tensor llama.cpp may read but never uses where it is: marked read if present.
    fn ignore(&self, n: &str) {
        if self.has(n) {
            self.read.borrow_mut().insert(n.to_string());
        }
    }

    /// The values of a small tensor (rope factors), on the host.
    fn values(&self, n: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if !self.has(n) {
            return Ok(None);
        }
        let t = self.tensor(n)?.dequantize(&Device::Cpu)?.flatten_all()?;
        let v: Vec<f32> = t.to_vec1()?;
        if v.len() < len {
            bail!("{n} holds {} values, expected {len}", v.len());
        }
        Ok(Some(v))
    }

    /// A per-tensor scale (`blk.N.attn_q.scale` for `blk.N.attn_q.weight`: one value), when
    /// the file has one; `used` false: read and ignored, as llama.cpp does for the FFN of most
    /// families.
    fn scale(&self, base: &str, used: bool) -> Result<Option<f32>> {
        let n = format!("{base}.scale");
        if !self.has(&n) {
            return Ok(None);
        }
        let v = self.vector(&n, 1)?.to_vec1::<f32>()?[0];
        Ok(used.then_some(v))
    }

    /// The matrix `n` of `rows` (any, if None) by `cols`, and its row count.
    fn matrix(&self, n: &str, rows: Option<usize>, cols: usize) -> Result<(QLinear, usize)> {
        // On the CPU, gen's kernels repack the file's blocks straight from the mapped file
        // (a type candle cannot read, IQ4_NL or IQ4_XS, must take this way); a type they do
        // not run goes through candle below.
        if self.device.is_cpu() && self.kind == DeviceWeights::Quantized {
            if let Some(m) = self.timed(|| self.ckpt.matrix_bytes(n))? {
                let own = self.ckpt.is_own_type(n);
                let (r, c) = (m.rows, m.cols);
                let fits = rows.is_none_or(|want| want == r) && c == cols;
                if !fits && own {
                    bail!(
                        "{n} has shape [{r}, {c}], expected [{}, {cols}]",
                        rows.map_or("_".into(), |r| r.to_string())
                    );
                }
                // Misshapen otherwise: candle's reading below says how.
                if let (true, Some(w)) = (fits, self.tiles.take(n, m.ggml, r, c)) {
                    self.read.borrow_mut().insert(n.to_string());
                    return Ok((QLinear::Cpu(w), r));
                }
                if fits {
                    match CpuQWeight::from_raw(m.ggml, &m.bytes, r, c, Kernel::detect())? {
                        Some(mut w) => {
                            w.set_name(n);
                            self.read.borrow_mut().insert(n.to_string());
                            self.ckpt.release(m);
                            return Ok((QLinear::Cpu(w), r));
                        }
                        None if own => bail!("{n}: no kernel for its type"),
                        None => {}
                    }
                }
            }
        }
        let q = self.tensor(n)?;
        let dims = q.shape().dims().to_vec();
        if dims.len() != 2 || rows.is_some_and(|r| r != dims[0]) || dims[1] != cols {
            bail!(
                "{n} has shape {dims:?}, expected [{}, {cols}]",
                rows.map_or("_".into(), |r| r.to_string())
            );
        }
        Ok((QLinear::for_device(q, self.device, self.kind)?, dims[0]))
    }

    /// Expert `e`'s matrix (`rows` by `cols`) of the stacked expert tensor `n`, which must
    /// hold `experts` of them; repacked from the mapped file as [`Self::matrix`] does, its
    /// tile-cache part named `n#e`.
    fn expert(
        &self,
        n: &str,
        e: usize,
        experts: usize,
        rows: usize,
        cols: usize,
    ) -> Result<QLinear> {
        match self.ckpt.expert_dims(n) {
            Some(dims) if dims == (experts, rows, cols) => {}
            Some((a, b, c)) => {
                bail!("{n} has shape [{a}, {b}, {c}], expected [{experts}, {rows}, {cols}]")
            }
            None if self.has(n) => bail!("{n} is not a stack of {experts} expert matrices"),
            None => bail!("tensor {n} is missing"),
        }
        self.read.borrow_mut().insert(n.to_string());
        let part = format!("{n}#{e}");
        if self.device.is_cpu() && self.kind == DeviceWeights::Quantized {
            if let Some(m) = self.timed(|| self.ckpt.expert_bytes(n, e))? {
                if let Some(w) = self.tiles.take(&part, m.ggml, rows, cols) {
                    return Ok(QLinear::Cpu(w));
                }
                if let Some(mut w) =
                    CpuQWeight::from_raw(m.ggml, &m.bytes, rows, cols, Kernel::detect())?
                {
                    w.set_name(&part);
                    self.ckpt.release(m);
                    return Ok(QLinear::Cpu(w));
                }
            }
        }
        let q = self.timed(|| self.ckpt.expert_tensor(n, e, self.device))?;
        QLinear::for_device(q, self.device, self.kind)
    }

    /// A norm as `rule` says: None where the architecture has no norm there.
    fn norm(&self, prefix: &str, len: usize, rule: NormRule) -> Result<Option<Norm>> {
        match rule {
            NormRule::None => Ok(None),
            NormRule::Plain => Ok(Some(Norm {
                weight: None,
                bias: None,
            })),
            NormRule::Weighted { bias } => Ok(Some(Norm {
                weight: Some(self.vector(&format!("{prefix}.weight"), len)?),
                bias: self.vector_if(&format!("{prefix}.bias"), len, bias)?,
            })),
            NormRule::WeightedIfPresent { bias } => {
                if self.has(&format!("{prefix}.weight")) {
                    self.norm(prefix, len, NormRule::Weighted { bias })
                } else if self.has(&format!("{prefix}.bias")) {
                    bail!("{prefix}.bias without {prefix}.weight")
                } else {
                    Ok(None)
                }
            }
        }
    }
}

impl Weights {
    /// Every weight of `ckpt` for `cfg`, on `device`; quantized matrices kept as `kind` says.
    pub fn load(
        ckpt: &Checkpoint,
        cfg: &DecoderConfig,
        device: &Device,
        kind: DeviceWeights,
    ) -> Result<Self> {
        let started = std::time::Instant::now();
        let tiles = match device.is_cpu() && kind == DeviceWeights::Quantized {
            true => TileCache::open(ckpt, Kernel::detect()),
            false => TileCache::Off,
        };
        let r = Reader {
            ckpt,
            device,
            kind,
            read: RefCell::new(BTreeSet::new()),
            reading: Cell::new(started.elapsed()),
            tiles: &tiles,
        };
        let rules = &cfg.tensors;
        let tied = match rules.output {
            Output::Tied => true,
            Output::TiedIfAbsent => !ckpt.has_tensor("output.weight"),
            Output::Own => false,
        };
        // Tied embeddings (SmolLM2, Gemma, small Qwens): the output layer is the embedding
        // matrix. On gen's CPU kernels it is read once, as the output layer, and lookups widen
        // its rows; otherwise the embedding is a table of its own.
        let (embedding, tied_output) = match tied {
            true if device.is_cpu() && kind == DeviceWeights::Quantized => {
                match r.matrix("token_embd.weight", None, cfg.d_model) {
                    Ok((out @ QLinear::Cpu(_), _)) => (Embedding::Output, Some(out)),
                    Ok((out, _)) => (Embedding::Table(r.tensor("token_embd.weight")?), Some(out)),
                    // Misshapen: the table's checks below say how.
                    Err(_) => (Embedding::Table(r.tensor("token_embd.weight")?), None),
                }
            }
            _ => (Embedding::Table(r.tensor("token_embd.weight")?), None),
        };
        let (vocab_size, emb_width) = match (&embedding, &tied_output) {
            (Embedding::Table(t), _) => t.shape().dims2()?,
            (Embedding::Output, Some(QLinear::Cpu(w))) => w.dims(),
            (Embedding::Output, _) => unreachable!("an output layer on gen's kernels"),
        };
        if emb_width != cfg.d_model {
            bail!(
                "token_embd.weight is {vocab_size}x{emb_width}, expected width {}",
                cfg.d_model
            );
        }
        let mut windows: Vec<Option<usize>> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let view = index_of(&mut windows, cfg.layer_window(i));
            layers.push(load_layer(&r, cfg, i, view)?);
        }
        let out_norm = r.norm(rules.output_norm_name, cfg.d_model, rules.output_norm)?;
        let output = match tied_output {
            Some(out) => out,
            None => {
                let name = if tied {
                    "token_embd.weight"
                } else {
                    "output.weight"
                };
                r.matrix(name, Some(vocab_size), cfg.d_model)?.0
            }
        };
        let output_bias = r.vector_if("output.bias", vocab_size, rules.output_bias)?;
        let per_layer_input = load_per_layer_input(&r, cfg, vocab_size)?;
        let half = cfg.ropes.iter().map(|c| c.n_rot / 2).max().unwrap_or(0);
        let (rope_freqs, rope_long, rope_short) = match rules.rope_factors {
            RopeFactors::None => (None, None, None),
            RopeFactors::FreqsIgnored => {
                r.vector_if("rope_freqs.weight", half, Need::Ignored)?;
                (None, None, None)
            }
            RopeFactors::Freqs => (r.values("rope_freqs.weight", half)?, None, None),
            RopeFactors::FreqsRequired => match r.values("rope_freqs.weight", half)? {
                Some(f) => (Some(f), None, None),
                None => bail!("rope_freqs.weight is missing: {} needs it", cfg.arch),
            },
            RopeFactors::LongShort => (
                None,
                r.values("rope_factors_long.weight", half)?,
                r.values("rope_factors_short.weight", half)?,
            ),
        };
        let mut w = Self {
            embedding,
            layers,
            out_norm,
            output,
            output_bias,
            per_layer_input,
            windows,
            rope_freqs,
            rope_long,
            rope_short,
            vocab_size,
            times: super::LoadTimes {
                read_s: r.reading.get().as_secs_f64(),
                repack_s: (started.elapsed() - r.reading.get()).as_secs_f64(),
                ..Default::default()
            },
        };
        check_all_read(ckpt, cfg, &r.read.borrow())?;
        let t = &mut w.times;
        match &tiles {
            TileCache::Off => t.tile_cache = "off",
            TileCache::Hit(hit) => {
                (t.tile_cache, t.tile_cache_bytes) = ("mapped", hit.bytes as u64)
            }
            TileCache::Miss { path, id } => {
                let t0 = std::time::Instant::now();
                let written = tile_cache::write(path, id, &w.cpu_matrices());
                let t = &mut w.times;
                t.tile_cache_write_s = t0.elapsed().as_secs_f64();
                (t.tile_cache, t.tile_cache_bytes) = match written {
                    Ok(0) => ("missed", 0),
                    Ok(bytes) => ("written", bytes),
                    Err(e) => {
                        eprintln!("warning: {e:#}");
                        ("missed", 0)
                    }
                };
            }
        }
        Ok(w)
    }

    /// Every matrix on gen's CPU kernels (what the tile cache keeps).
    fn cpu_matrices(&self) -> Vec<&CpuQWeight> {
        fn of(l: &QLinear) -> Option<&CpuQWeight> {
            match l {
                QLinear::Cpu(w) => Some(w),
                QLinear::Candle(_) | QLinear::Dense(_) => None,
            }
        }
        fn of_all(p: &Projections) -> Vec<&CpuQWeight> {
            match p {
                Projections::Fused { linear, .. } => of(linear).into_iter().collect(),
                Projections::Separate(ls) => ls.iter().filter_map(of).collect(),
            }
        }
        let mut all = Vec::new();
        for l in &self.layers {
            all.extend(l.mixer.linears().into_iter().filter_map(of));
            for m in l.ffn.mlps() {
                all.extend(of_all(&m.gate_up));
                all.extend(of(&m.w_down));
            }
            if let Some(g) = &l.per_layer {
                all.extend(of(&g.gate));
                all.extend(of(&g.proj));
            }
        }
        if let Some(p) = &self.per_layer_input {
            all.extend(of(&p.proj));
        }
        all.extend(of(&self.output));
        all
    }

    /// Every matrix on gen's CPU kernels, to choose their paths ([`super::cpu::choice`]).
    pub fn cpu_matrices_mut(&mut self) -> Vec<&mut CpuQWeight> {
        fn of(l: &mut QLinear) -> Option<&mut CpuQWeight> {
            match l {
                QLinear::Cpu(w) => Some(w),
                QLinear::Candle(_) | QLinear::Dense(_) => None,
            }
        }
        fn of_all(p: &mut Projections) -> Vec<&mut CpuQWeight> {
            match p {
                Projections::Fused { linear, .. } => of(linear).into_iter().collect(),
                Projections::Separate(ls) => ls.iter_mut().filter_map(of).collect(),
            }
        }
        let mut all = Vec::new();
        for l in &mut self.layers {
            all.extend(l.mixer.linears_mut().into_iter().filter_map(of));
            for m in l.ffn.mlps_mut() {
                all.extend(of_all(&mut m.gate_up));
                all.extend(of(&mut m.w_down));
            }
            if let Some(g) = &mut l.per_layer {
                all.extend(of(&mut g.gate));
                all.extend(of(&mut g.proj));
            }
        }
        if let Some(p) = &mut self.per_layer_input {
            all.extend(of(&mut p.proj));
        }
        all.extend(of(&mut self.output));
        all
    }

    /// The embeddings of a pass's tokens, scaled where the family says: (N, d).
    pub fn embed(&self, ids: &[u32], cfg: &DecoderConfig, device: &Device) -> Result<Tensor> {
        let mut x = match (&self.embedding, &self.output) {
            (Embedding::Table(t), _) => t.embedding(&Tensor::new(ids, device)?)?, // (N, d)
            (Embedding::Output, QLinear::Cpu(w)) => {
                use rayon::prelude::*;
                let (v, d) = w.dims();
                if let Some(id) = ids.iter().find(|&&id| id as usize >= v) {
                    anyhow::bail!("token id {id} is outside the vocabulary of {v}");
                }
                let mut rows = vec![0f32; ids.len() * d];
                // A prompt's rows over the threads (a K-quant row takes a few microseconds: 2 ms
                // of a 500-token prefill on one); a decode step's here.
                if ids.len() >= 32 {
                    rows.par_chunks_exact_mut(d)
                        .zip(ids.par_iter())
                        .for_each(|(row, &id)| w.dequantize_row(id as usize, row));
                } else {
                    for (&id, row) in ids.iter().zip(rows.chunks_exact_mut(d)) {
                        w.dequantize_row(id as usize, row);
                    }
                }
                Tensor::from_vec(rows, (ids.len(), d), device)?
            }
            (Embedding::Output, _) => unreachable!("tied to an output layer on gen's kernels"),
        };
        if let Some(s) = cfg.embed_scale {
            x = (x * s as f64)?;
        }
        Ok(x)
    }

    /// The frequency factors rotary embedding `rope` divides by, if any (llama.cpp's
    /// `get_rope_factors`: `rope_freqs` first, else long-rope's long or short ones).
    pub fn rope_factors(&self, rope: &super::rope::RopeCfg) -> Option<&[f32]> {
        use super::rope::Factors;
        match rope.factors {
            Factors::None => None,
            Factors::Long => self.rope_freqs.as_ref().or(self.rope_long.as_ref()),
            Factors::Short => self.rope_freqs.as_ref().or(self.rope_short.as_ref()),
        }
        .map(Vec::as_slice)
    }
}

/// Gemma 4's per-layer input tables, where the configuration has a per-layer width.
fn load_per_layer_input(
    r: &Reader<'_>,
    cfg: &DecoderConfig,
    vocab: usize,
) -> Result<Option<PerLayerInput>> {
    let width = cfg.per_layer_input;
    if width == 0 {
        return Ok(None);
    }
    let all = width * cfg.n_layer;
    let table = r.tensor("per_layer_token_embd.weight")?;
    if table.shape().dims() != [vocab, all] {
        bail!(
            "per_layer_token_embd.weight has shape {:?}, expected [{vocab}, {all}]",
            table.shape().dims()
        );
    }
    let (proj, _) = r.matrix("per_layer_model_proj.weight", Some(all), cfg.d_model)?;
    let norm = r
        .norm(
            "per_layer_proj_norm",
            width,
            NormRule::Weighted { bias: Need::Absent },
        )?
        .expect("a weighted norm");
    Ok(Some(PerLayerInput {
        table,
        proj,
        norm,
        width,
    }))
}

/// Layer `i`'s weights (`view`: its window's index).
fn load_layer(r: &Reader<'_>, cfg: &DecoderConfig, i: usize, view: usize) -> Result<Layer> {
    let rules = &cfg.tensors;
    let p = format!("blk.{i}");
    let name = |n: &str| format!("{p}.{n}");
    let d = cfg.d_model;
    let mixer = match cfg.layers[i].mixer {
        Mixer::None => MixerWeights::None,
        Mixer::Attention => MixerWeights::Attention(Box::new(load_attention(r, cfg, &p, i)?)),
        Mixer::ShortConv { taps } => {
            MixerWeights::ShortConv(Box::new(load_short_conv(r, cfg, &p, taps)?))
        }
        Mixer::DeltaNet(n) => MixerWeights::DeltaNet(Box::new(load_delta_net(r, cfg, &p, n)?)),
        Mixer::Mamba2(m) => MixerWeights::Mamba2(Box::new(load_mamba2(r, cfg, &p, m)?)),
    };
    // Experts from layer `dense_lead` on (DeepSeek-style leading dense layers before).
    let ffn = match &cfg.moe {
        _ if !cfg.layers[i].ffn => Ffn::None,
        // Gemma 4's layers have experts where they have a router.
        Some(m) if m.shared == SharedExpert::Beside && !r.has(&name("ffn_gate_inp.weight")) => {
            Ffn::Dense(load_mlp(r, cfg, &p)?)
        }
        Some(m) if i >= m.dense_lead => Ffn::Moe(Box::new(load_moe(r, cfg, m, &p)?)),
        _ => Ffn::Dense(load_mlp(r, cfg, &p)?),
    };
    let per_layer = match cfg.per_layer_input {
        0 => None,
        w => Some(PerLayerGate {
            gate: r.matrix(&name("inp_gate.weight"), Some(w), d)?.0,
            proj: r.matrix(&name("proj.weight"), Some(d), w)?.0,
            post_norm: r
                .norm(
                    &name("post_norm"),
                    d,
                    NormRule::Weighted { bias: Need::Absent },
                )?
                .expect("a weighted norm"),
        }),
    };
    let out_scale =
        match r.vector_if(&name("layer_output_scale.weight"), 1, rules.layer_out_scale)? {
            Some(t) => Some(t.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?[0]),
            None => None,
        };
    Ok(Layer {
        per_layer,
        out_scale,
        attn_norm: r.norm(&name("attn_norm"), d, rules.attn_norm)?,
        mixer,
        post_attn_norm: r.norm(&name("post_attention_norm"), d, rules.post_attn_norm)?,
        ffn_norm: r.norm(&name(rules.ffn_norm_name), d, rules.ffn_norm)?,
        ffn,
        post_ffn_norm: r.norm(&name("post_ffw_norm"), d, rules.post_ffn_norm)?,
        view,
    })
}

/// The attention block of layer `p`.
fn load_attention(r: &Reader<'_>, cfg: &DecoderConfig, p: &str, l: usize) -> Result<AttnWeights> {
    let rules = &cfg.tensors;
    let name = |n: &str| format!("{p}.{n}");
    let mm = |n: &str, rows: Option<usize>, cols: usize| r.matrix(&name(n), rows, cols);
    let shape = cfg.layers[l].heads;
    let (d, h, kv, hd) = (cfg.d_model, shape.heads, shape.kv_heads, shape.dim);
    // A layer reading another's cache: its k and v (and k's norm), where the file has them,
    // are read by llama.cpp and unused.
    let shared = cfg.layers[l].kv_from.is_some();
    let q_rows = match cfg.attn.gated_output {
        true => 2 * h * hd,
        false => h * hd,
    };
    let widths = [q_rows, kv * hd, kv * hd];
    let attn_scale = |n: &str| r.scale(&name(n), true);
    let (qkv, qkv_post) = if r.has(&name("attn_qkv.weight")) {
        let (w, _) = mm("attn_qkv.weight", Some(widths.iter().sum()), d)?;
        let scale = attn_scale("attn_qkv")?;
        let bias = match r.vector_if(&name("attn_qkv.bias"), widths.iter().sum(), rules.qkv_bias)? {
            Some(b) => {
                let (q, k) = (
                    b.narrow(0, 0, widths[0])?,
                    b.narrow(0, widths[0], widths[1])?,
                );
                let v = b.narrow(0, widths[0] + widths[1], widths[2])?;
                [Some(q), Some(k), Some(v)]
            }
            None => qkv_biases(r, &name, &widths, rules.qkv_bias)?,
        };
        let post = bias.map(|bias| Affine {
            scale,
            bias,
            bias_first: false,
        });
        let fused = Projections::Fused {
            linear: w,
            widths: widths.to_vec(),
        };
        (fused, post)
    } else {
        if rules.fused_qkv {
            bail!(
                "{} is missing: {} keeps q, k and v in one matrix",
                name("attn_qkv.weight"),
                cfg.arch
            );
        }
        // q, k and v; q and k where v may be k (Gemma 4's `attention_k_eq_v`); q alone.
        let own = match (shared, rules.values) {
            (true, _) => 1,
            (false, Need::Optional) if !r.has(&name("attn_v.weight")) => 2,
            _ => 3,
        };
        for n in ["attn_k", "attn_v"].iter().skip(own - 1) {
            r.ignore(&name(&format!("{n}.weight")));
        }
        let mut parts = Vec::new();
        let mut scales = Vec::new();
        for (n, rows) in ["attn_q", "attn_k", "attn_v"].iter().zip(widths).take(own) {
            parts.push(mm(&format!("{n}.weight"), Some(rows), d)?.0);
            scales.push(attn_scale(n)?);
        }
        let biases = qkv_biases(r, &name, &widths, rules.qkv_bias)?;
        scales.resize(3, None);
        let mut post = biases.into_iter().zip(scales).map(|(bias, scale)| Affine {
            scale,
            bias,
            bias_first: false,
        });
        let post = [(); 3].map(|_| post.next().expect("three parts"));
        (Projections::new(parts), post)
    };
    let qk_norm = match (rules.qk_norm, cfg.attn.qk_norm) {
        (Need::Absent, _) | (_, QkNorm::None) => None,
        (need, kind) => {
            let (q, k) = match kind {
                // llama.cpp's {hd, heads}: a row of hd weights per head.
                QkNorm::EachHead => (
                    r.table_if(&name("attn_q_norm.weight"), h, hd, need)?,
                    r.table_if(&name("attn_k_norm.weight"), kv, hd, need)?,
                ),
                _ => {
                    let (ql, kl) = match kind {
                        QkNorm::Whole => (h * hd, kv * hd),
                        _ => (hd, hd),
                    };
                    (
                        r.vector_if(&name("attn_q_norm.weight"), ql, need)?,
                        match shared {
                            true => r.vector_if(&name("attn_k_norm.weight"), kl, Need::Ignored)?,
                            false => r.vector_if(&name("attn_k_norm.weight"), kl, need)?,
                        },
                    )
                }
            };
            match (q, k) {
                (Some(q), Some(k)) => Some((norm_of(q), norm_of(k))),
                // q's norm stands in for the k a layer reading another's cache never has.
                (Some(q), None) if shared => Some((norm_of(q.clone()), norm_of(q))),
                (None, None) => None,
                _ => bail!("{p} has one of attn_q_norm and attn_k_norm without the other"),
            }
        }
    };
    let (wo, _) = mm("attn_output.weight", Some(d), h * hd)?;
    let wo_post = Affine {
        scale: attn_scale("attn_output")?,
        bias: r.vector_if(&name("attn_output.bias"), d, rules.wo_bias)?,
        bias_first: false,
    };
    let sinks = match cfg.attn.sinks {
        true => Some(r.host_vector(&name("attn_sinks.weight"), h)?),
        false => None,
    };
    Ok(AttnWeights {
        qkv,
        qkv_post,
        qk_norm,
        wo,
        wo_post,
        sinks,
    })
}

/// Layer `p`'s short convolution block (`taps`: the convolution's length, `shortconv.l_cache`).
fn load_short_conv(
    r: &Reader<'_>,
    cfg: &DecoderConfig,
    p: &str,
    taps: usize,
) -> Result<ShortConvWeights> {
    let d = cfg.d_model;
    let (in_proj, _) = r.matrix(&format!("{p}.shortconv.in_proj.weight"), Some(3 * d), d)?;
    let (out_proj, _) = r.matrix(&format!("{p}.shortconv.out_proj.weight"), Some(d), d)?;
    // llama.cpp's graph passes these products no scale: read and ignored, as it does.
    r.scale(&format!("{p}.shortconv.in_proj"), false)?;
    r.scale(&format!("{p}.shortconv.out_proj"), false)?;
    let conv = r.host_table(&format!("{p}.shortconv.conv.weight"), d, taps)?;
    Ok(ShortConvWeights {
        in_proj,
        conv,
        out_proj,
    })
}

/// Layer `p`'s DeltaNet block.
fn load_delta_net(
    r: &Reader<'_>,
    cfg: &DecoderConfig,
    p: &str,
    n: DeltaNet,
) -> Result<DeltaNetWeights> {
    let d = cfg.d_model;
    let name = |s: &str| format!("{p}.{s}");
    let (ch, vd) = (n.conv_channels(), n.v_heads * n.v_dim);
    let scaled = !n.grouped; // Qwen3-Next's graph passes no scale to these products
    let mut parts = Vec::new();
    let mut post = Vec::new();
    let mut part = |t: &str, rows: usize, used: bool| -> Result<()> {
        parts.push(r.matrix(&name(&format!("{t}.weight")), Some(rows), d)?.0);
        post.push(Affine {
            scale: r.scale(&name(t), used)?,
            ..Default::default()
        });
        Ok(())
    };
    if !r.has(&name("attn_qkv.weight")) {
        bail!(
            "{} is missing: gen reads a DeltaNet layer's q, k and v from attn_qkv (a file with \
             only the older ssm_in layout is not supported)",
            name("attn_qkv.weight")
        );
    }
    part("attn_qkv", ch, scaled)?;
    part("attn_gate", vd, scaled)?;
    if n.grouped {
        part("ssm_ba", 2 * n.v_heads, true)?;
        // Read by llama.cpp's loader, unused where attn_qkv is there.
        if r.has(&name("ssm_in.weight")) {
            r.matrix(&name("ssm_in.weight"), None, d)?;
            r.scale(&name("ssm_in"), false)?;
        }
    } else {
        part("ssm_beta", n.v_heads, true)?;
        part("ssm_alpha", n.v_heads, true)?;
    }
    let conv = r.host_table(&name("ssm_conv1d.weight"), ch, n.taps)?;
    let (out, _) = r.matrix(&name("ssm_out.weight"), Some(d), vd)?;
    let out_post = Affine {
        scale: r.scale(&name("ssm_out"), scaled)?,
        ..Default::default()
    };
    Ok(DeltaNetWeights {
        proj: Projections::new(parts),
        proj_post: post,
        conv,
        dt_bias: r.host_vector(&name("ssm_dt.bias"), n.v_heads)?,
        a: r.host_vector(&name("ssm_a"), n.v_heads)?,
        norm: r.host_vector(&name("ssm_norm.weight"), n.v_dim)?,
        out,
        out_post,
    })
}

/// Layer `p`'s Mamba-2 block.
fn load_mamba2(r: &Reader<'_>, cfg: &DecoderConfig, p: &str, m: Mamba2) -> Result<Mamba2Weights> {
    let d = cfg.d_model;
    let name = |s: &str| format!("{p}.{s}");
    let ch = m.conv_channels();
    let rows = 2 * m.d_inner + 2 * m.groups * m.d_state + m.heads;
    let (in_proj, _) = r.matrix(&name("ssm_in.weight"), Some(rows), d)?;
    let (out, _) = r.matrix(&name("ssm_out.weight"), Some(d), m.d_inner)?;
    // Optional for the families gen runs (llama.cpp then adds nothing).
    let conv_bias = match r.has(&name("ssm_conv1d.bias")) {
        true => Some(r.host_vector(&name("ssm_conv1d.bias"), ch)?),
        false => None,
    };
    Ok(Mamba2Weights {
        in_proj,
        in_post: Affine {
            scale: r.scale(&name("ssm_in"), true)?,
            ..Default::default()
        },
        conv: r.host_table(&name("ssm_conv1d.weight"), ch, m.taps)?,
        conv_bias,
        dt_bias: r.host_vector(&name("ssm_dt.bias"), m.heads)?,
        a: r.host_vector(&name("ssm_a"), m.heads)?,
        d: r.host_vector(&name("ssm_d"), m.heads)?,
        norm: r.host_table(&name("ssm_norm.weight"), m.groups, m.d_inner / m.groups)?,
        out,
        out_post: Affine {
            scale: r.scale(&name("ssm_out"), true)?,
            ..Default::default()
        },
    })
}

/// Layer `p`'s dense FFN.
fn load_mlp(r: &Reader<'_>, cfg: &DecoderConfig, p: &str) -> Result<Mlp> {
    let rules = &cfg.tensors;
    let (gate_up, gate_up_post, ff) = load_ffn_in(r, cfg, p)?;
    let (w_down, _) = r.matrix(&format!("{p}.ffn_down.weight"), Some(cfg.d_model), ff)?;
    let down_post = Affine {
        scale: r.scale(&format!("{p}.ffn_down"), rules.ffn_scales)?,
        bias: r.vector_if(&format!("{p}.ffn_down.bias"), cfg.d_model, rules.ffn_bias)?,
        bias_first: true,
    };
    Ok(Mlp {
        gate_up,
        gate_up_post,
        w_down,
        down_post,
    })
}

/// Layer `p`'s mixture of experts: the router, each expert's gate (where the family has it),
/// up and down sliced from the stacked `ffn_*_exps` tensors with their `.scale`s (applied or
/// read and ignored, as `m` says), and the shared expert.
fn load_moe(r: &Reader<'_>, cfg: &DecoderConfig, m: &MoeCfg, p: &str) -> Result<Moe> {
    let (d, n) = (cfg.d_model, m.n_expert);
    let name = |s: &str| format!("{p}.{s}");
    let router = r
        .tensor(&name("ffn_gate_inp.weight"))?
        .dequantize(r.device)?;
    let router = router
        .to_dtype(candle_core::DType::F32)?
        .to_device(&Device::Cpu)?;
    if router.dims() != [n, d] {
        bail!(
            "{p}.ffn_gate_inp.weight has shape {:?}, expected [{n}, {d}]",
            router.dims()
        );
    }
    let router: Vec<f32> = router.flatten_all()?.to_vec1()?;
    let router_bias = match m.biases {
        true => Some(r.host_vector(&name("ffn_gate_inp.bias"), n)?),
        false => None,
    };
    let selection_bias = match m.selection_bias {
        Need::Absent | Need::Ignored => None,
        Need::Optional if !r.has(&name("exp_probs_b.bias")) => None,
        _ => Some(r.host_vector(&name("exp_probs_b.bias"), n)?),
    };
    // Gate and up as one stack of 2·ff rows an expert, gate first (llama.cpp reads either).
    let merged = r.has(&name("ffn_gate_up_exps.weight"));
    if merged && m.biases {
        bail!("{p}.ffn_gate_up_exps.weight: merged gate and up with biases are not supported");
    }
    let gated = match m.gate {
        Need::Required => true,
        _ => merged || r.has(&name("ffn_gate_exps.weight")),
    };
    // Per-expert scales: E values each, applied where the family does.
    let scales = |base: &str| -> Result<Option<Vec<f32>>> {
        let t = format!("{}.scale", name(base));
        if !r.has(&t) {
            return Ok(None);
        }
        let v: Vec<f32> = r.vector(&t, n)?.to_vec1()?;
        Ok(m.scales.then_some(v))
    };
    let (s_gate, s_up) = match (merged, gated) {
        (true, _) => {
            let s = scales("ffn_gate_up_exps")?;
            (s.clone(), s)
        }
        (false, true) => (scales("ffn_gate_exps")?, scales("ffn_up_exps")?),
        (false, false) => (None, scales("ffn_up_exps")?),
    };
    let s_down = scales("ffn_down_exps")?;
    // Per-expert biases (gpt-oss): E rows of the product's width each, added after the
    // product (and its scale, as llama.cpp's graph orders them).
    let biases = |base: &str, width: usize| -> Result<Option<Tensor>> {
        if !m.biases {
            return Ok(None);
        }
        r.table_if(&name(&format!("{base}.bias")), n, width, Need::Required)
    };
    let b_gate = if gated {
        biases("ffn_gate_exps", m.ff)?
    } else {
        None
    };
    let (b_up, b_down) = (biases("ffn_up_exps", m.ff)?, biases("ffn_down_exps", d)?);
    let post = |s: &Option<Vec<f32>>, b: &Option<Tensor>, e: usize| -> Result<Affine> {
        Ok(Affine {
            scale: s.as_ref().map(|s| s[e]),
            bias: b.as_ref().map(|b| b.get(e)).transpose()?,
            bias_first: false,
        })
    };
    let mut experts = Vec::with_capacity(n);
    for e in 0..n {
        let mut parts = Vec::new();
        let mut posts = Vec::new();
        if gated {
            posts.push(post(&s_gate, &b_gate, e)?);
        }
        posts.push(post(&s_up, &b_up, e)?);
        let gate_up = match merged {
            true => Projections::Fused {
                linear: r.expert(&name("ffn_gate_up_exps.weight"), e, n, 2 * m.ff, d)?,
                widths: vec![m.ff, m.ff],
            },
            false => {
                if gated {
                    parts.push(r.expert(&name("ffn_gate_exps.weight"), e, n, m.ff, d)?);
                }
                parts.push(r.expert(&name("ffn_up_exps.weight"), e, n, m.ff, d)?);
                Projections::new(parts)
            }
        };
        experts.push(Mlp {
            gate_up,
            gate_up_post: posts,
            w_down: r.expert(&name("ffn_down_exps.weight"), e, n, d, m.ff)?,
            down_post: post(&s_down, &b_down, e)?,
        });
    }
    let shared_mlp = |ff: usize| -> Result<Mlp> {
        // Each product's scale, where the family's graph applies it (read and ignored
        // otherwise).
        let mm = |s: &str, rows: usize, cols: usize| -> Result<(QLinear, Affine)> {
            let post = Affine {
                scale: r.scale(&name(s), m.shared_scales)?,
                ..Default::default()
            };
            Ok((
                r.matrix(&name(&format!("{s}.weight")), Some(rows), cols)?.0,
                post,
            ))
        };
        let (gate, gate_post) = mm("ffn_gate_shexp", ff, d)?;
        let (up, up_post) = mm("ffn_up_shexp", ff, d)?;
        let (w_down, down_post) = mm("ffn_down_shexp", d, ff)?;
        Ok(Mlp {
            gate_up: Projections::new(vec![gate, up]),
            gate_up_post: vec![gate_post, up_post],
            w_down,
            down_post,
        })
    };
    let weighted = NormRule::Weighted { bias: Need::Absent };
    let norm =
        |n: &str| -> Result<Norm> { Ok(r.norm(&name(n), d, weighted)?.expect("a weighted norm")) };
    let beside = match m.shared {
        SharedExpert::Beside => Some(Beside {
            router_scale: r.host_vector(&name("ffn_gate_inp.scale"), d)?,
            experts_in: norm("pre_ffw_norm_2")?,
            experts_out: norm("post_ffw_norm_2")?,
            dense_out: norm("post_ffw_norm_1")?,
        }),
        _ => None,
    };
    let (shared, shared_gate) = match m.shared {
        SharedExpert::None => (None, None),
        SharedExpert::Beside => (Some(load_mlp(r, cfg, p)?), None),
        SharedExpert::Plain { ff } => (Some(shared_mlp(ff)?), None),
        SharedExpert::Gated { ff } => {
            let g = r
                .vector(&name("ffn_gate_inp_shexp.weight"), d)?
                .to_dtype(candle_core::DType::F32)?;
            (
                Some(shared_mlp(ff)?),
                Some(g.to_device(&Device::Cpu)?.to_vec1()?),
            )
        }
    };
    Ok(Moe {
        router,
        experts,
        shared,
        shared_gate,
        router_bias,
        selection_bias,
        beside,
    })
}

/// The FFN's input side: gate and up (or up alone, or one matrix holding both), what follows
/// each, and the FFN's width.
fn load_ffn_in(
    r: &Reader<'_>,
    cfg: &DecoderConfig,
    p: &str,
) -> Result<(Projections, Vec<Affine>, usize)> {
    let rules = &cfg.tensors;
    let d = cfg.d_model;
    let name = |n: &str| format!("{p}.{n}");
    let post = |n: &str, len: usize| -> Result<Affine> {
        Ok(Affine {
            scale: r.scale(&name(n), rules.ffn_scales)?,
            bias: r.vector_if(&name(&format!("{n}.bias")), len, rules.ffn_bias)?,
            bias_first: true,
        })
    };
    if rules.fused_gate_up {
        let (w, rows) = r.matrix(&name("ffn_up.weight"), None, d)?;
        if rows % 2 != 0 {
            bail!("{p}.ffn_up.weight holds gate and up, but has an odd number of rows ({rows})");
        }
        let ff = rows / 2;
        let up = post("ffn_up", rows)?;
        if !up.is_identity() {
            bail!("{p}.ffn_up holds gate and up: a scale or bias on it is not supported");
        }
        let fused = Projections::Fused {
            linear: w,
            widths: vec![ff, ff],
        };
        return Ok((fused, vec![Affine::default(), Affine::default()], ff));
    }
    let (w_up, ff) = r.matrix(&name("ffn_up.weight"), None, d)?;
    let up = post("ffn_up", ff)?;
    match rules.ffn_gate {
        Need::Required => {
            let (w_gate, _) = r.matrix(&name("ffn_gate.weight"), Some(ff), d)?;
            let gate = post("ffn_gate", ff)?;
            Ok((Projections::new(vec![w_gate, w_up]), vec![gate, up], ff))
        }
        _ => Ok((Projections::Separate(vec![w_up]), vec![up], ff)),
    }
}

/// q/k/v's biases, one per part (as many as the file has, where `need` allows them).
fn qkv_biases(
    r: &Reader<'_>,
    name: &dyn Fn(&str) -> String,
    widths: &[usize; 3],
    need: Need,
) -> Result<[Option<Tensor>; 3]> {
    let mut out = [None, None, None];
    for ((slot, n), &w) in out
        .iter_mut()
        .zip(["attn_q", "attn_k", "attn_v"])
        .zip(widths)
    {
        *slot = r.vector_if(&name(&format!("{n}.bias")), w, need)?;
    }
    Ok(out)
}

fn norm_of(weight: Tensor) -> Norm {
    Norm {
        weight: Some(weight),
        bias: None,
    }
}

/// Every tensor of the file must have been read, be one llama.cpp reads and ignores for this
/// architecture, or the file is refused: a tensor gen does not use may change what the model
/// computes.
fn check_all_read(ckpt: &Checkpoint, cfg: &DecoderConfig, read: &BTreeSet<String>) -> Result<()> {
    for n in ckpt.tensor_names() {
        if read.contains(&n) || cfg.tensors.ignored.contains(&n.as_str()) {
            continue;
        }
        // Multi-token prediction blocks, which llama.cpp skips too.
        let block = n
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|b| b.parse::<usize>().ok());
        if block.is_some_and(|b| b >= cfg.n_layer && b < cfg.n_layer + cfg.mtp_blocks) {
            continue;
        }
        // llama.cpp loads `.input_scale` factors for every projection and uses none of them.
        if let Some(of) = n.strip_suffix(".input_scale") {
            if read.contains(&format!("{of}.weight")) {
                continue;
            }
        }
        bail!(
            "tensor {n} is not one a {} model holds as llama.cpp reads it: refusing the file \
             rather than running it without",
            cfg.arch
        );
    }
    Ok(())
}

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
