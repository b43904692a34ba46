//! A reply's thinking kept apart from its answer as it streams ([`crate::reasoning`]): shown on
//! stderr (dim on a terminal), counted, closed when its budget is spent, and the grammar of a
//! constrained reply held back until the answer begins.

use std::io::Write;

use anyhow::Result;

use crate::generate::Gate;
use crate::reasoning::{Format, Part, Splitter};
use crate::tokenizer::Tokenizer;

/// Where a reply starts: the template's thinking format, and whether the prompt opened it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Start {
    pub format: Format,
    pub opened: bool,
}

impl Start {
    /// For a prompt `rendered` by `template`; None where the template has no thinking block.
    pub fn of(template: &crate::chat::ChatTemplate, rendered: &str) -> Option<Self> {
        template.reasoning_format().map(|format| Start {
            format,
            opened: format.opened_by(rendered),
        })
    }
}

pub(crate) struct Thinking {
    splitter: Splitter,
    /// The thinking so far.
    pub text: String,
    /// Tokens generated inside the block (its markers included).
    pub tokens: usize,
    budget: Option<usize>,
    /// The end marker as tokens, fed when the budget is spent.
    close: Vec<u32>,
    /// The open marker, when it is one token (a grammar lets the reply open the block).
    open: Option<u32>,
    forced: bool,
    /// Show the thinking on stderr (Some(true): dim).
    show: Option<bool>,
    shown_last: Option<char>,
}

impl Thinking {
    /// `show`: print the thinking to stderr as it comes.
    pub fn new(
        start: Start,
        tokenizer: &Tokenizer,
        budget: Option<usize>,
        show: bool,
    ) -> Result<Self> {
        let marker = |m: &str| -> Result<Vec<u32>> {
            Ok(match tokenizer.id_of(m) {
                Some(id) => vec![id],
                None => tokenizer.encode(m, false)?,
            })
        };
        Ok(Self {
            splitter: Splitter::new(start.format, start.opened),
            text: String::new(),
            tokens: 0,
            budget,
            close: marker(start.format.close)?,
            open: tokenizer.id_of(start.format.open),
            forced: false,
            // Dim on a terminal, unless NO_COLOR asks for plain text.
            show: show.then(super::stderr_colour),
            shown_last: None,
        })
    }

    /// One token's text; returns the part of it (and of what was held before) that is answer.
    pub fn push(&mut self, piece: &str) -> String {
        let was = self.splitter.thinking();
        let parts = self.splitter.push(piece);
        if was || self.splitter.thinking() {
            self.tokens += 1;
        }
        self.take(parts)
    }

    /// The end of the reply, with `rest` (text that came with no token: the end of a
    /// character cut short): the answer still held.
    pub fn finish_with(&mut self, rest: &str) -> String {
        let mut parts = self.splitter.push(rest);
        parts.extend(self.splitter.finish());
        let answer = self.take(parts);
        if self.shown_last.is_some_and(|c| c != '\n') {
            eprintln!();
        }
        answer
    }

    fn take(&mut self, parts: Vec<(Part, String)>) -> String {
        let mut answer = String::new();
        for (part, text) in parts {
            match part {
                Part::Answer => answer.push_str(&text),
                Part::Thinking => {
                    self.show(&text);
                    self.text.push_str(&text);
                }
            }
        }
        answer
    }

    fn show(&mut self, text: &str) {
        let Some(terminal) = self.show else {
            return;
        };
        let mut err = std::io::stderr().lock();
        let _ = match terminal {
            true => write!(err, "\x1b[2m{text}\x1b[0m"),
            false => write!(err, "{text}"),
        };
        let _ = err.flush();
        self.shown_last = text.chars().last().or(self.shown_last);
    }

    /// What the report says of the thinking.
    pub fn into_report(self) -> crate::report::Reasoning {
        crate::report::Reasoning {
            tokens: self.tokens,
            unfinished: self.unfinished(),
            text: self.text,
        }
    }

    /// Whether the reply is still inside its thinking block (at its end: it stopped while
    /// thinking, with no answer).
    pub fn unfinished(&self) -> bool {
        self.splitter.thinking()
    }

    /// The end marker's tokens, once, when the budget is spent inside the block.
    pub fn forced(&mut self) -> Vec<u32> {
        let spent = self.budget.is_some_and(|b| self.tokens >= b);
        if self.forced || !spent || !self.splitter.thinking() {
            return Vec::new();
        }
        self.forced = true;
        self.close.clone()
    }

    /// How a grammar applies to the next token.
    pub fn gate(&self) -> Gate {
        if self.splitter.thinking() {
            Gate::Pause
        } else if self.splitter.may_open() {
            self.open.map_or(Gate::Apply, Gate::ApplyOr)
        } else {
            Gate::Apply
        }
    }
}
