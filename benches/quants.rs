//! Every GGUF weight type on gen's own CPU kernels, side by side with llama.cpp's llama-bench
//! in the same run: per file, prefill (a 512-token prompt) and decode (128 tokens) tok/s for
//! both, the ratios, the weight bytes a decode step reads, and decode against the memory
//! roofline (those bytes over the machine's read bandwidth: the best of 5 passes at the start,
//! beside the vector units' multiply-add peaks, a prefill's ceiling; and per file the median
//! over its rounds of the best of 3 passes beside each, which its roofline uses); then time to
//! first token on the 1,000-token prompt for the files as published (mixed types).
//!
//!     .ci/llama-server llama-bench           # once, the peer (about 8 minutes on 2 cores)
//!     GEN_BENCH_QUANTS=DIR cargo bench --bench quants
//!
//! GEN_BENCH_QUANTS: a folder of GGUF files to measure (`$(benches/moe-files)`: the files with
//! experts in Qwen3-30B-A3B's and gpt-oss-20b's shapes scaled down; default ~/.cache/gen-peer/quants: where
//! the team's quant-files script writes the default model requantized by llama-quantize and a
//! random-weight llama, widths multiples of 256, in every type); Gemma 3 270M Q4_K_M (fetched
//! by gen) comes first. GEN_BENCH_FILTER: only files whose name contains it. GEN_BENCH_RUNS
//! (3): alternating rounds of gen and llama-bench, medians. GEN_BENCH_THREADS (2).
//! GEN_BENCH_SIZES: a folder of bigger files (default ~/.cache/gen-peer/sizes, where the team's
//! size-files script writes random weights in Llama 3.2 1B's and 3B's shapes); their F16 files
//! are left out. gen runs on the path it chooses and on each path this CPU has, forced with
//! GEN_KERNEL (the last column; GEN_BENCH_PATHS=0 leaves those out; `amx` and `bf16`, which
//! differ from the 512-bit path only for BF16 matrices, on files with BF16 only).
//! GEN_LLAMA_BENCH: the llama-bench binary (default: where `.ci/llama-server llama-bench`
//! builds it); absent, the rows say "no peer". Where `.ci/llama-server llama-bench-avx2` has
//! built llama-bench for AVX2 only (or GEN_LLAMA_BENCH_AVX2 names one) and gen has an `avx2`
//! path, a last column sets gen's AVX2 path beside that build, each program on AVX2 alone:
//! what a CPU without AVX-512 (Zen 1 to 3) would see, measured on one with it. Not a test:
//! nothing here asserts a speed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{env_or, json_report, median};

/// Multiply-adds per second (GMAC/s) the CPU's vector units can do on `threads` threads, the
/// ceiling of a prefill: f32 `vfmadd` on 512-bit registers, and where the CPU has AVX512-BF16,
/// `vdpbf16ps` (two bf16 products a lane into f32). 12 independent accumulators a thread, so
/// latency does not count; None where the CPU lacks AVX-512.
fn compute_peaks(threads: usize) -> (Option<f64>, Option<f64>) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const ROUNDS: usize = 20_000_000;
        #[target_feature(enable = "avx512f")]
        fn f32_loop() -> f32 {
            let m = _mm512_set1_ps(0.999);
            let c = _mm512_set1_ps(1e-6);
            let mut x = [_mm512_setzero_ps(); 12];
            for _ in 0..ROUNDS {
                for v in x.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, m, c);
                }
            }
            x.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        #[target_feature(enable = "avx512f,avx512bf16")]
        fn bf16_loop() -> f32 {
            let m: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3f80)) };
            let c: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3380)) };
            let mut x = [_mm512_setzero_ps(); 12];
            for _ in 0..ROUNDS {
                for v in x.iter_mut() {
                    *v = _mm512_dpbf16_ps(*v, m, c);
                }
            }
            x.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        // The best of 5 runs.
        let time = |f: fn() -> f32, macs_per_instr: f64| {
            (0..5)
                .map(|_| {
                    let t0 = std::time::Instant::now();
                    std::thread::scope(|s| {
                        for _ in 0..threads {
                            s.spawn(move || std::hint::black_box(f()));
                        }
                    });
                    let macs = (threads * ROUNDS * 12) as f64 * macs_per_instr;
                    macs / t0.elapsed().as_secs_f64() / 1e9
                })
                .fold(0f64, f64::max)
        };
        let f32_peak = is_x86_feature_detected!("avx512f").then(|| {
            // SAFETY: the feature was just detected.
            time(|| unsafe { f32_loop() }, 16.0)
        });
        let bf16_peak = is_x86_feature_detected!("avx512bf16").then(|| {
            // SAFETY: the features were just detected (avx512bf16 implies avx512f).
            time(|| unsafe { bf16_loop() }, 32.0)
        });
        (f32_peak, bf16_peak)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = threads;
        (None, None)
    }
}

/// Memory read bandwidth with `threads` threads: one pass sums 1 GiB, each task reading four
/// runs of memory at once (as a kernel reading several tiles does: one stream a core measured
/// 30% less than four on an Intel Xeon, understating the roofline).
struct Reader {
    pool: rayon::ThreadPool,
    v: Vec<u64>,
}

impl Reader {
    fn new(threads: usize) -> Self {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        Reader {
            pool,
            v: vec![1u64; (1 << 30) / 8],
        }
    }

    /// GB/s of one pass.
    fn pass(&self) -> f64 {
        use rayon::prelude::*;
        let start = std::time::Instant::now();
        let s: u64 = self.pool.install(|| {
            self.v
                .par_chunks(1 << 16)
                .map(|c| {
                    let q = c.len() / 4;
                    let mut s = [0u64; 4];
                    for i in 0..q {
                        for (j, s) in s.iter_mut().enumerate() {
                            *s = s.wrapping_add(c[j * q + i]);
                        }
                    }
                    s.iter().fold(0u64, |a, &x| a.wrapping_add(x))
                })
                .sum()
        });
        std::hint::black_box(s);
        (self.v.len() * 8) as f64 / start.elapsed().as_secs_f64() / 1e9
    }

    /// The best of 5 passes.
    fn best(&self) -> f64 {
        (0..5).map(|_| self.pass()).fold(0f64, f64::max)
    }
}

/// (experts used a token, experts) of a file with experts; (1, 1) without.
fn expert_share(path: &Path) -> (u64, u64) {
    // gen's reader: candle's refuses a file with a type it does not know (MXFP4).
    let Ok(c) = gen::format::checkpoint::Checkpoint::open_gguf(path) else {
        return (1, 1);
    };
    let arch = c
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok().cloned())
        .unwrap_or_default();
    let key = |k: &str| {
        c.metadata
            .get(&format!("{arch}.{k}"))
            .and_then(|v| v.to_u32().ok())
            .map(u64::from)
    };
    match (key("expert_used_count"), key("expert_count")) {
        (Some(used), Some(n)) if n > 0 => (used, n),
        _ => (1, 1),
    }
}

/// Bytes of weights a decode step reads: every tensor but the embedding matrix when the file
/// has a separate output layer (then only one row of it is read), and of the stacked experts
/// (`*_exps`) only the share a token uses (experts used / experts: what one token reads,
/// whichever experts it picks); and the file's matrix types by share of bytes, e.g. "Q5_0
/// 59%, Q8_0 35%, Q6_K 6%".
fn decode_bytes(path: &Path) -> (f64, String) {
    let mut f = std::fs::File::open(path).expect("open the model");
    let s =
        gen::format::gguf::validate(&mut f, path).unwrap_or_else(|e| common::fail(&e.to_string()));
    let untied = s.tensor_bytes.iter().any(|(n, _, _)| n == "output.weight");
    let (used, experts) = expert_share(path);
    let bytes: u64 = s
        .tensor_bytes
        .iter()
        .filter(|(n, _, _)| !(untied && n == "token_embd.weight"))
        .map(|(n, _, b)| match n.contains("_exps.") {
            true => b * used / experts,
            false => *b,
        })
        .sum();
    let mut by: Vec<(&str, u64)> = Vec::new();
    for (_, ty, bytes) in &s.tensor_bytes {
        let ty = gen::format::gguf::type_label(*ty);
        match by.iter_mut().find(|(t, _)| *t == ty) {
            Some(e) => e.1 += bytes,
            None => by.push((ty, *bytes)),
        }
    }
    let total: u64 = by.iter().map(|b| b.1).sum();
    by.sort_by_key(|b| std::cmp::Reverse(b.1));
    let types = by
        .iter()
        .filter(|(_, b)| *b * 50 >= total)
        .map(|(t, b)| format!("{t} {}%", (100 * b).div_ceil(total.max(1))))
        .collect::<Vec<_>>()
        .join(", ");
    (bytes as f64, types)
}

struct Gen {
    prefill: f64,
    decode: f64,
}

/// gen's kernel paths: the one it chooses (None: GEN_KERNEL unset, so the kept measurement
/// decides), then each it has on this CPU, forced.
fn paths() -> Vec<Option<&'static str>> {
    let mut p = vec![None];
    #[cfg(target_arch = "x86_64")]
    {
        if std::env::var("GEN_BENCH_PATHS").is_ok_and(|v| v == "0") {
            return p;
        }
        if is_x86_feature_detected!("avx2") {
            p.push(Some("avx2"));
        }
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512bw") {
            p.push(Some("avx512"));
            // AMX (prefill chunks on tile multiplies; the 512-bit path elsewhere), where the
            // CPU lists it; gen itself also asks Linux for the tiles, and without them runs
            // the 512-bit path.
            let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
            let has = |f: &str| flags.split_whitespace().any(|w| w == f);
            if has("amx_int8") && has("amx_bf16") {
                p.push(Some("amx"));
            }
            // `vdpbf16ps` for BF16 prefill chunks (the 512-bit path elsewhere).
            if is_x86_feature_detected!("avx512bf16") {
                p.push(Some("bf16"));
            }
        }
    }
    p
}

/// llama-bench built for AVX2 only: GEN_LLAMA_BENCH_AVX2, else where `.ci/llama-server
/// llama-bench-avx2` puts it beside `peer`'s build; None (silently: it is optional) where
/// neither is there.
fn avx2_peer(peer: Option<&Path>) -> Option<PathBuf> {
    let bin = match std::env::var_os("GEN_LLAMA_BENCH_AVX2") {
        Some(p) => PathBuf::from(p),
        None => peer?
            .parent()?
            .parent()?
            .parent()?
            .join("build-avx2/bin/llama-bench"),
    };
    bin.is_file().then_some(bin)
}

fn run_gen(
    model: &Path,
    prompt: &Path,
    max_new: usize,
    threads: usize,
    path: Option<&str>,
) -> serde_json::Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gen"));
    match path {
        Some(p) => cmd.env("GEN_KERNEL", p),
        None => cmd.env_remove("GEN_KERNEL"),
    };
    json_report(
        cmd.arg("--model")
            .arg(model)
            .arg("--prompt-file")
            .arg(prompt)
            .args(["--max-new", &max_new.to_string(), "--temperature", "0"])
            .args([
                "--ignore-eos",
                "--stats",
                "json",
                "--threads",
                &threads.to_string(),
            ]),
    )
}

/// gen's prefill tok/s on `prompt` (one token generated) and decode tok/s (128 tokens after a
/// short prompt).
fn gen_sample(
    model: &Path,
    prompt: &Path,
    short: &Path,
    threads: usize,
    path: Option<&str>,
) -> Gen {
    let p = run_gen(model, prompt, 1, threads, path);
    let d = run_gen(model, short, 128, threads, path);
    Gen {
        prefill: p["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
        decode: d["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
    }
}

/// llama-bench's prefill (pp`prompt`) and decode (tg128) tok/s; None if it failed. One that
/// dies with weight repacking runs again with `--repack 0` ([`common::peer_run`]).
fn peer_sample(bin: &Path, model: &Path, prompt: usize, threads: usize) -> Option<(f64, f64)> {
    let what = format!("llama-bench on {}", model.display());
    let (out, _) = common::peer_run(&what, |repack| {
        let mut c = Command::new(bin);
        c.arg("-m").arg(model).args([
            "-t",
            &threads.to_string(),
            "-p",
            &prompt.to_string(),
            "-n",
            "128",
        ]);
        c.args(["-r", "1", "-o", "json"]);
        if !repack {
            c.args(["--repack", "0"]);
        }
        c
    })
    .ok()?;
    if !out.status.success() {
        eprintln!(
            "bench: llama-bench failed on {}: {}",
            model.display(),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let rate = |gen: bool| {
        rows.as_array()?
            .iter()
            .find(|r| (r["n_gen"].as_u64().unwrap_or(0) > 0) == gen)?["avg_ts"]
            .as_f64()
    };
    Some((rate(false)?, rate(true)?))
}

fn files() -> Vec<PathBuf> {
    let dir = std::env::var_os("GEN_BENCH_QUANTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/gen-peer/quants")
        });
    let mut fs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
                .collect()
        })
        .unwrap_or_else(|e| {
            eprintln!(
                "bench: no quantized files in {} ({e}): Gemma 3 only",
                dir.display()
            );
            Vec::new()
        });
    fs.sort();
    // The sizes people run (the team's size-files script): Llama 3.2 1B's and 3B's shapes.
    let sizes = std::env::var_os("GEN_BENCH_SIZES")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.parent().unwrap_or(&dir).join("sizes"));
    let mut big: Vec<PathBuf> = std::fs::read_dir(&sizes)
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let n = p.file_name().unwrap_or_default().to_string_lossy();
                    n.ends_with(".gguf") && !n.contains("F16")
                })
                .collect()
        })
        .unwrap_or_default();
    big.sort();
    fs.extend(big);
    let gemma = gen::source::resolve(
        &gen::source::ModelSpec::Known("gemma3-270m".into()),
        &gen::source::FetchOptions::default(),
    )
    .unwrap_or_else(|e| common::fail(&format!("cannot fetch gemma3-270m: {e:#}")));
    fs.insert(0, gemma);
    let filter = std::env::var("GEN_BENCH_FILTER").unwrap_or_default();
    fs.retain(|f| {
        f.file_name()
            .is_some_and(|n| n.to_string_lossy().contains(&filter))
    });
    fs
}

fn main() {
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let text = std::fs::read_to_string(common::bench_text()).expect("the benchmark text");
    let dir = std::env::temp_dir().join(format!("gen-bench-quants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch folder");
    // About 512 SmolLM2 tokens: the first half of the 1,000-token text.
    let half: String = text.chars().take(text.chars().count() / 2).collect();
    let (p512, short) = (dir.join("p512.txt"), dir.join("short.txt"));
    std::fs::write(&p512, half).unwrap();
    std::fs::write(&short, "Once upon a time").unwrap();
    let p1000 = common::bench_text();
    let reader = Reader::new(threads);
    let bw = reader.best();
    let (f32_peak, bf16_peak) = compute_peaks(threads);
    let peak = |p: Option<f64>| p.map_or("-".to_string(), |v| format!("{v:.0}"));
    let peer = common::llama_tool("llama-bench", "GEN_LLAMA_BENCH");
    let paths = paths();
    // llama-bench built for AVX2 only, beside gen's forced AVX2 path (index `avx2_at`).
    let avx2_at = paths.iter().position(|p| *p == Some("avx2"));
    let peer_avx2 = avx2_at.and_then(|_| avx2_peer(peer.as_deref()));
    println!(
        "read bandwidth {bw:.1} GB/s, f32 / bf16 multiply-add peak {} / {} GMAC/s ({threads} threads) | {runs} rounds, medians | gen vs {}",
        peak(f32_peak),
        peak(bf16_peak),
        peer.as_ref()
            .map_or("no peer".into(), |p| p.display().to_string())
    );
    println!();
    let forced: Vec<&str> = paths.iter().flatten().copied().collect();
    let avx2_head = match &peer_avx2 {
        Some(p) => {
            println!("AVX2 alone: gen's avx2 path against {}", p.display());
            println!();
            " AVX2 alone: llama.cpp's AVX2 build prefill, decode tok/s; gen avx2 / it |"
        }
        None => "",
    };
    println!(
        "| file (types by bytes) | MB/token | prefill tok/s llama.cpp / gen / ratio | decode tok/s llama.cpp / gen / ratio | roofline tok/s (read GB/s) | gen, llama.cpp / roofline | prefill, decode per path ({}) |{avx2_head}",
        forced.join(" / ")
    );
    println!(
        "|---|---|---|---|---|---|---|{}",
        if avx2_head.is_empty() { "" } else { "---|" }
    );
    let mut mixed = Vec::new();
    for f in files() {
        let (bytes, types) = decode_bytes(&f);
        let (mut g, mut l, mut l2) = (
            (0..paths.len())
                .map(|_| Vec::new())
                .collect::<Vec<Vec<Gen>>>(),
            Vec::new(),
            Vec::new(),
        );
        // The memory's speed drifts (on a shared host from 12 to 46 GB/s within minutes): the
        // roofline is each file's own, from the best of 3 read passes beside each of its rounds
        // (the median of those), what the memory gave when least disturbed.
        let mut reads = Vec::new();
        for _ in 0..runs {
            reads.push((0..3).map(|_| reader.pass()).fold(0f64, f64::max));
            // gen on each path and llama-bench, alternating round by round.
            for (i, path) in paths.iter().enumerate() {
                // AMX and bf16 are the 512-bit path but for BF16 matrices: run where there are.
                if matches!(path, Some("amx" | "bf16")) && !types.contains("BF16") {
                    continue;
                }
                g[i].push(gen_sample(&f, &p512, &short, threads, *path));
            }
            if let Some(bin) = &peer {
                l.extend(peer_sample(bin, &f, 512, threads));
            }
            if let Some(bin) = &peer_avx2 {
                l2.extend(peer_sample(bin, &f, 512, threads));
            }
        }
        let med = |i: usize, pick: fn(&Gen) -> f64| median(g[i].iter().map(pick).collect());
        let (gp, gd) = (med(0, |s| s.prefill), med(0, |s| s.decode));
        let per_path = (1..paths.len())
            .map(|i| match g[i].is_empty() {
                true => "-".to_string(),
                false => format!("{:.0}, {:.1}", med(i, |s| s.prefill), med(i, |s| s.decode)),
            })
            .collect::<Vec<_>>()
            .join(" / ");
        let lp = median(l.iter().map(|s| s.0).collect());
        let ld = median(l.iter().map(|s| s.1).collect());
        let read = median(reads);
        let roof = read * 1e9 / bytes;
        let avx2 = match (avx2_at, &peer_avx2) {
            (Some(i), Some(_)) => {
                let (ap, ad) = (med(i, |s| s.prefill), med(i, |s| s.decode));
                let lp2 = median(l2.iter().map(|s| s.0).collect());
                let ld2 = median(l2.iter().map(|s| s.1).collect());
                format!(
                    " {}, {}; {}, {} |",
                    show(lp2, 0),
                    show(ld2, 1),
                    ratio(ap, lp2),
                    ratio(ad, ld2)
                )
            }
            _ => String::new(),
        };
        let name = f
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        println!(
            "| {name} ({types}) | {:.1} | {} / {gp:.0} / {} | {} / {gd:.1} / {} | {roof:.0} ({read:.1}) | {:.0}%, {} | {per_path} |{avx2}",
            bytes / 1e6,
            show(lp, 0),
            ratio(gp, lp),
            show(ld, 1),
            ratio(gd, ld),
            100.0 * gd / roof,
            if ld.is_nan() {
                "-".to_string()
            } else {
                format!("{:.0}%", 100.0 * ld / roof)
            }
        );
        if !name.starts_with("k256")
            && !name.starts_with("llama-")
            && !name.ends_with("Q4_0")
            && !name.ends_with("Q8_0")
            && !name.ends_with("Q6_K")
        {
            mixed.push(f);
        }
    }
    println!();
    println!("Files as published (mixed types), time to first token on the 1,000-token prompt:");
    println!();
    println!("| file | TTFT llama.cpp (s) | TTFT gen (s) | gen / llama.cpp |");
    println!("|---|---|---|---|");
    for f in mixed {
        let (mut g, mut l) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            g.push(
                run_gen(&f, &p1000, 1, threads, None)["ttft_s"]
                    .as_f64()
                    .unwrap_or(f64::NAN),
            );
            if let Some(bin) = &peer {
                // llama-bench's pp1000 is the prompt's prefill: TTFT without sampling.
                l.extend(peer_sample(bin, &f, 1000, threads).map(|(pp, _)| 1000.0 / pp));
            }
        }
        let (g, l) = (median(g), median(l));
        println!(
            "| {} | {} | {g:.2} | {} |",
            f.file_stem().unwrap_or_default().to_string_lossy(),
            show(l, 2),
            ratio(g, l)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn show(v: f64, digits: usize) -> String {
    if v.is_nan() {
        "no peer".into()
    } else {
        format!("{v:.digits$}")
    }
}

fn ratio(a: f64, b: f64) -> String {
    if b.is_nan() {
        "-".into()
    } else {
        format!("{:.2}x", a / b)
    }
}
