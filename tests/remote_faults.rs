//! `--endpoint` against what a real server will not do on demand: a loopback stub that answers
//! 429 with Retry-After, cuts a stream mid-event, sends an event that is not JSON, or hangs.
//! Each fault must affect only its own item. (The real server, llama.cpp's llama-server, is in
//! tests/remote.rs.)

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{gen, text, with_stdin};
use serde_json::Value;

/// How often each prompt was asked for.
type Seen = Arc<Mutex<HashMap<String, usize>>>;

fn read_request(stream: &mut TcpStream) -> Option<(String, Value)> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut first = String::new();
    reader.read_line(&mut first).ok()?;
    let path = first.split_whitespace().nth(1)?.to_string();
    let mut len = 0;
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).ok()?;
        if h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0; len];
    reader.read_exact(&mut body).ok()?;
    Some((path, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

fn event(text: &str, finish: Option<&str>) -> String {
    let e = serde_json::json!({"choices": [{"index": 0, "text": text, "finish_reason": finish}]});
    format!("data: {e}\n\n")
}

fn stream_head() -> &'static str {
    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
}

/// `status` may carry extra header lines after it.
fn json_reply(stream: &mut TcpStream, status: &str, body: &str) {
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// Answer one connection as the prompt asks.
fn serve(mut stream: TcpStream, seen: &Seen) {
    let Some((path, body)) = read_request(&mut stream) else {
        return;
    };
    if path.ends_with("/models") {
        let b = r#"{"object":"list","data":[{"id":"stub-model","object":"model"}]}"#;
        return json_reply(&mut stream, "200 OK", b);
    }
    let prompt = body["prompt"].as_str().unwrap_or("").to_string();
    let n = {
        let mut s = seen.lock().unwrap();
        let c = s.entry(prompt.clone()).or_default();
        *c += 1;
        *c
    };
    let ok = |stream: &mut TcpStream| {
        let _ = stream.write_all(stream_head().as_bytes());
        let _ = stream.write_all(event(&format!("reply to {prompt}"), None).as_bytes());
        let usage = r#"data: {"choices":[{"index":0,"text":"","finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        let _ = write!(stream, "{usage}\n\ndata: [DONE]\n\n");
    };
    match prompt.as_str() {
        "rate" if n == 1 => json_reply(
            &mut stream,
            "429 Too Many Requests\r\nRetry-After: 1",
            r#"{"error":{"message":"slow down now"}}"#,
        ),
        "cut" if n == 1 => {
            let _ = stream.write_all(stream_head().as_bytes());
            let _ = stream.write_all(event("half a ", None).as_bytes());
            let _ = stream.write_all(b"data: {\"choices\": [{\"te");
        }
        "garbled" => {
            let _ = stream.write_all(stream_head().as_bytes());
            let _ = stream.write_all(b"data: {this is not json}\n\n");
        }
        "hang" => std::thread::sleep(Duration::from_secs(30)),
        "slow" => {
            let _ = stream.write_all(stream_head().as_bytes());
            for i in 0..50 {
                if stream
                    .write_all(event(&format!("{i} "), None).as_bytes())
                    .is_err()
                {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = stream.write_all(b"data: [DONE]\n\n");
        }
        "bad-request" => json_reply(
            &mut stream,
            "400 Bad Request",
            r#"{"error":{"message":"no such model x"}}"#,
        ),
        _ => ok(&mut stream),
    }
}

fn stub() -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let seen: Seen = Arc::default();
    let s = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let s = s.clone();
            std::thread::spawn(move || serve(stream, &s));
        }
    });
    (url, seen)
}

#[test]
fn each_fault_affects_only_its_own_item() {
    let (url, seen) = stub();
    let prompts = [
        "a",
        "rate",
        "b",
        "cut",
        "garbled",
        "hang",
        "bad-request",
        "c",
    ];
    let input: String = prompts.iter().map(|p| format!("{p}\n")).collect();
    let mut cmd = gen();
    cmd.args(["--endpoint", &url, "--batch", "-", "--concurrency", "3"]);
    cmd.args(["--timeout", "2", "--retries", "2", "--temperature", "0"]);
    let started = Instant::now();
    let out = with_stdin(cmd, &input);
    let took = started.elapsed();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let lines: Vec<Value> = common::jsonl(&text(&out.stdout));
    assert_eq!(lines.len(), prompts.len(), "{err}");
    for (i, (line, prompt)) in lines.iter().zip(prompts).enumerate() {
        assert_eq!(line["index"], i);
        match prompt {
            "garbled" | "hang" | "bad-request" => {
                assert!(line["error"].is_string(), "{prompt}: {line}");
                assert!(line.get("text").is_none());
            }
            _ => {
                assert_eq!(
                    line["text"],
                    format!("reply to {prompt}"),
                    "{prompt}: {line}"
                );
                assert_eq!(
                    (line["tokens"].clone(), line["stop"].clone()),
                    (4.into(), "eos".into())
                );
            }
        }
    }
    let msg = |i: usize| lines[i]["error"].as_str().unwrap().to_string();
    assert!(msg(4).contains("not JSON"), "{}", msg(4));
    assert!(
        msg(6).contains("HTTP 400") && msg(6).contains("no such model x"),
        "{}",
        msg(6)
    );
    let seen = seen.lock().unwrap();
    // 429 and the cut stream were retried once and then served; the garbled stream was tried
    // three times (two retries); the 400 was not retried.
    assert_eq!((seen["rate"], seen["cut"], seen["garbled"]), (2, 2, 3));
    assert_eq!((seen["bad-request"], seen["a"]), (1, 1));
    assert_eq!(seen["hang"], 3, "a hung request times out and is retried");
    // The hung item took three 2 s timeouts; the others ran meanwhile on the other workers.
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert!(err.contains("gen: error: 3 of 8 prompts failed"), "{err}");
    assert!(err.contains("retries"), "{err}");
}

#[test]
fn one_prompt_streams_and_the_report_says_what_is_known() {
    let (url, _) = stub();
    let out = gen()
        .args(["--endpoint", &url, "--prompt", "x", "--stats", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "reply to x");
    let report: Value = serde_json::from_str(text(&out.stderr).lines().last().unwrap()).unwrap();
    assert_eq!(
        report["model"], "stub-model",
        "the first model /models lists"
    );
    assert_eq!(report["generated_tokens"], 4);
    assert_eq!(report["prompt_tokens"], 3);
    assert!(
        report["forward_passes"].is_null(),
        "passes happen on the server"
    );
    assert!(report["ttft_s"].as_f64().unwrap() >= 0.0);

    // No server at all: one line, exit 1, after the retries.
    let dead = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    let out = gen()
        .args([
            "--endpoint",
            &format!("http://127.0.0.1:{port}/v1"),
            "--prompt",
            "x",
        ])
        .args(["--retries", "1", "--remote-model", "m"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = common::one_error_line(&out);
    assert!(line.contains("after 2 tries"), "{line}");
}

#[test]
fn ctrl_c_writes_every_line_and_marks_the_unfinished_interrupted() {
    let (url, _) = stub();
    let mut child = gen()
        .args(["--endpoint", &url, "--batch", "-", "--concurrency", "1"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"a\nslow\nb\nc\n").unwrap();
    drop(stdin);
    // Item 0 is done at once; item 1 streams for 5 s: interrupt it midway.
    std::thread::sleep(Duration::from_millis(1500));
    common::sigint(&child);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(130), "{}", text(&out.stderr));
    let lines: Vec<Value> = common::jsonl(&text(&out.stdout));
    assert_eq!(lines.len(), 4, "every item has its line");
    assert_eq!(lines[0]["text"], "reply to a");
    assert_eq!(lines[1]["stop"], "interrupted");
    assert!(
        lines[1]["text"].as_str().unwrap().starts_with("0 1 "),
        "{}",
        lines[1]
    );
    for l in &lines[2..] {
        assert_eq!(l["stop"], "interrupted", "never started: {l}");
    }
}
