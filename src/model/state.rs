//! The recurrent half of a sequence's memory: what a hybrid model's recurrent layers (LFM2's
//! short convolutions, Gated DeltaNet) carry from one token to the next, kept per sequence
//! beside its blocks in the paged KV cache ([`super::kv_cache`]).
//!
//! A layer's state folds in every token before it, so unlike keys and values it cannot be cut
//! back by forgetting rows. What the generation loop needs of it:
//! - a sequence starts from zeros (every step at position 0 starts it afresh);
//! - a step must start where the state ends: anything else (a prefix taken from a cache that
//!   kept no state) is refused, never run from the wrong state;
//! - a step of several decode tokens (speculation's check, forced tokens) keeps a log: the
//!   state before it and each token's input to every recurrence, so that a rollback to any
//!   token of that step restores the state before it and replays the kept inputs through the
//!   same arithmetic ([`super::recurrent::replay`]), bit for bit what a run that stopped there
//!   would hold. A rollback the log cannot serve marks the sequence lost: its next step is
//!   refused with the reason.
//!
//! - a prompt chunk copies its state at the last block end inside it; once that block is
//!   published, the copy is kept beside it (at most [`KEPT_STATES`] copies or [`KEPT_BYTES`]),
//!   and a sequence that takes the cached blocks starts from it ([`States::restore`]).
//!
//! Memory: per sequence, each recurrent layer's state ([`super::config::Mixer::state_floats`]
//! floats), plus during a logged step one more copy and the tokens' inputs.

use std::collections::HashMap;

use anyhow::{bail, Result};

use super::SeqId;

/// One step of a pass as the states see it.
#[derive(Debug, Clone, Copy)]
pub struct PassStep {
    pub seq: SeqId,
    pub pos: usize,
    /// A step of several decode tokens: its inputs are logged for a rollback.
    pub log: bool,
    /// A prefill step's last block end inside it (the position of that block's last token).
    pub snap_at: Option<usize>,
}

/// One sequence's recurrent state.
#[derive(Debug, Clone, Default)]
pub struct SeqState {
    /// Per layer, the state after `len` tokens (empty for layers with attention).
    pub layers: Vec<Vec<f32>>,
    /// Tokens folded in.
    pub len: usize,
    /// The log of the last step of several decode tokens, while it may be rolled back.
    log: Option<Log>,
    /// Why the state no longer matches the sequence's tokens, after a rollback it could not do.
    lost: Option<String>,
    /// A prefill step's last block boundary inside it: the position of the token after which
    /// each recurrent layer copies its state into `snap` (what the prefix cache keeps).
    pub snap_at: Option<usize>,
    pub snap: Vec<Vec<f32>>,
}

#[derive(Debug, Clone)]
struct Log {
    /// The state's length before the step, and its layers then.
    start: usize,
    layers: Vec<Vec<f32>>,
    /// Per layer, per token of the step: the token's input to the recurrence.
    inputs: Vec<Vec<Vec<f32>>>,
}

impl SeqState {
    /// Whether the token at `pos` ends the block whose state the step keeps.
    pub fn snaps_after(&self, pos: usize) -> bool {
        self.snap_at == Some(pos)
    }

    /// Record `input`, token `t`'s input to layer `l`'s recurrence, when this step is logged.
    pub fn record(&mut self, l: usize, input: &[f32]) {
        if let Some(log) = &mut self.log {
            log.inputs[l].push(input.to_vec());
        }
    }
}

/// Every live sequence's recurrent state, and the states kept at the ends of published
/// blocks for the prefix cache.
#[derive(Debug, Default)]
pub struct States {
    /// Floats of state per layer (0: attention).
    sizes: Vec<usize>,
    seqs: HashMap<SeqId, SeqState>,
    /// Per sequence, the state its last prefill step kept at a block's end: (tokens, layers).
    pending: HashMap<SeqId, (usize, Vec<Vec<f32>>)>,
    /// States at the end of published blocks, by block id.
    kept: HashMap<u32, Kept>,
    clock: u64,
}

/// The state after a published block: valid while the block holds the chain `key`.
#[derive(Debug)]
struct Kept {
    key: u64,
    len: usize,
    layers: Vec<Vec<f32>>,
    used: u64,
}

/// The most states kept for the prefix cache, and the most bytes they may take: the least
/// recently used go first.
pub const KEPT_STATES: usize = 16;
pub const KEPT_BYTES: usize = 512 << 20;

impl States {
    /// States for a model whose layer `l` keeps `sizes[l]` floats per sequence.
    pub fn new(sizes: Vec<usize>) -> Self {
        Self {
            sizes,
            ..Default::default()
        }
    }

    /// Whether the model keeps any state (a hybrid model).
    pub fn any(&self) -> bool {
        self.sizes.iter().any(|&s| s > 0)
    }

    fn zeros(&self) -> Vec<Vec<f32>> {
        self.sizes.iter().map(|&n| vec![0f32; n]).collect()
    }

    /// Forget `seq`'s state (the sequence ended).
    pub fn free(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        self.pending.remove(&seq);
    }

    /// The states of a pass's steps, in step order. A step at position 0 starts from zeros; any
    /// other must start where its sequence's state ends.
    pub fn for_pass(&mut self, steps: &[PassStep]) -> Result<Vec<&mut SeqState>> {
        for &PassStep {
            seq,
            pos,
            log,
            snap_at,
        } in steps
        {
            if pos == 0 {
                let fresh = SeqState {
                    layers: self.zeros(),
                    ..Default::default()
                };
                self.seqs.insert(seq, fresh);
            }
            let Some(s) = self.seqs.get_mut(&seq) else {
                bail!(
                    "sequence {seq} starts at token {pos} without the recurrent state of the \
                     tokens before it (this model keeps no state for a cached prefix)"
                );
            };
            if let Some(why) = &s.lost {
                bail!("sequence {seq}: {why}");
            }
            if s.len != pos {
                bail!(
                    "sequence {seq}'s recurrent state holds {} tokens but the step starts at {pos}",
                    s.len
                );
            }
            s.log = log.then(|| Log {
                start: pos,
                layers: s.layers.clone(),
                inputs: vec![Vec::new(); s.layers.len()],
            });
            s.snap_at = snap_at;
            s.snap = match snap_at {
                Some(_) => vec![Vec::new(); s.layers.len()],
                None => Vec::new(),
            };
        }
        let mut out: Vec<&mut SeqState> = Vec::with_capacity(steps.len());
        let mut by_seq: HashMap<SeqId, &mut SeqState> =
            self.seqs.iter_mut().map(|(k, v)| (*k, v)).collect();
        for step in steps {
            out.push(
                by_seq
                    .remove(&step.seq)
                    .expect("checked above, each sequence once"),
            );
        }
        Ok(out)
    }

    /// After a pass: `seq`'s state now folds in `n` more tokens; a state its step kept at a
    /// block's end waits for the block to be published.
    pub fn advance(&mut self, seq: SeqId, n: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len += n;
            if let Some(at) = s.snap_at.take() {
                let layers = std::mem::take(&mut s.snap);
                let whole = layers.iter().zip(&self.sizes).all(|(l, &n)| l.len() == n);
                if whole {
                    self.pending.insert(seq, (at + 1, layers));
                }
            }
        }
    }

    /// `seq`'s blocks were published: keep the state its last prefill kept at the end of
    /// block `block` (chain `key`, `len` tokens), if that is where it was kept.
    pub fn keep(&mut self, seq: SeqId, len: usize, block: u32, key: u64) {
        match self.pending.get(&seq) {
            Some((at, _)) if *at == len => {}
            _ => return,
        }
        let (_, layers) = self.pending.remove(&seq).expect("just seen");
        self.clock += 1;
        let used = self.clock;
        self.kept.insert(
            block,
            Kept {
                key,
                len,
                layers,
                used,
            },
        );
        let bytes = |k: &Kept| k.layers.iter().map(|l| l.len() * 4).sum::<usize>();
        while self.kept.len() > KEPT_STATES
            || self.kept.values().map(bytes).sum::<usize>() > KEPT_BYTES
        {
            let oldest = self
                .kept
                .iter()
                .min_by_key(|(_, k)| k.used)
                .map(|(b, _)| *b);
            self.kept.remove(&oldest.expect("not empty"));
        }
    }

    /// How many of the published blocks `found` (with their current chain keys) a sequence
    /// can take: up to the last one whose state is kept.
    pub fn restorable(&self, found: &[(u32, u64)]) -> usize {
        found
            .iter()
            .rposition(|(b, key)| self.kept.get(b).is_some_and(|k| k.key == *key))
            .map_or(0, |i| i + 1)
    }

    /// `seq` starts from the state kept at the end of `block`.
    pub fn restore(&mut self, seq: SeqId, block: u32) {
        self.clock += 1;
        let Some(k) = self.kept.get_mut(&block) else {
            return;
        };
        k.used = self.clock;
        let s = SeqState {
            layers: k.layers.clone(),
            len: k.len,
            ..Default::default()
        };
        self.seqs.insert(seq, s);
    }

    /// Roll `seq` back to its first `len` tokens. `replay(layer, state, input)` folds one
    /// logged input into a layer's state, as the pass did.
    pub fn truncate(
        &mut self,
        seq: SeqId,
        len: usize,
        mut replay: impl FnMut(usize, &mut [f32], &[f32]),
    ) {
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        if len >= s.len {
            return;
        }
        let Some(log) = s.log.as_ref().filter(|l| l.start <= len) else {
            s.lost = Some(format!(
                "its recurrent state cannot go back from {} tokens to {len} (only within the \
                 last step of several decode tokens)",
                s.len
            ));
            return;
        };
        let keep = len - log.start;
        let mut layers = log.layers.clone();
        for (l, state) in layers.iter_mut().enumerate() {
            for input in log.inputs[l].iter().take(keep) {
                replay(l, state, input);
            }
        }
        s.layers = layers;
        s.len = len;
        // Another rollback within the same step may follow (to a shorter length still).
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy recurrence: the state is a running sum of the inputs.
    fn add(_: usize, state: &mut [f32], input: &[f32]) {
        for (s, x) in state.iter_mut().zip(input) {
            *s += x;
        }
    }

    fn pass(states: &mut States, seq: SeqId, pos: usize, inputs: &[f32], log: bool) {
        let step = PassStep {
            seq,
            pos,
            log,
            snap_at: None,
        };
        let mut views = states.for_pass(&[step]).unwrap();
        let s = &mut views[0];
        for &x in inputs {
            s.record(0, &[x]);
            add(0, &mut s.layers[0], &[x]);
        }
        states.advance(seq, inputs.len());
    }

    #[test]
    fn a_logged_step_rolls_back_to_any_of_its_tokens() {
        let mut st = States::new(vec![1, 0]);
        pass(&mut st, 3, 0, &[1.0, 2.0], false);
        pass(&mut st, 3, 2, &[10.0, 20.0, 40.0], true);
        assert_eq!(st.seqs[&3].layers[0], [73.0]);
        st.truncate(3, 4, add);
        assert_eq!((st.seqs[&3].len, st.seqs[&3].layers[0][0]), (4, 33.0));
        st.truncate(3, 2, add);
        assert_eq!((st.seqs[&3].len, st.seqs[&3].layers[0][0]), (2, 3.0));
        // It goes on from there.
        pass(&mut st, 3, 2, &[5.0], false);
        assert_eq!(st.seqs[&3].layers[0], [8.0]);
    }

    #[test]
    fn what_cannot_be_rolled_back_is_refused_not_run() {
        let mut st = States::new(vec![1]);
        pass(&mut st, 0, 0, &[1.0, 2.0, 3.0], false);
        st.truncate(0, 1, add);
        let step = |seq, pos| PassStep {
            seq,
            pos,
            log: false,
            snap_at: None,
        };
        let err = st.for_pass(&[step(0, 1)]).unwrap_err().to_string();
        assert!(err.contains("cannot go back from 3 tokens to 1"), "{err}");
        // A step that does not start where the state ends is refused too.
        pass(&mut st, 1, 0, &[1.0], false);
        let err = st.for_pass(&[step(1, 4)]).unwrap_err().to_string();
        assert!(
            err.contains("holds 1 tokens but the step starts at 4"),
            "{err}"
        );
        let err = st.for_pass(&[step(9, 16)]).unwrap_err().to_string();
        assert!(err.contains("without the recurrent state"), "{err}");
        // Starting again from position 0 is always possible.
        pass(&mut st, 0, 0, &[4.0], false);
        assert_eq!(st.seqs[&0].layers[0], [4.0]);
    }
}
