//! Attention off the CPU through candle's operations, and the one-token steps of a pass
//! attended together (through gen's CUDA kernel where it runs): keys gathered from the paged
//! cache, padded to the longest, masked, a handful of launches for the whole batch instead of a
//! handful per step. Also the additive masks of prompt chunks.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

use super::check::{KernelCheck, KernelMode};
use crate::model::config::HeadShape;

/// A one-token step off the CPU, as [`DeviceDecode`] takes it: its row among the N, its block
/// table, positions in its cache (its own included), the first position it may see, and the
/// cache rows of its keys (kv head by kv head) for candle's path.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct DeviceStep<'a> {
    pub at: usize,
    pub table: &'a [u32],
    pub end: usize,
    pub lo: usize,
    pub rows: Vec<u32>,
}

/// The one-token steps of a pass off the CPU, for one kind of layer, attended together: through
/// gen's CUDA kernel reading the paged cache in place, or through candle's operations on keys
/// gathered from the cache in one go, padded to the longest, a handful of launches for the
/// whole batch instead of a handful per step.
pub(super) struct DeviceDecode {
    /// For the CUDA kernel.
    #[cfg(feature = "cuda")]
    meta: Option<super::cuda::DecodeMeta>,
    /// For candle's path: None when the kernel alone runs.
    gathered: Option<Gathered>,
    pub steps: usize,
}

/// The one-token steps' keys for candle's operations.
struct Gathered {
    /// Rows of q (N, h, hd) that are one-token steps, in order; None when all N are.
    q_rows: Option<Tensor>,
    /// B * kv * lmax cache rows: per step, per kv head, its keys from the first it may see
    /// on, padded by repeating its last key.
    rows: Tensor,
    /// (B, 1, lmax): 0 where a step has a key, -inf on its padding; None when none is padded.
    mask: Option<Tensor>,
    lmax: usize,
}

impl DeviceDecode {
    pub fn new(
        n: usize,
        steps: &[DeviceStep<'_>],
        kv: usize,
        kernels: KernelMode,
        device: &Device,
    ) -> Result<Self> {
        let b = steps.len();
        let gathered = (kernels != KernelMode::On)
            .then(|| Gathered::new(n, steps, kv, device))
            .transpose()?;
        #[cfg(feature = "cuda")]
        let meta = (kernels != KernelMode::Off)
            .then(|| {
                let info: Vec<_> = steps.iter().map(|s| (s.at, s.table, s.end, s.lo)).collect();
                super::cuda::DecodeMeta::new(&info, device)
            })
            .transpose()?;
        Ok(Self {
            #[cfg(feature = "cuda")]
            meta,
            gathered,
            steps: b,
        })
    }

    /// q: (N, h, hd); pools: (kv * P * BLOCK_SIZE, hd). Returns (B, h * hd).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        shape: HeadShape,
        (scale, softcap): (f64, Option<f64>),
        sinks: Option<&[f32]>,
        check: &KernelCheck,
    ) -> Result<Tensor> {
        let gathered = |g: &Gathered| {
            g.attend(
                q,
                k_pool,
                v_pool,
                shape,
                (scale, softcap),
                sinks,
                self.steps,
            )
        };
        #[cfg(feature = "cuda")]
        if let Some(meta) = &self.meta {
            let y = super::cuda::decode_attention(
                q,
                k_pool,
                v_pool,
                meta,
                shape.kv_heads,
                scale as f32,
            )?;
            if let Some(g) = &self.gathered {
                check.attention(&y, &gathered(g)?)?;
            }
            return Ok(y);
        }
        let _ = check;
        gathered(
            self.gathered
                .as_ref()
                .context("one-token steps with neither kernel nor gathered keys")?,
        )
    }
}

impl Gathered {
    fn new(n: usize, steps: &[DeviceStep<'_>], kv: usize, device: &Device) -> Result<Self> {
        let b = steps.len();
        let lmax = steps.iter().map(|s| s.rows.len() / kv).max().unwrap_or(0);
        let mut rows = Vec::with_capacity(b * kv * lmax);
        let mut mask = vec![0f32; b * lmax];
        let mut padded = false;
        for (i, s) in steps.iter().enumerate() {
            let l = s.rows.len() / kv;
            for head in s.rows.chunks_exact(l) {
                rows.extend_from_slice(head);
                rows.extend(std::iter::repeat_n(head[l - 1], lmax - l));
            }
            mask[i * lmax + l..(i + 1) * lmax].fill(f32::NEG_INFINITY);
            padded |= l < lmax;
        }
        let in_order = b == n && steps.iter().enumerate().all(|(i, s)| s.at == i);
        let q_rows: Vec<u32> = steps.iter().map(|s| s.at as u32).collect();
        Ok(Self {
            q_rows: (!in_order)
                .then(|| Tensor::new(q_rows.as_slice(), device))
                .transpose()?,
            rows: Tensor::new(rows.as_slice(), device)?,
            mask: padded
                .then(|| Tensor::from_vec(mask, (b, 1, lmax), device))
                .transpose()?,
            lmax,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        shape: HeadShape,
        (scale, softcap): (f64, Option<f64>),
        sinks: Option<&[f32]>,
        b: usize,
    ) -> Result<Tensor> {
        let (h, kv, hd) = (shape.heads, shape.kv_heads, shape.dim);
        let (l, g) = (self.lmax, h / kv);
        let q = match &self.q_rows {
            Some(r) => q.index_select(r, 0)?,
            None => q.clone(),
        };
        // Heads sharing a kv head sit next to each other: (B * kv, g, hd).
        let q = q.reshape((b * kv, g, hd))?;
        let keys = k_pool
            .index_select(&self.rows, 0)?
            .reshape((b * kv, l, hd))?;
        let values = v_pool
            .index_select(&self.rows, 0)?
            .reshape((b * kv, l, hd))?;
        let att = (q.matmul(&keys.t()?)? * scale)?; // (B * kv, g, L)
        let att = softcapped(att, softcap)?;
        let att = match &self.mask {
            Some(m) => att
                .reshape((b, kv * g, l))?
                .broadcast_add(m)?
                .reshape((b * kv, g, l))?,
            None => att,
        };
        // Rows (B * kv, g): row r of the (B * kv * g) is query head r % h.
        let att = softmax_with_sinks(&att, sinks, |r| r % h)?;
        Ok(att.matmul(&values)?.reshape((b, h * hd))?)
    }
}

/// The softmax over the last dimension of att (rows, L) whose rows are query heads in the
/// order `head_of` gives, each head's sink (where there are sinks) joining its denominator as
/// one more score that takes no value: the sinks as a last column, dropped after.
pub(super) fn softmax_with_sinks(
    att: &Tensor,
    sinks: Option<&[f32]>,
    head_of: impl Fn(usize) -> usize,
) -> Result<Tensor> {
    let Some(sinks) = sinks else {
        return Ok(candle_nn::ops::softmax_last_dim(att)?);
    };
    let dims = att.dims().to_vec();
    let l = *dims.last().expect("scores have a last dimension");
    let rows = att.elem_count() / l;
    let col: Vec<f32> = (0..rows).map(|r| sinks[head_of(r)]).collect();
    let mut col_dims = dims.clone();
    *col_dims.last_mut().expect("scores have a last dimension") = 1;
    let col = Tensor::from_vec(col, col_dims, att.device())?.to_dtype(att.dtype())?;
    let all = Tensor::cat(&[att, &col], dims.len() - 1)?;
    let p = candle_nn::ops::softmax_last_dim(&all)?;
    Ok(p.narrow(dims.len() - 1, 0, l)?)
}

/// Additive mask for T new tokens at positions pos.. attending to the cached tokens lo..pos+T
/// (L = pos + T - lo of them), repeated for the g query heads folded into each kv head's rows:
/// (g*T, L). A query sees the keys at or before it, and with a window only the last `window`
/// of those (itself included).
pub(super) fn attention_mask(
    t: usize,
    pos: usize,
    lo: usize,
    window: Option<usize>,
    g: usize,
    device: &Device,
) -> Result<Tensor> {
    let l = pos + t - lo;
    let mut m = vec![0f32; g * t * l];
    for gi in 0..g {
        for i in 0..t {
            let query = pos + i;
            let row = &mut m[(gi * t + i) * l..(gi * t + i + 1) * l];
            for (j, v) in row.iter_mut().enumerate() {
                let key = lo + j;
                let visible = key <= query && window.is_none_or(|w| query - key < w);
                if !visible {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }
    Ok(Tensor::from_vec(m, (g * t, l), device)?)
}

/// Scores through Gemma 2's soft cap, c·tanh(s / c), where there is one.
pub(super) fn softcapped(att: Tensor, softcap: Option<f64>) -> Result<Tensor> {
    Ok(match softcap {
        Some(c) => ((att / c)?.tanh()? * c)?,
        None => att,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_mask_hides_the_future_per_group() {
        let m = attention_mask(2, 3, 0, None, 2, &Device::Cpu).unwrap();
        let m = m.to_vec2::<f32>().unwrap();
        assert_eq!(m.len(), 4);
        for (r, row) in m.iter().enumerate() {
            let i = r % 2;
            for (j, v) in row.iter().enumerate() {
                let visible = j <= 3 + i;
                assert_eq!(*v == 0.0, visible, "row {r} col {j}");
            }
        }
    }

    #[test]
    fn window_mask_shows_each_query_its_last_w_tokens() {
        // Queries at 5, 6, 7 with a window of 3; the first sees 3..=5, so keys start at lo = 3.
        let m = attention_mask(3, 5, 3, Some(3), 1, &Device::Cpu).unwrap();
        let visible: Vec<Vec<usize>> = m
            .to_vec2::<f32>()
            .unwrap()
            .iter()
            .map(|row| {
                (0..row.len())
                    .filter(|&j| row[j] == 0.0)
                    .map(|j| j + 3)
                    .collect()
            })
            .collect();
        assert_eq!(visible, [vec![3, 4, 5], vec![4, 5, 6], vec![5, 6, 7]]);
    }
}
