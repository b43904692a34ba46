//! A model's weights and hyper-parameters, wherever they are stored: a GGUF file, or a Hugging
//! Face checkpoint folder (`config.json`, safetensors weights, `tokenizer.json`).
//!
//! The rest of the model code sees one thing, a [`Checkpoint`]: GGUF-style metadata
//! (`llama.block_count`, ...) and tensors by their GGUF names (`blk.0.attn_q.weight`), each a
//! `QTensor`. For a Hugging Face folder this module translates: `config.json` becomes metadata,
//! tensor names are mapped, and the q/k projection rows are permuted the way llama.cpp's
//! converter does, so one forward pass (interleaved rotary pairs) serves both formats.
//!
//! Not here: the tokenizer and the chat template (see `super::load`), and downloading
//! (`crate::source::hub`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::{ggml_file, gguf_file, GgmlDType, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

/// Hugging Face architectures gen runs, with their `model_type` and the family (a name from
/// `model::arch::ARCHS`) whose forward pass runs them.
pub const SUPPORTED_HF_ARCHS: &[(&str, &str, &str)] = &[
    ("LlamaForCausalLM", "llama", "llama"),
    ("MistralForCausalLM", "mistral", "llama"),
    ("Qwen2ForCausalLM", "qwen2", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3", "qwen3"),
    ("Phi3ForCausalLM", "phi3", "phi3"),
    ("Gemma3ForCausalLM", "gemma3_text", "gemma3"),
];

/// Files of a Hugging Face checkpoint folder.
pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
pub const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";

/// Weights and hyper-parameters of one model.
pub struct Checkpoint {
    /// Family, as GGUF names it (`llama`).
    pub arch: String,
    /// Human name: the file's stem, or the folder's name.
    pub name: String,
    /// GGUF metadata, or the equivalent keys built from `config.json`.
    pub metadata: HashMap<String, gguf_file::Value>,
    /// End-of-sequence ids from `config.json` (`eos_token_id`, an int or a list); empty for GGUF,
    /// whose tokenizer metadata carries them.
    pub eos_token_ids: Vec<u32>,
    store: Store,
}

enum Store {
    Gguf {
        content: gguf_file::Content,
        // Reading a tensor seeks: interior mutability lets `tensor` take `&self`, so a model
        // constructor can hold a tensor-reading closure and still ask `has_tensor`.
        file: RefCell<File>,
        /// The file mapped into memory (None where it could not be): matrices for gen's CPU
        /// kernels are repacked from it ([`Checkpoint::matrix_bytes`]).
        map: Option<super::mapped::Mapped>,
        /// Every tensor's ggml type number.
        types: HashMap<String, u32>,
        /// Tensors of a type candle cannot read (name -> ggml type): gen reads their bytes
        /// itself ([`Checkpoint::matrix_bytes`]).
        own: HashMap<String, u32>,
        /// What names this file's contents ([`Checkpoint::fingerprint`]).
        fingerprint: [u8; 32],
        /// The file, as opened.
        path: PathBuf,
    },
    Safetensors(Safetensors),
}

struct Safetensors {
    files: MmapedSafetensors,
    /// GGUF name -> Hugging Face name, for every tensor gen uses.
    names: HashMap<String, String>,
    /// Type the matrices are kept in; vectors (norm weights) stay f32.
    dtype: DType,
    n_head: usize,
    n_kv_head: usize,
    family: &'static str,
}

/// A matrix's GGUF blocks as the file holds them, for gen's own kernels to repack.
pub struct RawMatrix<'a> {
    pub ggml: u32,
    pub rows: usize,
    pub cols: usize,
    /// Borrowed from the mapped file, or read into memory where it is not mapped.
    pub bytes: std::borrow::Cow<'a, [u8]>,
    /// Where the bytes are in the file.
    at: std::ops::Range<usize>,
}

/// The bytes `at` of the file: borrowed from the mapping, or read (for `name`'s errors).
fn bytes_at<'a>(
    map: Option<&'a super::mapped::Mapped>,
    file: &RefCell<File>,
    at: std::ops::Range<usize>,
    name: &str,
) -> Result<std::borrow::Cow<'a, [u8]>> {
    Ok(match map {
        Some(m) => std::borrow::Cow::Borrowed(m.bytes(at)),
        None => {
            let mut raw = vec![0u8; at.len()];
            let mut f = file.borrow_mut();
            std::io::Seek::seek(&mut *f, std::io::SeekFrom::Start(at.start as u64))?;
            std::io::Read::read_exact(&mut *f, &mut raw)
                .with_context(|| format!("reading {name}"))?;
            std::borrow::Cow::Owned(raw)
        }
    })
}

/// A matrix of a type candle cannot hold (IQ4_NL, IQ4_XS, MXFP4), widened to f32 on `device`.
fn widened(m: &RawMatrix<'_>, name: &str, device: &Device) -> Result<QTensor> {
    use crate::model::cpu::quants::{mxfp4_scales_fit, QType, Tiles};
    let (rows, cols) = (m.rows, m.cols);
    let ty = QType::from_ggml(m.ggml).with_context(|| format!("{name}: no kernel for its type"))?;
    if ty == QType::Mxfp4 && !mxfp4_scales_fit(&m.bytes) {
        anyhow::bail!("{name}: an MXFP4 block scale above 2^15 (byte 143): not a trained weight");
    }
    let tiles = Tiles::from_gguf(ty, &m.bytes, rows, cols);
    let mut values = vec![0f32; rows * cols];
    for (r, row) in values.chunks_exact_mut(cols).enumerate() {
        tiles.dequantize_row(r, row);
    }
    let t = Tensor::from_vec(values, (rows, cols), device)?;
    Ok(QTensor::quantize(&t, GgmlDType::F32)?)
}

/// See [`Checkpoint::fingerprint`]. Without a mapping, the samples are read from the file.
fn fingerprint(
    file: &File,
    header: &[u8],
    map: Option<&super::mapped::Mapped>,
    summary: &crate::format::gguf::GgufSummary,
) -> Result<[u8; 32]> {
    use sha2::{Digest, Sha256};
    let meta = file.metadata()?;
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let mut h = Sha256::new();
    h.update(b"gen gguf fingerprint\0");
    h.update(meta.len().to_le_bytes());
    h.update(modified.to_le_bytes());
    h.update(header);
    let mut sample = [0u8; 64];
    for &(start, len) in &summary.tensor_spans {
        let end = start + len;
        for at in [start, end.saturating_sub(64).max(start)] {
            let n = 64.min(end - at) as usize;
            match map {
                Some(m) => h.update(m.bytes(at as usize..at as usize + n)),
                None => {
                    std::os::unix::fs::FileExt::read_exact_at(file, &mut sample[..n], at)?;
                    h.update(&sample[..n]);
                }
            }
        }
    }
    Ok(h.finalize().into())
}

impl Checkpoint {
    /// Open a GGUF file: validate every count and size in it, then read its header.
    pub fn open_gguf(path: &Path) -> Result<Self> {
        let shown = path.display();
        let mut file =
            File::open(path).with_context(|| format!("cannot open model file {shown}"))?;
        // candle's reader trusts every count and size in the file: check them all first.
        let summary = crate::format::gguf::validate(&mut file, path)?;
        // candle reads the header from memory: it asks for the stream position at every
        // length-prefixed field, a system call each on a file (300,000 of them, most of a second,
        // for a vocabulary of 150,000 tokens and as many merges). It also refuses the whole file
        // for one tensor of a type it does not know: in the copy, those tensors say F32 (it
        // checks no sizes), and gen reads their data itself.
        let mut header = vec![0u8; summary.data_offset as usize];
        std::io::Read::read_exact(&mut file, &mut header)
            .with_context(|| format!("reading the header of {shown}"))?;
        std::io::Seek::rewind(&mut file)?;
        let map = super::mapped::Mapped::new(&file);
        let fingerprint = fingerprint(&file, &header, map.as_ref(), &summary)?;
        for t in &summary.own_types {
            let at = t.type_pos as usize;
            header[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
        }
        let mut content = super::header::content(&header)
            .map_err(|e| anyhow!("{shown} is not a readable GGUF file: {e}"))?;
        // The metadata moves to the checkpoint (tensors are read through the tensor index
        // alone): a copy was 262,144 token strings and as many scores for Gemma's vocabulary.
        let metadata = std::mem::take(&mut content.metadata);
        let own = summary
            .own_types
            .into_iter()
            .map(|t| (t.name, t.ggml))
            .collect();
        let types = summary
            .tensor_bytes
            .into_iter()
            .map(|(name, ggml, _)| (name, ggml))
            .collect();
        let arch = metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .with_context(|| format!("{shown}: metadata has no general.architecture"))?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| arch.clone());
        Ok(Self {
            arch,
            name,
            metadata,
            eos_token_ids: Vec::new(),
            store: Store::Gguf {
                content,
                file: RefCell::new(file),
                map,
                types,
                own,
                fingerprint,
                path: path.to_path_buf(),
            },
        })
    }

    /// For a GGUF file: a SHA-256 of its size, modification time, header (metadata and tensor
    /// index) and the first and last 64 bytes of every tensor's data, which names what gen
    /// derives from the file (the tile cache). None for checkpoint folders.
    pub fn fingerprint(&self) -> Option<[u8; 32]> {
        match &self.store {
            Store::Gguf { fingerprint, .. } => Some(*fingerprint),
            Store::Safetensors(_) => None,
        }
    }

    /// A GGUF file's path, as opened; None for checkpoint folders.
    pub fn gguf_path(&self) -> Option<&Path> {
        match &self.store {
            Store::Gguf { path, .. } => Some(path),
            Store::Safetensors(_) => None,
        }
    }

    /// A GGUF file's size in bytes; None for checkpoint folders.
    pub fn file_bytes(&self) -> Option<u64> {
        match &self.store {
            Store::Gguf { file, .. } => file.borrow().metadata().ok().map(|m| m.len()),
            Store::Safetensors(_) => None,
        }
    }

    /// Open a Hugging Face checkpoint folder: `config.json` and `model.safetensors`, or
    /// `model.safetensors.index.json` and the shards it names. Matrices are kept as `dtype`
    /// (f32, f16 or bf16).
    pub fn open_hf_dir(dir: &Path, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            bail!("weights can be kept as f32, f16 or bf16, not {dtype:?}");
        }
        let config_path = dir.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let cfg = HfConfig::parse(&text).with_context(|| format!("{}", config_path.display()))?;
        let shards = weight_files(dir)?;
        // SAFETY: the files are mapped read-only; like every mmap user we rely on nobody
        // truncating them while gen runs.
        let files = unsafe { MmapedSafetensors::multi(&shards) }.map_err(|e| {
            anyhow!(
                "{}: not a readable safetensors checkpoint: {e}",
                dir.display()
            )
        })?;
        let mut names = HashMap::new();
        for (hf, view) in files.tensors() {
            if hf.ends_with(".rotary_emb.inv_freq") {
                continue; // a buffer older checkpoints saved; the forward pass computes it
            }
            let Some(gguf) = gguf_name(&hf, cfg.family) else {
                bail!(
                    "{}: tensor {hf:?} is not one of the {} weights gen knows (extras such as \
                     biases the family does not have are not supported)",
                    dir.display(),
                    cfg.family
                );
            };
            if !matches!(
                DType::try_from(view.dtype()),
                Ok(DType::F32 | DType::F16 | DType::BF16)
            ) {
                bail!(
                    "{}: tensor {hf} is {:?}; gen reads f32, f16 and bf16 safetensors",
                    dir.display(),
                    view.dtype()
                );
            }
            names.insert(gguf, hf);
        }
        if cfg.tie_word_embeddings {
            // The output layer is the embedding matrix, whether or not lm_head was saved too.
            names.remove("output.weight");
        } else if !names.contains_key("output.weight") {
            bail!(
                "{}: there is no lm_head.weight and config.json does not say \
                 tie_word_embeddings: true",
                dir.display()
            );
        }
        let name = checkpoint_name(&dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()));
        let metadata = cfg.gguf_metadata(&name);
        Ok(Self {
            arch: cfg.family.to_string(),
            name,
            metadata,
            eos_token_ids: cfg.eos_token_ids.clone(),
            store: Store::Safetensors(Safetensors {
                files,
                names,
                dtype,
                n_head: cfg.num_attention_heads,
                n_kv_head: cfg.num_key_value_heads,
                family: cfg.family,
            }),
        })
    }

    /// The blocks of matrix `name` as the file holds them, for any type whose size gen knows;
    /// None for other tensors, other types, and checkpoint folders (read those with
    /// [`Self::tensor`]).
    pub fn matrix_bytes(&self, name: &str) -> Result<Option<RawMatrix<'_>>> {
        let Store::Gguf {
            content,
            file,
            map,
            types,
            own,
            ..
        } = &self.store
        else {
            return Ok(None);
        };
        let (Some(info), Some(&ggml)) = (content.tensor_infos.get(name), types.get(name)) else {
            return Ok(None);
        };
        // candle's shape is reversed from GGUF's: (rows, columns) for a matrix. A vector of
        // a type candle cannot read is a matrix of one row (candle reads the others).
        let (rows, cols) = match info.shape.dims() {
            [cols] if own.contains_key(name) => (1, *cols),
            [rows, cols] => (*rows, *cols),
            _ if !own.contains_key(name) => return Ok(None),
            d => bail!("{name} has shape {d:?}; a matrix was expected"),
        };
        let Some(len) = crate::model::cpu::matmul::CpuQWeight::file_bytes_of(ggml, rows, cols)
        else {
            return Ok(None);
        };
        // Inside the file: gguf::validate checked every tensor's offset and size.
        let start = (content.tensor_data_offset + info.offset) as usize;
        let at = start..start + len;
        let bytes = bytes_at(map.as_ref(), file, at.clone(), name)?;
        Ok(Some(RawMatrix {
            ggml,
            rows,
            cols,
            bytes,
            at,
        }))
    }

    /// Expert `e`'s matrix of the stacked expert tensor `name` (candle dims [E, rows, cols],
    /// GGUF's [cols, rows, E]): its blocks as the file holds them, for any type whose size gen
    /// or candle knows. None where the checkpoint has no such 3-D tensor.
    pub fn expert_bytes(&self, name: &str, e: usize) -> Result<Option<RawMatrix<'_>>> {
        let Store::Gguf {
            content,
            file,
            map,
            types,
            ..
        } = &self.store
        else {
            return Ok(None);
        };
        let (Some(info), Some(&ggml)) = (content.tensor_infos.get(name), types.get(name)) else {
            return Ok(None);
        };
        let &[n, rows, cols] = info.shape.dims() else {
            return Ok(None);
        };
        if e >= n {
            bail!("{name} holds {n} experts, not {}", e + 1);
        }
        let len = match crate::model::cpu::matmul::CpuQWeight::file_bytes_of(ggml, rows, cols) {
            Some(len) => len,
            None => {
                let dt = crate::format::gguf::candle_dtype(ggml)
                    .with_context(|| format!("{name}: a type gen cannot slice into experts"))?;
                if cols % dt.block_size() != 0 {
                    bail!("{name}: rows of {cols} values are not whole blocks of its type");
                }
                rows * cols / dt.block_size() * dt.type_size()
            }
        };
        // Inside the file: gguf::validate checked every tensor's offset and size.
        let start = (content.tensor_data_offset + info.offset) as usize + e * len;
        let at = start..start + len;
        let bytes = bytes_at(map.as_ref(), file, at.clone(), name)?;
        Ok(Some(RawMatrix {
            ggml,
            rows,
            cols,
            bytes,
            at,
        }))
    }

    /// Expert `e` of `name` ([`Self::expert_bytes`]) as a tensor on `device`; a type candle
    /// cannot hold comes widened to f32, as [`Self::tensor`] gives it.
    pub fn expert_tensor(&self, name: &str, e: usize, device: &Device) -> Result<QTensor> {
        let m = self
            .expert_bytes(name, e)?
            .with_context(|| format!("{name} is not a stack of expert matrices"))?;
        let (rows, cols) = (m.rows, m.cols);
        if let Some(dt) = crate::format::gguf::candle_dtype(m.ggml) {
            return Ok(candle_core::quantized::ggml_file::qtensor_from_ggml(
                dt,
                &m.bytes,
                vec![rows, cols],
                device,
            )?);
        }
        widened(&m, name, device)
    }

    /// The experts, rows and columns of a stacked expert tensor (candle's [E, rows, cols]).
    pub fn expert_dims(&self, name: &str) -> Option<(usize, usize, usize)> {
        let Store::Gguf { content, .. } = &self.store else {
            return None;
        };
        match content.tensor_infos.get(name)?.shape.dims() {
            &[n, rows, cols] => Some((n, rows, cols)),
            _ => None,
        }
    }

    /// Whether `name` is of a type candle cannot read, so gen's kernels must take it.
    pub fn is_own_type(&self, name: &str) -> bool {
        matches!(&self.store, Store::Gguf { own, .. } if own.contains_key(name))
    }

    /// Done with a matrix's bytes: its pages of the mapped file leave the process's memory.
    pub fn release(&self, m: RawMatrix<'_>) {
        if let (Store::Gguf { map: Some(map), .. }, std::borrow::Cow::Borrowed(_)) =
            (&self.store, &m.bytes)
        {
            let at = m.at.clone();
            drop(m);
            map.release(at);
        }
    }

    /// Whether the checkpoint holds a tensor of this GGUF name.
    pub fn has_tensor(&self, name: &str) -> bool {
        match &self.store {
            Store::Gguf { content, .. } => content.tensor_infos.contains_key(name),
            Store::Safetensors(st) => st.names.contains_key(name),
        }
    }

    /// The GGUF names of every tensor the checkpoint holds, sorted.
    pub fn tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = match &self.store {
            Store::Gguf { content, .. } => content.tensor_infos.keys().cloned().collect(),
            Store::Safetensors(st) => st.names.keys().cloned().collect(),
        };
        names.sort();
        names
    }

    /// Values in all of the checkpoint's tensors (weights of every type counted alike).
    pub fn parameter_count(&self) -> usize {
        match &self.store {
            Store::Gguf { content, .. } => content
                .tensor_infos
                .values()
                .map(|t| t.shape.elem_count())
                .sum(),
            Store::Safetensors(st) => st
                .names
                .values()
                .filter_map(|hf| st.files.get(hf).ok())
                .map(|view| view.shape().iter().product::<usize>())
                .sum(),
        }
    }

    /// The tensor of this GGUF name, on `device`. A tensor of a type candle cannot hold
    /// (IQ4_NL, IQ4_XS, MXFP4) comes widened to f32: matrices of those types are read with
    /// [`Self::matrix_bytes`] instead, so this serves an embedding or a norm in such a type.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        match &self.store {
            Store::Gguf { own, .. } if own.contains_key(name) => {
                let m = self
                    .matrix_bytes(name)?
                    .with_context(|| format!("{name}: not a whole number of blocks"))?;
                widened(&m, name, device)
            }
            Store::Gguf { content, file, .. } => {
                Ok(content.tensor(&mut *file.borrow_mut(), name, device)?)
            }
            Store::Safetensors(st) => st.tensor(name, device),
        }
    }
}

impl Safetensors {
    fn tensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        let hf = self
            .names
            .get(name)
            .with_context(|| format!("the checkpoint has no tensor {name}"))?;
        let mut t = self.files.load(hf, &Device::Cpu)?;
        // Only llama GGUFs pair neighbouring dimensions in rope; the other families rotate
        // halves, as Hugging Face does, and keep its row order.
        let heads = match name {
            _ if self.family != "llama" => None,
            n if n.ends_with(".attn_q.weight") => Some(self.n_head),
            n if n.ends_with(".attn_k.weight") => Some(self.n_kv_head),
            _ => None,
        };
        if let Some(heads) = heads {
            t = hf_rows_to_interleaved(&t, heads).with_context(|| format!("tensor {hf}"))?;
        }
        // Gemma's RMS norms scale by 1 + w; llama.cpp's converter stores 1 + w, as gen reads it.
        if self.family == "gemma3" && name.ends_with("norm.weight") {
            t = (t.to_dtype(DType::F32)? + 1.0)?;
        }
        let (dtype, ggml) = match (t.rank(), self.dtype) {
            (2, DType::F16) => (DType::F16, GgmlDType::F16),
            (2, DType::BF16) => (DType::BF16, GgmlDType::BF16),
            _ => (DType::F32, GgmlDType::F32),
        };
        let t = t.to_dtype(dtype)?.contiguous()?;
        let dims = t.dims().to_vec();
        let bytes = cpu_bytes(&t)?;
        Ok(ggml_file::qtensor_from_ggml(ggml, &bytes, dims, device)?)
    }
}

/// The raw little-endian bytes of a contiguous CPU tensor of f32, f16 or bf16.
fn cpu_bytes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(match t.dtype() {
        DType::F32 => t
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => t
            .flatten_all()?
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .flatten_all()?
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        other => bail!("unexpected tensor type {other:?}"),
    })
}

/// How the report names a checkpoint folder: `owner/name` for a snapshot in the Hugging Face
/// cache (`.../models--owner--name/snapshots/COMMIT`), else the folder's name.
pub fn checkpoint_name(dir: &Path) -> String {
    fn part(p: Option<&Path>) -> Option<String> {
        Some(p?.file_name()?.to_string_lossy().into_owned())
    }
    let snapshots = dir.parent();
    if part(snapshots).as_deref() == Some("snapshots") {
        if let Some(repo) = part(snapshots.and_then(Path::parent)) {
            if let Some((owner, name)) = repo
                .strip_prefix("models--")
                .and_then(|r| r.split_once("--"))
            {
                return format!("{owner}/{name}");
            }
        }
    }
    part(Some(dir)).unwrap_or_else(|| "model".into())
}

/// The safetensors files of a checkpoint folder: the shards the index names, or the one file.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(WEIGHTS_INDEX_FILE);
    let single = dir.join(SINGLE_WEIGHTS_FILE);
    let files = if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        shard_names(&text)
            .with_context(|| format!("{}", index.display()))?
            .into_iter()
            .map(|s| dir.join(s))
            .collect()
    } else if single.is_file() {
        vec![single]
    } else {
        bail!(
            "{} has neither {SINGLE_WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}. HINT: gen reads \
             Hugging Face checkpoints in safetensors format, or a .gguf file",
            dir.display()
        );
    };
    for f in &files {
        if !f.is_file() {
            bail!(
                "{} names the shard {}, which is missing. HINT: download the whole checkpoint",
                index.display(),
                f.display()
            );
        }
    }
    Ok(files)
}

/// The distinct shard files of a `model.safetensors.index.json`, in order, each checked to be
/// a plain file name inside the folder.
pub fn shard_names(index_json: &str) -> Result<Vec<String>> {
    let v: Value = serde_json::from_str(index_json).context("not valid JSON")?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .context("it has no weight_map object")?;
    let mut shards: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .with_context(|| format!("weight_map[{tensor:?}] is not a file name"))?;
        let inside = !file.is_empty()
            && Path::new(file)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        if !inside {
            bail!("weight_map[{tensor:?}] names {file:?}, which is not a file inside the folder");
        }
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_string());
        }
    }
    if shards.is_empty() {
        bail!("its weight_map is empty");
    }
    shards.sort();
    Ok(shards)
}

/// The GGUF name of a Hugging Face tensor of `family` (a GGUF architecture name), or `None`
/// for a name gen does not use.
pub fn gguf_name(hf: &str, family: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let i: usize = layer.parse().ok()?;
    if i.to_string() != layer {
        return None; // "01", "+1": not a name a real checkpoint has
    }
    let gemma = family == "gemma3";
    let part = match rest {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        // Gemma norms before and after each block; the others only before.
        "post_attention_layernorm.weight" if gemma => "post_attention_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "pre_feedforward_layernorm.weight" if gemma => "ffn_norm.weight",
        "post_feedforward_layernorm.weight" if gemma => "post_ffw_norm.weight",
        "self_attn.q_proj.bias" if family == "qwen2" => "attn_q.bias",
        "self_attn.k_proj.bias" if family == "qwen2" => "attn_k.bias",
        "self_attn.v_proj.bias" if family == "qwen2" => "attn_v.bias",
        "self_attn.q_norm.weight" if gemma || family == "qwen3" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" if gemma || family == "qwen3" => "attn_k_norm.weight",
        "self_attn.qkv_proj.weight" if family == "phi3" => "attn_qkv.weight",
        "mlp.gate_up_proj.weight" if family == "phi3" => "ffn_up.weight",
        _ => return None,
    };
    Some(format!("blk.{i}.{part}"))
}

/// Reorder the rows of a Hugging Face q or k projection (heads*hd, d) into GGUF order.
///
/// Hugging Face llama rotates pairs (i, i + hd/2) of each head ("rotate half"); GGUF files, and
/// candle's `rope_i` that our forward pass uses, rotate neighbours (2j, 2j + 1). Moving row
/// `s*hd/2 + j` of each head to row `2j + s` (s in {0, 1}) turns one into the other; it is
/// llama.cpp's `permute` in `convert_hf_to_gguf.py`. Attention scores are dot products over a
/// head's width, which do not change when q and k are both permuted the same way.
pub fn hf_rows_to_interleaved(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        bail!("a q/k projection of {rows} rows does not split into {heads} heads of even width");
    }
    let half = rows / heads / 2;
    Ok(w.reshape((heads, 2, half, cols))? // head, s, j
        .transpose(1, 2)? // head, j, s
        .contiguous()?
        .reshape((rows, cols))?)
}

/// The fields of a `config.json` gen uses.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    /// Family gen runs it with (`llama`, `gemma3`, ...).
    pub family: &'static str,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: Option<usize>,
    /// `max_position_embeddings`, capped at `sliding_window` where the model has one (gen
    /// attends to the whole context, which equals a sliding window only up to its width).
    pub context_length: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    /// Sliding window of the layers that have one (Gemma 3's local layers, Phi-3's).
    pub sliding_window: Option<usize>,
    /// Rope base of Gemma 3's local layers (`rope_local_base_freq`).
    pub rope_local_base: Option<f64>,
}

impl HfConfig {
    /// Parse a `config.json`. Errors name the field and what was wrong with it.
    pub fn parse(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).context("not valid JSON")?;
        if !v.is_object() {
            bail!("not a JSON object");
        }
        let family = family_of(&v)?;
        let uint = |key: &str| -> Result<Option<usize>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => match x.as_u64().and_then(|n| usize::try_from(n).ok()) {
                    Some(n) if n > 0 => Ok(Some(n)),
                    _ => bail!("{key} should be a positive integer, found {x}"),
                },
            }
        };
        let need = |key: &str| -> Result<usize> {
            uint(key)?.with_context(|| format!("{key} is missing"))
        };
        let float = |key: &str, default: f64| -> Result<f64> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => match x.as_f64() {
                    Some(f) if f.is_finite() && f > 0.0 => Ok(f),
                    _ => bail!("{key} should be a positive number, found {x}"),
                },
            }
        };
        let flag = |key: &str, default: bool| -> Result<bool> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(x) => bail!("{key} should be true or false, found {x}"),
            }
        };
        let gemma = family == "gemma3";
        let act_wanted = if gemma { "gelu_pytorch_tanh" } else { "silu" };
        if let Some(act) = v.get("hidden_act").or_else(|| v.get("hidden_activation")) {
            if act.as_str() != Some(act_wanted) {
                bail!("hidden_act {act} is not supported (gen's {family} runs {act_wanted})");
            }
        }
        for key in ["attention_bias", "mlp_bias"] {
            if flag(key, false)? {
                bail!("{key}: true is not supported (gen's {family} has no such biases)");
            }
        }
        for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if !matches!(v.get(key), None | Some(Value::Null)) {
                bail!("{key} is set: logit soft-capping is not supported");
            }
        }
        if let Some(f) = v.get("partial_rotary_factor") {
            if f.as_f64() != Some(1.0) {
                bail!("partial_rotary_factor {f} is not supported (gen rotates whole heads)");
            }
        }
        match v.get("rope_scaling") {
            None | Some(Value::Null) => {}
            Some(s) => {
                let kind = s.get("rope_type").or_else(|| s.get("type"));
                if kind.and_then(Value::as_str) != Some("default") {
                    bail!(
                        "rope_scaling {s} is not supported yet (gen applies plain rotary \
                         embeddings)"
                    );
                }
            }
        }
        let num_attention_heads = need("num_attention_heads")?;
        let num_key_value_heads = uint("num_key_value_heads")?.unwrap_or(num_attention_heads);
        let mut context_length = need("max_position_embeddings")?;
        let num_hidden_layers = need("num_hidden_layers")?;
        let mut sliding_window = None;
        let window = uint("sliding_window")?;
        match family {
            // gen runs llama-family models without a window (as llama.cpp does), so only up to
            // its width is that the same model.
            "llama" => {
                if let Some(w) = window {
                    context_length = context_length.min(w);
                }
            }
            "qwen2" | "qwen3" => {
                if flag("use_sliding_window", false)? {
                    bail!("use_sliding_window: true is not supported for {family}");
                }
            }
            "gemma3" => {
                sliding_window = window;
                // Five local layers, then one global (gen's decoder; llama.cpp's too).
                let expected: Vec<&str> = (0..num_hidden_layers)
                    .map(|l| match (window, l % 6 < 5) {
                        (Some(_), true) => "sliding_attention",
                        _ => "full_attention",
                    })
                    .collect();
                if let Some(types) = v.get("layer_types").filter(|t| !t.is_null()) {
                    let given: Option<Vec<&str>> = types
                        .as_array()
                        .map(|a| a.iter().filter_map(Value::as_str).collect());
                    if given.as_deref() != Some(expected.as_slice()) {
                        bail!("layer_types {} is not Gemma 3's five local layers then one global, which is what gen runs", short(types));
                    }
                }
                if let Some(p) = v.get("sliding_window_pattern").filter(|p| !p.is_null()) {
                    if p.as_u64() != Some(6) {
                        bail!("sliding_window_pattern {p} is not supported (gen runs 6)");
                    }
                }
                // llama.cpp scales Gemma 3's scores by 1/sqrt(head_dim) (by 1/sqrt(d / heads)
                // for the 62-layer 27B), as gemma_pytorch does, not by the config's scalar.
                let heads = need("num_attention_heads")?;
                let width = match num_hidden_layers {
                    62 => need("hidden_size")? / heads,
                    _ => uint("head_dim")?.unwrap_or(need("hidden_size")? / heads),
                };
                if let Some(q) = v.get("query_pre_attn_scalar").filter(|q| !q.is_null()) {
                    if q.as_f64() != Some(width as f64) {
                        bail!(
                            "query_pre_attn_scalar {q} is not {width}, the width llama.cpp and gen \
                             scale Gemma 3's attention by"
                        );
                    }
                }
            }
            _ => sliding_window = window,
        }
        let eos_token_ids = match v.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => ids.iter().map(token_id).collect::<Result<_>>()?,
            Some(id) => vec![token_id(id)?],
        };
        Ok(Self {
            family,
            hidden_size: need("hidden_size")?,
            intermediate_size: need("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim: uint("head_dim")?,
            context_length,
            rms_norm_eps: float("rms_norm_eps", 1e-6)?,
            rope_theta: float("rope_theta", 10_000.0)?,
            // Gemma's configs leave it out: tied is their default.
            tie_word_embeddings: flag("tie_word_embeddings", gemma)?,
            eos_token_ids,
            sliding_window,
            rope_local_base: gemma
                .then(|| float("rope_local_base_freq", 10_000.0))
                .transpose()?,
        })
    }

    /// The GGUF metadata a GGUF converted from this checkpoint would carry.
    pub fn gguf_metadata(&self, name: &str) -> HashMap<String, gguf_file::Value> {
        use gguf_file::Value as V;
        let a = self.family;
        let u = |n: usize| V::U64(n as u64);
        let mut md = HashMap::from([
            ("general.architecture".to_string(), V::String(a.into())),
            ("general.name".to_string(), V::String(name.into())),
            (format!("{a}.block_count"), u(self.num_hidden_layers)),
            (format!("{a}.embedding_length"), u(self.hidden_size)),
            (
                format!("{a}.feed_forward_length"),
                u(self.intermediate_size),
            ),
            (
                format!("{a}.attention.head_count"),
                u(self.num_attention_heads),
            ),
            (
                format!("{a}.attention.head_count_kv"),
                u(self.num_key_value_heads),
            ),
            (format!("{a}.context_length"), u(self.context_length)),
            (
                format!("{a}.attention.layer_norm_rms_epsilon"),
                V::F32(self.rms_norm_eps as f32),
            ),
            (
                format!("{a}.rope.freq_base"),
                V::F32(self.rope_theta as f32),
            ),
        ]);
        if let Some(hd) = self.head_dim {
            md.insert(format!("{a}.attention.key_length"), u(hd));
            md.insert(format!("{a}.attention.value_length"), u(hd));
        }
        if let Some(w) = self.sliding_window {
            md.insert(format!("{a}.attention.sliding_window"), u(w));
        }
        if let Some(base) = self.rope_local_base {
            md.insert(format!("{a}.rope.freq_base_swa"), V::F32(base as f32));
        }
        md
    }
}

/// The family of a `config.json`, from `architectures` (or `model_type` when that is absent).
fn family_of(v: &Value) -> Result<&'static str> {
    let supported = || {
        let names: Vec<&str> = SUPPORTED_HF_ARCHS.iter().map(|(a, _, _)| *a).collect();
        let mut families: Vec<&str> = Vec::new();
        for (_, _, family) in SUPPORTED_HF_ARCHS {
            if !families.contains(family) {
                families.push(family);
            }
        }
        format!(
            "supported: {} (families {})",
            names.join(", "),
            families.join(", ")
        )
    };
    let model_type = v.get("model_type").and_then(Value::as_str);
    match v.get("architectures") {
        Some(Value::Array(archs)) if !archs.is_empty() => {
            let arch = archs[0].as_str().with_context(|| {
                format!("architectures[0] should be a string, found {}", archs[0])
            })?;
            SUPPORTED_HF_ARCHS
                .iter()
                .find(|(a, _, _)| *a == arch)
                .map(|(_, _, f)| *f)
                .with_context(|| {
                    format!(
                        "architecture {arch:?} is not supported yet ({})",
                        supported()
                    )
                })
        }
        None | Some(Value::Null) | Some(Value::Array(_)) => {
            let mt = model_type.with_context(|| {
                format!(
                    "neither architectures nor model_type says what model this is ({})",
                    supported()
                )
            })?;
            SUPPORTED_HF_ARCHS
                .iter()
                .find(|(_, t, _)| *t == mt)
                .map(|(_, _, f)| *f)
                .with_context(|| {
                    format!("model_type {mt:?} is not supported yet ({})", supported())
                })
        }
        Some(other) => bail!("architectures should be a list of names, found {other}"),
    }
}

fn token_id(v: &Value) -> Result<u32> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .with_context(|| format!("eos_token_id should be a token id or a list of them, found {v}"))
}

/// What gen takes from a `tokenizer_config.json`. (`add_bos_token` and the special token ids
/// are read with the tokenizer itself, see `Tokenizer::from_file`.)
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HfTokenizerConfig {
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl HfTokenizerConfig {
    pub fn parse(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).context("not valid JSON")?;
        if !v.is_object() {
            bail!("not a JSON object");
        }
        // A token is a string or an AddedToken object {"content": ...}.
        let token = |key: &str| -> Result<Option<String>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(t) => match t.get("content").and_then(Value::as_str) {
                    Some(s) => Ok(Some(s.to_string())),
                    None => bail!("{key} should be a string or {{\"content\": ...}}, found {t}"),
                },
            }
        };
        // The template is a string, or a list of named templates of which gen takes "default".
        let chat_template = match v.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(named)) => {
                let mut default = None;
                for t in named {
                    let (Some(name), Some(src)) = (
                        t.get("name").and_then(Value::as_str),
                        t.get("template").and_then(Value::as_str),
                    ) else {
                        bail!(
                            "chat_template entries should be {{\"name\", \"template\"}}, found {t}"
                        );
                    };
                    if name == "default" {
                        default = Some(src.to_string());
                    }
                }
                default
            }
            Some(other) => bail!(
                "chat_template should be a string or a list of named templates, found {}",
                short(other)
            ),
        };
        Ok(Self {
            chat_template,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
        })
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_snapshots_are_named_by_their_repo() {
        let snap = Path::new("/c/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/0123abc");
        assert_eq!(checkpoint_name(snap), "HuggingFaceTB/SmolLM2-135M");
        assert_eq!(checkpoint_name(Path::new("/m/my-llama")), "my-llama");
        assert_eq!(checkpoint_name(Path::new("/x/snapshots/abc")), "abc");
    }

    #[test]
    fn names_map_to_gguf() {
        let cases = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
            (
                "model.layers.0.input_layernorm.weight",
                "blk.0.attn_norm.weight",
            ),
            (
                "model.layers.7.self_attn.q_proj.weight",
                "blk.7.attn_q.weight",
            ),
            (
                "model.layers.7.self_attn.k_proj.weight",
                "blk.7.attn_k.weight",
            ),
            (
                "model.layers.7.self_attn.v_proj.weight",
                "blk.7.attn_v.weight",
            ),
            (
                "model.layers.7.self_attn.o_proj.weight",
                "blk.7.attn_output.weight",
            ),
            (
                "model.layers.12.post_attention_layernorm.weight",
                "blk.12.ffn_norm.weight",
            ),
            (
                "model.layers.29.mlp.gate_proj.weight",
                "blk.29.ffn_gate.weight",
            ),
            ("model.layers.29.mlp.up_proj.weight", "blk.29.ffn_up.weight"),
            (
                "model.layers.29.mlp.down_proj.weight",
                "blk.29.ffn_down.weight",
            ),
        ];
        for (hf, gguf) in cases {
            assert_eq!(gguf_name(hf, "llama").as_deref(), Some(gguf), "{hf}");
        }
        for other in [
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.01.mlp.up_proj.weight",
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj",
            "model.embed_tokens",
            "transformer.wte.weight",
        ] {
            assert_eq!(gguf_name(other, "llama"), None, "{other}");
        }
    }

    const SMOL: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-05, "rope_theta": 100000, "tie_word_embeddings": true,
        "hidden_act": "silu", "rope_scaling": null, "eos_token_id": 2, "bos_token_id": 1
    }"#;

    fn with(field: &str, value: &str) -> String {
        let mut v: Value = serde_json::from_str(SMOL).unwrap();
        if value == "<absent>" {
            v.as_object_mut().unwrap().remove(field);
        } else {
            v[field] = serde_json::from_str(value).unwrap();
        }
        v.to_string()
    }

    #[test]
    fn config_json_becomes_gguf_metadata() {
        let cfg = HfConfig::parse(SMOL).unwrap();
        assert_eq!(cfg.family, "llama");
        assert_eq!(cfg.num_key_value_heads, 3);
        assert_eq!(cfg.eos_token_ids, [2]);
        assert!(cfg.tie_word_embeddings);
        let md = cfg.gguf_metadata("smol");
        let llama = crate::model::arch::from_gguf(&md, "llama").unwrap();
        assert_eq!(
            (
                llama.n_layer,
                llama.d_model,
                llama.n_head,
                llama.n_kv_head,
                llama.head_dim
            ),
            (30, 576, 9, 3, 64)
        );
        assert_eq!(llama.context_len, 8192);
        assert_eq!(llama.ropes[0].base, 100_000.0);
        assert!((llama.norm_eps - 1e-5).abs() < 1e-12);

        // Defaults: kv heads = heads, untied, theta 10000; a head_dim and eos list are read.
        let cfg = HfConfig::parse(&with("num_key_value_heads", "<absent>")).unwrap();
        assert_eq!(cfg.num_key_value_heads, 9);
        let cfg = HfConfig::parse(&with("tie_word_embeddings", "<absent>")).unwrap();
        assert!(!cfg.tie_word_embeddings);
        let cfg = HfConfig::parse(&with("rope_theta", "<absent>")).unwrap();
        assert_eq!(cfg.rope_theta, 10_000.0);
        let cfg = HfConfig::parse(&with("eos_token_id", "[128001, 128008]")).unwrap();
        assert_eq!(cfg.eos_token_ids, [128001, 128008]);
        let cfg = HfConfig::parse(&with("head_dim", "128")).unwrap();
        let md = cfg.gguf_metadata("x");
        let llama = crate::model::arch::from_gguf(&md, "llama").unwrap();
        assert_eq!(llama.head_dim, 128);
        let cfg = HfConfig::parse(&with("sliding_window", "4096")).unwrap();
        assert_eq!(cfg.context_length, 4096);
    }

    #[test]
    fn mistral_and_model_type_only_configs_are_llama() {
        let cfg = HfConfig::parse(&with("architectures", r#"["MistralForCausalLM"]"#)).unwrap();
        assert_eq!(cfg.family, "llama");
        let cfg = HfConfig::parse(&with("architectures", "<absent>")).unwrap();
        assert_eq!(cfg.family, "llama");
    }

    #[test]
    fn bad_config_fields_are_named() {
        for (field, value, expect) in [
            ("hidden_size", "<absent>", "hidden_size is missing"),
            (
                "hidden_size",
                "\"576\"",
                "hidden_size should be a positive integer",
            ),
            (
                "num_hidden_layers",
                "0",
                "num_hidden_layers should be a positive integer",
            ),
            (
                "num_attention_heads",
                "-9",
                "num_attention_heads should be a positive integer",
            ),
            (
                "rms_norm_eps",
                "\"tiny\"",
                "rms_norm_eps should be a positive number",
            ),
            (
                "tie_word_embeddings",
                "1",
                "tie_word_embeddings should be true or false",
            ),
            (
                "eos_token_id",
                "\"</s>\"",
                "eos_token_id should be a token id",
            ),
            (
                "eos_token_id",
                "[2, -1]",
                "eos_token_id should be a token id",
            ),
            (
                "hidden_act",
                "\"gelu\"",
                "hidden_act \"gelu\" is not supported",
            ),
            (
                "attention_bias",
                "true",
                "attention_bias: true is not supported",
            ),
            (
                "rope_scaling",
                r#"{"rope_type": "llama3", "factor": 8.0}"#,
                "rope_scaling",
            ),
            (
                "architectures",
                "\"LlamaForCausalLM\"",
                "architectures should be a list",
            ),
        ] {
            let err = format!("{:#}", HfConfig::parse(&with(field, value)).unwrap_err());
            assert!(err.contains(expect), "{field}={value}: {err}");
        }
        assert!(HfConfig::parse("[1, 2]").is_err());
        assert!(HfConfig::parse("{")
            .unwrap_err()
            .to_string()
            .contains("JSON"));
    }

    #[test]
    fn family_tensors_map_to_their_gguf_names() {
        for (hf, family, gguf) in [
            (
                "model.layers.3.post_attention_layernorm.weight",
                "gemma3",
                Some("blk.3.post_attention_norm.weight"),
            ),
            (
                "model.layers.3.pre_feedforward_layernorm.weight",
                "gemma3",
                Some("blk.3.ffn_norm.weight"),
            ),
            (
                "model.layers.3.post_feedforward_layernorm.weight",
                "gemma3",
                Some("blk.3.post_ffw_norm.weight"),
            ),
            (
                "model.layers.3.self_attn.q_norm.weight",
                "gemma3",
                Some("blk.3.attn_q_norm.weight"),
            ),
            (
                "model.layers.3.self_attn.k_norm.weight",
                "qwen3",
                Some("blk.3.attn_k_norm.weight"),
            ),
            (
                "model.layers.3.self_attn.v_proj.bias",
                "qwen2",
                Some("blk.3.attn_v.bias"),
            ),
            (
                "model.layers.3.self_attn.qkv_proj.weight",
                "phi3",
                Some("blk.3.attn_qkv.weight"),
            ),
            (
                "model.layers.3.mlp.gate_up_proj.weight",
                "phi3",
                Some("blk.3.ffn_up.weight"),
            ),
            // What a family does not have is not mapped (and so refused when present).
            (
                "model.layers.3.pre_feedforward_layernorm.weight",
                "llama",
                None,
            ),
            ("model.layers.3.self_attn.q_proj.bias", "qwen3", None),
            ("model.layers.3.self_attn.q_norm.weight", "qwen2", None),
            ("model.layers.3.self_attn.qkv_proj.weight", "llama", None),
        ] {
            assert_eq!(gguf_name(hf, family).as_deref(), gguf, "{hf} in {family}");
        }
    }

    #[test]
    fn gemma3_config_carries_window_local_rope_base_and_scale() {
        let text = r#"{
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0, "sliding_window": 512, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": null,
            "attn_logit_softcapping": null, "rope_scaling": null, "eos_token_id": [1, 106]
        }"#;
        let cfg = HfConfig::parse(text).unwrap();
        assert_eq!(cfg.family, "gemma3");
        assert!(cfg.tie_word_embeddings, "Gemma ties by default");
        let md = cfg.gguf_metadata("g");
        let dc = crate::model::arch::from_gguf(&md, "gemma3").unwrap();
        assert_eq!((dc.head_dim, dc.context_len), (256, 32768));
        assert_eq!(dc.layer_window(0), Some(512));
        assert_eq!(dc.layer_window(5), None);
        assert_eq!(
            (
                dc.layer_rope(0).unwrap().base,
                dc.layer_rope(5).unwrap().base
            ),
            (10_000.0, 1e6)
        );
        assert!((dc.attn.scale - 1.0 / 16.0).abs() < 1e-9);

        let mut v: Value = serde_json::from_str(text).unwrap();
        v["final_logit_softcapping"] = 30.0.into();
        let err = HfConfig::parse(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("final_logit_softcapping"), "{err}");
        let mut v: Value = serde_json::from_str(text).unwrap();
        v["hidden_activation"] = "silu".into();
        assert!(HfConfig::parse(&v.to_string()).is_err());
        let mut v: Value = serde_json::from_str(text).unwrap();
        v["layer_types"] = serde_json::json!(vec!["full_attention"; 18]);
        let err = HfConfig::parse(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("layer_types"), "{err}");
    }

    #[test]
    fn phi3_long_rope_and_qwen_sliding_windows_are_refused() {
        let phi = with("architectures", r#"["Phi3ForCausalLM"]"#);
        let mut v: Value = serde_json::from_str(&phi).unwrap();
        v["rope_scaling"] =
            serde_json::json!({"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]});
        let err = HfConfig::parse(&v.to_string()).unwrap_err().to_string();
        assert!(
            err.contains("rope_scaling") && err.contains("longrope"),
            "{err}"
        );
        let mut v: Value =
            serde_json::from_str(&with("architectures", r#"["Qwen2ForCausalLM"]"#)).unwrap();
        v["use_sliding_window"] = true.into();
        v["sliding_window"] = 4096.into();
        assert!(HfConfig::parse(&v.to_string()).is_err());
        v["use_sliding_window"] = false.into();
        let cfg = HfConfig::parse(&v.to_string()).unwrap();
        assert_eq!(
            (cfg.family, cfg.context_length, cfg.sliding_window),
            ("qwen2", 8192, None)
        );
    }

    #[test]
    fn unsupported_families_are_named_with_the_supported_list() {
        let err = HfConfig::parse(&with("architectures", r#"["GPT2LMHeadModel"]"#))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"GPT2LMHeadModel\" is not supported")
                && err.contains("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM")
                && err.contains("Gemma3ForCausalLM")
                && err.contains("families llama, qwen2, qwen3, phi3, gemma3"),
            "{err}"
        );
        let text = with("architectures", "<absent>").replace("\"llama\"", "\"gpt2\"");
        let err = HfConfig::parse(&text).unwrap_err().to_string();
        assert!(
            err.contains("model_type \"gpt2\" is not supported"),
            "{err}"
        );
    }

    #[test]
    fn tokenizer_config_variants() {
        let c = HfTokenizerConfig::parse(
            r#"{"chat_template": "{{ x }}", "bos_token": "<s>", "eos_token": "</s>"}"#,
        )
        .unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("{{ x }}"));
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));

        let c = HfTokenizerConfig::parse(
            r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}],
                "bos_token": {"content": "<s>", "lstrip": false, "__type": "AddedToken"},
                "eos_token": null}"#,
        )
        .unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("D"));
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token, None);

        let c = HfTokenizerConfig::parse(r#"{"model_max_length": 2048}"#).unwrap();
        assert_eq!(c, HfTokenizerConfig::default());
        let c =
            HfTokenizerConfig::parse(r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#)
                .unwrap();
        assert_eq!(c.chat_template, None);

        for (bad, expect) in [
            (r#"{"chat_template": 3}"#, "chat_template should be"),
            (
                r#"{"chat_template": [{"name": "default"}]}"#,
                "chat_template entries",
            ),
            (r#"{"eos_token": {"text": "</s>"}}"#, "eos_token should be"),
            ("[]", "not a JSON object"),
        ] {
            let err = HfTokenizerConfig::parse(bad).unwrap_err().to_string();
            assert!(err.contains(expect), "{bad}: {err}");
        }
    }

    #[test]
    fn shard_names_are_distinct_and_stay_inside_the_folder() {
        let idx = r#"{"metadata": {"total_size": 10}, "weight_map": {
            "a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors"}}"#;
        assert_eq!(
            shard_names(idx).unwrap(),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        for bad in [
            r#"{"weight_map": {"a": "../x.safetensors"}}"#,
            r#"{"weight_map": {"a": "/etc/passwd"}}"#,
            r#"{"weight_map": {"a": 3}}"#,
            r#"{"weight_map": {}}"#,
            r#"{"metadata": {}}"#,
        ] {
            assert!(shard_names(bad).is_err(), "{bad}");
        }
    }

    /// Pseudo-random values in [-1, 1).
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// cos and sin (T, hd/2) of the standard rotary angles pos * base^(-2i/hd).
    fn angles(t: usize, hd: usize) -> (Tensor, Tensor) {
        let half = hd / 2;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..t {
            for i in 0..half {
                let a = p as f32 * 10_000f32.powf(-((2 * i) as f32) / hd as f32);
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (
            Tensor::from_vec(cos, (t, half), &Device::Cpu).unwrap(),
            Tensor::from_vec(sin, (t, half), &Device::Cpu).unwrap(),
        )
    }

    /// Attention scores (heads, T, T) of x through q and k weights, rotated by `rope`.
    fn scores(
        x: &Tensor,
        wq: &Tensor,
        wk: &Tensor,
        heads: usize,
        hd: usize,
        rope: fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    ) -> Vec<f32> {
        let t = x.dim(0).unwrap();
        let (cos, sin) = angles(t, hd);
        let split = |y: Tensor| {
            y.reshape((1, t, heads, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let q = rope(&split(x.matmul(&wq.t().unwrap()).unwrap()), &cos, &sin).unwrap();
        let k = rope(&split(x.matmul(&wk.t().unwrap()).unwrap()), &cos, &sin).unwrap();
        q.matmul(&k.transpose(2, 3).unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// The permutation's direction, checked against the two rotary conventions themselves:
    /// Hugging Face weights under rotate-half rope (`rope`) must give the same attention
    /// scores as the permuted weights under interleaved rope (`rope_i`, our forward pass).
    #[test]
    fn permuted_rows_under_interleaved_rope_equal_hf_rows_under_rotate_half() {
        let (heads, hd, d, t) = (3, 8, 16, 5);
        let dev = Device::Cpu;
        let x = Tensor::from_vec(data(t * d, 1), (t, d), &dev).unwrap();
        let wq = Tensor::from_vec(data(heads * hd * d, 2), (heads * hd, d), &dev).unwrap();
        let wk = Tensor::from_vec(data(heads * hd * d, 3), (heads * hd, d), &dev).unwrap();
        let hf = scores(&x, &wq, &wk, heads, hd, candle_nn::rotary_emb::rope);

        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-4);
        let pq = hf_rows_to_interleaved(&wq, heads).unwrap();
        let pk = hf_rows_to_interleaved(&wk, heads).unwrap();
        let ours = scores(&x, &pq, &pk, heads, hd, candle_nn::rotary_emb::rope_i);
        assert!(close(&hf, &ours), "{hf:?}\n{ours:?}");

        // The check can fail: unpermuted rows, or the inverse permutation, do not match.
        let raw = scores(&x, &wq, &wk, heads, hd, candle_nn::rotary_emb::rope_i);
        assert!(!close(&hf, &raw));
        let inverse = |w: &Tensor| {
            w.reshape((heads, hd / 2, 2, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
                .reshape((heads * hd, d))
                .unwrap()
        };
        let wrong = scores(
            &x,
            &inverse(&wq),
            &inverse(&wk),
            heads,
            hd,
            candle_nn::rotary_emb::rope_i,
        );
        assert!(!close(&hf, &wrong));
    }

    #[test]
    fn permutation_moves_rows_within_heads() {
        // 2 heads of width 4, one column holding the row number.
        let w = Tensor::arange(0f32, 8., &Device::Cpu)
            .unwrap()
            .reshape((8, 1))
            .unwrap();
        let p = hf_rows_to_interleaved(&w, 2).unwrap();
        let rows: Vec<f32> = p.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(rows, [0., 2., 1., 3., 4., 6., 5., 7.]);
        assert!(hf_rows_to_interleaved(&w, 3).is_err());
    }
}
