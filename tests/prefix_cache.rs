//! Work not done twice, on the real default model: the prefix cache (prompts that begin alike
//! share KV blocks in a batch, in one process's later runs) and `--prompt-cache` files across
//! runs. Every case checks that the replies are exactly those of a run without the cache.

mod common;

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::Device;
use gen::batch::{self, BatchOptions, BatchSink, BatchStats, Outcome, Request};
use gen::generate::{generate, Flow, Limits, StopReason, TokenSink};
use gen::model::{load_gguf, Loaded};
use gen::sampler::{Sampler, SamplingParams};
use sha2::{Digest, Sha256};

fn model() -> Loaded {
    load_gguf(&common::smollm2(), &Device::Cpu, None).expect("load the default model")
}

fn bench_text() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/bench-prompt-1000.txt");
    std::fs::read_to_string(path).unwrap()
}

/// `n` prompts: one instruction of about `shared` tokens, then a question of its own each
/// (10 to 40 tokens, cut from elsewhere in the text).
fn shared_prompts(m: &Loaded, n: usize, shared: usize) -> Vec<Vec<u32>> {
    let ids = m.tokenizer.encode(&bench_text(), false).unwrap();
    (0..n)
        .map(|i| {
            let mut p = ids[..shared].to_vec();
            let (start, len) = (shared + 37 * i, 10 + (i * 7) % 31);
            p.extend_from_slice(&ids[start..start + len]);
            p
        })
        .collect()
}

#[derive(Default)]
struct Collect {
    done: Vec<(usize, Outcome)>,
}

impl BatchSink for Collect {
    fn on_token(&mut self, _: usize, _: u32) -> Result<Flow> {
        Ok(Flow::Continue)
    }
    fn on_done(&mut self, index: usize, outcome: Outcome) -> Result<()> {
        self.done.push((index, outcome));
        Ok(())
    }
}

/// A greedy batch run: each prompt's generated ids in input order, and the run's figures.
fn run_batch(
    m: &mut Loaded,
    prompts: &[Vec<u32>],
    batch_size: usize,
    pool_blocks: usize,
    prefix_cache: bool,
) -> (Vec<Vec<u32>>, Vec<Outcome>, BatchStats) {
    run_batch_n(m, prompts, batch_size, pool_blocks, prefix_cache, 24)
}

fn run_batch_n(
    m: &mut Loaded,
    prompts: &[Vec<u32>],
    batch_size: usize,
    pool_blocks: usize,
    prefix_cache: bool,
    max_new: usize,
) -> (Vec<Vec<u32>>, Vec<Outcome>, BatchStats) {
    let requests = prompts
        .iter()
        .map(|p| Request {
            prompt: p.clone(),
            max_new,
            sampler: Sampler::new(SamplingParams::default()),
            score_from: None,
        })
        .collect();
    let opts = BatchOptions {
        batch_size,
        context_len: 8192,
        pool_blocks,
        eos: Vec::new(),
        prefix_cache,
        speculate: None,
    };
    let mut sink = Collect::default();
    let stats = batch::run(m.model.as_mut(), requests, &opts, &mut sink).unwrap();
    sink.done.sort_by_key(|(i, _)| *i);
    let outcomes: Vec<Outcome> = sink.done.into_iter().map(|(_, o)| o).collect();
    (
        outcomes.iter().map(|o| o.tokens.clone()).collect(),
        outcomes,
        stats,
    )
}

/// Prompts sharing a 200-token instruction: with the prefix cache every prompt after the
/// first takes its 12 full blocks from the cache (the ones admitted with the first wait one
/// pass for them), and every reply is the one the run without the cache gives, id for id.
/// Afterwards no block is held: every reference was returned.
#[test]
fn batched_prompts_share_their_prefix_and_reply_as_without_it() {
    let mut m = model();
    let prompts = shared_prompts(&m, 10, 200);
    let (plain, _, plain_stats) = run_batch(&mut m, &prompts, 4, 256, false);
    assert_eq!(plain_stats.cached_tokens, 0);
    let (shared, outcomes, stats) = run_batch(&mut m, &prompts, 4, 256, true);
    assert_eq!(shared, plain);
    assert_eq!(outcomes[0].cached_tokens, 0);
    for (i, o) in outcomes.iter().enumerate().skip(1) {
        assert_eq!(o.cached_tokens, 192, "prompt {i}");
    }
    assert_eq!(stats.cached_tokens, 9 * 192);
    assert!(stats.blocks_returned);
    let usage = m.model.kv_usage();
    assert_eq!(usage.blocks_used, 0, "a reference was not returned");
    assert!(usage.blocks_cached >= 12, "the shared blocks stay cached");
    // A later run in the same process finds each whole prompt in the cache from the start
    // (every full block but the one holding its last token).
    let (again, outcomes, _) = run_batch(&mut m, &prompts[..3], 3, 256, true);
    assert_eq!(again, plain[..3]);
    for (o, p) in outcomes.iter().zip(&prompts) {
        assert_eq!(o.cached_tokens, (p.len() - 1) / 16 * 16);
    }
}

/// Gemma 3's sliding-window layers (512 positions) with a shared beginning longer than the
/// window: the cached blocks serve them as well, and the replies are unchanged.
#[test]
fn windowed_layers_share_prefixes_too() {
    let mut m = load_gguf(&common::gemma3(), &Device::Cpu, None).expect("load Gemma 3");
    let prompts = shared_prompts(&m, 3, 600);
    let (plain, _, _) = run_batch_n(&mut m, &prompts, 3, 256, false, 12);
    let (shared, outcomes, _) = run_batch_n(&mut m, &prompts, 3, 256, true, 12);
    assert_eq!(shared, plain);
    assert!(outcomes[1..].iter().all(|o| o.cached_tokens == 592));
}

/// A pool too small for every sequence at once: sequences sharing the instruction are
/// preempted and resumed, and still reply exactly as a roomy run without the cache does.
#[test]
fn a_preempted_sequence_sharing_a_prefix_resumes_intact() {
    let mut m = model();
    let prompts = shared_prompts(&m, 6, 200);
    // 12 shared blocks, and 6 to 8 of its own per sequence: 6 at once would need ~55, one
    // alone up to 20. (First: a pool only grows.)
    let (shared, _, stats) = run_batch_n(&mut m, &prompts, 6, 24, true, 80);
    let (plain, _, _) = run_batch_n(&mut m, &prompts, 6, 256, false, 80);
    assert!(
        stats.preemptions > 0,
        "the pool was meant to run short: {stats:?}"
    );
    assert_eq!(shared, plain);
    assert!(stats.blocks_returned);
    assert_eq!(m.model.kv_usage().blocks_used, 0);
}

struct Quiet;
impl TokenSink for Quiet {
    fn on_token(&mut self, _: u32) -> Result<Flow> {
        Ok(Flow::Continue)
    }
}

fn greedy(m: &mut Loaded, prompt: &[u32], max_new: usize) -> gen::generate::Generation {
    let limits = Limits {
        max_new,
        context_len: 8192,
    };
    let mut sampler = Sampler::new(SamplingParams::default());
    generate(
        m.model.as_mut(),
        prompt,
        &mut sampler,
        &[],
        &limits,
        &mut Quiet,
    )
    .unwrap()
}

/// One run after another in a process: a later prompt that begins as an earlier one did
/// prefills only its own part and replies as a fresh model does; the blocks it shared hold
/// the same bytes before and after other sequences ran beside them.
#[test]
fn later_runs_reuse_earlier_prompts_and_never_write_shared_blocks() {
    let mut m = model();
    // A pool with room for all of it from the start: one that grows starts empty.
    m.model.reserve_pool(64).unwrap();
    let prompts = shared_prompts(&m, 4, 120);
    let first = greedy(&mut m, &prompts[0], 8);
    assert_eq!(first.reused_tokens, 0);
    let kv = m.model.kv();
    let blocks = kv.chain(&prompts[0], prompts[0].len() / 16);
    assert_eq!(blocks.len(), prompts[0].len() / 16);
    let before = m.model.read_kv_blocks(&blocks).unwrap();

    let second = greedy(&mut m, &prompts[1], 8);
    assert_eq!(
        second.reused_tokens, 112,
        "7 full blocks of the 120 shared tokens"
    );
    let (.., stats) = run_batch(&mut m, &prompts, 4, 64, true);
    assert!(stats.cached_tokens >= 4 * 112);
    assert_eq!(m.model.read_kv_blocks(&blocks).unwrap(), before);

    let mut fresh = model();
    fresh.model.kv_mut().set_prefix_cache(false);
    assert_eq!(second.tokens, greedy(&mut fresh, &prompts[1], 8).tokens);
    assert_eq!(second.stop, StopReason::MaxNew);
}

/// gen with `args`, the prompt on stdin; (stdout, stderr, success).
fn run(args: &[&str], prompt: &str) -> (String, String, bool) {
    let mut cmd = common::gen();
    cmd.arg("--model")
        .arg(common::smollm2())
        .args(["--temperature", "0", "--max-new", "6", "--threads", "2"])
        .args(args);
    let out = common::with_stdin(cmd, prompt);
    (
        common::text(&out.stdout),
        common::text(&out.stderr),
        out.status.success(),
    )
}

fn stats_json(stderr: &str) -> serde_json::Value {
    let line = stderr
        .lines()
        .rfind(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON report in {stderr}"));
    serde_json::from_str(line).unwrap()
}

/// `--batch`: the same lines with and without `--no-prefix-cache`, and each line says how many
/// of its prompt tokens came from the cache.
#[test]
fn the_binary_shares_prefixes_in_batches_and_says_so() {
    let text = bench_text();
    let instruction = &text[..900];
    let input: String = (0..5)
        .map(|i| {
            let q = &text[1000 + 120 * i..1060 + 120 * i];
            serde_json::json!({ "prompt": format!("{instruction}\n\nQuestion: {q}") }).to_string()
                + "\n"
        })
        .collect();
    let (with, err, ok) = run(&["--batch", "-", "--stats", "json"], &input);
    assert!(ok, "{err}");
    let (without, err2, ok) = run(&["--batch", "-", "--no-prefix-cache"], &input);
    assert!(ok, "{err2}");
    let texts = |s: &str| -> Vec<String> {
        common::jsonl::<serde_json::Value>(s)
            .iter()
            .map(|l| l["text"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&with), texts(&without));
    let cached: Vec<u64> = common::jsonl::<serde_json::Value>(&with)
        .iter()
        .map(|l| l["cached_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(cached[0], 0);
    assert!(cached[1..].iter().all(|&c| c >= 160), "{cached:?}");
    assert_eq!(
        stats_json(&err)["cached_tokens"].as_u64().unwrap(),
        cached.iter().sum::<u64>()
    );
    assert!(common::jsonl::<serde_json::Value>(&without)
        .iter()
        .all(|l| l["cached_tokens"] == 0));
}

fn temp(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gen-pcache-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A prompt-cache file is made by the first run and used by the next (same text, most of the
/// prompt from the file). Damaged copies of it (cut at points in every part, flipped bytes in
/// every part, another model's file, a newer layout) each give one warning, the same text,
/// and a rewritten file the next run uses again.
#[test]
fn prompt_cache_files_are_used_whole_or_not_at_all() {
    let dir = temp("files");
    let file = dir.join("prompt.cache");
    let f = file.to_str().unwrap();
    let prompt = &bench_text()[..1200];
    let (reference, err, ok) = run(&[], prompt);
    assert!(ok, "{err}");
    let (first, err, ok) = run(&["--prompt-cache", f, "--stats", "json"], prompt);
    assert!(ok && !err.contains("warning"), "{err}");
    assert_eq!(first, reference);
    assert_eq!(stats_json(&err)["cached_tokens"], 0);
    let good = std::fs::read(&file).unwrap();

    let uses_the_file = |what: &str| {
        let (out, err, ok) = run(&["--prompt-cache", f, "--stats", "json"], prompt);
        assert!(ok && !err.contains("warning"), "{what}: {err}");
        assert_eq!(out, reference, "{what}");
        let cached = stats_json(&err)["cached_tokens"].as_u64().unwrap();
        assert!(cached >= 16 * 14, "{what}: {cached} tokens from the file");
        assert_eq!(
            std::fs::read(&file).unwrap(),
            good,
            "{what}: the file is unchanged"
        );
    };
    uses_the_file("second run");

    // Header 64 bytes (the token count last), then the token ids, the blocks, a 32-byte
    // checksum.
    let n = good.len();
    let tokens_end = 64 + 4 * u64::from_le_bytes(good[56..64].try_into().unwrap()) as usize;
    let mut damaged: Vec<(String, Vec<u8>)> = Vec::new();
    for cut in [0, 5, 30, 63, 100, tokens_end + 1000, n / 2, n - 33, n - 1] {
        damaged.push((format!("cut at {cut}"), good[..cut].to_vec()));
    }
    for at in [9, 20, 46, 50, 58, 80, tokens_end + 7, n * 3 / 4, n - 1] {
        let mut bad = good.clone();
        bad[at] ^= 0x40;
        damaged.push((format!("byte {at} flipped"), bad));
    }
    let mut newer = good.clone();
    newer[8] += 1;
    let body = n - 32;
    let sum = Sha256::digest(&newer[..body]);
    newer[body..].copy_from_slice(&sum);
    damaged.push(("a newer layout".into(), newer));
    damaged.push((
        "another model's file".into(),
        other_models_file(&dir, prompt),
    ));

    for (what, bytes) in damaged {
        std::fs::write(&file, &bytes).unwrap();
        let (out, err, ok) = run(&["--prompt-cache", f], prompt);
        assert!(ok, "{what}: {err}");
        assert_eq!(out, reference, "{what}");
        let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
        assert_eq!(warnings.len(), 1, "{what}: {err}");
        assert!(warnings[0].contains("prompt cache"), "{what}: {err}");
        assert_eq!(
            std::fs::read(&file).unwrap(),
            good,
            "{what}: rewritten whole"
        );
    }

    // A file without gen's signature is not gen's to rewrite (a model, notes given by mistake):
    // one line, exit 1, and the file as it was.
    let mut flipped = good.clone();
    flipped[0] ^= 0x40;
    for (what, bytes) in [
        ("byte 0 flipped", flipped),
        ("a text file", b"notes the user keeps\n".to_vec()),
    ] {
        std::fs::write(&file, &bytes).unwrap();
        let (out, err, ok) = run(&["--prompt-cache", f], prompt);
        assert!(!ok && out.is_empty(), "{what}: {err}");
        assert!(err.contains("not a gen prompt cache"), "{what}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{what}: {err}");
        assert_eq!(
            std::fs::read(&file).unwrap(),
            bytes,
            "{what}: left as it was"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prompt-cache file Gemma 3 made for `prompt`.
fn other_models_file(dir: &Path, prompt: &str) -> Vec<u8> {
    let path = dir.join("gemma.cache");
    let mut cmd = common::gen();
    cmd.arg("--model")
        .arg(common::gemma3())
        .args([
            "--temperature",
            "0",
            "--max-new",
            "1",
            "-q",
            "--prompt-cache",
        ])
        .arg(&path);
    let out = common::with_stdin(cmd, prompt);
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    std::fs::read(&path).unwrap()
}

/// The path GPUs take (candle's operations, an f32 cache of tensors) saves and loads its own
/// blocks; a file from gen's CPU kernels is another layout to it, refused with a warning.
#[test]
fn prompt_cache_files_work_on_the_device_path_and_are_its_own() {
    let dir = temp("device");
    let file = dir.join("prompt.cache");
    let prompt = &bench_text()[..800];
    let run_on = |candle: bool| {
        let mut cmd = common::gen();
        if candle {
            cmd.env("GEN_ATTENTION", "candle");
        }
        cmd.arg("--model")
            .arg(common::smollm2())
            .args(["--temperature", "0", "--max-new", "8", "--stats", "json"])
            .arg("--prompt-cache")
            .arg(&file);
        let out = common::with_stdin(cmd, prompt);
        let err = common::text(&out.stderr);
        assert!(out.status.success(), "{err}");
        let cached = stats_json(&err)["cached_tokens"].as_u64().unwrap();
        (common::text(&out.stdout), err, cached)
    };
    let (first, _, cached) = run_on(true);
    assert_eq!(cached, 0);
    let (second, err, cached) = run_on(true);
    assert_eq!(second, first);
    assert!(
        cached >= 16 * 8 && !err.contains("warning"),
        "{cached}: {err}"
    );
    let (_, err, cached) = run_on(false);
    assert_eq!(cached, 0);
    assert!(
        err.contains("another model file or KV cache layout"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
