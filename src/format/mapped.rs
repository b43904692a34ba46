//! A file mapped read-only into memory, so the loader repacks weights straight from the page
//! cache instead of copying each tensor into a buffer first (a second or more for a 1B model's
//! gigabyte), and hands each tensor's pages back once it is repacked, so the process never
//! holds the file and gen's tiles of it at once.

use std::fs::File;
use std::ops::Range;

/// A whole file, mapped read-only (private: nothing written reaches it).
pub struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and never remapped; sharing its bytes between threads is
// sharing an immutable slice.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    /// The whole of `file`; None where it cannot be mapped (an empty file, a pipe, a system
    /// without mmap), and the caller reads instead.
    pub fn new(file: &File) -> Option<Self> {
        use std::os::fd::AsRawFd;
        let len = usize::try_from(file.metadata().ok()?.len()).ok()?;
        if len == 0 {
            return None;
        }
        // SAFETY: a fresh read-only private mapping of an open file; the kernel picks the
        // address. Like every reader of a mapped file, gen relies on nobody truncating it
        // while it runs (safetensors checkpoints are read the same way).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        (ptr != libc::MAP_FAILED).then_some(Self { ptr, len })
    }

    /// The file's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: an empty file is not mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes in `range` (within the file: the caller checked it).
    pub fn bytes(&self, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: inside the mapping, which lives as long as `self`, and never written.
        unsafe { std::slice::from_raw_parts((self.ptr as *const u8).add(range.start), range.len()) }
    }

    /// Done with `range` for now: the whole pages inside it leave the process's memory (the
    /// page cache keeps them; reading them again maps them again).
    pub fn release(&self, range: Range<usize>) {
        let page = page_size();
        let start = range.start.div_ceil(page) * page;
        let end = range.end.min(self.len) / page * page;
        if start < end {
            // SAFETY: page-aligned, inside the mapping; MADV_DONTNEED on a read-only private
            // file mapping drops only this process's view of the pages.
            unsafe {
                libc::madvise(
                    (self.ptr as *mut u8).add(start) as *mut libc::c_void,
                    end - start,
                    libc::MADV_DONTNEED,
                );
            }
        }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no borrow of it outlives `self`.
        unsafe {
            libc::munmap(self.ptr, self.len);
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn maps_a_file_and_gives_back_its_pages_unchanged() {
        let path = std::env::temp_dir().join(format!("gen-mapped-{}", std::process::id()));
        let data: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let m = Mapped::new(&File::open(&path).unwrap()).expect("mapped");
        assert_eq!(m.bytes(0..data.len()), &data[..]);
        m.release(10..data.len());
        // Released pages read back the file's bytes.
        assert_eq!(m.bytes(4000..9000), &data[4000..9000]);
        std::fs::remove_file(&path).ok();
        let empty = std::env::temp_dir().join(format!("gen-mapped-empty-{}", std::process::id()));
        std::fs::File::create(&empty).unwrap();
        assert!(Mapped::new(&File::open(&empty).unwrap()).is_none());
        std::fs::remove_file(&empty).ok();
    }
}
