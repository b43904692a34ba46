//! `--endpoint` reads each reply as server-sent events from a server gen does not control:
//! `gen::remote::read_events` on any response body must end, without a panic or a hang, in a
//! reply (every `data:` line parsed) or a clean failure (an event that is not JSON, a body cut
//! before the reply ended, not UTF-8: retry; an `error` event: fatal). The same body in
//! pieces of any size (as the network delivers it) must give the same reply or failure; the
//! reply's text is what was handed on piece by piece; a reader that stops early (Ctrl-C)
//! stops the read at once; a connection reset mid-body is a failure, not a panic.
//!
//! Input layout: the first byte's bits pick what else to try (bit 0: stop after the
//! (byte >> 4)-th piece of text; bit 1: end the body with a connection reset instead of its
//! end); the second seeds the sizes of the pieces the body arrives in; the rest is the body.
#![no_main]

use std::io::{self, Read};
use std::time::Instant;

use gen::remote::{read_events, Failure, Reply};
use libfuzzer_sys::fuzz_target;

/// A response body delivered in pieces of 1 to 16 bytes (sizes from `seed`), then the end or,
/// with `reset`, a connection reset.
struct Pieces<'a> {
    body: &'a [u8],
    seed: u32,
    reset: bool,
}

impl Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.body.is_empty() {
            return if self.reset {
                Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "reset by peer",
                ))
            } else {
                Ok(0)
            };
        }
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 17;
        self.seed ^= self.seed << 5;
        let n = (self.seed as usize % 16 + 1)
            .min(self.body.len())
            .min(buf.len());
        buf[..n].copy_from_slice(&self.body[..n]);
        self.body = &self.body[n..];
        Ok(n)
    }
}

/// What a read gave, less its timing.
#[derive(Debug, PartialEq)]
struct Outcome {
    result: Result<(), String>,
    text: String,
    stop: String,
    prompt_tokens: Option<usize>,
    tokens: Option<usize>,
    pieces: Vec<String>,
}

fn read(body: impl Read, stop_after: Option<usize>) -> Outcome {
    let mut reply = Reply::default();
    let mut pieces = Vec::new();
    let result = read_events(body, &mut reply, Instant::now(), &mut |t: &str| {
        assert!(!t.is_empty(), "an empty piece of text was handed on");
        pieces.push(t.to_string());
        stop_after.is_none_or(|k| pieces.len() <= k)
    });
    let result = match result {
        Ok(()) => {
            assert!(!reply.stop.is_empty(), "a reply without a stop reason");
            Ok(())
        }
        Err(Failure::Stopped) => {
            assert_eq!(reply.stop, "interrupted");
            assert_eq!(Some(pieces.len()), stop_after.map(|k| k + 1));
            Err("stopped".to_string())
        }
        Err(Failure::Retry { why, after }) => {
            assert!(after.is_none(), "a retry-after from the body");
            assert!(!why.is_empty());
            Err(format!("retry: {why}"))
        }
        Err(Failure::Fatal(why)) => {
            assert!(!why.is_empty());
            Err(format!("fatal: {why}"))
        }
    };
    assert_eq!(reply.text, pieces.concat());
    Outcome {
        result,
        text: reply.text,
        stop: reply.stop,
        prompt_tokens: reply.prompt_tokens,
        tokens: reply.tokens,
        pieces,
    }
}

fuzz_target!(|data: &[u8]| {
    let [flags, seed, body @ ..] = data else {
        return;
    };
    let whole = read(body, None);
    let seed = u32::from(*seed) | 0x100; // xorshift needs a non-zero state
    let pieces = read(
        Pieces {
            body,
            seed,
            reset: false,
        },
        None,
    );
    assert_eq!(whole, pieces, "the same body in pieces read differently");
    if flags & 1 != 0 {
        let k = usize::from(flags >> 4);
        let stopped = read(body, Some(k));
        if whole.pieces.len() > k {
            assert_eq!(stopped.result, Err("stopped".to_string()));
            assert_eq!(stopped.pieces[..], whole.pieces[..k + 1]);
        } else {
            assert_eq!(stopped, whole);
        }
    }
    if flags & 2 != 0 {
        let reset = read(
            Pieces {
                body,
                seed,
                reset: true,
            },
            None,
        );
        // A reset after `[DONE]` is never read; before it, the read fails (or was failing).
        if reset.result.is_ok() {
            assert_eq!(reset, whole);
        }
    }
});
