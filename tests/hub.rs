//! Hub downloads against a small hub server on 127.0.0.1, written here.
//!
//! The server speaks just enough HTTP/1.1 for hf-hub 0.4's sync client: `GET` (and `HEAD`) on
//! `/{owner}/{name}/resolve/{revision}/{file}`, honouring `Range` (hf-hub first asks for
//! `bytes=0-0` to learn the size from `Content-Range`, with the `ETag` and `X-Repo-Commit`
//! headers, then downloads with `bytes=N-`). Every request is logged for the assertions.
mod common;

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use gen::source::hub::{fetch, fetch_checkpoint, HubConfig};
use gen::source::{parse_model_arg, resolve, FetchOptions};
use sha2::{Digest, Sha256};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A folder under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let path = std::env::temp_dir().join(format!("gen-hub-{tag}-{}-{n}", std::process::id()));
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

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: HashMap<String, String>,
}

/// The hub: files by repo-relative path (`owner/name/file`), served at any revision.
struct Hub {
    addr: SocketAddr,
    /// When set, the next download (a GET from byte 0 for more than one byte) sends only half
    /// the body and hangs up, as a dropped connection would.
    cut_next_download: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Hub {
    fn start(files: Vec<(&str, Vec<u8>)>, required_token: Option<&str>) -> Hub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(AtomicBool::new(false));
        let files: HashMap<String, Vec<u8>> =
            files.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let required = required_token.map(|t| format!("Bearer {t}"));
        let thread = {
            let (log, stop, cut) = (log.clone(), stop.clone(), cut.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(conn) = conn {
                        // A broken client connection must not take the server down.
                        let _ = serve(conn, &files, required.as_deref(), &log, &cut);
                    }
                }
            })
        };
        Hub {
            addr,
            cut_next_download: cut,
            log,
            stop,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.log.lock().unwrap().clone()
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag; then the port is closed.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

fn serve(
    conn: TcpStream,
    files: &HashMap<String, Vec<u8>>,
    required: Option<&str>,
    log: &Mutex<Vec<Seen>>,
    cut: &AtomicBool,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut words = line.split_whitespace();
    let (Some(method), Some(path)) = (words.next(), words.next()) else {
        return Ok(());
    };
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let seen = Seen {
        method: method.to_string(),
        path: path.to_string(),
        headers,
    };
    log.lock().unwrap().push(seen.clone());

    let mut out = conn;
    let respond = |out: &mut TcpStream, status: &str, extra: &[String], body: &[u8]| {
        let mut head = format!(
            "HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for h in extra {
            head.push_str(h);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        out.write_all(head.as_bytes())?;
        if seen.method != "HEAD" {
            out.write_all(body)?;
        }
        out.flush()
    };
    if let Some(required) = required {
        if seen.headers.get("authorization").map(String::as_str) != Some(required) {
            return respond(
                &mut out,
                "401 Unauthorized",
                &["X-Error-Code: GatedRepo".into()],
                b"unauthorized",
            );
        }
    }
    // /{owner}/{name}/resolve/{revision}/{file}
    let parts: Vec<&str> = seen.path.trim_start_matches('/').splitn(5, '/').collect();
    let found = match parts.as_slice() {
        [owner, name, "resolve", _revision, file] => files.get(&format!("{owner}/{name}/{file}")),
        _ => None,
    };
    let Some(body) = found else {
        return respond(
            &mut out,
            "404 Not Found",
            &["X-Error-Code: EntryNotFound".into()],
            b"Entry not found",
        );
    };
    let etag = Sha256::digest(body)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>();
    let mut extra = vec![
        format!("ETag: \"{etag}\""),
        format!("X-Repo-Commit: {COMMIT}"),
        "Accept-Ranges: bytes".to_string(),
    ];
    let range = seen.headers.get("range").and_then(|r| {
        let (start, end) = r.strip_prefix("bytes=")?.split_once('-')?;
        let start: usize = start.parse().ok()?;
        let end: usize = if end.is_empty() {
            body.len() - 1
        } else {
            end.parse().ok()?
        };
        (start <= end && end < body.len()).then_some((start, end))
    });
    match range {
        Some((0, end)) if end > 0 && cut.swap(false, Ordering::SeqCst) => {
            extra.push(format!("Content-Range: bytes 0-{end}/{}", body.len()));
            let head = format!(
                "HTTP/1.1 206 Partial Content\r\nConnection: close\r\nContent-Length: {}\r\n{}\r\n\r\n",
                end + 1,
                extra.join("\r\n")
            );
            out.write_all(head.as_bytes())?;
            out.write_all(&body[..body.len() / 2])?;
            out.flush()
        }
        Some((start, end)) => {
            extra.push(format!("Content-Range: bytes {start}-{end}/{}", body.len()));
            respond(&mut out, "206 Partial Content", &extra, &body[start..=end])
        }
        None => respond(&mut out, "200 OK", &extra, body),
    }
}

/// A model-ish payload large enough to need several reads.
fn payload() -> Vec<u8> {
    (0..200_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect()
}

fn config(endpoint: &str, home: &TempDir) -> HubConfig {
    HubConfig {
        endpoint: endpoint.to_string(),
        cache_dir: home.0.join("hub"),
        token: None,
        offline: false,
    }
}

fn quiet() -> FetchOptions {
    FetchOptions::default()
}

/// An address where nothing listens.
fn closed_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

#[test]
fn downloads_into_the_hf_cache_layout_then_works_offline() {
    let data = payload();
    let hub = Hub::start(vec![("owner/name/model.gguf", data.clone())], None);
    let home = TempDir::new("layout");
    let cfg = config(&hub.url(), &home);
    let path = fetch(&cfg, "owner/name", "model.gguf", None, &quiet()).unwrap();

    let repo_dir = home.0.join("hub").join("models--owner--name");
    assert_eq!(
        path,
        repo_dir.join("snapshots").join(COMMIT).join("model.gguf")
    );
    assert_eq!(fs::read(&path).unwrap(), data);
    assert_eq!(
        fs::read_to_string(repo_dir.join("refs").join("main")).unwrap(),
        COMMIT
    );
    let etag: String = Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(fs::read(repo_dir.join("blobs").join(etag)).unwrap(), data);

    let seen = hub.seen();
    assert!(
        seen.iter()
            .all(|s| s.method == "GET" && s.path == "/owner/name/resolve/main/model.gguf"),
        "{seen:?}"
    );
    assert_eq!(
        seen[0].headers.get("range").map(String::as_str),
        Some("bytes=0-0")
    );
    assert!(
        seen.iter()
            .all(|s| !s.headers.contains_key("authorization")),
        "{seen:?}"
    );
    drop(hub);

    // The server is gone: the cache answers, offline or not.
    let offline = HubConfig {
        offline: true,
        ..cfg.clone()
    };
    assert_eq!(
        fetch(&offline, "owner/name", "model.gguf", None, &quiet()).unwrap(),
        path
    );
    assert_eq!(
        fetch(&cfg, "owner/name", "model.gguf", None, &quiet()).unwrap(),
        path
    );
}

#[test]
fn a_broken_download_is_never_used_and_resumes() {
    let data = payload();
    let hub = Hub::start(vec![("owner/name/model.gguf", data.clone())], None);
    hub.cut_next_download.store(true, Ordering::SeqCst);
    let home = TempDir::new("cut");
    let cfg = config(&hub.url(), &home);
    let err = fetch(&cfg, "owner/name", "model.gguf", None, &quiet())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("broke off") && err.contains("HINT: ") && !err.contains('\n'),
        "{err}"
    );
    let snapshots = home
        .0
        .join("hub")
        .join("models--owner--name")
        .join("snapshots");
    assert!(!snapshots.exists(), "a cut download must not look complete");
    let offline = HubConfig {
        offline: true,
        ..cfg.clone()
    };
    assert!(fetch(&offline, "owner/name", "model.gguf", None, &quiet()).is_err());

    // The next run picks up where the cut one stopped.
    let path = fetch(&cfg, "owner/name", "model.gguf", None, &quiet()).unwrap();
    assert_eq!(fs::read(path).unwrap(), data);
    let resumed = format!("bytes={}-", data.len() / 2);
    assert!(
        hub.seen()
            .iter()
            .any(|s| s.headers.get("range") == Some(&resumed)),
        "{:?}",
        hub.seen()
    );
}

#[test]
fn offline_without_cache_is_a_clear_error() {
    let home = TempDir::new("offline");
    let cfg = HubConfig {
        offline: true,
        ..config(&closed_endpoint(), &home)
    };
    let err = fetch(&cfg, "owner/name", "model.gguf", None, &quiet())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.gguf from hub repo owner/name (revision main)"),
        "{err}"
    );
    assert!(
        err.contains("offline") && err.contains("HINT: ") && !err.contains('\n'),
        "{err}"
    );

    // --offline (FetchOptions) counts as much as HF_HUB_OFFLINE.
    let cfg = config(&closed_endpoint(), &home);
    let opts = FetchOptions {
        offline: true,
        ..quiet()
    };
    let err = fetch(&cfg, "owner/name", "model.gguf", None, &opts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("offline"), "{err}");
}

#[test]
fn missing_file_is_a_clear_error_with_the_status() {
    let hub = Hub::start(vec![("owner/name/model.gguf", payload())], None);
    let home = TempDir::new("404");
    let err = fetch(
        &config(&hub.url(), &home),
        "owner/name",
        "nope.gguf",
        None,
        &quiet(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("nope.gguf from hub repo owner/name"), "{err}");
    assert!(
        err.contains("HTTP 404") && err.contains("HINT: ") && !err.contains('\n'),
        "{err}"
    );
}

#[test]
fn token_is_sent_as_bearer() {
    let data = payload();
    let hub = Hub::start(
        vec![("owner/gated/model.gguf", data.clone())],
        Some("hf_secret"),
    );
    let home = TempDir::new("token");

    let err = fetch(
        &config(&hub.url(), &home),
        "owner/gated",
        "model.gguf",
        None,
        &quiet(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("HTTP 401") && err.contains("HF_TOKEN"),
        "{err}"
    );

    let cfg = HubConfig {
        token: Some("hf_secret".into()),
        ..config(&hub.url(), &home)
    };
    let path = fetch(&cfg, "owner/gated", "model.gguf", None, &quiet()).unwrap();
    assert_eq!(fs::read(path).unwrap(), data);
    let seen = hub.seen();
    let authorized: Vec<_> = seen
        .iter()
        .filter(|s| s.headers.contains_key("authorization"))
        .collect();
    assert!(authorized.len() >= 2, "{seen:?}");
    assert!(authorized
        .iter()
        .all(|s| s.headers["authorization"] == "Bearer hf_secret"));
}

#[test]
fn revision_is_requested_and_cached_under_its_name() {
    let data = payload();
    let hub = Hub::start(vec![("owner/name/model.gguf", data.clone())], None);
    let home = TempDir::new("rev");
    let cfg = config(&hub.url(), &home);
    let path = fetch(&cfg, "owner/name", "model.gguf", Some("v1.0"), &quiet()).unwrap();
    assert_eq!(fs::read(&path).unwrap(), data);
    assert!(hub
        .seen()
        .iter()
        .all(|s| s.path == "/owner/name/resolve/v1.0/model.gguf"));
    let refs = home.0.join("hub").join("models--owner--name").join("refs");
    assert_eq!(fs::read_to_string(refs.join("v1.0")).unwrap(), COMMIT);
    assert!(!refs.join("main").exists());

    // Another revision is not served from v1.0's cache entry.
    drop(hub);
    let offline = HubConfig {
        offline: true,
        ..cfg
    };
    assert!(fetch(&offline, "owner/name", "model.gguf", Some("v1.0"), &quiet()).is_ok());
    assert!(fetch(&offline, "owner/name", "model.gguf", None, &quiet()).is_err());
}

#[test]
fn unreachable_hub_is_a_clear_error() {
    let home = TempDir::new("unreachable");
    let endpoint = closed_endpoint();
    let err = fetch(
        &config(&endpoint, &home),
        "owner/name",
        "model.gguf",
        None,
        &quiet(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("cannot reach") && err.contains(&endpoint),
        "{err}"
    );
    assert!(err.contains("HINT: ") && !err.contains('\n'), "{err}");
}

#[test]
fn paths_that_leave_the_cache_are_refused() {
    let home = TempDir::new("traversal");
    let cfg = config(&closed_endpoint(), &home);
    for (file, revision) in [
        ("../../x.gguf", None),
        ("m.gguf", Some("../x")),
        ("/etc/passwd", None),
    ] {
        let err = fetch(&cfg, "owner/name", file, revision, &quiet())
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid"), "{err}");
    }
}

#[test]
fn config_reads_the_environment_like_huggingface_hub() {
    let home = TempDir::new("env");
    fs::write(home.0.join("token"), "hf_from_file\n").unwrap();
    let home_str = home.0.to_str().unwrap().to_string();
    let from = |pairs: &[(&str, &str)]| {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubConfig::from_vars(move |k| map.get(k).cloned())
    };

    let cfg = from(&[("HOME", "/h")]);
    assert_eq!(cfg.endpoint, "https://huggingface.co");
    assert_eq!(cfg.cache_dir, PathBuf::from("/h/.cache/huggingface/hub"));
    assert_eq!(cfg.token, None);
    assert!(!cfg.offline);

    let cfg = from(&[
        ("HOME", "/h"),
        ("HF_HOME", &home_str),
        ("HF_ENDPOINT", "http://127.0.0.1:9/"),
        ("HF_HUB_OFFLINE", "1"),
    ]);
    assert_eq!(cfg.endpoint, "http://127.0.0.1:9");
    assert_eq!(cfg.cache_dir, home.0.join("hub"));
    assert_eq!(cfg.token.as_deref(), Some("hf_from_file"));
    assert!(cfg.offline);

    let cfg = from(&[
        ("HF_HOME", &home_str),
        ("HF_TOKEN", "hf_env"),
        ("HF_HUB_CACHE", "/c"),
    ]);
    assert_eq!(cfg.token.as_deref(), Some("hf_env"));
    assert_eq!(cfg.cache_dir, PathBuf::from("/c"));

    let cfg = from(&[
        ("XDG_CACHE_HOME", "/x"),
        ("HOME", "/h"),
        ("HF_ENDPOINT", ""),
    ]);
    assert_eq!(cfg.cache_dir, PathBuf::from("/x/huggingface/hub"));
    assert_eq!(cfg.endpoint, "https://huggingface.co");

    for (value, offline) in [
        ("true", true),
        ("ON", true),
        ("yes", true),
        ("0", false),
        ("false", false),
    ] {
        assert_eq!(
            from(&[("HF_HUB_OFFLINE", value), ("HOME", "/h")]).offline,
            offline,
            "{value}"
        );
    }
}

#[test]
fn resolve_reads_the_hf_environment() {
    let data = payload();
    let hub = Hub::start(
        vec![("owner/name/model.gguf", data.clone())],
        Some("hf_env_token"),
    );
    let home = TempDir::new("resolve");
    let run = |extra: &[(&str, &str)]| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["child_resolve_hub", "--exact", "--ignored", "--nocapture"])
            .env("GEN_HUB_CHILD_EXPECT", home.0.join("expected"))
            .env("HF_HOME", &home.0)
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_TOKEN_PATH")
            .env_remove("HF_HUB_OFFLINE")
            .env_remove("HF_TOKEN");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
    };
    fs::write(home.0.join("expected"), &data).unwrap();
    run(&[("HF_ENDPOINT", &hub.url()), ("HF_TOKEN", "hf_env_token")]);
    let seen = hub.seen();
    assert!(
        !seen.is_empty()
            && seen
                .iter()
                .all(|s| s.headers.get("authorization").map(String::as_str)
                    == Some("Bearer hf_env_token")),
        "{seen:?}"
    );
    assert!(home.0.join("hub").join("models--owner--name").is_dir());

    // Server gone, HF_HUB_OFFLINE=1: served from the cache HF_HOME points at.
    drop(hub);
    run(&[("HF_ENDPOINT", &closed_endpoint()), ("HF_HUB_OFFLINE", "1")]);
}

/// Run as a child process, with the HF_* variables set, by `resolve_reads_the_hf_environment`.
#[test]
#[ignore = "helper: run as a child process by resolve_reads_the_hf_environment"]
fn child_resolve_hub() {
    let Some(expected) = std::env::var_os("GEN_HUB_CHILD_EXPECT") else {
        return;
    };
    let spec = parse_model_arg(Some("owner/name"), Some("model.gguf"), None).unwrap();
    let path = resolve(&spec, &quiet()).unwrap();
    assert!(
        path.starts_with(std::env::var("HF_HOME").unwrap()),
        "{}",
        path.display()
    );
    assert_eq!(fs::read(path).unwrap(), fs::read(expected).unwrap());
}

/// A llama config.json, as a hub repo of a safetensors checkpoint holds it.
const LLAMA_CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": true}"#;

/// Requests for files of `repo`, by file name, in order.
fn requested(hub: &Hub, repo: &str) -> Vec<String> {
    let prefix = format!("/{repo}/resolve/");
    hub.seen()
        .iter()
        .filter_map(|s| {
            let rest = s.path.strip_prefix(&prefix)?;
            Some(rest.split_once('/')?.1.to_string())
        })
        .collect()
}

#[test]
fn checkpoint_is_fetched_whole_then_served_from_the_cache_offline() {
    let weights = payload();
    let hub = Hub::start(
        vec![
            ("owner/ckpt/config.json", LLAMA_CONFIG.as_bytes().to_vec()),
            ("owner/ckpt/tokenizer.json", b"{\"tok\": 1}".to_vec()),
            ("owner/ckpt/tokenizer_config.json", b"{}".to_vec()),
            ("owner/ckpt/model.safetensors", weights.clone()),
        ],
        None,
    );
    let home = TempDir::new("ckpt");
    let cfg = config(&hub.url(), &home);
    let dir = fetch_checkpoint(&cfg, "owner/ckpt", None, &quiet()).unwrap();
    assert_eq!(
        dir,
        home.0
            .join("hub")
            .join("models--owner--ckpt")
            .join("snapshots")
            .join(COMMIT)
    );
    assert_eq!(fs::read(dir.join("model.safetensors")).unwrap(), weights);
    assert_eq!(
        fs::read(dir.join("config.json")).unwrap(),
        LLAMA_CONFIG.as_bytes()
    );
    assert_eq!(
        fs::read(dir.join("tokenizer.json")).unwrap(),
        b"{\"tok\": 1}"
    );
    assert!(dir.join("tokenizer_config.json").is_file());
    // The optional chat_template.jinja was asked for and is simply absent.
    assert!(!dir.join("chat_template.jinja").exists());
    let files = requested(&hub, "owner/ckpt");
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
        "model.safetensors",
    ] {
        assert!(files.iter().any(|r| r == f), "{f} not requested: {files:?}");
    }
    drop(hub);

    // The server is gone: the cache answers, offline or not, without a request.
    let offline = HubConfig {
        offline: true,
        ..cfg.clone()
    };
    assert_eq!(
        fetch_checkpoint(&offline, "owner/ckpt", None, &quiet()).unwrap(),
        dir
    );
    assert_eq!(
        fetch_checkpoint(&cfg, "owner/ckpt", None, &quiet()).unwrap(),
        dir
    );
}

#[test]
fn sharded_checkpoint_fetches_the_index_and_every_shard() {
    let (a, b) = (payload(), payload().into_iter().rev().collect::<Vec<u8>>());
    let index = r#"{"metadata": {"total_size": 400000}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}"#;
    let hub = Hub::start(
        vec![
            ("owner/big/config.json", LLAMA_CONFIG.as_bytes().to_vec()),
            ("owner/big/tokenizer.json", b"{}".to_vec()),
            (
                "owner/big/model.safetensors.index.json",
                index.as_bytes().to_vec(),
            ),
            ("owner/big/model-00001-of-00002.safetensors", a.clone()),
            ("owner/big/model-00002-of-00002.safetensors", b.clone()),
        ],
        None,
    );
    let home = TempDir::new("shards");
    let cfg = config(&hub.url(), &home);
    let dir = fetch_checkpoint(&cfg, "owner/big", Some("v2"), &quiet()).unwrap();
    assert_eq!(
        fs::read(dir.join("model-00001-of-00002.safetensors")).unwrap(),
        a
    );
    assert_eq!(
        fs::read(dir.join("model-00002-of-00002.safetensors")).unwrap(),
        b
    );
    assert_eq!(
        gen::format::checkpoint::weight_files(&dir).unwrap(),
        [
            dir.join("model-00001-of-00002.safetensors"),
            dir.join("model-00002-of-00002.safetensors")
        ]
    );
    let files = requested(&hub, "owner/big");
    assert!(
        !files.iter().any(|f| f == "model.safetensors"),
        "the index names the weights: {files:?}"
    );
    assert!(hub
        .seen()
        .iter()
        .all(|s| s.path.starts_with("/owner/big/resolve/v2/")));
    drop(hub);

    let offline = HubConfig {
        offline: true,
        ..cfg.clone()
    };
    assert_eq!(
        fetch_checkpoint(&offline, "owner/big", Some("v2"), &quiet()).unwrap(),
        dir
    );
    // A shard missing from the cache makes the checkpoint incomplete: offline, that is an error.
    fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = fetch_checkpoint(&offline, "owner/big", Some("v2"), &quiet())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("offline") && err.contains("HINT") && !err.contains('\n'),
        "{err}"
    );
}

#[test]
fn repo_without_config_json_is_a_clear_error() {
    let hub = Hub::start(vec![("owner/gguf/model.gguf", payload())], None);
    let home = TempDir::new("noconfig");
    let err = fetch_checkpoint(&config(&hub.url(), &home), "owner/gguf", None, &quiet())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("owner/gguf")
            && err.contains("no config.json")
            && err.contains("--model-file"),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");
}

#[test]
fn unsupported_checkpoint_is_refused_before_its_weights_are_fetched() {
    let config_json = LLAMA_CONFIG.replace("LlamaForCausalLM", "GPT2LMHeadModel");
    let hub = Hub::start(
        vec![
            ("owner/gpt2/config.json", config_json.into_bytes()),
            ("owner/gpt2/tokenizer.json", b"{}".to_vec()),
            ("owner/gpt2/model.safetensors", payload()),
        ],
        None,
    );
    let home = TempDir::new("gpt2");
    let err = format!(
        "{:#}",
        fetch_checkpoint(&config(&hub.url(), &home), "owner/gpt2", None, &quiet()).unwrap_err()
    );
    assert!(
        err.contains("GPT2LMHeadModel") && err.contains("not supported"),
        "{err}"
    );
    assert_eq!(
        requested(&hub, "owner/gpt2"),
        ["config.json", "config.json"]
    );
}

#[test]
fn checkpoint_offline_without_cache_is_a_clear_error() {
    let home = TempDir::new("ckpt-offline");
    let cfg = config(&closed_endpoint(), &home);
    let opts = FetchOptions {
        offline: true,
        ..quiet()
    };
    let err = fetch_checkpoint(&cfg, "owner/ckpt", None, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("owner/ckpt") && err.contains("offline") && err.contains("HINT"),
        "{err}"
    );
}

/// The binary on a hub repo holding a real checkpoint (the default model converted to a bf16
/// safetensors folder): it fetches it, generates what the local folder generates, and then
/// does the same with the server gone, under HF_HUB_OFFLINE=1 and under --offline.
#[test]
fn gen_runs_a_hub_checkpoint_then_runs_it_offline() {
    use common::hf::{converted, Layout};
    let local = converted(
        "single-bf16",
        Layout {
            shards: 1,
            dtype: candle_core::DType::BF16,
        },
    );
    let files: Vec<(String, Vec<u8>)> = fs::read_dir(&local)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != "complete")
        .map(|e| {
            let name = format!("owner/smol/{}", e.file_name().to_string_lossy());
            (name, fs::read(e.path()).unwrap())
        })
        .collect();
    let hub = Hub::start(
        files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect(),
        None,
    );
    drop(files);
    let home = TempDir::new("gen-ckpt");
    let gen = |model: &std::path::Path, endpoint: &str, extra: &[&str]| {
        let out = common::gen()
            .arg("--model")
            .arg(model)
            .args(["--prompt", "The capital of France is", "--temperature", "0"])
            .args(["--max-new", "8", "--threads", "2", "--quiet"])
            .args(extra)
            .env("HF_HOME", &home.0)
            .env("HF_ENDPOINT", endpoint)
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_TOKEN")
            .env_remove("HF_TOKEN_PATH")
            .output()
            .unwrap();
        let err = common::text(&out.stderr);
        assert!(out.status.success() && err.is_empty(), "{err}");
        common::text(&out.stdout)
    };
    let want = gen(&local, &closed_endpoint(), &[]);
    assert!(want.starts_with(" Paris"), "{want:?}");
    let repo = std::path::Path::new("owner/smol");
    assert_eq!(gen(repo, &hub.url(), &[]), want);
    assert!(requested(&hub, "owner/smol")
        .iter()
        .any(|f| f == "model.safetensors"));
    drop(hub);

    let closed = closed_endpoint();
    let out = common::gen()
        .args([
            "--model",
            "owner/smol",
            "--prompt",
            "Hi",
            "--max-new",
            "2",
            "--quiet",
        ])
        .env("HF_HOME", &home.0)
        .env("HF_ENDPOINT", &closed)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    assert_eq!(gen(repo, &closed, &["--offline"]), want);
}
