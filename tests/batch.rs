//! Batch runs: the continuous-batching loop with the counting model (pass structure worked out
//! by hand, pages, preemption, cancellation), then the real default model (batched greedy ids
//! equal one-by-one ids) and the binary as scripts use it (`--batch`, JSONL out).

mod common;

use anyhow::Result;
use candle_core::Device;
use common::counting::{Counting, EOS};
use gen::batch::{self, BatchOptions, BatchSink, Outcome, Request};
use gen::generate::{generate, Flow, Limits, StopReason, TokenSink};
use gen::model::{load_gguf, LanguageModel};
use gen::sampler::{Sampler, SamplingParams};

#[derive(Default)]
struct Collect {
    tokens: Vec<Vec<u32>>,
    done: Vec<(usize, Outcome)>,
    cancel_after_tokens: Option<usize>,
    seen: usize,
}

impl BatchSink for Collect {
    fn on_token(&mut self, index: usize, id: u32) -> Result<Flow> {
        if self.tokens.len() <= index {
            self.tokens.resize(index + 1, Vec::new());
        }
        self.tokens[index].push(id);
        self.seen += 1;
        Ok(Flow::Continue)
    }
    fn on_done(&mut self, index: usize, outcome: Outcome) -> Result<()> {
        self.done.push((index, outcome));
        Ok(())
    }
    fn cancelled(&self) -> Option<StopReason> {
        self.cancel_after_tokens
            .filter(|&n| self.seen >= n)
            .map(|_| StopReason::Interrupted)
    }
}

fn greedy_requests(prompt_lens: &[usize], max_new: usize) -> Vec<Request> {
    prompt_lens
        .iter()
        .map(|&n| Request {
            prompt: (1..=n as u32).collect(),
            max_new,
            sampler: Sampler::new(SamplingParams::default()),
            score_from: None,
        })
        .collect()
}

fn opts(batch_size: usize, pool_blocks: usize) -> BatchOptions {
    BatchOptions {
        batch_size,
        context_len: 1000,
        pool_blocks,
        eos: vec![EOS],
        prefix_cache: true,
        speculate: None,
    }
}

/// The counting model ends a sequence when it holds 10 tokens: a prompt of p tokens gets
/// 10 - p tokens and takes 10 - p + 1 passes (the last one samples EOS).
///
/// With two slots and prompts A (7 tokens), B (9), C (8), D (6):
///   pass 1: A prefill, B prefill        A -> 8,  B -> 10
///   pass 2: A, B                        A -> 9,  B: EOS, done after 2 passes
///   pass 3: A, C prefill                A -> 10, C -> 9        (C took B's slot at once)
///   pass 4: A, C                        A: EOS (4 passes), C -> 10
///   pass 5: C, D prefill                C: EOS (3 passes), D -> 7
///   passes 6 to 9: D alone              D -> 8, 9, 10, EOS (5 passes)
/// 9 passes in all; one prompt at a time would take 4 + 2 + 3 + 5 = 14.
#[test]
fn continuous_batching_takes_the_passes_worked_out_by_hand() {
    let mut model = Counting::new(10, 1000);
    let mut sink = Collect::default();
    let stats = batch::run(
        &mut model,
        greedy_requests(&[7, 9, 8, 6], 100),
        &opts(2, 64),
        &mut sink,
    )
    .unwrap();
    assert_eq!(stats.forward_passes, 9);
    assert_eq!(stats.solo_passes, 14);
    let steps: Vec<Vec<(usize, usize)>> = model
        .passes
        .iter()
        .map(|p| p.iter().map(|&(_, pos, t)| (pos, t)).collect())
        .collect();
    assert_eq!(
        steps,
        vec![
            vec![(0, 7), (0, 9)],
            vec![(7, 1), (9, 1)],
            vec![(8, 1), (0, 8)],
            vec![(9, 1), (8, 1)],
            vec![(9, 1), (0, 6)],
            vec![(6, 1)],
            vec![(7, 1)],
            vec![(8, 1)],
            vec![(9, 1)],
        ]
    );
    // Finished in the order they ended, each with its own count of passes.
    let order: Vec<(usize, usize)> = sink.done.iter().map(|(i, o)| (*i, o.passes)).collect();
    assert_eq!(order, vec![(1, 2), (0, 4), (2, 3), (3, 5)]);
    for (i, o) in &sink.done {
        let p = [7u32, 9, 8, 6][*i];
        assert_eq!(o.tokens, (p + 1..=10).collect::<Vec<_>>(), "prompt {i}");
        assert_eq!(o.stop, StopReason::Eos);
    }
    assert!(stats.blocks_returned);
    assert_eq!(
        model.kv_usage().blocks_used,
        0,
        "every page is back in the pool"
    );
    assert!(stats.blocks_peak >= 2);
}

#[test]
fn max_new_is_per_request_and_the_batch_never_exceeds_its_size() {
    let mut model = Counting::new(1000, 1000);
    let mut reqs = greedy_requests(&[3, 5, 2, 4, 1], 1);
    for (r, n) in reqs.iter_mut().zip([4, 1, 6, 2, 3]) {
        r.max_new = n;
    }
    let mut sink = Collect::default();
    let stats = batch::run(&mut model, reqs, &opts(3, 64), &mut sink).unwrap();
    assert!(model.passes.iter().all(|p| p.len() <= 3));
    let mut by_index: Vec<(usize, usize, StopReason)> = sink
        .done
        .iter()
        .map(|(i, o)| (*i, o.tokens.len(), o.stop))
        .collect();
    by_index.sort_by_key(|x| x.0);
    assert_eq!(
        by_index,
        vec![
            (0, 4, StopReason::MaxNew),
            (1, 1, StopReason::MaxNew),
            (2, 6, StopReason::MaxNew),
            (3, 2, StopReason::MaxNew),
            (4, 3, StopReason::MaxNew),
        ]
    );
    assert_eq!(stats.generated_tokens, 16);
    assert_eq!(
        stats.solo_passes, 16,
        "a reply cut by max-new costs one pass per token"
    );
}

/// A pool of 5 blocks (80 tokens) for four sequences that each grow to 40 tokens (3 blocks):
/// they cannot all fit, so some wait or are preempted and resumed, and every one still gets
/// its whole, correct reply.
#[test]
fn a_short_pool_makes_sequences_wait_and_loses_nothing() {
    let mut model = Counting::new(40, 1000);
    let mut sink = Collect::default();
    let stats = batch::run(
        &mut model,
        greedy_requests(&[10, 12, 14, 16], 100),
        &opts(4, 5),
        &mut sink,
    )
    .unwrap();
    assert_eq!(sink.done.len(), 4);
    for (i, o) in &sink.done {
        let p = [10u32, 12, 14, 16][*i];
        assert_eq!(o.tokens, (p + 1..=40).collect::<Vec<_>>(), "prompt {i}");
        assert_eq!(o.stop, StopReason::Eos);
    }
    assert!(stats.preemptions > 0, "this pool forces preemption");
    // A resumed sequence's reply goes back in as one step of several tokens from the end of
    // its prompt, after its prompt's own prefill step.
    let steps = model.steps();
    assert!(
        steps.iter().enumerate().any(|(k, &(pos, t))| t > 1
            && [10, 12, 14, 16].contains(&pos)
            && steps[..k].contains(&(0, pos))),
        "{steps:?}"
    );
    assert!(stats.blocks_peak <= 5);
    assert!(stats.blocks_returned);
    // The sink saw each token once, even for sequences that were resumed.
    for (i, o) in &sink.done {
        assert_eq!(sink.tokens[*i], o.tokens);
    }
}

#[test]
fn cancelling_ends_every_sequence_and_returns_the_pages() {
    let mut model = Counting::new(1000, 1000);
    let mut sink = Collect {
        cancel_after_tokens: Some(5),
        ..Default::default()
    };
    let stats = batch::run(
        &mut model,
        greedy_requests(&[3, 4, 5, 6], 50),
        &opts(2, 64),
        &mut sink,
    )
    .unwrap();
    assert_eq!(sink.done.len(), 4, "every prompt gets its outcome");
    assert!(sink
        .done
        .iter()
        .all(|(_, o)| o.stop == StopReason::Interrupted));
    let never_started = sink.done.iter().filter(|(_, o)| o.passes == 0).count();
    assert_eq!(never_started, 2);
    assert!(stats.blocks_returned);
}

struct Ids(Vec<u32>);
impl TokenSink for Ids {
    fn on_token(&mut self, id: u32) -> Result<Flow> {
        self.0.push(id);
        Ok(Flow::Continue)
    }
}

/// The real default model: prompts of mixed lengths batched together give exactly the greedy
/// ids each gives alone.
#[test]
fn a_reply_whose_sampling_fails_ends_alone_with_its_error() {
    use gen::constraint::{byte_constraint, Spec};
    // The grammar allows only bytes a-z (ids 97..122), none of which this 64-token model has:
    // its first sample fails. The other two prompts must not notice.
    let mut requests = greedy_requests(&[3, 4, 5], 4);
    requests[1].sampler = Sampler::new(SamplingParams::default())
        .with_constraint(byte_constraint(&Spec::Regex("[a-z]+".into())));
    let mut model = Counting::new(100, 1000);
    let mut sink = Collect::default();
    let stats = batch::run(&mut model, requests, &opts(3, 30), &mut sink).unwrap();
    sink.done.sort_by_key(|(i, _)| *i);
    let outcomes: Vec<&Outcome> = sink.done.iter().map(|(_, o)| o).collect();
    assert_eq!(outcomes.len(), 3);
    assert_eq!(outcomes[1].stop, StopReason::Failed);
    assert!(outcomes[1].tokens.is_empty());
    let why = outcomes[1].error.as_deref().unwrap();
    assert!(why.contains("allows no token"), "{why}");
    for i in [0, 2] {
        assert_eq!(outcomes[i].stop, StopReason::MaxNew);
        assert_eq!(outcomes[i].tokens.len(), 4);
        assert!(outcomes[i].error.is_none());
    }
    assert!(stats.blocks_returned);
}

#[test]
fn batched_greedy_ids_equal_one_by_one_on_the_real_model() {
    let mut loaded = load_gguf(&common::smollm2(), &Device::Cpu, None).unwrap();
    let long = "Summarise the following. ".repeat(12) + "The end.";
    let texts = [
        "The capital of France is",
        "def fibonacci(n):",
        long.as_str(),
        "Once upon a time",
        "List three colours:",
        "1, 2, 3, 4,",
    ];
    let max_new = 16;
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| loaded.tokenizer.encode(t, loaded.add_bos).unwrap())
        .collect();
    assert!(
        prompts[2].len() > 60 && prompts[0].len() < 10,
        "mixed lengths"
    );
    let eos = loaded.tokenizer.eos_ids().to_vec();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut sink = Ids(Vec::new());
            let limits = Limits {
                max_new,
                context_len: 8192,
            };
            let mut sampler = Sampler::new(SamplingParams::default());
            let g = generate(
                loaded.model.as_mut(),
                p,
                &mut sampler,
                &eos,
                &limits,
                &mut sink,
            )
            .unwrap();
            g.tokens
        })
        .collect();
    for batch_size in [4, 6] {
        let reqs = prompts
            .iter()
            .map(|p| Request {
                prompt: p.clone(),
                max_new,
                sampler: Sampler::new(SamplingParams::default()),
                score_from: None,
            })
            .collect();
        let mut sink = Collect::default();
        let o = BatchOptions {
            batch_size,
            context_len: 8192,
            pool_blocks: 64,
            eos: eos.clone(),
            prefix_cache: true,
            speculate: None,
        };
        let stats = batch::run(loaded.model.as_mut(), reqs, &o, &mut sink).unwrap();
        assert!(stats.forward_passes < stats.solo_passes);
        for (i, outcome) in &sink.done {
            assert_eq!(
                outcome.tokens, alone[*i],
                "batch size {batch_size}, prompt {i} ({:?})",
                texts[*i]
            );
        }
        assert_eq!(sink.done.len(), texts.len());
        assert!(stats.blocks_returned);
    }
}

fn run_gen(args: &[&str], stdin: &str) -> std::process::Output {
    let mut cmd = common::gen();
    cmd.args(args);
    common::with_stdin(cmd, stdin)
}

fn lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    common::text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

/// One JSONL file with good prompts, a prompt too long for the window and a broken line: every
/// prompt gets its line, in input order; the bad ones say why (naming the input line), the good
/// ones complete, and the exit status says something failed.
#[test]
fn the_binary_writes_one_line_per_prompt_in_order_and_keeps_going_past_failures() {
    let model = common::smollm2();
    let long = "word ".repeat(200);
    let input = [
        r#"{"prompt": "The capital of France is", "id": "paris"}"#.to_string(),
        format!(r#"{{"prompt": "{long}", "id": "too-long"}}"#),
        r#"{"prompt": "Once upon a time", "max_new": 3}"#.to_string(),
        r#"{"prompt": "broken"#.to_string(),
        String::new(),
        r#"{"prompt": "Roses are red,", "id": 42, "stop": ["\n"], "max_new": 12}"#.to_string(),
    ]
    .join("\n");
    let out = run_gen(
        &[
            "--model",
            model.to_str().unwrap(),
            "--batch",
            "-",
            "--temperature",
            "0",
            "-n",
            "8",
            "--ctx-size",
            "64",
            "--batch-size",
            "2",
            "--stats",
            "json",
        ],
        &input,
    );
    let err = common::text(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.lines()
            .any(|l| l == "gen: error: 2 of 5 prompts failed (see their \"error\" lines)"),
        "{err}"
    );
    let got = lines(&out);
    assert_eq!(got.len(), 5);
    let indices: Vec<u64> = got.iter().map(|l| l["index"].as_u64().unwrap()).collect();
    assert_eq!(indices, vec![0, 1, 2, 3, 4]);
    assert_eq!(got[0]["id"], "paris");
    let single = |prompt: &str, extra: &[&str]| {
        let out = common::gen()
            .args(["--model", model.to_str().unwrap(), "--prompt", prompt])
            .args(["--temperature", "0", "-q"])
            .args(extra)
            .output()
            .unwrap();
        common::text(&out.stdout)
    };
    assert_eq!(
        got[0]["text"],
        single("The capital of France is", &["-n", "8"])
    );
    assert!(got[0]["text"].as_str().unwrap().starts_with(" Paris."));
    assert_eq!(got[0]["tokens"], 8);
    assert_eq!(got[0]["stop"], "max-new");
    assert_eq!(got[0]["passes"], 8);
    assert!(got[0]["ttft_ms"].as_f64().unwrap() > 0.0);

    assert_eq!(got[1]["id"], "too-long");
    assert_eq!(got[1]["line"], 2);
    let e1 = got[1]["error"].as_str().unwrap();
    assert!(e1.contains("context window of 64 tokens"), "{e1}");
    assert!(got[1].get("text").is_none());

    assert_eq!(got[2]["tokens"], 3, "max_new from the line");
    assert_eq!(got[3]["line"], 4);
    assert!(got[3]["error"]
        .as_str()
        .unwrap()
        .starts_with("not valid JSON"));
    assert_eq!(got[4]["id"], 42);
    assert_eq!(got[4]["line"], 6, "blank lines are skipped but counted");
    assert_eq!(got[4]["stop"], "stop");
    let text4 = got[4]["text"].as_str().unwrap();
    assert!(
        !text4.is_empty() && !text4.contains('\n'),
        "cut before the stop string"
    );
    assert_eq!(
        text4,
        single("Roses are red,", &["-n", "12", "--stop", "\n"])
    );

    let report: serde_json::Value =
        serde_json::from_str(err.lines().find(|l| l.starts_with('{')).unwrap()).unwrap();
    assert_eq!(report["prompts"], 5);
    assert_eq!(report["failed"], 2);
    assert_eq!(
        report["generated_tokens"].as_u64().unwrap(),
        got.iter().filter_map(|l| l["tokens"].as_u64()).sum::<u64>()
    );
    assert!(report["forward_passes"].as_u64() < report["solo_passes"].as_u64());
    // The longest request is 5 prompt tokens + 12 new (+1 fed): 2 blocks of 16, times 2 slots.
    assert_eq!(report["kv_blocks_total"], 4);
    assert!(report["kv_blocks_peak"].as_u64().unwrap() <= 4);
}

/// Sampled text depends on the seed and the prompt's place, not on the batch size; the first
/// prompt samples as a single run with the same seed does.
#[test]
fn sampling_is_reproducible_whatever_the_batch_size() {
    let model = common::smollm2();
    let prompts = "Tell me a story.\nWrite a poem about rain.\nWhat is a cat?\nName a city.\n";
    let run = |b: &str| {
        let out = run_gen(
            &[
                "--model",
                model.to_str().unwrap(),
                "--batch",
                "-",
                "--seed",
                "11",
                "--temperature",
                "1.0",
                "-n",
                "12",
                "--batch-size",
                b,
                "--ignore-eos",
                "-q",
            ],
            prompts,
        );
        assert!(out.status.success(), "{}", common::text(&out.stderr));
        // Timings differ from run to run; everything else must not.
        let mut got = lines(&out);
        for l in &mut got {
            let l = l.as_object_mut().unwrap();
            assert!(l.remove("ttft_ms").is_some() && l.remove("wait_ms").is_some());
        }
        got
    };
    let one = run("1");
    let three = run("3");
    assert_eq!(one, three);
    assert_eq!(one[1]["seed"], 12, "prompt i samples with seed + i");
    let texts: Vec<&str> = one.iter().map(|l| l["text"].as_str().unwrap()).collect();
    assert!(texts.windows(2).any(|w| w[0] != w[1]));

    let single = common::gen()
        .args([
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Tell me a story.",
            "--seed",
            "11",
            "--temperature",
            "1.0",
            "-n",
            "12",
            "--ignore-eos",
            "-q",
        ])
        .output()
        .unwrap();
    assert_eq!(common::text(&single.stdout), texts[0]);
}

#[test]
fn batch_input_errors_are_one_line() {
    let model = common::smollm2();
    let out = run_gen(
        &["--model", model.to_str().unwrap(), "--batch", "-"],
        "\n\n  \n",
    );
    assert_eq!(out.status.code(), Some(1));
    let line = common::one_error_line(&out);
    assert!(line.contains("no prompts"), "{line}");
    let out = common::gen()
        .args(["--batch", "/nonexistent/prompts.txt"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(common::one_error_line(&out).contains("/nonexistent/prompts.txt"));
}

/// Ctrl-C in a batch run: every prompt still gets its line (finished ones as they were, the
/// running one with what it generated, the waiting ones empty), then exit 130.
#[test]
fn ctrl_c_writes_every_line_and_exits_130() {
    let (code, err, got) = common::signalled_batch("INT");
    assert_eq!(code, Some(130), "{err}");
    assert_eq!(got.len(), 3);
    assert_eq!(
        (got[0]["stop"].as_str(), got[0]["tokens"].as_u64()),
        (Some("max-new"), Some(2))
    );
    assert_eq!(got[1]["stop"], "interrupted");
    let n = got[1]["tokens"].as_u64().unwrap();
    assert!(n > 0 && n < 2000, "{n}");
    assert_eq!(
        (got[2]["stop"].as_str(), got[2]["tokens"].as_u64()),
        (Some("interrupted"), Some(0))
    );
}

#[test]
fn resume_runs_only_what_the_output_lacks_and_openai_shapes_round_trip() {
    let model = common::smollm2();
    let model = model.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("gen-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = "{\"prompt\": \"The capital of France is\", \"id\": \"a\"}\n\
                 {\"prompt\": \"Once upon a time\", \"id\": \"b\"}\n\
                 {\"prompt\": \"Water boils at\", \"id\": \"c\"}\n\
                 {\"prompt\": \"The sun rises in the\", \"id\": \"d\"}\n";
    let args = [
        "--model",
        model,
        "--batch",
        "-",
        "-n",
        "6",
        "--temperature",
        "0",
        "-q",
    ];
    let full = run_gen(&args, input);
    assert!(full.status.success());
    let full = lines(&full);

    // What a crashed run leaves: a, c complete; b failed; d interrupted; a half-written line.
    let out = dir.join("out.jsonl");
    let mut partial = String::new();
    partial.push_str(&format!("{}\n", full[0]));
    partial.push_str("{\"index\":1,\"id\":\"b\",\"line\":2,\"error\":\"the server went away\"}\n");
    partial.push_str(&format!("{}\n", full[2]));
    partial.push_str(
        "{\"index\":3,\"id\":\"d\",\"line\":4,\"text\":\" ea\",\"stop\":\"interrupted\"}\n",
    );
    partial.push_str("{\"index\":3,\"id\":\"d\",\"li");
    std::fs::write(&out, &partial).unwrap();
    let mut resume_args = args.to_vec();
    let out_arg = out.to_str().unwrap().to_string();
    resume_args.extend(["--resume", out_arg.as_str()]);
    let again = run_gen(&resume_args, input);
    assert!(again.status.success(), "{}", common::text(&again.stderr));
    let again = lines(&again);
    let ids: Vec<&str> = again.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["b", "d"], "only what the output lacks runs");
    assert_eq!(again[0]["text"], full[1]["text"]);
    assert_eq!(again[1]["text"], full[3]["text"]);
    // Appended to the cut file itself (`--resume OUT >> OUT`): the fragment is ended first, so
    // every new line is whole and OUT then holds every item complete.
    let appended = std::process::Command::new(env!("CARGO_BIN_EXE_gen"))
        .args(&resume_args)
        .stdin(
            std::fs::File::open({
                let p = dir.join("in.jsonl");
                std::fs::write(&p, input).unwrap();
                p
            })
            .unwrap(),
        )
        .stdout(std::fs::OpenOptions::new().append(true).open(&out).unwrap())
        .status()
        .unwrap();
    assert!(appended.success());
    let whole = std::fs::read_to_string(&out).unwrap();
    let complete: Vec<serde_json::Value> = whole
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["text"].is_string() && l["stop"] != "interrupted")
        .collect();
    let mut ids: Vec<&str> = complete.iter().map(|l| l["id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "c", "d"], "{whole}");
    // Resuming from a complete output runs nothing.
    std::fs::write(
        &out,
        full.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let none = run_gen(&resume_args, input);
    assert!(none.status.success() && none.stdout.is_empty());

    // OpenAI's Batch API: its input lines in, its output shape out; resumable by custom_id.
    let openai_in = "{\"custom_id\": \"x1\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"model\": \"m\", \"prompt\": \"The capital of France is\", \"max_tokens\": 6}}\n\
                     {\"custom_id\": \"x2\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"model\": \"m\", \"prompt\": \"Once upon a time\", \"max_tokens\": 6}}\n";
    let mut oa = args.to_vec();
    oa.extend(["--batch-output", "openai"]);
    let got = run_gen(&oa, openai_in);
    assert!(got.status.success(), "{}", common::text(&got.stderr));
    let got = lines(&got);
    assert_eq!(got[0]["custom_id"], "x1");
    assert_eq!(got[0]["response"]["status_code"], 200);
    let body = &got[0]["response"]["body"];
    assert_eq!(body["choices"][0]["text"], full[0]["text"]);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 6);
    assert!(got[0]["error"].is_null());
    std::fs::write(&out, format!("{}\n", got[0])).unwrap();
    oa.extend(["--resume", out_arg.as_str()]);
    let rest = lines(&run_gen(&oa, openai_in));
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0]["custom_id"], "x2");
    std::fs::remove_dir_all(&dir).unwrap();
}
