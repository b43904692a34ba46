//! The KV cache storage off the CPU (and for `GEN_ATTENTION=candle` on it): per layer, keys and
//! values as f32 tensors of (kv * P * BLOCK_SIZE, hd) rows, laid out (kv, P, BLOCK_SIZE, hd) like
//! the host store, written with one `scatter_set` per tensor (or gen's CUDA kernel) and read
//! with `index_select` (or in place by gen's CUDA attention kernel).

use candle_core::{DType, Device, Tensor};

use super::check::KernelCheck;
use crate::model::kv_cache::{check_block_data, gather_rows, BLOCK_SIZE};

pub struct DeviceKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Per layer: (kv heads, head width) of its keys and values; (0, 0) where it keeps none.
    shapes: Vec<(usize, usize)>,
    blocks: usize,
}

/// Where one pass's new keys and values go in a [`DeviceKv`], worked out once for all layers
/// (once for each shape of layer).
pub struct WritePlan {
    slots: Vec<u32>,
    scatter: Vec<((usize, usize), ScatterPlan)>,
    /// The slots on the device, for gen's CUDA kernel.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kernel_slots: Option<Tensor>,
}

/// Which new row each (kv head, block, place) receives (`map`, into the (N * kv, hd) rows) and
/// its row within the block (`ids`, u32::MAX where nothing comes).
struct ScatterPlan {
    map: Tensor,
    ids: Tensor,
}

impl DeviceKv {
    /// A store of `blocks` blocks for layers of these shapes (kv heads, head width; (0, 0) for
    /// a layer keeping no keys and values).
    pub fn new(
        device: &Device,
        shapes: &[(usize, usize)],
        blocks: usize,
    ) -> candle_core::Result<Self> {
        let mk = || -> candle_core::Result<Vec<Tensor>> {
            shapes
                .iter()
                .map(|&(kv, hd)| {
                    Tensor::zeros((blocks * kv * BLOCK_SIZE, hd.max(1)), DType::F32, device)
                })
                .collect()
        };
        Ok(DeviceKv {
            k: mk()?,
            v: mk()?,
            shapes: shapes.to_vec(),
            blocks,
        })
    }

    /// A store with no blocks (before the first pool is reserved).
    pub fn empty() -> Self {
        DeviceKv {
            k: Vec::new(),
            v: Vec::new(),
            shapes: Vec::new(),
            blocks: 0,
        }
    }

    /// Blocks in the pool.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Work out where a pass's N new tokens (at cache `slots`) go, once for every layer.
    /// `kernel`: gen's CUDA kernel writes (it needs only the slots on the device).
    pub fn plan_write(
        &self,
        slots: &[u32],
        device: &Device,
        kernel: bool,
    ) -> candle_core::Result<WritePlan> {
        if kernel {
            return Ok(WritePlan {
                slots: slots.to_vec(),
                scatter: Vec::new(),
                kernel_slots: Some(Tensor::new(slots, device)?),
            });
        }
        let mut shapes: Vec<(usize, usize)> = Vec::new();
        for &s in self.shapes.iter().filter(|s| s.0 > 0) {
            if !shapes.contains(&s) {
                shapes.push(s);
            }
        }
        let scatter = shapes
            .into_iter()
            .map(|shape| Ok((shape, self.scatter_plan(slots, shape, device)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(WritePlan {
            slots: slots.to_vec(),
            scatter,
            kernel_slots: None,
        })
    }

    /// The scatter of a pass's rows into layers of `(kv, hd)`.
    fn scatter_plan(
        &self,
        slots: &[u32],
        (kv, hd): (usize, usize),
        device: &Device,
    ) -> candle_core::Result<ScatterPlan> {
        // One scatter per tensor writes every token of every head: the cache seen as
        // (kv * P, BLOCK_SIZE, hd), each (head, block) receiving up to `per_block` rows of a
        // source of (kv * P, per_block, hd) gathered from the new rows; (head, block) pairs
        // with nothing to receive are skipped through the index u32::MAX. candle's scatter
        // runs one thread per (head, block, value) and loops only over `per_block`, where a
        // plain scatter of N rows would loop over all N in each of hd threads.
        let p = self.blocks();
        let mut count = vec![0usize; p];
        for &s in slots {
            count[s as usize / BLOCK_SIZE] += 1;
        }
        let per_block = count.iter().copied().max().unwrap_or(0).max(1);
        let mut map = vec![0u32; kv * p * per_block];
        let mut ids = vec![u32::MAX; kv * p * per_block];
        count.fill(0);
        for (i, &s) in slots.iter().enumerate() {
            let (blk, r) = (s as usize / BLOCK_SIZE, s as usize % BLOCK_SIZE);
            let c = count[blk];
            count[blk] += 1;
            for j in 0..kv {
                let e = (j * p + blk) * per_block + c;
                map[e] = (i * kv + j) as u32;
                ids[e] = r as u32;
            }
        }
        let n = kv * p * per_block;
        let ids = Tensor::from_vec(ids, (n, 1), device)?
            .broadcast_as((n, hd))?
            .contiguous()?
            .reshape((kv * p, per_block, hd))?;
        Ok(ScatterPlan {
            map: Tensor::from_vec(map, n, device)?,
            ids,
        })
    }

    /// Store one layer's keys and values of N tokens, (N, kv*hd) each, where `plan` says.
    /// `check` (GEN_CUDA_KERNELS=check) compares what gen's CUDA kernel wrote with its input.
    pub fn write(
        &mut self,
        layer: usize,
        keys: &Tensor,
        values: &Tensor,
        plan: &WritePlan,
        check: &KernelCheck,
    ) -> anyhow::Result<()> {
        let slots = &plan.slots;
        let (kv, hd) = self.shapes[layer];
        #[cfg(feature = "cuda")]
        if let Some(on_device) = &plan.kernel_slots {
            // GEN_CUDA_KERNELS=check: the rows the kernel should have written, head by head.
            let check_rows = check.enabled().then(|| self.gather_rows(layer, slots));
            let (k, v) = (&self.k[layer], &self.v[layer]);
            super::cuda::kv_write(k, v, keys, values, on_device, kv, hd)?;
            if let Some(rows) = &check_rows {
                let rows = Tensor::new(rows.as_slice(), keys.device())?;
                let n = slots.len();
                for (src, pool) in [(keys, k), (values, v)] {
                    // (N, kv*hd) -> (kv, N, hd): the order gather_rows gives.
                    let want = src
                        .contiguous()?
                        .reshape((n, kv, hd))?
                        .transpose(0, 1)?
                        .contiguous()?
                        .reshape((kv * n, hd))?;
                    check.write(&pool.index_select(&rows, 0)?, &want)?;
                }
            }
            return Ok(());
        }
        let _ = check;
        let Some((_, ScatterPlan { map, ids })) = plan.scatter.iter().find(|(s, _)| *s == (kv, hd))
        else {
            anyhow::bail!("a device cache needs a write plan made for it");
        };
        let p = self.k[layer].dim(0)? / (kv * BLOCK_SIZE).max(1);
        let per_block = ids.dim(1)?;
        for (src, dst) in [(keys, &self.k[layer]), (values, &self.v[layer])] {
            let rows = src.contiguous()?.reshape((slots.len() * kv, hd))?;
            let source = rows
                .index_select(map, 0)?
                .reshape((kv * p, per_block, hd))?;
            dst.reshape((kv * p, BLOCK_SIZE, hd))?
                .scatter_set(ids, &source, 1)?;
        }
        Ok(())
    }

    /// Rows of layer `layer`'s cache holding the tokens at `slots`, kv head by kv head (see
    /// [`gather_rows`]).
    pub fn gather_rows(&self, layer: usize, slots: &[u32]) -> Vec<u32> {
        self.rows_for(self.shapes[layer].0, slots)
    }

    /// Rows holding the tokens at `slots` in a layer of `kv` kv heads.
    pub fn rows_for(&self, kv: usize, slots: &[u32]) -> Vec<u32> {
        gather_rows(kv, self.blocks(), slots)
    }

    /// One layer's keys and values at `rows` (from `gather_rows`; already on the device as
    /// `rows_on_device` if given): (kv, L, hd) each.
    pub fn gather(
        &self,
        layer: usize,
        rows: &[u32],
        rows_on_device: Option<&Tensor>,
        device: &Device,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (kv, hd) = self.shapes[layer];
        let l = rows.len() / kv.max(1);
        let idx = match rows_on_device {
            Some(t) => t.clone(),
            None => Tensor::new(rows, device)?,
        };
        Ok((
            self.k[layer].index_select(&idx, 0)?.reshape((kv, l, hd))?,
            self.v[layer].index_select(&idx, 0)?.reshape((kv, l, hd))?,
        ))
    }

    /// The keys and values of `blocks`, as bytes: per block, per layer, the keys of every kv
    /// head (BLOCK_SIZE rows of hd f32 each, head by head), then the values likewise.
    pub fn read_blocks(&self, blocks: &[u32]) -> candle_core::Result<Vec<u8>> {
        let p = self.blocks();
        let mut out = Vec::with_capacity(blocks.len() * self.block_bytes());
        for &b in blocks {
            for layer in 0..self.k.len() {
                for store in [&self.k[layer], &self.v[layer]] {
                    for j in 0..self.shapes[layer].0 {
                        let at = (j * p + b as usize) * BLOCK_SIZE;
                        let rows = store.narrow(0, at, BLOCK_SIZE)?.flatten_all()?;
                        for x in rows.to_vec1::<f32>()? {
                            out.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Write what [`read_blocks`](Self::read_blocks) gave into `blocks`. `data` must hold
    /// exactly that many bytes.
    pub fn write_blocks(&mut self, blocks: &[u32], data: &[u8]) -> anyhow::Result<()> {
        check_block_data(data.len(), blocks.len(), self.block_bytes())?;
        let p = self.blocks();
        let mut values = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        for &b in blocks {
            for layer in 0..self.k.len() {
                let (kv, hd) = self.shapes[layer];
                let run = BLOCK_SIZE * hd;
                for store in [&self.k[layer], &self.v[layer]] {
                    for j in 0..kv {
                        let rows: Vec<f32> = values.by_ref().take(run).collect();
                        let src = Tensor::from_vec(rows, (BLOCK_SIZE, hd), store.device())?;
                        store.slice_set(&src, 0, (j * p + b as usize) * BLOCK_SIZE)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Bytes one block takes in [`read_blocks`](Self::read_blocks).
    pub fn block_bytes(&self) -> usize {
        let floats: usize = self.shapes.iter().map(|(kv, hd)| kv * hd).sum();
        2 * floats * BLOCK_SIZE * 4
    }

    /// One layer's cache tensors, (kv * P * BLOCK_SIZE, hd) each.
    pub fn layer(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.k[layer], &self.v[layer])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cpu::kv_store::HostKv;

    /// The device layout (tensors, `slice_set`, `index_select`: what a GPU runs) stores and
    /// gathers exactly what the host layout does. Exercised here with CPU tensors.
    #[test]
    fn device_and_host_stores_agree() {
        let (layers, kv, hd, blocks) = (2, 3, 8, 6);
        let dev = Device::Cpu;
        let mut host = HostKv::new(&vec![(kv, hd); layers], blocks);
        let mut device = DeviceKv::new(&dev, &vec![(kv, hd); layers], blocks).unwrap();
        assert_eq!((host.blocks(), device.blocks()), (blocks, blocks));
        // A sequence in blocks 4, 1, 5: 40 tokens written in two steps, crossing blocks.
        let slots: Vec<u32> = [4u32, 1, 5]
            .iter()
            .flat_map(|b| (0..16).map(move |r| b * 16 + r))
            .take(40)
            .collect();
        let n = slots.len();
        for (from, to) in [(0, 23), (23, n)] {
            let m = to - from;
            let k = Tensor::arange(0f32, (m * kv * hd) as f32, &dev)
                .unwrap()
                .reshape((m, kv * hd))
                .unwrap();
            let v = (k.clone() * -1.0).unwrap();
            host.write(1, &k, &v, &slots[from..to]).unwrap();
            let plan = device.plan_write(&slots[from..to], &dev, false).unwrap();
            device.write(1, &k, &v, &plan, &Default::default()).unwrap();
        }
        let rows = host.gather_rows(1, &slots);
        assert_eq!(rows, device.gather_rows(1, &slots));
        let (hk, hv) = host.gather(1, &rows).unwrap();
        let (dk, dv) = device.gather(1, &rows, None, &dev).unwrap();
        assert_eq!(hk.dims(), &[kv, n, hd]);
        for (a, b) in [(hk, dk), (hv, dv)] {
            let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(a, b);
        }
        // A decode pass of three sequences, one token each, in three blocks, one of them over
        // a value already there; then the whole pools compared.
        let scattered = [slots[5], 2 * 16 + 3, 15];
        let k = (Tensor::arange(0f32, (3 * kv * hd) as f32, &dev).unwrap() + 1000.0)
            .unwrap()
            .reshape((3, kv * hd))
            .unwrap();
        let v = (k.clone() * -1.0).unwrap();
        host.write(1, &k, &v, &scattered).unwrap();
        let plan = device.plan_write(&scattered, &dev, false).unwrap();
        device.write(1, &k, &v, &plan, &Default::default()).unwrap();
        let all: Vec<u32> = (0..(blocks * 16) as u32).collect();
        let rows = host.gather_rows(1, &all);
        let (hk, hv) = host.gather(1, &rows).unwrap();
        let (dk, dv) = device.gather(1, &rows, None, &dev).unwrap();
        for (a, b) in [(hk, dk), (hv, dv)] {
            let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(a, b);
        }
        let (k1, _) = host.layer(1);
        let at = ((blocks + 2) * 16 + 3) * hd; // kv head 1, block 2, row 3
        assert_eq!(k1[at].to_f32(), (1000 + kv * hd + hd) as f32);
        // Token 30 of the second write (index 7 of it), kv head 2, value 3 of its row.
        let (k1, _) = host.layer(1);
        let (blk, r) = (slots[30] as usize / 16, slots[30] as usize % 16);
        let at = ((2 * blocks + blk) * 16 + r) * hd + 3;
        assert_eq!(k1[at].to_f32(), ((30 - 23) * kv * hd + 2 * hd + 3) as f32);
    }
}
