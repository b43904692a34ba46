//! The `gen` binary as users run it: exit codes, stdout carrying only the reply, stdin piping,
//! `--stats json`, broken pipes, and one clear line for bad input. Runs the real default model.

mod common;

use common::{gen, one_error_line, text};

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Output, Stdio};

/// `gen` on the default model, greedy, 2 threads, with extra args and optional stdin.
fn run(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let model = common::smollm2();
    let mut c = gen();
    c.arg("--model")
        .arg(&model)
        .args(["--temperature", "0", "--threads", "2"])
        .args(args);
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn stats(out: &Output) -> serde_json::Value {
    let err = text(&out.stderr);
    let line = err
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON in stderr: {err}"));
    serde_json::from_str(line).unwrap()
}

#[test]
fn stdout_holds_only_the_reply_and_stats_json_parse() {
    let out = run(
        &[
            "--prompt",
            "The capital of France is",
            "--max-new",
            "5",
            "--stats",
            "json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), " Paris.\n\nThe");
    let s = stats(&out);
    assert_eq!(s["prompt_tokens"], 5);
    assert_eq!(s["generated_tokens"], 5);
    assert_eq!(s["forward_passes"], 5);
    assert_eq!(s["stop_reason"], "max-new");
    assert!(s["device"].as_str().unwrap().starts_with("cpu"));
    assert!(s["ttft_s"].as_f64().unwrap() > 0.0);
    assert!(s["decode_tok_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn prompt_from_stdin_file_and_dash_agree() {
    let a = run(
        &["--max-new", "4", "--quiet"],
        Some(b"The capital of France is"),
    );
    let b = run(
        &["--prompt", "-", "--max-new", "4", "--quiet"],
        Some(b"The capital of France is"),
    );
    let dir = tempdir("prompt-file");
    let f = dir.join("p.txt");
    std::fs::write(&f, "The capital of France is").unwrap();
    let c = run(
        &[
            "--prompt-file",
            f.to_str().unwrap(),
            "--max-new",
            "4",
            "--quiet",
        ],
        None,
    );
    for o in [&a, &b, &c] {
        assert!(o.status.success(), "{}", text(&o.stderr));
        assert_eq!(text(&o.stdout), " Paris.\n\n");
        assert!(o.stderr.is_empty(), "--quiet printed: {}", text(&o.stderr));
    }
}

#[test]
fn echo_and_stop_strings() {
    let out = run(
        &[
            "--prompt",
            "The capital of France is",
            "--max-new",
            "20",
            "--echo",
            "--stop",
            "\n",
            "--stats",
            "json",
        ],
        None,
    );
    assert!(out.status.success());
    assert_eq!(text(&out.stdout), "The capital of France is Paris.");
    let s = stats(&out);
    assert_eq!(s["stop_reason"], "stop");
}

#[test]
fn chat_uses_the_models_template() {
    let out = run(
        &[
            "--chat",
            "--prompt",
            "What is 2+2?",
            "--max-new",
            "40",
            "--stats",
            "json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let reply = text(&out.stdout);
    assert!(reply.contains('4'), "{reply}");
    assert!(
        !reply.contains("<|im_end|>") && !reply.contains("<|im_start|>"),
        "{reply}"
    );
    let s = stats(&out);
    assert_eq!(
        s["stop_reason"], "eos",
        "the reply should end at <|im_end|>"
    );
    assert_eq!(
        s["forward_passes"].as_u64().unwrap(),
        s["generated_tokens"].as_u64().unwrap() + 1
    );
}

#[test]
fn same_seed_same_text() {
    let args = [
        "--prompt",
        "Once upon a time",
        "--max-new",
        "16",
        "--temperature",
        "0.9",
        "--seed",
        "11",
        "--quiet",
    ];
    let a = run(&args, None);
    let b = run(&args, None);
    assert!(a.status.success());
    assert_eq!(a.stdout, b.stdout);
    assert!(!a.stdout.is_empty());
}

#[test]
fn broken_pipe_ends_quietly() {
    let model = common::smollm2();
    let mut child = gen()
        .arg("--model")
        .arg(&model)
        .args([
            "--prompt",
            "Once upon a time",
            "--max-new",
            "200",
            "--temperature",
            "0",
            "--threads",
            "2",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 8];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    drop(child.stdout.take()); // the reader goes away, as `| head -c 8` does
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {err}", out.status.code());
    assert!(!err.contains("error") && !err.contains("panicked"), "{err}");
}

#[test]
fn usage_errors_exit_2_with_one_line() {
    for args in [
        &["--prompt", "x", "--temperature", "-1"][..],
        &["--prompt", "x", "--top-p", "0"],
        &["--prompt", "x", "--top-p", "1.5"],
        &["--prompt", "x", "--max-new", "0"],
        &["--prompt", "x", "--device", "tpu"],
        &["--prompt", "x", "--model", "/nonexistent/model.gguf"],
        &["--prompt", "x", "--dtype", "f16"],
        &[
            "--prompt",
            "x",
            "--model",
            "SomeOrg/some-repo",
            "--dtype",
            "f8",
        ],
    ] {
        let out = run(args, None);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        one_error_line(&out);
    }
    let out = gen().args(["--no-such-flag"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// `owner/name` alone names the repo's safetensors checkpoint: not a usage error, a fetch (here
/// offline, from an empty cache, so one line and exit 1).
#[test]
fn hub_repo_without_model_file_is_a_checkpoint_fetch() {
    let home = tempdir("hub-ckpt");
    let out = gen()
        .args(["--prompt", "x", "--model", "SomeOrg/some-repo", "--offline"])
        .env("HF_HOME", &home)
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    let line = one_error_line(&out);
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert!(
        line.contains("SomeOrg/some-repo") && line.contains("offline") && line.contains("HINT"),
        "{line}"
    );
    let _ = std::fs::remove_dir_all(&home);
}

#[test]
fn bad_input_is_one_line_and_exit_1() {
    let dir = tempdir("bad-input");
    let not_gguf = dir.join("not.gguf");
    std::fs::write(&not_gguf, b"this is not a model file at all").unwrap();
    let truncated = dir.join("truncated.gguf");
    let real = std::fs::read(common::smollm2()).unwrap();
    std::fs::write(&truncated, &real[..real.len() / 3]).unwrap();

    // (arguments, standard input, what the error line must mention)
    type Case<'a> = (Vec<String>, Option<&'a [u8]>, &'a str);
    // (An empty prompt is a usage error, exit 2: tests/scripts.rs.)
    let cases: Vec<Case> = vec![
        (vec![], Some(&[0x66, 0x6f, 0xff, 0xfe]), "UTF-8"),
        (
            s(&["--model", not_gguf.to_str().unwrap(), "--prompt", "x"]),
            None,
            "GGUF",
        ),
        (
            s(&["--model", truncated.to_str().unwrap(), "--prompt", "x"]),
            None,
            "truncated.gguf",
        ),
        (
            s(&["--prompt-file", "/nonexistent/prompt.txt"]),
            None,
            "prompt.txt",
        ),
        (
            s(&["--prompt", "x", "--max-new", "9000"]),
            None,
            "context window",
        ),
    ];
    for (args, stdin, needle) in cases {
        let mut full: Vec<&str> = vec![];
        // The model flag in `run` comes first; a later --model overrides it.
        full.extend(args.iter().map(|a| a.as_str()));
        let out = run(&full, stdin);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {}",
            text(&out.stderr)
        );
        let line = one_error_line(&out);
        assert!(line.contains(needle), "{args:?}: {line}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn stop_at_context_generates_until_the_window_is_full() {
    let out = run(
        &[
            "--prompt",
            "Once upon a time",
            "--ctx-size",
            "12",
            "--max-new",
            "100",
            "--stop-at-context",
            "--stats",
            "json",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = stats(&out);
    assert_eq!(s["stop_reason"], "context-full");
    assert_eq!(
        s["prompt_tokens"].as_u64().unwrap() + s["generated_tokens"].as_u64().unwrap(),
        12
    );
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn ctrl_c_flushes_the_partial_reply_prints_the_report_and_exits_130() {
    let model = common::smollm2();
    let mut child = gen()
        .arg("--model")
        .arg(&model)
        .args([
            "--prompt",
            "Once upon a time",
            "--max-new",
            "2000",
            "--ctx-size",
            "4096",
        ])
        .args([
            "--temperature",
            "0",
            "--ignore-eos",
            "--threads",
            "2",
            "--stats",
            "json",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    common::sigint(&child);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let s = stats(&out);
    assert_eq!(s["stop_reason"], "interrupted");
    let generated = s["generated_tokens"].as_u64().unwrap();
    assert!(generated > 0 && generated < 2000, "{generated}");
    // Everything generated before the interrupt reached stdout.
    let mut all = first.to_vec();
    all.extend_from_slice(&out.stdout);
    assert!(all.len() >= 16 && !text(&all).is_empty());
}

/// A small GGUF written by the test: given metadata and one f32 tensor.
fn tiny_gguf(path: &Path, arch: &str, tensor_type_patch: Option<u32>) {
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::{Device, Tensor};
    let t = QTensor::quantize(
        &Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
        candle_core::quantized::GgmlDType::F32,
    )
    .unwrap();
    let arch_v = gguf_file::Value::String(arch.to_string());
    let name_v = gguf_file::Value::String("tiny".to_string());
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(
        &mut f,
        &[("general.architecture", &arch_v), ("general.name", &name_v)],
        &[("token_embd.weight", &t)],
    )
    .unwrap();
    drop(f);
    if let Some(ty) = tensor_type_patch {
        // The tensor's type id sits right after its name, dim count and two dims.
        let mut bytes = std::fs::read(path).unwrap();
        let name = b"token_embd.weight";
        let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len() + 4 + 16;
        bytes[at..at + 4].copy_from_slice(&ty.to_le_bytes());
        std::fs::write(path, bytes).unwrap();
    }
}

#[test]
fn unsupported_architecture_and_tensor_type_are_one_line_errors() {
    let dir = tempdir("unsupported");
    let mamba = dir.join("mamba.gguf");
    tiny_gguf(&mamba, "mamba", None);
    let out = run(&["--model", mamba.to_str().unwrap(), "--prompt", "x"], None);
    assert_eq!(out.status.code(), Some(1));
    let line = one_error_line(&out);
    assert!(
        line.contains("\"mamba\"") && line.contains("supported: llama"),
        "{line}"
    );

    let bad_type = dir.join("badtype.gguf");
    tiny_gguf(&bad_type, "llama", Some(9999));
    let out = run(
        &["--model", bad_type.to_str().unwrap(), "--prompt", "x"],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    let line = one_error_line(&out);
    assert!(line.contains("badtype.gguf"), "{line}");
}
