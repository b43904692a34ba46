//! The shape of the source tree, as docs/development.md's "Source layout" promises it: modules
//! import each other in one direction only (no circles between files), and no function in src/
//! runs much over 150 lines. Read from the files themselves, as text: `use`s and paths starting
//! `crate::`, `super::` or `self::`, outside comments, test modules and inline modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest function allowed, in lines from its `fn` to its closing brace.
const MAX_FN_LINES: usize = 160;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/model/cpu/mod.rs` -> ["model", "cpu"]; `src/lib.rs` -> [].
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The file's code: comments dropped, and everything from `#[cfg(test)]` on (test modules sit at
/// the end of each file), and the bodies of inline modules (whose `super` is another module) and
/// of macros.
fn code(text: &str) -> Vec<String> {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
    let mut out = Vec::new();
    let mut skip_until: Option<String> = None;
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or("").to_string();
        if let Some(end) = &skip_until {
            if line.starts_with(end.as_str()) {
                skip_until = None;
            }
            continue;
        }
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        // Macro bodies resolve their paths where they expand: skipped like inline modules.
        let inline_mod = (trimmed.starts_with("mod ")
            || trimmed.starts_with("pub(crate) mod ")
            || trimmed.starts_with("macro_rules!"))
            && trimmed.ends_with('{');
        if inline_mod {
            skip_until = Some(format!("{indent}}}"));
            continue;
        }
        out.push(line);
    }
    out
}

/// Module paths named by `crate::…`, `super::…` or `self::…` in `lines` (with `{a, b}` groups
/// one level deep), resolved against `me`, each cut to the longest prefix that is a file.
fn dependencies(
    me: &[String],
    lines: &[String],
    files: &BTreeSet<Vec<String>>,
) -> BTreeSet<Vec<String>> {
    let text = lines.join("\n");
    let mut deps = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < text.len() {
        if !text.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let rest = &text[i..];
        let starts = ["crate::", "super::", "self::"]
            .iter()
            .any(|p| rest.starts_with(p));
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if !(starts && boundary) {
            i += 1;
            continue;
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        let path: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
        let mut base: Vec<String> = me.to_vec();
        let mut k = 0;
        if path[0] == "crate" {
            base.clear();
            k = 1;
        }
        while k < path.len() && (path[k] == "super" || path[k] == "self") {
            if path[k] == "super" {
                base.pop();
            }
            k += 1;
        }
        let mut names: Vec<Vec<String>> = vec![path[k..].iter().map(|s| s.to_string()).collect()];
        if rest[end..].starts_with('{') {
            let group = &rest[end + 1..rest[end..].find('}').map_or(rest.len(), |j| end + j)];
            names = group
                .split(',')
                .map(|n| {
                    let mut p: Vec<String> = path[k..].iter().map(|s| s.to_string()).collect();
                    p.extend(n.trim().split("::").next().map(str::to_string));
                    p
                })
                .collect();
        }
        for name in names {
            for cut in (0..=name.len()).rev() {
                let mut cand = base.clone();
                cand.extend_from_slice(&name[..cut]);
                if files.contains(&cand) {
                    if cand != me {
                        deps.insert(cand);
                    }
                    break;
                }
            }
        }
        i += end.max(1);
    }
    deps
}

fn find_cycle(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        node: &Vec<String>,
        graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        state.insert(node.clone(), 1);
        stack.push(node.clone());
        for d in graph.get(node).into_iter().flatten() {
            match state.get(d).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|n| n == d).unwrap();
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(d.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(d, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(node.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if state.get(node).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(node, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn sources() -> (PathBuf, Vec<PathBuf>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    (src, files)
}

fn graph_of(files: &[(Vec<String>, Vec<String>)]) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let known: BTreeSet<Vec<String>> = files.iter().map(|(m, _)| m.clone()).collect();
    files
        .iter()
        .map(|(m, lines)| (m.clone(), dependencies(m, lines, &known)))
        .collect()
}

#[test]
fn no_two_files_of_src_import_each_other_even_through_others() {
    let (src, paths) = sources();
    let files: Vec<(Vec<String>, Vec<String>)> = paths
        .iter()
        // main.rs is the binary, a crate of its own.
        .filter(|p| !p.ends_with("main.rs"))
        .map(|p| {
            (
                module_of(&src, p),
                code(&std::fs::read_to_string(p).unwrap()),
            )
        })
        .collect();
    let graph = graph_of(&files);
    // The reader must see the imports that are there, or the check proves nothing.
    let decoder = vec!["model".to_string(), "decoder".to_string()];
    let plan = vec!["model".to_string(), "plan".to_string()];
    assert!(graph[&decoder].contains(&plan), "{:?}", graph[&decoder]);
    if let Some(cycle) = find_cycle(&graph) {
        let shown: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
        panic!(
            "modules import each other in a circle: {}",
            shown.join(" -> ")
        );
    }
}

#[test]
fn the_cycle_finder_finds_a_circle_of_three() {
    let m = |s: &str| vec![s.to_string()];
    let files = vec![
        (m("a"), vec!["use crate::b::X;".to_string()]),
        (m("b"), vec!["use crate::{c, d};".to_string()]),
        (m("c"), vec!["fn f() { super::a::g() }".to_string()]),
        (m("d"), vec![]),
    ];
    let graph = graph_of(&files);
    let cycle = find_cycle(&graph).expect("a -> b -> c -> a");
    assert_eq!(cycle.len(), 4);
    let files = vec![
        (m("a"), vec!["use crate::b::X;".to_string()]),
        (m("b"), vec![]),
    ];
    assert_eq!(find_cycle(&graph_of(&files)), None);
}

#[test]
fn no_function_in_src_runs_much_over_150_lines() {
    let (src, paths) = sources();
    let mut long = Vec::new();
    for p in &paths {
        let text = std::fs::read_to_string(p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            let indent = line.len() - t.len();
            let is_fn = [
                "fn ",
                "pub fn ",
                "pub(crate) fn ",
                "pub(super) fn ",
                "unsafe fn ",
                "pub unsafe fn ",
            ]
            .iter()
            .any(|p| t.starts_with(p));
            // A declaration without a body (a trait's) ends on its own line.
            if !is_fn || t.ends_with(';') {
                continue;
            }
            let close = " ".repeat(indent) + "}";
            let end = lines[i + 1..]
                .iter()
                .position(|l| *l == close || l.starts_with(&format!("{close} ")))
                .map_or(lines.len(), |j| i + 1 + j);
            let n = end - i + 1;
            if n > MAX_FN_LINES {
                long.push(format!(
                    "{}:{} ({n} lines)",
                    p.strip_prefix(&src).unwrap().display(),
                    i + 1
                ));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FN_LINES} lines: {long:?}"
    );
}
