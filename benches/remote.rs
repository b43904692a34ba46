//! The same batch locally and on a server: gen's own `--batch` against `gen --endpoint` at
//! llama.cpp's llama-server (built by .ci/llama-server; 32 slots) on this machine, at
//! concurrency 1, 8 and 32, same prompts, greedy. Prints wall time and generated tok/s of each.
//!
//!     cargo bench --bench remote
//!
//! Environment: GEN_BENCH_THREADS (2), GEN_BENCH_PROMPTS (32), GEN_BENCH_MAX_NEW (64).
//! Not a test: nothing here asserts a speed.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{env_or, fail, last_json};

const TOPICS: [&str; 8] = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe the city of Paris.",
    "Give advice to a new programmer.",
    "What is the water cycle?",
    "Tell me about the history of tea.",
    "Why is the sky blue?",
    "Describe your ideal weekend.",
];

/// Wall seconds and generated tokens of one `gen --batch` run with `args`.
fn run(args: &[&str], input: &str, threads: usize) -> (f64, f64) {
    let start = Instant::now();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gen"));
    cmd.args(args)
        .args(["--batch", "-", "--temperature", "0", "--stats", "json"])
        .args(["--threads", &threads.to_string()]);
    let out = common::with_stdin(&mut cmd, input);
    let wall = start.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        fail(&format!("gen {args:?} failed: {}", err.trim()));
    }
    let report = last_json(&err).unwrap_or_else(|| fail(&format!("no report: {err}")));
    (
        wall,
        report["generated_tokens"].as_f64().unwrap_or(f64::NAN),
    )
}

fn main() {
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let n: usize = env_or("GEN_BENCH_PROMPTS", 32);
    let max_new: usize = env_or("GEN_BENCH_MAX_NEW", 64);
    let model = common::bench_model();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/llama-server");
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| fail(&format!("cannot run {}: {e}", script.display())));
    let server_bin = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| fail(&e.to_string()));
    let mut server = Command::new(&server_bin)
        .arg("-m")
        .arg(&model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["-np", "32", "-c", "32768", "-t", &threads.to_string()])
        // As in tests/remote.rs: this llama.cpp's AMX buffer crashes the server on an AMX Xeon.
        .arg("--no-repack")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| fail(&format!("cannot start {server_bin}: {e}")));
    let health = format!("http://127.0.0.1:{port}/health");
    let deadline = Instant::now() + Duration::from_secs(120);
    while ureq::get(&health).call().is_err() {
        if Instant::now() > deadline {
            let _ = server.kill();
            fail("llama-server did not become healthy");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let input: String = (0..n)
        .map(|i| format!("{}\n", serde_json::json!({"prompt": format!("{} ({i})", TOPICS[i % 8]), "max_new": max_new})))
        .collect();
    let url = format!("http://127.0.0.1:{port}/v1");
    let model_arg = model.to_string_lossy().to_string();
    eprintln!("bench: {n} prompts x {max_new} new tokens, greedy, {threads} threads");
    println!("| run | wall s | generated tokens | tok/s |");
    println!("|---|---|---|---|");
    let cases: Vec<(String, Vec<String>)> = vec![
        (
            "gen local, --batch-size 8".into(),
            vec!["--model".into(), model_arg.clone()],
        ),
        (
            "gen --endpoint llama-server, --concurrency 1".into(),
            vec![
                "--endpoint".into(),
                url.clone(),
                "--concurrency".into(),
                "1".into(),
            ],
        ),
        (
            "gen --endpoint llama-server, --concurrency 8".into(),
            vec![
                "--endpoint".into(),
                url.clone(),
                "--concurrency".into(),
                "8".into(),
            ],
        ),
        (
            "gen --endpoint llama-server, --concurrency 32".into(),
            vec![
                "--endpoint".into(),
                url.clone(),
                "--concurrency".into(),
                "32".into(),
            ],
        ),
    ];
    for (label, args) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (wall, tokens) = run(&args, &input, threads);
        println!(
            "| {label} | {wall:.2} | {tokens:.0} | {:.1} |",
            tokens / wall
        );
    }
    let _ = server.kill();
    let _ = server.wait();
}
