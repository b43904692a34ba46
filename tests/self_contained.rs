//! A clone stands on its own: no code under src/, tests/, benches/ or .ci/ (nor build.rs or
//! Cargo.toml) names a path outside the repository, so the tests and benchmarks need nothing
//! beside the clone. Their data lives in assets/ (assets/README.md says where each file came from).
//!
//! Every path-like word with a parent step in it (`a/` then up, a leading or trailing up-step, a
//! quoted up-step alone, `cd` up) is resolved lexically from where it would be read: the file's
//! own folder after `include_str!("`, `include_bytes!("`, `include!("`, `#include "` and shell's
//! `$(dirname "$0")`; the repository root otherwise (cargo runs tests and benchmarks there, the
//! .ci scripts cd there, and CARGO_MANIFEST_DIR is it). A word that climbs above the root is a
//! finding, and so is an absolute path into a folder beside the repository as it sits on this
//! machine. The only exceptions are the hostile inputs that tests hand to gen to see them
//! refused, listed in `HOSTILE_INPUTS` by file.
//!
//! This file spells no up-step itself (it builds them at run time), so it is scanned like the rest.

use std::fs;
use std::path::{Component, Path, PathBuf};

/// (file, word): paths that tests feed to gen as hostile input, never read.
const HOSTILE_INPUTS: &[(&str, &str)] = &[
    ("src/source/hub.rs", "../x"),
    ("src/source/hub.rs", "a/../../b"),
    ("src/format/checkpoint.rs", "../x.safetensors"),
    ("tests/hub.rs", "../../x.gguf"),
    ("tests/hub.rs", "../x"),
];

const THIS_FILE: &str = "tests/self_contained.rs";

/// What the scan reads: build.rs, Cargo.toml and every file under the code folders.
fn scanned_files(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = ["build.rs", "Cargo.toml"]
        .iter()
        .map(|f| root.join(f))
        .filter(|p| p.is_file())
        .collect();
    for dir in ["src", "tests", "benches", ".ci"] {
        walk(&root.join(dir), &mut files);
    }
    files.sort();
    files
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("list a folder").path();
        if path.is_dir() {
            walk(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "._/-$~{}".contains(c)
}

fn has_up_step(word: &str) -> bool {
    Path::new(word)
        .components()
        .any(|c| c == Component::ParentDir)
}

/// The path-like words of `line` that take a step up, with the text before each.
fn up_words(line: &str) -> Vec<(&str, &str)> {
    let mut words = Vec::new();
    let mut start = None;
    for (i, c) in line.char_indices().chain([(line.len(), ' ')]) {
        match (start, is_path_char(c) && i < line.len()) {
            (None, true) => start = Some(i),
            (Some(s), false) => {
                let (before, word) = (&line[..s], &line[s..i]);
                let after = &line[i..];
                // A lone up-step is a path only as a string of its own or after `cd`: elsewhere
                // it is Rust's range or rest syntax.
                let lone_path = !word.contains('/')
                    && ((before.ends_with('"') && after.starts_with('"'))
                        || (before.ends_with('\'') && after.starts_with('\''))
                        || before.trim_end().ends_with("cd"));
                if has_up_step(word) && (word.contains('/') || lone_path) {
                    words.push((before, word));
                }
                start = None;
            }
            _ => {}
        }
    }
    words
}

/// Whether `word`, read from `base_depth` folders below the root, climbs above the root.
fn climbs_out(base_depth: usize, word: &str) -> bool {
    // A word starting with a slash then an up-step is a suffix for some folder (as in
    // `concat!(env!("CARGO_MANIFEST_DIR"), word)`); another absolute path is not relative.
    let word = match word.strip_prefix('/') {
        Some(rest) if Path::new(rest).components().next() == Some(Component::ParentDir) => rest,
        Some(_) => return false,
        None => word,
    };
    let mut depth = base_depth as isize;
    for c in Path::new(word).components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            _ => {}
        }
        if depth < 0 {
            return true;
        }
    }
    false
}

/// Contexts after which a word is read relative to the file's own folder.
const FROM_THE_FILE: &[&str] = &[
    "include_str!(\"",
    "include_bytes!(\"",
    "include!(\"",
    "#include \"",
    "dirname \"$0\")",
    "dirname \"${BASH_SOURCE[0]}\")",
];

/// Every finding under `root`, as `file:line: word (why)`.
fn scan(root: &Path) -> Vec<String> {
    let beside = root
        .parent()
        .filter(|p| p.components().count() > 1)
        .map(|p| format!("{}/", p.display()));
    let root_text = root.display().to_string();
    let mut findings = Vec::new();
    for path in scanned_files(root) {
        // Not text (no such file now): nothing to resolve.
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let file_depth = Path::new(&rel).components().count() - 1;
        for (n, line) in text.lines().enumerate() {
            for (before, word) in up_words(line) {
                let hostile = HOSTILE_INPUTS
                    .iter()
                    .any(|&(file, w)| w == word && (file == rel || rel == THIS_FILE));
                let base = if FROM_THE_FILE.iter().any(|c| before.ends_with(c)) {
                    file_depth
                } else {
                    0
                };
                if !hostile && climbs_out(base, word) {
                    findings.push(format!("{rel}:{}: {word} (leaves the repository)", n + 1));
                }
            }
            let Some(beside) = &beside else { continue };
            for word in line.split(|c: char| !is_path_char(c)) {
                if word.starts_with(beside.as_str())
                    && word != root_text
                    && !word.starts_with(&format!("{root_text}/"))
                {
                    findings.push(format!(
                        "{rel}:{}: {word} (a folder beside the repository)",
                        n + 1
                    ));
                }
            }
        }
    }
    findings
}

#[test]
fn no_code_reads_a_path_outside_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = scanned_files(root);
    assert!(
        files.len() > 40 && files.iter().any(|f| f.ends_with(THIS_FILE)),
        "the scan sees too little: {files:?}"
    );
    let findings = scan(root);
    assert!(
        findings.is_empty(),
        "paths outside the repository (keep what tests and benchmarks read in assets/, or \
         list a hostile test input in HOSTILE_INPUTS):\n{}",
        findings.join("\n")
    );
}

/// The scan on a made-up repository: it finds what climbs out, and only that.
#[test]
fn the_scan_finds_what_leaves_and_passes_what_stays() {
    let up: String = ['.', '.'].iter().collect();
    let top = std::env::temp_dir().join(format!("gen-self-contained-{}", std::process::id()));
    let root = top.join("repo");
    let _ = fs::remove_dir_all(&top);
    let write = |rel: &str, text: String| {
        let path = root.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    };
    write(
        "benches/speed.rs",
        format!(
            "let long = root.join(\"{up}/shared/bench/prompt.txt\");\n\
             let r = 0..n; let Foo {{ a, {up} }} = foo; let s = &v[{up}];\n\
             let ok = root.join(\"assets/x/{up}/y.txt\");\n"
        ),
    );
    write(
        "tests/reference.rs",
        format!(
            "const R: &str = concat!(env!(\"CARGO_MANIFEST_DIR\"),\n    \"/{up}/shared/ids.jsonl\");\n\
             const A: &str = include_str!(\"{up}/assets/a.jsonl\");\n\
             const B: &str = include_str!(\"{up}/{up}/b.jsonl\");\n\
             for bad in [\"{up}/x\"] {{}}\n"
        ),
    );
    write(
        "tests/cuda_emu/harness.cpp",
        format!("#include \"{up}/{up}/src/k.cu\"\n#include \"{up}/{up}/{up}/k.cu\"\n"),
    );
    write(
        ".ci/run",
        format!(
            "cd \"$(dirname \"$0\")/{up}\"\ncd \"$(dirname \"$0\")/{up}/{up}\"\ncd {up}\n\
             python3 -c 'open(\"{}/shared/x\")'\n",
            top.display()
        ),
    );
    write("src/x.py", format!("ROOT = os.path.join(HERE, \"{up}\")\n"));
    let mut findings = scan(&root);
    findings.sort();
    let beside = format!("{}/shared/x", top.display());
    let mut want = vec![
        format!(".ci/run:2: /{up}/{up} (leaves the repository)"),
        format!(".ci/run:3: {up} (leaves the repository)"),
        format!("benches/speed.rs:1: {up}/shared/bench/prompt.txt (leaves the repository)"),
        format!("src/x.py:1: {up} (leaves the repository)"),
        format!("tests/cuda_emu/harness.cpp:2: {up}/{up}/{up}/k.cu (leaves the repository)"),
        format!("tests/reference.rs:2: /{up}/shared/ids.jsonl (leaves the repository)"),
        format!("tests/reference.rs:4: {up}/{up}/b.jsonl (leaves the repository)"),
        format!("tests/reference.rs:5: {up}/x (leaves the repository)"),
        format!(".ci/run:4: {beside} (a folder beside the repository)"),
    ];
    want.sort();
    fs::remove_dir_all(&top).unwrap();
    assert_eq!(findings, want);
}
