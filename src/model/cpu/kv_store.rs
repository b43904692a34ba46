//! The CPU's KV cache storage: per layer, keys and values as f16 host memory (as llama.cpp keeps
//! them: half the bytes for attention to read), in the blocks `PagedKv` hands out, laid out
//! (kv, P, BLOCK_SIZE, hd) so that a sequence in consecutive blocks is one contiguous run per
//! kv head, which the hardware prefetchers stream like an unpaged cache. Our attention kernels
//! read it in place.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::model::kv_cache::{check_block_data, gather_rows, store_row, BLOCK_SIZE};

pub struct HostKv {
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    /// Per layer: (kv heads, head width) of its keys and values; (0, 0) where it keeps none.
    shapes: Vec<(usize, usize)>,
    blocks: usize,
}

impl HostKv {
    /// A store with no blocks (before the first pool is reserved).
    pub fn empty() -> Self {
        Self::new(&[], 0)
    }

    /// A store of `blocks` blocks for layers of these shapes (kv heads, head width; (0, 0)
    /// for a layer keeping no keys and values).
    pub fn new(shapes: &[(usize, usize)], blocks: usize) -> Self {
        // Zeroed allocations: the OS hands out pages only as tokens land on them.
        let mk = || {
            shapes
                .iter()
                .map(|&(kv, hd)| vec![f16::ZERO; blocks * kv * BLOCK_SIZE * hd])
                .collect()
        };
        HostKv {
            k: mk(),
            v: mk(),
            shapes: shapes.to_vec(),
            blocks,
        }
    }

    /// The keys and values of `blocks`, as bytes: per block, per layer, the keys of every kv
    /// head (BLOCK_SIZE rows of hd f16 each, head by head), then the values likewise.
    pub fn read_blocks(&self, blocks: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(blocks.len() * self.block_bytes());
        self.each_run(blocks, |store, at, hd| {
            for x in &store[at..at + BLOCK_SIZE * hd] {
                out.extend_from_slice(&x.to_le_bytes());
            }
        });
        out
    }

    /// Write what [`read_blocks`](Self::read_blocks) gave into `blocks` (of this or another
    /// store of the same shape). `data` must hold exactly that many bytes.
    pub fn write_blocks(&mut self, blocks: &[u32], data: &[u8]) -> anyhow::Result<()> {
        check_block_data(data.len(), blocks.len(), self.block_bytes())?;
        let p = self.blocks();
        let mut chunks = data.chunks_exact(2);
        for &b in blocks {
            for layer in 0..self.k.len() {
                let (kv, hd) = self.shapes[layer];
                let run = BLOCK_SIZE * hd;
                for store in [&mut self.k[layer], &mut self.v[layer]] {
                    for j in 0..kv {
                        let at = store_row(b * BLOCK_SIZE as u32, j, p) * hd;
                        for x in &mut store[at..at + run] {
                            let c = chunks.next().expect("length checked above");
                            *x = f16::from_le_bytes([c[0], c[1]]);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes one block takes in [`read_blocks`](Self::read_blocks).
    pub fn block_bytes(&self) -> usize {
        let floats: usize = self.shapes.iter().map(|(kv, hd)| kv * hd).sum();
        2 * floats * BLOCK_SIZE * 2
    }

    /// Per block, per layer, keys then values, per kv head: `f(store, first value, width)`
    /// of each run of BLOCK_SIZE rows.
    fn each_run(&self, blocks: &[u32], mut f: impl FnMut(&[f16], usize, usize)) {
        let p = self.blocks();
        for &b in blocks {
            for layer in 0..self.k.len() {
                let (kv, hd) = self.shapes[layer];
                for store in [&self.k[layer], &self.v[layer]] {
                    for j in 0..kv {
                        f(store, store_row(b * BLOCK_SIZE as u32, j, p) * hd, hd);
                    }
                }
            }
        }
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Store one layer's keys and values of N tokens, (N, kv*hd) f32 each, at cache `slots`.
    pub fn write(
        &mut self,
        layer: usize,
        keys: &candle_core::Tensor,
        values: &candle_core::Tensor,
        slots: &[u32],
    ) -> anyhow::Result<()> {
        let (kv, hd) = self.shapes[layer];
        let p = self.blocks();
        let row = |s: u32, j: usize| store_row(s, j, p) * hd;
        // Ask for every destination row first: written one after the other, each write waited
        // for its line to come from memory (most of the write's time in a batch's decode step,
        // whose new rows are nowhere in cache).
        #[cfg(target_arch = "x86_64")]
        for pool in [&self.k[layer], &self.v[layer]] {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            for &s in slots.iter().take(64) {
                for j in 0..kv {
                    let at = pool[row(s, j)..].as_ptr() as *const i8;
                    for off in (0..hd * 2).step_by(64) {
                        // SAFETY: a prefetch is a hint: it cannot fault.
                        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(off)) };
                    }
                }
            }
        }
        for (src, dst) in [(keys, &mut self.k[layer]), (values, &mut self.v[layer])] {
            let src = src.contiguous()?;
            let (storage, layout) = src.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                anyhow::bail!("keys for the host cache are not on the host");
            };
            let src = &cpu.as_slice::<f32>()?[layout.start_offset()..];
            for (i, &s) in slots.iter().enumerate() {
                for j in 0..kv {
                    let to = row(s, j);
                    let from = (i * kv + j) * hd;
                    dst[to..to + hd].convert_from_f32_slice(&src[from..from + hd]);
                }
            }
        }
        Ok(())
    }

    /// Rows of layer `layer`'s cache holding the tokens at `slots`, kv head by kv head (see
    /// [`gather_rows`]).
    pub fn gather_rows(&self, layer: usize, slots: &[u32]) -> Vec<u32> {
        gather_rows(self.shapes[layer].0, self.blocks(), slots)
    }

    /// One layer's keys and values at `rows` (from `gather_rows`), widened: (kv, L, hd) each.
    /// For checks against the device store; the kernels read the storage in place.
    pub fn gather(
        &self,
        layer: usize,
        rows: &[u32],
    ) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
        let (kv, hd) = self.shapes[layer];
        let l = rows.len() / kv.max(1);
        let take = |pool: &[f16]| {
            let mut out = vec![0f32; rows.len() * hd];
            for (o, &r) in out.chunks_exact_mut(hd).zip(rows) {
                let at = r as usize * hd;
                pool[at..at + hd].convert_to_f32_slice(o);
            }
            candle_core::Tensor::from_vec(out, (kv, l, hd), &candle_core::Device::Cpu)
        };
        Ok((take(&self.k[layer])?, take(&self.v[layer])?))
    }

    /// One layer's storage, keys and values, (kv, P, BLOCK_SIZE, hd) each.
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        (&self.k[layer], &self.v[layer])
    }
}
