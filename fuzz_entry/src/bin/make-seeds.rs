//! Writes the fuzz targets' seed inputs from the test fixtures:
//! `cargo run --release -p waferc-fuzz-entry --bin make-seeds -- fuzz/seeds`.
//!
//! Seeds are small on purpose (libFuzzer mutates small inputs fastest): safetensors files keep
//! every tensor's name and dtype but shrink each dimension to at most 2; the GGUF seed is the
//! structured target's one-layer llama; the artifact seed is that llama compiled for a 16x16 grid.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};
use waferc_ir::wafer::artifact::{self, Artifact};

fn main() {
    let out = PathBuf::from(std::env::args().nth(1).expect("usage: make-seeds OUT_DIR"));
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository root").to_path_buf();
    let fixtures = repo.join("testsuite/fixtures/hf");
    let models: Vec<PathBuf> = sorted_dir(&fixtures).into_iter().filter(|p| p.is_dir()).collect();

    let ir_files: Vec<PathBuf> = sorted_dir(&repo.join("testsuite/filetests"))
        .into_iter()
        .filter(|d| d.is_dir())
        .flat_map(|d| sorted_dir(&d))
        .filter(|p| p.extension().is_some_and(|e| e == "ir"))
        .collect();
    for ir in ir_files {
        let name = format!("{}-{}", parent_name(&ir), ir.file_name().unwrap().to_string_lossy());
        put(&out, "ir_text", &name, &std::fs::read(&ir).expect("read IR file"));
    }
    for model in &models {
        let model_name = model.file_name().unwrap().to_string_lossy().to_string();
        put(&out, "config_json", &model_name, &std::fs::read(model.join("config.json")).expect("read config"));
        for file in sorted_dir(model) {
            let name = file.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".safetensors") && !name.starts_with("golden") {
                let shrunk = shrink_safetensors(&std::fs::read(&file).expect("read safetensors"));
                put(&out, "safetensors_header", &format!("{model_name}-{name}"), &shrunk);
            }
        }
    }
    for toml in sorted_dir(&repo.join("targets/files")) {
        put(&out, "target_toml", &toml.file_name().unwrap().to_string_lossy(), &std::fs::read(&toml).unwrap());
    }

    let gguf = waferc_fuzz_entry::tiny_llama_gguf();
    put(&out, "gguf", "tiny-llama.gguf", &gguf);
    let scratch = std::env::temp_dir().join(format!("waferc-make-seeds-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let gguf_path = scratch.join("tiny-llama.gguf");
    std::fs::write(&gguf_path, &gguf).unwrap();
    let loaded = waferc::frontend::load(&gguf_path).expect("the tiny llama GGUF loads");
    let target = waferc_targets::Target::resolve("grid:16x16").expect("grid target");
    let options = waferc_passes::wafer::CompileOptions::new(16);
    let program = waferc_passes::wafer::compile(&loaded.module, &target, &options).expect("tiny llama compiles");
    let tokenizer = loaded.tokenizer.map(|t| t.to_json().expect("tokenizer JSON"));
    let compiled = Artifact::new(program, loaded.module).with_tokenizer(tokenizer);
    let artifact_path = scratch.join("tiny-llama.wafer");
    artifact::write(&artifact_path, &compiled).expect("write the artifact");
    put(&out, "artifact", "tiny-llama-16x16.wafer", &std::fs::read(&artifact_path).unwrap());
    std::fs::remove_dir_all(&scratch).unwrap();
}

fn sorted_dir(dir: &Path) -> Vec<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).expect("read dir").map(|e| e.unwrap().path()).collect();
    entries.sort();
    entries
}

fn parent_name(path: &Path) -> String {
    path.parent().and_then(|p| p.file_name()).unwrap().to_string_lossy().to_string()
}

fn put(out: &Path, target: &str, name: &str, bytes: &[u8]) {
    let dir = out.join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

/// The same tensors (names, dtypes, header order) with every dimension cut to at most 2 and the
/// data zero-filled.
fn shrink_safetensors(bytes: &[u8]) -> Vec<u8> {
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let mut shrunk = Map::new();
    let mut end = 0u64;
    for (name, info) in header {
        if name == "__metadata__" {
            shrunk.insert(name, info);
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap().to_string();
        let shape: Vec<u64> = info["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap().min(2)).collect();
        let bits: u64 = match dtype.as_str() {
            "F32" | "I32" | "U32" => 32,
            "BF16" | "F16" => 16,
            "I64" | "F64" => 64,
            _ => 8,
        };
        let size = shape.iter().product::<u64>() * bits / 8;
        shrunk.insert(name, json!({ "dtype": dtype, "shape": shape, "data_offsets": [end, end + size] }));
        end += size;
    }
    let text = Value::Object(shrunk).to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.resize(out.len() + end as usize, 0);
    out
}
