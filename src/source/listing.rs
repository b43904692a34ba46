//! `gen models`: the short names gen can fetch, and the model files already on this machine
//! (gen's own cache, and the Hugging Face hub cache `--model ORG/NAME` fills), with sizes.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use super::known::{known_models, DEFAULT_MODEL};

/// One model file found in a cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedFile {
    pub path: PathBuf,
    pub bytes: u64,
}

/// The listing `gen models` prints: the known names (and whether each is fetched), then every
/// other model file in the caches.
pub fn listing(gen_cache: &Path, hub_cache: &Path) -> String {
    let mut out = String::new();
    let cached = cached_files(gen_cache, hub_cache);
    let _ = writeln!(out, "known models (fetched by name on first use):");
    for m in known_models() {
        let here = cached
            .iter()
            .any(|f| f.path.file_name() == Some(m.file.as_ref()));
        let _ = writeln!(
            out,
            "  {:<14} {:>9}  {:<11} {}{}",
            m.name,
            size(m.size),
            if here { "downloaded" } else { "not fetched" },
            m.about.split(" (").next().unwrap_or(m.about),
            if m.name == DEFAULT_MODEL {
                ", the default"
            } else {
                ""
            }
        );
    }
    let others: Vec<&CachedFile> = cached
        .iter()
        .filter(|f| {
            !known_models()
                .iter()
                .any(|m| f.path.file_name() == Some(m.file.as_ref()))
        })
        .collect();
    let _ = writeln!(out, "other model files in the caches:");
    if others.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for f in others {
        let _ = writeln!(out, "  {:>9}  {}", size(f.bytes), f.path.display());
    }
    let _ = writeln!(
        out,
        "caches: {} (gen), {} (Hugging Face hub)",
        gen_cache.display(),
        hub_cache.display()
    );
    out
}

/// Every finished model file in gen's cache (`.gguf`; not the lock and checksum files beside
/// them, nor a download in progress) and in the hub cache's snapshots (`.gguf`, `.safetensors`).
pub fn cached_files(gen_cache: &Path, hub_cache: &Path) -> Vec<CachedFile> {
    let mut files = Vec::new();
    for path in entries(gen_cache) {
        if path.extension().is_some_and(|e| e == "gguf") && path.is_file() {
            files.push(file(path));
        }
    }
    // hub layout: models--ORG--NAME/snapshots/REVISION/FILE (links into blobs/).
    for repo in entries(hub_cache) {
        let named = repo.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !named.starts_with("models--") {
            continue;
        }
        for snapshot in entries(&repo.join("snapshots")) {
            for path in walk(&snapshot) {
                let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                if matches!(ext, "gguf" | "safetensors") && path.is_file() {
                    files.push(file(path));
                }
            }
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    files
}

fn file(path: PathBuf) -> CachedFile {
    let bytes = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    CachedFile { path, bytes }
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Files under `dir`, a few levels down (a snapshot may keep files in subfolders).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = todo.pop() {
        for p in entries(&d) {
            if p.is_dir() && depth < 4 {
                todo.push((p, depth + 1));
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// "98.4 MB": decimal units, as the known models' descriptions give them.
fn size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_known_names_and_cached_files_with_sizes() {
        let root = std::env::temp_dir().join(format!("gen-listing-{}", std::process::id()));
        let (g, h) = (root.join("gen"), root.join("hub"));
        let snap = h.join("models--Org--Tiny-GGUF/snapshots/abc");
        fs::create_dir_all(&snap).unwrap();
        fs::create_dir_all(&g).unwrap();
        fs::write(g.join("SmolLM2-135M-Instruct.Q4_1.gguf"), vec![0u8; 10]).unwrap();
        fs::write(g.join("SmolLM2-135M-Instruct.Q4_1.gguf.lock"), b"").unwrap();
        fs::write(g.join("mine.gguf"), vec![0u8; 2_500_000]).unwrap();
        fs::write(snap.join("tiny.Q4_0.gguf"), vec![0u8; 1500]).unwrap();
        fs::write(snap.join("README.md"), b"x").unwrap();
        let files = cached_files(&g, &h);
        let names: Vec<_> = files.iter().map(|f| f.path.file_name().unwrap()).collect();
        assert_eq!(
            names,
            [
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                "mine.gguf",
                "tiny.Q4_0.gguf"
            ]
        );
        let text = listing(&g, &h);
        assert!(
            text.contains("smollm2-135m") && text.contains("downloaded"),
            "{text}"
        );
        assert!(
            text.contains("gemma3-270m") && text.contains("not fetched"),
            "{text}"
        );
        assert!(
            text.contains("2.5 MB") && text.contains("mine.gguf"),
            "{text}"
        );
        assert!(
            text.contains("1.5 kB") && text.contains("tiny.Q4_0.gguf"),
            "{text}"
        );
        assert!(
            !text.contains(".lock") && !text.contains("README"),
            "{text}"
        );
        fs::remove_dir_all(&root).unwrap();
    }
}
