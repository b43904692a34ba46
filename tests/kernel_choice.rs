//! The kernel paths gen measures on a CPU and keeps (src/model/cpu/choice.rs), through the
//! binary on the default model: measured once, then read; the same text every run; a damaged
//! file measured again; GEN_KERNEL forcing a path without measuring. On a CPU with one SIMD
//! path (AVX2 only) there is nothing to choose: no file, and the runs still agree.

mod common;

use std::path::{Path, PathBuf};

use common::{gen, smollm2, text};

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(cache: &Path, kernel: Option<&str>) -> (String, String) {
    let mut cmd = gen();
    cmd.env("XDG_CACHE_HOME", cache).env_remove("GEN_KERNEL");
    if let Some(k) = kernel {
        cmd.env("GEN_KERNEL", k);
    }
    let out = cmd
        .arg("--model")
        .arg(smollm2())
        .args(["--prompt", "The little robot", "--max-new", "12"])
        .args(["--seed", "7", "--temperature", "0.8", "--verbose"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    (text(&out.stdout), text(&out.stderr))
}

fn kept_files(cache: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(cache.join("gen/kernels"))
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "txt"))
                .collect()
        })
        .unwrap_or_default()
}

fn two_paths() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bw");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[test]
fn paths_are_measured_once_kept_and_give_the_same_text() {
    // A measurement shared with other work is not kept (the first run says so): try again
    // on a fresh cache, waiting longer each time, for one the machine had to itself.
    let mut tries = 0;
    let (dir, first, err1) = loop {
        tries += 1;
        let dir = Scratch(
            std::env::temp_dir().join(format!("gen-kernel-choice-{}-{tries}", std::process::id())),
        );
        let (first, err1) = run(&dir.0, None);
        let busy = err1.contains("the CPU was busy");
        assert!(
            !busy || tries < 8,
            "8 measurements, each refused as made on a busy CPU: {err1}"
        );
        if !busy {
            break (dir, first, err1);
        }
        // Let whatever else runs (other tests, a build) move on first.
        std::thread::sleep(std::time::Duration::from_secs(2 * tries));
        assert!(kept_files(&dir.0).is_empty(), "a busy measurement kept");
    };
    let cache = &dir.0;
    let (second, err2) = run(cache, None);
    assert_eq!(first, second, "the same seed, the same text");
    assert!(!err2.contains("measured this CPU's kernel paths"), "{err2}");
    let files = kept_files(cache);
    if !two_paths() {
        assert!(files.is_empty(), "one path, nothing to keep: {files:?}");
        return;
    }
    assert!(
        err1.contains("measured this CPU's kernel paths for Q4_1, Q8_0"),
        "{err1}"
    );
    assert_eq!(files.len(), 1, "{files:?}");
    // The gen under test is built as this test is: with debug assertions (`cargo test`), whose
    // checks slow the two paths unevenly, it keeps its choices apart from a release build's.
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(
        name.ends_with("-debug.txt"),
        cfg!(debug_assertions),
        "{name}"
    );
    let kept = std::fs::read_to_string(&files[0]).unwrap();
    assert!(kept.starts_with("gen kernel choices v5\n"), "{kept}");
    for ty in ["Q4_1", "Q8_0"] {
        for call in ["one", "few", "chunk"] {
            let line = kept
                .lines()
                .find(|l| l.starts_with(&format!("{ty} {call} ")))
                .unwrap_or_else(|| panic!("no {ty} {call} line in {kept}"));
            assert!(
                line.contains("avx2=") && line.contains("avx512-vnni="),
                "{line}"
            );
        }
    }
    // A forced path measures nothing and leaves the kept file as it was.
    let (_, forced) = run(cache, Some("avx2"));
    assert!(!forced.contains("measured"), "{forced}");
    assert_eq!(std::fs::read_to_string(&files[0]).unwrap(), kept);
    // A damaged file is said, measured again and replaced. A measurement made on a busy CPU
    // keeps nothing (the damaged file stays, and is said again next run): try again, as above.
    let mut tries = 0;
    let (third, err3) = loop {
        tries += 1;
        std::fs::write(&files[0], "gen kernel choices v5\nQ4_1 one warp-drive\n").unwrap();
        let (third, err3) = run(cache, None);
        assert!(err3.contains("unreadable"), "{err3}");
        if !err3.contains("the CPU was busy") {
            break (third, err3);
        }
        assert!(tries < 8, "8 measurements, each on a busy CPU: {err3}");
        assert!(
            std::fs::read_to_string(&files[0])
                .unwrap()
                .contains("warp-drive"),
            "a busy measurement replaced the file"
        );
        std::thread::sleep(std::time::Duration::from_secs(2 * tries));
    };
    assert!(err3.contains("measured this CPU's kernel paths"), "{err3}");
    let again = std::fs::read_to_string(&files[0]).unwrap();
    assert_eq!(
        again.lines().filter(|l| !l.starts_with('#')).count(),
        7,
        "{again}"
    );
    // Measured again, the choice may differ where the paths are close: the text is the same
    // as before wherever the paths chosen are.
    if again
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(' ').nth(2))
        .eq(kept
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(' ').nth(2)))
    {
        assert_eq!(third, first);
    }
    // Choices an older gen kept (timed another way) are measured again and replaced, without
    // a warning.
    std::fs::write(&files[0], "gen kernel choices v3\nQ4_1 one avx2 avx2=1ms\n").unwrap();
    let (_, err4) = run(cache, None);
    assert!(!err4.contains("unreadable"), "{err4}");
    if !err4.contains("the CPU was busy") {
        assert!(err4.contains("measured this CPU's kernel paths"), "{err4}");
        let replaced = std::fs::read_to_string(&files[0]).unwrap();
        assert!(
            replaced.starts_with("gen kernel choices v5\n"),
            "{replaced}"
        );
    }
}
