//! The decoder-only transformer behind every family gen runs (see [`super::config`] for what
//! sets them apart). The decoder holds the weights ([`super::weights`]), the family's
//! configuration, the paged KV cache's block tables, and the backend for its device: gen's own
//! CPU kernels ([`super::cpu`]) or candle's operations ([`super::device`]), which also own the
//! cache's storage.
//!
//! A forward pass: plan the batch once ([`PassPlan`]: ids, positions, cache slots, each step's
//! rows and key ranges), hand it to the backend, which embeds the tokens and runs every layer,
//! then the final norm and the output layer for each step's last token. Every token of every
//! step goes through each linear layer together (so each weight is read once per pass), and
//! attention per step against that step's own sequence in the paged KV cache. A step's result
//! does not depend on what else is in the batch.
//!
//! Shape legend: N = tokens of all steps of a pass, B = steps, d = embedding width, h = query
//! heads, kv = key/value heads, hd = head width, V = vocabulary.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

use super::config::DecoderConfig;
use super::cpu::CpuBackend;
use super::device::DeviceBackend;
use super::kv_cache::{PagedKv, BLOCK_SIZE};
use super::plan::PassPlan;
use super::profile::Profile;
use super::qlinear::DeviceWeights;
use super::state::{PassStep, States};
use super::weights::Weights;
use super::{LanguageModel, ModelInfo, SeqStep, StepKind};
use crate::format::checkpoint::Checkpoint;

/// Where the layers run.
enum Backend {
    /// gen's kernels over an f16 host cache.
    Cpu(CpuBackend),
    /// candle's operations (and gen's CUDA kernels) over an f32 cache of tensors.
    Device(DeviceBackend),
}

pub struct Decoder {
    info: ModelInfo,
    cfg: DecoderConfig,
    weights: Weights,
    kv: PagedKv,
    /// The recurrent layers' state per sequence (hybrid models), beside the KV cache.
    states: States,
    backend: Backend,
    profile: Profile,
    kernels: KernelPaths,
}

/// The paths the CPU's products take, in words, and what choosing them said.
#[derive(Default)]
struct KernelPaths {
    /// Per weight type, the paths of one token, a few and a chunk ("Q4_K avx2/avx2/avx512-vnni");
    /// empty when every product takes the instruction set's path.
    summary: String,
    /// The same per type, whatever chose them (measured, by rule or forced).
    per_type: std::collections::BTreeMap<String, String>,
    notes: Vec<String>,
    /// Time taken choosing them: reading the kept choices, or measuring them.
    seconds: f64,
}

impl KernelPaths {
    fn of(weights: &mut Weights, chosen: super::cpu::choice::Chosen) -> Self {
        use super::cpu::choice::Call;
        let mut per_type = std::collections::BTreeMap::new();
        for w in weights.cpu_matrices_mut() {
            let paths = Call::ALL.map(|c| w.path(c.sample_tokens()).name());
            per_type.insert(w.type_name().to_string(), paths.join("/"));
        }
        let summary = match chosen.file {
            Some(_) => per_type
                .iter()
                .map(|(ty, p)| format!("{ty} {p}"))
                .collect::<Vec<_>>()
                .join(", "),
            None => String::new(),
        };
        let mut notes: Vec<String> = chosen.warning.into_iter().collect();
        if let (false, Some(file)) = (chosen.measured.is_empty(), &chosen.file) {
            notes.push(format!(
                "measured this CPU's kernel paths for {} in {:.2} s, kept in {} (one token/a few/a chunk): {summary}",
                chosen.measured.join(", "),
                chosen.seconds,
                file.display()
            ));
        }
        Self {
            summary,
            notes,
            seconds: 0.0,
            per_type,
        }
    }
}

impl Decoder {
    /// The model of `ckpt` on `device`: on the CPU through gen's kernels, unless
    /// GEN_ATTENTION=candle asks for the device path there (gathered keys, candle's matrix
    /// products, an f32 cache), so tests can check what a GPU runs.
    pub fn from_checkpoint(ckpt: &Checkpoint, device: &Device) -> Result<Self> {
        let cfg = super::arch::from_gguf(&ckpt.metadata, &ckpt.arch)?;
        let host_kernels =
            device.is_cpu() && std::env::var("GEN_ATTENTION").map_or(true, |v| v != "candle");
        // Our CPU kernels on the CPU; off it (or running its path on the CPU), as the size says.
        let kind = if host_kernels {
            DeviceWeights::Quantized
        } else {
            DeviceWeights::choose(ckpt.parameter_count())
        };
        let mut weights = Weights::load(ckpt, &cfg, device, kind)?;
        let kernels = if host_kernels {
            let started = std::time::Instant::now();
            let chosen = super::cpu::choice::choose(&mut weights.cpu_matrices_mut());
            KernelPaths {
                seconds: started.elapsed().as_secs_f64(),
                ..KernelPaths::of(&mut weights, chosen)
            }
        } else {
            KernelPaths::default()
        };
        let backend = if host_kernels {
            Backend::Cpu(CpuBackend::new())
        } else {
            Backend::Device(DeviceBackend::new(device, &cfg))
        };
        let states = States::new(
            cfg.layers
                .iter()
                .map(|l| l.mixer.state_floats(cfg.d_model))
                .collect(),
        );
        let info = ModelInfo {
            arch: cfg.arch.clone(),
            name: ckpt.name.clone(),
            context_len: cfg.context_len,
            vocab_size: weights.vocab_size,
        };
        Ok(Self {
            info,
            cfg,
            weights,
            kv: PagedKv::new(0),
            states,
            backend,
            profile: Profile::from_env(),
            kernels,
        })
    }

    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// One forward pass over `batch`: the logits of each step's last token, (B, V).
    fn forward_batch(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        let n = super::check_batch(&self.kv, batch, self.cfg.context_len)?;
        self.profile.start(n == batch.len());
        let plan = PassPlan::new(&self.kv, batch, &self.weights.windows);
        let (w, cfg, profile) = (&self.weights, &self.cfg, &mut self.profile);
        // Each step's recurrent state (none without recurrent layers).
        let mut states = match self.states.any() {
            true => self.states.for_pass(&pass_steps(batch))?,
            false => Vec::new(),
        };
        let last = match &mut self.backend {
            Backend::Cpu(b) => b.forward(&plan, w, cfg, &mut states, profile)?,
            Backend::Device(b) => b.forward(&plan, w, cfg, &mut states, profile)?,
        }; // (B, d)
        drop(states);
        for step in batch {
            self.kv.advance(step.seq, step.tokens.len());
            self.states.advance(step.seq, step.tokens.len());
        }
        let logits = super::layer::logits(&last, w, cfg)?;
        profile.mark(last.device(), "norm, logits");
        Ok(logits)
    }
}

/// A pass's steps as the recurrent states see them: a step of several decode tokens logs its
/// inputs, so that rejected ones can be rolled back; a prompt chunk keeps the state at the last
/// block end inside it, for the prefix cache (kept when that block is published).
fn pass_steps(batch: &[SeqStep<'_>]) -> Vec<PassStep> {
    batch
        .iter()
        .map(|s| {
            let block_end = (s.pos + s.tokens.len()) / BLOCK_SIZE * BLOCK_SIZE;
            PassStep {
                seq: s.seq,
                pos: s.pos,
                log: s.kind == StepKind::Decode && s.tokens.len() > 1,
                snap_at: (s.kind.is_prefill() && block_end > s.pos).then(|| block_end - 1),
            }
        })
        .collect()
}

impl LanguageModel for Decoder {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv(&self) -> &PagedKv {
        &self.kv
    }

    fn kv_mut(&mut self) -> &mut PagedKv {
        &mut self.kv
    }

    fn reserve_pool(&mut self, blocks: usize) -> Result<()> {
        if self.kv.usage().blocks_total >= blocks {
            return Ok(());
        }
        if !self.kv.is_idle() {
            bail!("the KV cache pool can only grow while no sequence is live");
        }
        match &mut self.backend {
            Backend::Cpu(b) => b.reserve(&self.cfg, blocks),
            Backend::Device(b) => b.reserve(&self.cfg, blocks)?,
        }
        let caching = self.kv.prefix_cache();
        self.kv = PagedKv::new(blocks);
        self.kv.set_prefix_cache(caching);
        Ok(())
    }

    fn attach(&mut self, seq: super::SeqId, mut found: Vec<u32>) -> usize {
        if !self.states.any() {
            return self.kv.attach(seq, found);
        }
        // A hybrid takes a prefix only as far as a state it kept there.
        let keyed: Vec<(u32, u64)> = found
            .iter()
            .filter_map(|&b| self.kv.block_key(b).map(|k| (b, k)))
            .collect();
        found.truncate(self.states.restorable(&keyed));
        let Some(&last) = found.last() else {
            return 0;
        };
        let n = self.kv.attach(seq, found);
        if n > 0 {
            self.states.restore(seq, last);
        }
        n
    }

    fn publish(&mut self, seq: super::SeqId, tokens: &[u32]) {
        self.kv.publish(seq, tokens);
        if !self.states.any() {
            return;
        }
        // The state its last prompt chunk kept, beside the block it ends, once published.
        for (i, &b) in self.kv.blocks(seq).iter().enumerate() {
            if let Some(key) = self.kv.block_key(b) {
                self.states.keep(seq, (i + 1) * BLOCK_SIZE, b, key);
            }
        }
    }

    fn free_sequence(&mut self, seq: super::SeqId) {
        self.kv.free_sequence(seq);
        self.states.free(seq);
    }

    fn truncate(&mut self, seq: super::SeqId, len: usize) {
        self.kv.truncate(seq, len);
        let (cfg, w) = (&self.cfg, &self.weights);
        self.states.truncate(seq, len, |l, state, input| {
            let (mixer, eps) = (&cfg.layers[l].mixer, cfg.norm_eps);
            super::recurrent::replay(mixer, &w.layers[l].mixer, eps, state, input)
        });
    }

    fn kv_bytes_per_token(&self) -> usize {
        let bytes = match &self.backend {
            Backend::Cpu(b) => b.value_bytes(),
            Backend::Device(b) => b.value_bytes(),
        };
        self.cfg.kv_floats_per_token() * bytes
    }

    fn forward(&mut self, batch: &[SeqStep<'_>]) -> Result<Tensor> {
        self.forward_batch(batch)
    }

    fn set_context_window(&mut self, tokens: usize) {
        self.cfg.set_context_window(tokens);
    }

    fn load_notes(&self) -> Vec<String> {
        self.kernels.notes.clone()
    }

    fn load_times(&self) -> super::LoadTimes {
        super::LoadTimes {
            kernels_s: self.kernels.seconds,
            ..self.weights.times
        }
    }

    fn kernel_paths(&self) -> std::collections::BTreeMap<String, String> {
        self.kernels.per_type.clone()
    }

    fn kv_layout(&self) -> String {
        let c = &self.cfg;
        if c.recurrent() {
            // A hybrid's recurrent state is not in the blocks: they alone cannot be saved.
            return String::new();
        }
        let (store, compute) = match &self.backend {
            Backend::Cpu(_) => (
                "f16",
                match self.kernels.summary.as_str() {
                    "" => format!("gen cpu, {}", super::cpu::q8::Kernel::detect().name()),
                    paths => format!("gen cpu, {paths}"),
                },
            ),
            Backend::Device(b) => ("f32", format!("candle {}", b.device_name())),
        };
        let layout = c.kv_layout();
        let shapes = match layout.iter().all(|&s| s == (c.n_kv_head, c.head_dim)) {
            true => format!(
                "{} layers x {} kv heads x {} wide",
                c.n_layer, c.n_kv_head, c.head_dim
            ),
            // Layers of their own shapes (kv heads x width; 0x0 keeps none).
            false => {
                let each: Vec<String> = layout.iter().map(|(k, d)| format!("{k}x{d}")).collect();
                format!("layers of kv heads x width {}", each.join(" "))
            }
        };
        format!(
            "{store} (kv, block {}, hd) x {shapes}; computed by {compute}",
            super::kv_cache::BLOCK_SIZE,
        )
    }

    fn read_kv_blocks(&self, blocks: &[u32]) -> Result<Vec<u8>> {
        match &self.backend {
            Backend::Cpu(b) => Ok(b.store().read_blocks(blocks)),
            Backend::Device(b) => Ok(b.store().read_blocks(blocks)?),
        }
    }

    fn write_kv_blocks(&mut self, blocks: &[u32], data: &[u8]) -> Result<()> {
        match &mut self.backend {
            Backend::Cpu(b) => b.store_mut().write_blocks(blocks, data),
            Backend::Device(b) => b.store_mut().write_blocks(blocks, data),
        }
    }
}
