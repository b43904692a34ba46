//! Work not done twice, measured with the release binary (issue 18's targets):
//!
//! 1. Shared prefixes: 64 prompts made of one shared 600-token instruction and a question of
//!    its own each (20 to 80 tokens), 64 new tokens each, batch size 8, greedy: `gen --batch`
//!    with the prefix cache and with `--no-prefix-cache`, alternating within each round (the
//!    order flips every round), throughput = generated tokens / wall time (model load
//!    included), and the replies compared. Beside it, llama.cpp's `llama-batched-bench -pps`
//!    on the nearest shape it has (8 sequences of one shared 640-token prompt, 64 tokens each):
//!    it shares the whole prompt, gen only what the prompts really have in common; gen is also run
//!    on exactly that shape (8 copies of one 640-token prompt), timed as a run (load excluded).
//! 2. `--prompt-cache`: a run over the 1,000-token benchmark prompt that writes the file, then
//!    one that uses it; time to first token of each (the second's includes reading the file)
//!    and their texts compared.
//!
//!     cargo bench --bench prefix
//!
//! Environment: GEN_BENCH_RUNS (3), GEN_BENCH_THREADS (2), GEN_BENCH_MODEL (default model),
//! GEN_LLAMA_BATCHED_BENCH (llama-batched-bench; default: where `.ci/llama-server
//! llama-batched-bench` builds it; skipped when absent). Medians over rounds. Not a test: nothing here asserts a
//! speed; it stops with an error if the replies differ.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use candle_core::Device;
use common::{env_or, median};

/// The 64 prompts: the instruction (the first 600 tokens of the benchmark text), then
/// "Question N:" and 20 to 80 tokens cut from the rest of the text.
fn prompts(model: &Path, text: &str) -> Vec<String> {
    let loaded = gen::model::load_gguf(model, &Device::Cpu, None).expect("load the model");
    let ids = loaded.tokenizer.encode(text, false).expect("tokenize");
    let decode = |r: std::ops::Range<usize>| loaded.tokenizer.decode(&ids[r]).expect("decode");
    let instruction = decode(0..600);
    (0..64)
        .map(|i| {
            let len = 20 + (i * 37) % 61;
            let start = 600 + (i * 13) % (ids.len() - 600 - len);
            format!(
                "{instruction}\n\nQuestion {}: what does this mean? {}",
                i + 1,
                decode(start..start + len)
            )
        })
        .collect()
}

fn gen(model: &Path, threads: usize) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gen"));
    c.arg("--model")
        .arg(model)
        .args(["--temperature", "0", "--threads", &threads.to_string()])
        .args(["--stats", "json"]);
    c
}

/// One `--batch` run: (wall seconds, replies, report).
fn batch_run(
    model: &Path,
    threads: usize,
    jsonl: &Path,
    cache: bool,
) -> (f64, Vec<String>, serde_json::Value) {
    let mut c = gen(model, threads);
    c.arg("--batch")
        .arg(jsonl)
        .args(["--batch-size", "8", "--max-new", "64", "--ignore-eos"]);
    if !cache {
        c.arg("--no-prefix-cache");
    }
    let start = Instant::now();
    let out = c.output().expect("run gen");
    let wall = start.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        common::fail(&format!("gen --batch failed: {err}"));
    }
    let texts = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["text"].as_str().unwrap_or_default().to_string()
        })
        .collect();
    let report = common::last_json(&err).unwrap_or_else(|| common::fail("no report"));
    (wall, texts, report)
}

fn shared_prefixes(model: &Path, threads: usize, runs: usize, dir: &Path) {
    let text = std::fs::read_to_string(common::bench_text()).expect("the benchmark text");
    let jsonl = dir.join("prompts.jsonl");
    let lines: String = prompts(model, &text)
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string() + "\n")
        .collect();
    std::fs::write(&jsonl, lines).unwrap();
    let generated = 64.0 * 64.0;
    let (mut with, mut without, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    let mut cached = 0.0;
    let mut prompt_tokens = 0.0;
    for r in 0..runs {
        let order = if r % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        let mut walls = [0.0; 2];
        let mut replies: Vec<Vec<String>> = vec![Vec::new(); 2];
        for cache in order {
            let (wall, texts, report) = batch_run(model, threads, &jsonl, cache);
            walls[cache as usize] = wall;
            replies[cache as usize] = texts;
            if cache {
                cached = report["cached_tokens"].as_f64().unwrap_or(0.0);
                prompt_tokens = report["prompt_tokens"].as_f64().unwrap_or(0.0);
            }
        }
        if replies[0] != replies[1] {
            common::fail("the replies with and without the prefix cache differ");
        }
        let (on, off) = (generated / walls[1], generated / walls[0]);
        eprintln!(
            "  round {}/{runs}: prefix cache {on:.1} tok/s, --no-prefix-cache {off:.1} tok/s",
            r + 1
        );
        with.push(on);
        without.push(off);
        ratio.push(on / off);
    }
    println!(
        "shared 600-token instruction, 64 prompts x 64 new tokens, batch 8, {threads} threads"
    );
    println!(
        "  prompt tokens {prompt_tokens:.0}, of which from the prefix cache {cached:.0} ({:.0}%); replies identical",
        100.0 * cached / prompt_tokens.max(1.0)
    );
    println!(
        "  gen prefix cache {:.1} tok/s | --no-prefix-cache {:.1} tok/s | ratio {:.2}x (median of {runs} rounds)",
        median(with),
        median(without),
        median(ratio)
    );
    same_shape_as_peer(model, threads, &text, dir);
    peer_batched_bench(model, threads);
}

/// llama-batched-bench's shape for gen: 8 copies of one 640-token prompt, 64 tokens each, batch
/// 8; generated tokens over the run's own time (the report's, model load excluded).
fn same_shape_as_peer(model: &Path, threads: usize, text: &str, dir: &Path) {
    let loaded = gen::model::load_gguf(model, &Device::Cpu, None).expect("load the model");
    let ids = loaded.tokenizer.encode(text, false).expect("tokenize");
    let prompt = loaded.tokenizer.decode(&ids[..640]).expect("decode");
    let line = serde_json::json!({ "prompt": prompt }).to_string() + "\n";
    let jsonl = dir.join("same-shape.jsonl");
    std::fs::write(&jsonl, line.repeat(8)).unwrap();
    let (_, _, report) = batch_run(model, threads, &jsonl, true);
    let total = report["total_s"].as_f64().unwrap_or(f64::NAN);
    println!(
        "  gen on that shape (8 x (640 shared + 64), batch 8, prefix cache): {:.1} tok/s generated over the whole wave ({total:.2} s)",
        512.0 / total
    );
}

/// llama-batched-bench -pps: 8 sequences of one shared 640-token prompt, 64 tokens each.
fn peer_batched_bench(model: &Path, threads: usize) {
    let bin = std::env::var_os("GEN_LLAMA_BATCHED_BENCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_default();
            Path::new(&home)
                .join(".cache/gen-peer/llama-server-0.3.36/llama.cpp/build/bin/llama-batched-bench")
        });
    if !bin.exists() {
        println!("  llama-batched-bench: not found (set GEN_LLAMA_BATCHED_BENCH), skipped");
        return;
    }
    // One that dies with weight repacking runs again without it (`common::peer_run`).
    let (out, _) = common::peer_run("llama-batched-bench", |repack| {
        let mut c = Command::new(&bin);
        c.arg("-m")
            .arg(model)
            .args([
                "-c", "8192", "-b", "2048", "-ub", "512", "-npp", "640", "-ntg", "64",
            ])
            .args(["-npl", "8", "-pps", "--output-format", "jsonl"])
            .args(["-t", &threads.to_string()]);
        if !repack {
            c.arg("--no-repack");
        }
        c
    })
    .expect("run llama-batched-bench");
    // Its JSON line comes on stdout or stderr, depending on the build's logging.
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match common::last_json(&text) {
        Some(v) => println!(
            "  llama-batched-bench -pps (8 x (640 shared + 64)): prompt {:.2} s, then {:.1} tok/s generating; {:.1} tok/s generated over the whole wave",
            v["t_pp"].as_f64().unwrap_or(f64::NAN),
            v["speed_tg"].as_f64().unwrap_or(f64::NAN),
            8.0 * 64.0 / v["t"].as_f64().unwrap_or(f64::NAN)
        ),
        None => println!("  llama-batched-bench: no result"),
    }
}

/// One run over the 1,000-token prompt with `--prompt-cache FILE`: (time to first token in
/// seconds, text, prompt tokens from the file).
fn cache_run(model: &Path, threads: usize, file: &Path) -> (f64, String, f64) {
    let out = gen(model, threads)
        .arg("--prompt-file")
        .arg(common::bench_text())
        .args(["--max-new", "32", "--ignore-eos", "--prompt-cache"])
        .arg(file)
        .output()
        .expect("run gen");
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        common::fail(&format!("gen --prompt-cache failed: {err}"));
    }
    let report = common::last_json(&err).unwrap_or_else(|| common::fail("no report"));
    (
        report["ttft_s"].as_f64().unwrap_or(f64::NAN),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        report["cached_tokens"].as_f64().unwrap_or(0.0),
    )
}

fn prompt_cache(model: &Path, threads: usize, runs: usize, dir: &Path) {
    let file = dir.join("prompt.cache");
    let (mut first, mut second, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    let mut cached = 0.0;
    for r in 0..runs {
        let _ = std::fs::remove_file(&file);
        let (t1, text1, _) = cache_run(model, threads, &file);
        let (t2, text2, c) = cache_run(model, threads, &file);
        if text1 != text2 {
            common::fail("the run from the prompt cache wrote another text");
        }
        cached = c;
        eprintln!(
            "  round {}/{runs}: first token {:.1} ms, then {:.1} ms from the file",
            r + 1,
            t1 * 1e3,
            t2 * 1e3
        );
        first.push(t1);
        second.push(t2);
        ratio.push(t2 / t1);
    }
    let size = std::fs::metadata(&file).map_or(0, |m| m.len());
    println!("--prompt-cache over the 1,000-token prompt, {threads} threads");
    println!(
        "  first run {:.1} ms to the first token | second {:.1} ms ({cached:.0} tokens from a {:.1} MB file) | ratio {:.3} (median of {runs}); texts identical",
        median(first) * 1e3,
        median(second) * 1e3,
        size as f64 / 1e6,
        median(ratio)
    );
}

fn main() {
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let model = common::bench_model();
    let dir = std::env::temp_dir().join(format!("gen-bench-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    eprintln!(
        "bench: {} | {threads} threads | {runs} rounds",
        model.display()
    );
    shared_prefixes(&model, threads, runs, &dir);
    prompt_cache(&model, threads, runs, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}
