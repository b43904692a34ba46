//! Byte-level BPE (`gpt2`) vocabularies merged by gen itself: within each piece the
//! pre-tokenizer cut (already mapped to the vocabulary's byte-level characters), the adjacent
//! pair with the lowest merge rank is merged first, the leftmost on a tie, as llama.cpp's BPE
//! tokenizer and the `tokenizers` crate's BPE model both do. Characters the vocabulary lacks
//! are dropped before merging, as that crate's model (without an unknown token) drops them.
//!
//! The merges are read into a table of id pairs: no string is allocated per merge. Having the
//! `tokenizers` crate index them instead (it copies every merge and every entry) was 0.14 s
//! of Llama 3's 280,147 merges, more than half of its tokenizer's build.

use std::collections::BinaryHeap;

use anyhow::{bail, Result};

use super::lookup::Lookup;

/// (left id, right id) -> (rank, merged id), open addressing.
struct Pairs {
    /// Key `left << 32 | right`, `EMPTY` for a free slot; a power of two long, at most half full.
    keys: Vec<u64>,
    values: Vec<(u32, u32)>,
}

const EMPTY: u64 = u64::MAX;

impl Pairs {
    fn with_capacity(n: usize) -> Self {
        let len = (n * 2).next_power_of_two().max(16);
        Self {
            keys: vec![EMPTY; len],
            values: vec![(0, 0); len],
        }
    }

    fn slot(&self, key: u64) -> usize {
        let mask = self.keys.len() - 1;
        let mut slot = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & mask;
        while self.keys[slot] != EMPTY && self.keys[slot] != key {
            slot = (slot + 1) & mask;
        }
        slot
    }

    fn key(left: u32, right: u32) -> u64 {
        (u64::from(left) << 32) | u64::from(right)
    }

    /// Keeps the first value given for a pair (llama.cpp ranks a repeated merge by its first
    /// line).
    fn insert_first(&mut self, left: u32, right: u32, value: (u32, u32)) {
        let key = Self::key(left, right);
        let slot = self.slot(key);
        if self.keys[slot] == EMPTY {
            self.keys[slot] = key;
            self.values[slot] = value;
        }
    }

    fn get(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        let key = Self::key(left, right);
        let slot = self.slot(key);
        (self.keys[slot] == key).then(|| self.values[slot])
    }
}

/// What the encoder needs of a byte-level BPE vocabulary.
pub(super) struct Bpe {
    pub(super) lookup: Lookup,
    pairs: Pairs,
    /// Llama 3's pre-tokenizer: a piece that is an entry as a whole is that entry.
    ignore_merges: bool,
    /// Set for vocabularies merged on raw UTF-8 ([`Bpe::take_raw_utf8`]).
    raw: Option<RawUtf8>,
}

/// How a raw-UTF-8 vocabulary (Gemma 4's) differs: a character it lacks is kept as a symbol
/// that merges with nothing and comes out as `<0xNN>` byte tokens (a byte without one is
/// dropped), as llama.cpp's BPE session does when it does not byte-encode.
struct RawUtf8 {
    bytes: [Option<u32>; 256],
    /// A piece of newlines alone that is an entry is that entry.
    whole_newlines: bool,
}

/// The id of a symbol the vocabulary lacks (raw UTF-8 only): never merged.
const MISSING: u32 = u32::MAX;

/// A symbol of a piece being merged: its id, bytes, and neighbours (len 0 once merged away).
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    /// Where its bytes start in the piece.
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbol `pos` with its right neighbour into `id`.
struct Merge {
    rank: u32,
    pos: usize,
    id: u32,
}

// The heap's top is the lowest rank, then the leftmost.
queue_order!(Merge, |a, b| b.rank.cmp(&a.rank).then(b.pos.cmp(&a.pos)));

impl Bpe {
    /// `merges`: the file's `tokenizer.ggml.merges`, each "left right" (split at the first
    /// space after the first character, as llama.cpp splits them), in rank order. `key`
    /// names that list in errors.
    pub(super) fn new(
        texts: &[String],
        merges: &[&str],
        ignore_merges: bool,
        key: &str,
    ) -> Result<Self> {
        let lookup = Lookup::new(texts);
        // Three lookups a merge (280,147 merges in Llama 3's file): spread over the cores, each
        // share resolved in rank order, then inserted in rank order.
        let resolve = |first: usize, part: &[&str]| -> Result<Vec<(u32, u32, u32)>> {
            let mut joined = String::new();
            (first..)
                .zip(part)
                .map(|(rank, m)| {
                    let first_len = m.chars().next().map_or(0, char::len_utf8);
                    let Some(at) = m
                        .get(first_len..)
                        .and_then(|rest| rest.find(' '))
                        .map(|p| p + first_len)
                    else {
                        bail!("`{key}`[{rank}] = {m:?} is not two tokens");
                    };
                    let (left, right) = (&m[..at], &m[at + 1..]);
                    joined.clear();
                    joined.push_str(left);
                    joined.push_str(right);
                    match (lookup.get(left), lookup.get(right), lookup.get(&joined)) {
                        (Some(l), Some(r), Some(id)) => Ok((l, r, id)),
                        _ => bail!(
                            "`{key}`[{rank}] = {:?} names a token the vocabulary does not have",
                            m.chars().take(80).collect::<String>()
                        ),
                    }
                })
                .collect()
        };
        let resolved = super::by_parts(merges, resolve);
        let mut pairs = Pairs::with_capacity(merges.len());
        let mut rank = 0u32;
        for part in resolved {
            for (l, r, id) in part? {
                pairs.insert_first(l, r, (rank, id));
                rank += 1;
            }
        }
        Ok(Self {
            lookup,
            pairs,
            ignore_merges,
            raw: None,
        })
    }

    /// Merge raw UTF-8 (characters as they are) rather than byte-level characters: see
    /// [`RawUtf8`]. `whole_newlines`: llama.cpp's Gemma 4 rule for pieces of newlines.
    pub(super) fn take_raw_utf8(&mut self, whole_newlines: bool) {
        let mut bytes = [None; 256];
        for (b, id) in bytes.iter_mut().enumerate() {
            *id = self.lookup.get(&format!("<0x{b:02X}>"));
        }
        self.raw = Some(RawUtf8 {
            bytes,
            whole_newlines,
        });
    }

    /// The merges as (left id, right id) in rank order (for the `tokenizers` form).
    pub(super) fn merges(&self) -> Vec<(u32, u32)> {
        let mut ranked: Vec<(u32, u32, u32)> = self
            .pairs
            .keys
            .iter()
            .zip(&self.pairs.values)
            .filter(|(&k, _)| k != EMPTY)
            .map(|(&k, &(rank, _))| (rank, (k >> 32) as u32, k as u32))
            .collect();
        ranked.sort_unstable();
        ranked.into_iter().map(|(_, l, r)| (l, r)).collect()
    }

    /// The ids of one piece (byte-level characters), appended to `out`.
    pub(super) fn encode(&self, piece: &str, out: &mut Vec<u32>) {
        if piece.is_empty() {
            return;
        }
        let newlines = || piece.bytes().all(|b| b == b'\n');
        if self.ignore_merges || self.raw.as_ref().is_some_and(|r| r.whole_newlines) && newlines() {
            if let Some(id) = self.lookup.get(piece) {
                out.push(id);
                return;
            }
        }
        let mut symbols: Vec<Symbol> = Vec::with_capacity(piece.len());
        let mut buf = [0u8; 4];
        for (start, c) in piece.char_indices() {
            let id = match self.lookup.get(c.encode_utf8(&mut buf)) {
                Some(id) => id,
                None if self.raw.is_some() => MISSING,
                None => continue,
            };
            let i = symbols.len();
            if let Some(last) = symbols.last_mut() {
                last.next = Some(i);
            }
            symbols.push(Symbol {
                id,
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
        }
        let merge = |symbols: &[Symbol], pos: usize, right: usize| {
            let (left, right) = (symbols[pos].id, symbols[right].id);
            if left == MISSING || right == MISSING {
                return None;
            }
            let (rank, id) = self.pairs.get(left, right)?;
            Some(Merge { rank, pos, id })
        };
        let mut queue: BinaryHeap<Merge> = (1..symbols.len())
            .filter_map(|i| merge(&symbols, i - 1, i))
            .collect();
        while let Some(top) = queue.pop() {
            let s = symbols[top.pos];
            let Some(next) = s.next else { continue };
            // Stale unless this pair still makes the same entry.
            if s.len == 0 || self.pairs.get(s.id, symbols[next].id).map(|v| v.1) != Some(top.id) {
                continue;
            }
            let right = symbols[next];
            symbols[top.pos] = Symbol {
                id: top.id,
                start: s.start,
                len: s.len + right.len,
                prev: s.prev,
                next: right.next,
            };
            symbols[next].len = 0;
            if let Some(n) = right.next {
                symbols[n].prev = Some(top.pos);
                queue.extend(merge(&symbols, top.pos, n));
            }
            if let Some(p) = s.prev {
                queue.extend(merge(&symbols, p, top.pos));
            }
        }
        let mut at = (!symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            match (s.id, &self.raw) {
                (MISSING, Some(raw)) => {
                    let bytes = &piece.as_bytes()[s.start..s.start + s.len];
                    out.extend(bytes.iter().filter_map(|&b| raw.bytes[usize::from(b)]));
                }
                (id, _) => out.push(id),
            }
            at = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bpe(texts: &[&str], merges: &[&str], ignore_merges: bool) -> Bpe {
        let texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        Bpe::new(&texts, merges, ignore_merges, "merges").unwrap()
    }

    fn encode(b: &Bpe, piece: &str) -> Vec<u32> {
        let mut out = Vec::new();
        b.encode(piece, &mut out);
        out
    }

    #[test]
    fn merges_by_rank_then_leftmost() {
        // a b c ab bc abc
        let texts = ["a", "b", "c", "ab", "bc", "abc"];
        let b = bpe(&texts, &["b c", "a b", "a bc"], false);
        assert_eq!(encode(&b, "abc"), vec![5]);
        let b = bpe(&texts, &["a b", "b c"], false);
        assert_eq!(encode(&b, "abc"), vec![3, 2]);
        // Equal pairs: the leftmost first ("aaa" -> [aa, a]).
        let b = bpe(&["a", "aa"], &["a a"], false);
        assert_eq!(encode(&b, "aaa"), vec![1, 0]);
        assert_eq!(encode(&b, "aaaa"), vec![1, 1]);
        assert_eq!(encode(&b, ""), Vec::<u32>::new());
    }

    #[test]
    fn missing_characters_are_dropped_and_whole_entries_kept_with_ignore_merges() {
        let texts = ["a", "b", "ab", "abab"];
        let b = bpe(&texts, &["a b"], false);
        // "x" is no entry: dropped, and its neighbours meet.
        assert_eq!(encode(&b, "axb"), vec![2]);
        assert_eq!(encode(&b, "abab"), vec![2, 2]);
        let b = bpe(&texts, &["a b"], true);
        assert_eq!(encode(&b, "abab"), vec![3]);
    }

    #[test]
    fn a_repeated_merge_keeps_its_first_rank_and_bad_merges_are_errors() {
        let texts = ["a", "b", "c", "ab", "bc"];
        let b = bpe(&texts, &["b c", "a b", "b c"], false);
        assert_eq!(b.merges(), vec![(1, 2), (0, 1)]);
        assert_eq!(encode(&b, "abc"), vec![0, 4]);
        let texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        for bad in ["a c", "x b", "ab", "a"] {
            let e = Bpe::new(&texts, &[bad], false, "merges").err().unwrap();
            assert!(e.to_string().contains("`merges`[0]"), "{e}");
        }
    }
}
