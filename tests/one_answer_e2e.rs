//! One answer however it is computed, through the binary on the real models: `--batch`
//! replies equal each prompt run alone, and `--speculate lookup` equals plain decoding, greedy,
//! on both models gen fetches by name (SmolLM2 Q4_1; Gemma 3 270M, whose Q4_K and Q6_K
//! matrices are the types whose paths once rounded apart), under the paths this CPU measured
//! and under forced mixes of the AVX2 and 512-bit paths per kind of call (where it has both):
//! the split that gave 5 of 8 Gemma replies another text on an AMX Xeon. A sampled batch line
//! equals its prompt run alone with the seed the line reports. (tests/one_answer.rs checks the
//! logits bit for bit, every type and mix, in process.)

mod common;

use std::path::Path;
use std::process::Output;

use common::text;

const PROMPTS: [&str; 8] = [
    "Once upon a time, there was a little",
    "In 1969, Neil Armstrong",
    "The meaning of life is",
    "The best way to learn a language is",
    "def fibonacci(n):",
    "Water boils at",
    "My favourite season is autumn because",
    "The three primary colours are",
];

/// The measured choice (no `GEN_KERNEL`), then forced mixes where the CPU has both SIMD paths.
fn mixes() -> Vec<Option<&'static str>> {
    let mut out = vec![None];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx2")
    {
        out.extend([Some("avx2/avx512/avx512"), Some("avx512/avx2/avx2")]);
    }
    out
}

fn run(model: &Path, mix: Option<&str>, args: &[&str], stdin: &str) -> Output {
    let mut cmd = common::gen();
    cmd.env_remove("GEN_KERNEL");
    if let Some(m) = mix {
        cmd.env("GEN_KERNEL", m);
    }
    cmd.arg("--model").arg(model).args(args).args(["-q"]);
    let out = common::with_stdin(cmd, stdin);
    assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    out
}

fn batch_texts(out: &Output) -> Vec<String> {
    text(&out.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["text"].as_str().unwrap().to_string()
        })
        .collect()
}

fn greedy_everywhere(model: &Path, max_new: &str) {
    let input = PROMPTS.join("\n") + "\n";
    let greedy = ["--max-new", max_new, "--temperature", "0", "--ignore-eos"];
    let mut first: Option<Vec<String>> = None;
    for mix in mixes() {
        let alone: Vec<String> = PROMPTS
            .iter()
            .map(|p| {
                let args = [&["--prompt", p][..], &greedy].concat();
                text(&run(model, mix, &args, "").stdout)
            })
            .collect();
        let batched = batch_texts(&run(
            model,
            mix,
            &[&["--batch", "-"][..], &greedy].concat(),
            &input,
        ));
        let speculated = batch_texts(&run(
            model,
            mix,
            &[&["--batch", "-", "--speculate", "lookup"][..], &greedy].concat(),
            &input,
        ));
        for (i, p) in PROMPTS.iter().enumerate() {
            assert_eq!(batched[i], alone[i], "{mix:?}: {p:?} batched");
            assert_eq!(
                speculated[i], alone[i],
                "{mix:?}: {p:?} batched, speculating"
            );
        }
        // One prompt alone with speculation too.
        let args = [
            &["--prompt", PROMPTS[0], "--speculate", "lookup"][..],
            &greedy,
        ]
        .concat();
        assert_eq!(
            text(&run(model, mix, &args, "").stdout),
            alone[0],
            "{mix:?}"
        );
        // Every SIMD path gives the same bits, so every mix the same text.
        match &first {
            None => first = Some(alone),
            Some(f) => assert_eq!(&alone, f, "{mix:?} against the measured paths"),
        }
    }
}

#[test]
fn batch_and_speculation_give_each_prompts_own_reply_on_smollm2() {
    greedy_everywhere(&common::smollm2(), "48");
}

#[test]
fn batch_and_speculation_give_each_prompts_own_reply_on_gemma3() {
    greedy_everywhere(&common::gemma3(), "48");
}

/// Sampled: line i of a seeded batch samples with seed + i (the line says which), and the same
/// prompt run alone with that seed gives the same text.
#[test]
fn a_sampled_batch_line_is_its_prompt_alone_with_its_seed() {
    let model = common::gemma3();
    let input = PROMPTS[..4].join("\n") + "\n";
    let sampled = ["--max-new", "24", "--temperature", "0.9", "--ignore-eos"];
    let out = run(
        &model,
        None,
        &[&["--batch", "-", "--seed", "5"][..], &sampled].concat(),
        &input,
    );
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (i, line) in lines.iter().enumerate() {
        let seed = line["seed"].as_u64().unwrap().to_string();
        let args = [&["--prompt", PROMPTS[i], "--seed", &seed][..], &sampled].concat();
        let alone = text(&run(&model, None, &args, "").stdout);
        assert_eq!(
            line["text"].as_str().unwrap(),
            alone,
            "prompt {i}, seed {seed}"
        );
    }
}
