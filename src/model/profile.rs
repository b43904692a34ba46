//! GEN_PROFILE=1: where a forward pass's time goes, phase by phase.
//!
//! Each phase is timed to the end of its device work: at every boundary the device is
//! synchronised (on a GPU, kernels are queued and run later; without the synchronisation the
//! time would land on whichever phase waits next). Those waits make the whole pass slower than
//! an unprofiled one, so compare phases with each other, not the total with a plain run. Passes
//! of one-token steps only (decode) and passes holding a prompt (prefill) are kept apart. The
//! tables go to stderr when the model is dropped, each line starting with `profile`.

use std::time::{Duration, Instant};

use candle_core::Device;

#[derive(Default)]
struct Table {
    passes: usize,
    /// Phases in the order first seen, with their summed time.
    phases: Vec<(&'static str, Duration)>,
}

pub struct Profile {
    on: bool,
    decode: bool,
    last: Instant,
    tables: [Table; 2], // prefill, decode
}

impl Profile {
    /// On when GEN_PROFILE is set to anything but `0` or the empty string.
    pub fn from_env() -> Self {
        let on = std::env::var("GEN_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0");
        Self {
            on,
            decode: false,
            last: Instant::now(),
            tables: Default::default(),
        }
    }

    /// A pass begins; `decode`: it holds only one-token steps.
    pub fn start(&mut self, decode: bool) {
        if self.on {
            self.decode = decode;
            self.tables[decode as usize].passes += 1;
            self.last = Instant::now();
        }
    }

    /// The phase `name` ends here: wait for the device, charge the time since the last mark.
    pub fn mark(&mut self, device: &Device, name: &'static str) {
        if !self.on {
            return;
        }
        // A failed synchronisation shows up again in the pass's next operation.
        let _ = device.synchronize();
        let now = Instant::now();
        let spent = now - self.last;
        self.last = now;
        let table = &mut self.tables[self.decode as usize];
        match table.phases.iter_mut().find(|(n, _)| *n == name) {
            Some((_, d)) => *d += spent,
            None => table.phases.push((name, spent)),
        }
    }

    /// The tables, as the lines `Drop` prints.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (table, kind) in self.tables.iter().zip(["prefill", "decode"]) {
            if table.passes == 0 {
                continue;
            }
            let total: Duration = table.phases.iter().map(|(_, d)| *d).sum();
            out.push(format!(
                "profile {kind}: {} passes, {:.1} ms in all ({:.3} ms a pass)",
                table.passes,
                total.as_secs_f64() * 1e3,
                total.as_secs_f64() * 1e3 / table.passes as f64
            ));
            for (name, d) in &table.phases {
                out.push(format!(
                    "profile {kind}   {name:<18} {:>9.3} ms a pass {:>5.1}%",
                    d.as_secs_f64() * 1e3 / table.passes as f64,
                    100.0 * d.as_secs_f64() / total.as_secs_f64().max(1e-12)
                ));
            }
        }
        out
    }
}

impl Drop for Profile {
    fn drop(&mut self) {
        if self.on {
            for line in self.lines() {
                eprintln!("{line}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_per_kind_of_pass() {
        let mut p = Profile {
            on: true,
            decode: false,
            last: Instant::now(),
            tables: Default::default(),
        };
        for decode in [false, true, true] {
            p.start(decode);
            std::thread::sleep(Duration::from_millis(2));
            p.mark(&Device::Cpu, "a");
            p.mark(&Device::Cpu, "b");
            std::thread::sleep(Duration::from_millis(1));
            p.mark(&Device::Cpu, "a");
        }
        let lines = p.lines();
        assert!(
            lines[0].starts_with("profile prefill: 1 passes"),
            "{lines:?}"
        );
        assert!(
            lines[3].starts_with("profile decode: 2 passes"),
            "{lines:?}"
        );
        // Two phases each; "a" holds the sleeps (3 ms a pass at least).
        assert_eq!(lines.len(), 6);
        let a: f64 = lines[4].split_whitespace().nth(3).unwrap().parse().unwrap();
        assert!(a >= 3.0, "{lines:?}");
        p.on = false; // nothing printed by the test
    }
}
