//! llama.cpp's architecture suite and its reference reader, as `.ci/llama-archs` builds them,
//! and gen's logits on the same files and ids.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use candle_core::quantized::gguf_file;
use gen::format::checkpoint::Checkpoint;
use gen::model::decoder::Decoder;
use gen::model::{LanguageModel, SeqStep};

/// How far gen's logits on F32 files may be from llama.cpp's: a hundredth of llama.cpp's own bar
/// between its CPU and GPU backends (1e-4, tests/test-llama-archs.cpp), because the suite's
/// random models are insensitive enough that leaving out a rope variant moves their logits by
/// as little as 5e-7 (tests/arch_variants.rs). Measured up to 4.6e-8 (starcoder2) on
/// 2026-12-03.
pub const NMSE_F32: f64 = 1e-6;

/// The suite's folder: .ci/llama-archs prints it (and builds it first if it must).
pub fn dir() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/llama-archs");
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The token ids every reference of the suite was computed on.
pub fn ids(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("ids.txt"))
        .unwrap()
        .trim()
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect()
}

/// A `.logits` file: rows of n_vocab.
pub fn read_logits(path: &Path) -> Vec<Vec<f32>> {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let u = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap()) as usize;
    let (n, v) = (u(0), u(4));
    assert_eq!(b.len(), 8 + n * v * 4, "{}", path.display());
    let f: Vec<f32> = b[8..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    f.chunks_exact(v).map(<[f32]>::to_vec).collect()
}

/// llama.cpp's logits for `ids` on `model`, computed now by the suite's reader with a context
/// of `n_ctx` tokens.
pub fn llama_logits(dir: &Path, model: &Path, ids: &[u32], n_ctx: usize) -> Vec<Vec<f32>> {
    // A file of its own (never the suite's recorded `.logits` beside the model).
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = std::env::temp_dir().join(format!("gen-llama-logits-{}-{n}", std::process::id()));
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let status = Command::new(dir.join("llama-logits"))
        .arg(model)
        .arg(list.join(","))
        .arg(&out)
        .arg(n_ctx.to_string())
        .status()
        .expect("running llama-logits");
    assert!(status.success(), "llama-logits on {}", model.display());
    let logits = read_logits(&out);
    let _ = std::fs::remove_file(&out);
    logits
}

/// Normalized mean squared error: mse(want, got) / mse(want, 0).
pub fn nmse(want: &[Vec<f32>], got: &[Vec<f32>]) -> f64 {
    assert_eq!(want.len(), got.len());
    let (mut err, mut norm) = (0f64, 0f64);
    for (a, b) in want.iter().zip(got) {
        assert_eq!(a.len(), b.len());
        for (&x, &y) in a.iter().zip(b) {
            err += (x as f64 - y as f64).powi(2);
            norm += (x as f64).powi(2);
        }
    }
    err / norm
}

/// Logits, a row per position.
pub type Rows = Vec<Vec<f32>>;

fn rows(t: candle_core::Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

/// gen's logits for `ids` with a context window of `window` tokens: (every position as a
/// decode step; the positions from `split - 1` on after a prefill of the first `split` and
/// decode steps for the rest).
pub fn gen_logits(
    path: &Path,
    ids: &[u32],
    split: usize,
    window: usize,
) -> anyhow::Result<(Rows, Rows)> {
    let ckpt = Checkpoint::open_gguf(path)?;
    let mut m = Decoder::from_checkpoint(&ckpt, &candle_core::Device::Cpu)?;
    m.set_context_window(window);
    m.reserve_pool(2 * gen::model::kv_cache::blocks_for(ids.len()))?;
    let all = m.new_sequence();
    assert!(m.reserve(all, ids.len()));
    let decoded = rows(m.forward(&[SeqStep::decode(all, ids, 0)])?);
    let seq = m.new_sequence();
    assert!(m.reserve(seq, ids.len()));
    let mut mixed = rows(m.forward(&[SeqStep::prefill(seq, &ids[..split], 0)])?);
    for (i, id) in ids.iter().enumerate().skip(split) {
        let step = [*id];
        mixed.extend(rows(m.forward(&[SeqStep::decode(seq, &step, i)])?));
    }
    Ok((decoded, mixed))
}

/// A copy of the GGUF file `from` at `to`, its metadata changed by `edit` (keys set or, with
/// None, removed) and its tensors by `tensors` (a tensor replaced or added, or with None,
/// dropped).
pub fn rewrite(
    from: &Path,
    to: &Path,
    edit: &[(&str, Option<gguf_file::Value>)],
    tensors: Vec<(&str, Option<candle_core::quantized::QTensor>)>,
) {
    let mut f = std::fs::File::open(from).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    // candle's writer cannot tell an empty array's element type (it writes u32), which
    // llama.cpp's loader refuses for a string list: empty arrays are left out.
    let empty = |v: &gguf_file::Value| matches!(v, gguf_file::Value::Array(a) if a.is_empty());
    let mut md: Vec<(String, gguf_file::Value)> = content
        .metadata
        .iter()
        .filter(|(k, v)| !edit.iter().any(|(e, _)| e == k) && !empty(v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in edit {
        if let Some(v) = v {
            md.push((k.to_string(), v.clone()));
        }
    }
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut ts: Vec<(String, candle_core::quantized::QTensor)> = Vec::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for n in names {
        if !tensors.iter().any(|(t, _)| t == n) {
            let t = content
                .tensor(&mut f, n, &candle_core::Device::Cpu)
                .unwrap();
            ts.push((n.clone(), t));
        }
    }
    for (n, t) in tensors {
        if let Some(t) = t {
            ts.push((n.to_string(), t));
        }
    }
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &candle_core::quantized::QTensor)> =
        ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    // Written beside `to` and renamed over it, so that a test reading `to` while another
    // writes the same copy never sees half a file.
    let part = to.with_extension(format!(
        "part-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut w = std::io::BufWriter::new(std::fs::File::create(&part).unwrap());
    gguf_file::write(&mut w, &md_refs, &t_refs).unwrap();
    use std::io::Write;
    w.flush().unwrap();
    drop(w);
    std::fs::rename(&part, to).unwrap();
}

/// `n` ids of the suite's 128-token vocabulary, from `seed`.
pub fn ids_of(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % 128) as u32
        })
        .collect()
}

/// A pass's logits as bits, row by row.
pub fn bits(t: &candle_core::Tensor) -> Vec<Vec<u32>> {
    t.to_vec2::<f32>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(f32::to_bits).collect())
        .collect()
}

/// `prompt` as one prefill, then `reply` a token a pass, on a new sequence of `m` (freed
/// after): each pass's logits as bits.
pub fn plain(m: &mut Decoder, prompt: &[u32], reply: &[u32]) -> Vec<Vec<Vec<u32>>> {
    let s = m.new_sequence();
    assert!(m.reserve(s, prompt.len() + reply.len()));
    let mut rows = vec![bits(&m.forward(&[SeqStep::prefill(s, prompt, 0)]).unwrap())];
    for (i, t) in reply.iter().enumerate() {
        let step = [*t];
        let pos = prompt.len() + i;
        rows.push(bits(&m.forward(&[SeqStep::decode(s, &step, pos)]).unwrap()));
    }
    m.free_sequence(s);
    rows
}
