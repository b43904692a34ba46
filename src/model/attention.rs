//! Attention of one new token against a sequence's KV cache, fused into one pass over the cache
//! per head: scores, softmax and the weighted sum of values, with no intermediate tensors. The
//! decode step's attention cost grows with the context, so this is what keeps decode fast after
//! a long prompt. (Prefill, many queries at once, goes through candle's matrix multiplies.)
//!
//! Shape legend: h = query heads, kv = key/value heads (h = g * kv; query head i reads kv head
//! i / g), C = cache capacity, L = tokens in the cache, hd = head width.

use rayon::prelude::*;

/// q: (h, hd); k_cache, v_cache: (kv, C, hd) of which the first L rows of each head are filled.
/// Returns (h, hd).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    heads: usize,
    kv_heads: usize,
    capacity: usize,
    len: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let g = heads / kv_heads;
    let mut out = vec![0f32; heads * head_dim];
    out.par_chunks_mut(head_dim).enumerate().for_each(|(i, o)| {
        let j = i / g;
        let q = &q[i * head_dim..(i + 1) * head_dim];
        let base = j * capacity * head_dim;
        let keys = &k_cache[base..base + len * head_dim];
        let values = &v_cache[base..base + len * head_dim];
        let mut scores: Vec<f32> = keys
            .chunks_exact(head_dim)
            .map(|k| dot(q, k) * scale)
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        for (p, v) in scores.iter().zip(values.chunks_exact(head_dim)) {
            let w = p * inv;
            for (o, x) in o.iter_mut().zip(v) {
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

    #[test]
    fn matches_plain_attention_on_ragged_sizes() {
        for &(h, kv, c, l, hd) in &[
            (9, 3, 40, 1, 64),
            (9, 3, 40, 37, 64),
            (4, 1, 10, 10, 12),
            (2, 2, 5, 3, 7),
        ] {
            let q = data(h * hd, 1);
            let k = data(kv * c * hd, 2);
            let v = data(kv * c * hd, 3);
            let scale = 1.0 / (hd as f32).sqrt();
            let got = decode_attention(&q, &k, &v, h, kv, c, l, hd, scale);
            let want = reference(&q, &k, &v, h, kv, c, l, hd, scale);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "h={h} kv={kv} l={l}: {a} vs {b}");
            }
        }
    }
}
