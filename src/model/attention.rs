//! Attention of one new token against its sequence's pages of the KV cache, fused into one pass
//! over the cache per head: scores, softmax and the weighted sum of values, with no intermediate tensors. The
//! decode step's attention cost grows with the context, so this is what keeps decode fast after
//! a long prompt. (Prefill, many queries at once, goes through candle's matrix multiplies.)
//!
//! Shape legend: h = query heads, kv = key/value heads (h = g * kv; query head i reads kv head
//! i / g), L = tokens in the cache, hd = head width.

use rayon::prelude::*;

/// One step's query token and where its sequence's keys and values are.
pub struct PagedQuery<'a> {
    /// (h, hd)
    pub q: &'a [f32],
    /// Block table: token `p` is in row `blocks[p / block] * block + p % block` of the pools.
    pub blocks: &'a [u32],
    /// Tokens in the cache, the query's own included.
    pub len: usize,
}

/// Every step's query against its own sequence: pools are (P*block, kv*hd). Returns
/// (steps, h*hd). One parallel region for the whole batch, over (step, head) pairs.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    steps: &[PagedQuery<'_>],
    k_pool: &[f32],
    v_pool: &[f32],
    block: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let g = heads / kv_heads;
    let row = kv_heads * head_dim;
    let mut out = vec![0f32; steps.len() * heads * head_dim];
    out.par_chunks_mut(head_dim).enumerate().for_each(|(i, o)| {
        let (step, head) = (&steps[i / heads], i % heads);
        let q = &step.q[head * head_dim..(head + 1) * head_dim];
        let col = head / g * head_dim;
        // Cache row of token p, then this head's hd values in it.
        let at = |p: usize| (step.blocks[p / block] as usize * block + p % block) * row + col;
        let mut scores: Vec<f32> = (0..step.len)
            .map(|p| dot(q, &k_pool[at(p)..at(p) + head_dim]) * scale)
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        for (p, w) in scores.iter().enumerate() {
            let w = w * inv;
            for (o, x) in o.iter_mut().zip(&v_pool[at(p)..at(p) + head_dim]) {
                *o += w * x;
            }
        }
    });
    out
}

/// Dot product in 8 independent lanes, so the compiler can keep them in one vector register.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Plain attention in f64, one head at a time.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        h: usize,
        kv: usize,
        c: usize,
        l: usize,
        hd: usize,
        scale: f32,
    ) -> Vec<f32> {
        let g = h / kv;
        let mut out = vec![0f32; h * hd];
        for i in 0..h {
            let j = i / g;
            let s: Vec<f64> = (0..l)
                .map(|t| {
                    (0..hd)
                        .map(|d| q[i * hd + d] as f64 * k[(j * c + t) * hd + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                out[i * hd + d] = (0..l)
                    .map(|t| e[t] / z * v[(j * c + t) * hd + d] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// Lay a contiguous (kv, L, hd) cache out in scattered blocks of `block` rows.
    fn paged(
        cache: &[f32],
        kv: usize,
        l: usize,
        hd: usize,
        block: usize,
        blocks: &[u32],
    ) -> Vec<f32> {
        let pool_rows = (*blocks.iter().max().unwrap() as usize + 1) * block;
        let mut pool = data(pool_rows * kv * hd, 77); // junk where no token lives
        for p in 0..l {
            let r = blocks[p / block] as usize * block + p % block;
            for j in 0..kv {
                let src = &cache[(j * l + p) * hd..(j * l + p + 1) * hd];
                pool[(r * kv + j) * hd..(r * kv + j + 1) * hd].copy_from_slice(src);
            }
        }
        pool
    }

    #[test]
    fn matches_plain_attention_on_ragged_sizes() {
        for &(h, kv, l, hd, block) in &[
            (9, 3, 1, 64, 16),
            (9, 3, 37, 64, 16),
            (4, 1, 10, 12, 4),
            (2, 2, 3, 7, 2),
        ] {
            let k = data(kv * l * hd, 2);
            let v = data(kv * l * hd, 3);
            // Blocks out of order, as a pool hands them out after churn.
            let n_blocks = l.div_ceil(block);
            let blocks: Vec<u32> = (0..n_blocks as u32)
                .map(|b| (b * 5 + 3) % (n_blocks as u32 * 2 + 1))
                .collect();
            let (kp, vp) = (
                paged(&k, kv, l, hd, block, &blocks),
                paged(&v, kv, l, hd, block, &blocks),
            );
            let scale = 1.0 / (hd as f32).sqrt();
            // Two steps of one batch: different queries, different lengths, same pages.
            let (q1, q2) = (data(h * hd, 1), data(h * hd, 9));
            let steps = [
                PagedQuery {
                    q: &q1,
                    blocks: &blocks,
                    len: l,
                },
                PagedQuery {
                    q: &q2,
                    blocks: &blocks,
                    len: l.div_ceil(2),
                },
            ];
            let got = paged_decode_attention(&steps, &kp, &vp, block, h, kv, hd, scale);
            let want1 = reference(&q1, &k, &v, h, kv, l, l, hd, scale);
            let want2 = reference(&q2, &k, &v, h, kv, l, l.div_ceil(2), hd, scale);
            for (a, b) in got.iter().zip(want1.iter().chain(&want2)) {
                assert!((a - b).abs() < 1e-5, "h={h} kv={kv} l={l}: {a} vs {b}");
            }
        }
    }
}
