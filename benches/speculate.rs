//! Speculative decoding (`--speculate lookup`): decode speed with and without it, greedy, on
//! copy-heavy chat prompts (rewrite or extract from a given text, fix a line of given code,
//! summarise with quotes) and on free-text ones. Each prompt runs without and with speculation
//! one after the other, GEN_BENCH_RUNS rounds; per prompt the median decode tok/s of each (the
//! report's decode_tok_s: tokens sampled after the first, per second of decoding), and per
//! category the ratio of total decode time without to with (the replies are the same tokens
//! both ways, which the bench checks), plus tokens per pass and proposals accepted.
//!
//!     cargo bench --bench speculate
//!
//! Environment: GEN_BENCH_RUNS (3), GEN_BENCH_THREADS (2), GEN_BENCH_MAX_NEW (200),
//! GEN_BENCH_DRAFT_MAX (8: --draft-max), GEN_BENCH_MODEL (default model).
//! Targets (issue 18): copy-heavy at least 1.8 times the decode speed without, free text at
//! least 0.95 times. Not a test: nothing here asserts a speed.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::{env_or, fail, last_json, median};

const STORY: &str = "The old lighthouse stood at the edge of the cliff for more then two hundred \
years. Every night its keeper climbed the narrow stairs, lit the great lamp, and watched the \
ships pass safely through the rocky strait. When the storms came, the keeper stayed awake \
untill morning, making sure the light never went out. The villagers said that no ship had ever \
been lost while the lighthouse was burning, and they brought the keeper bread and fish every \
Sunday to thank him.";

const REPORT: &str = "Quarterly report. Sales rose by 12 percent in the northern region, \
driven by the new store in Leeds. The southern region was flat. Costs fell by 3 percent after \
the warehouse move in March. The board approved a budget of 2.4 million pounds for the next \
year. Hiring will focus on engineers and support staff. The chief executive said that the \
company expects steady growth and no new debt.";

const PYTHON: &str = "def average(values):\n    total = 0\n    for v in values:\n        \
total += v\n    return total / len(value)\n\n\ndef main():\n    data = [3, 5, 8, 13]\n    \
print(\"average:\", average(data))\n\n\nif __name__ == \"__main__\":\n    main()\n";

const RUST: &str = "fn largest(items: &[i32]) -> Option<i32> {\n    let mut best = None;\n    \
for &x in items {\n        if best.map_or(true, |b| x < b) {\n            best = Some(x);\n        \
}\n    }\n    best\n}\n";

/// (category, name, user message) of each prompt.
fn prompts() -> Vec<(&'static str, &'static str, String)> {
    vec![
        (
            "copy",
            "rewrite",
            format!("Rewrite the following text, fixing the spelling mistakes:\n\n{STORY}"),
        ),
        (
            "copy",
            "extract",
            format!("Copy out, word for word, the sentences of this report about money:\n\n{REPORT}"),
        ),
        (
            "copy",
            "fix-python",
            format!("This Python code has a bug in one line. Fix it and write out the whole corrected program:\n\n{PYTHON}"),
        ),
        (
            "copy",
            "fix-rust",
            format!("This Rust function should return the largest item but returns the smallest. Fix the comparison and write out the whole function:\n\n{RUST}"),
        ),
        (
            "copy",
            "quote-summary",
            format!("Summarise this report in three points, quoting its own sentences for each point:\n\n{REPORT}"),
        ),
        (
            "copy",
            "repeat-story",
            format!("Here is a story:\n\n{STORY}\n\nRepeat the story exactly, then give it a title."),
        ),
        ("free", "dragon", "Write a short story about a dragon who learns to bake bread.".into()),
        ("free", "photosynthesis", "Explain how photosynthesis works to a ten-year-old.".into()),
        ("free", "cooking", "Give me ten tips for learning to cook at home.".into()),
        ("free", "beach", "Describe a summer day at the beach in vivid detail.".into()),
    ]
}

struct Sample {
    tok_s: f64,
    decode_s: f64,
    tokens: u64,
    passes: u64,
    proposed: u64,
    accepted: u64,
    text: String,
}

fn run(model: &Path, threads: usize, max_new: usize, prompt: &str, draft: Option<usize>) -> Sample {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gen"));
    c.arg("--model")
        .arg(model)
        .args([
            "--chat",
            "--temperature",
            "0",
            "--stats",
            "json",
            "--max-new",
        ])
        .arg(max_new.to_string())
        .args(["--threads", &threads.to_string(), "--prompt", prompt])
        .stdin(Stdio::null());
    if let Some(k) = draft {
        c.args(["--speculate", "lookup", "--draft-max", &k.to_string()]);
    }
    let out = c
        .output()
        .unwrap_or_else(|e| fail(&format!("cannot run gen: {e}")));
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        fail(&format!("gen failed ({}): {}", out.status, err.trim()));
    }
    let r = last_json(&err).unwrap_or_else(|| fail("gen printed no JSON report"));
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let u = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let tok_s = f("decode_tok_s");
    let passes = u(&r["forward_passes"]).saturating_sub(1);
    let tokens = (f("tokens_per_pass") * passes as f64).round() as u64;
    Sample {
        tok_s,
        decode_s: if tok_s > 0.0 {
            tokens as f64 / tok_s
        } else {
            0.0
        },
        tokens,
        passes,
        proposed: u(&r["speculate"]["proposed"]),
        accepted: u(&r["speculate"]["accepted"]),
        text: String::from_utf8_lossy(&out.stdout).into_owned(),
    }
}

/// Milliseconds of a decode pass of 1..=k+1 tokens after a 200-token prompt, in process (the
/// price of checking proposals: what a pass costs per token it feeds). Medians of 15, after
/// a warm-up.
fn pass_costs(model: &Path, most: usize) -> Vec<f64> {
    use gen::model::SeqStep;
    let mut loaded = gen::model::load_gguf(model, &candle_core::Device::Cpu, None)
        .unwrap_or_else(|e| fail(&format!("cannot load the model: {e:#}")));
    let prompt = loaded
        .tokenizer
        .encode(&STORY.repeat(3), true)
        .unwrap_or_else(|e| fail(&e.to_string()));
    let m = loaded.model.as_mut();
    let total = prompt.len() + most + 1;
    m.reserve_pool(gen::model::kv_cache::blocks_for(total))
        .unwrap_or_else(|e| fail(&e.to_string()));
    let seq = m.new_sequence();
    assert!(m.reserve(seq, total));
    m.forward(&[SeqStep::prefill(seq, &prompt, 0)])
        .unwrap_or_else(|e| fail(&e.to_string()));
    // Warm up (caches, the thread pool) before anything is timed.
    for n in [1, most + 1, 1] {
        m.forward(&[SeqStep::decode(seq, &prompt[1..=n], prompt.len())])
            .unwrap_or_else(|e| fail(&e.to_string()));
        m.truncate(seq, prompt.len());
    }
    (1..=most + 1)
        .map(|n| {
            let times = (0..15)
                .map(|_| {
                    let start = std::time::Instant::now();
                    m.forward(&[SeqStep::decode(seq, &prompt[1..=n], prompt.len())])
                        .unwrap_or_else(|e| fail(&e.to_string()));
                    m.truncate(seq, prompt.len());
                    start.elapsed().as_secs_f64() * 1000.0
                })
                .collect();
            median(times)
        })
        .collect()
}

fn main() {
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let max_new: usize = env_or("GEN_BENCH_MAX_NEW", 200);
    let draft: usize = env_or("GEN_BENCH_DRAFT_MAX", 8);
    let model = common::bench_model();
    let prompts = prompts();
    eprintln!(
        "speculate bench: {} prompts, {runs} rounds, --threads {threads}, --max-new {max_new}, \
         --draft-max {draft}, greedy; model {}",
        prompts.len(),
        model.display()
    );
    // On a worker of the thread pool, as the binary runs (src/main.rs).
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    let costs = match rayon::ThreadPoolBuilder::new().build() {
        Ok(pool) => pool.install(|| pass_costs(&model, draft)),
        Err(_) => pass_costs(&model, draft),
    };
    println!("decode pass of n tokens, ms (relative to one token):");
    for (i, c) in costs.iter().enumerate() {
        println!("  n = {:<2} {c:>7.2} ms ({:.2}x)", i + 1, c / costs[0]);
    }
    // [prompt][0: plain, 1: speculative] -> samples over rounds
    let mut samples: Vec<[Vec<Sample>; 2]> = prompts.iter().map(|_| [vec![], vec![]]).collect();
    for round in 0..runs {
        for (i, (_, name, text)) in prompts.iter().enumerate() {
            // Alternate which goes first, so neither always runs on a warmer machine.
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for mode in order {
                let d = (mode == 1).then_some(draft);
                samples[i][mode].push(run(&model, threads, max_new, text, d));
            }
            let (a, b) = (
                &samples[i][0].last().unwrap(),
                &samples[i][1].last().unwrap(),
            );
            if a.text != b.text {
                fail(&format!(
                    "{name}: the reply differs with --speculate (greedy)"
                ));
            }
        }
    }
    println!(
        "{:<16} {:>6} {:>10} {:>10} {:>7} {:>10} {:>10}",
        "prompt", "tokens", "plain t/s", "spec t/s", "ratio", "tok/pass", "accepted"
    );
    for cat in ["copy", "free"] {
        let (mut plain_s, mut spec_s) = (0.0, 0.0);
        let (mut tokens, mut passes, mut proposed, mut accepted) = (0, 0, 0, 0);
        for (i, (c, name, _)) in prompts.iter().enumerate() {
            if *c != cat {
                continue;
            }
            let [p, s] = &samples[i];
            let med = |v: &[Sample], f: fn(&Sample) -> f64| median(v.iter().map(f).collect());
            let (pt, st) = (med(p, |x| x.tok_s), med(s, |x| x.tok_s));
            plain_s += med(p, |x| x.decode_s);
            spec_s += med(s, |x| x.decode_s);
            let last = s.last().unwrap();
            tokens += last.tokens;
            passes += last.passes;
            proposed += last.proposed;
            accepted += last.accepted;
            println!(
                "{name:<16} {:>6} {pt:>10.1} {st:>10.1} {:>6.2}x {:>10.2} {:>4}/{:<5}",
                last.tokens,
                st / pt,
                last.tokens as f64 / last.passes.max(1) as f64,
                last.accepted,
                last.proposed
            );
        }
        println!(
            "{cat:<16} decode speed with/without: {:.2}x ({} tokens in {} decode passes, {:.2} per \
             pass; {} of {} proposals accepted)",
            plain_s / spec_s,
            tokens,
            passes,
            tokens as f64 / passes.max(1) as f64,
            accepted,
            proposed
        );
    }
}
