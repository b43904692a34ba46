//! Helpers shared by the benchmarks.

use std::path::PathBuf;

use gen::source::{self, FetchOptions, ModelSpec};

/// The model to measure: GEN_BENCH_MODEL, or the default model (fetched into gen's cache).
pub fn bench_model() -> PathBuf {
    match std::env::var("GEN_BENCH_MODEL") {
        Ok(p) => PathBuf::from(p),
        Err(_) => source::resolve(
            &ModelSpec::Known(source::DEFAULT_MODEL.into()),
            &FetchOptions::default(),
        )
        .expect("fetch the default model"),
    }
}

/// An environment variable parsed as T, or `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median (NaN for no values).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
