//! The llama architecture (Llama 2/3, SmolLM2, TinyLlama, Mistral) over quantized GGUF weights.
//!
//! Shape legend: T = new tokens of a step, L = tokens in the cache after the step, C = capacity of
//! a sequence's cache, d = embedding width, h = query heads, kv = key/value heads, g = h / kv,
//! hd = head width, V = vocabulary.
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
use super::qlinear::{Projections, QLinear};
use super::{LanguageModel, ModelInfo, SeqStep};

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

pub struct Llama {
    info: ModelInfo,
    cfg: LlamaConfig,
    device: Device,
    embedding: QTensor, // (V, d)
    layers: Vec<Layer>,
    out_norm: Tensor, // (d)
    output: QLinear,  // (V, d)
    kv: PagedKv,
    store: KvStore,
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
            kv: PagedKv::new(0),
            store: KvStore::empty(),
        })
    }

    /// The rows of `x` (N, d) through every layer, then the output layer for the last token of
    /// each step: (batch, V).
    fn forward_batch(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        let n = super::check_batch(&self.kv, batch, self.cfg.context_len)?;
        let cfg = &self.cfg;
        let (h, kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let g = h / kv;
        let dev = &self.device;
        let cpu = dev.is_cpu();

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
        // Steps attended through candle's matrix multiplies (all of them off the CPU; prompt
        // chunks on it): every cache row of the sequence, and the causal mask.
        let mut gathered = Vec::with_capacity(batch.len());
        for step in batch {
            let t = step.tokens.len();
            if cpu {
                // Our kernels read the cache in place.
                gathered.push(None);
                continue;
            }
            let end = step.pos + t;
            let slots: Vec<u32> = self.kv.slots(step.seq, 0, end).collect();
            let rows = self.store.gather_rows(&slots);
            let on_device = (!cpu)
                .then(|| Tensor::new(rows.as_slice(), dev))
                .transpose()?;
            let mask = (t > 1)
                .then(|| causal_mask(t, step.pos, g, dev))
                .transpose()?;
            gathered.push(Some((rows, on_device, mask)));
        }
        // The fused CPU kernel's view of each one-token step: its block table and length.
        let decode: Vec<(usize, &[u32], usize)> = batch
            .iter()
            .zip(&starts)
            .filter(|(s, _)| cpu && s.tokens.len() == 1)
            .map(|(s, &at)| (at, self.kv.blocks(s.seq), s.pos + 1))
            .collect();

        let ids = Tensor::new(ids.as_slice(), dev)?;
        let mut x = self.embedding.embedding(&ids)?; // (N, d)
        let (cos, sin) = rope_tables(hd, cfg.rope_base, &positions, dev)?; // (N, hd/2)
        let scale = 1.0 / (hd as f64).sqrt();
        for (l, layer) in self.layers.iter().enumerate() {
            let xn = candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?;
            let [q, k, v]: [Tensor; 3] = layer
                .qkv
                .forward(&xn)?
                .try_into()
                .expect("three projections");
            let heads_first = |t: Tensor, heads: usize| -> Result<Tensor> {
                Ok(t.reshape((n, heads, hd))?
                    .transpose(0, 1)?
                    .contiguous()?
                    .unsqueeze(0)?)
            };
            // GGUF llama weights are permuted for interleaved (GPT-J style) rotary pairs.
            let q = candle_nn::rotary_emb::rope_i(&heads_first(q, h)?, &cos, &sin)?; // (1, h, N, hd)
            let k = candle_nn::rotary_emb::rope_i(&heads_first(k, kv)?, &cos, &sin)?; // (1, kv, N, hd)
            let q = q.squeeze(0)?.transpose(0, 1)?.contiguous()?; // (N, h, hd)
            let k = k.squeeze(0)?.transpose(0, 1)?.reshape((n, kv * hd))?; // (N, kv*hd)
            self.store.write(l, &k, &v, &slots)?;

            let fused = if decode.is_empty() {
                None
            } else {
                let (k_pool, v_pool) = self.store.host(l).context("a host KV cache")?;
                Some(decode_attention_cpu(
                    &q,
                    k_pool,
                    v_pool,
                    &decode,
                    cfg,
                    scale as f32,
                )?)
            };
            let y = if decode.len() == batch.len() {
                fused.expect("every step is a CPU decode step") // (N, h*hd)
            } else {
                let mut parts = Vec::with_capacity(batch.len());
                let mut fused_rows = 0..decode.len();
                for ((step, &at), gather) in batch.iter().zip(&starts).zip(&gathered) {
                    let t = step.tokens.len();
                    let Some((rows, on_device, mask)) = gather else {
                        if t > 1 {
                            let (k_pool, v_pool) = self.store.host(l).context("a host KV cache")?;
                            let blocks = self.kv.blocks(step.seq);
                            parts.push(prefill_attention_cpu(
                                &q,
                                at,
                                step.pos,
                                t,
                                blocks,
                                k_pool,
                                v_pool,
                                cfg,
                                scale as f32,
                            )?);
                            continue;
                        }
                        let f = fused.as_ref().expect("a CPU decode step");
                        let row = fused_rows.next().expect("one row per decode step");
                        parts.push(f.narrow(0, row, 1)?);
                        continue;
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
                Tensor::cat(&parts, 0)?
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
        for step in batch {
            self.kv.advance(step.seq, step.tokens.len());
        }
        // Only each step's last token needs logits: skip the output layer for the rest.
        let last: Vec<u32> = batch
            .iter()
            .zip(&starts)
            .map(|(s, &at)| (at + s.tokens.len() - 1) as u32)
            .collect();
        let last = if last.len() == n {
            x
        } else {
            x.index_select(&Tensor::new(last.as_slice(), dev)?, 0)?
        };
        let last = candle_nn::ops::rms_norm(&last, &self.out_norm, cfg.rms_eps)?;
        Ok(self.output.forward(&last)?.to_dtype(DType::F32)?)
    }
}

/// A step's T queries (rows at..at+T of q: (N, h, hd)) against its sequence's pages, causal,
/// on the CPU. Returns (T, h*hd).
#[allow(clippy::too_many_arguments)]
fn prefill_attention_cpu(
    q: &Tensor,
    at: usize,
    pos: usize,
    t: usize,
    blocks: &[u32],
    k: &[half::f16],
    v: &[half::f16],
    cfg: &LlamaConfig,
    scale: f32,
) -> Result<Tensor> {
    let (qs, ql) = q.storage_and_layout();
    let candle_core::Storage::Cpu(qc) = &*qs else {
        bail!("the queries are not on the CPU");
    };
    let width = cfg.n_head * cfg.head_dim;
    let q = &qc.as_slice::<f32>()?[ql.start_offset() + at * width..][..t * width];
    let y = super::attention::causal_prefill_attention(
        q,
        blocks,
        pos,
        t,
        k,
        v,
        BLOCK_SIZE,
        cfg.n_head,
        cfg.n_kv_head,
        cfg.head_dim,
        scale,
    );
    Ok(Tensor::from_vec(y, (t, width), &Device::Cpu)?)
}

/// One query token per step against its sequence's pages, on the CPU. q: (N, h, hd); pools:
/// (kv, P, BLOCK_SIZE, hd); `steps`: (row of q, block table, tokens in the cache). Returns
/// (steps, h*hd).
fn decode_attention_cpu(
    q: &Tensor,
    k: &[half::f16],
    v: &[half::f16],
    steps: &[(usize, &[u32], usize)],
    cfg: &LlamaConfig,
    scale: f32,
) -> Result<Tensor> {
    let (qs, ql) = q.storage_and_layout();
    let candle_core::Storage::Cpu(qc) = &*qs else {
        bail!("the queries are not on the CPU");
    };
    let q = &qc.as_slice::<f32>()?[ql.start_offset()..];
    let width = cfg.n_head * cfg.head_dim;
    let seqs: Vec<super::attention::PagedQuery<'_>> = steps
        .iter()
        .map(|&(row, blocks, len)| super::attention::PagedQuery {
            q: &q[row * width..(row + 1) * width],
            blocks,
            len,
        })
        .collect();
    let y = super::attention::paged_decode_attention(
        &seqs,
        k,
        v,
        BLOCK_SIZE,
        cfg.n_head,
        cfg.n_kv_head,
        cfg.head_dim,
        scale,
    );
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
        let bytes = if self.device.is_cpu() { 2 } else { 4 };
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
