//! The forward pass: the `LanguageModel` trait the generation loop drives, and loading a real one.
//!
//! A model owns its KV cache: a pool of fixed-size blocks shared by every live sequence. The
//! loop opens a sequence, reserves room for its tokens, then calls `forward` once per pass with a
//! batch of steps; each step appends tokens to one sequence at its own position. One call of
//! `forward` is one forward pass, whatever the batch holds: every weight is read once for all
//! of its steps, and each step attends only to its own sequence.

pub mod arch;
pub mod config;
pub mod cpu;
pub mod decoder;
pub mod delta_net;
pub mod device;
pub mod kv_cache;
pub mod layer;
pub mod mamba2;
pub mod moe;
pub mod plan;
pub mod profile;
pub mod qlinear;
pub mod recurrent;
pub mod rope;
pub mod scan;
pub mod state;
pub mod weights;

use candle_core::Tensor;

pub use kv_cache::{KvUsage, PagedKv};

use crate::format::checkpoint;

/// Handle of one sequence's KV cache inside a model.
pub type SeqId = usize;

/// One sequence's share of a forward pass: `tokens` are appended at positions `pos..pos+len`.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub pos: usize,
    pub kind: StepKind,
}

/// How a step's tokens are computed, and which of them get logits.
///
/// On gen's CPU kernels a token's keys, values and logits depend only on the tokens before it
/// and on the kind of step that computed it, bit for bit: not on the batch, the step's length
/// or where a prompt chunk starts. Prompt tokens are computed as `Prefill` and generated ones
/// as `Decode` whatever the pass holds, so a prompt whose beginning comes from a cache, or a
/// reply checked several tokens at a time, gives exactly what a plain run gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// A prompt chunk (of any length, one token included): causal attention over the chunk at
    /// once; logits of its last token only.
    Prefill,
    /// Each token as a one-token decode step of its own would compute it (the decode attention
    /// kernel, query by query); logits of every token. Several tokens: a reply's next token and
    /// proposals for the ones after it, checked in one pass.
    Decode,
    /// A prompt chunk computed as `Prefill` (the same bits), with logits of every token: what
    /// scoring a text needs (perplexity, a prompt's log-probabilities).
    Score,
}

impl StepKind {
    /// A prompt chunk's kind: the prefill attention kernel, causal over the chunk.
    pub fn is_prefill(self) -> bool {
        matches!(self, StepKind::Prefill | StepKind::Score)
    }
}

impl<'a> SeqStep<'a> {
    /// A prompt chunk.
    pub fn prefill(seq: SeqId, tokens: &'a [u32], pos: usize) -> Self {
        Self {
            seq,
            tokens,
            pos,
            kind: StepKind::Prefill,
        }
    }

    /// Decode steps: logits for each of `tokens`.
    pub fn decode(seq: SeqId, tokens: &'a [u32], pos: usize) -> Self {
        Self {
            seq,
            tokens,
            pos,
            kind: StepKind::Decode,
        }
    }

    /// A prompt chunk whose every token gets logits.
    pub fn score(seq: SeqId, tokens: &'a [u32], pos: usize) -> Self {
        Self {
            seq,
            tokens,
            pos,
            kind: StepKind::Score,
        }
    }

    /// A prompt chunk when `tokens` has several, a decode step when it has one: how a loop
    /// that feeds a prompt and then its reply token by token computes each.
    pub fn auto(seq: SeqId, tokens: &'a [u32], pos: usize) -> Self {
        match tokens.len() {
            1 => Self::decode(seq, tokens, pos),
            _ => Self::prefill(seq, tokens, pos),
        }
    }

    /// Rows of logits the step gets: 1 for a prompt chunk, one per token for decode steps.
    pub fn logit_rows(&self) -> usize {
        match self.kind {
            StepKind::Prefill => 1,
            StepKind::Decode | StepKind::Score => self.tokens.len(),
        }
    }
}

/// What the rest of the program needs to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Architecture family, e.g. `llama`, `gemma3`.
    pub arch: String,
    /// Human name from the file (`general.name`), or the file name.
    pub name: String,
    /// Longest sequence (prompt plus reply) the model was trained for.
    pub context_len: usize,
    /// Rows of the output layer.
    pub vocab_size: usize,
}

pub trait LanguageModel {
    fn info(&self) -> &ModelInfo;

    /// The block tables of the paged KV cache (see [`kv_cache`]).
    fn kv(&self) -> &PagedKv;
    fn kv_mut(&mut self) -> &mut PagedKv;

    /// Make the KV cache pool hold at least `blocks` blocks. Only while no sequence is live.
    fn reserve_pool(&mut self, blocks: usize) -> anyhow::Result<()>;

    /// Bytes of keys and values one token takes in the cache, all layers together.
    fn kv_bytes_per_token(&self) -> usize;

    /// The context window the run uses (`--ctx-size`, or the model's): long-rope models
    /// (Phi-3.5, Phi-4-mini) take their long factors when it exceeds their original context,
    /// as llama.cpp does. Before the first pass.
    fn set_context_window(&mut self, _tokens: usize) {}

    /// One forward pass. Each step's sequence must have room for its tokens (`reserve`).
    /// Returns the logits of each step's rows in step order ([`SeqStep::logit_rows`]: a prompt
    /// chunk's last token, every token of a decode step): (rows, vocab), f32.
    fn forward(&mut self, batch: &[SeqStep<'_>]) -> anyhow::Result<Tensor>;

    /// A new, empty sequence.
    fn new_sequence(&mut self) -> SeqId {
        self.kv_mut().new_sequence()
    }

    /// End a sequence; its blocks go back to the pool.
    fn free_sequence(&mut self, seq: SeqId) {
        self.kv_mut().free_sequence(seq)
    }

    /// Say how many tokens `seq` expects to hold in the end, so that its blocks can be laid
    /// out as one run (see [`PagedKv::expect`]); reserves nothing.
    fn expect_tokens(&mut self, seq: SeqId, tokens: usize) {
        self.kv_mut().expect(seq, tokens)
    }

    /// Give the new, empty sequence `seq` the cached prefix its `tokens` begin with (see
    /// [`PagedKv::attach_prefix`]); returns the tokens it now holds. A model whose memory is
    /// more than its blocks (a hybrid's recurrent state) takes only a prefix it can restore.
    fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        let found = self.kv().lookup(tokens);
        self.attach(seq, found)
    }

    /// Give the new, empty sequence `seq` the published blocks `found` (what
    /// [`PagedKv::lookup`] just returned), or the part of them this model can restore.
    fn attach(&mut self, seq: SeqId, found: Vec<u32>) -> usize {
        self.kv_mut().attach(seq, found)
    }

    /// Publish the full blocks of `seq` that hold `tokens`, computed by prefill steps (see
    /// [`PagedKv::publish`]).
    fn publish(&mut self, seq: SeqId, tokens: &[u32]) {
        self.kv_mut().publish(seq, tokens)
    }

    /// Forget `seq`'s tokens from `len` on; its room stays reserved.
    fn truncate(&mut self, seq: SeqId, len: usize) {
        self.kv_mut().truncate(seq, len)
    }

    /// Make room for `seq` to hold `tokens` tokens in all; false when the pool is short.
    fn reserve(&mut self, seq: SeqId, tokens: usize) -> bool {
        self.kv_mut().reserve(seq, tokens)
    }

    fn kv_usage(&self) -> KvUsage {
        self.kv().usage()
    }

    /// What the cache's keys and values are and how they were computed, in words: blocks saved
    /// under one layout (a prompt-cache file) are only ever loaded under the same one. Empty:
    /// this model cannot save its cache.
    fn kv_layout(&self) -> String {
        String::new()
    }

    /// What loading found worth saying (with --verbose): the kernel paths measured for this
    /// CPU, or why they could not be kept.
    fn load_notes(&self) -> Vec<String> {
        Vec::new()
    }

    /// Per weight type, the CPU paths its products take for one token, a few and a chunk
    /// ("avx2/avx512-vnni/avx512-vnni"): `kernels` in `--stats json`. Empty off gen's CPU
    /// kernels.
    fn kernel_paths(&self) -> std::collections::BTreeMap<String, String> {
        Default::default()
    }

    /// Where loading the weights went (the tokenizer's share is the loader's).
    fn load_times(&self) -> LoadTimes {
        LoadTimes::default()
    }

    /// The keys and values of cache `blocks`, as bytes (kv_layout says how).
    fn read_kv_blocks(&self, _blocks: &[u32]) -> anyhow::Result<Vec<u8>> {
        anyhow::bail!("this model cannot save its KV cache")
    }

    /// Write what `read_kv_blocks` gave into cache `blocks`.
    fn write_kv_blocks(&mut self, _blocks: &[u32], _data: &[u8]) -> anyhow::Result<()> {
        anyhow::bail!("this model cannot load a KV cache")
    }
}

/// Checks common to every model's `forward`: each step's sequence is live, starts where the
/// sequence ends, fits what was reserved and the context window, and no sequence appears
/// twice. Returns the total number of tokens in the batch.
pub fn check_batch(
    kv: &PagedKv,
    batch: &[SeqStep<'_>],
    context_len: usize,
) -> anyhow::Result<usize> {
    use anyhow::bail;
    if batch.is_empty() {
        bail!("a forward pass needs at least one step");
    }
    let mut total = 0;
    for (i, step) in batch.iter().enumerate() {
        let Some(len) = kv.len(step.seq) else {
            bail!("sequence {} is not live", step.seq);
        };
        if step.tokens.is_empty() {
            bail!("a forward step needs at least one token");
        }
        if batch[..i].iter().any(|s| s.seq == step.seq) {
            bail!("sequence {} appears twice in one pass", step.seq);
        }
        if step.pos != len {
            bail!(
                "sequence {} holds {len} tokens but the step starts at {}",
                step.seq,
                step.pos
            );
        }
        let end = step.pos + step.tokens.len();
        let room = kv.capacity(step.seq).unwrap_or(0).min(context_len);
        if end > room {
            bail!(
                "sequence {} would hold {end} tokens, over the {room} it has room for",
                step.seq
            );
        }
        total += step.tokens.len();
    }
    Ok(total)
}

/// A model file, loaded: the network, its tokenizer and its chat template.
/// Where a model's load time went, in seconds (the report's model line, `--stats json`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct LoadTimes {
    /// Reading tensors into memory: the small ones, every one for a device, and matrices
    /// where the file could not be mapped. (Gen's CPU kernels repack matrices straight from
    /// the mapped file: their pages come in as they are repacked, within `repack_s`.)
    pub read_s: f64,
    /// Making the weights ready to compute with: repacked into gen's tiles on the CPU,
    /// widened or uploaded for a device.
    pub repack_s: f64,
    /// Measuring this CPU's kernel paths (the first load of a weight type on a CPU only).
    pub kernels_s: f64,
    /// Building the tokenizer (from a GGUF file: alongside the weights, on a thread of its own).
    pub tokenizer_s: f64,
    /// The tile cache ([`cpu::tile_cache`]): "off" (not used for this file or device),
    /// "mapped" (the weights came from it), "written" (repacked, then written), or "missed"
    /// (repacked; it could not be written).
    pub tile_cache: &'static str,
    /// The cache file's size in bytes, when mapped or written.
    pub tile_cache_bytes: u64,
    /// Writing it (within the load time), when written.
    pub tile_cache_write_s: f64,
}

pub struct Loaded {
    pub model: Box<dyn LanguageModel>,
    pub tokenizer: crate::tokenizer::Tokenizer,
    pub chat_template: Option<crate::chat::ChatTemplate>,
    /// Whether the model expects a BOS token before a raw prompt.
    pub add_bos: bool,
    pub times: LoadTimes,
}

/// Load a model onto `device`: a GGUF file, or a Hugging Face checkpoint folder (one with a
/// `config.json`). `tokenizer_json` replaces the model's own tokenizer; `dtype` is the type a
/// checkpoint's matrices are kept in (default [`default_dtype`]; GGUF weights keep their own).
pub fn load(
    path: &std::path::Path,
    device: &candle_core::Device,
    tokenizer_json: Option<&std::path::Path>,
    dtype: Option<candle_core::DType>,
) -> anyhow::Result<Loaded> {
    if path.is_dir() {
        let dtype = dtype.unwrap_or_else(|| default_dtype(device));
        load_hf_dir(path, device, tokenizer_json, dtype)
    } else {
        if let Some(dt) = dtype {
            anyhow::bail!(
                "--dtype {dt:?} applies to Hugging Face checkpoints; {} is a GGUF file, whose \
                 weights keep the types they were saved in. HINT: drop --dtype",
                path.display()
            );
        }
        load_gguf(path, device, tokenizer_json)
    }
}

/// The type a checkpoint's matrices are kept in unless `--dtype` says: f32 on the CPU (the
/// activations are f32 there, and candle's CPU f16/bf16 matrix products are slower), bf16 on
/// CUDA (the type most checkpoints are published in, with f32's range), f16 on Metal.
pub fn default_dtype(device: &candle_core::Device) -> candle_core::DType {
    match device {
        candle_core::Device::Cpu => candle_core::DType::F32,
        candle_core::Device::Cuda(_) => candle_core::DType::BF16,
        candle_core::Device::Metal(_) => candle_core::DType::F16,
    }
}

/// The network of a checkpoint: every supported family runs through the one decoder.
pub fn build_model(
    ckpt: &checkpoint::Checkpoint,
    device: &candle_core::Device,
) -> anyhow::Result<Box<dyn LanguageModel>> {
    Ok(Box::new(decoder::Decoder::from_checkpoint(ckpt, device)?))
}

/// Load a GGUF file onto `device`, with its own tokenizer or the given tokenizer.json.
pub fn load_gguf(
    path: &std::path::Path,
    device: &candle_core::Device,
    tokenizer_json: Option<&std::path::Path>,
) -> anyhow::Result<Loaded> {
    use anyhow::Context;

    let shown = path.display();
    let ckpt = checkpoint::Checkpoint::open_gguf(path)?;
    let md = &ckpt.metadata;
    let supported = arch::supported();
    if !supported.contains(&ckpt.arch.as_str()) {
        anyhow::bail!(
            "{shown}: architecture {:?} is not supported (supported: {})",
            ckpt.arch,
            supported.join(", ")
        );
    }
    // The tokenizer is built on a thread of its own while the weights load (about 0.1 s for
    // Gemma's 262k-entry vocabulary or Llama 3's 280k merges); the model's error, if any, is
    // said first.
    let (model, tokenizer, tokenizer_s) = std::thread::scope(|s| {
        let building = s.spawn(|| {
            let started = std::time::Instant::now();
            let tokenizer = match tokenizer_json {
                Some(p) => crate::tokenizer::Tokenizer::from_file(p),
                None => crate::tokenizer::Tokenizer::from_gguf_metadata(md)
                    .with_context(|| format!("{shown}: building the tokenizer from its metadata")),
            };
            (tokenizer, started.elapsed().as_secs_f64())
        });
        let model = build_model(&ckpt, device).with_context(|| format!("loading {shown}"));
        let (tokenizer, seconds) = building
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (model, tokenizer, seconds)
    });
    let (model, tokenizer) = (model?, tokenizer?);
    let times = LoadTimes {
        tokenizer_s,
        ..model.load_times()
    };
    let add_bos = match tokenizer_json {
        // The file's add_bos_token or, without it, what llama.cpp assumes for the vocabulary
        // (Llama 3 and Tekken pre-tokenizers and SentencePiece vocabularies want BOS).
        None => tokenizer.wants_bos(),
        Some(_) => md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false),
    };
    let token_text = |id: Option<u32>| {
        id.and_then(|id| tokenizer.token_text(id))
            .unwrap_or_default()
    };
    let chat_template = md
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .map(|src| {
            crate::chat::ChatTemplate::new(
                src.clone(),
                token_text(tokenizer.bos_id()),
                token_text(tokenizer.eos_ids().first().copied()),
            )
        });
    Ok(Loaded {
        model,
        tokenizer,
        chat_template,
        add_bos,
        times,
    })
}

/// Load a Hugging Face checkpoint folder: config.json, safetensors weights, tokenizer.json, and
/// tokenizer_config.json (special tokens, chat template) when present.
fn load_hf_dir(
    dir: &std::path::Path,
    device: &candle_core::Device,
    tokenizer_json: Option<&std::path::Path>,
    dtype: candle_core::DType,
) -> anyhow::Result<Loaded> {
    use anyhow::Context;
    use checkpoint::{
        HfTokenizerConfig, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
    };

    let shown = dir.display();
    let ckpt = checkpoint::Checkpoint::open_hf_dir(dir, dtype)?;
    let model = build_model(&ckpt, device).with_context(|| format!("loading {shown}"))?;
    let tokenizer_start = std::time::Instant::now();
    let tokenizer_path = tokenizer_json
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| dir.join(TOKENIZER_FILE));
    let tokenizer = crate::tokenizer::Tokenizer::from_file(&tokenizer_path)?
        .with_eos_ids(&ckpt.eos_token_ids)
        .with_context(|| format!("{shown}/config.json: eos_token_id"))?;
    let times = LoadTimes {
        tokenizer_s: tokenizer_start.elapsed().as_secs_f64(),
        ..model.load_times()
    };
    let config_path = dir.join(TOKENIZER_CONFIG_FILE);
    let tok_cfg = match std::fs::read_to_string(&config_path) {
        Ok(text) => {
            HfTokenizerConfig::parse(&text).with_context(|| format!("{}", config_path.display()))?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => HfTokenizerConfig::default(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", config_path.display())),
    };
    // Newer checkpoints keep the template in a file of its own.
    let template_path = dir.join(CHAT_TEMPLATE_FILE);
    let template = match tok_cfg.chat_template {
        Some(t) => Some(t),
        None if template_path.is_file() => Some(
            std::fs::read_to_string(&template_path)
                .with_context(|| format!("cannot read {}", template_path.display()))?,
        ),
        None => None,
    };
    let token_text = |id: Option<u32>| {
        id.and_then(|id| tokenizer.token_text(id))
            .unwrap_or_default()
    };
    let chat_template = template.map(|src| {
        crate::chat::ChatTemplate::new(
            src,
            tok_cfg
                .bos_token
                .clone()
                .unwrap_or_else(|| token_text(tokenizer.bos_id())),
            tok_cfg
                .eos_token
                .clone()
                .unwrap_or_else(|| token_text(tokenizer.eos_ids().first().copied())),
        )
    });
    Ok(Loaded {
        model,
        tokenizer,
        chat_template,
        // The tokenizer decided from add_bos_token or its post-processor; `encode` asks it.
        add_bos: true,
        times,
    })
}
