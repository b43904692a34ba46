//! The llama architecture (Llama 2/3, SmolLM2, TinyLlama, Mistral) over quantized GGUF weights.
//!
//! Shape legend: T = new tokens of a step, L = tokens in the cache after the step, C = capacity of
//! a sequence's cache, d = embedding width, h = query heads, kv = key/value heads, g = h / kv,
//! hd = head width, V = vocabulary.
//!
//! Not here: batching several sequences into one matrix multiply (each step of a batch runs on
//! its own for now), and CPU kernels of our own (candle's quantized matmul does the work).

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device, Tensor};

use super::checkpoint::Checkpoint;
use super::qlinear::{Projections, QLinear};
use super::{LanguageModel, ModelInfo, SeqId, SeqStep};

/// Hyper-parameters read from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub context_len: usize,
}

impl LlamaConfig {
    pub fn from_gguf(md: &HashMap<String, gguf_file::Value>, arch: &str) -> Result<Self> {
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
        Ok(Self {
            n_layer,
            d_model,
            n_head,
            n_kv_head,
            head_dim,
            rms_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_base: get_f("rope.freq_base").unwrap_or(10_000.0),
            context_len,
        })
    }
}

struct Layer {
    attn_norm: Tensor,    // (d)
    qkv: Projections,     // q (h*hd, d), k (kv*hd, d), v (kv*hd, d)
    wo: QLinear,          // (d, h*hd)
    ffn_norm: Tensor,     // (d)
    gate_up: Projections, // gate (ff, d), up (ff, d)
    w_down: QLinear,      // (d, ff)
}

/// One sequence's keys and values, preallocated for its whole capacity and written in place.
struct KvCache {
    k: Vec<Tensor>, // per layer (kv, C, hd)
    v: Vec<Tensor>, // per layer (kv, C, hd)
    capacity: usize,
    len: usize,
}

pub struct Llama {
    info: ModelInfo,
    cfg: LlamaConfig,
    device: Device,
    embedding: QTensor, // (V, d)
    layers: Vec<Layer>,
    out_norm: Tensor, // (d)
    output: QLinear,  // (V, d)
    seqs: Vec<Option<KvCache>>,
}

impl Llama {
    pub fn from_checkpoint(ckpt: &Checkpoint, device: &Device) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(&ckpt.metadata, "llama")?;
        let name = ckpt.name.clone();
        let tensor = |n: &str| -> Result<QTensor> {
            ckpt.tensor(n, device)
                .with_context(|| format!("reading tensor {n}"))
        };
        let embedding = tensor("token_embd.weight")?;
        let (vocab_size, emb_width) = embedding.shape().dims2()?;
        if emb_width != cfg.d_model {
            bail!(
                "token_embd.weight is {vocab_size}x{emb_width}, expected width {}",
                cfg.d_model
            );
        }
        let norm = |q: QTensor| -> Result<Tensor> {
            let t = q.dequantize(device)?;
            if t.dims() != [cfg.d_model] {
                bail!(
                    "a norm weight has shape {:?}, expected [{}]",
                    t.dims(),
                    cfg.d_model
                );
            }
            Ok(t)
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
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
                Ok((QLinear::new(q, device)?, dims[0]))
            };
            let (d, h, kv, hd) = (cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim);
            let (wq, _) = mm("attn_q", Some(h * hd), d)?;
            let (wk, _) = mm("attn_k", Some(kv * hd), d)?;
            let (wv, _) = mm("attn_v", Some(kv * hd), d)?;
            let (wo, _) = mm("attn_output", Some(d), h * hd)?;
            let (w_gate, ff) = mm("ffn_gate", None, d)?;
            let (w_up, _) = mm("ffn_up", Some(ff), d)?;
            let (w_down, _) = mm("ffn_down", Some(d), ff)?;
            let attn_norm = norm(tensor(&format!("{p}.attn_norm.weight"))?)?;
            let ffn_norm = norm(tensor(&format!("{p}.ffn_norm.weight"))?)?;
            layers.push(Layer {
                attn_norm,
                qkv: Projections::new(vec![wq, wk, wv]),
                wo,
                ffn_norm,
                gate_up: Projections::new(vec![w_gate, w_up]),
                w_down,
            });
        }
        let out_norm = norm(tensor("output_norm.weight")?)?;
        // Tied embeddings (SmolLM2): the output layer is the embedding matrix itself.
        let output = if ckpt.has_tensor("output.weight") {
            let q = tensor("output.weight")?;
            if q.shape().dims() != [vocab_size, cfg.d_model] {
                bail!(
                    "output.weight has shape {:?}, expected [{vocab_size}, {}]",
                    q.shape().dims(),
                    cfg.d_model
                );
            }
            QLinear::new(q, device)?
        } else {
            QLinear::new(tensor("token_embd.weight")?, device)?
        };
        let info = ModelInfo {
            arch: "llama".into(),
            name,
            context_len: cfg.context_len,
            vocab_size,
        };
        Ok(Self {
            info,
            cfg,
            device: device.clone(),
            embedding,
            layers,
            out_norm,
            output,
            seqs: Vec::new(),
        })
    }

    /// Run one sequence's step through every layer; returns the last token's logits (1, V).
    fn forward_step(&mut self, step: &SeqStep<'_>) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (h, kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let g = h / kv;
        let t = step.tokens.len();
        let cache = self
            .seqs
            .get_mut(step.seq)
            .and_then(|c| c.as_mut())
            .with_context(|| format!("sequence {} is not allocated", step.seq))?;
        if t == 0 {
            bail!("a forward step needs at least one token");
        }
        if step.pos != cache.len {
            bail!(
                "sequence {} holds {} tokens but the step starts at {}",
                step.seq,
                cache.len,
                step.pos
            );
        }
        let end = step.pos + t;
        if end > cache.capacity || end > cfg.context_len {
            bail!(
                "sequence {} would hold {end} tokens, over its capacity {}",
                step.seq,
                cache.capacity.min(cfg.context_len)
            );
        }
        let ids = Tensor::new(step.tokens, &self.device)?;
        let mut x = self.embedding.embedding(&ids)?; // (T, d)
        let (cos, sin) = rope_tables(cfg.head_dim, cfg.rope_base, step.pos, t, &self.device)?;
        let mask = if t > 1 {
            Some(causal_mask(t, step.pos, g, &self.device)?)
        } else {
            None
        };
        let scale = 1.0 / (hd as f64).sqrt();
        for (l, layer) in self.layers.iter().enumerate() {
            let xn = candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let [q, k, v]: [Tensor; 3] = layer
                .qkv
                .forward(&xn)?
                .try_into()
                .expect("three projections");
            let q = q.reshape((1, t, h, hd))?.transpose(1, 2)?.contiguous()?;
            let k = k.reshape((1, t, kv, hd))?.transpose(1, 2)?.contiguous()?;
            let v = v.reshape((t, kv, hd))?.transpose(0, 1)?.contiguous()?;
            // GGUF llama weights are permuted for interleaved (GPT-J style) rotary pairs.
            let q = candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?; // (1, h, T, hd)
            let k = candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?; // (1, kv, T, hd)
            cache.k[l].slice_set(&k.squeeze(0)?, 1, step.pos)?;
            cache.v[l].slice_set(&v, 1, step.pos)?;
            let y = if t == 1 && self.device.is_cpu() {
                decode_attention_cpu(
                    &q,
                    &cache.k[l],
                    &cache.v[l],
                    cfg,
                    cache.capacity,
                    end,
                    scale as f32,
                )?
            } else {
                let keys = cache.k[l].narrow(1, 0, end)?; // (kv, L, hd)
                let values = cache.v[l].narrow(1, 0, end)?; // (kv, L, hd)
                                                            // Heads sharing a kv head sit next to each other: fold them into the row axis so
                                                            // the cache is used as is, never repeated.
                let q = q.reshape((kv, g * t, hd))?;
                let att = (q.matmul(&keys.t()?)? * scale)?; // (kv, g*T, L)
                let att = match &mask {
                    Some(m) => att.broadcast_add(m)?,
                    None => att,
                };
                let att = candle_nn::ops::softmax_last_dim(&att)?;
                let y = att.matmul(&values)?; // (kv, g*T, hd)
                y.reshape((h, t, hd))?
                    .transpose(0, 1)?
                    .reshape((t, h * hd))?
            };
            x = (x + layer.wo.forward(&y)?)?;
            let xn = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, cfg.rms_eps)?;
            let [gate, up]: [Tensor; 2] = layer
                .gate_up
                .forward(&xn)?
                .try_into()
                .expect("two projections");
            let gate = candle_nn::ops::silu(&gate)?;
            x = (x + layer.w_down.forward(&(gate * up)?)?)?;
        }
        cache.len = end;
        // Only the last position's logits are needed: skip the output layer for the rest.
        let last = x.narrow(0, t - 1, 1)?;
        let last = candle_nn::ops::rms_norm(&last, &self.out_norm, cfg.rms_eps)?;
        Ok(self.output.forward(&last)?.to_dtype(DType::F32)?)
    }
}

/// One query token against the cache on the CPU: q (1, h, 1, hd), caches (kv, C, hd) holding
/// L tokens. Returns (1, h*hd).
fn decode_attention_cpu(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cfg: &LlamaConfig,
    capacity: usize,
    len: usize,
    scale: f32,
) -> Result<Tensor> {
    let q = q.flatten_all()?.to_vec1::<f32>()?;
    let (ks, kl) = k_cache.storage_and_layout();
    let (vs, vl) = v_cache.storage_and_layout();
    let (candle_core::Storage::Cpu(k), candle_core::Storage::Cpu(v)) = (&*ks, &*vs) else {
        bail!("the KV cache is not on the CPU");
    };
    let k = &k.as_slice::<f32>()?[kl.start_offset()..];
    let v = &v.as_slice::<f32>()?[vl.start_offset()..];
    let y = super::attention::decode_attention(
        &q,
        k,
        v,
        cfg.n_head,
        cfg.n_kv_head,
        capacity,
        len,
        cfg.head_dim,
        scale,
    );
    Ok(Tensor::from_vec(
        y,
        (1, cfg.n_head * cfg.head_dim),
        &Device::Cpu,
    )?)
}

/// cos and sin of the rotation angles of positions pos..pos+T: (T, hd/2) each. Computed per
/// step (T * hd/2 values) rather than tabled for the whole context, whose length comes from the
/// file and may be huge.
fn rope_tables(
    head_dim: usize,
    base: f32,
    pos: usize,
    t: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in pos..pos + t {
        for f in &inv_freq {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, half), device)?,
        Tensor::from_vec(sin, (t, half), device)?,
    ))
}

/// Additive mask for T new tokens at positions pos.. attending to L = pos + T cached ones,
/// repeated for the g query heads folded into each kv head's rows: (g*T, L).
fn causal_mask(t: usize, pos: usize, g: usize, device: &Device) -> Result<Tensor> {
    let l = pos + t;
    let mut m = vec![0f32; g * t * l];
    for gi in 0..g {
        for i in 0..t {
            let row = &mut m[(gi * t + i) * l..(gi * t + i + 1) * l];
            for v in row.iter_mut().skip(pos + i + 1) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Tensor::from_vec(m, (g * t, l), device)?)
}

impl LanguageModel for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_sequence(&mut self, capacity: usize) -> Result<SeqId> {
        let capacity = capacity.min(self.cfg.context_len).max(1);
        let shape = (self.cfg.n_kv_head, capacity, self.cfg.head_dim);
        let mut k = Vec::with_capacity(self.cfg.n_layer);
        let mut v = Vec::with_capacity(self.cfg.n_layer);
        for _ in 0..self.cfg.n_layer {
            k.push(Tensor::zeros(shape, DType::F32, &self.device)?);
            v.push(Tensor::zeros(shape, DType::F32, &self.device)?);
        }
        let cache = KvCache {
            k,
            v,
            capacity,
            len: 0,
        };
        match self.seqs.iter().position(|s| s.is_none()) {
            Some(i) => {
                self.seqs[i] = Some(cache);
                Ok(i)
            }
            None => {
                self.seqs.push(Some(cache));
                Ok(self.seqs.len() - 1)
            }
        }
    }

    fn free_sequence(&mut self, seq: SeqId) {
        if let Some(slot) = self.seqs.get_mut(seq) {
            *slot = None;
        }
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        let rows = batch
            .iter()
            .map(|step| self.forward_step(step))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&rows, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_mask_hides_the_future_per_group() {
        let m = causal_mask(2, 3, 2, &Device::Cpu).unwrap();
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
}
