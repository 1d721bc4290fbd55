//! The GGUF frontend: reads a llama.cpp GGUF file into the same [`Checkpoint`] a Hugging Face
//! directory of that model gives, so lowering never knows which format it came from.
//!
//! Three things differ from a Hugging Face checkpoint and are undone here:
//! - names: `blk.N.attn_q.weight` becomes `model.layers.N.self_attn.q_proj.weight`, and so on;
//! - shapes: GGUF lists dimensions innermost first, so `ne = [K, N]` is the Hugging Face `[N, K]`;
//! - the q and k projections: llama.cpp's converter interleaves each head's rows into its own
//!   rotary order; we put them back, as transformers does when it loads a GGUF.
//!
//! Weights stay in the memory-mapped file except q and k, whose permuted rows are copied. Whole
//! rows move, so quantised blocks are never touched.

mod container;
mod vocab;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use waferc_ir::{Rope, RopeScaling, TensorType, WeightBytes};

use self::container::{GgufFile, MetadataValue, TensorInfo};
use crate::frontend::tokenizer::Tokenizer;
use crate::frontend::{Architecture, Checkpoint, FrontendError, ModelConfig, TensorEntry};

/// Reads a GGUF file: the checkpoint, and its tokenizer when there is one (a `tokenizer.json`
/// beside the file wins over the one GGUF metadata describes).
pub fn read(path: &Path) -> Result<(Checkpoint, Option<Tokenizer>), FrontendError> {
    read_parsed(GgufFile::open(path)?, path)
}

/// [`read`] of a GGUF image already in memory (an anonymous map, say); `path` names it in
/// errors and locates a `tokenizer.json` beside it. The fuzz targets' entry point.
pub fn read_image(map: Arc<memmap2::Mmap>, path: &Path) -> Result<(Checkpoint, Option<Tokenizer>), FrontendError> {
    read_parsed(GgufFile::from_map(map, path)?, path)
}

fn read_parsed(file: GgufFile, path: &Path) -> Result<(Checkpoint, Option<Tokenizer>), FrontendError> {
    let mut problems = Vec::new();
    let config = model_config(&file, &mut problems);
    let tensors = match &config {
        Some(config) => hf_tensors(&file, config, path, &mut problems),
        None => BTreeMap::new(),
    };
    let tokenizer = tokenizer(&file, path, &mut problems)?;
    match config {
        Some(config) if problems.is_empty() => Ok((Checkpoint { config, tensors, path: path.to_owned() }, tokenizer)),
        _ => Err(FrontendError::Invalid { path: path.to_owned(), problems }),
    }
}

/// The `ModelConfig` GGUF metadata describes, or `None` with the reasons in `problems`.
fn model_config(file: &GgufFile, problems: &mut Vec<String>) -> Option<ModelConfig> {
    let arch = match file.get("general.architecture").map(|v| v.as_str()) {
        Some(Some(arch)) => arch,
        Some(None) => {
            problems.push("general.architecture is not a string".into());
            return None;
        }
        None => {
            problems.push("general.architecture is missing".into());
            return None;
        }
    };
    if arch != "llama" {
        problems.push(format!("architecture {arch:?} is not supported by the GGUF frontend (only \"llama\")"));
        return None;
    }
    let start = problems.len();
    let mut required = |suffix: &str| -> u32 { metadata_u32(file, &format!("{arch}.{suffix}"), problems).unwrap_or(0) };
    let hidden_size = required("embedding_length");
    let intermediate_size = required("feed_forward_length");
    let num_layers = required("block_count");
    let num_heads = required("attention.head_count");
    let eps = metadata_f64(file, &format!("{arch}.attention.layer_norm_rms_epsilon"), problems);
    let num_kv_heads = optional_u32(file, &format!("{arch}.attention.head_count_kv"), problems).unwrap_or(num_heads);
    // llama.cpp's defaults when a converter leaves these out.
    let theta = optional_f64(file, &format!("{arch}.rope.freq_base"), problems).unwrap_or(10_000.0);
    let head_dim = optional_u32(file, &format!("{arch}.attention.key_length"), problems)
        .unwrap_or(hidden_size.checked_div(num_heads).unwrap_or(0));
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        problems.push(format!("{num_heads} attention heads cannot share {num_kv_heads} KV heads evenly"));
    }
    if let Some(rotary) = optional_u32(file, &format!("{arch}.rope.dimension_count"), problems) {
        if rotary != head_dim {
            problems.push(format!(
                "{arch}.rope.dimension_count is {rotary}, but heads are {head_dim} wide: partial rotary \
                 embeddings are not supported"
            ));
        }
    }
    if let Some(value_len) = optional_u32(file, &format!("{arch}.attention.value_length"), problems) {
        if value_len != head_dim {
            problems.push(format!("value heads of {value_len} differ from key heads of {head_dim}"));
        }
    }
    if optional_u32(file, &format!("{arch}.expert_count"), problems).is_some_and(|n| n > 0) {
        problems.push("mixture-of-experts GGUF files are not supported".into());
    }
    let scaling = rope_scaling(file, arch, problems);
    let vocab_size = vocab_size(file, arch, problems);
    let bos_token_id = optional_u32(file, "tokenizer.ggml.bos_token_id", problems);
    let eos_token_ids = optional_u32(file, "tokenizer.ggml.eos_token_id", problems).into_iter().collect();
    if problems.len() > start {
        return None;
    }
    Some(ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: vocab_size?,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: eps? as f32,
        rope: Rope { theta: theta as f32, scaling },
        tie_word_embeddings: !file.tensors.iter().any(|t| t.name == "output.weight"),
        attention_bias: false,
        attention_sinks: false,
        sliding_window: None,
        qk_norm: false,
        moe: None,
        bos_token_id,
        eos_token_ids,
    })
}

/// `{arch}.vocab_size` when the converter wrote it, else the length of the token list, else the
/// rows of the output or embedding matrix.
fn vocab_size(file: &GgufFile, arch: &str, problems: &mut Vec<String>) -> Option<u32> {
    if let Some(n) = optional_u32(file, &format!("{arch}.vocab_size"), problems) {
        return Some(n);
    }
    if let Some(tokens) = file.get("tokenizer.ggml.tokens").and_then(MetadataValue::as_array) {
        let n = u32::try_from(tokens.len()).ok();
        if n.is_none() {
            problems.push(format!("tokenizer.ggml.tokens lists {} tokens, more than a u32 counts", tokens.len()));
        }
        return n;
    }
    let matrix = ["output.weight", "token_embd.weight"]
        .iter()
        .find_map(|name| file.tensors.iter().find(|t| t.name == *name))
        .and_then(|t| t.dims.get(1).and_then(|&rows| u32::try_from(rows).ok()));
    if matrix.is_none() {
        problems
            .push(format!("no {arch}.vocab_size, token list or token_embd.weight to take the vocabulary size from"));
    }
    matrix
}

/// `{arch}.rope.scaling.*`. Llama 3.1's scaling is stored as a `rope_freqs.weight` tensor,
/// reported in `hf_tensors`.
fn rope_scaling(file: &GgufFile, arch: &str, problems: &mut Vec<String>) -> RopeScaling {
    let kind = file.get(&format!("{arch}.rope.scaling.type")).map(|v| v.as_str());
    match kind {
        None | Some(Some("none")) => RopeScaling::None,
        Some(Some("linear")) => match metadata_f64(file, &format!("{arch}.rope.scaling.factor"), problems) {
            Some(factor) => RopeScaling::Linear { factor: factor as f32 },
            None => RopeScaling::None,
        },
        Some(Some(other)) => {
            problems.push(format!("{arch}.rope.scaling.type {other:?} is not supported (only none and linear)"));
            RopeScaling::None
        }
        Some(None) => {
            problems.push(format!("{arch}.rope.scaling.type is not a string"));
            RopeScaling::None
        }
    }
}

/// The Hugging Face name of a llama GGUF tensor, or `None` for a tensor with no counterpart.
fn hf_name(gguf_name: &str) -> Option<String> {
    let whole = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = whole {
        return Some(name.to_owned());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: u32 = layer.parse().ok()?;
    let hf_part = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf_part}"))
}

/// Every tensor under its Hugging Face name and shape, q/k rows back in Hugging Face order.
/// Unsupported types and unknown names all go to `problems`, not just the first.
fn hf_tensors(
    file: &GgufFile,
    config: &ModelConfig,
    path: &Path,
    problems: &mut Vec<String>,
) -> BTreeMap<String, TensorEntry> {
    let mut tensors = BTreeMap::new();
    let mut unsupported = Vec::new();
    let shared_path = Arc::new(path.to_owned());
    for info in &file.tensors {
        if info.name == "rope_freqs.weight" {
            problems
                .push("rope_freqs.weight (Llama 3.1 frequency scaling stored as a tensor) is not supported".to_owned());
            continue;
        }
        let Some(name) = hf_name(&info.name) else {
            problems.push(format!("tensor {} has no Hugging Face llama counterpart", info.name));
            continue;
        };
        let (Some(dtype), Some(range)) = (info.ggml_type.dtype(), info.range.clone()) else {
            unsupported.push(format!("{} ({})", info.name, info.ggml_type));
            continue;
        };
        let ty = TensorType::new(dtype, info.hf_shape());
        let rotary_heads = if name.ends_with("q_proj.weight") {
            Some(config.num_heads)
        } else if name.ends_with("k_proj.weight") {
            Some(config.num_kv_heads)
        } else {
            None
        };
        let data = match rotary_heads {
            None => WeightBytes::Mapped { map: Arc::clone(&file.map), range, file: Arc::clone(&shared_path) },
            Some(heads) => match unpermute_rotary_rows(&file.map[range], info, heads) {
                Ok(rows) => WeightBytes::owned(rows),
                Err(problem) => {
                    problems.push(problem);
                    continue;
                }
            },
        };
        tensors.insert(name, TensorEntry { ty, data, file: path.to_owned() });
    }
    if !unsupported.is_empty() {
        problems.push(format!(
            "{} tensor{} of a type waferc cannot store (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1): {}",
            unsupported.len(),
            if unsupported.len() == 1 { "" } else { "s" },
            unsupported.join(", ")
        ));
    }
    tensors
}

/// Undoes llama.cpp's q/k permutation (`convert_hf_to_gguf.py`'s `permute`), as transformers'
/// `_reverse_permute_weights` does: within each head of `2 * half` rows, GGUF row `2 * i + j`
/// is Hugging Face row `j * half + i`.
fn unpermute_rotary_rows(src: &[u8], info: &TensorInfo, heads: u32) -> Result<Vec<u8>, String> {
    let shape = info.hf_shape();
    let rows = shape[0] as usize;
    let heads = heads as usize;
    if shape.len() != 2 || !rows.is_multiple_of(2 * heads) {
        return Err(format!(
            "tensor {} of shape {shape:?} cannot be split into {heads} heads of rotary pairs",
            info.name
        ));
    }
    let row_bytes = src.len() / rows;
    let half = rows / heads / 2;
    let mut out = vec![0u8; src.len()];
    for head in 0..heads {
        let base = head * 2 * half;
        for i in 0..half {
            for j in 0..2 {
                let from = (base + 2 * i + j) * row_bytes;
                let to = (base + j * half + i) * row_bytes;
                out[to..to + row_bytes].copy_from_slice(&src[from..from + row_bytes]);
            }
        }
    }
    Ok(out)
}

/// The tokenizer: `tokenizer.json` beside the file, else one built from GGUF metadata, else none.
fn tokenizer(file: &GgufFile, path: &Path, problems: &mut Vec<String>) -> Result<Option<Tokenizer>, FrontendError> {
    let beside = path.with_file_name("tokenizer.json");
    if beside.is_file() {
        return Tokenizer::from_file(&beside).map(Some);
    }
    match vocab::from_metadata(file) {
        Ok(tokenizer) => Ok(tokenizer.map(|inner| Tokenizer::new(inner, path.to_owned()))),
        Err(problem) => {
            problems.push(problem);
            Ok(None)
        }
    }
}

/// A required unsigned metadata value that fits a u32; missing or mistyped goes to `problems`.
fn metadata_u32(file: &GgufFile, key: &str, problems: &mut Vec<String>) -> Option<u32> {
    match file.get(key) {
        None => {
            problems.push(format!("metadata {key} is missing"));
            None
        }
        Some(_) => optional_u32(file, key, problems),
    }
}

fn optional_u32(file: &GgufFile, key: &str, problems: &mut Vec<String>) -> Option<u32> {
    let value = file.get(key)?;
    let n = value.as_u64().and_then(|n| u32::try_from(n).ok());
    if n.is_none() {
        problems.push(format!("metadata {key} should be an unsigned 32-bit integer, found {}", describe(value)));
    }
    n
}

fn metadata_f64(file: &GgufFile, key: &str, problems: &mut Vec<String>) -> Option<f64> {
    if file.get(key).is_none() {
        problems.push(format!("metadata {key} is missing"));
        return None;
    }
    optional_f64(file, key, problems)
}

fn optional_f64(file: &GgufFile, key: &str, problems: &mut Vec<String>) -> Option<f64> {
    let value = file.get(key)?;
    let x = value.as_f64();
    if x.is_none() {
        problems.push(format!("metadata {key} should be a float, found {}", describe(value)));
    }
    x
}

/// A metadata value for an error message: scalars in full, arrays by length.
fn describe(value: &MetadataValue) -> String {
    match value {
        MetadataValue::Array(items) => format!("an array of {} values", items.len()),
        MetadataValue::String(s) => format!("the string {s:?}"),
        scalar => format!("{} {scalar:?}", scalar.type_name()),
    }
}
