//! `--endpoint` against a real OpenAI-compatible server: llama.cpp's llama-server (built once by
//! .ci/llama-server from the llama-cpp-python 0.3.36 sdist, cached), started here on 127.0.0.1
//! with the default model. One prompt streams; a batch of 32 comes back complete, in order,
//! with greedy texts equal to the server's own one-at-a-time greedy; a server killed mid-batch
//! fails only the unfinished items, and `--resume` completes the job with no duplicates.

mod common;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{gen, smollm2, text, with_stdin};
use serde_json::Value;

/// The llama-server binary: .ci/llama-server prints it (and builds it first if it must).
fn llama_server() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/llama-server");
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed", script.display());
    PathBuf::from(text(&out.stdout).trim())
}

/// One test's servers at a time: each llama-server's threads spin while they wait for work, so
/// two servers on two cores slow each other down many times over (the two tests took 540 s
/// side by side).
fn one_server_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// llama-server on a free port with the default model, `slots` sequences at once.
    fn start(slots: usize) -> Self {
        Self::start_with(slots, &[])
    }

    /// [`Self::start`] with more of llama-server's arguments.
    fn start_with(slots: usize, extra: &[&str]) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let model = smollm2();
        let child = Command::new(llama_server())
            .arg("-m")
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-np", &slots.to_string(), "-c", &(2048 * slots).to_string()])
            .args(["-t", "2", "--alias", "smollm2"])
            // No weight repacking: on a Xeon with AMX, this llama.cpp puts the Q4_1 weights in
            // its AMX buffer, and the server crashes loading the default model (SIGSEGV in
            // ggml_backend_amx_mul_mat). The plain CPU kernels serve the same model everywhere.
            .arg("--no-repack")
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("llama-server starts");
        let server = Server {
            child,
            url: format!("http://127.0.0.1:{port}/v1"),
        };
        let health = format!("http://127.0.0.1:{port}/health");
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if ureq::get(&health).call().is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("llama-server did not become healthy in 120 s");
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

const TOPICS: [&str; 8] = [
    "The capital of France is",
    "Once upon a time",
    "The best way to learn to cook is",
    "Water boils at",
    "My favourite animal is",
    "The history of Rome began",
    "To write good code, you should",
    "The sun rises in the",
];

/// 32 prompts, each distinct.
fn prompts(n: usize) -> String {
    (0..n)
        .map(|i| {
            let line = serde_json::json!({"id": format!("p{i}"), "prompt": format!("{} (#{i})", TOPICS[i % 8])});
            format!("{line}\n")
        })
        .collect()
}

fn batch(url: &str, input: &str, extra: &[&str]) -> (Vec<Value>, String, Option<i32>) {
    let mut cmd = gen();
    cmd.args([
        "--endpoint",
        url,
        "--batch",
        "-",
        "--temperature",
        "0",
        "-n",
        "10",
    ]);
    cmd.args(extra);
    let out = with_stdin(cmd, input);
    (
        common::jsonl(&text(&out.stdout)),
        text(&out.stderr),
        out.status.code(),
    )
}

#[test]
fn one_prompt_streams_and_a_batch_of_32_is_complete_in_order_and_greedy() {
    let _one = one_server_at_a_time();
    let server = Server::start(4);
    let out = gen()
        .args([
            "--endpoint",
            &server.url,
            "--prompt",
            "The capital of France is",
        ])
        .args(["-n", "8", "--temperature", "0", "--stats", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("Paris"), "{}", text(&out.stdout));
    let report: Value = serde_json::from_str(text(&out.stderr).lines().last().unwrap()).unwrap();
    assert_eq!(report["generated_tokens"], 8, "{report}");
    assert_eq!(report["stop_reason"], "max-new");
    assert_eq!(
        report["model"], "smollm2",
        "the first (only) model /v1/models lists"
    );

    // --chat goes through the server's chat template.
    let out = gen()
        .args([
            "--endpoint",
            &server.url,
            "--chat",
            "--prompt",
            "Say hello.",
        ])
        .args(["-n", "16", "--temperature", "0", "-q"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stdout).trim().is_empty());

    let input = prompts(32);
    let (together, err, code) = batch(&server.url, &input, &["--concurrency", "8"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(together.len(), 32);
    for (i, l) in together.iter().enumerate() {
        assert_eq!(
            (l["index"].clone(), l["id"].clone()),
            (i.into(), format!("p{i}").into())
        );
        assert!(l["text"].is_string() && l.get("error").is_none(), "{l}");
        assert!(l["stop"] == "max-new" || l["stop"] == "eos", "{l}");
    }
    // The server's greedy one request at a time: the same texts.
    let (alone, err, code) = batch(&server.url, &input, &["--concurrency", "1"]);
    assert_eq!(code, Some(0), "{err}");
    let differ: Vec<usize> = (0..32)
        .filter(|&i| together[i]["text"] != alone[i]["text"])
        .collect();
    assert!(
        differ.is_empty(),
        "items {differ:?} differ between concurrency 8 and 1"
    );
}

/// The batch settings both runs of the kill-and-resume test share.
/// (12 tokens an item: llama-server decodes this model at about 45 tokens/s on two cores, so
/// a batch of 24 still runs for seconds after the fourth line, when the server is killed.)
const RUN: [&str; 6] = ["--temperature", "0", "-n", "12", "--concurrency", "2"];

#[test]
fn a_server_killed_mid_batch_fails_the_rest_and_resume_finishes_with_no_duplicates() {
    let _one = one_server_at_a_time();
    let dir = std::env::temp_dir().join(format!("gen-remote-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input_path = dir.join("in.jsonl");
    let out_path = dir.join("out.jsonl");
    std::fs::write(&input_path, prompts(24)).unwrap();

    let mut first = Server::start(2);
    let mut run = gen()
        .args(["--endpoint", &first.url, "--batch"])
        .arg(&input_path)
        .args(RUN)
        .args(["--retries", "1"])
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the server once a few lines are out.
    let deadline = Instant::now() + Duration::from_secs(300);
    while std::fs::read_to_string(&out_path).unwrap().lines().count() < 4 {
        assert!(Instant::now() < deadline, "no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
    first.kill();
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(1), "a failed item fails the run");
    let written: Vec<Value> = common::jsonl(&std::fs::read_to_string(&out_path).unwrap());
    assert_eq!(written.len(), 24, "every item has its line");
    let complete = |l: &Value| l["text"].is_string() && l.get("error").is_none();
    let first_done = written.iter().filter(|l| complete(l)).count();
    assert!(
        (4..24).contains(&first_done),
        "{first_done} complete before the kill"
    );

    // A new server (a new address, as after a restart), and the same command with --resume.
    let second = Server::start(2);
    let mut cmd = gen();
    cmd.args(["--endpoint", &second.url, "--batch"])
        .arg(&input_path)
        .args(RUN)
        .arg("--resume")
        .arg(&out_path);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(&format!("{first_done} items already complete")));
    let added: Vec<Value> = common::jsonl(&text(&out.stdout));
    assert_eq!(
        added.len(),
        24 - first_done,
        "only the unfinished items run again"
    );
    let mut by_index: BTreeMap<u64, usize> = BTreeMap::new();
    for l in written.iter().chain(&added).filter(|l| complete(l)) {
        *by_index.entry(l["index"].as_u64().unwrap()).or_default() += 1;
    }
    assert_eq!(by_index.len(), 24, "every item complete");
    assert!(
        by_index.values().all(|&n| n == 1),
        "an item complete twice: {by_index:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A server that keeps thinking apart (`--jinja`, the DeepSeek-R1 distill's template, which
/// opens `<think>` when asked to think, and `--reasoning-format deepseek`): `--reasoning on`
/// reaches its template (`chat_template_kwargs.enable_thinking`), its `reasoning_content` goes
/// to stderr and `--stats json`, never to stdout; `--reasoning off` closes the block in the
/// prompt (three tokens more) and the reply is all answer.
#[test]
fn reasoning_maps_to_the_servers_reasoning_content_and_template_switch() {
    let _one = one_server_at_a_time();
    let template = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("assets/chat-templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja");
    let server = Server::start_with(
        1,
        &[
            "--jinja",
            "--chat-template-file",
            template.to_str().unwrap(),
            "--reasoning-format",
            "deepseek",
        ],
    );
    let run = |mode: &str| {
        let out = gen()
            .args([
                "--endpoint",
                &server.url,
                "--chat",
                "--prompt",
                "What is 2 + 2?",
            ])
            .args(["-n", "12", "--temperature", "0", "--stats", "json"])
            .args(["--reasoning", mode])
            .output()
            .unwrap();
        common::with_stats(&out)
    };
    let (answer, err, on) = run("on");
    let thinking = on["reasoning"].as_str().expect("reasoning_content");
    assert!(!thinking.trim().is_empty(), "{on}");
    assert_eq!(answer, "", "the thinking stays off stdout");
    assert!(err.contains(thinking.trim()), "{err}");
    let (answer, _, off) = run("off");
    assert!(off.get("reasoning").is_none(), "{off}");
    assert!(!answer.trim().is_empty());
    assert_eq!(
        off["prompt_tokens"].as_u64().unwrap(),
        on["prompt_tokens"].as_u64().unwrap() + 3,
        "the prompt closed the block: {on} {off}"
    );
}

/// `--tools` reaches the server's own template (`--jinja`, Qwen3's): it renders the same prompt
/// gen renders locally (the same token count), and the reply's `tool_calls` field is there.
#[test]
fn tools_go_to_the_server_as_its_template_reads_them() {
    let _one = one_server_at_a_time();
    let template =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/chat-templates/Qwen-Qwen3-0.6B.jinja");
    let dir = std::env::temp_dir().join(format!("gen-remote-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tools = dir.join("tools.json");
    std::fs::write(
        &tools,
        r#"[{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]"#,
    )
    .unwrap();
    let server = Server::start_with(
        1,
        &[
            "--jinja",
            "--chat-template-file",
            template.to_str().unwrap(),
        ],
    );
    let stats = |extra: &[&str]| -> Value {
        let out = gen()
            .arg("--tools")
            .arg(&tools)
            .args(["--chat", "--prompt", "What is the weather in Paris?"])
            .args(["-n", "4", "--temperature", "0", "--stats", "json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_str(text(&out.stderr).lines().last().unwrap()).unwrap()
    };
    let remote = stats(&["--endpoint", &server.url]);
    let local = stats(&[
        "--model",
        smollm2().to_str().unwrap(),
        "--chat-template",
        template.to_str().unwrap(),
    ]);
    assert_eq!(
        remote["prompt_tokens"], local["prompt_tokens"],
        "{remote} {local}"
    );
    assert!(
        remote["prompt_tokens"].as_u64().unwrap() > 100,
        "the tools are in it"
    );
    assert!(remote["tool_calls"].is_array(), "{remote}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--logprobs` is asked of the server as OpenAI's API asks it and comes back in gen's shape
/// (a single prompt's report) and in OpenAI's (batch lines): the completions API's lists and
/// chat's entries alike; greedy, the first alternative is the token the server took.
#[test]
fn logprobs_are_asked_of_the_server_and_passed_through() {
    let _one = one_server_at_a_time();
    let server = Server::start(2);
    for chat in [false, true] {
        let mut cmd = gen();
        cmd.args([
            "--endpoint",
            &server.url,
            "--prompt",
            "The capital of France is",
        ])
        .args([
            "-n",
            "6",
            "--temperature",
            "0",
            "--stats",
            "json",
            "--logprobs",
            "2",
        ]);
        if chat {
            cmd.arg("--chat");
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        let report: Value =
            serde_json::from_str(text(&out.stderr).lines().last().unwrap()).unwrap();
        let lps = report["logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), 6, "chat {chat}: {report}");
        let mut bytes = Vec::new();
        for e in lps {
            let top = e["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 2, "{e}");
            assert_eq!(top[0]["token"], e["token"], "greedy: {e}");
            assert!(e["logprob"].as_f64().unwrap() <= 0.0);
            assert!(e.get("id").is_none(), "servers send no ids");
            bytes.extend(
                e["bytes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|b| b.as_u64().unwrap() as u8),
            );
        }
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            text(&out.stdout).trim_end_matches('\n')
        );
    }
    let (lines, err, code) = batch(
        &server.url,
        "The sun rises in the\n",
        &["--logprobs", "1", "--batch-output", "openai"],
    );
    assert_eq!(code, Some(0), "{err}");
    let lp = &lines[0]["response"]["body"]["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 10, "{lp}");
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 10);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 1);
    // Scoring lines need the model's rows: refused on a server, line by line.
    let (lines, _, code) = batch(
        &server.url,
        "{\"prompt\": \"Is it?\", \"continuation\": \" Yes\"}\n{\"prompt\": \"Hi\"}\n",
        &[],
    );
    assert_eq!(code, Some(1));
    assert!(lines[0]["error"]
        .as_str()
        .unwrap()
        .contains("local models only"));
    assert!(lines[1]["text"].is_string());
}
