//! Reading model files before anything trusts them: GGUF headers and metadata checked against
//! the file's real size ([`gguf`]), and checkpoints, GGUF files or Hugging Face folders of
//! config.json and safetensors, as one set of named tensors and GGUF-style metadata
//! ([`checkpoint`]), GGUF files mapped into memory ([`mapped`]), a checked header decoded for
//! candle's loader ([`header`]). Nothing here knows how a model runs.

pub mod checkpoint;
pub mod gguf;
pub mod header;
pub mod mapped;
