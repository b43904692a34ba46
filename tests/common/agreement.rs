//! Teacher-forced agreement with llama.cpp's greedy references (assets/llama-cpp-greedy-*.jsonl,
//! recorded by assets/record-llama-cpp-greedy.py), and the requantized copies of the default
//! model that some references were recorded on.

use std::path::{Path, PathBuf};

/// llama.cpp's greedy continuation of one prompt: the prompt's ids, the tokens it picked, and
/// (where recorded) its logit of each picked token.
#[derive(serde::Deserialize)]
pub struct Greedy {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub ids: Vec<u32>,
    #[serde(default)]
    pub logits: Vec<f32>,
}

/// What a teacher-forced run found: steps, steps whose greedy pick was llama.cpp's, the largest
/// difference between gen's and llama.cpp's logit of llama.cpp's token (where recorded), the
/// largest gap at a step that picked another token, and every step beyond the bounds.
pub struct Agreement {
    pub steps: usize,
    pub exact: usize,
    pub worst_logit: f32,
    pub worst_gap: f32,
    pub failures: Vec<String>,
}

impl Agreement {
    /// Panics, listing the failures, unless every step is within the bounds and at least
    /// `percent` of the steps are identical.
    pub fn assert(&self, what: &str, percent: usize) {
        eprintln!(
            "{what}: {} of {} greedy steps identical to llama.cpp; largest near-tie gap {:.3}, \
             largest logit difference {:.3}",
            self.exact, self.steps, self.worst_gap, self.worst_logit
        );
        assert!(
            self.failures.is_empty(),
            "{what}: gen disagrees with llama.cpp:\n{}",
            self.failures.join("\n")
        );
        assert!(
            self.exact * 100 >= self.steps * percent,
            "{what}: only {} of {} steps identical (at least {percent}% wanted)",
            self.exact,
            self.steps
        );
    }
}

/// Feed llama.cpp's tokens one by one after each prompt. At every step gen's best token must be
/// llama.cpp's or within `near_tie` of it, and, with a `logit_tolerance` (then every reference
/// must hold a logit for each token), gen's logit of llama.cpp's token within it of llama.cpp's.
pub fn teacher_forced_agreement(
    loaded: &mut gen::model::Loaded,
    references: &[Greedy],
    near_tie: f32,
    logit_tolerance: Option<f32>,
) -> Agreement {
    let mut a = Agreement {
        steps: 0,
        exact: 0,
        worst_logit: 0.0,
        worst_gap: 0.0,
        failures: Vec::new(),
    };
    for r in references {
        let prompt = loaded.tokenizer.encode(&r.prompt, loaded.add_bos).unwrap();
        assert_eq!(prompt, r.prompt_ids, "prompt ids for {:?}", r.prompt);
        if logit_tolerance.is_some() {
            assert_eq!(r.logits.len(), r.ids.len(), "logits for {:?}", r.prompt);
        }
        let rows = super::teacher_forced(loaded.model.as_mut(), &prompt, &r.ids);
        for (i, (&want, row)) in r.ids.iter().zip(&rows).enumerate() {
            let at = format!("{:?} ({} tokens), step {i}", r.prompt, prompt.len());
            a.steps += 1;
            if let (Some(tolerance), Some(&want_logit)) = (logit_tolerance, r.logits.get(i)) {
                let diff = (row[want as usize] - want_logit).abs();
                a.worst_logit = a.worst_logit.max(diff);
                if diff > tolerance {
                    a.failures.push(format!(
                        "{at}: logit of {want} is {} in gen, {want_logit} in llama.cpp",
                        row[want as usize]
                    ));
                }
            }
            let best = super::argmax(row);
            if best == want {
                a.exact += 1;
                continue;
            }
            let gap = row[best as usize] - row[want as usize];
            a.worst_gap = a.worst_gap.max(gap);
            if gap > near_tie {
                a.failures.push(format!(
                    "{at}: gen picks {best} ({:?}), llama.cpp {want} ({:?}), gap {gap:.3}",
                    loaded.tokenizer.token_text(best),
                    loaded.tokenizer.token_text(want)
                ));
            }
        }
    }
    a
}

/// The default model requantized by llama.cpp 0c1e57098's llama-quantize (`--allow-requantize
/// SRC DST TYPE 2`, as the team's quant-files script does), built once by `.ci/llama-server
/// llama-quantize` beside the remote tests' server and kept in the same cache. The result must
/// be the file the references were recorded on, byte for byte (`sha256`): llama-quantize is
/// deterministic, so another hash means another tool or source, and the test says so.
pub fn requantized(ty: &str, sha256: &str) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _held = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let src = super::smollm2();
    let quantize = peer_tool("llama-quantize");
    let dir = quantize
        .ancestors()
        .nth(4)
        .expect("llama-quantize sits in <cache>/llama.cpp/build/bin")
        .join("requantized");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(format!("SmolLM2-135M-Instruct.{ty}.gguf"));
    if !out.is_file() || file_sha256(&out) != sha256 {
        let tmp = dir.join(format!(".{ty}.{}.tmp", std::process::id()));
        let status = std::process::Command::new(&quantize)
            .arg("--allow-requantize")
            .args([&src, &tmp])
            .args([ty, "2"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "llama-quantize {ty} failed: {status}");
        std::fs::rename(&tmp, &out).unwrap();
    }
    let got = file_sha256(&out);
    assert_eq!(
        got,
        sha256,
        "{} is not the file the reference was recorded on: re-record it \
         (assets/README.md) or find why llama-quantize changed",
        out.display()
    );
    out
}

/// One of llama.cpp's tools, built (once) and cached by `.ci/llama-server TOOL`.
pub fn peer_tool(tool: &str) -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(".ci/llama-server");
    let out = std::process::Command::new(script)
        .arg(tool)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), ".ci/llama-server {tool} failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn file_sha256(path: &Path) -> String {
    use sha2::Digest;
    let bytes = std::fs::read(path).unwrap();
    format!("{:x}", sha2::Sha256::digest(bytes))
}
