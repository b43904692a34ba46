//! Tool calls through the binary (src/tool_calls.rs): tools offered with `--tools` through a
//! real template (Qwen3's, which asks for `<tool_call>` blocks), the reply's calls read back
//! as OpenAI `tool_calls`. The real default model does not call tools by itself: a regex holds
//! its reply to a call, as a grammar would hold a real model to its tool's schema. Then a
//! conversation carrying a call and its result, through `--messages` and `gen chat`'s `/tool`.

mod common;

use std::path::{Path, PathBuf};

use common::{gen, jsonl, smollm2, text};
use serde_json::Value;

const CALL: &str = r#"<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>"#;

fn template() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/chat-templates/Qwen-Qwen3-0.6B.jinja")
}

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gen-tools-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tools.json"),
        r#"[{"type": "function", "function": {"name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]"#,
    )
    .unwrap();
    dir
}

fn base(dir: &Path) -> std::process::Command {
    let mut c = gen();
    c.arg("--model")
        .arg(smollm2())
        .arg("--chat-template")
        .arg(template())
        .arg("--tools")
        .arg(dir.join("tools.json"))
        .args(["--temperature", "0"]);
    c
}

#[test]
fn a_call_in_the_reply_comes_back_as_openai_tool_calls() {
    let dir = scratch("one");
    let out = base(&dir)
        .args(["--chat", "--prompt", "What is the weather in Paris?"])
        .args(["--regex", CALL, "--stats", "json"])
        .output()
        .unwrap();
    let (stdout, _, stats) = common::with_stats(&out);
    assert!(
        stdout.starts_with("<tool_call>\n{\"name\": \"get_weather\""),
        "{stdout}"
    );
    let calls = stats["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{stats}");
    assert_eq!(calls[0]["id"], "call_0");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    let city = args["city"].as_str().unwrap();
    assert!(
        stdout.contains(&format!("\"city\": \"{city}\"")),
        "{stdout}"
    );
    assert_eq!(stats["malformed_tool_calls"], 0);
    // The tools reached the template: the prompt holds their description.
    assert!(stats["prompt_tokens"].as_u64().unwrap() > 100, "{stats}");

    // Cut before its end: no call, one malformed block, said in the report.
    let out = base(&dir)
        .args(["--chat", "--prompt", "What is the weather in Paris?"])
        .args(["--regex", CALL, "--max-new", "8"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(
        err.contains("tool calls     none (1 malformed, left in the text)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--tool-choice`: no regex needed, a grammar holds the reply to a call of the tool named
/// (or of any, `required`), its arguments to the tool's schema.
#[test]
fn tool_choice_holds_the_reply_to_a_call_of_the_schema() {
    let dir = scratch("choice");
    for choice in ["get_weather", "required"] {
        let out = base(&dir)
            .args(["--chat", "--prompt", "What is the weather in Paris?"])
            .args([
                "--tool-choice",
                choice,
                "--max-new",
                "60",
                "--stats",
                "json",
            ])
            .output()
            .unwrap();
        let (_, _, stats) = common::with_stats(&out);
        assert_eq!(stats["stop_reason"], "grammar", "{stats}");
        let calls = stats["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{stats}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        let keys: Vec<&String> = args.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["city"], "only the schema's properties: {args}");
        assert!(args["city"].is_string());
    }
    // A name not in --tools, and gen chat: refused.
    let out = base(&dir)
        .args(["--chat", "--prompt", "Hi", "--tool-choice", "get_time"])
        .output()
        .unwrap();
    assert!(common::one_error_line(&out).contains("no tool of that name"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn batch_lines_carry_the_calls_in_both_shapes() {
    let dir = scratch("batch");
    let run = |shape: &str| -> Vec<Value> {
        let mut cmd = base(&dir);
        cmd.args(["--chat", "--batch", "-", "--quiet", "--batch-output", shape])
            .args(["--regex", CALL]);
        let out = common::with_stdin(cmd, "What is the weather in Paris?\n");
        assert!(out.status.success(), "{}", text(&out.stderr));
        jsonl(&text(&out.stdout))
    };
    let lines = run("gen");
    assert_eq!(lines[0]["tool_calls"][0]["function"]["name"], "get_weather");
    assert!(lines[0]["text"].as_str().unwrap().contains("<tool_call>"));
    let openai = run("openai");
    let choice = &openai[0]["response"]["body"]["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    assert_eq!(choice["message"]["content"], Value::Null);
    assert_eq!(
        choice["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_call_and_its_result_go_back_to_the_template() {
    let dir = scratch("loop");
    let conv = dir.join("conv.json");
    std::fs::write(
        &conv,
        r#"[{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "18 C, sunny"}]"#,
    )
    .unwrap();
    // --messages: the call (its arguments read as the object they hold) and the result, as
    // Qwen3's template writes them.
    let out = base(&dir)
        .args(["--chat", "--dry-run", "--messages"])
        .arg(&conv)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let prompt = text(&out.stdout);
    assert!(
        prompt.contains(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        ),
        "{prompt}"
    );
    assert!(
        prompt.contains("<tool_response>\n18 C, sunny\n</tool_response>"),
        "{prompt}"
    );

    // gen chat: the same conversation up to the call, /tool answers it, the model replies.
    let first2 = dir.join("first2.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&conv).unwrap()).unwrap();
    std::fs::write(
        &first2,
        serde_json::to_string(&v.as_array().unwrap()[..2]).unwrap(),
    )
    .unwrap();
    let saved = dir.join("saved.json");
    let mut cmd = gen();
    cmd.arg("chat")
        .arg("--model")
        .arg(smollm2())
        .arg("--chat-template")
        .arg(template())
        .arg("--tools")
        .arg(dir.join("tools.json"))
        .args(["--temperature", "0", "--max-new", "8", "--messages"])
        .arg(&first2);
    let input = format!("/tool 18 C, sunny\n/save {}\n", saved.display());
    let out = common::with_stdin(cmd, &input);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let saved = saved.as_array().unwrap();
    assert_eq!(saved.len(), 4, "{saved:?}");
    assert_eq!(saved[2]["role"], "tool");
    assert_eq!(saved[2]["tool_call_id"], "call_0");
    assert_eq!(saved[2]["name"], "get_weather");
    assert_eq!(saved[2]["content"], "18 C, sunny");
    assert_eq!(saved[3]["role"], "assistant");
    // The reply is the one-shot run's over the whole conversation.
    let out = base(&dir)
        .args(["--chat", "--max-new", "8", "--messages"])
        .arg(&conv)
        .output()
        .unwrap();
    assert_eq!(saved[3]["content"], text(&out.stdout));
    // A result with no call waiting for one: one error line, the chat goes on, and its exit
    // status says a line failed.
    let mut cmd = gen();
    cmd.arg("chat")
        .arg("--model")
        .arg(smollm2())
        .args(["--temperature", "0", "--max-new", "4"]);
    let out = common::with_stdin(cmd, "Hi\n/tool 18 C\n");
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.lines()
            .any(|l| l == "gen: error: /tool: no tool call waits for a result"),
        "{err}"
    );
    assert!(
        err.ends_with("gen: error: 1 of 2 lines of standard input failed (see the lines above)\n"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_tools_are_one_clear_error() {
    let dir = scratch("bad");
    for (content, want) in [
        ("not json", "is not JSON"),
        (r#"{"a": 1}"#, "expected an array of tools"),
        (r#"[{"type": "function"}]"#, "tool 0 is not"),
        (
            r#"[{"type": "function", "function": {"name": "f", "parameters": 3}}]"#,
            "not a JSON Schema object",
        ),
    ] {
        std::fs::write(dir.join("t.json"), content).unwrap();
        let out = gen()
            .args(["--chat", "--prompt", "Hi", "--tools"])
            .arg(dir.join("t.json"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{content}");
        assert!(
            common::one_error_line(&out).contains(want),
            "{}",
            text(&out.stderr)
        );
    }
    let out = gen()
        .args(["--prompt", "Hi", "--tools"])
        .arg(dir.join("tools.json"))
        .output()
        .unwrap();
    assert!(common::one_error_line(&out).contains("add --chat"));
    let _ = std::fs::remove_dir_all(&dir);
}
