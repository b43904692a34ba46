//! GGUF header and metadata: `gen::format::gguf::validate`, then candle's reader only on files it passes,
//! as `gen::model::load_gguf` does. Neither may panic, abort, hang or allocate without bound.
#![no_main]

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::Mutex;

use candle_core::quantized::gguf_file;
use libfuzzer_sys::fuzz_target;

/// One scratch file per fuzzing process, rewritten for each input (validate takes a `File`).
static SCRATCH: Mutex<Option<(File, PathBuf)>> = Mutex::new(None);

fn scratch_dir() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

fuzz_target!(|data: &[u8]| {
    let mut guard = SCRATCH.lock().unwrap_or_else(|e| e.into_inner());
    let (file, path) = guard.get_or_insert_with(|| {
        let path = scratch_dir().join(format!("gen-fuzz-gguf-{}.gguf", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("scratch file");
        // Only the open file is used (the path just names it in errors): unlinking it now leaves
        // nothing behind when the process ends.
        let _ = std::fs::remove_file(&path);
        (file, path)
    });
    file.set_len(0).expect("truncate scratch file");
    file.seek(SeekFrom::Start(0)).expect("seek");
    file.write_all(data).expect("write scratch file");
    file.seek(SeekFrom::Start(0)).expect("seek");

    if gen::format::gguf::validate(file, path).is_ok() {
        // validate promises: candle's reader, from the start of the file, cannot misbehave.
        if let Ok(content) = gguf_file::Content::read(file) {
            // Touch what the loader touches next: string and integer metadata.
            for value in content.metadata.values() {
                let _ = value.to_string();
                let _ = value.to_u32();
            }
        }
    }
});
