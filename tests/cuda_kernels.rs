//! gen's CUDA kernels (src/model/device/kernels.cu) run on the CPU, against plain references.
//!
//! tests/cuda_emu/emu.h supplies just enough of CUDA for the kernel source to compile as C++
//! and run: each thread of a block a real thread, `__syncthreads` a barrier, warp shuffles
//! through shared memory. tests/cuda_emu/harness.cpp runs the cache write (a strided source,
//! scattered slots, nothing else touched) and one-token attention (several 256-key tiles of
//! online softmax, block tables out of order, a sliding window, query rows out of order, head
//! widths 64, 96 and 256, 1 to 7 query heads per kv head) against double-precision references.
//!
//! What this cannot check is the GPU itself (launch limits, registers, the PTX, candle's
//! buffers): `.ci/gpu-check` does that on a GPU. Needs a C++20 compiler (`c++`, or $CXX).

use std::path::Path;
use std::process::Command;

#[test]
fn cuda_kernels_agree_with_references_when_emulated() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gen-cuda-emu-harness");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let build = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-o",
        ])
        .arg(&exe)
        .arg(root.join("tests/cuda_emu/harness.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx} (a C++20 compiler is needed): {e}"));
    assert!(
        build.status.success(),
        "compiling the harness failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().expect("run the harness");
    let out = String::from_utf8_lossy(&run.stdout);
    eprint!("{out}");
    assert!(run.status.success(), "the kernels disagree:\n{out}");
    for case in ["kv_write", "smollm2 shape", "gemma3 shape", "width 96, g 7"] {
        assert!(
            out.lines().any(|l| l.starts_with(case)),
            "case {case:?} did not run:\n{out}"
        );
    }
}
