//! Ctrl-C, and the signals scripts and schedulers send to end a job (SIGTERM from `timeout`,
//! `kill` and job schedulers; SIGHUP when the terminal goes away): the first asks the running
//! phase to stop cleanly (the partial reply is flushed, `--batch` writes every line with the
//! unfinished ones `"stop":"interrupted"`, the report is printed, exit 128 + the signal: 130
//! for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP); a second exits at once. `gen chat` clears a
//! handled Ctrl-C, so Ctrl-C there stops one reply and returns to the prompt.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);
/// The signal that asked, 0 before any.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Exit status of a run ended by Ctrl-C (128 + SIGINT), as shells expect.
pub const EXIT_INTERRUPTED: i32 = 130;

/// The exit status of a run ended by the signal that asked: 128 + its number (130 for Ctrl-C).
pub fn exit_status() -> i32 {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => EXIT_INTERRUPTED,
        sig => 128 + sig,
    }
}

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    // Only atomics and _exit here: both are async-signal-safe.
    if REQUESTED.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe and ends the process at once.
        unsafe { libc::_exit(128 + sig) };
    }
    SIGNAL.store(sig, Ordering::SeqCst);
}

pub fn install() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is valid; the handler only touches atomics and _exit.
        // SA_RESTART: a read of standard input goes on after a handled signal (the loops
        // check `requested` between reads).
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            // Failing (not expected for these signals) leaves the default, which also ends
            // the process: nothing to report.
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
    #[cfg(not(unix))]
    let _ = ctrlc::set_handler(|| {
        if REQUESTED.swap(true, Ordering::SeqCst) {
            std::process::exit(EXIT_INTERRUPTED);
        }
    });
}

/// Whether the request came from Ctrl-C (or none came): `gen chat` stops the reply and goes on
/// after it, where SIGTERM and SIGHUP end the session.
pub fn by_ctrl_c() -> bool {
    matches!(SIGNAL.load(Ordering::SeqCst), 0 | 2)
}

pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// Forget a Ctrl-C that was handled (a chat's interrupted reply): the next press asks again
/// instead of exiting.
pub fn clear() {
    REQUESTED.store(false, Ordering::SeqCst);
    SIGNAL.store(0, Ordering::SeqCst);
}
