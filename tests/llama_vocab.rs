//! gen's tokenizer against llama.cpp's own vocabulary tests: the `models/ggml-vocab-*.gguf` files
//! of the llama.cpp tree that .ci/llama-server builds (llama.cpp 0c1e57098), with the texts in
//! each `.inp` and llama.cpp's ids for them in the `.out` beside it (what its
//! tests/test-tokenizer-0.cpp checks).
//!
//! For every vocabulary gen runs, each text must give exactly llama.cpp's ids. llama.cpp tokenizes
//! them with `add_special = false` (no BOS) and `parse_special = false`: control and unknown
//! tokens are not looked for in the text, user-defined ones still are. gen's tokenizer registers
//! the first as special added tokens and the others as plain ones, so its inner tokenizer with
//! `encode_special_tokens` set does the same. For every vocabulary gen does not run, loading must
//! fail with a one-line error that names why. Which is which is listed in `VOCABS`, so a change
//! on either side shows up here.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::quantized::gguf_file;
use gen::tokenizer::Tokenizer;

/// What loading a vocab file must do.
enum Expect {
    /// gen runs it; its `.inp`/`.out` (if any) must match.
    Runs,
    /// gen refuses it; the error names this.
    Refused(&'static str),
}

use Expect::{Refused, Runs};

/// Every `ggml-vocab-*.gguf` of llama.cpp's models/ folder, by the part of its name after
/// `ggml-vocab-`, with `tokenizer.ggml.model` / `tokenizer.ggml.pre` in the comment.
const VOCABS: &[(&str, Expect)] = &[
    ("aquila", Runs),                    // gpt2, no pre (default); no .inp
    ("baichuan", Runs),                  // llama (SentencePiece); no .inp
    ("bert-bge", Refused("`bert`")),     // WordPiece
    ("command-r", Runs),                 // gpt2 / command-r
    ("deepseek-coder", Runs),            // gpt2 / deepseek-coder
    ("deepseek-llm", Runs),              // gpt2 / deepseek-llm
    ("falcon", Runs),                    // gpt2 / falcon
    ("gemma-4", Runs),                   // gemma4: BPE on raw UTF-8 with escaped spaces
    ("gpt-2", Runs),                     // gpt2 / gpt-2
    ("gpt-neox", Runs),                  // gpt2, no pre (default); no .inp
    ("llama-bpe", Runs),                 // gpt2 / llama-bpe
    ("llama-spm", Runs),                 // llama (SentencePiece)
    ("mpt", Runs),                       // gpt2 / mpt
    ("nomic-bert-moe", Refused("`t5`")), // Unigram; no .inp
    ("phi-3", Runs),                     // llama (SentencePiece)
    ("qwen2", Runs),                     // gpt2 / qwen2
    ("qwen35", Runs),                    // gpt2 / qwen35
    ("refact", Runs),                    // gpt2 / refact
    ("starcoder", Runs),                 // gpt2 / starcoder
];

/// test-tokenizer-0.cpp's reading of `.inp` and `.out`: texts separated by
/// "\n__ggml_vocab_test__\n" (a trailing separator ends the last one), and per text one line of
/// ids separated by spaces, surrounding whitespace stripped.
fn read_tests(inp: &Path, out: &Path) -> Vec<(String, Vec<u32>)> {
    let raw = std::fs::read_to_string(inp).unwrap_or_else(|e| panic!("{}: {e}", inp.display()));
    let ids = std::fs::read_to_string(out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    const SEP: &str = "\n__ggml_vocab_test__\n";
    let mut texts = Vec::new();
    let mut rest = raw.as_str();
    while !rest.is_empty() {
        match rest.find(SEP) {
            Some(at) => {
                texts.push(rest[..at].to_owned());
                rest = &rest[at + SEP.len()..];
            }
            None => {
                texts.push(rest.to_owned());
                rest = "";
            }
        }
    }
    let lines: Vec<&str> = ids.lines().collect();
    assert_eq!(
        texts.len(),
        lines.len(),
        "{} and {} hold different numbers of tests",
        inp.display(),
        out.display()
    );
    texts
        .into_iter()
        .zip(lines)
        .map(|(text, line)| {
            let ids = line
                .split_whitespace()
                .map(|id| id.parse().unwrap_or_else(|e| panic!("id {id:?}: {e}")))
                .collect();
            (text, ids)
        })
        .collect()
}

fn load(path: &Path) -> anyhow::Result<Tokenizer> {
    let mut file = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut file)?;
    Tokenizer::from_gguf_metadata(&content.metadata)
}

#[test]
fn llama_cpp_vocab_tests_match() {
    let models = common::llama_cpp_tree().join("models");
    let found: BTreeSet<String> = std::fs::read_dir(&models)
        .unwrap_or_else(|e| panic!("{}: {e}", models.display()))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|name| {
            Some(
                name.strip_prefix("ggml-vocab-")?
                    .strip_suffix(".gguf")?
                    .to_owned(),
            )
        })
        .collect();
    let listed: BTreeSet<String> = VOCABS.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(
        found,
        listed,
        "the vocab files in {} are not the ones VOCABS lists",
        models.display()
    );

    let mut report = Vec::new();
    let mut failures = 0;
    for (name, expect) in VOCABS {
        let gguf = models.join(format!("ggml-vocab-{name}.gguf"));
        let inp = gguf.with_extension("gguf.inp");
        let out = gguf.with_extension("gguf.out");
        let loaded = load(&gguf);
        let tokenizer = match (expect, loaded) {
            (Refused(why), Err(e)) => {
                let e = format!("{e:#}");
                assert!(
                    e.contains(why) && !e.contains('\n'),
                    "{name}: expected a one-line refusal naming {why}, got: {e}"
                );
                report.push(format!("{name:<16} refused: {e}"));
                continue;
            }
            (Refused(why), Ok(_)) => panic!("{name}: gen now loads it (expected a refusal: {why})"),
            (Runs, Err(e)) => panic!("{name}: {e:#}"),
            (Runs, Ok(t)) => t,
        };
        if !inp.exists() || !out.exists() {
            report.push(format!("{name:<16} loads (no .inp/.out)"));
            continue;
        }
        // parse_special = false: special tokens are matched as plain text.
        let tests = read_tests(&inp, &out);
        let mut matching = 0;
        for (text, want) in &tests {
            let got = tokenizer
                .encode_plain(text)
                .unwrap_or_else(|e| panic!("{name}: encoding {text:?}: {e}"));
            if got == *want {
                matching += 1;
                continue;
            }
            failures += 1;
            let show = |ids: &[u32]| {
                ids.iter()
                    .map(|&id| format!("{id}:{:?}", tokenizer.token_text(id).unwrap_or_default()))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            eprintln!(
                "[{name}] MISMATCH for {text:?}\n  llama.cpp: {}\n  gen:       {}",
                show(want),
                show(&got)
            );
        }
        report.push(format!(
            "{name:<16} {matching} of {} inputs match llama.cpp",
            tests.len()
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert_eq!(
        failures, 0,
        "{failures} inputs differ from llama.cpp (see above)"
    );
}

/// gen decodes a GGUF header itself (`gen::format::header`, for speed); on each of llama.cpp's
/// vocab files, real headers with hundreds of thousands of strings, scores and token types, it
/// must give what candle's `Content::read` gives: every key and value, every tensor, where the
/// data starts.
#[test]
fn headers_decode_as_candle_decodes_them() {
    use gen::format::header::{canonical, content};
    let models = common::llama_cpp_tree().join("models");
    for (name, _) in VOCABS {
        let path = models.join(format!("ggml-vocab-{name}.gguf"));
        let bytes = std::fs::read(&path).unwrap();
        let theirs = gguf_file::Content::read(&mut std::io::Cursor::new(&bytes)).unwrap();
        let ours = content(&bytes).unwrap();
        assert!(theirs.metadata.len() > 10, "{name}");
        assert!(
            canonical(&ours) == canonical(&theirs),
            "{name}: gen's header differs from candle's"
        );
    }
}
