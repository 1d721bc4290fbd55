//! See `waferc_fuzz_entry::artifact`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = waferc_fuzz_entry::artifact(data);
});
