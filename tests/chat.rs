//! `gen chat` on the real default model: driven over standard input (one turn per line), and
//! on a real pseudo-terminal (tmux, a terminal emulator, so the line editor meets what it meets
//! on a user's screen: cursor queries answered, Ctrl-C as a signal, Ctrl-D as end of input).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn temp(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gen-chat-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `gen chat` fed `input` on a pipe; (stdout, stderr, success).
fn scripted(args: &[&str], input: &str) -> (String, String, bool) {
    let mut cmd = common::gen();
    cmd.arg("chat")
        .arg("--model")
        .arg(common::smollm2())
        .args(["--temperature", "0"])
        .args(args);
    let out = common::with_stdin(cmd, input);
    (
        common::text(&out.stdout),
        common::text(&out.stderr),
        out.status.success(),
    )
}

/// Run `cmd` with `input` on its standard input; its output.
/// (prefilled, reused) of each status line.
fn turns(stderr: &str) -> Vec<(usize, usize)> {
    stderr
        .lines()
        .filter_map(|l| {
            let (p, rest) = l.split_once(" tokens prefilled, ")?;
            let (r, _) = rest.split_once(" reused")?;
            Some((p.parse().ok()?, r.parse().ok()?))
        })
        .collect()
}

fn messages(path: &Path) -> Vec<(String, String)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_string(),
                m["content"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The second turn prefills only what the first did not leave in the cache, and its greedy
/// reply is the one a fresh run over the whole conversation gives.
#[test]
fn turns_reuse_the_cache_and_reply_as_a_fresh_run_would() {
    let dir = temp("reuse");
    let saved = dir.join("conv.json");
    let input = format!(
        "Name three colours.\nNow name three animals.\n/save {}\n",
        saved.display()
    );
    let (stdout, stderr, ok) = scripted(&["--max-new", "24"], &input);
    assert!(ok, "{stderr}");
    let t = turns(&stderr);
    assert_eq!(t.len(), 2, "{stderr}");
    assert_eq!(t[0].1, 0, "nothing to reuse in the first turn");
    // The first turn's prompt stays in the prefix cache, in whole blocks of 16 tokens; the
    // second prefills the rest only (the reply, the new message, the first prompt's partly
    // filled last block).
    assert_eq!(t[1].1, t[0].0 / 16 * 16, "{stderr}");
    assert!(t[1].1 > 0, "{stderr}");
    assert!(t[1].0 > 0 && t[1].0 < t[0].0 + 24 + 20, "{stderr}");
    let conv = messages(&saved);
    assert_eq!(conv.len(), 4);
    assert_eq!(conv[2], ("user".into(), "Now name three animals.".into()));
    // Replies on stdout, each followed by a blank line.
    assert_eq!(stdout, format!("{}\n\n{}\n\n", conv[1].1, conv[3].1));

    // The same conversation, fresh: one-shot --chat over its first three messages.
    let first3 = dir.join("first3.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    std::fs::write(
        &first3,
        serde_json::to_string(&v.as_array().unwrap()[..3]).unwrap(),
    )
    .unwrap();
    let out = common::gen()
        .arg("--model")
        .arg(common::smollm2())
        .args([
            "--chat",
            "--temperature",
            "0",
            "--max-new",
            "24",
            "-q",
            "--messages",
        ])
        .arg(&first3)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    assert_eq!(common::text(&out.stdout), conv[3].1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn undo_save_and_messages_round_trip() {
    let dir = temp("undo");
    let (a, b) = (dir.join("a.json"), dir.join("b.json"));
    let input = format!(
        "Hello.\nTell me a joke.\n/undo\n/system Be brief.\n/save {}\n",
        a.display()
    );
    let (_, stderr, ok) = scripted(&["--max-new", "8"], &input);
    assert!(ok, "{stderr}");
    let conv = messages(&a);
    assert_eq!(conv.len(), 3, "{conv:?}");
    assert_eq!(conv[0], ("system".into(), "Be brief.".into()));
    assert_eq!(conv[1], ("user".into(), "Hello.".into()));
    // Started from the file, saved again at once: the same conversation.
    let (_, stderr, ok) = scripted(
        &["--messages", a.to_str().unwrap()],
        &format!("/save {}\n", b.display()),
    );
    assert!(ok, "{stderr}");
    assert_eq!(messages(&b), conv);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_conversation_files_are_one_line_and_a_failure() {
    let dir = temp("bad");
    for (name, text, want) in [
        ("notjson.json", "hello", "not a JSON array"),
        ("empty.json", "[]", "holds no messages"),
        (
            "role.json",
            r#"[{"role": "robot", "content": "x"}]"#,
            "role \"robot\"",
        ),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        for chat in [true, false] {
            let mut cmd = common::gen();
            if chat {
                cmd.arg("chat");
            } else {
                cmd.args(["--chat"]);
            }
            let out = cmd
                .arg("--model")
                .arg(common::smollm2())
                .arg("--messages")
                .arg(&path)
                .stdin(Stdio::null())
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(1), "{name}");
            let line = common::one_error_line(&out);
            assert!(line.contains(want), "{name}: {line}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// tmux on a server of this test binary's own (not the user's, if one runs).
fn tmux() -> Command {
    let mut c = Command::new("tmux");
    c.args(["-L", &format!("gen-tests-{}", std::process::id())]);
    c
}

/// A tmux session running one command on a 100x40 terminal.
struct Tmux {
    name: String,
}

impl Tmux {
    fn start(tag: &str, command: &str) -> Self {
        // Sessions start one at a time: two `new-session`s racing to start the tmux server can
        // fail to connect to it.
        static START: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = START.lock().unwrap_or_else(|e| e.into_inner());
        let name = format!("gen-chat-{tag}-{}", std::process::id());
        let size = ["-x", "100", "-y", "40"];
        for attempt in 0.. {
            let out = tmux()
                .args(["new-session", "-d"])
                .args(size)
                .args(["-s", &name, command])
                .output()
                .expect("tmux (the chat tests run gen on a real terminal through it)");
            if out.status.success() {
                break;
            }
            assert!(
                attempt < 5,
                "tmux new-session: {}",
                common::text(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        Tmux { name }
    }

    fn screen(&self) -> String {
        let out = tmux()
            .args(["capture-pane", "-p", "-J", "-S", "-200", "-t", &self.name])
            .output()
            .unwrap();
        common::text(&out.stdout)
    }

    fn keys(&self, keys: &[&str]) {
        let status = tmux()
            .args(["send-keys", "-t", &self.name])
            .args(keys)
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Wait until the screen satisfies `ok`; panics with the screen after `secs`.
    fn wait(&self, secs: u64, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(
                start.elapsed() < Duration::from_secs(secs),
                "waited {secs} s for {what}; the screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = tmux().args(["kill-session", "-t", &self.name]).status();
    }
}

fn chat_command(dir: &Path, extra: &str) -> String {
    format!(
        "NO_COLOR=1 GEN_CHAT_HISTORY={} {} chat --model {} --temperature 0 {extra}; echo \"exit=$?\" > {}; sleep 30",
        dir.join("history").display(),
        env!("CARGO_BIN_EXE_gen"),
        common::smollm2().display(),
        dir.join("status").display(),
    )
}

fn exit_status(dir: &Path) -> String {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(dir.join("status")) {
            return s.trim().to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "gen chat did not exit"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Two turns typed, the second stopped by Ctrl-C mid-reply, a third that works, /undo and
/// /save, then Ctrl-D: exit 0, history written.
#[test]
fn a_terminal_chat_with_ctrl_c_mid_reply_and_ctrl_d() {
    let dir = temp("tty");
    let saved = dir.join("saved.json");
    let t = Tmux::start("tty", &chat_command(&dir, "--max-new 600 --ignore-eos"));
    let count = |s: &str| s.matches(" tokens prefilled, ").count();
    t.wait(60, "the prompt", |s| {
        s.contains("chatting with") && s.contains("> ")
    });
    t.keys(&["Name three colours.", "Enter"]);
    // 600 tokens take seconds: stop the reply once it has begun.
    t.wait(60, "the reply to begin", |s| {
        s.lines()
            .skip_while(|l| !l.contains("Name three colours."))
            .nth(1)
            .is_some_and(|l| !l.trim().is_empty())
    });
    t.keys(&["C-c"]);
    t.wait(60, "the interrupted reply's status", |s| {
        count(s) == 1 && s.contains("stop: interrupted")
    });
    t.keys(&["/set max_new 8", "Enter"]);
    t.wait(10, "/set", |s| s.contains("max_new = 8"));
    t.keys(&["Thanks.", "Enter"]);
    let screen = t.wait(60, "the second reply", |s| count(s) == 2);
    assert!(screen.contains("stop: max-new"), "{screen}");
    t.keys(&["/undo", "Enter"]);
    t.wait(10, "/undo", |s| s.contains("dropped the last exchange"));
    t.keys(&[&format!("/save {}", saved.display()), "Enter"]);
    t.wait(10, "/save", |s| s.contains("saved to"));
    t.keys(&["C-d"]);
    assert_eq!(exit_status(&dir), "exit=0", "{}", t.screen());
    let conv = messages(&saved);
    assert_eq!(conv.len(), 2, "{conv:?}");
    assert_eq!(conv[0].1, "Name three colours.");
    assert!(
        !conv[1].1.is_empty(),
        "the partial reply stays in the conversation"
    );
    let history = std::fs::read_to_string(dir.join("history")).unwrap();
    assert!(
        history.contains("Name three colours.") && history.contains("Thanks."),
        "{history}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ctrl_c_on_an_empty_line_ends_the_chat_and_on_a_typed_one_clears_it() {
    let dir = temp("ctrlc");
    let t = Tmux::start("ctrlc", &chat_command(&dir, "--max-new 4"));
    t.wait(60, "the prompt", |s| {
        s.contains("chatting with") && s.contains("> ")
    });
    t.keys(&["half a line"]);
    t.wait(10, "the typed text", |s| s.contains("half a line"));
    t.keys(&["C-c"]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !dir.join("status").exists(),
        "Ctrl-C on a typed line must not end the chat"
    );
    t.keys(&["C-c"]);
    assert_eq!(exit_status(&dir), "exit=0", "{}", t.screen());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dry_run_prints_what_the_model_sees_and_chat_template_replaces_the_models() {
    let run = |args: &[&str]| {
        common::gen()
            .arg("--model")
            .arg(common::smollm2())
            .args(["--chat", "--prompt", "Hi"])
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--system", "Be brief.", "--dry-run"]);
    assert!(out.status.success());
    assert_eq!(
        common::text(&out.stdout),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert!(common::text(&out.stderr).trim_end().ends_with(" tokens"));
    let dir = temp("template");
    let own = dir.join("own.jinja");
    std::fs::write(&own, "{{ 'Q: ' + messages[-1]['content'] + '\\nA:' }}").unwrap();
    let out = run(&["--chat-template", own.to_str().unwrap(), "--dry-run"]);
    assert_eq!(common::text(&out.stdout), "Q: Hi\nA:");
    let bad = dir.join("bad.jinja");
    std::fs::write(&bad, "{% for %}").unwrap();
    let out = run(&["--chat-template", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(common::one_error_line(&out).contains("bad.jinja"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A --batch line may carry "messages" instead of "prompt": the same reply as one-shot
/// --chat --messages over that conversation.
#[test]
fn batch_lines_may_carry_a_conversation() {
    let dir = temp("batch");
    let conv = r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]"#;
    let file = dir.join("conv.json");
    std::fs::write(&file, conv).unwrap();
    let input = format!(
        "{{\"id\": 1, \"messages\": {conv}}}\n{{\"id\": 2, \"messages\": [], \"x\": 1}}\n{{\"id\": 3, \"prompt\": \"a\", \"messages\": {conv}}}\n"
    );
    let mut cmd = common::gen();
    cmd.arg("--model").arg(common::smollm2()).args([
        "--batch",
        "-",
        "--temperature",
        "0",
        "--max-new",
        "12",
        "-q",
    ]);
    let out = common::with_stdin(cmd, &input);
    let lines: Vec<serde_json::Value> = common::text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert!(
        lines[1]["error"].as_str().unwrap().contains("no messages"),
        "{}",
        lines[1]
    );
    assert!(
        lines[2]["error"].as_str().unwrap().contains("not both"),
        "{}",
        lines[2]
    );
    let one = common::gen()
        .arg("--model")
        .arg(common::smollm2())
        .args([
            "--chat",
            "--temperature",
            "0",
            "--max-new",
            "12",
            "-q",
            "--messages",
        ])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(
        lines[0]["text"].as_str().unwrap(),
        common::text(&one.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A conversation longer than the window: the oldest exchanges go, with a line saying so, and
/// the chat goes on.
#[test]
fn a_conversation_over_the_window_drops_its_oldest_exchanges() {
    let dir = temp("window");
    let saved = dir.join("c.json");
    let turns: String = (0..6)
        .map(|i| format!("Question number {i}: tell me something about the number {i}.\n"))
        .collect();
    let input = format!("{turns}/save {}\n", saved.display());
    let (stdout, stderr, ok) = scripted(
        &[
            "--ctx-size",
            "160",
            "--max-new",
            "24",
            "--system",
            "Be brief.",
        ],
        &input,
    );
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("no longer fit the 160-token window"),
        "{stderr}"
    );
    assert_eq!(turns_of(&stdout), 6, "{stdout}");
    let conv = messages(&saved);
    assert_eq!(conv[0], ("system".into(), "Be brief.".into()));
    assert!(conv.len() < 13, "older exchanges were dropped: {conv:?}");
    assert_eq!(
        conv[conv.len() - 2].1,
        "Question number 5: tell me something about the number 5."
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn turns_of(stdout: &str) -> usize {
    stdout.matches("\n\n").count()
}

/// The terminal goes away (SIGHUP) in the middle of a reply: gen ends, and nothing it wrote to
/// the terminal before the end (tmux logs the pane to a file) is a panic.
#[test]
fn a_terminal_that_goes_away_ends_the_chat_without_a_panic() {
    let dir = temp("hup");
    let log = dir.join("pane.log");
    let history = dir.join("history");
    let pid_file = dir.join("pid");
    // The shell writes its pid and becomes gen (exec), so the file holds gen's pid.
    let cmd = format!(
        "echo $$ > {}; exec env NO_COLOR=1 GEN_CHAT_HISTORY={} {} chat --model {} --temperature 0 --max-new 2000 --ignore-eos",
        pid_file.display(),
        history.display(),
        env!("CARGO_BIN_EXE_gen"),
        common::smollm2().display(),
    );
    let t = Tmux::start("hup", &cmd);
    let status = tmux()
        .args(["pipe-pane", "-t", &t.name, "-o"])
        .arg(format!("cat >> {}", log.display()))
        .status()
        .unwrap();
    assert!(status.success());
    t.wait(60, "the prompt", |s| s.contains("> "));
    t.keys(&["Tell me a long story.", "Enter"]);
    t.wait(60, "the reply to begin", |s| {
        s.lines()
            .skip_while(|l| !l.contains("Tell me a long story."))
            .nth(1)
            .is_some_and(|l| !l.trim().is_empty())
    });
    drop(t); // kill-session: the pane's processes get SIGHUP
    let start = Instant::now();
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let running = || Path::new(&format!("/proc/{pid}")).exists();
    while running() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "gen chat outlived its terminal"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("Tell me a long story."),
        "the pane was logged: {text}"
    );
    assert!(!text.contains("panicked"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A thinking model's template on a real terminal: the thinking shows (NO_COLOR: plain), the
/// answer follows it, and the conversation saved holds the answer alone.
#[test]
fn a_terminal_chat_shows_the_thinking_and_keeps_only_the_answer() {
    let dir = temp("think");
    let saved = dir.join("saved.json");
    let template = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("assets/chat-templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja");
    let extra = format!(
        "--max-new 12 --chat-template {} --reasoning on --reasoning-budget 4",
        template.display()
    );
    let t = Tmux::start("think", &chat_command(&dir, &extra));
    t.wait(60, "the prompt", |s| {
        s.contains("chatting with") && s.contains("> ")
    });
    t.keys(&["What is 2 + 2?", "Enter"]);
    let screen = t.wait(60, "the reply", |s| s.contains(" tokens prefilled, "));
    t.keys(&[&format!("/save {}", saved.display()), "Enter"]);
    t.wait(10, "/save", |s| s.contains("saved to"));
    t.keys(&["C-d"]);
    assert_eq!(exit_status(&dir), "exit=0", "{}", t.screen());
    let conv = messages(&saved);
    let reply = &conv[1].1;
    // The one-shot run of the same turn: its thinking is on the screen before the answer.
    let out = common::gen()
        .arg("--model")
        .arg(common::smollm2())
        .arg("--chat-template")
        .arg(&template)
        .args(["--chat", "--prompt", "What is 2 + 2?", "--temperature", "0"])
        .args([
            "--max-new",
            "12",
            "--reasoning",
            "on",
            "--reasoning-budget",
            "4",
        ])
        .args(["--stats", "json"])
        .output()
        .unwrap();
    let stats: serde_json::Value =
        serde_json::from_str(common::text(&out.stderr).lines().last().unwrap()).unwrap();
    let thinking = stats["reasoning"].as_str().unwrap().trim();
    assert_eq!(
        *reply,
        common::text(&out.stdout),
        "the answer alone is kept"
    );
    let after_prompt = screen
        .split_once("What is 2 + 2?")
        .map_or("", |(_, rest)| rest);
    let at_thinking = after_prompt.find(thinking).expect("the thinking on screen");
    let at_answer = after_prompt[at_thinking + thinking.len()..].find(reply.trim());
    assert!(
        at_answer.is_some(),
        "the answer after the thinking:\n{screen}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
