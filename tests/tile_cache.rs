//! The tile cache (src/model/cpu/tile_cache.rs): a GGUF file's weights, repacked once and
//! written to gen's cache folder, then mapped by later loads. Through the loader on small
//! random-weight models covering every layout of gen's CPU kernels (Q4_1 and Q8_0 tiles, the
//! K-quant and legacy tiles, F16/BF16 column tiles, fused q/k/v and gate/up, an output layer
//! whose rows are not a multiple of 8): the mapped weights give the repacked ones' logits bit
//! for bit; a damaged or cut file is refused with a warning, rewritten, and the logits stay the
//! same; a changed model file replaces its cache. Through the binary on the default model: the
//! second run says its weights were mapped and writes the same text.
//!
//! One test function: the loader reads GEN_TILE_CACHE and XDG_CACHE_HOME from the process's
//! environment, so nothing else may run beside it in this binary.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{data, gen, smollm2, text, write_gguf};

const D: usize = common::SMALL_QWEN2.d;
const HEADS: usize = common::SMALL_QWEN2.heads;
const KV: usize = common::SMALL_QWEN2.kv;
const HD: usize = common::SMALL_QWEN2.hd;
const FF: usize = common::SMALL_QWEN2.ff;
const VOCAB: usize = 60;
const LAYERS: usize = common::SMALL_QWEN2.layers;

/// A matrix (rows, cols) of `w` in ggml type `ty`, as GGUF bytes.
fn encode(w: &[f32], rows: usize, cols: usize, ty: u32) -> Vec<u8> {
    let dt = match ty {
        1 => {
            return w
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes())
                .collect()
        }
        30 => {
            return w
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect()
        }
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        8 => GgmlDType::Q8_0,
        12 => GgmlDType::Q4K,
        14 => GgmlDType::Q6K,
        _ => panic!("type {ty}"),
    };
    let t = Tensor::from_vec(w.to_vec(), (rows, cols), &Device::Cpu).unwrap();
    QTensor::quantize(&t, dt).unwrap().data().unwrap().to_vec()
}

/// A Qwen2-shaped model whose matrices are of the types `types` gives by role (q/k/v, output
/// projection, gate/up, down, output layer), written to `path` with `seed`.
fn write_model(path: &Path, types: [u32; 5], seed: u64) {
    let mut tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = Vec::new();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut s = seed;
    let mut next = || {
        s += 1;
        s
    };
    let vector = |name: String, n: usize, around: f32, t: &mut Vec<_>, seed: u64| {
        let v: Vec<f32> = data(n, seed, 0.2).iter().map(|x| x + around).collect();
        t.push((name, vec![n as u64], 0, f32_bytes(&v)));
    };
    let matrix = |name: String, rows: usize, cols: usize, ty: u32, t: &mut Vec<_>, seed: u64| {
        let w = data(rows * cols, seed, 1.7 / (cols as f32).sqrt());
        t.push((
            name,
            vec![cols as u64, rows as u64],
            ty,
            encode(&w, rows, cols, ty),
        ));
    };
    let emb = data(VOCAB * D, next(), 1.0);
    tensors.push((
        "token_embd.weight".into(),
        vec![D as u64, VOCAB as u64],
        0,
        f32_bytes(&emb),
    ));
    let [qkv, o, gate_up, down, out] = types;
    for l in 0..LAYERS {
        let p = format!("blk.{l}");
        let t = &mut tensors;
        vector(format!("{p}.attn_norm.weight"), D, 1.0, t, next());
        vector(format!("{p}.ffn_norm.weight"), D, 1.0, t, next());
        vector(format!("{p}.attn_q.bias"), HEADS * HD, 0.0, t, next());
        vector(format!("{p}.attn_k.bias"), KV * HD, 0.0, t, next());
        vector(format!("{p}.attn_v.bias"), KV * HD, 0.0, t, next());
        matrix(format!("{p}.attn_q.weight"), HEADS * HD, D, qkv, t, next());
        matrix(format!("{p}.attn_k.weight"), KV * HD, D, qkv, t, next());
        matrix(format!("{p}.attn_v.weight"), KV * HD, D, qkv, t, next());
        matrix(
            format!("{p}.attn_output.weight"),
            D,
            HEADS * HD,
            o,
            t,
            next(),
        );
        matrix(format!("{p}.ffn_gate.weight"), FF, D, gate_up, t, next());
        matrix(format!("{p}.ffn_up.weight"), FF, D, gate_up, t, next());
        matrix(format!("{p}.ffn_down.weight"), D, FF, down, t, next());
    }
    vector("output_norm.weight".into(), D, 1.0, &mut tensors, next());
    matrix("output.weight".into(), VOCAB, D, out, &mut tensors, next());
    let meta = common::qwen2_meta(&common::SMALL_QWEN2);
    write_gguf(path, &meta, &tensors);
}

/// Logits of a prefill of 5 tokens then 6 one-token steps, and how the load used the cache.
fn logits(path: &Path, tokenizer: &Path) -> (Vec<Vec<f32>>, &'static str) {
    let tokens: Vec<u32> = (0..11).map(|i| (i * 13 + 5) % VOCAB as u32).collect();
    let mut loaded = gen::model::load(path, &Device::Cpu, Some(tokenizer), None).unwrap();
    let out = common::logits_of(&mut loaded, &tokens, 5);
    (out, loaded.times.tile_cache)
}

fn cache_files(cache: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cache.join("gen/tiles"))
        .map(|d| {
            let mut v: Vec<PathBuf> = d.flatten().map(|e| e.path()).collect();
            v.sort();
            v
        })
        .unwrap_or_default()
}

/// Flip one byte of `path` at `at` (from its end when negative).
fn flip(path: &Path, at: i64) {
    let mut b = std::fs::read(path).unwrap();
    let i = if at < 0 {
        b.len() - (-at) as usize
    } else {
        at as usize
    };
    b[i] ^= 0x10;
    std::fs::write(path, b).unwrap();
}

#[test]
fn mapped_tiles_give_the_repacked_logits_and_damage_is_rebuilt() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tile_cache");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cache = dir.join("xdg");
    // SAFETY (of the environment): this binary's only test, before any thread reads it.
    std::env::set_var("XDG_CACHE_HOME", &cache);
    std::env::remove_var("GEN_KERNEL");
    let tok = dir.join("tokenizer.json");
    std::fs::write(&tok, common::tokenizer_json(VOCAB).to_string()).unwrap();
    let models: [(&str, [u32; 5]); 4] = [
        ("q4_1", [3; 5]),
        ("q8_0", [8; 5]),
        ("mixed", [12, 14, 6, 8, 1]),
        ("bf16", [30; 5]),
    ];
    for (i, (name, types)) in models.into_iter().enumerate() {
        let path = dir.join(format!("{name}.gguf"));
        write_model(&path, types, 10 * i as u64);
        std::env::set_var("GEN_TILE_CACHE", "off");
        let (repacked, how) = logits(&path, &tok);
        assert_eq!(how, "off", "{name}");
        assert!(cache_files(&cache).len() == i, "{name}: off writes nothing");
        std::env::set_var("GEN_TILE_CACHE", "on");
        let (first, how) = logits(&path, &tok);
        assert_eq!(
            (how, &first),
            ("written", &repacked),
            "{name}: repacked, then written"
        );
        let (mapped, how) = logits(&path, &tok);
        assert_eq!(how, "mapped", "{name}");
        assert_eq!(mapped, repacked, "{name}: mapped tiles, the same logits");
        let files = cache_files(&cache);
        assert_eq!(files.len(), i + 1, "{name}: one cache file per model");
        let file = files
            .iter()
            .max_by_key(|p| std::fs::metadata(p).unwrap().modified().unwrap())
            .unwrap()
            .clone();
        // A flipped byte in the last buffer: refused by its checksum, rewritten.
        flip(&file, -100);
        let (after, how) = logits(&path, &tok);
        assert_eq!((how, &after), ("written", &repacked), "{name}: damaged");
        assert_eq!(logits(&path, &tok).1, "mapped", "{name}: rewritten whole");
        let len = std::fs::metadata(&file).unwrap().len();
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        let (after, how) = logits(&path, &tok);
        assert_eq!((how, &after), ("written", &repacked), "{name}: cut short");
    }
    // The scalar kernels keep Q4_1 and Q8_0 in rows, which are not cached: nothing mapped,
    // the same logits as their own repacking.
    let q4 = dir.join("q4_1.gguf");
    std::env::set_var("GEN_KERNEL", "scalar");
    std::env::set_var("GEN_TILE_CACHE", "off");
    let (scalar, _) = logits(&q4, &tok);
    std::env::set_var("GEN_TILE_CACHE", "on");
    assert_eq!(logits(&q4, &tok).0, scalar);
    let (again, how) = logits(&q4, &tok);
    assert_eq!(again, scalar);
    assert_ne!(how, "mapped", "rows are not cached");
    std::env::remove_var("GEN_KERNEL");
    // A changed model file (new weights, same name and shape): its cache is replaced, and
    // the logits are the new model's.
    // Temporary files of writes cut short: the next write takes those over an hour old.
    let tiles = cache.join("gen/tiles");
    let (stale_tmp, fresh_tmp) = (tiles.join("a.tmp-999"), tiles.join("b.tmp-998"));
    for f in [&stale_tmp, &fresh_tmp] {
        std::fs::write(f, b"partial").unwrap();
    }
    let two_hours = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    std::fs::File::options()
        .write(true)
        .open(&stale_tmp)
        .unwrap()
        .set_modified(two_hours)
        .unwrap();
    let before = cache_files(&cache).len() - 1;
    let mixed = dir.join("mixed.gguf");
    write_model(&mixed, [12, 14, 6, 8, 1], 777);
    std::env::set_var("GEN_TILE_CACHE", "off");
    let (fresh, _) = logits(&mixed, &tok);
    std::env::set_var("GEN_TILE_CACHE", "on");
    let (cached, how) = logits(&mixed, &tok);
    assert_eq!((how, &cached), ("written", &fresh));
    let (cached, how) = logits(&mixed, &tok);
    assert_eq!((how, &cached), ("mapped", &fresh));
    assert_eq!(cache_files(&cache).len(), before, "replaced, not added");
    assert!(
        !stale_tmp.exists() && fresh_tmp.exists(),
        "the stale temporary file went"
    );
    std::fs::remove_file(&fresh_tmp).unwrap();

    // Through the binary, on the default model.
    let run = || {
        let out = gen()
            .env("XDG_CACHE_HOME", &cache)
            .env("GEN_TILE_CACHE", "on")
            .env_remove("GEN_KERNEL")
            .arg("--model")
            .arg(smollm2())
            .args(["--prompt", "The little robot", "--max-new", "12"])
            .args(["--seed", "7", "--temperature", "0.8"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        (text(&out.stdout), text(&out.stderr))
    };
    let (first, err1) = run();
    assert!(err1.contains("writing the tile cache"), "{err1}");
    let (second, err2) = run();
    assert!(
        err2.contains("weights mapped from the tile cache"),
        "{err2}"
    );
    assert!(!err2.contains("repacking"), "{err2}");
    assert_eq!(first, second, "the same seed, the same text");
}
