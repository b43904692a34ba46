//! Perplexity of a text, windowed and scored as llama.cpp's `llama-perplexity` does it, so the
//! two figures can be compared on the same file.
//!
//! The text is tokenized once (BOS first when the model wants one) and cut into windows of
//! `n_ctx` tokens; tokens past the last whole window are not used, and fewer than two windows
//! is refused. Each window is computed from an empty cache, its first token replaced by BOS
//! when the model wants one. Only the second half is scored, so that every scored token has
//! at least `n_ctx / 2` tokens before it: the logits at positions `n_ctx / 2 ..= n_ctx - 2`
//! against the tokens after them (`n_ctx - n_ctx / 2 - 1` per window). Perplexity is
//! `exp(mean negative log-likelihood)`; its error is the standard error of that mean carried
//! through the exponential.
//!
//! A window costs two forward passes: its first half as a prompt chunk (logits of nothing
//! needed), its second half as a scoring chunk (logits of every token). On gen's CPU kernels
//! those rows are what one pass over the whole window would give, bit for bit.

use anyhow::{bail, Result};

use crate::model::kv_cache::blocks_for;
use crate::model::{LanguageModel, SeqStep};
use crate::sampler::argmax;

/// The log-probability of `token` under the distribution `logits` give (a log-softmax), as
/// llama.cpp's perplexity tool computes it: the maximum subtracted, exponentials in f32
/// summed in f64.
pub fn log_prob(logits: &[f32], token: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max).exp()) as f64).sum();
    (logits[token] - max) as f64 - sum.ln()
}

/// Running sums of what was scored.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tally {
    /// Sum of the negative log-likelihoods.
    pub nll: f64,
    /// Sum of their squares.
    pub nll2: f64,
    /// Tokens scored.
    pub count: usize,
    /// Tokens whose most likely prediction was the token itself.
    pub top1: usize,
}

impl Tally {
    /// Score one row of logits against the token that follows.
    pub fn add(&mut self, logits: &[f32], next: u32) {
        let lp = log_prob(logits, next as usize);
        self.nll -= lp;
        self.nll2 += lp * lp;
        self.count += 1;
        self.top1 += usize::from(argmax(logits) == next);
    }

    /// `exp` of the mean negative log-likelihood.
    pub fn perplexity(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// The perplexity's standard error (llama.cpp's "+/-"): the standard error of the mean
    /// negative log-likelihood times the perplexity. 0 with fewer than two tokens scored.
    pub fn error(&self) -> f64 {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        if self.count < 2 || var <= 0.0 {
            return 0.0;
        }
        (var / (n - 1.0)).sqrt() * self.perplexity()
    }
}

/// How a text is cut into windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    /// Tokens per window.
    pub n_ctx: usize,
    /// Whole windows in the text.
    pub chunks: usize,
}

impl Windows {
    /// The windows of a text of `tokens` tokens; refused in one line where llama.cpp refuses
    /// (fewer than two windows) or where a window would score nothing.
    pub fn new(tokens: usize, n_ctx: usize) -> Result<Self> {
        if n_ctx < 4 {
            bail!("perplexity needs a context of at least 4 tokens (--ctx-size {n_ctx})");
        }
        if tokens < 2 * n_ctx {
            bail!(
                "the text is {tokens} tokens; perplexity with a context of {n_ctx} needs at \
                 least {} (two windows): give a longer text or a smaller --ctx-size",
                2 * n_ctx
            );
        }
        Ok(Self {
            n_ctx,
            chunks: tokens / n_ctx,
        })
    }

    /// The first scored position of a window.
    pub fn first(&self) -> usize {
        self.n_ctx / 2
    }

    /// Tokens scored per window.
    pub fn scored_per_chunk(&self) -> usize {
        self.n_ctx - self.first() - 1
    }
}

/// Compute window `chunk` of `tokens` and add its scores to `tally`. `bos`: the token a
/// window starts with instead of its own, when the model wants one. `each`, when given, sees
/// every scored row with the token that follows it.
pub fn score_chunk(
    model: &mut dyn LanguageModel,
    tokens: &[u32],
    w: &Windows,
    chunk: usize,
    bos: Option<u32>,
    tally: &mut Tally,
    mut each: Option<&mut dyn FnMut(&[f32], u32)>,
) -> Result<()> {
    let start = chunk * w.n_ctx;
    let mut window = tokens[start..start + w.n_ctx].to_vec();
    if let Some(b) = bos {
        window[0] = b;
    }
    let first = w.first();
    let seq = model.new_sequence();
    let result = (|| -> Result<()> {
        if !model.reserve(seq, w.n_ctx) {
            bail!(
                "the KV cache has no room for a window of {} tokens",
                w.n_ctx
            );
        }
        model.forward(&[SeqStep::prefill(seq, &window[..first], 0)])?;
        let logits = model.forward(&[SeqStep::score(seq, &window[first..], first)])?;
        let rows = logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        for (i, row) in rows.iter().take(w.scored_per_chunk()).enumerate() {
            let next = window[first + i + 1];
            tally.add(row, next);
            if let Some(f) = each.as_mut() {
                f(row, next);
            }
        }
        Ok(())
    })();
    model.free_sequence(seq);
    result
}

/// Make the model ready for windows of `w.n_ctx` tokens (its cache pool); before the first.
pub fn prepare(model: &mut dyn LanguageModel, w: &Windows) -> Result<()> {
    model.reserve_pool(blocks_for(w.n_ctx))
}

/// The first bytes of a base run's file (`--kl-divergence-base`).
const BASE_MAGIC: &[u8; 8] = b"GENKLD01";

/// A base run's log-probabilities, written as they are computed (`--kl-divergence-base`
/// without `--kl-divergence`): beside the final path, renamed onto it when every window is in,
/// so an interrupted run leaves no file. Layout, little-endian: the magic, u32 `n_ctx`, u32
/// vocabulary size, u32 windows, the windows' tokens (u32 each), then per scored row f32
/// `min` and f32 `step` and one u16 per token: its log-probability is `min + step * q`.
pub struct BaseWriter {
    out: std::io::BufWriter<std::fs::File>,
    part: std::path::PathBuf,
    path: std::path::PathBuf,
    quantized: Vec<u8>,
}

impl BaseWriter {
    pub fn create(
        path: &std::path::Path,
        w: &Windows,
        vocab: usize,
        tokens: &[u32],
    ) -> Result<Self> {
        use anyhow::Context;
        use std::io::Write;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let part = path.with_file_name(format!(".{name}.part{}", std::process::id()));
        let file = std::fs::File::create(&part)
            .with_context(|| format!("cannot write {}", part.display()))?;
        let mut out = std::io::BufWriter::new(file);
        out.write_all(BASE_MAGIC)?;
        for v in [w.n_ctx, vocab, w.chunks] {
            out.write_all(&(v as u32).to_le_bytes())?;
        }
        for t in &tokens[..w.chunks * w.n_ctx] {
            out.write_all(&t.to_le_bytes())?;
        }
        Ok(Self {
            out,
            part,
            path: path.to_path_buf(),
            quantized: Vec::new(),
        })
    }

    /// One scored row's log-probabilities, from its logits.
    pub fn row(&mut self, logits: &[f32]) -> Result<()> {
        use std::io::Write;
        let lse = crate::sampler::log_sum_exp(logits);
        let lp: Vec<f32> = logits
            .iter()
            .map(|&l| (f64::from(l) - lse) as f32)
            .collect();
        let min = lp.iter().copied().fold(f32::INFINITY, f32::min);
        let max = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let step = ((max - min) / 65535.0).max(f32::MIN_POSITIVE);
        self.quantized.clear();
        for v in &lp {
            let q = ((v - min) / step).round().clamp(0.0, 65535.0) as u16;
            self.quantized.extend_from_slice(&q.to_le_bytes());
        }
        self.out.write_all(&min.to_le_bytes())?;
        self.out.write_all(&step.to_le_bytes())?;
        self.out.write_all(&self.quantized)?;
        Ok(())
    }

    /// Every row is in: the file takes its name.
    pub fn finish(mut self) -> Result<()> {
        use std::io::Write;
        self.out.flush()?;
        self.out.get_ref().sync_all()?;
        std::fs::rename(&self.part, &self.path)?;
        self.part = std::path::PathBuf::new();
        Ok(())
    }
}

impl Drop for BaseWriter {
    fn drop(&mut self) {
        if !self.part.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.part);
        }
    }
}

/// A base run's file, read row by row.
#[derive(Debug)]
pub struct BaseReader {
    input: std::io::BufReader<std::fs::File>,
    pub windows: Windows,
    pub vocab: usize,
    pub tokens: Vec<u32>,
    raw: Vec<u8>,
}

impl BaseReader {
    pub fn open(path: &std::path::Path) -> Result<Self> {
        use anyhow::Context;
        use std::io::Read;
        let file = std::fs::File::open(path)
            .with_context(|| format!("cannot read the base run {}", path.display()))?;
        let len = file.metadata()?.len();
        let mut input = std::io::BufReader::new(file);
        let mut head = [0u8; 20];
        let not_base = || anyhow::anyhow!("{} is not a base run of gen perplexity", path.display());
        input.read_exact(&mut head).map_err(|_| not_base())?;
        if &head[..8] != BASE_MAGIC {
            return Err(not_base());
        }
        let word =
            |i: usize| u32::from_le_bytes(head[8 + 4 * i..12 + 4 * i].try_into().unwrap()) as usize;
        let (n_ctx, vocab, chunks) = (word(0), word(1), word(2));
        let windows = Windows { n_ctx, chunks };
        let rows = (chunks as u64) * windows.scored_per_chunk() as u64;
        let want = 20 + 4 * (chunks * n_ctx) as u64 + rows * (8 + 2 * vocab as u64);
        if n_ctx < 4 || chunks == 0 || vocab == 0 || len != want {
            bail!(
                "{} is damaged: {len} bytes where its header says {want}",
                path.display()
            );
        }
        let mut raw = vec![0u8; 4 * chunks * n_ctx];
        input.read_exact(&mut raw)?;
        let tokens = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        Ok(Self {
            input,
            windows,
            vocab,
            tokens,
            raw: Vec::new(),
        })
    }

    /// The next scored row's log-probabilities, into `out`.
    pub fn row(&mut self, out: &mut Vec<f32>) -> Result<()> {
        use std::io::Read;
        self.raw.resize(8 + 2 * self.vocab, 0);
        self.input.read_exact(&mut self.raw)?;
        let min = f32::from_le_bytes(self.raw[0..4].try_into().unwrap());
        let step = f32::from_le_bytes(self.raw[4..8].try_into().unwrap());
        out.clear();
        out.extend(
            self.raw[8..]
                .chunks_exact(2)
                .map(|b| min + step * f32::from(u16::from_le_bytes([b[0], b[1]]))),
        );
        Ok(())
    }
}

/// What comparing a run with its base found, token by token.
#[derive(Debug, Clone, Default)]
pub struct KlTally {
    /// Each scored token's KL divergence of this run's distribution from the base's.
    pub values: Vec<f64>,
    /// Tokens whose most likely token was the same in both.
    pub same_top: usize,
    /// The base run's own scores of the same tokens.
    pub base: Tally,
}

impl KlTally {
    /// One row: the base's log-probabilities and this run's logits, and the token after it.
    /// KL(base || this) = sum over tokens of p_base (log p_base - log p), leaving out tokens
    /// the base gives less than e^-16 (llama-perplexity's cut).
    pub fn add(&mut self, base: &[f32], logits: &[f32], next: u32) {
        let lse = crate::sampler::log_sum_exp(logits);
        let mut kl = 0.0f64;
        for (&b, &l) in base.iter().zip(logits) {
            if b > -16.0 {
                kl += f64::from(b).exp() * (f64::from(b) - (f64::from(l) - lse));
            }
        }
        self.values.push(kl.max(0.0));
        let base_top = argmax(base);
        self.same_top += usize::from(base_top == argmax(logits));
        let lp = f64::from(base[next as usize]);
        self.base.nll -= lp;
        self.base.nll2 += lp * lp;
        self.base.count += 1;
        self.base.top1 += usize::from(base_top == next);
    }

    /// Mean, its standard error, median, 99th percentile and largest value.
    pub fn summary(&self) -> [f64; 5] {
        let n = self.values.len() as f64;
        let mean = self.values.iter().sum::<f64>() / n;
        let var = self.values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        let mut sorted = self.values.clone();
        sorted.sort_by(f64::total_cmp);
        let at = |q: f64| sorted[((q * (n - 1.0)).round() as usize).min(sorted.len() - 1)];
        [mean, (var / n).sqrt(), at(0.5), at(0.99), at(1.0)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_prob_is_a_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (i, &l) in logits.iter().enumerate() {
            let want = l as f64 - z.ln();
            assert!((log_prob(&logits, i) - want).abs() < 1e-6, "{i}");
        }
        // Shifting every logit changes nothing.
        let shifted: Vec<f32> = logits.iter().map(|l| l + 100.0).collect();
        assert!((log_prob(&shifted, 2) - log_prob(&logits, 2)).abs() < 1e-5);
    }

    #[test]
    fn a_uniform_guess_has_the_vocabulary_as_perplexity() {
        let mut t = Tally::default();
        for next in 0..8 {
            t.add(&[0.5; 8], next);
        }
        assert!((t.perplexity() - 8.0).abs() < 1e-9);
        assert_eq!(t.error(), 0.0, "every token scored alike: no spread");
        assert_eq!(t.count, 8);
    }

    #[test]
    fn the_error_is_the_standard_error_of_the_mean_through_exp() {
        let mut t = Tally::default();
        let rows = [[2.0f32, 0.0], [0.0, 0.0], [0.0, 3.0]];
        for r in &rows {
            t.add(r, 0);
        }
        let nll: Vec<f64> = rows.iter().map(|r| -log_prob(r, 0)).collect();
        let mean = nll.iter().sum::<f64>() / 3.0;
        let var = nll.iter().map(|x| x * x).sum::<f64>() / 3.0 - mean * mean;
        assert!((t.perplexity() - mean.exp()).abs() < 1e-12);
        assert!((t.error() - (var / 2.0).sqrt() * mean.exp()).abs() < 1e-12);
        assert_eq!(
            t.top1, 2,
            "rows 0 and 1 put token 0 first (a tie goes to the lower id)"
        );
    }

    #[test]
    fn windows_are_llama_cpps() {
        let w = Windows::new(1300, 512).unwrap();
        assert_eq!((w.chunks, w.first(), w.scored_per_chunk()), (2, 256, 255));
        assert!(Windows::new(1023, 512)
            .unwrap_err()
            .to_string()
            .contains("1024"));
        assert!(Windows::new(100, 2).is_err());
    }

    #[test]
    fn a_base_run_reads_back_within_its_rounding_and_kl_is_zero_on_itself() {
        let dir = std::env::temp_dir().join(format!("gen-kld-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("base.kld");
        let w = Windows::new(16, 8).unwrap();
        let tokens: Vec<u32> = (0..16).map(|i| i % 5).collect();
        let rows: Vec<Vec<f32>> = (0..w.chunks * w.scored_per_chunk())
            .map(|r| {
                (0..5)
                    .map(|i| ((r * 7 + i * 3) % 11) as f32 * 0.7 - 3.0)
                    .collect()
            })
            .collect();
        let mut out = BaseWriter::create(&path, &w, 5, &tokens).unwrap();
        for r in &rows {
            out.row(r).unwrap();
        }
        assert!(
            !path.exists(),
            "nothing under the name before every row is in"
        );
        out.finish().unwrap();
        let mut base = BaseReader::open(&path).unwrap();
        assert_eq!((base.windows, base.vocab, &base.tokens), (w, 5, &tokens));
        let (mut kl, mut row) = (KlTally::default(), Vec::new());
        for (i, r) in rows.iter().enumerate() {
            base.row(&mut row).unwrap();
            let lse = crate::sampler::log_sum_exp(r);
            for (b, l) in row.iter().zip(r) {
                assert!((f64::from(*b) - (f64::from(*l) - lse)).abs() < 2e-4);
            }
            kl.add(&row, r, (i % 5) as u32);
        }
        let [mean, _, _, _, max] = kl.summary();
        assert!(mean < 1e-6 && max < 1e-5, "{mean} {max}");
        assert_eq!(kl.same_top, rows.len());
        // A damaged file is refused.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(BaseReader::open(&path)
            .unwrap_err()
            .to_string()
            .contains("damaged"));
        std::fs::write(&path, b"not a base run at all").unwrap();
        assert!(BaseReader::open(&path)
            .unwrap_err()
            .to_string()
            .contains("not a base run"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
