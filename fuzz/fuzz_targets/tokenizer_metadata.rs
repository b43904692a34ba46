//! Tokenizers built from a model file's metadata: `gen::tokenizer::Tokenizer::from_gguf_metadata`
//! on a `tokenizer.ggml.*` map decoded from the fuzz input must return Ok or Err, never panic or
//! hang. A tokenizer that builds then encodes, decodes and streams a short text, and the token
//! count must respect the `min_tokens` lower bound gen uses to refuse huge prompts early.
#![no_main]

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use gen::tokenizer::Tokenizer;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

/// Pieces real vocabularies are made of, so that merges and special tokens line up often.
const FRAGMENTS: &[&str] = &[
    "a",
    "b",
    "ab",
    "c",
    " ",
    "\n",
    "Ġ",
    "▁",
    "Ċ",
    "é",
    "日",
    "<0x41>",
    "<0x0A>",
    "<0xE6>",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<fim_prefix>",
    "[EMPTY_0]",
    "",
    "  ",
    "\u{0}",
];

/// Names no table holds, beside every name gen knows (`gen::tokenizer::pre_tokenizer_names`).
const UNKNOWN_PRE_NAMES: &[&str] = &["no-such-pre", "", "Default"];

/// GPT-2's byte-to-character table (printable Latin-1 as itself, the rest from U+0100 on).
fn byte_level_alphabet() -> Vec<String> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let code = if printable {
                u32::from(b)
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(code).unwrap().to_string()
        })
        .collect()
}

fn token(u: &mut Unstructured) -> Result<String> {
    if u.ratio(1, 8)? {
        let s: &str = u.arbitrary()?;
        return Ok(s.chars().take(12).collect());
    }
    let parts = u.int_in_range(1..=3)?;
    let mut t = String::new();
    for _ in 0..parts {
        t.push_str(u.choose(FRAGMENTS)?);
    }
    Ok(t)
}

/// An id: mostly in range, sometimes out of it or of the wrong type.
fn id(u: &mut Unstructured, n: usize) -> Result<Value> {
    Ok(match u.int_in_range(0..=5)? {
        0 => Value::U32(u.arbitrary()?),
        1 => Value::I32(u.arbitrary()?),
        2 => Value::U64(u.arbitrary()?),
        3 => Value::String("1".into()),
        _ => Value::U32(u.int_in_range(0..=n as u32)?),
    })
}

fn metadata(u: &mut Unstructured) -> Result<HashMap<String, Value>> {
    let mut md = HashMap::new();
    let spm = u.arbitrary::<bool>()?;
    let model = match u.int_in_range(0..=9)? {
        0 => Value::String(u.arbitrary::<&str>()?.to_string()),
        1 => Value::U32(7),
        _ if spm => Value::String("llama".into()),
        _ => Value::String("gpt2".into()),
    };
    md.insert("tokenizer.ggml.model".into(), model);

    let mut tokens = Vec::new();
    if u.ratio(1, 2)? {
        // A full byte alphabet, so every input byte has a token (and the bound applies).
        if spm {
            tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        } else {
            tokens.extend(byte_level_alphabet());
        }
    }
    for _ in 0..u.int_in_range(0..=40)? {
        tokens.push(token(u)?);
    }
    let n = tokens.len();
    if u.ratio(1, 20)? {
        md.insert("tokenizer.ggml.tokens".into(), Value::U8(1));
    } else {
        let mut values: Vec<Value> = tokens.iter().cloned().map(Value::String).collect();
        if u.ratio(1, 20)? {
            values.push(Value::Array(vec![Value::I8(-1)]));
        }
        md.insert("tokenizer.ggml.tokens".into(), Value::Array(values));
    }

    if u.arbitrary()? {
        let len = if u.ratio(1, 10)? {
            u.int_in_range(0..=n + 1)?
        } else {
            n
        };
        let mut types = Vec::with_capacity(len);
        for _ in 0..len {
            types.push(Value::I32(match u.int_in_range(0..=9)? {
                0 => u.arbitrary()?,
                k => (k as i32).min(6),
            }));
        }
        md.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
    }
    if spm || u.ratio(1, 10)? {
        let len = if u.ratio(1, 10)? {
            u.int_in_range(0..=n + 1)?
        } else {
            n
        };
        let mut scores = Vec::with_capacity(len);
        for i in 0..len {
            scores.push(match u.int_in_range(0..=9)? {
                0 => Value::F32(u.arbitrary()?),
                1 => Value::F32(f32::NAN),
                2 => Value::U8(1),
                _ => Value::F32(-(i as f32)),
            });
        }
        md.insert("tokenizer.ggml.scores".into(), Value::Array(scores));
    }
    if !spm || u.ratio(1, 10)? {
        let mut merges = Vec::new();
        for _ in 0..u.int_in_range(0..=30)? {
            let m = if n > 0 && u.ratio(4, 5)? {
                let a = &tokens[u.choose_index(n)?];
                let b = &tokens[u.choose_index(n)?];
                format!("{a} {b}")
            } else {
                token(u)?
            };
            merges.push(Value::String(m));
        }
        md.insert("tokenizer.ggml.merges".into(), Value::Array(merges));
    }
    if u.arbitrary()? {
        let names: Vec<&str> = gen::tokenizer::pre_tokenizer_names()
            .chain(UNKNOWN_PRE_NAMES.iter().copied())
            .collect();
        let pre = u.choose(&names)?;
        md.insert("tokenizer.ggml.pre".into(), Value::String(pre.to_string()));
    }
    for key in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if u.arbitrary()? {
            md.insert(key.into(), id(u, n)?);
        }
    }
    for key in [
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix",
    ] {
        match u.int_in_range(0..=4)? {
            0 => {}
            1 => {
                md.insert(key.into(), Value::U8(1));
            }
            _ => {
                md.insert(key.into(), Value::Bool(u.arbitrary()?));
            }
        }
    }
    Ok(md)
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(md) = metadata(&mut u) else {
        return;
    };
    let Ok(tokenizer) = Tokenizer::from_gguf_metadata(&md) else {
        return;
    };
    let text = String::from_utf8_lossy(u.take_rest());
    let text: String = text.chars().take(200).collect();
    let Ok(ids) = tokenizer.encode(&text, false) else {
        return;
    };
    let bound = tokenizer.min_tokens(&text);
    assert!(
        ids.len() >= bound,
        "{} tokens for {:?}, below the bound {bound} (max_token_bytes {})",
        ids.len(),
        text,
        tokenizer.max_token_bytes()
    );
    let _ = tokenizer.decode(&ids);
    let mut stream = tokenizer.stream();
    for &id in &ids {
        let _ = stream.push(id);
    }
    let _ = stream.push(u32::MAX);
    let _ = stream.finish();
    let _ = tokenizer.encode(&text, true);
});
