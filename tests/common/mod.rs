//! Helpers shared by the integration tests.
#![allow(dead_code)]
pub mod agreement;
pub mod counting;
pub mod gemma4;

use std::path::PathBuf;
use std::process::{Command, Output};

use gen::source::{self, FetchOptions, ModelSpec};

pub mod hf;
pub mod suite;
pub mod typed;

/// A known model, fetched (once per cache) through the same code path users get.
pub fn known(name: &str) -> PathBuf {
    let spec = ModelSpec::Known(name.to_string());
    source::resolve(&spec, &FetchOptions::default())
        .unwrap_or_else(|e| panic!("fetching {name} for the tests failed: {e:#}"))
}

/// The default model (SmolLM2-135M-Instruct Q4_1).
pub fn smollm2() -> PathBuf {
    known("smollm2-135m")
}

/// Gemma 3 270M Q4_K_M.
pub fn gemma3() -> PathBuf {
    known("gemma3-270m")
}

/// The built `gen` binary, with a clean environment for what the tests assert on.
pub fn gen() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gen"));
    c.env_remove("HF_HUB_OFFLINE").env("RUST_BACKTRACE", "0");
    c
}

/// Run `cmd` with `input` on its standard input (then closed), collecting stdout and stderr.
pub fn with_stdin(mut cmd: Command, input: &str) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).unwrap();
    drop(stdin);
    child.wait_with_output().unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A successful run's stdout, stderr and `--stats json` report (stderr's last line).
pub fn with_stats(out: &Output) -> (String, String, serde_json::Value) {
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    let last = err.lines().last().unwrap_or("");
    let stats = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("no --stats json report ({e}) on stderr: {err}"));
    (text(&out.stdout), err, stats)
}

/// The one error line gen printed, asserting there is exactly one and no panic.
pub fn one_error_line(out: &Output) -> String {
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line on stderr, got: {err}");
    assert!(lines[0].starts_with("gen: error: "), "{err}");
    lines[0].to_string()
}

/// A token sink that keeps nothing (the tests read the returned `Generation`).
pub struct Discard;

impl gen::generate::TokenSink for Discard {
    fn on_token(&mut self, _: u32) -> anyhow::Result<gen::generate::Flow> {
        Ok(gen::generate::Flow::Continue)
    }
}

/// The records of a JSON Lines asset, blank lines skipped.
pub fn jsonl<T: serde::de::DeserializeOwned>(text: &str) -> Vec<T> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad asset line {l:?}: {e}")))
        .collect()
}

/// Teacher-forced logits: the prompt in one pass, then each of `ids` fed back in turn, as a
/// reference run chose them. Row i holds the logits from which token `ids[i]` was chosen.
pub fn teacher_forced(
    model: &mut dyn gen::model::LanguageModel,
    prompt: &[u32],
    ids: &[u32],
) -> Vec<Vec<f32>> {
    let need = prompt.len() + ids.len();
    model
        .reserve_pool(gen::model::kv_cache::blocks_for(need))
        .unwrap();
    let seq = model.new_sequence();
    assert!(model.reserve(seq, need));
    let mut rows = Vec::with_capacity(ids.len());
    let mut input = prompt.to_vec();
    let mut pos = 0;
    for &id in ids {
        let step = gen::model::SeqStep::auto(seq, &input, pos);
        let logits = model.forward(&[step]).unwrap();
        rows.push(logits.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        pos += input.len();
        input = vec![id];
    }
    model.free_sequence(seq);
    rows
}

/// The index of the largest value.
pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

/// A word-level tokenizer.json of `vocab` tokens (`<unk>`, `</s>`, then `w2`, `w3`, ...), for
/// tiny random-weight models.
pub fn tokenizer_json(vocab: usize) -> serde_json::Value {
    let mut v = serde_json::Map::new();
    v.insert("<unk>".into(), 0.into());
    v.insert("</s>".into(), 1.into());
    for i in 2..vocab {
        v.insert(format!("w{i}"), i.into());
    }
    serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
             "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": v, "unk_token": "<unk>"}
    })
}

/// A metadata value of [`write_gguf`].
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
}

/// A GGUF (version 3) written byte by byte: `meta` in order, then each tensor (name, GGUF
/// dimensions with the row width first, ggml type number, its bytes) at 32-byte alignment.
/// Unlike candle's writer it takes any type's blocks, those candle cannot hold included.
/// A small Qwen2 model's shape: layers, width, feed-forward width, heads, kv heads, head size.
pub struct Qwen2Shape {
    pub layers: usize,
    pub d: usize,
    pub ff: usize,
    pub heads: usize,
    pub kv: usize,
    pub hd: usize,
}

/// The small Qwen2 shape of the random-weight models in `quant_types.rs` and `tile_cache.rs`.
pub const SMALL_QWEN2: Qwen2Shape = Qwen2Shape {
    layers: 2,
    d: 256,
    ff: 512,
    heads: 4,
    kv: 2,
    hd: 64,
};

/// The metadata of a Qwen2 GGUF of that shape (context 64, rms epsilon 1e-6, rope base 10,000).
pub fn qwen2_meta(s: &Qwen2Shape) -> Vec<(&'static str, Meta)> {
    let u = |n: usize| Meta::U32(n as u32);
    vec![
        ("general.architecture", Meta::Str("qwen2".into())),
        ("qwen2.block_count", u(s.layers)),
        ("qwen2.embedding_length", u(s.d)),
        ("qwen2.feed_forward_length", u(s.ff)),
        ("qwen2.attention.head_count", u(s.heads)),
        ("qwen2.attention.head_count_kv", u(s.kv)),
        ("qwen2.attention.key_length", u(s.hd)),
        ("qwen2.attention.value_length", u(s.hd)),
        ("qwen2.context_length", u(64)),
        ("qwen2.attention.layer_norm_rms_epsilon", Meta::F32(1e-6)),
        ("qwen2.rope.freq_base", Meta::F32(10_000.0)),
    ]
}

pub fn write_gguf(
    path: &std::path::Path,
    meta: &[(&str, Meta)],
    tensors: &[(String, Vec<u64>, u32, Vec<u8>)],
) {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    let mut out = Vec::new();
    out.extend(b"GGUF");
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        string(&mut out, k);
        match v {
            Meta::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend(6u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::Str(x) => {
                out.extend(8u32.to_le_bytes());
                string(&mut out, x);
            }
        }
    }
    let mut offset = 0u64;
    for (name, dims, ty, bytes) in tensors {
        string(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset = (offset + bytes.len() as u64).next_multiple_of(32);
    }
    for (_, _, _, bytes) in tensors {
        out.resize(out.len().next_multiple_of(32), 0);
        out.extend(bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// Pseudo-random values in [-a, a).
pub fn data(n: usize, seed: u64, a: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * a
        })
        .collect()
}

/// gen's logits for `tokens`: a prefill of the first `split`, then one token per pass.
pub fn gen_logits(
    path: &std::path::Path,
    tokenizer: Option<&std::path::Path>,
    tokens: &[u32],
    split: usize,
) -> Vec<Vec<f32>> {
    let mut loaded = gen::model::load(path, &candle_core::Device::Cpu, tokenizer, None)
        .unwrap_or_else(|e| panic!("loading {}: {e:#}", path.display()));
    logits_of(&mut loaded, tokens, split)
}

/// [`gen_logits`] on a model already loaded.
pub fn logits_of(loaded: &mut gen::model::Loaded, tokens: &[u32], split: usize) -> Vec<Vec<f32>> {
    let m = loaded.model.as_mut();
    m.reserve_pool(gen::model::kv_cache::blocks_for(tokens.len()))
        .unwrap();
    let seq = m.new_sequence();
    assert!(m.reserve(seq, tokens.len()));
    let mut out = Vec::new();
    let mut pos = 0;
    let mut chunks = vec![&tokens[..split]];
    chunks.extend(tokens[split..].chunks(1));
    for chunk in chunks {
        let l = m
            .forward(&[gen::model::SeqStep::auto(seq, chunk, pos)])
            .unwrap();
        pos += chunk.len();
        out.push(l.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    out
}

/// A `--batch` of three prompts on the default model, one at a time (the first of 2 tokens,
/// the others of up to 2,000), sent `kill -SIG` 300 ms after the first line is out: its exit
/// status, its stderr and every line it wrote.
pub fn signalled_batch(sig: &str) -> (Option<i32>, String, Vec<serde_json::Value>) {
    use std::io::{BufRead, Read, Write};
    use std::process::Stdio;
    let mut child = gen()
        .arg("--model")
        .arg(smollm2())
        .args([
            "--batch",
            "-",
            "--temperature",
            "0",
            "--ignore-eos",
            "-n",
            "2000",
        ])
        .args(["--ctx-size", "4096", "--batch-size", "1", "--stats", "json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"{\"prompt\": \"Hi\", \"max_new\": 2}\n{\"prompt\": \"Once upon a time\"}\n{\"prompt\": \"The end\"}\n")
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    // The second prompt is running now; let it generate a little.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let status = Command::new("kill")
        .args([format!("-{sig}"), child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let lines = std::iter::once(first.as_str())
        .chain(rest.lines())
        .map(|l| serde_json::from_str(l.trim()).unwrap())
        .collect();
    (out.status.code(), text(&out.stderr), lines)
}

/// The llama.cpp source tree: .ci/llama-server prints `<tree>/build/bin/llama-server` (and builds
/// it first if it must).
pub fn llama_cpp_tree() -> PathBuf {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/llama-server");
    let out = std::process::Command::new(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    let binary = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    binary
        .parent()
        .and_then(std::path::Path::parent)
        .and_then(std::path::Path::parent)
        .unwrap_or_else(|| panic!("{} is not in <tree>/build/bin", binary.display()))
        .to_path_buf()
}

/// Send `child` Ctrl-C's signal (SIGINT), as a terminal would.
pub fn sigint(child: &std::process::Child) {
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}
