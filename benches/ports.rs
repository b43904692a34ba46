//! What this CPU's vector units sustain, per instruction, in core cycles: the byte products
//! the integer kernels are built from (maddubs, madd), the sign trick, shifts, f32
//! multiply-adds, broadcasts, and pairs of them (does one slow the other, i.e. do they share
//! a pipe?). The clock comes from a chain of dependent integer adds (one a cycle), so the
//! figures are core cycles whatever the time-stamp counter's rate.
//!
//!     cargo bench --bench ports
//!
//! Each line runs 12 independent chains of the instruction (or pair), 12 million times over;
//! "cycles" is the time per instruction (per pair) in core cycles, the best of 5 runs. Read
//! it as the reciprocal throughput: 2.0 for a 256-bit maddubs means one every 2 cycles. The
//! quantized kernels' arithmetic bound follows from it (see README, "Every GGUF type"). x86-64
//! with AVX2 and FMA only; elsewhere it says so and exits. Not a test: nothing here asserts a
//! speed.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::time::Instant;

    const ROUNDS: u64 = 1_000_000;

    /// Seconds a core takes for one dependent integer add: the clock period.
    fn clock() -> f64 {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let mut x = 0u64;
            let start = Instant::now();
            for _ in 0..ROUNDS {
                // SAFETY: register arithmetic only.
                unsafe {
                    asm!(
                        "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                        "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                        "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                        x = inout(reg) x,
                        options(nomem, nostack),
                    )
                };
            }
            std::hint::black_box(x);
            best = best.min(start.elapsed().as_secs_f64() / (12 * ROUNDS) as f64);
        }
        best
    }

    /// Seconds per instruction (or pair) of a body (see `body!`) run as 12 independent chains,
    /// on ymm0..ymm11, with ymm15 as the other operand (whatever it holds) and the word at
    /// [rsp - 64] as memory operand (only read).
    macro_rules! timed {
        ($body:tt) => {{
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = Instant::now();
                for _ in 0..ROUNDS {
                    // SAFETY: AVX2/FMA register arithmetic (checked by the caller) and reads of
                    // the stack below rsp, which is mapped; every register used is clobbered.
                    unsafe {
                        asm!(
                            concat!(
                                timed!(@r $body, "0"), timed!(@r $body, "1"),
                                timed!(@r $body, "2"), timed!(@r $body, "3"),
                                timed!(@r $body, "4"), timed!(@r $body, "5"),
                                timed!(@r $body, "6"), timed!(@r $body, "7"),
                                timed!(@r $body, "8"), timed!(@r $body, "9"),
                                timed!(@r $body, "10"), timed!(@r $body, "11"),
                            ),
                            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                            options(nostack, readonly),
                        )
                    };
                }
                best = best.min(start.elapsed().as_secs_f64() / (12 * ROUNDS) as f64);
            }
            best
        }};
        (@r $body:tt, $r:tt) => {
            body!($body, $r)
        };
    }

    /// A body's instructions on chain register ymm<r> (asm! takes only literals, so each
    /// body is spelt out here).
    macro_rules! body {
        ("maddubs", $r:tt) => {
            concat!("vpmaddubsw ymm", $r, ", ymm", $r, ", ymm15\n")
        };
        ("madd", $r:tt) => {
            concat!("vpmaddwd ymm", $r, ", ymm", $r, ", ymm15\n")
        };
        ("paddw", $r:tt) => {
            concat!("vpaddw ymm", $r, ", ymm", $r, ", ymm15\n")
        };
        ("pand", $r:tt) => {
            concat!("vpand ymm", $r, ", ymm", $r, ", ymm15\n")
        };
        ("psignb", $r:tt) => {
            concat!("vpsignb ymm", $r, ", ymm", $r, ", ymm15\n")
        };
        ("psrlw", $r:tt) => {
            concat!("vpsrlw ymm", $r, ", ymm", $r, ", 4\n")
        };
        ("fma", $r:tt) => {
            concat!("vfmadd231ps ymm", $r, ", ymm15, ymm15\n")
        };
        ("broadcast", $r:tt) => {
            concat!("vpbroadcastd ymm", $r, ", dword ptr [rsp - 64]\n")
        };
        ("maddubs+madd", $r:tt) => {
            concat!(body!("maddubs", $r), body!("madd", $r))
        };
        ("maddubs+paddw", $r:tt) => {
            concat!(body!("maddubs", $r), body!("paddw", $r))
        };
        ("maddubs+psignb", $r:tt) => {
            concat!(body!("maddubs", $r), body!("psignb", $r))
        };
        ("maddubs+psrlw", $r:tt) => {
            concat!(body!("maddubs", $r), body!("psrlw", $r))
        };
        ("maddubs+fma", $r:tt) => {
            concat!(body!("maddubs", $r), body!("fma", $r))
        };
        ("maddubs+broadcast", $r:tt) => {
            concat!(body!("maddubs", $r), body!("broadcast", $r))
        };
    }

    pub fn run() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            println!("ports: this CPU has no AVX2/FMA; nothing to measure");
            return;
        }
        // The clock is measured again beside each row: this machine's speed drifts.
        let mut periods = Vec::new();
        let mut row = |name: &str, time: &dyn Fn() -> f64| {
            let period = clock().min(clock());
            periods.push(period);
            (name.to_string(), time() / period)
        };
        let rows = [
            row("vpmaddubsw", &|| timed!("maddubs")),
            row("vpmaddwd", &|| timed!("madd")),
            row("vpaddw", &|| timed!("paddw")),
            row("vpand", &|| timed!("pand")),
            row("vpsignb", &|| timed!("psignb")),
            row("vpsrlw (immediate)", &|| timed!("psrlw")),
            row("vfmadd231ps", &|| timed!("fma")),
            row("vpbroadcastd from memory", &|| timed!("broadcast")),
            row("vpmaddubsw + vpmaddwd", &|| timed!("maddubs+madd")),
            row("vpmaddubsw + vpaddw", &|| timed!("maddubs+paddw")),
            row("vpmaddubsw + vpsignb", &|| timed!("maddubs+psignb")),
            row("vpmaddubsw + vpsrlw", &|| timed!("maddubs+psrlw")),
            row("vpmaddubsw + vfmadd231ps", &|| timed!("maddubs+fma")),
            row("vpmaddubsw + vpbroadcastd", &|| timed!("maddubs+broadcast")),
        ];
        let ghz = |p: f64| 1e-9 / p;
        let (lo, hi) = periods.iter().fold((f64::MAX, 0f64), |(lo, hi), &p| {
            (lo.min(ghz(p)), hi.max(ghz(p)))
        });
        println!("core clock {lo:.2}-{hi:.2} GHz (dependent adds, beside each row)");
        println!();
        println!("| 256-bit instruction(s) | cycles each |");
        println!("|---|---|");
        for (name, cycles) in rows {
            println!("| {name} | {cycles:.2} |");
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    x86::run();
    #[cfg(not(target_arch = "x86_64"))]
    println!("ports: x86-64 only");
}
