//! The forward pass on the CPU, through gen's own kernels: quantized matrix products
//! ([`matmul`]), attention reading the f16 paged cache in place ([`attention`], [`kv_store`]),
//! and fused element-wise steps ([`ops`]: rope in the token-major layout, each residual add with
//! the norm after it, silu(gate) * up). Activations stay token-major, (N, heads, hd), from the
//! projections through the cache to attention's output. The layer itself is
//! [`super::layer`]'s, shared with the device backend; this backend brings its rope, its
//! attention (every one-token step of the pass in one call of the decode kernel; each prompt
//! chunk through the causal prefill kernel) and its fused steps.

/// `$body` with the const `$k` set to the count `$n`: each of `$c` (the counts a kernel is
/// instantiated for, in order), and `$last` for any other: kernels take a token or query count
/// as a const generic, each count its own unrolled instance.
macro_rules! const_count {
    ($n:expr, $k:ident => $body:expr; $($c:literal)+; $last:literal) => {
        match $n {
            $($c => {
                const $k: usize = $c;
                $body
            })+
            _ => {
                const $k: usize = $last;
                $body
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_half;
pub mod attention;
#[cfg(target_arch = "x86_64")]
mod bf16_dot;
pub mod buf;
pub mod choice;
pub mod kv_store;
pub mod matmul;
pub mod moe;
pub mod ops;
pub mod q8;
pub mod quants;
#[cfg(target_arch = "x86_64")]
mod quants_x86;
#[cfg(target_arch = "x86_64")]
mod quants_zmm;
pub mod tile_cache;
pub mod wide16;

use anyhow::Result;
use candle_core::{Device, Tensor};

use self::attention::Scoring;
use self::kv_store::HostKv;
use super::config::{Activation, DecoderConfig, HeadShape, RopePairs};
use super::kv_cache::BLOCK_SIZE;
use super::layer::LayerOps;
use super::plan::{DecodeQuery, PassPlan, StepPlan};
use super::profile::Profile;
use super::weights::Weights;
use super::StepKind;

pub struct CpuBackend {
    store: HostKv,
}

/// What the CPU's layers need of a pass beyond its plan, prepared once.
struct CpuPass<'p, 'a> {
    plan: &'p PassPlan<'a>,
    cfg: &'p DecoderConfig,
    store: &'p mut HostKv,
    /// Per rotary embedding of the configuration: cos and sin, (N, n_rot/2) each.
    ropes: Vec<(Vec<f32>, Vec<f32>)>,
    /// The decode steps' tokens, for the decode kernel.
    decode: Vec<DecodeQuery<'a>>,
    device: Device,
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
        self.store = HostKv::new(&cfg.kv_layout(), blocks);
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
        states: &mut [&mut crate::model::state::SeqState],
        profile: &mut Profile,
    ) -> Result<Tensor> {
        let mut pass = CpuPass {
            plan,
            cfg,
            store: &mut self.store,
            ropes: cfg
                .ropes
                .iter()
                .map(|r| r.angles(&plan.positions, w.rope_factors(r)))
                .collect(),
            decode: plan.decode_queries(),
            device: Device::Cpu,
        };
        super::layer::run(&mut pass, plan, w, cfg, states, profile)
    }
}

impl LayerOps for CpuPass<'_, '_> {
    fn device(&self) -> &Device {
        &self.device
    }

    fn rope(&self, x: &Tensor, rope: usize) -> Result<Tensor> {
        let (cos, sin) = &self.ropes[rope];
        ops::rope(x, cos, sin, self.cfg.rope_pairs == RopePairs::Norm)
    }

    fn add_rms_norm(
        &self,
        x: &Tensor,
        o: &Tensor,
        w: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        ops::add_rms_norm(x, o, w, eps)
    }

    fn gated(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        match act {
            Activation::Silu => ops::silu_mul(gate, up),
            Activation::GeluTanh => ops::gelu_mul(gate, up),
            Activation::SwigluOai => ops::swiglu_oai_mul(gate, up),
            other => Ok((super::layer::activation(gate, other)? * up)?),
        }
    }

    /// The cache write, then attention: every one-token step of the pass in one call of the
    /// decode kernel, each prompt chunk through the prefill kernel.
    fn attend(
        &mut self,
        l: usize,
        view: usize,
        q: &Tensor,
        kv: Option<(&Tensor, &Tensor)>,
        sinks: Option<&[f32]>,
        profile: &mut Profile,
    ) -> Result<Tensor> {
        let dev = &Device::Cpu;
        let (plan, cfg) = (self.plan, self.cfg);
        let n = plan.tokens();
        if let Some((k, v)) = kv {
            self.store.write(l, k, v, &plan.slots)?;
        }
        profile.mark(dev, "kv write");
        let (k_pool, v_pool) = self.store.layer(cfg.cache_layer(l));
        let shape = cfg.layers[l].heads;
        let scoring = Scoring {
            scale: cfg.attn.scale,
            softcap: cfg.attn.softcap,
            sinks,
        };
        let decoded = (!self.decode.is_empty())
            .then(|| decode_attention(q, k_pool, v_pool, &self.decode, view, shape, scoring))
            .transpose()?;
        let y = match decoded {
            Some(y) if self.decode.len() == n => y, // every token: (N, h*hd)
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
                            q, step, window, k_pool, v_pool, shape, scoring,
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
    shape: HeadShape,
    scale: Scoring<'_>,
) -> Result<Tensor> {
    let width = shape.heads * shape.dim;
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
            shape.heads,
            shape.kv_heads,
            shape.dim,
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
    shape: HeadShape,
    scale: Scoring<'_>,
) -> Result<Tensor> {
    let width = shape.heads * shape.dim;
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
            shape.heads,
            shape.kv_heads,
            shape.dim,
            scale,
        )
    })?;
    Ok(Tensor::from_vec(y, (queries.len(), width), &Device::Cpu)?)
}
