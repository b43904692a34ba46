//! Ctrl-C: the first press asks the running phase to stop cleanly (the partial reply is flushed
//! and the report printed, exit 130); a second press exits at once. `gen chat` clears a handled
//! press, so Ctrl-C there stops one reply and returns to the prompt.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Exit status of a run ended by Ctrl-C (128 + SIGINT), as shells expect.
pub const EXIT_INTERRUPTED: i32 = 130;

pub fn install() {
    // Failing to install (a handler already set by an embedding program) leaves the default
    // behaviour, which also ends the process on Ctrl-C: nothing to report.
    let _ = ctrlc::set_handler(|| {
        if REQUESTED.swap(true, Ordering::SeqCst) {
            std::process::exit(EXIT_INTERRUPTED);
        }
    });
}

pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// Forget a Ctrl-C that was handled (a chat's interrupted reply): the next press asks again
/// instead of exiting.
pub fn clear() {
    REQUESTED.store(false, Ordering::SeqCst);
}
