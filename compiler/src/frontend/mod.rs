//! Frontends: read a checkpoint (a Hugging Face directory of config.json + safetensors, or a
//! GGUF file), check everything the model needs before any work, and lower it to the tensor IR.
//!
//! Both formats meet in [`Checkpoint`]: a [`ModelConfig`] and the tensors under their Hugging
//! Face names. [`lower`] turns a checkpoint into an `ir::Module`, whatever file it came from.

pub mod config;
pub mod error;
pub mod gguf;
pub mod hf;
pub mod lower;
pub mod safetensors;
pub mod tokenizer;

pub use error::FrontendError;
pub use lower::lower;
pub use tokenizer::Tokenizer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use waferc_ir::{Rope, TensorType, WeightBytes};

/// The architectures the frontend lowers (Hugging Face `model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen3Moe,
    GptOss,
}

impl Architecture {
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::GptOss => "gpt_oss",
        }
    }
}

/// Mixture-of-experts parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: u32,
    pub top_k: u32,
    /// Hidden width of one expert's FFN.
    pub expert_intermediate_size: u32,
    /// Divide the chosen experts' weights by their sum (always on for Mixtral).
    pub normalize_top_k: bool,
    /// Layers that keep a dense FFN of `ModelConfig::intermediate_size` (Qwen3-MoE's
    /// `mlp_only_layers` and `decoder_sparse_step`).
    pub dense_layers: Vec<u32>,
    /// gpt-oss: the router's logits carry a bias, each expert's projections carry biases, gate
    /// and up are one interleaved tensor (all experts fused), and the activation is the clamped
    /// SwiGLU with these `(alpha, limit)`.
    pub gpt_oss_experts: Option<(f32, f32)>,
    /// The fused expert tensors are stored as MXFP4 `_blocks`/`_scales` pairs in the release
    /// layout (`quantization_config.quant_method = "mxfp4"`).
    pub mxfp4_experts: bool,
}

/// Attention layers that only see the last `window` positions.
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    pub window: u32,
    pub layers: Vec<u32>,
}

/// Everything lowering needs to know about a model, whatever format it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub intermediate_size: u32,
    pub num_layers: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub rms_norm_eps: f32,
    pub rope: Rope,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2, gpt-oss).
    pub attention_bias: bool,
    /// The output projection carries a bias and each attention head a sink logit (gpt-oss).
    pub attention_sinks: bool,
    /// A sliding window in force on some layers (Mistral, Qwen with `use_sliding_window`, gpt-oss).
    pub sliding_window: Option<SlidingWindow>,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub moe: Option<MoeConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// One tensor of a checkpoint, under its Hugging Face name.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub ty: TensorType,
    pub data: WeightBytes,
    /// The file it was read from, for error messages.
    pub file: PathBuf,
}

/// A checkpoint as read from disk: what lowering consumes.
#[derive(Debug)]
pub struct Checkpoint {
    pub config: ModelConfig,
    pub tensors: BTreeMap<String, TensorEntry>,
    /// The path the user named (directory or GGUF file).
    pub path: PathBuf,
}

/// A checkpoint lowered to IR, with its tokenizer when the checkpoint carries one.
#[derive(Debug)]
pub struct LoadedModel {
    pub module: waferc_ir::Module,
    pub tokenizer: Option<Tokenizer>,
    /// The path the user named.
    pub checkpoint_path: PathBuf,
}

/// The largest `config.json` the frontend reads (real ones are a few kilobytes).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// The largest `model.safetensors.index.json` (a 1,000-shard MoE index is a few megabytes).
pub const MAX_INDEX_BYTES: u64 = 64 << 20;
/// The largest `tokenizer.json` (the biggest real vocabularies are tens of megabytes).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Reads a whole text or JSON file no larger than `limit` bytes, so a hostile or mistaken path
/// (a multi-gigabyte file named config.json) fails with an error instead of exhausting memory.
pub(crate) fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FrontendError> {
    use std::io::Read;
    let io = |source| FrontendError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    // One byte past the limit tells "exactly at the limit" from "larger".
    file.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(FrontendError::Format {
            file: path.to_path_buf(),
            message: format!("larger than the {limit} bytes waferc reads for this file"),
        });
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text.
pub(crate) fn read_bounded_text(path: &Path, limit: u64) -> Result<String, FrontendError> {
    String::from_utf8(read_bounded(path, limit)?)
        .map_err(|e| FrontendError::Format { file: path.to_path_buf(), message: format!("not UTF-8 text: {e}") })
}

/// Loads a checkpoint and lowers it: a Hugging Face directory (config.json + safetensors,
/// optionally tokenizer.json) or a `.gguf` file.
pub fn load(path: &Path) -> Result<LoadedModel, FrontendError> {
    if path.is_dir() {
        return hf::load(path);
    }
    let is_gguf = path.extension().is_some_and(|ext| ext.eq_ignore_ascii_case("gguf"));
    if is_gguf && path.is_file() {
        let (checkpoint, tokenizer) = gguf::read(path)?;
        let module = lower(&checkpoint)?;
        return Ok(LoadedModel { module, tokenizer, checkpoint_path: path.to_path_buf() });
    }
    let problem = if !path.exists() {
        "no such file or directory"
    } else {
        "not a checkpoint: expected a Hugging Face checkpoint directory (config.json + safetensors) or a .gguf file"
    };
    Err(FrontendError::Format { file: path.to_path_buf(), message: problem.to_string() })
}
