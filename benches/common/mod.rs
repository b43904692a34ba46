//! Helpers shared by the benchmarks.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use gen::source::{self, FetchOptions, ModelSpec};

/// The model to measure: GEN_BENCH_MODEL, or the default model (fetched into gen's cache).
pub fn bench_model() -> PathBuf {
    match std::env::var("GEN_BENCH_MODEL") {
        Ok(p) => PathBuf::from(p),
        Err(_) => source::resolve(
            &ModelSpec::Known(source::DEFAULT_MODEL.into()),
            &FetchOptions::default(),
        )
        .unwrap_or_else(|e| fail(&format!("cannot fetch the default model: {e:#}"))),
    }
}

/// The benchmark text, in the repository: 1,000 SmolLM2 tokens (assets/README.md says where it
/// came from).
pub fn bench_text() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("assets")
        .join("bench-prompt-1000.txt")
}

/// End the benchmark with one line on stderr and exit status 1.
pub fn fail(message: &str) -> ! {
    eprintln!("bench: error: {message}");
    std::process::exit(1)
}

/// An environment variable parsed as T, or `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median (NaN for no values).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// n values in [-1, 1), a fixed scramble of their index and `seed` (the kernel benchmarks'
/// inputs only need to be varied).
#[allow(dead_code)] // used by the kernel benchmarks, not by speed and batch
pub fn data(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 23) as f32
                - 1.0
        })
        .collect()
}

/// The last line of `text` that parses as a JSON object.
pub fn last_json(text: &str) -> Option<serde_json::Value> {
    text.lines()
        .rev()
        .filter(|l| l.trim_start().starts_with('{'))
        .find_map(|l| serde_json::from_str(l).ok())
}

/// Run `cmd` with `input` on its standard input, stdout and stderr collected (ending the
/// benchmark with one line if it cannot run).
pub fn with_stdin(cmd: &mut std::process::Command, input: &str) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| fail(&format!("cannot run gen: {e}")));
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(input.as_bytes())
        .unwrap_or_else(|e| fail(&e.to_string()));
    child
        .wait_with_output()
        .unwrap_or_else(|e| fail(&e.to_string()))
}

/// Run gen as `cmd` (nothing on stdin, stdout discarded) and return the JSON report it printed
/// last on stderr, ending the benchmark with one line if it failed or printed none.
pub fn json_report(cmd: &mut std::process::Command) -> serde_json::Value {
    use std::process::Stdio;
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .unwrap_or_else(|e| fail(&format!("cannot run gen: {e}")));
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        fail(&format!("gen failed ({}): {}", out.status, err.trim()));
    }
    last_json(&err).unwrap_or_else(|| fail(&format!("gen printed no JSON report: {}", err.trim())))
}

/// One of llama.cpp's tools: `$env` if set, else where `.ci/llama-server TOOL` builds it (under
/// `$GEN_PEER_HOME`, else `$XDG_CACHE_HOME/gen-peer`, else `~/.cache/gen-peer`); None, with a
/// line saying how to build it, when it is not there.
pub fn llama_tool(tool: &str, env: &str) -> Option<PathBuf> {
    let bin = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
            });
        std::env::var_os("GEN_PEER_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache.join("gen-peer"))
            .join("llama-server-0.3.36/llama.cpp/build/bin")
            .join(tool)
    });
    if bin.is_file() {
        Some(bin)
    } else {
        eprintln!(
            "bench: no peer: {} is missing (build it once with `.ci/llama-server {tool}`, or set {env})",
            bin.display()
        );
        None
    }
}

/// Runs a llama.cpp tool as `cmd(repack)` builds it: with weight repacking first, and again
/// without (`false`) if it dies by a signal, saying so on stderr. On a Xeon with AMX (Sapphire
/// Rapids and later), llama.cpp 0c1e57098 moves most quantized weights into its AMX buffer,
/// whose code dies there (SIGILL in llama-bench and llama-batched-bench, SIGSEGV in
/// llama-server and llama-completion); the figures are then its plain CPU kernels'. Returns
/// the output and whether it ran with repacking.
pub fn peer_run(
    what: &str,
    cmd: impl Fn(bool) -> std::process::Command,
) -> std::io::Result<(std::process::Output, bool)> {
    let out = cmd(true).output()?;
    if out.status.code().is_some() {
        return Ok((out, true));
    }
    eprintln!(
        "bench: {what} died ({}) with weight repacking; run again without it",
        out.status
    );
    Ok((cmd(false).output()?, false))
}
