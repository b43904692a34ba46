//! `--prompt-cache FILE`: a prompt's keys and values kept on disk between runs.
//!
//! After a run, the full blocks of its prompt (the blocks the prefix cache published: what its
//! prefill computed) are written to FILE with their token ids. A later run on the same model
//! whose prompt begins with some of those tokens puts those blocks back into the prefix cache
//! before it starts, and its prefill runs over the rest only: a long, fixed instruction costs
//! its tokens once, not once per run. The values are the cache's own, byte for byte, so the
//! run gives exactly what it would without the file.
//!
//! The file says which model and cache layout it belongs to: a hash of the model file's size
//! and header (tensor index included) and of the cache layout in words (`kv_layout`: value
//! type, shape, the kernels that computed it), plus gen's file layout version. It ends with a
//! SHA-256 of everything before. A file that is short, damaged, for another model or layout,
//! or from a newer gen is not used: one warning line, and the run rewrites it. A file that does
//! not begin with gen's signature is somebody else's (a model, notes): the run stops with an
//! error before any compute and leaves it as it is. Writes go to a temporary file renamed over
//! FILE, so FILE is whole or absent, never half-written.
//!
//! Layout (little-endian): magic `genkvpc\0`, u32 version, 32-byte model id, u32 block size,
//! u64 bytes per block, u64 token count (a multiple of the block size), the token ids (u32),
//! each block's keys and values (`LanguageModel::read_kv_blocks`), 32-byte SHA-256.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

use crate::model::kv_cache::BLOCK_SIZE;
use crate::model::LanguageModel;

const MAGIC: &[u8; 8] = b"genkvpc\0";
/// Bumped whenever what a file holds, or how, changes: files of another version are not used.
/// 2: F16 and BF16 products round the activations to the weights' type (as llama.cpp does), so
/// keys and values computed before differ in their last bits from a fresh run's.
pub const VERSION: u32 = 2;
/// Bytes before the token ids.
const HEAD: usize = 8 + 4 + 32 + 4 + 8 + 8;

/// A prompt-cache file, as this run found it.
pub struct PromptCache {
    path: PathBuf,
    model_id: [u8; 32],
    /// The token ids the file holds, when it was usable.
    saved: Option<Vec<u32>>,
    /// Prompt tokens put back into the prefix cache from it.
    pub restored: usize,
    /// Reading, checking and restoring it.
    pub load_time: Duration,
}

impl PromptCache {
    /// Read `path` (if it exists) and put into `model`'s prefix cache the blocks `prompt` can
    /// use. The pool must already have room for the run (`reserve_pool`). A file that cannot
    /// be used is reported on stderr (unless `quiet`) and left to be rewritten.
    pub fn open(
        path: &Path,
        model_path: &Path,
        model: &mut dyn LanguageModel,
        prompt: &[u32],
        quiet: bool,
    ) -> Result<Self> {
        let start = Instant::now();
        let layout = model.kv_layout();
        anyhow::ensure!(
            !layout.is_empty(),
            "--prompt-cache: this model cannot save its cache (a hybrid model's recurrent state is not kept in cache files)"
        );
        let model_id = model_id(model_path, &layout)?;
        let mut cache = Self {
            path: path.to_path_buf(),
            model_id,
            saved: None,
            restored: 0,
            load_time: Duration::ZERO,
        };
        let block_bytes = model.kv_bytes_per_token() * BLOCK_SIZE;
        if !is_ours(path)? {
            anyhow::bail!(
                "--prompt-cache {} is not a gen prompt cache (it does not begin with gen's \
                 signature): refusing to overwrite it. HINT: name another file, or delete this one",
                path.display()
            );
        }
        match read(path) {
            Ok(None) => {}
            Ok(Some(bytes)) => match parse(&bytes, &model_id, block_bytes) {
                Ok((tokens, data)) => {
                    cache.restored = restore(model, prompt, &tokens, data, block_bytes)?;
                    cache.saved = Some(tokens);
                }
                Err(why) => warn(path, &why, quiet),
            },
            Err(e) => warn(path, &format!("{e:#}"), quiet),
        }
        cache.load_time = start.elapsed();
        Ok(cache)
    }

    /// Write the prompt's published blocks to the file, unless it holds those tokens already.
    /// After the run, while its blocks are still in the prefix cache.
    pub fn save(&self, model: &dyn LanguageModel, prompt: &[u32]) -> Result<()> {
        let blocks = model.kv().chain(prompt, prompt.len() / BLOCK_SIZE);
        let tokens = &prompt[..blocks.len() * BLOCK_SIZE];
        if blocks.is_empty() || self.saved.as_deref() == Some(tokens) {
            return Ok(());
        }
        let data = model.read_kv_blocks(&blocks)?;
        let block_bytes = model.kv_bytes_per_token() * BLOCK_SIZE;
        anyhow::ensure!(
            data.len() == blocks.len() * block_bytes,
            "cache blocks of another size"
        );
        let out = encode(&self.model_id, block_bytes, tokens, &data);
        write_atomically(&self.path, &out)
            .with_context(|| format!("cannot write the prompt cache {}", self.path.display()))
    }
}

fn warn(path: &Path, why: &str, quiet: bool) {
    if !quiet {
        eprintln!(
            "gen: warning: prompt cache {}: {why}; not used (this run rewrites it)",
            path.display()
        );
    }
}

/// Whether `path` may be a prompt-cache file: absent, empty, or beginning with gen's
/// signature (or a first part of it, as a file cut short does). Anything else is somebody's
/// file, which a run must not overwrite.
fn is_ours(path: &Path) -> Result<bool> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let mut head = Vec::with_capacity(MAGIC.len());
    (&mut file)
        .take(MAGIC.len() as u64)
        .read_to_end(&mut head)
        .with_context(|| format!("cannot read {}", path.display()))?;
    Ok(MAGIC.starts_with(&head))
}

/// The file's bytes; None when there is no file.
fn read(path: &Path) -> Result<Option<Vec<u8>>> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("cannot read it"),
    };
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).context("cannot read it")?;
    Ok(Some(bytes))
}

/// A prompt-cache file's bytes: `tokens` (whole blocks) and their blocks' keys and values
/// (`data`, `block_bytes` a block), for the model and cache layout `model_id` names.
pub fn encode(model_id: &[u8; 32], block_bytes: usize, tokens: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + tokens.len() * 4 + data.len() + 32);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(model_id);
    out.extend_from_slice(&(BLOCK_SIZE as u32).to_le_bytes());
    out.extend_from_slice(&(block_bytes as u64).to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(data);
    let sum = Sha256::digest(&out);
    out.extend_from_slice(&sum);
    out
}

/// The token ids and block data of a file's bytes, or why it cannot be used (one line, for
/// the warning): the file must be whole, of this file layout [`VERSION`], for `model_id` (see
/// [`model_id`]) and for blocks of `block_bytes` bytes (the model's KV bytes per token times
/// the block size). Needs no model: the fuzz target `prompt_cache` calls it on any bytes.
pub fn parse<'a>(
    bytes: &'a [u8],
    model_id: &[u8; 32],
    block_bytes: usize,
) -> std::result::Result<(Vec<u32>, &'a [u8]), String> {
    let short = || format!("cut short ({} bytes)", bytes.len());
    if bytes.len() < HEAD + 32 {
        return Err(short());
    }
    if &bytes[..8] != MAGIC {
        return Err("not a gen prompt cache".into());
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let version = u32_at(8);
    if version != VERSION {
        return Err(format!(
            "made by a gen with cache file layout {version} (this one reads {VERSION})"
        ));
    }
    if bytes[12..44] != model_id[..] {
        return Err("made for another model file or KV cache layout".into());
    }
    if u32_at(44) as usize != BLOCK_SIZE || u64_at(48) != block_bytes as u64 {
        return Err("made for another KV cache block layout".into());
    }
    let n = u64_at(56);
    if n % BLOCK_SIZE as u64 != 0 {
        return Err(format!("{n} tokens, not whole blocks"));
    }
    let blocks = n / BLOCK_SIZE as u64;
    let expected = (HEAD as u64)
        .checked_add(n.checked_mul(4).ok_or_else(short)?)
        .and_then(|x| x.checked_add(blocks.checked_mul(block_bytes as u64)?))
        .and_then(|x| x.checked_add(32))
        .ok_or_else(short)?;
    if expected != bytes.len() as u64 {
        return Err(format!(
            "{} bytes where its header says {expected}",
            bytes.len()
        ));
    }
    let body = bytes.len() - 32;
    if Sha256::digest(&bytes[..body])[..] != bytes[body..] {
        return Err("damaged (its checksum does not match)".into());
    }
    let end = HEAD + n as usize * 4;
    let tokens = bytes[HEAD..end]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    Ok((tokens, &bytes[end..body]))
}

/// Put the blocks of `saved` that `prompt` begins with into the prefix cache (at most all
/// but the prompt's last token, in whole blocks); returns how many tokens that is.
fn restore(
    model: &mut dyn LanguageModel,
    prompt: &[u32],
    saved: &[u32],
    data: &[u8],
    block_bytes: usize,
) -> Result<usize> {
    let common = saved.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    let usable = common.min(prompt.len().saturating_sub(1)) / BLOCK_SIZE;
    let placed = model.kv_mut().adopt(prompt, usable);
    for (i, b) in placed.iter().enumerate() {
        if let Some(b) = b {
            model.write_kv_blocks(&[*b], &data[i * block_bytes..(i + 1) * block_bytes])?;
        }
    }
    Ok(placed.len() * BLOCK_SIZE)
}

/// Who the cache belongs to: SHA-256 over the model's size and header (a GGUF file's bytes up
/// to its tensor data; a checkpoint folder's config.json and safetensors headers) and the
/// cache layout in words.
pub fn model_id(model_path: &Path, layout: &str) -> Result<[u8; 32]> {
    let mut h = Sha256::new();
    h.update(b"gen prompt cache\0");
    h.update(layout.as_bytes());
    h.update([0]);
    let shown = model_path.display();
    if model_path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(model_path)
            .with_context(|| format!("cannot read {shown}"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.extension().is_some_and(|x| x == "safetensors")
                    || p.file_name().is_some_and(|n| n == "config.json")
            })
            .collect();
        files.sort();
        for f in files {
            let mut file =
                std::fs::File::open(&f).with_context(|| format!("cannot read {}", f.display()))?;
            let size = file.metadata()?.len();
            h.update(f.file_name().unwrap_or_default().as_encoded_bytes());
            h.update(size.to_le_bytes());
            let head = if f.extension().is_some_and(|x| x == "safetensors") {
                let mut n = [0u8; 8];
                file.read_exact(&mut n)?;
                8 + u64::from_le_bytes(n).min(size)
            } else {
                size
            };
            h.update(read_prefix(&f, head)?);
        }
    } else {
        let mut file =
            std::fs::File::open(model_path).with_context(|| format!("cannot read {shown}"))?;
        let size = file.metadata()?.len();
        let summary = crate::format::gguf::validate(&mut file, model_path)?;
        h.update(size.to_le_bytes());
        h.update(read_prefix(model_path, summary.data_offset)?);
    }
    Ok(h.finalize().into())
}

fn read_prefix(path: &Path, len: u64) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path)?;
    let mut out = Vec::new();
    file.take(len).read_to_end(&mut out)?;
    Ok(out)
}

/// Write `bytes` to a temporary file beside `path`, flush it to disk, and rename it over
/// `path`: a reader (or a crash) sees the old file or the new one, whole.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .context("the prompt cache path names no file")?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let result = (|| -> Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tokens: &[u32], data: &[u8], id: &[u8; 32], block_bytes: u64) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(id);
        out.extend_from_slice(&(BLOCK_SIZE as u32).to_le_bytes());
        out.extend_from_slice(&block_bytes.to_le_bytes());
        out.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
        for t in tokens {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out.extend_from_slice(data);
        let sum = Sha256::digest(&out);
        out.extend_from_slice(&sum);
        out
    }

    /// A whole file parses; every shorter prefix of it, every single flipped byte, another
    /// model's id and another version are refused with a reason.
    #[test]
    fn only_a_whole_file_for_this_model_parses() {
        let id = [7u8; 32];
        let tokens: Vec<u32> = (0..32).collect();
        let data: Vec<u8> = (0..2 * 24).map(|i| i as u8).collect();
        let good = file(&tokens, &data, &id, 24);
        assert_eq!(
            encode(&id, 24, &tokens, &data),
            good,
            "save writes what parse reads"
        );
        let (t, d) = parse(&good, &id, 24).unwrap();
        assert_eq!((t, d), (tokens.clone(), &data[..]));
        for cut in 0..good.len() {
            assert!(parse(&good[..cut], &id, 24).is_err(), "cut at {cut}");
        }
        for at in 0..good.len() {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            assert!(parse(&bad, &id, 24).is_err(), "byte {at} flipped");
        }
        assert!(parse(&good, &[8u8; 32], 24)
            .unwrap_err()
            .contains("another model"));
        assert!(parse(&good, &id, 48).unwrap_err().contains("block layout"));
        let mut newer = good.clone();
        newer[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        let why = parse(&newer, &id, 24).unwrap_err();
        assert!(why.contains(&format!("layout {}", VERSION + 1)), "{why}");
    }

    #[test]
    fn atomic_writes_leave_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("gen-pc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.bin");
        write_atomically(&path, b"one").unwrap();
        write_atomically(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
