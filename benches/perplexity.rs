//! `gen perplexity` beside llama.cpp's llama-perplexity on the same text, model, context and
//! threads, alternating run by run: wall time of the whole process, the figure each prints,
//! and its windows. The text is the repository's own documentation (docs/*.md, README.md) cut
//! to GEN_BENCH_WINDOWS windows (default 16) of GEN_BENCH_CTX tokens (default 512).
//!
//!     .ci/llama-server llama-perplexity     # once, the peer
//!     cargo bench --bench perplexity
//!
//! GEN_BENCH_MODEL: the model (default: the default model); GEN_BENCH_RUNS (3): rounds,
//! medians; GEN_BENCH_THREADS (2); GEN_LLAMA_PERPLEXITY: the peer's binary. The peer runs
//! with its weights repacked, or without where that dies (AMX Xeons; see
//! `common::peer_run`). Not a test: nothing here asserts a speed.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use common::{env_or, median};

/// The documentation, concatenated and cut to about `bytes` bytes.
fn text(bytes: usize, to: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut t = String::new();
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    docs.sort();
    docs.push(root.join("README.md"));
    for d in docs {
        t.push_str(&std::fs::read_to_string(d).unwrap());
    }
    let cut = (0..=bytes.min(t.len()))
        .rev()
        .find(|&i| t.is_char_boundary(i))
        .unwrap();
    std::fs::write(to, &t[..cut]).unwrap();
}

/// "12.3456 +/- 0.1234" from gen's stdout or llama-perplexity's final estimate.
fn figure(s: &str) -> f64 {
    let at = s.find("Final estimate: PPL = ").map_or(0, |i| i + 22);
    s[at..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn main() {
    let model = common::bench_model();
    let ctx: usize = env_or("GEN_BENCH_CTX", 512);
    let windows: usize = env_or("GEN_BENCH_WINDOWS", 16);
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let dir = std::env::temp_dir().join(format!("gen-bench-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("text.txt");
    // About 4.2 bytes a token in English prose: a little more than the windows need.
    text(windows * ctx * 5, &file);
    let gen_bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/gen");
    if !gen_bin.is_file() {
        common::fail("build gen first: cargo build --release");
    }
    let peer = common::llama_tool("llama-perplexity", "GEN_LLAMA_PERPLEXITY");
    let gen_cmd = || {
        let mut c = Command::new(&gen_bin);
        c.arg("perplexity")
            .arg(&file)
            .arg("--model")
            .arg(&model)
            .args(["--ctx-size", &ctx.to_string()])
            .args(["--threads", &threads.to_string(), "--stats", "json"]);
        c
    };
    let peer_cmd = |repack: bool| {
        let mut c = Command::new(peer.as_ref().expect("a peer"));
        c.arg("-m").arg(&model).arg("-f").arg(&file);
        c.args(["-c", &ctx.to_string(), "-t", &threads.to_string()]);
        // One window a batch, as gen computes them (llama-perplexity's default batch of 2,048
        // would put four windows in each pass).
        c.args(["-b", &ctx.to_string()]);
        if !repack {
            c.arg("--no-repack");
        }
        c
    };
    let (mut gen_s, mut peer_s) = (Vec::new(), Vec::new());
    let (mut gen_ppl, mut peer_ppl) = (f64::NAN, f64::NAN);
    let mut chunks = 0;
    // One untimed round first (page cache, kernel choice).
    for round in 0..=runs {
        let t = Instant::now();
        let out = gen_cmd().output().unwrap();
        let s = t.elapsed().as_secs_f64();
        if !out.status.success() {
            common::fail(&String::from_utf8_lossy(&out.stderr));
        }
        gen_ppl = figure(&String::from_utf8_lossy(&out.stdout));
        let report = common::last_json(&String::from_utf8_lossy(&out.stderr))
            .unwrap_or_else(|| common::fail("gen printed no report"));
        chunks = report["chunks"].as_u64().unwrap_or(0) as usize;
        if round > 0 {
            gen_s.push(s);
        }
        if peer.is_some() {
            let t = Instant::now();
            let (out, _) = common::peer_run("llama-perplexity", peer_cmd).unwrap();
            let s = t.elapsed().as_secs_f64();
            if !out.status.success() {
                common::fail(&String::from_utf8_lossy(&out.stderr));
            }
            peer_ppl = figure(&String::from_utf8_lossy(&out.stderr));
            if round > 0 {
                peer_s.push(s);
            }
        }
    }
    let tokens = (chunks * ctx) as f64;
    println!(
        "{chunks} windows of {ctx} tokens, {threads} threads, {}",
        model.display()
    );
    let g = median(gen_s);
    println!(
        "gen perplexity   {gen_ppl:.4}  median {g:.2} s  {:.0} tok/s",
        tokens / g
    );
    if peer.is_some() {
        let p = median(peer_s);
        println!(
            "llama-perplexity {peer_ppl:.4}  median {p:.2} s  {:.0} tok/s  (gen {:.2}x its speed; figures {:+.3}% apart)",
            tokens / p,
            p / g,
            100.0 * (gen_ppl / peer_ppl - 1.0)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
