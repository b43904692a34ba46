//! The forward pass on the CPU, through gen's own kernels: quantized matrix products
//! ([`matmul`]), attention reading the f16 paged cache in place ([`attention`], [`kv_store`]),
//! and fused element-wise steps ([`ops`]: rope in the token-major layout, each residual add with
//! the norm after it, silu(gate) * up). Activations stay token-major, (N, heads, hd), from the
//! projections through the cache to attention's output.
//!
//! A layer, top to bottom: q/k/v projections (one fused matrix where the weights allow), biases,
//! per-head q/k norms, rope, the cache write, attention (every one-token step of the pass in one
//! call of the decode kernel; each prompt chunk through the causal prefill kernel), the output
//! projection, the residual add fused with the FFN's norm, gate/up, the activation, the down
//! projection, and the residual add fused with the next layer's attention norm.

pub mod attention;
pub mod kv_store;
pub mod matmul;
pub mod ops;
pub mod q8;
pub mod quants;
#[cfg(target_arch = "x86_64")]
mod quants_x86;
#[cfg(target_arch = "x86_64")]
mod quants_zmm;
pub mod wide16;

use anyhow::Result;
use candle_core::{Device, Tensor};

use self::kv_store::HostKv;
use super::config::{Activation, DecoderConfig, Rope};
use super::kv_cache::BLOCK_SIZE;
use super::plan::{DecodeQuery, PassPlan, StepPlan};
use super::profile::Profile;
use super::weights::{Layer, Weights};
use super::StepKind;

pub struct CpuBackend {
    store: HostKv,
}

/// What the CPU's layers need of a pass beyond its plan, prepared once.
struct CpuPass<'p, 'a> {
    plan: &'p PassPlan<'a>,
    /// Per rope base: cos and sin, (N, hd/2) each.
    ropes: Vec<(Vec<f32>, Vec<f32>)>,
    /// The decode steps' tokens, for the decode kernel.
    decode: Vec<DecodeQuery<'a>>,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self {
            store: HostKv::empty(),
        }
    }

    /// A new cache of `blocks` blocks; the old one goes first.
    pub fn reserve(&mut self, cfg: &DecoderConfig, blocks: usize) {
        self.store = HostKv::empty();
        self.store = HostKv::new(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, blocks);
    }

    pub fn store(&self) -> &HostKv {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut HostKv {
        &mut self.store
    }

    /// Bytes of one cached value (f16).
    pub fn value_bytes(&self) -> usize {
        2
    }

    /// The pass through every layer; returns the hidden state of each step's last token, (B, d).
    pub fn forward(
        &mut self,
        plan: &PassPlan<'_>,
        w: &Weights,
        cfg: &DecoderConfig,
        profile: &mut Profile,
    ) -> Result<Tensor> {
        let dev = &Device::Cpu;
        let pass = CpuPass {
            plan,
            ropes: w
                .rope_bases
                .iter()
                .map(|&base| plan.rope_angles(cfg.head_dim, base))
                .collect(),
            decode: plan.decode_queries(),
        };
        let mut x = w.embed(&plan.ids, cfg, dev)?;
        let last_rows = plan.logit_rows();
        profile.mark(dev, "prepare, embed");
        // Each residual add comes with the norm that follows it (one fused pass): the input of
        // the next layer's attention, normalised, waits here.
        let mut normed: Option<Tensor> = None;
        for (l, layer) in w.layers.iter().enumerate() {
            let xn = match normed.take() {
                Some(xn) => xn,
                None => candle_nn::ops::rms_norm(&x, &layer.attn_norm, cfg.rms_eps)?,
            };
            let y = self.attention(l, layer, &xn, &pass, cfg, profile)?;
            let mut o = layer.wo.forward(&y)?;
            if let Some(w) = &layer.post_attn_norm {
                o = candle_nn::ops::rms_norm(&o, w, cfg.rms_eps)?;
            }
            let xn;
            (x, xn) = ops::add_rms_norm(&x, &o, &layer.ffn_norm, cfg.rms_eps)?;
            profile.mark(dev, "attn out, add, norm");
            let [gate, up]: [Tensor; 2] = layer
                .gate_up
                .forward(&xn)?
                .try_into()
                .expect("two projections");
            profile.mark(dev, "gate/up");
            let act = match cfg.family.activation() {
                Activation::Silu => ops::silu_mul(&gate, &up)?,
                Activation::GeluTanh => ops::gelu_mul(&gate, &up)?,
            };
            profile.mark(dev, "activation");
            let mut o = layer.w_down.forward(&act)?;
            if let Some(w) = &layer.post_ffn_norm {
                o = candle_nn::ops::rms_norm(&o, w, cfg.rms_eps)?;
            }
            match w.layers.get(l + 1) {
                Some(next) => {
                    let xn;
                    (x, xn) = ops::add_rms_norm(&x, &o, &next.attn_norm, cfg.rms_eps)?;
                    normed = Some(xn);
                }
                None => x = (x + o)?,
            }
            profile.mark(dev, "down, add, norm");
        }
        Ok(match last_rows {
            Some(rows) => x.index_select(&Tensor::new(rows.as_slice(), dev)?, 0)?,
            None => x,
        })
    }

    /// Layer `l`'s attention block up to the output projection: q/k/v, rope, the cache
    /// write, attention. xn: (N, d) normalised. Returns (N, h*hd).
    fn attention(
        &mut self,
        l: usize,
        layer: &Layer,
        xn: &Tensor,
        pass: &CpuPass<'_, '_>,
        cfg: &DecoderConfig,
        profile: &mut Profile,
    ) -> Result<Tensor> {
        let dev = &Device::Cpu;
        let plan = pass.plan;
        let (n, h, kv, hd) = (plan.tokens(), cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let [mut q, mut k, mut v]: [Tensor; 3] = layer
            .qkv
            .forward(xn)?
            .try_into()
            .expect("three projections");
        if let Some([bq, bk, bv]) = &layer.qkv_bias {
            q = q.broadcast_add(bq)?;
            k = k.broadcast_add(bk)?;
            v = v.broadcast_add(bv)?;
        }
        profile.mark(dev, "q/k/v");
        // Token-major all the way: (N, heads, hd) is what the projections give and what the
        // attention kernels and the cache take.
        let (mut q, mut k) = (q.reshape((n, h, hd))?, k.reshape((n, kv, hd))?);
        if let Some((qn, kn)) = &layer.qk_norm {
            q = candle_nn::ops::rms_norm(&q, qn, cfg.rms_eps)?;
            k = candle_nn::ops::rms_norm(&k, kn, cfg.rms_eps)?;
        }
        let (cos, sin) = &pass.ropes[layer.rope];
        let interleaved = matches!(cfg.family.rope(), Rope::Interleaved);
        let q = ops::rope(&q, cos, sin, interleaved)?;
        let k = ops::rope(&k, cos, sin, interleaved)?.reshape((n, kv * hd))?;
        profile.mark(dev, "rope");
        self.store.write(l, &k, &v, &plan.slots)?;
        profile.mark(dev, "kv write");

        let (k_pool, v_pool) = self.store.layer(l);
        let scale = cfg.attn_scale as f32;
        let view = layer.view;
        let decoded = (!pass.decode.is_empty())
            .then(|| decode_attention(&q, k_pool, v_pool, &pass.decode, view, cfg, scale))
            .transpose()?;
        let y = match decoded {
            Some(y) if pass.decode.len() == n => y, // every token: (N, h*hd)
            _ => {
                // Steps in order: prompt chunks through the prefill kernel, decode steps from
                // the decode kernel's rows.
                let mut parts = Vec::with_capacity(plan.steps.len());
                let mut decode_rows = 0;
                for step in &plan.steps {
                    if step.kind == StepKind::Decode {
                        let d = decoded.as_ref().expect("a CPU decode step");
                        parts.push(d.narrow(0, decode_rows, step.len)?);
                        decode_rows += step.len;
                    } else {
                        let window = plan.windows[view];
                        parts.push(prefill_attention(
                            &q, step, window, k_pool, v_pool, cfg, scale,
                        )?);
                    }
                }
                Tensor::cat(&parts, 0)?
            }
        };
        profile.mark(dev, "attention");
        Ok(y)
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// A step's T queries (its rows of q: (N, h, hd)) against its sequence's pages, causal, within
/// `window` positions if given. Returns (T, h*hd).
fn prefill_attention(
    q: &Tensor,
    step: &StepPlan<'_>,
    window: Option<usize>,
    k: &[half::f16],
    v: &[half::f16],
    cfg: &DecoderConfig,
    scale: f32,
) -> Result<Tensor> {
    let width = cfg.n_head * cfg.head_dim;
    let t = step.len;
    let y = ops::with_f32(q, |q| {
        attention::causal_prefill_attention(
            &q[step.at * width..][..t * width],
            step.blocks,
            step.pos,
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

/// Each decode query (a token of a decode step) against its sequence's pages, keys from its
/// first visible position under window `view`. q: (N, h, hd). Returns (queries, h*hd).
fn decode_attention(
    q: &Tensor,
    k: &[half::f16],
    v: &[half::f16],
    queries: &[DecodeQuery<'_>],
    view: usize,
    cfg: &DecoderConfig,
    scale: f32,
) -> Result<Tensor> {
    let width = cfg.n_head * cfg.head_dim;
    let y = ops::with_f32(q, |q| {
        let seqs: Vec<attention::PagedQuery<'_>> = queries
            .iter()
            .map(|d| attention::PagedQuery {
                q: &q[d.row * width..(d.row + 1) * width],
                blocks: d.blocks,
                len: d.end,
                from: d.lo[view],
            })
            .collect();
        attention::paged_decode_attention(
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
    Ok(Tensor::from_vec(y, (queries.len(), width), &Device::Cpu)?)
}
