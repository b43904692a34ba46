//! One answer however it is computed: a token's logits are the same bits whatever else shares
//! its forward pass, for every weight type gen runs and every mix of kernel paths this CPU
//! offers per kind of call (one token, a few, a chunk: what the kernel choice may pick apart).
//!
//! For each type (a tiny random-weight model in the small Qwen2 shape, widths multiples of
//! 256, every matrix of that type) and each forced mix (`GEN_KERNEL=ONE/FEW/CHUNK`: every
//! combination of `avx2` and `avx512`, then `bf16` and `amx` for every call where the CPU has
//! them, and `scalar`), the logits of a reply's tokens computed one token a pass ("alone")
//! must equal, bit for bit, the same tokens' logits:
//! - beside 1, 2, 7, 15 and 16 other sequences decoding (2 to 17 tokens a pass: a few, and
//!   past 16 a chunk), the sequence at the front, in the middle or at the back of the pass;
//! - as one speculative check of 4 tokens (a few) and of 17 (a chunk);
//! - decoding beside another sequence's 20-token prompt in the same pass;
//! - with its prompt prefilled in chunks of other sizes;
//! - after preemption, resumed as the engine resumes it: its prompt prefilled again, its reply
//!   so far as one multi-token decode step, then one token a pass.
//!
//! And every mix of the AVX2 and 512-bit paths gives the same bits as the 512-bit path alone,
//! which is what lets the measured choice mix them. (AMX and `vdpbf16ps` sum BF16 products in
//! another order: a BF16 matrix takes one of them for all its calls or for none.)
//!
//! The same for a model with experts (Qwen2 MoE: 8 routed, 2 used, and a shared one) in five
//! types: routing and each expert's products see other token counts in every pass.
//!
//! One test in this binary: it sets `GEN_KERNEL` between loads, which no other test here reads.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use common::typed::{scratch, write_model, write_moe_model, TYPES, VOCAB};

/// The types also run with experts (a Qwen2 MoE of the same shape).
const MOE_TYPES: [&str; 5] = ["BF16", "Q4_0", "Q8_0", "Q4_K", "MXFP4"];
use gen::model::kv_cache::blocks_for;
use gen::model::{LanguageModel, SeqStep};

const PROMPT: usize = 21;
const REPLY: usize = 20;

type Bits = Vec<u32>;

/// The `GEN_KERNEL` values this CPU can run: every mix of its SIMD paths per kind of call
/// (the first is the 512-bit path alone where there is one), then the paths that must serve
/// every call alike.
fn mixes() -> Vec<String> {
    let mut simd = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        let zmm = avx2
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bw");
        if zmm {
            simd.push("avx512");
        }
        if avx2 {
            simd.push("avx2");
        }
    }
    let mut out = Vec::new();
    for one in &simd {
        for few in &simd {
            for chunk in &simd {
                out.push(format!("{one}/{few}/{chunk}"));
            }
        }
    }
    use gen::model::cpu::matmul::Kernel;
    if Kernel::bf16_ready() {
        out.push("bf16".into());
    }
    if Kernel::amx_ready() {
        out.push("amx".into());
    }
    out.push("scalar".into());
    out
}

fn bits(t: &Tensor) -> Vec<Bits> {
    t.to_vec2::<f32>()
        .unwrap()
        .iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Token ids of sequence `s`'s prompt and reply (sequence 0 is the one watched).
fn tokens(s: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 13 + s * 29 + 5) % (VOCAB - 2) + 1) as u32)
        .collect()
}

/// The watched sequence alone in its passes: its prompt prefilled in chunks of `chunks` tokens
/// (the last chunk's row: the prompt's last token's logits), then its reply fed in decode
/// steps of `steps` tokens (summing to REPLY - 1; a row per token).
fn one_sequence(m: &mut dyn LanguageModel, chunks: &[usize], steps: &[usize]) -> Vec<Bits> {
    let all = tokens(0, PROMPT + REPLY);
    let seq = m.new_sequence();
    assert!(m.reserve(seq, all.len()));
    let mut rows = Vec::new();
    let mut at = 0;
    for n in chunks {
        let step = SeqStep::prefill(seq, &all[at..at + n], at);
        rows = bits(&m.forward(&[step]).unwrap());
        at += n;
    }
    assert_eq!(at, PROMPT);
    for n in steps {
        let step = SeqStep::decode(seq, &all[at..at + n], at);
        rows.extend(bits(&m.forward(&[step]).unwrap()));
        at += n;
    }
    assert_eq!(at, all.len() - 1);
    m.free_sequence(seq);
    rows
}

/// The reply fed `first` tokens in one decode step, then `k` at a time.
fn steps(first: usize, k: usize) -> Vec<usize> {
    let mut out = vec![first];
    let mut left = REPLY - 1 - first;
    while left > 0 {
        out.push(k.min(left));
        left -= k.min(left);
    }
    out
}

/// The watched sequence decoding in lockstep with `others` more, itself at index `at` of
/// every pass; all prompts prefilled together in the first pass.
fn in_a_batch(m: &mut dyn LanguageModel, others: usize, at: usize) -> Vec<Bits> {
    let n = others + 1;
    let toks: Vec<Vec<u32>> = (0..n)
        .map(|i| match i.cmp(&at) {
            std::cmp::Ordering::Equal => tokens(0, PROMPT + REPLY),
            _ => tokens(i + 1, PROMPT + REPLY),
        })
        .collect();
    let seqs: Vec<_> = (0..n).map(|_| m.new_sequence()).collect();
    for s in &seqs {
        assert!(m.reserve(*s, PROMPT + REPLY));
    }
    let steps: Vec<SeqStep> = (0..n)
        .map(|i| SeqStep::prefill(seqs[i], &toks[i][..PROMPT], 0))
        .collect();
    let mut rows = vec![bits(&m.forward(&steps).unwrap()).swap_remove(at)];
    for p in PROMPT..PROMPT + REPLY - 1 {
        let steps: Vec<SeqStep> = (0..n)
            .map(|i| SeqStep::decode(seqs[i], &toks[i][p..p + 1], p))
            .collect();
        rows.push(bits(&m.forward(&steps).unwrap()).swap_remove(at));
    }
    for s in seqs {
        m.free_sequence(s);
    }
    rows
}

/// One token a pass, each pass beside a 20-token prompt of another sequence (first in the
/// pass; a new one each pass, as the model's window is short), so every product is a chunk's.
fn beside_a_prefill(m: &mut dyn LanguageModel) -> Vec<Bits> {
    let all = tokens(0, PROMPT + REPLY);
    let seq = m.new_sequence();
    assert!(m.reserve(seq, all.len()));
    let mut rows = bits(
        &m.forward(&[SeqStep::prefill(seq, &all[..PROMPT], 0)])
            .unwrap(),
    );
    for (i, p) in (PROMPT..all.len() - 1).enumerate() {
        let other = m.new_sequence();
        assert!(m.reserve(other, 20));
        let chunk = tokens(i + 40, 20);
        let l = m
            .forward(&[
                SeqStep::prefill(other, &chunk, 0),
                SeqStep::decode(seq, &all[p..p + 1], p),
            ])
            .unwrap();
        rows.push(bits(&l).swap_remove(1));
        m.free_sequence(other);
    }
    m.free_sequence(seq);
    rows
}

/// Which rows of `got` differ from `want` (as positions after the prompt).
fn differing(got: &[Bits], want: &[Bits]) -> Vec<usize> {
    assert_eq!(got.len(), want.len(), "row counts");
    (0..got.len()).filter(|&i| got[i] != want[i]).collect()
}

/// Every check on the model at `path` under the paths set now: the failures, and the rows of
/// the reply alone.
fn check_model(path: &Path, tok: &Path, label: &str) -> (Vec<String>, Vec<Bits>) {
    let mut loaded = gen::model::load(path, &Device::Cpu, Some(tok), None).unwrap();
    let m = loaded.model.as_mut();
    m.reserve_pool(17 * blocks_for(PROMPT + REPLY) + 4).unwrap();
    // One token a pass.
    let want = one_sequence(m, &[PROMPT], &steps(1, 1));
    let mut failures = Vec::new();
    let mut check = |what: String, got: Vec<Bits>, want: &[Bits]| {
        let bad = differing(&got, want);
        if !bad.is_empty() {
            failures.push(format!("{label}: {what}: rows {bad:?} differ"));
        }
    };
    for (others, at) in [(1, 1), (2, 0), (7, 3), (15, 15), (16, 8)] {
        check(
            format!("{others} others, at {at}"),
            in_a_batch(m, others, at),
            &want,
        );
    }
    // Speculative checks: several tokens of the reply in one decode step.
    for k in [4, 17] {
        let got = one_sequence(m, &[PROMPT], &steps(k, k));
        check(format!("checked {k} at a time"), got, &want);
    }
    check("beside a prefill chunk".into(), beside_a_prefill(m), &want);
    for sizes in [&[5, 16][..], &[7, 7, 7], &[20, 1]] {
        let got = one_sequence(m, sizes, &steps(1, 1));
        check(format!("prompt in chunks {sizes:?}"), got, &want);
    }
    // Preempted after h reply tokens and resumed as the engine resumes (`batch.rs`): its
    // prompt prefilled again, its reply so far as one decode step, then one token a pass.
    for h in [1, 8, 18] {
        let got = one_sequence(m, &[PROMPT], &steps(h, 1));
        check(format!("resumed after {h}"), got, &want);
    }
    (failures, want)
}

#[test]
fn a_tokens_logits_do_not_depend_on_its_pass_on_any_path_or_type() {
    let dir = scratch("one_answer");
    let tok = dir.join("tokenizer.json");
    let mut models: Vec<(PathBuf, String)> = TYPES
        .iter()
        .map(|(ty, name)| {
            let path = dir.join(format!("{name}.gguf"));
            write_model(&path, *ty, None);
            (path, name.to_string())
        })
        .collect();
    // With experts: each expert sees another count of tokens every pass.
    for (ty, name) in TYPES.iter().filter(|(_, n)| MOE_TYPES.contains(n)) {
        let path = dir.join(format!("{name}-moe.gguf"));
        write_moe_model(&path, *ty);
        models.push((path, format!("{name} with experts")));
    }
    let mixes = mixes();
    eprintln!("mixes of paths on this CPU: {mixes:?}");
    let mut failures = Vec::new();
    // Per type, the first SIMD mix's rows alone, which every other SIMD mix must give.
    let mut simd_rows: Vec<Option<(String, Vec<Bits>)>> = vec![None; models.len()];
    for mix in &mixes {
        // This binary's only test sets it, between the loads of each mix (the types of a mix
        // load and run on two threads).
        std::env::set_var("GEN_KERNEL", mix);
        let results: Vec<(Vec<String>, Vec<Bits>)> = std::thread::scope(|s| {
            let half = models.len().div_ceil(2);
            let handles: Vec<_> = models
                .chunks(half)
                .map(|ms| {
                    let tok = &tok;
                    s.spawn(move || {
                        ms.iter()
                            .map(|(p, name)| check_model(p, tok, &format!("{name} {mix}")))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        let simd = !matches!(mix.as_str(), "bf16" | "amx" | "scalar");
        for (i, (fails, want)) in results.into_iter().enumerate() {
            failures.extend(fails);
            match (&simd_rows[i], simd) {
                (None, true) => simd_rows[i] = Some((mix.clone(), want)),
                (Some((first, rows)), true) if *rows != want => failures.push(format!(
                    "{}: {mix} alone differs from {first} alone",
                    models[i].1
                )),
                _ => {}
            }
        }
    }
    std::env::remove_var("GEN_KERNEL");
    for (p, _) in models {
        let _ = std::fs::remove_file(p);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
