//! Linear layers as the decoder holds them: y = x W^T, with W kept the way its device runs it.
//!
//! On the CPU, every quantized GGUF type gen reads runs on gen's own kernels (Q4_1 and Q8_0 in
//! [`super::cpu::matmul`], the others in [`super::cpu::quants`]); f32, f16 and bf16 weights are
//! plain matrices in their own type; off the CPU, quantized types go through candle's `QMatMul`
//! (or are widened once to f32, see [`DeviceWeights`]).
//! Several projections of one input (q/k/v, gate/up) can run as one matrix ([`Projections`]).

use anyhow::Result;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use super::cpu::matmul::{CpuQWeight, Kernel};

/// Several linear layers reading the same input (q, k and v; gate and up), run as one matrix
/// when our kernels apply: one quantization of the input and one parallel region instead of
/// several, which is most of the per-layer overhead of a one-token decode step.
pub enum Projections {
    Fused { linear: QLinear, widths: Vec<usize> },
    Separate(Vec<QLinear>),
}

impl Projections {
    /// Its matrices (one when fused).
    pub fn linears(&self) -> Vec<&QLinear> {
        match self {
            Projections::Fused { linear, .. } => vec![linear],
            Projections::Separate(ls) => ls.iter().collect(),
        }
    }

    pub fn linears_mut(&mut self) -> Vec<&mut QLinear> {
        match self {
            Projections::Fused { linear, .. } => vec![linear],
            Projections::Separate(ls) => ls.iter_mut().collect(),
        }
    }

    pub fn new(parts: Vec<QLinear>) -> Self {
        if let Some(fused) = Self::fuse_dense(&parts) {
            return fused;
        }
        let ours: Option<Vec<&CpuQWeight>> = parts
            .iter()
            .map(|p| match p {
                QLinear::Cpu(w) => Some(w),
                QLinear::Candle(_) | QLinear::Dense(_) => None,
            })
            .collect();
        if !ours.is_some_and(|ws| CpuQWeight::can_concat(&ws)) || parts.is_empty() {
            return Projections::Separate(parts);
        }
        let ws = parts.into_iter().map(|p| match p {
            QLinear::Cpu(w) => w,
            QLinear::Candle(_) | QLinear::Dense(_) => unreachable!("checked above"),
        });
        let (all, widths) = CpuQWeight::concat(ws);
        Projections::Fused {
            linear: QLinear::Cpu(all),
            widths,
        }
    }

    /// Dense parts of one type and width become one matrix: one product instead of several
    /// (on a GPU, each is a kernel launch). None when the parts are not all like that, or the
    /// copy fails (then they stay apart).
    fn fuse_dense(parts: &[QLinear]) -> Option<Self> {
        let ws: Vec<&Tensor> = parts
            .iter()
            .map(|p| match p {
                QLinear::Dense(w) => Some(w),
                _ => None,
            })
            .collect::<Option<_>>()?;
        let first = ws.first()?;
        let same = ws.iter().all(|w| {
            w.dtype() == first.dtype() && w.rank() == 2 && w.dim(1).ok() == first.dim(1).ok()
        });
        if ws.len() < 2 || !same {
            return None;
        }
        let widths = ws
            .iter()
            .map(|w| w.dim(0))
            .collect::<candle_core::Result<Vec<_>>>()
            .ok()?;
        let all = Tensor::cat(&ws, 0).ok()?;
        Some(Projections::Fused {
            linear: QLinear::Dense(all),
            widths,
        })
    }

    /// x: (T, K) -> one (T, N_i) per projection.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(ps) => ps.iter().map(|p| p.forward(x)).collect(),
            Projections::Fused { linear, widths } => linear.forward_parts(x, widths),
        }
    }
}

/// A linear layer: our CPU kernels where they apply, a plain matrix for unquantized weights,
/// candle's QMatMul elsewhere.
pub enum QLinear {
    Cpu(CpuQWeight),
    Candle(QMatMul),
    /// An f32, f16 or bf16 weight (N, K), kept in its own type: the input is converted to it
    /// for the multiply and the output back to the input's type.
    Dense(Tensor),
}

/// How quantized weights are kept off the CPU (on a GPU).
///
/// `F32`: widened once at load, so each linear layer is one cuBLAS product, exact in its
/// weights; a decode step of a small model is bound by kernel launches, not by reading weights,
/// and candle's quantized kernels take two launches per product (quantize the input, multiply)
/// and round the input to 8 bits with f16 block sums, which moved greedy tokens off the CPU's
/// (llama.cpp's) within a few steps on the default model. `Quantized`: candle's QMatMul, a
/// quarter to an eighth of the memory, for models too big to widen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceWeights {
    Quantized,
    F32,
}

impl DeviceWeights {
    /// Widened f32 weights may take this much device memory.
    pub const F32_BUDGET: usize = 4 << 30;

    /// `F32` when the model widened to f32 fits [`Self::F32_BUDGET`] (about a billion
    /// parameters), else `Quantized`; GEN_DEVICE_WEIGHTS=f32|quantized decides instead.
    pub fn choose(parameters: usize) -> Self {
        match std::env::var("GEN_DEVICE_WEIGHTS").as_deref() {
            Ok("f32") => DeviceWeights::F32,
            Ok("quantized") => DeviceWeights::Quantized,
            _ if parameters.saturating_mul(4) <= Self::F32_BUDGET => DeviceWeights::F32,
            _ => DeviceWeights::Quantized,
        }
    }
}

impl QLinear {
    pub fn new(q: QTensor, device: &Device) -> Result<Self> {
        Self::with_kernel(q, device, Kernel::detect(), DeviceWeights::Quantized)
    }

    /// `new`, with quantized weights kept as `weights` says (`F32` replaces our CPU kernels
    /// too: the decoder asks for it only off the CPU, or to run a GPU's path on the CPU).
    pub fn for_device(q: QTensor, device: &Device, weights: DeviceWeights) -> Result<Self> {
        Self::with_kernel(q, device, Kernel::detect(), weights)
    }

    pub fn with_kernel(
        q: QTensor,
        device: &Device,
        kernel: Kernel,
        weights: DeviceWeights,
    ) -> Result<Self> {
        let quantized = !matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if quantized && weights == DeviceWeights::F32 {
            return Ok(QLinear::Dense(q.dequantize(device)?));
        }
        if device.is_cpu() {
            if let Some(w) = CpuQWeight::from_qtensor(&q, kernel)? {
                return Ok(QLinear::Cpu(w));
            }
        }
        // candle's QMatMul would widen f16 and bf16 weights to f32; keep their type.
        let dense = match q.dtype() {
            GgmlDType::F32 => Some(DType::F32),
            GgmlDType::F16 => Some(DType::F16),
            GgmlDType::BF16 => Some(DType::BF16),
            _ => None,
        };
        match dense {
            Some(dt) => Ok(QLinear::Dense(q.dequantize(device)?.to_dtype(dt)?)),
            None => Ok(QLinear::Candle(QMatMul::from_qtensor(q)?)),
        }
    }

    /// x: (..., K) -> (..., N)
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            QLinear::Candle(m) => Ok(m.forward(x)?),
            QLinear::Dense(w) => {
                let y = x.to_dtype(w.dtype())?.broadcast_matmul(&w.t()?)?;
                Ok(y.to_dtype(x.dtype())?)
            }
            QLinear::Cpu(w) => w.forward(x),
        }
    }

    /// x: (..., K) -> one (..., widths[i]) per part of the output columns (widths sum to N).
    pub fn forward_parts(&self, x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
        match self {
            QLinear::Cpu(w) => w.forward_parts(x, widths),
            // Several rows: one product per part, on views of the weight's rows, so each part
            // comes out contiguous; narrowed columns of one product would be strided, and on a
            // GPU every strided operation later uploads its shape first.
            QLinear::Dense(w) if x.elem_count() != *x.dims().last().unwrap_or(&0) => {
                let mut at = 0;
                widths
                    .iter()
                    .map(|&n| {
                        let part = QLinear::Dense(w.narrow(0, at, n)?);
                        at += n;
                        part.forward(x)
                    })
                    .collect()
            }
            _ => {
                let y = self.forward(x)?;
                let last = y.rank() - 1;
                let mut at = 0;
                // Views, not copies: what comes next (a reshape, an activation) reads them as
                // they are, and off the CPU every copy is one more kernel launch.
                widths
                    .iter()
                    .map(|&w| {
                        let part = y.narrow(last, at, w)?;
                        at += w;
                        Ok(part)
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    use crate::model::cpu::matmul::test_data as data;

    fn reference(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * n];
        for i in 0..t {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|c| x[i * k + c] as f64 * w[j * k + c] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    fn kernels() -> Vec<Kernel> {
        crate::model::cpu::q8::test_kernels()
    }

    /// Every kernel against the plain f32 product of the dequantized weights, for ragged sizes
    /// (N not a multiple of the chunk, T from 1 to many). Tolerance: activation quantization to
    /// 8 bits bounds the relative error per block at about 1/254; we allow 2% of the row's scale.
    #[test]
    fn kernels_match_the_dequantized_reference() {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            for &(t, n, k) in &[
                (1, 1, 32),
                (1, 37, 64),
                (3, 130, 96),
                (17, 19, 576),
                (1, 1000, 160),
            ] {
                let w = Tensor::from_vec(data(n * k, 7 + n as u64), (n, k), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&w, dtype).unwrap();
                let wd = q
                    .dequantize(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let x = data(t * k, 99 + t as u64);
                let want = reference(&x, &wd, t, n, k);
                let scale = (k as f32).sqrt() * 4.0;
                let xt = Tensor::from_vec(x.clone(), (t, k), &Device::Cpu).unwrap();
                let mut outs = Vec::new();
                for kernel in kernels() {
                    let lin = QLinear::with_kernel(
                        QTensor::quantize(&w, dtype).unwrap(),
                        &Device::Cpu,
                        kernel,
                        DeviceWeights::Quantized,
                    )
                    .unwrap();
                    let got = lin.forward(&xt).unwrap();
                    assert_eq!(got.dims(), &[t, n]);
                    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - e).abs() <= 0.02 * scale,
                            "{dtype:?} {kernel:?} t={t} n={n} k={k} [{i}]: {g} vs {e}"
                        );
                    }
                    outs.push(got);
                }
                // The fast kernel computes the same integer sums: only float summation order differs.
                for o in &outs[1..] {
                    for (a, b) in o.iter().zip(&outs[0]) {
                        assert!(
                            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "{dtype:?}: fast {a} vs scalar {b}"
                        );
                    }
                }
            }
        }
    }

    /// A token's outputs do not depend on which other tokens share the call: what lets a
    /// batched pass give each sequence exactly the logits it would get alone.
    #[test]
    fn each_row_is_computed_the_same_alone_or_with_others() {
        let (t, n, k) = (7, 27, 96);
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let w = Tensor::from_vec(data(n * k, 3), (n, k), &Device::Cpu).unwrap();
            let x = data(t * k, 4);
            for kernel in kernels() {
                let lin = QLinear::with_kernel(
                    QTensor::quantize(&w, dtype).unwrap(),
                    &Device::Cpu,
                    kernel,
                    DeviceWeights::Quantized,
                )
                .unwrap();
                let run = |rows: &[f32]| {
                    let xt =
                        Tensor::from_vec(rows.to_vec(), (rows.len() / k, k), &Device::Cpu).unwrap();
                    lin.forward(&xt)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                let all = run(&x);
                for i in 0..t {
                    let alone = run(&x[i * k..(i + 1) * k]);
                    assert_eq!(
                        &all[i * n..(i + 1) * n],
                        &alone[..],
                        "{dtype:?} {kernel:?} row {i}"
                    );
                }
            }
        }
    }

    /// Fused projections write each part's columns straight into its own buffer: every
    /// kernel, token counts within one chunk and across several (AVX2 splits a chunk of 8
    /// tokens in two calls), give each part exactly what its separate layer gives.
    #[test]
    fn fused_projections_equal_separate_ones() {
        let k = 64;
        for kernel in kernels() {
            for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
                let mk = |n: usize, seed: u64| {
                    let w = Tensor::from_vec(data(n * k, seed), (n, k), &Device::Cpu).unwrap();
                    QLinear::with_kernel(
                        QTensor::quantize(&w, dtype).unwrap(),
                        &Device::Cpu,
                        kernel,
                        DeviceWeights::Quantized,
                    )
                    .unwrap()
                };
                let shapes = [(32, 1), (8, 2), (16, 3)];
                for t in [1, 3, 8, 17] {
                    let x = Tensor::from_vec(data(t * k, 5), (t, k), &Device::Cpu).unwrap();
                    let separate: Vec<Vec<f32>> = shapes
                        .iter()
                        .map(|&(n, s)| {
                            mk(n, s)
                                .forward(&x)
                                .unwrap()
                                .flatten_all()
                                .unwrap()
                                .to_vec1()
                                .unwrap()
                        })
                        .collect();
                    let fused = Projections::new(shapes.iter().map(|&(n, s)| mk(n, s)).collect());
                    assert!(matches!(fused, Projections::Fused { .. }));
                    let outs = fused.forward(&x).unwrap();
                    assert_eq!(outs.len(), 3);
                    for ((o, s), &(n, _)) in outs.iter().zip(&separate).zip(&shapes) {
                        assert_eq!(o.dims(), &[t, n]);
                        assert_eq!(
                            &o.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                            s,
                            "{kernel:?} {dtype:?} t={t} n={n}"
                        );
                    }
                }
            }
        }
    }

    /// Rows widened from our layouts are candle's dequantization, bit for bit, for every type
    /// candle holds and every kernel's layout: what lets a tied embedding be read from the
    /// output layer's tiles instead of a second copy.
    #[test]
    fn rows_dequantize_exactly_as_candle_does() {
        let (n, k) = (19, 512);
        let w = Tensor::from_vec(data(n * k, 21), (n, k), &Device::Cpu).unwrap();
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
            GgmlDType::F16,
            GgmlDType::BF16,
        ] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let want = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for kernel in kernels() {
                let ours = CpuQWeight::from_qtensor(&q, kernel).unwrap().unwrap();
                let mut row = vec![0f32; k];
                for (r, want) in want.iter().enumerate() {
                    ours.dequantize_row(r, &mut row);
                    assert_eq!(&row, want, "{dtype:?} {kernel:?} row {r}");
                }
            }
        }
    }

    #[test]
    fn three_d_inputs_and_zero_rows_work() {
        let (n, k) = (8, 64);
        let w = Tensor::from_vec(data(n * k, 3), (n, k), &Device::Cpu).unwrap();
        let lin = QLinear::new(
            QTensor::quantize(&w, GgmlDType::Q8_0).unwrap(),
            &Device::Cpu,
        )
        .unwrap();
        let x = Tensor::zeros((2, 3, k), DType::F32, &Device::Cpu).unwrap();
        let y = lin.forward(&x).unwrap();
        assert_eq!(y.dims(), &[2, 3, n]);
        assert!(y
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| *v == 0.0));
    }
}
