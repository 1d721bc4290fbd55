//! Structure-aware Hugging Face checkpoint directories: `arbitrary` decodes the fuzzer's bytes
//! into a [`CheckpointSpec`] (a config.json as edits of a tiny llama's, safetensors files with
//! well-framed headers, single or sharded with an index) that is written to a scratch directory
//! and loaded with `waferc::frontend::load`, as `waferc compile DIR` does. Random bytes would
//! never form a directory of JSON and safetensors files.

use std::path::PathBuf;

use arbitrary::{Arbitrary, Unstructured};
use serde_json::{json, Map, Value as Json};

/// config.json keys the frontend reads.
const CONFIG_KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "partial_rotary_factor",
    "quantization_config",
    "quant_method",
    "swiglu_limit",
    "bos_token_id",
    "eos_token_id",
];

const MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gpt_oss"];

/// Tensor names under `model.layers.N.` and whole-model ones.
const LAYER_TENSORS: &[&str] = &[
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.q_norm.weight",
    "self_attn.sinks",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.gate.weight",
    "mlp.experts.0.gate_proj.weight",
    "block_sparse_moe.gate.weight",
    "block_sparse_moe.experts.0.w1.weight",
    "mlp.router.weight",
    "mlp.experts.gate_up_proj_blocks",
    "mlp.experts.gate_up_proj_scales",
];
const MODEL_TENSORS: &[&str] = &["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"];
const DTYPES: &[&str] = &["F32", "BF16", "F16", "U8", "I64", "F8_E4M3", "F4", "BOOL"];

#[derive(Arbitrary, Debug)]
struct CheckpointSpec {
    /// Start config.json and the tensors from a complete one-layer llama.
    tiny_llama: bool,
    config_edits: Vec<(ConfigKey, JsonValue)>,
    tensors: Vec<TensorSpec>,
    /// 0: one `model.safetensors`; n: n shards and an index.
    shards: u8,
    index_edits: Vec<IndexEdit>,
    /// Mark every file shape-only (`waferc synth --shape-only`).
    shape_only: bool,
    file_edits: Vec<FileEdit>,
}

#[derive(Arbitrary, Debug)]
enum ConfigKey {
    Known(u8),
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum JsonValue {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    ModelType(u8),
    Str(String),
    Ints(Vec<i64>),
    Strs(Vec<String>),
    Object(Vec<(ConfigKey, JsonValue)>),
    Remove,
}

#[derive(Arbitrary, Debug)]
struct TensorSpec {
    name: TensorName,
    dtype: u8,
    shape: Vec<u32>,
    /// `None`: placed after the previous tensor, as big as its shape needs.
    offsets: Option<(u64, u64)>,
}

#[derive(Arbitrary, Debug)]
enum TensorName {
    Layer { layer: u8, part: u8 },
    Model(u8),
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum IndexEdit {
    Drop(u8),
    Move {
        tensor: u8,
        shard: String,
    },
    Add {
        tensor: String,
        shard: String,
    },
    NotAString(u8),
    /// Replace the whole index with this text.
    Raw(String),
}

#[derive(Arbitrary, Debug)]
enum FileEdit {
    Truncate { file: u8, keep: u32 },
    HeaderLength { file: u8, length: u64 },
    Flip { file: u8, at: u32, byte: u8 },
}

/// Data written for one tensor is capped, so a claim of a huge tensor makes a short file.
const MAX_TENSOR_DATA: u64 = 1 << 18;

/// Decodes `data` as a [`CheckpointSpec`], writes the directory and loads it as `waferc` does.
pub fn checkpoint_dir(data: &[u8]) -> Result<(), String> {
    let spec = CheckpointSpec::arbitrary_take_rest(Unstructured::new(data)).map_err(|e| format!("spec: {e}"))?;
    let dir = scratch_dir();
    let files = spec.files();
    for (name, bytes) in &files {
        std::fs::write(dir.join(name), bytes).expect("write a scratch checkpoint file");
    }
    let result = waferc::frontend::load(&dir).map(drop).map_err(|e| e.to_string());
    for (name, _) in &files {
        let _ = std::fs::remove_file(dir.join(name));
    }
    result
}

/// One directory per process, emptied after each input.
fn scratch_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("waferc-fuzz-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the scratch checkpoint directory");
    dir
}

type Tensor = (String, &'static str, Vec<u64>, Option<(u64, u64)>);

impl CheckpointSpec {
    /// The directory's files: config.json, safetensors files and (sharded) the index.
    fn files(&self) -> Vec<(String, Vec<u8>)> {
        let mut config = Map::new();
        let mut tensors: Vec<Tensor> = Vec::new();
        if self.tiny_llama {
            tiny_llama(&mut config, &mut tensors);
        }
        for (key, value) in &self.config_edits {
            match value.to_json() {
                Some(v) => config.insert(key.name(), v),
                None => config.remove(&key.name()),
            };
        }
        for t in &self.tensors {
            let name = match &t.name {
                TensorName::Layer { layer, part } => {
                    format!("model.layers.{}.{}", layer % 4, LAYER_TENSORS[*part as usize % LAYER_TENSORS.len()])
                }
                TensorName::Model(i) => MODEL_TENSORS[*i as usize % MODEL_TENSORS.len()].to_string(),
                TensorName::Other(s) => s.clone(),
            };
            tensors.retain(|(n, ..)| *n != name);
            let shape = t.shape.iter().map(|&d| u64::from(d)).collect();
            tensors.push((name, DTYPES[t.dtype as usize % DTYPES.len()], shape, t.offsets));
        }

        let mut files = vec![("config.json".to_string(), Json::Object(config).to_string().into_bytes())];
        let shard_count = usize::from(self.shards.min(4));
        if shard_count == 0 {
            files.push(("model.safetensors".to_string(), safetensors(&tensors, self.shape_only)));
        } else {
            let name = |i: usize| format!("model-{:05}-of-{shard_count:05}.safetensors", i + 1);
            let mut weight_map = Map::new();
            for i in 0..shard_count {
                let mine: Vec<Tensor> = tensors.iter().skip(i).step_by(shard_count).cloned().collect();
                for (tensor, ..) in &mine {
                    weight_map.insert(tensor.clone(), Json::String(name(i)));
                }
                files.push((name(i), safetensors(&mine, self.shape_only)));
            }
            let mut index_text = None;
            for edit in &self.index_edits {
                let nth = |i: u8| weight_map.keys().nth(i as usize % weight_map.len().max(1)).cloned();
                match edit {
                    IndexEdit::Drop(i) => {
                        nth(*i).map(|k| weight_map.remove(&k));
                    }
                    IndexEdit::Move { tensor, shard } => {
                        nth(*tensor).map(|k| weight_map.insert(k, Json::String(shard.clone())));
                    }
                    IndexEdit::Add { tensor, shard } => {
                        weight_map.insert(tensor.clone(), Json::String(shard.clone()));
                    }
                    IndexEdit::NotAString(i) => {
                        nth(*i).map(|k| weight_map.insert(k, json!([1])));
                    }
                    IndexEdit::Raw(text) => index_text = Some(text.clone()),
                }
            }
            let index = index_text.unwrap_or_else(|| json!({ "weight_map": weight_map }).to_string());
            files.push(("model.safetensors.index.json".to_string(), index.into_bytes()));
        }

        let data_files = files.len() - 1 - usize::from(shard_count > 0);
        for edit in &self.file_edits {
            let pick = |file: u8| 1 + file as usize % data_files;
            match *edit {
                FileEdit::Truncate { file, keep } => {
                    let bytes = &mut files[pick(file)].1;
                    bytes.truncate(keep as usize);
                }
                FileEdit::HeaderLength { file, length } => {
                    let bytes = &mut files[pick(file)].1;
                    bytes[..8].copy_from_slice(&length.to_le_bytes());
                }
                FileEdit::Flip { file, at, byte } => {
                    let bytes = &mut files[pick(file)].1;
                    let at = at as usize % bytes.len();
                    bytes[at] ^= byte;
                }
            }
        }
        files
    }
}

impl ConfigKey {
    fn name(&self) -> String {
        match self {
            ConfigKey::Known(i) => CONFIG_KEYS[*i as usize % CONFIG_KEYS.len()].to_string(),
            ConfigKey::Other(s) => s.clone(),
        }
    }
}

impl JsonValue {
    /// `None` removes the key.
    fn to_json(&self) -> Option<Json> {
        Some(match self {
            JsonValue::Null => Json::Null,
            JsonValue::Bool(b) => json!(b),
            JsonValue::Int(i) => json!(i),
            JsonValue::UInt(u) => json!(u),
            JsonValue::Float(f) => json!(f),
            JsonValue::ModelType(i) => json!(MODEL_TYPES[*i as usize % MODEL_TYPES.len()]),
            JsonValue::Str(s) => json!(s),
            JsonValue::Ints(v) => json!(v),
            JsonValue::Strs(v) => json!(v),
            JsonValue::Object(fields) => {
                Json::Object(fields.iter().filter_map(|(k, v)| Some((k.name(), v.to_json()?))).collect())
            }
            JsonValue::Remove => return None,
        })
    }
}

/// A safetensors file of `tensors`, data zero-filled (capped per tensor).
fn safetensors(tensors: &[Tensor], shape_only: bool) -> Vec<u8> {
    let mut header = Map::new();
    if shape_only {
        header.insert("__metadata__".into(), json!({ "waferc.shape_only": "true" }));
    }
    let mut end = 0u64;
    for (name, dtype, shape, offsets) in tensors {
        let bits: u64 = match *dtype {
            "F32" => 32,
            "BF16" | "F16" => 16,
            "I64" => 64,
            "F4" => 4,
            _ => 8,
        };
        let bytes = shape.iter().try_fold(bits, |acc, &d| acc.checked_mul(d)).map_or(0, |b| b / 8);
        let (begin, finish) = offsets.unwrap_or((end, end + bytes.min(MAX_TENSOR_DATA)));
        end = end.max(finish.min(end + MAX_TENSOR_DATA));
        header.insert(name.clone(), json!({ "dtype": dtype, "shape": shape, "data_offsets": [begin, finish] }));
    }
    let header = Json::Object(header).to_string();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + end as usize, 0);
    out
}

/// A one-layer llama (hidden 32, 2 heads of 16, 1 KV head, vocab 32) in bf16.
fn tiny_llama(config: &mut Map<String, Json>, tensors: &mut Vec<Tensor>) {
    let fields = json!({
        "model_type": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "hidden_act": "silu", "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2
    });
    config.extend(fields.as_object().expect("an object").clone());
    let mut add = |name: &str, shape: &[u64]| tensors.push((name.to_string(), "BF16", shape.to_vec(), None));
    add("model.embed_tokens.weight", &[32, 32]);
    add("model.norm.weight", &[32]);
    add("lm_head.weight", &[32, 32]);
    add("model.layers.0.input_layernorm.weight", &[32]);
    add("model.layers.0.post_attention_layernorm.weight", &[32]);
    add("model.layers.0.self_attn.q_proj.weight", &[32, 32]);
    add("model.layers.0.self_attn.k_proj.weight", &[16, 32]);
    add("model.layers.0.self_attn.v_proj.weight", &[16, 32]);
    add("model.layers.0.self_attn.o_proj.weight", &[32, 32]);
    add("model.layers.0.mlp.gate_proj.weight", &[48, 32]);
    add("model.layers.0.mlp.up_proj.weight", &[48, 32]);
    add("model.layers.0.mlp.down_proj.weight", &[32, 48]);
}
