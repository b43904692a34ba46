//! A decoder's weights, read from a checkpoint and checked against its configuration: the
//! embedding matrix, each layer's norms and projections, the final norm and the output layer,
//! and which layers share a sliding window or a rope base. Both backends read them; neither
//! owns them.

use anyhow::{bail, Context, Result};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use super::config::{DecoderConfig, Family};
use super::cpu::matmul::{CpuQWeight, Kernel};
use super::qlinear::{DeviceWeights, Projections, QLinear};
use crate::format::checkpoint::Checkpoint;

pub struct Layer {
    pub attn_norm: Tensor, // (d)
    /// q (h*hd, d), k (kv*hd, d), v (kv*hd, d): three matrices, or one of (h+2kv)*hd rows.
    pub qkv: Projections,
    pub qkv_bias: Option<[Tensor; 3]>, // (h*hd), (kv*hd), (kv*hd)
    pub qk_norm: Option<(Tensor, Tensor)>, // (hd), (hd)
    pub wo: QLinear,                   // (d, h*hd)
    pub post_attn_norm: Option<Tensor>, // (d)
    pub ffn_norm: Tensor,              // (d)
    pub gate_up: Projections,          // gate (ff, d), up (ff, d); or one of 2ff rows
    pub w_down: QLinear,               // (d, ff)
    pub post_ffn_norm: Option<Tensor>, // (d)
    /// Index into [`Weights::windows`] (the pass plan's key ranges) and into
    /// [`Weights::rope_bases`].
    pub view: usize,
    pub rope: usize,
}

pub struct Weights {
    pub embedding: Embedding,
    pub layers: Vec<Layer>,
    pub out_norm: Tensor, // (d)
    pub output: QLinear,  // (V, d)
    /// Distinct sliding windows (`None`: whole context) and rope bases among the layers.
    pub windows: Vec<Option<usize>>,
    pub rope_bases: Vec<f32>,
    pub vocab_size: usize,
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

/// Reads a checkpoint's tensors onto one device, quantized weights kept as `kind` says.
struct Reader<'a> {
    ckpt: &'a Checkpoint,
    device: &'a Device,
    kind: DeviceWeights,
}

impl Reader<'_> {
    fn tensor(&self, n: &str) -> Result<QTensor> {
        self.ckpt
            .tensor(n, self.device)
            .with_context(|| format!("reading tensor {n}"))
    }

    /// A norm's weight or a bias: `len` values, widened.
    fn vector(&self, n: &str, len: usize) -> Result<Tensor> {
        let t = self.tensor(n)?.dequantize(self.device)?;
        if t.dims() != [len] {
            bail!("{n} has shape {:?}, expected [{len}]", t.dims());
        }
        Ok(t)
    }

    /// The matrix `n` of `rows` (any, if None) by `cols`, and its row count.
    fn matrix(&self, n: &str, rows: Option<usize>, cols: usize) -> Result<(QLinear, usize)> {
        // A type gen reads itself (IQ4_NL, IQ4_XS): its blocks straight to our kernels on the
        // CPU; widened elsewhere.
        if self.device.is_cpu() && self.kind == DeviceWeights::Quantized {
            if let Some((ggml, r, c, raw)) = self.ckpt.own_matrix(n)? {
                if rows.is_some_and(|want| want != r) || c != cols {
                    bail!(
                        "{n} has shape [{r}, {c}], expected [{}, {cols}]",
                        rows.map_or("_".into(), |r| r.to_string())
                    );
                }
                let w = CpuQWeight::from_raw(ggml, &raw, r, c, Kernel::detect())?
                    .with_context(|| format!("{n}: no kernel for its type"))?;
                return Ok((QLinear::Cpu(w), r));
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
}

impl Weights {
    /// Every weight of `ckpt` for `cfg`, on `device`; quantized matrices kept as `kind` says.
    pub fn load(
        ckpt: &Checkpoint,
        cfg: &DecoderConfig,
        device: &Device,
        kind: DeviceWeights,
    ) -> Result<Self> {
        let r = Reader { ckpt, device, kind };
        // Tied embeddings (SmolLM2, Gemma, small Qwens): the output layer is the embedding
        // matrix. On gen's CPU kernels it is read once, as the output layer, and lookups widen
        // its rows; otherwise the embedding is a table of its own.
        let tied = !ckpt.has_tensor("output.weight");
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
        let mut rope_bases: Vec<f32> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let view = index_of(&mut windows, cfg.layer_window(i));
            let rope = index_of(&mut rope_bases, cfg.layer_rope_base(i));
            layers.push(load_layer(&r, cfg, i, view, rope)?);
        }
        let out_norm = r.vector("output_norm.weight", cfg.d_model)?;
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
        Ok(Self {
            embedding,
            layers,
            out_norm,
            output,
            windows,
            rope_bases,
            vocab_size,
        })
    }

    /// The embeddings of a pass's tokens, scaled where the family says: (N, d).
    pub fn embed(&self, ids: &[u32], cfg: &DecoderConfig, device: &Device) -> Result<Tensor> {
        let mut x = match (&self.embedding, &self.output) {
            (Embedding::Table(t), _) => t.embedding(&Tensor::new(ids, device)?)?, // (N, d)
            (Embedding::Output, QLinear::Cpu(w)) => {
                let (v, d) = w.dims();
                let mut rows = vec![0f32; ids.len() * d];
                for (&id, row) in ids.iter().zip(rows.chunks_exact_mut(d)) {
                    if id as usize >= v {
                        anyhow::bail!("token id {id} is outside the vocabulary of {v}");
                    }
                    w.dequantize_row(id as usize, row);
                }
                Tensor::from_vec(rows, (ids.len(), d), device)?
            }
            (Embedding::Output, _) => unreachable!("tied to an output layer on gen's kernels"),
        };
        if cfg.family.scales_embeddings() {
            x = (x * (cfg.d_model as f32).sqrt() as f64)?;
        }
        Ok(x)
    }
}

/// Layer `i`'s weights (`view` and `rope`: its window's and rope base's index).
fn load_layer(
    r: &Reader<'_>,
    cfg: &DecoderConfig,
    i: usize,
    view: usize,
    rope: usize,
) -> Result<Layer> {
    let family = cfg.family;
    let p = format!("blk.{i}");
    let mm = |n: &str, rows: Option<usize>, cols: usize| {
        r.matrix(&format!("{p}.{n}.weight"), rows, cols)
    };
    let has = |n: &str| r.ckpt.has_tensor(&format!("{p}.{n}.weight"));
    let (d, h, kv, hd) = (cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim);
    let qkv = if has("attn_qkv") {
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
                r.vector(&format!("{p}.attn_q.bias"), h * hd)?,
                r.vector(&format!("{p}.attn_k.bias"), kv * hd)?,
                r.vector(&format!("{p}.attn_v.bias"), kv * hd)?,
            ])
        })
        .transpose()?;
    let qk_norm = family
        .qk_norm()
        .then(|| -> Result<(Tensor, Tensor)> {
            Ok((
                r.vector(&format!("{p}.attn_q_norm.weight"), hd)?,
                r.vector(&format!("{p}.attn_k_norm.weight"), hd)?,
            ))
        })
        .transpose()?;
    let (wo, _) = mm("attn_output", Some(d), h * hd)?;
    // Phi-3 keeps gate and up in one matrix, gate first.
    let (gate_up, ff) = if has("ffn_gate") {
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
            .then(|| r.vector(&format!("{p}.{n}.weight"), d))
            .transpose()
    };
    Ok(Layer {
        attn_norm: r.vector(&format!("{p}.attn_norm.weight"), d)?,
        qkv,
        qkv_bias,
        qk_norm,
        wo,
        post_attn_norm: sandwich("post_attention_norm")?,
        ffn_norm: r.vector(&format!("{p}.ffn_norm.weight"), d)?,
        gate_up,
        w_down,
        post_ffn_norm: sandwich("post_ffw_norm")?,
        view,
        rope,
    })
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
