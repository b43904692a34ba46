//! Element-wise steps of the CPU forward pass done in place of candle's ops: fused, vectorised,
//! and without candle's per-op thread hand-offs or layout copies. The gated activation of the
//! feed-forward block, silu(gate) * up, where candle computes silu with a scalar libm exp per
//! value and then multiplies in a second pass; rotary embeddings applied in the token-major
//! layout the projections produce, where candle's want heads first (two transposing copies);
//! each residual add with the RMS norm after it, in one pass (two candle ops and buffers); and
//! the greedy argmax of each row of logits, where candle's scans one value at a time.

use std::mem::MaybeUninit;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Storage, Tensor};
use rayon::prelude::*;

/// Values per parallel task: large enough that a one-token step stays on one thread.
const CHUNK: usize = 16 * 1024;

/// silu(gate) * up for two CPU tensors of the same shape, f32.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_mul(gate, up, false)
}

/// gelu(gate) * up, GELU's tanh form (Gemma's; candle's `gelu`), for two CPU tensors of the
/// same shape, f32. gelu(x) = x * sigmoid(2 * sqrt(2/pi) * (x + 0.044715 x^3)), the same
/// function as 0.5 x (1 + tanh(...)), vectorised as silu is (candle's is a scalar tanh per
/// value: 30% of a Gemma 3 prefill).
pub fn gelu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_mul(gate, up, true)
}

/// act(gate) * up on host slices of the same length (silu, or GELU's tanh form with
/// `gelu`): the same kernels, and bits, as [`silu_mul`] and [`gelu_mul`].
pub fn gated_mul_slices(g: &[f32], u: &[f32], gelu: bool) -> Vec<f32> {
    debug_assert_eq!(g.len(), u.len());
    let simd = simd_available();
    let mut out = Vec::with_capacity(g.len());
    out.spare_capacity_mut()[..g.len()]
        .par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| match simd {
            // SAFETY: only when the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            true => unsafe { x86::gated_mul(g, u, o, gelu) },
            _ if gelu => gelu_mul_scalar(g, u, o),
            _ => silu_mul_scalar(g, u, o),
        });
    // SAFETY: both paths write every one of the g.len() values.
    unsafe { out.set_len(g.len()) };
    out
}

/// gpt-oss's clamped SwiGLU on host slices, value by value as ggml's `swiglu_oai`: with
/// g = min(gate, limit) and u = clamp(up, -limit, limit), g / (1 + exp(-alpha·g))·(u + 1).
/// Scalar (one `exp` a value): gpt-oss's experts are a few thousand values a token.
pub fn swiglu_oai_slices(g: &[f32], u: &[f32]) -> Vec<f32> {
    debug_assert_eq!(g.len(), u.len());
    let (alpha, limit) = crate::model::config::SWIGLU_OAI;
    g.iter()
        .zip(u)
        .map(|(&g, &u)| {
            let x = g.min(limit);
            let y = u.clamp(-limit, limit);
            x / (1.0 + (alpha * -x).exp()) * (y + 1.0)
        })
        .collect()
}

/// [`swiglu_oai_slices`] for two CPU tensors of the same shape.
pub fn swiglu_oai_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "gated activation: shapes {:?} and {:?}",
            gate.dims(),
            up.dims()
        );
    }
    let out = with_f32(gate, |g| with_f32(up, |u| swiglu_oai_slices(g, u)))??;
    Ok(Tensor::from_vec(out, gate.dims(), &Device::Cpu)?)
}

fn gated_mul(gate: &Tensor, up: &Tensor, gelu: bool) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "gated activation: shapes {:?} and {:?}",
            gate.dims(),
            up.dims()
        );
    }
    // Written once, never zeroed first (a prefill's is megabytes).
    let out = with_f32(gate, |g| with_f32(up, |u| gated_mul_slices(g, u, gelu)))??;
    Ok(Tensor::from_vec(out, gate.dims(), &Device::Cpu)?)
}

/// Rotary position embedding of x: (N, heads, hd), token n rotated by its row of cos and sin
/// (N, n_rot / 2 each); each head's first n_rot values turn, the rest pass through.
/// `interleaved`: pairs (2i, 2i + 1) (GGUF llama layout); otherwise pairs (i, i + n_rot/2).
/// The same products and sums as candle's rope and rope_i, in the token-major layout the
/// projections produce, so no transposes are needed around it.
pub fn rope(x: &Tensor, cos: &[f32], sin: &[f32], interleaved: bool) -> Result<Tensor> {
    let (n, heads, hd) = x.dims3()?;
    let half = cos.len() / n.max(1);
    if 2 * half > hd || cos.len() != n * half || sin.len() != n * half {
        bail!(
            "rope: x {:?} against tables of {} and {}",
            x.dims(),
            cos.len(),
            sin.len()
        );
    }
    let mut v = f32_contiguous(x)?;
    let token = |(t, row): (usize, &mut [f32])| {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for head in row.chunks_exact_mut(hd) {
            for i in 0..half {
                let (a, b) = if interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c[i] - x1 * s[i];
                head[b] = x0 * s[i] + x1 * c[i];
            }
        }
    };
    // A prefill's hundreds of tokens in parallel (a serial pass was 3% of a batch's prefill);
    // a decode step's few on this thread.
    if n >= 64 {
        v.par_chunks_exact_mut(heads * hd)
            .enumerate()
            .for_each(token);
    } else {
        v.chunks_exact_mut(heads * hd).enumerate().for_each(token);
    }
    Ok(Tensor::from_vec(v, (n, heads, hd), &Device::Cpu)?)
}

/// The residual add and the RMS norm that follows it, in one pass: returns (x + o, and that
/// sum normalised and scaled by `w`), both (N, d) f32. The same operations in the same order
/// as candle's add and rms_norm (each row's sum of squares added up in order), so the result
/// is bit for bit theirs; eight rows' sums go side by side, which hides the latency of that
/// serial chain. Rows in parallel for a prefill.
pub fn add_rms_norm(x: &Tensor, o: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let (n, d) = x.dims2()?;
    if o.dims() != x.dims() || w.dims() != [d] {
        bail!(
            "add_rms_norm: x {:?}, o {:?}, w {:?}",
            x.dims(),
            o.dims(),
            w.dims()
        );
    }
    let (sum, normed) = with_f32(x, |x| {
        with_f32(o, |o| {
            with_f32(w, |w| {
                let mut sum = Vec::with_capacity(n * d);
                let mut normed = Vec::with_capacity(n * d);
                let group = NORM_ROWS * d;
                let (s_out, m_out) = (
                    &mut sum.spare_capacity_mut()[..n * d],
                    &mut normed.spare_capacity_mut()[..n * d],
                );
                if n >= 64 {
                    s_out
                        .par_chunks_mut(group)
                        .zip(m_out.par_chunks_mut(group))
                        .zip(x.par_chunks(group).zip(o.par_chunks(group)))
                        .for_each(|((s, m), (x, o))| add_norm_rows(x, o, w, eps, s, m));
                } else {
                    s_out
                        .chunks_mut(group)
                        .zip(m_out.chunks_mut(group))
                        .zip(x.chunks(group).zip(o.chunks(group)))
                        .for_each(|((s, m), (x, o))| add_norm_rows(x, o, w, eps, s, m));
                }
                // SAFETY: add_norm_rows wrote all n * d values of both.
                unsafe {
                    sum.set_len(n * d);
                    normed.set_len(n * d);
                }
                (sum, normed)
            })
        })
    })???;
    Ok((
        Tensor::from_vec(sum, (n, d), &Device::Cpu)?,
        Tensor::from_vec(normed, (n, d), &Device::Cpu)?,
    ))
}

/// Rows whose sums of squares `add_norm_rows` runs side by side.
const NORM_ROWS: usize = 8;

/// Up to NORM_ROWS rows of `add_rms_norm`: s = x + o, m = s / sqrt(mean(s^2) + eps) * w.
fn add_norm_rows(
    x: &[f32],
    o: &[f32],
    w: &[f32],
    eps: f32,
    s: &mut [MaybeUninit<f32>],
    m: &mut [MaybeUninit<f32>],
) {
    let d = w.len();
    let rows = x.len() / d;
    for ((s, &x), &o) in s.iter_mut().zip(x).zip(o) {
        s.write(x + o);
    }
    // SAFETY: every value was written just above.
    let s = unsafe { &*(s as *const [MaybeUninit<f32>] as *const [f32]) };
    let mut acc = [0f32; NORM_ROWS];
    match simd_available() && d.is_multiple_of(8) {
        // SAFETY: only when the CPU has AVX2; d is a multiple of 8.
        #[cfg(target_arch = "x86_64")]
        true => unsafe { x86::sums_of_squares(s, d, &mut acc) },
        _ => {
            for (acc, row) in acc.iter_mut().zip(s.chunks_exact(d)) {
                *acc = row.iter().map(|&v| v * v).sum();
            }
        }
    }
    for r in 0..rows {
        let scale = (acc[r] / d as f32 + eps).sqrt();
        for ((m, &v), &w) in m[r * d..(r + 1) * d]
            .iter_mut()
            .zip(&s[r * d..(r + 1) * d])
            .zip(w)
        {
            m.write(v / scale * w);
        }
    }
}

/// The index of the largest value of each row of `logits` ((rows, vocab) or (vocab,)), as
/// candle's argmax gives it: the first index holding the maximum, NaN ignored except as the
/// first value (then 0). On the CPU a vectorised maximum then a search for its first index;
/// elsewhere candle's op (one transfer).
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    let vocab = *logits.dims().last().unwrap_or(&0);
    if !logits.device().is_cpu() || logits.dtype() != DType::F32 || vocab == 0 {
        let rows = logits.reshape(((), vocab))?;
        return Ok(rows.argmax(1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?);
    }
    let simd = simd_available();
    with_f32(logits, |v| {
        v.chunks_exact(vocab)
            .map(|row| match simd {
                // SAFETY: only when the CPU has AVX2.
                #[cfg(target_arch = "x86_64")]
                true => unsafe { x86::argmax(row) },
                _ => argmax_scalar(row),
            } as u32)
            .collect()
    })
}

/// candle's argmax loop: a later value replaces the best only when strictly larger.
fn argmax_scalar(row: &[f32]) -> usize {
    let (mut best, mut at) = (row[0], 0);
    for (i, &x) in row.iter().enumerate() {
        if best < x {
            best = x;
            at = i;
        }
    }
    at
}

/// The portable path: the formula candle uses, x / (1 + e^-x), times up.
fn silu_mul_scalar(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    for ((o, &x), &u) in o.iter_mut().zip(g).zip(u) {
        o.write(x / (1.0 + (-x).exp()) * u);
    }
}

/// The portable path for GELU: candle's formula, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
/// times up.
fn gelu_mul_scalar(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    const S: f32 = 0.797_884_6; // sqrt(2 / pi)
    for ((o, &x), &u) in o.iter_mut().zip(g).zip(u) {
        o.write(0.5 * x * (1.0 + (S * (x + 0.044715 * x * x * x)).tanh()) * u);
    }
}

/// An output buffer that several threads of one parallel region write at disjoint indices
/// (each user says which indices are whose).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: users give every task its own indices of the buffer (see `matmul::CpuQWeight::
// matmul_parts` and `attention::causal_prefill_attention`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Where value `i` is (a method, so closures capture the whole wrapper, not its pointer).
    pub(crate) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `f` on a tensor's values as one f32 slice, borrowed when the tensor is already a contiguous
/// f32 one (what the forward pass hands over).
pub(crate) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = t.to_dtype(DType::F32)?.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("expected a CPU tensor")
    };
    let all = cpu.as_slice::<f32>()?;
    let start = layout.start_offset();
    Ok(f(&all[start..start + t.elem_count()]))
}

/// A tensor's values, copied into one f32 vector.
fn f32_contiguous(t: &Tensor) -> Result<Vec<f32>> {
    with_f32(t, |v| v.to_vec())
}

/// Whether the AVX2 code may run: decided once per process (GEN_KERNEL=scalar turns it off,
/// as for the other kernels).
pub(crate) fn simd_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::env::var("GEN_KERNEL").map_or(true, |v| v != "scalar") {
            return is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
        }
        false
    })
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// exp(x) for x <= 0, to about 2 ulp: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, and p a
    /// degree-6 polynomial. Below -87 the result is 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_nonpositive(x: __m256) -> __m256 {
        let tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0), _CMP_LT_OQ);
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        // r = x - n ln2, with ln2 in two parts so r keeps its precision.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        ));
        _mm256_andnot_ps(tiny, _mm256_mul_ps(p, pow2))
    }

    /// Each row's sum of squares of up to 8 rows of d values (rows: (n, d) row-major, d a
    /// multiple of 8), into sums[..n]: added up in order, as a plain loop over the row would,
    /// but the 8 rows side by side, one per lane (8 x 8 tiles transposed in registers), so
    /// eight serial chains run at once.
    #[target_feature(enable = "avx2")]
    pub unsafe fn sums_of_squares(rows: &[f32], d: usize, sums: &mut [f32; 8]) {
        let n = rows.len() / d;
        debug_assert!(n <= 8 && d.is_multiple_of(8));
        let zero = [0f32; 8];
        let ptr: [*const f32; 8] = std::array::from_fn(|r| {
            if r < n {
                rows.as_ptr().add(r * d)
            } else {
                zero.as_ptr()
            }
        });
        let step = |r: usize| if r < n { 8 } else { 0 };
        let mut acc = _mm256_setzero_ps();
        let mut at = [0usize; 8];
        for _ in (0..d).step_by(8) {
            let v: [__m256; 8] = std::array::from_fn(|r| _mm256_loadu_ps(ptr[r].add(at[r])));
            for (r, a) in at.iter_mut().enumerate() {
                *a += step(r);
            }
            // Transpose: c[k] holds column k of the tile, lane r from row r.
            let t0 = _mm256_unpacklo_ps(v[0], v[1]);
            let t1 = _mm256_unpackhi_ps(v[0], v[1]);
            let t2 = _mm256_unpacklo_ps(v[2], v[3]);
            let t3 = _mm256_unpackhi_ps(v[2], v[3]);
            let t4 = _mm256_unpacklo_ps(v[4], v[5]);
            let t5 = _mm256_unpackhi_ps(v[4], v[5]);
            let t6 = _mm256_unpacklo_ps(v[6], v[7]);
            let t7 = _mm256_unpackhi_ps(v[6], v[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let c = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for c in c {
                // A multiply, then an add: no fused multiply-add, as in the plain loop.
                acc = _mm256_add_ps(acc, _mm256_mul_ps(c, c));
            }
        }
        _mm256_storeu_ps(sums.as_mut_ptr(), acc);
    }

    /// `argmax_scalar`'s answer: the largest value in vectors (four running maxima), then the
    /// first index holding it. A row with a NaN goes through the scalar loop itself.
    #[target_feature(enable = "avx2")]
    pub unsafe fn argmax(row: &[f32]) -> usize {
        let n = row.len() / 32 * 32;
        let p = row.as_ptr();
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        let mut nan = _mm256_setzero_ps();
        for i in (0..n).step_by(32) {
            for (k, m) in m.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(p.add(i + 8 * k));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
                *m = _mm256_max_ps(*m, x);
            }
        }
        if _mm256_movemask_ps(nan) != 0 {
            return super::argmax_scalar(row);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(
            lanes.as_mut_ptr(),
            _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])),
        );
        let mut best = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for &x in &row[n..] {
            if x.is_nan() {
                return super::argmax_scalar(row);
            }
            best = best.max(x);
        }
        // The first index holding the maximum (== also matches -0.0 against 0.0, as the
        // scalar loop's strict comparison keeps the first of them).
        let target = _mm256_set1_ps(best);
        for i in (0..n).step_by(8) {
            let hit =
                _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p.add(i)), target, _CMP_EQ_OQ));
            if hit != 0 {
                return i + hit.trailing_zeros() as usize;
            }
        }
        n + row[n..].iter().position(|&x| x == best).unwrap_or(0)
    }

    /// o = silu(g) * u, or with `gelu` o = gelu(g) * u = g * sigmoid(z) * u with z = 2 *
    /// sqrt(2/pi) * (g + 0.044715 g^3). sigmoid(z) from e = exp(-|z|), which never overflows:
    /// 1 / (1 + e) for z >= 0, e / (1 + e) below.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gated_mul(
        g: &[f32],
        u: &[f32],
        o: &mut [std::mem::MaybeUninit<f32>],
        gelu: bool,
    ) {
        let n = o.len().min(g.len()).min(u.len());
        let sign = _mm256_set1_ps(-0.0);
        let one = _mm256_set1_ps(1.0);
        let (c1, c3) = (
            _mm256_set1_ps(2.0 * 0.797_884_6),
            _mm256_set1_ps(2.0 * 0.797_884_6 * 0.044715),
        );
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let z = if gelu {
                // c1 x + c3 x^3 = x (c1 + c3 x^2)
                _mm256_mul_ps(x, _mm256_fmadd_ps(c3, _mm256_mul_ps(x, x), c1))
            } else {
                x
            };
            let e = exp_nonpositive(_mm256_or_ps(z, sign)); // exp(-|z|)
            let negative = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
            let num = _mm256_blendv_ps(one, e, negative);
            let sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
            let y = _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(o.as_mut_ptr().add(i).cast(), y);
            i += 8;
        }
        if gelu {
            super::gelu_mul_scalar(&g[i..n], &u[i..n], &mut o[i..n]);
        } else {
            super::silu_mul_scalar(&g[i..n], &u[i..n], &mut o[i..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same index as candle's argmax on rows with ties, zeros of both signs, infinities,
    /// NaN (first and elsewhere) and lengths around the vector width, on both paths.
    #[test]
    fn argmax_rows_is_candles_argmax() {
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for len in [1usize, 7, 8, 31, 32, 33, 100, 49152] {
            let base: Vec<f32> = (0..len)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 20) as f32 * 0.01 - 20.0)
                .collect();
            rows.push(base.clone());
            let mut tie = base.clone();
            tie[len / 2] = 1e9;
            tie[len - 1] = 1e9;
            rows.push(tie);
            let mut zeros = vec![-1.0f32; len];
            zeros[len / 3] = -0.0;
            zeros[len - 1] = 0.0;
            rows.push(zeros);
            let mut inf = base.clone();
            inf[len - 1] = f32::INFINITY;
            rows.push(inf);
            let mut nan_first = base.clone();
            nan_first[0] = f32::NAN;
            rows.push(nan_first);
            let mut nan_later = base.clone();
            nan_later[len - 1] = f32::NAN;
            nan_later[len / 2] = 5e8;
            rows.push(nan_later);
            rows.push(vec![f32::NEG_INFINITY; len]);
        }
        for row in rows {
            let t = Tensor::from_vec(row.clone(), (1, row.len()), &Device::Cpu).unwrap();
            let want = t.argmax(1).unwrap().to_vec1::<u32>().unwrap();
            assert_eq!(argmax_rows(&t).unwrap(), want, "row of {}", row.len());
            assert_eq!(argmax_scalar(&row) as u32, want[0]);
        }
        // Several rows at once, and a 1-D tensor.
        let two =
            Tensor::from_vec(vec![1f32, 3.0, 2.0, 9.0, 0.0, 9.0], (2, 3), &Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&two).unwrap(), vec![1, 0]);
        let one = Tensor::from_vec(vec![1f32, 3.0, 2.0], 3, &Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&one).unwrap(), vec![1]);
    }

    /// Bit for bit candle's add and rms_norm, for row counts around the side-by-side group
    /// of 8 and the parallel threshold, and values far apart in size.
    #[test]
    fn add_rms_norm_is_candles_add_then_rms_norm() {
        for (n, d) in [
            (1, 576),
            (5, 40),
            (3, 36),
            (8, 576),
            (13, 64),
            (100, 576),
            (131, 40),
        ] {
            let val = |i: usize, k: u32| {
                let h = (i as u32).wrapping_mul(2_654_435_761).rotate_left(k) >> 8;
                (h as f32 / (1u32 << 24) as f32 - 0.5)
                    * if i.is_multiple_of(97) { 300.0 } else { 3.0 }
            };
            let x: Vec<f32> = (0..n * d).map(|i| val(i, 3)).collect();
            let o: Vec<f32> = (0..n * d).map(|i| val(i, 11)).collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + val(i, 7)).collect();
            let dev = Device::Cpu;
            let xt = Tensor::from_vec(x, (n, d), &dev).unwrap();
            let ot = Tensor::from_vec(o, (n, d), &dev).unwrap();
            let wt = Tensor::from_vec(w, d, &dev).unwrap();
            let (sum, normed) = add_rms_norm(&xt, &ot, &wt, 1e-5).unwrap();
            let want_sum = (&xt + &ot).unwrap();
            let want = candle_nn::ops::rms_norm(&want_sum, &wt, 1e-5).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v.iter().map(|f| f.to_bits()).collect()
            };
            assert_eq!(bits(&sum), bits(&want_sum), "sum, n = {n}, d = {d}");
            assert_eq!(bits(&normed), bits(&want), "norm, n = {n}, d = {d}");
        }
    }

    /// The vector path against the f64 formula over the range activations take, the extremes
    /// included (no overflow, no NaN), and against the portable path to within a few ulp.
    #[test]
    fn silu_mul_matches_the_formula() {
        let g: Vec<f32> = (-4000..4000)
            .map(|i| i as f32 * 0.01)
            .chain([-1e30, -200.0, -88.0, -87.5, 87.5, 200.0, 1e30, 0.0, -0.0])
            .collect();
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let gt = Tensor::from_vec(g.clone(), g.len(), &Device::Cpu).unwrap();
        let ut = Tensor::from_vec(u.clone(), u.len(), &Device::Cpu).unwrap();
        let got = silu_mul(&gt, &ut).unwrap().to_vec1::<f32>().unwrap();
        let mut portable = vec![MaybeUninit::new(0f32); g.len()];
        silu_mul_scalar(&g, &u, &mut portable);
        // SAFETY: initialised above (and written again by silu_mul_scalar).
        let portable: Vec<f32> = portable
            .iter()
            .map(|v| unsafe { v.assume_init() })
            .collect();
        for i in 0..g.len() {
            let x = g[i] as f64;
            let want = x / (1.0 + (-x).exp()) * u[i] as f64;
            let err = (got[i] as f64 - want).abs();
            assert!(
                err <= 1e-6 * want.abs() + 1e-35,
                "silu({}) * {}: {} vs {want}",
                g[i],
                u[i],
                got[i]
            );
            assert!(
                (got[i] - portable[i]).abs() <= 4.0 * f32::EPSILON * portable[i].abs() + 1e-35,
                "vector {} vs portable {} at {}",
                got[i],
                portable[i],
                g[i]
            );
        }
    }

    /// GELU (tanh form): the vector path against candle's gelu times up and the f64 formula,
    /// over the range activations take and the extremes (no overflow, no NaN).
    #[test]
    fn gelu_mul_matches_candle_and_the_formula() {
        let g: Vec<f32> = (-2000..2000)
            .map(|i| i as f32 * 0.01)
            .chain([
                -1e30, -200.0, -88.0, -10.0, 10.0, 87.5, 200.0, 1e30, 0.0, -0.0,
            ])
            .collect();
        let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let gt = Tensor::from_vec(g.clone(), g.len(), &Device::Cpu).unwrap();
        let ut = Tensor::from_vec(u.clone(), u.len(), &Device::Cpu).unwrap();
        let got = gelu_mul(&gt, &ut).unwrap().to_vec1::<f32>().unwrap();
        let candle = (gt.gelu().unwrap() * &ut)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for i in 0..g.len() {
            let x = g[i] as f64;
            let want = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
                * u[i] as f64;
            let tol = 2e-6 * want.abs() + 1e-6 * u[i] as f64;
            assert!(
                got[i].is_finite() || !want.is_finite(),
                "gelu({}) = {}",
                g[i],
                got[i]
            );
            if want.is_finite() && x.abs() < 1e6 {
                assert!(
                    (got[i] as f64 - want).abs() <= tol,
                    "gelu({}) * {}: {} vs {want}",
                    g[i],
                    u[i],
                    got[i]
                );
                assert!(
                    (got[i] - candle[i]).abs() as f64 <= tol + 2e-6 * (candle[i].abs() as f64),
                    "gelu({}): {} vs candle {}",
                    g[i],
                    got[i],
                    candle[i]
                );
            }
        }
    }

    /// Both layouts give exactly candle's rope on the heads-first layout.
    #[test]
    fn rope_equals_candles() {
        let (n, heads, hd) = (5, 3, 8);
        let x: Vec<f32> = (0..n * heads * hd)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let cos: Vec<f32> = (0..n * hd / 2).map(|i| (i as f32 * 0.11).cos()).collect();
        let sin: Vec<f32> = (0..n * hd / 2).map(|i| (i as f32 * 0.11).sin()).collect();
        let xt = Tensor::from_vec(x, (n, heads, hd), &Device::Cpu).unwrap();
        let ct = Tensor::from_vec(cos.clone(), (n, hd / 2), &Device::Cpu).unwrap();
        let st = Tensor::from_vec(sin.clone(), (n, hd / 2), &Device::Cpu).unwrap();
        let heads_first = xt
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        for interleaved in [true, false] {
            let want = if interleaved {
                candle_nn::rotary_emb::rope_i(&heads_first, &ct, &st).unwrap()
            } else {
                candle_nn::rotary_emb::rope(&heads_first, &ct, &st).unwrap()
            };
            let want = want.squeeze(0).unwrap().transpose(0, 1).unwrap();
            let got = rope(&xt, &cos, &sin, interleaved).unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&got), flat(&want), "interleaved {interleaved}");
        }
        assert!(rope(&xt, &cos[1..], &sin, true).is_err());
    }

    #[test]
    fn shapes_must_match() {
        let a = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(silu_mul(&a, &b).is_err());
    }
}
