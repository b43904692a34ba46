//! Speed, side by side with llama.cpp on the same file, prompt, thread count and machine:
//! time to first token on a 1,000-token prompt, prefill tok/s, decode tok/s after a short and
//! after the long prompt. Medians of several runs; ratios gen / llama.cpp.
//!
//!     benches/peer/llama-cpp --build      # once, to have a peer: about 10 minutes on 2 cores
//!     cargo bench --bench speed
//!
//! Environment: GEN_BENCH_RUNS (default 3), GEN_BENCH_THREADS (2), GEN_BENCH_MAX_NEW (200),
//! GEN_BENCH_MODEL (default: the default model, fetched into gen's cache),
//! GEN_PEER: the program to compare with, called as `PEER MODEL.gguf PROMPT_FILE MAX_NEW THREADS`
//! and printing one JSON line with `prompt_tokens`, `ttft_s`, `prefill_tok_s`, `decode_tok_s`
//! (default benches/peer/llama-cpp; `none` for no peer). Without a peer (`none`, or one that
//! fails, e.g. llama.cpp not built yet) the benchmark still runs gen, says why on one stderr
//! line, and the peer's rows read "no peer".
//! The long prompt is assets/bench-prompt-1000.txt. Not a test: nothing here asserts a speed.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{env_or, fail, json_report, last_json, median};

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

/// The four numbers of a report line (gen's `--stats json`, or the peer's line).
fn sample(j: &serde_json::Value) -> Option<Sample> {
    let num = |k: &str| j[k].as_f64();
    Some(Sample {
        ttft_s: num("ttft_s")?,
        prefill_tok_s: num("prefill_tok_s")?,
        // A one-token run has no decode rate (the peer writes null).
        decode_tok_s: num("decode_tok_s").unwrap_or(f64::NAN),
        prompt_tokens: num("prompt_tokens")?,
    })
}

fn run_gen(model: &Path, prompt: &Path, max_new: usize, threads: usize) -> Sample {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gen"));
    cmd.arg("--model")
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
        .args(["--threads", &threads.to_string(), "--stats", "json"]);
    let report = json_report(&mut cmd);
    sample(&report).unwrap_or_else(|| fail(&format!("gen's report lacks a field: {report}")))
}
/// What gen is compared with: a program, and the name its rows go by.
struct Peer {
    program: PathBuf,
    label: String,
}

/// GEN_PEER (a program, or `none`), else the script in the repository. Err: why there is none.
fn peer_from_env(root: &Path) -> Result<Peer, String> {
    match std::env::var_os("GEN_PEER") {
        Some(p) if p == "none" => Err("GEN_PEER=none".into()),
        Some(p) if !p.is_empty() => {
            let program = PathBuf::from(p);
            let label = program
                .file_name()
                .map_or("peer".into(), |n| n.to_string_lossy().into_owned());
            Ok(Peer { program, label })
        }
        _ => Ok(Peer {
            program: root.join("benches").join("peer").join("llama-cpp"),
            label: "llama.cpp".into(),
        }),
    }
}

/// One run of the peer. Err: why it gave no numbers, in one line.
fn run_peer(
    peer: &Peer,
    model: &Path,
    prompt: &Path,
    max_new: usize,
    threads: usize,
) -> Result<Sample, String> {
    let shown = peer.program.display();
    let out = Command::new(&peer.program)
        .arg(model)
        .arg(prompt)
        .arg(max_new.to_string())
        .arg(threads.to_string())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {shown}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!("{shown} failed ({}): {}", out.status, last.trim()));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    last_json(&text).as_ref().and_then(sample).ok_or_else(|| {
        format!("{shown} printed no JSON line with ttft_s, prefill_tok_s and prompt_tokens")
    })
}

fn main() {
    // `cargo bench` passes --bench; a filter argument, if any, is ignored.
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let max_new: usize = env_or("GEN_BENCH_MAX_NEW", 200);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let model = common::bench_model();
    let long = common::bench_text();
    let short = std::env::temp_dir().join(format!("gen-bench-short-{}.txt", std::process::id()));
    std::fs::write(&short, "Once upon a time")
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", short.display())));
    let mut peer = peer_from_env(&root);
    let label = peer.as_ref().map_or("peer".into(), |p| p.label.clone());
    if let Err(why) = &peer {
        eprintln!("bench: no peer: {why}");
    }

    eprintln!(
        "bench: {} | {runs} runs each | {threads} threads | {max_new} new tokens | greedy",
        model.display()
    );
    let mut rows = Vec::new();
    for (prompt_label, prompt) in [("short prompt", &short), ("1,000-token prompt", &long)] {
        let mut g = Vec::new();
        let mut p = Vec::new();
        // Alternate the two tools so drift in machine load hits both alike.
        for i in 0..runs {
            g.push(run_gen(&model, prompt, max_new, threads));
            if let Ok(tool) = &peer {
                match run_peer(tool, &model, prompt, max_new, threads) {
                    Ok(sample) => p.push(sample),
                    Err(why) => {
                        eprintln!("bench: no peer: {why}");
                        peer = Err(why);
                        p.clear();
                    }
                }
            }
            eprintln!("  {prompt_label}: run {}/{runs} done", i + 1);
        }
        rows.push((
            prompt_label,
            summarise(&g),
            (!p.is_empty()).then(|| summarise(&p)),
        ));
    }
    let _ = std::fs::remove_file(&short);

    println!("| prompt | tool | prompt tokens | TTFT (s) | prefill tok/s | decode tok/s |");
    println!("|---|---|---|---|---|---|");
    for (prompt_label, g, p) in &rows {
        println!(
            "| {prompt_label} | gen | {:.0} | {:.3} | {:.1} | {:.1} |",
            g.prompt_tokens, g.ttft_s, g.prefill_tok_s, g.decode_tok_s
        );
        if let Some(p) = p {
            println!(
                "| {prompt_label} | {label} | {:.0} | {:.3} | {:.1} | {:.1} |",
                p.prompt_tokens, p.ttft_s, p.prefill_tok_s, p.decode_tok_s
            );
            println!(
                "| {prompt_label} | gen / {label} | | {:.2}x | {:.2}x | {:.2}x |",
                g.ttft_s / p.ttft_s,
                g.prefill_tok_s / p.prefill_tok_s,
                g.decode_tok_s / p.decode_tok_s
            );
        } else {
            println!("| {prompt_label} | {label} | no peer | no peer | no peer | no peer |");
            println!("| {prompt_label} | gen / {label} | | no peer | no peer | no peer |");
        }
    }
}
