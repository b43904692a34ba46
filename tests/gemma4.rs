//! Gemma 4 against llama.cpp on files written here: llama.cpp's suite writes no Gemma 4 file
//! (its saver skips the architecture), so this test writes them as Google's converter lays
//! them out (llama.cpp's conversion/gemma.py), with random F32 weights and the suite's
//! 128-token vocabulary, and runs llama.cpp's reader on the same file and ids.
//!
//! The E2B-like file has everything the small models have: windowed layers of one head
//! width and kv heads and global layers of another, v taken from k's projection on the global
//! layers, the global layers' partial rotation through `rope_freqs` (1e30 for the pairs that
//! do not turn), the last two layers reading the cache of the last earlier layer of their
//! kind (and wider FFNs there), per-layer inputs, per-layer output factors, and the default
//! logit soft-cap. The 31B-like file has none of the per-layer inputs and shared caches.

mod common;

use std::path::PathBuf;

use candle_core::quantized::GgmlDType;
use candle_core::Device;
use common::gemma4::{write, Shape, DENSE_LIKE, E2B_LIKE, MOE_LIKE};
use common::suite::ids_of as ids;
use common::suite::{self, bits, gen_logits, llama_logits, nmse, plain, NMSE_F32};
use gen::format::checkpoint::Checkpoint;
use gen::model::decoder::Decoder;
use gen::model::{LanguageModel, SeqStep};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gen-gemma4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn gemma4_files_agree_with_llama_cpp() {
    let dir = suite::dir();
    for (what, shape) in [
        ("e2b-like", &E2B_LIKE),
        ("dense-like", &DENSE_LIKE),
        ("moe-like", &MOE_LIKE),
    ] {
        for seed in [1u64, 2] {
            let path = scratch(&format!("{what}-{seed}.gguf"));
            write(shape, seed, GgmlDType::F32, &path);
            let tokens = ids(48, seed);
            let want = llama_logits(&dir, &path, &tokens, 256);
            let split = 20;
            let (decoded, mixed) =
                gen_logits(&path, &tokens, split, 256).unwrap_or_else(|e| panic!("{what}: {e:#}"));
            let (e, e_mixed) = (nmse(&want, &decoded), nmse(&want[split - 1..], &mixed));
            eprintln!(
                "{what} seed {seed}: NMSE {e:.2e} (decode steps), {e_mixed:.2e} (prefill + decode)"
            );
            assert!(
                e <= NMSE_F32 && e_mixed <= NMSE_F32,
                "{what} seed {seed}: NMSE {e:.2e} / {e_mixed:.2e}, bound {NMSE_F32:.0e}"
            );
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// On F16 matrices (gen's kernels sum a token's products in one order whatever shares its
/// pass), the layers reading another layer's cache and the per-layer inputs keep gen's
/// promises: a prompt in chunks, a reply decoded beside another prompt, and a prompt resumed
/// from the prefix cache give the same bits as a plain run.
#[test]
fn gemma4_tokens_are_the_same_however_they_are_passed() {
    for (what, shape) in [("e2b-like", &E2B_LIKE), ("moe-like", &MOE_LIKE)] {
        same_bits(what, shape);
    }
}

fn same_bits(what: &str, shape: &Shape) {
    let path = scratch(&format!("{what}.F16.gguf"));
    write(shape, 3, GgmlDType::F16, &path);
    let ckpt = Checkpoint::open_gguf(&path).unwrap();
    let mut m = Decoder::from_checkpoint(&ckpt, &Device::Cpu).unwrap();
    m.set_context_window(256);
    m.reserve_pool(64).unwrap();
    let (prompt, reply) = (ids(40, 7), ids(10, 8));
    let want = plain(&mut m, &prompt, &reply);
    let s = m.new_sequence();
    let other = m.new_sequence();
    assert!(m.reserve(s, 50) && m.reserve(other, 40));
    let mut last = None;
    for (a, b) in [(0, 5), (5, 21), (21, 40)] {
        last = Some(bits(
            &m.forward(&[SeqStep::prefill(s, &prompt[a..b], a)]).unwrap(),
        ));
    }
    assert_eq!(last.unwrap(), want[0], "{what}: a prompt in chunks");
    for (i, t) in reply.iter().enumerate() {
        let step = [*t];
        let mut batch = vec![SeqStep::decode(s, &step, 40 + i)];
        if i < 2 {
            batch.push(SeqStep::prefill(
                other,
                &prompt[i * 20..(i + 1) * 20],
                i * 20,
            ));
        }
        assert_eq!(
            bits(&m.forward(&batch).unwrap())[0],
            want[i + 1][0],
            "{what}: reply token {i}"
        );
    }
    m.free_sequence(s);
    m.free_sequence(other);
    // The prefix cache: a longer prompt takes the first's two whole blocks.
    m.kv_mut().set_prefix_cache(true);
    let longer: Vec<u32> = prompt.iter().copied().chain(ids(9, 9)).collect();
    let want_longer = plain(&mut m, &longer, &reply);
    let a = m.new_sequence();
    assert!(m.reserve(a, prompt.len()));
    m.forward(&[SeqStep::prefill(a, &prompt, 0)]).unwrap();
    m.publish(a, &prompt);
    m.free_sequence(a);
    let b = m.new_sequence();
    assert_eq!(m.attach_prefix(b, &longer), 32, "{what}: tokens reused");
    assert!(m.reserve(b, longer.len() + reply.len()));
    let mut rows = vec![bits(
        &m.forward(&[SeqStep::prefill(b, &longer[32..], 32)])
            .unwrap(),
    )];
    for (i, t) in reply.iter().enumerate() {
        let pos = longer.len() + i;
        rows.push(bits(&m.forward(&[SeqStep::decode(b, &[*t], pos)]).unwrap()));
    }
    assert_eq!(rows, want_longer, "{what}: resumed from the prefix cache");
    // Its cache layout names each layer's shape (a prompt-cache file must match it).
    let layout = m.kv_layout();
    let shapes = match shape.shared {
        0 => "2x32 2x32 1x64 2x32 2x32 1x64",
        _ => "2x32 2x32 1x64 2x32 1x64 0x0 0x0",
    };
    assert!(layout.contains(shapes), "{layout}");
    let _ = std::fs::remove_file(&path);
}

/// The metadata of Google's Gemma 4 26B-A4B as llama.cpp's vocabulary test file keeps it
/// (models/ggml-vocab-gemma-4.gguf: its hyper-parameters, no tensors) reads as llama.cpp
/// reads it: kv heads per layer (an i32 array), windowed layers by a flag array, each kind's
/// head width and rope, 128 experts of 704 with 8 chosen beside the dense FFN.
#[test]
fn the_published_26b_a4b_metadata_reads_as_llama_cpp_reads_it() {
    let vocab = common::llama_cpp_tree().join("models/ggml-vocab-gemma-4.gguf");
    let mut f = std::fs::File::open(&vocab).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    let cfg = gen::model::arch::from_gguf(&content.metadata, "gemma4").unwrap();
    assert_eq!((cfg.n_layer, cfg.d_model), (30, 2816));
    for (l, plan) in cfg.layers.iter().enumerate() {
        let global = l % 6 == 5;
        let (kv, dim, window, base, n_rot) = match global {
            true => (2, 512, None, 1_000_000.0, 512),
            false => (8, 256, Some(1024), 10_000.0, 256),
        };
        assert_eq!(plan.heads.heads, 16, "layer {l}");
        assert_eq!(
            (plan.heads.kv_heads, plan.heads.dim),
            (kv, dim),
            "layer {l}"
        );
        assert_eq!((plan.window, plan.kv_from), (window, None), "layer {l}");
        let rope = cfg.layer_rope(l).unwrap();
        assert_eq!((rope.base, rope.n_rot), (base, n_rot), "layer {l}");
    }
    let moe = cfg.moe.unwrap();
    assert_eq!((moe.n_expert, moe.n_used, moe.ff), (128, 8, 704));
    assert!(moe.norm_weights && moe.shared == gen::model::config::SharedExpert::Beside);
    assert_eq!(
        (cfg.final_softcap, cfg.attn.scale, cfg.per_layer_input),
        (Some(30.0), 1.0, 0)
    );
}
