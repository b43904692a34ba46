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

    /// Asks for huge pages where the mapping is read from the disk (Linux's MADV_HUGEPAGE: its
    /// page faults then read ahead 2 MiB folios): for a mapping read again and again, as the
    /// tile cache is once a token, fewer pages to walk. A hint; where it is refused nothing
    /// changes.
    pub fn prefer_huge_pages(&self) {
        // SAFETY: the whole mapping, which lives as long as `self`.
        unsafe { advise_huge_pages(self.ptr as *const u8, self.len) };
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

/// Bytes of a huge page: 2 MiB on x86-64 and most 64-bit systems.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks Linux for huge pages (MADV_HUGEPAGE) on the whole pages within `len` bytes from `at`:
/// anonymous memory then gets a huge page at the first touch of each aligned 2 MiB, a file
/// mapping reads ahead in 2 MiB folios. Nothing where the run holds no whole page, off Linux,
/// or with `GEN_HUGE_PAGES=off` (to measure what they are worth). A hint: a refusal changes
/// nothing but the page size.
///
/// # Safety
/// `at..at + len` must lie within one live allocation or mapping of this process.
pub unsafe fn advise_huge_pages(at: *const u8, len: usize) {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let wanted = *WANTED.get_or_init(|| {
        !matches!(
            std::env::var("GEN_HUGE_PAGES").as_deref(),
            Ok("off") | Ok("0")
        )
    });
    let page = page_size();
    let start = (at as usize).next_multiple_of(page);
    let end = at as usize + len;
    #[cfg(target_os = "linux")]
    if wanted && start < end {
        // SAFETY: whole pages inside the caller's allocation; advice changes no data.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
    let _ = (wanted, start, end);
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(1)
}

/// The flags Linux lists for the mapping that holds `addr` (`VmFlags` of /proc/self/smaps:
/// `hg` is MADV_HUGEPAGE's), or None where none holds it or the file cannot be read.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn vm_flags_at(addr: usize) -> Option<Vec<String>> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a <= addr && addr < b;
                continue;
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.split_whitespace().map(String::from).collect());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The tile cache's mapping asks for huge pages (what Linux lists for it says so), and
    /// its bytes are the file's.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_mapping_can_ask_for_huge_pages() {
        let path = std::env::temp_dir().join(format!("gen-mapped-huge-{}", std::process::id()));
        let data: Vec<u8> = (0..(5 << 20)).map(|i| (i * 13 % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let m = Mapped::new(&File::open(&path).unwrap()).expect("mapped");
        let at = m.bytes(0..1).as_ptr() as usize;
        let before = vm_flags_at(at).expect("the mapping is listed");
        assert!(!before.iter().any(|f| f == "hg"), "{before:?}");
        m.prefer_huge_pages();
        let after = vm_flags_at(at).expect("the mapping is listed");
        assert!(after.iter().any(|f| f == "hg"), "{after:?}");
        assert!(m.bytes(0..data.len()) == &data[..]);
        drop(m);
        std::fs::remove_file(&path).ok();
    }

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
