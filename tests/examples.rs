//! Every example command in README.md, docs/*.md and `gen --help`'s "Examples:", run as written
//! through a real shell (`bash -c`, in a fresh folder holding the files it names, `gen` on the
//! PATH, the default model), with what the text around it says it does asserted: the output
//! it shows, where it stops, its exit status, the files it writes.
//!
//! The commands are read from the documents themselves: a code block's lines that run `gen`
//! (after a `$ ` prompt, or piped into it), inline `gen ...` code that is a whole command (no
//! `...` or `FILE`-like placeholders), and --help's examples. Each must have its case in
//! [`case`]; a new example without one fails here, and so does a case whose example is gone. An
//! example that cannot run here (a server, the Hugging Face hub) says so on its own line, and
//! that is checked too.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

/// What a command did.
struct Ran {
    code: Option<i32>,
    out: String,
    err: String,
    dir: PathBuf,
}

impl Ran {
    fn ok(&self) -> &Self {
        assert_eq!(self.code, Some(0), "stderr: {}", self.err);
        self
    }

    fn file(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(name))
            .unwrap_or_else(|e| panic!("{name} was not written: {e}; stderr: {}", self.err))
    }

    fn jsonl(&self, text: &str) -> Vec<Value> {
        common::jsonl(text)
    }
}

/// How an example is checked.
enum How {
    /// Run it, with this on standard input, then check what it did.
    Run(Option<&'static str>, fn(&Ran)),
    /// An inline mention of a mode (`gen chat`), not a command line.
    Name,
    /// It cannot run in a test; its line says so with these words.
    NotHere(&'static str),
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).unwrap()
}

/// A placeholder makes inline code a pattern, not a command: `...`, `FILE`, `OUT`, `HEAD`.
fn has_placeholder(s: &str) -> bool {
    s.contains("...")
        || s.split(|c: char| !c.is_ascii_alphanumeric())
            .any(|w| w.len() >= 2 && w.chars().all(|c| c.is_ascii_uppercase()))
}

/// A code block line that runs gen: `gen ...`, `... | gen ...`, `cargo run -- ...`.
fn runs_gen(line: &str) -> bool {
    line == "gen"
        || line.starts_with("gen ")
        || line.contains("| gen ")
        || line.starts_with("cargo run ")
}

/// (where, the line it is on, the command) for every example of a markdown file.
fn from_markdown(name: &str, text: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    // Prose, a paragraph at a time: inline code may run over a line break.
    let mut para: Vec<&str> = Vec::new();
    let inline = |para: &mut Vec<&str>, out: &mut Vec<(String, String, String)>| {
        let joined = para.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ");
        for (i, part) in joined.split('`').enumerate() {
            if i % 2 == 1 && (part == "gen" || part.starts_with("gen ")) && !has_placeholder(part) {
                out.push((name.to_string(), joined.clone(), part.to_string()));
            }
        }
        para.clear();
    };
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            inline(&mut para, &mut out);
            fenced = !fenced;
            continue;
        }
        if fenced {
            let cmd = line.trim().strip_prefix("$ ").unwrap_or(line.trim());
            if runs_gen(cmd) {
                out.push((name.to_string(), line.to_string(), cmd.to_string()));
            }
        } else if line.trim().is_empty() {
            inline(&mut para, &mut out);
        } else {
            para.push(line);
        }
    }
    inline(&mut para, &mut out);
    out
}

fn help_examples() -> Vec<(String, String, String)> {
    let help = Command::new(env!("CARGO_BIN_EXE_gen"))
        .arg("--help")
        .output()
        .unwrap();
    let help = common::text(&help.stdout);
    let at = help.find("Examples:\n").expect("--help has examples");
    help[at..]
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| ("--help".to_string(), l.to_string(), l.trim().to_string()))
        .collect()
}

fn all_examples() -> Vec<(String, String, String)> {
    let mut all = from_markdown("README.md", &readme());
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    for p in docs {
        let name = format!("docs/{}", p.file_name().unwrap().to_string_lossy());
        all.extend(from_markdown(&name, &std::fs::read_to_string(&p).unwrap()));
    }
    all.extend(help_examples());
    all
}

/// The lines of README's block after the line `after` up to the next `$ ` line or the fence.
fn readme_lines_after(after: &str) -> Vec<String> {
    let text = readme();
    let at = text
        .find(after)
        .unwrap_or_else(|| panic!("README shows {after}"));
    text[at + after.len()..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("$ ") && !l.starts_with("```"))
        .map(str::to_string)
        .collect()
}

const CLASSIFY: &str = r#"{"type": "object", "properties": {"label": {"enum": ["positive", "negative"]}}, "required": ["label"], "additionalProperties": false}"#;

/// docs/scores.md's two choice lines.
fn readme_choices() -> String {
    let doc = std::fs::read_to_string(root().join("docs/scores.md")).unwrap();
    let lines: Vec<&str> = doc
        .lines()
        .filter(|l| l.contains("\"continuation\": "))
        .collect();
    assert_eq!(lines.len(), 2, "docs/scores.md shows two choice lines");
    lines.join("\n") + "\n"
}

/// Real English for `gen perplexity`'s examples: the start of docs/internals.md, cut at a
/// character boundary (enough for two windows of 512 tokens).
fn corpus(bytes: usize) -> String {
    let text = std::fs::read_to_string(root().join("docs/internals.md")).unwrap();
    let cut = (0..=bytes.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap();
    text[..cut].to_string()
}

/// The folder an example runs in: the files examples name, the default model where they name a
/// model file of their own.
fn workdir(cmd: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("examples-{}", std::process::id()))
        .join(N.fetch_add(1, Ordering::Relaxed).to_string());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let preamble = "You are a careful assistant for a bicycle shop. Answer questions about opening \
                    hours, repairs and parts in one short sentence, politely, without inventing facts.";
    let long = format!("{preamble} {preamble} {preamble}\nRewrite the text above as a list:");
    let jsonl: Vec<String> = readme_lines_after("$ cat prompts.jsonl");
    let files: Vec<(&str, String)> = vec![
        ("question.txt", "What is the capital of France? Answer in two short paragraphs.".into()),
        ("prompts.txt", "The capital of France is\nOnce upon a time\n".into()),
        ("prompts.jsonl", jsonl.join("\n") + "\n"),
        ("long-instructions.txt", long),
        (
            "questions.jsonl",
            ["When do you open?", "Can you fix a flat tyre?", "Do you sell helmets?"]
                .iter()
                .map(|q| serde_json::json!({"prompt": format!("{preamble}\nQuestion: {q}\nAnswer:")}).to_string() + "\n")
                .collect(),
        ),
        ("greeting.lark", "start: \"Hello, \" NAME \"!\"\nNAME: /[A-Z][a-z]+/\n".into()),
        (
            "rewrite-this.txt",
            "Rewrite this in the past tense: I walk to the shop. I buy bread. I walk home.".into(),
        ),
        (
            "saved.json",
            r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]"#.into(),
        ),
        ("more-turns.txt", "What can you do?\n".into()),
        ("turns.txt", "Hi there, who are you?\nTell me more about you.\n".into()),
        ("label.json", CLASSIFY.into()),
        (
            "requests.jsonl",
            [("q1", "Hi"), ("q2", "Bye")]
                .iter()
                .map(|(id, p)| {
                    let body = serde_json::json!({"model": "m", "prompt": p, "max_tokens": 4});
                    let line = serde_json::json!({"custom_id": id, "method": "POST", "url": "/v1/completions", "body": body});
                    line.to_string() + "\n"
                })
                .collect(),
        ),
        ("wiki.test.raw", corpus(8_000)),
        ("choices.jsonl", readme_choices()),
        ("notes.txt", corpus(9_000)),
        ("list.gbnf", "root ::= item item item\nitem ::= \"- \" [A-Za-z ]{1,30} \"\\n\"\n".into()),
    ];
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    for name in [
        "model.gguf",
        "my-model.gguf",
        "model-f16.gguf",
        "model-q4_k_m.gguf",
    ] {
        std::os::unix::fs::symlink(common::smollm2(), dir.join(name)).unwrap();
    }
    if cmd.contains("./SmolLM2-135M-Instruct/") || cmd.contains("./my-llama/") {
        let hf = common::hf::converted(
            "single-f32",
            common::hf::Layout {
                shards: 1,
                dtype: candle_core::DType::F32,
            },
        );
        for name in ["SmolLM2-135M-Instruct", "my-llama"] {
            std::os::unix::fs::symlink(&hf, dir.join(name)).unwrap();
        }
    }
    dir
}

/// `cmd` through `bash -c` in its folder, `gen` on the PATH.
fn run(cmd: &str, stdin: Option<&str>) -> Ran {
    let dir = workdir(cmd);
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_gen"), bin.join("gen")).unwrap();
    // cargo run -- ARGS: the gen cargo built, with ARGS.
    let cmd = cmd.replace("cargo run --release --", "gen");
    // What the README's pipeline names stand for: something that writes prompts, and
    // something that reads the lines.
    let prelude = "producer() { printf 'Hi\\nBye\\n'; }; consumer() { cat > consumed.jsonl; }";
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new("bash")
        .args(["-c", &format!("{prelude}\n{cmd}")])
        .current_dir(&dir)
        .env("PATH", path)
        .env("RUST_BACKTRACE", "0")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(input) = stdin {
        use std::io::Write;
        let mut w = child.stdin.take().unwrap();
        w.write_all(input.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    Ran {
        code: out.status.code(),
        out: common::text(&out.stdout),
        err: common::text(&out.stderr),
        dir,
    }
}

fn report(r: &Ran) -> Value {
    serde_json::from_str(&r.file("stats.json")).unwrap()
}

fn nonempty(r: &Ran) {
    r.ok();
    assert!(!r.out.trim().is_empty(), "a reply: {}", r.err);
}

fn batch_of_two(r: &Ran) {
    r.ok();
    let lines = r.jsonl(&r.file("replies.jsonl"));
    assert_eq!(lines.len(), 2);
    assert!(lines.iter().all(|l| l["text"].is_string()));
}

fn readme_batch(r: &Ran) {
    // The README shows the lines and the failure: compare what does not depend on timing.
    let shown = readme_lines_after(
        "$ gen --batch prompts.jsonl --max-new 12 --temperature 0 --ctx-size 32 -q",
    );
    let want: Vec<Value> = shown
        .iter()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let got = r.jsonl(&r.out);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        for key in [
            "index",
            "id",
            "line",
            "text",
            "error",
            "prompt_tokens",
            "tokens",
            "stop",
            "passes",
            "seed",
        ] {
            assert_eq!(g.get(key), w.get(key), "{key} of {w}");
        }
    }
    assert_eq!(r.code, Some(1));
    let last = shown.last().unwrap();
    assert_eq!(r.err.trim(), last.as_str());
}

fn first_example(r: &Ran) {
    r.ok();
    let shown = readme_lines_after(
        "$ gen --prompt \"The capital of France is\" --max-new 8 --temperature 0",
    );
    let split = shown.iter().position(|l| l.starts_with("model ")).unwrap();
    assert_eq!(r.out, shown[..split].join("\n"));
    for line in &shown[split..] {
        let head: String = line.chars().take(15).collect();
        assert!(r.err.contains(&head), "the report has {head:?}: {}", r.err);
    }
    assert!(r
        .err
        .contains("tokens         5 prompt, 8 generated, stop: max-new"));
    assert!(r.err.contains("forward passes 8 (1 prefill + 7 decode)"));
}

fn chat_transcript(r: &Ran) {
    // Over a pipe each reply is followed by a blank line; the README's terminal shows the same
    // replies after each "> " turn.
    r.ok();
    let shown = readme_lines_after("$ gen chat --temperature 0 --max-new 20");
    let replies: Vec<&String> = shown
        .iter()
        .enumerate()
        .filter(|(i, _)| *i > 0 && shown[i - 1].starts_with("> "))
        .map(|(_, l)| l)
        .collect();
    let got: Vec<&str> = r.out.split("\n\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(replies.len(), 2);
    assert_eq!(got.len(), 2, "{:?}", r.out);
    for (g, w) in got.iter().zip(replies) {
        assert_eq!(g.trim_end(), w.as_str());
    }
}

fn classified(r: &Ran) {
    r.ok();
    assert_eq!(r.out, r#"{"label": "positive"}"#, "as the README shows");
}

fn json_object(r: &Ran) {
    r.ok();
    let v: Value = serde_json::from_str(&r.out).unwrap_or_else(|e| panic!("{:?}: {e}", r.out));
    assert!(v.is_object());
}

fn yes_or_no(r: &Ran) {
    r.ok();
    assert!(r.out == "yes" || r.out == "no", "{:?}", r.out);
}

fn greeting(r: &Ran) {
    r.ok();
    assert!(
        r.out.starts_with("Hello, ") && r.out.ends_with('!'),
        "{:?}",
        r.out
    );
}

fn three_words(r: &Ran) {
    r.ok();
    let words: Vec<&str> = r.out.split(", ").collect();
    assert_eq!(words.len(), 3, "{:?}", r.out);
    for w in words {
        let mut c = w.chars();
        assert!(
            c.next().is_some_and(|c| c.is_ascii_uppercase()),
            "{:?}",
            r.out
        );
        let rest: Vec<char> = c.collect();
        assert!((1..=11).contains(&rest.len()), "{:?}", r.out);
        assert!(rest.iter().all(|c| c.is_ascii_lowercase()), "{:?}", r.out);
    }
}

fn three_lines(r: &Ran) {
    r.ok();
    let lines: Vec<&str> = r.out.lines().collect();
    assert_eq!(lines.len(), 3, "{:?}", r.out);
    let ok = |l: &&str| l.starts_with("- ") && (3..=32).contains(&l.len());
    assert!(lines.iter().all(ok), "{lines:?}");
}

fn cached_second_run(r: &Ran) {
    // Both README lines in one folder: the first writes instr.kv, the second loads it.
    r.ok();
    assert!(r.dir.join("instr.kv").is_file());
    assert!(
        r.err.contains("from the KV cache"),
        "the second run's report: {}",
        r.err
    );
}

fn shared_preamble(r: &Ran) {
    r.ok();
    let lines = r.jsonl(&r.file("answers.jsonl"));
    assert_eq!(lines.len(), 3);
    let cached: u64 = lines
        .iter()
        .map(|l| l["cached_tokens"].as_u64().unwrap_or(0))
        .sum();
    assert!(
        cached >= 32,
        "the preamble's blocks came from the cache: {lines:?}"
    );
}

fn producer_consumer(r: &Ran) {
    r.ok();
    assert_eq!(r.jsonl(&r.file("consumed.jsonl")).len(), 2);
    assert_eq!(report(r)["prompts"], 2);
}

fn jq_texts(r: &Ran) {
    r.ok();
    assert!(!r.out.contains("{\""), "jq kept the text: {}", r.out);
    assert!(r.out.lines().count() >= 2);
}

fn stats_and_reply(r: &Ran) {
    r.ok();
    assert!(!r.file("reply.txt").is_empty());
    let s = report(r);
    assert!(s["decode_tok_s"].as_f64().unwrap() > 0.0 && s["forward_passes"].as_u64().unwrap() > 0);
    // The README's next line reads it with python3.
    let py = Command::new("python3")
        .args(["-c", r#"import json; s = json.load(open("stats.json")); print(s["decode_tok_s"], s["forward_passes"])"#])
        .current_dir(&r.dir)
        .output()
        .unwrap();
    assert!(py.status.success(), "{}", common::text(&py.stderr));
}

/// `gen perplexity`'s stdout: the figure and its error, nothing else.
fn perplexity_figure(r: &Ran) {
    r.ok();
    let parts: Vec<&str> = r.out.trim_end().split(' ').collect();
    assert_eq!(r.out.lines().count(), 1, "{:?}", r.out);
    assert_eq!(parts.len(), 3, "{:?}", r.out);
    assert_eq!(parts[1], "+/-");
    let ppl: f64 = parts[0].parse().unwrap();
    assert!(ppl > 1.0 && ppl < 1000.0, "{ppl}");
    assert!(parts[2].parse::<f64>().unwrap() > 0.0);
}

/// A `--logprobs 5` run's first token's alternatives, as jq prints them.
fn five_alternatives(r: &Ran) {
    r.ok();
    let v: Value = serde_json::from_str(&r.out).unwrap_or_else(|e| panic!("{e}: {}", r.out));
    let top = v.as_array().unwrap();
    assert_eq!(top.len(), 5, "{}", r.out);
    assert!(top.iter().all(|t| t["logprob"].as_f64().unwrap() <= 0.0));
}

fn speculated(r: &Ran) {
    r.ok();
    assert!(
        r.err.contains("speculat"),
        "the report says what speculation did: {}",
        r.err
    );
}

fn stopped_at_blank_line(r: &Ran) {
    // Sampled with a fresh seed: it may end before any blank line, but never prints one
    // (tests/scripts.rs checks the stop itself, greedy).
    r.ok();
    assert!(!r.out.contains("\n\n"), "{:?}", r.out);
    let stop = report(r)["stop_reason"].as_str().unwrap().to_string();
    assert!(
        ["stop", "eos", "max-new"].contains(&stop.as_str()),
        "{stop}"
    );
}

fn chat_turns(r: &Ran) {
    r.ok();
    assert!(!r.out.trim().is_empty());
}

fn three_choices(r: &Ran) {
    r.ok();
    let lines = r.jsonl(&r.file("three.jsonl"));
    let choices: Vec<u64> = lines
        .iter()
        .map(|l| l["choice"].as_u64().unwrap())
        .collect();
    assert_eq!(choices, [0, 1, 2]);
}

fn models_listed(r: &Ran) {
    r.ok();
    assert!(
        r.out.contains("smollm2-135m") && r.out.contains("downloaded"),
        "{}",
        r.out
    );
}

fn help_text(r: &Ran) {
    r.ok();
    assert!(r.out.contains("Examples:") && r.out.contains("--prompt"));
}

fn chat_help(r: &Ran) {
    r.ok();
    assert!(
        r.out.contains("/set NAME VALUE"),
        "the slash commands: {}",
        r.out
    );
}

fn version(r: &Ran) {
    r.ok();
    assert!(r.out.starts_with("gen "), "{}", r.out);
}

/// The case of each example, by its text as written.
fn case(cmd: &str) -> Option<How> {
    Some(case_of(cmd)?)
}

fn case_of(cmd: &str) -> Option<How> {
    use How::{Name, NotHere, Run};
    Some(match cmd {
        "gen [--prompt TEXT | --prompt-file PATH | < stdin] [options]" => NotHere("gen [--prompt"),
        r#"gen --prompt "The capital of France is" --max-new 8 --temperature 0"# => Run(None, first_example),
        r#"cargo run --release -- --prompt "Once upon a time" --max-new 200"#
        | r#"gen --prompt "The capital of France is""#
        | r#"gen --prompt "Once upon a time" --max-new 200"#
        | r#"gen --model ./my-model.gguf --prompt "Hello""#
        | r#"gen --model ./SmolLM2-135M-Instruct/ --prompt "Hello"           # a local folder (it has a config.json)"#
        | r#"gen --model ./my-llama/ --dtype f16 --prompt "Hello""# => Run(None, nonempty),
        r#"echo "Write a haiku about the sea" | gen --chat"#
        | r#"echo "Write a haiku about rust" | gen --chat --temperature 0.7"#
        | r#"gen --prompt-file question.txt --chat --system "Answer in one sentence.""# => Run(None, nonempty),
        "gen --model ./model.gguf" => Run(Some("Hello"), nonempty),
        "gen --batch prompts.txt  --temperature 0 > replies.jsonl    # one prompt per line" => Run(None, batch_of_two),
        "gen --batch prompts.jsonl --batch-size 16 > replies.jsonl   # JSON Lines, per-prompt settings"
        | "gen --batch prompts.jsonl --temperature 0 > replies.jsonl" => Run(None, |r| {
            r.ok();
            assert_eq!(r.jsonl(&r.file("replies.jsonl")).len(), 4);
        }),
        "producer | gen --batch - --stats-file report.json | consumer" => Run(None, |r| {
            std::fs::copy(r.dir.join("report.json"), r.dir.join("stats.json")).unwrap();
            producer_consumer(r)
        }),
        "gen --batch prompts.jsonl --max-new 12 --temperature 0 --ctx-size 32 -q" => Run(None, readme_batch),
        "gen --prompt-file long-instructions.txt --prompt-cache instr.kv -n 200     # first run: writes instr.kv" => Run(None, |r| {
            r.ok();
            assert!(r.dir.join("instr.kv").is_file());
        }),
        "gen --prompt-file long-instructions.txt --prompt-cache instr.kv -n 200     # second: ~7% of the first token's wait" => Run(None, |r| {
            // Run after the first, in the same folder.
            let again = std::process::Command::new("bash")
                .args(["-c", "PATH=bin:$PATH gen --prompt-file long-instructions.txt --prompt-cache instr.kv -n 200"])
                .current_dir(&r.dir)
                .output()
                .unwrap();
            cached_second_run(&Ran {
                code: again.status.code(),
                out: common::text(&again.stdout),
                err: common::text(&again.stderr),
                dir: r.dir.clone(),
            })
        }),
        "gen --batch questions.jsonl --temperature 0 > answers.jsonl                 # a shared preamble is prefilled once" => Run(None, shared_preamble),
        cmd if cmd.starts_with(r#"gen --chat -p "Is this review positive or negative? I loved this film." --temperature 0 --json-schema"#) => {
            assert!(cmd.ends_with(&format!("'{CLASSIFY}'")), "the schema the test checks");
            Run(None, classified)
        }
        r#"gen --chat -p "Describe a cat as JSON with name, colour and age." --json -t 0    # any JSON object"# => Run(None, |r| {
            json_object(r);
            let shown = readme_lines_after("--json -t 0    # any JSON object");
            assert_eq!(r.out, shown[0], "as the README shows");
        }),
        r#"gen -p "Is water wet? " --regex '(yes|no)'            # the whole reply matches"# => Run(None, yes_or_no),
        r#"gen --chat -p "Greet Bob" --grammar greeting.lark     # a context-free grammar, Lark-like"# => Run(None, greeting),
        r#"gen --chat -p "Name three fruits." --grammar 'root ::= [A-Z][a-z]{1,11} (", " [A-Z][a-z]{1,11}){2}'   # GBNF"# => Run(None, three_words),
        r#"gen --grammar-file list.gbnf --prompt "Three fruits:""# => Run(None, three_lines),
        r#"gen --chat --prompt "Is this review positive or negative? I loved it." --json-schema label.json"# => Run(None, |r| {
            r.ok();
            let v: Value = serde_json::from_str(&r.out).unwrap();
            assert!(v == serde_json::json!({"label": "positive"}) || v == serde_json::json!({"label": "negative"}), "{v}");
        }),
        r#"gen --endpoint http://gpu-box:8000/v1 --prompt "Once upon a time" --max-new 200      # streams to stdout"#
        | "gen --endpoint http://gpu-box:8000/v1 --batch prompts.jsonl --concurrency 32 > replies.jsonl"
        | "gen --endpoint http://gpu-box:8000/v1 --batch prompts.jsonl --resume replies.jsonl >> replies.jsonl" => NotHere("`gpu-box` is your server"),
        "gen --endpoint http://gpu-box:8000/v1 --batch prompts.jsonl > replies.jsonl   # your server" => NotHere("# your server"),
        r#"gen --model TheOrg/Some-GGUF --model-file some.Q4_0.gguf --prompt "Hello"   # from the hub"# => NotHere("# from the hub"),
        r#"gen --model HuggingFaceTB/SmolLM2-135M-Instruct --chat -p "Hi"  # a hub repo without --model-file (the hub: not run by the tests)"# => NotHere("not run by the tests"),
        "gen chat --temperature 0 --max-new 20" => Run(Some("Hi there, who are you?\nTell me more about you.\n"), chat_transcript),
        "gen --batch prompts.txt --quiet --temperature 0 --max-new 60 | jq -r .text" => Run(None, jq_texts),
        r#"gen --prompt "Hello" --max-new 20 --stats-file stats.json >reply.txt"# => Run(None, stats_and_reply),
        r#"gen --prompt "Is the sky green? Answer yes or no:" -n 1 -t 0 --logprobs 5 --stats json 2>&1 >/dev/null | jq '.logprobs[0].top_logprobs'"#
        => Run(None, five_alternatives),
        "gen perplexity wiki.test.raw --ctx-size 512     # stdout: the perplexity and its error, as llama-perplexity computes them"
        | "gen perplexity wiki.test.raw --ctx-size 512 --threads 2" => Run(None, perplexity_figure),
        "gen perplexity notes.txt -m gemma3-270m --stats json -q --stats-file ppl.json" => Run(None, |r| {
            r.ok();
            let v: Value = serde_json::from_str(&r.file("ppl.json")).unwrap();
            assert!(v["perplexity"].as_f64().unwrap() > 1.0, "{v}");
            assert_eq!(v["chunks"], v["chunks_total"]);
            assert!(v["chunks"].as_u64().unwrap() >= 2);
            assert!(r.err.is_empty(), "-q: {}", r.err);
        }),
        r#"gen --prompt "The capital of France is Paris." -n 1 --prompt-logprobs 2 --stats json 2>&1 >/dev/null | jq -c '.prompt_logprobs[1:3]'"# => Run(None, |r| {
            r.ok();
            let v: Value = serde_json::from_str(&r.out).unwrap();
            assert_eq!(v.as_array().unwrap().len(), 2, "{}", r.out);
            assert!(v[0]["logprob"].as_f64().unwrap() < 0.0);
        }),
        r#"gen --batch choices.jsonl -q | jq -r '[.id, .continuation_logprob] | @tsv'   # lines {"prompt", "continuation"}: each choice scored"# => Run(None, |r| {
            r.ok();
            let rows: Vec<Vec<&str>> = r.out.lines().map(|l| l.split('\t').collect()).collect();
            assert_eq!(rows.len(), 2, "{}", r.out);
            for row in rows {
                assert!(row[0].starts_with("q1-"), "{row:?}");
                assert!(row[1].parse::<f64>().unwrap() < 0.0, "{row:?}");
            }
        }),
        r#"gen --batch choices.jsonl -q > scores.jsonl      # lines with "prompt" and "continuation""# => Run(None, |r| {
            r.ok();
            let lines = r.jsonl(&r.file("scores.jsonl"));
            assert_eq!(lines.len(), 2);
            for l in &lines {
                assert_eq!(l["stop"], "scored");
                assert!(l["continuation_logprob"].as_f64().unwrap() < 0.0, "{l}");
            }
        }),
        "gen perplexity wiki.test.raw -m model-f16.gguf --kl-divergence-base f16.kld     # the base run" => Run(None, |r| {
            perplexity_figure(r);
            assert!(r.dir.join("f16.kld").is_file());
        }),
        "gen perplexity -m model-q4_k_m.gguf --kl-divergence-base f16.kld --kl-divergence" => Run(None, |r| {
            // Alone, in a folder without the base run: one line, no figure.
            assert_eq!(r.code, Some(1));
            assert!(r.err.contains("cannot read the base run f16.kld"), "{}", r.err);
            assert!(r.out.is_empty());
            let sh = |cmd: &str| {
                std::process::Command::new("bash")
                    .args(["-c", &format!("PATH=bin:$PATH {cmd}")])
                    .current_dir(&r.dir)
                    .output()
                    .unwrap()
            };
            let base = sh("gen perplexity wiki.test.raw -m model-f16.gguf --kl-divergence-base f16.kld");
            assert!(base.status.success(), "{}", common::text(&base.stderr));
            let again = sh("gen perplexity -m model-q4_k_m.gguf --kl-divergence-base f16.kld --kl-divergence --stats json");
            let (_, _, stats) = common::with_stats(&again);
            let kl = &stats["kl_divergence"];
            // The same file twice: nothing between them but the base file's rounding.
            assert!(kl["mean"].as_f64().unwrap() < 1e-4, "{kl}");
            assert_eq!(kl["same_top"], 1.0);
            let (a, b) = (stats["perplexity"].as_f64().unwrap(), kl["base_perplexity"].as_f64().unwrap());
            assert!((a / b - 1.0).abs() < 1e-3, "{a} {b}");
        }),
        r#"gen --prompt "The capital of France is" -n 5 -t 0 --logprobs 3          # a table on stderr"# => Run(None, |r| {
            r.ok();
            assert!(r.err.contains("logprobs       token"), "{}", r.err);
        }),
        r#"gen --prompt "The capital of France is" -n 5 -t 0 --logprobs 3 --stats json 2>&1 >/dev/null | jq .logprobs"# => Run(None, |r| {
            r.ok();
            let v: Value = serde_json::from_str(&r.out).unwrap();
            assert_eq!(v.as_array().unwrap().len(), 5, "{}", r.out);
            assert_eq!(v[0]["top_logprobs"].as_array().unwrap().len(), 3);
        }),
        "gen --batch prompts.jsonl --logprobs 5 > replies.jsonl                  # a \"logprobs\" list per line" => Run(None, |r| {
            r.ok();
            for l in r.jsonl(&r.file("replies.jsonl")) {
                let lps = l["logprobs"].as_array().unwrap();
                assert_eq!(lps.len() as u64, l["tokens"].as_u64().unwrap(), "{l}");
            }
        }),
        "gen --chat --speculate lookup --prompt-file rewrite-this.txt" => Run(None, speculated),
        "gen --batch prompts.jsonl --speculate lookup --draft-max 6 > replies.jsonl" => Run(None, speculated),
        r#"gen chat --system "Answer briefly.""# => Run(Some("Hi\n"), chat_turns),
        "gen chat --messages saved.json < more-turns.txt" => Run(None, chat_turns),
        "gen chat --temperature 0 < turns.txt > replies.txt" => Run(None, |r| {
            r.ok();
            assert_eq!(r.file("replies.txt").matches("\n\n").count(), 2, "two replies");
        }),
        r#"gen --prompt-file question.txt --stop "\n\n" --stats-file stats.json"# => Run(None, stopped_at_blank_line),
        r#"gen --prompt "Name a colour:" --n 3 --max-new 8 > three.jsonl"# => Run(None, three_choices),
        "gen models" => Run(None, models_listed),
        "gen --model gemma3-270m --prompt Hi --max-new 1" => Run(None, |r| {
            r.ok();
            assert!(r.err.contains("1 generated"), "{}", r.err);
        }),
        "gen --batch requests.jsonl --batch-output openai" => Run(None, |r| {
            r.ok();
            let lines = r.jsonl(&r.out);
            assert_eq!(lines.len(), 2);
            assert_eq!(lines[1]["custom_id"], "q2");
            assert_eq!(lines[1]["response"]["status_code"], 200);
        }),
        "gen --help" | "gen help" => Run(None, help_text),
        "gen chat --help" => Run(None, chat_help),
        "gen --version" => Run(None, version),
        "gen" | "gen chat" | "gen --prompt-file" | "gen --batch" | "gen --endpoint" | "gen perplexity" => Name,
        _ => return None,
    })
}

/// Whether `says` is on `line` or on one of the six lines before it in `source` (the sentence
/// that opens its block).
fn said_near(source: &str, line: &str, says: &str) -> bool {
    if line.contains(says) {
        return true;
    }
    let text = match source {
        "--help" => return false,
        "README.md" => readme(),
        doc => std::fs::read_to_string(root().join(doc)).unwrap(),
    };
    let lines: Vec<&str> = text.lines().collect();
    lines.iter().position(|l| *l == line).is_some_and(|i| {
        lines[i.saturating_sub(6)..i]
            .iter()
            .any(|l| l.contains(says))
    })
}

#[test]
fn every_example_runs_as_written() {
    common::smollm2();
    let all = all_examples();
    assert!(all.len() > 40, "{} examples found", all.len());
    let missing: Vec<&String> = all
        .iter()
        .filter(|e| case(&e.2).is_none())
        .map(|e| &e.2)
        .collect();
    assert!(
        missing.is_empty(),
        "examples with no case in tests/examples.rs: {missing:#?}"
    );
    let mut ran = BTreeSet::new();
    let mut not_here = Vec::new();
    for (source, line, cmd) in &all {
        match case(cmd).expect("checked above") {
            How::Name => assert!(
                !cmd.contains(' ') || line.contains(&format!("`{cmd}`")),
                "{source}: {cmd}"
            ),
            How::NotHere(says) => {
                assert!(
                    said_near(source, line, says),
                    "{source}: {cmd} must say why it does not run here ({says:?})"
                );
                not_here.push(cmd.clone());
            }
            How::Run(stdin, check) => {
                if !ran.insert(cmd.clone()) {
                    continue; // the same command in two places: run once
                }
                let r = run(cmd, stdin);
                eprintln!("ran ({source}): {cmd} -> {:?}", r.code);
                check(&r);
            }
        }
    }
    assert!(ran.len() >= 35, "{} commands ran", ran.len());
    assert!(not_here.len() <= 7, "{not_here:?}");
    let _ = std::fs::remove_dir_all(
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("examples-{}", std::process::id())),
    );
}
