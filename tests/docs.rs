//! The documentation holds together: README.md and docs/*.md link only to files and headings that
//! exist, every page of docs/ is linked from another page, every long flag `gen --help` and
//! `gen chat --help` print is documented in one of them, and the README stays short enough to
//! read (the rest lives in docs/).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// Most lines README.md may have.
const README_MAX_LINES: usize = 420;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every docs/*.md, as paths relative to the repository root.
fn doc_files() -> Vec<PathBuf> {
    let mut files = vec![PathBuf::from("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("a docs/ folder")
        .map(|e| e.expect("list docs/").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| p.strip_prefix(root()).unwrap().to_path_buf())
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds no .md file");
    files.extend(docs);
    files
}

fn read(rel: &Path) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("read {rel:?}: {e}"))
}

/// The text outside code: fenced blocks and inline code spans (which may run over a line break,
/// not over a blank line) become spaces, newlines kept, so line numbers stay those of the file.
fn prose(text: &str) -> String {
    strip_code_spans(&blank_fences(text))
}

fn blank(c: char) -> char {
    if c == '\n' {
        '\n'
    } else {
        ' '
    }
}

/// Inline code (a run of N backticks up to the next run of exactly N) blanked out.
fn strip_code_spans(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let run_at = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut out = chars.clone();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let n = run_at(i);
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '\n' && chars.get(j + 1) == Some(&'\n') {
                break;
            }
            if chars[j] == '`' {
                let m = run_at(j);
                if m == n {
                    close = Some(j);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                for c in &mut out[i..j + n] {
                    *c = blank(*c);
                }
                i = j + n;
            }
            None => i += n,
        }
    }
    out.into_iter().collect()
}

/// GitHub's anchor for a heading: lowercase, every character but letters, digits, `-`, `_` and
/// spaces dropped, spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// A heading's text as GitHub renders it: `[text](target)` becomes text.
fn heading_text(raw: &str) -> String {
    let mut out = String::new();
    let mut rest = raw;
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](").map(|m| open + m) else {
            break;
        };
        let Some(close) = rest[mid..].find(')').map(|c| mid + c) else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..mid]);
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The anchors of a markdown file's headings (outside code blocks), with GitHub's `-1`, `-2`
/// suffixes for repeats.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let code_free = blank_fences(text);
    for (line, original) in code_free.lines().zip(text.lines()) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let title = original[hashes..].trim().trim_end_matches('#').trim();
        let base = slug(&heading_text(title));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// The text with its fenced code blocks (``` or ~~~) blanked out, newlines kept.
fn blank_fences(text: &str) -> String {
    let mut out = String::new();
    let mut fence: Option<char> = None;
    for line in text.split_inclusive('\n') {
        let t = line.trim_start();
        let opener = ['`', '~']
            .into_iter()
            .find(|&f| t.starts_with(&String::from(f).repeat(3)));
        match (fence, opener) {
            (Some(f), Some(o)) if f == o => {
                fence = None;
                out.extend(line.chars().map(blank));
            }
            (Some(_), _) => out.extend(line.chars().map(blank)),
            (None, Some(o)) => {
                fence = Some(o);
                out.extend(line.chars().map(blank));
            }
            (None, None) => out.push_str(line),
        }
    }
    out
}

/// Every `[text](target)` outside code: (line number, target).
fn links(text: &str) -> Vec<(usize, String)> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = prose[from..].find("](").map(|i| from + i) {
        let start = at + 2;
        let end = prose[start..]
            .find(|c: char| c == ')' || c.is_whitespace())
            .map_or(prose.len(), |e| start + e);
        let line = prose[..at].matches('\n').count() + 1;
        out.push((line, prose[start..end].to_string()));
        from = end;
    }
    out
}

fn is_external(target: &str) -> bool {
    target.contains("://") || target.starts_with("mailto:")
}

/// `dir/rel`, with current-folder and parent steps taken lexically; None if it climbs above the
/// root.
fn join(dir: &Path, rel: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in dir.join(rel).components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            other => out.push(other),
        }
    }
    Some(out)
}

/// The problems with `file`'s relative links: a target that does not exist, or an anchor that no
/// heading of the target makes. Each also names the file it links to, in `linked`.
fn check_links(file: &Path, linked: &mut BTreeSet<PathBuf>) -> Vec<String> {
    let text = read(file);
    let dir = file.parent().unwrap_or(Path::new(""));
    let mut problems = Vec::new();
    for (line, target) in links(&text) {
        if is_external(&target) {
            continue;
        }
        let at = format!("{}:{line}: ({target})", file.display());
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else {
            match join(dir, path) {
                Some(p) => p,
                None => {
                    problems.push(format!("{at} leaves the repository"));
                    continue;
                }
            }
        };
        if !root().join(&resolved).exists() {
            problems.push(format!("{at}: no such file {}", resolved.display()));
            continue;
        }
        if resolved != file {
            linked.insert(resolved.clone());
        }
        let Some(anchor) = anchor else { continue };
        if resolved.extension().is_none_or(|e| e != "md") {
            problems.push(format!("{at}: an anchor into a file that is not markdown"));
            continue;
        }
        let known = anchors(&read(&resolved));
        if !known.contains(anchor) {
            problems.push(format!(
                "{at}: no heading of {} makes #{anchor}",
                resolved.display()
            ));
        }
    }
    problems
}

#[test]
fn relative_links_resolve_to_files_and_headings() {
    let mut linked = BTreeSet::new();
    let mut problems = Vec::new();
    let mut count = 0;
    for file in doc_files() {
        count += links(&read(&file))
            .iter()
            .filter(|(_, t)| !is_external(t))
            .count();
        problems.extend(check_links(&file, &mut linked));
    }
    assert!(
        count > 20,
        "found only {count} relative links: is the link scan broken?"
    );
    assert!(
        problems.is_empty(),
        "{} broken link(s) in the documentation:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn every_docs_page_is_linked_from_another() {
    let mut linked = BTreeSet::new();
    for file in doc_files() {
        check_links(&file, &mut linked);
    }
    let orphans: Vec<String> = doc_files()
        .into_iter()
        .filter(|f| f != Path::new("README.md") && !linked.contains(f))
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        orphans.is_empty(),
        "pages no other page links to: {orphans:?}"
    );
}

/// Every `--long-flag` in `gen ARGS`'s output.
fn help_flags(args: &[&str]) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_gen"))
        .args(args)
        .output()
        .expect("run gen");
    assert!(out.status.success(), "gen {args:?} failed: {out:?}");
    let help = String::from_utf8(out.stdout).expect("help is UTF-8");
    let mut flags = BTreeSet::new();
    let bytes = help.as_bytes();
    let mut from = 0;
    while let Some(at) = help[from..].find("--").map(|i| from + i) {
        let start = at + 2;
        let end = help[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .map_or(help.len(), |e| start + e);
        let name = help[start..end].trim_end_matches('-');
        let after_word = at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'-');
        if !after_word && name.starts_with(|c: char| c.is_ascii_lowercase()) {
            flags.insert(format!("--{name}"));
        }
        from = end.max(start);
    }
    flags
}

/// Whether `flag` occurs in `text` as a whole flag (`--json` in "`--json`" or "--json=any", not
/// in "--json-schema").
fn mentions(text: &str, flag: &str) -> bool {
    let bytes = text.as_bytes();
    text.match_indices(flag).any(|(i, _)| {
        let before = i.checked_sub(1).map(|j| bytes[j]);
        let after = bytes.get(i + flag.len()).copied();
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'_';
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

#[test]
fn every_flag_in_help_is_documented() {
    let mut flags = help_flags(&["--help"]);
    flags.extend(help_flags(&["chat", "--help"]));
    for expected in ["--prompt", "--batch", "--endpoint", "--help", "--version"] {
        assert!(
            flags.contains(expected),
            "{expected} not found in --help: is the flag scan broken? found {flags:?}"
        );
    }
    let docs: String = doc_files()
        .iter()
        .map(|f| read(f))
        .collect::<Vec<_>>()
        .join("\n");
    let missing: Vec<&String> = flags.iter().filter(|f| !mentions(&docs, f)).collect();
    assert!(
        missing.is_empty(),
        "flags in `gen --help` that neither README.md nor docs/*.md mention: {missing:?}"
    );
}

#[test]
fn readme_is_short() {
    let lines = read(Path::new("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, over {README_MAX_LINES}: move detail into docs/"
    );
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug("Speculative decoding: `--speculate lookup`"),
        "speculative-decoding---speculate-lookup"
    );
    assert_eq!(
        slug("How generation works, and what the report means"),
        "how-generation-works-and-what-the-report-means"
    );
    assert_eq!(slug("`gen chat`'s line editor"), "gen-chats-line-editor");
    assert_eq!(
        slug("Single stream against llama.cpp"),
        "single-stream-against-llamacpp"
    );
    let text = "# A\n```\n# not a heading\n```\n## A\n### B_c [link](x.md)\n";
    let got: Vec<String> = anchors(text).into_iter().collect();
    assert_eq!(got, ["a", "a-1", "b_c-link"]);
    let found = links("[a](x.md) `[b](y.md)` and [c](z.md#d)\n```\n[e](f.md)\n```\n");
    assert_eq!(found, [(1, "x.md".to_string()), (1, "z.md#d".to_string())]);
}
