//! The CPU matrix kernels alone: y = x W^T for the default model's layer shapes, Q4_1 and
//! Q8_0 weights, at several token counts (1 and 8: decode steps; 64 and 512: prefill), on 1
//! thread and on GEN_BENCH_THREADS (2). Prints GMAC/s (multiply-adds per second) per shape,
//! the median of GEN_BENCH_REPS timed calls after a warm-up.
//!
//!     cargo bench --bench matmul
//!
//! Then every GGUF type gen runs (GEN_BENCH_TYPES=0 skips it) on a K-quant-shaped matrix
//! (5,632 x 1,024: a 1B-class model's fused gate+up; GEN_BENCH_N and GEN_BENCH_K change it), on
//! GEN_BENCH_THREADS: one token with the weights from memory (GB/s of weight bytes) and 512
//! tokens (GMAC/s, the median call and the best).
//!
//! GEN_BENCH_SHAPES=0 skips the first table; GEN_BENCH_TYPE=Q6_K measures only the types whose
//! name contains it.
//!
//! A yardstick for kernel work, not a test: nothing here asserts a speed.

mod common;

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{data, env_or, median};
use gen::model::cpu::matmul::{CpuQWeight, Kernel};
use gen::model::cpu::quants::{random_blocks, QType};
use gen::model::qlinear::{DeviceWeights, QLinear};

fn main() {
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let reps: usize = env_or("GEN_BENCH_REPS", 9);
    // (name, N, K): SmolLM2-135M's fused gate+up, down, fused q/k/v, and the output layer.
    let shapes = [
        ("gate+up", 3072, 576, GgmlDType::Q4_1),
        ("down", 576, 1536, GgmlDType::Q4_1),
        ("q/k/v", 960, 576, GgmlDType::Q4_1),
        ("logits", 49152, 576, GgmlDType::Q8_0),
    ];
    let kernel = Kernel::detect();
    println!("kernel {}", kernel.name());
    println!("| shape | tokens | threads | weights | ms a call | GMAC/s |");
    println!("|---|---|---|---|---|---|");
    let shapes = if env_or("GEN_BENCH_SHAPES", 1) == 1 {
        &shapes[..]
    } else {
        &[]
    };
    for nthreads in [1, threads] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(nthreads)
            .build()
            .expect("thread pool");
        for &(name, n, k, dtype) in shapes {
            let w = Tensor::from_vec(data(n * k, 7), (n, k), &Device::Cpu).unwrap();
            // Copies enough to overflow the last-level cache, cycled through as a decode pass
            // cycles through its layers, so the weights come from memory ("cold"), or the
            // first one again and again, its weights in cache ("warm").
            let bytes = n * k * if dtype == GgmlDType::Q8_0 { 34 } else { 20 } / 32;
            let copies = (96 << 20) / bytes + 1;
            let cold: Vec<QLinear> = (0..copies)
                .map(|_| {
                    QLinear::with_kernel(
                        QTensor::quantize(&w, dtype).unwrap(),
                        &Device::Cpu,
                        kernel,
                        DeviceWeights::Quantized,
                    )
                    .unwrap()
                })
                .collect();
            for t in [1usize, 8, 64, 512] {
                if name == "logits" && t > 8 {
                    continue;
                }
                let x = Tensor::from_vec(data(t * k, 11), (t, k), &Device::Cpu).unwrap();
                for (mode, set) in [("warm", &cold[..1]), ("cold", &cold[..])] {
                    let times: Vec<f64> = pool.install(|| {
                        set[0].forward(&x).unwrap();
                        (0..reps.max(set.len()))
                            .map(|i| {
                                let start = Instant::now();
                                std::hint::black_box(set[i % set.len()].forward(&x).unwrap());
                                start.elapsed().as_secs_f64()
                            })
                            .collect()
                    });
                    let s = median(times);
                    let macs = (t * n * k) as f64;
                    println!(
                        "| {name} {n}x{k} | {t} | {nthreads} | {mode} | {:.3} | {:.1} |",
                        s * 1e3,
                        macs / s / 1e9
                    );
                }
            }
        }
    }
    if env_or("GEN_BENCH_TYPES", 1) == 1 {
        every_type(threads, reps, kernel);
    }
}

/// One row per type: decode-like (T = 1, weights cycled from memory) and prefill-like.
fn every_type(threads: usize, reps: usize, kernel: Kernel) {
    let (n, k) = (env_or("GEN_BENCH_N", 5632), env_or("GEN_BENCH_K", 1024));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    println!();
    println!("| type | bytes | T=1 ms | T=1 GB/s | T=512 ms | T=512 GMAC/s | T=512 best GMAC/s |");
    println!("|---|---|---|---|---|---|---|");
    type Make = Box<dyn Fn(u64) -> Vec<u8>>;
    let mut types: Vec<(String, u32, Make)> = Vec::new();
    for (name, dt, id) in [("Q4_1", GgmlDType::Q4_1, 3), ("Q8_0", GgmlDType::Q8_0, 8)] {
        types.push((
            name.into(),
            id,
            Box::new(move |seed| {
                let w = Tensor::from_vec(data(n * k, seed), (n, k), &Device::Cpu).unwrap();
                QTensor::quantize(&w, dt).unwrap().data().unwrap().to_vec()
            }),
        ));
    }
    for (name, id) in [("F16", 1u32), ("BF16", 30)] {
        types.push((
            name.into(),
            id,
            Box::new(move |seed| {
                let f = |v: f32| {
                    if id == 1 {
                        half::f16::from_f32(v).to_bits()
                    } else {
                        half::bf16::from_f32(v).to_bits()
                    }
                };
                data(n * k, seed)
                    .into_iter()
                    .flat_map(|v| f(v).to_le_bytes())
                    .collect()
            }),
        ));
    }
    for q in QType::ALL {
        types.push((
            q.spec().name.into(),
            q.spec().ggml,
            Box::new(move |seed| random_blocks(q, n, k, seed)),
        ));
    }
    let only = std::env::var("GEN_BENCH_TYPE").unwrap_or_default();
    for (name, id, make) in types.iter().filter(|t| t.0.contains(&only)) {
        let raw = make(7);
        // GEN_BENCH_WARM=1: one copy (T=1 from cache: a quick look at compute alone).
        let copies = if env_or("GEN_BENCH_WARM", 0) == 1 {
            1
        } else {
            (160 << 20) / raw.len() + 1
        };
        let ws: Vec<CpuQWeight> = (0..copies)
            .map(|i| {
                CpuQWeight::from_raw(*id, &make(7 + i as u64), n, k, kernel)
                    .unwrap()
                    .unwrap()
            })
            .collect();
        let time = |t: usize, set: &[CpuQWeight]| {
            let x = data(t * k, 11);
            let times: Vec<f64> = pool.install(|| {
                set[0].matmul(&x, t);
                (0..reps.max(set.len()))
                    .map(|i| {
                        let start = Instant::now();
                        std::hint::black_box(set[i % set.len()].matmul(&x, t));
                        start.elapsed().as_secs_f64()
                    })
                    .collect()
            });
            let best = times.iter().copied().fold(f64::INFINITY, f64::min);
            (median(times), best)
        };
        let ((one, _), (many, best)) = (time(1, &ws), time(512, &ws[..1]));
        // The best call as well as the median: on a shared machine, the one least disturbed.
        let macs = (512 * n * k) as f64;
        println!(
            "| {name} | {} | {:.3} | {:.1} | {:.2} | {:.1} | {:.1} |",
            raw.len(),
            one * 1e3,
            raw.len() as f64 / one / 1e9,
            many * 1e3,
            macs / many / 1e9,
            macs / best / 1e9
        );
    }
}
