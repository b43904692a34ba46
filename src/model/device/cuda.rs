//! gen's own CUDA kernels (src/model/device/kernels.cu, compiled to PTX by build.rs): the paged KV
//! cache write and one-token attention over the cache, each one launch where candle's operations
//! take four and six or seven. Launched on candle's device and stream, on candle's buffers.
//!
//! Off unless GEN_CUDA_KERNELS=1. CI compiles them, and tests/cuda_kernels.rs tests their
//! arithmetic on the CPU by emulating CUDA's threads for kernels.cu. On an H200 (2026-12-04,
//! docs/gpu.md) they agreed with candle's operations within 1e-5, gave the same greedy text,
//! and decoded about twice as fast. They stay off by default until that change has its own run
//! on a GPU.
//! GEN_CUDA_KERNELS=check runs both and reports the largest difference to stderr when the
//! model is dropped; .ci/gpu-check runs that and compares greedy text with and without them.

use anyhow::{bail, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{Device, Storage, Tensor};

/// GEN_CUDA_KERNELS as [`super::check::KernelMode`] reads it.
pub const ENV: &str = "GEN_CUDA_KERNELS";

use crate::model::kv_cache::BLOCK_SIZE;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gen_kernels.ptx"));
const MODULE: &str = "gen_kernels";
/// Threads per block of the attention kernel (THREADS in kernels.cu).
const THREADS: u32 = 256;
/// Most query heads per kv head the attention kernel serves (MAX_G in kernels.cu).
pub const MAX_GROUP: usize = 16;

/// The CUDA buffer under a tensor's storage, from its first element on, and its device. The
/// caller keeps the storage guard alive while the view is in use.
fn view<'a, T: CudaDType>(
    storage: &'a Storage,
    layout: &candle_core::Layout,
) -> Result<(CudaView<'a, T>, &'a CudaDevice)> {
    let Storage::Cuda(cs) = storage else {
        bail!("a tensor for gen's CUDA kernels is not on a CUDA device");
    };
    Ok((
        cs.as_cuda_slice::<T>()?.slice(layout.start_offset()..),
        &cs.device,
    ))
}

/// Rows of a 2-D tensor whose rows may be apart (a view of a wider product) but whose values in
/// a row are adjacent: the distance between rows.
fn row_stride(t: &Tensor) -> Result<usize> {
    let (rows, cols) = t.dims2()?;
    let stride = t.stride();
    if cols > 1 && stride[1] != 1 {
        bail!("gen's CUDA kernels need each row's values adjacent");
    }
    Ok(if rows > 1 { stride[0] } else { cols })
}

/// Write N tokens' keys and values, (N, kv*hd) each (rows may be apart), at cache `slots`
/// (N u32 on the device) of one layer's pools (kv * P * BLOCK_SIZE, hd).
pub fn kv_write(
    k_pool: &Tensor,
    v_pool: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    slots: &Tensor,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let n = keys.dim(0)?;
    let pool_blocks = k_pool.dim(0)? / (kv_heads * BLOCK_SIZE);
    let (k_stride, v_stride) = (row_stride(keys)? as i64, row_stride(values)? as i64);
    if !k_pool.is_contiguous() || !v_pool.is_contiguous() || slots.dim(0)? != n {
        bail!("kv_write: pools must be contiguous and hold one slot per token");
    }
    let (ks, kl) = keys.storage_and_layout();
    let (vs, vl) = values.storage_and_layout();
    let (ss, sl) = slots.storage_and_layout();
    let (kps, kpl) = k_pool.storage_and_layout();
    let (vps, vpl) = v_pool.storage_and_layout();
    let (k, dev) = view::<f32>(&ks, kl)?;
    let (v, _) = view::<f32>(&vs, vl)?;
    let (s, _) = view::<u32>(&ss, sl)?;
    let (kp, _) = view::<f32>(&kps, kpl)?;
    let (vp, _) = view::<f32>(&vps, vpl)?;
    let func = dev.get_or_load_custom_func("gen_kv_write_f32", MODULE, PTX)?;
    let (hd, pb) = (head_dim as i32, pool_blocks as i32);
    let mut b = func.builder();
    b.arg(&k).arg(&v).arg(&k_stride).arg(&v_stride).arg(&s);
    // The kernel writes the pools through these views: the cache is gen's alone, and every
    // use of it is ordered on the one stream.
    b.arg(&kp).arg(&vp).arg(&hd).arg(&pb);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, kv_heads as u32, 1),
        block_dim: (head_dim.min(256) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.map_err(|e| anyhow::anyhow!("gen_kv_write_f32: {e:?}"))?;
    Ok(())
}

/// What the attention kernel needs of each one-token step: u32 rows of `3 + max_blocks`:
/// the step's row of q, the positions in its cache (its own included), the first position
/// it may see, its block table (padded with zeros).
pub struct DecodeMeta {
    pub meta: Tensor,
    pub stride: usize,
    pub steps: usize,
}

impl DecodeMeta {
    /// `steps`: (row of q, block table, positions in the cache, first position seen).
    pub fn new(steps: &[(usize, &[u32], usize, usize)], device: &Device) -> Result<Self> {
        let max_blocks = steps.iter().map(|s| s.1.len()).max().unwrap_or(0);
        let stride = 3 + max_blocks;
        let mut meta = vec![0u32; steps.len() * stride];
        for (row, &(q_row, table, end, lo)) in meta.chunks_exact_mut(stride).zip(steps) {
            row[0] = q_row as u32;
            row[1] = end as u32;
            row[2] = lo as u32;
            row[3..3 + table.len()].copy_from_slice(table);
        }
        Ok(Self {
            meta: Tensor::from_vec(meta, steps.len() * stride, device)?,
            stride,
            steps: steps.len(),
        })
    }
}

/// One query token per step against its cache: q (N, h, hd) contiguous, pools (kv * P *
/// BLOCK_SIZE, hd). Returns (steps, h * hd).
pub fn decode_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    meta: &DecodeMeta,
    kv_heads: usize,
    scale: f32,
) -> Result<Tensor> {
    let (_, n_head, head_dim) = q.dims3()?;
    let g = n_head / kv_heads;
    if !supported(n_head, kv_heads, head_dim) {
        bail!("decode_attention: {n_head} heads over {kv_heads} of width {head_dim} unsupported");
    }
    if !q.is_contiguous() || !k_pool.is_contiguous() || !v_pool.is_contiguous() {
        bail!("decode_attention: q and the pools must be contiguous");
    }
    let pool_blocks = k_pool.dim(0)? / (kv_heads * BLOCK_SIZE);
    let (qs, ql) = q.storage_and_layout();
    let (kps, kpl) = k_pool.storage_and_layout();
    let (vps, vpl) = v_pool.storage_and_layout();
    let (ms, ml) = meta.meta.storage_and_layout();
    let (qv, dev) = view::<f32>(&qs, ql)?;
    let (kp, _) = view::<f32>(&kps, kpl)?;
    let (vp, _) = view::<f32>(&vps, vpl)?;
    let (m, _) = view::<u32>(&ms, ml)?;
    let len = meta.steps * n_head * head_dim;
    let out = unsafe { dev.alloc::<f32>(len) }?;
    let func = dev.get_or_load_custom_func("gen_decode_attention_f32", MODULE, PTX)?;
    let (stride, h, kv, hd, pb) = (
        meta.stride as i32,
        n_head as i32,
        kv_heads as i32,
        head_dim as i32,
        pool_blocks as i32,
    );
    let mut b = func.builder();
    b.arg(&qv).arg(&kp).arg(&vp).arg(&m).arg(&out);
    b.arg(&stride)
        .arg(&h)
        .arg(&kv)
        .arg(&hd)
        .arg(&pb)
        .arg(&scale);
    let floats = g * head_dim + g * THREADS as usize + g * (THREADS as usize / 32);
    let cfg = LaunchConfig {
        grid_dim: (meta.steps as u32, kv_heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (floats * 4) as u32,
    };
    unsafe { b.launch(cfg) }.map_err(|e| anyhow::anyhow!("gen_decode_attention_f32: {e:?}"))?;
    drop(b);
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone()));
    Ok(Tensor::from_storage(
        storage,
        (meta.steps, n_head * head_dim),
        BackpropOp::none(),
        false,
    ))
}

/// Whether the attention kernel serves these shapes (its shared memory and registers are
/// sized for them); otherwise candle's operations do.
pub fn supported(n_head: usize, kv_heads: usize, head_dim: usize) -> bool {
    kv_heads > 0
        && n_head.is_multiple_of(kv_heads)
        && n_head / kv_heads <= MAX_GROUP
        && head_dim > 0
        && head_dim <= THREADS as usize
}
