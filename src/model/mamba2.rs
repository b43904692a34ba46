//! Mamba-2, the state-space layer of Granite 4.0-H (and Mamba-2 itself), as llama.cpp's graph
//! computes it (src/models/mamba-base.cpp and ggml's `ssm_conv` / `ssm_scan`), token by token.
//!
//! Per token x (normalised): `ssm_in` gives z (d_inner), xBC (d_inner + 2·groups·d_state) and dt
//! (one per head). Then:
//! - a causal convolution over xBC's channels (the last `taps` tokens), plus its bias, then
//!   SiLU; split into x (heads of head_dim), B and C (a d_state row per group);
//! - per head h (group g = h / (heads / groups)): dt = softplus(dt + dt_bias),
//!   S ← S·exp(dt·A) + dt·(x ⊗ B_g), y = S·C_g + D·x (A = `ssm_a`, already -exp(A_log));
//! - y times SiLU(z), then RMS-normalised per group (`ssm_norm`), then `ssm_out`.
//!
//! The state a sequence keeps: the convolution's last taps - 1 inputs (token-major), then each
//! head's S (head_dim rows of d_state). What a token logs for a rollback: its xBC and dt.

use anyhow::Result;
use candle_core::{Device, Tensor};

use super::config::{DecoderConfig, Mamba2};
use super::plan::PassPlan;
use super::scan::{conv_step, heads_through, host_rows, silu, softplus};
use super::state::SeqState;
use super::weights::Mamba2Weights;

/// A token's logged input [xBC | dt] through the convolution: x, B and C (after the bias and
/// SiLU) into `xbc`; the conv state moves on.
fn conv(m: &Mamba2, w: &Mamba2Weights, conv_state: &mut [f32], input: &[f32], xbc: &mut [f32]) {
    let ch = m.conv_channels();
    conv_step(&w.conv, m.taps, conv_state, &input[..ch], xbc);
    if let Some(b) = &w.conv_bias {
        for (x, b) in xbc.iter_mut().zip(b) {
            *x += b;
        }
    }
    for x in xbc.iter_mut() {
        *x = silu(*x);
    }
}

/// One token through head h's state `s` (head_dim rows of d_state): the update, then
/// y = S·C + D·x into `y` (head_dim).
fn head_step(
    m: &Mamba2,
    w: &Mamba2Weights,
    h: usize,
    s: &mut [f32],
    xbc: &[f32],
    dt: f32,
    y: &mut [f32],
) {
    let (hd, ds) = (m.d_inner / m.heads, m.d_state);
    let g = h / (m.heads / m.groups);
    let x = &xbc[h * hd..(h + 1) * hd];
    let b = &xbc[m.d_inner + g * ds..m.d_inner + (g + 1) * ds];
    let c0 = m.d_inner + m.groups * ds;
    let c = &xbc[c0 + g * ds..c0 + (g + 1) * ds];
    let decay = (dt * w.a[h]).exp();
    for (p, row) in s.chunks_exact_mut(ds).enumerate() {
        let x_dt = x[p] * dt;
        let mut acc = 0f32;
        for ((sv, &bn), &cn) in row.iter_mut().zip(b).zip(c) {
            *sv = *sv * decay + bn * x_dt;
            acc += *sv * cn;
        }
        y[p] = acc + x[p] * w.d[h];
    }
}

/// Layer `l`'s Mamba-2 over a pass: xn (N, d) normalised; each step's tokens in order through
/// its sequence's state. Returns (N, d).
pub fn forward(
    w: &Mamba2Weights,
    m: &Mamba2,
    l: usize,
    xn: &Tensor,
    cfg: &DecoderConfig,
    plan: &PassPlan<'_>,
    states: &mut [&mut SeqState],
) -> Result<Tensor> {
    let (tokens, _) = xn.dims2()?;
    let (di, ch, nh) = (m.d_inner, m.conv_channels(), m.heads);
    let hd = di / nh;
    let proj = host_rows(&w.in_post.apply(w.in_proj.forward(xn)?)?)?;
    let width = di + ch + nh;
    // Per token, the logged input [xBC | dt after softplus].
    let mut inputs = vec![0f32; tokens * (ch + nh)];
    for t in 0..tokens {
        let row = &proj[t * width..(t + 1) * width];
        let inp = &mut inputs[t * (ch + nh)..(t + 1) * (ch + nh)];
        inp[..ch].copy_from_slice(&row[di..di + ch]);
        for h in 0..nh {
            inp[ch + h] = softplus(row[di + ch + h] + w.dt_bias[h]);
        }
    }
    let mut y = vec![0f32; tokens * di];
    let mut xbc = vec![0f32; tokens * ch];
    let conv_floats = (m.taps - 1) * ch;
    for (step, st) in plan.steps.iter().zip(states.iter_mut()) {
        let rows = step.at..step.at + step.len;
        let snap_row = rows
            .clone()
            .find(|&t| st.snaps_after(step.pos + t - step.at));
        for t in rows.clone() {
            st.record(l, &inputs[t * (ch + nh)..(t + 1) * (ch + nh)]);
        }
        let mut snap = Vec::new();
        let (conv_state, heads) = st.layers[l].split_at_mut(conv_floats);
        for t in rows.clone() {
            let inp = &inputs[t * (ch + nh)..(t + 1) * (ch + nh)];
            conv(m, w, conv_state, inp, &mut xbc[t * ch..(t + 1) * ch]);
            if Some(t) == snap_row {
                snap.extend_from_slice(conv_state);
            }
        }
        heads_through(
            heads,
            hd * m.d_state,
            rows,
            hd,
            snap_row,
            &mut y,
            &mut snap,
            |h, s, t, out| {
                let dt = inputs[t * (ch + nh) + ch + h];
                head_step(m, w, h, s, &xbc[t * ch..(t + 1) * ch], dt, out);
            },
        );
        if snap_row.is_some() {
            st.snap[l] = snap;
        }
    }
    // Gated by SiLU(z), then RMS-normalised per group.
    let gs = di / m.groups;
    for t in 0..tokens {
        let z = &proj[t * width..t * width + di];
        let yt = &mut y[t * di..(t + 1) * di];
        for (v, &zv) in yt.iter_mut().zip(z) {
            *v *= silu(zv);
        }
        for (seg, wn) in yt.chunks_exact_mut(gs).zip(w.norm.chunks_exact(gs)) {
            let ss: f64 = seg.iter().map(|&v| v as f64 * v as f64).sum();
            let scale = 1.0 / ((ss / gs as f64) as f32 + cfg.norm_eps).sqrt();
            for (v, &wv) in seg.iter_mut().zip(wn) {
                *v = (*v * scale) * wv;
            }
        }
    }
    let y = Tensor::from_vec(y, (tokens, di), &Device::Cpu)?
        .to_device(xn.device())?
        .to_dtype(xn.dtype())?;
    w.out_post.apply(w.out.forward(&y)?)
}

/// Fold one logged input into a layer's state, as [`forward`] did (outputs discarded).
pub fn replay(m: &Mamba2, w: &Mamba2Weights, state: &mut [f32], input: &[f32]) {
    let ch = m.conv_channels();
    let hd = m.d_inner / m.heads;
    let (conv_state, heads) = state.split_at_mut((m.taps - 1) * ch);
    let mut xbc = vec![0f32; ch];
    conv(m, w, conv_state, input, &mut xbc);
    let mut y = vec![0f32; hd];
    for (h, s) in heads.chunks_exact_mut(hd * m.d_state).enumerate() {
        head_step(m, w, h, s, &xbc, input[ch + h], &mut y);
    }
}
