//! Which path runs each product on this machine: measured once per CPU, then kept.
//!
//! On a CPU with AVX-512 VNNI, every weight type gen runs on its own kernels has two SIMD
//! paths: the 512-bit kernels and the AVX2 ones. Which is faster is a property of the CPU, not
//! of its instruction set: an Intel Ice Lake runs 512-bit operations on two full-width units
//! and the 512-bit kernels win there, while an AMD Zen 4 executes them as two 256-bit halves and
//! decoded a k256 Q4_K_M file 1.2-1.4x faster on the AVX2 path. So the first time gen loads a
//! weight type on a CPU, it times both paths on the same work on every machine ([`workload`]:
//! matrices of that type in a Llama 3.2 1B layer's shapes), for each kind of call ([`Call`]:
//! one token, a few, a prefill chunk; the first two from memory, as decoding reads them), picks
//! the faster (a near-tie keeps the preferred path, [`preferred_first`]), and keeps the choice
//! in a file under gen's cache folder named by the CPU's identity and thread count. Later runs
//! read it and measure only types not seen before. A measurement during which other processes took the
//! cores from gen's threads ([`busy`]: preemptions, or its threads waiting for a core) is not
//! kept: that run takes the paths by rule ([`set_by_rule`]).
//!
//! The choice is kept, never re-measured, because the paths round differently in the last bits
//! (their float sums run in another order): a machine that changed its mind between runs would
//! give another text for the same seed. Where the file cannot be kept (no writable cache), gen
//! does not measure and takes the paths by rule. `GEN_KERNEL`
//! (`avx2`, `avx512`, `amx`, `bf16`, `scalar`) forces a path and skips all of this.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::matmul::{CpuQWeight, Kernel};
pub use super::q8::{Call, FEW};

/// Bump when a kernel change makes the kept choices stale. 2: one-token and few-token calls
/// are timed with their weights evicted from the caches first (`Evict`), and a one-token
/// near-tie goes to AVX2 (`preferred_first`). 3: a debug build keeps its choices in a file of
/// its own (`choices_file`); a v2 file may hold a debug build's, so it is measured again.
/// 4: BF16 chunks may take the `vdpbf16ps` path ([`Kernel::Bf16`]), which a v3 file never timed.
/// 5: a type's paths all give the same bits ([`Kernel::agrees`]; a v4 file could give BF16
/// chunks to AMX or `vdpbf16ps` and decode steps to the 512-bit path), and the Q8_K types'
/// 512-bit kernels gather their sums in integers, as AVX2's do, so they time differently.
const VERSION: u32 = 5;

/// How much faster than the preferred path (the first of [`preferred_first`]) another must be
/// to be chosen.
const MARGIN: f64 = 0.05;

/// Timed rounds per path and kind (after one untimed call each); the fastest round counts.
const ROUNDS: usize = 3;

/// Rounds for the calls timed from memory (one token, a few): the memory's speed drifts more
/// than the arithmetic's, and with 3 rounds the k256 Q4_K file's one-token choice went either
/// way in repeated first runs (Zen 5), while its decode was 8-10% faster on AVX2 every time;
/// with 9, four runs in four chose AVX2.
const ROUNDS_FROM_MEMORY: usize = 9;

/// What [`choose`] did, for the report.
#[derive(Debug, Default)]
pub struct Chosen {
    /// Types measured this run, with the seconds it took.
    pub measured: Vec<&'static str>,
    pub seconds: f64,
    /// Where the choices are kept; None when they were not (forced, one path, no cache).
    pub file: Option<PathBuf>,
    /// A kept file that could not be read or written, in one line.
    pub warning: Option<String>,
}

/// The paths this CPU offers gen's products (the first is the rule by instruction set), or
/// none when `GEN_KERNEL` forces one or there is only one.
pub fn candidates() -> Vec<Kernel> {
    let forced = std::env::var("GEN_KERNEL").is_ok_and(|v| !v.is_empty());
    let base = Kernel::detect();
    #[cfg(target_arch = "x86_64")]
    if base == Kernel::Vnni && !forced {
        let mut paths = vec![Kernel::Vnni, Kernel::Avx2];
        if Kernel::amx_ready() {
            paths.push(Kernel::Amx);
        }
        if Kernel::bf16_ready() {
            paths.push(Kernel::Bf16);
        }
        return paths;
    }
    let _ = (forced, base);
    Vec::new()
}

/// Sets every matrix's paths from the choices kept for this CPU, measuring (on these matrices)
/// the types not yet chosen and keeping the result.
pub fn choose(ws: &mut [&mut CpuQWeight]) -> Chosen {
    let paths = candidates();
    let mut done = Chosen::default();
    if paths.len() < 2 || ws.is_empty() {
        return done;
    }
    let threads = rayon::current_num_threads();
    let file = choices_file(threads);
    let mut kept = match Kept::read(&file) {
        Ok(k) => k,
        Err(why) => {
            done.warning = Some(format!(
                "the kept kernel choices in {} were unreadable ({why}): measured again",
                file.display()
            ));
            Kept::default()
        }
    };
    let mut types: Vec<&'static str> = ws.iter().map(|w| w.type_name()).collect();
    types.sort_unstable();
    types.dedup();
    let missing: Vec<&'static str> = types
        .iter()
        .copied()
        .filter(|t| Call::ALL.iter().any(|c| kept.get(t, *c).is_none()))
        .collect();
    if !missing.is_empty() {
        // Measure only what can be kept: a choice made anew every run could differ between runs.
        if let Err(why) = std::fs::create_dir_all(file.parent().unwrap_or(Path::new("."))) {
            let why = format!("cannot keep kernel choices in {} ({why})", file.display());
            return by_rule(ws, &paths, done, why);
        }
        let t0 = Instant::now();
        let before = Contention::now();
        let mut fresh = Kept::default();
        let evict = std::cell::LazyCell::new(Evict::new);
        for ty in &missing {
            let Some(ggml) = ws
                .iter()
                .find(|w| w.type_name() == *ty)
                .map(|w| w.ggml_type())
            else {
                continue;
            };
            // One workload for every kind: each times as much of it as its budget reads.
            let of_type = workload(ggml, paths[0]);
            let refs: Vec<&CpuQWeight> = of_type.iter().collect();
            for call in Call::ALL {
                if kept.get(ty, call).is_none() {
                    let evict = (call != Call::Many).then(|| &*evict);
                    let mut order = preferred_first(&paths, call);
                    order.retain(|k| refs.iter().all(|w| w.takes(*k)));
                    // A token's products must not change with the size of its pass: after the
                    // one-token call's pick, the others choose among the paths that give its
                    // bits (`Kernel::agrees`).
                    if let Some(one) = kept.get(ty, Call::One).or(fresh.get(ty, Call::One)) {
                        order.retain(|k| Kernel::agrees(*k, one));
                    }
                    let times = time_paths(&refs, &order, call, evict);
                    fresh.set(ty, call, &order, &times);
                }
            }
        }
        done.seconds = t0.elapsed().as_secs_f64();
        done.measured = missing;
        let shared = Contention::now().since(&before, done.seconds, threads);
        if let Some(why) = shared {
            // Other work shared the cores: the timings say more about it than about the
            // paths, and a choice is kept for good. This run takes the paths by rule, as it
            // would without a cache; a later run measures again.
            let why = format!(
                "the CPU was busy while gen measured its kernel paths ({why} in {:.2} s), so \
                 nothing is kept and a later run measures again",
                done.seconds
            );
            return by_rule(ws, &paths, done, why);
        }
        match fresh.merge_into(&file) {
            Ok(all) => kept = all,
            Err(why) => {
                let why = format!("cannot keep kernel choices in {} ({why})", file.display());
                return by_rule(ws, &paths, done, why);
            }
        }
    }
    for w in ws.iter_mut() {
        let ty = w.type_name();
        let pick = agreeing(Call::ALL.map(|c| kept.get(ty, c).unwrap_or(paths[0])));
        w.set_paths(pick);
    }
    done.file = Some(file);
    done
}

/// The kept paths of one type (one token, a few, a chunk), with any that would not give the
/// one-token path's bits replaced by it: a file written by hand, or by a gen whose kernels
/// differed, can mix them.
fn agreeing(paths: [Kernel; 3]) -> [Kernel; 3] {
    paths.map(|k| {
        if Kernel::agrees(k, paths[0]) {
            k
        } else {
            paths[0]
        }
    })
}

/// `done` for a run that cannot keep a measurement, with `why` as its warning: every matrix
/// takes the paths by rule ([`set_by_rule`]).
fn by_rule(ws: &mut [&mut CpuQWeight], paths: &[Kernel], mut done: Chosen, why: String) -> Chosen {
    done.warning = Some(format!(
        "{why}: the paths by rule are used (on AMD CPUs AVX2 for one token, else the 512-bit path)"
    ));
    set_by_rule(ws, paths);
    done
}

/// Sets every matrix's paths by rule, for a run that cannot keep a measurement (a busy CPU, no
/// writable cache): on AMD CPUs the preferred order's first ([`preferred_first`]: AVX2 for one
/// token, what every type measured idle chose on Zen 4 and Zen 5, where the 512-bit path decoded
/// 1.2-1.5x slower), elsewhere the 512-bit path, the rule by instruction set (on the Intel Xeons
/// measured it was as fast or faster for every kind).
fn set_by_rule(ws: &mut [&mut CpuQWeight], paths: &[Kernel]) {
    let amd = cpu_id().starts_with("AuthenticAMD");
    let pick = Call::ALL.map(|c| match amd {
        true => preferred_first(paths, c)[0],
        false => paths[0],
    });
    for w in ws.iter_mut() {
        w.set_paths(pick);
    }
}

/// The paths in the order [`Kept::set`] prefers them on a near-tie: the rule by instruction
/// set first, except for one-token calls, where AVX2 goes first. A one-token call reads its
/// weights from memory; both paths run at the memory's speed within a few percent, less than
/// the calibration can tell apart, while whole decodes on AMD Zen 4 and Zen 5 ran faster on the
/// AVX2 path for every type measured (Zen 5, 2026-12-05, paired runs: F16 1.07x, Q8_0 1.05x on
/// files whose calibrations were near-ties; Zen 4's k256 Q4_K_M and Q8_0 1.2-1.4x). The
/// 512-bit path is still chosen where it measures 5% faster.
fn preferred_first(paths: &[Kernel], call: Call) -> Vec<Kernel> {
    let mut order = paths.to_vec();
    #[cfg(target_arch = "x86_64")]
    if call == Call::One {
        order.sort_by_key(|k| *k != Kernel::Avx2);
    }
    // AMX and `vdpbf16ps` are timed for every kind of call: a BF16 matrix takes one of them for
    // all its calls or for none (their sums are not the 512-bit kernel's), and which is decided
    // by the one-token call (`choose`). (`vdpbf16ps` timed for a few tokens on Zen 4,
    // 2026-12-06, 3 calibrations: 2.2-2.8 ms against the 512-bit path's 1.7-2.0; rearranging
    // a call's groups costs more than 4 tokens save.)
    let _ = call;
    order
}

/// How much this process's threads were kept off the cores by other work, read before and
/// after a measurement.
struct Contention {
    /// Involuntary context switches (getrusage).
    switches: i64,
    /// Nanoseconds its threads spent runnable but waiting for a core (the second field of
    /// each /proc/self/task/*/schedstat), where the kernel reports it.
    waited_ns: Option<u64>,
}

impl Contention {
    fn now() -> Self {
        Contention {
            switches: involuntary_switches(),
            waited_ns: run_delay_ns(),
        }
    }

    /// Why a measurement of `seconds` on `threads` threads that began at `before` was shared
    /// with other work, or None when it had the cores.
    fn since(&self, before: &Contention, seconds: f64, threads: usize) -> Option<String> {
        let preempted = self.switches - before.switches;
        let waited = match (self.waited_ns, before.waited_ns) {
            (Some(a), Some(b)) => Some(a.saturating_sub(b) as f64 * 1e-9),
            _ => None,
        };
        busy(preempted, waited, seconds, threads.max(1)).then(|| match waited {
            Some(w) => format!(
                "{preempted} preemptions, {:.0} ms waiting for a core",
                w * 1e3
            ),
            None => format!("{preempted} preemptions"),
        })
    }
}

/// Whether `preempted` involuntary switches, and `waited` seconds spent waiting for a core, in
/// `seconds` of measuring on `threads` threads mean other work shared the cores.
///
/// Switches, measured on a 2-core AMD EPYC Zen 5: idle, 2-23 in 0.2 s (up to ~115 a second,
/// the kernel's own threads); beside one or two busy processes, 129-145 in 0.3 s (~400 a
/// second). The line lies between, and below 20 nothing counts. They miss other work of lower
/// priority: beside two `nice -n 19` loops (Zen 4, 2026-12-05) 130 switches in 0.74 s, under
/// the line, while gen's threads waited for a core 28% of their time. The wait sees any other
/// runnable work: past 5% of the threads' time, the measurement is not the CPU's.
fn busy(preempted: i64, waited: Option<f64>, seconds: f64, threads: usize) -> bool {
    let switched = preempted > 20 && preempted as f64 > 250.0 * seconds;
    let waiting = waited.is_some_and(|w| w > 0.05 * seconds * threads as f64);
    switched || waiting
}

/// Times this process's threads were taken off a core for another process (not waiting on
/// their own): how busy the machine was while they ran.
fn involuntary_switches() -> i64 {
    // SAFETY: an all-zero rusage is valid, and getrusage fills it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0;
    }
    u.ru_nivcsw as i64
}

/// Nanoseconds this process's threads have spent runnable without a core, summed over its
/// threads (Linux's schedstat); None where the kernel does not report it.
fn run_delay_ns() -> Option<u64> {
    let mut total = 0u64;
    let mut any = false;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Ok(t) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        if let Some(ns) = t
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u64>().ok())
        {
            total += ns;
            any = true;
        }
    }
    any.then_some(total)
}

/// Matrices of ggml type `ggml` in the shapes of a Llama 3.2 1B layer (2048 wide: q and o
/// 2048 rows, gate and up 8192 rows, in that order), as many as the largest byte budget reads:
/// the same work on every machine, whichever model came first, so that the kept choice
/// describes the CPU. The values are a fixed pseudo-random pattern, 16-bit weights made from
/// floats in [-1, 1] (no subnormals or NaNs, which some CPUs compute slowly); a quantized
/// block's f16 scales may be anything, their f32 products are normal floats.
fn workload(ggml: u32, kernel: Kernel) -> Vec<CpuQWeight> {
    const WIDTH: usize = 2048;
    let budget = Call::ALL
        .map(|c| c.sample().1)
        .into_iter()
        .max()
        .unwrap_or(0);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = Vec::new();
    let mut bytes = 0;
    for rows in [WIDTH, WIDTH, 4 * WIDTH, 4 * WIDTH].into_iter().cycle() {
        if bytes >= budget || out.len() >= 64 {
            break;
        }
        let Some(size) = CpuQWeight::file_bytes_of(ggml, rows, WIDTH) else {
            break;
        };
        let raw: Vec<u8> = match ggml {
            1 | 30 => (0..size / 2)
                .flat_map(|_| {
                    let v = (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                    let bits = match ggml {
                        1 => half::f16::from_f32(v).to_bits(),
                        _ => half::bf16::from_f32(v).to_bits(),
                    };
                    bits.to_le_bytes()
                })
                .collect(),
            _ => (0..size.div_ceil(8))
                .flat_map(|_| next().to_le_bytes())
                .take(size)
                .collect(),
        };
        match CpuQWeight::from_raw(ggml, &raw, rows, WIDTH, kernel) {
            Ok(Some(w)) => out.push(w),
            _ => break,
        }
        bytes += size;
    }
    out
}

/// Seconds of the fastest round of each path, alternating paths round by round: one call of
/// `call`'s token count on each of `ws` in turn until its byte budget is read, after reading
/// through `evict` where given.
fn time_paths(ws: &[&CpuQWeight], paths: &[Kernel], call: Call, evict: Option<&Evict>) -> Vec<f64> {
    let (tokens, budget) = call.sample();
    let mut chosen = Vec::new();
    let mut bytes = 0;
    for w in ws {
        if bytes >= budget {
            break;
        }
        bytes += w.file_bytes();
        chosen.push(*w);
    }
    // Inputs in the range activations have; the same for every path.
    let width = chosen.iter().map(|w| w.dims().1).max().unwrap_or(0);
    let x: Vec<f32> = (0..tokens * width)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let run = |k: Kernel| {
        let t0 = Instant::now();
        for w in &chosen {
            let cols = w.dims().1;
            let mut sink = 0f32;
            for out in w
                .matmul_on(k, &x[..tokens * cols], tokens)
                .iter()
                .step_by(97)
            {
                sink += out;
            }
            std::hint::black_box(sink);
        }
        t0.elapsed().as_secs_f64()
    };
    // A decode step (one token, or a few) reads its weights from memory; timed on weights the
    // previous run left in the last-level cache, the path with more arithmetic won where it
    // lost in real decoding (Zen 5, 2026-12-05: IQ4_NL and Q5_K chose the 512-bit path at
    // 0.87x and 0.77x of the AVX2 one's decode speed on k256 files). So those calls are timed
    // on weights evicted from every cache first; a prefill chunk reuses each tile from L2, and
    // is timed warm (`evict` None).
    let mut best = vec![f64::INFINITY; paths.len()];
    for &k in paths {
        run(k);
    }
    let rounds = if evict.is_some() {
        ROUNDS_FROM_MEMORY
    } else {
        ROUNDS
    };
    for round in 0..rounds {
        for i in 0..paths.len() {
            // Each round in the other order, so neither path always follows the other.
            let i = if round % 2 == 0 {
                i
            } else {
                paths.len() - 1 - i
            };
            if let Some(e) = evict {
                e.run();
            }
            best[i] = best[i].min(run(paths[i]));
        }
    }
    best
}

/// Memory read through to push a workload out of the caches: twice the last-level cache
/// (sysfs's largest cache of cpu0; 32 MiB where none is listed), between 32 and 256 MiB, filled
/// so that its pages are real (untouched ones all map the one zero page).
struct Evict(Vec<u64>);

impl Evict {
    fn new() -> Self {
        let llc = (0..8)
            .filter_map(|i| {
                let p = format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size");
                parse_cache_size(&std::fs::read_to_string(p).ok()?)
            })
            .max()
            .unwrap_or(32 << 20);
        let bytes = (2 * llc).clamp(32 << 20, 256 << 20);
        Evict(vec![0x0101_0101_0101_0101; bytes / 8])
    }

    /// Reads all of it, in parallel as the products do.
    fn run(&self) {
        use rayon::prelude::*;
        let s: u64 = self
            .0
            .par_chunks(1 << 15)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
    }
}

/// A sysfs cache size ("32768K", "2M", "512") in bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, unit) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|n| n * unit)
}

/// The choices kept in one file: per type and kind, the path and each path's time.
#[derive(Debug, Default, Clone)]
struct Kept {
    rows: BTreeMap<(String, Call), (Kernel, String)>,
}

impl Kept {
    fn get(&self, ty: &str, call: Call) -> Option<Kernel> {
        self.rows.get(&(ty.to_string(), call)).map(|r| r.0)
    }

    /// The fastest of `paths` for `ty` and `call`, where it beats the first (the rule by
    /// instruction set) by [`MARGIN`]; else the first: a difference within the machine's noise
    /// does not move a choice that is kept for good.
    fn set(&mut self, ty: &str, call: Call, paths: &[Kernel], times: &[f64]) {
        let mut best = 0;
        for (i, t) in times.iter().enumerate() {
            if *t < times[best] && *t < times[0] * (1.0 - MARGIN) {
                best = i;
            }
        }
        let detail = paths
            .iter()
            .zip(times)
            .map(|(k, t)| format!("{}={:.3}ms", k.name(), t * 1e3))
            .collect::<Vec<_>>()
            .join(" ");
        self.rows
            .insert((ty.to_string(), call), (paths[best], detail));
    }

    /// Nothing kept yet is an empty set; a file gen did not write, or damaged, an error.
    fn read(file: &Path) -> Result<Self, String> {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(e.to_string()),
        };
        let mut lines = text.lines();
        match lines.next() {
            Some(h) if h == header() => {}
            // Another version's choices are stale (its kernels or its timing differ): measured
            // again and replaced, with no warning.
            Some(h) if h.starts_with("gen kernel choices v") => return Ok(Self::default()),
            _ => return Err("not written by gen".into()),
        }
        let mut kept = Self::default();
        for line in lines.filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
            let mut f = line.splitn(4, ' ');
            let (ty, call, path) = (f.next(), f.next().and_then(Call::from_name), f.next());
            let path = path.and_then(kernel_named);
            match (ty, call, path) {
                (Some(ty), Some(call), Some(path)) => {
                    let detail = f.next().unwrap_or("").to_string();
                    kept.rows.insert((ty.to_string(), call), (path, detail));
                }
                _ => return Err(format!("a line reads {line:?}")),
            }
        }
        Ok(kept)
    }

    /// Adds these rows to the file's (the file's win where both have one: another process may
    /// have measured first, and a choice made is kept), written whole and renamed into place
    /// under a lock. Returns what the file holds now.
    fn merge_into(&self, file: &Path) -> std::io::Result<Self> {
        let lock_path = file.with_extension("lock");
        let lock = std::fs::File::create(&lock_path)?;
        lock.lock()?;
        let mut all = Self::read(file).unwrap_or_default();
        for (key, row) in &self.rows {
            all.rows.entry(key.clone()).or_insert_with(|| row.clone());
        }
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        let mut out = std::fs::File::create(&tmp)?;
        writeln!(out, "{}", header())?;
        writeln!(out, "# {}", cpu_name())?;
        writeln!(out, "# type call path: each path's fastest timed round")?;
        for ((ty, call), (path, detail)) in &all.rows {
            writeln!(out, "{ty} {} {} {detail}", call.name(), path.name())?;
        }
        out.sync_all()?;
        drop(out);
        std::fs::rename(&tmp, file)?;
        Ok(all)
    }
}

fn header() -> String {
    format!("gen kernel choices v{VERSION}")
}

/// A path by the name [`Kernel::name`] gives it.
fn kernel_named(name: &str) -> Option<Kernel> {
    let mut all = vec![Kernel::Scalar];
    #[cfg(target_arch = "x86_64")]
    all.extend([Kernel::Avx2, Kernel::Vnni, Kernel::Amx, Kernel::Bf16]);
    all.into_iter().find(|k| k.name() == name)
}

/// `<gen's cache folder>/kernels/<cpu>-t<threads>[-debug].txt`: where the choices for this CPU
/// and thread count are kept. A build with debug assertions
/// (the gen `cargo test` runs) keeps its own: its kernels run checks a release build does not,
/// and they slow the AVX2 path more than the 512-bit one. On an idle Zen 4 (2026-12-05) it timed
/// one token of Q4_K at 7.03 ms on AVX2 against 4.79 on the 512-bit path, where a release build
/// times 1.36 against 1.90. Kept in the one file, a test run's choices sent a release gen's
/// one-token K-quant, IQ4 and Q4_0/Q5_x products to the path that decodes them 1.2-1.5x slower.
fn choices_file(threads: usize) -> PathBuf {
    let build = if cfg!(debug_assertions) { "-debug" } else { "" };
    crate::source::gen_cache_home()
        .join("kernels")
        .join(format!("{}-t{threads}{build}.txt", cpu_id()))
}

/// The CPU's identity as a file name: vendor, family, model and stepping (what distinguishes
/// a Zen 4 from an Ice Lake), and the features the paths use.
fn cpu_id() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // cpuid exists on every x86_64 CPU; leaves 0 and 1 always.
        let (v, l1) = (__cpuid(0), __cpuid(1));
        let vendor: Vec<u8> = [v.ebx, v.edx, v.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .filter(|b| b.is_ascii_alphanumeric())
            .collect();
        let base_family = (l1.eax >> 8) & 0xF;
        let family = base_family
            + if base_family == 0xF {
                (l1.eax >> 20) & 0xFF
            } else {
                0
            };
        let model = ((l1.eax >> 4) & 0xF) | (((l1.eax >> 16) & 0xF) << 4);
        let stepping = l1.eax & 0xF;
        let mut features = String::new();
        for (f, on) in [
            ("avx2", is_x86_feature_detected!("avx2")),
            ("vnni", is_x86_feature_detected!("avx512vnni")),
            ("bf16", is_x86_feature_detected!("avx512bf16")),
            ("amx", Kernel::amx_ready()),
        ] {
            if on {
                features.push('-');
                features.push_str(f);
            }
        }
        format!(
            "{}-f{family}-m{model}-s{stepping}{features}",
            String::from_utf8_lossy(&vendor)
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH.to_string()
    }
}

/// The CPU's own name (for the file's reader), from /proc/cpuinfo where there is one.
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|n| n.trim().to_string())
        })
        .unwrap_or_else(cpu_id)
}

#[cfg(test)]
mod tests {

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_one_token_near_tie_goes_to_avx2_and_the_rest_to_the_512_bit_path() {
        let paths = [Kernel::Vnni, Kernel::Avx2];
        assert_eq!(
            preferred_first(&paths, Call::One),
            [Kernel::Avx2, Kernel::Vnni]
        );
        assert_eq!(preferred_first(&paths, Call::Few), paths);
        assert_eq!(preferred_first(&paths, Call::Many), paths);
        // The preferred path keeps a near-tie; 5% faster takes it.
        let mut k = Kept::default();
        let order = preferred_first(&paths, Call::One);
        k.set("Q4_K", Call::One, &order, &[1.00, 0.97]);
        assert_eq!(k.get("Q4_K", Call::One), Some(Kernel::Avx2));
        k.set("Q6_K", Call::One, &order, &[1.00, 0.90]);
        assert_eq!(k.get("Q6_K", Call::One), Some(Kernel::Vnni));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_run_that_cannot_keep_a_measurement_takes_the_paths_by_rule() {
        let paths = [Kernel::Vnni, Kernel::Avx2];
        let mut w = workload(2, Kernel::Vnni).swap_remove(0); // Q4_0
        set_by_rule(&mut [&mut w], &paths);
        let amd = cpu_id().starts_with("AuthenticAMD");
        let one = if amd { Kernel::Avx2 } else { Kernel::Vnni };
        assert_eq!(w.path(Call::One.sample_tokens()), one);
        assert_eq!(w.path(Call::Few.sample_tokens()), Kernel::Vnni);
        assert_eq!(w.path(Call::Many.sample_tokens()), Kernel::Vnni);
    }

    #[test]
    fn cache_sizes_read_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn a_measurement_shared_with_other_work_is_not_taken_for_the_cpus() {
        // Figures from the 2-core Zen 5 the line was drawn on: idle, then beside busy work.
        for (n, secs) in [(2, 0.225), (6, 0.197), (23, 0.199), (0, 0.0), (15, 0.01)] {
            assert!(!busy(n, None, secs, 2), "{n} in {secs} s");
        }
        for (n, secs) in [(140, 0.311), (139, 0.298), (129, 0.359), (60, 0.1)] {
            assert!(busy(n, None, secs, 2), "{n} in {secs} s");
        }
        // Zen 4, 2026-12-05: idle, 12 switches and 1.1 ms waiting in 0.48 s on 2 threads; beside
        // two `nice -n 19 yes`, 130 and 152 switches (under the switches' line) with 411 and
        // 488 ms waiting in 0.74 and 0.80 s; beside two at nice 5, 425 with 1,479 ms in 1.21 s.
        assert!(!busy(12, Some(0.0011), 0.475, 2));
        assert!(!busy(12, Some(0.0016), 0.519, 2));
        assert!(!busy(130, None, 0.740, 2), "switches alone miss it");
        for (n, waited, secs) in [
            (130, 0.411, 0.740),
            (152, 0.488, 0.802),
            (425, 1.479, 1.213),
        ] {
            assert!(
                busy(n, Some(waited), secs, 2),
                "{n}, {waited} s in {secs} s"
            );
        }
        // Waiting alone counts too, past 5% of the threads' time.
        assert!(busy(0, Some(0.06), 0.5, 2));
        assert!(!busy(0, Some(0.04), 0.5, 2));
    }

    use super::*;

    #[test]
    fn calls_are_named_and_counted() {
        assert_eq!(Call::of(1), Call::One);
        assert_eq!(Call::of(2), Call::Few);
        assert_eq!(Call::of(FEW), Call::Few);
        assert_eq!(Call::of(FEW + 1), Call::Many);
        for c in Call::ALL {
            assert_eq!(Call::from_name(c.name()), Some(c));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn kept_choices_round_trip_and_the_first_choice_stays() {
        let dir = std::env::temp_dir().join(format!("gen-choice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cpu-t2.txt");
        let paths = [Kernel::Vnni, Kernel::Avx2];
        let mut a = Kept::default();
        a.set("Q4_K", Call::One, &paths, &[2e-3, 1e-3]);
        let all = a.merge_into(&file).unwrap();
        assert_eq!(all.get("Q4_K", Call::One), Some(Kernel::Avx2));
        // Another measurement of the same type and call does not replace the kept one.
        let mut b = Kept::default();
        b.set("Q4_K", Call::One, &paths, &[1e-3, 2e-3]);
        b.set("Q6_K", Call::Many, &paths, &[1e-3, 0.97e-3]);
        b.merge_into(&file).unwrap();
        let read = Kept::read(&file).unwrap();
        assert_eq!(read.get("Q4_K", Call::One), Some(Kernel::Avx2));
        assert_eq!(
            read.get("Q6_K", Call::Many),
            Some(Kernel::Vnni),
            "3% is within the margin"
        );
        assert_eq!(read.get("Q6_K", Call::One), None);
        assert_eq!(read.rows.len(), 2);
        // What gen did not write, or a damaged line, is an error (then measured again).
        std::fs::write(&file, "something else\n").unwrap();
        assert!(Kept::read(&file).is_err());
        std::fs::write(&file, format!("{}\nQ4_K one no-such-path\n", header())).unwrap();
        assert!(Kept::read(&file).is_err());
        std::fs::remove_file(&file).unwrap();
        assert!(Kept::read(&file).unwrap().rows.is_empty(), "none kept yet");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
