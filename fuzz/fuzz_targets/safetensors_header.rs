//! See `waferc_fuzz_entry::safetensors_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = waferc_fuzz_entry::safetensors_header(data);
});
