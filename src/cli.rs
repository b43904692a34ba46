//! The command line: `Args` mirrors the flags as typed; `Args::resolve` turns them, once, into
//! the validated `Config` the rest of the program uses.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};

use crate::batch_input::BatchFormat;
use crate::constraint::Spec;
use crate::sampler::SamplingParams;
use crate::source::{self, ModelSpec};

const AFTER_HELP: &str = "\
Examples:
  gen --prompt \"Once upon a time\" --max-new 200
  echo \"Write a haiku about rust\" | gen --chat --temperature 0.7
  gen chat --system \"Answer briefly.\"
  gen chat --messages saved.json < more-turns.txt
  gen --prompt-file question.txt --stop \"\\n\\n\" --stats-file stats.json
  gen --batch prompts.jsonl --temperature 0 > replies.jsonl
  gen --prompt \"Name a colour:\" --n 3 --max-new 8 > three.jsonl
  gen --chat --prompt \"Is this review positive or negative? I loved it.\" --json-schema label.json
  gen --grammar-file list.gbnf --prompt \"Three fruits:\"
  gen --model ./my-model.gguf --prompt \"Hello\"
  gen models
  gen --endpoint http://gpu-box:8000/v1 --batch prompts.jsonl > replies.jsonl   # your server
  gen --model TheOrg/Some-GGUF --model-file some.Q4_0.gguf --prompt \"Hello\"   # from the hub

stdout carries only the generated text (with --batch, one JSON line per prompt); the report goes
to stderr.
Exit status: 0 done, 1 error (with --batch: any prompt failed), 2 bad usage, 128 + the signal when
one ended the run (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP; the text so far and the report are written).";

/// Generate text from a local language model, one token per forward pass.
#[derive(Debug, Parser)]
#[command(name = "gen", version, about, after_help = AFTER_HELP, args_override_self = true)]
pub struct Args {
    /// `chat`: a conversation in the terminal (or one user turn per line of standard input),
    /// the KV cache reused across turns. `perplexity FILE`: the model's perplexity on a text
    /// file, windowed and scored as llama.cpp's llama-perplexity (--ctx-size tokens a window,
    /// 512 by default).
    #[arg(value_enum, value_name = "COMMAND")]
    pub command: Option<Command>,

    /// `perplexity`: the text file to score.
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,

    /// gen perplexity: save this run's log-probabilities to PATH as the base of a later
    /// --kl-divergence run (with --kl-divergence: read them from PATH).
    #[arg(long, value_name = "PATH")]
    pub kl_divergence_base: Option<PathBuf>,

    /// gen perplexity: compare this run with the base run saved at --kl-divergence-base (its
    /// text and windows; FILE may be left out): the KL divergence of each token's
    /// distribution from the base's, and how often both put the same token first.
    #[arg(long, requires = "kl_divergence_base")]
    pub kl_divergence: bool,

    /// The prompt. Without it, or with `-`, the prompt is all of standard input.
    #[arg(short, long, allow_hyphen_values = true)]
    pub prompt: Option<String>,

    /// Read the prompt from a file.
    #[arg(short = 'f', long, value_name = "PATH", conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,

    /// Model: a known name (default smollm2-135m), a path to a .gguf file, a Hugging Face
    /// checkpoint folder (config.json + safetensors), or a Hugging Face repo id: its safetensors
    /// checkpoint, or with --model-file one .gguf file in it.
    #[arg(short, long)]
    pub model: Option<String>,

    /// File inside the Hugging Face repo given with --model.
    #[arg(long, value_name = "NAME.gguf")]
    pub model_file: Option<String>,

    /// Type a Hugging Face checkpoint's weights are kept in for the matrix products (default:
    /// f32 on the CPU, bf16 on CUDA, f16 on Metal). Only for checkpoints: a GGUF file's weights
    /// keep the (quantized) types in the file, and --dtype with one is an error.
    #[arg(long, value_enum)]
    pub dtype: Option<WeightDtype>,

    /// Revision (branch, tag or commit) of the Hugging Face repo.
    #[arg(long)]
    pub revision: Option<String>,

    /// Use this tokenizer.json instead of the tokenizer in the model file.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,

    /// Use only models already in the cache; never touch the network (also HF_HUB_OFFLINE=1).
    #[arg(long)]
    pub offline: bool,

    /// Most tokens to generate.
    #[arg(short = 'n', long, visible_alias = "n-predict", default_value_t = 256)]
    pub max_new: usize,

    /// Stop here (never printed). Repeatable. `\n`, `\t` and the other escapes below apply.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,

    /// Take --prompt, --stop and --system as typed: without it, `\n`, `\r`, `\t`, `\\`, `\"`,
    /// `\'` and `\xHH` in them are processed as llama.cpp processes them (so `--stop "\n\n"` is
    /// a blank line). Files and standard input are never processed.
    #[arg(long)]
    pub no_escape: bool,

    /// When prompt plus --max-new exceeds the context window, generate until the window is full
    /// instead of refusing to start.
    #[arg(long)]
    pub stop_at_context: bool,

    /// Context window in tokens (default: the model's own; more is capped to it, with a
    /// warning).
    #[arg(short = 'c', long, value_name = "TOKENS")]
    pub ctx_size: Option<usize>,

    /// Keep generating past the end-of-sequence token (for benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,

    /// Sampling temperature; 0 is greedy (always the most likely token).
    #[arg(
        short,
        long,
        visible_alias = "temp",
        default_value_t = 0.8,
        allow_negative_numbers = true
    )]
    pub temperature: f64,

    /// Sample only among the K most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,

    /// Sample only among the most likely tokens whose probabilities add up to P, in (0, 1].
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f64,

    /// Drop tokens less likely than P times the most likely one, in [0, 1).
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f64,

    /// Penalise tokens seen in the last --repeat-last-n tokens (1.0: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repeat_penalty: f32,

    /// How many recent tokens the repetition, presence and frequency penalties look at.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,

    /// OpenAI's presence penalty, in [-2, 2]: lowers the logit of every token seen in the last
    /// --repeat-last-n tokens by this much (0: off).
    #[arg(
        long,
        value_name = "P",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub presence_penalty: f32,

    /// OpenAI's frequency penalty, in [-2, 2]: lowers a token's logit by this much for each
    /// time it was seen in the last --repeat-last-n tokens (0: off).
    #[arg(
        long,
        value_name = "F",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub frequency_penalty: f32,

    /// Random seed; the same seed and inputs give the same text (default: a fresh one, shown in
    /// the report).
    #[arg(short = 's', long)]
    pub seed: Option<u64>,

    /// Render the prompt through the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,

    /// System message for --chat and gen chat (also `--system-prompt`, `-sys`).
    #[arg(long, visible_alias = "system-prompt")]
    pub system: Option<String>,

    /// A conversation to continue: a JSON array of {"role", "content"} messages (system, user,
    /// assistant). gen chat starts from it; gen --chat generates its next assistant turn.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_file", "batch", "system"])]
    pub messages: Option<PathBuf>,

    /// Use this Jinja chat template instead of the model's own (for --chat and gen chat).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,

    /// Thinking models (a chat template with a thinking block): `on` or `off` render the
    /// template with thinking enabled or disabled (its `enable_thinking` switch), `auto` as the
    /// template defaults. Whatever the model thinks is kept out of the answer: stdout and
    /// `text` carry the answer, the thinking goes to stderr and a `reasoning` field.
    #[arg(long, value_enum, default_value_t = ReasoningArg::Auto, value_name = "MODE")]
    pub reasoning: ReasoningArg,

    /// Tools the model may call: a JSON file holding OpenAI's `tools` array. They go to the chat
    /// template, and the calls a reply makes come back as OpenAI `tool_calls` (in --stats json,
    /// --batch lines and OpenAI-shaped output).
    #[arg(long, value_name = "FILE")]
    pub tools: Option<PathBuf>,

    /// With --tools: `auto` (the model decides), `required` (the reply is a call of one of the
    /// tools) or a tool's name (a call of that one); a grammar holds the call's arguments to
    /// the tool's `parameters` schema.
    #[arg(long, value_name = "CHOICE", requires = "tools",
          conflicts_with_all = ["json", "json_schema", "grammar", "regex"])]
    pub tool_choice: Option<String>,

    /// After this many thinking tokens the thinking block is closed (its end marker is fed to
    /// the model) and the answer begins.
    #[arg(long, value_name = "N")]
    pub reasoning_budget: Option<usize>,

    /// Print the exact text the model would see (after the chat template) to stdout and its
    /// token count to stderr, and exit without generating.
    #[arg(long, conflicts_with = "batch")]
    pub dry_run: bool,

    /// Print the prompt to stdout before the reply.
    #[arg(long)]
    pub echo: bool,

    /// Record each generated token's log-probability and its N most likely alternatives
    /// (0 to 20), from the model's logits before any sampling step: in the report (`logprobs`
    /// in --stats json), in --batch lines, and OpenAI-shaped in --batch-output openai.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u8).range(0..=crate::logprobs::MAX_TOP as i64))]
    pub logprobs: Option<u8>,

    /// Also score the prompt: each prompt token's log-probability given those before it, with
    /// N alternatives (0 to 20), as vLLM's prompt_logprobs: `prompt_logprobs` in --stats json
    /// and in --batch lines (a line's own "prompt_logprobs" overrides it). The prompt is then
    /// computed whole, not taken from the prefix cache.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u8).range(0..=crate::logprobs::MAX_TOP as i64))]
    pub prompt_logprobs: Option<u8>,

    /// The reply is JSON that parses: an object (`--json`), or any JSON value (`--json=any`).
    /// Generation ends where the value does.
    #[arg(long, value_enum, num_args = 0..=1, require_equals = true,
          default_missing_value = "object", value_name = "KIND",
          conflicts_with_all = ["json_schema", "grammar", "regex"])]
    pub json: Option<JsonKind>,

    /// The reply is JSON valid under this JSON Schema: a file, or the schema itself inline
    /// (`'{"type": "object", ...}'`).
    #[arg(long, value_name = "FILE|JSON", conflicts_with_all = ["grammar", "regex"])]
    pub json_schema: Option<String>,

    /// The reply follows this context-free grammar: a file, or the grammar itself inline when
    /// it holds `::=`. llama.cpp's GBNF (rules `name ::= ...`, `root` first) or llguidance's
    /// Lark-like syntax (rules `name: ...`, `/regex/` terminals, `%json {...}`), told apart by
    /// the `::=`.
    #[arg(
        long,
        visible_alias = "grammar-file",
        value_name = "FILE|GBNF",
        conflicts_with = "regex"
    )]
    pub grammar: Option<String>,

    /// The whole reply matches this regular expression.
    #[arg(long, value_name = "PATTERN", allow_hyphen_values = true)]
    pub regex: Option<String>,

    /// Run many prompts: one per line of FILE (`-`: standard input), plain text or JSON Lines
    /// with {"prompt" (or "messages", a conversation), and optionally "id", "max_new",
    /// "temperature", "seed", "stop", and one of "json" (true), "json_schema" (a schema),
    /// "grammar", "regex"}; other fields are ignored. Writes one JSON object per prompt to
    /// stdout, in input order.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_file", "echo"])]
    pub batch: Option<PathBuf>,

    /// Write K completions of the prompt (or of each --batch line without its own "n"), each
    /// sampled with its own seed; they share the prompt's prefill through the prefix cache.
    /// Above 1, stdout is JSON lines as with --batch, one per completion, with "choice".
    #[arg(long = "n", value_name = "K", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=crate::batch_input::MAX_N as i64))]
    pub n: u16,

    /// How to read the --batch file.
    #[arg(long, value_enum, default_value_t = BatchFormat::Auto, requires = "batch")]
    pub batch_format: BatchFormat,

    /// Most prompts decoded together in one forward pass (default: 8 on the CPU, 64 on a GPU).
    #[arg(long, value_name = "N", requires = "batch")]
    pub batch_size: Option<usize>,

    /// KV cache pool for --batch, in blocks of 16 tokens (default: room for --batch-size
    /// prompts as long as the longest, with their replies). When it runs short, sequences wait
    /// or are paused and resumed; nothing is lost.
    #[arg(long, value_name = "BLOCKS", requires = "batch")]
    pub kv_blocks: Option<usize>,

    /// Do not share prompt beginnings through the KV cache's prefix cache (on by default: a
    /// prompt that begins with blocks an earlier prompt, or an earlier turn of gen chat,
    /// computed prefills only the rest). For comparison; the output is the same either way.
    #[arg(long)]
    pub no_prefix_cache: bool,

    /// Keep the prompt's KV cache in FILE: a run whose prompt begins as the saved one did, on
    /// the same model file, loads those tokens' keys and values instead of computing them,
    /// then saves its own prompt there. A file that does not fit (another model, damaged) is
    /// ignored with a warning and rewritten; one that is not a prompt cache stops the run.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["batch", "no_prefix_cache"])]
    pub prompt_cache: Option<PathBuf>,

    /// Propose tokens and check several in one forward pass: `lookup` drafts them from earlier
    /// text of the same prompt and reply (n-gram matching). The output is the model's own
    /// (greedy: identical; sampled: the same distribution); copy-heavy prompts decode faster.
    #[arg(long, value_enum, value_name = "HOW")]
    pub speculate: Option<Speculate>,

    /// Most tokens --speculate proposes per pass.
    #[arg(long, value_name = "K", default_value_t = 8, requires = "speculate")]
    pub draft_max: usize,

    /// Run on an OpenAI-compatible server instead of a local model: its base URL, such as
    /// http://gpu-box:8000/v1 (vLLM, SGLang, TGI, llama.cpp's llama-server). --chat uses
    /// /chat/completions (the server applies the template), otherwise /completions.
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,

    /// The server's API key (default: $OPENAI_API_KEY).
    #[arg(
        long,
        value_name = "KEY",
        env = "OPENAI_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,

    /// The model to ask the server for (default: the first it lists at /models).
    #[arg(long, value_name = "NAME", requires = "endpoint")]
    pub remote_model: Option<String>,

    /// With --endpoint and --batch: requests in flight at once, so the server's own batching
    /// fills its GPUs [default: 8].
    #[arg(long, value_name = "N", requires = "endpoint")]
    pub concurrency: Option<usize>,

    /// With --endpoint: seconds one try of a request may take (or stay silent) before it
    /// counts as failed [default: 600].
    #[arg(long, value_name = "SECS", requires = "endpoint")]
    pub timeout: Option<f64>,

    /// With --endpoint: retries of a request that failed in a way that may pass (no
    /// connection, 408, 429, 5xx, a stream cut short), with exponential backoff and jitter,
    /// honouring Retry-After [default: 4].
    #[arg(long, value_name = "N", requires = "endpoint")]
    pub retries: Option<u32>,

    /// Continue a batch run that died or was interrupted: skip the items OUT (its output so
    /// far) holds complete, run the others, as in `gen --batch IN --resume OUT >> OUT`.
    #[arg(long, value_name = "OUT.jsonl", requires = "batch")]
    pub resume: Option<PathBuf>,

    /// The shape of --batch's output lines: gen's own, or OpenAI's Batch API output.
    #[arg(long, value_enum, default_value_t = BatchOutput::Gen, requires = "batch")]
    pub batch_output: BatchOutput,

    /// Where to run: auto, cpu, cuda, cuda:N, metal.
    #[arg(long, default_value = "auto")]
    pub device: String,

    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,

    /// Report format on stderr.
    #[arg(long, value_enum, default_value_t = StatsFormat::Human)]
    pub stats: StatsFormat,

    /// Also write the report as one JSON object to FILE (whole or absent: written beside it,
    /// then renamed), whatever else reaches stderr and with -q too: what a script reads.
    #[arg(long, value_name = "FILE")]
    pub stats_file: Option<PathBuf>,

    /// Print no report and no progress bars.
    #[arg(short, long)]
    pub quiet: bool,

    /// Show the output of the tools gen runs: pip's own lines (and, on a terminal, its progress
    /// bar) while fetching a known model, instead of gen's one bar.
    #[arg(short, long, conflicts_with = "quiet")]
    pub verbose: bool,
}

/// `--reasoning`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReasoningArg {
    On,
    Off,
    Auto,
}

impl ReasoningArg {
    fn mode(self) -> crate::reasoning::Mode {
        match self {
            ReasoningArg::On => crate::reasoning::Mode::On,
            ReasoningArg::Off => crate::reasoning::Mode::Off,
            ReasoningArg::Auto => crate::reasoning::Mode::Auto,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Command {
    /// A multi-turn conversation.
    Chat,
    /// The perplexity of a text file.
    Perplexity,
    /// List the known short names (fetched or not) and the model files in gen's cache and the
    /// Hugging Face hub cache, with their sizes.
    Models,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BatchOutput {
    /// gen's lines: index, id, line, text (or error), tokens, stop, timings.
    Gen,
    /// OpenAI's Batch API output lines: custom_id, response {status_code, body}, error.
    Openai,
}

/// Where a run goes when it goes to a server (--endpoint).
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    pub url: String,
    pub key: Option<String>,
    pub model: Option<String>,
    pub concurrency: usize,
    pub policy: crate::remote::Policy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum JsonKind {
    /// A JSON object.
    Object,
    /// Any JSON value.
    Any,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WeightDtype {
    F32,
    F16,
    Bf16,
}

impl WeightDtype {
    pub fn to_dtype(self) -> candle_core::DType {
        match self {
            WeightDtype::F32 => candle_core::DType::F32,
            WeightDtype::F16 => candle_core::DType::F16,
            WeightDtype::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// How `--speculate` proposes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Speculate {
    /// From earlier text of the same sequence: the tokens that followed the last place its
    /// final few tokens occurred.
    Lookup,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StatsFormat {
    Human,
    Json,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptSource {
    Text(String),
    File(PathBuf),
    Stdin,
}

/// A batch run's input and sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchConfig {
    /// None: standard input.
    pub file: Option<PathBuf>,
    pub format: BatchFormat,
    pub batch_size: Option<usize>,
    pub kv_blocks: Option<usize>,
    /// `--n K` without `--batch`: the one prompt (`Config::prompt` or `--messages`), K times.
    pub one_prompt: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda(usize),
    Metal(usize),
}

impl std::str::FromStr for DeviceChoice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let ordinal = |rest: &str| -> Result<usize> {
            rest.parse()
                .map_err(|_| anyhow::anyhow!("bad device ordinal in --device {s:?}"))
        };
        Ok(match s {
            "auto" => Self::Auto,
            "cpu" => Self::Cpu,
            "cuda" => Self::Cuda(0),
            "metal" => Self::Metal(0),
            _ => match s.split_once(':') {
                Some(("cuda", n)) => Self::Cuda(ordinal(n)?),
                Some(("metal", n)) => Self::Metal(ordinal(n)?),
                _ => bail!("unknown device {s:?}: use auto, cpu, cuda, cuda:N or metal"),
            },
        })
    }
}

/// The run, resolved and validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub model: ModelSpec,
    /// Type of a checkpoint's weights; `None`: the device's default.
    pub dtype: Option<candle_core::DType>,
    pub tokenizer: Option<PathBuf>,
    pub offline: bool,
    pub prompt: PromptSource,
    /// Some: a batch run over many prompts (`prompt` is unused unless `one_prompt`).
    pub batch: Option<BatchConfig>,
    /// Completions of each prompt (`--n`; a batch line's `"n"` overrides it).
    pub n: usize,
    pub chat: bool,
    /// `gen chat`: the conversation loop (`chat` is then true too).
    pub interactive: bool,
    pub system: Option<String>,
    /// A conversation file to continue (--messages).
    pub messages: Option<PathBuf>,
    /// A chat template file replacing the model's (--chat-template).
    pub chat_template: Option<PathBuf>,
    /// --reasoning.
    pub reasoning: crate::reasoning::Mode,
    /// --reasoning-budget: thinking tokens before the block is closed.
    pub reasoning_budget: Option<usize>,
    /// --tools: OpenAI's `tools` array, read and checked.
    pub tools: Option<serde_json::Value>,
    /// --tool-choice, when the reply must be a call.
    pub tool_choice: Option<crate::tool_calls::Choice>,
    pub dry_run: bool,
    pub echo: bool,
    pub max_new: usize,
    pub stops: Vec<String>,
    pub stop_at_context: bool,
    pub ctx_size: Option<usize>,
    pub ignore_eos: bool,
    pub sampling: SamplingParams,
    /// What the reply must be (--json, --json-schema, --grammar, --regex); already checked.
    pub constraint: Option<Spec>,
    /// Some: run on this server instead of a local model.
    pub remote: Option<RemoteConfig>,
    /// --resume: the earlier output whose complete items are skipped.
    pub resume: Option<PathBuf>,
    pub batch_output: BatchOutput,
    pub device: DeviceChoice,
    pub threads: Option<usize>,
    pub stats: StatsFormat,
    /// --stats-file: the JSON report's own file.
    pub stats_file: Option<PathBuf>,
    pub quiet: bool,
    /// The prefix cache is on (not --no-prefix-cache).
    pub prefix_cache: bool,
    /// --prompt-cache FILE.
    pub prompt_cache: Option<PathBuf>,
    /// --speculate, with the most tokens proposed per pass.
    pub speculate: Option<(Speculate, usize)>,
    /// Show the fetch tools' own output (`--verbose`).
    pub verbose: bool,
    /// `gen perplexity [FILE]`: the run (`ctx_size` is then the window, 512 by default).
    pub perplexity: Option<PerplexityConfig>,
    /// `--logprobs N`: alternatives listed per generated token.
    pub logprobs: Option<usize>,
    /// `--prompt-logprobs N`: alternatives listed per prompt token.
    pub prompt_logprobs: Option<usize>,
}

impl Args {
    /// Counts that must be at least 1.
    fn check_counts(&self) -> Result<()> {
        if self.max_new == 0 {
            bail!("--max-new must be at least 1");
        }
        if self.threads == Some(0) {
            bail!("--threads must be at least 1");
        }
        if self.ctx_size == Some(0) {
            bail!("--ctx-size must be at least 1");
        }
        if self.batch_size == Some(0) {
            bail!("--batch-size must be at least 1");
        }
        if self.draft_max == 0 {
            bail!("--draft-max must be at least 1");
        }
        if self.kv_blocks == Some(0) {
            bail!("--kv-blocks must be at least 1");
        }
        Ok(())
    }

    /// `gen perplexity`'s settings (None for any other run), and the flags that apply only
    /// to it or never to it.
    fn perplexity_config(&mut self, interactive: bool) -> Result<Option<PerplexityConfig>> {
        let perplexity = self.command == Some(Command::Perplexity);
        let perplexity_file = match (perplexity, self.file.take()) {
            (true, f @ Some(_)) => Some(PerplexityConfig {
                file: f,
                kl_base: self.kl_divergence_base.take(),
                compare: self.kl_divergence,
            }),
            (true, None) if self.kl_divergence => Some(PerplexityConfig {
                file: None,
                kl_base: self.kl_divergence_base.take(),
                compare: true,
            }),
            (true, None) => bail!("gen perplexity needs a text file: gen perplexity FILE"),
            (false, Some(f)) => bail!(
                "unexpected argument '{}': the prompt goes in --prompt (or --prompt-file, or \
                 standard input)",
                f.display()
            ),
            (false, None) => None,
        };
        if perplexity {
            check_perplexity_flags(self)?;
        } else if self.kl_divergence_base.is_some() {
            bail!("--kl-divergence-base and --kl-divergence apply to gen perplexity");
        }
        for (flag, on) in [
            ("--logprobs", self.logprobs.is_some()),
            ("--prompt-logprobs", self.prompt_logprobs.is_some()),
        ] {
            if on && interactive {
                bail!("{flag} applies to one prompt and --batch, not gen chat");
            }
        }
        if self.prompt_logprobs.is_some() && self.endpoint.is_some() {
            bail!("--prompt-logprobs is not passed to a server (OpenAI's API has no such field): drop --endpoint or --prompt-logprobs");
        }
        Ok(perplexity_file)
    }

    /// Flags that apply only to some kinds of run (gen chat, --chat).
    fn check_modes(&self, interactive: bool) -> Result<()> {
        if self.tool_choice.is_some() && interactive {
            bail!("--tool-choice holds one reply to a call: with gen chat use --tools alone (or gen --chat, or --batch)");
        }
        if self.tools.is_some() && !(self.chat || interactive) {
            bail!("--tools offers tools through the chat template: add --chat (or use gen chat)");
        }
        if interactive
            && (self.batch.is_some() || self.prompt.is_some() || self.prompt_file.is_some())
        {
            bail!("gen chat takes its turns from the terminal or standard input: drop --prompt, --prompt-file and --batch");
        }
        if self.system.is_some() && !(self.chat || interactive) {
            bail!("--system applies to --chat and gen chat");
        }
        if interactive && self.dry_run {
            bail!("--dry-run applies to one prompt: use it with --chat (and --messages) instead of gen chat");
        }
        if self.chat_template.is_some() && !(self.chat || interactive) {
            bail!("--chat-template applies to --chat and gen chat");
        }
        if self.messages.is_some() && !(self.chat || interactive) {
            bail!("--messages applies to --chat and gen chat");
        }
        if interactive && self.prompt_cache.is_some() {
            bail!("--prompt-cache applies to one prompt; gen chat keeps its turns in the KV cache itself");
        }
        Ok(())
    }

    /// Validate and resolve. Every error here is a usage error (exit status 2).
    pub fn resolve(mut self) -> Result<Config> {
        self.check_counts()?;
        let interactive = self.command == Some(Command::Chat);
        let perplexity_file = self.perplexity_config(interactive)?;
        let tools = self
            .tools
            .as_deref()
            .map(crate::tool_calls::read_tools)
            .transpose()?;
        self.check_modes(interactive)?;
        let constrained = self.json.is_some()
            || self.json_schema.is_some()
            || self.grammar.is_some()
            || self.regex.is_some();
        let remote = remote_config(&self, interactive, constrained)?;
        let one_prompt = self.batch.is_none() && self.n > 1;
        if one_prompt && (interactive || self.dry_run || self.echo || self.prompt_cache.is_some()) {
            bail!("--n above 1 writes JSON lines, one per completion: it does not go with gen chat, --dry-run, --echo or --prompt-cache");
        }
        let batch = match self.batch {
            Some(file) => Some((file.as_os_str() != "-").then_some(file)),
            None => one_prompt.then_some(None),
        }
        .map(|file| BatchConfig {
            file,
            format: self.batch_format,
            batch_size: self.batch_size,
            kv_blocks: self.kv_blocks,
            one_prompt,
        });
        let seed = self.seed.unwrap_or_else(fresh_seed);
        let sampling = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed,
        };
        sampling.validate()?;
        let constraint = structured_spec(self.json, self.json_schema, self.grammar, self.regex)?;
        if interactive && constraint.is_some() {
            bail!("--json, --json-schema, --grammar and --regex apply to one prompt (and --batch), not gen chat");
        }
        let escape = |t: String| if self.no_escape { t } else { unescape(&t) };
        let prompt = match (self.prompt, self.prompt_file) {
            (_, Some(path)) => PromptSource::File(path),
            (Some(p), None) if p == "-" => PromptSource::Stdin,
            (Some(p), None) => PromptSource::Text(escape(p)),
            (None, None) => PromptSource::Stdin,
        };
        let stops: Vec<String> = self.stop.into_iter().map(escape).collect();
        let system = self.system.map(escape);
        let offline = self.offline || env_flag("HF_HUB_OFFLINE");
        let model = source::parse_model_arg(
            self.model.as_deref(),
            self.model_file.as_deref(),
            self.revision.as_deref(),
        )?;
        if let Some(dt) = self.dtype {
            if !model.is_checkpoint() {
                bail!(
                    "--dtype {} applies to Hugging Face checkpoints (a folder with config.json, or \
                     a hub repo without --model-file); GGUF weights keep the types in the file. \
                     HINT: drop --dtype",
                    dt.to_possible_value().map_or("?".into(), |v| v.get_name().to_string())
                );
            }
        }
        Ok(Config {
            model,
            dtype: self.dtype.map(WeightDtype::to_dtype),
            tokenizer: self.tokenizer,
            offline,
            prompt,
            batch,
            n: usize::from(self.n),
            chat: self.chat || interactive,
            interactive,
            system,
            messages: self.messages,
            chat_template: self.chat_template,
            // A budget of nothing: the template's switch turns thinking off, as llama.cpp does.
            reasoning: match (self.reasoning, self.reasoning_budget) {
                (ReasoningArg::Auto, Some(0)) => crate::reasoning::Mode::Off,
                (r, _) => r.mode(),
            },
            reasoning_budget: self.reasoning_budget,
            tool_choice: match (&tools, &self.tool_choice) {
                (Some(t), Some(c)) => crate::tool_calls::Choice::parse(c, t)?,
                _ => None,
            },
            tools,
            dry_run: self.dry_run,
            echo: self.echo,
            max_new: self.max_new,
            stops,
            stop_at_context: self.stop_at_context,
            // A comparison takes its windows from the base run.
            ctx_size: match perplexity_file.is_some() && !self.kl_divergence {
                true => Some(self.ctx_size.unwrap_or(512)),
                false => self.ctx_size,
            },
            ignore_eos: self.ignore_eos,
            sampling,
            constraint,
            remote,
            resume: self.resume,
            batch_output: self.batch_output,
            device: self.device.parse()?,
            threads: self.threads,
            prefix_cache: !self.no_prefix_cache,
            prompt_cache: self.prompt_cache,
            speculate: self.speculate.map(|s| (s, self.draft_max)),
            stats: self.stats,
            stats_file: self.stats_file,
            quiet: self.quiet,
            verbose: self.verbose,
            perplexity: perplexity_file,
            logprobs: self.logprobs.map(usize::from),
            prompt_logprobs: self.prompt_logprobs.map(usize::from),
        })
    }
}

/// `gen perplexity`'s own settings.
#[derive(Debug, Clone)]
pub struct PerplexityConfig {
    /// The text (None: the base run's, with `compare`).
    pub file: Option<PathBuf>,
    /// --kl-divergence-base: where the base run is saved, or read from with `compare`.
    pub kl_base: Option<PathBuf>,
    /// --kl-divergence.
    pub compare: bool,
}

/// The flags that mean nothing to `gen perplexity` (it reads its text from FILE and generates
/// nothing), refused rather than ignored.
fn check_perplexity_flags(a: &Args) -> Result<()> {
    let given = [
        ("--prompt", a.prompt.is_some()),
        ("--prompt-file", a.prompt_file.is_some()),
        ("--batch", a.batch.is_some()),
        ("--chat", a.chat),
        ("--messages", a.messages.is_some()),
        ("--endpoint", a.endpoint.is_some()),
        ("--echo", a.echo),
        ("--dry-run", a.dry_run),
        ("--prompt-cache", a.prompt_cache.is_some()),
        ("--speculate", a.speculate.is_some()),
        ("--tools", a.tools.is_some()),
        ("--logprobs", a.logprobs.is_some()),
        ("--prompt-logprobs", a.prompt_logprobs.is_some()),
        (
            "--json, --json-schema, --grammar or --regex",
            a.json.is_some() || a.json_schema.is_some() || a.grammar.is_some() || a.regex.is_some(),
        ),
    ];
    if let Some((flag, _)) = given.iter().find(|(_, on)| *on) {
        bail!("{flag} does not apply to gen perplexity, which scores the text of FILE");
    }
    Ok(())
}

/// A string from the command line with its escapes processed as llama.cpp's
/// `string_process_escapes` does: `\n`, `\r`, `\t`, `\\`, `\"`, `\'`, `\xHH` (one byte, as
/// Latin-1 would not be: the bytes are UTF-8 decoded after, lossily); any other backslash stays
/// as typed, and a trailing one too.
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' || i + 1 == b.len() {
            out.push(b[i]);
            i += 1;
            continue;
        }
        let c = b[i + 1];
        let simple = match c {
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            b'\\' | b'"' | b'\'' => Some(c),
            _ => None,
        };
        if let Some(v) = simple {
            out.push(v);
            i += 2;
            continue;
        }
        let hex = |j: usize| b.get(j).and_then(|h| (*h as char).to_digit(16));
        if c == b'x' {
            if let (Some(h), Some(l)) = (hex(i + 2), hex(i + 3)) {
                out.push((h * 16 + l) as u8);
                i += 4;
                continue;
            }
        }
        out.push(b'\\');
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// gen chat's slash commands, as `/help` and `gen chat --help` list them.
pub const CHAT_COMMANDS: &str = "\
commands:
  /help                 this list
  /reset                start over (the system message stays)
  /system TEXT          set the system message (/system alone removes it)
  /undo                 drop the last exchange
  /save FILE            write the conversation as JSON ({\"role\", \"content\"} messages)
  /load FILE            continue a conversation saved with /save (or --messages)
  /set NAME VALUE       temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                        presence_penalty, frequency_penalty, seed, max_new
  /stats                the last reply's full report
  /tool TEXT            the result of the model's pending tool call (with --tools); the
                        model then replies
  /exit                 end the chat (also Ctrl-D, or Ctrl-C on an empty line)
A line ending in \\ continues on the next line (also Alt-Enter); Ctrl-C stops a reply.";

/// The help a command line asks for that clap does not give itself: `gen help` (the long help),
/// `gen help chat` and `gen chat --help` (it, with gen chat's slash commands). None otherwise.
pub fn help_request(args: &[std::ffi::OsString]) -> Option<String> {
    use clap::CommandFactory;
    let words: Vec<&str> = args.iter().skip(1).filter_map(|a| a.to_str()).collect();
    let chat = match words.as_slice() {
        ["help"] => false,
        ["help", "chat"] => true,
        w if w.first() == Some(&"chat") && w.iter().any(|a| *a == "--help" || *a == "-h") => true,
        _ => return None,
    };
    let help = Args::command().render_long_help().to_string();
    Some(match chat {
        false => help,
        true => format!(
            "gen chat: a conversation in the terminal, or one user turn per line of standard \
             input. It takes the flags below (model, sampling, --system, --messages, ...).\n\n\
             {}\n\n{help}",
            CHAT_COMMANDS
        ),
    })
}

/// `-sys` (llama-cli's spelling of `--system-prompt`, a short flag of three letters that clap
/// cannot declare) as `--system`; every other argument as it is.
pub fn llama_spellings(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    args.into_iter()
        .map(|a| if a == "-sys" { "--system".into() } else { a })
        .collect()
}

/// --endpoint and what goes with it, checked.
fn remote_config(a: &Args, interactive: bool, constrained: bool) -> Result<Option<RemoteConfig>> {
    let Some(url) = &a.endpoint else {
        return Ok(None);
    };
    if interactive {
        bail!("gen chat runs a local model; with --endpoint use --chat (one turn) or --batch with \"messages\"");
    }
    if constrained {
        bail!("--json, --json-schema, --grammar and --regex run on local models only; drop them with --endpoint");
    }
    if a.dry_run {
        bail!("--dry-run shows the local chat template's text; with --endpoint the server applies its own");
    }
    if a.prompt_cache.is_some() || a.no_prefix_cache {
        bail!("--prompt-cache and --no-prefix-cache are about the local KV cache; with --endpoint the server keeps its own");
    }
    if a.reasoning_budget.is_some() {
        bail!("--reasoning-budget runs on local models only; with --endpoint the server sets its own (llama-server --reasoning-budget)");
    }
    if (a.tools.is_some() || a.reasoning != ReasoningArg::Auto)
        && !(a.chat || a.messages.is_some() || a.batch.is_some())
    {
        bail!("--tools and --reasoning go to the server's chat template: add --chat");
    }
    if a.speculate.is_some() {
        bail!("--speculate runs on local models only (a server decodes as it is configured to); drop it with --endpoint");
    }
    let concurrency = a.concurrency.unwrap_or(8);
    if concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    let timeout = a.timeout.unwrap_or(600.0);
    if !(timeout.is_finite() && timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds, got {timeout}");
    }
    Ok(Some(RemoteConfig {
        url: url.clone(),
        key: a.api_key.clone().filter(|k| !k.is_empty()),
        model: a.remote_model.clone(),
        concurrency,
        policy: crate::remote::Policy {
            attempts: a.retries.unwrap_or(4).saturating_add(1),
            timeout: std::time::Duration::from_secs_f64(timeout),
            ..crate::remote::Policy::default()
        },
    }))
}

/// The constraint asked for on the command line, compiled once to refuse a bad one before
/// anything loads.
fn structured_spec(
    json: Option<JsonKind>,
    json_schema: Option<String>,
    grammar: Option<String>,
    regex: Option<String>,
) -> Result<Option<Spec>> {
    let (spec, flag) = match (json, json_schema, grammar, regex) {
        (Some(JsonKind::Object), ..) => (Spec::json_object(), "--json".to_string()),
        (Some(JsonKind::Any), ..) => (Spec::AnyJson, "--json=any".to_string()),
        (_, Some(arg), ..) => (
            Spec::schema_from_arg(&arg).map_err(|e| anyhow::anyhow!("--json-schema: {e:#}"))?,
            "--json-schema".to_string(),
        ),
        (_, _, Some(arg), _) if arg.contains("::=") && !Path::new(&arg).is_file() => {
            (Spec::Grammar(arg), "--grammar".to_string())
        }
        (_, _, Some(path), _) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| anyhow::anyhow!("--grammar: cannot read {path}: {e}"))?;
            (Spec::Grammar(text), format!("--grammar {path}"))
        }
        (_, _, _, Some(rx)) => (Spec::Regex(rx), "--regex".to_string()),
        _ => return Ok(None),
    };
    spec.check().map_err(|e| anyhow::anyhow!("{flag}: {e:#}"))?;
    Ok(Some(spec))
}

/// True when an environment variable is set to something other than empty, 0, false or no.
pub fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .map(|v| {
            !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "" | "0" | "false" | "no" | "off"
            )
        })
        .unwrap_or(false)
}

fn fresh_seed() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (t as u64) ^ ((std::process::id() as u64) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config> {
        let mut v = vec!["gen"];
        v.extend_from_slice(args);
        Args::try_parse_from(v)?.resolve()
    }

    #[test]
    fn devices_parse() {
        assert_eq!("auto".parse::<DeviceChoice>().unwrap(), DeviceChoice::Auto);
        assert_eq!(
            "cuda:3".parse::<DeviceChoice>().unwrap(),
            DeviceChoice::Cuda(3)
        );
        assert_eq!(
            "metal".parse::<DeviceChoice>().unwrap(),
            DeviceChoice::Metal(0)
        );
        assert!("tpu".parse::<DeviceChoice>().is_err());
        assert!("cuda:x".parse::<DeviceChoice>().is_err());
    }

    #[test]
    fn prompt_sources() {
        assert_eq!(
            parse(&["--prompt", "hi"]).unwrap().prompt,
            PromptSource::Text("hi".into())
        );
        assert_eq!(
            parse(&["--prompt", "-"]).unwrap().prompt,
            PromptSource::Stdin
        );
        assert_eq!(parse(&[]).unwrap().prompt, PromptSource::Stdin);
        assert_eq!(
            parse(&["--prompt-file", "p.txt"]).unwrap().prompt,
            PromptSource::File("p.txt".into())
        );
        assert!(parse(&["--prompt", "a", "--prompt-file", "p.txt"]).is_err());
    }

    #[test]
    fn bad_values_are_refused() {
        for bad in [
            &["--max-new", "0"][..],
            &["--temperature", "-1"],
            &["--top-p", "0"],
            &["--top-p", "1.01"],
            &["--device", "tpu"],
            &["--threads", "0"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn dtype_is_only_for_checkpoints() {
        let cfg = parse(&["--model", "owner/name", "--dtype", "bf16"]).unwrap();
        assert_eq!(cfg.dtype, Some(candle_core::DType::BF16));
        assert_eq!(parse(&["--model", "o/n"]).unwrap().dtype, None);
        for gguf in [
            &["--dtype", "f16"][..],
            &["--model", "o/n", "--model-file", "m.gguf", "--dtype", "f32"],
        ] {
            let err = parse(gguf).unwrap_err().to_string();
            assert!(err.contains("--dtype") && err.contains("HINT"), "{err}");
        }
        assert!(parse(&["--model", "o/n", "--dtype", "f64"]).is_err());
    }

    #[test]
    fn batch_flags() {
        let b = parse(&["--batch", "p.jsonl", "--batch-size", "4"])
            .unwrap()
            .batch
            .unwrap();
        assert_eq!(b.file, Some(PathBuf::from("p.jsonl")));
        assert_eq!((b.batch_size, b.format), (Some(4), BatchFormat::Auto));
        assert_eq!(parse(&["--batch", "-"]).unwrap().batch.unwrap().file, None);
        assert_eq!(parse(&[]).unwrap().batch, None);
        for bad in [
            &["--batch", "p", "--prompt", "x"][..],
            &["--batch", "p", "--echo"],
            &["--batch", "p", "--batch-size", "0"],
            &["--batch-size", "4"],
            &["--kv-blocks", "4"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn seed_given_is_kept() {
        assert_eq!(parse(&["--seed", "7"]).unwrap().sampling.seed, 7);
    }

    #[test]
    fn remote_flags_need_an_endpoint_and_refuse_local_only_ones() {
        let url = "http://127.0.0.1:8000/v1";
        let rc = parse(&["--endpoint", url, "--concurrency", "32", "--retries", "0"])
            .unwrap()
            .remote
            .unwrap();
        assert_eq!((rc.concurrency, rc.policy.attempts), (32, 1));
        let rc = parse(&["--endpoint", url]).unwrap().remote.unwrap();
        assert_eq!(rc.concurrency, 8);
        assert!(parse(&[]).unwrap().remote.is_none());
        for bad in [
            &["--concurrency", "4"][..],
            &["--timeout", "5"],
            &["--remote-model", "m"],
            &["--endpoint", url, "--concurrency", "0"],
            &["--endpoint", url, "--timeout", "-1"],
            &["--endpoint", url, "--json"],
            &["--endpoint", url, "--dry-run", "--chat"],
            &["--endpoint", url, "--speculate", "lookup"],
            &["chat", "--endpoint", url],
            &["--endpoint", "gpu-box:8000"],
            &["--resume", "out.jsonl"],
        ] {
            let err = parse(bad);
            // A bad URL is found when connecting; the rest before anything runs.
            if bad.contains(&"gpu-box:8000") {
                assert!(err.is_ok());
                continue;
            }
            assert!(err.is_err(), "{bad:?} was accepted");
        }
    }
}
