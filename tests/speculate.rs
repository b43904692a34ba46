//! Speculative decoding (`--speculate lookup`): the loops with proposals on test models (pass
//! accounting, stops in the middle of a pass, room), multi-token decode passes bit for bit
//! against one-token passes (a tiny generated model and the real default model), greedy ids
//! with and without speculation on the real model (one prompt and a batch), and the sampled
//! output's distribution against the model's exact one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use gen::batch::{self, BatchOptions, BatchSink, Outcome, Request};
use gen::generate::{generate_with, Flow, Generation, Limits, StopReason};
use gen::model::kv_cache::blocks_for;
use gen::model::{check_batch, load_gguf, LanguageModel, ModelInfo, PagedKv, SeqStep};
use gen::sampler::{Sampler, SamplingParams};

mod common;
use common::counting::{Collect, Counting, EOS};

fn run(
    model: &mut dyn LanguageModel,
    prompt: &[u32],
    params: &SamplingParams,
    max_new: usize,
    draft: Option<usize>,
    sink: &mut Collect,
) -> Generation {
    let mut sampler = Sampler::new(params.clone());
    let limits = Limits {
        max_new,
        context_len: model.info().context_len,
    };
    generate_with(model, prompt, &mut sampler, &[EOS], &limits, draft, sink).unwrap()
}

/// A prompt of 30 tokens for the counting model (which predicts length + 1): it opens with
/// 29, 30, 31, ... 50 and ends with 23 .. 30 (each token its position + 1), so the reply
/// 31, 32, ... is a copy of its opening: after "30 31" the drafter proposes 32, 33, ...
fn counting_copy_prompt() -> Vec<u32> {
    let mut p: Vec<u32> = (29..=50).collect();
    p.extend(23..=30);
    assert_eq!(p.len(), 30);
    p
}

#[test]
fn accepted_proposals_save_passes_with_the_same_reply() {
    let prompt = counting_copy_prompt();
    let greedy = SamplingParams::default();
    let mut plain = Counting::new(64, 64);
    let want = run(
        &mut plain,
        &prompt,
        &greedy,
        20,
        None,
        &mut Collect::default(),
    );
    assert_eq!(want.tokens, (31..=50).collect::<Vec<u32>>());
    assert_eq!(want.forward_passes, 20);
    assert!(want.speculation.is_none());

    let mut model = Counting::new(64, 64);
    let mut sink = Collect::default();
    let g = run(&mut model, &prompt, &greedy, 20, Some(4), &mut sink);
    assert_eq!(g.tokens, want.tokens);
    assert_eq!(sink.seen, want.tokens);
    assert_eq!(g.stop, StopReason::MaxNew);
    // The prefill gives 31; each pass feeds the last token and 4 proposals and keeps all 5
    // rows; the last pass proposes only what max-new can use.
    assert_eq!(
        model.steps(),
        vec![(0, 30), (30, 5), (35, 5), (40, 5), (45, 4)]
    );
    assert_eq!(g.forward_passes, 5);
    assert_eq!(
        (g.sampled, g.decode_tokens(), g.decode_passes()),
        (20, 19, 4)
    );
    let (max, stats) = g.speculation.unwrap();
    assert_eq!(max, 4);
    assert_eq!((stats.drafts, stats.proposed, stats.accepted), (4, 15, 15));
}

#[test]
fn rejected_proposals_are_forgotten_and_the_drafter_backs_off() {
    // The opening now continues "30 31" with 7 7 7 ...: every proposal is wrong.
    let mut prompt: Vec<u32> = vec![29, 30, 31];
    prompt.extend([7; 19]);
    prompt.extend(23..=30);
    let greedy = SamplingParams::default();
    let mut model = Counting::new(64, 64);
    let g = run(
        &mut model,
        &prompt,
        &greedy,
        20,
        Some(4),
        &mut Collect::default(),
    );
    assert_eq!(g.tokens, (31..=50).collect::<Vec<u32>>());
    let steps = model.steps();
    // Each step starts where the kept tokens end (the model checks it against its cache):
    // rejected proposals were truncated.
    for (pos, &(at, n)) in (30..).zip(&steps[1..]) {
        assert_eq!(at, pos);
        assert!(n <= 5);
    }
    let (_, stats) = g.speculation.unwrap();
    assert_eq!(stats.accepted, 0);
    // "30 31" matches once: one draft of 4, then silence (the later suffixes never occurred).
    assert_eq!((stats.drafts, stats.proposed), (1, 4));
    assert_eq!(g.forward_passes, 20);
}

#[test]
fn every_stop_check_fires_in_the_middle_of_a_pass() {
    let prompt = counting_copy_prompt();
    let greedy = SamplingParams::default();
    // The sink stops after 3 tokens: the pass held rows for 5.
    let mut model = Counting::new(64, 64);
    let mut sink = Collect {
        stop_after: Some(3),
        ..Default::default()
    };
    let g = run(&mut model, &prompt, &greedy, 20, Some(8), &mut sink);
    assert_eq!(g.tokens, vec![31, 32, 33]);
    assert_eq!(g.stop, StopReason::Stop);
    assert_eq!(g.forward_passes, 2);
    // EOS in the middle of the rows: the model ends at length 36.
    let mut model = Counting::new(36, 64);
    let g = run(
        &mut model,
        &prompt,
        &greedy,
        20,
        Some(8),
        &mut Collect::default(),
    );
    assert_eq!(g.tokens, vec![31, 32, 33, 34, 35, 36]);
    assert_eq!(g.stop, StopReason::Eos);
    assert_eq!(g.forward_passes, 2);
    // The context window: 40 tokens hold the prompt and 10 tokens, and no proposal goes past.
    let mut model = Counting::new(64, 40);
    let g = run(
        &mut model,
        &prompt,
        &greedy,
        20,
        Some(8),
        &mut Collect::default(),
    );
    assert_eq!(g.tokens, (31..=40).collect::<Vec<u32>>());
    assert_eq!(g.stop, StopReason::ContextFull);
    assert!(model.steps().iter().all(|&(pos, n)| pos + n < 40));
    assert_eq!(model.steps(), vec![(0, 30), (30, 9)]);
}

#[derive(Default)]
struct Done(Vec<(usize, Outcome)>);

impl BatchSink for Done {
    fn on_token(&mut self, _: usize, _: u32) -> Result<Flow> {
        Ok(Flow::Continue)
    }
    fn on_done(&mut self, index: usize, outcome: Outcome) -> Result<()> {
        self.0.push((index, outcome));
        Ok(())
    }
}

fn batch_opts(speculate: Option<usize>, pool_blocks: usize, context_len: usize) -> BatchOptions {
    BatchOptions {
        batch_size: 4,
        context_len,
        pool_blocks,
        eos: vec![EOS],
        prefix_cache: true,
        speculate,
    }
}

#[test]
fn a_batch_speculates_per_sequence_with_the_same_replies() {
    let copy = counting_copy_prompt();
    let prompts = [
        copy.clone(),
        vec![5, 9, 11],
        copy[..29].to_vec(),
        vec![3; 12],
    ];
    let reqs = |max_new: usize| -> Vec<Request> {
        prompts
            .iter()
            .map(|p| Request {
                prompt: p.clone(),
                max_new,
                sampler: Sampler::new(SamplingParams::default()),
                score_from: None,
            })
            .collect()
    };
    let mut results = Vec::new();
    // A roomy pool, and one so short that sequences are preempted.
    for pool in [64, 5] {
        for speculate in [None, Some(6)] {
            let mut model = Counting::new(60, 64);
            let mut sink = Done::default();
            let stats = batch::run(
                &mut model,
                reqs(20),
                &batch_opts(speculate, pool, 64),
                &mut sink,
            )
            .unwrap();
            assert!(stats.blocks_returned);
            sink.0.sort_by_key(|(i, _)| *i);
            let tokens: Vec<Vec<u32>> = sink.0.iter().map(|(_, o)| o.tokens.clone()).collect();
            results.push((pool, speculate, tokens, stats, sink.0));
        }
    }
    let plain = &results[0].2;
    assert_eq!(plain[0], (31..=50).collect::<Vec<u32>>());
    for (pool, speculate, tokens, stats, outcomes) in &results {
        assert_eq!(tokens, plain, "pool {pool}, speculate {speculate:?}");
        if speculate.is_some() {
            assert!(stats.drafts.accepted > 0);
            assert!(stats.sampled_tokens > stats.solo_passes);
            // The copying sequences took fewer passes than tokens; the others did not draft.
            assert!(outcomes[0].1.passes < outcomes[0].1.tokens.len());
            assert!(outcomes[0].1.drafts.accepted >= 10);
            assert_eq!(outcomes[1].1.drafts.proposed, 0);
        } else {
            assert_eq!(stats.drafts.proposed, 0);
        }
    }
    // The short pool preempted sequences, with and without speculation.
    assert!(results[2].3.preemptions > 0 && results[3].3.preemptions > 0);
}

// ---------------------------------------------------------------------------------------
// A tiny generated model and the real one: multi-token decode passes, bit for bit.

/// A tiny llama with random weights (Q8_0 matrices, so the quantized kernels run), written
/// to a GGUF file with a word-level tokenizer beside it.
fn tiny_llama() -> (PathBuf, PathBuf) {
    use gguf_file::Value as V;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("speculate-tiny");
    std::fs::create_dir_all(&dir).unwrap();
    let (vocab, d, ff, layers, heads, kv_heads) = (96usize, 64usize, 128usize, 2usize, 4, 2);
    let hd = d / heads;
    let mut seed = 1;
    let mut matrix = |rows: usize, cols: usize, scale: f32| {
        seed += 1;
        let t = Tensor::from_vec(
            common::data(rows * cols, seed, scale),
            (rows, cols),
            &Device::Cpu,
        )
        .unwrap();
        QTensor::quantize(&t, GgmlDType::Q8_0).unwrap()
    };
    let ones = |n: usize| {
        let t = Tensor::from_vec(vec![1f32; n], n, &Device::Cpu).unwrap();
        QTensor::quantize(&t, GgmlDType::F32).unwrap()
    };
    let mut tensors: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), matrix(vocab, d, 1.0)),
        ("output_norm.weight".into(), ones(d)),
        ("output.weight".into(), matrix(vocab, d, 0.5)),
    ];
    for l in 0..layers {
        let b = |n: &str| format!("blk.{l}.{n}.weight");
        tensors.push((b("attn_norm"), ones(d)));
        tensors.push((b("ffn_norm"), ones(d)));
        tensors.push((b("attn_q"), matrix(heads * hd, d, 0.3)));
        tensors.push((b("attn_k"), matrix(kv_heads * hd, d, 0.3)));
        tensors.push((b("attn_v"), matrix(kv_heads * hd, d, 0.3)));
        tensors.push((b("attn_output"), matrix(d, heads * hd, 0.3)));
        tensors.push((b("ffn_gate"), matrix(ff, d, 0.3)));
        tensors.push((b("ffn_up"), matrix(ff, d, 0.3)));
        tensors.push((b("ffn_down"), matrix(d, ff, 0.3)));
    }
    let u = |n: usize| V::U32(n as u32);
    let md: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("llama".into())),
        ("llama.block_count", u(layers)),
        ("llama.embedding_length", u(d)),
        ("llama.feed_forward_length", u(ff)),
        ("llama.attention.head_count", u(heads)),
        ("llama.attention.head_count_kv", u(kv_heads)),
        ("llama.context_length", u(256)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("llama.rope.freq_base", V::F32(10000.0)),
    ];
    let path = dir.join("tiny.gguf");
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
    let tok = dir.join("tokenizer.json");
    std::fs::write(&tok, common::tokenizer_json(vocab).to_string()).unwrap();
    (path, tok)
}

fn bits(t: &Tensor) -> Vec<Vec<u32>> {
    t.to_vec2::<f32>()
        .unwrap()
        .iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The logits of `tokens` after `prompt`, fed one token per pass, then in multi-token decode
/// steps of the given sizes, each beside another sequence's prompt chunk in the same pass (a
/// mixed pass): every row must be the same bits.
fn multi_token_rows_are_one_token_rows(
    model: &mut dyn LanguageModel,
    prompt: &[u32],
    tokens: &[u32],
) {
    let total = prompt.len() + tokens.len();
    model.reserve_pool(2 * blocks_for(total) + 2).unwrap();
    let seq = model.new_sequence();
    assert!(model.reserve(seq, total));
    model.forward(&[SeqStep::prefill(seq, prompt, 0)]).unwrap();
    let mut want = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let l = model
            .forward(&[SeqStep::decode(
                seq,
                std::slice::from_ref(t),
                prompt.len() + i,
            )])
            .unwrap();
        want.extend(bits(&l));
    }
    model.free_sequence(seq);
    for sizes in [vec![tokens.len()], vec![1, 3, tokens.len() - 4]] {
        let (seq, other) = (model.new_sequence(), model.new_sequence());
        assert!(model.reserve(seq, total) && model.reserve(other, total));
        model.forward(&[SeqStep::prefill(seq, prompt, 0)]).unwrap();
        let mut got = Vec::new();
        let mut at = 0;
        for (k, n) in sizes.iter().enumerate() {
            let step = SeqStep::decode(seq, &tokens[at..at + n], prompt.len() + at);
            // The other sequence prefills a chunk of its own prompt in the same pass.
            let chunk = &tokens[..k + 2];
            let other_pos = model.kv().len(other).unwrap();
            let l = model
                .forward(&[SeqStep::prefill(other, chunk, other_pos), step])
                .unwrap();
            let rows = bits(&l);
            assert_eq!(
                rows.len(),
                1 + n,
                "a prompt chunk's row, then one per decode token"
            );
            got.extend(rows.into_iter().skip(1));
            at += n;
        }
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g == w,
                "steps {sizes:?}: row {i} differs from its one-token pass"
            );
        }
        model.free_sequence(seq);
        model.free_sequence(other);
    }
}

#[test]
fn multi_token_decode_passes_are_bitwise_one_token_passes_on_a_tiny_model() {
    let (path, tok) = tiny_llama();
    let mut loaded = load_gguf(&path, &Device::Cpu, Some(&tok)).unwrap();
    let prompt: Vec<u32> = (0..21).map(|i| (i * 7 % 90 + 2) as u32).collect();
    let tokens: Vec<u32> = (0..9).map(|i| (i * 13 % 90 + 3) as u32).collect();
    multi_token_rows_are_one_token_rows(loaded.model.as_mut(), &prompt, &tokens);
}

#[test]
fn multi_token_decode_passes_are_bitwise_one_token_passes_on_the_real_model() {
    let mut loaded = load_gguf(&common::smollm2(), &Device::Cpu, None).unwrap();
    let t = &loaded.tokenizer;
    let prompt = t
        .encode(
            "The quick brown fox jumps over the lazy dog. The quick",
            true,
        )
        .unwrap();
    let tokens = t
        .encode(" brown fox jumps over the lazy dog and runs away", false)
        .unwrap();
    assert!(tokens.len() >= 8);
    multi_token_rows_are_one_token_rows(loaded.model.as_mut(), &prompt, &tokens);
}

// ---------------------------------------------------------------------------------------
// The real default model: greedy ids with and without speculation.

const SOURCE: &str = "The old lighthouse stood at the edge of the cliff for more then two \
hundred years. Every night its keeper climbed the narrow stairs, lit the great lamp, and \
watched the ships pass safely through the rocky strait. When the storms came, the keeper \
stayed awake untill morning, making sure the light never went out.";

fn chat_prompts(loaded: &gen::model::Loaded) -> Vec<Vec<u32>> {
    let template = loaded.chat_template.as_ref().unwrap();
    let texts = [
        format!("Rewrite this text, fixing its spelling:\n\n{SOURCE}"),
        "Fix the bug and repeat the corrected function:\n\ndef area(width, height):\n    \
         return width + height\n"
            .to_string(),
        format!("Quote the sentence about storms from this text:\n\n{SOURCE}"),
        "Write a short story about a cat.".to_string(),
        "What is the capital of France?".to_string(),
    ];
    texts
        .iter()
        .map(|t| {
            let text = template
                .render(&gen::chat::one_shot(None, t), true)
                .unwrap();
            loaded.tokenizer.encode(&text, false).unwrap()
        })
        .collect()
}

#[test]
fn greedy_ids_are_the_same_with_and_without_speculation_on_the_real_model() {
    let mut loaded = load_gguf(&common::smollm2(), &Device::Cpu, None).unwrap();
    let prompts = chat_prompts(&loaded);
    let eos = loaded.tokenizer.eos_ids().to_vec();
    let max_new = 80;
    let greedy = SamplingParams::default();
    let mut alone = Vec::new();
    let (mut tokens, mut passes, mut accepted) = (0, 0, 0);
    for p in &prompts {
        let mut gens = Vec::new();
        for draft in [None, Some(8)] {
            let mut sampler = Sampler::new(greedy.clone());
            let limits = Limits {
                max_new,
                context_len: 2048,
            };
            let m = loaded.model.as_mut();
            let g = generate_with(
                m,
                p,
                &mut sampler,
                &eos,
                &limits,
                draft,
                &mut Collect::default(),
            )
            .unwrap();
            gens.push(g);
        }
        assert_eq!(gens[0].tokens, gens[1].tokens);
        assert_eq!(gens[0].stop, gens[1].stop);
        let (_, stats) = gens[1].speculation.unwrap();
        tokens += gens[1].decode_tokens();
        passes += gens[1].decode_passes();
        accepted += stats.accepted;
        alone.push(gens.swap_remove(0).tokens);
    }
    eprintln!("{tokens} tokens in {passes} decode passes, {accepted} proposals accepted");
    assert!(
        accepted > 20 && passes < tokens,
        "the copying prompts must draft"
    );

    // A batch, with speculation: the same ids as each prompt alone without.
    let reqs = prompts
        .iter()
        .map(|p| Request {
            prompt: p.clone(),
            max_new,
            sampler: Sampler::new(greedy.clone()),
            score_from: None,
        })
        .collect();
    let opts = BatchOptions {
        batch_size: 3,
        context_len: 2048,
        pool_blocks: 64,
        eos,
        prefix_cache: true,
        speculate: Some(8),
    };
    let mut sink = Done::default();
    let stats = batch::run(loaded.model.as_mut(), reqs, &opts, &mut sink).unwrap();
    assert_eq!(sink.0.len(), prompts.len());
    for (i, o) in &sink.0 {
        assert_eq!(o.tokens, alone[*i], "prompt {i} in the batch");
    }
    assert!(stats.drafts.accepted > 20 && stats.sampled_tokens > stats.solo_passes);
    assert!(stats.blocks_returned);
}

#[test]
fn the_binary_speculates_reports_it_and_refuses_it_with_an_endpoint() {
    let prompt = format!("Rewrite this text, fixing its spelling:\n\n{SOURCE}");
    let args = [
        "--chat",
        "--temperature",
        "0",
        "--max-new",
        "60",
        "--stats",
        "json",
    ];
    let run = |extra: &[&str]| {
        let out = common::gen()
            .args(args)
            .args(["--prompt", &prompt])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", common::text(&out.stderr));
        let report = common::text(&out.stderr);
        let json: serde_json::Value = serde_json::from_str(report.lines().last().unwrap()).unwrap();
        (common::text(&out.stdout), json)
    };
    let (plain, r0) = run(&[]);
    let (spec, r1) = run(&["--speculate", "lookup", "--draft-max", "6"]);
    assert_eq!(plain, spec);
    assert!(r0.get("speculate").is_none());
    assert_eq!(r0["tokens_per_pass"], 1.0);
    let s = &r1["speculate"];
    assert_eq!(s["draft_max"], 6);
    assert!(s["accepted"].as_u64().unwrap() > 0);
    assert!(s["proposed"].as_u64().unwrap() >= s["accepted"].as_u64().unwrap());
    assert!(r1["tokens_per_pass"].as_f64().unwrap() > 1.0);
    assert!(r1["forward_passes"].as_u64() < r0["forward_passes"].as_u64());
    assert_eq!(r1["generated_tokens"], r0["generated_tokens"]);

    let out = common::gen()
        .args([
            "--endpoint",
            "http://127.0.0.1:9/v1",
            "--speculate",
            "lookup",
        ])
        .args(["--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let line = common::one_error_line(&out);
    assert!(line.contains("--speculate"), "{line}");
    let out = common::gen()
        .args([
            "--draft-max",
            "0",
            "--speculate",
            "lookup",
            "--prompt",
            "hi",
        ])
        .output()
        .unwrap();
    assert!(common::one_error_line(&out).contains("--draft-max"));
}

// ---------------------------------------------------------------------------------------
// Sampling: the output's distribution is the model's.

/// A Markov chain over 8 tokens as a model: the logits of the token after `t` are row `t` of
/// a fixed table, for every row a pass asks for. 1 -> 2 -> 3 -> 1 are likely, so drafts copied
/// from a "1 2 3 1 2 3" prompt are often (not always) accepted.
struct Markov {
    info: ModelInfo,
    kv: PagedKv,
    table: Vec<Vec<f32>>,
}

const MV: usize = 8;

impl Markov {
    fn new() -> Self {
        let noise = common::data(MV * MV, 5, 1.0);
        let mut table: Vec<Vec<f32>> = noise.chunks(MV).map(|r| r.to_vec()).collect();
        for (a, b) in [(1, 2), (2, 3), (3, 1)] {
            table[a][b] = 3.5;
        }
        let info = ModelInfo {
            arch: "test".into(),
            name: "markov".into(),
            context_len: 64,
            vocab_size: MV,
        };
        Self {
            info,
            kv: PagedKv::new(0),
            table,
        }
    }
}

impl LanguageModel for Markov {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn kv(&self) -> &PagedKv {
        &self.kv
    }
    fn kv_mut(&mut self) -> &mut PagedKv {
        &mut self.kv
    }
    fn reserve_pool(&mut self, blocks: usize) -> Result<()> {
        if self.kv.usage().blocks_total < blocks {
            self.kv = PagedKv::new(blocks);
        }
        Ok(())
    }
    fn kv_bytes_per_token(&self) -> usize {
        4
    }
    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        check_batch(&self.kv, batch, self.info.context_len)?;
        let mut rows: Vec<f32> = Vec::new();
        for step in batch {
            self.kv.advance(step.seq, step.tokens.len());
            let from = step.tokens.len() - step.logit_rows();
            for &t in &step.tokens[from..] {
                rows.extend(&self.table[t as usize]);
            }
        }
        let n = rows.len() / MV;
        Ok(Tensor::from_vec(rows, (n, MV), &Device::Cpu)?)
    }
}

/// Tokens of the replies whose distribution is compared.
const R: usize = 4;

/// The exact probability of every R-token reply to `prompt` under `params`: the product of
/// the sampler's own distributions, each after the history so far.
fn exact_replies(
    model: &Markov,
    params: &SamplingParams,
    prompt: &[u32],
) -> HashMap<[u32; R], f64> {
    let mut sampler = Sampler::new(params.clone());
    let mut frontier = vec![([0u32; R], 1.0)];
    for depth in 0..R {
        let mut next = Vec::new();
        for (reply, p) in frontier {
            let mut history = prompt.to_vec();
            history.extend(&reply[..depth]);
            let last = *history.last().unwrap() as usize;
            for (id, q) in sampler.distribution(&model.table[last], &history).unwrap() {
                let mut r = reply;
                r[depth] = id;
                next.push((r, p * q));
            }
        }
        frontier = next;
    }
    frontier.into_iter().collect()
}

/// Pearson's chi-square of `counts` (n draws) against `exact`, cells expected fewer than 5
/// times pooled into one; with its degrees of freedom.
fn chi_square(
    counts: &HashMap<[u32; R], usize>,
    exact: &HashMap<[u32; R], f64>,
    n: usize,
) -> (f64, usize) {
    let (mut chi, mut cells) = (0.0, 0);
    let (mut pooled_e, mut pooled_o) = (0.0, 0.0);
    for (r, p) in exact {
        let e = p * n as f64;
        let o = *counts.get(r).unwrap_or(&0) as f64;
        if e < 5.0 {
            pooled_e += e;
            pooled_o += o;
        } else {
            chi += (o - e).powi(2) / e;
            cells += 1;
        }
    }
    let unexpected: usize = counts.keys().filter(|r| !exact.contains_key(*r)).count();
    assert_eq!(unexpected, 0, "a reply the sampler's distribution forbids");
    if pooled_e > 0.0 {
        chi += (pooled_o - pooled_e).powi(2) / pooled_e;
        cells += 1;
    }
    (chi, cells - 1)
}

/// The chi-square value a correct sampler exceeds with probability 0.001 (Wilson and
/// Hilferty's approximation, z = 3.09).
fn chi_square_limit(df: usize) -> f64 {
    let k = df as f64;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + 3.09 * a.sqrt()).powi(3)
}

#[test]
fn speculative_sampling_draws_from_the_models_distribution() {
    let prompt = [4, 1, 2, 3, 1, 2, 3, 1, 2];
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 6,
        top_p: 0.97,
        // Strong, and over the last two tokens only: a row sampled with the wrong history
        // (the proposals before it left out) has another distribution.
        repeat_penalty: 3.0,
        repeat_last_n: 2,
        ..Default::default()
    };
    let model = Markov::new();
    let exact = exact_replies(&model, &params, &prompt);
    let total: f64 = exact.values().sum();
    assert!(
        (total - 1.0).abs() < 1e-5,
        "the exact distribution sums to {total}"
    );

    let n = 40_000;
    for draft in [None, Some(4)] {
        let mut model = Markov::new();
        let mut counts: HashMap<[u32; R], usize> = HashMap::new();
        let (mut accepted, mut passes) = (0, 0);
        for seed in 0..n as u64 {
            let p = SamplingParams {
                seed: seed * 7919 + 1,
                ..params.clone()
            };
            let mut sampler = Sampler::new(p);
            let limits = Limits {
                max_new: R,
                context_len: 64,
            };
            let mut sink = Collect::default();
            let g = generate_with(
                &mut model,
                &prompt,
                &mut sampler,
                &[],
                &limits,
                draft,
                &mut sink,
            )
            .unwrap();
            let reply: [u32; R] = g.tokens.clone().try_into().unwrap();
            *counts.entry(reply).or_default() += 1;
            passes += g.forward_passes;
            accepted += g.speculation.map_or(0, |(_, s)| s.accepted);
        }
        let (chi, df) = chi_square(&counts, &exact, n);
        let limit = chi_square_limit(df);
        eprintln!(
            "draft {draft:?}: chi-square {chi:.1} over {df} degrees of freedom (limit {limit:.1}); \
             {accepted} proposals accepted, {passes} passes for {} tokens",
            R * n
        );
        assert!(
            chi < limit,
            "draft {draft:?}: chi-square {chi:.1} >= {limit:.1}"
        );
        if draft.is_some() {
            // Not vacuous: proposals were kept, so rows after the first were sampled.
            assert!(accepted > n, "{accepted} accepted");
            assert!(passes < R * n);
        }
    }
}

#[test]
fn seeded_speculative_runs_are_reproducible_and_equal_the_plain_run() {
    let prompt = [4, 1, 2, 3, 1, 2, 3, 1, 2];
    let params = SamplingParams {
        temperature: 1.0,
        repeat_penalty: 2.0,
        repeat_last_n: 2,
        ..Default::default()
    };
    let mut model = Markov::new();
    let (mut differ, mut accepted) = (0, 0);
    for seed in 0..50 {
        let p = SamplingParams {
            seed,
            ..params.clone()
        };
        let a = run(
            &mut model,
            &prompt,
            &p,
            30,
            Some(5),
            &mut Collect::default(),
        );
        let b = run(
            &mut model,
            &prompt,
            &p,
            30,
            Some(5),
            &mut Collect::default(),
        );
        let plain = run(&mut model, &prompt, &p, 30, None, &mut Collect::default());
        assert_eq!(a.tokens, b.tokens);
        // Each token takes the same random draw as in the plain run.
        assert_eq!(a.tokens, plain.tokens);
        accepted += a.speculation.unwrap().1.accepted;
        let other = SamplingParams {
            seed: seed + 1000,
            ..params.clone()
        };
        if run(
            &mut model,
            &prompt,
            &other,
            30,
            Some(5),
            &mut Collect::default(),
        )
        .tokens
            != a.tokens
        {
            differ += 1;
        }
    }
    assert!(differ > 40, "seeds matter: {differ} of 50 differ");
    assert!(accepted > 100, "proposals were kept: {accepted}");
}

#[test]
fn a_grammar_holds_with_speculation_and_the_reply_is_the_same() {
    use gen::constraint::{Grammars, Spec};
    let mut loaded = load_gguf(&common::smollm2(), &Device::Cpu, None).unwrap();
    let template = loaded.chat_template.as_ref().unwrap();
    let text = template
        .render(
            &gen::chat::one_shot(
                None,
                &format!("Copy this text in lower case, without commas:\n\n{SOURCE}"),
            ),
            true,
        )
        .unwrap();
    let prompt = loaded.tokenizer.encode(&text, false).unwrap();
    let eos = loaded.tokenizer.eos_ids().to_vec();
    let grammars = Grammars::new(&loaded.tokenizer, &eos).unwrap();
    // Lower-case words and full stops only: many of the model's favourite tokens are masked.
    let spec = Spec::Regex("[a-z .]{1,300}".into());
    let mut replies = Vec::new();
    for draft in [None, Some(8)] {
        let mut sampler = Sampler::new(SamplingParams::default())
            .with_constraint(grammars.constraint(&spec).unwrap());
        let limits = Limits {
            max_new: 60,
            context_len: 2048,
        };
        let m = loaded.model.as_mut();
        let g = generate_with(
            m,
            &prompt,
            &mut sampler,
            &eos,
            &limits,
            draft,
            &mut Collect::default(),
        )
        .unwrap();
        let text = loaded.tokenizer.decode(&g.tokens).unwrap();
        assert!(
            text.chars()
                .all(|c| c.is_ascii_lowercase() || c == ' ' || c == '.'),
            "{text:?}"
        );
        replies.push((g.tokens.clone(), g.speculation));
    }
    assert_eq!(replies[0].0, replies[1].0);
    let (_, stats) = replies[1].1.unwrap();
    eprintln!("{stats:?}");
    assert!(stats.accepted > 0, "the copy was drafted: {stats:?}");
}

#[test]
fn the_binary_batch_gives_the_same_lines_with_speculation_and_reports_it() {
    let prompts = [
        format!("Rewrite this text, fixing its spelling:\n\n{SOURCE}"),
        "Name three colours.".to_string(),
        format!("Quote the sentence about storms from this text:\n\n{SOURCE}"),
    ];
    let input: String = prompts
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string() + "\n")
        .collect();
    let run = |extra: &[&str]| {
        let mut cmd = common::gen();
        cmd.args([
            "--batch",
            "-",
            "--chat",
            "--temperature",
            "0",
            "--max-new",
            "50",
        ])
        .args(["--stats", "json"])
        .args(extra);
        let out = common::with_stdin(cmd, &input);
        assert!(out.status.success(), "{}", common::text(&out.stderr));
        let lines: Vec<serde_json::Value> = common::text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let report: serde_json::Value =
            serde_json::from_str(common::text(&out.stderr).lines().last().unwrap()).unwrap();
        (lines, report)
    };
    let (plain, r0) = run(&[]);
    let (spec, r1) = run(&["--speculate", "lookup"]);
    assert_eq!(plain.len(), 3);
    for (a, b) in plain.iter().zip(&spec) {
        assert_eq!(a["text"], b["text"]);
        assert_eq!(a["tokens"], b["tokens"]);
    }
    // The copying prompt took fewer passes than it has tokens.
    assert!(spec[0]["passes"].as_u64() < spec[0]["tokens"].as_u64());
    assert!(r0.get("speculate").is_none());
    assert!(r1["speculate"]["accepted"].as_u64().unwrap() > 0);
    assert!(r1["tokens_per_pass"].as_f64().unwrap() > 1.0);
    assert!(r1["solo_passes"].as_u64() < r0["solo_passes"].as_u64());
}
