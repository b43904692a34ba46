//! gen: a command-line text generator for local language models.
//!
//! Reading order: `source` (where the model files are) -> `model` (loading, the forward pass)
//! -> `tokenizer` (text <-> ids, streaming text out) -> `sampler` -> `generate` (the loop)
//! -> `report` -> `cli` (flags resolved into a `Config`) -> `app` (wires it all together).

pub mod source;
pub mod tokenizer;
