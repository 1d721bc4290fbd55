//! Bad checkpoints, built in temporary directories from copies of the fixtures: each is rejected
//! with an error that names the file, tensor or field and the values involved, and never panics.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{json, Map, Value};
use waferc::frontend::{load, FrontendError};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf").join(name)
}

/// A fresh copy of a fixture directory (without its goldens) that a test may damage.
fn copy_fixture(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("frontend_errors-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)))
        .join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        let file_name = path.file_name().unwrap().to_str().unwrap();
        if !file_name.starts_with("golden") {
            std::fs::copy(&path, dir.join(file_name)).unwrap();
        }
    }
    dir
}

fn load_error(dir: &Path) -> FrontendError {
    match load(dir) {
        Ok(_) => panic!("{} loaded, but should have been rejected", dir.display()),
        Err(e) => e,
    }
}

/// The `Invalid` problems of an error (panics, failing the test, on another variant).
fn problems(error: &FrontendError) -> &[String] {
    match error {
        FrontendError::Invalid { problems, .. } => problems,
        other => panic!("expected FrontendError::Invalid, found {other:?}: {other}"),
    }
}

fn assert_format_error(error: &FrontendError, file: &Path, needle: &str) {
    match error {
        FrontendError::Format { file: f, message } => {
            assert_eq!(f, file, "error names the wrong file: {error}");
            assert!(message.contains(needle), "expected {needle:?} in: {error}");
        }
        other => panic!("expected FrontendError::Format, found {other:?}: {other}"),
    }
}

fn assert_has(problems: &[String], needle: &str) {
    assert!(problems.iter().any(|p| p.contains(needle)), "no problem mentions {needle:?}:\n{}", problems.join("\n"));
}

/// A safetensors file split into its header (parsed) and data section.
fn read_safetensors(path: &Path) -> (Map<String, Value>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    (header, bytes[8 + header_len..].to_vec())
}

fn write_safetensors(path: &Path, header: &Map<String, Value>, data: &[u8]) {
    let header = serde_json::to_vec(header).unwrap();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// Rewrites a safetensors file's header with `edit`, keeping the data.
fn edit_header(path: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let (mut header, data) = read_safetensors(path);
    edit(&mut header);
    write_safetensors(path, &header, &data);
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut config: Map<String, Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

const Q_PROJ: &str = "model.layers.0.self_attn.q_proj.weight";

#[test]
fn truncated_safetensors() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let error = load_error(&dir);
    assert_format_error(&error, &file, "run past the end of the data");
    assert!(error.to_string().contains("tensor model."), "names a tensor: {error}");

    std::fs::write(&file, &bytes[..5]).unwrap();
    assert_format_error(&load_error(&dir), &file, "truncated: 5 bytes, too short for the 8-byte header length");
}

#[test]
fn header_length_larger_than_file() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let claimed = bytes.len() as u64;
    bytes[..8].copy_from_slice(&claimed.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let expected = format!("header length {claimed} runs past the end of the file ({claimed} bytes)");
    assert_format_error(&load_error(&dir), &file, &expected);

    // A claim past the bound on headers is refused as such, before looking at the file's size.
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    assert_format_error(&load_error(&dir), &file, "is more than the 100000000 bytes a safetensors header may have");
}

#[test]
fn overlapping_offsets() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    let mut k_offsets = Value::Null;
    edit_header(&file, |h| {
        // v_proj has k_proj's shape; give it k_proj's bytes too.
        k_offsets = h["model.layers.0.self_attn.k_proj.weight"]["data_offsets"].clone();
        h["model.layers.0.self_attn.v_proj.weight"]["data_offsets"] = k_offsets.clone();
    });
    let error = load_error(&dir);
    assert_format_error(&error, &file, "overlap");
    let message = error.to_string();
    assert!(message.contains("model.layers.0.self_attn.k_proj.weight"), "{message}");
    assert!(message.contains("model.layers.0.self_attn.v_proj.weight"), "{message}");
}

#[test]
fn offsets_past_the_file() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    let (mut header, data) = read_safetensors(&file);
    let end = data.len() as u64;
    header["model.norm.weight"]["data_offsets"] = json!([end, end + 256]);
    write_safetensors(&file, &header, &data);
    let expected =
        format!("tensor model.norm.weight: data_offsets [{end}, {}] run past the end of the data", end + 256);
    assert_format_error(&load_error(&dir), &file, &expected);
}

#[test]
fn offsets_that_do_not_match_the_shape() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    edit_header(&file, |h| h["model.norm.weight"]["shape"] = json!([65]));
    assert_format_error(&load_error(&dir), &file, "hold 256 bytes, but F32[65] needs 260");
}

#[test]
fn unknown_dtype_in_header() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    edit_header(&file, |h| h["model.norm.weight"]["dtype"] = json!("F17"));
    assert_format_error(&load_error(&dir), &file, "tensor model.norm.weight: unknown dtype `F17`");
}

#[test]
fn invalid_header_json() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8..20].copy_from_slice(b"{{{{{{{{{{{{");
    std::fs::write(&file, &bytes).unwrap();
    assert_format_error(&load_error(&dir), &file, "header is not a JSON object");
}

#[test]
fn invalid_config_json() {
    let dir = copy_fixture("llama31-gqa-bf16");
    let config = dir.join("config.json");
    std::fs::write(&config, "{\"model_type\": \"llama\",").unwrap();
    assert_format_error(&load_error(&dir), &config, "invalid JSON");
    std::fs::write(&config, "[1, 2]").unwrap();
    assert_format_error(&load_error(&dir), &config, "expected a JSON object, found a list");
}

#[test]
fn unknown_model_type() {
    let dir = copy_fixture("llama31-gqa-bf16");
    edit_config(&dir, |c| c["model_type"] = json!("gpt2"));
    let error = load_error(&dir);
    let problems = problems(&error);
    assert_eq!(problems.len(), 1, "{error}");
    assert_has(
        problems,
        "model_type `gpt2` is not supported (supported: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, gpt_oss)",
    );
    assert!(error.to_string().contains("config.json"), "names the file: {error}");
}

#[test]
fn config_problems_are_reported_together() {
    let dir = copy_fixture("llama31-gqa-bf16");
    edit_config(&dir, |c| {
        c.remove("hidden_size");
        c["num_attention_heads"] = json!("six");
        c["hidden_act"] = json!("gelu");
        c["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0});
        c["rms_norm_eps"] = json!(-1.0);
    });
    let error = load_error(&dir);
    let problems = problems(&error);
    assert_has(problems, "missing field `hidden_size`");
    assert_has(problems, "field `num_attention_heads` must be a positive integer, found \"six\"");
    assert_has(problems, "hidden_act `gelu` is not supported");
    assert_has(problems, "rope_scaling.rope_type `dynamic` is not supported");
    assert_has(problems, "field `rms_norm_eps` must be a positive number, found -1.0");
    assert_eq!(problems.len(), 5, "{error}");
    assert!(error.to_string().contains("(5 problems)"), "{error}");
}

/// A sliding window in force is lowered (it used to be refused): the sliding layer's attention
/// keeps a window, the full layer's does not.
#[test]
fn sliding_window_in_force_is_lowered() {
    let dir = copy_fixture("qwen2-bias");
    edit_config(&dir, |c| {
        c["use_sliding_window"] = json!(true);
        c["sliding_window"] = json!(128);
        c["layer_types"] = json!(["full_attention", "sliding_attention"]);
    });
    let module = load(&dir).unwrap().module;
    let windows: Vec<Option<u32>> = module
        .body
        .iter()
        .filter_map(|(_, i)| match i.op {
            waferc_ir::Op::Attention { window, .. } => Some(window),
            _ => None,
        })
        .collect();
    assert_eq!(windows, [None, Some(128)]);
}

/// gpt-oss's release layout: a `_blocks` without its `_scales`, a pair whose shapes disagree and
/// an unknown rope type, all reported together, each naming its tensor or field.
#[test]
fn gpt_oss_mxfp4_problems_are_reported_together() {
    let dir = copy_fixture("gpt-oss-tiny-mxfp4");
    edit_header(&dir.join("model.safetensors"), |h| {
        h.remove("model.layers.1.mlp.experts.down_proj_scales");
        // Same bytes, wrong shape: 256 rows of one block for blocks of 128 rows of two.
        h["model.layers.0.mlp.experts.gate_up_proj_scales"]["shape"] = json!([8, 256, 1]);
    });
    edit_config(&dir, |c| c["rope_scaling"]["rope_type"] = json!("dynamic"));
    let error = load_error(&dir);
    let p = problems(&error);
    assert_has(p, "rope_scaling.rope_type `dynamic` is not supported (supported: default, linear, llama3, yarn)");
    assert_eq!(p.len(), 1, "config problems come first: {error}");

    edit_config(&dir, |c| c["rope_scaling"]["rope_type"] = json!("yarn"));
    let error = load_error(&dir);
    let p = problems(&error);
    assert_has(p, "model.safetensors: MXFP4 tensor model.layers.1.mlp.experts.down_proj_blocks U8[8, 64, 2, 16] has no model.layers.1.mlp.experts.down_proj_scales");
    assert_has(p, "model.safetensors: MXFP4 tensor model.layers.0.mlp.experts.gate_up_proj_blocks is U8[8, 128, 2, 16] but model.layers.0.mlp.experts.gate_up_proj_scales is U8[8, 256, 1]");
    assert_eq!(p.len(), 2, "{error}");
}

/// The transformers layout of gpt-oss with a fused expert tensor of the wrong orientation.
#[test]
fn gpt_oss_bf16_fused_tensor_shape() {
    let dir = copy_fixture("gpt-oss-tiny-bf16");
    edit_header(&dir.join("model.safetensors"), |h| {
        h["model.layers.2.mlp.experts.gate_up_proj"]["shape"] = json!([8, 128, 64]);
    });
    assert_has(
        problems(&load_error(&dir)),
        "tensor model.layers.2.mlp.experts.gate_up_proj: expected shape [8, 64, 128], found bf16[8, 128, 64]",
    );
}

#[test]
fn missing_shard() {
    let dir = copy_fixture("mixtral-sharded-bf16");
    std::fs::remove_file(dir.join("model-00003-of-00008.safetensors")).unwrap();
    let index = dir.join("model.safetensors.index.json");
    let error = load_error(&dir);
    assert_format_error(&error, &index, "shard model-00003-of-00008.safetensors is missing");
    assert!(error.to_string().contains("model.layers.0.block_sparse_moe.experts.0.w1.weight"), "{error}");
}

#[test]
fn index_names_a_tensor_its_shard_lacks() {
    let dir = copy_fixture("mixtral-sharded-bf16");
    let index = dir.join("model.safetensors.index.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    json["weight_map"]["model.norm.weight"] = json!("model-00001-of-00008.safetensors");
    std::fs::write(&index, json.to_string()).unwrap();
    let error = load_error(&dir);
    assert_format_error(
        &error,
        &index,
        "tensor model.norm.weight is not in its shard model-00001-of-00008.safetensors",
    );
    assert!(
        error.to_string().contains(
            "tensor model.norm.weight is in shard model-00008-of-00008.safetensors but the index puts it in model-00001-of-00008.safetensors"
        ),
        "{error}"
    );
}

#[test]
fn wrong_shape() {
    let dir = copy_fixture("llama-tiny-tok");
    let file = dir.join("model.safetensors");
    // Same bytes, another shape: the header is consistent, the model is not.
    edit_header(&file, |h| h[Q_PROJ]["shape"] = json!([32, 128]));
    let error = load_error(&dir);
    let problems = problems(&error);
    assert_eq!(problems.len(), 1, "{error}");
    let expected = format!("{}: tensor {Q_PROJ}: expected shape [64, 64], found f32[32, 128]", file.display());
    assert_has(problems, &expected);
}

#[test]
fn several_tensor_problems_are_reported_together() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.safetensors");
    let (mut header, mut data) = read_safetensors(&file);
    // Misnamed: k_proj.bias stored as k_proj.biases.
    let bias = header.remove("model.layers.1.self_attn.k_proj.bias").unwrap();
    header.insert("model.layers.1.self_attn.k_proj.biases".into(), bias);
    // Missing: the final norm (its bytes stay, unreferenced).
    header.remove("model.norm.weight");
    // Wrong shape.
    header["model.layers.0.mlp.up_proj.weight"]["shape"] = json!([64, 128]);
    // Unusable dtype, expected name: v_proj.bias as i64.
    let start = data.len() as u64;
    data.extend_from_slice(&[0; 32 * 8]);
    header["model.layers.0.self_attn.v_proj.bias"] =
        json!({"dtype": "I64", "shape": [32], "data_offsets": [start, start + 256]});
    // Extra: a tensor nothing uses.
    let start = data.len() as u64;
    data.extend_from_slice(&[0; 16]);
    header.insert(
        "model.extra.weight".into(),
        json!({"dtype": "F32", "shape": [4], "data_offsets": [start, start + 16]}),
    );
    write_safetensors(&file, &header, &data);

    let error = load_error(&dir);
    let problems = problems(&error);
    let f = file.display();
    assert_has(problems, "missing tensor model.layers.1.self_attn.k_proj.bias (expected shape [32])");
    assert_has(
        problems,
        &format!(
            "{f}: unexpected tensor model.layers.1.self_attn.k_proj.biases f32[32]: qwen2 with 2 layers does not use it \
             (misnamed model.layers.1.self_attn.k_proj.bias?)"
        ),
    );
    assert_has(problems, "missing tensor model.norm.weight (expected shape [64])");
    assert_has(
        problems,
        &format!("{f}: tensor model.layers.0.mlp.up_proj.weight: expected shape [128, 64], found f32[64, 128]"),
    );
    assert_has(
        problems,
        &format!("{f}: tensor model.layers.0.self_attn.v_proj.bias is I64[32]; waferc reads F32, BF16 and F16"),
    );
    assert_has(
        problems,
        &format!("{f}: unexpected tensor model.extra.weight f32[4]: qwen2 with 2 layers does not use it"),
    );
    assert_eq!(problems.len(), 6, "{error}");
    assert!(error.to_string().contains("(6 problems)"), "{error}");
}

#[test]
fn tied_checkpoint_with_a_head_tensor() {
    let dir = copy_fixture("qwen2-bias");
    edit_config(&dir, |c| c["tie_word_embeddings"] = json!(true));
    assert_has(
        problems(&load_error(&dir)),
        "lm_head.weight f32[512, 64]: qwen2 with 2 layers does not use it (tie_word_embeddings is true",
    );
}

#[test]
fn paths_that_are_not_checkpoints() {
    let dir = copy_fixture("qwen2-bias");
    let missing = dir.join("nothing-here");
    assert_format_error(&load_error(&missing), &missing, "no such file or directory");
    let config = dir.join("config.json");
    assert_format_error(&load_error(&config), &config, "not a checkpoint");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert_format_error(&load_error(&dir), &dir, "no model.safetensors or model.safetensors.index.json");
    std::fs::remove_file(&config).unwrap();
    assert!(matches!(load_error(&dir), FrontendError::Io { path, .. } if path == config));
}

/// Every prefix of the header region and single-byte damage across it: an error, never a panic.
#[test]
fn damaged_headers_never_panic() {
    let dir = copy_fixture("qwen3-dense");
    let file = dir.join("model.safetensors");
    let original = std::fs::read(&file).unwrap();
    let header_end = 8 + u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    for len in (0..header_end + 64).step_by(7).chain([original.len() - 1]) {
        std::fs::write(&file, &original[..len]).unwrap();
        assert!(load(&dir).is_err(), "a {len}-byte prefix loaded");
    }
    for at in (0..header_end).step_by(13) {
        let mut damaged = original.clone();
        damaged[at] ^= 0x5a;
        std::fs::write(&file, &damaged).unwrap();
        // Some damage leaves a valid checkpoint (a digit of an unused metadata string, say);
        // what matters is that nothing panics.
        let _ = load(&dir);
    }
}

/// A `.gguf` path goes to the GGUF reader, whose error names the file.
#[test]
fn gguf_paths_go_to_the_gguf_reader() {
    let dir = copy_fixture("qwen2-bias");
    let file = dir.join("model.gguf");
    std::fs::write(&file, b"GGML not really").unwrap();
    match load_error(&file) {
        FrontendError::Format { file: f, message } => {
            assert_eq!(f, file);
            assert!(!message.contains("not a checkpoint"), "the GGUF reader should have rejected it: {message}");
        }
        other => panic!("expected a GGUF format error, found {other:?}: {other}"),
    }
}
