//! The `gen` binary: parse the flags, run, map the outcome to an exit status.

use std::process::ExitCode;

use clap::Parser;
use gen::{app, cli, interrupt};

/// A forward pass allocates and frees buffers of a few MB (activations of a prompt chunk or a
/// batch) dozens of times per layer. With glibc's defaults each thread allocates from its own
/// arena, buffers above a moving threshold get their own mapping, and freed memory at the top of
/// a heap goes back to the kernel: the next pass then page-faults the same memory in again, which
/// took a fifth of the time of a batch run (1.3M faults for 16 prompts; 0.1M with this). Keep
/// one arena, serve buffers up to 32 MiB from it, and never trim: memory is held at its peak
/// until the process ends, which for a generation run is what it would need again anyway.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    // SAFETY: mallopt only changes allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

fn main() -> ExitCode {
    tune_allocator();
    let argv = cli::llama_spellings(std::env::args_os());
    if let Some(help) = cli::help_request(&argv) {
        print!("{help}");
        return ExitCode::SUCCESS;
    }
    let args = match cli::Args::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) if !e.use_stderr() => {
            // --help and --version: their text is what the user asked for.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let rendered = e.to_string();
            let first = rendered.lines().next().unwrap_or_default();
            let first = first.strip_prefix("error: ").unwrap_or(first);
            // clap's suggestion for a mistyped flag or value, on the same line.
            let tip = rendered
                .lines()
                .map(str::trim)
                .find_map(|l| l.strip_prefix("tip: "))
                .map(|t| format!("; {t}"))
                .unwrap_or_default();
            eprintln!("gen: error: {first}{tip} (see gen --help)");
            return ExitCode::from(2);
        }
    };
    if args.command == Some(cli::Command::Models) {
        let hub = gen::source::hub::HubConfig::from_env().cache_dir;
        print!(
            "{}",
            gen::source::listing::listing(&gen::source::cache_dir(), &hub)
        );
        return ExitCode::SUCCESS;
    }
    let threads = args.threads;
    let cfg = match args.resolve() {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("gen: error: {e:#}");
            return ExitCode::from(2);
        }
    };
    if let Some(n) = threads {
        // candle's CPU kernels and rayon's pool both size themselves from this variable;
        // set it before either starts a thread.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    interrupt::install();
    // Run on a worker of the thread pool that does the parallel work: each of the ~150 parallel
    // regions of a decode step is then split between workers directly, instead of being handed
    // over from this thread and waited for.
    let result = match rayon::ThreadPoolBuilder::new().build() {
        Ok(pool) => pool.install(|| app::run(&cfg)),
        Err(_) => app::run(&cfg),
    };
    match result {
        Ok(app::Outcome::Done) => ExitCode::SUCCESS,
        Ok(app::Outcome::Interrupted) => ExitCode::from(interrupt::exit_status() as u8),
        Ok(app::Outcome::PromptsFailed { failed, total }) => {
            eprintln!("gen: error: {failed} of {total} prompts failed (see their \"error\" lines)");
            ExitCode::from(1)
        }
        Err(e) => {
            if interrupt::requested() {
                eprintln!("gen: interrupted");
                return ExitCode::from(interrupt::exit_status() as u8);
            }
            eprintln!("gen: error: {e:#}");
            // A usage error found only after parsing (an empty prompt) exits as clap's do.
            match e.downcast_ref::<app::Usage>() {
                Some(_) => ExitCode::from(2),
                None => ExitCode::from(1),
            }
        }
    }
}
