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
    /// Block table: token `p` is row `p % block` of block `blocks[p / block]` of the pools.
    pub blocks: &'a [u32],
    /// Tokens in the cache, the query's own included.
    pub len: usize,
    /// First position attended: 0, or `len - window` under a sliding window.
    pub from: usize,
}

/// Every step's query against its own sequence: pools are (kv, P, block, hd). Returns
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
    let pool_blocks = k_pool.len() / (kv_heads * block * head_dim).max(1);
    let avx2 = avx2_available();
    let mut out = vec![0f32; steps.len() * heads * head_dim];
    out.par_chunks_mut(head_dim).enumerate().for_each(|(i, o)| {
        let (step, head) = (&steps[i / heads], i % heads);
        let one = OneHead {
            q: &step.q[head * head_dim..(head + 1) * head_dim],
            blocks: step.blocks,
            len: step.len,
            from: step.from,
            block,
            pool_blocks,
            j: head / g,
            scale,
        };
        match avx2 {
            // SAFETY: only when the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            true => unsafe { one.run_avx2(k_pool, v_pool, o) },
            _ => one.run(k_pool, v_pool, o),
        }
    });
    out
}

fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::env::var("GEN_KERNEL").map_or(true, |v| v != "scalar") {
        return is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    }
    false
}

/// One query head against its kv head's cached rows.
struct OneHead<'a> {
    q: &'a [f32],
    blocks: &'a [u32],
    len: usize,
    from: usize,
    block: usize,
    /// Blocks in the pool, and the kv head this query head reads.
    pool_blocks: usize,
    j: usize,
    scale: f32,
}

/// The same loops compiled twice: for any x86-64 (or other) CPU, and with AVX2 and FMA, where
/// the compiler turns the 8-lane loops into 256-bit instructions.
macro_rules! one_head_impl {
    ($name:ident $(, $features:literal)?) => {
        $(#[target_feature(enable = $features)])?
        #[allow(unused_unsafe)]
        unsafe fn $name(&self, k_pool: &[f32], v_pool: &[f32], o: &mut [f32]) {
            let hd = self.q.len();
            let mut scores = Vec::with_capacity(self.len - self.from.min(self.len));
            let mut max = f32::NEG_INFINITY;
            for (b, &id) in self.blocks.iter().enumerate() {
                let first = b * self.block;
                if first >= self.len {
                    break;
                }
                for r in self.from.saturating_sub(first)..(self.len - first).min(self.block) {
                    let at = ((self.j * self.pool_blocks + id as usize) * self.block + r) * hd;
                    let s = dot(self.q, &k_pool[at..at + hd]) * self.scale;
                    max = max.max(s);
                    scores.push(s);
                }
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            let mut p = 0;
            for (b, &id) in self.blocks.iter().enumerate() {
                let first = b * self.block;
                if first >= self.len {
                    break;
                }
                for r in self.from.saturating_sub(first)..(self.len - first).min(self.block) {
                    let at = ((self.j * self.pool_blocks + id as usize) * self.block + r) * hd;
                    let w = scores[p] * inv;
                    p += 1;
                    for (o, x) in o.iter_mut().zip(&v_pool[at..at + hd]) {
                        *o += w * x;
                    }
                }
            }
        }
    };
}

impl OneHead<'_> {
    fn run(&self, k_pool: &[f32], v_pool: &[f32], o: &mut [f32]) {
        // SAFETY: the portable instance needs no CPU features.
        unsafe { self.run_portable(k_pool, v_pool, o) }
    }
    one_head_impl!(run_portable);
    #[cfg(target_arch = "x86_64")]
    one_head_impl!(run_avx2, "avx2,fma");
}

/// Dot product in 8 independent lanes, so the compiler can keep them in one vector register.
#[inline(always)]
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
        let p_blocks = *blocks.iter().max().unwrap() as usize + 1;
        let mut pool = data(kv * p_blocks * block * hd, 77); // junk where no token lives
        for p in 0..l {
            let (id, r) = (blocks[p / block] as usize, p % block);
            for j in 0..kv {
                let src = &cache[(j * l + p) * hd..(j * l + p + 1) * hd];
                let at = ((j * p_blocks + id) * block + r) * hd;
                pool[at..at + hd].copy_from_slice(src);
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
            let n_blocks = l.div_ceil(block);
            // Distinct, out of order, with gaps: as a pool hands them out after churn.
            let blocks: Vec<u32> = (0..n_blocks as u32).rev().map(|b| b * 2 + 1).collect();
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
                    from: 0,
                },
                PagedQuery {
                    q: &q2,
                    blocks: &blocks,
                    len: l.div_ceil(2),
                    from: 0,
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

    /// A sliding window: only positions from..len count, whichever block they start in.
    #[test]
    fn a_window_attends_to_the_last_positions_only() {
        let (h, kv, l, hd, block) = (4, 2, 37, 8, 4);
        let k = data(kv * l * hd, 2);
        let v = data(kv * l * hd, 3);
        let blocks: Vec<u32> = (0..l.div_ceil(block) as u32).rev().collect();
        let (kp, vp) = (
            paged(&k, kv, l, hd, block, &blocks),
            paged(&v, kv, l, hd, block, &blocks),
        );
        let q = data(h * hd, 5);
        // The window's keys and values alone, as a contiguous cache of w rows.
        let tail = |c: &[f32], from: usize| -> Vec<f32> {
            (0..kv)
                .flat_map(|j| c[(j * l + from) * hd..(j * l + l) * hd].to_vec())
                .collect()
        };
        for from in [1, 6, 8, 36] {
            let steps = [PagedQuery {
                q: &q,
                blocks: &blocks,
                len: l,
                from,
            }];
            let got = paged_decode_attention(&steps, &kp, &vp, block, h, kv, hd, 0.3);
            let w = l - from;
            let want = reference(&q, &tail(&k, from), &tail(&v, from), h, kv, w, w, hd, 0.3);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "from {from}: {a} vs {b}");
            }
            let all = paged_decode_attention(
                &[PagedQuery {
                    from: 0,
                    ..steps[0]
                }],
                &kp,
                &vp,
                block,
                h,
                kv,
                hd,
                0.3,
            );
            assert!(
                all.iter().zip(&got).any(|(a, b)| (a - b).abs() > 1e-3),
                "from {from}"
            );
        }
    }
}
