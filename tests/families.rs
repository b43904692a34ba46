//! Families without real weights here (Qwen2, Qwen3, Phi-3) and Gemma 3's Hugging Face path:
//! tiny random-weight checkpoints, written by this test as a Hugging Face folder and as a GGUF,
//! loaded through gen's `load`, and checked against a plain f32 forward pass written below from
//! the Hugging Face modeling descriptions (not from gen's code): rotate-half rope, q/k biases
//! (Qwen2), per-head q/k RMS norms (Qwen3, Gemma 3), fused qkv and gate_up (Phi-3), Gemma's
//! 1 + w norms, sandwich norms, GELU-tanh, sqrt(d) embedding scale, query_pre_attn_scalar,
//! sliding-window local layers with their own rope base, tied and untied output layers.
//!
//! The GGUF is what llama.cpp's converter would write (GGUF names, Gemma norms stored as 1 + w,
//! no q/k permutation for these families); both files must give the same logits.

mod common;

use common::data;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use serde_json::json;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Fam {
    Qwen2,
    Qwen3,
    Phi3,
    Gemma3,
}

struct Spec {
    fam: Fam,
    layers: usize,
    d: usize,
    heads: usize,
    kv: usize,
    hd: usize,
    ff: usize,
    vocab: usize,
    tied: bool,
    theta: f64,
    /// Gemma 3: window of the local layers, their rope base, query_pre_attn_scalar.
    window: Option<usize>,
    local_theta: f64,
    qpas: f64,
}

const EPS: f64 = 1e-6;

impl Spec {
    fn new(fam: Fam) -> Self {
        let mut s = Spec {
            fam,
            layers: 2,
            d: 32,
            heads: 4,
            kv: 2,
            hd: 8,
            ff: 48,
            vocab: 40,
            tied: false,
            theta: 10_000.0,
            window: None,
            local_theta: 10_000.0,
            qpas: 8.0,
        };
        match fam {
            Fam::Qwen2 => s.tied = true,
            Fam::Qwen3 => s.hd = 16, // head_dim apart from d / heads, as in real Qwen3
            Fam::Phi3 => {}
            Fam::Gemma3 => {
                s.layers = 7; // layers 0-4 and 6 local, 5 global
                s.hd = 16;
                s.kv = 1;
                s.tied = true;
                s.theta = 1_000_000.0;
                s.window = Some(4);
                // llama.cpp (and so gen) scales Gemma 3's scores by 1/sqrt(hd), whatever
                // query_pre_attn_scalar says; a checkpoint whose scalar differs is refused.
                s.qpas = 16.0;
            }
        }
        s
    }
    fn local(&self, l: usize) -> bool {
        self.window.is_some() && l % 6 < 5
    }
}

/// Hugging Face tensors of a random model: name -> (shape, values).
type Weights = HashMap<String, (Vec<usize>, Vec<f32>)>;

fn random_weights(s: &Spec) -> Weights {
    let mut w = Weights::new();
    let mut seed = 1;
    let mut add = |name: String, shape: Vec<usize>, a: f32| {
        seed += 1;
        let n = shape.iter().product();
        w.insert(name, (shape, data(n, seed, a)));
    };
    let (d, q, kvw, ff) = (s.d, s.heads * s.hd, s.kv * s.hd, s.ff);
    add("model.embed_tokens.weight".into(), vec![s.vocab, d], 1.0);
    // Norm weights: around 1 for w (llama style), around 0 for Gemma's 1 + w.
    let norm = |fam: Fam| if fam == Fam::Gemma3 { 0.3 } else { 1.0 };
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![d], norm(s.fam));
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![d],
            norm(s.fam),
        );
        if s.fam == Fam::Phi3 {
            add(
                format!("{p}.self_attn.qkv_proj.weight"),
                vec![q + 2 * kvw, d],
                0.3,
            );
            add(format!("{p}.mlp.gate_up_proj.weight"), vec![2 * ff, d], 0.3);
        } else {
            add(format!("{p}.self_attn.q_proj.weight"), vec![q, d], 0.3);
            add(format!("{p}.self_attn.k_proj.weight"), vec![kvw, d], 0.3);
            add(format!("{p}.self_attn.v_proj.weight"), vec![kvw, d], 0.3);
            add(format!("{p}.mlp.gate_proj.weight"), vec![ff, d], 0.3);
            add(format!("{p}.mlp.up_proj.weight"), vec![ff, d], 0.3);
        }
        add(format!("{p}.self_attn.o_proj.weight"), vec![d, q], 0.3);
        add(format!("{p}.mlp.down_proj.weight"), vec![d, ff], 0.3);
        if s.fam == Fam::Qwen2 {
            add(format!("{p}.self_attn.q_proj.bias"), vec![q], 0.5);
            add(format!("{p}.self_attn.k_proj.bias"), vec![kvw], 0.5);
            add(format!("{p}.self_attn.v_proj.bias"), vec![kvw], 0.5);
        }
        if matches!(s.fam, Fam::Qwen3 | Fam::Gemma3) {
            add(
                format!("{p}.self_attn.q_norm.weight"),
                vec![s.hd],
                norm(s.fam),
            );
            add(
                format!("{p}.self_attn.k_norm.weight"),
                vec![s.hd],
                norm(s.fam),
            );
        }
        if s.fam == Fam::Gemma3 {
            add(
                format!("{p}.pre_feedforward_layernorm.weight"),
                vec![d],
                0.3,
            );
            add(
                format!("{p}.post_feedforward_layernorm.weight"),
                vec![d],
                0.3,
            );
        }
    }
    add("model.norm.weight".into(), vec![d], norm(s.fam));
    if !s.tied {
        add("lm_head.weight".into(), vec![s.vocab, d], 0.3);
    }
    w
}

// ---- The reference forward pass, plain f32 loops over Hugging Face tensors. ----

fn matvec(w: &[f32], rows: usize, x: &[f32]) -> Vec<f32> {
    let cols = x.len();
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

/// RMS norm; Gemma scales by (1 + w).
fn rms(x: &[f32], w: &[f32], gemma: bool) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + EPS as f32).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| v * r * if gemma { 1.0 + w } else { *w })
        .collect()
}

/// Rotate-half rope on one head at position `pos`.
fn rope(x: &mut [f32], pos: usize, theta: f64) {
    let half = x.len() / 2;
    for i in 0..half {
        let f = (pos as f64 * theta.powf(-((2 * i) as f64) / x.len() as f64)) as f32;
        let (c, s) = (f.cos(), f.sin());
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Logits (T, V) of every position of `tokens`.
fn reference(s: &Spec, w: &Weights, tokens: &[u32]) -> Vec<Vec<f32>> {
    let g = |n: &str| -> &[f32] { &w.get(n).unwrap_or_else(|| panic!("{n}")).1 };
    let gemma = s.fam == Fam::Gemma3;
    let (d, hd, q_w, kv_w) = (s.d, s.hd, s.heads * s.hd, s.kv * s.hd);
    let emb = g("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| {
            let row = &emb[t as usize * d..(t as usize + 1) * d];
            let scale = if gemma { (d as f32).sqrt() } else { 1.0 };
            row.iter().map(|v| v * scale).collect()
        })
        .collect();
    let scale = if gemma {
        1.0 / (s.qpas as f32).sqrt()
    } else {
        1.0 / (hd as f32).sqrt()
    };
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        let theta = if s.local(l) { s.local_theta } else { s.theta };
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let h = rms(x, g(&format!("{p}.input_layernorm.weight")), gemma);
            let (mut q, mut k, mut v) = if s.fam == Fam::Phi3 {
                let all = matvec(
                    g(&format!("{p}.self_attn.qkv_proj.weight")),
                    q_w + 2 * kv_w,
                    &h,
                );
                (
                    all[..q_w].to_vec(),
                    all[q_w..q_w + kv_w].to_vec(),
                    all[q_w + kv_w..].to_vec(),
                )
            } else {
                (
                    matvec(g(&format!("{p}.self_attn.q_proj.weight")), q_w, &h),
                    matvec(g(&format!("{p}.self_attn.k_proj.weight")), kv_w, &h),
                    matvec(g(&format!("{p}.self_attn.v_proj.weight")), kv_w, &h),
                )
            };
            if s.fam == Fam::Qwen2 {
                for (t, n) in [(&mut q, "q"), (&mut k, "k"), (&mut v, "v")] {
                    for (a, b) in t.iter_mut().zip(g(&format!("{p}.self_attn.{n}_proj.bias"))) {
                        *a += b;
                    }
                }
            }
            for (t, n) in [(&mut q, "q"), (&mut k, "k")] {
                for head in t.chunks_mut(hd) {
                    if matches!(s.fam, Fam::Qwen3 | Fam::Gemma3) {
                        let normed = rms(head, g(&format!("{p}.self_attn.{n}_norm.weight")), gemma);
                        head.copy_from_slice(&normed);
                    }
                    rope(head, pos, theta);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (i, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0f32; q_w];
            for hq in 0..s.heads {
                let j = hq / (s.heads / s.kv);
                let visible: Vec<usize> = (0..=i)
                    .filter(|&k| !s.local(l) || i - k < s.window.unwrap())
                    .collect();
                let sc: Vec<f32> = visible
                    .iter()
                    .map(|&k| {
                        (0..hd)
                            .map(|e| qs[i][hq * hd + e] * ks[k][j * hd + e])
                            .sum::<f32>()
                            * scale
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = sc.iter().map(|v| (v - m).exp()).sum();
                for (&k, sv) in visible.iter().zip(&sc) {
                    let p = (sv - m).exp() / z;
                    for e in 0..hd {
                        att[hq * hd + e] += p * vs[k][j * hd + e];
                    }
                }
            }
            let mut o = matvec(g(&format!("{p}.self_attn.o_proj.weight")), d, &att);
            if gemma {
                o = rms(&o, g(&format!("{p}.post_attention_layernorm.weight")), true);
            }
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let pre = if gemma {
                "pre_feedforward_layernorm"
            } else {
                "post_attention_layernorm"
            };
            let h = rms(x, g(&format!("{p}.{pre}.weight")), gemma);
            let (gate, up) = if s.fam == Fam::Phi3 {
                let all = matvec(g(&format!("{p}.mlp.gate_up_proj.weight")), 2 * s.ff, &h);
                (all[..s.ff].to_vec(), all[s.ff..].to_vec())
            } else {
                (
                    matvec(g(&format!("{p}.mlp.gate_proj.weight")), s.ff, &h),
                    matvec(g(&format!("{p}.mlp.up_proj.weight")), s.ff, &h),
                )
            };
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(a, b)| if gemma { gelu_tanh(*a) } else { silu(*a) } * b)
                .collect();
            let mut o = matvec(g(&format!("{p}.mlp.down_proj.weight")), d, &act);
            if gemma {
                o = rms(
                    &o,
                    g(&format!("{p}.post_feedforward_layernorm.weight")),
                    true,
                );
            }
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
        }
    }
    let out = if s.tied {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    xs.iter()
        .map(|x| matvec(g(out), s.vocab, &rms(x, g("model.norm.weight"), gemma)))
        .collect()
}

// ---- Writing the checkpoints. ----

fn hf_config(s: &Spec) -> serde_json::Value {
    let (arch, mt) = match s.fam {
        Fam::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Fam::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        Fam::Phi3 => ("Phi3ForCausalLM", "phi3"),
        Fam::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
    };
    let mut c = json!({
        "architectures": [arch], "model_type": mt,
        "hidden_size": s.d, "intermediate_size": s.ff, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv, "head_dim": s.hd,
        "max_position_embeddings": 64, "rms_norm_eps": EPS, "rope_theta": s.theta,
        "tie_word_embeddings": s.tied, "vocab_size": s.vocab, "eos_token_id": 1,
        "rope_scaling": null,
    });
    match s.fam {
        Fam::Gemma3 => {
            let o = c.as_object_mut().unwrap();
            o.remove("tie_word_embeddings"); // Gemma's default: tied
            o.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
            o.insert("sliding_window".into(), s.window.into());
            o.insert("rope_local_base_freq".into(), s.local_theta.into());
            o.insert("query_pre_attn_scalar".into(), s.qpas.into());
            o.insert("final_logit_softcapping".into(), serde_json::Value::Null);
        }
        Fam::Qwen2 => {
            c["use_sliding_window"] = false.into();
            c["sliding_window"] = 32.into();
            c["hidden_act"] = "silu".into();
        }
        _ => c["hidden_act"] = "silu".into(),
    }
    c
}

fn write_hf(s: &Spec, w: &Weights, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let tensors: HashMap<String, Tensor> = w
        .iter()
        .map(|(n, (shape, v))| {
            (
                n.clone(),
                Tensor::from_vec(v.clone(), shape.as_slice(), &Device::Cpu).unwrap(),
            )
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), hf_config(s).to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        common::tokenizer_json(s.vocab).to_string(),
    )
    .unwrap();
}

/// The GGUF llama.cpp's converter would write: its own tensor names, Gemma norms as 1 + w.
fn write_gguf(s: &Spec, w: &Weights, path: &Path) {
    use gguf_file::Value as V;
    let gemma = s.fam == Fam::Gemma3;
    let rename = |hf: &str| -> String {
        let fixed = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
            return g.to_string();
        }
        let rest = hf.strip_prefix("model.layers.").unwrap();
        let (l, part) = rest.split_once('.').unwrap();
        let g = match part {
            "input_layernorm.weight" => "attn_norm.weight",
            "post_attention_layernorm.weight" if gemma => "post_attention_norm.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
            "pre_feedforward_layernorm.weight" => "ffn_norm.weight",
            "post_feedforward_layernorm.weight" => "post_ffw_norm.weight",
            "self_attn.q_proj.weight" => "attn_q.weight",
            "self_attn.k_proj.weight" => "attn_k.weight",
            "self_attn.v_proj.weight" => "attn_v.weight",
            "self_attn.q_proj.bias" => "attn_q.bias",
            "self_attn.k_proj.bias" => "attn_k.bias",
            "self_attn.v_proj.bias" => "attn_v.bias",
            "self_attn.qkv_proj.weight" => "attn_qkv.weight",
            "self_attn.q_norm.weight" => "attn_q_norm.weight",
            "self_attn.k_norm.weight" => "attn_k_norm.weight",
            "self_attn.o_proj.weight" => "attn_output.weight",
            "mlp.gate_proj.weight" => "ffn_gate.weight",
            "mlp.up_proj.weight" => "ffn_up.weight",
            "mlp.gate_up_proj.weight" => "ffn_up.weight",
            "mlp.down_proj.weight" => "ffn_down.weight",
            other => panic!("{other}"),
        };
        format!("blk.{l}.{g}")
    };
    let mut tensors: Vec<(String, QTensor)> = w
        .iter()
        .map(|(n, (shape, v))| {
            let mut v = v.clone();
            if gemma && n.ends_with("norm.weight") {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
            let t = Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap();
            (rename(n), QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let a = match s.fam {
        Fam::Qwen2 => "qwen2",
        Fam::Qwen3 => "qwen3",
        Fam::Phi3 => "phi3",
        Fam::Gemma3 => "gemma3",
    };
    let u = |n: usize| V::U32(n as u32);
    let mut md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(a.into())),
        (format!("{a}.block_count"), u(s.layers)),
        (format!("{a}.embedding_length"), u(s.d)),
        (format!("{a}.feed_forward_length"), u(s.ff)),
        (format!("{a}.attention.head_count"), u(s.heads)),
        (format!("{a}.attention.head_count_kv"), u(s.kv)),
        (format!("{a}.attention.key_length"), u(s.hd)),
        (format!("{a}.attention.value_length"), u(s.hd)),
        (format!("{a}.context_length"), u(64)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            V::F32(EPS as f32),
        ),
        (format!("{a}.rope.freq_base"), V::F32(s.theta as f32)),
    ];
    if gemma {
        md.push((
            format!("{a}.attention.sliding_window"),
            u(s.window.unwrap()),
        ));
    }
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("families")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Agreement of gen (both formats) with the reference, and of the two formats with each other.
fn check(fam: Fam) {
    let s = Spec::new(fam);
    let w = random_weights(&s);
    let dir = scratch(&format!("{fam:?}"));
    let hf = dir.join("hf");
    write_hf(&s, &w, &hf);
    let gguf = dir.join("model.gguf");
    write_gguf(&s, &w, &gguf);

    let tokens: Vec<u32> = (0..11).map(|i| (i * 7 + 3) % s.vocab as u32).collect();
    let split = 6; // a prefill past Gemma's window of 4, then decode steps
    let want = reference(&s, &w, &tokens);
    let want: Vec<&Vec<f32>> = want[split - 1..].iter().collect();
    let from_hf = common::gen_logits(&hf, None, &tokens, split);
    let from_gguf = common::gen_logits(&gguf, Some(&hf.join("tokenizer.json")), &tokens, split);
    let scale = want
        .iter()
        .flat_map(|r| r.iter())
        .fold(0f32, |m, v| m.max(v.abs()));
    for (step, ((r, a), b)) in want.iter().zip(&from_hf).zip(&from_gguf).enumerate() {
        assert_eq!(a.len(), s.vocab);
        let (da, db) = (max_diff(r, a), max_diff(r, b));
        assert!(
            da < 1e-3 * scale.max(1.0),
            "{fam:?} step {step}: safetensors vs reference {da} (logits up to {scale})"
        );
        assert!(
            db < 1e-3 * scale.max(1.0),
            "{fam:?} step {step}: GGUF vs reference {db}"
        );
        assert!(
            max_diff(a, b) < 1e-4,
            "{fam:?} step {step}: GGUF and safetensors differ by {}",
            max_diff(a, b)
        );
    }
}

#[test]
fn qwen2_biases_and_tied_output_match_the_reference() {
    check(Fam::Qwen2);
}

#[test]
fn qwen3_head_norms_match_the_reference() {
    check(Fam::Qwen3);
}

#[test]
fn phi3_fused_qkv_and_gate_up_match_the_reference() {
    check(Fam::Phi3);
}

#[test]
fn gemma3_sandwich_norms_gelu_and_sliding_window_match_the_reference() {
    check(Fam::Gemma3);
}
