//! Recurrent token mixers, the layers of hybrid models that keep a state per sequence instead
//! of keys and values ([`super::state`]): LFM2's gated short convolution here, Gated DeltaNet
//! ([`super::delta_net`]) and Mamba-2 ([`super::mamba2`]) in their own files, and the rollback
//! that replays any of them. Their products run on the backend like any other; the recurrences run
//! on the host in f32, token by token in each sequence's order, for prompts and replies alike.
//! So a token's state and output are the same bits however its tokens were batched, chunked or
//! checked, and a rollback replays exactly what the pass computed ([`replay`]).
//!
//! (A prompt's DeltaNet could run in chunks, as llama.cpp's graph does: the same sums in
//! another order, so not the same bits as a reply token by token. The recurrence costs a
//! head k_dim·v_dim multiply-adds four times a token, a few percent of a layer's products.)

use anyhow::Result;
use candle_core::Tensor;

use super::config::Mixer;
use super::plan::PassPlan;
use super::scan::{conv_step, host_rows};
use super::state::SeqState;
use super::weights::{MixerWeights, ShortConvWeights};

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
