//! Structured output on the real default model, through the binary as scripts use it: 50
//! prompts over 10 JSON Schemas (assets/structured/), greedy and sampled, every reply that ends
//! by its grammar checked by an independent validator (the jsonschema crate, formats on);
//! a Lark grammar and regexes checked by the regex crate; batch equal to alone; bad specs
//! refused before the model loads; a reply cut by --max-new reported as such.

mod common;

use std::collections::BTreeMap;
use std::process::Output;

use common::{gen, one_error_line, smollm2, text};
use serde_json::Value;

fn schemas() -> BTreeMap<String, Value> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/assets/structured/schemas.json"
    ))
    .unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The 50 prompts, each with the name of its schema.
fn prompts() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/assets/structured/prompts.jsonl"
    ))
    .unwrap();
    common::jsonl::<Value>(&text)
        .into_iter()
        .map(|r| {
            (
                r["schema"].as_str().unwrap().to_string(),
                r["prompt"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn run_with_stdin(args: &[&str], stdin: &str) -> Output {
    let mut cmd = gen();
    cmd.args(args);
    common::with_stdin(cmd, stdin)
}

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .unwrap_or_else(|e| panic!("the test's schema does not compile: {e}"))
}

/// Run the 50 prompts as one batch; returns each output line with its schema's name.
fn fifty(extra: &[&str]) -> (Vec<(String, Value)>, String) {
    let schemas = schemas();
    let prompts = prompts();
    let input: String = prompts
        .iter()
        .map(|(name, prompt)| {
            let line =
                serde_json::json!({"id": name, "prompt": prompt, "json_schema": schemas[name]});
            format!("{line}\n")
        })
        .collect();
    let model = smollm2();
    let mut args = vec![
        "--model",
        model.to_str().unwrap(),
        "--batch",
        "-",
        "--chat",
        "--max-new",
        "200",
    ];
    args.extend_from_slice(extra);
    let out = run_with_stdin(&args, &input);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<Value> = common::jsonl(&text(&out.stdout));
    assert_eq!(lines.len(), 50);
    let named = lines
        .into_iter()
        .zip(prompts)
        .map(|(l, (name, _))| (name, l))
        .collect();
    (named, text(&out.stderr))
}

/// Every reply that ended by its grammar parses and validates; the others were cut by
/// --max-new and said so on stderr. Returns how many ended by the grammar.
fn check_fifty(lines: &[(String, Value)], stderr: &str) -> usize {
    let schemas = schemas();
    let mut complete = 0;
    for (name, line) in lines {
        let reply = line["text"].as_str().expect("a text");
        match line["stop"].as_str().unwrap() {
            "grammar" => {
                complete += 1;
                let value: Value = serde_json::from_str(reply)
                    .unwrap_or_else(|e| panic!("{name}: {reply:?} does not parse: {e}"));
                let v = validator(&schemas[name]);
                let errors: Vec<String> = v.iter_errors(&value).map(|e| e.to_string()).collect();
                assert!(errors.is_empty(), "{name}: {reply} is invalid: {errors:?}");
            }
            "max-new" => {
                let warning = format!("the reply of line {} is incomplete", line["line"]);
                assert!(stderr.contains(&warning), "{stderr}");
            }
            other => panic!("{name}: stop {other}: {line}"),
        }
    }
    complete
}

#[test]
fn fifty_prompts_over_ten_schemas_validate_greedy_and_sampled() {
    let (greedy, stderr) = fifty(&["--temperature", "0"]);
    let complete = check_fifty(&greedy, &stderr);
    assert_eq!(
        complete, 50,
        "greedy: every reply ends by its grammar within 200 tokens"
    );
    // The report counts one mask per generated token.
    let generated: u64 = greedy
        .iter()
        .map(|(_, l)| l["tokens"].as_u64().unwrap())
        .sum();
    assert!(
        stderr.contains(&format!("grammar        json-schema: {generated} masks")),
        "{stderr}"
    );

    let (sampled, stderr) = fifty(&["--temperature", "0.9", "--seed", "11"]);
    let complete = check_fifty(&sampled, &stderr);
    assert!(
        complete >= 45,
        "sampled: only {complete} of 50 ended by the grammar"
    );
    let differ = greedy
        .iter()
        .zip(&sampled)
        .filter(|((_, a), (_, b))| a["text"] != b["text"])
        .count();
    assert!(differ >= 10, "sampling changed only {differ} replies");
}

fn single(model: &str, prompt: &str, args: &[&str]) -> Output {
    let mut all = vec![
        "--model",
        model,
        "--prompt",
        prompt,
        "--chat",
        "--temperature",
        "0",
    ];
    all.extend_from_slice(args);
    gen().args(&all).output().unwrap()
}

#[test]
fn greedy_with_a_schema_in_a_batch_equals_the_prompt_alone() {
    let schemas = schemas();
    let model = smollm2();
    let model = model.to_str().unwrap();
    let picked = [
        ("book", "Recommend a book about the Roman empire."),
        ("segment", "Pick two random points."),
        ("person", "Who are you? Answer in JSON."),
    ];
    let input: String = picked
        .iter()
        .map(|(name, p)| {
            format!(
                "{}\n",
                serde_json::json!({"prompt": p, "json_schema": schemas[*name]})
            )
        })
        .chain(std::iter::once(
            "{\"prompt\": \"Say hello.\"}\n".to_string(),
        ))
        .collect();
    let out = run_with_stdin(
        &[
            "--model",
            model,
            "--batch",
            "-",
            "--chat",
            "--temperature",
            "0",
            "-n",
            "120",
        ],
        &input,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<Value> = common::jsonl(&text(&out.stdout));
    for ((name, prompt), line) in picked.iter().zip(&lines) {
        let schema = schemas[*name].to_string();
        let alone = single(
            model,
            prompt,
            &["-n", "120", "--json-schema", &schema, "-q"],
        );
        assert!(alone.status.success(), "{}", text(&alone.stderr));
        assert_eq!(
            text(&alone.stdout),
            line["text"].as_str().unwrap(),
            "{name}"
        );
        assert_eq!(line["stop"], "grammar");
    }
    assert_ne!(
        lines[3]["stop"], "grammar",
        "the unconstrained line has no grammar"
    );
}

#[test]
fn a_lark_grammar_and_regexes_hold_whatever_the_model_wants() {
    let model = smollm2();
    let model = model.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("gen-structured-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let grammar = dir.join("greeting.lark");
    std::fs::write(
        &grammar,
        "start: greeting \" \" name \"!\" (\" \" mood)?\n\
         greeting: \"Hello\" | \"Hi\" | \"Goodbye\"\n\
         name: /[A-Z][a-z]{1,10}/\n\
         mood: \"I am \" (\"happy\" | \"sad\") \".\"\n",
    )
    .unwrap();
    let shape =
        regex::Regex::new(r"^(Hello|Hi|Goodbye) [A-Z][a-z]{1,10}!( I am (happy|sad)\.)?$").unwrap();
    for (prompt, temp) in [
        ("Greet Bob.", "0"),
        ("Write a long essay about the sea.", "0"),
        ("Say bye to Anna.", "1.0"),
    ] {
        let out = single(
            model,
            prompt,
            &[
                "-n",
                "40",
                "--grammar",
                grammar.to_str().unwrap(),
                "--temperature",
                temp,
                "--seed",
                "5",
            ],
        );
        assert!(out.status.success(), "{}", text(&out.stderr));
        let reply = text(&out.stdout);
        let reply = reply.trim_end_matches('\n');
        assert!(shape.is_match(reply), "{prompt}: {reply:?}");
    }

    // The first two cannot go on once matched (stop: grammar); the third can (its last word
    // may grow), so it ends where the model puts an end-of-sequence the grammar allows.
    for (rx, prompt, stop) in [
        (r"(yes|no)", "Is the sky blue? Answer yes or no.", "grammar"),
        (r"[0-9]{3}-[0-9]{4}", "Write a poem.", "grammar"),
        (
            r"[a-z]+(, [a-z]+){2}",
            "Name three animals, comma separated.",
            "eos",
        ),
    ] {
        let out = single(model, prompt, &["-n", "40", "--regex", rx]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let whole = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
        let reply = text(&out.stdout);
        assert!(whole.is_match(&reply), "{rx}: {reply:?}");
        let err = text(&out.stderr);
        assert!(err.contains(&format!("stop: {stop}\n")), "{err}");
    }

    // Told not to write JSON, the model still does under --json, and --json=any parses too.
    for flag in ["--json", "--json=any"] {
        let out = single(
            model,
            "Do not write JSON. Write a poem about the sea.",
            &["-n", "150", flag],
        );
        let reply = text(&out.stdout);
        let err = text(&out.stderr);
        // A reply the grammar ended succeeds; one --max-new cut fails (exit 1), saying so.
        let ended = err.contains("stop: grammar");
        assert_eq!(out.status.code(), Some(if ended { 0 } else { 1 }), "{err}");
        if ended {
            let v: Value =
                serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{reply:?}: {e}"));
            if flag == "--json" {
                assert!(v.is_object(), "{reply}");
            }
        } else {
            assert!(err.contains("incomplete by its grammar"), "{err}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_specs_fail_in_one_line_before_the_model_loads() {
    // The model does not exist: an error about the spec proves it was checked first.
    let model = "/nonexistent/model.gguf";
    let dir = std::env::temp_dir().join(format!("gen-bad-specs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad_grammar = dir.join("bad.lark");
    std::fs::write(&bad_grammar, "start: item+\n").unwrap();
    let bad_schema = dir.join("bad.json");
    std::fs::write(&bad_schema, "{\"type\": \"object\",").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--json-schema".into(), r#"{"type": "strnig"}"#.into()],
            "--json-schema: ",
        ),
        (
            vec!["--json-schema".into(), bad_schema.display().to_string()],
            "not valid JSON",
        ),
        (
            vec!["--json-schema".into(), "/no/such/schema.json".into()],
            "cannot read",
        ),
        (
            vec![
                "--json-schema".into(),
                r##"{"$ref": "#/$defs/nope"}"##.into(),
            ],
            "--json-schema: ",
        ),
        (
            vec!["--grammar".into(), bad_grammar.display().to_string()],
            "--grammar ",
        ),
        (
            vec!["--grammar".into(), "/no/such/grammar.lark".into()],
            "cannot read",
        ),
        (vec!["--regex".into(), "(unclosed".into()], "--regex: "),
    ];
    for (args, expect) in cases {
        let mut all = vec!["--model", model, "--prompt", "hi"];
        all.extend(args.iter().map(String::as_str));
        let out = gen().args(&all).output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
        let line = one_error_line(&out);
        assert!(line.contains(expect), "{args:?}: {line}");
        assert!(
            !line.contains("nonexistent"),
            "the model was looked at first: {line}"
        );
    }
    // Two constraints at once is a usage error too.
    let out = gen()
        .args(["--model", model, "--prompt", "hi", "--json", "--regex", "a"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_reply_cut_by_max_new_says_so_and_the_report_has_the_mask_cost() {
    let model = smollm2();
    let model = model.to_str().unwrap();
    let schema = schemas()["book"].to_string();
    let out = single(
        model,
        "Describe the book Pride and Prejudice as JSON.",
        &["-n", "6", "--json-schema", &schema, "--stats", "json"],
    );
    // A cut reply is a failed run: exit 1, the last line saying why.
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("is incomplete by its grammar (--max-new came first; stop: max-new)"),
        "{err}"
    );
    let mut lines = err.lines().rev();
    assert!(
        lines
            .next()
            .unwrap()
            .contains("did not complete its grammar"),
        "{err}"
    );
    let report: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(report["complete"], false);
    assert_eq!(report["stop_reason"], "max-new");
    assert_eq!(report["generated_tokens"], 6);
    assert_eq!(report["constraint"]["kind"], "json-schema");
    assert_eq!(report["constraint"]["masks"], 6);
    assert!(report["constraint"]["mask_ms"].as_f64().unwrap() > 0.0);
    // What it wrote is the start of valid JSON, cut: not silently something else.
    assert!(
        text(&out.stdout).starts_with("{\"book\": {"),
        "{}",
        text(&out.stdout)
    );
}
