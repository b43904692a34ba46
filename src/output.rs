//! Streaming text out: each token's text goes to stdout as soon as it is sampled, except text
//! that might be the start of a stop string, which waits until it is known not to be one.
//! A stop string is never printed, not even in part.

use std::io::{self, Write};

/// Matches stop strings across token boundaries.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text seen but not yet released: a suffix that is a prefix of some stop string.
    pending: String,
}

/// What `StopMatcher::push` decided.
#[derive(Debug, PartialEq, Eq)]
pub struct Release {
    /// Text that is safe to print now.
    pub text: String,
    /// A stop string was completed; nothing after its start is to be printed.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stops,
            pending: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Release {
        if self.stops.is_empty() {
            return Release {
                text: piece.to_string(),
                stopped: false,
            };
        }
        self.pending.push_str(piece);
        // The earliest complete stop string wins.
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return Release {
                text,
                stopped: true,
            };
        }
        // Hold back the longest suffix that could still grow into a stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.pending, s))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        Release {
            text,
            stopped: false,
        }
    }

    /// Text still held back when generation ends without a stop string: it was no stop after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of `stop`,
/// cut only at character boundaries.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// Writes text to stdout (or any writer), flushing after each piece so a reader sees each
/// token when it is sampled. A closed pipe is remembered, not reported as an error.
pub struct TextOut<W: Write> {
    out: W,
    closed: bool,
}

impl<W: Write> TextOut<W> {
    pub fn new(out: W) -> Self {
        Self { out, closed: false }
    }

    /// Returns false once the reader has gone away (broken pipe).
    pub fn write(&mut self, text: &str) -> io::Result<bool> {
        if self.closed {
            return Ok(false);
        }
        if text.is_empty() {
            return Ok(true);
        }
        match self
            .out
            .write_all(text.as_bytes())
            .and_then(|_| self.out.flush())
        {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn no_stops_passes_everything_through_at_once() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("Hello").text, "Hello");
        assert_eq!(m.push(" wor").text, " wor");
    }

    #[test]
    fn stop_split_over_tokens_is_never_printed() {
        assert_eq!(
            run(&["\n\n"], &["Paris", ".", "\n", "\n", "More"]),
            ("Paris.".into(), true)
        );
        assert_eq!(
            run(&["END"], &["abc E", "N", "Dxyz"]),
            ("abc ".into(), true)
        );
    }

    #[test]
    fn text_is_released_as_soon_as_it_cannot_start_a_stop() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abc E").text, "abc ");
        assert_eq!(m.push("x").text, "Ex");
        assert_eq!(m.push(" and").text, " and");
    }

    #[test]
    fn false_starts_and_end_of_generation_flush_the_held_text() {
        assert_eq!(run(&["STOP"], &["ST", "OP!"]), ("".into(), true));
        assert_eq!(run(&["STOP"], &["a ST", "ON"]), ("a STON".into(), false));
        assert_eq!(run(&["STOP"], &["a ST"]), ("a ST".into(), false));
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_text_is_safe() {
        assert_eq!(run(&["b", "abc"], &["xxabc"]), ("xx".into(), true));
        assert_eq!(
            run(&["日本"], &["こんにちは日", "本語"]),
            ("こんにちは".into(), true)
        );
        assert_eq!(run(&["é!"], &["café", "s"]), ("cafés".into(), false));
    }

    struct Closed;
    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn broken_pipe_is_a_quiet_end() {
        let mut out = TextOut::new(Closed);
        assert!(!out.write("x").unwrap());
        assert!(out.is_closed());
        let mut buf = TextOut::new(Vec::new());
        assert!(buf.write("ok").unwrap());
        assert_eq!(buf.out, b"ok");
    }
}
