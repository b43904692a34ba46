//! Thinking kept apart from the answer (src/reasoning.rs, src/app/thinking.rs), through the
//! binary on the real default model given a thinking model's real chat template
//! (assets/chat-templates: the DeepSeek-R1 distill's, which opens `<think>` at the end of the
//! prompt with `enable_thinking`, and closes it at once without). Greedy, so every run of the
//! same arguments writes the same reply. The model was not trained to think, so it never closes
//! the block itself in these few tokens: the budget closes it (its end marker fed to the model),
//! and a regex holds the answer, not the thinking, to its shape.

mod common;

use std::path::Path;

use common::{gen, jsonl, smollm2, text};
use serde_json::Value;

/// gen on the default model with the chat template `t` (an asset's file name).
fn with_template(t: &str) -> std::process::Command {
    let mut c = gen();
    c.arg("--model").arg(smollm2()).arg("--chat-template").arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("assets/chat-templates")
            .join(t),
    );
    c
}

/// `gen --chat --prompt Hi --dry-run --reasoning off` with the given template: the prompt it
/// would run, on stdout.
fn dry_run_thinking_off(template: &str) -> std::process::Output {
    with_template(template)
        .args([
            "--chat",
            "--prompt",
            "Hi",
            "--dry-run",
            "--reasoning",
            "off",
        ])
        .output()
        .unwrap()
}

/// `gen --chat` with template `t` and `args`, greedy: (stdout, stderr, the --stats json).
fn run_with(t: &str, args: &[&str]) -> (String, String, Value) {
    let out = with_template(t)
        .args(["--chat", "--prompt", "What is 2 + 2?", "--temperature", "0"])
        .args(["--stats", "json"])
        .args(args)
        .output()
        .unwrap();
    common::with_stats(&out)
}

const R1: &str = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja";

/// [`run_with`] the DeepSeek-R1 distill's template.
fn run(args: &[&str]) -> (String, String, Value) {
    run_with(R1, args)
}

#[test]
fn the_budget_closes_the_thinking_and_the_grammar_holds_the_answer_only() {
    let (answer, err, stats) = run(&[
        "--reasoning",
        "on",
        "--reasoning-budget",
        "6",
        "--regex",
        "[0-9]{1,3}",
        "--max-new",
        "40",
    ]);
    // stdout: the answer alone, whole under the regex; the thinking went to stderr.
    assert!(
        !answer.is_empty() && answer.len() <= 3 && answer.bytes().all(|b| b.is_ascii_digit()),
        "{answer:?}"
    );
    let thinking = stats["reasoning"].as_str().unwrap();
    assert!(!thinking.trim().is_empty(), "{stats}");
    assert!(
        !thinking.contains("think>"),
        "markers stay out: {thinking:?}"
    );
    assert!(
        err.starts_with(thinking),
        "the thinking streams to stderr first: {err:?}"
    );
    // Six tokens of thinking, then the end marker's tokens (fed, not sampled).
    let tokens = stats["reasoning_tokens"].as_u64().unwrap();
    assert!((7..=12).contains(&tokens), "{stats}");
    assert_eq!(stats["stopped_while_thinking"], false);
    assert_eq!(stats["stop_reason"], "grammar");
    // The forced marker took no pass of its own: fewer passes than tokens after the first.
    let (passes, generated) = (
        stats["forward_passes"].as_u64().unwrap(),
        stats["generated_tokens"].as_u64().unwrap(),
    );
    assert!(passes < generated, "{stats}");
}

#[test]
fn reasoning_off_renders_the_block_closed_and_the_reply_is_all_answer() {
    let (answer, _, stats) = run(&["--reasoning", "off", "--regex", "[0-9]{1,3}"]);
    assert!(answer.bytes().all(|b| b.is_ascii_digit()) && !answer.is_empty());
    assert_eq!(stats["reasoning_tokens"], 0, "{stats}");
    assert_eq!(stats["reasoning"], "");
    // --dry-run shows why: the template closed the block in the prompt.
    let out = dry_run_thinking_off(R1);
    assert!(
        text(&out.stdout).ends_with("<think>\n</think>"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn a_reply_cut_while_thinking_has_no_answer_and_the_report_says_so() {
    let (answer, err, stats) = run(&["--reasoning", "on", "--max-new", "5"]);
    assert_eq!(answer, "", "nothing of the thinking on stdout");
    assert_eq!(stats["stopped_while_thinking"], true, "{stats}");
    assert_eq!(stats["reasoning_tokens"], 5);
    assert_eq!(stats["stop_reason"], "max-new");
    assert!(!stats["reasoning"].as_str().unwrap().is_empty());
    // The human report too.
    let out = with_template(R1)
        .args(["--chat", "--prompt", "What is 2 + 2?", "--temperature", "0"])
        .args(["--reasoning", "on", "--max-new", "5"])
        .output()
        .unwrap();
    let human = text(&out.stderr);
    assert!(
        human.contains("reasoning      5 tokens (the reply stopped while thinking: no answer)"),
        "{human}"
    );
    assert!(err.contains(stats["reasoning"].as_str().unwrap()));
}

#[test]
fn batch_lines_carry_the_thinking_apart_in_both_shapes() {
    let (_, _, single) = run(&["--reasoning", "on", "--max-new", "8"]);
    let input = "What is 2 + 2?\nName a colour.\n";
    let batch = |shape: &str| -> Vec<Value> {
        let mut cmd = with_template(R1);
        cmd.args(["--chat", "--batch", "-", "--temperature", "0"])
            .args(["--reasoning", "on", "--max-new", "8", "--quiet"])
            .args(["--batch-output", shape]);
        let out = common::with_stdin(cmd, input);
        assert!(out.status.success(), "{}", text(&out.stderr));
        jsonl(&text(&out.stdout))
    };
    let lines = batch("gen");
    assert_eq!(lines.len(), 2);
    // The first line is the single run's reply: all thinking, no text.
    assert_eq!(lines[0]["reasoning"], single["reasoning"], "{}", lines[0]);
    assert_eq!(lines[0]["reasoning_tokens"], 8);
    assert_eq!(lines[0]["text"], "");
    let openai = batch("openai");
    let message = &openai[0]["response"]["body"]["choices"][0]["message"];
    assert_eq!(
        message["reasoning_content"], single["reasoning"],
        "{message}"
    );
    assert_eq!(message["content"], "");
    let usage = &openai[0]["response"]["body"]["usage"];
    assert_eq!(usage["completion_tokens_details"]["reasoning_tokens"], 8);
}

/// The budget in a batch: each line's thinking is closed after its budget, and each line is the
/// single run's reply (greedy): the same thinking, the same answer under the same regex.
#[test]
fn the_budget_closes_each_batch_lines_thinking_as_a_single_run_does() {
    let args = [
        "--reasoning",
        "on",
        "--reasoning-budget",
        "6",
        "--regex",
        "[0-9]{1,3}",
        "--max-new",
        "40",
    ];
    let (answer, _, single) = run(&args);
    let mut cmd = with_template(R1);
    cmd.args(["--chat", "--batch", "-", "--temperature", "0", "--quiet"])
        .args(args);
    let out = common::with_stdin(cmd, "What is 2 + 2?\nWhat is 3 + 5?\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<Value> = jsonl(&text(&out.stdout));
    assert_eq!(lines[0]["text"], answer.as_str(), "{}", lines[0]);
    assert_eq!(lines[0]["reasoning"], single["reasoning"]);
    assert_eq!(lines[0]["reasoning_tokens"], single["reasoning_tokens"]);
    for l in &lines {
        let t = l["text"].as_str().unwrap();
        assert!(
            !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()),
            "{l}"
        );
        // Done by the regex (three digits) or by the model's end after one or two.
        assert!(l["stop"] == "grammar" || l["stop"] == "eos", "{l}");
        let r = l["reasoning_tokens"].as_u64().unwrap();
        assert!((7..=12).contains(&r), "closed after 6 tokens: {l}");
    }
}

/// gpt-oss's Harmony template: the analysis channel is the thinking, the final channel's
/// header is stripped from the answer. The regex writes the channel headers (the model does not
/// know them); the budget closes the analysis with `<|end|>`.
#[test]
fn gpt_oss_channels_split_into_thinking_and_answer() {
    const GPT_OSS: &str = "openai-gpt-oss-120b.jinja";
    let (answer, _, stats) = run_with(
        GPT_OSS,
        &[
            "--reasoning-budget",
            "5",
            "--max-new",
            "60",
            "--regex",
            r"<\|channel\|>analysis<\|message\|>\n<\|start\|>assistant<\|channel\|>final<\|message\|>[0-9]{1,3}",
        ],
    );
    assert!(
        !answer.is_empty() && answer.bytes().all(|b| b.is_ascii_digit()),
        "the final channel's text alone: {answer:?}"
    );
    let thinking = stats["reasoning"].as_str().unwrap();
    assert!(
        !thinking.trim().is_empty() && !thinking.contains("<|"),
        "{stats}"
    );
    assert!(stats["reasoning_tokens"].as_u64().unwrap() > 5, "{stats}");
    // gpt-oss has no enable_thinking switch (it takes reasoning_effort): off says so.
    let out = dry_run_thinking_off(GPT_OSS);
    assert!(text(&out.stderr).contains("no switch to turn thinking off"));
}

/// Gemma 4's thought channel (`<|channel>thought` ... `<channel|>`), thinking on by its switch.
#[test]
fn gemma4_thought_channel_is_the_thinking() {
    let (answer, _, stats) = run_with(
        "google-gemma-4-31B-it.jinja",
        &[
            "--reasoning",
            "on",
            "--reasoning-budget",
            "5",
            "--max-new",
            "40",
            "--regex",
            r"<\|channel>thought[0-9]{1,3}",
        ],
    );
    assert!(
        !answer.is_empty() && answer.bytes().all(|b| b.is_ascii_digit()),
        "{answer:?}"
    );
    assert!(stats["reasoning_tokens"].as_u64().unwrap() > 5, "{stats}");
    assert!(
        !stats["reasoning"].as_str().unwrap().contains("channel"),
        "{stats}"
    );
}

#[test]
fn gen_chat_keeps_the_thinking_out_of_the_conversation() {
    let dir = std::env::temp_dir().join(format!("gen-reasoning-chat-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let saved = dir.join("conv.json");
    let mut cmd = with_template(R1);
    cmd.arg("chat")
        .args(["--temperature", "0", "--max-new", "12"])
        .args(["--reasoning", "on", "--reasoning-budget", "4"]);
    let out = common::with_stdin(cmd, &format!("What is 2 + 2?\n/save {}\n", saved.display()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let conv: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let reply = conv[1]["content"].as_str().unwrap();
    // The one-shot run of the same turn: its answer is the reply kept, its thinking is not.
    let (answer, _, stats) = run(&[
        "--reasoning",
        "on",
        "--reasoning-budget",
        "4",
        "--max-new",
        "12",
    ]);
    assert_eq!(reply, answer, "{conv}");
    let thinking = stats["reasoning"].as_str().unwrap();
    assert!(!thinking.trim().is_empty(), "{stats}");
    assert!(!reply.contains("think>"), "{reply:?}");
    assert!(
        text(&out.stderr).contains(thinking.trim()),
        "shown on stderr"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn reasoning_flags_are_refused_where_they_cannot_work() {
    for (args, want) in [
        (
            vec![
                "--prompt",
                "Hi",
                "--endpoint",
                "http://127.0.0.1:9",
                "--reasoning-budget",
                "5",
            ],
            "local models only",
        ),
        (
            vec![
                "--prompt",
                "Hi",
                "--endpoint",
                "http://127.0.0.1:9",
                "--reasoning",
                "off",
            ],
            "add --chat",
        ),
    ] {
        let out = gen()
            .args(&args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        assert!(
            common::one_error_line(&out).contains(want),
            "{}",
            text(&out.stderr)
        );
    }
}
