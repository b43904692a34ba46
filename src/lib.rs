//! gen: a command-line text generator for local language models.
//!
//! Reading order: `source` (where the model files are) -> `format` (reading and checking GGUF
//! files and Hugging Face checkpoints) -> `model` (loading, the forward pass) -> `tokenizer` (text <-> ids) -> `sampler` -> `generate` (the loop) -> `batch` (many prompts per pass) -> `output` (streaming
//! text out) -> `report` -> `cli` (flags resolved into a `Config`) -> `app` (the wiring).

pub mod app;
pub mod batch;
pub mod batch_input;
pub mod chat;
pub mod cli;
pub mod constraint;
pub mod conversation;
pub mod format;
pub mod gbnf;
pub mod generate;
pub mod interrupt;
pub mod logprobs;
pub mod model;
pub mod output;
pub mod perplexity;
pub mod prompt_cache;
pub mod reasoning;
pub mod remote;
pub mod report;
pub mod sampler;
pub mod source;
pub mod speculate;
pub mod tokenizer;
pub mod tool_calls;
