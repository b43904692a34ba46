//! Wiring: resolve the model, read the prompt, load, tokenize, generate while streaming text to
//! stdout, and print the report on stderr.

use std::io::{IsTerminal, Read, Write};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::Device;

use crate::cli::{Config, DeviceChoice, PromptSource, StatsFormat};
use crate::constraint::Grammars;
use crate::generate::{self, Flow, Limits, StopReason, TokenSink};
use crate::model::kv_cache::blocks_for;
use crate::output::{StopMatcher, TextOut};
use crate::prompt_cache::PromptCache;
use crate::report::Report;
use crate::sampler::Sampler;
use crate::source::{self, FetchOptions};
use crate::tokenizer::TextStream;
use crate::{chat, interrupt, model};

mod batch;
mod chat_repl;
mod jsonl;
mod perplexity;
mod remote;
mod thinking;

/// How a run ended, for the exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Done,
    Interrupted,
    /// A batch run finished, but some of its prompts failed.
    PromptsFailed {
        failed: usize,
        total: usize,
    },
}

/// A usage error found after the flags were parsed (an empty prompt): exit status 2, as for
/// a bad flag, where runtime failures exit 1.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// A loaded model, ready to take prompts.
pub(crate) struct Session {
    pub loaded: model::Loaded,
    pub device: Device,
    pub device_name: String,
    pub load_s: f64,
    pub load_times: model::LoadTimes,
    pub path: std::path::PathBuf,
    /// The context window in use: the model's, or --ctx-size if smaller.
    pub context_len: usize,
}

impl Session {
    /// Fetch (if needed) and load the model. None when Ctrl-C came meanwhile.
    pub fn open(cfg: &Config) -> Result<Option<Self>> {
        let fetch = FetchOptions {
            progress: std::io::stderr().is_terminal() && !cfg.quiet,
            offline: cfg.offline,
            verbose: cfg.verbose,
        };
        let path = source::resolve(&cfg.model, &fetch)?;
        if interrupt::requested() {
            eprintln!("gen: interrupted");
            return Ok(None);
        }
        let (device, device_name) = pick_device(cfg.device, cfg.threads)?;
        let load_start = Instant::now();
        let mut loaded = model::load(&path, &device, cfg.tokenizer.as_deref(), cfg.dtype)?;
        if let Some(file) = &cfg.chat_template {
            let source = std::fs::read_to_string(file)
                .with_context(|| format!("cannot read the chat template {}", file.display()))?;
            let text = |id: Option<u32>| {
                id.and_then(|id| loaded.tokenizer.token_text(id))
                    .unwrap_or_default()
            };
            let (bos, eos) = (
                text(loaded.tokenizer.bos_id()),
                text(loaded.tokenizer.eos_ids().first().copied()),
            );
            let template = chat::ChatTemplate::new(source, bos, eos);
            // A template that does not parse is refused now, not at the first turn.
            template
                .render(&chat::one_shot(None, "check"), true)
                .with_context(|| format!("chat template {}", file.display()))?;
            loaded.chat_template = Some(template);
        }
        if let Some(t) = loaded.chat_template.take() {
            if cfg.chat && !cfg.quiet {
                note_reasoning(cfg.reasoning, &t);
            }
            if cfg.tools.is_some() && t.tool_format().is_none() && !cfg.quiet {
                eprintln!(
                    "gen: note: this model's chat template describes no tool-call format gen \
                     reads; the tools are offered, and calls stay in the reply's text"
                );
            }
            loaded.chat_template = Some(
                t.with_thinking(cfg.reasoning.enable_thinking())
                    .with_tools(cfg.tools.clone()),
            );
        }
        loaded.model.kv_mut().set_prefix_cache(cfg.prefix_cache);
        if cfg.verbose {
            for note in loaded.model.load_notes() {
                eprintln!("gen: {note}");
            }
        }
        let load_s = load_start.elapsed().as_secs_f64();
        if interrupt::requested() {
            eprintln!("gen: interrupted");
            return Ok(None);
        }
        let model_ctx = loaded.model.info().context_len;
        let context_len = cfg.ctx_size.map_or(model_ctx, |c| c.min(model_ctx));
        if let Some(c) = cfg.ctx_size.filter(|c| *c > model_ctx) {
            // Said even with -q: it changes what fits.
            eprintln!(
                "gen: warning: --ctx-size {c} is beyond the {model_ctx} tokens this model was \
                 trained for; the window is {model_ctx}"
            );
        }
        loaded.model.set_context_window(context_len);
        Ok(Some(Self {
            load_times: loaded.times,
            loaded,
            device,
            device_name,
            load_s,
            path,
            context_len,
        }))
    }

    /// The token ids of a prompt as the model will see it (through the chat template with
    /// --chat), checked against the context window with room for `max_new` tokens (or for one
    /// with --stop-at-context), and where the reply starts when the chat template has a
    /// thinking block.
    pub fn prompt(
        &self,
        cfg: &Config,
        prompt_text: &str,
        max_new: usize,
    ) -> Result<(Vec<u32>, Option<thinking::Start>)> {
        self.prompt_as(cfg, prompt_text, max_new, cfg.chat)
    }

    /// [`Self::prompt`], through the chat template or not as `chat` says (a batch line's
    /// `url` may say otherwise than `--chat`).
    pub fn prompt_as(
        &self,
        cfg: &Config,
        prompt_text: &str,
        max_new: usize,
        chat: bool,
    ) -> Result<(Vec<u32>, Option<thinking::Start>)> {
        if chat {
            let messages = chat::one_shot(cfg.system.as_deref(), prompt_text);
            return self.conversation(cfg, &messages, max_new);
        }
        Ok((self.text_ids(cfg, prompt_text, max_new, false)?, None))
    }

    /// The token ids of a conversation through the model's chat template, with the opening of
    /// the assistant's turn, checked like [`Self::prompt`], and where the reply starts.
    pub fn conversation(
        &self,
        cfg: &Config,
        messages: &[chat::Message],
        max_new: usize,
    ) -> Result<(Vec<u32>, Option<thinking::Start>)> {
        let template = self.template()?;
        let text = template.render(messages, true)?;
        let start = thinking::Start::of(template, &text);
        Ok((self.text_ids(cfg, &text, max_new, true)?, start))
    }

    /// What the reply must be: `--tool-choice`'s call (held to its tool's schema, in the
    /// template's call format), or --json/--json-schema/--grammar/--regex.
    pub fn constraint(&self, cfg: &Config) -> Result<Option<crate::constraint::Spec>> {
        let (Some(choice), Some(tools)) = (&cfg.tool_choice, &cfg.tools) else {
            return Ok(cfg.constraint.clone());
        };
        let format = self.tool_format(cfg).context(
            "--tool-choice: this model's chat template describes no tool-call format gen reads",
        )?;
        let grammar = crate::tool_calls::choice_grammar(format, tools, choice)?;
        Ok(Some(crate::constraint::Spec::Grammar(grammar)))
    }

    /// With --tools, the format the model's calls come in (from its chat template).
    pub fn tool_format(&self, cfg: &Config) -> Option<crate::tool_calls::Format> {
        cfg.tools.as_ref()?;
        self.loaded.chat_template.as_ref()?.tool_format()
    }

    fn template(&self) -> Result<&chat::ChatTemplate> {
        self.loaded.chat_template.as_ref().with_context(|| {
            format!(
                "{} has no chat template: drop --chat, or use a chat model",
                self.path.display()
            )
        })
    }

    /// `templated`: the text came from the chat template, which writes its own BOS.
    fn text_ids(
        &self,
        cfg: &Config,
        text: &str,
        max_new: usize,
        templated: bool,
    ) -> Result<Vec<u32>> {
        let loaded = &self.loaded;
        let context_len = self.context_len;
        // No token stands for more than max_token_bytes of text, so this many tokens at least:
        // a prompt far over the window is refused now, without tokenizing all of it first.
        let at_least = loaded.tokenizer.min_tokens(text);
        if at_least > context_len {
            bail!(
                "the prompt is {} bytes, so at least {at_least} tokens (no token is longer than {} \
                 bytes), over the context window of {context_len} tokens; shorten the prompt",
                text.len(),
                loaded.tokenizer.max_token_bytes()
            );
        }
        // A chat template writes its own BOS where it wants one.
        let prompt = loaded
            .tokenizer
            .encode(text, loaded.add_bos && !templated)?;
        if prompt.is_empty() {
            bail!("the prompt encodes to no tokens");
        }
        // Checked before any compute. With --stop-at-context the loop stops at the window instead.
        if prompt.len() + max_new > context_len
            && (!cfg.stop_at_context || prompt.len() >= context_len)
        {
            bail!(
                "prompt ({} tokens) plus --max-new ({}) is {} tokens, over the context window of {} tokens{}",
                prompt.len(),
                max_new,
                prompt.len() + max_new,
                context_len,
                if prompt.len() < context_len {
                    "; lower --max-new or pass --stop-at-context"
                } else {
                    "; shorten the prompt"
                }
            );
        }
        Ok(prompt)
    }
}

/// Whether stderr takes dim text: a terminal, and NO_COLOR unset or empty (no-color.org).
pub(crate) fn stderr_colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Say where `--reasoning on|off` cannot do what it asks of this template.
fn note_reasoning(mode: crate::reasoning::Mode, t: &chat::ChatTemplate) {
    use crate::reasoning::{has_switch, Mode};
    let thinks = t.reasoning_format().is_some();
    match mode {
        Mode::On if !thinks => {
            eprintln!("gen: note: this model's chat template has no thinking block; --reasoning on changes nothing")
        }
        Mode::Off if thinks && !has_switch(t.source()) => eprintln!(
            "gen: note: this model's chat template has no switch to turn thinking off \
             (enable_thinking); it may still think, and its thinking is kept out of the answer"
        ),
        _ => {}
    }
}

pub fn run(cfg: &Config) -> Result<Outcome> {
    if let Some(pc) = &cfg.perplexity {
        return perplexity::run(cfg, pc);
    }
    if let Some(rc) = &cfg.remote {
        return match &cfg.batch {
            Some(batch) => remote::run_batch(cfg, batch, rc),
            None => remote::run_one(cfg, rc),
        };
    }
    if let Some(batch) = &cfg.batch {
        return batch::run(cfg, batch);
    }
    if cfg.interactive {
        return chat_repl::run(cfg);
    }
    run_one(cfg)
}

/// One prompt on a local model: the prompt read, the model loaded, the reply streamed, the
/// report written.
fn run_one(cfg: &Config) -> Result<Outcome> {
    // A saved conversation is the prompt itself.
    let conversation = cfg
        .messages
        .as_deref()
        .map(crate::conversation::Conversation::load)
        .transpose()?;
    let prompt_text = match &conversation {
        Some(_) => String::new(),
        None => read_prompt(&cfg.prompt)?,
    };
    if conversation.is_none() && prompt_text.trim().is_empty() {
        return Err(Usage(
            "the prompt is empty: give one with --prompt, --prompt-file or on standard input"
                .into(),
        )
        .into());
    }
    let Some(mut session) = Session::open(cfg)? else {
        return Ok(Outcome::Interrupted);
    };
    let (prompt, start) = match &conversation {
        Some(conv) => session.conversation(cfg, &conv.messages(), cfg.max_new)?,
        None => session.prompt(cfg, &prompt_text, cfg.max_new)?,
    };
    if cfg.dry_run {
        // The exact text the model would see: the ids decoded back (special tokens included).
        let text = session.loaded.tokenizer.decode(&prompt)?;
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()?;
        eprintln!("{} tokens", prompt.len());
        return Ok(Outcome::Done);
    }
    let tool_format = session.tool_format(cfg);
    let constraint = session.constraint(cfg)?;
    let loaded = &mut session.loaded;
    let context_len = session.context_len;

    let stdout = std::io::stdout();
    let mut out = TextOut::new(stdout.lock());
    if cfg.echo {
        out.write(&prompt_text)?;
    }
    let thinking = start
        .map(|s| thinking::Thinking::new(s, &loaded.tokenizer, cfg.reasoning_budget, !cfg.quiet))
        .transpose()?;
    // With --tools, the answer is kept too: its calls are read from it at the end.
    let mut sink = StreamSink {
        text: loaded.tokenizer.stream(),
        stops: StopMatcher::new(cfg.stops.clone()),
        out: &mut out,
        kept: tool_format.map(|_| String::new()),
        thinking,
    };
    let limits = Limits {
        max_new: cfg.max_new,
        context_len,
    };
    let eos = if cfg.ignore_eos {
        Vec::new()
    } else {
        loaded.tokenizer.eos_ids().to_vec()
    };
    let mut sampler = Sampler::new(cfg.sampling.clone())
        .with_logprobs(cfg.logprobs)
        .with_prompt_logprobs(cfg.prompt_logprobs);
    if let Some(spec) = &constraint {
        let grammars = Grammars::new(&loaded.tokenizer, &eos)?;
        sampler = sampler.with_constraint(grammars.constraint(spec)?);
    }
    let cache = match &cfg.prompt_cache {
        Some(path) => {
            // The pool generate() will use, made now so the file's blocks can go into it.
            loaded
                .model
                .reserve_pool(blocks_for(limits.capacity(prompt.len())))?;
            let model = loaded.model.as_mut();
            Some(PromptCache::open(
                path,
                &session.path,
                model,
                &prompt,
                cfg.quiet,
            )?)
        }
        None => None,
    };
    let mut gen = generate::generate_with(
        loaded.model.as_mut(),
        &prompt,
        &mut sampler,
        &eos,
        &limits,
        cfg.speculate.map(|(_, k)| k),
        &mut sink,
    )?;
    sink.finish(gen.stop)?;
    let calls = tool_format
        .zip(sink.kept.take())
        .map(|(f, answer)| crate::tool_calls::parse(f, &answer));
    let reasoning = sink.thinking.take().map(thinking::Thinking::into_report);
    if let Some(cache) = &cache {
        // The first token waited for the file too.
        gen.time_to_first_token += cache.load_time;
        if gen.forward_passes > 0 {
            if let Err(e) = cache.save(loaded.model.as_ref(), &prompt) {
                eprintln!("gen: warning: {e:#}");
            }
        }
    }
    if !out.is_closed() && stdout_is_terminal() {
        out.write("\n")?;
    }
    drop(out);
    // A structured reply that did not complete its grammar: warned (even with -q), `complete`
    // false in the report, and exit 1 after it.
    let incomplete = constraint.is_some() && warn_incomplete(gen.stop, None);

    if !cfg.quiet || cfg.stats_file.is_some() {
        let seed = (!cfg.sampling.is_greedy()).then_some(cfg.sampling.seed);
        let report = Report::new(
            loaded.model.info().name.as_str(),
            &session.device_name,
            session.load_s,
            &gen,
            seed,
        )
        .with_load_times(session.load_times)
        .with_kernels(loaded.model.kernel_paths())
        .with_constraint(sampler.constraint())
        .with_prompt_cache(cache.as_ref().map(|c| c.load_time))
        .with_reasoning(reasoning)
        .with_tool_calls(calls.as_ref())
        .with_scores(scores(cfg, &gen, &prompt, &loaded.tokenizer));
        let report = Report {
            complete: constraint.is_some().then_some(!incomplete),
            ..report
        };
        emit(cfg, &report)?;
    }
    if gen.stop == StopReason::Interrupted {
        return Ok(Outcome::Interrupted);
    }
    if incomplete {
        bail!(
            "the reply did not complete its grammar (stop: {})",
            gen.stop.as_str()
        );
    }
    Ok(Outcome::Done)
}

/// What --logprobs and --prompt-logprobs asked of a single run, named by `tok`.
fn scores(
    cfg: &Config,
    gen: &generate::Generation,
    prompt: &[u32],
    tok: &crate::tokenizer::Tokenizer,
) -> crate::report::Scores {
    use crate::logprobs::{Logprobs, PromptScores};
    (
        cfg.logprobs
            .map(|_| Logprobs::new(&gen.logprobs, &gen.tokens, tok)),
        cfg.prompt_logprobs
            .map(|_| PromptScores::new(&gen.prompt_logprobs, 1, None, prompt, tok)),
    )
}

/// The report to `--stats-file` where asked, and to stderr unless -q.
fn emit(cfg: &Config, report: &Report) -> Result<()> {
    if let Some(path) = &cfg.stats_file {
        crate::report::save_json(path, report)?;
    }
    if !cfg.quiet {
        report.write(
            cfg.stats == StatsFormat::Json,
            &mut std::io::stderr().lock(),
        )?;
    }
    Ok(())
}

/// A reply cut before its grammar's end is not valid output: say so (`item`: which batch
/// line) rather than let a script find out; -q does not hide it. Returns whether it was cut.
pub(crate) fn warn_incomplete(stop: StopReason, item: Option<usize>) -> bool {
    let why = match stop {
        StopReason::MaxNew => "--max-new came first",
        StopReason::ContextFull => "the context window filled first",
        StopReason::Stop => "a stop string came first",
        StopReason::Interrupted => "interrupted",
        StopReason::OutputClosed => "the output closed",
        _ => return false,
    };
    let which = item.map_or(String::new(), |i| format!(" of line {i}"));
    eprintln!(
        "gen: warning: the reply{which} is incomplete by its grammar ({why}; stop: {})",
        stop.as_str()
    );
    true
}

fn stdout_is_terminal() -> bool {
    std::io::stdout().is_terminal()
}

/// The longest prompt gen reads: far beyond any context window (16M tokens would be some tens
/// of MB), and it bounds the memory a runaway pipe or a wrong file can take.
const MAX_PROMPT_BYTES: u64 = 1 << 30;

fn read_prompt(src: &PromptSource) -> Result<String> {
    let (bytes, what) = match src {
        PromptSource::Text(t) => return Ok(t.clone()),
        PromptSource::File(p) => {
            let what = format!("prompt file {}", p.display());
            let file = std::fs::File::open(p).with_context(|| format!("cannot read {what}"))?;
            // A file's size is known up front: a huge one is refused without reading any.
            if let Ok(meta) = file.metadata() {
                if meta.is_file() && meta.len() > MAX_PROMPT_BYTES {
                    bail!(
                        "{what} is {} bytes, over the {MAX_PROMPT_BYTES} bytes gen reads as a \
                         prompt; shorten it",
                        meta.len()
                    );
                }
            }
            (read_bounded(file, &what)?, what)
        }
        PromptSource::Stdin => {
            let what = "standard input".to_string();
            (read_bounded(std::io::stdin().lock(), &what)?, what)
        }
    };
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{what} is not valid UTF-8 (byte {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// All of `input`, refused beyond [`MAX_PROMPT_BYTES`] after reading at most one byte more.
fn read_bounded(input: impl Read, what: &str) -> Result<Vec<u8>> {
    read_at_most(input, MAX_PROMPT_BYTES, what)
}

fn read_at_most(input: impl Read, limit: u64, what: &str) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    input
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {what}"))?;
    if bytes.len() as u64 > limit {
        bail!(
            "{what} is over {} bytes, the most gen reads as a prompt; shorten it",
            limit
        );
    }
    Ok(bytes)
}

/// The device to run on, and how the report names it.
fn pick_device(choice: DeviceChoice, threads: Option<usize>) -> Result<(Device, String)> {
    let cpu = || {
        let n = threads.unwrap_or_else(candle_core::utils::get_num_threads);
        (Device::Cpu, format!("cpu ({n} threads)"))
    };
    match choice {
        DeviceChoice::Cpu => Ok(cpu()),
        DeviceChoice::Cuda(n) => {
            if !candle_core::utils::cuda_is_available() {
                bail!("--device cuda: this gen was built without CUDA; rebuild with `cargo build --release --features cuda`");
            }
            let d = Device::new_cuda(n).with_context(|| format!("cannot open CUDA device {n}"))?;
            Ok((single_stream(d), format!("cuda:{n}")))
        }
        DeviceChoice::Metal(n) => {
            if !candle_core::utils::metal_is_available() {
                bail!("--device metal: this gen was built without Metal; rebuild with `cargo build --release --features metal`");
            }
            let d =
                Device::new_metal(n).with_context(|| format!("cannot open Metal device {n}"))?;
            Ok((d, format!("metal:{n}")))
        }
        DeviceChoice::Auto => {
            if candle_core::utils::cuda_is_available() {
                match Device::new_cuda(0) {
                    Ok(d) => return Ok((single_stream(d), "cuda:0".into())),
                    Err(e) => {
                        let (d, name) = cpu();
                        let first = e.to_string().lines().next().unwrap_or_default().to_string();
                        return Ok((d, format!("{name}; no usable CUDA GPU: {first}")));
                    }
                }
            }
            Ok(cpu())
        }
    }
}

/// A CUDA device set up for gen's use of it: every operation on one stream, issued from one
/// thread. cudarc, under candle, by default gives every buffer two CUDA events (created with
/// it, destroyed with it) to order its uses across streams; with one stream they order
/// nothing, and a decode step makes some thousand buffers. GEN_CUDA_EVENTS=1 keeps them.
fn single_stream(device: Device) -> Device {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &device {
        if std::env::var("GEN_CUDA_EVENTS").map_or(true, |v| v != "1") {
            // SAFETY: cudarc's events only order work between streams; gen issues all of its
            // work on the device's one stream (candle's per-thread stream, from the one thread
            // the whole program runs on), and this runs before any buffer exists.
            unsafe { d.disable_event_tracking() };
        }
    }
    device
}

/// Streams each token's text out as it is sampled.
struct StreamSink<'a, 'w, W: Write> {
    text: TextStream<'a>,
    stops: StopMatcher,
    out: &'w mut TextOut<W>,
    /// Some: also keep the text written (gen chat keeps each reply in the conversation).
    kept: Option<String>,
    /// Some: the reply may think first; its thinking is kept apart from the text written.
    thinking: Option<thinking::Thinking>,
}

impl<W: Write> StreamSink<'_, '_, W> {
    /// Write `text` out (and keep it, if asked); false once the reader went away.
    fn emit(&mut self, text: &str) -> Result<bool> {
        if let Some(kept) = &mut self.kept {
            kept.push_str(text);
        }
        Ok(self.out.write(text)?)
    }

    /// Flush what is still held back, unless a stop string or a closed pipe ended the run.
    fn finish(&mut self, stop: StopReason) -> Result<()> {
        let mut rest = self.text.finish();
        if let Some(t) = self.thinking.as_mut() {
            rest = t.finish_with(&rest);
        }
        if matches!(stop, StopReason::Stop | StopReason::OutputClosed) {
            return Ok(());
        }
        rest.push_str(&self.stops.push("").text);
        rest.push_str(&self.stops.finish());
        self.emit(&rest)?;
        Ok(())
    }
}

impl<W: Write> TokenSink for StreamSink<'_, '_, W> {
    fn on_token(&mut self, id: u32) -> Result<Flow> {
        let mut piece = self.text.push(id)?;
        if let Some(t) = self.thinking.as_mut() {
            piece = t.push(&piece);
        }
        let release = self.stops.push(&piece);
        if !self.emit(&release.text)? {
            return Ok(Flow::Stop(StopReason::OutputClosed));
        }
        if release.stopped {
            return Ok(Flow::Stop(StopReason::Stop));
        }
        Ok(Flow::Continue)
    }

    fn cancelled(&self) -> Option<StopReason> {
        interrupt::requested().then_some(StopReason::Interrupted)
    }

    fn forced(&mut self) -> Vec<u32> {
        self.thinking
            .as_mut()
            .map_or_else(Vec::new, thinking::Thinking::forced)
    }

    fn gate(&self) -> generate::Gate {
        self.thinking
            .as_ref()
            .map_or(generate::Gate::Apply, thinking::Thinking::gate)
    }
}

#[cfg(test)]
mod tests {
    use super::read_at_most;

    #[test]
    fn reading_stops_one_byte_past_the_limit() {
        assert_eq!(read_at_most(&b"12345"[..], 5, "x").unwrap(), b"12345");
        // An endless input is refused after limit + 1 bytes, not read to the end.
        let err = read_at_most(std::io::repeat(b'a'), 5, "the input").unwrap_err();
        assert_eq!(
            err.to_string(),
            "the input is over 5 bytes, the most gen reads as a prompt; shorten it"
        );
    }
}
