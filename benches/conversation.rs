//! A conversation's later turns, measured with the release binary (issue 56's reuse target):
//! `gen chat` reading ten user turns from standard input (a scripted session), each about 380
//! tokens cut from the benchmark text, 24 new tokens a reply (greedy, end of sequence
//! ignored), so that turn 10 begins about 4,000 tokens into the conversation. Each turn's
//! status line gives its time to first token and the tokens it prefilled and reused. The same
//! session with `--no-prefix-cache` is what re-processing costs (every turn prefills the
//! whole conversation). Reported per model: turn 2's and turn 10's first-token times, their
//! ratio, and the same for the run without the cache; medians over rounds.
//!
//!     GEN_BENCH_CHAT_MODELS="A.gguf B.gguf" cargo bench --bench conversation
//!
//! GEN_BENCH_CHAT_MODELS: the files (default: the Qwen3.5- and Gemma 4-shaped files of
//! `benches/hybrid-files`, where it has written them, else the default model).
//! GEN_BENCH_RUNS (3), GEN_BENCH_THREADS (2). Not a test: nothing here asserts a speed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{env_or, median};

const TURNS: usize = 10;

/// Ten user turns of about 380 tokens of the benchmark text each (SmolLM2's tokenizer: some
/// 1,700 characters), one a line.
fn turns() -> String {
    let text = std::fs::read_to_string(common::bench_text()).expect("the benchmark text");
    let words: Vec<&str> = text.split_whitespace().collect();
    (0..TURNS)
        .map(|t| {
            let from = (t * 97) % words.len().saturating_sub(300).max(1);
            let take: Vec<&str> = words.iter().cycle().skip(from).take(290).copied().collect();
            format!("Turn {}: summarise this. {}\n", t + 1, take.join(" "))
        })
        .collect()
}

/// Per turn: (first token ms, prefilled, reused), from the session's status lines.
fn session(model: &Path, threads: usize, cache: bool, input: &str) -> Vec<(f64, usize, usize)> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gen"));
    cmd.arg("chat")
        .arg("--model")
        .arg(model)
        .args(["--temperature", "0", "--threads", &threads.to_string()])
        .args(["--max-new", "24", "--ignore-eos", "--ctx-size", "8192"]);
    if !cache {
        cmd.arg("--no-prefix-cache");
    }
    let out = common::with_stdin(&mut cmd, input);
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        common::fail(&format!("gen chat on {}: {err}", model.display()));
    }
    let num = |s: &str| -> f64 { s.trim().parse().unwrap_or(f64::NAN) };
    let rows: Vec<(f64, usize, usize)> = err
        .lines()
        .filter(|l| l.contains("tokens prefilled"))
        .map(|l| {
            let prefilled = num(l.split(" tokens prefilled").next().unwrap_or(""));
            let reused = num(l
                .split(", ")
                .nth(1)
                .and_then(|r| r.split(" reused").next())
                .unwrap_or(""));
            let ttft = num(l
                .split("first token ")
                .nth(1)
                .and_then(|r| r.split(" ms").next())
                .unwrap_or(""));
            (ttft, prefilled as usize, reused as usize)
        })
        .collect();
    if rows.len() != TURNS {
        common::fail(&format!(
            "{} status lines, expected {TURNS}: {err}",
            rows.len()
        ));
    }
    rows
}

fn models() -> Vec<PathBuf> {
    if let Ok(list) = std::env::var("GEN_BENCH_CHAT_MODELS") {
        return list.split_whitespace().map(PathBuf::from).collect();
    }
    let peer = std::env::var("GEN_PEER_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/gen-peer")
        });
    let hybrid: Vec<PathBuf> = ["qwen35-0.8b-like", "gemma4-e2b-like"]
        .iter()
        .map(|n| peer.join(format!("hybrid-v1/{n}-Q4_K_M.gguf")))
        .filter(|p| p.exists())
        .collect();
    match hybrid.is_empty() {
        true => vec![common::bench_model()],
        false => hybrid,
    }
}

fn main() {
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let input = turns();
    eprintln!(
        "bench: {TURNS} turns of about 380 tokens, 24 new each | {threads} threads | {runs} rounds"
    );
    println!("| model | prefix cache | turn 2 first token | turn 10 first token | turn 10 / turn 2 | turn 10 prefilled / reused |");
    println!("|---|---|---|---|---|---|");
    for model in models() {
        let name = model.file_name().unwrap().to_string_lossy().into_owned();
        for cache in [true, false] {
            let (mut t2, mut t10, mut last) = (Vec::new(), Vec::new(), (0, 0));
            for _ in 0..runs {
                let rows = session(&model, threads, cache, &input);
                t2.push(rows[1].0);
                t10.push(rows[TURNS - 1].0);
                last = (rows[TURNS - 1].1, rows[TURNS - 1].2);
            }
            let (a, b) = (median(t2), median(t10));
            println!(
                "| {name} | {} | {a:.0} ms | {b:.0} ms | {:.2}x | {} / {} |",
                if cache { "on" } else { "off" },
                b / a,
                last.0,
                last.1
            );
        }
    }
}
