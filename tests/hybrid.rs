//! Hybrid models (LFM2's short convolutions, Qwen3.5's and Qwen3-Next's Gated DeltaNet beside
//! attention layers): their recurrent state carried exactly, however a sequence's tokens are
//! passed, and rolled back where speculation rejects tokens.
//!
//! On llama.cpp's own suite files for each hybrid architecture (F32, random weights):
//! - a prompt of 150 tokens, past DeltaNet's 64-token chunks in llama.cpp's prefill, agrees
//!   with llama.cpp's logits at every position (as a prefill of 100 then decode steps, and as
//!   decode steps alone);
//! - the logits are the same bits whether the prompt is one prefill or chunks of other sizes,
//!   whether the reply is decoded a token a pass, beside another sequence's prompt, or checked
//!   several at a time and rolled back to where a proposal was rejected;
//! - a rollback the state cannot make is refused at the next pass, never run from a wrong
//!   state;
//! - a prefix taken from the cache starts from the state kept at its end (the same bits as a
//!   fresh run), and a prefix without a kept state is not taken;
//! - value heads outnumbering key heads read the key head each family gives them.

mod common;

use std::path::PathBuf;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::suite::ids_of as ids;
use common::suite::{self, bits, gen_logits, llama_logits, nmse, plain, NMSE_F32};
use gen::format::checkpoint::Checkpoint;
use gen::model::decoder::Decoder;
use gen::model::{LanguageModel, SeqStep};

const HYBRIDS: [&str; 7] = [
    "lfm2-dense",
    "nemotron_h-dense",
    "lfm2moe-moe",
    "granitehybrid-dense",
    "qwen35-dense",
    "qwen35moe-moe",
    "qwen3next-moe",
];

fn file(stem: &str) -> PathBuf {
    suite::dir().join("seed-1").join(format!("{stem}.gguf"))
}

/// An F16 copy of a suite file: its matrices in a type gen's kernels sum in one order however
/// many tokens share a product (F32 matrices go through candle's products, which do not
/// promise that).
fn f16_copy(stem: &str) -> PathBuf {
    let src = file(stem);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hybrid");
    std::fs::create_dir_all(&dir).unwrap();
    let to = dir.join(format!("{stem}.F16.gguf"));
    let mut f = std::fs::File::open(&src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut tensors = Vec::new();
    for (name, info) in &content.tensor_infos {
        let matrix = info.shape.rank() >= 2 && name.ends_with(".weight");
        let host = name.ends_with("shortconv.conv.weight") || name.contains("ssm_conv1d");
        if matrix && !host && !name.contains("norm") {
            let t = content.tensor(&mut f, name, &Device::Cpu).unwrap();
            let t = t.dequantize(&Device::Cpu).unwrap();
            tensors.push((name.clone(), QTensor::quantize(&t, GgmlDType::F16).unwrap()));
        }
    }
    let (names, tensors): (Vec<String>, Vec<QTensor>) = tensors.into_iter().unzip();
    let refs = names
        .iter()
        .map(String::as_str)
        .zip(tensors.into_iter().map(Some))
        .collect();
    suite::rewrite(&src, &to, &[], refs);
    to
}

fn load(stem: &str) -> Decoder {
    let ckpt = Checkpoint::open_gguf(&f16_copy(stem)).unwrap();
    let mut m = Decoder::from_checkpoint(&ckpt, &candle_core::Device::Cpu).unwrap();
    m.set_context_window(256);
    m.reserve_pool(64).unwrap();
    m
}

/// A suite file without its random per-tensor scales (near 0.1 each, which leave each
/// layer's output a small part of the residual), so that the recurrent layers show.
fn unscaled(stem: &str) -> PathBuf {
    let src = file(stem);
    let content = gguf_file::Content::read(&mut std::fs::File::open(&src).unwrap()).unwrap();
    let drop: Vec<(&str, Option<QTensor>)> = content
        .tensor_infos
        .keys()
        .filter(|n| n.ends_with(".scale"))
        .map(|n| (n.as_str(), None))
        .collect();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hybrid");
    std::fs::create_dir_all(&dir).unwrap();
    let to = dir.join(format!("{stem}.unscaled.gguf"));
    suite::rewrite(&src, &to, &[], drop);
    to
}

#[test]
fn a_prompt_past_deltanets_chunks_agrees_with_llama_cpp() {
    let dir = suite::dir();
    let ids = ids(150, 7);
    for path in HYBRIDS.iter().flat_map(|s| [file(s), unscaled(s)]) {
        let stem = path.file_name().unwrap().to_string_lossy().to_string();
        let want = llama_logits(&dir, &path, &ids, 256);
        let (decoded, mixed) = gen_logits(&path, &ids, 100, 256).unwrap();
        let (e, e_mixed) = (nmse(&want, &decoded), nmse(&want[99..], &mixed));
        eprintln!("{stem}: decode steps {e:.2e}, prefill of 100 + decode {e_mixed:.2e}");
        assert!(
            e <= NMSE_F32 && e_mixed <= NMSE_F32,
            "{stem}: {e:.2e} / {e_mixed:.2e}"
        );
    }
}

#[test]
fn the_state_is_the_same_however_a_sequence_is_passed() {
    let (prompt, reply) = (ids(40, 1), ids(12, 2));
    let p = prompt.len();
    for stem in HYBRIDS {
        let mut m = load(stem);
        let want = plain(&mut m, &prompt, &reply);
        // The prompt in chunks of 5, 16 and 19.
        let s = m.new_sequence();
        assert!(m.reserve(s, p + reply.len()));
        let mut last = None;
        for (a, b) in [(0, 5), (5, 21), (21, 40)] {
            last = Some(bits(
                &m.forward(&[SeqStep::prefill(s, &prompt[a..b], a)]).unwrap(),
            ));
        }
        assert_eq!(last.unwrap(), want[0], "{stem}: a chunked prompt");
        // Decoding beside another sequence's prompt, in one pass each time.
        let other = m.new_sequence();
        assert!(m.reserve(other, 40));
        for (i, t) in reply.iter().enumerate() {
            let step = [*t];
            let mut batch = vec![SeqStep::decode(s, &step, p + i)];
            if i < 2 {
                batch.push(SeqStep::prefill(
                    other,
                    &prompt[i * 20..(i + 1) * 20],
                    i * 20,
                ));
            }
            let rows = bits(&m.forward(&batch).unwrap());
            assert_eq!(
                rows[0],
                want[i + 1][0],
                "{stem}: reply token {i} in a batch"
            );
        }
        m.free_sequence(s);
        m.free_sequence(other);
        checked_and_rolled_back(&mut m, stem, &prompt, &reply, &want);
    }
}

/// Speculation's check: the reply's tokens several a pass, rejected ones rolled back.
fn checked_and_rolled_back(
    m: &mut Decoder,
    stem: &str,
    prompt: &[u32],
    reply: &[u32],
    want: &[Vec<Vec<u32>>],
) {
    let p = prompt.len();
    let s = m.new_sequence();
    assert!(m.reserve(s, p + reply.len()));
    m.forward(&[SeqStep::prefill(s, prompt, 0)]).unwrap();
    // Check reply[0..5] in one pass; keep two, roll back the rest; then reply[2..6], keep
    // four; then the rest a token a pass.
    let mut at = 0;
    for (fed, keep) in [(5, 2), (4, 4)] {
        let rows = bits(
            &m.forward(&[SeqStep::decode(s, &reply[at..at + fed], p + at)])
                .unwrap(),
        );
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(
                *row,
                want[at + i + 1][0],
                "{stem}: token {} checked",
                at + i
            );
        }
        at += keep;
        m.truncate(s, p + at);
    }
    for i in at..reply.len() {
        let step = [reply[i]];
        let rows = bits(&m.forward(&[SeqStep::decode(s, &step, p + i)]).unwrap());
        assert_eq!(
            rows[0],
            want[i + 1][0],
            "{stem}: token {i} after the rollbacks"
        );
    }
    // Back past the last checked step: refused at the next pass, not run.
    m.truncate(s, p);
    let step = [reply[0]];
    let err = m
        .forward(&[SeqStep::decode(s, &step, p)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot go back"), "{stem}: {err}");
    m.free_sequence(s);
}

/// The prefix cache on a hybrid: a prompt chunk keeps its state at the last block end inside
/// it, kept beside that block once published; a later prompt that begins with those blocks
/// starts from that state, and its logits are the bits a fresh run gives. A prefix whose end
/// has no kept state is not taken.
#[test]
fn a_cached_prefix_resumes_from_the_state_kept_at_its_end() {
    let first = ids(40, 3);
    let second: Vec<u32> = first.iter().copied().chain(ids(20, 4)).collect();
    let reply = ids(6, 5);
    // Shares only its first block with `first`, whose state was not kept.
    let third: Vec<u32> = first[..16].iter().copied().chain(ids(30, 6)).collect();
    for stem in HYBRIDS {
        let mut m = load(stem);
        m.kv_mut().set_prefix_cache(true);
        let want_second = plain(&mut m, &second, &reply);
        let want_third = plain(&mut m, &third, &reply);
        let a = m.new_sequence();
        assert!(m.reserve(a, first.len()));
        m.forward(&[SeqStep::prefill(a, &first, 0)]).unwrap();
        m.publish(a, &first);
        m.free_sequence(a);
        for (prompt, want, reused) in [(&second, &want_second, 32), (&third, &want_third, 0)] {
            let s = m.new_sequence();
            assert_eq!(m.attach_prefix(s, prompt), reused, "{stem}: tokens reused");
            assert!(m.reserve(s, prompt.len() + reply.len()));
            let step = SeqStep::prefill(s, &prompt[reused..], reused);
            let mut rows = vec![bits(&m.forward(&[step]).unwrap())];
            for (i, t) in reply.iter().enumerate() {
                let step = [*t];
                let pos = prompt.len() + i;
                rows.push(bits(&m.forward(&[SeqStep::decode(s, &step, pos)]).unwrap()));
            }
            assert_eq!(&rows, want, "{stem}: {reused} tokens from the cache");
            m.free_sequence(s);
        }
        assert!(
            m.kv_layout().is_empty(),
            "no prompt-cache file for a hybrid"
        );
    }
}

/// `t` (a suite tensor, read as F32) with `extra` more random rows (of its row width), as F32.
fn grown_rows(t: &Tensor, extra: usize, seed: u64, a: f32) -> QTensor {
    let cols = t.dim(1).unwrap();
    let more = Tensor::from_vec(
        common::data(extra * cols, seed, a),
        (extra, cols),
        &Device::Cpu,
    );
    let t = Tensor::cat(&[t, &more.unwrap()], 0).unwrap();
    QTensor::quantize(&t, GgmlDType::F32).unwrap()
}

/// A suite file's DeltaNet layer (layer 0) rewritten from 2 key and 2 value heads to 2 key
/// heads and 4 value heads (value heads as wide as key heads, as llama.cpp's graph takes them):
/// q and k stay, v, z, the gates, the convolution's v channels and the output's columns grow.
/// Which key head a value head reads then matters: j mod 2 for Qwen3.5 (whose converter tiles
/// the value heads), j / 2 for Qwen3-Next.
fn four_value_heads(stem: &str, arch: &str) -> PathBuf {
    let src = file(stem);
    let mut f = std::fs::File::open(&src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let read = |f: &mut std::fs::File, n: &str| -> Tensor {
        let t = content.tensor(f, n, &Device::Cpu).unwrap();
        t.dequantize(&Device::Cpu).unwrap()
    };
    let (vd, extra) = (128, 2);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let p = "blk.0";
    // v rows go last in attn_qkv and in the convolution's channels.
    let qkv = read(&mut f, &format!("{p}.attn_qkv.weight"));
    tensors.push((
        format!("{p}.attn_qkv.weight"),
        grown_rows(&qkv, extra * vd, 11, 0.1),
    ));
    let conv = read(&mut f, &format!("{p}.ssm_conv1d.weight"));
    tensors.push((
        format!("{p}.ssm_conv1d.weight"),
        grown_rows(&conv, extra * vd, 12, 0.3),
    ));
    let gate = read(&mut f, &format!("{p}.attn_gate.weight"));
    tensors.push((
        format!("{p}.attn_gate.weight"),
        grown_rows(&gate, extra * vd, 13, 0.1),
    ));
    let gates: &[&str] = match arch {
        "qwen3next" => &["ssm_ba"],
        _ => &["ssm_beta", "ssm_alpha"],
    };
    for (i, g) in gates.iter().enumerate() {
        let t = read(&mut f, &format!("{p}.{g}.weight"));
        let rows = t.dim(0).unwrap(); // 2 (beta, alpha) or 4 (ba)
        tensors.push((
            format!("{p}.{g}.weight"),
            grown_rows(&t, rows, 14 + i as u64, 0.1),
        ));
    }
    for (i, v) in ["ssm_dt.bias", "ssm_a"].iter().enumerate() {
        let t = read(&mut f, &format!("{p}.{v}"));
        let mut vals: Vec<f32> = t.to_vec1().unwrap();
        vals.extend(common::data(extra, 20 + i as u64, 0.5));
        if *v == "ssm_a" {
            vals.iter_mut().for_each(|x| *x = -x.abs() - 0.1);
        }
        let n = vals.len();
        let t = Tensor::from_vec(vals, n, &Device::Cpu).unwrap();
        tensors.push((
            format!("{p}.{v}"),
            QTensor::quantize(&t, GgmlDType::F32).unwrap(),
        ));
    }
    let out = read(&mut f, &format!("{p}.ssm_out.weight"));
    let rows = out.dim(0).unwrap();
    let more = Tensor::from_vec(
        common::data(rows * extra * vd, 22, 0.1),
        (rows, extra * vd),
        &Device::Cpu,
    );
    let out = Tensor::cat(&[&out, &more.unwrap()], 1).unwrap();
    tensors.push((
        format!("{p}.ssm_out.weight"),
        QTensor::quantize(&out, GgmlDType::F32).unwrap(),
    ));
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hybrid");
    std::fs::create_dir_all(&dir).unwrap();
    let to = dir.join(format!("{stem}.4v.gguf"));
    let edit = [
        (
            format!("{arch}.ssm.inner_size"),
            Some(gguf_file::Value::U32(4 * vd as u32)),
        ),
        (
            format!("{arch}.ssm.time_step_rank"),
            Some(gguf_file::Value::U32(4)),
        ),
    ];
    let edit: Vec<(&str, Option<gguf_file::Value>)> =
        edit.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let mut refs = tensors
        .into_iter()
        .map(|(n, t)| (n, Some(t)))
        .collect::<Vec<_>>();
    // The suite's random per-tensor scales (near 0.1 each) leave the DeltaNet's output a
    // small part of the residual: without them, which key head a value head reads shows.
    for name in content.tensor_infos.keys() {
        if name.ends_with(".scale") && !refs.iter().any(|(n, _)| n == name) {
            refs.push((name.clone(), None));
        }
    }
    if arch == "qwen3next" {
        // The older fused input layout, which llama.cpp's loader sizes by the heads too: the
        // layer reads attn_qkv and attn_gate instead, so the file goes without it.
        for s in ["weight", "scale", "input_scale"] {
            refs.push((format!("{p}.ssm_in.{s}"), None));
        }
    }
    let (names, refs): (Vec<String>, Vec<Option<QTensor>>) = refs.into_iter().unzip();
    let refs = names.iter().map(String::as_str).zip(refs).collect();
    suite::rewrite(&src, &to, &edit, refs);
    to
}

#[test]
fn value_heads_read_the_key_head_each_family_gives_them() {
    let dir = suite::dir();
    let ids = ids(80, 5);
    for (stem, arch) in [("qwen35-dense", "qwen35"), ("qwen3next-moe", "qwen3next")] {
        let path = four_value_heads(stem, arch);
        let want = llama_logits(&dir, &path, &ids, 256);
        let (decoded, mixed) = gen_logits(&path, &ids, 40, 256).unwrap();
        let (e, e_mixed) = (nmse(&want, &decoded), nmse(&want[39..], &mixed));
        eprintln!("{stem}, 4 value heads on 2 key heads: {e:.2e} / {e_mixed:.2e}");
        assert!(
            e <= NMSE_F32 && e_mixed <= NMSE_F32,
            "{stem}: {e:.2e} / {e_mixed:.2e}"
        );
    }
}

/// Granite 4.0-H's files say `rope.scaling.finetuned` false: their attention layers take no
/// rope (the suite's file, without the key, rotates them).
#[test]
fn granite_4_h_attention_without_rope() {
    let dir = suite::dir();
    let ids = ids(80, 9);
    let src = unscaled("granitehybrid-dense");
    let to = src.with_file_name("granitehybrid-nope.gguf");
    let edit = [(
        "granitehybrid.rope.scaling.finetuned",
        Some(gguf_file::Value::Bool(false)),
    )];
    suite::rewrite(&src, &to, &edit, Vec::new());
    let want = llama_logits(&dir, &to, &ids, 256);
    let (decoded, mixed) = gen_logits(&to, &ids, 40, 256).unwrap();
    let (e, e_mixed) = (nmse(&want, &decoded), nmse(&want[39..], &mixed));
    let (roped, _) = gen_logits(&src, &ids, 40, 256).unwrap();
    let apart = nmse(&want, &roped);
    eprintln!("granitehybrid without rope: {e:.2e} / {e_mixed:.2e}; with rope {apart:.2e} away");
    assert!(
        e <= NMSE_F32 && e_mixed <= NMSE_F32,
        "{e:.2e} / {e_mixed:.2e}"
    );
    assert!(
        apart > 100.0 * e.max(e_mixed),
        "rope hardly matters here: {apart:.2e}"
    );
}
