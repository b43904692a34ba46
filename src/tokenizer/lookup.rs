//! A vocabulary's texts and a table from text to id, shared by gen's own encoders
//! ([`super::spm`], [`super::bpe`]): one buffer of every entry's bytes and an open-addressing
//! table of ids, no allocation per entry (building it takes about 20 ms for 262,144 entries).

/// The vocabulary's texts in one buffer, and an open-addressing table from text to id.
pub(super) struct Lookup {
    bytes: Vec<u8>,
    /// Text of id i: `bytes[starts[i]..starts[i + 1]]`.
    starts: Vec<usize>,
    /// id + 1 per slot, 0 for empty; a power of two long, at most half full.
    slots: Vec<u32>,
}

fn hash(s: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = (s.len() as u64).wrapping_mul(K);
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h.rotate_left(23) ^ w).wrapping_mul(K);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut tail = [0u8; 8];
        tail[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(23) ^ u64::from_le_bytes(tail)).wrapping_mul(K);
    }
    h ^ (h >> 29)
}

impl Lookup {
    /// Every text gets its id; where a text repeats, the last id holds it (as llama.cpp's and
    /// `tokenizers`' maps keep the last one inserted).
    pub(super) fn new(texts: &[String]) -> Self {
        let total: usize = texts.iter().map(String::len).sum();
        let mut bytes = Vec::with_capacity(total);
        let mut starts = Vec::with_capacity(texts.len() + 1);
        starts.push(0);
        for t in texts {
            bytes.extend_from_slice(t.as_bytes());
            starts.push(bytes.len());
        }
        let mut table = Self {
            bytes,
            starts,
            slots: vec![0; (texts.len() * 2).next_power_of_two().max(16)],
        };
        for id in 0..texts.len() as u32 {
            let slot = table.find(table.text(id));
            table.slots[slot] = id + 1;
        }
        table
    }

    fn text(&self, id: u32) -> &[u8] {
        let i = id as usize;
        &self.bytes[self.starts[i]..self.starts[i + 1]]
    }

    /// The slot that holds `s`, or the empty slot where it would go.
    fn find(&self, s: &[u8]) -> usize {
        let mask = self.slots.len() - 1;
        let mut slot = hash(s) as usize & mask;
        loop {
            match self.slots[slot] {
                0 => return slot,
                id if self.text(id - 1) == s => return slot,
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    /// The id whose text is `s`.
    pub(super) fn get(&self, s: &str) -> Option<u32> {
        self.slots[self.find(s.as_bytes())].checked_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_keeps_the_last_id_of_a_repeated_text() {
        let texts: Vec<String> = ["a", "b", "a", ""].iter().map(|s| s.to_string()).collect();
        let l = Lookup::new(&texts);
        assert_eq!(l.get("a"), Some(2));
        assert_eq!(l.get("b"), Some(1));
        assert_eq!(l.get(""), Some(3));
        assert_eq!(l.get("c"), None);
        // Many entries: every one found, nothing else.
        let texts: Vec<String> = (0..5000).map(|i| format!("t{i}")).collect();
        let l = Lookup::new(&texts);
        assert!((0..5000).all(|i| l.get(&format!("t{i}")) == Some(i)));
        assert_eq!(l.get("t5000"), None);
    }
}
