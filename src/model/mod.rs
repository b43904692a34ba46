//! The forward pass: the `LanguageModel` trait the generation loop drives, and loading a real one.
//!
//! A model owns its KV cache: a pool of fixed-size blocks shared by every live sequence. The
//! loop opens a sequence, reserves room for its tokens, then calls `forward` once per pass with a
//! batch of steps; each step appends tokens to one sequence at its own position. One call of
//! `forward` is one forward pass, whatever the batch holds: every weight is read once for all
//! of its steps, and each step attends only to its own sequence.

pub mod attention;
pub mod kv_cache;
pub mod llama;
pub mod qlinear;

use candle_core::Tensor;

pub use kv_cache::{KvUsage, PagedKv};

/// Handle of one sequence's KV cache inside a model.
pub type SeqId = usize;

/// One sequence's share of a forward pass: `tokens` are appended at positions `pos..pos+len`.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub pos: usize,
}

/// What the rest of the program needs to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Architecture family, e.g. `llama`.
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

    /// One forward pass. Each step's sequence must have room for its tokens (`reserve`).
    /// Returns the logits of each step's last token: (batch, vocab), f32.
    fn forward(&mut self, batch: &[SeqStep<'_>]) -> anyhow::Result<Tensor>;

    /// A new, empty sequence.
    fn new_sequence(&mut self) -> SeqId {
        self.kv_mut().new_sequence()
    }

    /// End a sequence; its blocks go back to the pool.
    fn free_sequence(&mut self, seq: SeqId) {
        self.kv_mut().free_sequence(seq)
    }

    /// Make room for `seq` to hold `tokens` tokens in all; false when the pool is short.
    fn reserve(&mut self, seq: SeqId, tokens: usize) -> bool {
        self.kv_mut().reserve(seq, tokens)
    }

    fn kv_usage(&self) -> KvUsage {
        self.kv().usage()
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
pub struct Loaded {
    pub model: Box<dyn LanguageModel>,
    pub tokenizer: crate::tokenizer::Tokenizer,
    pub chat_template: Option<crate::chat::ChatTemplate>,
    /// Whether the model expects a BOS token before a raw prompt.
    pub add_bos: bool,
}

/// Families gen can run, by GGUF `general.architecture`.
pub const SUPPORTED_ARCHS: &[&str] = &["llama"];

/// Load a GGUF file onto `device`, with its own tokenizer or the given tokenizer.json.
pub fn load_gguf(
    path: &std::path::Path,
    device: &candle_core::Device,
    tokenizer_json: Option<&std::path::Path>,
) -> anyhow::Result<Loaded> {
    use anyhow::Context;
    use candle_core::quantized::gguf_file;

    let shown = path.display();
    let mut file =
        std::fs::File::open(path).with_context(|| format!("cannot open model file {shown}"))?;
    // candle's reader trusts every count and size in the file: check them all first.
    crate::gguf::validate(&mut file, path)?;
    let content = gguf_file::Content::read(&mut file)
        .map_err(|e| anyhow::anyhow!("{shown} is not a readable GGUF file: {e}"))?;
    let md = &content.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .with_context(|| format!("{shown}: metadata has no general.architecture"))?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| arch.clone());
    let model: Box<dyn LanguageModel> = match arch.as_str() {
        "llama" => Box::new(
            llama::Llama::from_gguf(&content, &mut file, name, device)
                .with_context(|| format!("loading {shown}"))?,
        ),
        other => anyhow::bail!(
            "{shown}: architecture {other:?} is not supported (supported: {})",
            SUPPORTED_ARCHS.join(", ")
        ),
    };
    let tokenizer = match tokenizer_json {
        Some(p) => crate::tokenizer::Tokenizer::from_file(p)?,
        None => crate::tokenizer::Tokenizer::from_gguf_metadata(md)
            .with_context(|| format!("{shown}: building the tokenizer from its metadata"))?,
    };
    let add_bos = md
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
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
    })
}
