//! Speed, side by side with llama.cpp on the same file, prompt, thread count and machine:
//! time to first token on a 1,000-token prompt, prefill tok/s, decode tok/s after a short and
//! after the long prompt. Medians of several runs; ratios gen / llama.cpp.
//!
//!     cargo bench --bench speed
//!
//! Environment: GEN_BENCH_RUNS (default 3), GEN_BENCH_THREADS (2), GEN_BENCH_MAX_NEW (200),
//! GEN_BENCH_MODEL (default: the default model, fetched into gen's cache),
//! GEN_PEER (default ../shared/bench/peer-llama-cpp; set to "none" to skip the peer).
//! Not a test: nothing here asserts a speed.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{env_or, median};

#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    ttft_s: f64,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    prompt_tokens: f64,
}

fn summarise(samples: &[Sample]) -> Sample {
    Sample {
        ttft_s: median(samples.iter().map(|s| s.ttft_s).collect()),
        prefill_tok_s: median(samples.iter().map(|s| s.prefill_tok_s).collect()),
        decode_tok_s: median(samples.iter().map(|s| s.decode_tok_s).collect()),
        prompt_tokens: median(samples.iter().map(|s| s.prompt_tokens).collect()),
    }
}

fn last_json(text: &str) -> serde_json::Value {
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line in:\n{text}"));
    serde_json::from_str(line).unwrap()
}

fn run_gen(model: &Path, prompt: &Path, max_new: usize, threads: usize) -> Sample {
    let out = Command::new(env!("CARGO_BIN_EXE_gen"))
        .arg("--model")
        .arg(model)
        .arg("--prompt-file")
        .arg(prompt)
        .args([
            "--max-new",
            &max_new.to_string(),
            "--temperature",
            "0",
            "--ignore-eos",
        ])
        .args(["--threads", &threads.to_string(), "--stats", "json"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .expect("run gen");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gen failed: {err}");
    let j = last_json(&err);
    Sample {
        ttft_s: j["ttft_s"].as_f64().unwrap(),
        prefill_tok_s: j["prefill_tok_s"].as_f64().unwrap(),
        decode_tok_s: j["decode_tok_s"].as_f64().unwrap(),
        prompt_tokens: j["prompt_tokens"].as_f64().unwrap(),
    }
}

fn run_peer(peer: &Path, model: &Path, prompt: &Path, max_new: usize, threads: usize) -> Sample {
    let out = Command::new(peer)
        .arg(model)
        .arg(prompt)
        .arg(max_new.to_string())
        .arg(threads.to_string())
        .stdin(Stdio::null())
        .output()
        .expect("run the peer");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "peer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = last_json(&text);
    Sample {
        ttft_s: j["ttft_s"].as_f64().unwrap(),
        prefill_tok_s: j["prefill_tok_s"].as_f64().unwrap(),
        decode_tok_s: j["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
        prompt_tokens: j["prompt_tokens"].as_f64().unwrap(),
    }
}

fn main() {
    // `cargo bench` passes --bench; a filter argument, if any, is ignored.
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let max_new: usize = env_or("GEN_BENCH_MAX_NEW", 200);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let model = common::bench_model();
    let long = root.join("../shared/bench/prompt-1000.txt");
    let short = std::env::temp_dir().join(format!("gen-bench-short-{}.txt", std::process::id()));
    std::fs::write(&short, "Once upon a time").unwrap();
    let peer = match std::env::var("GEN_PEER") {
        Ok(p) if p == "none" => None,
        Ok(p) => Some(PathBuf::from(p)),
        Err(_) => Some(root.join("../shared/bench/peer-llama-cpp")).filter(|p| p.exists()),
    };

    eprintln!(
        "bench: {} | {runs} runs each | {threads} threads | {max_new} new tokens | greedy",
        model.display()
    );
    let mut rows = Vec::new();
    for (label, prompt) in [("short prompt", &short), ("1,000-token prompt", &long)] {
        let mut g = Vec::new();
        let mut p = Vec::new();
        // Alternate the two tools so drift in machine load hits both alike.
        for i in 0..runs {
            g.push(run_gen(&model, prompt, max_new, threads));
            if let Some(peer) = &peer {
                p.push(run_peer(peer, &model, prompt, max_new, threads));
            }
            eprintln!("  {label}: run {}/{runs} done", i + 1);
        }
        rows.push((label, summarise(&g), (!p.is_empty()).then(|| summarise(&p))));
    }
    let _ = std::fs::remove_file(&short);

    println!("| prompt | tool | prompt tokens | TTFT (s) | prefill tok/s | decode tok/s |");
    println!("|---|---|---|---|---|---|");
    for (label, g, p) in &rows {
        println!(
            "| {label} | gen | {:.0} | {:.3} | {:.1} | {:.1} |",
            g.prompt_tokens, g.ttft_s, g.prefill_tok_s, g.decode_tok_s
        );
        if let Some(p) = p {
            println!(
                "| {label} | llama.cpp | {:.0} | {:.3} | {:.1} | {:.1} |",
                p.prompt_tokens, p.ttft_s, p.prefill_tok_s, p.decode_tok_s
            );
            println!(
                "| {label} | gen / llama.cpp | | {:.2}x | {:.2}x | {:.2}x |",
                g.ttft_s / p.ttft_s,
                g.prefill_tok_s / p.prefill_tok_s,
                g.decode_tok_s / p.decode_tok_s
            );
        }
    }
}
