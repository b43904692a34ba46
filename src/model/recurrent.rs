//! Recurrent token mixers, the layers of hybrid models that keep a state per sequence instead
//! of keys and values ([`super::state`]): LFM2's gated short convolution and Qwen3.5's Gated
//! DeltaNet. Their products run on the backend like any other; the recurrences themselves run
//! on the host in f32, token by token in each sequence's order, for prompts and replies alike.
//! So a token's state and output are the same bits however its tokens were batched, chunked or
//! checked, and a rollback replays exactly what the pass computed ([`replay`]).
//!
//! (A prompt's DeltaNet could run in chunks, as llama.cpp's graph does: the same sums in
//! another order, so not the same bits as a reply token by token. The recurrence costs a
//! head k_dim·v_dim multiply-adds four times a token, a few percent of a layer's products.)

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

use super::config::{DecoderConfig, Mixer};
use super::plan::PassPlan;
use super::state::SeqState;
use super::weights::{MixerWeights, Reader, ShortConvWeights};

/// Layer `p`'s short convolution block (`taps`: the convolution's length, `shortconv.l_cache`).
pub(super) fn load_short_conv(
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
    let conv = host_table(r, &format!("{p}.shortconv.conv.weight"), d, taps)?;
    Ok(ShortConvWeights {
        in_proj,
        conv,
        out_proj,
    })
}

/// A (rows, cols) tensor's values on the host, row by row.
pub(super) fn host_table(r: &Reader<'_>, n: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
    let t = r
        .table_if(n, rows, cols, super::config::Need::Required)?
        .expect("a required tensor");
    Ok(t.to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?)
}

/// One token through a causal convolution: `out[c]` = the sum over the last `taps` inputs of
/// channel c (the `taps - 1` in `state`, oldest first, then `input`) times their weights
/// (`w`: per channel, its taps oldest first), summed oldest first as ggml's `ssm_conv` sums;
/// then `input` joins the state and its oldest row leaves.
pub(super) fn conv_step(w: &[f32], taps: usize, state: &mut [f32], input: &[f32], out: &mut [f32]) {
    let ch = input.len();
    for c in 0..ch {
        let wc = &w[c * taps..(c + 1) * taps];
        let mut sum = 0f32;
        for (i, &wi) in wc[..taps - 1].iter().enumerate() {
            sum += state[i * ch + c] * wi;
        }
        out[c] = sum + input[c] * wc[taps - 1];
    }
    if taps > 1 {
        state.copy_within(ch.., 0);
        let last = state.len() - ch;
        state[last..].copy_from_slice(input);
    }
}

/// The rows of a (N, w) tensor on the host.
pub(super) fn host_rows(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?)
}

/// Layer `l`'s short convolution over a pass: xn (N, d) normalised. Each step's tokens in
/// order through its sequence's state. Returns (N, d).
pub fn short_conv(
    w: &ShortConvWeights,
    taps: usize,
    l: usize,
    xn: &Tensor,
    plan: &PassPlan<'_>,
    states: &mut [&mut SeqState],
) -> Result<Tensor> {
    let (n, d) = xn.dims2()?;
    let bcx = host_rows(&w.in_proj.forward(xn)?)?;
    let mut y = vec![0f32; n * d];
    let mut bx = vec![0f32; d];
    for (step, st) in plan.steps.iter().zip(states.iter_mut()) {
        for t in step.at..step.at + step.len {
            let row = &bcx[t * 3 * d..(t + 1) * 3 * d];
            let (b, c, x) = (&row[..d], &row[d..2 * d], &row[2 * d..]);
            for ((o, b), x) in bx.iter_mut().zip(b).zip(x) {
                *o = b * x;
            }
            st.record(l, &bx);
            let out = &mut y[t * d..(t + 1) * d];
            conv_step(&w.conv, taps, &mut st.layers[l], &bx, out);
            if st.snaps_after(step.pos + t - step.at) {
                st.snap[l] = st.layers[l].clone();
            }
            for (o, c) in out.iter_mut().zip(c) {
                *o *= c;
            }
        }
    }
    let y = Tensor::from_vec(y, (n, d), xn.device())?.to_dtype(xn.dtype())?;
    w.out_proj.forward(&y)
}

/// Fold one logged input (what the pass recorded for a token) into layer state `state`, as
/// the pass did: the rollback of [`super::state::States::truncate`].
pub fn replay(mixer: &Mixer, w: &MixerWeights, eps: f32, state: &mut [f32], input: &[f32]) {
    match (mixer, w) {
        (Mixer::ShortConv { taps }, MixerWeights::ShortConv(sc)) => {
            let mut out = vec![0f32; input.len()];
            conv_step(&sc.conv, *taps, state, input, &mut out);
        }
        (Mixer::DeltaNet(n), MixerWeights::DeltaNet(dn)) => {
            super::delta_net::replay(n, dn, eps, state, input);
        }
        (Mixer::Mamba2(m), MixerWeights::Mamba2(mw)) => super::mamba2::replay(m, mw, state, input),
        _ => {}
    }
}

/// Refuse what the recurrent layers of `cfg` cannot be: attention-only options, for one.
pub fn check(cfg: &DecoderConfig) -> Result<()> {
    for (l, plan) in cfg.layers.iter().enumerate() {
        if let Mixer::ShortConv { taps } = plan.mixer {
            if taps < 2 {
                bail!(
                    "{}: layer {l}'s short convolution has {taps} taps, expected 2 or more",
                    cfg.arch
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three taps over two channels, token by token, against the sums written out.
    #[test]
    fn a_causal_convolution_sees_its_last_taps_oldest_first() {
        let w = [1.0, 10.0, 100.0, 2.0, 20.0, 200.0];
        let mut state = vec![0f32; 4];
        let mut out = [0f32; 2];
        let xs = [[1.0, 1.0], [2.0, 3.0], [4.0, 5.0]];
        conv_step(&w, 3, &mut state, &xs[0], &mut out);
        assert_eq!(out, [100.0, 200.0]);
        conv_step(&w, 3, &mut state, &xs[1], &mut out);
        assert_eq!(out, [10.0 + 200.0, 20.0 + 600.0]);
        conv_step(&w, 3, &mut state, &xs[2], &mut out);
        assert_eq!(out, [1.0 + 20.0 + 400.0, 2.0 + 60.0 + 1000.0]);
        assert_eq!(state, [2.0, 3.0, 4.0, 5.0]);
    }
}
