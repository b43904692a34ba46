//! The forward pass through candle's operations: what a GPU runs (CUDA, Metal), and what
//! `GEN_ATTENTION=candle` runs on the CPU so tests can check it against gen's CPU kernels. With
//! the `cuda` feature, gen's own CUDA kernels ([`cuda`], `kernels.cu`) take the cache write and
//! one-token attention where GEN_CUDA_KERNELS asks ([`check`]).
//!
//! Activations go heads-first, (1, heads, N, hd), for candle's norms and rope, and back to
//! token-major for the cache. Every input of a pass (gathered key rows, masks, the write plan,
//! rope tables, the rows that get logits) is uploaded before the layers queue any work: a copy
//! from ordinary host memory may wait for the device to finish what is queued.
//!
//! The layer itself is [`super::layer`]'s, shared with the CPU backend; this backend brings its
//! rope (candle's, heads-first) and its attention: the cache write, then the one-token steps
//! of the pass together ([`decode::DeviceDecode`]) and each prompt chunk against its gathered
//! keys with a mask.

pub mod check;
#[cfg(feature = "cuda")]
pub mod cuda;
mod decode;
pub mod kv_store;

use anyhow::Result;
use candle_core::{Device, Tensor};

use self::check::{KernelCheck, KernelMode};
use self::decode::{attention_mask, softcapped, softmax_with_sinks, DeviceDecode, DeviceStep};
use self::kv_store::{DeviceKv, WritePlan};
use super::config::{DecoderConfig, RopePairs};
use super::layer::LayerOps;
use super::plan::PassPlan;
use super::profile::Profile;
use super::weights::Weights;

pub struct DeviceBackend {
    device: Device,
    store: DeviceKv,
    /// gen's CUDA kernels for the cache write and one-token attention.
    kernels: KernelMode,
    check: KernelCheck,
}

/// A prompt chunk's keys, for one kind of layer (window): the cache rows it may see, on the
/// device, and its mask.
struct Chunk {
    rows: Vec<u32>,
    on_device: Tensor,
    mask: Tensor,
}

/// How one step reaches its keys, for one kind of layer.
enum StepKeys {
    /// A prompt chunk.
    Chunk(Chunk),
    /// A one-token step, attended with every other such step of the pass at once
    /// ([`DeviceDecode`]), row `usize` of its output.
    Batched(usize),
}

/// A kind of attention layer: its window (an index into the pass plan's windows), kv heads
/// and query heads.
type ViewKey = (usize, usize, usize);

/// One kind of layer's (one window's) view of the pass.
struct View {
    steps: Vec<StepKeys>,
    decode: Option<DeviceDecode>,
    /// When one-token steps and prompt chunks mix: where each step's rows sit in [batched
    /// output; the chunks' outputs], to put them back in step order.
    order: Option<Tensor>,
}

/// What the layers need of a pass beyond its plan, prepared (and uploaded) once.
struct DevicePass<'p, 'a> {
    plan: &'p PassPlan<'a>,
    cfg: &'p DecoderConfig,
    backend: &'p mut DeviceBackend,
    /// Per kind of layer ([`ViewKey`]), how the pass's steps reach their keys.
    views: Vec<(ViewKey, View)>,
    write: WritePlan,
    /// Per rotary embedding of the configuration: cos and sin, (N, n_rot/2) each.
    ropes: Vec<(Tensor, Tensor)>,
}

impl DeviceBackend {
    pub fn new(device: &Device, cfg: &DecoderConfig) -> Self {
        let kernels = KernelMode::for_device(device, cfg);
        Self {
            device: device.clone(),
            store: DeviceKv::empty(),
            kernels,
            check: KernelCheck::new(kernels == KernelMode::Check),
        }
    }

    /// A new cache of `blocks` blocks; the old one goes first.
    pub fn reserve(&mut self, cfg: &DecoderConfig, blocks: usize) -> Result<()> {
        self.store = DeviceKv::empty();
        self.store = DeviceKv::new(&self.device, &cfg.kv_layout(), blocks)?;
        Ok(())
    }

    pub fn store(&self) -> &DeviceKv {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut DeviceKv {
        &mut self.store
    }

    /// The device, in words (`Cpu`, `Cuda(0)`...).
    pub fn device_name(&self) -> String {
        format!("{:?}", self.device.location())
    }

    /// Bytes of one cached value (f32).
    pub fn value_bytes(&self) -> usize {
        4
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
        let dev = self.device.clone();
        // Each kind of attention layer the model has: its window, kv heads and heads.
        let mut keys: Vec<ViewKey> = Vec::new();
        for (l, layer) in w.layers.iter().enumerate() {
            let h = cfg.layers[l].heads;
            let key = (layer.view, h.kv_heads, h.heads);
            if cfg.layers[l].mixer == super::config::Mixer::Attention && !keys.contains(&key) {
                keys.push(key);
            }
        }
        let views = keys
            .iter()
            .map(|&key| Ok((key, self.view(plan, key)?)))
            .collect::<Result<Vec<_>>>()?;
        let write = self
            .store
            .plan_write(&plan.slots, &dev, self.kernels != KernelMode::Off)?;
        let views = views
            .into_iter()
            .map(|(key, (steps, decode))| -> Result<(ViewKey, View)> {
                let order = step_order(plan, &steps, decode.as_ref(), &dev)?;
                let view = View {
                    steps,
                    decode,
                    order,
                };
                Ok((key, view))
            })
            .collect::<Result<Vec<_>>>()?;
        let ropes = cfg
            .ropes
            .iter()
            .map(|r| {
                let (cos, sin) = r.angles(&plan.positions, w.rope_factors(r));
                let shape = (plan.tokens(), r.n_rot / 2);
                Ok((
                    Tensor::from_vec(cos, shape, &dev)?,
                    Tensor::from_vec(sin, shape, &dev)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut pass = DevicePass {
            plan,
            cfg,
            backend: self,
            views,
            write,
            ropes,
        };
        super::layer::run(&mut pass, plan, w, cfg, states, profile)
    }

    /// How each step of the pass reaches its keys in layers of kind `(v, kv, heads)` (window
    /// `v`): prompt chunks get the cache rows they may see and a mask; one-token steps are
    /// attended together.
    fn view(
        &self,
        plan: &PassPlan<'_>,
        (v, kv, heads): ViewKey,
    ) -> Result<(Vec<StepKeys>, Option<DeviceDecode>)> {
        let dev = &self.device;
        let g = heads / kv;
        let window = plan.windows[v];
        let mut keys = Vec::with_capacity(plan.steps.len());
        let mut batched = Vec::new();
        for step in &plan.steps {
            // candle's path gathers the keys; the kernel reads the block table.
            let rows = if step.len == 1 && self.kernels == KernelMode::On {
                Vec::new()
            } else {
                let slots: Vec<u32> = step.slots(step.keys(v)).collect();
                self.store.rows_for(kv, &slots)
            };
            if step.len == 1 {
                keys.push(StepKeys::Batched(batched.len()));
                batched.push(DeviceStep {
                    at: step.at,
                    table: step.blocks,
                    end: step.end(),
                    lo: step.lo[v],
                    rows,
                });
                continue;
            }
            let on_device = Tensor::new(rows.as_slice(), dev)?;
            let mask = attention_mask(step.len, step.pos, step.lo[v], window, g, dev)?;
            keys.push(StepKeys::Chunk(Chunk {
                rows,
                on_device,
                mask,
            }));
        }
        let n = plan.tokens();
        let decode = (!batched.is_empty())
            .then(|| DeviceDecode::new(n, &batched, kv, self.kernels, dev))
            .transpose()?;
        Ok((keys, decode))
    }
}

impl LayerOps for DevicePass<'_, '_> {
    fn device(&self) -> &Device {
        &self.backend.device
    }

    /// candle's rope, heads-first, on each head's first n_rot values.
    fn rope(&self, x: &Tensor, rope: usize) -> Result<Tensor> {
        let (cos, sin) = &self.ropes[rope];
        let (n, heads, hd) = x.dims3()?;
        let n_rot = 2 * cos.dim(1)?;
        let turned = x
            .narrow(2, 0, n_rot)?
            .transpose(0, 1)?
            .contiguous()?
            .unsqueeze(0)?; // (1, heads, N, n_rot)
        let turned = match self.cfg.rope_pairs {
            RopePairs::Norm => candle_nn::rotary_emb::rope_i(&turned, cos, sin)?,
            RopePairs::Neox => candle_nn::rotary_emb::rope(&turned, cos, sin)?,
        };
        let turned = turned.squeeze(0)?.transpose(0, 1)?; // (N, heads, n_rot)
        let y = match n_rot < hd {
            true => Tensor::cat(&[&turned, &x.narrow(2, n_rot, hd - n_rot)?], 2)?,
            false => turned,
        };
        Ok(y.contiguous()?.reshape((n, heads, hd))?)
    }

    /// The cache write, then attention over the gathered keys.
    fn attend(
        &mut self,
        l: usize,
        view: usize,
        q: &Tensor,
        kv: Option<(&Tensor, &Tensor)>,
        sinks: Option<&[f32]>,
        profile: &mut Profile,
    ) -> Result<Tensor> {
        let b = &mut *self.backend;
        let dev = b.device.clone();
        let (plan, cfg) = (self.plan, self.cfg);
        let shape = cfg.layers[l].heads;
        let (h, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.dim);
        let g = h / kv_heads;
        if let Some((k, v)) = kv {
            b.store.write(l, k, v, &self.write, &b.check)?;
        }
        profile.mark(&dev, "kv write");
        let cache = cfg.cache_layer(l);
        let key = (view, kv_heads, h);
        let Some((_, view)) = self.views.iter().find(|(k, _)| *k == key) else {
            anyhow::bail!("no view of the pass for layer {l}");
        };
        let scale = cfg.attn.scale as f64;
        let softcap = cfg.attn.softcap.map(|c| c as f64);
        let batched = match &view.decode {
            Some(d) => {
                let (k_pool, v_pool) = b.store.layer(cache);
                Some(d.attend(q, k_pool, v_pool, shape, (scale, softcap), sinks, &b.check)?)
            }
            None => None,
        };
        let every_step = view.decode.as_ref().map(|d| d.steps) == Some(plan.steps.len());
        let y = match batched {
            // Every step is a one-token step, in order: (N, h*hd).
            Some(out) if every_step => out,
            batched => {
                let mut parts = Vec::with_capacity(plan.steps.len());
                for (step, keys) in plan.steps.iter().zip(&view.steps) {
                    let StepKeys::Chunk(chunk) = keys else {
                        continue;
                    };
                    let t = step.len;
                    let (keys, values) =
                        b.store
                            .gather(cache, &chunk.rows, Some(&chunk.on_device), &dev)?; // (kv, L, hd)
                                                                                        // Heads sharing a kv head sit next to each other: fold them into the row
                                                                                        // axis so the cache is used as is, never repeated.
                    let qs = q
                        .narrow(0, step.at, t)?
                        .transpose(0, 1)?
                        .contiguous()?
                        .reshape((kv_heads, g * t, hd))?;
                    let att = (qs.matmul(&keys.t()?)? * scale)?; // (kv_heads, g*T, L)
                    let att = softcapped(att, softcap)?;
                    let att = att.broadcast_add(&chunk.mask)?;
                    // Rows (kv, g*T): row r of kv head j is query head j*g + r / T.
                    let att = softmax_with_sinks(&att, sinks, |r| {
                        let (j, r) = (r / (g * t), r % (g * t));
                        j * g + r / t
                    })?;
                    let y = att.matmul(&values)?; // (kv, g*T, hd)
                    parts.push(
                        y.reshape((h, t, hd))?
                            .transpose(0, 1)?
                            .reshape((t, h * hd))?,
                    );
                }
                match (batched, &view.order) {
                    (Some(out), Some(order)) => {
                        parts.insert(0, out);
                        Tensor::cat(&parts, 0)?.index_select(order, 0)?
                    }
                    _ => Tensor::cat(&parts, 0)?,
                }
            }
        };
        profile.mark(&dev, "attention");
        Ok(y)
    }
}

/// Passes mixing batched one-token steps with prompt chunks: where each step's rows sit in
/// [batched output; the chunks' outputs], to put them back in the order of the steps. None
/// when nothing is batched, or everything is.
fn step_order(
    plan: &PassPlan<'_>,
    steps: &[StepKeys],
    decode: Option<&DeviceDecode>,
    dev: &Device,
) -> Result<Option<Tensor>> {
    let Some(d) = decode.filter(|d| d.steps < plan.steps.len()) else {
        return Ok(None);
    };
    let mut order = Vec::with_capacity(plan.tokens());
    let mut part_rows = 0;
    for (step, k) in plan.steps.iter().zip(steps) {
        if let StepKeys::Batched(i) = k {
            order.push(*i as u32);
        } else {
            order.extend((0..step.len).map(|r| (d.steps + part_rows + r) as u32));
            part_rows += step.len;
        }
    }
    Ok(Some(Tensor::new(order.as_slice(), dev)?))
}
