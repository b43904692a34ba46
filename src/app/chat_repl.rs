//! `gen chat`: a conversation with the model in the terminal, or over standard input.
//!
//! Each turn renders the whole conversation through the chat template and generates from it as
//! one prompt; the model's prefix cache (see `model::kv_cache`) holds the blocks of the turns
//! before, so the prefill pass runs over what is new (the last reply and the new message, and
//! the few tokens of a partly filled block), not over the conversation's length. /undo, /reset
//! and /load need nothing special: what the cache holds is found by content.
//!
//! On a terminal, input comes from a line editor (reedline, on crossterm): history kept in a
//! file, multi-line input (a trailing backslash, Alt-Enter or Shift-Enter, or a bracketed
//! paste), slash commands. Ctrl-C during a reply stops it (the partial reply stays in the
//! conversation) and returns to the prompt; Ctrl-D, or Ctrl-C on an empty line, ends the chat.
//! Without a terminal each line of standard input is one user turn, and each reply is written
//! to stdout followed by a blank line. stdout carries only replies; everything else is stderr.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};

use super::{Outcome, Session, StreamSink};
use crate::cli::Config;
use crate::conversation::Conversation;
use crate::generate::{self, Generation, Limits, StopReason};
use crate::output::{StopMatcher, TextOut};
use crate::report::Report;
use crate::sampler::{Sampler, SamplingParams};
use crate::{interrupt, model::kv_cache::blocks_for};

use crate::cli::CHAT_COMMANDS as HELP;

/// The chat's state between turns.
struct Chat {
    session: Session,
    conv: Conversation,
    params: SamplingParams,
    sampler: Sampler,
    max_new: usize,
    stops: Vec<String>,
    last: Option<Generation>,
    /// Dim status lines on stderr (a terminal without NO_COLOR).
    colour: bool,
    quiet: bool,
    ignore_eos: bool,
    /// --reasoning-budget.
    reasoning_budget: Option<usize>,
    speculate: Option<usize>,
    /// With --tools: the format of the model's calls.
    tool_format: Option<crate::tool_calls::Format>,
}

/// What a turn starts from.
enum Input<'a> {
    /// A user message.
    User(&'a str),
    /// The result of the model's pending tool call (`/tool TEXT`).
    Tool(&'a str),
}

impl<'a> Input<'a> {
    /// A line typed: `/tool TEXT` is a tool result, a line not starting with `/` a message.
    fn of(line: &'a str) -> Option<Self> {
        let t = line.trim_start();
        if let Some(result) = t.strip_prefix("/tool ") {
            return Some(Input::Tool(result.trim()));
        }
        (!t.starts_with('/')).then_some(Input::User(line))
    }
}

/// How a turn ended, for the loop.
enum Turn {
    Replied,
    Interrupted,
}

pub fn run(cfg: &Config) -> Result<Outcome> {
    let conv = match &cfg.messages {
        Some(path) => Conversation::load(path)?,
        None => Conversation::new(cfg.system.clone()),
    };
    let Some(session) = Session::open(cfg)? else {
        return Ok(Outcome::Interrupted);
    };
    if session.loaded.chat_template.is_none() {
        bail!(
            "{} has no chat template: gen chat needs a chat model (or --chat-template FILE)",
            session.path.display()
        );
    }
    let mut chat = Chat::new(session, conv, cfg)?;
    if std::io::stdin().is_terminal() {
        chat.interactive()
    } else {
        chat.scripted()
    }
}

impl Chat {
    fn new(mut session: Session, conv: Conversation, cfg: &Config) -> Result<Self> {
        let context = session.context_len;
        let model = session.loaded.model.as_mut();
        // A pool with room for the whole window: each turn's sequence, and the prefix cache
        // of the turns before in what it does not use.
        model.reserve_pool(blocks_for(context))?;
        Ok(Self {
            conv,
            params: cfg.sampling.clone(),
            sampler: Sampler::new(cfg.sampling.clone()),
            max_new: cfg.max_new,
            stops: cfg.stops.clone(),
            last: None,
            colour: super::stderr_colour(),
            quiet: cfg.quiet,
            ignore_eos: cfg.ignore_eos,
            reasoning_budget: cfg.reasoning_budget,
            speculate: cfg.speculate.map(|(_, k)| k),
            tool_format: session.tool_format(cfg),
            session,
        })
    }

    /// Standard input, one user turn per line (a line ending in `\` goes on with the next, as
    /// on a terminal); replies to stdout, each followed by a blank line. A bad command or value,
    /// or a turn that fails, is one line on stderr and the next line is read; the exit status
    /// at the end says whether any failed.
    fn scripted(&mut self) -> Result<Outcome> {
        let stdin = std::io::stdin();
        let (mut failed, mut lines) = (0, 0);
        let mut pending = String::new();
        for line in stdin.lock().lines() {
            let line = line.context("cannot read standard input")?;
            let line = line.trim_end_matches('\r');
            if let Some(head) = line.strip_suffix('\\') {
                pending.push_str(head);
                pending.push('\n');
                continue;
            }
            let line = std::mem::take(&mut pending) + line;
            if line.trim().is_empty() {
                continue;
            }
            lines += 1;
            let Some(input) = Input::of(&line) else {
                match self.command(&line.trim_start()[1..]) {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        eprintln!("gen: error: {e:#}");
                        failed += 1;
                        continue;
                    }
                }
            };
            match self.turn(input) {
                Ok(Turn::Interrupted) => return Ok(Outcome::Interrupted),
                Ok(_) => {}
                Err(e) if interrupt::requested() => return Err(e),
                Err(e) => {
                    eprintln!("gen: error: {e:#}");
                    failed += 1;
                    continue;
                }
            }
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(b"\n\n");
            let _ = out.flush();
            drop(out);
            self.status();
        }
        if failed > 0 {
            bail!("{failed} of {lines} lines of standard input failed (see the lines above)");
        }
        Ok(Outcome::Done)
    }

    /// The line editor's loop.
    fn interactive(&mut self) -> Result<Outcome> {
        use reedline::Signal;
        let (mut editor, last_buffer) = editor()?;
        let prompt = ChatPrompt;
        self.note(&format!(
            "chatting with {} ({} tokens of context); /help for commands, Ctrl-D to end",
            self.session.loaded.model.info().name,
            self.session.context_len
        ));
        loop {
            let signal = editor.read_line(&prompt).context("reading the terminal")?;
            let line = match signal {
                Signal::Success(line) => line.replace("\\\n", "\n"),
                Signal::CtrlD => break,
                Signal::CtrlC => {
                    // Ctrl-C clears a line being typed; on an empty line it ends the chat.
                    let had_text = last_buffer.lock().map(|b| !b.is_empty()).unwrap_or(false);
                    if had_text {
                        continue;
                    }
                    break;
                }
                _ => continue,
            };
            if line.trim().is_empty() {
                continue;
            }
            let Some(input) = Input::of(&line) else {
                match self.command(&line.trim_start()[1..]) {
                    Ok(true) => continue,
                    Ok(false) => break,
                    Err(e) => {
                        eprintln!("gen: {e:#}");
                        continue;
                    }
                }
            };
            let done = self.turn(input);
            // The reply ends its line; its status follows, then the next prompt.
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(b"\n");
            let _ = out.flush();
            drop(out);
            match done {
                Ok(_) => self.status(),
                Err(e) => eprintln!("gen: {e:#}"),
            }
        }
        Ok(Outcome::Done)
    }

    /// One exchange: the user's message (or a tool's result), the reply streamed to stdout.
    fn turn(&mut self, input: Input<'_>) -> Result<Turn> {
        let before = self.conv.turns.len();
        match input {
            Input::User(user) => self.conv.push("user", user),
            Input::Tool(result) => self.push_tool_result(result)?,
        }
        let (ids, start) = match self.fit() {
            Ok(fit) => fit,
            Err(e) => {
                self.conv.turns.truncate(before);
                return Err(e);
            }
        };
        let limits = Limits {
            max_new: self.max_new.min(self.session.context_len - ids.len()),
            context_len: self.session.context_len,
        };
        let loaded = &mut self.session.loaded;
        let eos = if self.ignore_eos {
            Vec::new()
        } else {
            loaded.tokenizer.eos_ids().to_vec()
        };
        // The thinking shows on stderr (dim); the reply kept in the conversation is the
        // answer alone, as the templates expect of earlier turns.
        let thinking = start
            .map(|s| {
                super::thinking::Thinking::new(s, &loaded.tokenizer, self.reasoning_budget, true)
            })
            .transpose()?;
        let stdout = std::io::stdout();
        let mut out = TextOut::new(stdout.lock());
        let mut sink = StreamSink {
            text: loaded.tokenizer.stream(),
            stops: StopMatcher::new(self.stops.clone()),
            out: &mut out,
            kept: Some(String::new()),
            thinking,
        };
        let result = generate::generate_with(
            loaded.model.as_mut(),
            &ids,
            &mut self.sampler,
            &eos,
            &limits,
            self.speculate,
            &mut sink,
        );
        let gen = match result {
            Ok(gen) => gen,
            Err(e) => {
                self.conv.turns.truncate(before);
                return Err(e);
            }
        };
        sink.finish(gen.stop)?;
        let reply = sink.kept.take().unwrap_or_default();
        drop(out);
        self.keep_reply(&reply);
        // The next turn finds the conversation up to this reply in the prefix cache: blocks
        // prefill passes computed. The reply's own keys and values came from one-token decode
        // passes, whose attention sums in another order; they are not published, and the next
        // turn prefills them again, so its reply is the one a fresh run over the same
        // conversation gives (a prefill pass reads ~100 tokens in the time decode takes for a
        // few).
        let interrupted = gen.stop == StopReason::Interrupted;
        self.last = Some(gen);
        if interrupted {
            if !interrupt::by_ctrl_c() {
                // SIGTERM or SIGHUP: the session ends (the reply so far is shown and kept).
                anyhow::bail!("ended by a signal");
            }
            interrupt::clear();
            return Ok(Turn::Interrupted);
        }
        Ok(Turn::Replied)
    }

    /// The reply into the conversation: with --tools, the calls it makes as OpenAI
    /// `tool_calls` (each shown, to be answered with /tool), else as text.
    fn keep_reply(&mut self, reply: &str) {
        let parsed = self
            .tool_format
            .map(|f| crate::tool_calls::parse(f, reply))
            .filter(|p| !p.calls.is_empty());
        let Some(p) = parsed else {
            self.conv.push("assistant", reply);
            return;
        };
        // Ids numbered through the conversation, so every call's result names one call.
        let earlier: usize = self
            .conv
            .turns
            .iter()
            .filter_map(|m| m.tool_calls.as_ref().map(Vec::len))
            .sum();
        let calls = p.openai_calls(earlier);
        for c in &calls {
            self.note(&format!(
                "tool call {}({}) [{}]: answer with /tool RESULT",
                c["function"]["name"].as_str().unwrap_or(""),
                c["function"]["arguments"].as_str().unwrap_or(""),
                c["id"].as_str().unwrap_or("")
            ));
        }
        self.conv.push_calls(&p.content, calls);
    }

    /// `/tool TEXT`: the result of the first call of the last reply not answered yet.
    fn push_tool_result(&mut self, result: &str) -> Result<()> {
        let turns = &self.conv.turns;
        let at = turns
            .iter()
            .rposition(|m| m.tool_calls.is_some())
            .context("/tool: no tool call waits for a result")?;
        let answered = turns[at + 1..].iter().filter(|m| m.role == "tool").count();
        let calls = turns[at].tool_calls.as_deref().unwrap_or(&[]);
        let call = calls
            .get(answered)
            .filter(|_| turns[at + 1..].iter().all(|m| m.role == "tool"))
            .context("/tool: no tool call waits for a result")?;
        let message = crate::chat::Message {
            tool_call_id: call["id"].as_str().map(str::to_string),
            name: call["function"]["name"].as_str().map(str::to_string),
            ..crate::chat::Message::new("tool", result)
        };
        self.conv.turns.push(message);
        Ok(())
    }

    /// The conversation rendered and tokenized with room for a reply; the oldest exchanges go
    /// (the system message stays) while it does not fit.
    fn fit(&mut self) -> Result<(Vec<u32>, Option<super::thinking::Start>)> {
        let context = self.session.context_len;
        let mut dropped = 0;
        loop {
            let (ids, start) = self.render_ids()?;
            if ids.len() + self.max_new.min(context / 2) <= context {
                if dropped > 0 {
                    self.note(&format!(
                        "the conversation no longer fit the {context}-token window: dropped the \
                         {dropped} oldest exchange{}",
                        if dropped == 1 { "" } else { "s" }
                    ));
                }
                return Ok((ids, start));
            }
            if !self.conv.drop_oldest() {
                bail!(
                    "this message ({} tokens with the system message) leaves no room for a reply \
                     in the {context}-token window; send a shorter one",
                    ids.len()
                );
            }
            dropped += 1;
        }
    }

    /// The conversation's ids, and where the reply starts when the template thinks.
    fn render_ids(&self) -> Result<(Vec<u32>, Option<super::thinking::Start>)> {
        let loaded = &self.session.loaded;
        let template = loaded
            .chat_template
            .as_ref()
            .context("the model has no chat template")?;
        let text = template.render(&self.conv.messages(), true)?;
        let start = super::thinking::Start::of(template, &text);
        // The template writes its own BOS where it wants one.
        Ok((loaded.tokenizer.encode(&text, false)?, start))
    }

    /// A slash command (without its slash). False: the chat ends.
    fn command(&mut self, cmd: &str) -> Result<bool> {
        let (name, arg) = match cmd.trim().split_once(char::is_whitespace) {
            Some((n, a)) => (n, a.trim()),
            None => (cmd.trim(), ""),
        };
        match name {
            "help" => eprintln!("{HELP}"),
            "exit" | "quit" => return Ok(false),
            "reset" => {
                self.conv.turns.clear();
                self.note("a new conversation");
            }
            "system" => {
                self.conv.system = (!arg.is_empty()).then(|| arg.to_string());
                self.note(if arg.is_empty() {
                    "no system message"
                } else {
                    "system message set"
                });
            }
            "undo" => {
                let msg = if self.conv.undo() {
                    "dropped the last exchange"
                } else {
                    "nothing to undo"
                };
                self.note(msg);
            }
            "save" => {
                let path = file_arg(arg, "/save")?;
                self.conv.save(&path)?;
                self.note(&format!("saved to {}", path.display()));
            }
            "load" => {
                let path = file_arg(arg, "/load")?;
                self.conv = Conversation::load(&path)?;
                self.note(&format!(
                    "loaded {} messages from {}",
                    self.conv.messages().len(),
                    path.display()
                ));
            }
            "set" => self.set(arg)?,
            "stats" => match &self.last {
                Some(gen) => {
                    let report = Report::new(
                        self.session.loaded.model.info().name.as_str(),
                        &self.session.device_name,
                        self.session.load_s,
                        gen,
                        (!self.params.is_greedy()).then_some(self.params.seed),
                    )
                    .with_load_times(self.session.load_times)
                    .with_kernels(self.session.loaded.model.kernel_paths());
                    report.write_human(&mut std::io::stderr().lock())?;
                }
                None => self.note("no reply yet"),
            },
            other => bail!("unknown command /{other}; /help lists them"),
        }
        Ok(true)
    }

    /// `/set NAME VALUE`: a sampling option or max_new, validated like the flag.
    fn set(&mut self, arg: &str) -> Result<()> {
        let (name, value) = arg
            .split_once(char::is_whitespace)
            .map(|(n, v)| (n.trim(), v.trim()))
            .context("usage: /set NAME VALUE (e.g. /set temperature 0.3)")?;
        let mut p = self.params.clone();
        let bad = || format!("/set {name}: {value:?} is not a valid value");
        match name.replace('-', "_").as_str() {
            "temperature" => p.temperature = value.parse().with_context(bad)?,
            "top_k" => p.top_k = value.parse().with_context(bad)?,
            "top_p" => p.top_p = value.parse().with_context(bad)?,
            "min_p" => p.min_p = value.parse().with_context(bad)?,
            "repeat_penalty" => p.repeat_penalty = value.parse().with_context(bad)?,
            "repeat_last_n" => p.repeat_last_n = value.parse().with_context(bad)?,
            "presence_penalty" => p.presence_penalty = value.parse().with_context(bad)?,
            "frequency_penalty" => p.frequency_penalty = value.parse().with_context(bad)?,
            "seed" => p.seed = value.parse().with_context(bad)?,
            "max_new" => {
                let n: usize = value.parse().with_context(bad)?;
                if n == 0 {
                    bail!("/set max_new: must be at least 1");
                }
                self.max_new = n;
                self.note(&format!("max_new = {n}"));
                return Ok(());
            }
            other => bail!(
                "/set: unknown option {other:?} (temperature, top_k, top_p, min_p, \
                 repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, \
                 max_new)"
            ),
        }
        p.validate()?;
        self.sampler = Sampler::new(p.clone());
        self.params = p;
        self.note(&format!("{name} = {value}"));
        Ok(())
    }

    /// After a reply: what it cost, one dim line on stderr.
    fn status(&self) {
        let Some(gen) = self.last.as_ref().filter(|_| !self.quiet) else {
            return;
        };
        let prefilled = gen.prompt_tokens - gen.reused_tokens;
        let decode = gen.decode_time.as_secs_f64();
        let rate = if decode > 0.0 {
            format!("{:.1} tok/s", gen.decode_tokens() as f64 / decode)
        } else {
            "- tok/s".into()
        };
        let stop = match gen.stop {
            StopReason::Eos => String::new(),
            s => format!(" · stop: {}", s.as_str()),
        };
        self.note(&format!(
            "{prefilled} tokens prefilled, {} reused · first token {:.0} ms · {rate} · {} passes{stop}",
            gen.reused_tokens,
            gen.time_to_first_token.as_secs_f64() * 1000.0,
            gen.forward_passes
        ));
    }

    /// One line on stderr, dim on a terminal.
    fn note(&self, text: &str) {
        if self.colour {
            eprintln!("\x1b[2m{text}\x1b[0m");
        } else {
            eprintln!("{text}");
        }
    }
}

fn file_arg(arg: &str, cmd: &str) -> Result<PathBuf> {
    if arg.is_empty() {
        bail!("usage: {cmd} FILE");
    }
    Ok(PathBuf::from(arg))
}

/// The chat history file: GEN_CHAT_HISTORY, else gen's data folder ($XDG_DATA_HOME/gen or
/// ~/.local/share/gen).
fn history_path() -> PathBuf {
    let var = |n: &str| std::env::var_os(n).filter(|v| !v.is_empty());
    if let Some(p) = var("GEN_CHAT_HISTORY") {
        return PathBuf::from(p);
    }
    let base = var("XDG_DATA_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".local").join("share")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("gen").join("chat_history")
}

/// The line editor, and what its buffer held when last drawn (to tell Ctrl-C on an empty line
/// from Ctrl-C clearing a line being typed).
fn editor() -> Result<(reedline::Reedline, Arc<Mutex<String>>)> {
    use reedline::{FileBackedHistory, Reedline};
    let path = history_path();
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let last = Arc::new(Mutex::new(String::new()));
    let mut editor = Reedline::create()
        .use_bracketed_paste(true)
        .with_validator(Box::new(Continuation))
        .with_highlighter(Box::new(Watch(last.clone())));
    match FileBackedHistory::with_file(1000, path.clone()) {
        Ok(h) => editor = editor.with_history(Box::new(h)),
        Err(e) => eprintln!("gen: chat history off: cannot use {} ({e})", path.display()),
    }
    Ok((editor, last))
}

/// A line ending in a backslash continues on the next.
struct Continuation;

impl reedline::Validator for Continuation {
    fn validate(&self, line: &str) -> reedline::ValidationResult {
        if line.ends_with('\\') {
            reedline::ValidationResult::Incomplete
        } else {
            reedline::ValidationResult::Complete
        }
    }
}

/// Draws the line as typed, and remembers it.
struct Watch(Arc<Mutex<String>>);

impl reedline::Highlighter for Watch {
    fn highlight(&self, line: &str, _cursor: usize) -> reedline::StyledText {
        if let Ok(mut last) = self.0.lock() {
            last.clear();
            last.push_str(line);
        }
        let mut styled = reedline::StyledText::new();
        styled.push((Default::default(), line.to_string()));
        styled
    }
}

struct ChatPrompt;

impl reedline::Prompt for ChatPrompt {
    fn render_prompt_left(&self) -> std::borrow::Cow<'_, str> {
        "".into()
    }
    fn render_prompt_right(&self) -> std::borrow::Cow<'_, str> {
        "".into()
    }
    fn render_prompt_indicator(
        &self,
        _mode: reedline::PromptEditMode,
    ) -> std::borrow::Cow<'_, str> {
        "> ".into()
    }
    fn render_prompt_multiline_indicator(&self) -> std::borrow::Cow<'_, str> {
        ". ".into()
    }
    fn render_prompt_history_search_indicator(
        &self,
        search: reedline::PromptHistorySearch,
    ) -> std::borrow::Cow<'_, str> {
        format!("(search: {}) ", search.term).into()
    }
}
