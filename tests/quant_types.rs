//! Every GGUF weight type gen runs, end to end: a tiny random-weight model (widths multiples of
//! 256, so the K-quants apply) written by this test with every matrix in one type, loaded
//! through gen's loader onto its CPU kernels, against the same model with those matrices
//! widened to f32 (run through plain f32 products). The only difference between the two is
//! the 8-bit quantization of the activations that the quantized kernels make, as llama.cpp
//! does: logits agree within 3% of their scale (measured: 0.9-1.6%) and greedy picks agree.
//!
//! The files are written by `common::typed` (IQ4_NL, IQ4_XS and MXFP4 quantized there, the others by
//! candle's quantizers). A type gen does not run is refused with one line naming the tensor,
//! its type and the types gen runs, before any weight is read.

mod common;

use std::path::{Path, PathBuf};

use common::typed::{scratch as scratch_in, write_model, TYPES, VOCAB};

fn scratch() -> PathBuf {
    scratch_in("quant_types")
}

/// Logits of a prefill of 5 tokens, then 6 one-token steps.
fn logits(path: &Path, tokenizer: &Path) -> Vec<Vec<f32>> {
    let tokens: Vec<u32> = (0..11).map(|i| (i * 13 + 5) % VOCAB as u32).collect();
    common::gen_logits(path, Some(tokenizer), &tokens, 5)
}

#[test]
fn every_type_runs_and_agrees_with_its_widened_twin() {
    let dir = scratch();
    let tok = dir.join("tokenizer.json");
    // Every type but F16 and BF16, which have no quantization of the activations to compare.
    for &(ty, name) in &TYPES[2..] {
        let q = dir.join(format!("{name}.gguf"));
        let f = dir.join(format!("{name}-f32.gguf"));
        let widened = write_model(&q, ty, None);
        write_model(&f, 0, Some(&widened));
        let (got, want) = (logits(&q, &tok), logits(&f, &tok));
        let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 1.0, "{name}: logits too flat to compare ({scale})");
        let mut same_pick = 0;
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let diff = g
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 0.03 * scale,
                "{name} step {step}: logits differ by {diff} (scale {scale})"
            );
            same_pick += (common::argmax(g) == common::argmax(w)) as usize;
        }
        assert!(
            same_pick >= got.len() - 1,
            "{name}: greedy picks agree at {same_pick} of {} steps",
            got.len()
        );
        // Through the binary too: it loads and generates.
        let out = common::gen()
            .args([
                "--prompt",
                "w5 w9 w17",
                "-n",
                "4",
                "-t",
                "0",
                "--ignore-eos",
                "--stats",
                "json",
            ])
            .arg("--model")
            .arg(&q)
            .arg("--tokenizer")
            .arg(&tok)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            common::text(&out.stderr)
        );
        let _ = std::fs::remove_file(&q);
        let _ = std::fs::remove_file(&f);
    }
}

#[test]
fn a_type_gen_does_not_run_is_refused_in_one_line_naming_it() {
    let dir = scratch();
    let path = dir.join("iq2xxs.gguf");
    write_model(&path, 20, None);
    // Turn the first matrix into IQ2_XXS (type 16): same file otherwise.
    let mut bytes = std::fs::read(&path).unwrap();
    let name = b"blk.0.attn_q.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    // n_dims (4 bytes), two dims (16 bytes), then the type.
    bytes[at + 20..at + 24].copy_from_slice(&16u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let out = common::gen()
        .args(["--prompt", "w5", "-n", "2"])
        .arg("--model")
        .arg(&path)
        .arg("--tokenizer")
        .arg(dir.join("tokenizer.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = common::one_error_line(&out);
    for want in [
        "blk.0.attn_q.weight",
        "IQ2_XXS",
        "gen does not run",
        "Q4_K",
        "IQ4_XS",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    assert!(!line.to_lowercase().contains("candle"), "{line}");
}
