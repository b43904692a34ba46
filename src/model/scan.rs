//! The arithmetic the recurrent mixers share ([`super::recurrent`], [`super::delta_net`],
//! [`super::mamba2`]): a causal convolution's step, each head's state through a step's tokens
//! side by side, and a tensor's rows on the host.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

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

pub(super) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// ggml's softplus: linear above 20.
pub(super) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// A step's rows through each head's state, heads side by side, each head's tokens in order:
/// `head(h, state, row, out)` folds row `row` into head h's state (`head_floats` of `heads`)
/// and writes its `width` outputs, which land in `o` laid out (row, head, width). Where
/// `snap_row` is one of the rows, each head's state after it is appended to `snap`.
#[allow(clippy::too_many_arguments)]
pub(super) fn heads_through(
    heads: &mut [f32],
    head_floats: usize,
    rows: std::ops::Range<usize>,
    width: usize,
    snap_row: Option<usize>,
    o: &mut [f32],
    snap: &mut Vec<f32>,
    head: impl Fn(usize, &mut [f32], usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    let n_heads = heads.len() / head_floats;
    let outs: Vec<(Vec<f32>, Vec<f32>)> = heads
        .par_chunks_exact_mut(head_floats)
        .enumerate()
        .map(|(h, s)| {
            let mut out = vec![0f32; rows.len() * width];
            let mut kept = Vec::new();
            for (i, t) in rows.clone().enumerate() {
                head(h, s, t, &mut out[i * width..(i + 1) * width]);
                if Some(t) == snap_row {
                    kept = s.to_vec();
                }
            }
            (out, kept)
        })
        .collect();
    for (h, (out, kept)) in outs.iter().enumerate() {
        snap.extend_from_slice(kept);
        for (i, t) in rows.clone().enumerate() {
            let at = (t * n_heads + h) * width;
            o[at..at + width].copy_from_slice(&out[i * width..(i + 1) * width]);
        }
    }
}

/// The rows of a (N, w) tensor on the host.
pub(super) fn host_rows(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?)
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
