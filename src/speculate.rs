//! Lookup drafting for speculative decoding (`--speculate lookup`): guess the next few tokens of
//! a reply from earlier text of the same sequence, so that one forward pass can check several.
//!
//! A reply that copies (rewrites a given text, quotes it, fixes a line of given code) repeats
//! runs of tokens that are already in its prompt or earlier in the reply. The drafter looks for
//! the most recent earlier place where the sequence's last `n` tokens occurred, longest `n`
//! first, and proposes what followed there. The generation loop then feeds the last sampled
//! token and the proposals in one pass, keeps the proposals the model agrees with, and takes
//! the model's own token at the first disagreement (see `generate`): the output is the model's
//! whatever the drafter proposes; only the number of passes changes.
//!
//! Cost: every sequence position is indexed once (a hash table per n-gram length, from the
//! n-gram to the position after its latest occurrence), so a lookup is a few hash probes
//! whatever the length of the sequence.
//!
//! Adapting: a pass costs more the more tokens it feeds (on a CPU each one adds compute; see
//! docs/speed.md's figures), and a rejected proposal bought nothing. So the draft length adapts:
//! it doubles (up to the maximum) after a draft kept whole, and after a rejection it halves,
//! or drops to one more than what was kept if that is longer. A first draft rejected outright
//! only shortens the next (a copy that diverged for a word often resumes at once); from the
//! second such pass in a row on, the drafter stays silent for a growing number of steps (2, 4,
//! 8, ... up to [`MAX_PAUSE`]); any accepted proposal resets that. Free text, where matches are
//! rare and mostly wrong, thus runs almost entirely as plain one-token passes, and its few
//! drafts are short.

use std::collections::HashMap;

/// Longest suffix matched. Four tokens pin down a place in the text well; longer matches
/// rarely add anything a four-token match misses.
pub const NGRAM_MAX: usize = 4;
/// Shortest suffix matched. One token (" the", ",") occurs everywhere and proposes noise;
/// two tokens already locate a copy in progress reliably.
pub const NGRAM_MIN: usize = 2;
/// Most steps the drafter stays silent after proposals keep failing.
pub const MAX_PAUSE: u32 = 32;

/// What a drafter proposed and what was kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftStats {
    /// Passes that carried proposals.
    pub drafts: usize,
    /// Tokens proposed in those passes.
    pub proposed: usize,
    /// Of those, tokens the model agreed with (each one saved a pass).
    pub accepted: usize,
}

impl DraftStats {
    pub fn add(&mut self, other: &DraftStats) {
        self.drafts += other.drafts;
        self.proposed += other.proposed;
        self.accepted += other.accepted;
    }
}

/// The drafter of one sequence.
#[derive(Debug, Clone)]
pub struct Drafter {
    /// Most tokens proposed at once.
    max: usize,
    /// Per n-gram length (index n - NGRAM_MIN): hash of the n tokens -> the position after
    /// their most recent occurrence (whose token exists).
    index: Vec<HashMap<u64, usize>>,
    /// Positions indexed so far: the n-grams ending before each of 1..indexed.
    indexed: usize,
    /// Most tokens the next draft proposes: adapts between 1 and `max` (see `record`).
    len: usize,
    /// Passes in a row whose proposals were all rejected.
    fails: u32,
    /// Steps to stay silent.
    pause: u32,
    pub stats: DraftStats,
}

impl Drafter {
    /// A drafter proposing at most `max` tokens at once (at least 1).
    pub fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            index: vec![HashMap::new(); NGRAM_MAX - NGRAM_MIN + 1],
            indexed: 1,
            len: max.max(1),
            fails: 0,
            pause: 0,
            stats: DraftStats::default(),
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Proposals for the tokens after `history` (the sequence so far: prompt and reply, its
    /// last token the one about to be fed), at most `limit` of them (and at most `max`).
    /// Empty when nothing matches, when `limit` is 0, or while backing off. `history` must
    /// extend the history of the previous call.
    pub fn propose(&mut self, history: &[u32], limit: usize) -> Vec<u32> {
        self.index_up_to(history);
        let limit = limit.min(self.len);
        if limit == 0 {
            return Vec::new();
        }
        if self.pause > 0 {
            self.pause -= 1;
            return Vec::new();
        }
        let len = history.len();
        for n in (NGRAM_MIN..=NGRAM_MAX.min(len)).rev() {
            let suffix = &history[len - n..];
            let Some(&after) = self.index[n - NGRAM_MIN].get(&hash(suffix)) else {
                continue;
            };
            // A hash collision is no match: check the tokens themselves.
            if after < n || history[after - n..after] != *suffix {
                continue;
            }
            let end = (after + limit).min(len);
            return history[after..end].to_vec();
        }
        Vec::new()
    }

    /// Say how a pass's `proposed` proposals went: `accepted` of them were kept.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.stats.drafts += 1;
        self.stats.proposed += proposed;
        self.stats.accepted += accepted;
        if accepted == proposed {
            self.len = (self.len * 2).min(self.max);
        } else {
            self.len = (accepted + 1).max(self.len / 2);
        }
        if accepted > 0 {
            self.fails = 0;
        } else {
            // A copy that diverged for a word often resumes at once: the first outright
            // rejection only shortens the drafts; the pause starts at the second in a row.
            self.fails = self.fails.saturating_add(1);
            self.pause = 1u32
                .checked_shl(self.fails - 1)
                .unwrap_or(MAX_PAUSE)
                .min(MAX_PAUSE);
            if self.fails == 1 {
                self.pause = 0;
            }
        }
    }

    /// Index every n-gram of `history` that has a token after it (the last token's own
    /// n-grams wait for the token after them).
    fn index_up_to(&mut self, history: &[u32]) {
        debug_assert!(self.indexed <= history.len().max(1), "history only grows");
        for after in self.indexed..history.len() {
            for n in NGRAM_MIN..=NGRAM_MAX.min(after) {
                let gram = &history[after - n..after];
                self.index[n - NGRAM_MIN].insert(hash(gram), after);
            }
        }
        self.indexed = self.indexed.max(history.len());
    }
}

/// A hash of a few token ids (FNV-1a over their bytes): fast, and good enough for keys that
/// are checked against the tokens on a hit.
fn hash(tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_occurrence_longest_match_first() {
        let mut d = Drafter::new(4);
        // "1 2 3 4 5 6 | 9 2 3 7 8 | ... 1 2 3": the 3-gram "1 2 3" occurred at the start; the
        // 2-gram "2 3" occurred later too (followed by 7 8), but the longer match wins.
        let h = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 1, 2, 3];
        assert_eq!(d.propose(&h, 8), vec![4, 5, 6, 9]);
        // Only "2 3" matches: the most recent occurrence is followed by 7 8.
        let mut d = Drafter::new(4);
        let h = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 5, 2, 3];
        assert_eq!(d.propose(&h, 8), vec![7, 8, 0, 5]);
        // The limit caps the proposal; so does the end of the history.
        assert_eq!(Drafter::new(8).propose(&h, 2), vec![7, 8]);
        let h = [7, 1, 2, 9, 1, 2];
        assert_eq!(Drafter::new(8).propose(&h, 8), vec![9, 1, 2]);
    }

    #[test]
    fn no_match_no_proposal_and_single_tokens_do_not_match() {
        let mut d = Drafter::new(8);
        assert!(d.propose(&[], 8).is_empty());
        assert!(d.propose(&[5], 8).is_empty());
        // 5 occurred before, but a one-token match is not enough.
        assert!(d.propose(&[5, 6, 7, 5], 8).is_empty());
        assert!(d.propose(&[5, 6, 7, 5, 8], 8).is_empty());
        assert_eq!(d.propose(&[5, 6, 7, 5, 8, 5, 6], 8), vec![7, 5, 8, 5, 6]);
        assert!(d.propose(&[5, 6, 7, 5, 8, 5, 6, 7], 0).is_empty());
    }

    #[test]
    fn incremental_indexing_matches_indexing_at_once() {
        let h: Vec<u32> = (0..300).map(|i| (i * 7 % 13) as u32).collect();
        let mut grown = Drafter::new(5);
        for len in 1..=h.len() {
            let at_once = Drafter::new(5).propose(&h[..len], 5);
            assert_eq!(grown.propose(&h[..len], 5), at_once, "length {len}");
        }
    }

    #[test]
    fn backs_off_when_proposals_fail_and_resumes_on_success() {
        let h = [1, 2, 3, 4, 1, 2];
        let mut d = Drafter::new(4);
        let silent = |d: &mut Drafter| (0..100).take_while(|_| d.propose(&h, 4).is_empty()).count();
        assert_eq!(d.propose(&h, 4), vec![3, 4, 1, 2]);
        // A first outright rejection only halves the drafts.
        d.record(4, 0);
        assert_eq!(d.propose(&h, 4), vec![3, 4]);
        // The second in a row: silent for 2 steps, then one token.
        d.record(2, 0);
        assert_eq!(silent(&mut d), 2);
        d.record(1, 0);
        // The third: silent for 4.
        assert_eq!(silent(&mut d), 4);
        // The pause grows to its cap and no further.
        for _ in 0..10 {
            d.record(1, 0);
        }
        assert_eq!(silent(&mut d), MAX_PAUSE as usize);
        // A success resets: the next rejection pauses nothing, the one after for 2.
        d.record(1, 1);
        d.record(2, 0);
        assert_eq!(silent(&mut d), 0);
        d.record(1, 0);
        assert_eq!(silent(&mut d), 2);
        assert_eq!(
            d.stats,
            DraftStats {
                drafts: 16,
                proposed: 21,
                accepted: 1
            }
        );
        // A pass without proposals is not a failure.
        d.record(0, 0);
        assert_eq!(d.stats.drafts, 16);
    }

    #[test]
    fn the_draft_length_shrinks_after_a_rejection_and_doubles_after_full_acceptance() {
        let h: Vec<u32> = (1..=20).chain(1..=3).collect();
        let mut d = Drafter::new(8);
        assert_eq!(d.propose(&h, 100).len(), 8);
        // 2 of 8 kept: half the length (more than 2 + 1).
        d.record(8, 2);
        assert_eq!(d.propose(&h, 100), vec![4, 5, 6, 7]);
        // All kept: doubled, up to the cap, and never past the caller's limit.
        d.record(4, 4);
        assert_eq!(d.propose(&h, 100).len(), 8);
        d.record(8, 8);
        assert_eq!(d.propose(&h, 100).len(), 8);
        assert_eq!(d.propose(&h, 2).len(), 2);
        // 6 of 8 kept: one more than kept.
        d.record(8, 6);
        assert_eq!(d.propose(&h, 100).len(), 7);
        // None kept, twice: 3, then after a pause 1.
        d.record(7, 0);
        assert_eq!(d.propose(&h, 100).len(), 3);
        d.record(3, 0);
        let next = (0..10).map(|_| d.propose(&h, 100)).find(|p| !p.is_empty());
        assert_eq!(next, Some(vec![4]));
    }

    #[test]
    fn hash_collisions_are_checked() {
        let mut d = Drafter::new(4);
        let h = [1, 2, 3, 9, 9, 8, 7];
        d.index_up_to(&h);
        // Forge an entry: the key of "8 7" now points at position 3, after "1 2 3".
        d.index[0].insert(hash(&[8, 7]), 3);
        assert!(d.propose(&h, 4).is_empty());
    }
}
