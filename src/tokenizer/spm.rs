//! SentencePiece (`llama`) vocabularies encoded the way llama.cpp does it, straight from the
//! vocabulary and its scores: a text's characters are merged pairwise, always the adjacent
//! pair whose concatenation is the entry with the highest score (the leftmost on a tie), until
//! no adjacent pair is an entry; a character left without an entry becomes its `<0xNN>` byte
//! tokens (or the unknown token).
//!
//! Building this is a hash table of ids over the vocabulary's texts, about 20 ms for Gemma's
//! 262,144 entries. Expressing the same rule as a `tokenizers` BPE model meant deriving every
//! merge (514,847 for Gemma) and having that crate index them: 0.6-0.9 s of every start. The `tokenizers` crate still cuts the special tokens out of the raw text and
//! normalizes the rest ([`Spm::encode`] takes its pieces).

use std::collections::BinaryHeap;

use super::lookup::Lookup;

/// What the encoder needs of a SentencePiece vocabulary.
pub(super) struct Spm {
    pub(super) lookup: Lookup,
    scores: Vec<f32>,
    /// `<0xNN>` per byte, where the vocabulary has it.
    byte_ids: Box<[Option<u32>; 256]>,
    unk: Option<u32>,
}

/// One character, or a run of them merged into one entry: bytes start..start + len of the text
/// being encoded; len 0 once merged into its left neighbour.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and its right neighbour `right` into the entry of
/// `score`, `len` bytes long (stale once either side has changed).
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

// The heap's top is the highest score, then the leftmost.
queue_order!(Bigram, |a, b| a
    .score
    .total_cmp(&b.score)
    .then(b.left.cmp(&a.left)));

impl Spm {
    pub(super) fn new(texts: &[String], scores: Vec<f32>, unk: Option<u32>) -> Self {
        let lookup = Lookup::new(texts);
        let byte_ids = Box::new(std::array::from_fn(|b| lookup.get(&format!("<0x{b:02X}>"))));
        Self {
            lookup,
            scores,
            byte_ids,
            unk,
        }
    }

    pub(super) fn scores(&self) -> &[f32] {
        &self.scores
    }

    pub(super) fn unk(&self) -> Option<u32> {
        self.unk
    }

    /// The ids of one normalized piece of text (no special tokens in it), appended to `out`.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        let Some(last) = symbols.last_mut() else {
            return;
        };
        last.next = None;
        let mut queue = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: usize, right: usize| {
            let (l, r) = (symbols[left], symbols[right]);
            let id = self.lookup.get(&text[l.start..l.start + l.len + r.len])?;
            Some(Bigram {
                score: self.scores[id as usize],
                left,
                right,
                len: l.len + r.len,
            })
        };
        for i in 1..symbols.len() {
            queue.extend(candidate(&symbols, i - 1, i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            symbols[b.left].len = b.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = l.prev {
                queue.extend(candidate(&symbols, p, b.left));
            }
            if let Some(n) = r.next {
                queue.extend(candidate(&symbols, b.left, n));
            }
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.lookup.get(piece) {
                Some(id) => out.push(id),
                // Only a single character can be missing (every merge made an entry).
                None => self.fall_back(piece, out),
            }
            at = s.next;
        }
    }

    /// A character the vocabulary lacks: its bytes' `<0xNN>` tokens where it has them all,
    /// else the unknown token, else nothing (as `tokenizers`' byte fallback does).
    fn fall_back(&self, piece: &str, out: &mut Vec<u32>) {
        let bytes: Option<Vec<u32>> = piece.bytes().map(|b| self.byte_ids[b as usize]).collect();
        match (bytes, self.unk) {
            (Some(ids), _) => out.extend(ids),
            (None, Some(unk)) => out.push(unk),
            (None, None) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(entries: &[(&str, f32)]) -> Spm {
        let texts: Vec<String> = entries.iter().map(|(t, _)| t.to_string()).collect();
        Spm::new(&texts, entries.iter().map(|&(_, s)| s).collect(), None)
    }

    fn encode(spm: &Spm, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        spm.encode(text, &mut out);
        out
    }

    #[test]
    fn merges_the_highest_scored_pair_first() {
        // "abc": "ab" (-1) beats "bc" (-2), then "abc" is not an entry: [ab, c].
        let spm = vocab(&[
            ("a", -9.0),
            ("b", -9.0),
            ("c", -9.0),
            ("ab", -1.0),
            ("bc", -2.0),
        ]);
        assert_eq!(encode(&spm, "abc"), vec![3, 2]);
        // With "bc" scored higher it is [a, bc].
        let spm = vocab(&[
            ("a", -9.0),
            ("b", -9.0),
            ("c", -9.0),
            ("ab", -2.0),
            ("bc", -1.0),
        ]);
        assert_eq!(encode(&spm, "abc"), vec![0, 4]);
    }

    #[test]
    fn equal_scores_merge_leftmost_first_and_merges_chain() {
        // "aaa": both "aa" pairs score alike; the left one merges, leaving [aa, a], then "aaa".
        let spm = vocab(&[("a", -9.0), ("aa", -1.0)]);
        assert_eq!(encode(&spm, "aaa"), vec![1, 0]);
        let spm = vocab(&[("a", -9.0), ("aa", -1.0), ("aaa", -5.0)]);
        assert_eq!(encode(&spm, "aaa"), vec![2]);
        assert_eq!(encode(&spm, "aaaa"), vec![1, 1]);
        assert_eq!(encode(&spm, ""), Vec::<u32>::new());
    }

    #[test]
    fn missing_characters_fall_back_to_bytes_then_unknown_then_nothing() {
        // "é" is two bytes, C3 A9.
        let mut entries: Vec<(String, f32)> = vec![("x".into(), 0.0)];
        entries.extend((0..256).map(|b| (format!("<0x{b:02X}>"), 0.0)));
        let texts: Vec<String> = entries.iter().map(|(t, _)| t.clone()).collect();
        let scores = entries.iter().map(|e| e.1).collect();
        let spm = Spm::new(&texts, scores, None);
        assert_eq!(encode(&spm, "xéx"), vec![0, 1 + 0xC3, 1 + 0xA9, 0]);
        // Without every byte token: the unknown token, or the character dropped.
        let texts: Vec<String> = vec!["x".into(), "<unk>".into(), "<0xC3>".into()];
        let spm = Spm::new(&texts, vec![0.0; 3], Some(1));
        assert_eq!(encode(&spm, "xéx"), vec![0, 1, 0]);
        let spm = Spm::new(&texts, vec![0.0; 3], None);
        assert_eq!(encode(&spm, "xéx"), vec![0, 0]);
    }

    #[test]
    fn a_character_missing_on_its_own_still_merges_into_an_entry() {
        // llama.cpp merges before it falls back: "é" has no entry, "xé" has.
        let spm = vocab(&[("x", 0.0), ("xé", -1.0)]);
        assert_eq!(encode(&spm, "xé"), vec![1]);
    }
}
