//! `gen perplexity FILE`: the model's perplexity on a text file (see `crate::perplexity`),
//! with a progress bar on a terminal, the figure on stdout and the report on stderr.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::{Outcome, Session, Usage};
use crate::cli::{Config, PerplexityConfig, StatsFormat};
use crate::interrupt;
use crate::perplexity::{self, KlTally, Tally, Windows};

/// What `--stats json` and `--stats-file` hold for a perplexity run.
#[derive(Debug, Clone, Serialize)]
pub struct PerplexityReport {
    pub model: String,
    pub device: String,
    pub load_s: f64,
    pub file: String,
    /// Tokens of the whole text (BOS included where the model wants one).
    pub tokens: usize,
    /// Tokens per window.
    pub ctx_size: usize,
    /// Windows computed (all of the text's, unless the run was interrupted).
    pub chunks: usize,
    /// Whole windows in the text.
    pub chunks_total: usize,
    /// Tokens scored: the second half of each window computed, but its last.
    pub scored_tokens: usize,
    /// exp(mean negative log-likelihood); null before the first window is done.
    pub perplexity: Option<f64>,
    /// Its standard error.
    pub perplexity_error: Option<f64>,
    /// Mean negative log-likelihood per scored token, in nats.
    pub mean_nll: Option<f64>,
    /// Share of scored tokens the model ranked first.
    pub top1_agreement: Option<f64>,
    pub forward_passes: usize,
    /// Scoring time (tokenizing and loading apart).
    pub seconds: f64,
    /// Tokens computed per second (both halves of every window).
    pub tokens_per_second: f64,
    pub interrupted: bool,
    /// With --kl-divergence: how this run's distributions differ from the base run's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_divergence: Option<KlReport>,
}

/// `kl_divergence` in the report.
#[derive(Debug, Clone, Serialize)]
pub struct KlReport {
    /// The base run's file.
    pub base: String,
    /// Mean KL divergence (nats) of this run's next-token distribution from the base's, its
    /// standard error, median, 99th percentile and largest value.
    pub mean: f64,
    pub error: f64,
    pub median: f64,
    pub p99: f64,
    pub max: f64,
    /// Share of scored tokens where both put the same token first.
    pub same_top: f64,
    /// The base run's perplexity on the same tokens.
    pub base_perplexity: f64,
}

impl PerplexityReport {
    fn write_human(&self, w: &mut dyn Write) -> std::io::Result<()> {
        writeln!(w)?;
        writeln!(
            w,
            "model          {} on {}, loaded in {:.2} s",
            self.model, self.device, self.load_s
        )?;
        writeln!(
            w,
            "text           {}: {} tokens, {} of {} windows of {} computed, {} tokens scored",
            self.file,
            self.tokens,
            self.chunks,
            self.chunks_total,
            self.ctx_size,
            self.scored_tokens
        )?;
        if let (Some(p), Some(e), Some(top)) =
            (self.perplexity, self.perplexity_error, self.top1_agreement)
        {
            writeln!(
                w,
                "perplexity     {p:.4} +/- {e:.5}; the model's first choice was the next token {:.2}% of the time",
                100.0 * top
            )?;
        }
        if let Some(k) = &self.kl_divergence {
            writeln!(
                w,
                "KL divergence  {:.6} +/- {:.6} from {} (median {:.6}, 99% {:.6}, max {:.6}); same first choice {:.2}%; base perplexity {:.4}",
                k.mean, k.error, k.base, k.median, k.p99, k.max, 100.0 * k.same_top, k.base_perplexity
            )?;
        }
        writeln!(
            w,
            "speed          {:.1} tok/s, {} forward passes in {:.2} s",
            self.tokens_per_second, self.forward_passes, self.seconds
        )
    }
}

/// Read FILE as the text to score: all of it but one trailing newline (as llama.cpp reads its
/// `-f` file). Empty or not UTF-8 text: a usage error.
fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let Ok(mut text) = String::from_utf8(bytes) else {
        return Err(Usage(format!("{} is not UTF-8 text", path.display())).into());
    };
    if text.contains('\0') {
        return Err(Usage(format!(
            "{} is not text (it holds NUL bytes)",
            path.display()
        ))
        .into());
    }
    if text.ends_with('\n') {
        text.pop();
    }
    if text.trim().is_empty() {
        return Err(Usage(format!("{} is empty: nothing to score", path.display())).into());
    }
    Ok(text)
}

/// What a run compares with or saves: a base run's file.
enum Base {
    None,
    Save(perplexity::BaseWriter),
    Compare(perplexity::BaseReader, KlTally, String),
}

pub fn run(cfg: &Config, pc: &PerplexityConfig) -> Result<Outcome> {
    let text = pc.file.as_deref().map(read_text).transpose()?;
    let reader = match (&pc.kl_base, pc.compare) {
        (Some(path), true) => Some(perplexity::BaseReader::open(path)?),
        _ => None,
    };
    let mut cfg = cfg.clone();
    if let Some(r) = &reader {
        match cfg.ctx_size {
            Some(c) if c != r.windows.n_ctx => {
                return Err(Usage(format!(
                    "the base run was computed in windows of {} tokens: drop --ctx-size {c}",
                    r.windows.n_ctx
                ))
                .into())
            }
            _ => cfg.ctx_size = Some(r.windows.n_ctx),
        }
    }
    let Some(mut session) = Session::open(&cfg)? else {
        return Ok(Outcome::Interrupted);
    };
    let loaded = &mut session.loaded;
    let tokens = match (&text, &reader) {
        (Some(t), _) => loaded.tokenizer.encode(t, true)?,
        (None, Some(r)) => r.tokens.clone(),
        (None, None) => unreachable!("the command line gives a text or a base run"),
    };
    let windows = Windows::new(tokens.len(), session.context_len)?;
    let vocab = loaded.model.info().vocab_size;
    let mut base = match (reader, &pc.kl_base) {
        (Some(r), Some(path)) => {
            let n = r.windows.chunks * r.windows.n_ctx;
            if r.vocab != vocab || tokens.get(..n) != Some(&r.tokens[..]) || r.windows != windows {
                bail!(
                    "the base run {} is of another text, tokenizer or vocabulary: compare runs on the same text",
                    path.display()
                );
            }
            Base::Compare(r, KlTally::default(), path.display().to_string())
        }
        (None, Some(path)) => Base::Save(perplexity::BaseWriter::create(
            path, &windows, vocab, &tokens,
        )?),
        _ => Base::None,
    };
    let bos = loaded
        .tokenizer
        .wants_bos()
        .then(|| loaded.tokenizer.bos_id())
        .flatten();
    let model = loaded.model.as_mut();
    perplexity::prepare(model, &windows)?;
    let bar = progress_bar(&cfg, windows.chunks);
    let started = Instant::now();
    let mut tally = Tally::default();
    let mut done = 0;
    let mut base_row = Vec::new();
    let mut failed: Result<()> = Ok(());
    for chunk in 0..windows.chunks {
        if interrupt::requested() {
            break;
        }
        let mut each = |row: &[f32], next: u32| {
            let r = match &mut base {
                Base::None => Ok(()),
                Base::Save(w) => w.row(row),
                Base::Compare(r, kl, _) => {
                    r.row(&mut base_row).map(|_| kl.add(&base_row, row, next))
                }
            };
            if failed.is_ok() {
                failed = r;
            }
        };
        perplexity::score_chunk(
            model,
            &tokens,
            &windows,
            chunk,
            bos,
            &mut tally,
            Some(&mut each),
        )?;
        std::mem::replace(&mut failed, Ok(()))?;
        done += 1;
        bar.set_message(format!("perplexity {:.4}", tally.perplexity()));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let interrupted = done < windows.chunks;
    let kl = match base {
        Base::Save(w) if !interrupted => {
            w.finish()?;
            None
        }
        Base::Compare(_, kl, path) if done > 0 => Some(kl_report(&kl, path)),
        _ => None,
    };
    let file = pc.file.as_ref().map_or_else(
        || {
            format!(
                "{} (the base run's text)",
                pc.kl_base.as_ref().expect("a base").display()
            )
        },
        |f| f.display().to_string(),
    );
    let report = report(
        model.info().name.clone(),
        &session,
        file,
        &tokens,
        &windows,
        done,
        &tally,
        seconds,
        kl,
    );
    write_out(&cfg, &report, windows.chunks)?;
    Ok(match interrupted {
        true => Outcome::Interrupted,
        false => Outcome::Done,
    })
}

fn kl_report(kl: &KlTally, base: String) -> KlReport {
    let [mean, error, median, p99, max] = kl.summary();
    KlReport {
        base,
        mean,
        error,
        median,
        p99,
        max,
        same_top: kl.same_top as f64 / kl.values.len() as f64,
        base_perplexity: kl.base.perplexity(),
    }
}

#[allow(clippy::too_many_arguments)]
fn report(
    model: String,
    session: &Session,
    file: String,
    tokens: &[u32],
    windows: &Windows,
    done: usize,
    tally: &Tally,
    seconds: f64,
    kl_divergence: Option<KlReport>,
) -> PerplexityReport {
    let scored = (done > 0).then_some(tally);
    PerplexityReport {
        model,
        device: session.device_name.clone(),
        load_s: session.load_s,
        file,
        tokens: tokens.len(),
        ctx_size: windows.n_ctx,
        chunks: done,
        chunks_total: windows.chunks,
        scored_tokens: tally.count,
        perplexity: scored.map(Tally::perplexity),
        perplexity_error: scored.map(Tally::error),
        mean_nll: scored.map(|t| t.nll / t.count as f64),
        top1_agreement: scored.map(|t| t.top1 as f64 / t.count as f64),
        forward_passes: 2 * done,
        seconds,
        tokens_per_second: (done * windows.n_ctx) as f64 / seconds.max(1e-9),
        interrupted: done < windows.chunks,
        kl_divergence,
    }
}

/// The figure on stdout, the report on stderr and to --stats-file.
fn write_out(cfg: &Config, report: &PerplexityReport, total: usize) -> Result<()> {
    if let (Some(p), Some(e)) = (report.perplexity, report.perplexity_error) {
        let mut out = std::io::stdout().lock();
        let part = match report.interrupted {
            true => format!(" (interrupted: {} of {total} windows)", report.chunks),
            false => String::new(),
        };
        // A closed stdout (`| head -0`) is not an error worth more than the report.
        let _ = writeln!(out, "{p:.4} +/- {e:.5}{part}").and_then(|_| out.flush());
    }
    if let Some(path) = &cfg.stats_file {
        crate::report::save_json(path, report)?;
    }
    if !cfg.quiet {
        let mut err = std::io::stderr().lock();
        match cfg.stats == StatsFormat::Json {
            true => {
                serde_json::to_writer(&mut err, report)?;
                writeln!(err)?;
            }
            false => report.write_human(&mut err)?,
        }
    }
    Ok(())
}

/// Windows done, on stderr when it is a terminal (and not -q); hidden otherwise.
fn progress_bar(cfg: &Config, chunks: usize) -> indicatif::ProgressBar {
    if cfg.quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(chunks as u64);
    let style = indicatif::ProgressStyle::with_template(
        "{bar:30} {pos}/{len} windows, {elapsed} (eta {eta}) {msg}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}
