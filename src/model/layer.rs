//! A decoder's layers, written once for every architecture and both backends: what
//! [`DecoderConfig`] says the layer does (norms before and after, parallel or sequential
//! blocks, per-tensor scales and biases, q/k clamps and norms, rope on the layers that have
//! it, Mistral 3's attention temperature, gated or plain FFNs, residual scales), around the
//! three things a backend does its own way ([`LayerOps`]): rotary embeddings, attention over
//! its cache, and the fused element-wise steps of gen's CPU kernels.
//!
//! Shapes: N tokens of a pass, d = embedding width, h / kv = query / key-value heads, hd =
//! head width.

use anyhow::Result;
use candle_core::{Device, Tensor, D};

use super::config::{Activation, DecoderConfig, Mixer, NormKind, NormRule, QkNorm};
use super::plan::PassPlan;
use super::profile::Profile;
use super::state::SeqState;
use super::weights::{AttnWeights, Ffn, Layer, MixerWeights, Mlp, Moe, Norm, Weights};

/// What a backend brings to a pass.
pub trait LayerOps {
    fn device(&self) -> &Device;

    /// x (N, heads, hd), each token's heads turned by rotary embedding `rope` (an index into
    /// the configuration's ropes).
    fn rope(&self, x: &Tensor, rope: usize) -> Result<Tensor>;

    /// Layer `l` (of the shape its plan gives): write k and v (N, kv*hd) into the cache
    /// (None: the layer reads another layer's, [`DecoderConfig::cache_layer`]), then attend
    /// with q (N, h, hd) over what window `view` lets each token see, each head's softmax with
    /// its sink (h values) in the denominator where the layer has them. Returns (N, h*hd).
    fn attend(
        &mut self,
        l: usize,
        view: usize,
        q: &Tensor,
        kv: Option<(&Tensor, &Tensor)>,
        sinks: Option<&[f32]>,
        profile: &mut Profile,
    ) -> Result<Tensor>;

    /// x + o, and that through an RMS norm of weight `w`.
    fn add_rms_norm(
        &self,
        x: &Tensor,
        o: &Tensor,
        w: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        let x = (x + o)?;
        let n = candle_nn::ops::rms_norm(&x, w, eps)?;
        Ok((x, n))
    }

    /// act(gate) * up (gpt-oss's clamped form: [`swiglu_oai`]).
    fn gated(&self, gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
        match act {
            Activation::SwigluOai => swiglu_oai(gate, up),
            _ => Ok((activation(gate, act)? * up)?),
        }
    }
}

/// gpt-oss's clamped SwiGLU with candle's operations: g = min(gate, limit), u = clamp(up,
/// -limit, limit), g·sigmoid(alpha·g)·(u + 1).
pub fn swiglu_oai(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (alpha, limit) = super::config::SWIGLU_OAI;
    let g = gate.minimum(limit as f64)?;
    let u = up.clamp(-limit as f64, limit as f64)?;
    let s = candle_nn::ops::sigmoid(&(&g * alpha as f64)?)?;
    Ok(((g * s)? * (u + 1.0)?)?)
}

/// act(x) with candle's operations.
pub fn activation(x: &Tensor, act: Activation) -> Result<Tensor> {
    Ok(match act {
        Activation::Silu => candle_nn::ops::silu(x)?,
        Activation::GeluTanh => x.gelu()?,
        Activation::ReluSquared => x.relu()?.sqr()?,
        Activation::SwigluOai => anyhow::bail!("gpt-oss's SwiGLU takes a gate"),
    })
}

/// x through `norm` (over its last dimension) as the configuration's kind of norm.
pub fn norm(x: &Tensor, norm: &Norm, cfg: &DecoderConfig) -> Result<Tensor> {
    let eps = cfg.norm_eps;
    let y = match (cfg.norm, &norm.weight) {
        (NormKind::Rms, Some(w)) if w.rank() == 1 => candle_nn::ops::rms_norm(x, w, eps)?,
        (NormKind::Rms, w) => {
            let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
            let y = x.broadcast_div(&(ms + eps as f64)?.sqrt()?)?;
            match w {
                // Per-head weights (heads, hd) over x (N, heads, hd).
                Some(w) => y.broadcast_mul(w)?,
                None => y,
            }
        }
        (NormKind::Layer, _) => {
            let mean = x.mean_keepdim(D::Minus1)?;
            let xc = x.broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
            let y = xc.broadcast_div(&(var + eps as f64)?.sqrt()?)?;
            match &norm.weight {
                Some(w) => y.broadcast_mul(w)?,
                None => y,
            }
        }
    };
    Ok(match &norm.bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

/// x RMS-normed over its last dimension, without weights.
fn rms_rows(x: &Tensor, eps: f32) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps as f64)?.sqrt()?)?)
}

/// x, or x through `n` where the layer has a norm there.
fn maybe_norm(x: &Tensor, n: Option<&Norm>, cfg: &DecoderConfig) -> Result<Tensor> {
    match n {
        Some(n) => norm(x, n, cfg),
        None => Ok(x.clone()),
    }
}

/// o times the residual scale, where the architecture has one.
fn residual(o: Tensor, cfg: &DecoderConfig) -> Result<Tensor> {
    Ok(match cfg.residual_scale {
        Some(s) => (o * s as f64)?,
        None => o,
    })
}

/// The pass through every layer; returns the hidden state of each step's rows that get
/// logits, (rows, d), before the final norm.
pub fn run(
    ops: &mut impl LayerOps,
    plan: &PassPlan<'_>,
    w: &Weights,
    cfg: &DecoderConfig,
    states: &mut [&mut SeqState],
    profile: &mut Profile,
) -> Result<Tensor> {
    let dev = ops.device().clone();
    let mut x = w.embed(&plan.ids, cfg, &dev)?;
    let last_rows = plan
        .logit_rows()
        .map(|rows| Tensor::new(rows.as_slice(), &dev))
        .transpose()?;
    let temperature = attention_temperature(plan, cfg, &dev)?;
    let per_layer = match &w.per_layer_input {
        Some(p) => Some(per_layer_inputs(p, &x, &plan.ids, cfg)?),
        None => None,
    };
    profile.mark(&dev, "prepare, embed");
    // A residual add comes fused with the norm after it where that is an RMS norm with a
    // weight and nothing in between (gen's CPU kernels do both in one pass): the next
    // layer's attention input, normalised, waits here.
    let mut normed: Option<Tensor> = None;
    for (l, layer) in w.layers.iter().enumerate() {
        let xn = match normed.take() {
            Some(xn) => xn,
            None => maybe_norm(&x, layer.attn_norm.as_ref(), cfg)?,
        };
        let mixed = mix(
            ops,
            l,
            layer,
            &xn,
            cfg,
            temperature.as_ref(),
            plan,
            states,
            profile,
        )?;
        let f = match mixed {
            // A layer without a mixer is its FFN alone, on the layer's one norm.
            None => residual(ffn(ops, layer, &xn, &x, cfg, profile)?, cfg)?,
            Some(mut a) => {
                if let Some(n) = &layer.post_attn_norm {
                    a = norm(&a, n, cfg)?;
                }
                let a = residual(a, cfg)?;
                if matches!(layer.ffn, Ffn::None) {
                    // A layer without an FFN: its mixer's output is what the residual adds.
                    a
                } else if side_by_side(layer, cfg) {
                    // Attention and the FFN read one normalised input (or each its own norm
                    // of x).
                    let fin = match &layer.ffn_norm {
                        Some(n) => norm(&x, n, cfg)?,
                        None => xn,
                    };
                    profile.mark(&dev, "attn out, norm");
                    let o = residual(ffn(ops, layer, &fin, &x, cfg, profile)?, cfg)?;
                    x = (x + a)?;
                    o
                } else {
                    let fin;
                    (x, fin) = add_then_norm(ops, &x, &a, layer.ffn_norm.as_ref(), cfg)?;
                    profile.mark(&dev, "attn out, add, norm");
                    residual(ffn(ops, layer, &fin, &x, cfg, profile)?, cfg)?
                }
            }
        };
        let next = w.layers.get(l + 1).and_then(|n| n.attn_norm.as_ref());
        let tail = layer.per_layer.is_some() || layer.out_scale.is_some();
        match next {
            Some(n) if fusable(n, cfg) && !tail => {
                let xn;
                (x, xn) = add_then_norm(ops, &x, &f, Some(n), cfg)?;
                normed = Some(xn);
            }
            _ => x = (x + f)?,
        }
        if tail {
            x = layer_tail(layer, x, per_layer.as_ref(), l, cfg)?;
        }
        profile.mark(&dev, "down, add, norm");
    }
    Ok(match &last_rows {
        Some(rows) => x.index_select(rows, 0)?,
        None => x,
    })
}

/// Gemma 4's per-layer inputs of a pass, (N, layers, width): each token's row of the second
/// embedding times sqrt(width), plus the projection of its (scaled) embedding x (N, d) times
/// 1/sqrt(d) normed per layer, the sum times 1/sqrt(2).
fn per_layer_inputs(
    p: &super::weights::PerLayerInput,
    x: &Tensor,
    ids: &[u32],
    cfg: &DecoderConfig,
) -> Result<Tensor> {
    let (n, d) = x.dims2()?;
    let (layers, width) = (cfg.n_layer, p.width);
    let ids = Tensor::new(ids, x.device())?;
    let rows = (p.table.embedding(&ids)?.to_dtype(x.dtype())? * (width as f64).sqrt())?;
    let proj = (p.proj.forward(x)? * (1.0 / (d as f64).sqrt()))?;
    let proj = norm(&proj.reshape((n, layers, width))?, &p.norm, cfg)?;
    Ok(((proj + rows.reshape((n, layers, width))?)? * std::f64::consts::FRAC_1_SQRT_2)?)
}

/// What follows a layer's residual add where the family has it: Gemma 4's per-layer input
/// (x + post_norm(proj(gelu(gate x) · input of layer l))), then the layer's output factor.
fn layer_tail(
    layer: &Layer,
    mut x: Tensor,
    inputs: Option<&Tensor>,
    l: usize,
    cfg: &DecoderConfig,
) -> Result<Tensor> {
    if let (Some(g), Some(inputs)) = (&layer.per_layer, inputs) {
        let t = g.gate.forward(&x)?.gelu()?;
        let t = (t * inputs.narrow(1, l, 1)?.squeeze(1)?)?;
        let t = norm(&g.proj.forward(&t)?, &g.post_norm, cfg)?;
        x = (x + t)?;
    }
    if let Some(s) = layer.out_scale {
        x = (x * s as f64)?;
    }
    Ok(x)
}

/// Layer `l`'s token mixer over xn (N, d) normalised: attention, or a recurrence through each
/// step's state. Returns (N, d), or None for a layer without a mixer.
#[allow(clippy::too_many_arguments)]
fn mix(
    ops: &mut impl LayerOps,
    l: usize,
    layer: &Layer,
    xn: &Tensor,
    cfg: &DecoderConfig,
    temperature: Option<&Tensor>,
    plan: &PassPlan<'_>,
    states: &mut [&mut SeqState],
    profile: &mut Profile,
) -> Result<Option<Tensor>> {
    let dev = ops.device().clone();
    Ok(Some(match &layer.mixer {
        MixerWeights::None => return Ok(None),
        MixerWeights::Attention(at) => {
            attention(ops, l, layer.view, at, xn, cfg, temperature, profile)?
        }
        MixerWeights::ShortConv(sc) => {
            let Mixer::ShortConv { taps } = cfg.layers[l].mixer else {
                unreachable!("weights loaded for the layer's plan")
            };
            let a = super::recurrent::short_conv(sc, taps, l, xn, plan, states)?;
            profile.mark(&dev, "short conv");
            a
        }
        MixerWeights::Mamba2(mw) => {
            let Mixer::Mamba2(m) = cfg.layers[l].mixer else {
                unreachable!("weights loaded for the layer's plan")
            };
            let a = super::mamba2::forward(mw, &m, l, xn, cfg, plan, states)?;
            profile.mark(&dev, "mamba2");
            a
        }
        MixerWeights::DeltaNet(dn) => {
            let Mixer::DeltaNet(n) = cfg.layers[l].mixer else {
                unreachable!("weights loaded for the layer's plan")
            };
            let a = super::delta_net::forward(dn, &n, l, xn, cfg, plan, states)?;
            profile.mark(&dev, "delta net");
            a
        }
    }))
}

/// Whether attention and the FFN run side by side in this layer: where the architecture says
/// so, or where its FFN norm is optional and the layer has none (StableLM).
fn side_by_side(layer: &Layer, cfg: &DecoderConfig) -> bool {
    cfg.parallel
        || (layer.ffn_norm.is_none()
            && matches!(cfg.tensors.ffn_norm, NormRule::WeightedIfPresent { .. }))
}

/// Whether a residual add and norm `n` can run as one fused step.
fn fusable(n: &Norm, cfg: &DecoderConfig) -> bool {
    cfg.norm == NormKind::Rms && n.weight.is_some() && n.bias.is_none()
}

/// x + o, and that through `n` (or as is, where there is no norm).
fn add_then_norm(
    ops: &impl LayerOps,
    x: &Tensor,
    o: &Tensor,
    n: Option<&Norm>,
    cfg: &DecoderConfig,
) -> Result<(Tensor, Tensor)> {
    match n {
        Some(n) if fusable(n, cfg) => {
            let w = n.weight.as_ref().expect("a fusable norm has a weight");
            ops.add_rms_norm(x, o, w, cfg.norm_eps)
        }
        _ => {
            let x = (x + o)?;
            let xn = maybe_norm(&x, n, cfg)?;
            Ok((x, xn))
        }
    }
}

/// Mistral 3's per-token factor on q, (N, 1, 1), where the architecture has one.
fn attention_temperature(
    plan: &PassPlan<'_>,
    cfg: &DecoderConfig,
    dev: &Device,
) -> Result<Option<Tensor>> {
    let Some((scale, floor_scale, offset)) = cfg.attn.temperature else {
        return Ok(None);
    };
    let f: Vec<f32> = plan
        .positions
        .iter()
        .map(|&p| ((p as f32 + offset) / floor_scale).floor().ln_1p() * scale + 1.0)
        .collect();
    let n = f.len();
    Ok(Some(Tensor::from_vec(f, (n, 1, 1), dev)?))
}

/// The layer's attention block: q/k/v with their scales and biases, clamps, q/k norms, rope,
/// the backend's attention, the output projection with its scale and bias. xn: (N, d).
/// Returns (N, d).
#[allow(clippy::too_many_arguments)]
fn attention(
    ops: &mut impl LayerOps,
    l: usize,
    view: usize,
    layer: &AttnWeights,
    xn: &Tensor,
    cfg: &DecoderConfig,
    temperature: Option<&Tensor>,
    profile: &mut Profile,
) -> Result<Tensor> {
    let dev = ops.device().clone();
    let shape = cfg.layers[l].heads;
    let (n, h, kv, hd) = (xn.dim(0)?, shape.heads, shape.kv_heads, shape.dim);
    let parts = layer.qkv.forward(xn)?;
    let mut qkv = Vec::with_capacity(3);
    for (part, post) in parts.into_iter().zip(&layer.qkv_post) {
        let mut t = post.apply(part)?;
        if let Some(c) = cfg.attn.clamp {
            t = t.clamp(-c, c)?;
        }
        qkv.push(t);
    }
    // q, k and v; or q and k, v being k as projected (Gemma 4's global layers); or q alone,
    // where the layer reads another layer's cache.
    let mut qkv = qkv.into_iter();
    let mut q = qkv.next().expect("a q projection");
    let (mut k, v) = match (qkv.next(), qkv.next()) {
        _ if cfg.layers[l].kv_from.is_some() => (q.clone(), None),
        (Some(k), Some(v)) => (k, Some(v)),
        (Some(k), None) => (k.clone(), Some(k)),
        _ => (q.clone(), None),
    };
    let own_kv = v.is_some();
    // Qwen3.5's q rows hold each head's query, then its output gate.
    let gate = match cfg.attn.gated_output {
        true => {
            let qg = q.reshape((n, h, 2 * hd))?;
            q = qg.narrow(2, 0, hd)?.contiguous()?.reshape((n, h * hd))?;
            Some(qg.narrow(2, hd, hd)?.contiguous()?.reshape((n, h * hd))?)
        }
        false => None,
    };
    profile.mark(&dev, "q/k/v");
    let qk_norm = |q: Tensor, k: Tensor| -> Result<(Tensor, Tensor)> {
        match &layer.qk_norm {
            Some((qn, kn)) if own_kv => Ok((norm(&q, qn, cfg)?, norm(&k, kn, cfg)?)),
            Some((qn, _)) => Ok((norm(&q, qn, cfg)?, k)),
            None => Ok((q, k)),
        }
    };
    if cfg.attn.qk_norm == QkNorm::Whole {
        (q, k) = qk_norm(q, k)?;
    }
    // Token-major all the way: (N, heads, hd) is what the projections give and what the
    // attention kernels and the cache take.
    // A layer reading another's cache has no k: its q goes through the steps alone.
    let kv = if own_kv { kv } else { h };
    let (mut q, mut k) = (q.reshape((n, h, hd))?, k.reshape((n, kv, hd))?);
    if matches!(
        cfg.attn.qk_norm,
        QkNorm::Heads { after_rope: false } | QkNorm::EachHead
    ) {
        (q, k) = qk_norm(q, k)?;
    }
    if let Some(r) = cfg.layers[l].rope {
        q = ops.rope(&q, r)?;
        if own_kv {
            k = ops.rope(&k, r)?;
        }
    }
    if cfg.attn.qk_norm == (QkNorm::Heads { after_rope: true }) {
        (q, k) = qk_norm(q, k)?;
    }
    if let Some(t) = temperature {
        q = q.broadcast_mul(t)?;
    }
    let k = k.reshape((n, kv * hd))?;
    let v = match (v, cfg.attn.v_norm) {
        (Some(v), true) => {
            Some(rms_rows(&v.reshape((n, kv, hd))?, cfg.norm_eps)?.reshape((n, kv * hd))?)
        }
        (v, _) => v,
    };
    profile.mark(&dev, "rope");
    let kv_pair = v.as_ref().map(|v| (&k, v));
    let mut y = ops.attend(l, view, &q, kv_pair, layer.sinks.as_deref(), profile)?;
    if let Some(g) = gate {
        y = (y * candle_nn::ops::sigmoid(&g)?)?;
    }
    let o = layer.wo.forward(&y)?;
    layer.wo_post.apply(o)
}

/// The FFN (a dense one, or a mixture of experts), then the norm after it where the layer has
/// one. x: (N, d) normalised; raw: the residual it was normalised from. Returns (N, d).
fn ffn(
    ops: &impl LayerOps,
    layer: &Layer,
    x: &Tensor,
    raw: &Tensor,
    cfg: &DecoderConfig,
    profile: &mut Profile,
) -> Result<Tensor> {
    let o = match &layer.ffn {
        Ffn::None => unreachable!("a layer without an FFN does not run one"),
        Ffn::Dense(m) => mlp(ops, m, x, cfg.activation, profile)?,
        Ffn::Moe(m) => match &m.beside {
            Some(b) => {
                let e = experts(
                    ops,
                    m,
                    &norm(raw, &b.experts_in, cfg)?,
                    Some(raw),
                    cfg,
                    profile,
                )?;
                let dense = m.shared.as_ref().expect("a dense FFN beside the experts");
                let y = mlp(ops, dense, x, cfg.activation, profile)?;
                (norm(&e, &b.experts_out, cfg)? + norm(&y, &b.dense_out, cfg)?)?
            }
            None => experts(ops, m, x, None, cfg, profile)?,
        },
    };
    Ok(match &layer.post_ffn_norm {
        Some(n) => norm(&o, n, cfg)?,
        None => o,
    })
}

/// A dense FFN: act(gate) * up (or act(up) without a gate), with their biases and scales,
/// then down. x: (N, d). Returns (N, d).
fn mlp(
    ops: &impl LayerOps,
    m: &Mlp,
    x: &Tensor,
    act: Activation,
    profile: &mut Profile,
) -> Result<Tensor> {
    let dev = ops.device().clone();
    let parts = m.gate_up.forward(x)?;
    let mut parts = parts
        .into_iter()
        .zip(&m.gate_up_post)
        .map(|(p, post)| post.apply(p))
        .collect::<Result<Vec<_>>>()?;
    profile.mark(&dev, "gate/up");
    let act = match parts.len() {
        2 => {
            let up = parts.pop().expect("two parts");
            let gate = parts.pop().expect("two parts");
            ops.gated(&gate, &up, act)?
        }
        _ => activation(&parts[0], act)?,
    };
    profile.mark(&dev, "activation");
    let o = m.w_down.forward(&act)?;
    m.down_post.apply(o)
}

/// A mixture of experts over x (N, d): each token's experts from the router
/// ([`super::moe::route`]), each chosen expert run once over all the tokens that chose it, each
/// token's outputs times their weights summed in the order chosen, then the shared expert's
/// added (gated where the family gates it). The routing and the sums are on the host; the
/// products on the backend. Returns (N, d).
fn experts(
    ops: &impl LayerOps,
    m: &Moe,
    x: &Tensor,
    router_from: Option<&Tensor>,
    cfg: &DecoderConfig,
    profile: &mut Profile,
) -> Result<Tensor> {
    let mc = cfg
        .moe
        .as_ref()
        .expect("a layer with experts has their configuration");
    let (n, d) = x.dims2()?;
    let k = mc.n_used;
    let dev = x.device().clone();
    let xs: Vec<f32> = x
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    // Gemma 4's router reads the residual RMS-normed without weights, times 1/sqrt(d) and
    // its scale.
    let router_in: Option<Vec<f32>> = match (router_from, &m.beside) {
        (Some(raw), Some(b)) => Some(super::moe::gemma4_router_rows(
            &raw.to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1()?,
            &b.router_scale,
            cfg.norm_eps,
        )),
        _ => None,
    };
    // Each token's routing alone (its own order of sums), tokens side by side on the pool.
    let sel: Vec<(u32, f32)> = {
        use rayon::prelude::*;
        let per_token: Vec<Vec<(u32, f32)>> = router_in
            .as_deref()
            .unwrap_or(&xs)
            .par_chunks_exact(d)
            .map(|row| {
                let mut logits = vec![0f32; mc.n_expert];
                super::moe::router_logits(&m.router, row, &mut logits);
                if let Some(b) = &m.router_bias {
                    for (l, b) in logits.iter_mut().zip(b) {
                        *l += b;
                    }
                }
                let mut sel = Vec::with_capacity(k);
                super::moe::route(&logits, mc, m.selection_bias.as_deref(), &mut sel);
                sel
            })
            .collect();
        per_token.concat()
    };
    profile.mark(&dev, "router");
    // Each expert's (token, slot) pairs, tokens in pass order.
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); mc.n_expert];
    for (slot, &(e, _)) in sel.iter().enumerate() {
        by_expert[e as usize].push(slot);
    }
    // On the CPU, experts on gen's kernels run on host slices (super::cpu::moe).
    let act = cfg.activation;
    let host = dev.is_cpu() && m.experts.iter().all(|e| super::cpu::moe::runs(e, act));
    let mut slots = vec![0f32; n * k * d];
    let work: Vec<(usize, Vec<u32>)> = by_expert
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(e, p)| (e, p.iter().map(|&s| (s / k) as u32).collect()))
        .collect();
    let ys: Vec<Vec<f32>> = if host {
        super::cpu::moe::run_all(&m.experts, &work, &xs, d, act)
    } else {
        let mut ys = Vec::with_capacity(work.len());
        for (e, tokens) in &work {
            let ids = Tensor::new(tokens.as_slice(), &dev)?;
            let y = mlp(ops, &m.experts[*e], &x.index_select(&ids, 0)?, act, profile)?;
            ys.push(
                y.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1()?,
            );
        }
        ys
    };
    for ((e, _), y) in work.iter().zip(&ys) {
        for (row, &s) in y.chunks_exact(d).zip(&by_expert[*e]) {
            let w = sel[s].1;
            for (o, v) in slots[s * d..(s + 1) * d].iter_mut().zip(row) {
                *o = v * w;
            }
        }
    }
    let mut out = vec![0f32; n * d];
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        o.copy_from_slice(&slots[t * k * d..(t * k + 1) * d]);
        for j in 1..k {
            let s = &slots[(t * k + j) * d..(t * k + j + 1) * d];
            for (a, b) in o.iter_mut().zip(s) {
                *a += b;
            }
        }
    }
    let mut o = Tensor::from_vec(out, (n, d), &dev)?.to_dtype(x.dtype())?;
    if let Some(sh) = m.shared.as_ref().filter(|_| m.beside.is_none()) {
        let y = mlp(ops, sh, x, cfg.activation, profile)?;
        o = match &m.shared_gate {
            // llama.cpp's silu(g) / g: the sigmoid of g, as its graph computes it.
            Some(g) => {
                let gi: Vec<f32> = xs
                    .chunks_exact(d)
                    .map(|row| row.iter().zip(g).map(|(a, b)| a * b).sum())
                    .collect();
                let gi = Tensor::from_vec(gi, (n, 1), &dev)?;
                let gate = (candle_nn::ops::silu(&gi)? / &gi)?.to_dtype(y.dtype())?;
                (o + y.broadcast_mul(&gate)?)?
            }
            None => (o + y)?,
        };
    }
    Ok(o)
}

/// After the last layer: the final norm, the output layer with its bias, the logit scale
/// and soft cap. x: (B, d). Returns (B, V) f32.
pub fn logits(x: &Tensor, w: &Weights, cfg: &DecoderConfig) -> Result<Tensor> {
    let x = maybe_norm(x, w.out_norm.as_ref(), cfg)?;
    let mut l = w.output.forward(&x)?.to_dtype(candle_core::DType::F32)?;
    if let Some(b) = &w.output_bias {
        l = l.broadcast_add(&b.to_dtype(candle_core::DType::F32)?)?;
    }
    if let Some(s) = cfg.logit_scale {
        l = (l * s as f64)?;
    }
    if let Some(c) = cfg.final_softcap {
        l = ((l / c as f64)?.tanh()? * c as f64)?;
    }
    Ok(l)
}
