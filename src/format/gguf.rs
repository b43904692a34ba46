//! A strict, bounded pre-reader for GGUF headers: [`validate`] runs before candle reads a file.
//!
//! Model files come from strangers. candle's `gguf_file::Content::read` sizes allocations from
//! counts and lengths stored in the file, multiplies tensor dimensions without overflow checks
//! and divides by the file's own alignment, so a few hundred crafted bytes can make gen panic,
//! abort on a huge allocation or stall. [`validate`] walks the same header first and trusts none
//! of it:
//!
//! - every count and length is compared with the bytes left in the file *before* anything is
//!   allocated or looped over, so work and memory stay proportional to the file's real size;
//! - string lengths, array nesting and the total number of array elements have fixed caps (see
//!   the constants below for the reason behind each);
//! - tensor shapes and byte sizes use checked arithmetic, tensor types must be ones candle can
//!   load, and every tensor's bytes must lie inside the file, aligned, without overlapping;
//! - for the architectures gen runs (`llama`), the hyper-parameters must agree with each other,
//!   with the tensors (block count, shapes) and with the vocabulary (embedding rows, token
//!   arrays, special token ids).
//!
//! It reads only the header (about 1.8 MB for the default model), never tensor data. Every error
//! is one line that names the file and the offending field, with file-supplied text escaped and
//! shortened so a hostile name cannot forge extra lines.
//!
//! Not covered (see the module's tests for what is): tensor *contents* (NaN weights, garbage
//! quantization scales) and a file that changes between this check and candle's read.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::GgmlDType;

/// What [`validate`] learned about a file that passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufSummary {
    /// GGUF format version: 2 or 3.
    pub version: u32,
    /// Number of tensors in the file.
    pub tensor_count: u64,
    /// Number of metadata key/value pairs.
    pub metadata: usize,
    /// `general.architecture`, e.g. `llama`.
    pub architecture: String,
    /// Absolute file offset where tensor data starts: the end of the header rounded up to the
    /// alignment. Equal to candle's `Content::tensor_data_offset` for the same file.
    pub data_offset: u64,
    /// Tensors of a type gen runs but candle cannot read (IQ4_NL, IQ4_XS, MXFP4): the loader reads
    /// them itself.
    pub own_types: Vec<OwnType>,
    /// Every tensor's name, ggml type number ([`type_label`] names it) and size in bytes, in
    /// file order.
    pub tensor_bytes: Vec<(String, u32, u64)>,
    /// Every tensor's data as (file offset, bytes), in file order.
    pub tensor_spans: Vec<(u64, u64)>,
}

/// A tensor whose type candle cannot read: where its type field is in the header (so a copy
/// of the header can name a type candle reads instead) and its real type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnType {
    pub name: String,
    pub ggml: u32,
    pub type_pos: u64,
}

/// Tensor types gen runs (and so loads), by ggml's names: what a refusal lists.
pub const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4";

/// Values per block and bytes per block of a type gen reads though candle cannot.
fn own_layout(t: u32) -> Option<(u64, u64)> {
    match t {
        20 => Some((32, 18)),   // IQ4_NL
        23 => Some((256, 136)), // IQ4_XS
        39 => Some((32, 17)),   // MXFP4
        _ => None,
    }
}

/// ggml's type name (public for the loader's messages).
pub fn type_label(t: u32) -> &'static str {
    ggml_type_name(t)
}

// --- Limits. Each is far above what real models use and exists to bound work or memory. ---

/// Keys: the GGUF spec caps them at 2^16 - 1 bytes; real keys are under 64.
const MAX_KEY_LEN: u64 = 65_535;
/// Tensor names: the spec caps them at 64 bytes (ggml's `GGML_MAX_NAME`); llama.cpp refuses
/// longer names, so no loadable file has one.
const MAX_TENSOR_NAME_LEN: u64 = 64;
/// String values: the largest real ones are chat templates of some tens of KiB. candle copies
/// each string into memory, so this bounds one allocation regardless of the file's size.
const MAX_STRING_LEN: u64 = 16 << 20;
/// Array nesting. llama.cpp rejects nested arrays outright; candle recurses once per level, so
/// an uncapped chain of arrays-of-arrays could exhaust the stack. Four levels is generous.
const MAX_ARRAY_DEPTH: usize = 4;
/// Array elements in the whole file, nested ones included. candle turns each element into a
/// 32-byte `Value`, up to 32x the element's size on disk (a 1-byte u8): this caps that tree at
/// about 256 MiB. The biggest real vocabularies (~262k tokens) need about 1.3M elements for
/// tokens, types, scores and merges together, so the cap leaves 6x headroom.
const MAX_ARRAY_ELEMENTS: u64 = 1 << 23;
/// ggml tensors have at most four dimensions (`GGML_MAX_DIMS`); candle's loader agrees.
const MAX_DIMS: u32 = 4;
/// `general.alignment` ceiling: real files use 32 (the default) or 64; padding the header to a
/// larger boundary only wastes space and pushes the data offset around.
const MAX_ALIGNMENT: u64 = 1 << 20;
/// The spec's default when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// `{arch}.context_length` ceiling (16M tokens). gen builds rotary tables for the full trained
/// context, so an absurd value would be an absurd allocation; the longest real contexts are
/// around 10M.
const MAX_CONTEXT_LENGTH: u64 = 1 << 24;
/// Short string values are kept (for `general.architecture`); longer ones are only skipped.
const KEPT_STRING_LEN: u64 = 256;
/// Smallest possible metadata entry: key length prefix, a 1-byte key, value type, 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// Smallest possible tensor info: name length, 1-byte name, n_dims, one dim, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 1 + 4 + 8 + 4 + 8;

// GGUF metadata value types, as numbered on disk.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

fn type_name(t: u32) -> &'static str {
    match t {
        T_U8 => "u8",
        T_I8 => "i8",
        T_U16 => "u16",
        T_I16 => "i16",
        T_U32 => "u32",
        T_I32 => "i32",
        T_F32 => "f32",
        T_BOOL => "bool",
        T_STRING => "string",
        T_ARRAY => "array",
        T_U64 => "u64",
        T_I64 => "i64",
        T_F64 => "f64",
        _ => "unknown",
    }
}

/// Fewest bytes one value of type `t` takes on disk (`None`: not a GGUF type). Used to bound
/// an array's length by the bytes left before looping over it.
fn min_value_bytes(t: u32) -> Option<u64> {
    Some(match t {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 => 8,
        // A length prefix and possibly nothing else.
        T_STRING => 8,
        // Element type and length.
        T_ARRAY => 4 + 8,
        _ => return None,
    })
}

/// The tensor types candle can load, keyed by their ggml number. This mirrors candle 0.11's
/// (crate-private) `GgmlDType::from_u32`; a unit test checks the two agree for every number.
pub(crate) fn candle_dtype(t: u32) -> Option<GgmlDType> {
    Some(match t {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// ggml's name for a tensor type number, so a rejection says what the file actually holds.
fn ggml_type_name(t: u32) -> &'static str {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2 (removed)",
        "Q4_3 (removed)",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4 (removed)",
        "Q4_0_4_8 (removed)",
        "Q4_0_8_8 (removed)",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4 (removed)",
        "IQ4_NL_4_8 (removed)",
        "IQ4_NL_8_8 (removed)",
        "MXFP4",
    ];
    NAMES.get(t as usize).copied().unwrap_or("unknown")
}

/// Validate a GGUF file's header (and metadata/tensor consistency) without trusting any field.
///
/// Reads from the start of `file` and leaves its cursor at the start again, which is where
/// candle's `Content::read` expects it. `path` is only used to name the file in errors.
pub fn validate(file: &mut File, path: &Path) -> anyhow::Result<GgufSummary> {
    let checked = check(file);
    let rewound = file.seek(SeekFrom::Start(0));
    let shown = path.display();
    match (checked, rewound) {
        (Err(why), _) => Err(anyhow::anyhow!("{shown}: {why}")),
        (Ok(_), Err(e)) => Err(anyhow::anyhow!(
            "{shown}: cannot seek back to the start: {e}"
        )),
        (Ok(summary), Ok(_)) => Ok(summary),
    }
}

/// Internal result: the error is the message without the file name.
type Check<T> = Result<T, String>;

/// A file-supplied string as it may appear in an error: quoted, escaped, at most 80 chars.
fn show(s: &str) -> String {
    const MAX: usize = 80;
    match s.char_indices().nth(MAX) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}...", &s[..cut]),
    }
}

/// A metadata value, reduced to what the consistency checks need.
#[derive(Debug)]
enum Val {
    /// Any integer type; i128 holds both u64 and i64 exactly.
    Int(i128),
    Float,
    Bool,
    /// The text, when short and valid UTF-8.
    Str(Option<String>),
    Array {
        elem: u32,
        len: u64,
    },
}

#[derive(Debug)]
struct Kv {
    index: u64,
    ty: u32,
    val: Val,
}

impl Kv {
    /// The type as a reader would describe it, e.g. `u32` or `array of string`.
    fn describe(&self) -> String {
        match self.val {
            Val::Array { elem, .. } => format!("array of {}", type_name(elem)),
            _ => type_name(self.ty).to_string(),
        }
    }
}

#[derive(Debug)]
struct TensorInfo {
    name: String,
    /// In GGUF order: `dims[0]` is the row width (candle reverses this).
    dims: Vec<u64>,
    offset: u64,
    size: u64,
    /// ggml's type number.
    ty: u32,
    /// Set for a type gen reads itself (see [`OwnType`]).
    own: Option<OwnType>,
}

/// Reads the header sequentially, tracking the position so every read can be checked against
/// the file's length first; nothing is ever read past the end.
struct Reader<'f> {
    inner: BufReader<&'f mut File>,
    pos: u64,
    len: u64,
    /// Array elements seen so far (nested included), against [`MAX_ARRAY_ELEMENTS`].
    array_elems: u64,
}

impl Reader<'_> {
    fn left(&self) -> u64 {
        self.len - self.pos
    }

    fn cut_off(&self, what: &dyn Fn() -> String, need: u64) -> String {
        format!(
            "truncated: {} needs {need} bytes at offset {}, but the file ends at {}",
            what(),
            self.pos,
            self.len
        )
    }

    fn io_error(&self, e: std::io::Error) -> String {
        format!("read error at offset {}: {e}", self.pos)
    }

    fn fixed<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Check<[u8; N]> {
        if self.left() < N as u64 {
            return Err(self.cut_off(what, N as u64));
        }
        let mut b = [0u8; N];
        if let Err(e) = self.inner.read_exact(&mut b) {
            return Err(self.io_error(e));
        }
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Check<u32> {
        self.fixed(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Check<u64> {
        self.fixed(what).map(u64::from_le_bytes)
    }

    fn skip(&mut self, n: u64, what: &dyn Fn() -> String) -> Check<()> {
        if self.left() < n {
            return Err(self.cut_off(what, n));
        }
        // n fits: it is at most the file's length, and files are shorter than 2^63 bytes.
        let step = i64::try_from(n).map_err(|_| self.cut_off(what, n))?;
        if let Err(e) = self.inner.seek_relative(step) {
            return Err(self.io_error(e));
        }
        self.pos += n;
        Ok(())
    }

    /// `n` bytes; callers have bounded `n` by the bytes left and a fixed cap.
    fn bytes(&mut self, n: u64, what: &dyn Fn() -> String) -> Check<Vec<u8>> {
        if self.left() < n {
            return Err(self.cut_off(what, n));
        }
        let mut v = vec![0u8; n as usize];
        if let Err(e) = self.inner.read_exact(&mut v) {
            return Err(self.io_error(e));
        }
        self.pos += n;
        Ok(v)
    }

    /// A string's length prefix, checked against the end of the file and then `max`.
    fn string_len(&mut self, what: &dyn Fn() -> String, max: u64, limit: &str) -> Check<u64> {
        let n = self.u64(&|| format!("{}'s string length", what()))?;
        if n > self.left() {
            return Err(format!(
                "{} has string length {n}, beyond the end of the file ({} bytes left)",
                what(),
                self.left()
            ));
        }
        if n > max {
            return Err(format!(
                "{} has string length {n}, over the {max}-byte limit for {limit}",
                what()
            ));
        }
        Ok(n)
    }

    /// A key or tensor name: bounded, valid UTF-8, and non-empty once trailing NULs are
    /// dropped. candle drops them too, so `"a\0"` and `"a"` are the same name to it and the
    /// duplicate checks must compare the trimmed forms.
    fn name(&mut self, what: &dyn Fn() -> String, max: u64, limit: &str) -> Check<String> {
        let n = self.string_len(what, max, limit)?;
        let mut raw = self.bytes(n, what)?;
        while raw.last() == Some(&0) {
            raw.pop();
        }
        let name = String::from_utf8(raw).map_err(|e| {
            format!(
                "{} is not valid UTF-8 (bad byte {} of {n})",
                what(),
                e.utf8_error().valid_up_to()
            )
        })?;
        if name.is_empty() {
            return Err(format!("{} is an empty string", what()));
        }
        Ok(name)
    }

    /// One metadata value of type `ty`; `depth` is the number of arrays it sits in.
    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Check<Val> {
        Ok(match ty {
            T_U8 => Val::Int(self.fixed::<1>(what)?[0].into()),
            T_I8 => Val::Int(i8::from_le_bytes(self.fixed(what)?).into()),
            T_U16 => Val::Int(u16::from_le_bytes(self.fixed(what)?).into()),
            T_I16 => Val::Int(i16::from_le_bytes(self.fixed(what)?).into()),
            T_U32 => Val::Int(u32::from_le_bytes(self.fixed(what)?).into()),
            T_I32 => Val::Int(i32::from_le_bytes(self.fixed(what)?).into()),
            T_U64 => Val::Int(u64::from_le_bytes(self.fixed(what)?).into()),
            T_I64 => Val::Int(i64::from_le_bytes(self.fixed(what)?).into()),
            T_F32 => {
                self.fixed::<4>(what)?;
                Val::Float
            }
            T_F64 => {
                self.fixed::<8>(what)?;
                Val::Float
            }
            T_BOOL => {
                self.bool(what)?;
                Val::Bool
            }
            T_STRING => {
                let n = self.string_len(what, MAX_STRING_LEN, "string values")?;
                if n <= KEPT_STRING_LEN {
                    let mut raw = self.bytes(n, what)?;
                    while raw.last() == Some(&0) {
                        raw.pop();
                    }
                    Val::Str(String::from_utf8(raw).ok())
                } else {
                    self.skip(n, what)?;
                    Val::Str(None)
                }
            }
            T_ARRAY => self.array(depth + 1, what)?,
            other => return Err(format!("{} has unknown value type {other}", what())),
        })
    }

    fn bool(&mut self, what: &dyn Fn() -> String) -> Check<()> {
        match self.fixed::<1>(what)?[0] {
            0 | 1 => Ok(()),
            b => Err(format!(
                "{} is a bool stored as {b}; only 0 and 1 are valid",
                what()
            )),
        }
    }

    /// An array's element type, length and elements; `depth` counts this array itself.
    fn array(&mut self, depth: usize, what: &dyn Fn() -> String) -> Check<Val> {
        let elem = self.u32(&|| format!("{}'s array element type", what()))?;
        let Some(min) = min_value_bytes(elem) else {
            return Err(format!(
                "{} is an array of unknown element type {elem}",
                what()
            ));
        };
        if elem == T_ARRAY && depth >= MAX_ARRAY_DEPTH {
            return Err(format!(
                "{} nests arrays more than {MAX_ARRAY_DEPTH} deep",
                what()
            ));
        }
        let len = self.u64(&|| format!("{}'s array length", what()))?;
        let left = self.left();
        let need = len.checked_mul(min).filter(|&need| need <= left);
        let Some(need) = need else {
            return Err(format!(
                "{} has array length {len}, beyond the end of the file \
                 ({min} or more bytes each, {left} bytes left)",
                what()
            ));
        };
        self.array_elems = self.array_elems.saturating_add(len);
        if self.array_elems > MAX_ARRAY_ELEMENTS {
            return Err(format!(
                "{} has array length {len}, taking the file past its limit of \
                 {MAX_ARRAY_ELEMENTS} array elements in all",
                what()
            ));
        }
        match elem {
            // Fixed-size numbers: nothing to check element by element.
            T_U8 | T_I8 | T_U16 | T_I16 | T_U32 | T_I32 | T_F32 | T_U64 | T_I64 | T_F64 => {
                self.skip(need, what)?
            }
            _ => {
                // Each pass consumes at least `min` bytes, so `len` passes fit in the file.
                for i in 0..len {
                    let at = || format!("{}[{i}]", what());
                    match elem {
                        T_BOOL => self.bool(&at)?,
                        T_STRING => {
                            let n = self.string_len(&at, MAX_STRING_LEN, "string values")?;
                            self.skip(n, &at)?;
                        }
                        _ => {
                            self.array(depth + 1, &at)?;
                        }
                    }
                }
            }
        }
        Ok(Val::Array { elem, len })
    }
}

/// Everything but the file name in the messages; see [`validate`].
fn check(file: &mut File) -> Check<GgufSummary> {
    let mut r = open_reader(file)?;
    let len = r.len;
    let (version, tensor_count, kv_count) = read_preamble(&mut r)?;
    let md = read_metadata(&mut r, kv_count)?;
    let alignment = alignment(&md)?;
    let (tensors, by_name) = read_tensor_infos(&mut r, tensor_count)?;
    let data_offset = check_data(&tensors, r.pos, alignment, len)?;
    let architecture = architecture(&md)?;
    // Only families gen runs get the consistency checks; for any other the loader reports
    // the architecture as unsupported, which is the more useful message.
    if architecture == "llama" {
        let model = Model {
            md: &md,
            tensors: &tensors,
            by_name: &by_name,
            arch: &architecture,
        };
        model.check_llama()?;
    }

    let own_types = tensors.iter().filter_map(|t| t.own.clone()).collect();
    let tensor_bytes = tensors
        .iter()
        .map(|t| (t.name.clone(), t.ty, t.size))
        .collect();
    let tensor_spans = tensors
        .iter()
        .map(|t| (data_offset + t.offset, t.size))
        .collect();
    Ok(GgufSummary {
        version,
        tensor_count,
        metadata: md.len(),
        architecture,
        data_offset,
        own_types,
        tensor_bytes,
        tensor_spans,
    })
}

/// A reader over the whole file, from its start.
fn open_reader(file: &mut File) -> Check<Reader<'_>> {
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read the file's metadata: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let len = meta.len();
    if len == 0 {
        return Err("empty file: not a GGUF model".into());
    }
    file.seek(SeekFrom::Start(0))
        .map_err(|e| format!("cannot seek to the start: {e}"))?;
    // The header of a 100 MB model is under 2 MB; a 256 KiB buffer makes it a few reads.
    let capacity = len.min(256 << 10) as usize;
    Ok(Reader {
        inner: BufReader::with_capacity(capacity, file),
        pos: 0,
        len,
        array_elems: 0,
    })
}

/// The magic, the version and the two counts, each count bounded by the bytes left: (version,
/// tensor count, metadata key count).
fn read_preamble(r: &mut Reader<'_>) -> Check<(u32, u64, u64)> {
    let len = r.len;
    if len < 4 {
        return Err(format!("{len} bytes long: too short to be a GGUF file"));
    }
    let magic = r.fixed::<4>(&|| "magic".into())?;
    if &magic != b"GGUF" {
        return Err(format!(
            "not a GGUF file: it starts with {} instead of the magic \"GGUF\"",
            show(&String::from_utf8_lossy(&magic))
        ));
    }
    let version = r.u32(&|| "the version".into())?;
    match version {
        2 | 3 => {}
        // llama.cpp's hint: a byte-swapped small version means the other endianness.
        v if v & 0xffff == 0 && (1..=3).contains(&v.swap_bytes()) => {
            return Err(format!(
                "GGUF version {v} is not supported (only 2 and 3); read byte-swapped it is {}, \
                 so this is probably a big-endian file",
                v.swap_bytes()
            ))
        }
        v => {
            return Err(format!(
                "GGUF version {v} is not supported (only versions 2 and 3)"
            ))
        }
    }
    let tensor_count = r.u64(&|| "the tensor count".into())?;
    let kv_count = r.u64(&|| "the metadata key count".into())?;
    let left = r.left();
    if tensor_count > left / MIN_TENSOR_INFO_BYTES {
        return Err(format!(
            "tensor count {tensor_count} is more than the file can hold \
             (at most {} in the {left} bytes left)",
            left / MIN_TENSOR_INFO_BYTES
        ));
    }
    if kv_count > left / MIN_KV_BYTES {
        return Err(format!(
            "metadata key count {kv_count} is more than the file can hold \
             (at most {} in the {left} bytes left)",
            left / MIN_KV_BYTES
        ));
    }
    // Each count is bounded by `left` now, so neither product can overflow.
    let need = (kv_count * MIN_KV_BYTES).saturating_add(tensor_count * MIN_TENSOR_INFO_BYTES);
    if need > left {
        return Err(format!(
            "metadata key count {kv_count} and tensor count {tensor_count} need at least \
             {need} bytes, but only {left} are left"
        ));
    }
    Ok((version, tensor_count, kv_count))
}

/// The `kv_count` metadata entries; no key twice.
fn read_metadata(r: &mut Reader<'_>, kv_count: u64) -> Check<HashMap<String, Kv>> {
    // Maps grow one entry per entry actually read, never from the counts above.
    let mut md: HashMap<String, Kv> = HashMap::new();
    for i in 0..kv_count {
        let key = r.name(&|| format!("metadata key #{i}"), MAX_KEY_LEN, "keys")?;
        if let Some(prev) = md.get(&key) {
            return Err(format!(
                "metadata key #{i} {} is a duplicate of key #{}",
                show(&key),
                prev.index
            ));
        }
        let what = || format!("metadata key #{i} {}", show(&key));
        let ty = r.u32(&|| format!("{}'s value type", what()))?;
        let val = r.value(ty, 0, &what)?;
        md.insert(key, Kv { index: i, ty, val });
    }
    Ok(md)
}

/// `general.alignment`, checked, or the default.
fn alignment(md: &HashMap<String, Kv>) -> Check<u64> {
    Ok(match md.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Kv {
            ty: T_U32,
            val: Val::Int(a),
            ..
        }) => {
            let a = *a as u64;
            if !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(format!(
                    "general.alignment is {a}; it must be a power of two from 1 to {MAX_ALIGNMENT}"
                ));
            }
            a
        }
        Some(kv) => {
            return Err(format!(
                "general.alignment must be a u32, found {}",
                kv.describe()
            ))
        }
    })
}

/// The `tensor_count` tensor infos, each name once, each shape and type one candle reads; and
/// each name's index.
fn read_tensor_infos(
    r: &mut Reader<'_>,
    tensor_count: u64,
) -> Check<(Vec<TensorInfo>, HashMap<String, usize>)> {
    let mut tensors: Vec<TensorInfo> = Vec::new();
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for i in 0..tensor_count {
        let name = r.name(
            &|| format!("tensor #{i}'s name"),
            MAX_TENSOR_NAME_LEN,
            "tensor names",
        )?;
        if let Some(&j) = by_name.get(&name) {
            return Err(format!(
                "tensor #{i} {} has the same name as tensor #{j}",
                show(&name)
            ));
        }
        let what = || format!("tensor #{i} {}", show(&name));
        let n_dims = r.u32(&|| format!("{}'s dimension count", what()))?;
        if !(1..=MAX_DIMS).contains(&n_dims) {
            return Err(format!(
                "{} has {n_dims} dimensions; 1 to {MAX_DIMS} are supported",
                what()
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            let size = r.u64(&|| format!("{}'s dimension {d}", what()))?;
            if size == 0 {
                return Err(format!("{} has dimension {d} of size 0", what()));
            }
            dims.push(size);
        }
        // ggml indexes elements with int64: the product must fit there, checked step by step.
        let elems = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| {
                format!(
                    "{} has dimensions {dims:?} whose product overflows 63 bits",
                    what()
                )
            })?;
        let type_pos = r.pos;
        let ty = r.u32(&|| format!("{}'s type", what()))?;
        // (values, bytes) per block, and whether gen reads the type itself.
        let (block, block_bytes, own) = match (candle_dtype(ty), own_layout(ty)) {
            // Q8_1 and Q8_K are activation formats: no weights come in them.
            (Some(dt), _) if !matches!(dt, GgmlDType::Q8_1 | GgmlDType::Q8K) => {
                (dt.block_size() as u64, dt.type_size() as u64, false)
            }
            (_, Some((b, bytes))) => (b, bytes, true),
            _ => {
                return Err(format!(
                    "{} has type {} (ggml type {ty}), which gen does not run; supported types: {SUPPORTED_TYPES}",
                    what(),
                    ggml_type_name(ty)
                ))
            }
        };
        // Quantized types pack whole blocks per row (ggml requires this).
        if dims[0] % block != 0 {
            return Err(format!(
                "{} has rows of {} elements, not a multiple of the {} block size {block}",
                what(),
                dims[0],
                ggml_type_name(ty)
            ));
        }
        let size = (elems / block)
            .checked_mul(block_bytes)
            .ok_or_else(|| format!("{}'s byte size overflows 64 bits", what()))?;
        let own = own.then(|| OwnType {
            name: name.clone(),
            ggml: ty,
            type_pos,
        });
        let offset = r.u64(&|| format!("{}'s data offset", what()))?;
        by_name.insert(name.clone(), tensors.len());
        tensors.push(TensorInfo {
            name,
            dims,
            offset,
            size,
            ty,
            own,
        });
    }
    Ok((tensors, by_name))
}

/// Every tensor's data lies aligned inside the file, none overlapping another; returns where
/// the data starts (the header's end, `header_end`, rounded up to the alignment).
fn check_data(tensors: &[TensorInfo], header_end: u64, alignment: u64, len: u64) -> Check<u64> {
    // Where candle will look for tensor data: the header's end, rounded up to the alignment.
    let data_offset = header_end
        .checked_next_multiple_of(alignment)
        .ok_or("the data offset overflows 64 bits")?;
    for t in tensors {
        if t.offset % alignment != 0 {
            return Err(format!(
                "tensor {} has data offset {}, not a multiple of the alignment {alignment}",
                show(&t.name),
                t.offset
            ));
        }
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|start| start.checked_add(t.size));
        if end.is_none_or(|end| end > len) {
            return Err(format!(
                "tensor {} ({} bytes at data offset {}) extends beyond the end of the file \
                 ({len} bytes; truncated?)",
                show(&t.name),
                t.size,
                t.offset
            ));
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Both ends were checked to lie inside the file, so this cannot overflow.
        if a.offset + a.size > b.offset {
            return Err(format!(
                "tensors {} (data bytes {}..{}) and {} (from {}) overlap",
                show(&a.name),
                a.offset,
                a.offset + a.size,
                show(&b.name),
                b.offset
            ));
        }
    }
    Ok(data_offset)
}

/// `general.architecture`: a short, non-empty UTF-8 string.
fn architecture(md: &HashMap<String, Kv>) -> Check<String> {
    Ok(match md.get("general.architecture") {
        None => return Err("metadata has no general.architecture".into()),
        Some(Kv {
            val: Val::Str(Some(arch)),
            ..
        }) if !arch.is_empty() => arch.clone(),
        Some(kv @ Kv { ty: T_STRING, .. }) => {
            return Err(format!(
                "general.architecture (key #{}) is not a short UTF-8 string",
                kv.index
            ))
        }
        Some(kv) => {
            return Err(format!(
                "general.architecture must be a string, found {}",
                kv.describe()
            ))
        }
    })
}

/// Metadata and tensor infos of a file whose structure is sound, for the consistency checks.
struct Model<'a> {
    md: &'a HashMap<String, Kv>,
    tensors: &'a [TensorInfo],
    by_name: &'a HashMap<String, usize>,
    arch: &'a str,
}

impl Model<'_> {
    /// A hyper-parameter `{arch}.{key}`, accepted in the integer types gen's loader reads.
    fn hparam(&self, key: &str) -> Check<Option<u64>> {
        let full = format!("{}.{key}", self.arch);
        match self.md.get(&full) {
            None => Ok(None),
            Some(Kv {
                ty: T_U32 | T_I32 | T_U64 | T_I64,
                val: Val::Int(v),
                ..
            }) => u64::try_from(*v)
                .map(Some)
                .map_err(|_| format!("{full} is {v}; it cannot be negative")),
            Some(kv) => Err(format!(
                "{full} must be an integer (u32, i32, u64 or i64), found {}",
                kv.describe()
            )),
        }
    }

    fn required(&self, key: &str) -> Check<u64> {
        self.hparam(key)?
            .ok_or_else(|| format!("metadata has no {}.{key}", self.arch))
    }

    fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor `name` must exist with exactly `want` (GGUF order); `why` says where `want`
    /// comes from.
    fn expect(&self, name: &str, want: &[u64], why: &str) -> Check<&TensorInfo> {
        let t = self
            .tensor(name)
            .ok_or_else(|| format!("tensor {name} is missing"))?;
        if t.dims != want {
            return Err(format!(
                "tensor {name} has shape {:?}, but {why} imply {want:?}",
                t.dims
            ));
        }
        Ok(t)
    }

    /// The llama family as gen's loader reads it (`model::llama::LlamaConfig` and
    /// `Llama::from_checkpoint`), so a file that passes here does not fail there on shapes, and no
    /// size the loader allocates from (layers, context) comes unchecked from the metadata.
    fn check_llama(&self) -> Check<()> {
        let (n_layer, d, h, kv, hd) = self.llama_hyper_parameters()?;
        let vocab = self.vocabulary(d)?;
        self.check_tokenizer(vocab)?;
        self.check_blocks(n_layer)?;
        let a = self.arch;
        // Shapes, in GGUF order ([row width, rows]), as the loader expects them.
        let overflow = || format!("{a}.attention head sizes overflow 64 bits");
        let q_rows = h.checked_mul(hd).ok_or_else(overflow)?;
        let kv_rows = kv.checked_mul(hd).ok_or_else(overflow)?;
        let hp = format!("the {a}.* hyper-parameters");
        for i in 0..n_layer {
            let p = format!("blk.{i}");
            self.expect(&format!("{p}.attn_norm.weight"), &[d], &hp)?;
            self.expect(&format!("{p}.ffn_norm.weight"), &[d], &hp)?;
            self.expect(&format!("{p}.attn_q.weight"), &[d, q_rows], &hp)?;
            self.expect(&format!("{p}.attn_k.weight"), &[d, kv_rows], &hp)?;
            self.expect(&format!("{p}.attn_v.weight"), &[d, kv_rows], &hp)?;
            self.expect(&format!("{p}.attn_output.weight"), &[q_rows, d], &hp)?;
            if self.tensor(&format!("{p}.ffn_gate_inp.weight")).is_some() {
                // Experts (Mixtral-style): the loader checks their shapes against the router.
                continue;
            }
            let gate_name = format!("{p}.ffn_gate.weight");
            let gate = self
                .tensor(&gate_name)
                .ok_or_else(|| format!("tensor {gate_name} is missing"))?;
            let ff = match gate.dims.as_slice() {
                &[w, ff] if w == d => ff,
                _ => {
                    return Err(format!(
                        "tensor {gate_name} has shape {:?}, but {hp} imply [{d}, _]",
                        gate.dims
                    ))
                }
            };
            let why = format!("{hp} and {gate_name}");
            self.expect(&format!("{p}.ffn_up.weight"), &[d, ff], &why)?;
            self.expect(&format!("{p}.ffn_down.weight"), &[ff, d], &why)?;
        }
        self.expect("output_norm.weight", &[d], &hp)?;
        if self.tensor("output.weight").is_some() {
            self.expect(
                "output.weight",
                &[d, vocab],
                &format!("{a}.embedding_length and the vocabulary"),
            )?;
        }
        Ok(())
    }

    /// (layers, width, heads, kv heads, head width), each checked.
    fn llama_hyper_parameters(&self) -> Check<(u64, u64, u64, u64, u64)> {
        let a = self.arch;
        let n_layer = self.required("block_count")?;
        let d = self.required("embedding_length")?;
        let h = self.required("attention.head_count")?;
        let kv = self.hparam("attention.head_count_kv")?.unwrap_or(h);
        let ctx = self.required("context_length")?;
        if n_layer == 0 {
            return Err(format!(
                "{a}.block_count is 0; a model needs at least one block"
            ));
        }
        if d == 0 {
            return Err(format!("{a}.embedding_length is 0"));
        }
        if h == 0 {
            return Err(format!("{a}.attention.head_count is 0"));
        }
        if kv == 0 {
            return Err(format!("{a}.attention.head_count_kv is 0"));
        }
        // An explicit key_length sets the head width; without it, heads split the width.
        let hd = match self.hparam("attention.key_length")? {
            Some(hd) => hd,
            None if d % h != 0 => {
                return Err(format!(
                    "{a}.attention.head_count {h} does not divide {a}.embedding_length {d}"
                ))
            }
            None => d / h,
        };
        if h % kv != 0 {
            return Err(format!(
                "{a}.attention.head_count_kv {kv} does not divide {a}.attention.head_count {h}"
            ));
        }
        if hd == 0 || hd % 2 != 0 {
            return Err(format!(
                "head width {hd} ({a}.attention.key_length, or embedding_length / head_count) \
                 must be even and non-zero for rotary embeddings"
            ));
        }
        if ctx == 0 || ctx > MAX_CONTEXT_LENGTH {
            return Err(format!(
                "{a}.context_length is {ctx}; it must be from 1 to {MAX_CONTEXT_LENGTH}"
            ));
        }
        Ok((n_layer, d, h, kv, hd))
    }

    /// The vocabulary's size: the token list when the file has one, else the embedding's rows;
    /// both, and `vocab_size`, must agree.
    fn vocabulary(&self, d: u64) -> Check<u64> {
        let a = self.arch;
        // The vocabulary: the token list when the file has one, else the embedding's rows.
        let tokens = match self.md.get("tokenizer.ggml.tokens") {
            None => None,
            Some(Kv {
                val:
                    Val::Array {
                        elem: T_STRING,
                        len,
                    },
                ..
            }) => Some(*len),
            Some(kv) => {
                return Err(format!(
                    "tokenizer.ggml.tokens must be an array of strings, found {}",
                    kv.describe()
                ))
            }
        };
        if tokens == Some(0) {
            return Err("tokenizer.ggml.tokens is empty".into());
        }
        let embd = self
            .tensor("token_embd.weight")
            .ok_or("tensor token_embd.weight is missing")?;
        let &[width, rows] = embd.dims.as_slice() else {
            return Err(format!(
                "tensor token_embd.weight has shape {:?}; it must be 2-dimensional",
                embd.dims
            ));
        };
        if width != d {
            return Err(format!(
                "tensor token_embd.weight is {width} wide, but {a}.embedding_length is {d}"
            ));
        }
        let vocab = match tokens {
            Some(n) if n != rows => {
                return Err(format!(
                    "tensor token_embd.weight has {rows} rows, but tokenizer.ggml.tokens \
                     has {n} entries"
                ))
            }
            Some(n) => n,
            None => rows,
        };
        if let Some(v) = self.hparam("vocab_size")? {
            if v != vocab {
                return Err(format!(
                    "{a}.vocab_size is {v}, but the vocabulary has {vocab} tokens"
                ));
            }
        }
        Ok(vocab)
    }

    /// Blocks: exactly blk.0 .. blk.{n_layer-1}. The loader allocates per layer, so the count
    /// must be backed by tensors actually in the file.
    fn check_blocks(&self, n_layer: u64) -> Check<()> {
        let a = self.arch;
        // Blocks: exactly blk.0 .. blk.{n_layer-1}. The loader allocates per layer, so the
        // count must be backed by tensors actually in the file.
        if n_layer > self.tensors.len() as u64 {
            return Err(format!(
                "{a}.block_count is {n_layer}, but the file has only {} tensors",
                self.tensors.len()
            ));
        }
        let mut present = vec![false; n_layer as usize];
        for t in self.tensors {
            let Some(rest) = t.name.strip_prefix("blk.") else {
                continue;
            };
            let number = rest.split('.').next().unwrap_or_default();
            // Canonical decimal only: "blk.01" would be a tensor the loader never asks for.
            let canonical = !number.is_empty()
                && number.bytes().all(|b| b.is_ascii_digit())
                && (number == "0" || !number.starts_with('0'));
            let index = number.parse::<u64>().ok().filter(|_| canonical);
            let Some(index) = index else {
                return Err(format!(
                    "tensor {} has no valid block number",
                    show(&t.name)
                ));
            };
            if index >= n_layer {
                return Err(format!(
                    "tensor {} is in block {index}, but {a}.block_count is {n_layer}",
                    show(&t.name)
                ));
            }
            present[index as usize] = true;
        }
        if let Some(missing) = present.iter().position(|&p| !p) {
            return Err(format!(
                "{a}.block_count is {n_layer}, but there are no blk.{missing}.* tensors"
            ));
        }
        Ok(())
    }

    /// Token arrays and special token ids against a vocabulary of `vocab` tokens.
    fn check_tokenizer(&self, vocab: u64) -> Check<()> {
        let array = |key: &str, ok: &dyn Fn(u32) -> bool, kind: &str| -> Check<()> {
            match self.md.get(key) {
                None => Ok(()),
                Some(Kv {
                    val: Val::Array { elem, len },
                    ..
                }) if ok(*elem) => {
                    if *len != vocab {
                        return Err(format!(
                            "{key} has {len} entries, but the vocabulary has {vocab} tokens"
                        ));
                    }
                    Ok(())
                }
                Some(kv) => Err(format!(
                    "{key} must be an array of {kind}, found {}",
                    kv.describe()
                )),
            }
        };
        let integer = |t: u32| {
            matches!(
                t,
                T_U8 | T_I8 | T_U16 | T_I16 | T_U32 | T_I32 | T_U64 | T_I64
            )
        };
        array("tokenizer.ggml.token_type", &integer, "integers")?;
        array(
            "tokenizer.ggml.scores",
            &|t| t == T_F32 || t == T_F64,
            "numbers",
        )?;
        match self.md.get("tokenizer.ggml.merges") {
            None
            | Some(Kv {
                val: Val::Array { elem: T_STRING, .. },
                ..
            }) => {}
            Some(kv) => {
                return Err(format!(
                    "tokenizer.ggml.merges must be an array of strings, found {}",
                    kv.describe()
                ))
            }
        }

        // Every special id (bos, eos, unknown, padding, eot, fim_*, ...), in file order so
        // the first bad one is reported.
        let mut ids: Vec<(&String, &Kv)> = self
            .md
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer.ggml.") && k.ends_with("_token_id"))
            .collect();
        ids.sort_by_key(|(_, kv)| kv.index);
        for (key, kv) in ids {
            let Val::Int(id) = kv.val else {
                return Err(format!("{key} must be an integer, found {}", kv.describe()));
            };
            if id < 0 || id >= i128::from(vocab) {
                return Err(format!(
                    "{key} is {id}, outside the vocabulary of {vocab} tokens"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    /// A hand-made GGUF: header fields written one by one, so tests can lie in any of them.
    #[derive(Default)]
    struct Bytes(Vec<u8>);

    impl Bytes {
        fn header(version: u32, tensors: u64, kvs: u64) -> Self {
            let mut b = Self::default();
            b.raw(b"GGUF").u32(version).u64(tensors).u64(kvs);
            b
        }
        fn raw(&mut self, b: &[u8]) -> &mut Self {
            self.0.extend_from_slice(b);
            self
        }
        fn u32(&mut self, v: u32) -> &mut Self {
            self.raw(&v.to_le_bytes())
        }
        fn u64(&mut self, v: u64) -> &mut Self {
            self.raw(&v.to_le_bytes())
        }
        fn str(&mut self, s: &str) -> &mut Self {
            self.u64(s.len() as u64).raw(s.as_bytes())
        }
        fn kv_str(&mut self, k: &str, v: &str) -> &mut Self {
            self.str(k).u32(T_STRING).str(v)
        }
        fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
            self.str(k).u32(T_U32).u32(v)
        }
        fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
            self.str(name).u32(dims.len() as u32);
            for &d in dims {
                self.u64(d);
            }
            self.u32(ty).u64(offset)
        }
        /// Pad to `align`, then `data` zero bytes of tensor data.
        fn data(&mut self, align: usize, data: usize) -> &mut Self {
            let n = self.0.len().next_multiple_of(align) - self.0.len() + data;
            self.raw(&vec![0; n])
        }
    }

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("gen-gguf-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn run(name: &str, bytes: &[u8]) -> anyhow::Result<GgufSummary> {
        let p = temp(name, bytes);
        validate(&mut File::open(&p).unwrap(), &p)
    }

    fn err(name: &str, bytes: &[u8]) -> String {
        let e = format!("{:#}", run(name, bytes).expect_err("should be rejected"));
        assert!(!e.contains('\n'), "not one line: {e}");
        assert!(e.contains(name), "does not name the file: {e}");
        e
    }

    #[test]
    fn dtype_table_matches_candle_for_every_number() {
        // candle's own `from_u32` is crate-private: ask it through `Content::read`.
        for ty in 0..64u32 {
            let mut b = Bytes::header(3, 1, 1);
            b.kv_str("general.architecture", "test")
                .tensor("t", &[256], ty, 0)
                .data(32, 1024);
            let candle = gguf_file::Content::read(&mut std::io::Cursor::new(&b.0))
                .ok()
                .map(|c| c.tensor_infos["t"].ggml_dtype);
            assert_eq!(candle_dtype(ty), candle, "ggml type {ty}");
            // Accepted: the weight types gen runs, candle's (but its activation-only Q8_1 and
            // Q8_K) and IQ4_NL, IQ4_XS and MXFP4, which gen reads itself.
            let ours = run(&format!("dtype{ty}.gguf"), &b.0);
            let runs = candle.is_some_and(|d| !matches!(d, GgmlDType::Q8_1 | GgmlDType::Q8K))
                || [20, 23, 39].contains(&ty);
            assert_eq!(ours.is_ok(), runs, "ggml type {ty}: {ours:?}");
        }
    }

    #[test]
    fn data_offset_and_cursor_match_what_candle_expects() {
        for align in [None, Some(64u32), Some(1)] {
            let mut b = Bytes::header(3, 2, 1 + align.is_some() as u64);
            b.kv_str("general.architecture", "test");
            if let Some(a) = align {
                b.kv_u32("general.alignment", a);
            }
            let a = align.unwrap_or(32) as u64;
            b.tensor("odd-length-name", &[3], 0, 0)
                .tensor("b", &[5], 0, 12u64.next_multiple_of(a))
                .data(a as usize, 64 + 20);
            let p = temp("offset.gguf", &b.0);
            let mut f = File::open(&p).unwrap();
            f.seek(SeekFrom::Start(7)).unwrap();
            let s = validate(&mut f, &p).unwrap();
            assert_eq!(f.stream_position().unwrap(), 0, "cursor left at the start");
            let c = gguf_file::Content::read(&mut f).unwrap();
            assert_eq!(s.data_offset, c.tensor_data_offset, "alignment {align:?}");
            assert_eq!(
                (s.version, s.tensor_count, s.metadata),
                (3, 2, c.metadata.len())
            );
        }
    }

    #[test]
    fn accepts_what_candle_writes() {
        use candle_core::quantized::QTensor;
        use candle_core::{Device, Tensor};
        let dev = Device::Cpu;
        let t = Tensor::arange(0f32, 512., &dev)
            .unwrap()
            .reshape((2, 256))
            .unwrap();
        let q8 = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        let f32 = QTensor::quantize(&t.flatten_all().unwrap(), GgmlDType::F32).unwrap();
        let arch = gguf_file::Value::String("test".into());
        let list = gguf_file::Value::Array(vec![gguf_file::Value::U8(1); 3]);
        let mut buf = std::io::Cursor::new(Vec::new());
        gguf_file::write(
            &mut buf,
            &[("general.architecture", &arch), ("some.list", &list)],
            &[("q8", &q8), ("f32", &f32)],
        )
        .unwrap();
        let s = run("written.gguf", buf.get_ref()).unwrap();
        assert_eq!((s.version, s.tensor_count, s.metadata), (2, 2, 2));
        assert_eq!(s.architecture, "test");
    }

    #[test]
    fn file_supplied_text_cannot_forge_lines_or_flood_the_message() {
        let key = format!("evil\nkey{}", "x".repeat(500));
        let mut b = Bytes::header(3, 0, 2);
        b.kv_u32(&key, 1).kv_u32(&key, 2);
        let e = err("dup.gguf", &b.0);
        assert!(e.contains("duplicate") && e.contains("evil\\nkey"), "{e}");
        assert!(e.len() < 300, "{e}");
    }

    #[test]
    fn trailing_nuls_are_trimmed_before_duplicate_checks_as_candle_does() {
        let mut b = Bytes::header(3, 0, 2);
        b.kv_u32("a.b", 1).kv_u32("a.b\0", 2);
        assert!(err("nul.gguf", &b.0).contains("duplicate"));
    }

    #[test]
    fn nesting_is_capped_at_the_limit_and_allowed_below_it() {
        let nested = |levels: usize| {
            let mut b = Bytes::header(3, 0, 2);
            b.kv_str("general.architecture", "test")
                .str("deep")
                .u32(T_ARRAY);
            for _ in 1..levels {
                b.u32(T_ARRAY).u64(1);
            }
            b.u32(T_U8).u64(1).raw(&[7]);
            b
        };
        run("nest-ok.gguf", &nested(MAX_ARRAY_DEPTH).0).unwrap();
        let e = err("nest-deep.gguf", &nested(MAX_ARRAY_DEPTH + 1).0);
        assert!(e.contains("deep") && e.contains("\"deep\""), "{e}");
    }

    #[test]
    fn total_array_elements_are_capped() {
        // Two u8 arrays whose sum passes the cap; each alone is within it.
        let half = MAX_ARRAY_ELEMENTS / 2 + 1;
        let mut b = Bytes::header(3, 0, 2);
        for k in ["a", "b"] {
            b.str(k)
                .u32(T_ARRAY)
                .u32(T_U8)
                .u64(half)
                .raw(&vec![0; half as usize]);
        }
        let e = err("elements.gguf", &b.0);
        assert!(e.contains("\"b\"") && e.contains("limit"), "{e}");
    }

    #[test]
    fn block_numbers_must_be_canonical() {
        let mut b = Bytes::header(3, 2, 5);
        b.kv_str("general.architecture", "llama")
            .kv_u32("llama.block_count", 1)
            .kv_u32("llama.embedding_length", 32)
            .kv_u32("llama.attention.head_count", 4)
            .kv_u32("llama.context_length", 64)
            .tensor("token_embd.weight", &[32, 4], 0, 0)
            .tensor("blk.01.attn_norm.weight", &[32], 0, 512)
            .data(32, 640);
        let e = err("blk01.gguf", &b.0);
        assert!(
            e.contains("blk.01.attn_norm.weight") && e.contains("block number"),
            "{e}"
        );
    }

    #[test]
    fn show_escapes_and_truncates() {
        assert_eq!(show("a\nb"), "\"a\\nb\"");
        assert!(show(&"é".repeat(200)).ends_with("\"..."));
    }
}
