//! The entry points of waferc's fuzz targets, shared by the cargo-fuzz crate (`fuzz/`, nightly,
//! libFuzzer) and the stable-toolchain replay test (`testsuite/tests/fuzz_replay.rs`), so the
//! replay runs exactly the code the fuzzer ran.
//!
//! Each entry takes the fuzzer's bytes and returns `Ok` or the error waferc reported. A panic,
//! an abort, a hang or an allocation past libFuzzer's `-rss_limit_mb` is a bug; an `Err` is the
//! expected answer to a bad input. Files are fed through the same functions `waferc` uses on
//! disk, from an anonymous memory map named like the real file, so every error names that file.

mod checkpoint_dir;
mod gguf_spec;

use std::path::Path;
use std::sync::Arc;

use memmap2::{Mmap, MmapMut};
use waferc::frontend;
use waferc::inspect::{self, ColourBy, Filter};
use waferc_ir::wafer::artifact;
use waferc_runtime::executor::{ExecOptions, Executor};
use waferc_targets::Target;

pub use checkpoint_dir::checkpoint_dir;
pub use gguf_spec::{gguf_structured, tiny_llama_gguf};

/// One fuzz target: its name (the cargo-fuzz target and corpus directory) and its entry.
pub struct FuzzTarget {
    pub name: &'static str,
    pub entry: fn(&[u8]) -> Result<(), String>,
}

/// Every target, in the order the run script fuzzes them.
pub const TARGETS: &[FuzzTarget] = &[
    FuzzTarget { name: "ir_text", entry: ir_text },
    FuzzTarget { name: "config_json", entry: config_json },
    FuzzTarget { name: "safetensors_header", entry: safetensors_header },
    FuzzTarget { name: "target_toml", entry: target_toml },
    FuzzTarget { name: "gguf", entry: gguf },
    FuzzTarget { name: "gguf_structured", entry: gguf_structured },
    FuzzTarget { name: "checkpoint_dir", entry: checkpoint_dir },
    FuzzTarget { name: "artifact", entry: artifact },
];

/// A read-only anonymous map holding `bytes`: what the file readers take, without a file.
pub fn anon_map(bytes: &[u8]) -> Arc<Mmap> {
    let mut map = MmapMut::map_anon(bytes.len()).expect("anonymous map for a fuzz input");
    map.copy_from_slice(bytes);
    Arc::new(map.make_read_only().expect("make the anonymous map read-only"))
}

/// The IR text parser and verifier; a module that parses must also print and parse back to the
/// same text.
pub fn ir_text(data: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(data).map_err(|e| e.to_string())?;
    let module = waferc_ir::text::parse(text).map_err(|e| e.to_string())?;
    let printed = waferc_ir::text::print(&module);
    let again = waferc_ir::text::parse(&printed)
        .unwrap_or_else(|e| panic!("printed module does not parse back: {e}\n{printed}"));
    assert_eq!(waferc_ir::text::print(&again), printed, "print/parse round trip changed the module");
    waferc_ir::verify(&module).map_err(|e| e.to_string())
}

/// `config.json` of a Hugging Face checkpoint.
pub fn config_json(data: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(data).map_err(|e| e.to_string())?;
    frontend::config::parse_config(text, Path::new("config.json")).map(drop).map_err(|e| e.to_string())
}

/// One safetensors file image (header length, JSON header, data), as each shard is validated.
pub fn safetensors_header(data: &[u8]) -> Result<(), String> {
    frontend::safetensors::check_image(data, Path::new("fuzz.safetensors")).map(drop).map_err(|e| e.to_string())
}

/// A target TOML file; a target that parses is also listed, and a small dense model (shape only)
/// is compiled onto it, so grid sizes and rates reach the placer.
pub fn target_toml(data: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(data).map_err(|e| e.to_string())?;
    let target = Target::from_toml(text, "fuzz.toml").map_err(|e| e.to_string())?;
    let _ = (target.params(), target.total_pes(), target.total_sram_bytes(), target.rows(), target.to_json());
    let module = waferc_ir::text::parse(SMALL_MODEL).expect("the built-in model parses");
    let options = waferc_passes::wafer::CompileOptions::new(64);
    waferc_passes::wafer::compile(&module, &target, &options).map(drop).map_err(|e| e.to_string())
}

/// A small dense llama (2 layers, hidden 64, shape only): what `target_toml` compiles.
const SMALL_MODEL: &str = include_str!("../../testsuite/filetests/verify/dense-llama.ir");

/// A GGUF file image, read and lowered as `waferc compile model.gguf` does.
pub fn gguf(data: &[u8]) -> Result<(), String> {
    read_gguf(data)
}

pub(crate) fn read_gguf(data: &[u8]) -> Result<(), String> {
    let path = Path::new("fuzz.gguf");
    let (checkpoint, tokenizer) = frontend::gguf::read_image(anon_map(data), path).map_err(|e| e.to_string())?;
    if let Some(tokenizer) = tokenizer {
        let ids = tokenizer.encode("Hello, wafer!").map_err(|e| e.to_string())?;
        tokenizer.decode(&ids).map_err(|e| e.to_string())?;
    }
    frontend::lower(&checkpoint).map(drop).map_err(|e| e.to_string())
}

/// An artifact image (header, checksum, tile blob, IR blob, tokenizer), then `inspect` (text, JSON, SVG) and one decode step of `run` on it.
///
/// Structure-aware: an input that starts with the artifact magic has its IR blob length and
/// checksum recomputed from its bytes, so a mutated header or blob gets past the corruption
/// check (which random bytes never pass) into the decoder, the module parser and the executor.
pub fn artifact(data: &[u8]) -> Result<(), String> {
    let mut image = data.to_vec();
    seal_artifact(&mut image);
    let compiled = artifact::read_image(anon_map(&image), Path::new("fuzz.wafer")).map_err(|e| e.to_string())?;
    // As `waferc run` and `inspect` do, executor errors (which name the instruction and PE) get
    // the artifact's name in front.
    let running = |e: waferc_runtime::executor::ExecError| format!("running fuzz.wafer: {e}");
    let (program, module) = (&compiled.program, &compiled.module);
    if let Some(json) = &compiled.tokenizer_json {
        let tokenizer = frontend::Tokenizer::from_json(json, Path::new("fuzz.wafer")).map_err(|e| e.to_string())?;
        let ids = tokenizer.encode("Hello, wafer!").map_err(|e| e.to_string())?;
        tokenizer.decode(&ids).map_err(|e| e.to_string())?;
    }
    let filter = Filter::all();
    let timing = ExecOptions { timing_only: true, record_values: false };
    let mut executor = Executor::new(program, module, None, timing).map_err(running)?;
    executor.step(0).map_err(running)?;
    inspect::summary_text(program, Some(module), &filter, None);
    inspect::write_placement_json(program, Some(module), &filter, &mut std::io::sink(), true)
        .map_err(|e| e.to_string())?;
    inspect::placement_svg(program, Some(module), &filter, ColourBy::Layer);
    let functional = ExecOptions { timing_only: false, record_values: false };
    let mut executor = Executor::new(program, module, compiled.tiles.bytes(), functional).map_err(running)?;
    executor.step(0).map(drop).map_err(running)
}

/// Makes an artifact image whose prefix carries the magic consistent: the IR blob length takes
/// up whatever follows the header and tile blob, and the checksum is recomputed.
pub fn seal_artifact(image: &mut [u8]) {
    if image.len() < artifact::PREFIX_LEN || image[..8] != artifact::MAGIC {
        return;
    }
    let u64_at = |image: &[u8], at: usize| u64::from_le_bytes(image[at..at + 8].try_into().expect("8 bytes"));
    let body = (image.len() - artifact::PREFIX_LEN) as u64;
    let (header_len, tile_len) = (u64_at(image, 12), u64_at(image, 20));
    if let Some(ir_len) = header_len.checked_add(tile_len).and_then(|used| body.checked_sub(used)) {
        image[28..36].copy_from_slice(&ir_len.to_le_bytes());
    }
    let sum = artifact::checksum(&image[artifact::PREFIX_LEN..]);
    image[36..44].copy_from_slice(&sum.to_le_bytes());
}
