//! Helpers shared by the integration tests.
#![allow(dead_code)]
use std::path::PathBuf;

use gen::source::{self, FetchOptions, ModelSpec};

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
