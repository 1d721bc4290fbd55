//! See `waferc_fuzz_entry::gguf`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = waferc_fuzz_entry::gguf(data);
});
