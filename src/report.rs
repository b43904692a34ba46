//! The report printed on stderr after a run: what was generated and what it cost.
//! Human-readable lines, or one JSON object (`--stats json`) for scripts.

use std::io::Write;

use serde::Serialize;

use crate::generate::Generation;

/// Everything the report says, as plain data.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub device: String,
    pub load_s: f64,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub forward_passes: usize,
    pub ttft_s: f64,
    pub prefill_tok_s: f64,
    /// Decode passes per second (each samples one token).
    pub decode_tok_s: f64,
    pub ms_per_token: f64,
    pub total_s: f64,
    pub stop_reason: String,
    pub seed: Option<u64>,
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
        let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        Self {
            model: model.to_string(),
            device: device.to_string(),
            load_s,
            prompt_tokens: gen.prompt_tokens,
            generated_tokens: gen.tokens.len(),
            forward_passes: gen.forward_passes,
            ttft_s: ttft,
            prefill_tok_s: rate(gen.prompt_tokens, ttft),
            decode_tok_s: rate(passes, decode),
            ms_per_token: if passes > 0 {
                decode * 1000.0 / passes as f64
            } else {
                0.0
            },
            total_s: ttft + decode,
            stop_reason: gen.stop.as_str().to_string(),
            seed,
        }
    }

    pub fn write_human(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(w)?;
        writeln!(
            w,
            "model          {} on {} (loaded in {:.2} s)",
            self.model, self.device, self.load_s
        )?;
        writeln!(
            w,
            "tokens         {} prompt, {} generated, stop: {}",
            self.prompt_tokens, self.generated_tokens, self.stop_reason
        )?;
        writeln!(
            w,
            "forward passes {} (1 prefill + {} decode)",
            self.forward_passes,
            self.forward_passes.saturating_sub(1)
        )?;
        writeln!(
            w,
            "first token    {:.1} ms (prefill {:.1} tok/s)",
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
        Ok(())
    }

    pub fn write_json(&self, w: &mut dyn Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *w, self)?;
        writeln!(w)
    }
}
