//! Structured output: a grammar the reply must follow (`--json`, `--json-schema`, `--grammar`,
//! `--regex`), enforced at each step by masking the tokens it does not allow.
//!
//! The engine is llguidance (the one llama.cpp, vLLM, SGLang and TGI use): it compiles JSON
//! Schemas, Lark-like grammars and regexes into an Earley parser over a lexer, and computes for a
//! parser state which token ids may come next by walking a trie of the vocabulary's bytes. gen
//! gives it that trie ([`Grammars::new`], from gen's own tokenizer: special tokens are marked so
//! no grammar can spell them out), applies the mask before any other sampling step, and ends the
//! reply when the grammar is complete.
//!
//! A [`Spec`] is checked before the model loads ([`Spec::check`], against a byte-level
//! vocabulary), so a schema that does not compile costs one line and exit status 2, not a load.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{self, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// What the reply must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// A JSON value of any kind (`--json=any`).
    AnyJson,
    /// A JSON Schema (`--json` is the schema `{"type": "object"}`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark-like syntax, or in llama.cpp's GBNF (told apart by its
    /// `::=`, and rewritten as Lark by [`crate::gbnf`]).
    Grammar(String),
    /// A regular expression the whole reply matches.
    Regex(String),
}

impl Spec {
    /// `--json`: any JSON object.
    pub fn json_object() -> Self {
        Spec::JsonSchema(serde_json::json!({"type": "object"}))
    }

    /// How the report names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Spec::AnyJson => "json",
            Spec::JsonSchema(_) => "json-schema",
            Spec::Grammar(_) => "grammar",
            Spec::Regex(_) => "regex",
        }
    }

    /// A schema from `--json-schema`'s argument: inline JSON, or the path of a file holding it.
    pub fn schema_from_arg(arg: &str) -> Result<Self> {
        let trimmed = arg.trim_start();
        let (text, what) = if trimmed.starts_with('{') || trimmed == "true" {
            (arg.to_string(), "the schema".to_string())
        } else {
            let text = std::fs::read_to_string(arg)
                .with_context(|| format!("cannot read the schema file {arg}"))?;
            (text, format!("schema file {arg}"))
        };
        let schema: Value =
            serde_json::from_str(&text).map_err(|e| anyhow!("{what} is not valid JSON: {e}"))?;
        Ok(Spec::JsonSchema(schema))
    }

    fn top_level(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Spec::AnyJson => TopLevelGrammar::from_json_schema(with_layout(serde_json::json!({}))?),
            Spec::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_layout(s.clone())?),
            Spec::Grammar(g) => {
                if g.trim().is_empty() {
                    bail!("the grammar is empty");
                }
                if crate::gbnf::is_gbnf(g) {
                    TopLevelGrammar::from_lark(crate::gbnf::to_lark(g)?)
                } else {
                    TopLevelGrammar::from_lark(g.clone())
                }
            }
            Spec::Regex(r) => TopLevelGrammar::from_regex(r),
        })
    }

    /// Compile it against a vocabulary of single bytes: whatever the model, a spec that passes
    /// here compiles for it (the grammar does not depend on the vocabulary). One line on error.
    pub fn check(&self) -> Result<()> {
        compile(byte_factory()?, self).map(drop)
    }
}

/// gen's default JSON layout, unless the schema sets its own with llguidance's `x-guidance`
/// key: one line, a space after `:` and `,` (as Python's json.dumps writes it), no other
/// whitespace. A small model given free whitespace can pad a reply with newlines until
/// --max-new; this way every token it spends is content.
fn with_layout(schema: Value) -> Result<Value> {
    let mut schema = match schema {
        Value::Bool(true) => serde_json::json!({}),
        Value::Bool(false) => bail!("the schema is `false`: no value satisfies it"),
        Value::Object(map) => Value::Object(map),
        other => bail!("a JSON Schema is an object or a boolean, not {other}"),
    };
    let map = schema.as_object_mut().expect("an object");
    if !map.contains_key("x-guidance") {
        map.insert(
            "x-guidance".into(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
        );
    }
    Ok(schema)
}

fn factory(env: &TokEnv) -> Result<ParserFactory> {
    let mut factory = ParserFactory::new_simple(env)?;
    factory.quiet();
    *factory.limits_mut() = ParserLimits {
        // One line per error: not the parser's state and the whole grammar.
        verbose_errors: false,
        ..ParserLimits::default()
    };
    Ok(factory)
}

fn compile(factory: &ParserFactory, spec: &Spec) -> Result<Matcher> {
    let grammar = spec.top_level()?;
    let parser = factory
        .create_parser(grammar)
        .map_err(|e| anyhow!("{}", one_line(&e.to_string())))?;
    let matcher = Matcher::new(Ok(parser));
    if let Some(e) = matcher.get_error() {
        bail!("{}", one_line(&e));
    }
    Ok(matcher)
}

/// Engine messages can span lines; gen's errors are one.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn byte_env() -> TokEnv {
    toktrie::ApproximateTokEnv::single_byte_env()
}

/// The single-byte vocabulary's factory, built once per process: every `--batch` line with a
/// spec is checked against it.
fn byte_factory() -> Result<&'static ParserFactory> {
    static FACTORY: std::sync::OnceLock<std::result::Result<ParserFactory, String>> =
        std::sync::OnceLock::new();
    FACTORY
        .get_or_init(|| factory(&byte_env()).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| anyhow!("{e}"))
}

/// gen's tokenizer as llguidance sees it: each id's bytes (special tokens behind the 0xFF
/// marker, so no grammar matches them as text) and an encoder.
struct GenTokEnv {
    trie: TokTrie,
    encoder: crate::tokenizer::Encoder,
    canonical: bool,
}

impl TokenizerEnv for GenTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        // Bytes that are not UTF-8 are spelled greedily from the vocabulary instead.
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.encoder.encode(text).unwrap_or_default())
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// Compiles specs for one model's vocabulary; shared by every sequence of a run.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// `eos`: the ids that end a reply; the grammar allows them where it may end.
    pub fn new(tokenizer: &Tokenizer, eos: &[u32]) -> Result<Self> {
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                if tokenizer.is_special(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        // No EOS (--ignore-eos): an id past the vocabulary stands in, so none is ever allowed.
        let first = eos.first().copied().unwrap_or(n as u32);
        let mut info = TokRxInfo::new(n as u32, first);
        info.tok_bos = tokenizer.bos_id();
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        let env: TokEnv = Arc::new(GenTokEnv {
            trie,
            encoder: tokenizer.encoder(),
            canonical: !tokenizer.adds_space_prefix(),
        });
        Ok(Self {
            factory: factory(&env)?,
        })
    }

    /// A fresh constraint for one reply.
    pub fn constraint(&self, spec: &Spec) -> Result<Constraint> {
        Constraint::start(compile(&self.factory, spec)?, spec.kind())
    }
}

/// What computing masks cost one reply.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MaskStats {
    /// Masks computed (one per sampled token).
    pub masks: usize,
    /// Time the engine spent computing them, on its own thread.
    pub compute: Duration,
    /// Time the sampler waited for a mask (what the constraint added to a step).
    pub wait: Duration,
}

/// The state of one reply's grammar. The engine runs on a thread of its own: once a token is
/// committed, the next mask is computed while the model's forward pass runs.
pub struct Constraint {
    kind: &'static str,
    to_engine: Option<Sender<u32>>,
    from_engine: Receiver<Result<Msg>>,
    /// The mask for the next token, once received.
    ready: Option<SimpleVob>,
    finished: bool,
    stats: MaskStats,
}

/// The engine's answers: after each commit, whether the grammar is complete, then (unless it
/// is) the next mask. The first answer is the first mask.
enum Msg {
    Consumed { complete: bool },
    Mask { mask: SimpleVob, compute: Duration },
}

impl Constraint {
    fn start(mut matcher: Matcher, kind: &'static str) -> Result<Self> {
        let (to_engine, commits) = mpsc::channel::<u32>();
        let (answers, from_engine) = mpsc::channel::<Result<Msg>>();
        std::thread::Builder::new()
            .name("gen-grammar".into())
            .spawn(move || {
                if answers.send(next_mask(&mut matcher)).is_err() {
                    return;
                }
                while let Ok(id) = commits.recv() {
                    let consumed = matcher
                        .consume_token(id)
                        .map_err(|e| anyhow!("{}", one_line(&e.to_string())));
                    let complete = matcher.is_stopped();
                    let ok = consumed.is_ok();
                    let answer = consumed.map(|()| Msg::Consumed { complete });
                    if answers.send(answer).is_err() || !ok || complete {
                        break;
                    }
                    if answers.send(next_mask(&mut matcher)).is_err() {
                        break;
                    }
                }
            })
            .context("cannot start the grammar engine's thread")?;
        Ok(Self {
            kind,
            to_engine: Some(to_engine),
            from_engine,
            ready: None,
            finished: false,
            stats: MaskStats::default(),
        })
    }

    pub fn kind(&self) -> &'static str {
        self.kind
    }

    pub fn stats(&self) -> MaskStats {
        self.stats
    }

    /// Whether the grammar is complete: nothing may follow what was committed.
    pub fn finished(&self) -> bool {
        self.finished
    }

    fn receive(&mut self) -> Result<Msg> {
        let wait = Instant::now();
        let msg = self
            .from_engine
            .recv()
            .map_err(|_| anyhow!("the grammar engine stopped"))?;
        self.stats.wait += wait.elapsed();
        msg
    }

    /// Set every logit the grammar does not allow next to -inf. Fails when it allows nothing
    /// (it cannot happen with a grammar that can end, but a broken engine must not hang).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        if self.finished {
            bail!("the grammar is already complete");
        }
        if self.ready.is_none() {
            match self.receive()? {
                Msg::Mask { mask, compute } => {
                    self.stats.compute += compute;
                    self.stats.masks += 1;
                    self.ready = Some(mask);
                }
                Msg::Consumed { .. } => bail!("the grammar engine answered out of turn"),
            }
        }
        let mask = self.ready.as_ref().expect("received");
        let words = mask.as_slice();
        let mut any = false;
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == 0 {
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits >> b & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                } else {
                    any |= !l.is_nan();
                }
            }
        }
        if !any {
            bail!("the grammar allows no token here");
        }
        Ok(())
    }

    /// Whether `id` was allowed by the mask last applied.
    pub fn allowed(&self, id: u32) -> bool {
        self.ready
            .as_ref()
            .is_some_and(|m| (id as usize) < m.len() && m.is_allowed(id))
    }

    /// The sampled token: the engine advances over it and starts on the next mask, which
    /// [`Self::apply`] collects at the next step.
    pub fn commit(&mut self, id: u32) -> Result<()> {
        if !self.allowed(id) {
            bail!("token {id} is not allowed by the grammar here");
        }
        self.ready = None;
        let sender = self
            .to_engine
            .as_ref()
            .ok_or_else(|| anyhow!("the grammar is already complete"))?;
        sender
            .send(id)
            .map_err(|_| anyhow!("the grammar engine stopped"))?;
        match self.receive()? {
            Msg::Consumed { complete } => {
                if complete {
                    self.finished = true;
                    self.to_engine = None;
                }
                Ok(())
            }
            Msg::Mask { .. } => bail!("the grammar engine answered out of turn"),
        }
    }
}

fn next_mask(matcher: &mut Matcher) -> Result<Msg> {
    let start = Instant::now();
    let mask = matcher
        .compute_mask()
        .map_err(|e| anyhow!("{}", one_line(&e.to_string())))?;
    Ok(Msg::Mask {
        mask,
        compute: start.elapsed(),
    })
}

/// A constraint over a vocabulary of single bytes (id = byte, then 6 special tokens, the last
/// one EOS), for tests of what uses constraints.
#[doc(hidden)]
pub fn byte_constraint(spec: &Spec) -> Constraint {
    let factory = byte_factory().expect("the byte vocabulary builds");
    let matcher = compile(factory, spec).expect("a spec for tests compiles");
    Constraint::start(matcher, spec.kind()).expect("a thread starts")
}

/// Drive `spec` over the single-byte vocabulary: at each step take the allowed byte that
/// `picks` points at (modulo how many are allowed), until the grammar is complete, only EOS is
/// left, or the picks run out. Returns the bytes written and whether the grammar completed.
/// For the fuzz target: whatever the spec, this must end without a panic or a hang.
#[doc(hidden)]
pub fn walk_bytes(spec: &Spec, picks: &[u8]) -> Result<(Vec<u8>, bool)> {
    let factory = byte_factory()?;
    let mut c = Constraint::start(compile(factory, spec)?, spec.kind())?;
    let vocab = factory.tok_env().tok_trie().vocab_size();
    let mut written = Vec::new();
    for &pick in picks {
        let mut logits = vec![0.0f32; vocab];
        c.apply(&mut logits)?;
        let allowed: Vec<u8> = (0..=255u8)
            .filter(|&b| logits[usize::from(b)] == 0.0)
            .collect();
        let Some(&b) = allowed.get(usize::from(pick) % allowed.len().max(1)) else {
            break; // only EOS (or a special token) may come next
        };
        c.commit(u32::from(b))?;
        written.push(b);
        if c.finished() {
            return Ok((written, true));
        }
    }
    Ok((written, false))
}

/// Whether `spec` takes the whole of `text` as a complete reply (every byte allowed where it
/// comes, and the grammar may end after the last): the question llama.cpp's grammar tests ask.
#[doc(hidden)]
pub fn accepts(spec: &Spec, text: &[u8]) -> Result<bool> {
    let mut matcher = compile(byte_factory()?, spec)?;
    let ids: Vec<u32> = text.iter().map(|&b| u32::from(b)).collect();
    if matcher.validate_tokens(&ids)? < ids.len() {
        return Ok(false);
    }
    matcher.consume_tokens(&ids)?;
    Ok(matcher.is_stopped() || matcher.is_accepting()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed_bytes(c: &mut Constraint) -> Vec<u8> {
        let mut logits = vec![0.0f32; 262];
        c.apply(&mut logits).unwrap();
        (0..=255u8).filter(|&b| logits[b as usize] == 0.0).collect()
    }

    #[test]
    fn a_regex_allows_exactly_its_next_bytes_and_completes() {
        let mut c = byte_constraint(&Spec::Regex("ab(c|d)".into()));
        assert_eq!(allowed_bytes(&mut c), b"a");
        c.commit(u32::from(b'a')).unwrap();
        assert_eq!(allowed_bytes(&mut c), b"b");
        // A token the mask did not allow is refused, not fed to the engine.
        assert!(c.commit(u32::from(b'x')).is_err());
        c.commit(u32::from(b'b')).unwrap();
        assert_eq!(allowed_bytes(&mut c), b"cd");
        assert!(!c.finished());
        c.commit(u32::from(b'd')).unwrap();
        assert!(c.finished(), "nothing may follow abd");
        assert!(c.apply(&mut [0.0; 262]).is_err());
        let stats = c.stats();
        assert_eq!(stats.masks, 3);
    }

    #[test]
    fn a_json_schema_allows_what_the_schema_allows() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": false
        });
        let mut c = byte_constraint(&Spec::JsonSchema(schema));
        for &b in br#"{"ok": "# {
            assert_eq!(allowed_bytes(&mut c), vec![b], "before {:?}", b as char);
            c.commit(u32::from(b)).unwrap();
        }
        assert_eq!(allowed_bytes(&mut c), b"ft", "true or false");
        for &b in b"false}" {
            allowed_bytes(&mut c);
            c.commit(u32::from(b)).unwrap();
        }
        assert!(c.finished());
    }

    #[test]
    fn masked_logits_are_minus_infinity_and_nothing_allowed_is_an_error() {
        let mut c = byte_constraint(&Spec::Regex("[0-9]".into()));
        let mut logits: Vec<f32> = (0..262).map(|i| i as f32).collect();
        c.apply(&mut logits).unwrap();
        for (i, l) in logits.iter().enumerate() {
            if i < 256 && (i as u8).is_ascii_digit() {
                assert_eq!(*l, i as f32);
            } else {
                assert_eq!(*l, f32::NEG_INFINITY, "id {i}");
            }
        }
        // Every allowed logit NaN: the engine's mask leaves nothing to sample.
        let mut c = byte_constraint(&Spec::Regex("[0-9]".into()));
        let mut nan = vec![f32::NAN; 262];
        assert!(c.apply(&mut nan).is_err());
    }

    #[test]
    fn default_layout_is_added_unless_the_schema_has_its_own() {
        let s = with_layout(serde_json::json!({"type": "object"})).unwrap();
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        let own = serde_json::json!({"x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_layout(own.clone()).unwrap(), own);
        assert_eq!(
            with_layout(serde_json::json!(true)).unwrap()["x-guidance"]["key_separator"],
            ": "
        );
        assert!(with_layout(serde_json::json!(false)).is_err());
        assert!(with_layout(serde_json::json!([1])).is_err());
    }

    #[test]
    fn bad_specs_are_one_line_errors() {
        let bad = [
            Spec::JsonSchema(serde_json::json!({"type": "intger"})),
            Spec::JsonSchema(serde_json::json!({"$ref": "#/$defs/missing"})),
            Spec::JsonSchema(serde_json::json!({"type": "integer", "minimum": 5, "maximum": 1})),
            Spec::Grammar("start: foo\n".into()),
            Spec::Grammar("start: \"a\" (\n".into()),
            Spec::Grammar("   ".into()),
            Spec::Regex("(ab".into()),
            Spec::Regex("a{2,1}".into()),
        ];
        for spec in bad {
            let err = format!("{:#}", spec.check().unwrap_err());
            assert!(!err.contains('\n') && !err.is_empty(), "{spec:?}: {err:?}");
        }
        for good in [
            Spec::json_object(),
            Spec::AnyJson,
            Spec::Grammar("start: \"yes\" | \"no\"\n".into()),
            Spec::Regex("[a-z]+@[a-z]+\\.com".into()),
        ] {
            good.check().unwrap_or_else(|e| panic!("{good:?}: {e:#}"));
        }
    }

    #[test]
    fn schema_args_are_inline_json_or_a_file() {
        let inline = Spec::schema_from_arg(r#"{"type": "string"}"#).unwrap();
        assert_eq!(
            inline,
            Spec::JsonSchema(serde_json::json!({"type": "string"}))
        );
        let dir = std::env::temp_dir().join(format!("gen-schema-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("s.json");
        std::fs::write(&file, r#"{"type": "integer"}"#).unwrap();
        let from_file = Spec::schema_from_arg(file.to_str().unwrap()).unwrap();
        assert_eq!(
            from_file,
            Spec::JsonSchema(serde_json::json!({"type": "integer"}))
        );
        std::fs::write(&file, "{not json").unwrap();
        let err = Spec::schema_from_arg(file.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("not valid JSON"), "{err}");
        assert!(Spec::schema_from_arg("/no/such/schema.json").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
