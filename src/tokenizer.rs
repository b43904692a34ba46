//! Text <-> token ids, and streaming text out.
//!
//! The job of this module: turn a prompt into exactly the ids llama.cpp would produce for the
//! same model file, and turn generated ids back into text as they arrive. The tokenizer is
//! built either from a GGUF file's `tokenizer.ggml.*` metadata (the usual case) or from a
//! Hugging Face `tokenizer.json`.
//!
//! GGUF files carry one of three tokenizer families that gen supports:
//!
//! - `gpt2`: byte-level BPE. The ranked merges are in the file. What llama.cpp adds on top is a
//!   list of regex splits chosen by the `tokenizer.ggml.pre` name; we reproduce that list as a
//!   sequence of isolating `Split` pre-tokenizers, followed by a byte-to-char mapping that adds
//!   no prefix space (a prefix space is what makes a naive conversion put an extra space after
//!   every special token). `bpe` then merges each piece by the file's ranks.
//! - `gemma4` (and `gpt2` files whose pre-tokenizer is `gemma4` or `sarvam-moe`): BPE on raw
//!   UTF-8. Spaces are written `▁`, the text is cut only at newlines, the file's merges run on
//!   characters as they are, and a character the vocabulary lacks comes out as `<0xNN>` byte
//!   tokens, as llama.cpp's BPE session does when it does not byte-encode.
//! - `llama`: SentencePiece. llama.cpp repeatedly merges the adjacent pair whose concatenation
//!   is the vocabulary entry with the highest score; `spm` does exactly that on the vocabulary
//!   and its scores. Characters not in the vocabulary fall back to `<0xNN>` byte tokens. (For
//!   [`Tokenizer::inner`] the same rule is written as a `tokenizers` BPE model whose merges,
//!   derived from the vocabulary, are ranked by the merged entry's score; that takes half a
//!   second for a large vocabulary, so only a caller of `inner` builds it.)
//!
//! In both, control, user-defined and unknown-type tokens are cut out of the raw text before
//! anything else runs, as llama.cpp's special-token partition does. That cut, the normalizer
//! and the pre-tokenizer are the `tokenizers` crate's; the merging is gen's own, on a table of
//! ids (`lookup`): having that crate index the merges was most of a start for large
//! vocabularies (Gemma's 262k entries 0.6 s, Llama 3's 280k merges 0.14 s). A tokenizer.json
//! runs through the crate whole.
//!
//! Decoding does not go through a `tokenizers` decoder: every id has a precomputed byte string
//! (byte-level characters mapped back to bytes, `▁` to a space, `<0xNN>` to its byte, special
//! tokens as their text). `decode` and the streaming decoder both concatenate those bytes, so
//! they agree by construction, and a character split across several tokens is reassembled
//! before it is shown.

/// `Ord` and the comparisons it needs for the entries of a merge queue (`BinaryHeap`, whose top
/// is the greatest), from one ordering of `$a` against `$b`.
macro_rules! queue_order {
    ($t:ty, |$a:ident, $b:ident| $order:expr) => {
        impl Ord for $t {
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                let ($a, $b) = (self, other);
                $order
            }
        }

        impl PartialOrd for $t {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        impl PartialEq for $t {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other) == std::cmp::Ordering::Equal
            }
        }

        impl Eq for $t {}
    };
}

mod bpe;
mod lookup;
mod spm;

/// `work(first, part)` on consecutive parts of `items` (`first`: the index of the part's first
/// item), spread over the cores, the results in the parts' order. A part no thread can be had
/// for runs on this one.
fn by_parts<I: Sync, T: Send>(items: &[I], work: impl Fn(usize, &[I]) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let chunk = items.len().div_ceil(threads).max(1);
    let work = &work;
    std::thread::scope(|scope| {
        let workers: Vec<_> = items
            .chunks(chunk)
            .enumerate()
            .map(|(i, part)| {
                std::thread::Builder::new()
                    .spawn_scoped(scope, move || work(i * chunk, part))
                    .map_err(|_| (i, part))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| match w {
                Ok(w) => w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                Err((i, part)) => work(i * chunk, part),
            })
            .collect()
    })
}

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
/// Ids llama.cpp adds to its end-of-generation set when the file names them.
const KEYS_EXTRA_EOG: &[&str] = &[
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
];

/// Token texts that end generation whatever the file's ids say. Conversions often leave the
/// end-of-turn token out of the metadata, so llama.cpp recognises them by text; stopping on
/// the same set keeps gen's output identical to llama.cpp's.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
    // Fill-in-the-middle padding / repo / file separators: llama.cpp stops on these too.
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// Token texts llama.cpp forces to control type, so they are parsed in text even when a
/// conversion marked them normal (in addition to `EOG_TEXTS`).
const FORCED_CONTROL_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
];

/// The SentencePiece space marker.
const SPACE_MARKER: &str = "\u{2581}";

// llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, `llm_tokenizer_bpe`). Each list is
// applied in order, every regex splitting the pieces left by the previous one; text between
// matches stays a piece of its own, which is what `SplitDelimiterBehavior::Isolated` does.
//
// What llama.cpp does with a regex is not always what the regex says, and these are written for
// what it does (src/unicode.cpp, `unicode_regex_split`):
// - A regex that uses `\p{..}` runs on a copy of the text in which every non-ASCII character is
//   replaced by one byte for its category, and `\p{Lu}`, `\p{Ll}`, `\p{Lt}`, `\p{Lm}` and `\p{Lo}`
//   all stand for "any letter" (ASCII ones included). So upper and lower case are not told apart
//   there: those classes are written `\p{L}` here.
// - A regex without `\p{..}` runs on the code points with every non-ASCII whitespace character
//   replaced by `\v`; such a character therefore never matches a class that names it outright
//   (those classes subtract `\s` here), only `\s`.
// - `\d` means ASCII digits: `[0-9]` here.
// - A few regexes are never run as regexes but select a hand-written splitter; those are written
//   as the regex that splits the same way (see `RE_AFMOE_DIGITS` and `RE_KIMI_K2`; the GPT-2,
//   Llama 3, Qwen2 and Qwen3.5 splitters follow their regexes).

/// GPT-2's split (llama.cpp's hand-written splitter for it adds `\s+` at the end, which changes
/// nothing: what it would match is left between matches and so is a piece anyway).
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_JAIS2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_UFAKZEKA: &str =
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const RE_EXAONE_MOE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";
const RE_MINICPM5: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Tekken (Mistral) as llama.cpp rewrites it: "a letter that is not ASCII lower (upper) case"
/// stands for the original's upper (lower) case classes, so non-ASCII letters are both.
const RE_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's (`o200k`) split, rewritten the same way as Tekken's.
const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_GRANITE_EMB_MULTI: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The GPT-4o-shaped split Tiny Aya and Youtu name with case classes (`\p{Lu}`, `\p{Ll}`, ...),
/// which llama.cpp reads as "any letter" (see above): so case does not split words here.
const RE_CASELESS_WORDS_N3: &str = r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_CASELESS_WORDS_N1: &str = r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_YOUTU_CJK: &str = r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+";
/// DeepSeek LLM's and Coder's CJK run: 一-龥, U+0800-一 and 가-U+D7FF, less the whitespace
/// llama.cpp has turned into `\v` by then.
const RE_DEEPSEEK_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}--\s]+";
const RE_DEEPSEEK_LLM_LETTERS: &str = r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+";
/// ASCII and full-width punctuation, ‘-‟ and 、-。 (llama.cpp's class starts at the ideographic
/// space U+3000, which it has turned into `\v` by then).
const RE_DEEPSEEK_LLM_PUNCT: &str =
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}--\s]+";
const RE_DEEPSEEK3_CJK: &str = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+";
/// DeepSeek V3's (and AFMoE's) main split.
const RE_DEEPSEEK3: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
const RE_SPARK2_5: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##;
/// AFMoE's CJK and Southeast Asian runs. The range after 䶿 starts at U+8C48: llama.cpp's source
/// has 豈 there in its canonical form U+8C48 rather than the compatibility ideograph U+F900, and
/// runs the range from where it says.
const RE_AFMOE_SCRIPTS: &str = r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{E40}-\x{E7F}\x{E80}-\x{EFF}\x{1780}-\x{17FF}\x{1000}-\x{109F}\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+";
/// llama.cpp's AFMoE digit splitter (also what it runs for Tiny Aya's
/// `\d{1,3}(?=(?:\d{3})*\b)`): every run of `\p{N}` is cut into groups of three counted from its
/// end, and the first group of a run also takes all the text since the previous run (or the
/// start), which is left in that piece; the text after the last run is a piece of its own. So
/// `ab1234cd` gives `ab1`, `234`, `cd`. Each match starts where the previous one ended (`\G`):
/// after a digit the run goes on in threes, otherwise the text up to the next run is taken with
/// the run's first one to three digits, as many as leave a multiple of three.
const RE_AFMOE_DIGITS: &str =
    r"\G(?:(?<=\p{N})\p{N}{3}|(?>\P{N}*)(?:\p{N}{1,2}|\p{N}{3})(?=(?:\p{N}{3})*(?:\P{N}|$)))";
/// llama.cpp's Kimi K2 splitter (selected by the list `\p{Han}+`), as the regex it implements:
/// runs of Han (its `unicode_cpt_is_han` ranges); words of other letters (no marks, case not
/// told apart) with an optional leading non-letter and trailing contraction; then digits in
/// threes, punctuation and whitespace as in Llama 3.
const RE_KIMI_K2: &str = r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]+|[^\r\n\p{L}\p{N}]?[\p{L}--[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}]]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_PORO: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const RE_DIGIT: &str = r"\p{N}";
const RE_LINES: &str = r"[^\n]+|[\n]+";

/// How a `gpt2` vocabulary splits text before merging, per `tokenizer.ggml.pre`.
struct BpePre {
    regexes: &'static [&'static str],
    /// A pre-token that is itself in the vocabulary is emitted whole (llama3-style vocabs).
    ignore_merges: bool,
    /// Whether the model wants BOS when the file does not say (`add_bos_token` absent).
    add_bos: bool,
    /// Merged as raw UTF-8 with spaces written `▁` and `<0xNN>` tokens for bytes the
    /// vocabulary lacks (llama.cpp's `byte_encode = false` with `escape_whitespaces`), not as
    /// GPT-2's byte-level characters.
    raw: Option<RawUtf8>,
}

/// What differs between the raw-UTF-8 vocabularies llama.cpp runs (Gemma 4's and Sarvam's).
#[derive(Clone, Copy)]
struct RawUtf8 {
    /// A piece of newlines alone that is an entry is that entry (llama.cpp's Gemma 4 fix).
    whole_newlines: bool,
    /// BOS is added even where the file says `add_bos_token = false` (llama.cpp overrides it
    /// for Gemma 4).
    always_bos: bool,
}

const fn split(regexes: &'static [&'static str]) -> BpePre {
    BpePre {
        regexes,
        ignore_merges: false,
        add_bos: false,
        raw: None,
    }
}

/// A split after which a pre-token that is in the vocabulary is taken whole (`ignore_merges`).
const fn whole_words(regexes: &'static [&'static str], add_bos: bool) -> BpePre {
    BpePre {
        regexes,
        ignore_merges: true,
        add_bos,
        raw: None,
    }
}

/// SentencePiece-style BPE: cut at newlines only (merges never cross one), merged on raw UTF-8.
const fn raw_lines(raw: RawUtf8) -> BpePre {
    BpePre {
        regexes: &[RE_LINES],
        ignore_merges: false,
        add_bos: false,
        raw: Some(raw),
    }
}

/// llama.cpp's table from `tokenizer.ggml.pre` names to splits and the flags that change ids
/// (llama-vocab.cpp, `llama_vocab::impl::load` and `llm_tokenizer_bpe`); the test
/// `pre_tokenizers_split_as_llama_cpp` checks every entry against llama.cpp's own. Its
/// `clean_spaces` only affects llama.cpp's `detokenize`, which gen does not have: gen's text is
/// the tokens' bytes, as llama.cpp's `token_to_piece` gives them. `jina-v1-en`, `jina-v2-code`
/// and `roberta-bpe` also add a separator when llama.cpp adds special tokens; gen adds none but
/// BOS. llama.cpp has no BOS id for `chatglm-bpe`, `glm4` and `glm5` unless the file names one;
/// gen takes BOS only from the file for every vocabulary (where llama.cpp falls back to id 11
/// for other `gpt2` vocabularies).
const BPE_PRES: &[(&[&str], BpePre)] = &[
    (
        &["default"],
        split(&[
            r"[\p{P}\$\+<=>\^~\|]+",
            RE_GPT2,
            r"\p{N}+",
            r"[0-9][0-9][0-9]",
        ]),
    ),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        whole_words(&[RE_LLAMA3], true),
    ),
    (
        &["minicpm5"],
        whole_words(&[r"\p{N}{1,3}", RE_MINICPM5], false),
    ),
    (
        &["deepseek-llm"],
        split(&[
            r"[\r\n]",
            RE_DEEPSEEK_LLM_LETTERS,
            RE_DEEPSEEK_LLM_PUNCT,
            r"\s+$",
            RE_DEEPSEEK_CJK,
            r"\p{N}+",
        ]),
    ),
    (
        &["deepseek-coder"],
        split(&[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            RE_DEEPSEEK_CJK,
            RE_DIGIT,
        ]),
    ),
    (
        &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        split(&[r"\p{N}{1,3}", RE_DEEPSEEK3_CJK, RE_DEEPSEEK3]),
    ),
    (
        &["spark2_5"],
        split(&[r"\p{N}{1,3}", RE_DEEPSEEK3_CJK, RE_SPARK2_5, RE_DIGIT]),
    ),
    (
        &["youtu"],
        whole_words(&[RE_YOUTU_CJK, RE_CASELESS_WORDS_N1], false),
    ),
    (
        &["falcon"],
        split(&[r"[\p{P}\$\+<=>\^~\|`]+", RE_GPT2, r"[0-9][0-9][0-9]"]),
    ),
    (
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        split(&[RE_DIGIT, RE_GPT2]),
    ),
    (
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
        ],
        split(&[RE_GPT2]),
    ),
    (&["jais-2"], split(&[RE_JAIS2])),
    (&["dbrx", "smaug-bpe", "chatglm-bpe"], split(&[RE_LLAMA3])),
    (&["glm4", "glm5"], whole_words(&[RE_LLAMA3], false)),
    (
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        split(&[RE_QWEN2]),
    ),
    (&["qwen35"], split(&[RE_QWEN35])),
    (&["poro-chat", "bloom", "gpt3-finnish"], split(&[RE_PORO])),
    (&["viking"], split(&[RE_PORO, RE_DIGIT])),
    (&["tekken"], whole_words(&[RE_TEKKEN], true)),
    (
        &["chameleon"],
        BpePre {
            regexes: &[
                r"<sentinel:[0-9]+>",
                r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                r"([\t\n]|    |  )",
                RE_DIGIT,
                r"[\p{P}!-/:-@\[-`{-~]",
                RE_GPT2,
            ],
            ignore_merges: false,
            add_bos: true,
            raw: None,
        },
    ),
    (
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        split(&[RE_GPT4O]),
    ),
    (
        &["granite-embed-multi-97m"],
        whole_words(&[RE_GRANITE_EMB_MULTI], false),
    ),
    (
        &["tiny_aya", "cohere2moe"],
        split(&[RE_AFMOE_DIGITS, RE_CASELESS_WORDS_N3]),
    ),
    (&["kimi-k2"], split(&[RE_KIMI_K2])),
    (
        &["superbpe"],
        split(&[r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))"]),
    ),
    (
        &["bailingmoe", "bailingmoe2", "llada-moe"],
        split(&[RE_BAILINGMOE]),
    ),
    (&["seed-coder"], split(&[RE_SEED_CODER])),
    (&["ufakzeka"], split(&[RE_UFAKZEKA])),
    (
        &["afmoe"],
        split(&[RE_AFMOE_DIGITS, RE_AFMOE_SCRIPTS, RE_DEEPSEEK3]),
    ),
    (&["laguna"], split(&[RE_LINES, RE_QWEN2])),
    (&["exaone-moe"], split(&[RE_EXAONE_MOE])),
    (
        &["gemma4", "granite-embed-multi-311m"],
        raw_lines(RawUtf8 {
            whole_newlines: true,
            always_bos: true,
        }),
    ),
    (
        &["sarvam-moe"],
        raw_lines(RawUtf8 {
            whole_newlines: false,
            always_bos: false,
        }),
    ),
];

/// Names llama.cpp tokenizes with a session of its own (`whitespace`: text cut at spaces and
/// looked up whole), which gen does not have.
const OWN_SESSION_PRES: &[&str] = &["whitespace"];

/// Every `tokenizer.ggml.pre` name gen knows: the ones it splits as llama.cpp does and the ones it
/// refuses by name (for the fuzz target, which draws from them).
pub fn pre_tokenizer_names() -> impl Iterator<Item = &'static str> {
    BPE_PRES
        .iter()
        .flat_map(|(names, _)| names.iter().copied())
        .chain(OWN_SESSION_PRES.iter().copied())
}

fn bpe_pre(name: &str) -> Result<&'static BpePre> {
    if let Some((_, pre)) = BPE_PRES.iter().find(|(names, _)| names.contains(&name)) {
        return Ok(pre);
    }
    // Refusing beats tokenizing differently from llama.cpp without saying so.
    if OWN_SESSION_PRES.contains(&name) {
        bail!(
            "unsupported pre-tokenizer `{name}` (`{KEY_PRE}`): llama.cpp tokenizes it with a \
             tokenizer of its own, which gen does not have"
        );
    }
    bail!(
        "unsupported pre-tokenizer `{name}` (`{KEY_PRE}`): gen does not know how llama.cpp splits \
         text for it"
    )
}

/// The ids that end generation besides `eos_token_id`, as llama.cpp finds them: the file's
/// end-of-turn keys and well-known end-of-turn texts.
fn gguf_end_of_generation(
    md: &HashMap<String, gguf_file::Value>,
    tokens: &[String],
) -> Result<HashSet<u32>> {
    let mut eog = HashSet::new();
    for key in KEYS_EXTRA_EOG {
        if let Some(id) = get_id(md, key, tokens.len())? {
            eog.insert(id);
        }
    }
    let eog_texts: HashSet<&str> = EOG_TEXTS.iter().copied().collect();
    for (id, text) in tokens.iter().enumerate() {
        if eog_texts.contains(text.as_str()) {
            eog.insert(id as u32);
        }
    }
    // gpt-oss ends a message with <|end|> but keeps generating after it; llama.cpp only
    // stops there when the vocab lacks <|return|> and <|call|>.
    if ["<|return|>", "<|call|>"]
        .iter()
        .all(|t| tokens.iter().any(|x| x == t))
    {
        for (id, text) in tokens.iter().enumerate() {
            if text == "<|end|>" {
                eog.remove(&(id as u32));
            }
        }
    }
    Ok(eog)
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenKind {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    fn from_gguf(v: i64) -> Self {
        match v {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }

    /// Tokens llama.cpp cuts out of the raw text before tokenizing the rest.
    fn matched_in_text(self) -> bool {
        matches!(self, Self::Control | Self::Unknown | Self::UserDefined)
    }
}

/// The bytes each id stands for, in one buffer: `bytes[offsets[id]..offsets[id + 1]]`.
#[derive(Clone, Default)]
struct Pieces {
    offsets: Vec<usize>,
    bytes: Vec<u8>,
}

impl Pieces {
    fn with_capacity(n: usize) -> Self {
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        Self {
            offsets,
            bytes: Vec::with_capacity(n * 6),
        }
    }

    fn push(&mut self, piece: &[u8]) {
        self.bytes.extend_from_slice(piece);
        self.offsets.push(self.bytes.len());
    }

    fn get(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let (start, end) = (*self.offsets.get(i)?, *self.offsets.get(i.checked_add(1)?)?);
        self.bytes.get(start..end)
    }
}

/// GPT-2's reversible byte <-> printable-char mapping: printable Latin-1 bytes stand for
/// themselves, the rest are shifted to U+0100 upwards in byte order.
fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        table[usize::from(b)] = char::from_u32(code).unwrap_or('\0');
    }
    table
}

fn byte_level_inverse() -> HashMap<char, u8> {
    byte_level_chars()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// Byte-level token text -> bytes. A character outside the mapping (only in hand-made vocabs)
/// is kept as its own UTF-8 rather than dropped.
fn byte_level_decode(text: &str, inverse: &HashMap<char, u8>, out: &mut Vec<u8>) {
    for c in text.chars() {
        match inverse.get(&c) {
            Some(&b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
}

/// `<0xNN>` -> the byte.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// A tokenizer with the special ids a generator needs; see the module docs.
pub struct Tokenizer {
    encoder: Encoder,
    /// What [`Tokenizer::inner`] returns for a GGUF vocabulary, built on first use.
    full: OnceLock<tokenizers::Tokenizer>,
    /// The encoder that takes special-token text as text ([`Tokenizer::encode_plain`]).
    plain: OnceLock<Encoder>,
    /// Raw vocabulary text per id (`Ġworld`, `▁world`, `<|im_end|>`).
    texts: Vec<String>,
    pieces: Pieces,
    bos: Option<u32>,
    /// Whether the model wants BOS in front of a raw prompt.
    add_bos: bool,
    eos: Vec<u32>,
    /// The encoder puts a space in front of the text (SentencePiece `add_space_prefix`), so
    /// `decode` drops one leading space from the first piece to give the text back.
    strip_first_space: bool,
    /// See [`Tokenizer::max_token_bytes`].
    max_token_bytes: usize,
    /// Per id: a special token (control, unknown, unused; a tokenizer.json's special added
    /// tokens), which stands for no text of its own.
    special: Vec<bool>,
    /// Input bytes the encoder may drop (no token holds them); all `true` when unknown.
    /// See [`Tokenizer::min_tokens`].
    droppable: [bool; 256],
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.texts.len())
            .field("bos", &self.bos)
            .field("add_bos", &self.add_bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Build from a GGUF file's metadata (`tokenizer.ggml.*` keys).
    pub fn from_gguf_metadata(md: &HashMap<String, gguf_file::Value>) -> Result<Self> {
        let model = get_str(md, KEY_MODEL)?;
        // llama.cpp runs a `gemma4` vocabulary as BPE with the `gemma4` pre-tokenizer, whatever
        // `tokenizer.ggml.pre` says.
        let (spm, forced_pre) = match model {
            "gpt2" => (false, None),
            "gemma4" => (false, Some("gemma4")),
            "llama" => (true, None),
            other => bail!(
                "unsupported tokenizer model `{other}` (`{KEY_MODEL}`); gen supports `gpt2` \
                 (byte-level BPE), `gemma4` (BPE on UTF-8) and `llama` (SentencePiece)"
            ),
        };

        let tokens: Vec<String> = get_str_array(md, KEY_TOKENS)?
            .into_iter()
            .enumerate()
            // llama.cpp renames empty entries the same way; an empty key would confuse matching.
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.to_owned()
                }
            })
            .collect();
        let n = tokens.len();
        if n == 0 {
            bail!("`{KEY_TOKENS}` is empty");
        }
        if u32::try_from(n).is_err() {
            bail!("`{KEY_TOKENS}` has {n} entries, more than token ids can address");
        }

        let mut kinds = match md.get(KEY_TOKEN_TYPE) {
            None => vec![TokenKind::Normal; n],
            Some(v) => {
                let types = int_array(v, KEY_TOKEN_TYPE)?;
                if types.len() != n {
                    bail!(
                        "`{KEY_TOKEN_TYPE}` has {} entries but `{KEY_TOKENS}` has {n}",
                        types.len()
                    );
                }
                types.into_iter().map(TokenKind::from_gguf).collect()
            }
        };
        let forced: HashSet<&str> = EOG_TEXTS
            .iter()
            .chain(FORCED_CONTROL_TEXTS)
            .copied()
            .collect();
        for (kind, text) in kinds.iter_mut().zip(&tokens) {
            if forced.contains(text.as_str()) {
                *kind = TokenKind::Control;
            }
        }

        let bos = get_id(md, KEY_BOS, n)?;
        let eos_id = get_id(md, KEY_EOS, n)?;
        let unk = get_id(md, KEY_UNK, n)?;
        let add_space_prefix = get_bool(md, KEY_ADD_SPACE_PREFIX)?.unwrap_or(spm);

        // Added tokens are matched on the raw text (normalized = false), like llama.cpp's
        // partition, so user-defined whitespace tokens (Gemma's "  ", "\n\n") match real
        // spaces and newlines rather than `▁`.
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&kinds)
            .filter(|(_, k)| k.matched_in_text())
            .map(|(t, k)| {
                AddedToken::from(t.clone(), *k != TokenKind::UserDefined).normalized(false)
            })
            .collect();

        let mut raw = None;
        let (encoder, add_bos_default) = if spm {
            let scores = f32_array(md, KEY_SCORES)?;
            if scores.len() != n {
                bail!(
                    "`{KEY_SCORES}` has {} entries but `{KEY_TOKENS}` has {n}",
                    scores.len()
                );
            }
            let encoder = OwnEncoder {
                merging: Arc::new(Merging::Spm(spm::Spm::new(&tokens, scores, unk))),
                split: spm_split(add_space_prefix, &added)?,
                form: Form::Spm { add_space_prefix },
                added,
            };
            (Encoder(EncoderKind::Own(Arc::new(encoder))), true)
        } else {
            // llama.cpp reads a missing or empty name as `default`.
            let pre_name = match (forced_pre, md.get(KEY_PRE)) {
                (Some(name), _) => name,
                (None, None) => "default",
                (None, Some(v)) => match value_str(v, KEY_PRE)? {
                    "" => "default",
                    name => name,
                },
            };
            let pre = bpe_pre(pre_name)?;
            raw = pre.raw;
            // llama.cpp loads a Kimi K2 vocabulary without merges (every character then stays
            // a token of its own); any other needs them.
            let merges = if pre_name == "kimi-k2" && !md.contains_key(KEY_MERGES) {
                Vec::new()
            } else {
                get_str_array(md, KEY_MERGES)?
            };
            check_merge_lengths(&tokens, &merges)?;
            let mut bpe = bpe::Bpe::new(&tokens, &merges, pre.ignore_merges, KEY_MERGES)?;
            if let Some(r) = pre.raw {
                bpe.take_raw_utf8(r.whole_newlines);
            }
            let encoder = OwnEncoder {
                merging: Arc::new(Merging::Bpe(bpe)),
                split: gpt2_split(pre, &added)?,
                form: Form::Bpe { pre },
                added,
            };
            (Encoder(EncoderKind::Own(Arc::new(encoder))), pre.add_bos)
        };

        // Raw-UTF-8 BPE writes spaces and bytes as SentencePiece does.
        let escaped = spm || raw.is_some();
        let pieces = gguf_pieces(&tokens, &kinds, escaped, md.contains_key(KEY_TOKEN_TYPE));

        let eog = gguf_end_of_generation(md, &tokens)?;

        let max_token_bytes = longest_token(&tokens, &pieces);
        // BPE never falls back to an unknown token.
        let droppable = gguf_droppable_bytes(&tokens, escaped, spm && unk.is_some());
        let special = kinds
            .iter()
            .map(|k| {
                matches!(
                    k,
                    TokenKind::Control | TokenKind::Unknown | TokenKind::Unused
                )
            })
            .collect();
        Ok(Self {
            special,
            encoder,
            full: OnceLock::new(),
            plain: OnceLock::new(),
            texts: tokens,
            pieces,
            bos,
            add_bos: get_bool(md, KEY_ADD_BOS)?.unwrap_or(add_bos_default)
                || raw.is_some_and(|r| r.always_bos),
            eos: order_eos(eos_id, eog),
            strip_first_space: spm && add_space_prefix,
            max_token_bytes,
            droppable,
        })
    }

    /// Build from a Hugging Face tokenizer.json.
    ///
    /// Special ids come from a `tokenizer_config.json` next to the file when there is one
    /// (`bos_token`, `eos_token`, `add_bos_token`), otherwise from well-known token names among
    /// the file's added tokens. End-of-turn tokens are recognised by name as for GGUF.
    pub fn from_file(path: &Path) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("reading tokenizer {}: {e}", path.display()))?;
        // gen feeds whole prompts; a truncation or padding setting in the file must not apply.
        inner
            .with_truncation(None)
            .map_err(|e| anyhow!("disabling truncation: {e}"))?;
        inner.with_padding(None);

        let config_path = path.with_file_name("tokenizer_config.json");
        let config: Option<serde_json::Value> = match std::fs::read_to_string(&config_path) {
            Ok(s) => Some(
                serde_json::from_str(&s)
                    .with_context(|| format!("parsing {}", config_path.display()))?,
            ),
            Err(_) => None,
        };
        let config_token = |field: &str| -> Option<u32> {
            let v = config.as_ref()?.get(field)?;
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            inner.token_to_id(text)
        };
        let first_known =
            |names: &[&str]| -> Option<u32> { names.iter().find_map(|t| inner.token_to_id(t)) };

        let bos = config_token("bos_token")
            .or_else(|| first_known(&["<|begin_of_text|>", "<bos>", "<s>", "<|startoftext|>"]));
        let eos_id = config_token("eos_token")
            .or_else(|| first_known(&["<|end_of_text|>", "<eos>", "</s>", "<|endoftext|>"]));
        let add_bos = match config
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
        {
            Some(b) => b,
            // Otherwise ask the file's post-processor what it does to an empty prompt.
            None => match (bos, inner.encode_fast("", true)) {
                (Some(b), Ok(enc)) => enc.get_ids().first() == Some(&b),
                _ => false,
            },
        };

        let vocab = inner.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut texts = vec![String::new(); n];
        for (text, id) in vocab {
            texts[id as usize] = text;
        }
        let eog = EOG_TEXTS
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        let (pieces, strip_first_space) = hf_pieces(&inner, &texts)?;
        let max_token_bytes = longest_token(&texts, &pieces);
        let mut special = vec![false; n];
        for (id, t) in inner.get_added_tokens_decoder() {
            if let Some(s) = special.get_mut(id as usize) {
                *s = t.special;
            }
        }

        Ok(Self {
            special,
            encoder: Encoder(EncoderKind::Crate(Arc::new(inner))),
            full: OnceLock::new(),
            plain: OnceLock::new(),
            texts,
            pieces,
            bos,
            add_bos,
            eos: order_eos(eos_id, eog),
            max_token_bytes,
            // A tokenizer.json may carry normalizers or pre-tokenizers that delete any text
            // (control characters, whitespace): no byte is sure to reach a token.
            droppable: [true; 256],
            strip_first_space,
        })
    }

    /// Encode text. Special-token text such as "<|im_start|>" in `text` is parsed as the
    /// special token. `add_bos`: prepend BOS when the model wants one
    /// (`tokenizer.ggml.add_bos_token`); pass true for a raw prompt.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let ids = self.encoder.encode(text)?;
        Ok(match (add_bos && self.add_bos, self.bos) {
            (true, Some(bos)) => std::iter::once(bos).chain(ids).collect(),
            _ => ids,
        })
    }

    /// Encode text with special-token text taken as plain text (llama.cpp's `parse_special =
    /// false`): `<|im_start|>` in `text` becomes the ids of its characters. User-defined
    /// tokens are still matched. No BOS.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.plain
            .get_or_init(|| self.encoder.special_as_text())
            .encode(text)
    }

    /// The encoder alone (no BOS), to keep beside other state: cheap to clone.
    pub fn encoder(&self) -> Encoder {
        self.encoder.clone()
    }

    /// Decode ids to text. Skips nothing: special tokens come out as their text. Bytes that do
    /// not form valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let mut piece = self.piece(id)?;
            if i == 0 && self.strip_first_space {
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
            }
            bytes.extend_from_slice(piece);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The longest token in bytes (as stored or as decoded, whichever is longer; at least 4, as
    /// an unknown token stands for one character), computed once at construction: no token
    /// covers more of the input text than this.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// A lower bound on the number of tokens `text` encodes to, known without tokenizing it:
    /// every byte the encoder keeps lands in a token of at most [`Self::max_token_bytes`].
    /// Bytes a vocabulary has no token for are dropped by the encoder and not counted (SmolLM2
    /// lacks some control bytes); a tokenizer.json gives 0, as its normalizers may drop anything.
    pub fn min_tokens(&self, text: &str) -> usize {
        let kept = if !self.droppable.contains(&true) {
            text.len()
        } else if !self.droppable.contains(&false) {
            0
        } else {
            text.bytes()
                .filter(|&b| !self.droppable[usize::from(b)])
                .count()
        };
        kept.div_ceil(self.max_token_bytes)
    }

    /// Number of ids in the vocabulary, special tokens included (for GGUF, the length of
    /// `tokenizer.ggml.tokens`).
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Whether the model wants BOS in front of a raw prompt, which is what
    /// [`Tokenizer::encode`] with `add_bos` adds: a GGUF file's `add_bos_token`, or without it
    /// what llama.cpp assumes for the vocabulary (SentencePiece ones and some pre-tokenizers
    /// want BOS).
    pub fn wants_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Ids that end generation: `tokenizer.ggml.eos_token_id` first, then end-of-turn and
    /// similar tokens (`<|im_end|>`, `<end_of_turn>`, ...) the way llama.cpp finds them.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Also end generation at these ids (a checkpoint's `config.json` `eos_token_id`), after the
    /// ones already known; the first becomes the end-of-sequence id if there was none.
    pub fn with_eos_ids(mut self, ids: &[u32]) -> Result<Self> {
        for &id in ids {
            if id as usize >= self.texts.len() {
                bail!(
                    "end-of-sequence id {id} is outside the vocabulary of {} tokens",
                    self.texts.len()
                );
            }
            if !self.eos.contains(&id) {
                self.eos.push(id);
            }
        }
        Ok(self)
    }

    /// The vocabulary entry for `id` as stored (`Ġworld`, `▁world`, `<0x0A>`), not decoded.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.texts.get(id as usize).cloned()
    }

    /// The bytes `id` stands for in generated text (a special token: its name).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id)
    }

    /// Whether `id` is a special token (BOS, EOS, end of turn, unknown, unused): one that
    /// stands for no text, so no grammar may produce it as text.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Whether encoding puts a space in front of the text (SentencePiece `add_space_prefix`):
    /// then encoding a piece of text on its own does not spell it as it reads mid-reply.
    pub fn adds_space_prefix(&self) -> bool {
        self.strip_first_space
    }

    /// The id of a vocabulary entry, written as stored (see `token_text`).
    pub fn id_of(&self, token: &str) -> Option<u32> {
        match &self.encoder.0 {
            EncoderKind::Crate(t) => t.token_to_id(token),
            EncoderKind::Own(e) => e.merging.lookup().get(token),
        }
    }

    /// The vocabulary as a `tokenizers` tokenizer (to save as a tokenizer.json, or decode
    /// through its decoder). For GGUF vocabularies it has no post-processor: BOS is added by
    /// [`Tokenizer::encode`], so `inner().encode(text, true)` adds nothing. A GGUF
    /// vocabulary's is built on the first call (half a second for Gemma's, 0.15 s for Llama
    /// 3's): gen's own encoder does not need it.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        match &self.encoder.0 {
            EncoderKind::Crate(t) => t,
            EncoderKind::Own(e) => self.full.get_or_init(|| e.full(&self.texts)),
        }
    }

    /// A streaming decoder: push ids one at a time, get the new text as soon as it is valid
    /// UTF-8.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            pending: Vec::new(),
        }
    }

    fn piece(&self, id: u32) -> Result<&[u8]> {
        self.pieces.get(id).ok_or_else(|| {
            anyhow!(
                "token id {id} is out of range for a vocabulary of {} tokens",
                self.texts.len()
            )
        })
    }
}

/// Turns generated ids into text as they arrive. See [`Tokenizer::stream`].
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    /// The start of a character whose remaining bytes are in tokens not yet pushed.
    pending: Vec<u8>,
}

impl TextStream<'_> {
    /// Returns the text this token adds (possibly empty while a multi-byte character is
    /// incomplete). Complete characters are never held back. The SentencePiece leading space is
    /// kept: a stream continues text that is already on screen.
    pub fn push(&mut self, id: u32) -> Result<String> {
        let piece = self.tokenizer.piece(id)?;
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // Bytes that can never become a character: show them as U+FFFD now
                        // rather than stalling the stream.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + bad;
                        }
                        // The tail may still be completed by the next token.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        Ok(out)
    }

    /// Whatever bytes are still pending at the end (lossy), usually empty.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

/// EOS first (callers that need a single stop id take that), then the rest in id order.
fn order_eos(eos: Option<u32>, mut others: HashSet<u32>) -> Vec<u32> {
    let mut ids: Vec<u32> = eos.into_iter().collect();
    if let Some(e) = eos {
        others.remove(&e);
    }
    let mut rest: Vec<u32> = others.into_iter().collect();
    rest.sort_unstable();
    ids.extend(rest);
    ids
}

fn build_gpt2(
    tokens: &[String],
    merges: Vec<(String, String)>,
    pre: &BpePre,
) -> Result<tokenizers::Tokenizer> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .byte_fallback(pre.raw.is_some())
        .build()
        .map_err(|e| anyhow!("`{KEY_MERGES}` does not fit `{KEY_TOKENS}`: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(gpt2_pre_tokenizer(pre)?));
    if pre.raw.is_some() {
        inner
            .with_normalizer(Some(spm_normalizer(false)?))
            .map_err(|e| anyhow!("{e}"))?;
        inner.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
            DecoderWrapper::Replace(Replace::new(SPACE_MARKER, " ").map_err(|e| anyhow!("{e}"))?),
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ]))));
    } else {
        inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(
            false, false, false,
        ))));
    }
    Ok(inner)
}

/// A merge whose two sides are longer together than any entry cannot make one. tokenizers
/// 0.23 (the form [`Tokenizer::inner`] builds) joins them into a buffer as long as the longest
/// entry and panics there, so such a file is refused by name first.
fn check_merge_lengths(tokens: &[String], merges: &[&str]) -> Result<()> {
    let longest = tokens.iter().map(String::len).max().unwrap_or(0);
    // The two sides without their separating space.
    if let Some(m) = merges.iter().find(|m| m.len().saturating_sub(1) > longest) {
        let short = |t: &str| t.chars().take(40).collect::<String>();
        bail!(
            "`{KEY_MERGES}` does not fit `{KEY_TOKENS}`: merging {:?} makes a token longer than \
             any in the vocabulary",
            short(m)
        );
    }
    Ok(())
}

/// llama.cpp's regex splits for the vocabulary's pre-tokenizer name, then the byte-to-character
/// mapping (the regexes already split the text; it only maps bytes to the vocabulary's
/// characters), which raw-UTF-8 vocabularies do without.
fn gpt2_pre_tokenizer(pre: &BpePre) -> Result<PreTokenizerWrapper> {
    let mut steps = split_steps(pre.regexes)?;
    if pre.raw.is_none() {
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, false, false,
        )));
    }
    Ok(PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(
        steps,
    )))
}

/// The part of a byte-level BPE tokenizer that `tokenizers` keeps doing for gen's own encoder:
/// cutting the special tokens out of the raw text and the rest into pieces (`gpt2_split` is
/// to `bpe` what `spm_split` is to `spm`).
fn gpt2_split(pre: &BpePre, added: &[AddedToken]) -> Result<tokenizers::Tokenizer> {
    let mut split = tokenizers::Tokenizer::new(BPE::default());
    split.with_pre_tokenizer(Some(gpt2_pre_tokenizer(pre)?));
    // Raw-UTF-8 vocabularies write spaces as `▁` in every piece of text between special
    // tokens, before the split, as llama.cpp escapes each fragment.
    if pre.raw.is_some() {
        split
            .with_normalizer(Some(spm_normalizer(false)?))
            .map_err(|e| anyhow!("{e}"))?;
    }
    add_special(&mut split, added.to_vec())?;
    Ok(split)
}

/// One isolating `Split` per regex, in order.
fn split_steps(regexes: &[&str]) -> Result<Vec<PreTokenizerWrapper>> {
    let mut steps = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow!("compiling pre-tokenizer regex {re:?}: {e}"))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    Ok(steps)
}

fn build_spm(
    tokens: &[String],
    scores: &[f32],
    unk: Option<String>,
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    // Merges in a GGUF "llama" vocab (if any) are ignored: llama.cpp merges by score.
    let merges = spm_merges(tokens, scores, &vocab);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(|e| anyhow!("building the SentencePiece model from `{KEY_TOKENS}`: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner
        .with_normalizer(Some(spm_normalizer(add_space_prefix)?))
        .map_err(|e| anyhow!("{e}"))?;

    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new(SPACE_MARKER, " ").map_err(|e| anyhow!("{e}"))?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space_prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    inner.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(
        decoders,
    ))));
    Ok(inner)
}

/// How SentencePiece text is normalized before merging: spaces become `▁`, and with
/// `add_space_prefix` every piece between special tokens starts with one (Prepend runs per
/// piece and skips empty pieces, as llama.cpp prefixes every raw-text fragment).
fn spm_normalizer(add_space_prefix: bool) -> Result<NormalizerWrapper> {
    let escape = Replace::new(" ", SPACE_MARKER).map_err(|e| anyhow!("{e}"))?;
    Ok(if add_space_prefix {
        NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new(SPACE_MARKER.to_owned())),
            NormalizerWrapper::Replace(escape),
        ]))
    } else {
        NormalizerWrapper::Replace(escape)
    })
}

/// The part of a SentencePiece tokenizer that `tokenizers` keeps doing for gen's own encoder:
/// cutting the special tokens out of the raw text and normalizing the rest. Its model has no
/// vocabulary, so it numbers the special tokens its own way ([`OwnEncoder::encode`] looks
/// their text up instead).
fn spm_split(add_space_prefix: bool, added: &[AddedToken]) -> Result<tokenizers::Tokenizer> {
    let mut split = tokenizers::Tokenizer::new(BPE::default());
    split
        .with_normalizer(Some(spm_normalizer(add_space_prefix)?))
        .map_err(|e| anyhow!("{e}"))?;
    add_special(&mut split, added.to_vec())?;
    Ok(split)
}

/// Register the tokens cut out of the raw text before tokenizing (see `matched_in_text`).
fn add_special(inner: &mut tokenizers::Tokenizer, added: Vec<AddedToken>) -> Result<()> {
    if !added.is_empty() {
        inner
            .add_tokens(added)
            .map_err(|e| anyhow!("registering special tokens: {e}"))?;
    }
    Ok(())
}

/// Text to ids, without BOS: for GGUF vocabularies gen's own merging (`spm`, `bpe`)
/// behind the `tokenizers` crate's special-token split and pre-tokenizer; for a tokenizer.json,
/// that crate's tokenizer. Cheap to clone.
#[derive(Clone)]
pub struct Encoder(EncoderKind);

#[derive(Clone)]
enum EncoderKind {
    Crate(Arc<tokenizers::Tokenizer>),
    Own(Arc<OwnEncoder>),
}

/// A GGUF vocabulary's merging, SentencePiece or byte-level BPE.
enum Merging {
    Spm(spm::Spm),
    Bpe(bpe::Bpe),
}

impl Merging {
    fn lookup(&self) -> &lookup::Lookup {
        match self {
            Merging::Spm(m) => &m.lookup,
            Merging::Bpe(m) => &m.lookup,
        }
    }
}

/// What the `tokenizers` form of a GGUF vocabulary ([`Tokenizer::inner`]) is built from,
/// besides its texts and special tokens.
#[derive(Clone, Copy)]
enum Form {
    Spm { add_space_prefix: bool },
    Bpe { pre: &'static BpePre },
}

struct OwnEncoder {
    merging: Arc<Merging>,
    split: tokenizers::Tokenizer,
    form: Form,
    added: Vec<AddedToken>,
}

impl Encoder {
    /// The ids of `text` (special-token text parsed as the special token), without BOS.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.0 {
            EncoderKind::Crate(t) => Ok(t
                .encode_fast(text, false)
                .map_err(|e| anyhow!("tokenizing failed: {e}"))?
                .get_ids()
                .to_vec()),
            EncoderKind::Own(e) => e.encode(text),
        }
    }

    /// The same encoder with special tokens (not user-defined ones) left in the text.
    fn special_as_text(&self) -> Encoder {
        Encoder(match &self.0 {
            EncoderKind::Crate(t) => {
                let mut t = (**t).clone();
                t.set_encode_special_tokens(true);
                EncoderKind::Crate(Arc::new(t))
            }
            EncoderKind::Own(e) => {
                let mut split = e.split.clone();
                split.set_encode_special_tokens(true);
                EncoderKind::Own(Arc::new(OwnEncoder {
                    merging: e.merging.clone(),
                    split,
                    form: e.form,
                    added: e.added.clone(),
                }))
            }
        })
    }
}

impl OwnEncoder {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizer};
        let mut pieces = self
            .split
            .get_added_vocabulary()
            .extract_and_normalize(self.split.get_normalizer(), text);
        if let Some(pre) = self.split.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pieces)
                .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        }
        let lookup = self.merging.lookup();
        let mut ids = Vec::with_capacity(text.len() / 2 + 1);
        for (piece, _, special) in pieces.get_splits(OffsetReferential::Original, OffsetType::Byte)
        {
            match special {
                Some(tokens) => {
                    for t in tokens {
                        let id = lookup.get(&t.value).ok_or_else(|| {
                            anyhow!("tokenizing failed: special token {:?} not found", t.value)
                        })?;
                        ids.push(id);
                    }
                }
                None => match &*self.merging {
                    Merging::Spm(m) => m.encode(piece, &mut ids),
                    Merging::Bpe(m) => m.encode(piece, &mut ids),
                },
            }
        }
        Ok(ids)
    }

    /// This vocabulary as a `tokenizers` BPE model, with its special tokens: for SentencePiece
    /// the merges derived from the vocabulary (see `spm_merges`), for byte-level BPE the file's
    /// (as gen read them: a repeated merge once, at its first rank).
    fn full(&self, texts: &[String]) -> tokenizers::Tokenizer {
        // Every merge names entries the vocabulary has (derived from it, or checked when the
        // file was read), so the build cannot fail, nor can registering the special tokens
        // the split already took.
        let mut inner = match (&*self.merging, self.form) {
            (Merging::Spm(m), Form::Spm { add_space_prefix }) => {
                let unk = m.unk().map(|id| texts[id as usize].clone());
                build_spm(texts, m.scores(), unk, add_space_prefix)
            }
            (Merging::Bpe(m), Form::Bpe { pre }) => {
                let text = |id: u32| texts[id as usize].clone();
                let merges = m
                    .merges()
                    .into_iter()
                    .map(|(l, r)| (text(l), text(r)))
                    .collect();
                build_gpt2(texts, merges, pre)
            }
            _ => unreachable!("a form is made with its merging"),
        }
        .expect("a BPE model of merges checked against its vocabulary");
        add_special(&mut inner, self.added.clone()).expect("special tokens as registered before");
        inner
    }
}

/// BPE merges that make a BPE model behave like llama.cpp's SentencePiece merging: every way
/// of writing a vocabulary entry as two vocabulary entries is a merge, ranked by the entry's
/// score (highest first). Equal scores are ordered by id; llama.cpp breaks such ties by
/// position instead, which only matters when two different splits of equally scored tokens
/// compete at once (never in vocabularies whose scores are distinct, like Gemma's and Llama's).
fn spm_merges(tokens: &[String], scores: &[f32], vocab: &Vocab) -> Vec<(String, String)> {
    // Gemma's 262k entries have ~2M split points to look up: spread them over the cores so
    // loading stays well under a second.
    let splits_of = |first: usize, part: &[String]| {
        let mut found: Vec<(usize, usize)> = Vec::new();
        for (id, text) in (first..).zip(part) {
            // With duplicate texts only the id a lookup returns can ever be produced.
            if vocab.get(text.as_str()).map(|&v| v as usize) != Some(id) {
                continue;
            }
            for (split, _) in text.char_indices().skip(1) {
                let (left, right) = text.split_at(split);
                if vocab.contains_key(right) && vocab.contains_key(left) {
                    found.push((id, split));
                }
            }
        }
        found
    };
    let mut found: Vec<(usize, usize)> = by_parts(tokens, splits_of).concat();
    found.sort_unstable_by(|a, b| {
        scores[b.0]
            .total_cmp(&scores[a.0])
            .then(a.0.cmp(&b.0))
            .then(a.1.cmp(&b.1))
    });
    found
        .into_iter()
        .map(|(id, split)| {
            let (left, right) = tokens[id].split_at(split);
            (left.to_owned(), right.to_owned())
        })
        .collect()
}

/// See [`Tokenizer::max_token_bytes`].
fn longest_token(texts: &[String], pieces: &Pieces) -> usize {
    texts
        .iter()
        .enumerate()
        .map(|(id, text)| {
            let piece = pieces.get(id as u32).map_or(0, <[u8]>::len);
            text.len().max(piece)
        })
        .fold(4, usize::max)
}

/// The input bytes a GGUF tokenizer may drop: the encoder skips what it has no token for.
/// Byte-level vocabularies drop the bytes whose character is missing; escaped ones (SentencePiece,
/// raw-UTF-8 BPE) with an unknown token or all 256 `<0xNN>` byte-fallback tokens keep
/// everything; any other escaped vocabulary may drop any byte.
fn gguf_droppable_bytes(tokens: &[String], escaped: bool, has_unk: bool) -> [bool; 256] {
    // Only entries of a byte token's or a character's length are asked about (`<0xNN>` is
    // six bytes): a set of those, not of the whole vocabulary (25 ms for Gemma's 262k).
    let known: HashSet<&str> = tokens
        .iter()
        .map(String::as_str)
        .filter(|t| t.len() <= 6)
        .collect();
    let mut droppable = [false; 256];
    if escaped {
        let all_bytes = (0..=255u8).all(|b| known.contains(format!("<0x{b:02X}>").as_str()));
        if !has_unk && !all_bytes {
            droppable = [true; 256];
        }
    } else {
        for (b, c) in byte_level_chars().iter().enumerate() {
            droppable[b] = !known.contains(c.encode_utf8(&mut [0; 4]) as &str);
        }
    }
    droppable
}

/// Per-id bytes for a GGUF vocabulary, following llama.cpp's token_to_piece (with special
/// tokens rendered). `escaped`: spaces are written `▁` and bytes `<0xNN>` (SentencePiece,
/// raw-UTF-8 BPE), not as GPT-2's byte-level characters.
fn gguf_pieces(tokens: &[String], kinds: &[TokenKind], escaped: bool, typed: bool) -> Pieces {
    let inverse = byte_level_inverse();
    let mut pieces = Pieces::with_capacity(tokens.len());
    let mut buf = Vec::new();
    for (text, &kind) in tokens.iter().zip(kinds) {
        buf.clear();
        // Without a type array llama.cpp has no byte tokens; we still read `<0xNN>` as a byte
        // in escaped vocabs because byte fallback produces them.
        let byte = (kind == TokenKind::Byte || (escaped && !typed))
            .then(|| parse_byte_token(text))
            .flatten();
        match (byte, kind) {
            (Some(b), _) => buf.push(b),
            (None, TokenKind::Normal) if escaped => {
                buf.extend_from_slice(text.replace(SPACE_MARKER, " ").as_bytes())
            }
            (None, TokenKind::Normal) => byte_level_decode(text, &inverse, &mut buf),
            _ => buf.extend_from_slice(text.as_bytes()),
        }
        pieces.push(&buf);
    }
    pieces
}

/// Per-id bytes for a tokenizer.json, read off its decoder: byte-level vocabularies map chars
/// back to bytes, SentencePiece-style ones turn `▁` into a space and `<0xNN>` into a byte.
/// Anything else decodes each token on its own through the file's decoder.
fn hf_pieces(inner: &tokenizers::Tokenizer, texts: &[String]) -> Result<(Pieces, bool)> {
    let decoder = match inner.get_decoder() {
        Some(d) => serde_json::to_value(d).context("inspecting the tokenizer's decoder")?,
        None => serde_json::Value::Null,
    };
    let mut steps = Vec::new();
    collect_decoder_steps(&decoder, &mut steps);
    let has = |ty: &str| {
        steps
            .iter()
            .any(|s| s.get("type").and_then(|t| t.as_str()) == Some(ty))
    };
    let marker: Option<String> = steps.iter().find_map(|s| match s.get("type")?.as_str()? {
        "Metaspace" => Some(s.get("replacement")?.as_str()?.to_owned()),
        "Replace" if s.get("content")?.as_str()? == " " => {
            Some(s.get("pattern")?.get("String")?.as_str()?.to_owned())
        }
        _ => None,
    });
    let strip_first_space = steps
        .iter()
        .any(|s| match s.get("type").and_then(|t| t.as_str()) {
            Some("Strip") => s.get("start").and_then(|v| v.as_u64()).unwrap_or(0) > 0,
            Some("Metaspace") => {
                s.get("prepend_scheme").and_then(|v| v.as_str()) != Some("never")
                    || s.get("add_prefix_space").and_then(|v| v.as_bool()) == Some(true)
            }
            _ => false,
        });
    let byte_level = has("ByteLevel");
    let byte_fallback = has("ByteFallback");
    let added = inner.get_added_tokens_decoder();
    let inverse = byte_level_inverse();

    let mut pieces = Pieces::with_capacity(texts.len());
    let mut buf = Vec::new();
    for (id, text) in texts.iter().enumerate() {
        buf.clear();
        let id = id as u32;
        if text.is_empty() || added.contains_key(&id) {
            buf.extend_from_slice(text.as_bytes());
        } else if byte_level {
            byte_level_decode(text, &inverse, &mut buf);
        } else if let Some(marker) = &marker {
            match parse_byte_token(text).filter(|_| byte_fallback) {
                Some(b) => buf.push(b),
                None => buf.extend_from_slice(text.replace(marker.as_str(), " ").as_bytes()),
            }
        } else {
            let s = inner
                .decode(&[id], false)
                .map_err(|e| anyhow!("decoding token {id}: {e}"))?;
            buf.extend_from_slice(s.as_bytes());
        }
        pieces.push(&buf);
    }
    Ok((pieces, marker.is_some() && strip_first_space))
}

fn collect_decoder_steps<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
    if let Some(inner) = v.get("decoders").and_then(|d| d.as_array()) {
        for d in inner {
            collect_decoder_steps(d, out);
        }
    } else if v.is_object() {
        out.push(v);
    }
}

// --- GGUF metadata access: every failure names the key. ---

fn get<'a>(md: &'a HashMap<String, gguf_file::Value>, key: &str) -> Result<&'a gguf_file::Value> {
    md.get(key)
        .ok_or_else(|| anyhow!("GGUF metadata has no `{key}`"))
}

fn value_str<'a>(v: &'a gguf_file::Value, key: &str) -> Result<&'a str> {
    match v {
        gguf_file::Value::String(s) => Ok(s),
        other => bail!("`{key}` should be a string, found {:?}", other.value_type()),
    }
}

fn get_str<'a>(md: &'a HashMap<String, gguf_file::Value>, key: &str) -> Result<&'a str> {
    value_str(get(md, key)?, key)
}

fn array<'a>(v: &'a gguf_file::Value, key: &str) -> Result<&'a [gguf_file::Value]> {
    match v {
        gguf_file::Value::Array(a) => Ok(a),
        other => bail!("`{key}` should be an array, found {:?}", other.value_type()),
    }
}

fn get_str_array<'a>(md: &'a HashMap<String, gguf_file::Value>, key: &str) -> Result<Vec<&'a str>> {
    array(get(md, key)?, key)?
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            gguf_file::Value::String(s) => Ok(s.as_str()),
            other => bail!(
                "`{key}`[{i}] should be a string, found {:?}",
                other.value_type()
            ),
        })
        .collect()
}

fn as_i64(v: &gguf_file::Value) -> Option<i64> {
    use gguf_file::Value as V;
    Some(match *v {
        V::U8(x) => x.into(),
        V::I8(x) => x.into(),
        V::U16(x) => x.into(),
        V::I16(x) => x.into(),
        V::U32(x) => x.into(),
        V::I32(x) => x.into(),
        V::U64(x) => i64::try_from(x).ok()?,
        V::I64(x) => x,
        _ => return None,
    })
}

fn int_array(v: &gguf_file::Value, key: &str) -> Result<Vec<i64>> {
    array(v, key)?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            as_i64(x).ok_or_else(|| {
                anyhow!(
                    "`{key}`[{i}] should be an integer, found {:?}",
                    x.value_type()
                )
            })
        })
        .collect()
}

fn f32_array(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Vec<f32>> {
    array(get(md, key)?, key)?
        .iter()
        .enumerate()
        .map(|(i, x)| match *x {
            gguf_file::Value::F32(f) => Ok(f),
            gguf_file::Value::F64(f) => Ok(f as f32),
            ref other => bail!(
                "`{key}`[{i}] should be a number, found {:?}",
                other.value_type()
            ),
        })
        .collect()
}

/// An optional token id; present but malformed or out of range is an error.
fn get_id(md: &HashMap<String, gguf_file::Value>, key: &str, n: usize) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id = as_i64(v)
        .ok_or_else(|| anyhow!("`{key}` should be an integer, found {:?}", v.value_type()))?;
    match u32::try_from(id) {
        Ok(id) if (id as usize) < n => Ok(Some(id)),
        _ => bail!("`{key}` = {id} is out of range for a vocabulary of {n} tokens"),
    }
}

fn get_bool(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(gguf_file::Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => bail!("`{key}` should be a bool, found {:?}", other.value_type()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value;

    fn s(x: &str) -> Value {
        Value::String(x.to_owned())
    }

    fn str_array(xs: &[String]) -> Value {
        Value::Array(xs.iter().map(|x| s(x)).collect())
    }

    const GPT2_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

    /// A byte-level vocab: three control tokens, all 256 byte characters, and a few merges.
    fn gpt2_md(pre: &str) -> HashMap<String, Value> {
        let mut tokens: Vec<String> = GPT2_SPECIALS.iter().map(|t| t.to_string()).collect();
        tokens.extend(byte_level_chars().iter().map(|c| c.to_string()));
        let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"];
        for m in merges {
            tokens.push(m.replace(' ', ""));
        }
        let mut types = vec![Value::I32(3); 3];
        types.resize(tokens.len(), Value::I32(1));
        let mut md = HashMap::new();
        md.insert(KEY_MODEL.into(), s("gpt2"));
        md.insert(KEY_PRE.into(), s(pre));
        md.insert(KEY_TOKENS.into(), str_array(&tokens));
        md.insert(
            KEY_MERGES.into(),
            Value::Array(merges.iter().map(|m| s(m)).collect()),
        );
        md.insert(KEY_TOKEN_TYPE.into(), Value::Array(types));
        md.insert(KEY_BOS.into(), Value::U32(1));
        md.insert(KEY_EOS.into(), Value::U32(0));
        md.insert(KEY_ADD_BOS.into(), Value::Bool(false));
        md
    }

    fn gpt2(pre: &str) -> Tokenizer {
        Tokenizer::from_gguf_metadata(&gpt2_md(pre)).unwrap()
    }

    fn texts(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| t.token_text(i).unwrap()).collect()
    }

    fn err(md: &HashMap<String, Value>) -> String {
        format!("{:#}", Tokenizer::from_gguf_metadata(md).unwrap_err())
    }

    #[test]
    fn byte_level_table_is_a_bijection_onto_printable_chars() {
        let chars = byte_level_chars();
        let distinct: HashSet<char> = chars.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(chars[usize::from(b' ')], 'Ġ');
        assert_eq!(chars[usize::from(b'\n')], 'Ċ');
        assert_eq!(chars[usize::from(b'A')], 'A');
        assert!(chars.iter().all(|c| !c.is_whitespace() && !c.is_control()));
    }

    #[test]
    fn no_space_is_added_after_special_tokens() {
        let t = gpt2("smollm");
        let ids = t.encode("<|im_start|>hello<|im_end|>", false).unwrap();
        assert_eq!(texts(&t, &ids), ["<|im_start|>", "hello", "<|im_end|>"]);
        let ids = t.encode("hello world", false).unwrap();
        assert_eq!(texts(&t, &ids), ["hello", "Ġwor", "l", "d"]);
    }

    #[test]
    fn smollm_splits_digits_one_by_one() {
        let t = gpt2("smollm");
        let ids = t.encode("a 123", false).unwrap();
        assert_eq!(texts(&t, &ids), ["a", "Ġ", "1", "2", "3"]);
    }

    #[test]
    fn missing_pre_uses_llama_cpp_default_and_unknown_pre_is_refused() {
        let mut md = gpt2_md("x");
        md.remove(KEY_PRE);
        let t = Tokenizer::from_gguf_metadata(&md).unwrap();
        assert_eq!(
            t.decode(&t.encode("hello, world", false).unwrap()).unwrap(),
            "hello, world"
        );
        let e = err(&gpt2_md("no-such-pre"));
        assert!(e.contains("no-such-pre") && e.contains(KEY_PRE), "{e}");
    }

    #[test]
    fn bos_only_when_asked_and_wanted() {
        let mut md = gpt2_md("smollm");
        let t = Tokenizer::from_gguf_metadata(&md).unwrap();
        assert_eq!(
            t.encode("hello", true).unwrap(),
            t.encode("hello", false).unwrap()
        );
        md.insert(KEY_ADD_BOS.into(), Value::Bool(true));
        let t = Tokenizer::from_gguf_metadata(&md).unwrap();
        assert_eq!(t.bos_id(), Some(1));
        assert_eq!(t.encode("hello", true).unwrap()[0], 1);
        assert_ne!(t.encode("hello", false).unwrap()[0], 1);
        assert_eq!(t.encode("", true).unwrap(), [1]);
        assert!(t.encode("", false).unwrap().is_empty());
    }

    #[test]
    fn eos_ids_start_with_eos_and_include_end_of_turn() {
        let t = gpt2("smollm");
        assert_eq!(t.eos_ids(), [0, 2]);
        assert_eq!(t.id_of("<|im_end|>"), Some(2));
    }

    #[test]
    fn decode_and_stream_reassemble_multibyte_characters() {
        let t = gpt2("smollm");
        let text = "<|im_start|>héllo 世界 🦀\n\t x<|im_end|>";
        let ids = t.encode(text, false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
        assert_eq!(t.inner().decode(&ids, false).unwrap(), text);

        let mut stream = t.stream();
        let mut out = String::new();
        for &id in &ids {
            let chunk = stream.push(id).unwrap();
            assert!(!chunk.contains('\u{FFFD}'));
            out.push_str(&chunk);
        }
        out.push_str(&stream.finish());
        assert_eq!(out, text);

        // "世" is three byte tokens: nothing, nothing, then the character.
        let ids = t.encode("世", false).unwrap();
        assert_eq!(ids.len(), 3);
        let mut stream = t.stream();
        let chunks: Vec<String> = ids.iter().map(|&i| stream.push(i).unwrap()).collect();
        assert_eq!(chunks, ["", "", "世"]);
    }

    #[test]
    fn stream_does_not_stall_on_invalid_bytes() {
        let t = gpt2("smollm");
        let byte = |b: u8| {
            t.id_of(&byte_level_chars()[usize::from(b)].to_string())
                .unwrap()
        };
        let mut stream = t.stream();
        // A lead byte followed by a space: the lead byte can never complete.
        assert_eq!(stream.push(byte(0xE4)).unwrap(), "");
        assert_eq!(stream.push(byte(b' ')).unwrap(), "\u{FFFD} ");
        // A stray continuation byte comes out at once.
        assert_eq!(stream.push(byte(0x80)).unwrap(), "\u{FFFD}");
        // An unfinished character at the end is flushed by finish.
        assert_eq!(stream.push(byte(0xE4)).unwrap(), "");
        assert_eq!(stream.finish(), "\u{FFFD}");
        assert_eq!(stream.finish(), "");
    }

    #[test]
    fn out_of_range_ids_are_errors_not_panics() {
        let t = gpt2("smollm");
        let n = t.vocab_size() as u32;
        assert!(t.decode(&[n]).is_err());
        assert!(t.stream().push(u32::MAX).is_err());
        assert_eq!(t.token_text(n), None);
    }

    #[test]
    fn malformed_metadata_names_the_key() {
        let mut md = gpt2_md("smollm");
        md.insert(KEY_MODEL.into(), s("bert"));
        let e = err(&md);
        assert!(e.contains("`bert`") && e.contains(KEY_MODEL), "{e}");

        for key in [KEY_MODEL, KEY_TOKENS, KEY_MERGES] {
            let mut md = gpt2_md("smollm");
            md.remove(key);
            let e = err(&md);
            assert!(e.contains(key), "{e}");
        }

        let mut md = gpt2_md("smollm");
        md.insert(KEY_TOKEN_TYPE.into(), Value::Array(vec![Value::I32(1); 5]));
        let e = err(&md);
        assert!(e.contains(KEY_TOKEN_TYPE) && e.contains("5 entries"), "{e}");

        let mut md = gpt2_md("smollm");
        md.insert(KEY_BOS.into(), Value::U32(1_000_000));
        let e = err(&md);
        assert!(e.contains(KEY_BOS) && e.contains("out of range"), "{e}");

        let mut md = gpt2_md("smollm");
        md.insert(KEY_EOS.into(), Value::I32(-1));
        assert!(err(&md).contains(KEY_EOS));

        let mut md = gpt2_md("smollm");
        md.insert(KEY_TOKENS.into(), Value::Array(vec![s("a"), Value::U8(1)]));
        let e = err(&md);
        assert!(e.contains("tokenizer.ggml.tokens`[1]"), "{e}");

        let mut md = gpt2_md("smollm");
        md.insert(KEY_MERGES.into(), Value::Array(vec![s("he")]));
        let e = err(&md);
        assert!(e.contains(KEY_MERGES), "{e}");

        let mut md = gpt2_md("smollm");
        md.insert(KEY_MERGES.into(), Value::Array(vec![s("x y")]));
        let e = err(&md);
        assert!(e.contains(KEY_MERGES), "{e}");

        let mut md = gpt2_md("smollm");
        md.insert(KEY_ADD_BOS.into(), Value::U8(1));
        assert!(err(&md).contains(KEY_ADD_BOS));

        let mut md = gpt2_md("smollm");
        md.insert(KEY_TOKENS.into(), s("abc"));
        assert!(err(&md).contains(KEY_TOKENS));
    }

    /// A SentencePiece vocab whose scores make "bc" win over "ab".
    fn spm_md(add_space_prefix: bool) -> HashMap<String, Value> {
        let entries = [
            ("▁", -1.0),
            ("a", -2.0),
            ("b", -3.0),
            ("c", -4.0),
            ("ab", -5.0),
            ("bc", -1.5),
            ("▁a", -0.5),
            ("▁b", -6.0),
        ]
        .map(|(t, score)| (t.to_string(), score));
        spm_md_with(add_space_prefix, &entries)
    }

    /// A SentencePiece vocab: unknown, BOS, EOS, two turn markers, a user-defined "  ", the 256
    /// byte tokens, then `entries` (text, score) as normal tokens.
    fn spm_md_with(add_space_prefix: bool, entries: &[(String, f32)]) -> HashMap<String, Value> {
        let mut tokens: Vec<(String, f32, i32)> = vec![
            ("<unk>".into(), 0.0, 2),
            ("<s>".into(), 0.0, 3),
            ("</s>".into(), 0.0, 3),
            ("<start_of_turn>".into(), 0.0, 3),
            ("<end_of_turn>".into(), 0.0, 3),
            ("  ".into(), 0.0, 4),
        ];
        for b in 0..=255u8 {
            tokens.push((format!("<0x{b:02X}>"), 0.0, 6));
        }
        for (t, score) in entries {
            tokens.push((t.clone(), *score, 1));
        }
        let mut md = HashMap::new();
        md.insert(KEY_MODEL.into(), s("llama"));
        md.insert(
            KEY_TOKENS.into(),
            Value::Array(tokens.iter().map(|t| s(&t.0)).collect()),
        );
        md.insert(
            KEY_SCORES.into(),
            Value::Array(tokens.iter().map(|t| Value::F32(t.1)).collect()),
        );
        md.insert(
            KEY_TOKEN_TYPE.into(),
            Value::Array(tokens.iter().map(|t| Value::I32(t.2)).collect()),
        );
        md.insert(KEY_BOS.into(), Value::U32(1));
        md.insert(KEY_EOS.into(), Value::U32(2));
        md.insert(KEY_UNK.into(), Value::U32(0));
        md.insert(KEY_ADD_SPACE_PREFIX.into(), Value::Bool(add_space_prefix));
        md
    }

    #[test]
    fn spm_merges_by_score_not_by_position() {
        let t = Tokenizer::from_gguf_metadata(&spm_md(false)).unwrap();
        let ids = t.encode("abc", false).unwrap();
        assert_eq!(texts(&t, &ids), ["a", "bc"]);
        let ids = t.encode("ab", false).unwrap();
        assert_eq!(texts(&t, &ids), ["ab"]);
    }

    #[test]
    fn spm_byte_fallback_spaces_and_user_defined_tokens() {
        let t = Tokenizer::from_gguf_metadata(&spm_md(false)).unwrap();
        let ids = t.encode("é b", false).unwrap();
        assert_eq!(texts(&t, &ids), ["<0xC3>", "<0xA9>", "▁b"]);
        // The user-defined "  " matches two real spaces, before `▁` escaping.
        let ids = t.encode("a  b", false).unwrap();
        assert_eq!(texts(&t, &ids), ["a", "  ", "b"]);
        let ids = t.encode("<start_of_turn>a b<end_of_turn>", false).unwrap();
        assert_eq!(
            texts(&t, &ids),
            ["<start_of_turn>", "a", "▁b", "<end_of_turn>"]
        );
        for text in ["é b", "a  b", "<start_of_turn>a b<end_of_turn>", " a"] {
            let ids = t.encode(text, false).unwrap();
            assert_eq!(t.decode(&ids).unwrap(), text);
            assert_eq!(t.inner().decode(&ids, false).unwrap(), text);
        }
        let ids = t.encode("é b", false).unwrap();
        let mut stream = t.stream();
        let chunks: Vec<String> = ids.iter().map(|&i| stream.push(i).unwrap()).collect();
        assert_eq!(chunks, ["", "é", " b"]);
        assert_eq!(t.eos_ids(), [2, 4]);
        // No add_bos_token key: SentencePiece models want BOS, as in llama.cpp.
        assert_eq!(t.encode("a", true).unwrap()[0], 1);
    }

    #[test]
    fn spm_space_prefix_is_added_per_fragment_and_stripped_by_decode() {
        let t = Tokenizer::from_gguf_metadata(&spm_md(true)).unwrap();
        let ids = t.encode("a", false).unwrap();
        assert_eq!(texts(&t, &ids), ["▁a"]);
        assert_eq!(t.decode(&ids).unwrap(), "a");
        // The stream continues text on screen, so it keeps the space.
        assert_eq!(t.stream().push(ids[0]).unwrap(), " a");
        let ids = t.encode("<start_of_turn>a", false).unwrap();
        assert_eq!(texts(&t, &ids), ["<start_of_turn>", "▁a"]);
        assert_eq!(t.decode(&ids).unwrap(), "<start_of_turn> a");
        assert_eq!(t.encode("", false).unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn spm_requires_scores_of_the_right_length() {
        let mut md = spm_md(false);
        md.remove(KEY_SCORES);
        assert!(err(&md).contains(KEY_SCORES));
        let mut md = spm_md(false);
        md.insert(KEY_SCORES.into(), Value::Array(vec![Value::F32(0.0)]));
        assert!(err(&md).contains(KEY_SCORES));
    }

    /// A seeded stream of numbers below each given bound (xorshift64).
    fn below(mut state: u64) -> impl FnMut(usize) -> usize {
        move |n| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        }
    }

    /// gen's SentencePiece encoder and the `tokenizers` model `inner()` builds for the same
    /// vocabulary (what a saved tokenizer.json holds) give the same ids.
    #[test]
    fn spm_encoder_agrees_with_its_tokenizers_form() {
        for prefix in [false, true] {
            let t = Tokenizer::from_gguf_metadata(&spm_md(prefix)).unwrap();
            for text in [
                "abc",
                "ab bc  abc",
                "é b<end_of_turn>ca",
                "<start_of_turn>bbb\ncab  ",
                "",
                " ",
            ] {
                let ours = t.encode(text, false).unwrap();
                let crate_ids = t.inner().encode_fast(text, false).unwrap();
                assert_eq!(ours, crate_ids.get_ids(), "{text:?} (prefix {prefix})");
            }
        }
    }

    /// Random SentencePiece vocabularies (every character of an entry an entry of its own, as
    /// in real ones; distinct scores) and random texts with spaces, special tokens and
    /// characters the vocabulary lacks: gen's encoder and the `tokenizers` form agree.
    #[test]
    fn spm_encoder_agrees_with_its_tokenizers_form_on_random_vocabularies() {
        let mut next = below(0x2545_F491_4F6C_DD1D);
        let alphabet = ["a", "b", "c", "▁", "é", "日"];
        let extra = [" ", "x", "\n", "<end_of_turn>", "  ", "ab"];
        for round in 0..60 {
            let mut texts: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
            while texts.len() < 40 {
                let len = 2 + next(4);
                let t: String = (0..len).map(|_| alphabet[next(alphabet.len())]).collect();
                if !texts.contains(&t) {
                    texts.push(t);
                }
            }
            // Distinct scores in a random order.
            let mut scores: Vec<f32> = (0..texts.len()).map(|i| -(i as f32) - 1.0).collect();
            for i in (1..scores.len()).rev() {
                scores.swap(i, next(i + 1));
            }
            let entries: Vec<(String, f32)> = texts.into_iter().zip(scores).collect();
            let t = Tokenizer::from_gguf_metadata(&spm_md_with(round % 2 == 0, &entries)).unwrap();
            for _ in 0..40 {
                let text: String = (0..next(24))
                    .map(|_| match next(4) {
                        0 => extra[next(extra.len())],
                        _ => alphabet[next(alphabet.len())],
                    })
                    .collect();
                let ours = t.encode(&text, false).unwrap();
                let crate_ids = t.inner().encode_fast(text.as_str(), false).unwrap();
                assert_eq!(ours, crate_ids.get_ids(), "round {round}, {text:?}");
                assert_eq!(
                    t.encode_plain(&text).unwrap(),
                    {
                        let mut plain = t.inner().clone();
                        plain.set_encode_special_tokens(true);
                        plain
                            .encode_fast(text.as_str(), false)
                            .unwrap()
                            .get_ids()
                            .to_vec()
                    },
                    "round {round}, {text:?} with special tokens as text"
                );
            }
        }
    }

    /// Random byte-level BPE vocabularies (all 256 byte characters, random merges of them in
    /// random rank order, under Llama 3's and the default pre-tokenizer) and random texts: gen's
    /// encoder and the `tokenizers` form `inner()` builds from the same merges agree.
    #[test]
    fn bpe_encoder_agrees_with_its_tokenizers_form_on_random_vocabularies() {
        let mut next = below(0x9E37_79B9_7F4A_7C15);
        let letters = ["a", "b", "c", "Ġ", "Ċ", "Ã", "©"];
        let extra = [" ", "\n", "é", "<|im_end|>", "12", "'s", "ab"];
        for round in 0..40 {
            let mut tokens: Vec<String> = GPT2_SPECIALS.iter().map(|t| t.to_string()).collect();
            tokens.extend(byte_level_chars().iter().map(|c| c.to_string()));
            let mut merges: Vec<String> = Vec::new();
            // Merges of entries already there, each making a new entry.
            while merges.len() < 60 {
                let pick = |n: usize| -> String {
                    if n.is_multiple_of(3) && tokens.len() > 259 {
                        tokens[259 + n % (tokens.len() - 259)].clone()
                    } else {
                        letters[n % letters.len()].to_string()
                    }
                };
                let (l, r) = (pick(next(1000)), pick(next(1000)));
                let joined = format!("{l}{r}");
                if !tokens.contains(&joined) {
                    tokens.push(joined);
                    merges.push(format!("{l} {r}"));
                }
            }
            let mut md = gpt2_md(if round % 2 == 0 {
                "llama-bpe"
            } else {
                "default"
            });
            md.insert(KEY_TOKENS.into(), str_array(&tokens));
            md.insert(
                KEY_MERGES.into(),
                Value::Array(merges.iter().map(|m| s(m)).collect()),
            );
            let mut types = vec![Value::I32(3); 3];
            types.resize(tokens.len(), Value::I32(1));
            md.insert(KEY_TOKEN_TYPE.into(), Value::Array(types));
            let t = Tokenizer::from_gguf_metadata(&md).unwrap();
            for _ in 0..40 {
                let text: String = (0..next(24))
                    .map(|_| match next(3) {
                        0 => extra[next(extra.len())].to_string(),
                        // Byte-level letters stand for other bytes: spell some as such.
                        _ => match letters[next(letters.len())] {
                            "Ġ" => " ".to_string(),
                            "Ċ" => "\n".to_string(),
                            l => l.to_string(),
                        },
                    })
                    .collect();
                let ours = t.encode(&text, false).unwrap();
                let crate_ids = t.inner().encode_fast(text.as_str(), false).unwrap();
                assert_eq!(ours, crate_ids.get_ids(), "round {round}, {text:?}");
            }
        }
    }

    /// A `gemma4` vocabulary: specials, `▁`-escaped words, all 256 byte tokens.
    fn gemma4_md(texts: &[&str], merges: &[&str]) -> HashMap<String, Value> {
        let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>"].map(String::from).to_vec();
        let mut types = vec![Value::I32(3); 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(Value::I32(6));
        }
        tokens.extend(texts.iter().map(|t| t.to_string()));
        types.resize(tokens.len(), Value::I32(1));
        let mut md = HashMap::new();
        md.insert(KEY_MODEL.into(), s("gemma4"));
        // llama.cpp takes the `gemma4` split whatever the file names.
        md.insert(KEY_PRE.into(), s("qwen2"));
        md.insert(KEY_TOKENS.into(), str_array(&tokens));
        md.insert(
            KEY_MERGES.into(),
            Value::Array(merges.iter().map(|m| s(m)).collect()),
        );
        md.insert(KEY_TOKEN_TYPE.into(), Value::Array(types));
        md.insert(KEY_BOS.into(), Value::U32(2));
        md.insert(KEY_EOS.into(), Value::U32(1));
        md.insert(KEY_ADD_BOS.into(), Value::Bool(false));
        md
    }

    #[test]
    fn gemma4_merges_utf8_with_escaped_spaces_and_byte_fallback() {
        let entries = [
            "a",
            "b",
            "\u{2581}",
            "\n",
            "\u{2581}a",
            "ab",
            "\u{2581}ab",
            "\n\n",
        ];
        let merges = ["\u{2581} a", "a b", "\u{2581}a b"];
        let md = gemma4_md(&entries, &merges);
        let t = Tokenizer::from_gguf_metadata(&md).unwrap();
        // "é" is no entry: its two bytes; "\n\n" is one entry though no merge makes it; "x"
        // stops "a" and "b" from merging across it.
        let ids = t.encode("ab ab é\n\naxb", true).unwrap();
        assert_eq!(
            texts(&t, &ids),
            [
                "<bos>",
                "ab",
                "\u{2581}ab",
                "\u{2581}",
                "<0xC3>",
                "<0xA9>",
                "\n\n",
                "a",
                "<0x78>",
                "b"
            ],
            "BOS even where the file says add_bos_token = false, as llama.cpp forces it"
        );
        assert_eq!(t.decode(&ids[1..]).unwrap(), "ab ab é\n\naxb");
        assert_eq!(
            t.inner().decode(&ids[1..], false).unwrap(),
            "ab ab é\n\naxb"
        );
        assert_eq!(t.min_tokens("ab"), 1);
        // The same vocabulary named `gpt2` with the `gemma4` split is the same tokenizer.
        let mut named = md.clone();
        named.insert(KEY_MODEL.into(), s("gpt2"));
        named.insert(KEY_PRE.into(), s("gemma4"));
        let t2 = Tokenizer::from_gguf_metadata(&named).unwrap();
        assert_eq!(t2.encode("ab ab é\n\naxb", true).unwrap(), ids);
    }

    #[test]
    fn raw_utf8_bpe_agrees_with_its_tokenizers_form_on_random_vocabularies() {
        let mut next = below(0x2545_F491_4F6C_DD1D);
        let letters = ["a", "b", "c", "\u{2581}", "\n", "é"];
        for round in 0..30 {
            // No merge of newlines: a piece of them that is an entry is taken whole, which a
            // `tokenizers` BPE model does not do.
            let mut texts: Vec<String> = ["a", "b", "c", "\u{2581}"].map(String::from).to_vec();
            let mut merges: Vec<String> = Vec::new();
            while merges.len() < 40 {
                let pick = |n: usize| texts[n % texts.len()].clone();
                let (l, r) = (pick(next(1000)), pick(next(1000)));
                let joined = format!("{l}{r}");
                if !texts.contains(&joined) {
                    texts.push(joined);
                    merges.push(format!("{l} {r}"));
                }
            }
            texts.push("\n".into());
            let texts_ref: Vec<&str> = texts.iter().map(String::as_str).collect();
            let merges_ref: Vec<&str> = merges.iter().map(String::as_str).collect();
            let t = Tokenizer::from_gguf_metadata(&gemma4_md(&texts_ref, &merges_ref)).unwrap();
            for _ in 0..40 {
                let text: String = (0..next(24))
                    .map(|_| match letters[next(letters.len())] {
                        "\u{2581}" => " ",
                        l => l,
                    })
                    .collect();
                let ours = t.encode(&text, false).unwrap();
                let crate_ids = t.inner().encode_fast(text.as_str(), false).unwrap();
                assert_eq!(ours, crate_ids.get_ids(), "round {round}, {text:?}");
                assert_eq!(t.decode(&ours).unwrap(), text);
            }
        }
    }

    #[test]
    fn spm_merge_list_is_every_split_ranked_by_score() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
            .iter()
            .map(|t| t.to_string())
            .collect();
        let scores = [0.0, 0.0, 0.0, -3.0, -1.0, -2.0];
        let vocab: Vocab = (0..).zip(&tokens).map(|(i, t)| (t.clone(), i)).collect();
        let merges = spm_merges(&tokens, &scores, &vocab);
        let merges: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        assert_eq!(merges, [("b", "c"), ("a", "bc"), ("ab", "c"), ("a", "b")]);
    }

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(b'\n'));
        assert_eq!(parse_byte_token("<0xff>"), Some(0xFF));
        assert_eq!(parse_byte_token("<0x0A"), None);
        assert_eq!(parse_byte_token("<0x100>"), None);
        assert_eq!(parse_byte_token("<0xé>"), None);
    }

    /// The pieces `regexes` cut `text` into, as gen's pre-tokenizer runs them.
    fn pieces(regexes: &[&str], text: &str) -> Vec<String> {
        split_with(
            &PreTokenizerSequence::new(split_steps(regexes).unwrap()),
            text,
        )
    }

    fn split_with(steps: &PreTokenizerSequence, text: &str) -> Vec<String> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut pretokenized = PreTokenizedString::from(text);
        steps.pre_tokenize(&mut pretokenized).unwrap();
        pretokenized
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (start, end), _)| text[start..end].to_owned())
            .collect()
    }

    fn pre_pieces(name: &str, text: &str) -> Vec<String> {
        pieces(bpe_pre(name).unwrap().regexes, text)
    }

    /// Every name in gen's table is one of llama.cpp's, with llama.cpp's flags; every name
    /// llama.cpp knows is either run by gen or refused in one line for a reason that holds; and
    /// for every text of assets/llama-cpp-pre-splits.json (made from llama.cpp's own source by
    /// assets/record-llama-cpp-pre-splits.py) gen cuts the same pieces as llama.cpp.
    #[test]
    fn pre_tokenizers_split_as_llama_cpp() {
        let reference: serde_json::Value =
            serde_json::from_str(include_str!("../assets/llama-cpp-pre-splits.json")).unwrap();
        let names = reference["names"].as_object().unwrap();
        let texts: Vec<&str> = reference["texts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();

        for (gen_names, pre) in BPE_PRES {
            for name in *gen_names {
                let info = names
                    .get(*name)
                    .unwrap_or_else(|| panic!("llama.cpp has no pre-tokenizer `{name}`"));
                assert_eq!(info["raw_utf8"], pre.raw.is_some(), "{name}: raw UTF-8");
                assert_eq!(
                    info["ignore_merges"], pre.ignore_merges,
                    "{name}: ignore_merges"
                );
                assert_eq!(info["add_bos"], pre.add_bos, "{name}: add_bos");
            }
        }

        let (mut runs, mut refused, mut failures) = (0, 0, 0);
        for (name, info) in names {
            let ty = info["type"].as_str().unwrap();
            let pre = match bpe_pre(name) {
                Ok(pre) => pre,
                Err(e) => {
                    let e = format!("{e:#}");
                    assert!(!e.contains('\n') && e.contains(name.as_str()), "{e}");
                    assert_eq!(info["raw_utf8"], true, "gen refuses `{name}` ({ty}): {e}");
                    refused += 1;
                    continue;
                }
            };
            runs += 1;
            let mut want = &reference["splits"][ty];
            // A type that cuts every text as an earlier one names it.
            while let Some(same_as) = want.as_str() {
                want = &reference["splits"][same_as];
            }
            let want = want.as_array().unwrap();
            assert_eq!(want.len(), texts.len(), "{ty}");
            let steps = PreTokenizerSequence::new(split_steps(pre.regexes).unwrap());
            for (text, want) in texts.iter().zip(want) {
                let want: Vec<u64> = want
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_u64().unwrap())
                    .collect();
                let got = split_with(&steps, text);
                let got_lens: Vec<u64> = got.iter().map(|p| p.chars().count() as u64).collect();
                if got_lens != want {
                    failures += 1;
                    let mut rest = text.chars();
                    let want: Vec<String> = want
                        .iter()
                        .map(|&n| rest.by_ref().take(n as usize).collect())
                        .collect();
                    eprintln!(
                        "`{name}` ({ty}) on {text:?}:\n  llama.cpp {want:?}\n  gen       {got:?}"
                    );
                }
            }
        }
        eprintln!(
            "{runs} pre-tokenizer names split {} texts; {refused} refused; {failures} differ",
            texts.len()
        );
        assert_eq!(
            failures, 0,
            "gen splits differently from llama.cpp (see above)"
        );
        assert!(
            runs > 80 && texts.len() > 200,
            "{runs} names, {} texts",
            texts.len()
        );
    }

    #[test]
    fn afmoe_digits_group_in_threes_from_the_right_and_keep_the_text_before() {
        let p = |text| pieces(&[RE_AFMOE_DIGITS], text);
        assert_eq!(p("ab1234cd"), ["ab1", "234", "cd"]);
        assert_eq!(p("123456"), ["123", "456"]);
        assert_eq!(p("12 3456789 x"), ["12", " 3", "456", "789", " x"]);
        assert_eq!(p("x  12"), ["x  12"]);
        assert_eq!(p("no digits"), ["no digits"]);
        assert_eq!(p("٣٤ and ७"), ["٣٤", " and ७"]);
        assert!(p("").is_empty());
        // Long runs stay linear: each group after the first is taken without looking ahead.
        let long = "7".repeat(100_001);
        let got = p(&long);
        assert_eq!(got.len(), 33_334);
        assert_eq!(got[0], "77");
        assert!(got[1..].iter().all(|g| g == "777"));
        // The whole of Tiny Aya's and AFMoE's lists, on a bit of everything.
        assert_eq!(
            pre_pieces("afmoe", "価格は1234円, x12"),
            ["価格は", "1", "234", "円", ",", " x", "12"]
        );
        assert_eq!(
            pre_pieces("tiny_aya", "HelloWorld 12345"),
            ["HelloWorld", " ", "12", "345"]
        );
    }

    #[test]
    fn kimi_k2_splits_han_from_other_letters() {
        assert_eq!(
            pre_pieces("kimi-k2", "中文English混合 it's 12345"),
            ["中文", "English", "混合", " it's", " ", "123", "45"]
        );
        // Marks are not letters to llama.cpp's splitter, and case does not split a word.
        assert_eq!(
            pre_pieces("kimi-k2", "e\u{301}tÉ CamelCase"),
            ["e", "\u{301}tÉ", " CamelCase"]
        );
    }

    #[test]
    fn superbpe_keeps_words_together_and_groups_digits_from_the_right() {
        assert_eq!(
            pre_pieces("superbpe", "by the way 1234567"),
            ["by the way ", "1", "234", "567"]
        );
    }

    #[test]
    fn whitespace_llama_cpp_has_replaced_never_matches_a_named_range() {
        // U+3000 is inside DeepSeek LLM's punctuation range, U+2003 inside its CJK range; llama.cpp
        // has turned both into `\v` before those regexes run.
        assert_eq!(pre_pieces("deepseek-llm", "。\u{3000}"), ["。", "\u{3000}"]);
        assert_eq!(
            pre_pieces("deepseek-coder", "中\u{2003}文"),
            ["中", "\u{2003}", "文"]
        );
    }

    #[test]
    fn case_classes_are_any_letter_as_llama_cpp_reads_them() {
        // Youtu's regex names \p{Lu} and \p{Ll}; llama.cpp reads both as \p{L}.
        assert_eq!(pre_pieces("youtu", "HelloWorld"), ["HelloWorld"]);
        // Tekken's rewrite does tell ASCII case apart.
        assert_eq!(pre_pieces("tekken", "HelloWorld"), ["Hello", "World"]);
        assert_eq!(pre_pieces("gpt-4o", "helloWorld's"), ["hello", "World's"]);
        assert_eq!(pre_pieces("gpt-4o", "HELLOWorld's"), ["HELLOWorld's"]);
    }

    #[test]
    fn new_pre_names_build_with_their_flags() {
        for name in [
            "tekken",
            "gpt-4o",
            "deepseek-v3",
            "kimi-k2",
            "afmoe",
            "glm5",
            "qwen35",
        ] {
            let t = gpt2(name);
            let text = "hello world 1234, 世界!\n";
            assert_eq!(
                t.decode(&t.encode(text, false).unwrap()).unwrap(),
                text,
                "{name}"
            );
        }
        // An empty name is `default`, as in llama.cpp.
        let t = gpt2("");
        assert_eq!(t.decode(&t.encode("a, b", false).unwrap()).unwrap(), "a, b");
        // Tekken wants BOS when the file does not say.
        let mut md = gpt2_md("tekken");
        md.remove(KEY_ADD_BOS);
        let t = Tokenizer::from_gguf_metadata(&md).unwrap();
        assert!(t.wants_bos());
        assert_eq!(t.encode("hello", true).unwrap()[0], 1);
        let mut md = gpt2_md("qwen2");
        md.remove(KEY_ADD_BOS);
        assert!(!Tokenizer::from_gguf_metadata(&md).unwrap().wants_bos());
        // GLM-4 takes a word that is in the vocabulary whole, whatever the merges say.
        let mut md = gpt2_md("glm4");
        md.insert(
            KEY_MERGES.into(),
            Value::Array(vec![s("h e"), s("l l"), s("he ll")]),
        );
        let t = Tokenizer::from_gguf_metadata(&md).unwrap();
        let ids = t.encode("hello", false).unwrap();
        assert_eq!(texts(&t, &ids), ["hello"]);
        let t = Tokenizer::from_gguf_metadata(&{
            let mut md = md.clone();
            md.insert(KEY_PRE.into(), s("chatglm-bpe"));
            md
        })
        .unwrap();
        let ids = t.encode("hello", false).unwrap();
        assert_eq!(texts(&t, &ids), ["hell", "o"]);
    }

    #[test]
    fn kimi_k2_loads_without_merges_and_others_do_not() {
        let mut md = gpt2_md("kimi-k2");
        md.remove(KEY_MERGES);
        let t = Tokenizer::from_gguf_metadata(&md).unwrap();
        let ids = t.encode("hello", false).unwrap();
        assert_eq!(texts(&t, &ids), ["h", "e", "l", "l", "o"]);
        let mut md = gpt2_md("qwen2");
        md.remove(KEY_MERGES);
        assert!(err(&md).contains(KEY_MERGES));
    }

    #[test]
    fn own_session_pre_tokenizers_are_refused_in_one_line() {
        for name in OWN_SESSION_PRES {
            let e = err(&gpt2_md(name));
            assert!(
                e.contains(name) && e.contains("of its own") && !e.contains('\n'),
                "{e}"
            );
        }
    }
}
