//! The tile cache: the weights of a GGUF file as gen's CPU kernels lay them out, kept in a file
//! under gen's cache folder (`tiles/<hash of the model's path>.tiles`) and mapped by later runs, which then read no
//! weight from the GGUF file and repack nothing: the page cache holds the tiles once for every
//! process that runs the model.
//!
//! The first run of a file repacks its weights as before and then writes the cache (a
//! temporary file renamed into place, so it is whole or absent). The file's id is a SHA-256
//! of the GGUF file's fingerprint ([`Checkpoint::fingerprint`]: size, modification time,
//! header, samples of every tensor's data), this layout's [`VERSION`] and the instruction set
//! the tiles were made for. A cache file is used only if its header says the same id and
//! version, its index fits the file and every buffer's CRC-32 matches (checked in parallel
//! when it is opened); otherwise one warning line, and the run repacks and writes it again.
//!
//! `GEN_TILE_CACHE`: `off` never reads or writes it; `on` always; unset (`auto`), for GGUF
//! files of 64 MiB or more: the two models gen fetches by name among them (SmolLM2 98 MB, Gemma
//! 3 270M 253 MB), whose whole process for one token it takes from 118 to 54 ms and from 299 to
//! 152 (Zen 4); below it are test models, whose repacking takes milliseconds.
//! `GEN_TILE_CACHE_MAX_GB` (default 20) caps the folder: after a write, the least recently
//! used files go until it fits. A write that would leave less than 1 GB of disk free is skipped.
//!
//! Layout (little-endian): magic `gentiles`, u32 version, 32-byte id, u64 index length, the
//! index (JSON: per weight its ggml type, width, the file's tensors it holds with their row
//! counts, and per buffer its offset, length and CRC-32), then the buffers, each at a multiple
//! of 64 bytes.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::matmul::{CpuQWeight, Kernel};
use crate::format::checkpoint::Checkpoint;
use crate::format::mapped::Mapped;

const MAGIC: &[u8; 8] = b"gentiles";
/// Bumped whenever a layout of [`super::matmul`], [`super::quants`] or [`super::wide16`]
/// changes, or what this file holds: files of another version are not used. 2: the biased
/// Q8_K types' `corr` is an i32 of the integer sums, no longer an f32 with d in it.
pub const VERSION: u32 = 2;
const HEAD: usize = 8 + 4 + 32 + 8;
const ALIGN: usize = 64;
/// Files at least this large are cached unless `GEN_TILE_CACHE=off`.
const AUTO_MIN_BYTES: u64 = 64 << 20;

#[derive(Serialize, Deserialize)]
struct Entry {
    ggml: u32,
    cols: usize,
    /// The file's tensors these rows are, in order, with their row counts.
    parts: Vec<(String, usize)>,
    bufs: Vec<BufEntry>,
}

#[derive(Serialize, Deserialize)]
struct BufEntry {
    at: usize,
    len: usize,
    crc: u32,
}

/// A tile cache as this run found it.
pub enum TileCache {
    /// Not used for this file (off, too small, a checkpoint folder).
    Off,
    /// Usable: weights come from it.
    Hit(Hit),
    /// To be written once the weights are repacked.
    Miss { path: PathBuf, id: [u8; 32] },
}

/// An opened, checked cache file.
pub struct Hit {
    file: Arc<Mapped>,
    entries: Vec<Entry>,
    /// Tensor name -> (entry, first row, rows).
    parts: HashMap<String, (usize, usize, usize)>,
    kernel: Kernel,
    pub path: PathBuf,
    /// Bytes of tiles it holds.
    pub bytes: usize,
}

impl TileCache {
    /// The cache for `ckpt`'s weights laid out for `kernel` (a file that is there and cannot
    /// be used is one warning on stderr).
    pub fn open(ckpt: &Checkpoint, kernel: Kernel) -> Self {
        let mode = std::env::var("GEN_TILE_CACHE").unwrap_or_default();
        let on = match mode.as_str() {
            "off" | "0" => false,
            "on" | "1" => true,
            _ => ckpt.file_bytes().is_some_and(|n| n >= AUTO_MIN_BYTES),
        };
        let Some(fingerprint) = ckpt.fingerprint().filter(|_| on) else {
            return TileCache::Off;
        };
        let id = cache_id(&fingerprint, kernel);
        let Some(path) = ckpt.gguf_path().map(|p| file_for(p, kernel)) else {
            return TileCache::Off;
        };
        match Hit::open(&path, &id, kernel) {
            Ok(Some(hit)) => {
                // Used now: the last to go when the folder is trimmed.
                if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                TileCache::Hit(hit)
            }
            Ok(None) => TileCache::Miss { path, id },
            Err(why) => {
                eprintln!(
                    "warning: tile cache {} cannot be used ({why:#}); repacking the weights and \
                     writing it again",
                    path.display()
                );
                TileCache::Miss { path, id }
            }
        }
    }

    /// The cached weight for tensor `name` (`rows` x `cols` of ggml type `ggml`), if the cache
    /// holds it so.
    pub fn take(&self, name: &str, ggml: u32, rows: usize, cols: usize) -> Option<CpuQWeight> {
        match self {
            TileCache::Hit(h) => h.take(name, ggml, rows, cols),
            _ => None,
        }
    }
}

impl Hit {
    /// Ok(None): no file there.
    fn open(path: &Path, id: &[u8; 32], kernel: Kernel) -> Result<Option<Self>> {
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).context("cannot open it"),
        };
        let file = Mapped::new(&f).context("empty or cannot be mapped")?;
        // Pages not in the page cache (after a restart) are read in as huge pages, as the
        // write left them ([`Pieces`]).
        file.prefer_huge_pages();
        let file = Arc::new(file);
        if file.len() < HEAD || file.bytes(0..8) != MAGIC {
            bail!("not a gen tile cache");
        }
        let head = file.bytes(0..HEAD);
        let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            bail!("layout version {version}, this gen writes {VERSION}");
        }
        if head[12..44] != id[..] {
            bail!("made from another file or for other kernels");
        }
        let index_len = u64::from_le_bytes(head[44..52].try_into().expect("8 bytes"));
        let index_end = usize::try_from(index_len)
            .ok()
            .and_then(|n| n.checked_add(HEAD))
            .filter(|&e| e <= file.len())
            .context("cut short")?;
        let entries: Vec<Entry> =
            serde_json::from_slice(file.bytes(HEAD..index_end)).context("damaged index")?;
        let mut parts = HashMap::new();
        let mut bytes = 0;
        for (i, e) in entries.iter().enumerate() {
            let sizes = CpuQWeight::group_bytes(e.ggml, e.cols).context("damaged index")?;
            let rows: usize = e.parts.iter().map(|p| p.1).sum();
            let groups = rows.div_ceil(8);
            let fits = sizes.len() == e.bufs.len()
                && e.bufs.iter().zip(&sizes).all(|(b, s)| {
                    b.len == groups * s
                        && b.at >= index_end
                        && b.at.checked_add(b.len).is_some_and(|end| end <= file.len())
                });
            if !fits {
                bail!("cut short or damaged");
            }
            let mut row = 0;
            for (name, n) in &e.parts {
                parts.insert(name.clone(), (i, row, *n));
                row += n;
            }
            bytes += e.bufs.iter().map(|b| b.len).sum::<usize>();
        }
        check_sums(&file, &entries)?;
        Ok(Some(Hit {
            file,
            entries,
            parts,
            kernel,
            path: path.to_path_buf(),
            bytes,
        }))
    }

    fn take(&self, name: &str, ggml: u32, rows: usize, cols: usize) -> Option<CpuQWeight> {
        let &(i, row, n) = self.parts.get(name)?;
        let e = &self.entries[i];
        // A part after the first starts on a whole group of 8 rows (fused parts are so).
        if e.ggml != ggml || e.cols != cols || n != rows || !row.is_multiple_of(8) {
            return None;
        }
        let sizes = CpuQWeight::group_bytes(ggml, cols)?;
        let at: Vec<usize> = e
            .bufs
            .iter()
            .zip(&sizes)
            .map(|(b, s)| b.at + row / 8 * s)
            .collect();
        let mut w = CpuQWeight::from_cached(ggml, rows, cols, self.kernel, &self.file, &at)?;
        w.set_name(name);
        Some(w)
    }
}

/// Every buffer's CRC-32 against the index, the buffers shared out over the threads.
fn check_sums(file: &Mapped, entries: &[Entry]) -> Result<()> {
    use rayon::prelude::*;
    const PIECE: usize = 8 << 20;
    // Pieces of at most 8 MiB, so two threads share the work evenly; their CRCs combine.
    let pieces: Vec<(usize, usize, usize)> = entries
        .iter()
        .flat_map(|e| e.bufs.iter())
        .enumerate()
        .flat_map(|(b, buf)| {
            (0..buf.len.div_ceil(PIECE).max(1))
                .map(move |p| (b, buf.at + p * PIECE, PIECE.min(buf.len - p * PIECE)))
        })
        .collect();
    let sums: Vec<(usize, crc32fast::Hasher, usize)> = pieces
        .par_iter()
        .map(|&(b, at, len)| {
            let mut h = crc32fast::Hasher::new();
            h.update(file.bytes(at..at + len));
            (b, h, len)
        })
        .collect();
    let mut whole: Vec<crc32fast::Hasher> = Vec::new();
    for (b, h, _) in sums {
        if b == whole.len() {
            whole.push(h);
        } else {
            whole[b].combine(&h);
        }
    }
    let bufs = entries.iter().flat_map(|e| e.bufs.iter());
    if bufs.zip(whole).any(|(buf, h)| h.finalize() != buf.crc) {
        bail!("damaged (a checksum differs)");
    }
    Ok(())
}

/// Write the cache file for `weights` (every weight on gen's kernels, each naming the file's
/// tensors it holds). Returns the bytes written; Ok(0) when skipped: no weight on a layout
/// the cache keeps, or too little disk space.
pub fn write(path: &Path, id: &[u8; 32], weights: &[&CpuQWeight]) -> Result<u64> {
    let mut entries = Vec::new();
    let mut data: Vec<&[u8]> = Vec::new();
    let mut at = 0usize;
    for w in weights {
        let (Some(bufs), false) = (w.cached_buffers(), w.parts().is_empty()) else {
            continue;
        };
        let mut list = Vec::new();
        for b in bufs {
            list.push(BufEntry {
                at,
                len: b.len(),
                crc: crc32fast::hash(b),
            });
            at += b.len().div_ceil(ALIGN) * ALIGN;
            data.push(b);
        }
        entries.push(Entry {
            ggml: w.ggml_type(),
            cols: w.dims().1,
            parts: w.parts().to_vec(),
            bufs: list,
        });
    }
    if entries.is_empty() {
        return Ok(0); // nothing on a cached layout (the scalar kernels' rows)
    }
    // Offsets so far are from the start of the data; the data starts after the index, at a
    // multiple of ALIGN. The index's length depends on the offsets: grow the start until
    // the index fits before it.
    let mut start = ALIGN * (HEAD / ALIGN + 1);
    let index = loop {
        let shifted: Vec<Entry> = entries
            .iter()
            .map(|e| Entry {
                ggml: e.ggml,
                cols: e.cols,
                parts: e.parts.clone(),
                bufs: e
                    .bufs
                    .iter()
                    .map(|b| BufEntry {
                        at: b.at + start,
                        len: b.len,
                        crc: b.crc,
                    })
                    .collect(),
            })
            .collect();
        let index = serde_json::to_vec(&shifted)?;
        if HEAD + index.len() <= start {
            break index;
        }
        start = (HEAD + index.len()).div_ceil(ALIGN) * ALIGN + 4096;
    };
    let total = (start + at) as u64;
    let dir = path
        .parent()
        .context("the tile cache path names no folder")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if free_bytes(dir).is_some_and(|free| free < total + (1 << 30)) {
        return Ok(0);
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let written = (|| -> Result<()> {
        let mut f = Pieces::new(std::fs::File::create(&tmp)?);
        f.write_all(MAGIC)?;
        f.write_all(&VERSION.to_le_bytes())?;
        f.write_all(id)?;
        f.write_all(&(index.len() as u64).to_le_bytes())?;
        f.write_all(&index)?;
        let zeros = [0u8; 4096 + ALIGN];
        f.write_all(&zeros[..start - HEAD - index.len()])?;
        for b in &data {
            f.write_all(b)?;
            f.write_all(&zeros[..b.len().div_ceil(ALIGN) * ALIGN - b.len()])?;
        }
        f.finish()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.with_context(|| format!("cannot write the tile cache {}", path.display()))?;
    trim(dir, path);
    Ok(total)
}

/// The tile cache is written in whole pieces of a huge page at multiples of it ([`Pieces`]).
const PIECE: usize = crate::format::mapped::HUGE_PAGE;

/// A file written from its start in pieces of [`PIECE`] bytes, each at a multiple of it (the
/// last shorter). The page cache keeps a file in folios no larger than the writes that made
/// them and aligned as they were: the 1 MiB writes of a `BufWriter`, at offsets the index's
/// length shifts, left 45% of a 1B model's tile cache in 2 MiB folios (Linux 6.18, ext4), and
/// only those are mapped with one page-table entry each. In whole aligned pieces it is all of
/// it, so that a later run's decode, which reads every weight once a token, walks a huge page
/// a 2 MiB run of tiles instead of 512 small ones.
struct Pieces<W: Write> {
    file: W,
    buf: Vec<u8>,
}

impl<W: Write> Pieces<W> {
    fn new(file: W) -> Self {
        Pieces {
            file,
            buf: Vec::with_capacity(PIECE),
        }
    }

    /// Writes what is left (the last, short piece); the file is then whole.
    fn finish(mut self) -> std::io::Result<W> {
        self.file.write_all(&self.buf)?;
        self.buf.clear();
        Ok(self.file)
    }
}

impl<W: Write> Write for Pieces<W> {
    fn write(&mut self, mut data: &[u8]) -> std::io::Result<usize> {
        let n = data.len();
        while !data.is_empty() {
            if self.buf.is_empty() && data.len() >= PIECE {
                // At a multiple of PIECE: the whole pieces of a large buffer go uncopied.
                let whole = data.len() / PIECE * PIECE;
                self.file.write_all(&data[..whole])?;
                data = &data[whole..];
                continue;
            }
            let take = (PIECE - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == PIECE {
                self.file.write_all(&self.buf)?;
                self.buf.clear();
            }
        }
        Ok(n)
    }

    /// Nothing: a piece is written whole or not yet (a short write here would move every
    /// later piece off its alignment); [`Pieces::finish`] writes the rest.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Least recently used cache files leave until the folder holds at most
/// `GEN_TILE_CACHE_MAX_GB` (default 20); `keep` stays. Temporary files of writes cut short
/// (over an hour old) go too.
fn trim(dir: &Path, keep: &Path) {
    let cap = std::env::var("GEN_TILE_CACHE_MAX_GB")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(20.0);
    let cap = (cap.max(0.0) * 1e9) as u64;
    let Ok(list) = std::fs::read_dir(dir) else {
        return;
    };
    let entries: Vec<std::fs::DirEntry> = list.filter_map(|e| e.ok()).collect();
    // A write cut short (the process killed) leaves its temporary file: gone after an hour.
    for e in &entries {
        let stale = e
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .is_some_and(|t| {
                t.elapsed()
                    .is_ok_and(|age| age > std::time::Duration::from_secs(3600))
            });
        let name = e.file_name();
        if stale && name.to_string_lossy().contains(".tmp-") {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
        .into_iter()
        .filter(|e| e.path().extension().is_some_and(|x| x == "tiles"))
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            Some((m.modified().ok()?, m.len(), e.path()))
        })
        .collect();
    files.sort();
    let mut total: u64 = files.iter().map(|f| f.1).sum();
    for (_, len, p) in files {
        if total <= cap {
            break;
        }
        if p != keep && std::fs::remove_file(&p).is_ok() {
            total -= len;
        }
    }
}

fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid C string and a zeroed statvfs for the call to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// `<gen's cache folder>/tiles`.
pub fn folder() -> PathBuf {
    crate::source::gen_cache_home().join("tiles")
}

/// The cache file for the GGUF file at `model` (one per file and instruction set: a changed
/// model file replaces its cache rather than adding one).
fn file_for(model: &Path, kernel: Kernel) -> PathBuf {
    let canonical = std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf());
    let mut h = Sha256::new();
    h.update(b"gen tile cache file\0");
    h.update(canonical.as_os_str().as_encoded_bytes());
    h.update([0]);
    h.update(kernel.name().as_bytes());
    let name: [u8; 32] = h.finalize().into();
    folder().join(format!("{}.tiles", hex(&name[..16])))
}

fn cache_id(fingerprint: &[u8; 32], kernel: Kernel) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"gen tile cache\0");
    h.update(VERSION.to_le_bytes());
    h.update(kernel.name().as_bytes());
    h.update([0]);
    h.update(fingerprint);
    h.finalize().into()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Remembers each write the file got: where it started and how long it was.
    #[derive(Default)]
    struct Writes {
        data: Vec<u8>,
        calls: Vec<(usize, usize)>,
    }

    impl Write for Writes {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.calls.push((self.data.len(), b.len()));
            self.data.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn pieces_reach_the_file_whole_and_aligned() {
        // Runs of the sizes a tile cache is made of: a header, an index, padding, large
        // buffers of odd lengths, small ones; flushed between runs as a caller might.
        let sizes = [
            52,
            1000,
            3044,
            5 << 20,
            7,
            3 * PIECE + 12_345,
            64,
            PIECE,
            1 << 20,
            99,
        ];
        let mut expected = Vec::new();
        let mut p = Pieces::new(Writes::default());
        for (i, &n) in sizes.iter().enumerate() {
            let run: Vec<u8> = (0..n).map(|j| (i * 31 + j * 7) as u8).collect();
            p.write_all(&run).unwrap();
            p.flush().unwrap();
            expected.extend_from_slice(&run);
        }
        let w = p.finish().unwrap();
        assert_eq!(w.data, expected, "every byte, in order");
        // Every write starts at a multiple of PIECE and, but the last, is whole pieces.
        let (last, whole) = w.calls.split_last().unwrap();
        assert!(whole.len() >= 6, "{:?}", w.calls);
        for &(at, n) in whole {
            assert!(at % PIECE == 0 && n % PIECE == 0 && n > 0, "{at} + {n}");
        }
        assert_eq!(last.0 % PIECE, 0);
        assert_eq!(last.0 + last.1, expected.len());
    }
}
