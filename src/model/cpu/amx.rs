//! Intel AMX: whether this process may use it, and the tile configuration. The products on it
//! are [`super::amx_half`]'s.
//!
//! Linux hands a process the tile registers only after it asks (`arch_prctl`), once; [`ready`]
//! asks and says whether this CPU and kernel allow it.

#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::sync::OnceLock;

/// `arch_prctl` request for permission to use an extended state component, and AMX's tile
/// data component.
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Whether this CPU has AMX (tiles, bf16 and 8-bit integers: every AMX CPU so far has all
/// three) and this process may use it (asked for once).
pub fn ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE, bit 25 AMX-INT8.
        // CPUID leaf 7 exists on every x86_64 CPU with AVX2 (the kernels' floor); an absent
        // leaf reads as zeros.
        let leaf = std::arch::x86_64::__cpuid_count(7, 0);
        let all = (1 << 22) | (1 << 24) | (1 << 25);
        if leaf.edx & all != all {
            return false;
        }
        // SAFETY: a plain system call with integer arguments.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        rc == 0
    })
}

/// A tile configuration (palette 1): each tile register's rows and bytes a row.
#[repr(C, align(64))]
pub struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl Config {
    pub fn new() -> Self {
        Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        }
    }

    /// Tile register `t`: `rows` rows (at most 16) of `bytes` bytes (at most 64).
    pub fn set(&mut self, t: usize, rows: usize, bytes: usize) {
        debug_assert!(rows <= 16 && bytes <= 64);
        self.rows[t] = rows as u8;
        self.colsb[t] = bytes as u16;
    }
}

thread_local! {
    /// The configuration this thread's tile registers have (a [`configure_with`] key; 0: none).
    static LOADED: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Loads the tile configuration `make()` on this thread, unless the one named `key` (not 0) is
/// already loaded: loading one (`ldtilecfg`) resets every tile and costs as much as a small
/// call's tile multiplies, so a thread keeps its configuration between calls (and its tile
/// registers, which Linux saves with the thread's other registers).
///
/// # Safety
/// [`ready`] must have returned true; no other code on this thread changes the configuration.
#[inline]
pub unsafe fn configure_with(key: u32, make: impl FnOnce() -> Config) {
    debug_assert_ne!(key, 0);
    if LOADED.get() != key {
        let c = make();
        asm!("ldtilecfg [{}]", in(reg) &c, options(nostack, readonly, preserves_flags));
        LOADED.set(key);
    }
}
