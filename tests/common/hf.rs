//! Turn a llama GGUF into a Hugging Face checkpoint folder, the way the hub would hold it.
//!
//! Written apart from gen's own loader on purpose (its own name table and row permutation), so
//! a mistake in gen's mapping is not mirrored here: every tensor is dequantized to f32, renamed
//! to its Hugging Face name, and the q/k rows are put back into Hugging Face's rotate-half order.
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use serde_json::json;

/// How to store the weights.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Number of safetensors files; more than one also writes model.safetensors.index.json.
    pub shards: usize,
    /// Type the matrices are saved in (norm weights stay f32).
    pub dtype: DType,
}

fn md_u(md: &HashMap<String, gguf_file::Value>, key: &str) -> usize {
    md[key].to_u32().unwrap_or_else(|_| panic!("{key}")) as usize
}

fn md_f(md: &HashMap<String, gguf_file::Value>, key: &str) -> f32 {
    md[key].to_f32().unwrap_or_else(|_| panic!("{key}"))
}

/// The Hugging Face name of a GGUF llama tensor.
fn hf_name(gguf: &str) -> String {
    let fixed = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ];
    if let Some((_, hf)) = fixed.iter().find(|(g, _)| *g == gguf) {
        return hf.to_string();
    }
    let rest = gguf.strip_prefix("blk.").expect(gguf);
    let (layer, part) = rest.split_once('.').expect(gguf);
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        other => panic!("unexpected GGUF tensor {other}"),
    };
    format!("model.layers.{layer}.{hf}")
}

/// GGUF q/k rows back into Hugging Face order: within each head of width hd, GGUF row 2j + s
/// holds Hugging Face row s*hd/2 + j (s in {0, 1}).
fn unpermute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    let hd = rows / heads;
    let half = hd / 2;
    let src: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
    let mut dst = vec![0f32; src.len()];
    for h in 0..heads {
        for j in 0..half {
            for s in 0..2 {
                let from = h * hd + 2 * j + s;
                let to = h * hd + s * half + j;
                dst[to * cols..(to + 1) * cols]
                    .copy_from_slice(&src[from * cols..(from + 1) * cols]);
            }
        }
    }
    Tensor::from_vec(dst, (rows, cols), &Device::Cpu).unwrap()
}

/// Write the checkpoint folder `out` from the llama GGUF `gguf`.
pub fn gguf_to_hf_dir(gguf: &Path, out: &Path, layout: Layout) {
    std::fs::create_dir_all(out).unwrap();
    let mut file = File::open(gguf).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let md = &content.metadata;
    let heads = md_u(md, "llama.attention.head_count");
    let kv_heads = md_u(md, "llama.attention.head_count_kv");

    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let q = content.tensor(&mut file, name, &Device::Cpu).unwrap();
        let mut t = q.dequantize(&Device::Cpu).unwrap();
        if name.ends_with(".attn_q.weight") {
            t = unpermute(&t, heads);
        } else if name.ends_with(".attn_k.weight") {
            t = unpermute(&t, kv_heads);
        }
        if t.rank() == 2 {
            t = t.to_dtype(layout.dtype).unwrap();
        }
        tensors.insert(hf_name(name), t);
    }
    let tied = !tensors.contains_key("lm_head.weight");

    if layout.shards <= 1 {
        let all: HashMap<String, Tensor> = tensors.into_iter().collect();
        candle_core::safetensors::save(&all, out.join("model.safetensors")).unwrap();
    } else {
        let n = layout.shards;
        let all: Vec<(String, Tensor)> = tensors.into_iter().collect();
        let per = all.len().div_ceil(n);
        let mut weight_map = BTreeMap::new();
        let mut total = 0usize;
        for (i, chunk) in all.chunks(per).enumerate() {
            let shard = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            let part: HashMap<String, Tensor> = chunk.iter().cloned().collect();
            for (name, t) in chunk {
                weight_map.insert(name.clone(), shard.clone());
                total += t.elem_count() * t.dtype().size_in_bytes();
            }
            candle_core::safetensors::save(&part, out.join(&shard)).unwrap();
        }
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(out.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }

    let tokenizer = gen::tokenizer::Tokenizer::from_gguf_metadata(md).unwrap();
    let bos = md_u(md, "tokenizer.ggml.bos_token_id") as u32;
    let eos = md_u(md, "tokenizer.ggml.eos_token_id") as u32;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": md_u(md, "llama.embedding_length"),
        "intermediate_size": md_u(md, "llama.feed_forward_length"),
        "num_hidden_layers": md_u(md, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": md_u(md, "llama.context_length"),
        "rms_norm_eps": md_f(md, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": md_f(md, "llama.rope.freq_base"),
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "vocab_size": tokenizer.vocab_size(),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    });
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    tokenizer
        .inner()
        .save(out.join("tokenizer.json"), false)
        .unwrap();
    let add_bos = md
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    let tokenizer_config = json!({
        "chat_template": md["tokenizer.chat_template"].to_string().unwrap(),
        "bos_token": tokenizer.token_text(bos).unwrap(),
        "eos_token": {"content": tokenizer.token_text(eos).unwrap(), "__type": "AddedToken"},
        "add_bos_token": add_bos,
    });
    std::fs::write(
        out.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
}

/// Write a copy of the GGUF `gguf` at `out` with every tensor dequantized to f32 (same names,
/// same metadata): the weights of `gguf_to_hf_dir`'s folder, in GGUF's own layout.
pub fn dequantized_gguf(gguf: &Path, out: &Path) {
    use candle_core::quantized::{GgmlDType, QTensor};
    let mut file = File::open(gguf).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|name| {
            let t = content
                .tensor(&mut file, name, &Device::Cpu)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap();
            (name.clone(), QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let mut metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    metadata.sort_by_key(|(k, _)| *k);
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut w = std::io::BufWriter::new(File::create(out).unwrap());
    gguf_file::write(&mut w, &metadata, &tensor_refs).unwrap();
}

/// The default GGUF converted by [`gguf_to_hf_dir`] into folder `variant`. Folders live under
/// cargo's scratch space for integration tests and are reused by later runs (a `complete`
/// marker is written last); bump the version when this file changes what it writes.
pub fn converted(variant: &str, layout: Layout) -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("hf-smollm2-v1")
        .join(variant);
    if !dir.join("complete").is_file() {
        let _ = std::fs::remove_dir_all(&dir);
        gguf_to_hf_dir(&super::smollm2(), &dir, layout);
        std::fs::write(dir.join("complete"), b"").unwrap();
    }
    dir
}
