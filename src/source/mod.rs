//! Where the model files are: a local path, a known model fetched into gen's cache, or a hub repo.
//! (Interface placeholder: being written.)
use std::path::PathBuf;

/// Options that change how a model is fetched.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// Draw progress bars on stderr.
    pub progress: bool,
    /// Never touch the network: use only what is already cached.
    pub offline: bool,
}

/// What the user asked for with `--model` (and `--model-file`, `--revision`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// A local `.gguf` file.
    Path(PathBuf),
    /// A short name from gen's registry of known models, e.g. `smollm2-135m`.
    Known(String),
    /// A Hugging Face repo id with a file in it.
    Hub { repo: String, file: String, revision: Option<String> },
}

/// Turn the command-line words into a spec (no I/O besides checking whether a path exists).
pub fn parse_model_arg(
    _model: Option<&str>,
    _model_file: Option<&str>,
    _revision: Option<&str>,
) -> anyhow::Result<ModelSpec> {
    anyhow::bail!("source::parse_model_arg is being written")
}

/// Make the model file available locally and return its path.
pub fn resolve(_spec: &ModelSpec, _opts: &FetchOptions) -> anyhow::Result<PathBuf> {
    anyhow::bail!("source::resolve is being written")
}
