//! `--prompt-cache FILE` is read before every run, and the file may be cut short, damaged,
//! another model's or a newer gen's: `gen::prompt_cache::parse` on any bytes must return the
//! token ids and block data of a whole file for this model, or one line saying why not (the
//! warning gen prints before it rewrites the file), without a panic, a hang or an allocation
//! larger than the file.
//!
//! Input layout: the first byte's bits pick the block size in bytes (two bits), whether to write
//! this model's id into the header (bit 2, so the fuzzer gets past the id check) and whether to
//! put the right SHA-256 of the rest into the last 32 bytes (bit 3, which it could not find by
//! itself); the rest is the file.
#![no_main]

use gen::prompt_cache::{encode, parse};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

/// The model the target plays: the seeds in fuzz/corpus/prompt_cache hold this id.
const MODEL_ID: [u8; 32] = [0x5a; 32];
/// Blocks of 16 tokens at 1, 4, 24 and 256 KV bytes a token.
const BLOCK_BYTES: [usize; 4] = [16, 64, 384, 4096];
const BLOCK_SIZE: usize = 16;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let block_bytes = BLOCK_BYTES[usize::from(flags & 3)];
    let mut file = rest.to_vec();
    if flags & 4 != 0 && file.len() >= 44 {
        file[12..44].copy_from_slice(&MODEL_ID);
    }
    if flags & 8 != 0 && file.len() >= 32 {
        let body = file.len() - 32;
        let sum = Sha256::digest(&file[..body]);
        file[body..].copy_from_slice(&sum);
    }
    match parse(&file, &MODEL_ID, block_bytes) {
        Ok((tokens, blocks)) => {
            // Whole blocks, each with its keys and values: what restoring slices out of it.
            assert_eq!(tokens.len() % BLOCK_SIZE, 0);
            assert_eq!(blocks.len(), tokens.len() / BLOCK_SIZE * block_bytes);
            // And exactly what saving those tokens and blocks writes.
            assert_eq!(encode(&MODEL_ID, block_bytes, &tokens, blocks), file);
        }
        Err(why) => {
            assert!(!why.is_empty() && !why.contains('\n'), "{why:?}");
            assert!(why.len() < 200, "{why:?}");
        }
    }
});
