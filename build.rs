//! With the `cuda` feature: compile gen's own CUDA kernels (src/model/device/kernels.cu) to PTX with
//! nvcc, for src/model/cuda.rs to load at run time. Nothing happens in a CPU-only build.
//!
//! nvcc is found as $NVCC, else $CUDA_HOME/bin/nvcc, else on PATH. The PTX targets
//! compute capability $CUDA_COMPUTE_CAP (as for candle's kernels; 70 when unset): the driver
//! compiles it for the GPU at hand, any of that capability or newer.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/model/device/kernels.cu");
    for var in ["NVCC", "CUDA_HOME", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"))
        .join("gen_kernels.ptx");
    let nvcc = std::env::var("NVCC").ok().unwrap_or_else(|| {
        std::env::var("CUDA_HOME")
            .ok()
            .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
            .filter(|p| p.exists())
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "nvcc".into())
    });
    let cap: String = std::env::var("CUDA_COMPUTE_CAP")
        .unwrap_or_else(|_| "70".into())
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "--std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&out)
        .arg("src/model/device/kernels.cu")
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{nvcc} failed ({s}) compiling src/model/device/kernels.cu"),
        Err(e) => panic!(
            "cannot run {nvcc} ({e}): the cuda feature needs the CUDA toolkit's nvcc \
             (set NVCC or CUDA_HOME, or put it on PATH)"
        ),
    }
}
