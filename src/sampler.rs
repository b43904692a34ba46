//! Sampling: turning a row of logits into the next token id.
//!
//! `SamplingParams` is plain data (what the user asked for); `Sampler` holds the random state.
//! Order of the filters follows llama.cpp's default chain: repetition penalty, top-k, then
//! temperature, top-p, min-p, and a draw. Temperature 0 is greedy (argmax), done on the
//! model's device so only one id crosses to the host.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

use crate::constraint::Constraint;

/// What the user asked for. Validated by `SamplingParams::validate`.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// In (0, 1]; 1 means no nucleus cut.
    pub top_p: f64,
    /// In [0, 1); 0 means no min-p cut.
    pub min_p: f64,
    /// 1.0 means off.
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalties look at.
    pub repeat_last_n: usize,
    /// OpenAI's presence penalty: subtracted once from the logit of every token seen in the
    /// last `repeat_last_n` (0: off; -2 to 2).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from a token's logit once per time it was seen
    /// there (0: off; -2 to 2).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!(
                "--temperature must be 0 (greedy) or positive, got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..1.0).contains(&self.min_p) {
            bail!("--min-p must be in [0, 1), got {}", self.min_p);
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            bail!(
                "--repeat-penalty must be positive, got {}",
                self.repeat_penalty
            );
        }
        for (name, v) in [
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                bail!("{name} must be in [-2, 2], as OpenAI's, got {v}");
            }
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    // Reused between calls so a decode step allocates nothing here.
    candidates: Vec<(u32, f32)>,
    /// A grammar the reply must follow: its mask comes before every other step.
    constraint: Option<Constraint>,
    /// How the grammar applies to the next token ([`Gate`]).
    gate: Gate,
    /// `--logprobs N`: alternatives kept per token (None: log-probabilities not recorded).
    logprobs: Option<usize>,
    /// The log-probabilities of the token sampled last, until taken.
    last: Option<TokenLogprob>,
    /// Score the prompt's own tokens too, with this many alternatives each.
    prompt_logprobs: Option<usize>,
}

/// A token's log-probability and the most likely alternatives with theirs, from the logits the
/// forward pass returned (before penalties, temperature, filters or a grammar's mask).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// The `N` most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// The entry of `id` from the row of logits it was chosen from, with `n` alternatives.
    pub fn of(row: &[f32], id: u32, n: usize) -> Self {
        let lse = log_sum_exp(row);
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
        if n > 0 {
            for (i, &l) in row.iter().enumerate() {
                if top.len() == n && l <= top[n - 1].1 {
                    continue;
                }
                let at = top.partition_point(|&(_, t)| t >= l);
                top.insert(at, (i as u32, l));
                top.truncate(n);
            }
        }
        let lp = |l: f32| (f64::from(l) - lse) as f32;
        Self {
            id,
            logprob: lp(row[id as usize]),
            top: top.into_iter().map(|(i, l)| (i, lp(l))).collect(),
        }
    }
}

/// `ln(sum(exp(row)))`, the maximum taken out first, summed in f64.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
    f64::from(max) + sum.ln()
}

/// How a grammar applies to the next token. A reply that thinks first is held to its grammar
/// only once its thinking is over: the grammar constrains the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gate {
    /// The grammar masks the token and is told of it.
    #[default]
    Apply,
    /// Thinking: the grammar neither masks nor sees the token.
    Pause,
    /// The grammar's tokens, or this one (a thinking block's open marker); the grammar is told
    /// of the token only if it is one of its own.
    ApplyOr(u32),
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            rng: SplitMix64(params.seed),
            params,
            candidates: Vec::new(),
            constraint: None,
            gate: Gate::Apply,
            logprobs: None,
            last: None,
            prompt_logprobs: None,
        }
    }

    /// Also score the prompt: each of its tokens' log-probability given those before it, with
    /// `n` alternatives (vLLM's `prompt_logprobs`).
    pub fn with_prompt_logprobs(mut self, n: Option<usize>) -> Self {
        self.prompt_logprobs = n;
        self
    }

    /// Alternatives per prompt token when the prompt is scored.
    pub fn prompt_logprobs(&self) -> Option<usize> {
        self.prompt_logprobs
    }

    /// Record each sampled token's log-probability and its `n` most likely alternatives
    /// (`--logprobs N`); taken with [`Sampler::take_logprob`].
    pub fn with_logprobs(mut self, n: Option<usize>) -> Self {
        self.logprobs = n;
        self
    }

    /// The log-probabilities of the token sampled last (None without `with_logprobs`).
    pub fn take_logprob(&mut self) -> Option<TokenLogprob> {
        self.last.take()
    }

    /// Whether sampled tokens' log-probabilities are recorded.
    pub fn records_logprobs(&self) -> bool {
        self.logprobs.is_some()
    }

    /// How the grammar (if any) applies to the next token.
    pub fn set_gate(&mut self, gate: Gate) {
        self.gate = gate;
    }

    /// Sample only what `constraint` allows, and tell it each token sampled.
    pub fn with_constraint(mut self, constraint: Constraint) -> Self {
        self.constraint = Some(constraint);
        self
    }

    pub fn constraint(&self) -> Option<&Constraint> {
        self.constraint.as_ref()
    }

    /// Whether the grammar (if any) is complete: the reply must end here.
    pub fn grammar_complete(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::finished)
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Pick the next token from `logits` (vocab,) or (1, vocab); `history` is the sequence so far
    /// (prompt and reply), which the repetition penalty looks at.
    pub fn sample(&mut self, logits: &Tensor, history: &[u32]) -> Result<u32> {
        let logits = logits.flatten_all()?;
        if self.is_plain_argmax() {
            return Ok(crate::model::cpu::ops::argmax_rows(&logits)?[0]);
        }
        let mut row = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        self.sample_host(&mut row, history)
    }

    /// Whether `sample` picks the largest logit as it is (greedy, no repetition penalty): then
    /// whoever holds the logits may take the argmax where they are, for many rows at once.
    pub fn is_plain_argmax(&self) -> bool {
        let p = &self.params;
        let penalised =
            (p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0)
                && p.repeat_last_n > 0;
        self.params.is_greedy()
            && !penalised
            && self.constraint.is_none()
            && self.logprobs.is_none()
    }

    /// `sample` on a row of logits already on the host (changed in place).
    pub fn sample_row(&mut self, row: &mut [f32], history: &[u32]) -> Result<u32> {
        self.sample_host(row, history)
    }

    fn sample_host(&mut self, row: &mut [f32], history: &[u32]) -> Result<u32> {
        if row.is_empty() {
            bail!("the model returned no logits");
        }
        let Some(n) = self.logprobs else {
            return self.pick(row, history);
        };
        let raw = row.to_vec();
        let id = self.pick(row, history)?;
        self.last = Some(TokenLogprob::of(&raw, id, n));
        Ok(id)
    }

    fn pick(&mut self, row: &mut [f32], history: &[u32]) -> Result<u32> {
        let (Some(constraint), false) = (self.constraint.as_mut(), self.gate == Gate::Pause) else {
            return self.draw(row, history);
        };
        let also = match self.gate {
            Gate::ApplyOr(id) => row.get(id as usize).map(|&v| (id, v)),
            _ => None,
        };
        constraint.apply(row)?;
        if let Some((id, v)) = also {
            row[id as usize] = v;
        }
        let id = self.draw(row, history)?;
        if also.is_some_and(|(open, _)| open == id) {
            return Ok(id); // the thinking block opens: the grammar waits for the answer
        }
        let constraint = self.constraint.as_mut().expect("checked");
        constraint.commit(id)?;
        Ok(id)
    }

    /// The distribution `sample` draws from for `row` after `history`, the grammar's mask
    /// aside: (id, probability) of every token it may pick, most likely first. Greedy: the
    /// one token it picks, with probability 1.
    pub fn distribution(&mut self, row: &[f32], history: &[u32]) -> Result<Vec<(u32, f64)>> {
        let mut row = row.to_vec();
        Ok(match self.weigh(&mut row, history)? {
            Weighed::Greedy(id) => vec![(id, 1.0)],
            Weighed::Candidates(total) => self
                .candidates
                .iter()
                .map(|&(id, w)| (id, f64::from(w) / f64::from(total)))
                .collect(),
        })
    }

    fn draw(&mut self, row: &mut [f32], history: &[u32]) -> Result<u32> {
        let total = match self.weigh(row, history)? {
            Weighed::Greedy(id) => return Ok(id),
            Weighed::Candidates(total) => total,
        };
        let c = &self.candidates;
        let mut r = self.rng.next_f32() * total;
        for e in c.iter() {
            r -= e.1;
            if r <= 0.0 {
                return Ok(e.0);
            }
        }
        Ok(c[c.len() - 1].0)
    }

    /// Every step before the draw, in one place for `draw` and `distribution`: repetition
    /// penalty, then greedy's pick, or the candidates (in `self.candidates`, most likely first,
    /// with weights summing to the returned total) after top-k, temperature, top-p and min-p.
    fn weigh(&mut self, row: &mut [f32], history: &[u32]) -> Result<Weighed> {
        let p = &self.params;
        if p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = history[start..].to_vec();
            seen.sort_unstable();
            // Each seen token once, with how often it was seen, as llama.cpp's penalties
            // sampler counts them over the same window.
            for run in seen.chunk_by(|a, b| a == b) {
                let Some(l) = row.get_mut(run[0] as usize) else {
                    continue;
                };
                if p.repeat_penalty != 1.0 {
                    // As in llama.cpp and the CTRL paper: shrink a positive logit, grow a
                    // negative one.
                    *l = if *l > 0.0 {
                        *l / p.repeat_penalty
                    } else {
                        *l * p.repeat_penalty
                    };
                }
                *l -= run.len() as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
        if p.is_greedy() {
            return Ok(Weighed::Greedy(argmax(row)));
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            row.iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(i, &l)| (i as u32, l)),
        );
        if c.is_empty() {
            bail!("every logit is NaN: the model's output is broken");
        }
        // Sort by logit, highest first; ties by id so results never depend on sort stability.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        // Softmax with temperature, in place: logits become probabilities.
        let max = c[0].1;
        let inv_t = 1.0 / p.temperature as f32;
        let mut sum = 0f32;
        for e in c.iter_mut() {
            e.1 = ((e.1 - max) * inv_t).exp();
            sum += e.1;
        }
        for e in c.iter_mut() {
            e.1 /= sum;
        }
        if p.top_p < 1.0 {
            let mut acc = 0f32;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                acc += e.1;
                if acc >= p.top_p as f32 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = c[0].1 * p.min_p as f32;
            let keep = c.iter().take_while(|e| e.1 >= floor).count().max(1);
            c.truncate(keep);
        }
        Ok(Weighed::Candidates(c.iter().map(|e| e.1).sum()))
    }
}

/// What `Sampler::weigh` left to draw from.
enum Weighed {
    Greedy(u32),
    /// In `Sampler::candidates`, with their total weight.
    Candidates(f32),
}

/// The rows of logits of one forward pass, ready to be sampled one at a time in order: their
/// argmax already taken where that is all the sampler does (one scan of every row on the
/// device), otherwise on the host.
pub enum Rows {
    Argmax(Vec<u32>),
    Host(Vec<Vec<f32>>),
}

impl Rows {
    /// `logits`: (rows, vocab), to be sampled by `sampler`.
    pub fn new(logits: &Tensor, sampler: &Sampler) -> Result<Self> {
        let logits = match logits.rank() {
            1 => logits.unsqueeze(0)?,
            _ => logits.clone(),
        };
        Ok(if sampler.is_plain_argmax() {
            Rows::Argmax(crate::model::cpu::ops::argmax_rows(&logits)?)
        } else {
            Rows::Host(logits.to_dtype(DType::F32)?.to_vec2::<f32>()?)
        })
    }

    pub fn len(&self) -> usize {
        match self {
            Rows::Argmax(v) => v.len(),
            Rows::Host(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `sampler.sample` on row `i` (each row is sampled once: a host row is changed in place).
    pub fn sample(&mut self, i: usize, sampler: &mut Sampler, history: &[u32]) -> Result<u32> {
        match self {
            Rows::Argmax(v) => Ok(v[i]),
            Rows::Host(v) => sampler.sample_row(&mut v[i], history),
        }
    }
}

/// The index of the largest value (the first of equal ones).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A small, fast, seedable generator (Steele, Lea and Flood's SplitMix64): the same seed gives
/// the same stream on every platform, which is all reproducible sampling needs.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn logprobs_are_a_log_softmax_of_the_raw_logits() {
        let row = [0.5f32, 3.0, -1.0, 2.0, 3.0, -7.5];
        let z: f64 = row.iter().map(|&l| f64::from(l).exp()).sum();
        let want = |i: usize| (f64::from(row[i]) - z.ln()) as f32;
        // Penalties and a low temperature change the draw, not the recorded values.
        let params = SamplingParams {
            temperature: 0.3,
            repeat_penalty: 1.5,
            seed: 7,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params).with_logprobs(Some(3));
        let id = s.sample(&logits(&row), &[1, 4]).unwrap();
        let got = s.take_logprob().unwrap();
        assert_eq!(got.id, id);
        assert!((got.logprob - want(id as usize)).abs() < 1e-6);
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 4, 3], "most likely first, ties by id");
        for (i, lp) in &got.top {
            assert!((lp - want(*i as usize)).abs() < 1e-6);
        }
        assert!(s.take_logprob().is_none(), "taken once");
        // Greedy: the top alternative is the token chosen, at every step.
        let mut g = Sampler::new(SamplingParams::default()).with_logprobs(Some(1));
        assert!(!g.is_plain_argmax(), "the rows must reach the host");
        let id = g.sample(&logits(&row), &[]).unwrap();
        assert_eq!(g.take_logprob().unwrap().top[0].0, id);
        // No alternatives asked: the token's own value still.
        assert!(TokenLogprob::of(&row, 2, 0).top.is_empty());
    }

    #[test]
    fn greedy_picks_the_largest() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits(&[0.1, 3.0, -1.0, 2.9]), &[]).unwrap(), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_are_openais() {
        let with = |presence: f32, frequency: f32| {
            let p = SamplingParams {
                presence_penalty: presence,
                frequency_penalty: frequency,
                ..Default::default()
            };
            let mut row = vec![0.1, 3.0, -1.0, 2.9];
            // Token 1 seen twice, token 2 once, in the window.
            let id = Sampler::new(p).sample_row(&mut row, &[1, 2, 1]).unwrap();
            (id, row)
        };
        // Presence: once per seen token. 3.0 - 0.2 = 2.8 < 2.9.
        let (id, row) = with(0.2, 0.0);
        assert_eq!((id, row[1], row[2]), (3, 3.0 - 0.2, -1.0 - 0.2));
        // Frequency: once per time seen. 3.0 - 2 * 0.04 = 2.92 > 2.9; -1 - 0.04.
        let (id, row) = with(0.0, 0.04);
        assert_eq!((id, row[1], row[2]), (1, 3.0 - 2.0 * 0.04, -1.0 - 0.04));
        // Both, as llama.cpp adds them; negative values encourage.
        let (_, row) = with(-0.5, 0.25);
        assert_eq!(row[1], 3.0 - (2.0 * 0.25 - 0.5));
        assert_eq!(row[3], 2.9, "an unseen token is left alone");
        // Out of OpenAI's range: a usage error.
        let bad = SamplingParams {
            frequency_penalty: 2.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn repeat_penalty_can_change_the_greedy_choice() {
        let p = SamplingParams {
            repeat_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        // Token 1 (3.0) was just said: it drops to 1.5, below token 3's 2.9.
        assert_eq!(s.sample(&logits(&[0.1, 3.0, -1.0, 2.9]), &[1]).unwrap(), 3);
        // Outside the window it is not penalised.
        let p = SamplingParams {
            repeat_penalty: 2.0,
            repeat_last_n: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        assert_eq!(
            s.sample(&logits(&[0.1, 3.0, -1.0, 2.9]), &[1, 0]).unwrap(),
            1
        );
    }

    #[test]
    fn same_seed_same_draws_and_top_k_one_is_greedy() {
        let p = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        let row: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..20)
                .map(|_| s.sample(&logits(&row), &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        let other = SamplingParams {
            seed: 43,
            ..p.clone()
        };
        assert_ne!(draw(&p), draw(&other));
        let k1 = SamplingParams { top_k: 1, ..p };
        let best = argmax(&row);
        assert!(draw(&k1).iter().all(|&t| t == best));
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // Probabilities at T=1 are about [0.844, 0.114, 0.042]: top-p 0.5 keeps only the first.
        let row = [3.0f32, 1.0, 0.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        assert!((0..200).all(|_| s.sample(&logits(&row), &[]).unwrap() == 0));
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.2,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        assert!((0..200).all(|_| s.sample(&logits(&row), &[]).unwrap() == 0));
        // Without cuts all three appear.
        let p = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let mut seen = [false; 3];
        for _ in 0..2000 {
            seen[s.sample(&logits(&row), &[]).unwrap() as usize] = true;
        }
        assert_eq!(seen, [true, true, true]);
    }

    #[test]
    fn validation_rejects_bad_values() {
        let bad = [
            SamplingParams {
                temperature: -0.1,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.0,
                ..Default::default()
            },
            SamplingParams {
                repeat_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: f64::NAN,
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?}");
        }
        assert!(SamplingParams::default().validate().is_ok());
    }

    #[test]
    fn a_constraint_masks_before_every_other_step() {
        use crate::constraint::{byte_constraint, Spec};
        // The model wants 'z' most; the grammar allows only digits, and '7' is the best of them.
        let mut row = vec![0.0f32; 262];
        row[usize::from(b'z')] = 10.0;
        row[usize::from(b'7')] = 5.0;
        row[usize::from(b'3')] = 4.0;
        let greedy = SamplingParams::default();
        let mut s = Sampler::new(greedy.clone())
            .with_constraint(byte_constraint(&Spec::Regex("[0-9]{2}".into())));
        assert!(
            !s.is_plain_argmax(),
            "a constrained row must reach the host"
        );
        assert_eq!(s.sample(&logits(&row), &[]).unwrap(), u32::from(b'7'));
        assert!(!s.grammar_complete());
        assert_eq!(s.sample(&logits(&row), &[]).unwrap(), u32::from(b'7'));
        assert!(s.grammar_complete(), "two digits and the regex is done");

        // Sampling: every draw is one the grammar allows, whatever the temperature.
        let hot = SamplingParams {
            temperature: 5.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 3,
            ..greedy
        };
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..200 {
            let mut s = Sampler::new(SamplingParams {
                seed: i,
                ..hot.clone()
            })
            .with_constraint(byte_constraint(&Spec::Regex("[ab]".into())));
            let id = s.sample(&logits(&row), &[]).unwrap();
            assert!(id == u32::from(b'a') || id == u32::from(b'b'), "drew {id}");
            seen.insert(id);
        }
        assert_eq!(seen.len(), 2, "both allowed tokens are drawn");
    }

    #[test]
    fn the_gate_holds_the_grammar_back_while_the_reply_thinks() {
        use crate::constraint::{byte_constraint, Spec};
        // 'z' stands for a thinking block's open marker (one token), '<' for thinking text.
        let mut row = vec![0.0f32; 262];
        row[usize::from(b'z')] = 10.0;
        row[usize::from(b'<')] = 9.0;
        row[usize::from(b'7')] = 5.0;
        let mut s = Sampler::new(SamplingParams::default())
            .with_constraint(byte_constraint(&Spec::Regex("[0-9]{2}".into())));
        // Before anything is written: the grammar's tokens, or the open marker.
        s.set_gate(Gate::ApplyOr(u32::from(b'z')));
        assert_eq!(s.sample(&logits(&row), &[]).unwrap(), u32::from(b'z'));
        // Thinking: no mask, and the grammar sees nothing.
        s.set_gate(Gate::Pause);
        assert_eq!(s.sample(&logits(&row), &[]).unwrap(), u32::from(b'z'));
        assert!(!s.grammar_complete());
        // The answer: held to the grammar from its start (two digits, not one).
        s.set_gate(Gate::Apply);
        assert_eq!(s.sample(&logits(&row), &[]).unwrap(), u32::from(b'7'));
        assert!(
            !s.grammar_complete(),
            "the marker and the thinking were not committed"
        );
        assert_eq!(s.sample(&logits(&row), &[]).unwrap(), u32::from(b'7'));
        assert!(s.grammar_complete());
        // Once the answer began, the open marker is not let through.
        let mut s = Sampler::new(SamplingParams::default())
            .with_constraint(byte_constraint(&Spec::Regex("[0-9]{2}".into())));
        s.set_gate(Gate::Apply);
        assert_eq!(s.sample(&logits(&row), &[]).unwrap(), u32::from(b'7'));
    }
}
