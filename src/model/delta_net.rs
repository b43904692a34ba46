//! Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next, as llama.cpp's graph
//! computes it (src/models/qwen35.cpp, qwen3next.cpp, delta-net-base.cpp), token by token.
//!
//! Per token x (normalised): `mixed` = [q | k | v] (one row of `attn_qkv`), the gate z
//! (`attn_gate`), and per value head b and a (`ssm_beta`, `ssm_alpha`; Qwen3-Next's `ssm_ba`
//! holds both, grouped by key head). Then:
//! - a causal convolution over `mixed`'s channels (the last `taps` tokens, no bias), then SiLU;
//! - q and k L2-normalised per key head (x / sqrt(Σx² + eps), eps the RMS norms'), q scaled by
//!   1/sqrt(k_dim);
//! - per value head j (its key head: j mod k_heads for Qwen3.5, whose converter tiles the value
//!   heads; j / (v_heads / k_heads) for Qwen3-Next): beta = sigmoid(b), g = softplus(a + dt) · A
//!   (A = `ssm_a`, already -exp(A_log)); with the state S (v_dim rows of k_dim):
//!   S ← exp(g)·S; delta = (v - S·k)·beta; S ← S + delta ⊗ k; o = S·q;
//! - o RMS-normalised per head (`ssm_norm`, shared by the heads) times SiLU(z), then `ssm_out`.
//!
//! The state a sequence keeps: the convolution's last taps - 1 inputs (token-major), then each
//! value head's S. What a token logs for a rollback: its `mixed`, g and beta.

use anyhow::Result;
use candle_core::{Device, Tensor};

use super::config::{DecoderConfig, DeltaNet};
use super::plan::PassPlan;
use super::scan::{heads_through, silu, softplus};
use super::state::SeqState;
use super::weights::DeltaNetWeights;

/// 8-lane sums (vectorised by the compiler), reduced in one fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// x / sqrt(Σx² + eps), in place.
fn l2_norm(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let s = 1.0 / ((ss as f32) + eps).sqrt();
    for v in x {
        *v *= s;
    }
}

/// One token's update of one value head's state `s` (v_dim rows of k_dim): decay, the delta
/// rule, and the head's output from the updated state.
fn head_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { head_step_avx2(s, q, k, v, g, beta, o) };
        return;
    }
    head_step_body(s, q, k, v, g, beta, o)
}

/// [`head_step`] built for AVX2: the same operations (no fused multiply-adds), the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn head_step_avx2(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    o: &mut [f32],
) {
    head_step_body(s, q, k, v, g, beta, o)
}

#[inline(always)]
fn head_step_body(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    o: &mut [f32],
) {
    let kd = k.len();
    let decay = g.exp();
    for (m, row) in s.chunks_exact_mut(kd).enumerate() {
        for x in row.iter_mut() {
            *x *= decay;
        }
        let delta = (v[m] - dot(row, k)) * beta;
        for (x, &ki) in row.iter_mut().zip(k) {
            *x += ki * delta;
        }
        o[m] = dot(row, q);
    }
}

/// The layout of one token's logged input and of the state.
struct Shape {
    n: DeltaNet,
    ch: usize,
    conv: usize,
}

impl Shape {
    fn new(n: &DeltaNet) -> Self {
        Self {
            n: *n,
            ch: n.conv_channels(),
            conv: n.conv_floats(),
        }
    }

    /// Value head j's key head.
    fn key_head(&self, j: usize) -> usize {
        match self.n.grouped {
            true => j / (self.n.v_heads / self.n.k_heads),
            false => j % self.n.k_heads,
        }
    }

    /// A token's logged input [mixed | g | beta] through the convolution: q, k (normalised, q
    /// scaled) and v, each head after the other, into `qkv`; the conv state moves on.
    fn conv(&self, w: &[f32], conv_state: &mut [f32], input: &[f32], qkv: &mut [f32], eps: f32) {
        super::scan::conv_step(w, self.n.taps, conv_state, &input[..self.ch], qkv);
        self.finish(qkv, eps);
    }

    /// A step's rows (`rows` of `inputs`, `width` each) through the convolution at once: a
    /// token's window is the taps - 1 inputs before it (the state's, then the step's own) and
    /// its own, summed as `conv_step` sums them, so tokens go side by side with the same bits
    /// as one by one. The state moves on to the step's last inputs. Returns the state after
    /// `snap_row`, where that is one of the rows.
    #[allow(clippy::too_many_arguments)]
    fn conv_rows(
        &self,
        w: &[f32],
        conv_state: &mut [f32],
        inputs: &[f32],
        width: usize,
        rows: std::ops::Range<usize>,
        qkv: &mut [f32],
        eps: f32,
        snap_row: Option<usize>,
    ) -> Option<Vec<f32>> {
        use rayon::prelude::*;
        let (ch, taps) = (self.ch, self.n.taps);
        let keep = taps - 1;
        // The state's rows, then the step's inputs: ch values each.
        let mut x = Vec::with_capacity((keep + rows.len()) * ch);
        x.extend_from_slice(conv_state);
        for t in rows.clone() {
            x.extend_from_slice(&inputs[t * width..t * width + ch]);
        }
        qkv[rows.start * ch..rows.end * ch]
            .par_chunks_mut(ch)
            .enumerate()
            .for_each(|(i, out)| {
                for (c, o) in out.iter_mut().enumerate() {
                    let wc = &w[c * taps..(c + 1) * taps];
                    let mut sum = 0f32;
                    for (j, &wj) in wc[..keep].iter().enumerate() {
                        sum += x[(i + j) * ch + c] * wj;
                    }
                    *o = sum + x[(i + keep) * ch + c] * wc[keep];
                }
                self.finish(out, eps);
            });
        let after = |i: usize| x[(i + 1) * ch..(i + 1 + keep) * ch].to_vec();
        let snap = snap_row
            .filter(|r| rows.contains(r))
            .map(|r| after(r - rows.start));
        conv_state.copy_from_slice(&after(rows.len() - 1));
        snap
    }

    /// A token's convolved channels on: SiLU, q and k normed per head, q scaled.
    fn finish(&self, qkv: &mut [f32], eps: f32) {
        let n = &self.n;
        for x in qkv.iter_mut() {
            *x = silu(*x);
        }
        let kw = n.k_heads * n.k_dim;
        let scale = 1.0 / (n.k_dim as f32).sqrt();
        for h in qkv[..2 * kw].chunks_exact_mut(n.k_dim) {
            l2_norm(h, eps);
        }
        for x in &mut qkv[..kw] {
            *x *= scale;
        }
    }
}

/// Layer `l`'s DeltaNet over a pass: xn (N, d) normalised; each step's tokens in order through
/// its sequence's state. Returns (N, d).
pub fn forward(
    w: &DeltaNetWeights,
    n: &DeltaNet,
    l: usize,
    xn: &Tensor,
    cfg: &DecoderConfig,
    plan: &PassPlan<'_>,
    states: &mut [&mut SeqState],
) -> Result<Tensor> {
    let sh = Shape::new(n);
    let (tokens, _) = xn.dims2()?;
    let (ch, nv, vdim, kdim) = (sh.ch, n.v_heads, n.v_dim, n.k_dim);
    let mut parts = Vec::new();
    for (p, post) in w.proj.forward(xn)?.into_iter().zip(&w.proj_post) {
        parts.push(super::scan::host_rows(&post.apply(p)?)?);
    }
    let (mixed, z) = (&parts[0], &parts[1]);
    // Per token: the logged input [mixed | g | beta].
    let width = ch + 2 * nv;
    let mut inputs = vec![0f32; tokens * width];
    for t in 0..tokens {
        let row = &mut inputs[t * width..(t + 1) * width];
        row[..ch].copy_from_slice(&mixed[t * ch..(t + 1) * ch]);
        for j in 0..nv {
            let (b, a) = match n.grouped {
                // ssm_ba: per key head, its heads' b then their a.
                true => {
                    let rf = nv / n.k_heads;
                    let (g, r) = (j / rf, j % rf);
                    let ba = &parts[2][t * 2 * nv..(t + 1) * 2 * nv];
                    (ba[g * 2 * rf + r], ba[g * 2 * rf + rf + r])
                }
                false => (parts[2][t * nv + j], parts[3][t * nv + j]),
            };
            row[ch + j] = softplus(a + w.dt_bias[j]) * w.a[j];
            row[ch + nv + j] = 1.0 / (1.0 + (-b).exp());
        }
    }
    let mut o = vec![0f32; tokens * nv * vdim];
    let mut qkv = vec![0f32; tokens * ch];
    for (step, st) in plan.steps.iter().zip(states.iter_mut()) {
        let rows = step.at..step.at + step.len;
        for t in rows.clone() {
            st.record(l, &inputs[t * width..(t + 1) * width]);
        }
        // Where the step keeps its state (for the prefix cache): after this row.
        let snap_row = rows
            .clone()
            .find(|&t| st.snaps_after(step.pos + t - step.at));
        let (conv_state, heads) = st.layers[l].split_at_mut(sh.conv);
        let (eps, r) = (cfg.norm_eps, rows.clone());
        let conv_snap = sh.conv_rows(
            &w.conv, conv_state, &inputs, width, r, &mut qkv, eps, snap_row,
        );
        let mut snap = conv_snap.unwrap_or_default();
        // Heads side by side, each through the step's tokens in order.
        let kw = n.k_heads * kdim;
        heads_through(
            heads,
            vdim * kdim,
            rows,
            vdim,
            snap_row,
            &mut o,
            &mut snap,
            |j, s, t, out| {
                let kh = sh.key_head(j);
                let x = &qkv[t * ch..(t + 1) * ch];
                let q = &x[kh * kdim..(kh + 1) * kdim];
                let k = &x[kw + kh * kdim..kw + (kh + 1) * kdim];
                let v = &x[2 * kw + j * vdim..2 * kw + (j + 1) * vdim];
                let inp = &inputs[t * width..(t + 1) * width];
                head_step(s, q, k, v, inp[ch + j], inp[ch + nv + j], out);
            },
        );
        if snap_row.is_some() {
            st.snap[l] = snap;
        }
    }
    // The gated norm: each head's output RMS-normalised, times the weights and SiLU(z).
    for (oh, zh) in o.chunks_exact_mut(vdim).zip(z.chunks_exact(vdim)) {
        let ss: f64 = oh.iter().map(|&v| v as f64 * v as f64).sum();
        let scale = 1.0 / ((ss / vdim as f64) as f32 + cfg.norm_eps).sqrt();
        for ((x, &wn), &zv) in oh.iter_mut().zip(&w.norm).zip(zh) {
            *x = (*x * scale) * wn * silu(zv);
        }
    }
    let y = Tensor::from_vec(o, (tokens, nv * vdim), &Device::Cpu)?
        .to_device(xn.device())?
        .to_dtype(xn.dtype())?;
    w.out_post.apply(w.out.forward(&y)?)
}

/// Fold one logged input into a layer's state, as [`forward`] did (outputs discarded).
pub fn replay(n: &DeltaNet, w: &DeltaNetWeights, eps: f32, state: &mut [f32], input: &[f32]) {
    let sh = Shape::new(n);
    let (ch, nv, vdim, kdim) = (sh.ch, n.v_heads, n.v_dim, n.k_dim);
    let (conv_state, heads) = state.split_at_mut(sh.conv);
    let mut qkv = vec![0f32; ch];
    sh.conv(&w.conv, conv_state, input, &mut qkv, eps);
    let kw = n.k_heads * kdim;
    let mut out = vec![0f32; vdim];
    for (j, s) in heads.chunks_exact_mut(vdim * kdim).enumerate() {
        let kh = sh.key_head(j);
        let q = &qkv[kh * kdim..(kh + 1) * kdim];
        let k = &qkv[kw + kh * kdim..kw + (kh + 1) * kdim];
        let v = &qkv[2 * kw + j * vdim..2 * kw + (j + 1) * vdim];
        head_step(s, q, k, v, input[ch + j], input[ch + nv + j], &mut out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The delta rule on one head, against the update written out with k_dim = v_dim = 2.
    #[test]
    fn the_avx2_build_gives_the_portable_bits() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut r = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect()
        };
        // Widths with and without a remainder of 8.
        for kd in [128, 36] {
            let (s0, q, k, v) = (r(kd * kd), r(kd), r(kd), r(kd));
            let (mut a, mut b) = (s0.clone(), s0);
            let (mut oa, mut ob) = (vec![0f32; kd], vec![0f32; kd]);
            head_step(&mut a, &q, &k, &v, -0.3, 0.7, &mut oa);
            head_step_body(&mut b, &q, &k, &v, -0.3, 0.7, &mut ob);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "state, width {kd}");
            assert_eq!(bits(&oa), bits(&ob), "output, width {kd}");
        }
    }

    #[test]
    fn one_head_follows_the_delta_rule() {
        let mut s = vec![1.0, 0.0, 0.0, 1.0]; // rows m, columns i
        let (q, k, v) = ([1.0, 2.0], [0.6, 0.8], [3.0, -1.0]);
        let (g, beta) = ((0.5f32).ln(), 0.5);
        let mut o = [0f32; 2];
        head_step(&mut s, &q, &k, &v, g, beta, &mut o);
        // S = 0.5·I; S·k = (0.3, 0.4); delta = ((3 - 0.3)·0.5, (-1 - 0.4)·0.5) = (1.35, -0.7)
        let want = [0.5 + 0.6 * 1.35, 0.8 * 1.35, 0.6 * -0.7, 0.5 + 0.8 * -0.7];
        for (a, b) in s.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{s:?}");
        }
        let o_want = [want[0] + 2.0 * want[1], want[2] + 2.0 * want[3]];
        assert!((o[0] - o_want[0]).abs() < 1e-6 && (o[1] - o_want[1]).abs() < 1e-6);
    }
}
