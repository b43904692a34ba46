//! The real default model end to end: greedy generation must agree with llama.cpp's greedy
//! output on the same file. The reference (assets/llama-cpp-greedy-smollm2.jsonl) was recorded
//! with llama.cpp 0c1e57098 (llama-cpp-python 0.3.36): top-k 1, 2 threads, no BOS, special tokens
//! parsed, 24 tokens or up to EOS per prompt.

mod common;

use candle_core::Device;
use common::agreement::{teacher_forced_agreement, Greedy};
use gen::generate::{generate, Limits, StopReason};
use gen::model::load_gguf;
use gen::sampler::{Sampler, SamplingParams};

fn references() -> Vec<Greedy> {
    common::jsonl(include_str!("../assets/llama-cpp-greedy-smollm2.jsonl"))
}

/// Largest logit gap at which gen may pick a different token than llama.cpp. Both engines
/// quantize activations to 8 bits before every matrix multiply, so a difference in float
/// summation order can flip an activation's rounding, and such flips compound over 30 layers.
/// Measured on these prompts: gen's scalar kernel and its AVX2 kernel (the same integer dot
/// products, summed in a different float order) differ from llama.cpp at different steps, the
/// scalar one by gaps under 0.15, the AVX2 one once by 0.57. A gap beyond 0.6 is a real error.
const NEAR_TIE: f32 = 0.6;

/// Teacher-forced comparison: feed llama.cpp's own tokens one by one and check at every step
/// that gen's greedy choice is llama.cpp's token, or that llama.cpp's token is within NEAR_TIE
/// of gen's best. Forcing keeps one near-tie from derailing the comparison of the rest.
#[test]
fn greedy_choices_agree_with_llama_cpp_at_every_step() {
    let mut loaded = load_gguf(&common::smollm2(), &Device::Cpu, None).unwrap();
    assert!(!loaded.add_bos);
    // This reference holds no logits: only the choices are compared.
    teacher_forced_agreement(&mut loaded, &references(), NEAR_TIE, None).assert("SmolLM2 Q4_1", 90);
}

/// Free-running greedy generation: the first three tokens are exact for every reference prompt
/// (the earliest near-tie on these prompts is the fourth token of the chat reply),
/// and a reply that matches llama.cpp's to its EOS ends there, costing one pass more than tokens.
#[test]
fn greedy_generation_starts_exactly_like_llama_cpp() {
    let mut loaded = load_gguf(&common::smollm2(), &Device::Cpu, None).unwrap();
    for r in references() {
        let prompt = loaded.tokenizer.encode(&r.prompt, false).unwrap();
        let mut sampler = Sampler::new(SamplingParams::default());
        let limits = Limits {
            max_new: r.ids.len(),
            context_len: 2048,
        };
        let eos = loaded.tokenizer.eos_ids().to_vec();
        let g = generate(
            loaded.model.as_mut(),
            &prompt,
            &mut sampler,
            &eos,
            &limits,
            &mut common::Discard,
        )
        .unwrap();
        // llama.cpp's reference keeps the EOS it stopped at; gen neither prints nor keeps it.
        let expected: Vec<u32> = r
            .ids
            .iter()
            .copied()
            .filter(|id| !eos.contains(id))
            .collect();
        let n = 3.min(expected.len());
        let text = loaded.tokenizer.decode(&g.tokens).unwrap();
        assert_eq!(g.tokens[..n], expected[..n], "{:?}: {text:?}", r.prompt);
        if expected.len() < r.ids.len() && g.tokens == expected {
            assert_eq!(g.stop, StopReason::Eos);
        }
        match g.stop {
            StopReason::Eos => assert_eq!(g.forward_passes, g.tokens.len() + 1),
            StopReason::MaxNew => assert_eq!(g.forward_passes, g.tokens.len()),
            other => panic!("unexpected stop {other:?}"),
        }
    }
}

#[test]
fn the_capital_of_france_is_paris() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gen"))
        .arg("--model")
        .arg(common::smollm2())
        .args([
            "--prompt",
            "The capital of France is",
            "--max-new",
            "3",
            "--temperature",
            "0",
        ])
        .args(["--threads", "2", "--stats", "json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), " Paris.\n");
    let err = String::from_utf8_lossy(&out.stderr);
    let report: serde_json::Value = serde_json::from_str(err.lines().last().unwrap()).unwrap();
    assert_eq!(report["forward_passes"], 3);
    assert_eq!(report["generated_tokens"], 3);
    assert_eq!(report["prompt_tokens"], 5);
    assert_eq!(report["stop_reason"], "max-new");
    assert_eq!(report["model"], "SmolLM2-135M-Instruct.Q4_1");
    for key in [
        "ttft_s",
        "prefill_tok_s",
        "decode_tok_s",
        "ms_per_token",
        "total_s",
        "load_s",
    ] {
        assert!(report[key].as_f64().unwrap() > 0.0, "{key} in {report}");
    }
}
