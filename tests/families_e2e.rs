//! Each architecture gen runs, end to end through the binary as users run it: the suite's
//! random-weight model of that architecture (`.ci/llama-archs`) given a real tokenizer (one of
//! llama.cpp's vocabulary files, or Gemma 3's from the published model) with an embedding and
//! output layer of its size, and the family's real chat template where it has one. `gen
//! --model FILE --prompt ...` must generate the asked tokens with the report on stderr, and
//! `--chat` must render the family's template and generate through it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::suite;

/// (architecture, vocabulary: a llama.cpp `models/ggml-vocab-NAME.gguf` or `gemma3` for Gemma
/// 3's own, chat template in assets/chat-templates).
const CASES: &[(&str, &str, Option<&str>)] = &[
    (
        "llama",
        "llama-bpe",
        Some("meta-llama-Llama-3.2-3B-Instruct.jinja"),
    ),
    (
        "mistral3",
        "llama-bpe",
        Some("mistralai-Ministral-3-14B-Reasoning-2512.jinja"),
    ),
    (
        "granite",
        "gpt-2",
        Some("ibm-granite-granite-3.3-2B-Instruct.jinja"),
    ),
    ("minicpm", "llama-spm", None),
    (
        "smollm3",
        "llama-bpe",
        Some("HuggingFaceTB-SmolLM3-3B.jinja"),
    ),
    ("arcee", "gpt-2", None),
    ("exaone", "gpt-2", None),
    ("internlm2", "llama-spm", None),
    ("xverse", "llama-spm", None),
    ("maincoder", "gpt-2", None),
    ("nanbeige", "llama-spm", None),
    ("qwen2", "qwen2", Some("Qwen-Qwen2.5-7B-Instruct.jinja")),
    ("qwen3", "qwen2", Some("Qwen-Qwen3-0.6B.jinja")),
    ("qwen3moe", "qwen2", Some("Qwen-Qwen3-0.6B.jinja")),
    // Qwen3-VL's text models, with Qwen3's template (its own adds image and video parts).
    ("qwen3vl", "qwen2", Some("Qwen-Qwen3-0.6B.jinja")),
    ("qwen3vlmoe", "qwen2", Some("Qwen-Qwen3-0.6B.jinja")),
    ("qwen2moe", "qwen2", Some("Qwen-Qwen2.5-7B-Instruct.jinja")),
    ("olmoe", "gpt-2", None),
    // gpt-oss's own vocabulary (o200k_harmony) is in none of llama.cpp's vocabulary files: a
    // byte-level BPE one stands in, with gpt-oss's Harmony template.
    ("gpt-oss", "gpt-2", Some("openai-gpt-oss-120b.jinja")),
    // dots.llm1's vocabulary is Qwen2's byte-level BPE grown; its template is not among
    // llama.cpp's.
    ("dots1", "qwen2", None),
    ("deepseek", "deepseek-llm", None),
    // GLM-4.5's vocabulary (its own byte-level BPE) is in none of llama.cpp's vocabulary
    // files: Qwen2's stands in, with GLM-4.6's template.
    ("glm4moe", "qwen2", Some("GLM-4.6.jinja")),
    // Ling 2.0's vocabulary (byte-level BPE, pre-tokenizer `bailingmoe2`) is in none of
    // llama.cpp's vocabulary files: Llama 3's stands in.
    ("bailingmoe2", "llama-bpe", None),
    // Hunyuan-A13B's vocabulary (byte-level BPE, pre-tokenizer `hunyuan`, split as Qwen2's) is
    // in none of llama.cpp's vocabulary files: Qwen2's stands in.
    ("hunyuan-moe", "qwen2", None),
    // MiniMax-M2's vocabulary (byte-level BPE, pre-tokenizer `minimax-m2`, split as GPT-4o's)
    // is in none of llama.cpp's vocabulary files: Llama 3's stands in, with its own template.
    ("minimax-m2", "llama-bpe", Some("MiniMax-M2.jinja")),
    // K-EXAONE's vocabulary (byte-level BPE, pre-tokenizer `exaone-moe`) is in none of
    // llama.cpp's vocabulary files: GPT-2's stands in.
    ("exaone-moe", "gpt-2", None),
    // Phi-3.5-MoE shares Phi-3.5-mini's vocabulary and template.
    (
        "phimoe",
        "phi-3",
        Some("microsoft-Phi-3.5-mini-instruct.jinja"),
    ),
    // ERNIE 4.5's vocabulary is SentencePiece: llama.cpp's Llama 2 one stands in.
    ("ernie4_5-moe", "llama-spm", None),
    (
        "granitemoe",
        "gpt-2",
        Some("ibm-granite-granite-3.3-2B-Instruct.jinja"),
    ),
    ("gemma", "llama-spm", None),
    ("gemma2", "gemma3", Some("google-gemma-2-2b-it.jinja")),
    ("gemma3", "gemma3", Some("google-gemma-2-2b-it.jinja")),
    ("phi2", "gpt-2", None),
    (
        "phi3",
        "phi-3",
        Some("microsoft-Phi-3.5-mini-instruct.jinja"),
    ),
    ("olmo", "gpt-2", None),
    ("olmo2", "gpt-2", None),
    ("exaone4", "gpt-2", None),
    ("glm4", "gpt-2", None),
    ("command-r", "command-r", None),
    (
        "cohere2",
        "command-r",
        Some("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"),
    ),
    ("starcoder2", "starcoder", None),
    ("orion", "llama-spm", None),
    ("nemotron", "gpt-2", None),
    ("jais2", "gpt-2", None),
    ("plamo", "llama-spm", None),
    ("seed_oss", "llama-bpe", Some("ByteDance-Seed-OSS.jinja")),
    (
        "deci",
        "llama-bpe",
        Some("meta-llama-Llama-3.1-8B-Instruct.jinja"),
    ),
    ("pangu-embedded", "llama-spm", None),
    ("hunyuan-dense", "gpt-2", None),
    ("hunyuan_vl", "gpt-2", None),
    ("qwen", "qwen2", None),
    ("chatglm", "gpt-2", None),
    ("gptneox", "gpt-neox", None),
    ("codeshell", "starcoder", None),
    ("stablelm", "gpt-neox", None),
    // LFM2's vocabulary (byte-level BPE, pre-tokenizer `lfm2`) is in none of llama.cpp's
    // vocabulary files: Llama 3's stands in, with LFM2.5's template.
    ("lfm2", "llama-bpe", Some("LFM2.5-Instruct.jinja")),
    ("lfm2moe", "llama-bpe", Some("LFM2-8B-A1B.jinja")),
    ("qwen35", "qwen35", Some("Qwen3.5-4B.jinja")),
    // Nemotron-H's vocabulary (byte-level BPE) is in none of llama.cpp's vocabulary files:
    // GPT-2's stands in.
    ("nemotron_h", "gpt-2", None),
    ("nemotron_h_moe", "gpt-2", None),
    (
        "granitehybrid",
        "gpt-2",
        Some("ibm-granite-granite-3.3-2B-Instruct.jinja"),
    ),
    ("qwen35moe", "qwen35", Some("Qwen3.5-4B.jinja")),
    // Qwen3-Next shares Qwen3's vocabulary and chat format.
    ("qwen3next", "qwen2", Some("Qwen-Qwen3-0.6B.jinja")),
    // The suite has no Gemma 4 file: an E2B-like one is written (tests/common/gemma4.rs).
    ("gemma4", "gemma-4", Some("google-gemma-4-31B-it.jinja")),
];

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("families_e2e");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// llama.cpp's source folder (its `models/` holds the vocabulary files).
fn llama_cpp_source() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/llama-server");
    let out = Command::new(&script)
        .output()
        .expect("running .ci/llama-server");
    assert!(out.status.success());
    let bin = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    bin.ancestors().nth(3).unwrap().to_path_buf()
}

/// A deterministic (rows, cols) matrix of small values, quantized to Q8_0.
fn random_matrix(rows: usize, cols: usize, seed: u64) -> QTensor {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
    QTensor::quantize(&t, GgmlDType::Q8_0).unwrap()
}

/// The suite's `arch` model with the tokenizer of `vocab_file` and `template`.
fn model_with_tokenizer(
    dir: &Path,
    arch: &str,
    vocab_file: &Path,
    template: Option<&str>,
) -> PathBuf {
    // An architecture that only comes with experts (qwen3moe, olmoe) has only its -moe file.
    let dense = dir.join(format!("seed-1/{arch}-dense.gguf"));
    let src = match dense.exists() {
        _ if arch == "gemma4" => {
            let written = scratch("gemma4-e2b-like.gguf");
            common::gemma4::write(&common::gemma4::E2B_LIKE, 1, GgmlDType::F32, &written);
            written
        }
        true => dense,
        false => dir.join(format!("seed-1/{arch}-moe.gguf")),
    };
    let mut f = std::fs::File::open(&src).unwrap();
    let fixture = gguf_file::Content::read(&mut f).unwrap();
    let vocab = gguf_file::Content::read(&mut std::fs::File::open(vocab_file).unwrap()).unwrap();
    let n_vocab = match &vocab.metadata["tokenizer.ggml.tokens"] {
        Value::Array(a) => a.len(),
        _ => panic!("no token list in {}", vocab_file.display()),
    };
    let d = fixture.tensor_infos["token_embd.weight"].shape.dims()[1];
    let mut edit: Vec<(String, Option<Value>)> = fixture
        .metadata
        .keys()
        .filter(|k| k.starts_with("tokenizer."))
        .map(|k| (k.clone(), None))
        .collect();
    for (k, v) in &vocab.metadata {
        if k.starts_with("tokenizer.") && k != "tokenizer.chat_template" {
            edit.retain(|(e, _)| e != k);
            edit.push((k.clone(), Some(v.clone())));
        }
    }
    if let Some(t) = template {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("assets/chat-templates")
            .join(t);
        let text = std::fs::read_to_string(path).unwrap();
        edit.push(("tokenizer.chat_template".into(), Some(Value::String(text))));
    }
    edit.push((
        format!("{arch}.vocab_size"),
        Some(Value::U32(n_vocab as u32)),
    ));
    // Room for the longer templates' system prompts (the suite's models say 256).
    edit.push((format!("{arch}.context_length"), Some(Value::U32(4096))));
    let mut tensors = vec![("token_embd.weight", Some(random_matrix(n_vocab, d, 1)))];
    if fixture.tensor_infos.contains_key("output.weight") {
        tensors.push(("output.weight", Some(random_matrix(n_vocab, d, 2))));
    }
    // Gemma 4's per-layer inputs: a second embedding, as many rows (F16: its width of 7 x 16
    // is not a whole number of Q8_0 blocks).
    if let Some(info) = fixture.tensor_infos.get("per_layer_token_embd.weight") {
        let width = info.shape.dims()[1];
        let m = random_matrix(n_vocab, width.next_multiple_of(32), 3)
            .dequantize(&Device::Cpu)
            .unwrap()
            .narrow(1, 0, width)
            .unwrap()
            .contiguous()
            .unwrap();
        let m = QTensor::quantize(&m, GgmlDType::F16).unwrap();
        tensors.push(("per_layer_token_embd.weight", Some(m)));
    }
    if fixture.tensor_infos.contains_key("output.bias") {
        let zeros = Tensor::zeros(n_vocab, candle_core::DType::F32, &Device::Cpu).unwrap();
        tensors.push((
            "output.bias",
            Some(QTensor::quantize(&zeros, GgmlDType::F32).unwrap()),
        ));
    }
    // Kept between runs (CI keeps its target dir): named by the suite's version and this
    // file's, written whole or not at all.
    let version = dir.file_name().unwrap().to_str().unwrap();
    let out = scratch(&format!("{arch}-{version}-{FILES}.gguf"));
    if out.exists() {
        return out;
    }
    let partial = out.with_extension("partial");
    let edit_refs: Vec<(&str, Option<Value>)> =
        edit.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    suite::rewrite(&src, &partial, &edit_refs, tensors);
    std::fs::rename(&partial, &out).unwrap();
    out
}

/// The version of the files `model_with_tokenizer` writes: change it with what they hold.
const FILES: u32 = 2;

fn run(model: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gen"))
        .arg("--model")
        .arg(model)
        .args(args)
        .env("GEN_CACHE_DIR", scratch("cache"))
        .output()
        .unwrap()
}

#[test]
fn every_architecture_generates_through_the_binary_with_a_real_tokenizer() {
    let dir = suite::dir();
    let models = llama_cpp_source().join("models");
    let gemma3 = common::gemma3();
    let mut failures = Vec::new();
    for arch in gen::model::arch::supported() {
        if !CASES.iter().any(|(a, _, _)| *a == arch) {
            failures.push(format!("{arch}: gen runs it, but it has no case here"));
        }
    }
    for &(arch, vocab, template) in CASES {
        let vocab_file = match vocab {
            "gemma3" => gemma3.clone(),
            v => models.join(format!("ggml-vocab-{v}.gguf")),
        };
        let model = model_with_tokenizer(&dir, arch, &vocab_file, template);
        let generate = [
            "-n",
            "6",
            "--temperature",
            "0",
            "--ignore-eos",
            "--stats",
            "json",
        ];
        let out = run(
            &model,
            &[&["--prompt", "The capital of France is"][..], &generate].concat(),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let ok = out.status.success()
            && stderr.contains("\"generated_tokens\":6")
            && stderr.contains("\"forward_passes\":6");
        if !ok {
            failures.push(format!(
                "{arch} ({vocab}): {:?} {stderr}",
                out.status.code()
            ));
            continue;
        }
        if template.is_some() {
            // The template wraps the two words of the message in its turn markers (and some in
            // a system prompt): many more prompt tokens than the message alone.
            let chat = run(
                &model,
                &[&["--chat", "-p", "Hi there"][..], &generate].concat(),
            );
            let stderr = String::from_utf8_lossy(&chat.stderr);
            let prompt_tokens: usize = stderr
                .split("\"prompt_tokens\":")
                .nth(1)
                .and_then(|r| r.split(',').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if !chat.status.success()
                || prompt_tokens < 8
                || !stderr.contains("\"generated_tokens\":6")
            {
                failures.push(format!("{arch} --chat: {:?} {stderr}", chat.status.code()));
            }
        }
        eprintln!(
            "{arch}: ran with the {vocab} tokenizer{}",
            if template.is_some() {
                " and its chat template"
            } else {
                ""
            }
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
