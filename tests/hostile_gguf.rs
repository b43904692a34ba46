//! Hostile GGUF files against `gen::format::gguf::validate` and the `gen` binary.
//!
//! Two sources of bad files: hand-made headers (a tiny byte writer below, so any field can lie)
//! and copies of the real default model with one field patched. The copies keep the real
//! header and the real length but are sparse past the header: `validate` never reads tensor
//! data, and neither does a loader that validates first, so the data need not be real.
//!
//! The tests that run the binary (`binary_*`) pass only once `load_gguf` calls `validate`
//! before candle reads the file.

mod common;

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gen::format::gguf::{validate, GgufSummary};

// GGUF value types and ggml tensor types used below.
const U8: u32 = 0;
const BOOL: u32 = 7;
const U32: u32 = 4;
const F32_VAL: u32 = 6;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
const U64: u32 = 10;
const F32: u32 = 0;
const Q4_0: u32 = 2;

fn tmp_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("hostile-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    })
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let p = tmp_dir().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Remove a test file once checked: the patched copies are sparse but add up over runs.
fn done(path: &Path) {
    let _ = std::fs::remove_file(path);
}

fn check(path: &Path) -> anyhow::Result<GgufSummary> {
    validate(&mut File::open(path).unwrap(), path)
}

/// `validate` must reject `path` with one line naming the file and every needle.
fn rejects(path: &Path, needles: &[&str]) -> String {
    let e = match check(path) {
        Ok(s) => panic!("{} was accepted: {s:?}", path.display()),
        Err(e) => format!("{e:#}"),
    };
    assert!(!e.contains('\n'), "not one line: {e}");
    let file = path.file_name().unwrap().to_str().unwrap();
    assert!(e.contains(file), "does not name the file: {e}");
    for n in needles {
        assert!(e.contains(n), "{}: expected {n:?} in: {e}", path.display());
    }
    e
}

// --- A tiny GGUF writer. ---

fn le32(v: u32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn le64(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// A length-prefixed string.
fn s(b: &[u8]) -> Vec<u8> {
    [le64(b.len() as u64), b.to_vec()].concat()
}

/// One metadata entry: key, value type, value bytes.
fn kv(key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    [s(key.as_bytes()), le32(ty), value.to_vec()].concat()
}

/// One tensor info: name, dims (GGUF order), ggml type, data offset.
fn ti(name: &str, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut b = [s(name.as_bytes()), le32(dims.len() as u32)].concat();
    for &d in dims {
        b.extend(le64(d));
    }
    [b, le32(ty), le64(offset)].concat()
}

/// A GGUF file as parts, so each case can change exactly one of them.
#[derive(Clone)]
struct Gguf {
    magic: Vec<u8>,
    version: u32,
    /// (tensor count, kv count) to write instead of the real ones.
    counts: Option<(u64, u64)>,
    kvs: Vec<Vec<u8>>,
    tensors: Vec<Vec<u8>>,
    align: usize,
    data: usize,
}

impl Gguf {
    /// The smallest valid file: an unknown architecture (structural checks only) and one
    /// 8 x f32 tensor.
    fn minimal() -> Self {
        Self {
            magic: b"GGUF".to_vec(),
            version: 3,
            counts: None,
            kvs: vec![kv("general.architecture", STRING, &s(b"test"))],
            tensors: vec![ti("t", &[8], F32, 0)],
            align: 32,
            data: 32,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let (nt, nkv) = self
            .counts
            .unwrap_or((self.tensors.len() as u64, self.kvs.len() as u64));
        let mut b = [self.magic.clone(), le32(self.version), le64(nt), le64(nkv)].concat();
        b.extend(self.kvs.concat());
        b.extend(self.tensors.concat());
        b.resize(b.len().next_multiple_of(self.align) + self.data, 0);
        b
    }

    fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}

#[test]
fn the_minimal_hand_made_file_passes() {
    let s = check(&write("minimal.gguf", &Gguf::minimal().bytes())).unwrap();
    assert_eq!(s.architecture, "test");
    assert_eq!((s.version, s.tensor_count, s.metadata), (3, 1, 1));
}

#[test]
fn hand_made_hostile_headers_are_rejected_naming_the_field() {
    let m = Gguf::minimal;
    let arch = || kv("general.architecture", STRING, &s(b"test"));
    let nested: Vec<u8> = [
        (0..99)
            .flat_map(|_| [le32(ARRAY), le64(1)].concat())
            .collect(),
        le32(U8),
        le64(0),
    ]
    .concat();
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        ("empty.gguf", vec![], &["empty file"]),
        ("short.gguf", b"GG".to_vec(), &["too short"]),
        (
            "magic.gguf",
            m().with(|g| g.magic = b"GGML".to_vec()).bytes(),
            &["\"GGML\"", "magic \"GGUF\""],
        ),
        (
            "v1.gguf",
            m().with(|g| g.version = 1).bytes(),
            &["version 1 "],
        ),
        (
            "v4.gguf",
            m().with(|g| g.version = 4).bytes(),
            &["version 4 "],
        ),
        (
            "vmax.gguf",
            m().with(|g| g.version = u32::MAX).bytes(),
            &["version 4294967295"],
        ),
        (
            "big-endian.gguf",
            m().with(|g| g.version = 3u32.swap_bytes()).bytes(),
            &["version 50331648", "big-endian"],
        ),
        (
            "tensor-count.gguf",
            m().with(|g| g.counts = Some((1 << 62, 1))).bytes(),
            &[
                "tensor count 4611686018427387904",
                "more than the file can hold",
            ],
        ),
        (
            "kv-count.gguf",
            m().with(|g| g.counts = Some((1, u64::MAX))).bytes(),
            &["metadata key count 18446744073709551615"],
        ),
        (
            "key-length.gguf",
            m().with(|g| g.kvs = vec![le64(1 << 63)]).bytes(),
            &[
                "metadata key #0",
                "string length 9223372036854775808",
                "beyond the end",
            ],
        ),
        (
            "key-too-long.gguf",
            m().with(|g| g.kvs.push(kv(&"k".repeat(70_000), U32, &le32(1))))
                .bytes(),
            &["metadata key #1", "string length 70000", "limit"],
        ),
        (
            "key-utf8.gguf",
            m().with(|g| g.kvs.push([s(b"\xff\xfe"), le32(U32), le32(1)].concat()))
                .bytes(),
            &["metadata key #1", "UTF-8"],
        ),
        (
            "string-value.gguf",
            m().with(|g| {
                g.kvs.push(kv(
                    "general.name",
                    STRING,
                    &[le64(1 << 40), b"abc".to_vec()].concat(),
                ))
            })
            .bytes(),
            &[
                "\"general.name\"",
                "string length 1099511627776",
                "beyond the end",
            ],
        ),
        (
            "array-2p60.gguf",
            m().with(|g| {
                g.kvs
                    .push(kv("big", ARRAY, &[le32(U64), le64(1 << 60)].concat()))
            })
            .bytes(),
            &[
                "\"big\"",
                "array length 1152921504606846976",
                "beyond the end",
            ],
        ),
        (
            "nested-100.gguf",
            m().with(|g| g.kvs.push(kv("deep", ARRAY, &nested))).bytes(),
            &["\"deep\"", "nests arrays more than 4 deep"],
        ),
        (
            "value-type.gguf",
            m().with(|g| g.kvs.push(kv("odd", 13, &le32(0)))).bytes(),
            &["\"odd\"", "unknown value type 13"],
        ),
        (
            "element-type.gguf",
            m().with(|g| g.kvs.push(kv("odd", ARRAY, &[le32(99), le64(0)].concat())))
                .bytes(),
            &["\"odd\"", "unknown element type 99"],
        ),
        (
            "bool.gguf",
            m().with(|g| g.kvs.push(kv("flag", BOOL, &[2]))).bytes(),
            &["\"flag\"", "bool stored as 2"],
        ),
        (
            "duplicate-key.gguf",
            m().with(|g| g.kvs.push(arch())).bytes(),
            &[
                "metadata key #1 \"general.architecture\"",
                "duplicate of key #0",
            ],
        ),
        (
            "no-arch.gguf",
            m().with(|g| g.kvs.clear()).bytes(),
            &["general.architecture"],
        ),
        (
            "arch-type.gguf",
            m().with(|g| g.kvs = vec![kv("general.architecture", U32, &le32(1))])
                .bytes(),
            &["general.architecture must be a string"],
        ),
        (
            "tensor-type-iq.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[256], 16, 0)])
                .bytes(),
            &[
                "tensor #0 \"t\"",
                "type IQ2_XXS (ggml type 16), which gen does not run",
                "supported types: F32, F16, BF16, Q4_0",
                "IQ4_XS",
            ],
        ),
        (
            "tensor-type-1000.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[8], 1000, 0)])
                .bytes(),
            &["tensor #0 \"t\"", "ggml type 1000"],
        ),
        (
            "ndims-0.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[], F32, 0)]).bytes(),
            &["tensor #0 \"t\"", "0 dimensions"],
        ),
        (
            "ndims-9.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[1; 9], F32, 0)])
                .bytes(),
            &["tensor #0 \"t\"", "9 dimensions"],
        ),
        (
            "dim-0.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[8, 0], F32, 0)])
                .bytes(),
            &["tensor #0 \"t\"", "dimension 1 of size 0"],
        ),
        (
            "dims-overflow.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[1 << 32, 1 << 32, 2], F32, 0)])
                .bytes(),
            &["tensor #0 \"t\"", "overflows"],
        ),
        (
            "bytes-overflow.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[1 << 31, 1 << 31], F32, 0)])
                .bytes(),
            &["tensor #0 \"t\"", "byte size overflows"],
        ),
        (
            "block-size.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[16], Q4_0, 0)])
                .bytes(),
            &["tensor #0 \"t\"", "block size 32"],
        ),
        (
            "tensor-name-long.gguf",
            m().with(|g| g.tensors = vec![ti(&"n".repeat(65), &[8], F32, 0)])
                .bytes(),
            &["tensor #0's name", "string length 65", "limit"],
        ),
        (
            "offset-beyond.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[8], F32, 1 << 40)])
                .bytes(),
            &["tensor \"t\"", "beyond the end of the file"],
        ),
        (
            "offset-max.gguf",
            m().with(|g| g.tensors = vec![ti("t", &[8], F32, u64::MAX - 31)])
                .bytes(),
            &["tensor \"t\"", "beyond the end of the file"],
        ),
        (
            "misaligned.gguf",
            m().with(|g| {
                g.tensors = vec![ti("t", &[8], F32, 4)];
                g.data = 64;
            })
            .bytes(),
            &["tensor \"t\"", "data offset 4", "alignment 32"],
        ),
        (
            "overlap.gguf",
            m().with(|g| {
                g.tensors = vec![ti("t", &[16], F32, 0), ti("u", &[8], F32, 32)];
                g.data = 96;
            })
            .bytes(),
            &["\"t\"", "\"u\"", "overlap"],
        ),
        (
            "duplicate-tensor.gguf",
            m().with(|g| {
                g.tensors = vec![ti("t", &[8], F32, 0), ti("t", &[8], F32, 32)];
                g.data = 64;
            })
            .bytes(),
            &["tensor #1 \"t\"", "same name as tensor #0"],
        ),
        (
            "alignment-0.gguf",
            m().with(|g| g.kvs.push(kv("general.alignment", U32, &le32(0))))
                .bytes(),
            &["general.alignment is 0"],
        ),
        (
            "alignment-3.gguf",
            m().with(|g| g.kvs.push(kv("general.alignment", U32, &le32(3))))
                .bytes(),
            &["general.alignment is 3"],
        ),
        (
            "alignment-2p31.gguf",
            m().with(|g| g.kvs.push(kv("general.alignment", U32, &le32(1 << 31))))
                .bytes(),
            &["general.alignment is 2147483648"],
        ),
        (
            "alignment-type.gguf",
            m().with(|g| g.kvs.push(kv("general.alignment", U64, &le64(32))))
                .bytes(),
            &["general.alignment must be a u32, found u64"],
        ),
    ];
    for (name, bytes, needles) in cases {
        let p = write(name, &bytes);
        rejects(&p, needles);
        done(&p);
    }
}

#[test]
fn every_prefix_of_a_hand_made_file_is_rejected() {
    let full = Gguf::minimal()
        .with(|g| {
            g.kvs.push(kv(
                "list",
                ARRAY,
                &[le32(STRING), le64(2), s(b"ab"), s(b"")].concat(),
            ));
            g.kvs.push(kv("f", F32_VAL, &le32(0)));
        })
        .bytes();
    check(&write("prefix-full.gguf", &full)).unwrap();
    for cut in 0..full.len() {
        rejects(&write("prefix.gguf", &full[..cut]), &[]);
    }
    done(&tmp_dir().join("prefix.gguf"));
}

// --- Copies of the real model with one field patched. ---

/// The real model's header (everything before the tensor data) and the file's length.
fn real_header() -> &'static (Vec<u8>, u64) {
    static HEADER: OnceLock<(Vec<u8>, u64)> = OnceLock::new();
    HEADER.get_or_init(|| {
        let path = common::smollm2();
        let s = check(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        (bytes[..s.data_offset as usize].to_vec(), bytes.len() as u64)
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

/// Offset of metadata key `key`'s type field.
fn key_at(h: &[u8], key: &str) -> usize {
    let pat = s(key.as_bytes());
    find(h, &pat).unwrap_or_else(|| panic!("{key} not in the real header")) + pat.len()
}

/// Offset of metadata key `key`'s value, asserting its type is `ty`.
fn value_at(h: &[u8], key: &str, ty: u32) -> usize {
    let at = key_at(h, key);
    assert_eq!(h[at..at + 4], le32(ty), "{key} type");
    at + 4
}

/// Offset of tensor `name`'s n_dims field (tensor infos come last in the header).
fn tensor_at(h: &[u8], name: &str) -> usize {
    let pat = s(name.as_bytes());
    rfind(h, &pat).unwrap_or_else(|| panic!("{name} not in the real header")) + pat.len()
}

fn put32(h: &mut [u8], at: usize, v: u32) {
    h[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(h: &mut [u8], at: usize, v: u64) {
    h[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The real header, patched by `f`, written as a sparse file of the real length.
fn patched(name: &str, f: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let (header, len) = real_header();
    let mut h = header.clone();
    f(&mut h);
    let p = tmp_dir().join(name);
    let mut file = File::create(&p).unwrap();
    file.write_all(&h).unwrap();
    file.set_len(*len).unwrap();
    p
}

fn set_key_u32(h: &mut [u8], key: &str, v: u32) {
    let at = value_at(h, key, U32);
    put32(h, at, v);
}

/// Set dimension `d` (GGUF order) of tensor `name`.
fn set_dim(h: &mut [u8], name: &str, d: usize, v: u64) {
    let at = tensor_at(h, name) + 4 + 8 * d;
    put64(h, at, v);
}

/// Set the data offset of tensor `name`, which must have `n_dims` dimensions.
fn set_offset(h: &mut [u8], name: &str, n_dims: usize, f: impl FnOnce(u64) -> u64) {
    let at = tensor_at(h, name) + 4 + 8 * n_dims + 4;
    let old = u64::from_le_bytes(h[at..at + 8].try_into().unwrap());
    put64(h, at, f(old));
}

#[test]
fn the_real_model_passes_and_agrees_with_candle() {
    let path = common::smollm2();
    let s = check(&path).unwrap();
    assert_eq!(s.version, 3);
    assert_eq!(s.architecture, "llama");
    let mut f = File::open(&path).unwrap();
    let c = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(s.data_offset, c.tensor_data_offset);
    assert_eq!(s.tensor_count, c.tensor_infos.len() as u64);
    assert_eq!(s.metadata, c.metadata.len());
    // A sparse copy of its header passes too, so the patched cases below differ only in
    // their patch.
    let p = patched("unpatched.gguf", |_| {});
    check(&p).unwrap();
    done(&p);
}

#[test]
fn validating_the_real_model_is_fast() {
    let path = common::smollm2();
    check(&path).unwrap(); // warm the page cache
    let best = (0..5)
        .map(|_| {
            let t = Instant::now();
            check(&path).unwrap();
            t.elapsed()
        })
        .min()
        .unwrap();
    eprintln!("validate on the real model: best of 5 = {best:?}");
    assert!(best < Duration::from_millis(50), "took {best:?}");
}

#[test]
fn real_model_with_lying_metadata_is_rejected_naming_the_field() {
    type Patch = Box<dyn FnOnce(&mut Vec<u8>)>;
    let key = |k: &'static str, v: u32| -> Patch { Box::new(move |h| set_key_u32(h, k, v)) };
    let cases: Vec<(&str, Patch, &[&str])> = vec![
        (
            "heads-0.gguf",
            key("llama.attention.head_count", 0),
            &["llama.attention.head_count is 0"],
        ),
        (
            "heads-5.gguf",
            key("llama.attention.head_count", 5),
            &["llama.attention.head_count 5", "llama.embedding_length 576"],
        ),
        (
            "kv-heads-2.gguf",
            key("llama.attention.head_count_kv", 2),
            &["llama.attention.head_count_kv 2", "head_count 9"],
        ),
        (
            "kv-heads-0.gguf",
            key("llama.attention.head_count_kv", 0),
            &["llama.attention.head_count_kv is 0"],
        ),
        (
            "blocks-31.gguf",
            key("llama.block_count", 31),
            &["llama.block_count is 31", "no blk.30.* tensors"],
        ),
        (
            "blocks-29.gguf",
            key("llama.block_count", 29),
            &["llama.block_count is 29", "block 29"],
        ),
        (
            "blocks-0.gguf",
            key("llama.block_count", 0),
            &["llama.block_count is 0"],
        ),
        (
            "blocks-max.gguf",
            key("llama.block_count", u32::MAX),
            &["llama.block_count is 4294967295", "only 272 tensors"],
        ),
        (
            "blocks-type.gguf",
            Box::new(|h| {
                let at = key_at(h, "llama.block_count");
                put32(h, at, F32_VAL);
            }),
            &["llama.block_count must be an integer", "found f32"],
        ),
        (
            "context-0.gguf",
            key("llama.context_length", 0),
            &["llama.context_length is 0"],
        ),
        (
            "context-max.gguf",
            key("llama.context_length", u32::MAX),
            &["llama.context_length is 4294967295"],
        ),
        (
            "width.gguf",
            // 522 = 9 heads of 58: consistent by itself, but not the embedding's width.
            key("llama.embedding_length", 522),
            &[
                "token_embd.weight is 576 wide",
                "llama.embedding_length is 522",
            ],
        ),
        (
            "vocab-size.gguf",
            key("llama.vocab_size", 50_000),
            &["llama.vocab_size is 50000", "49152 tokens"],
        ),
        (
            "embd-rows.gguf",
            Box::new(|h| set_dim(h, "token_embd.weight", 1, 49_151)),
            &[
                "token_embd.weight has 49151 rows",
                "tokenizer.ggml.tokens has 49152 entries",
            ],
        ),
        (
            "embd-dims-wrap.gguf",
            // 576 x 2^58 elements: 9 x 2^64, which wraps to 0 unchecked.
            Box::new(|h| set_dim(h, "token_embd.weight", 1, 1 << 58)),
            &["tensor #0 \"token_embd.weight\"", "overflows"],
        ),
        (
            "bos.gguf",
            key("tokenizer.ggml.bos_token_id", 49_152),
            &[
                "tokenizer.ggml.bos_token_id is 49152",
                "vocabulary of 49152",
            ],
        ),
        (
            "padding.gguf",
            key("tokenizer.ggml.padding_token_id", u32::MAX),
            &["tokenizer.ggml.padding_token_id is 4294967295"],
        ),
        (
            "attn-q-shape.gguf",
            Box::new(|h| set_dim(h, "blk.0.attn_q.weight", 1, 512)),
            &["blk.0.attn_q.weight has shape [576, 512]", "[576, 576]"],
        ),
        (
            "real-misaligned.gguf",
            Box::new(|h| set_offset(h, "blk.0.attn_norm.weight", 1, |o| o + 1)),
            &["blk.0.attn_norm.weight", "alignment 32"],
        ),
        (
            "real-overlap.gguf",
            Box::new(|h| set_offset(h, "blk.0.attn_norm.weight", 1, |o| o - 32)),
            &[
                "\"token_embd.weight\"",
                "\"blk.0.attn_norm.weight\"",
                "overlap",
            ],
        ),
        (
            "real-offset-beyond.gguf",
            Box::new(|h| set_offset(h, "output_norm.weight", 1, |_| 1 << 40)),
            &["\"output_norm.weight\"", "beyond the end of the file"],
        ),
    ];
    for (name, patch, needles) in cases {
        let p = patched(name, patch);
        rejects(&p, needles);
        done(&p);
    }
}

#[test]
fn unknown_architectures_get_only_the_structural_checks() {
    // "llama" -> "llamb", and a block count that would fail the llama checks.
    let p = patched("llamb.gguf", |h| {
        let at = value_at(h, "general.architecture", STRING);
        assert_eq!(&h[at + 8..at + 13], b"llama");
        h[at + 12] = b'b';
        set_key_u32(h, "llama.block_count", 31);
    });
    assert_eq!(check(&p).unwrap().architecture, "llamb");
    done(&p);
}

#[test]
fn truncations_of_the_real_model_are_rejected() {
    let (header, len) = real_header();
    let (header_len, len) = (header.len() as u64, *len);
    let mut cuts: Vec<u64> = (0..4096).collect();
    cuts.extend((0..64).map(|k| k * len / 64));
    cuts.extend((0..256).map(|k| k * header_len / 256));
    cuts.extend(header_len - 64..header_len + 64);
    cuts.extend(len - 64..len);
    cuts.sort_unstable();
    cuts.dedup();

    // One full copy, cut shorter and shorter.
    let p = tmp_dir().join("truncated.gguf");
    std::fs::copy(common::smollm2(), &p).unwrap();
    let mut f = File::options().read(true).write(true).open(&p).unwrap();
    validate(&mut f, &p).unwrap();
    let start = Instant::now();
    for &cut in cuts.iter().rev() {
        f.set_len(cut).unwrap();
        let e = format!(
            "{:#}",
            validate(&mut f, &p).expect_err("accepted a cut file")
        );
        assert!(!e.contains('\n') && e.contains("truncated.gguf"), "{e}");
        let known = [
            "truncated",
            "beyond the end of the file",
            "more than the file can hold",
            "empty file",
            "too short",
        ];
        assert!(known.iter().any(|k| e.contains(k)), "cut at {cut}: {e}");
    }
    eprintln!("{} cut points in {:?}", cuts.len(), start.elapsed());
    done(&p);
}

// --- The binary: one clear line and exit 1, never a panic or an abort. ---

fn run_gen(model: &Path, backtrace: &str) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gen"))
        .arg("--model")
        .arg(model)
        .args(["--prompt", "x", "--threads", "2"])
        .env("RUST_BACKTRACE", backtrace)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Exit 1 and one `gen: error:` line naming the file, with backtraces off and on (candle's own
/// errors carry a multi-line backtrace when they are on; a validated file never reaches them).
fn binary_rejects(path: &Path) {
    let shown = path.display().to_string();
    for backtrace in ["0", "1"] {
        let (code, err) = run_gen(path, backtrace);
        let ctx = format!("{shown} (RUST_BACKTRACE={backtrace})");
        assert!(!err.contains("panicked"), "{ctx}: panic: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(code, Some(1), "{ctx}: exit {code:?}: {err}");
        assert_eq!(lines.len(), 1, "{ctx}: expected one line: {err}");
        assert!(lines[0].starts_with("gen: error: "), "{ctx}: {err}");
        assert!(
            lines[0].contains(&shown),
            "{ctx}: does not name the file: {err}"
        );
    }
}

#[test]
fn binary_reports_hostile_files_in_one_line() {
    let m = Gguf::minimal;
    let files = [
        write("bin-empty.gguf", b""),
        write(
            "bin-alignment-0.gguf",
            &m().with(|g| g.kvs.push(kv("general.alignment", U32, &le32(0))))
                .bytes(),
        ),
        write(
            "bin-key-length.gguf",
            &m().with(|g| g.kvs = vec![le64(1 << 63)]).bytes(),
        ),
        // 576 x 2^58 elements wrap to 0 in unchecked u64 arithmetic.
        patched("bin-dims-overflow.gguf", |h| {
            set_dim(h, "token_embd.weight", 1, 1 << 58)
        }),
        patched("bin-blocks-max.gguf", |h| {
            set_key_u32(h, "llama.block_count", u32::MAX)
        }),
        patched("bin-context-max.gguf", |h| {
            set_key_u32(h, "llama.context_length", u32::MAX)
        }),
        patched("bin-embd-rows.gguf", |h| {
            set_dim(h, "token_embd.weight", 1, 49_151)
        }),
        patched("bin-bos.gguf", |h| {
            set_key_u32(h, "tokenizer.ggml.bos_token_id", 49_152)
        }),
    ];
    for f in &files {
        binary_rejects(f);
        done(f);
    }
}

#[test]
fn binary_reports_a_truncated_real_model_in_one_line() {
    let (header, _) = real_header();
    let p = write("bin-truncated.gguf", &header[..header.len() / 2]);
    binary_rejects(&p);
    done(&p);
}
