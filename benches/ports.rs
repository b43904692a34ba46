//! What this CPU's vector units sustain, per instruction, in core cycles: the byte products
//! the integer kernels are built from (maddubs, madd), the sign trick, shifts, f32
//! multiply-adds, broadcasts, and pairs of them (does one slow the other, i.e. do they share
//! a pipe?), and on CPUs with AVX-512 VNNI and BF16 the same for the 512-bit kernels'
//! instructions (vpdpbusd, vdpbf16ps, conversions). The clock comes from a chain of dependent
//! integer adds (one a cycle), so the
//! figures are core cycles whatever the time-stamp counter's rate.
//!
//!     cargo bench --bench ports
//!
//! Each line runs 12 independent chains of the instruction (or pair), 12 million times over;
//! "cycles" is the time per instruction (per pair) in core cycles, the best of 5 runs. Read
//! it as the reciprocal throughput: 2.0 for a 256-bit maddubs means one every 2 cycles. The
//! quantized kernels' arithmetic bound follows from it (see docs/speed.md, "On an AVX2-only
//! machine"). x86-64 with AVX2 and FMA only; elsewhere it says so and exits. Not a test: nothing
//! here asserts a speed.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::time::Instant;

    const ROUNDS: u64 = 1_000_000;

    /// Seconds per instruction of `run` (ROUNDS rounds of 12 instructions or pairs): the best
    /// of 5 runs.
    fn per_instruction(run: impl Fn()) -> f64 {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let start = Instant::now();
            run();
            best = best.min(start.elapsed().as_secs_f64() / (12 * ROUNDS) as f64);
        }
        best
    }

    /// Seconds a core takes for one dependent integer add: the clock period.
    fn clock() -> f64 {
        per_instruction(|| {
            let mut x = 0u64;
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
        })
    }

    /// Seconds per instruction (or pair) of a body (see `body!`: one or two mnemonics) run as
    /// 12 independent chains, on ymm0..ymm11, with ymm15 as the other operand (whatever it
    /// holds) and the word at [rsp - 64] as memory operand (only read).
    macro_rules! timed {
        ($($m:tt),+) => {
            per_instruction(|| {
                for _ in 0..ROUNDS {
                    // SAFETY: AVX2/FMA register arithmetic (checked by the caller) and reads of
                    // the stack below rsp, which is mapped; every register used is clobbered.
                    unsafe {
                        asm!(
                            concat!(
                                $(body!($m, "0"), body!($m, "1"), body!($m, "2"),)+
                                $(body!($m, "3"), body!($m, "4"), body!($m, "5"),)+
                                $(body!($m, "6"), body!($m, "7"), body!($m, "8"),)+
                                $(body!($m, "9"), body!($m, "10"), body!($m, "11"),)+
                            ),
                            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                            options(nostack, readonly),
                        )
                    };
                }
            })
        };
    }

    /// One instruction on chain register ymm<r>: `m ymm<r>, ymm<r>, ymm15`, or the operands
    /// the few other forms take (asm! takes only literals, so the text is built here).
    macro_rules! body {
        ("vpsrlw", $r:tt) => {
            concat!("vpsrlw ymm", $r, ", ymm", $r, ", 4\n")
        };
        ("vfmadd231ps", $r:tt) => {
            concat!("vfmadd231ps ymm", $r, ", ymm15, ymm15\n")
        };
        ("vpbroadcastd", $r:tt) => {
            concat!("vpbroadcastd ymm", $r, ", dword ptr [rsp - 64]\n")
        };
        ($m:tt, $r:tt) => {
            concat!($m, " ymm", $r, ", ymm", $r, ", ymm15\n")
        };
    }

    /// As `timed!`, on 512-bit registers (zmm0..zmm11, zmm15 the other operand), for the
    /// VNNI kernels' bound.
    macro_rules! timed512 {
        ($($m:tt),+) => {{
            #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512bf16")]
            unsafe fn go() {
                for _ in 0..ROUNDS {
                    // SAFETY: AVX-512 register arithmetic (checked by the caller) and reads of
                    // the stack below rsp, which is mapped; every register used is clobbered.
                    unsafe {
                        asm!(
                            concat!(
                                $(body512!($m, "0"), body512!($m, "1"), body512!($m, "2"),)+
                                $(body512!($m, "3"), body512!($m, "4"), body512!($m, "5"),)+
                                $(body512!($m, "6"), body512!($m, "7"), body512!($m, "8"),)+
                                $(body512!($m, "9"), body512!($m, "10"), body512!($m, "11"),)+
                            ),
                            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                            out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                            options(nostack, readonly),
                        )
                    };
                }
            }
            // SAFETY: only called where the CPU has the features (see `run`).
            per_instruction(|| unsafe { go() })
        }};
    }

    /// One 512-bit instruction on chain register zmm<r> (see `body!`).
    macro_rules! body512 {
        ("vcvtdq2ps", $r:tt) => {
            concat!("vcvtdq2ps zmm", $r, ", zmm15\n")
        };
        ("vcvtph2ps", $r:tt) => {
            concat!("vcvtph2ps zmm", $r, ", ymm15\n")
        };
        ("vpbroadcastd", $r:tt) => {
            concat!("vpbroadcastd zmm", $r, ", dword ptr [rsp - 64]\n")
        };
        ($m:tt, $r:tt) => {
            concat!($m, " zmm", $r, ", zmm15, zmm15\n")
        };
    }

    /// Measures one row: its name and what `time` gives, in core cycles.
    type Row<'a> = dyn FnMut(&str, &dyn Fn() -> f64) -> (String, f64) + 'a;

    /// The 512-bit table, on CPUs with AVX-512 VNNI and BF16: the integer kernels' byte dot
    /// product (vpdpbusd), the f32 multiply-add, the conversions and adds of their sums, and
    /// the pairs a kernel's inner loop issues together.
    fn run512(row: &mut Row) -> Vec<(String, f64)> {
        vec![
            row("vpdpbusd", &|| timed512!("vpdpbusd")),
            row("vfmadd231ps", &|| timed512!("vfmadd231ps")),
            row("vdpbf16ps", &|| timed512!("vdpbf16ps")),
            row("vcvtdq2ps", &|| timed512!("vcvtdq2ps")),
            row("vcvtph2ps (from ymm)", &|| timed512!("vcvtph2ps")),
            row("vpaddd", &|| timed512!("vpaddd")),
            row("vpmulld", &|| timed512!("vpmulld")),
            row("vpdpbusd + vfmadd231ps", &|| {
                timed512!("vpdpbusd", "vfmadd231ps")
            }),
            row("vpdpbusd + vcvtdq2ps", &|| {
                timed512!("vpdpbusd", "vcvtdq2ps")
            }),
            row("vpdpbusd + vpaddd", &|| timed512!("vpdpbusd", "vpaddd")),
            row("vpdpbusd + vpmulld", &|| timed512!("vpdpbusd", "vpmulld")),
            row("vpdpbusd + vpbroadcastd", &|| {
                timed512!("vpdpbusd", "vpbroadcastd")
            }),
            row("vfmadd231ps + vcvtph2ps", &|| {
                timed512!("vfmadd231ps", "vcvtph2ps")
            }),
        ]
    }

    pub fn run() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            println!("ports: this CPU has no AVX2/FMA; nothing to measure");
            return;
        }
        // The clock is measured again beside each row: this machine's speed drifts.
        let mut periods = Vec::new();
        let mut row = |name: &str, time: &dyn Fn() -> f64| {
            let period = clock();
            periods.push(period);
            (name.to_string(), time() / period)
        };
        let rows = [
            row("vpmaddubsw", &|| timed!("vpmaddubsw")),
            row("vpmaddwd", &|| timed!("vpmaddwd")),
            row("vpaddw", &|| timed!("vpaddw")),
            row("vpand", &|| timed!("vpand")),
            row("vpsignb", &|| timed!("vpsignb")),
            row("vpsrlw (immediate)", &|| timed!("vpsrlw")),
            row("vfmadd231ps", &|| timed!("vfmadd231ps")),
            row("vpbroadcastd from memory", &|| timed!("vpbroadcastd")),
            row("vpmaddubsw + vpmaddwd", &|| {
                timed!("vpmaddubsw", "vpmaddwd")
            }),
            row("vpmaddubsw + vpaddw", &|| timed!("vpmaddubsw", "vpaddw")),
            row("vpmaddubsw + vpsignb", &|| timed!("vpmaddubsw", "vpsignb")),
            row("vpmaddubsw + vpsrlw", &|| timed!("vpmaddubsw", "vpsrlw")),
            row("vpmaddubsw + vfmadd231ps", &|| {
                timed!("vpmaddubsw", "vfmadd231ps")
            }),
            row("vpmaddubsw + vpbroadcastd", &|| {
                timed!("vpmaddubsw", "vpbroadcastd")
            }),
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
        let wide = ["avx512f", "avx512bw", "avx512vnni", "avx512bf16"];
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512bf16"))
        {
            println!();
            println!(
                "(no 512-bit table: this CPU lacks one of {})",
                wide.join(", ")
            );
            return;
        }
        let mut row = |name: &str, time: &dyn Fn() -> f64| {
            let period = clock();
            (name.to_string(), time() / period)
        };
        println!();
        println!("| 512-bit instruction(s) | cycles each |");
        println!("|---|---|");
        for (name, cycles) in run512(&mut row) {
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
