//! Fetches a file, or a whole safetensors checkpoint, from a Hugging Face hub repo into the
//! shared HF cache, via hf-hub's sync API.
//!
//! The environment is read once into a [`HubConfig`] (HF_ENDPOINT, HF_HOME / HF_HUB_CACHE,
//! HF_TOKEN / the token file, HF_HUB_OFFLINE) so the download itself depends only on its
//! arguments: tests run it against a local server without touching the process environment.
//!
//! A file already in the cache for the requested revision is used without asking the hub (fast,
//! works offline); in offline mode only the cache is consulted. A checkpoint counts as cached
//! when its config.json, tokenizer.json and every weight file are.
use std::fs::{self, File};
use std::path::{Component, Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};
use indicatif::ProgressBar;

use super::FetchOptions;
use crate::format::checkpoint::{
    self, CHAT_TEMPLATE_FILE, CONFIG_FILE, SINGLE_WEIGHTS_FILE, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE, WEIGHTS_INDEX_FILE,
};

/// The hub used when HF_ENDPOINT is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Everything the hub download takes from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubConfig {
    /// Base URL of the hub, without a trailing slash.
    pub endpoint: String,
    /// The hub cache (`models--owner--name/{blobs,snapshots,refs}` live here).
    pub cache_dir: PathBuf,
    /// Sent as `Authorization: Bearer ...`.
    pub token: Option<String>,
    /// Use only the cache; never touch the network.
    pub offline: bool,
}

impl HubConfig {
    /// Read the configuration from the process environment (empty values count as unset).
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Build the configuration from a variable lookup, the way huggingface_hub reads it:
    /// - endpoint: HF_ENDPOINT, else <https://huggingface.co>;
    /// - cache: HF_HUB_CACHE, else `$HF_HOME/hub`, where HF_HOME defaults to
    ///   `$XDG_CACHE_HOME/huggingface`, then `~/.cache/huggingface`;
    /// - token: HF_TOKEN, else the file HF_TOKEN_PATH, else `$HF_HOME/token` (what
    ///   `huggingface-cli login` writes);
    /// - offline: HF_HUB_OFFLINE set to 1, true, yes or on.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let endpoint = var("HF_ENDPOINT")
            .map(|e| e.trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            match var("XDG_CACHE_HOME") {
                Some(xdg) => PathBuf::from(xdg),
                None => super::home_dir(&var).join(".cache"),
            }
            .join("huggingface")
        });
        let cache_dir = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token = var("HF_TOKEN").map(|t| t.trim().to_string()).or_else(|| {
            let path = var("HF_TOKEN_PATH")
                .map(PathBuf::from)
                .unwrap_or_else(|| hf_home.join("token"));
            let text = fs::read_to_string(path).ok()?;
            Some(text.trim().to_string()).filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        HubConfig {
            endpoint,
            cache_dir,
            token,
            offline,
        }
    }
}

/// A path inside the cache built from user input must stay inside it.
fn check_relative(what: &str, value: &str) -> Result<()> {
    let path = Path::new(value);
    let ok = !value.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_)));
    if !ok {
        bail!("invalid {what} {value:?}: it must be a relative path inside the repo, without `..`");
    }
    Ok(())
}

/// Return the local path of `file` in hub repo `repo` at `revision` (default `main`),
/// downloading it into the HF cache unless it is there already.
pub fn fetch(
    cfg: &HubConfig,
    repo: &str,
    file: &str,
    revision: Option<&str>,
    opts: &FetchOptions,
) -> Result<PathBuf> {
    let revision = revision.unwrap_or("main");
    check_relative("repo id", repo)?;
    check_relative("--model-file", file)?;
    check_relative("--revision", revision)?;
    let hf_repo = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
    let cache = Cache::new(cfg.cache_dir.clone());
    let what = format!("{file} from hub repo {repo} (revision {revision})");

    if let Some(path) = cache.repo(hf_repo.clone()).get(file) {
        return Ok(path);
    }
    if cfg.offline || opts.offline {
        bail!(
            "{what} is not in the hub cache {} and offline mode (HF_HUB_OFFLINE / --offline) \
             forbids downloading it. HINT: run once online, or pass --model PATH to a local .gguf file",
            cfg.cache_dir.display()
        );
    }

    fs::create_dir_all(&cfg.cache_dir).with_context(|| {
        format!(
            "cannot create the hub cache {}. HINT: set HF_HOME to a writable folder",
            cfg.cache_dir.display()
        )
    })?;
    // hf-hub's own lock gives up after 5 s; a second gen process fetching the same repo waits
    // here instead, then finds the file in the cache.
    let _lock = lock_repo(&cfg.cache_dir, &hf_repo)?;
    if let Some(path) = cache.repo(hf_repo.clone()).get(file) {
        return Ok(path);
    }
    let api = ApiBuilder::from_cache(cache)
        .with_endpoint(cfg.endpoint.clone())
        .with_token(cfg.token.clone())
        .with_progress(opts.progress)
        .build()
        .map_err(|e| anyhow!("cannot set up the hub client: {e}"))?;
    api.repo(hf_repo)
        .get(file)
        .map_err(|e| describe(e, &what, &cfg.endpoint, &cfg.cache_dir).1)
}

/// Return the local folder of the safetensors checkpoint in hub repo `repo` at `revision`
/// (default `main`): config.json, tokenizer.json, tokenizer_config.json and chat_template.jinja
/// when the repo has them, and model.safetensors or model.safetensors.index.json with every
/// shard it names. Downloads what the cache lacks, with one progress bar for the weights.
pub fn fetch_checkpoint(
    cfg: &HubConfig,
    repo: &str,
    revision: Option<&str>,
    opts: &FetchOptions,
) -> Result<PathBuf> {
    let revision = revision.unwrap_or("main");
    check_relative("repo id", repo)?;
    check_relative("--revision", revision)?;
    let hf_repo = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
    let cache = Cache::new(cfg.cache_dir.clone());
    let what = format!("hub repo {repo} (revision {revision})");

    if let Some(dir) = cached_checkpoint(&cache, &hf_repo)? {
        return Ok(dir);
    }
    if cfg.offline || opts.offline {
        bail!(
            "the checkpoint of {what} is not (completely) in the hub cache {} and offline mode \
             (HF_HUB_OFFLINE / --offline) forbids downloading it. HINT: run once online, or \
             pass --model PATH to a local checkpoint folder or .gguf file",
            cfg.cache_dir.display()
        );
    }
    fs::create_dir_all(&cfg.cache_dir).with_context(|| {
        format!(
            "cannot create the hub cache {}. HINT: set HF_HOME to a writable folder",
            cfg.cache_dir.display()
        )
    })?;
    let _lock = lock_repo(&cfg.cache_dir, &hf_repo)?;
    if let Some(dir) = cached_checkpoint(&cache, &hf_repo)? {
        return Ok(dir);
    }
    let api = ApiBuilder::from_cache(cache.clone())
        .with_endpoint(cfg.endpoint.clone())
        .with_token(cfg.token.clone())
        .with_progress(false)
        .build()
        .map_err(|e| anyhow!("cannot set up the hub client: {e}"))?;
    let api_repo = api.repo(hf_repo.clone());
    let bar = Bar(super::fetch::progress_bar(
        opts,
        0,
        format!("downloading {repo}"),
    ));
    // Ok(None): the repo has no such file.
    let get = |file: &str, bar: &Bar| -> Result<Option<PathBuf>> {
        if let Some(path) = cache.repo(hf_repo.clone()).get(file) {
            if let Ok(meta) = fs::metadata(&path) {
                bar.0.inc(meta.len());
            }
            return Ok(Some(path));
        }
        let file_what = format!("{file} from {what}");
        match api_repo.download_with_progress(file, bar.clone()) {
            Ok(path) => Ok(Some(path)),
            Err(e) => match describe(e, &file_what, &cfg.endpoint, &cfg.cache_dir) {
                (Some(404), _) => Ok(None),
                (_, err) => Err(err),
            },
        }
    };
    let quiet = Bar(ProgressBar::hidden());

    let config = get(CONFIG_FILE, &quiet)?.with_context(|| {
        format!(
            "{what} has no {CONFIG_FILE}, so it is not a Hugging Face checkpoint. HINT: for a \
             repo of GGUF files, add --model-file NAME.gguf"
        )
    })?;
    let dir = config
        .parent()
        .context("a cached file has no folder")?
        .to_path_buf();
    // Refuse an unsupported model before downloading gigabytes of it.
    let text =
        fs::read_to_string(&config).with_context(|| format!("cannot read {}", config.display()))?;
    checkpoint::HfConfig::parse(&text).with_context(|| format!("{CONFIG_FILE} of {what}"))?;
    let mut files = vec![(CONFIG_FILE.to_string(), config)];
    let tokenizer = get(TOKENIZER_FILE, &quiet)?.with_context(|| {
        format!("{what} has no {TOKENIZER_FILE}. HINT: pass --tokenizer PATH with a local one")
    })?;
    files.push((TOKENIZER_FILE.into(), tokenizer));
    for optional in [TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE] {
        if let Some(path) = get(optional, &quiet)? {
            files.push((optional.into(), path));
        }
    }
    match get(WEIGHTS_INDEX_FILE, &quiet)? {
        Some(index) => {
            let text = fs::read_to_string(&index)
                .with_context(|| format!("cannot read {}", index.display()))?;
            let shards = checkpoint::shard_names(&text)
                .with_context(|| format!("{WEIGHTS_INDEX_FILE} of {what}"))?;
            bar.0.set_length(index_total_size(&text).unwrap_or(0));
            files.push((WEIGHTS_INDEX_FILE.into(), index));
            for shard in shards {
                let path = get(&shard, &bar)?.with_context(|| {
                    format!("{what}: {WEIGHTS_INDEX_FILE} names {shard}, which the repo lacks")
                })?;
                files.push((shard, path));
            }
        }
        None => {
            let path = get(SINGLE_WEIGHTS_FILE, &bar)?.with_context(|| {
                format!(
                    "{what} has neither {SINGLE_WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}. HINT: gen \
                     reads safetensors checkpoints; for GGUF files add --model-file NAME.gguf"
                )
            })?;
            files.push((SINGLE_WEIGHTS_FILE.into(), path));
        }
    }
    bar.0.finish_and_clear();
    // Files fetched from different commits (the branch moved meanwhile) land in different
    // snapshot folders; the model must come from one.
    if let Some((name, _)) = files.iter().find(|(name, path)| *path != dir.join(name)) {
        bail!(
            "{what} changed while downloading ({name} comes from another commit than \
             {CONFIG_FILE}). HINT: run again, or pin --revision to a commit"
        );
    }
    Ok(dir)
}

/// The snapshot folder when config.json, tokenizer.json and all the weights are cached.
fn cached_checkpoint(cache: &Cache, repo: &Repo) -> Result<Option<PathBuf>> {
    let cached = |file: &str| cache.repo(repo.clone()).get(file);
    let (Some(config), Some(_)) = (cached(CONFIG_FILE), cached(TOKENIZER_FILE)) else {
        return Ok(None);
    };
    let Some(dir) = config.parent().map(Path::to_path_buf) else {
        return Ok(None);
    };
    let weights = match cached(WEIGHTS_INDEX_FILE) {
        Some(index) => {
            let text = fs::read_to_string(&index)
                .with_context(|| format!("cannot read {}", index.display()))?;
            let shards =
                checkpoint::shard_names(&text).with_context(|| format!("{}", index.display()))?;
            shards.iter().all(|s| cached(s).is_some())
        }
        None => cached(SINGLE_WEIGHTS_FILE).is_some(),
    };
    Ok(weights.then_some(dir))
}

/// `metadata.total_size` of a safetensors index: the bytes of all tensors.
fn index_total_size(index_json: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(index_json).ok()?;
    v.get("metadata")?.get("total_size")?.as_u64()
}

/// One progress bar over several downloads: each file adds to it.
#[derive(Clone)]
struct Bar(ProgressBar);

impl Progress for Bar {
    fn init(&mut self, size: usize, _filename: &str) {
        // The index's total counts tensor bytes only; grow the bar if the files are larger.
        let need = self.0.position() + size as u64;
        if self.0.length().is_none_or(|len| len < need) {
            self.0.set_length(need);
        }
    }

    fn update(&mut self, size: usize) {
        self.0.inc(size as u64);
    }

    fn finish(&mut self) {}
}

fn lock_repo(cache_dir: &Path, repo: &Repo) -> Result<File> {
    let dir = cache_dir.join(".locks").join("gen");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{}.lock", repo.folder_name()));
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    file.lock()
        .with_context(|| format!("cannot lock {}", path.display()))?;
    Ok(file)
}

/// A network failure mid-body (as opposed to a local disk problem).
fn is_broken_transfer(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | TimedOut
    )
}

/// The HTTP status if there was one, and one line: what failed and what to do about it.
fn describe(
    err: ApiError,
    what: &str,
    endpoint: &str,
    cache_dir: &Path,
) -> (Option<u16>, anyhow::Error) {
    let err = match err {
        ApiError::RequestError(request) => {
            let text = request.to_string();
            match (*request).into_response() {
                Some(response) => {
                    let status = response.status();
                    let hint = match status {
                        401 | 403 => "HINT: set HF_TOKEN to a token that can read this repo",
                        404 => "HINT: check the repo id, --model-file and --revision",
                        _ => "HINT: try again later, or pass --model PATH to a local .gguf file",
                    };
                    return (
                        Some(status),
                        anyhow!(
                            "could not download {what}: HTTP {status} {} from {endpoint}. {hint}",
                            response.status_text()
                        ),
                    );
                }
                None => anyhow!(
                    "could not download {what}: cannot reach {endpoint} ({text}). HINT: check the \
                     network and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use only cached files"
                ),
            }
        }
        ApiError::MissingHeader(_) | ApiError::InvalidHeader(_) => anyhow!(
            "could not download {what}: {endpoint} did not answer like a Hugging Face hub ({err}). \
             HINT: check HF_ENDPOINT"
        ),
        ApiError::LockAcquisition(path) => anyhow!(
            "could not download {what}: another program is downloading it ({} is locked). \
             HINT: wait for it to finish and try again",
            path.display()
        ),
        ApiError::IoError(e) if is_broken_transfer(&e) => anyhow!(
            "could not download {what}: the transfer from {endpoint} broke off ({e}). HINT: run \
             again to resume it"
        ),
        other => anyhow!(
            "could not download {what} into {}: {other}. HINT: check free space and permissions \
             there (HF_HOME), or pass --model PATH to a local .gguf file",
            cache_dir.display()
        ),
    };
    (None, err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bar_counts_every_file() {
        // Sharded: the index's total first; a file larger than the total grows the bar.
        let mut bar = Bar(ProgressBar::hidden());
        bar.0.set_length(100);
        bar.init(60, "a");
        assert_eq!(bar.0.length(), Some(100));
        bar.update(60);
        bar.init(50, "b");
        bar.update(50);
        assert_eq!((bar.0.position(), bar.0.length()), (110, Some(110)));
        // One file: its size is the bar's length.
        let mut bar = Bar(ProgressBar::hidden());
        bar.0.set_length(0);
        bar.init(30, "model.safetensors");
        assert_eq!(bar.0.length(), Some(30));
    }

    #[test]
    fn rejects_paths_that_leave_the_cache() {
        for bad in ["", "../x", "a/../../b", "/etc/passwd"] {
            assert!(check_relative("--model-file", bad).is_err(), "{bad}");
        }
        for good in ["model.gguf", "sub/dir/model.gguf", "v1.0"] {
            assert!(check_relative("--model-file", good).is_ok(), "{good}");
        }
    }
}
