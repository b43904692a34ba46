//! The default model as people requantize it: SmolLM2-135M-Instruct requantized by llama.cpp's
//! llama-quantize to Q4_K_M and Q5_K_M, teacher-forced against llama.cpp's greedy ids and
//! logits on the same files (assets/llama-cpp-greedy-smollm2-q4_k_m.jsonl and -q5_k_m.jsonl:
//! the 6 prompts of assets/llama-cpp-greedy-smollm2.jsonl, recorded by
//! assets/record-llama-cpp-greedy.py with llama.cpp 0c1e57098). Most of the model's matrices
//! are 576 wide, not a multiple of 256, so llama-quantize falls back from the K-quants for them:
//! of the 211 matrices, Q4_K_M has 166 in Q5_0, 16 in Q4_K, 14 in Q6_K and 15 in Q8_0; Q5_K_M
//! 166 in Q5_1, 16 in Q5_K, 14 in Q6_K and 15 in Q8_0. All run on gen's own kernels, with the
//! activations quantized as llama.cpp does for each type (Q8_0 blocks against Q5_0 and Q8_0,
//! Q8_1 against Q5_1, Q8_K against the K-quants).
//!
//! The files are made in the test (common::agreement::requantized) by the llama-quantize that
//! `.ci/llama-server llama-quantize` builds once, and checked by sha256 against the files the
//! references were recorded on.

mod common;

use candle_core::Device;
use common::agreement::{requantized, teacher_forced_agreement, Greedy};
use gen::model::load_gguf;

/// Largest logit gap at which gen may pick another token than llama.cpp. Both quantize the
/// activations to 8 bits before each product, so a last-bit difference in a float sum can flip
/// one activation's rounding and move the logits by far more than the sum's own error (see
/// tests/e2e.rs). Measured (2026-12-03, an AVX2 machine): Q4_K_M 112 of 115 steps identical,
/// gaps 0.14 at most; Q5_K_M 128 of 132, 0.21; with GEN_KERNEL=scalar 110 of 115 (0.20) and
/// 128 of 132 (0.23).
const NEAR_TIE: f32 = 0.6;
/// Largest difference between gen's logit of llama.cpp's token and llama.cpp's own (logits here
/// run from about -5 to 26). Measured: 1.27 (Q4_K_M) and 0.98 (Q5_K_M) with the AVX2 kernels,
/// 0.82 and 1.40 with the scalar ones (the 8-bit activation flips above, compounded over 30
/// layers); llama.cpp itself moves by up to 0.41 between its AVX2 and AVX-512 builds (Gemma 3,
/// the first prompt of tests/e2e_gemma3.rs recorded on both).
const LOGIT_TOLERANCE: f32 = 2.0;

fn check(ty: &str, sha256: &str, references: &str) {
    let path = requantized(ty, sha256);
    let mut loaded = load_gguf(&path, &Device::Cpu, None).unwrap();
    let refs: Vec<Greedy> = common::jsonl(references);
    assert_eq!(refs.len(), 6);
    teacher_forced_agreement(&mut loaded, &refs, NEAR_TIE, Some(LOGIT_TOLERANCE))
        .assert(&format!("SmolLM2 {ty}"), 95);
}

#[test]
fn q4_k_m_agrees_with_llama_cpp_at_every_step() {
    check(
        "Q4_K_M",
        "dc0f3a02e821146247a0af6895adf9872124f368682cb110cb9ed09ff2a9f9f1",
        include_str!("../assets/llama-cpp-greedy-smollm2-q4_k_m.jsonl"),
    );
}

#[test]
fn q5_k_m_agrees_with_llama_cpp_at_every_step() {
    check(
        "Q5_K_M",
        "8170c7ef444692b3b2fe63459c326def0358807ef9be6e3cb020efb86a71015e",
        include_str!("../assets/llama-cpp-greedy-smollm2-q5_k_m.jsonl"),
    );
}
