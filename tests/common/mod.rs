//! Helpers shared by the integration tests.
#![allow(dead_code)]
use std::path::PathBuf;

/// The default model (SmolLM2-135M-Instruct Q4_1), fetched through gen's own code path.
pub fn smollm2() -> PathBuf {
    // Temporary: replaced by gen::source once it lands.
    PathBuf::from("/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Gemma 3 270M Q4_K_M, fetched through gen's own code path.
pub fn gemma3() -> PathBuf {
    PathBuf::from("/tmp/gemma/gemma-3-270m-q4_k_m.gguf")
}
