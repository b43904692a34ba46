//! Reasoning kept apart from the answer.
//!
//! Models that think before they answer write their deliberation between two markers that
//! their chat template names (`<think>` ... `</think>` for Qwen3, QwQ, the DeepSeek-R1
//! distills, SmolLM3, GLM, MiniMax and most others; `<seed:think>` for Seed-OSS, `[THINK]` for
//! Magistral, `<|START_THINKING|>` for Command R7B, `<|channel>thought` for Gemma 4, Apriel
//! 1.6's `Here are my reasoning steps:` ... `[BEGIN FINAL RESPONSE]`; gpt-oss's
//! analysis channel, whose answer comes after its final channel's header). gen finds the format in the template
//! ([`Format::of_template`]) and splits the reply as it streams ([`Splitter`]): the thinking
//! goes one way (stderr, a `reasoning` field), the answer the other (stdout, `text`). A
//! template that opens the block itself at the end of the prompt (the R1 distills) starts the
//! reply in the thinking; otherwise the reply thinks only if it begins with the open marker.
//! A marker split across tokens is held back until it is whole, so no part of one is printed.

/// A thinking block's markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Format {
    pub open: &'static str,
    pub close: &'static str,
    /// Markers that may stand where the answer begins (after the block, or at the reply's
    /// start), in this order, and are not part of it: gpt-oss's header of its final channel.
    pub answer_markers: &'static [&'static str],
}

/// The formats gen knows, most specific first.
const FORMATS: &[Format] = &[
    // gpt-oss's Harmony: an analysis channel, then the final one after a new header.
    Format {
        open: "<|channel|>analysis<|message|>",
        close: "<|end|>",
        answer_markers: &["<|start|>assistant", "<|channel|>final<|message|>"],
    },
    // Apriel 1.6: the template opens the reasoning in words; the answer follows a marker.
    Format {
        open: "Here are my reasoning steps:",
        close: "[BEGIN FINAL RESPONSE]",
        answer_markers: &[],
    },
    // Gemma 4: a thought channel.
    Format {
        open: "<|channel>thought",
        close: "<channel|>",
        answer_markers: &[],
    },
    Format {
        open: "<seed:think>",
        close: "</seed:think>",
        answer_markers: &[],
    },
    Format {
        open: "<|START_THINKING|>",
        close: "<|END_THINKING|>",
        answer_markers: &[],
    },
    Format {
        open: "[THINK]",
        close: "[/THINK]",
        answer_markers: &[],
    },
    Format {
        open: "<think>",
        close: "</think>",
        answer_markers: &[],
    },
];

impl Format {
    /// The thinking format a chat template writes, if it writes one (both markers appear in it).
    pub fn of_template(source: &str) -> Option<Format> {
        FORMATS
            .iter()
            .find(|f| source.contains(f.open) && source.contains(f.close))
            .copied()
    }

    /// Whether a rendered prompt leaves the reply inside a thinking block: it ends with the
    /// open marker (whitespace aside), as the R1 distills' templates end.
    pub fn opened_by(&self, prompt: &str) -> bool {
        prompt.trim_end().ends_with(self.open)
    }
}

/// What `enable_thinking` a template gets: `on` true, `off` false, `auto` the template's own
/// default (not set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    On,
    Off,
    #[default]
    Auto,
}

impl Mode {
    /// The `enable_thinking` value to render with.
    pub fn enable_thinking(self) -> Option<bool> {
        match self {
            Mode::On => Some(true),
            Mode::Off => Some(false),
            Mode::Auto => None,
        }
    }
}

/// Whether a template has a switch for thinking (`enable_thinking`).
pub fn has_switch(source: &str) -> bool {
    source.contains("enable_thinking")
}

/// Which side of the reply a stretch of text is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Thinking,
    Answer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the reply may still open a block.
    Start,
    Thinking,
    /// The block closed; the whitespace after it is not part of the answer.
    Closed,
    Answer,
}

/// Splits a streamed reply into thinking and answer (see the module doc).
#[derive(Debug, Clone)]
pub struct Splitter {
    format: Format,
    state: State,
    /// Text not yet given out: whitespace at the start, or what may be the start of a marker.
    held: String,
    /// Whether the reply ever thought.
    thought: bool,
}

impl Splitter {
    /// `opened`: the prompt ended inside a thinking block ([`Format::opened_by`]).
    pub fn new(format: Format, opened: bool) -> Self {
        Self {
            format,
            state: if opened {
                State::Thinking
            } else {
                State::Start
            },
            held: String::new(),
            thought: opened,
        }
    }

    /// The markers this splitter looks for.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Whether the reply is inside its thinking block now.
    pub fn thinking(&self) -> bool {
        self.state == State::Thinking
    }

    /// Whether the reply may still open a thinking block (nothing but whitespace so far).
    pub fn may_open(&self) -> bool {
        self.state == State::Start
    }

    /// Whether the reply thought at all (a block opened, closed or not).
    pub fn thought(&self) -> bool {
        self.thought
    }

    /// The next piece of the reply; returns the text that can be given out now, by part.
    pub fn push(&mut self, piece: &str) -> Vec<(Part, String)> {
        self.held.push_str(piece);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let rest = self.held.trim_start();
                    let f = self.format;
                    let maybe = |m: &str| m.starts_with(rest);
                    if rest.is_empty() || maybe(f.open) || f.answer_markers.iter().any(|m| maybe(m))
                    {
                        break; // whitespace, or maybe a marker: wait
                    }
                    if let Some(after) = rest.strip_prefix(f.open) {
                        self.held = after.to_string();
                        self.state = State::Thinking;
                        self.thought = true;
                    } else if f.answer_markers.iter().any(|m| rest.starts_with(m)) {
                        self.state = State::Closed; // an answer's header: Closed strips it
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if let Some(i) = self.held.find(self.format.close) {
                        let rest = self.held.split_off(i + self.format.close.len());
                        self.held.truncate(i);
                        give(&mut out, Part::Thinking, std::mem::take(&mut self.held));
                        self.held = rest;
                        self.state = State::Closed;
                    } else {
                        let keep = partial_marker(&self.held, self.format.close);
                        let rest = self.held.split_off(self.held.len() - keep);
                        give(
                            &mut out,
                            Part::Thinking,
                            std::mem::replace(&mut self.held, rest),
                        );
                        break;
                    }
                }
                State::Closed => {
                    let rest = self.held.trim_start();
                    if rest.is_empty() {
                        self.held.clear();
                        break;
                    }
                    let markers = self.format.answer_markers;
                    if let Some(m) = markers.iter().find(|m| rest.starts_with(**m)) {
                        self.held = rest[m.len()..].to_string();
                        continue;
                    }
                    if markers.iter().any(|m| m.starts_with(rest)) {
                        break; // maybe a marker: wait
                    }
                    self.held = rest.to_string();
                    self.state = State::Answer;
                }
                State::Answer => {
                    give(&mut out, Part::Answer, std::mem::take(&mut self.held));
                    break;
                }
            }
        }
        out
    }

    /// The end of the reply: whatever is still held, given out.
    pub fn finish(&mut self) -> Vec<(Part, String)> {
        let held = std::mem::take(&mut self.held);
        let part = match self.state {
            State::Thinking => Part::Thinking,
            State::Closed => return Vec::new(),
            State::Start | State::Answer => Part::Answer,
        };
        let mut out = Vec::new();
        give(&mut out, part, held);
        out
    }

    /// A whole reply, split: (thinking, answer).
    pub fn split(format: Format, opened: bool, reply: &str) -> (String, String) {
        let mut s = Splitter::new(format, opened);
        let mut parts = s.push(reply);
        parts.extend(s.finish());
        let mut thinking = String::new();
        let mut answer = String::new();
        for (part, text) in parts {
            match part {
                Part::Thinking => thinking.push_str(&text),
                Part::Answer => answer.push_str(&text),
            }
        }
        (thinking, answer)
    }
}

fn give(out: &mut Vec<(Part, String)>, part: Part, text: String) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some((p, t)) if *p == part => t.push_str(&text),
        _ => out.push((part, text)),
    }
}

/// Bytes at the end of `text` that begin `marker` (and may become it with the next piece).
fn partial_marker(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            let at = text.len() - k;
            text.is_char_boundary(at) && marker.as_bytes().starts_with(&text.as_bytes()[at..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const THINK: Format = Format {
        open: "<think>",
        close: "</think>",
        answer_markers: &[],
    };

    #[test]
    fn harmony_channels_come_apart_and_their_headers_go() {
        let f = Format::of_template(
            "<|start|>assistant<|channel|>analysis<|message|>{{ x }}<|end|> to=functions.",
        )
        .unwrap();
        let reply = "<|channel|>analysis<|message|>Add them: 4.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 4.";
        for size in [1, 2, 5, 200] {
            let mut s = Splitter::new(f, false);
            let mut parts = Vec::new();
            let chars: Vec<char> = reply.chars().collect();
            for c in chars.chunks(size) {
                parts.extend(s.push(&c.iter().collect::<String>()));
            }
            parts.extend(s.finish());
            let (mut t, mut a) = (String::new(), String::new());
            for (part, text) in parts {
                match part {
                    Part::Thinking => t.push_str(&text),
                    Part::Answer => a.push_str(&text),
                }
            }
            assert_eq!(
                (t.as_str(), a.as_str()),
                ("Add them: 4.", "The answer is 4."),
                "size {size}"
            );
        }
        // Straight to the final channel: no thinking, the header gone.
        let (t, a) = Splitter::split(f, false, "<|channel|>final<|message|>Hi.");
        assert_eq!((t.as_str(), a.as_str()), ("", "Hi."));
        // A tool call after the analysis: its header stays for the call's parser.
        let (_, a) = Splitter::split(
            f,
            false,
            "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}",
        );
        assert_eq!(a, "to=functions.f<|channel|>commentary json<|message|>{}");
    }

    /// `reply` pushed in pieces of `size` characters: (thinking, answer), and no piece given out
    /// ever held part of a marker.
    fn streamed(reply: &str, size: usize, opened: bool) -> (String, String) {
        let mut s = Splitter::new(THINK, opened);
        let chars: Vec<char> = reply.chars().collect();
        let mut parts = Vec::new();
        for c in chars.chunks(size) {
            parts.extend(s.push(&c.iter().collect::<String>()));
        }
        parts.extend(s.finish());
        let (mut t, mut a) = (String::new(), String::new());
        for (part, text) in parts {
            assert!(!text.contains('<') || !text.contains("think"), "{text:?}");
            match part {
                Part::Thinking => t.push_str(&text),
                Part::Answer => a.push_str(&text),
            }
        }
        (t, a)
    }

    #[test]
    fn thinking_and_answer_come_apart_whatever_the_pieces() {
        let reply = "\n<think>\nLet me count: 2 + 2 é 4.\n</think>\n\nThe answer is 4.";
        for size in 1..12 {
            let (t, a) = streamed(reply, size, false);
            assert_eq!(t, "\nLet me count: 2 + 2 é 4.\n", "size {size}");
            assert_eq!(a, "The answer is 4.", "size {size}");
        }
    }

    #[test]
    fn a_prompt_that_opened_the_block_starts_in_it() {
        for size in [1, 3, 100] {
            let (t, a) = streamed("so the sum is 4</think>4", size, true);
            assert_eq!((t.as_str(), a.as_str()), ("so the sum is 4", "4"));
        }
    }

    #[test]
    fn a_reply_that_does_not_open_a_block_is_all_answer() {
        for size in [1, 2, 50] {
            let (t, a) = streamed("  <thin ice> is all", size, false);
            assert_eq!((t.as_str(), a.as_str()), ("", "  <thin ice> is all"));
        }
        // Text that merely mentions the marker later is answer too.
        let (t, a) = Splitter::split(THINK, false, "Use <think> tags.");
        assert_eq!((t.as_str(), a.as_str()), ("", "Use <think> tags."));
    }

    #[test]
    fn an_unclosed_block_is_all_thinking_and_no_answer() {
        let mut s = Splitter::new(THINK, false);
        let mut parts = s.push("<think>still going </th");
        assert!(s.thinking() && s.thought());
        parts.extend(s.finish());
        assert!(parts.iter().all(|(p, _)| *p == Part::Thinking), "{parts:?}");
        let all: String = parts.into_iter().map(|(_, t)| t).collect();
        assert_eq!(all, "still going </th");
    }

    #[test]
    fn partial_markers_are_held_back_only_while_they_could_complete() {
        let mut s = Splitter::new(THINK, true);
        assert_eq!(s.push("a </"), vec![(Part::Thinking, "a ".to_string())]);
        assert_eq!(s.push("b"), vec![(Part::Thinking, "</b".to_string())]);
        assert_eq!(partial_marker("xx</thin", "</think>"), 6);
        assert_eq!(partial_marker("é", "</think>"), 0);
    }

    #[test]
    fn formats_are_found_in_templates() {
        let t = |s: &str| Format::of_template(s).map(|f| f.open);
        assert_eq!(t("{{ '<think>\\n' }}...{{ '</think>' }}"), Some("<think>"));
        assert_eq!(t("<seed:think>x</seed:think>"), Some("<seed:think>"));
        assert_eq!(t("[THINK]..[/THINK]"), Some("[THINK]"));
        assert_eq!(
            t("'<|channel>thought\\n<channel|>'"),
            Some("<|channel>thought")
        );
        let apriel = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/assets/chat-templates/Apriel-1.6-15b-Thinker-fixed.jinja"
        ))
        .unwrap();
        let f = Format::of_template(&apriel).unwrap();
        assert!(f.opened_by("<|begin_assistant|>\nHere are my reasoning steps:\n"));
        let (th, a) = Splitter::split(f, true, "\n1. Add.\n[BEGIN FINAL RESPONSE]\n4");
        assert_eq!((th.as_str(), a.as_str()), ("\n1. Add.\n", "4"));
        assert_eq!(t("{{ messages }}"), None);
        assert!(THINK.opened_by("<|Assistant|><think>\n"));
        assert!(!THINK.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    }
}
