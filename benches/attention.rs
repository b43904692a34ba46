//! The CPU attention kernels alone, at the default model's shapes (9 query heads, 3 kv heads,
//! 64 dims): a prompt's causal prefill at several lengths, and a batch of decode steps against
//! caches of several lengths. Prints ms a call and GFLOP/s (2 per multiply-add of the score
//! and value products), the median of GEN_BENCH_REPS calls after a warm-up, on
//! GEN_BENCH_THREADS (2) threads.
//!
//!     cargo bench --bench attention
//!
//! A yardstick for kernel work, not a test: nothing here asserts a speed.

mod common;

use std::time::Instant;

use common::{data, env_or, median};
use gen::model::cpu::attention::{causal_prefill_attention, paged_decode_attention, PagedQuery};
use half::f16;

const BLOCK: usize = 16;
const HEADS: usize = 9;
const KV: usize = 3;
const HD: usize = 64;

fn main() {
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let reps: usize = env_or("GEN_BENCH_REPS", 15);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    // Prefill: one sequence of up to 1,024 tokens in one run of blocks (as the KV pool lays
    // a sequence out).
    let per_seq = 1024 / BLOCK;
    let pool_len = KV * per_seq * BLOCK * HD;
    let k_pool: Vec<f16> = data(pool_len, 3)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let v_pool: Vec<f16> = data(pool_len, 5)
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let scale = 1.0 / (HD as f32).sqrt();
    let time = |f: &(dyn Fn() + Sync)| -> f64 {
        pool.install(|| {
            f();
            median(
                (0..reps)
                    .map(|_| {
                        let start = Instant::now();
                        f();
                        start.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        })
    };
    println!("threads {threads}");
    println!("| case | tokens | ms a call | GFLOP/s |");
    println!("|---|---|---|---|");
    for t in [64usize, 210, 400, 1000] {
        let q = data(t * HEADS * HD, 7);
        let blocks: Vec<u32> = (0..per_seq as u32).collect();
        let s = time(&|| {
            std::hint::black_box(causal_prefill_attention(
                &q, &blocks, 0, t, None, &k_pool, &v_pool, BLOCK, HEADS, KV, HD, scale,
            ));
        });
        // t (t + 1) / 2 query-key pairs per head, each a score and a weighted value.
        let flops = (t * (t + 1) / 2 * HEADS * HD * 2 * 2) as f64;
        println!(
            "| prefill | {t} | {:.3} | {:.1} |",
            s * 1e3,
            flops / s / 1e9
        );
    }
    // Decode: 8 steps a call against their sequences' caches, the way a pass meets them: 30
    // layers of caches (more than the last-level cache holds), one layer a call in turn.
    for len in [64usize, 275, 1000] {
        let per = len.div_ceil(BLOCK);
        let layer_len = KV * 8 * per * BLOCK * HD;
        let layers: Vec<(Vec<f16>, Vec<f16>)> = (0..30u64)
            .map(|l| {
                let k = data(layer_len, 2 * l + 1);
                let v = data(layer_len, 2 * l + 2);
                (
                    k.iter().map(|&x| f16::from_f32(x)).collect(),
                    v.iter().map(|&x| f16::from_f32(x)).collect(),
                )
            })
            .collect();
        let q = data(8 * HEADS * HD, 9);
        let tables: Vec<Vec<u32>> = (0..8)
            .map(|s| (0..per).map(|b| (s * per + b) as u32).collect())
            .collect();
        let steps: Vec<PagedQuery<'_>> = (0..8)
            .map(|i| PagedQuery {
                q: &q[i * HEADS * HD..(i + 1) * HEADS * HD],
                blocks: &tables[i],
                len,
                from: 0,
            })
            .collect();
        let s = time(&|| {
            for (k, v) in &layers {
                std::hint::black_box(paged_decode_attention(
                    &steps, k, v, BLOCK, HEADS, KV, HD, scale,
                ));
            }
        }) / layers.len() as f64;
        let flops = (8 * len * HEADS * HD * 2 * 2) as f64;
        let bytes = (8 * len * KV * HD * 2 * 2) as f64;
        println!(
            "| decode, 8 steps, per layer | {len} | {:.3} | {:.1} ({:.1} GB/s of cache) |",
            s * 1e3,
            flops / s / 1e9,
            bytes / s / 1e9
        );
    }
}
