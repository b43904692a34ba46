//! Start-up: gen's whole process for one token against llama.cpp's llama-completion on the
//! same file, the page cache warm, alternating run by run: wall time from start to exit, peak
//! resident memory, and where gen's load went (reading the file, repacking the weights into its
//! tiles, measuring kernel paths, the tokenizer), from its `--stats json` report. gen runs
//! twice a round: with its tile cache (written by the untimed first round, mapped after) and
//! with `GEN_TILE_CACHE=off` (every weight repacked), in a scratch cache folder of its own;
//! the first round's time, which writes the cache, is shown too.
//!
//!     .ci/llama-server llama-completion     # once, the peer
//!     cargo bench --bench startup
//!
//! GEN_BENCH_SIZES: the folder of files (default ~/.cache/gen-peer/sizes, where the team's
//! size-files script writes random weights in Llama 3.2 1B's and 3B's shapes); GEN_BENCH_FILTER
//! (default `1b`): only files whose name contains it. GEN_BENCH_RUNS (5): rounds, medians.
//! GEN_BENCH_THREADS (2). GEN_LLAMA_COMPLETION: the peer's binary. One untimed round comes
//! first. Not a test: nothing here asserts a speed.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use common::{env_or, median};

/// One finished process: seconds from spawn to exit, peak resident memory in bytes, stderr.
struct Run {
    seconds: f64,
    peak_rss: u64,
    stderr: String,
}

/// Run `cmd` to its end (stdout discarded, stderr to a scratch file so a talkative peer never
/// blocks on a full pipe), reaping it with wait4 for its own peak resident memory.
#[allow(clippy::zombie_processes)] // reaped by wait4, which std does not know of
fn run(cmd: &mut Command, scratch: &Path) -> Run {
    let err = std::fs::File::create(scratch).expect("scratch file");
    let started = Instant::now();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| common::fail(&format!("cannot run {cmd:?}: {e}")));
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for the child we spawned.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    // SAFETY: `pid` is our child, not yet reaped (std never waits for it: `child` is dropped
    // without a wait).
    let got = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let seconds = started.elapsed().as_secs_f64();
    let stderr = std::fs::read_to_string(scratch).unwrap_or_default();
    if got != pid || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        common::fail(&format!(
            "{cmd:?} failed (status {status}): {}",
            stderr.lines().last().unwrap_or("")
        ));
    }
    Run {
        seconds,
        peak_rss: usage.ru_maxrss as u64 * 1024,
        stderr,
    }
}

fn files() -> Vec<PathBuf> {
    let dir = std::env::var_os("GEN_BENCH_SIZES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/gen-peer/sizes")
        });
    let filter = std::env::var("GEN_BENCH_FILTER").unwrap_or_else(|_| "1b".into());
    let mut fs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            common::fail(&format!(
                "no files in {} ({e}): run the team's size-files script",
                dir.display()
            ))
        })
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().unwrap_or_default().to_string_lossy();
            n.ends_with(".gguf") && !n.contains("F16") && n.contains(&filter)
        })
        .collect();
    fs.sort();
    fs
}

/// Read the whole file once, so every run finds it in the page cache.
fn warm(path: &Path) {
    use std::io::Read;
    let mut f = std::fs::File::open(path).expect("open the model");
    let mut buf = vec![0u8; 1 << 20];
    while f.read(&mut buf).expect("read the model") > 0 {}
}

/// llama-completion's run of one token on `file`, with weight repacking or without.
fn completion(bin: &Path, file: &Path, threads: &str, repack: bool) -> Command {
    let mut c = Command::new(bin);
    c.arg("-m").arg(file).args([
        "-p", "Hello", "-n", "1", "--temp", "0", "-no-cnv", "-t", threads,
    ]);
    if !repack {
        c.arg("--no-repack");
    }
    c
}

fn main() {
    let runs: usize = env_or("GEN_BENCH_RUNS", 5);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let peer = common::llama_tool("llama-completion", "GEN_LLAMA_COMPLETION");
    let scratch = std::env::temp_dir().join(format!("gen-bench-startup-{}", std::process::id()));
    let t = threads.to_string();
    println!(
        "one token, whole process, warm page cache | {runs} rounds, medians | {threads} threads | gen vs {}",
        peer.as_ref()
            .map_or("no peer".into(), |p| p.display().to_string())
    );
    println!();
    println!("| file | MB | seconds llama.cpp / gen / ratio | gen repacking: seconds / ratio | gen's first run (writes the cache) s | peak RSS MB llama.cpp / gen / gen per file MB | gen repacking: RSS per file MB | gen repacking's load: reading / repacking / kernels / tokenizer s |");
    println!("|---|---|---|---|---|---|---|---|");
    let xdg = std::env::temp_dir().join(format!("gen-bench-startup-xdg-{}", std::process::id()));
    let gen_run = |file: &Path, tiles: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_gen"));
        c.env("XDG_CACHE_HOME", &xdg)
            .env("GEN_TILE_CACHE", tiles)
            .arg("--model")
            .arg(file)
            .args(["--prompt", "Hello", "--max-new", "1", "--temperature", "0"])
            .args(["--stats", "json", "--threads", &t]);
        c
    };
    for file in files() {
        warm(&file);
        let mb = std::fs::metadata(&file).map_or(0.0, |m| m.len() as f64 / 1e6);
        let (mut ours, mut repack, mut theirs): (Vec<Run>, Vec<Run>, Vec<Run>) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut first = 0.0;
        // Whether the peer runs with weight repacking on this file: one untimed run tells
        // (`common::peer_run`: without it if it dies with it).
        let peer_repacks = peer.as_ref().is_none_or(|bin| {
            let what = format!("llama-completion on {}", file.display());
            common::peer_run(&what, |r| completion(bin, &file, &t, r)).map_or(true, |(_, r)| r)
        });
        // One untimed round first: the first load of a weight type on a CPU measures gen's
        // kernel paths (kept for every later run), and the first load of a file writes its
        // tile cache, which is not start-up as users see it (its time is shown apart).
        for round in 0..=runs {
            if round == 1 {
                first = ours[0].seconds;
                ours.clear();
                repack.clear();
                theirs.clear();
            }
            ours.push(run(&mut gen_run(&file, "on"), &scratch));
            repack.push(run(&mut gen_run(&file, "off"), &scratch));
            if let Some(bin) = &peer {
                theirs.push(run(&mut completion(bin, &file, &t, peer_repacks), &scratch));
            }
        }
        let secs = |v: &[Run]| median(v.iter().map(|r| r.seconds).collect());
        let rss = |v: &[Run]| median(v.iter().map(|r| r.peak_rss as f64 / 1e6).collect());
        let part = |key: &str| {
            median(
                repack
                    .iter()
                    .filter_map(|r| common::last_json(&r.stderr)?["load"][key].as_f64())
                    .collect(),
            )
        };
        let (g, r, l) = (secs(&ours), secs(&repack), secs(&theirs));
        println!(
            "| {} | {mb:.0} | {l:.2} / {g:.2} / {:.2}x | {r:.2} / {:.2}x | {first:.2} | {:.0} / {:.0} / {:.2} | {:.2} | {:.2} / {:.2} / {:.2} / {:.2} |",
            file.file_name().unwrap_or_default().to_string_lossy(),
            g / l,
            r / l,
            rss(&theirs),
            rss(&ours),
            rss(&ours) / mb,
            rss(&repack) / mb,
            part("read_s"),
            part("repack_s"),
            part("kernels_s"),
            part("tokenizer_s"),
        );
    }
    std::fs::remove_file(&scratch).ok();
    std::fs::remove_dir_all(&xdg).ok();
}
