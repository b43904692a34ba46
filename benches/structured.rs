//! Structured output: what a JSON Schema costs and what it buys, in one run.
//!
//!     cargo bench --bench structured
//!
//! 1. Validity: the 50 prompts of assets/structured/ (10 schemas), each told to reply with JSON
//!    matching its schema (the schema is in the prompt), as one greedy `--batch` run without
//!    a constraint and one with `json_schema` on every line. Counts the replies that parse
//!    (the whole reply, and leniently: from the first `{`/`[` to the last `}`/`]`) and that
//!    validate (the jsonschema crate, formats on).
//! 2. Speed: single-stream decode tok/s of the same prompts with and without `--json-schema`,
//!    alternating, medians; the ratio, and the engine's time per mask from `--stats json`.
//!
//! Environment: GEN_BENCH_RUNS (default 3), GEN_BENCH_THREADS (2), GEN_BENCH_MODEL (default:
//! the default model). Not a test: nothing here asserts a speed.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::{env_or, fail, json_report, median};
use serde_json::Value;

fn asset(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("assets")
        .join("structured")
        .join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())))
}

struct Case {
    schema_name: String,
    schema: Value,
    /// The prompt, with the schema spelled out so the unconstrained model knows it too.
    prompt: String,
}

fn cases() -> Vec<Case> {
    let schemas: BTreeMap<String, Value> =
        serde_json::from_str(&asset("schemas.json")).unwrap_or_else(|e| fail(&e.to_string()));
    asset("prompts.jsonl")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let r: Value = serde_json::from_str(l).unwrap_or_else(|e| fail(&e.to_string()));
            let name = r["schema"].as_str().unwrap_or_default().to_string();
            let schema = schemas[&name].clone();
            Case {
                prompt: format!(
                    "{}\nReply with only a JSON value matching this JSON Schema: {schema}",
                    r["prompt"].as_str().unwrap_or_default()
                ),
                schema_name: name,
                schema,
            }
        })
        .collect()
}

fn gen_cmd(model: &Path, threads: usize) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gen"));
    c.arg("--model").arg(model).args([
        "--chat",
        "--temperature",
        "0",
        "--threads",
        &threads.to_string(),
    ]);
    c
}

/// One greedy batch over every case; `constrained`: each line carries its schema.
fn batch(model: &Path, threads: usize, cases: &[Case], constrained: bool) -> Vec<String> {
    let input: String = cases
        .iter()
        .map(|c| {
            let mut line = serde_json::json!({"prompt": c.prompt});
            if constrained {
                line["json_schema"] = c.schema.clone();
            }
            format!("{line}\n")
        })
        .collect();
    let mut cmd = gen_cmd(model, threads);
    cmd.args(["--batch", "-", "--max-new", "200", "-q"]);
    let out = common::with_stdin(&mut cmd, &input);
    if !out.status.success() {
        fail(&format!(
            "gen --batch failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| fail(&e.to_string()));
            v["text"].as_str().unwrap_or_default().to_string()
        })
        .collect()
}

#[derive(Default)]
struct Validity {
    parses: usize,
    parses_leniently: usize,
    valid: usize,
}

fn validity(cases: &[Case], replies: &[String]) -> Validity {
    let mut v = Validity::default();
    for (c, reply) in cases.iter().zip(replies) {
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(&c.schema)
            .unwrap_or_else(|e| fail(&format!("schema {}: {e}", c.schema_name)));
        let strict = serde_json::from_str::<Value>(reply.trim()).ok();
        let lenient = strict.clone().or_else(|| {
            let start = reply.find(['{', '['])?;
            let end = reply.rfind(['}', ']'])?;
            serde_json::from_str::<Value>(reply.get(start..=end)?).ok()
        });
        v.parses += strict.is_some() as usize;
        v.parses_leniently += lenient.is_some() as usize;
        v.valid += lenient.is_some_and(|j| validator.is_valid(&j)) as usize;
    }
    v
}

/// One single-stream run: (decode tok/s, engine ms per mask, ms waited per token).
fn single(model: &Path, threads: usize, case: &Case, constrained: bool) -> (f64, f64, f64) {
    let schema = case.schema.to_string();
    let mut cmd = gen_cmd(model, threads);
    cmd.args([
        "--prompt",
        &case.prompt,
        "--max-new",
        "64",
        "--stats",
        "json",
    ]);
    if constrained {
        cmd.args(["--json-schema", &schema]);
    }
    let report = json_report(&mut cmd);
    let c = &report["constraint"];
    (
        report["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
        c["mask_ms"].as_f64().unwrap_or(0.0),
        c["wait_ms_per_token"].as_f64().unwrap_or(0.0),
    )
}

fn main() {
    let runs: usize = env_or("GEN_BENCH_RUNS", 3);
    let threads: usize = env_or("GEN_BENCH_THREADS", 2);
    let model = common::bench_model();
    let cases = cases();
    eprintln!(
        "bench: {} | {} prompts, {threads} threads, greedy",
        model.display(),
        cases.len()
    );

    let plain = validity(&cases, &batch(&model, threads, &cases, false));
    let constrained = validity(&cases, &batch(&model, threads, &cases, true));
    let n = cases.len();
    println!("| replies of {n} | parse | parse (lenient) | valid under the schema |");
    println!("|---|---|---|---|");
    for (label, v) in [("no constraint", &plain), ("json_schema", &constrained)] {
        println!(
            "| {label} | {} | {} | {} |",
            v.parses, v.parses_leniently, v.valid
        );
    }

    // One prompt per schema, alternating the two modes so drift hits both alike.
    let picked: Vec<&Case> = {
        let mut seen = std::collections::BTreeSet::new();
        cases
            .iter()
            .filter(|c| seen.insert(c.schema_name.clone()))
            .collect()
    };
    let (mut free, mut bound, mut mask, mut wait) = (vec![], vec![], vec![], vec![]);
    for run in 0..runs {
        for c in &picked {
            free.push(single(&model, threads, c, false).0);
            let (rate, m, w) = single(&model, threads, c, true);
            bound.push(rate);
            mask.push(m);
            wait.push(w);
        }
        eprintln!("  speed: run {}/{runs} done", run + 1);
    }
    let (free, bound) = (median(free), median(bound));
    println!();
    println!(
        "| single stream, {} prompts x {runs} | decode tok/s (median) |",
        picked.len()
    );
    println!("|---|---|");
    println!("| no constraint | {free:.1} |");
    println!("| --json-schema | {bound:.1} |");
    println!("| ratio | {:.3} |", bound / free);
    println!(
        "| engine per mask, ms (median) | {:.3} |\n| waited per token, ms (median) | {:.3} |",
        median(mask),
        median(wait)
    );
}
