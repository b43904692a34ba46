//! Whether gen's CUDA kernels run, and GEN_CUDA_KERNELS=check's record of how far they are from
//! candle's operations doing the same work.

use anyhow::Result;
use candle_core::{Device, Tensor};

use crate::model::config::DecoderConfig;

/// Whether gen's CUDA kernels run (see `super::cuda`, with the cuda feature): on a CUDA device, for shapes they
/// serve, with GEN_CUDA_KERNELS=1 (`On`) or `check`; always `Off` without the cuda feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelMode {
    Off,
    On,
    /// On, and compared with candle's operations.
    Check,
}

impl KernelMode {
    pub fn for_device(device: &Device, cfg: &DecoderConfig) -> Self {
        #[cfg(feature = "cuda")]
        // gen's CUDA attention knows no soft cap or sinks: Gemma 2 and gpt-oss take candle's
        // path.
        if device.is_cuda()
            && cfg.attn.softcap.is_none()
            && !cfg.attn.sinks
            && cfg
                .layers
                .iter()
                .all(|l| super::cuda::supported(l.heads.heads, l.heads.kv_heads, l.heads.dim))
        {
            return match std::env::var(super::cuda::ENV).as_deref() {
                Ok("1") => KernelMode::On,
                Ok("check") => KernelMode::Check,
                _ => KernelMode::Off,
            };
        }
        let _ = (device, cfg);
        KernelMode::Off
    }
}

/// GEN_CUDA_KERNELS=check: the largest differences between gen's kernels and candle's
/// operations over a run, printed to stderr when the model is dropped.
#[derive(Default)]
pub struct KernelCheck {
    on: bool,
    attention: std::cell::Cell<(f32, usize)>,
    write: std::cell::Cell<(f32, usize)>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl KernelCheck {
    pub fn new(on: bool) -> Self {
        Self {
            on,
            attention: Default::default(),
            write: Default::default(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.on
    }

    pub(crate) fn attention(&self, got: &Tensor, want: &Tensor) -> Result<()> {
        Self::note(&self.attention, got, want)
    }

    pub(crate) fn write(&self, got: &Tensor, want: &Tensor) -> Result<()> {
        Self::note(&self.write, got, want)
    }

    fn note(cell: &std::cell::Cell<(f32, usize)>, got: &Tensor, want: &Tensor) -> Result<()> {
        let diff = (got - want)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let (worst, calls) = cell.get();
        // NaN counts as the worst of all.
        cell.set((
            if diff.is_nan() || diff > worst {
                diff
            } else {
                worst
            },
            calls + 1,
        ));
        Ok(())
    }
}

impl Drop for KernelCheck {
    fn drop(&mut self) {
        if self.on {
            let (a, an) = self.attention.get();
            let (w, wn) = self.write.get();
            eprintln!(
                "cuda kernel check: attention largest |difference| {a:e} over {an} calls; \
                 kv write {w:e} over {wn} calls"
            );
        }
    }
}
