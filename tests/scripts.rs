//! gen as scripts meet it: escapes in command-line strings, llama-cli's spellings, clap's
//! suggestions, exit statuses (2 for usage, 128 + the signal for SIGTERM and SIGHUP), and the
//! warning for a window past the model's, on the default model through the binary.

mod common;

use std::io::Read;
use std::process::{Output, Stdio};

use common::{gen, smollm2, text};

fn run(args: &[&str]) -> Output {
    gen()
        .arg("--model")
        .arg(smollm2())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn escapes_in_command_line_strings_are_processed_unless_turned_off() {
    use gen::cli::unescape;
    assert_eq!(unescape(r"a\nb\tc\rd"), "a\nb\tc\rd");
    assert_eq!(unescape(r#"\\ \" \'"#), "\\ \" '");
    assert_eq!(unescape(r"\x41\x7a"), "Az");
    // Unknown escapes, a short \x and a trailing backslash stay as typed.
    assert_eq!(unescape(r"\q \x4 \xZZ end\"), r"\q \x4 \xZZ end\");
    assert_eq!(unescape("plain: é"), "plain: é");

    // --help's example: --stop "\n\n" stops at the first blank line, which is never printed.
    let args = [
        "--prompt",
        "Write three short paragraphs about the sea.",
        "-n",
        "200",
    ];
    let greedy = ["--temperature", "0", "--chat", "-q"];
    let free = run(&[&args[..], &greedy].concat());
    let full = text(&free.stdout);
    assert!(
        full.contains("\n\n"),
        "the reply has a blank line to stop at: {full:?}"
    );
    let stopped = run(&[&args[..], &greedy, &["--stop", r"\n\n"]].concat());
    assert!(stopped.status.success(), "{}", text(&stopped.stderr));
    let cut = text(&stopped.stdout);
    assert_eq!(
        cut,
        full[..full.find("\n\n").unwrap()],
        "stops at the blank line"
    );
    // --no-escape takes the two characters as typed: the reply runs past the blank line.
    let typed = run(&[&args[..], &greedy, &["--stop", r"\n\n", "--no-escape"]].concat());
    assert_eq!(text(&typed.stdout), full);
    // --prompt's escapes: "a\nb" is the same prompt as a real newline.
    let dry = |p: &str, extra: &[&str]| {
        text(&run(&[&["--prompt", p, "--dry-run", "-q"][..], extra].concat()).stdout)
    };
    assert_eq!(dry(r"one\ntwo", &[]), dry("one\ntwo", &[]));
    assert_eq!(dry(r"one\ntwo", &["--no-escape"]), r"one\ntwo");
}

#[test]
fn llama_cli_spellings_are_taken() {
    let dir = std::env::temp_dir().join(format!("gen-scripts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("p.txt");
    std::fs::write(&file, "The capital of France is").unwrap();
    let f = file.to_str().unwrap();
    let ours = run(&[
        "--prompt-file",
        f,
        "--max-new",
        "6",
        "--temperature",
        "0.9",
        "--seed",
        "3",
        "--ctx-size",
        "256",
        "-q",
    ]);
    let theirs = run(&[
        "-f",
        f,
        "--n-predict",
        "6",
        "--temp",
        "0.9",
        "-s",
        "3",
        "-c",
        "256",
        "-q",
    ]);
    assert!(theirs.status.success(), "{}", text(&theirs.stderr));
    assert_eq!(text(&theirs.stdout), text(&ours.stdout));
    // -sys and --system-prompt are --system.
    let sys = |flag: &str| {
        let out = run(&[
            "--chat",
            "--prompt",
            "Hi",
            flag,
            "You are terse.",
            "--dry-run",
            "-q",
        ]);
        assert!(out.status.success(), "{flag}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    assert!(sys("--system").contains("You are terse."));
    assert_eq!(sys("-sys"), sys("--system"));
    assert_eq!(sys("--system-prompt"), sys("--system"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn usage_errors_exit_2_with_one_line_and_a_suggestion() {
    let typo = run(&["--prompt", "x", "--temprature", "0"]);
    assert_eq!(typo.status.code(), Some(2));
    let line = common::one_error_line(&typo);
    assert!(line.contains("--temperature"), "a suggestion: {line}");
    // An empty prompt is a usage error too.
    let empty = run(&["--prompt", "   "]);
    assert_eq!(empty.status.code(), Some(2), "{}", text(&empty.stderr));
    assert!(common::one_error_line(&empty).contains("the prompt is empty"));
}

#[test]
fn a_window_past_the_models_is_capped_with_a_warning_even_when_quiet() {
    let out = run(&["--prompt", "Hi", "-n", "2", "--ctx-size", "100000", "-q"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("--ctx-size 100000") && err.contains("8192"),
        "one warning naming both: {err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// `sig` sent once the reply has begun: the text so far on stdout, the report on stderr with
/// `stop: interrupted`, exit 128 + the signal.
fn signalled_single(sig: &str, code: i32) {
    let mut child = gen()
        .arg("--model")
        .arg(smollm2())
        .args([
            "--prompt",
            "Once upon a time",
            "-n",
            "3000",
            "--ctx-size",
            "4096",
        ])
        .args(["--temperature", "0", "--ignore-eos", "--stats", "json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let kill = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{sig}: {err}");
    assert!(
        !rest.is_empty() || first[0] != 0,
        "the text so far was written"
    );
    let report: serde_json::Value = serde_json::from_str(err.lines().last().unwrap()).unwrap();
    assert_eq!(report["stop_reason"], "interrupted", "{err}");
    let n = report["generated_tokens"].as_u64().unwrap();
    assert!(n > 0 && n < 3000, "{n}");
}

/// The README's "Exit status" paragraph, as (status, what it says) pairs: "0 done", "1 error",
/// "130 Ctrl-C", ...
fn readme_exit_statuses() -> Vec<(i32, String)> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let at = readme
        .find("### Exit status")
        .expect("the README has the section");
    let para = readme[at..].split("\n\n").nth(1).unwrap();
    let words: Vec<&str> = para.split_whitespace().collect();
    let mut out = Vec::new();
    for w in words.windows(2) {
        if let Ok(code) = w[0].trim_start_matches('(').parse::<i32>() {
            out.push((code, w[1].trim_end_matches([',', ';', ')']).to_string()));
        }
    }
    out
}

/// Every status the README's table names, tried: each case ends with the status it says.
#[test]
fn exit_statuses_match_the_readmes_table() {
    let table = readme_exit_statuses();
    let codes: Vec<i32> = table.iter().map(|(c, _)| *c).collect();
    assert_eq!(codes, [0, 1, 2, 128, 130, 143, 129], "{table:?}");
    for (code, what) in table {
        match (code, what.as_str()) {
            (0, "done") => {
                let ok = run(&["-p", "Hi", "-n", "2", "-q"]);
                assert_eq!(ok.status.code(), Some(0));
                // The reader of stdout went away (| head): still 0.
                let cmd = format!(
                    "{} --model {} -p 'Count to fifty:' -n 200 -t 0 --ignore-eos | head -c 5 >/dev/null; exit ${{PIPESTATUS[0]}}",
                    env!("CARGO_BIN_EXE_gen"),
                    smollm2().display()
                );
                let piped = std::process::Command::new("bash")
                    .args(["-c", &cmd])
                    .output()
                    .unwrap();
                assert_eq!(piped.status.code(), Some(0), "{}", text(&piped.stderr));
            }
            (1, "error") => {
                // A runtime failure: a model file that is not a model.
                let dir = std::env::temp_dir().join(format!("gen-exit-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                let bad = dir.join("bad.gguf");
                std::fs::write(&bad, b"not a model").unwrap();
                let out = gen()
                    .arg("--model")
                    .arg(&bad)
                    .args(["-p", "x"])
                    .output()
                    .unwrap();
                assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
                common::one_error_line(&out);
                // A structured reply cut before it was complete: eight digits cannot fit in two
                // tokens whatever is sampled (`--json` could, as `{}`).
                let cut = run(&["-p", "x", "--regex", "[0-9]{8}", "-n", "2", "-q"]);
                assert_eq!(cut.status.code(), Some(1), "{}", text(&cut.stderr));
            }
            (2, "bad") => {
                let typo = run(&["--prompt", "x", "--max-neww", "3"]);
                assert_eq!(typo.status.code(), Some(2));
                let empty = run(&["--prompt", ""]);
                assert_eq!(empty.status.code(), Some(2));
            }
            (128, "+") => {} // "128 + the signal": the three below
            (130, "Ctrl-C") => signalled_single("INT", 130),
            (143, "SIGTERM") => signalled_single("TERM", 143),
            (129, "SIGHUP") => signalled_single("HUP", 129),
            other => panic!("the README names a status this test does not try: {other:?}"),
        }
    }
}

/// A --batch run whose reader goes away (`| head -c 50`) ends as a single prompt does: status
/// 0, and the report says so.
#[test]
fn a_batch_whose_reader_goes_away_reports_it() {
    let cmd = format!(
        "seq 1 30 | {} --model {} --batch - --batch-size 2 -n 20 -t 0 --ignore-eos --stats-file \"$1\" | head -c 50 >/dev/null; exit ${{PIPESTATUS[1]}}",
        env!("CARGO_BIN_EXE_gen"),
        smollm2().display()
    );
    let dir = std::env::temp_dir().join(format!("gen-closed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stats = dir.join("stats.json");
    let out = std::process::Command::new("bash")
        .args(["-c", &cmd, "bash", stats.to_str().unwrap()])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("stopped        output-closed after"), "{err}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(report["stop_reason"], "output-closed");
    assert!(report["written"].as_u64().unwrap() < 30, "{report}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sigterm_writes_every_batch_line_and_the_report() {
    let (code, err, lines) = common::signalled_batch("TERM");
    assert_eq!(code, Some(143), "{err}");
    assert_eq!(lines.len(), 3, "every line written");
    assert_eq!(lines[0]["stop"], "max-new");
    assert_eq!(lines[1]["stop"], "interrupted");
    assert_eq!(lines[2]["stop"], "interrupted");
    let report = err
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .expect("the report");
    let report: serde_json::Value = serde_json::from_str(report).unwrap();
    assert_eq!(report["prompts"], 3, "{err}");
}

#[test]
fn stats_file_holds_the_json_report_whatever_reaches_stderr() {
    let dir = std::env::temp_dir().join(format!("gen-stats-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("stats.json");
    let f = file.to_str().unwrap();
    // A warning on stderr (the window) and -q: the file is the report all the same.
    let out = run(&[
        "--prompt",
        "Hi",
        "-n",
        "3",
        "--ctx-size",
        "100000",
        "-q",
        "--stats-file",
        f,
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(report["generated_tokens"], 3);
    assert!(text(&out.stderr).contains("warning"));
    // A batch run's report, beside human lines on stderr.
    let mut cmd = gen();
    cmd.arg("--model").arg(smollm2());
    cmd.args(["--batch", "-", "-n", "2", "--stats-file", f]);
    let out = common::with_stdin(cmd, "one\ntwo\n");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(report["prompts"], 2);
    assert!(
        text(&out.stderr).contains("forward passes"),
        "the human report too"
    );
    // No temporary file is left beside it.
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(left.len(), 1, "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gen_chat_over_a_pipe_goes_on_past_a_bad_command_and_says_so_at_the_end() {
    let mut cmd = gen();
    cmd.arg("--model").arg(smollm2());
    cmd.args(["chat", "-n", "4", "--temperature", "0", "-q"]);
    let out = common::with_stdin(cmd, "hi\n/foo\n/set temperature nope\nmore \\\nlines\n");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a line failed: {err}");
    assert!(err.contains("/foo"), "{err}");
    assert!(err.contains("2 of 4 lines"), "{err}");
    // Both turns replied (each reply ends with a blank line).
    assert_eq!(
        text(&out.stdout).matches("\n\n").count(),
        2,
        "{:?}",
        text(&out.stdout)
    );
}

/// A structured reply that did not complete its grammar says so: `complete` false in the report
/// and the batch line, the warning even with -q, and exit 1 for a single run.
#[test]
fn an_incomplete_structured_reply_is_flagged_and_fails() {
    let dir = std::env::temp_dir().join(format!("gen-complete-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("stats.json");
    let f = file.to_str().unwrap();
    let report = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap()
    };
    let base = [
        "--prompt",
        "A number:",
        "--temperature",
        "0",
        "-q",
        "--stats-file",
        f,
    ];
    let cut = run(&[&base[..], &["--regex", "[0-9]{8}", "-n", "2"]].concat());
    assert_eq!(cut.status.code(), Some(1), "{}", text(&cut.stderr));
    assert!(
        text(&cut.stderr).contains("incomplete"),
        "{}",
        text(&cut.stderr)
    );
    assert_eq!(report()["complete"], false);
    let whole = run(&[&base[..], &["--regex", "[0-9]{3}", "-n", "10"]].concat());
    assert!(whole.status.success(), "{}", text(&whole.stderr));
    assert_eq!(text(&whole.stdout).len(), 3);
    assert_eq!(report()["complete"], true);
    // Without a grammar there is no such field.
    run(&["--prompt", "Hi", "-n", "2", "-q", "--stats-file", f]);
    assert!(report().get("complete").is_none());
    // Batch lines say it per line.
    let mut cmd = gen();
    cmd.arg("--model")
        .arg(smollm2())
        .args(["--batch", "-", "--temperature", "0", "-q"]);
    let out = common::with_stdin(
        cmd,
        "{\"prompt\": \"A number:\", \"regex\": \"[0-9]{8}\", \"max_new\": 2}\n\
         {\"prompt\": \"A number:\", \"regex\": \"[0-9]{3}\", \"max_new\": 10}\n\
         {\"prompt\": \"Hi\", \"max_new\": 2}\n",
    );
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["complete"], false);
    assert_eq!(lines[1]["complete"], true);
    assert!(lines[2].get("complete").is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

/// OpenAI batch input: each line's `url` decides whether its prompt goes through the chat
/// template and whether its output is a chat or a text completion, whatever `--chat` says.
#[test]
fn an_openai_batch_lines_url_decides_its_template_and_shape() {
    let input = concat!(
        r#"{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0}}"#,
        "\n",
        r#"{"custom_id": "t", "method": "POST", "url": "/v1/completions", "body": {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}}"#,
        "\n",
        r#"{"custom_id": "p", "method": "POST", "url": "/v1/chat/completions", "body": {"prompt": "Say hi", "max_tokens": 6, "temperature": 0}}"#,
        "\n",
    );
    let alone = |chat: bool| {
        let mut args = vec![
            "--prompt",
            "The capital of France is",
            "-n",
            "6",
            "-t",
            "0",
            "-q",
        ];
        if chat {
            args = vec!["--prompt", "Say hi", "-n", "6", "-t", "0", "-q", "--chat"];
        }
        text(&run(&args).stdout)
    };
    for flag in [None, Some("--chat")] {
        let mut cmd = gen();
        cmd.arg("--model").arg(smollm2());
        cmd.args(["--batch", "-", "--batch-output", "openai", "-q"]);
        cmd.args(flag);
        let out = common::with_stdin(cmd, input);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let lines: Vec<serde_json::Value> = text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let body = |i: usize| &lines[i]["response"]["body"];
        assert_eq!(body(0)["object"], "chat.completion", "{flag:?}");
        assert_eq!(body(1)["object"], "text_completion", "{flag:?}");
        assert_eq!(body(2)["object"], "chat.completion", "{flag:?}");
        // The text completion is the raw prompt's, --chat or not; a chat line's bare prompt
        // goes through the template as a user message.
        assert_eq!(body(1)["choices"][0]["text"], alone(false), "{flag:?}");
        assert_eq!(
            body(2)["choices"][0]["message"]["content"],
            alone(true),
            "{flag:?}"
        );
    }
}

/// `gen help` is the long help; `gen chat --help` and `gen help chat` list the slash commands.
#[test]
fn help_as_subcommands_and_for_gen_chat() {
    let top = gen().arg("help").output().unwrap();
    assert!(top.status.success());
    assert!(
        text(&top.stdout).contains("Usage: gen"),
        "{}",
        text(&top.stdout)
    );
    for args in [&["chat", "--help"][..], &["help", "chat"], &["chat", "-h"]] {
        let out = gen().args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}");
        let help = text(&out.stdout);
        for want in ["/undo", "/save FILE", "/set NAME VALUE", "--system"] {
            assert!(help.contains(want), "{args:?}: {want} missing");
        }
    }
}

/// OpenAI's presence and frequency penalties: flags and batch fields, checked in range.
#[test]
fn presence_and_frequency_penalties_are_taken_and_checked() {
    let plain = run(&["--prompt", "1, 1, 1, 1,", "-n", "8", "-t", "0", "-q"]);
    let penalised = run(&[
        "--prompt",
        "1, 1, 1, 1,",
        "-n",
        "8",
        "-t",
        "0",
        "-q",
        "--frequency-penalty",
        "2",
    ]);
    assert!(penalised.status.success(), "{}", text(&penalised.stderr));
    assert_ne!(
        text(&plain.stdout),
        text(&penalised.stdout),
        "the penalty changes the reply"
    );
    let bad = run(&["--prompt", "x", "--presence-penalty", "3"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(common::one_error_line(&bad).contains("--presence-penalty"));
    // As batch fields: the same reply as the flag; out of range, that line's error.
    let mut cmd = gen();
    cmd.arg("--model")
        .arg(smollm2())
        .args(["--batch", "-", "-n", "8", "-t", "0", "-q"]);
    let out = common::with_stdin(
        cmd,
        "{\"prompt\": \"1, 1, 1, 1,\", \"frequency_penalty\": 2}\n{\"prompt\": \"x\", \"presence_penalty\": 9}\n",
    );
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["text"], text(&penalised.stdout));
    assert!(lines[1]["error"]
        .as_str()
        .unwrap()
        .contains("presence_penalty"));
}

/// `--n K`: K completions of one prompt as JSON lines, each with its own seed (seed + choice),
/// the first the same text a single run with that seed writes, the others taking the prompt's
/// full blocks from the prefix cache; `"n"` per batch line likewise.
#[test]
fn n_completions_share_the_prompts_prefill_and_differ_by_seed() {
    let prompt = "Here is a list of ten colours that painters like to use in their work, \
                  with a short note on each one, starting with the warm colours: ";
    let args = [
        "-p",
        prompt,
        "-n",
        "12",
        "--seed",
        "41",
        "--temperature",
        "0.9",
    ];
    let single = run(&[&args[..], &["-q"]].concat());
    assert!(single.status.success(), "{}", text(&single.stderr));
    let out = run(&[&args[..], &["--n", "3", "--stats", "json"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = common::jsonl(&text(&out.stdout));
    assert_eq!(lines.len(), 3, "{}", text(&out.stdout));
    for (j, l) in lines.iter().enumerate() {
        assert_eq!(l["choice"], j);
        assert_eq!(l["seed"], 41 + j as u64);
        assert_eq!(l["line"], 1);
    }
    assert_eq!(
        lines[0]["text"],
        text(&single.stdout),
        "choice 0 is the single run"
    );
    assert!(
        lines[1]["cached_tokens"].as_u64().unwrap() >= 16,
        "{}",
        lines[1]
    );
    assert!(
        lines[2]["cached_tokens"].as_u64().unwrap() >= 16,
        "{}",
        lines[2]
    );
    let texts: std::collections::BTreeSet<&str> =
        lines.iter().map(|l| l["text"].as_str().unwrap()).collect();
    assert!(texts.len() > 1, "sampled completions differ: {texts:?}");
    let report: serde_json::Value =
        serde_json::from_str(text(&out.stderr).lines().last().unwrap()).unwrap();
    assert_eq!(report["prompts"], 3);

    // Per batch line: "n" with a "seed" gives seed, seed + 1; a line without "n" gives one.
    let mut cmd = gen();
    cmd.arg("--model").arg(smollm2());
    cmd.args(["--batch", "-", "-n", "4", "-q"]);
    let input = "{\"prompt\": \"Hi\", \"n\": 2, \"seed\": 9, \"id\": \"a\"}\n\
                 {\"prompt\": \"Bye\", \"id\": \"b\"}\n\
                 {\"prompt\": \"x\", \"n\": 0}\n";
    let out = common::with_stdin(cmd, input);
    let lines: Vec<serde_json::Value> = common::jsonl(&text(&out.stdout));
    assert_eq!(lines.len(), 4, "{}", text(&out.stdout));
    assert_eq!(
        (lines[0]["id"].as_str(), lines[0]["choice"].as_u64()),
        (Some("a"), Some(0))
    );
    assert_eq!(
        (lines[1]["seed"].as_u64(), lines[1]["choice"].as_u64()),
        (Some(10), Some(1))
    );
    assert_eq!(lines[0]["seed"], 9);
    assert!(lines[2].get("choice").is_none() && lines[2]["id"] == "b");
    assert!(lines[3]["error"]
        .as_str()
        .unwrap()
        .contains("\"n\" must be"));
    assert_eq!(out.status.code(), Some(1), "a line failed");

    // Out of range on the command line: a usage error.
    let bad = run(&["-p", "x", "--n", "0"]);
    assert_eq!(bad.status.code(), Some(2));
    let bad = run(&["--n", "2", "--echo", "-p", "x"]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
}
