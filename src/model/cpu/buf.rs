//! The buffers weights are kept in on gen's CPU kernels: gen's own memory (repacked this run),
//! or a stretch of a mapped tile-cache file ([`super::tile_cache`]) that an earlier run wrote,
//! read in place (no repacking, no copy: the page cache holds it once for every process).

use std::ops::Deref;
use std::sync::Arc;

use crate::format::mapped::Mapped;

/// The element types weights are kept in: plain numbers, any bit pattern valid.
pub trait Plain: Copy + Default + Send + Sync + 'static {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for f32 {}

/// A run of `T`, owned or borrowed from a mapped file.
pub enum Buf<T: Plain> {
    Owned(Vec<T>),
    Mapped {
        file: Arc<Mapped>,
        /// Byte offset in the file (a multiple of T's alignment).
        at: usize,
        /// Elements.
        len: usize,
    },
}

impl<T: Plain> Buf<T> {
    /// `len` elements of the mapped `file` from byte `at`; None where that is outside the file
    /// or misaligned for T.
    pub fn mapped(file: &Arc<Mapped>, at: usize, len: usize) -> Option<Self> {
        let end = len
            .checked_mul(std::mem::size_of::<T>())
            .and_then(|n| n.checked_add(at))?;
        (end <= file.len() && at.is_multiple_of(std::mem::align_of::<T>())).then(|| Buf::Mapped {
            file: file.clone(),
            at,
            len,
        })
    }

    /// Elements `range` of this run, as a run of its own (borrowing the same file, or copied).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= self.len());
        match self {
            Buf::Owned(v) => Buf::Owned(v[range].to_vec()),
            Buf::Mapped { file, at, .. } => Buf::Mapped {
                file: file.clone(),
                at: at + range.start * std::mem::size_of::<T>(),
                len: range.len(),
            },
        }
    }

    /// `other`'s elements after ours. Two stretches of one mapped file that follow each other
    /// (the parts of a fused projection read from the tile cache) join without a copy.
    pub fn append(&mut self, other: &Buf<T>) {
        if let (
            Buf::Mapped { file, at, len },
            Buf::Mapped {
                file: f2,
                at: a2,
                len: l2,
            },
        ) = (&mut *self, other)
        {
            if Arc::ptr_eq(file, f2) && *at + *len * std::mem::size_of::<T>() == *a2 {
                *len += l2;
                return;
            }
        }
        // Into one new run from `zeroed` (huge pages where it is large): growing the old one
        // in place would move its pages and leave the appended ones small.
        let ours: &[T] = self;
        let mut v = zeroed::<T>(ours.len() + other.len());
        v[..ours.len()].copy_from_slice(ours);
        v[ours.len()..].copy_from_slice(other);
        *self = Buf::Owned(v);
    }

    /// The elements' bytes, as memory holds them (little-endian: what the cache file keeps).
    pub fn bytes(&self) -> &[u8] {
        let s: &[T] = self;
        // SAFETY: T is a plain number type (no padding, any bit pattern); the bytes of a valid
        // slice of T.
        unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
    }

    /// Whether the elements live in a mapped file.
    pub fn is_mapped(&self) -> bool {
        matches!(self, Buf::Mapped { .. })
    }
}

impl<T: Plain> Deref for Buf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Buf::Owned(v) => v,
            Buf::Mapped { file, at, len } => {
                let b = file.bytes(*at..*at + *len * std::mem::size_of::<T>());
                // SAFETY: `mapped` checked the range and T's alignment (the mapping itself is
                // page-aligned); T is a plain number type, so any bytes are a valid T.
                unsafe { std::slice::from_raw_parts(b.as_ptr() as *const T, *len) }
            }
        }
    }
}

/// `len` zeros, for weights about to be repacked into them: where the run is at least a huge
/// page (2 MiB), its memory is asked to come in huge pages (MADV_HUGEPAGE, before anything is
/// written, so the first touch of each 2 MiB gets one). A decode step reads every weight once,
/// and on memory in 4 KiB pages the processor walks 512 times as many pages for it; Linux
/// gives anonymous memory huge pages only where asked on systems set to `madvise`, the
/// common default. A hint: where it is refused, plain pages, the same bytes.
pub fn zeroed<T: Plain>(len: usize) -> Vec<T> {
    let v = vec![T::default(); len];
    let bytes = std::mem::size_of_val(&v[..]);
    if bytes >= crate::format::mapped::HUGE_PAGE {
        // SAFETY: the run just allocated, whole.
        unsafe { crate::format::mapped::advise_huge_pages(v.as_ptr() as *const u8, bytes) };
    }
    v
}

impl<T: Plain> From<Vec<T>> for Buf<T> {
    fn from(v: Vec<T>) -> Self {
        Buf::Owned(v)
    }
}

impl<T: Plain> Default for Buf<T> {
    fn default() -> Self {
        Buf::Owned(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Runs of weights of a huge page or more are zeros whose memory asked for huge pages
    /// before it was written (Linux lists the advice on their mapping).
    #[cfg(target_os = "linux")]
    #[test]
    fn large_runs_ask_for_huge_pages_before_they_are_written() {
        use crate::format::mapped::vm_flags_at;
        let big = zeroed::<u16>(3 << 20);
        assert!(big.len() == 3 << 20 && big.iter().all(|&w| w == 0));
        let flags = vm_flags_at(big.as_ptr() as usize + (3 << 20)).expect("listed");
        assert!(flags.iter().any(|f| f == "hg"), "{flags:?}");
        let small = zeroed::<u8>(100_000);
        assert!(small.len() == 100_000 && small.iter().all(|&b| b == 0));
        // Appending makes one new run of both, asked the same way where it is large.
        let mut joined = Buf::from(zeroed::<u16>(2 << 20));
        joined.append(&Buf::from(vec![7u16; 1 << 20]));
        assert_eq!(joined.len(), 3 << 20);
        assert!(
            joined[..2 << 20].iter().all(|&w| w == 0) && joined[2 << 20..].iter().all(|&w| w == 7)
        );
        let flags = vm_flags_at(joined.as_ptr() as usize + (4 << 20)).expect("listed");
        assert!(flags.iter().any(|f| f == "hg"), "{flags:?}");
    }

    #[test]
    fn mapped_runs_read_the_file_and_join_without_a_copy_when_adjacent() {
        let path = std::env::temp_dir().join(format!("gen-buf-{}", std::process::id()));
        let words: Vec<u16> = (0..4096u16).map(|i| i.wrapping_mul(31)).collect();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&bytes)
            .unwrap();
        let file = Arc::new(Mapped::new(&std::fs::File::open(&path).unwrap()).unwrap());
        let a = Buf::<u16>::mapped(&file, 0, 100).unwrap();
        let b = Buf::<u16>::mapped(&file, 200, 50).unwrap();
        assert_eq!(&a[..], &words[..100]);
        assert_eq!(&b[..], &words[100..150]);
        // Adjacent: still mapped, one run.
        let mut joined = Buf::<u16>::mapped(&file, 0, 100).unwrap();
        joined.append(&b);
        assert!(joined.is_mapped());
        assert_eq!(&joined[..], &words[..150]);
        // Not adjacent: copied, same values.
        let mut apart = Buf::<u16>::mapped(&file, 0, 10).unwrap();
        apart.append(&b);
        assert!(!apart.is_mapped());
        assert_eq!(&apart[..10], &words[..10]);
        assert_eq!(&apart[10..], &words[100..150]);
        // A slice borrows the same file.
        let s = joined.slice(100..150);
        assert!(s.is_mapped());
        assert_eq!(&s[..], &words[100..150]);
        // Outside the file, or misaligned: refused.
        assert!(Buf::<u16>::mapped(&file, 8190, 2).is_none());
        assert!(Buf::<u16>::mapped(&file, 1, 2).is_none());
        assert!(Buf::<f32>::mapped(&file, 2, 1).is_none());
        std::fs::remove_file(&path).ok();
    }
}
