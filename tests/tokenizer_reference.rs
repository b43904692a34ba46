//! gen's tokenizer against llama.cpp on real model files.
//!
//! `assets/llama-cpp-tokenizer-ids.jsonl` holds the ids llama.cpp produced for a set of texts on
//! each model (special tokens parsed, no BOS; assets/README.md says how it was made). Every line
//! must match exactly; on a mismatch the test prints the text, both id lists and where they first
//! differ, then fails with the count.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use gen::tokenizer::Tokenizer;

const REFERENCE: &str = "assets/llama-cpp-tokenizer-ids.jsonl";
const REFERENCE_TEXT: &str = include_str!("../assets/llama-cpp-tokenizer-ids.jsonl");

struct Case {
    text: String,
    ids: Vec<u32>,
    add_special_tokens: bool,
}

/// Reference lines grouped by model file name.
fn reference() -> &'static BTreeMap<String, Vec<Case>> {
    static CASES: OnceLock<BTreeMap<String, Vec<Case>>> = OnceLock::new();
    CASES.get_or_init(|| {
        let mut cases: BTreeMap<String, Vec<Case>> = BTreeMap::new();
        for (n, line) in REFERENCE_TEXT
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let v: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{REFERENCE} line {}: {e}", n + 1));
            let field = |k: &str| {
                v.get(k)
                    .unwrap_or_else(|| panic!("{REFERENCE} line {}: no `{k}`", n + 1))
            };
            let case = Case {
                text: field("text").as_str().expect("text is a string").to_owned(),
                ids: field("ids")
                    .as_array()
                    .expect("ids is an array")
                    .iter()
                    .map(|x| x.as_u64().expect("id is a number") as u32)
                    .collect(),
                add_special_tokens: v
                    .get("add_special_tokens")
                    .and_then(|b| b.as_bool())
                    .unwrap_or(false),
            };
            let model = field("model").as_str().expect("model is a string");
            cases.entry(model.to_owned()).or_default().push(case);
        }
        cases
    })
}

struct Loaded {
    tokenizer: Tokenizer,
    build_time: Duration,
}

fn load(path: &Path) -> Loaded {
    let mut file =
        std::fs::File::open(path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let content = gguf_file::Content::read(&mut file)
        .unwrap_or_else(|e| panic!("reading GGUF metadata of {}: {e}", path.display()));
    // The fastest of a few builds: the machine running the tests may be busy.
    let mut best = Duration::MAX;
    let mut built = None;
    for _ in 0..3 {
        let start = Instant::now();
        let tokenizer = Tokenizer::from_gguf_metadata(&content.metadata)
            .unwrap_or_else(|e| panic!("building the tokenizer of {}: {e:#}", path.display()));
        best = best.min(start.elapsed());
        built = Some(tokenizer);
    }
    Loaded {
        tokenizer: built.expect("built at least once"),
        build_time: best,
    }
}

fn smollm2() -> &'static Loaded {
    static T: OnceLock<Loaded> = OnceLock::new();
    T.get_or_init(|| load(&common::smollm2()))
}

fn gemma3() -> &'static Loaded {
    static T: OnceLock<Loaded> = OnceLock::new();
    T.get_or_init(|| load(&common::gemma3()))
}

fn cases_for(path: PathBuf) -> &'static [Case] {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .expect("model path has a file name")
        .to_owned();
    let cases = reference()
        .get(&name)
        .unwrap_or_else(|| panic!("{REFERENCE} has no lines for {name}"));
    assert!(!cases.is_empty());
    cases
}

fn show(t: &Tokenizer, ids: &[u32]) -> String {
    ids.iter()
        .map(|&id| format!("{id}:{:?}", t.token_text(id).unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn check_ids(label: &str, t: &Tokenizer, cases: &[Case]) {
    let mut failures = 0;
    for case in cases {
        let got = t
            .encode(&case.text, case.add_special_tokens)
            .unwrap_or_else(|e| panic!("[{label}] encoding {:?}: {e:#}", case.text));
        if got == case.ids {
            continue;
        }
        failures += 1;
        let at = got
            .iter()
            .zip(&case.ids)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!("[{label}] MISMATCH for {:?}", case.text);
        eprintln!("  llama.cpp: {:?}", case.ids);
        eprintln!("  gen:       {got:?}");
        eprintln!("  first difference at index {at}:");
        eprintln!(
            "    llama.cpp: {}",
            show(t, &case.ids[at..case.ids.len().min(at + 6)])
        );
        eprintln!(
            "    gen:       {}",
            show(t, &got[at..got.len().min(at + 6)])
        );
    }
    eprintln!(
        "[{label}] {} of {} reference lines match llama.cpp",
        cases.len() - failures,
        cases.len()
    );
    assert_eq!(
        failures,
        0,
        "[{label}] {failures} of {} lines differ from llama.cpp (see above)",
        cases.len()
    );
}

/// decode(encode(text)) == text, both through our decoder and the inner tokenizers one.
fn check_round_trip(label: &str, t: &Tokenizer, cases: &[Case]) {
    for case in cases {
        let ids = t.encode(&case.text, false).unwrap();
        assert_eq!(
            t.decode(&ids).unwrap(),
            case.text,
            "[{label}] decode(encode(text)) for {:?}",
            case.text
        );
        assert_eq!(
            t.inner().decode(&ids, false).unwrap(),
            case.text,
            "[{label}] inner().decode for {:?}",
            case.text
        );
    }
}

/// Pushing ids one by one gives back the text exactly, never shows U+FFFD, and never holds a
/// token back once its own bytes form complete characters (spaces, punctuation, words).
fn check_stream(label: &str, t: &Tokenizer, cases: &[Case]) {
    let mut split_chars = 0;
    for case in cases {
        let ids = t.encode(&case.text, false).unwrap();
        let mut stream = t.stream();
        let mut out = String::new();
        for &id in &ids {
            let chunk = stream.push(id).unwrap();
            assert!(
                !chunk.contains('\u{FFFD}'),
                "[{label}] U+FFFD streaming {:?}: chunk {chunk:?} at id {id}",
                case.text
            );
            let own = t.decode(&[id]).unwrap();
            if own.contains('\u{FFFD}') {
                split_chars += 1;
            } else {
                assert!(
                    chunk.ends_with(&own),
                    "[{label}] streaming {:?}: id {id} ({own:?}) was held back; got {chunk:?}",
                    case.text
                );
            }
            out.push_str(&chunk);
        }
        out.push_str(&stream.finish());
        assert_eq!(out, case.text, "[{label}] streamed text");
    }
    eprintln!("[{label}] stream ok; {split_chars} tokens carried part of a character");
}

#[test]
fn smollm2_ids_match_llama_cpp() {
    check_ids(
        "SmolLM2",
        &smollm2().tokenizer,
        cases_for(common::smollm2()),
    );
}

#[test]
fn gemma3_ids_match_llama_cpp() {
    check_ids("Gemma 3", &gemma3().tokenizer, cases_for(common::gemma3()));
}

#[test]
fn smollm2_round_trip_and_stream() {
    let t = &smollm2().tokenizer;
    let cases = cases_for(common::smollm2());
    check_round_trip("SmolLM2", t, cases);
    check_stream("SmolLM2", t, cases);
}

#[test]
fn gemma3_round_trip_and_stream() {
    let t = &gemma3().tokenizer;
    let cases = cases_for(common::gemma3());
    check_round_trip("Gemma 3", t, cases);
    check_stream("Gemma 3", t, cases);
}

#[test]
fn special_ids() {
    let smol = &smollm2().tokenizer;
    let im_end = smol.id_of("<|im_end|>").expect("SmolLM2 has <|im_end|>");
    assert!(smol.eos_ids().contains(&im_end), "{:?}", smol.eos_ids());
    assert_eq!(smol.eos_ids()[0], 2, "eos_token_id comes first");
    assert_eq!(smol.bos_id(), Some(1));
    assert_eq!(smol.vocab_size(), 49152);
    // SmolLM2's file says add_bos_token = false.
    assert_eq!(
        smol.encode("Hi", true).unwrap(),
        smol.encode("Hi", false).unwrap()
    );
    assert_eq!(smol.token_text(im_end).as_deref(), Some("<|im_end|>"));

    let gemma = &gemma3().tokenizer;
    let end_of_turn = gemma
        .id_of("<end_of_turn>")
        .expect("Gemma has <end_of_turn>");
    assert!(
        gemma.eos_ids().contains(&end_of_turn),
        "{:?}",
        gemma.eos_ids()
    );
    assert_eq!(gemma.eos_ids()[0], 1, "eos_token_id comes first");
    assert_eq!(gemma.bos_id(), Some(2));
    assert_eq!(gemma.vocab_size(), 262144);
    let ids = gemma.encode("Hi", true).unwrap();
    assert_eq!(ids[0], 2, "Gemma wants BOS");
    assert_eq!(&ids[1..], gemma.encode("Hi", false).unwrap());
    let turn = gemma.encode("<start_of_turn>user\n", false).unwrap();
    assert_eq!(turn[0], gemma.id_of("<start_of_turn>").unwrap());
}

#[test]
fn building_is_fast() {
    for (label, loaded) in [("SmolLM2", smollm2()), ("Gemma 3", gemma3())] {
        eprintln!(
            "[{label}] tokenizer built in {:?} ({} tokens)",
            loaded.build_time,
            loaded.tokenizer.vocab_size()
        );
        // Generous: debug builds on a busy machine. The release target is well under a second.
        assert!(
            loaded.build_time < Duration::from_secs(5),
            "[{label}] building took {:?}",
            loaded.build_time
        );
    }
}

/// `from_file` on the tokenizer.json that our own GGUF-built tokenizer saves, with a
/// tokenizer_config.json beside it: the ids must still match llama.cpp, and decoding (worked
/// out from the file's decoder) must still round-trip.
fn check_from_file(label: &str, loaded: &Loaded, cases: &[Case], config: &str) {
    let dir = std::env::temp_dir().join(format!(
        "gen-tokenizer-test-{}-{}",
        std::process::id(),
        label.replace(' ', "-")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("tokenizer.json");
    loaded.tokenizer.inner().save(&json, false).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
    let reloaded = Tokenizer::from_file(&json);
    std::fs::remove_dir_all(&dir).ok();
    let t = reloaded.unwrap_or_else(|e| panic!("[{label}] from_file: {e:#}"));

    let label = format!("{label} via tokenizer.json");
    check_ids(&label, &t, cases);
    check_round_trip(&label, &t, cases);
    check_stream(&label, &t, cases);
    let original = &loaded.tokenizer;
    assert_eq!(
        t.vocab_size(),
        original.vocab_size(),
        "[{label}] vocab size"
    );
    assert_eq!(t.bos_id(), original.bos_id(), "[{label}] bos");
    assert_eq!(
        t.encode("Hi", true).unwrap(),
        original.encode("Hi", true).unwrap(),
        "[{label}] BOS handling"
    );
    for id in original.eos_ids() {
        assert!(t.eos_ids().contains(id), "[{label}] eos {:?}", t.eos_ids());
    }
}

#[test]
fn smollm2_from_tokenizer_json() {
    check_from_file(
        "SmolLM2",
        smollm2(),
        cases_for(common::smollm2()),
        r#"{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": false}"#,
    );
}

#[test]
fn gemma3_from_tokenizer_json() {
    check_from_file(
        "Gemma 3",
        gemma3(),
        cases_for(common::gemma3()),
        r#"{"bos_token": {"content": "<bos>"}, "eos_token": "<eos>", "add_bos_token": true}"#,
    );
}

/// Characters outside Gemma's vocabulary go out as `<0xNN>` byte tokens; they must decode and
/// stream back whole.
#[test]
fn rare_characters_fall_back_to_bytes_and_stream_whole() {
    let text = "byte fallback: 𓀀 ꙮ 🫨 𝕏 䨻 𠀀 done.";
    let cases = [Case {
        text: text.to_owned(),
        ids: Vec::new(),
        add_special_tokens: false,
    }];
    for (label, loaded) in [("SmolLM2", smollm2()), ("Gemma 3", gemma3())] {
        check_round_trip(label, &loaded.tokenizer, &cases);
        check_stream(label, &loaded.tokenizer, &cases);
    }
    let gemma = &gemma3().tokenizer;
    let ids = gemma.encode(text, false).unwrap();
    let bytes = ids
        .iter()
        .filter(|&&id| gemma.token_text(id).unwrap().starts_with("<0x"))
        .count();
    assert!(
        bytes >= 8,
        "expected byte-fallback tokens in {}",
        show(gemma, &ids)
    );
}
