//! Batch throughput: 64 prompts of mixed length (20 to 400 tokens), 128 new tokens each,
//! greedy, run by `gen --batch` at several batch sizes and, for comparison, by running gen once
//! per prompt as a shell loop would. Aggregate tok/s = generated tokens / wall time, model load
//! included for both. GEN_BENCH_RUNS rounds (default 1), each running the loop and then every
//! batch size, so that ratios compare runs made close together; medians over rounds.
//!
//!     cargo bench --bench batch
//!
//! Environment: GEN_BENCH_RUNS (1), GEN_BENCH_THREADS (2), GEN_BENCH_PROMPTS (64),
//! GEN_BENCH_MAX_NEW (128), GEN_BENCH_SIZES (1,4,8,16), GEN_BENCH_MODEL (default model),
//! GEN_BENCH_SKIP_LOOP (set: skip the one-process-per-prompt runs, for quick batch-only
//! measurements), GEN_BENCH_KEEP (set: keep the prompt files and print where they are).
//! The prompts are cut from assets/bench-prompt-1000.txt; there is no peer here (gen against gen).
//! Not a test: nothing here asserts a speed.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use candle_core::Device;
use common::{env_or, median};

/// `count` prompts cut from the benchmark text, lengths spread evenly over 20..=400 tokens and
/// shuffled (a fixed permutation) so short and long ones alternate.
fn prompts(model: &Path, text: &str, count: usize) -> Vec<String> {
    let loaded = gen::model::load_gguf(model, &Device::Cpu, None).expect("load the model");
    let ids = loaded.tokenizer.encode(text, false).expect("tokenize");
    let mut out: Vec<String> = (0..count)
        .map(|i| {
            let len = 20 + (380 * i) / (count - 1).max(1);
            let start = (i * 37) % (ids.len() - len.min(ids.len()) + 1);
            loaded
                .tokenizer
                .decode(&ids[start..start + len.min(ids.len())])
                .expect("decode")
        })
        .collect();
    // A fixed shuffle: stride through the list with a step coprime to its length.
    let step = (1..count)
        .rev()
        .find(|s| gcd(*s, count) == 1 && *s > count / 3)
        .unwrap_or(1);
    out = (0..count)
        .map(|i| out[(i * step) % count].clone())
        .collect();
    out
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn gen_cmd(model: &Path, threads: usize, max_new: usize) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gen"));
    c.arg("--model")
        .arg(model)
        .args(["--temperature", "0", "--ignore-eos", "--max-new"])
        .arg(max_new.to_string())
        .args(["--threads", &threads.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    c
}

fn main() {
    let runs: usize = env_or("GEN_BENCH_RUNS", 1);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let count: usize = env_or("GEN_BENCH_PROMPTS", 64);
    let max_new: usize = env_or("GEN_BENCH_MAX_NEW", 128);
    let sizes: Vec<usize> = std::env::var("GEN_BENCH_SIZES")
        .unwrap_or_else(|_| "1,4,8,16".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let model = common::bench_model();
    let text_path = common::bench_text();
    let text = std::fs::read_to_string(&text_path)
        .unwrap_or_else(|e| common::fail(&format!("cannot read {}: {e}", text_path.display())));
    let prompts = prompts(&model, &text, count);
    let dir = std::env::temp_dir().join(format!("gen-bench-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let jsonl = dir.join("prompts.jsonl");
    let mut lines = String::new();
    for p in &prompts {
        lines.push_str(&serde_json::json!({ "prompt": p }).to_string());
        lines.push('\n');
    }
    std::fs::write(&jsonl, lines).unwrap();
    let files: Vec<PathBuf> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let f = dir.join(format!("p{i}.txt"));
            std::fs::write(&f, p).unwrap();
            f
        })
        .collect();
    let generated = (count * max_new) as f64;
    eprintln!(
        "bench: {} | {count} prompts, {max_new} new tokens each | {threads} threads | {runs} runs",
        model.display()
    );

    // Rounds: in each, the one-process-per-prompt loop, then every batch size. The machine's
    // speed drifts by 10-30% over minutes, so each round's ratios compare runs made minutes
    // apart, and the table reports the median of those per-round ratios.
    let skip_loop = std::env::var_os("GEN_BENCH_SKIP_LOOP").is_some();
    let mut loop_s = Vec::new();
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    let mut ratio: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    let mut passes = vec![0.0; sizes.len()];
    let mut peak = vec![0.0; sizes.len()];
    let mut prompt_tokens = 0.0;
    for r in 0..runs {
        let round_loop = if skip_loop {
            f64::NAN
        } else {
            // One process per prompt, one after the other.
            let start = Instant::now();
            for f in &files {
                let st = gen_cmd(&model, threads, max_new)
                    .arg("--prompt-file")
                    .arg(f)
                    .arg("-q")
                    .status()
                    .expect("run gen");
                assert!(st.success());
            }
            start.elapsed().as_secs_f64()
        };
        loop_s.push(round_loop);
        eprintln!("  round {}/{runs}: one at a time {round_loop:.1} s", r + 1);
        for (i, &b) in sizes.iter().enumerate() {
            let start = Instant::now();
            let out = gen_cmd(&model, threads, max_new)
                .arg("--batch")
                .arg(&jsonl)
                .args(["--batch-size", &b.to_string(), "--stats", "json"])
                .output()
                .expect("run gen --batch");
            let w = start.elapsed().as_secs_f64();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "gen --batch failed: {err}");
            let j: serde_json::Value = serde_json::from_str(
                err.lines()
                    .rev()
                    .find(|l| l.starts_with('{'))
                    .expect("a JSON report"),
            )
            .unwrap();
            passes[i] = j["forward_passes"].as_f64().unwrap();
            peak[i] = j["kv_peak_bytes"].as_f64().unwrap() / (1024.0 * 1024.0);
            prompt_tokens = j["prompt_tokens"].as_f64().unwrap();
            wall[i].push(w);
            ratio[i].push(round_loop / w);
            eprintln!("  round {}/{runs}: batch size {b} {w:.1} s", r + 1);
        }
    }
    let loop_s = median(loop_s);
    if std::env::var_os("GEN_BENCH_KEEP").is_some() {
        eprintln!("bench: prompts kept in {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }

    println!(
        "{count} prompts ({prompt_tokens:.0} prompt tokens in all), {max_new} new tokens each, \
         {threads} threads"
    );
    println!();
    println!("| run | wall time (s) | aggregate tok/s | vs one at a time | forward passes | peak KV cache (MiB) |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| gen once per prompt | {loop_s:.1} | {:.1} | 1.00x | {} | |",
        generated / loop_s,
        count * max_new
    );
    for (i, &b) in sizes.iter().enumerate() {
        let w = median(wall[i].clone());
        println!(
            "| gen --batch, batch size {b} | {w:.1} | {:.1} | {:.2}x | {:.0} | {:.1} |",
            generated / w,
            median(ratio[i].clone()),
            passes[i],
            peak[i]
        );
    }
    println!();
    println!("(wall times: medians over {runs} rounds; \"vs one at a time\": median of each round's ratio)");
}
