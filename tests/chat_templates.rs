//! gen's chat-template renders against Hugging Face transformers' on real templates.
//!
//! `assets/chat-templates/` holds the chat templates that llama.cpp ships (models/templates);
//! `assets/chat-template-renders.jsonl` holds what jinja2, set up as transformers'
//! `apply_chat_template` sets it up, rendered from each for a few conversations (made by
//! `assets/record-chat-templates.py`). Every render must be byte-identical, and where jinja2
//! raised, gen must fail too (with the template's own message where the template raised it).
//! All mismatches are listed, each with where the texts first differ, before the test fails.
//! Templates with a thinking switch are also rendered with `enable_thinking` true and false
//! (`--reasoning on|off`), and with an earlier reply that kept its thinking; templates that
//! mention tools with `tools` offered, an assistant tool call and the tool's result.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gen::chat::{ChatTemplate, LocalTime, Message};
use serde_json::Value;

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets")
}

/// The records of the reference file, one a line.
fn records() -> Vec<Value> {
    let path = assets().join("chat-template-renders.jsonl");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn field<'a>(r: &'a Value, name: &str) -> &'a str {
    r[name]
        .as_str()
        .unwrap_or_else(|| panic!("record without {name}: {r}"))
}

/// "2026-03-14T09:26:53" as the time `strftime_now` reads.
fn parse_now(s: &str) -> LocalTime {
    let n: Vec<u32> = s
        .split(['-', 'T', ':'])
        .map(|p| p.parse().expect("a number"))
        .collect();
    LocalTime {
        year: n[0] as i32,
        month: n[1],
        day: n[2],
        hour: n[3],
        minute: n[4],
        second: n[5],
    }
}

/// Where two texts first differ, with a little of each from there.
fn first_difference(want: &str, got: &str) -> String {
    let at = want
        .char_indices()
        .zip(got.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(want.len().min(got.len()));
    let around = |s: &str| {
        let start = s[..at.min(s.len())]
            .char_indices()
            .rev()
            .nth(20)
            .map_or(0, |(i, _)| i);
        let tail: String = s[start..].chars().take(60).collect();
        format!("{tail:?}")
    };
    format!(
        "byte {at} (lengths {} vs {}): want ...{} got ...{}",
        want.len(),
        got.len(),
        around(want),
        around(got)
    )
}

/// What went wrong with one record, if anything.
fn check(r: &Value) -> Option<String> {
    let name = field(r, "template");
    let source = std::fs::read_to_string(assets().join("chat-templates").join(name))
        .unwrap_or_else(|e| panic!("cannot read template {name}: {e}"));
    let messages: Vec<Message> = serde_json::from_value(r["messages"].clone()).expect("messages");
    let template = ChatTemplate::new(
        source,
        field(r, "bos_token").into(),
        field(r, "eos_token").into(),
    )
    .with_thinking(r.get("enable_thinking").and_then(Value::as_bool))
    .with_tools(r.get("tools").cloned());
    let add = r["add_generation_prompt"]
        .as_bool()
        .expect("add_generation_prompt");
    let got = template.render_at(&messages, add, parse_now(field(r, "now")));
    match (r.get("text").and_then(Value::as_str), got) {
        (Some(want), Ok(got)) if want == got => None,
        (Some(want), Ok(got)) => Some(first_difference(want, &got)),
        (Some(_), Err(e)) => Some(format!("gen failed: {e:#}")),
        (None, Ok(got)) => Some(format!(
            "jinja2 raised {} ({}), gen rendered {} bytes",
            r["error"]["type"],
            r["error"]["message"],
            got.len()
        )),
        (None, Err(e)) => {
            let e = format!("{e:#}");
            let want = field(&r["error"], "message").replace(['\n', '\r'], " ");
            if e.contains('\n') {
                Some(format!("gen's error is not one line: {e:?}"))
            } else if r["error"]["raised"] == true && !e.contains(&want) {
                Some(format!("the template raised {want:?}; gen's error: {e}"))
            } else {
                None
            }
        }
    }
}

/// Renders known to differ, and why: each must still differ (a fix updates this list).
/// jinja2 escapes a plain string added to a `|safe` one (`Markup + str`, HTML escapes
/// included, autoescaping off or not); minijinja concatenates them as they are. Only
/// functionary v3.1's tool list meets this: it writes `"..."|safe + tool|tojson`.
const KNOWN: [(&str, &str); 2] = [
    ("meetkai-functionary-medium-v3.1.jinja", "tools:user"),
    ("meetkai-functionary-medium-v3.1.jinja", "tools:call+result"),
];

#[test]
fn real_templates_render_as_transformers_renders_them() {
    let records = records();
    let mut mismatches = Vec::new();
    let mut templates = BTreeSet::new();
    let (mut texts, mut errors) = (0, 0);
    for r in &records {
        templates.insert(field(r, "template").to_string());
        if r.get("text").is_some() {
            texts += 1;
        } else {
            errors += 1;
        }
        let known = KNOWN.contains(&(field(r, "template"), field(r, "conversation")));
        if known {
            assert!(
                check(r).is_some(),
                "{r}: renders the same now; drop it from KNOWN"
            );
            continue;
        }
        if let Some(what) = check(r) {
            mismatches.push(format!(
                "{} [{}, add_generation_prompt={}, enable_thinking={}]: {what}",
                field(r, "template"),
                field(r, "conversation"),
                r["add_generation_prompt"],
                r.get("enable_thinking").unwrap_or(&Value::Null)
            ));
        }
    }
    let bad_templates: BTreeSet<&str> = mismatches
        .iter()
        .map(|m| m.split(' ').next().unwrap_or(""))
        .collect();
    eprintln!(
        "{} templates, {} renders and {} expected errors; {} mismatches in {} templates",
        templates.len(),
        texts,
        errors,
        mismatches.len(),
        bad_templates.len()
    );
    for m in &mismatches {
        eprintln!("  {m}");
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches, listed above",
        mismatches.len()
    );
}

/// Every template in assets/chat-templates has expected renders: a template added without
/// re-running the recording script fails here.
#[test]
fn every_template_has_expected_renders() {
    let recorded: BTreeSet<String> = records()
        .iter()
        .map(|r| field(r, "template").to_string())
        .collect();
    let dir = assets().join("chat-templates");
    let files: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("assets/chat-templates")
        .map(|e| {
            e.expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".jinja"))
        .collect();
    assert_eq!(files, recorded);
    assert!(files.len() >= 60, "{} templates", files.len());
    let switched = records()
        .iter()
        .filter(|r| r.get("enable_thinking").is_some())
        .count();
    assert!(switched >= 200, "{switched} renders with enable_thinking");
}

#[test]
fn differences_are_located() {
    let d = first_difference("<|user|>\nHi", "<|user|>Hi");
    assert!(d.starts_with("byte 8 (lengths 11 vs 10)"), "{d}");
    assert!(first_difference("abc", "abcd").starts_with("byte 3 "));
}
