//! The generation loop with a test model standing in for a real one: pass accounting, stop
//! reasons, and the positions the loop feeds the model.

use gen::generate::{generate, Limits, StopReason};
use gen::model::LanguageModel;
use gen::sampler::{Sampler, SamplingParams};

mod common;
use common::counting::{Collect, Counting, EOS};

fn run(
    model: &mut Counting,
    prompt: &[u32],
    max_new: usize,
    sink: &mut Collect,
) -> gen::generate::Generation {
    let mut sampler = Sampler::new(SamplingParams::default());
    let limits = Limits {
        max_new,
        context_len: model.info.context_len,
    };
    generate(model, prompt, &mut sampler, &[EOS], &limits, sink).unwrap()
}

#[test]
fn worked_example_from_the_issue() {
    let mut model = Counting::new(8, 64);
    let mut sink = Collect::default();
    let g = run(&mut model, &[1, 2, 3], 20, &mut sink);
    assert_eq!(g.tokens, vec![4, 5, 6, 7, 8]);
    assert_eq!(
        sink.seen,
        vec![4, 5, 6, 7, 8],
        "EOS is neither printed nor kept"
    );
    assert_eq!(g.forward_passes, 6);
    assert_eq!(g.stop, StopReason::Eos);
    // One prefill pass of 3 tokens, then one pass per token at consecutive positions.
    assert_eq!(
        model.steps(),
        vec![(0, 3), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1)]
    );
    assert!(model.kv().is_idle(), "the sequence is ended");
    assert_eq!(model.kv_usage().blocks_used, 0, "its blocks are returned");
}

#[test]
fn a_reply_stopped_by_max_new_costs_n_passes() {
    for n in 1..=4 {
        let mut model = Counting::new(1000, 64);
        let g = run(&mut model, &[1, 2, 3], n, &mut Collect::default());
        assert_eq!(g.tokens.len(), n);
        assert_eq!(g.forward_passes, n);
        assert_eq!(g.stop, StopReason::MaxNew);
    }
}

#[test]
fn a_reply_ending_at_eos_costs_n_plus_one_passes_and_prompt_length_does_not_matter() {
    for prompt_len in [1usize, 5, 30] {
        let prompt: Vec<u32> = (1..=prompt_len as u32).collect();
        let mut model = Counting::new(prompt_len + 4, 64);
        let g = run(&mut model, &prompt, 100, &mut Collect::default());
        assert_eq!(g.tokens.len(), 4);
        assert_eq!(g.forward_passes, 5);
        assert_eq!(g.stop, StopReason::Eos);
    }
}

#[test]
fn eos_as_first_token_gives_an_empty_reply_in_one_pass() {
    let mut model = Counting::new(3, 64);
    let g = run(&mut model, &[1, 2, 3], 10, &mut Collect::default());
    assert!(g.tokens.is_empty());
    assert_eq!(g.forward_passes, 1);
    assert_eq!(g.stop, StopReason::Eos);
}

#[test]
fn a_full_context_window_stops_generation() {
    // Window of 6: prompt 3 plus reply 3; the reply's last token is never fed back.
    let mut model = Counting::new(1000, 6);
    let g = run(&mut model, &[1, 2, 3], 100, &mut Collect::default());
    assert_eq!(g.stop, StopReason::ContextFull);
    assert_eq!(g.tokens, vec![4, 5, 6]);
    assert_eq!(g.forward_passes, 3);
    assert_eq!(model.steps().last(), Some(&(4, 1)));
}

#[test]
fn the_sink_can_stop_and_cancel() {
    let mut model = Counting::new(1000, 64);
    let mut sink = Collect {
        stop_after: Some(2),
        ..Default::default()
    };
    let g = run(&mut model, &[1], 100, &mut sink);
    assert_eq!(
        (g.stop, g.tokens.len(), g.forward_passes),
        (StopReason::Stop, 2, 2)
    );

    let mut model = Counting::new(1000, 64);
    let mut sink = Collect {
        cancel_after: Some(3),
        ..Default::default()
    };
    let g = run(&mut model, &[1], 100, &mut sink);
    assert_eq!(
        (g.stop, g.tokens.len(), g.forward_passes),
        (StopReason::Interrupted, 3, 3)
    );

    let mut model = Counting::new(1000, 64);
    let mut sink = Collect {
        cancel_after: Some(0),
        ..Default::default()
    };
    let g = run(&mut model, &[1], 100, &mut sink);
    assert_eq!(
        (g.stop, g.tokens.len(), g.forward_passes),
        (StopReason::Interrupted, 0, 0)
    );
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let mut sampler = Sampler::new(SamplingParams::default());
    let mut model = Counting::new(8, 4);
    let mut sink = Collect::default();
    let limits = Limits {
        max_new: 5,
        context_len: 4,
    };
    assert!(generate(&mut model, &[], &mut sampler, &[EOS], &limits, &mut sink).is_err());
    assert!(generate(
        &mut model,
        &[1, 2, 3, 4],
        &mut sampler,
        &[EOS],
        &limits,
        &mut sink
    )
    .is_err());
    let zero = Limits {
        max_new: 0,
        context_len: 4,
    };
    assert!(generate(&mut model, &[1], &mut sampler, &[EOS], &zero, &mut sink).is_err());
}
