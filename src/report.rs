//! The report printed on stderr after a run: what was generated and what it cost.
//! Human-readable lines, or one JSON object (`--stats json`) for scripts.

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;

use crate::generate::Generation;
use crate::model::LoadTimes;

/// Everything the report says, as plain data.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub device: String,
    pub load_s: f64,
    /// Where `load_s` went.
    pub load: LoadTimes,
    /// Per weight type, the CPU kernel paths of one token, a few and a chunk (absent off gen's
    /// CPU kernels): every path of a type gives the same bits, so they say how fast, not what.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub kernels: BTreeMap<String, String>,
    pub prompt_tokens: usize,
    /// Of the prompt tokens, how many came from the prefix cache or a prompt-cache file.
    pub cached_tokens: usize,
    /// Time to read and restore a prompt-cache file (within `ttft_s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_cache_load_s: Option<f64>,
    pub generated_tokens: usize,
    pub forward_passes: usize,
    pub ttft_s: f64,
    pub prefill_tok_s: f64,
    /// Tokens the decode passes sampled, per second of decoding.
    pub decode_tok_s: f64,
    pub ms_per_token: f64,
    /// Tokens the decode passes sampled per decode pass: 1 without speculation.
    pub tokens_per_pass: f64,
    pub total_s: f64,
    pub stop_reason: String,
    pub seed: Option<u64>,
    /// What the grammar cost, when the reply had one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub constraint: Option<ConstraintReport>,
    /// With a grammar (--json, --json-schema, --grammar, --regex): whether the reply completed
    /// it (false: cut by --max-new, the window, a stop string or an interrupt).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub complete: Option<bool>,
    /// What speculation proposed and kept, with --speculate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculate: Option<SpeculateReport>,
    /// The reply's thinking, when the chat template has a thinking block.
    #[serde(skip_serializing_if = "Option::is_none", flatten)]
    pub reasoning: Option<Reasoning>,
    /// The calls the reply made (OpenAI's `tool_calls`), with --tools.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// Blocks that looked like tool calls and did not parse (cut, malformed), with --tools.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub malformed_tool_calls: Option<usize>,
    /// With --logprobs: one entry per generated token (see `crate::logprobs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<crate::logprobs::Logprobs>,
    /// With --prompt-logprobs: `prompt_logprobs`, one entry per prompt token (null first).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub prompt_scores: Option<crate::logprobs::PromptScores>,
}

/// A reply's thinking, kept apart from its text ([`crate::reasoning`]).
#[derive(Debug, Clone, Serialize)]
pub struct Reasoning {
    /// Tokens generated inside the thinking block (within `generated_tokens`).
    #[serde(rename = "reasoning_tokens")]
    pub tokens: usize,
    /// The thinking.
    #[serde(rename = "reasoning")]
    pub text: String,
    /// The reply stopped while thinking: there is no answer.
    #[serde(rename = "stopped_while_thinking")]
    pub unfinished: bool,
}

/// What --speculate did.
#[derive(Debug, Clone, Serialize)]
pub struct SpeculateReport {
    /// Most proposals per pass (--draft-max).
    pub draft_max: usize,
    /// Passes that carried proposals.
    pub drafts: usize,
    pub proposed: usize,
    /// Proposals the model agreed with: tokens that took no pass of their own.
    pub accepted: usize,
}

impl SpeculateReport {
    pub fn new(draft_max: usize, stats: &crate::speculate::DraftStats) -> Self {
        Self {
            draft_max,
            drafts: stats.drafts,
            proposed: stats.proposed,
            accepted: stats.accepted,
        }
    }

    fn write_human(&self, w: &mut dyn Write, tokens_per_pass: f64) -> std::io::Result<()> {
        let rate = if self.proposed > 0 {
            100.0 * self.accepted as f64 / self.proposed as f64
        } else {
            0.0
        };
        writeln!(
            w,
            "speculate      lookup, up to {} per pass: {} proposed in {} pass{}, {} accepted \
             ({rate:.0}%); {tokens_per_pass:.2} tokens per pass",
            self.draft_max,
            self.proposed,
            self.drafts,
            if self.drafts == 1 { "" } else { "es" },
            self.accepted
        )
    }
}

/// The cost of a grammar (--json, --json-schema, --grammar, --regex).
#[derive(Debug, Clone, Serialize)]
pub struct ConstraintReport {
    pub kind: String,
    /// Token masks computed: one per sampled token.
    pub masks: usize,
    /// Mean time the engine took per mask, on its own thread, mostly while the forward pass ran.
    pub mask_ms: f64,
    /// Mean time per token the sampler waited for the engine: what the grammar added.
    pub wait_ms_per_token: f64,
}

impl ConstraintReport {
    pub fn new(kind: &str, stats: &[crate::constraint::MaskStats]) -> Self {
        let masks: usize = stats.iter().map(|s| s.masks).sum();
        let compute: f64 = stats.iter().map(|s| s.compute.as_secs_f64()).sum();
        let wait: f64 = stats.iter().map(|s| s.wait.as_secs_f64()).sum();
        let per = |t: f64| {
            if masks > 0 {
                t * 1000.0 / masks as f64
            } else {
                0.0
            }
        };
        Self {
            kind: kind.to_string(),
            masks,
            mask_ms: per(compute),
            wait_ms_per_token: per(wait),
        }
    }

    fn write_human(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            w,
            "grammar        {}: {} masks, {:.3} ms each; waited {:.3} ms per token",
            self.kind, self.masks, self.mask_ms, self.wait_ms_per_token
        )
    }
}

impl Report {
    pub fn new(
        model: &str,
        device: &str,
        load_s: f64,
        gen: &Generation,
        seed: Option<u64>,
    ) -> Self {
        let ttft = gen.time_to_first_token.as_secs_f64();
        let decode = gen.decode_time.as_secs_f64();
        let passes = gen.decode_passes();
        let tokens = gen.decode_tokens();
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        Self {
            model: model.to_string(),
            device: device.to_string(),
            load_s,
            load: LoadTimes::default(),
            kernels: BTreeMap::new(),
            prompt_tokens: gen.prompt_tokens,
            cached_tokens: gen.reused_tokens,
            prompt_cache_load_s: None,
            generated_tokens: gen.tokens.len(),
            forward_passes: gen.forward_passes,
            ttft_s: ttft,
            prefill_tok_s: rate(gen.prompt_tokens - gen.reused_tokens, ttft),
            decode_tok_s: rate(tokens, decode),
            ms_per_token: if tokens > 0 {
                decode * 1000.0 / tokens as f64
            } else {
                0.0
            },
            tokens_per_pass: if passes > 0 {
                tokens as f64 / passes as f64
            } else {
                0.0
            },
            total_s: ttft + decode,
            stop_reason: gen.stop.as_str().to_string(),
            seed,
            constraint: None,
            complete: None,
            speculate: gen
                .speculation
                .as_ref()
                .map(|(max, stats)| SpeculateReport::new(*max, stats)),
            reasoning: None,
            tool_calls: None,
            malformed_tool_calls: None,
            logprobs: None,
            prompt_scores: None,
        }
    }

    pub fn with_tool_calls(mut self, parsed: Option<&crate::tool_calls::Parsed>) -> Self {
        if let Some(p) = parsed {
            self.tool_calls = Some(p.openai_calls(0));
            self.malformed_tool_calls = Some(p.malformed);
        }
        self
    }

    /// Sets the kernel paths per weight type (`LanguageModel::kernel_paths`).
    pub fn with_kernels(mut self, kernels: BTreeMap<String, String>) -> Self {
        self.kernels = kernels;
        self
    }

    /// With --logprobs and --prompt-logprobs: the reply's and the prompt's scores.
    pub fn with_scores(mut self, (logprobs, prompt): Scores) -> Self {
        self.logprobs = logprobs;
        self.prompt_scores = prompt;
        self
    }

    pub fn with_load_times(mut self, load: LoadTimes) -> Self {
        self.load = load;
        self
    }

    pub fn with_prompt_cache(mut self, load: Option<std::time::Duration>) -> Self {
        self.prompt_cache_load_s = load.map(|d| d.as_secs_f64());
        self
    }

    pub fn with_reasoning(mut self, reasoning: Option<Reasoning>) -> Self {
        self.reasoning = reasoning;
        self
    }

    pub fn with_constraint(mut self, constraint: Option<&crate::constraint::Constraint>) -> Self {
        self.constraint = constraint.map(|c| ConstraintReport::new(c.kind(), &[c.stats()]));
        self
    }

    pub fn write_human(&self, w: &mut dyn Write) -> std::io::Result<()> {
        write_model_line(w, &self.model, &self.device, self.load_s, &self.load)?;
        writeln!(
            w,
            "tokens         {} prompt{}, {} generated, stop: {}",
            self.prompt_tokens,
            cached_note(self.cached_tokens),
            self.generated_tokens,
            self.stop_reason
        )?;
        writeln!(
            w,
            "forward passes {} (1 prefill + {} decode)",
            self.forward_passes,
            self.forward_passes.saturating_sub(1)
        )?;
        let file = self.prompt_cache_load_s.map_or(String::new(), |s| {
            format!("; prompt cache file read in {:.1} ms", s * 1000.0)
        });
        writeln!(
            w,
            "first token    {:.1} ms (prefill {:.1} tok/s{file})",
            self.ttft_s * 1000.0,
            self.prefill_tok_s
        )?;
        writeln!(
            w,
            "decode         {:.1} tok/s, {:.2} ms/token; total {:.2} s",
            self.decode_tok_s, self.ms_per_token, self.total_s
        )?;
        if let Some(seed) = self.seed {
            writeln!(w, "seed           {seed}")?;
        }
        if let Some(r) = &self.reasoning {
            let note = match r.unfinished {
                true => " (the reply stopped while thinking: no answer)",
                false => "",
            };
            writeln!(w, "reasoning      {} tokens{note}", r.tokens)?;
        }
        if let Some(calls) = &self.tool_calls {
            let malformed = match self.malformed_tool_calls.unwrap_or(0) {
                0 => String::new(),
                n => format!(" ({n} malformed, left in the text)"),
            };
            let shown = crate::tool_calls::describe(calls);
            writeln!(w, "tool calls     {shown}{malformed}")?;
        }
        if let Some(c) = &self.constraint {
            c.write_human(w)?;
        }
        if let Some(s) = &self.speculate {
            s.write_human(w, self.tokens_per_pass)?;
        }
        if let Some(l) = &self.logprobs {
            l.write_human(w)?;
        }
        Ok(())
    }

    pub fn write_json(&self, w: &mut dyn Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *w, self)?;
        writeln!(w)
    }

    /// The report as JSON (`--stats json`) or as lines for people.
    pub fn write(&self, json: bool, w: &mut dyn Write) -> std::io::Result<()> {
        match json {
            true => self.write_json(w),
            false => self.write_human(w),
        }
    }
}

/// Writes `report` as one JSON object and a newline to `path` (`--stats-file`): to a file beside
/// it first, renamed into place, so the file is whole or absent.
pub fn save_json(path: &std::path::Path, report: &impl Serialize) -> anyhow::Result<()> {
    use anyhow::Context;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        serde_json::to_writer(&mut f, report)?;
        writeln!(f)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write()
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            e
        })
        .with_context(|| format!("writing --stats-file {}", path.display()))
}

/// A run's scores: the reply's log-probabilities (--logprobs) and the prompt's
/// (--prompt-logprobs).
pub type Scores = (
    Option<crate::logprobs::Logprobs>,
    Option<crate::logprobs::PromptScores>,
);

/// The report of a batch run (`--batch`).
#[derive(Debug, Clone, Serialize)]
pub struct BatchReport {
    pub model: String,
    pub device: String,
    pub load_s: f64,
    /// Where `load_s` went.
    pub load: LoadTimes,
    /// Per weight type, the CPU kernel paths of one token, a few and a chunk (absent off gen's
    /// CPU kernels): every path of a type gives the same bits, so they say how fast, not what.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub kernels: BTreeMap<String, String>,
    pub prompts: usize,
    pub failed: usize,
    /// Lines written to stdout: all of them unless the run was cut short.
    pub written: usize,
    /// Why the run ended: "done", "interrupted" (a signal) or "output-closed" (the reader of
    /// stdout went away, as with `| head`).
    pub stop_reason: String,
    pub batch_size: usize,
    pub prompt_tokens: usize,
    /// Of the prompt tokens, how many came from the prefix cache.
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub forward_passes: usize,
    /// Passes the same prompts would have taken one at a time.
    pub solo_passes: usize,
    /// Generated tokens per second of the whole run, all prompts together.
    pub decode_tok_s: f64,
    pub total_s: f64,
    pub preemptions: usize,
    pub kv_block_tokens: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_peak: usize,
    pub kv_peak_bytes: usize,
    /// What the replies' grammars cost, all together, when any had one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub constraint: Option<ConstraintReport>,
    /// Tokens sampled per step of a sequence (its share of a pass): 1 without speculation.
    pub tokens_per_pass: f64,
    /// What speculation proposed and kept, all sequences together, with --speculate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculate: Option<SpeculateReport>,
}

impl BatchReport {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &str,
        device: &str,
        load_s: f64,
        prompts: usize,
        failed: usize,
        batch_size: usize,
        stats: &crate::batch::BatchStats,
        block_bytes: usize,
    ) -> Self {
        let total_s = stats.elapsed.as_secs_f64();
        Self {
            model: model.to_string(),
            device: device.to_string(),
            load_s,
            load: LoadTimes::default(),
            kernels: BTreeMap::new(),
            prompts,
            failed,
            written: prompts,
            stop_reason: "done".to_string(),
            batch_size,
            prompt_tokens: stats.prompt_tokens,
            cached_tokens: stats.cached_tokens,
            generated_tokens: stats.generated_tokens,
            forward_passes: stats.forward_passes,
            solo_passes: stats.solo_passes,
            decode_tok_s: if total_s > 0.0 {
                stats.generated_tokens as f64 / total_s
            } else {
                0.0
            },
            total_s,
            preemptions: stats.preemptions,
            kv_block_tokens: crate::model::kv_cache::BLOCK_SIZE,
            kv_blocks_total: stats.blocks_total,
            kv_blocks_peak: stats.blocks_peak,
            kv_peak_bytes: stats.blocks_peak * block_bytes,
            constraint: None,
            tokens_per_pass: if stats.solo_passes > 0 {
                stats.sampled_tokens as f64 / stats.solo_passes as f64
            } else {
                0.0
            },
            speculate: None,
        }
    }

    /// `draft_max`: --draft-max with --speculate.
    pub fn with_speculation(
        mut self,
        draft_max: Option<usize>,
        stats: &crate::batch::BatchStats,
    ) -> Self {
        self.speculate = draft_max.map(|k| SpeculateReport::new(k, &stats.drafts));
        self
    }

    /// `masks`: each constrained reply's kind of grammar and cost.
    pub fn with_constraints(mut self, masks: &[(&str, crate::constraint::MaskStats)]) -> Self {
        if let Some((first, _)) = masks.first() {
            let kind = if masks.iter().all(|(k, _)| k == first) {
                first
            } else {
                "mixed"
            };
            let stats: Vec<_> = masks.iter().map(|(_, s)| *s).collect();
            self.constraint = Some(ConstraintReport::new(kind, &stats));
        }
        self
    }

    /// Sets the kernel paths per weight type (`LanguageModel::kernel_paths`).
    pub fn with_kernels(mut self, kernels: BTreeMap<String, String>) -> Self {
        self.kernels = kernels;
        self
    }

    /// The run ended early (`stop`: "interrupted" or "output-closed") with `written` lines out.
    pub fn with_end(mut self, written: usize, stop: &str) -> Self {
        self.written = written;
        self.stop_reason = stop.to_string();
        self
    }

    pub fn with_load_times(mut self, load: LoadTimes) -> Self {
        self.load = load;
        self
    }

    pub fn write_human(&self, w: &mut dyn Write) -> std::io::Result<()> {
        write_model_line(w, &self.model, &self.device, self.load_s, &self.load)?;
        writeln!(
            w,
            "prompts        {} ({} failed), up to {} per pass",
            self.prompts, self.failed, self.batch_size
        )?;
        if self.stop_reason != "done" {
            writeln!(
                w,
                "stopped        {} after {} of {} lines",
                self.stop_reason, self.written, self.prompts
            )?;
        }
        writeln!(
            w,
            "tokens         {} prompt{}, {} generated",
            self.prompt_tokens,
            cached_note(self.cached_tokens),
            self.generated_tokens
        )?;
        writeln!(
            w,
            "forward passes {} (one prompt at a time: {})",
            self.forward_passes, self.solo_passes
        )?;
        writeln!(
            w,
            "decode         {:.1} tok/s, all prompts together; total {:.2} s",
            self.decode_tok_s, self.total_s
        )?;
        writeln!(
            w,
            "kv cache       peak {} of {} blocks of {} tokens ({:.1} MiB){}",
            self.kv_blocks_peak,
            self.kv_blocks_total,
            self.kv_block_tokens,
            self.kv_peak_bytes as f64 / (1024.0 * 1024.0),
            if self.preemptions > 0 {
                format!(", {} preemptions", self.preemptions)
            } else {
                String::new()
            }
        )?;
        if let Some(c) = &self.constraint {
            c.write_human(w)?;
        }
        if let Some(s) = &self.speculate {
            s.write_human(w, self.tokens_per_pass)?;
        }
        Ok(())
    }

    pub fn write_json(&self, w: &mut dyn Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *w, self)?;
        writeln!(w)
    }
}

/// " (N from the KV cache)" when any prompt tokens came from the prefix cache (or a prompt
/// cache file, through it).
fn cached_note(cached: usize) -> String {
    match cached {
        0 => String::new(),
        n => format!(" ({n} from the KV cache)"),
    }
}

/// The report's first lines, the same for one prompt and for a batch.
fn write_model_line(
    w: &mut dyn Write,
    model: &str,
    device: &str,
    load_s: f64,
    load: &LoadTimes,
) -> std::io::Result<()> {
    writeln!(w)?;
    // The parts that took a centisecond or more (the tokenizer's alone, on a run that did
    // not measure them).
    let mut parts: Vec<String> = [
        (load.read_s, "reading"),
        (load.repack_s, "repacking"),
        (load.tile_cache_write_s, "writing the tile cache"),
        (load.kernels_s, "measuring kernels"),
        (load.tokenizer_s, "tokenizer"),
    ]
    .iter()
    .filter(|(s, _)| *s >= 0.005)
    .map(|(s, what)| format!("{what} {s:.2}"))
    .collect();
    if load.tile_cache == "mapped" {
        parts.insert(0, "weights mapped from the tile cache".into());
    }
    let split = match parts.is_empty() {
        true => String::new(),
        false => format!(": {}", parts.join(", ")),
    };
    writeln!(
        w,
        "model          {model} on {device} (loaded in {load_s:.2} s{split})"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::StopReason;
    use crate::speculate::DraftStats;
    use std::time::Duration;

    /// 40 tokens and the EOS after them, sampled by the prefill and 10 decode passes in 2 s.
    fn generation(speculation: Option<(usize, DraftStats)>) -> Generation {
        Generation {
            prompt_tokens: 12,
            reused_tokens: 0,
            tokens: vec![7; 40],
            stop: StopReason::Eos,
            forward_passes: 11,
            time_to_first_token: Duration::from_millis(100),
            decode_time: Duration::from_secs(2),
            sampled: 41,
            speculation,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
        }
    }

    #[test]
    fn decode_speed_counts_tokens_and_speculation_is_reported() {
        let stats = DraftStats {
            drafts: 9,
            proposed: 50,
            accepted: 30,
        };
        let r = Report::new("m", "cpu", 0.1, &generation(Some((8, stats))), None);
        // 40 tokens after the first, over 10 decode passes, in 2 s.
        assert_eq!(r.decode_tok_s, 20.0);
        assert_eq!(r.ms_per_token, 50.0);
        assert_eq!(r.tokens_per_pass, 4.0);
        let mut human = Vec::new();
        r.write_human(&mut human).unwrap();
        let human = String::from_utf8(human).unwrap();
        assert!(
            human.contains(
                "speculate      lookup, up to 8 per pass: 50 proposed in 9 passes, 30 accepted \
                 (60%); 4.00 tokens per pass"
            ),
            "{human}"
        );
        let mut json = Vec::new();
        r.write_json(&mut json).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["speculate"]["accepted"], 30);
        assert_eq!(v["speculate"]["draft_max"], 8);
        assert_eq!(v["tokens_per_pass"], 4.0);

        let plain = Report::new("m", "cpu", 0.1, &generation(None), None);
        let mut json = Vec::new();
        plain.write_json(&mut json).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert!(v.get("speculate").is_none());
        let mut human = Vec::new();
        plain.write_human(&mut human).unwrap();
        assert!(!String::from_utf8(human).unwrap().contains("speculate"));
    }
}
