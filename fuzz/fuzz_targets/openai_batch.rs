//! `--batch FILE` also reads OpenAI Batch API input files, whose lines other tools write:
//! `{"custom_id", "method", "url", "body": {"prompt" | "messages", "max_tokens", ...}}`.
//! `gen::batch_input::parse` on any such file must give one result per non-blank line, in
//! order and with that line's number, without a panic; a request line it accepts carries its
//! `custom_id` and its body's fields over as gen's own (`max_completion_tokens` over
//! `max_tokens`), and one whose body is not an object or whose url is not a completions
//! endpoint is that line's error.
//!
//! Input layout: the file's bytes, read as `--batch-format auto` reads them (not UTF-8 is
//! refused by the file read before; here it is replaced, so the parser sees every input).
#![no_main]

use gen::batch_input::{parse, BatchFormat};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let got = parse(&text, BatchFormat::Auto);
    let lines: Vec<(usize, &str)> = text
        .split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    assert_eq!(got.len(), lines.len(), "one result per non-blank line");
    let jsonl = lines
        .first()
        .is_some_and(|(_, l)| l.trim_start().starts_with('{'));
    for (result, &(number, line)) in got.iter().zip(&lines) {
        let (at, entry) = match result {
            Ok(e) => (e.line, Some(e)),
            Err(e) => (e.line, None),
        };
        assert_eq!(at, number, "results out of order");
        if !jsonl {
            assert_eq!(entry.map(|e| e.prompt.as_str()), Some(line));
            continue;
        }
        let Ok(Value::Object(request)) = serde_json::from_str::<Value>(line) else {
            assert!(
                result.is_err(),
                "line {number}: not a JSON object, yet a prompt"
            );
            continue;
        };
        let (Some(custom_id), Some(body)) = (request.get("custom_id"), request.get("body")) else {
            continue; // one of gen's own lines
        };
        let Some(body) = body.as_object() else {
            let e = result
                .as_ref()
                .expect_err("a request whose body is not an object");
            assert!(e.message.contains("\"body\""), "{e}");
            continue;
        };
        let Some(e) = entry else {
            continue;
        };
        if let Some(url) = request.get("url").and_then(Value::as_str) {
            assert!(url.ends_with("/completions"), "url {url:?} accepted");
        }
        let field = |k: &str| body.get(k).filter(|v| !v.is_null());
        assert_eq!(e.id.as_ref(), Some(custom_id).filter(|v| !v.is_null()));
        match field("prompt") {
            Some(p) => assert_eq!(p.as_str(), Some(e.prompt.as_str())),
            None => assert!(e.prompt.is_empty() && e.messages.is_some()),
        }
        assert_eq!(e.messages.is_some(), field("messages").is_some());
        let max = field("max_completion_tokens").or(field("max_tokens"));
        assert_eq!(e.max_new.map(|n| n as u64), max.and_then(Value::as_u64));
        assert_eq!(e.temperature, field("temperature").and_then(Value::as_f64));
        assert_eq!(e.seed, field("seed").and_then(Value::as_u64));
        let stop = match field("stop") {
            Some(Value::String(s)) => Some(vec![s.clone()]),
            Some(Value::Array(a)) => Some(
                a.iter()
                    .map(|s| s.as_str().expect("a stop list of strings").to_string())
                    .collect(),
            ),
            Some(other) => panic!("stop {other} accepted"),
            None => None,
        };
        assert_eq!(e.stop, stop);
        assert!(e.constraint.is_none(), "a constraint from a batch request");
    }
});
