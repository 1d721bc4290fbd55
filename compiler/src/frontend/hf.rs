//! Hugging Face checkpoint directories: `config.json`, safetensors (single or sharded) and an
//! optional `tokenizer.json`.

use std::path::Path;

use super::config::read_config;
use super::lower::lower_with_unusable;
use super::safetensors::{pair_mxfp4, read_checkpoint_dir};
use super::tokenizer::Tokenizer;
use super::{Checkpoint, LoadedModel};

pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Reads, checks and lowers the checkpoint in `dir`.
pub fn load(dir: &Path) -> Result<LoadedModel, super::FrontendError> {
    let config = read_config(&dir.join(CONFIG_FILE))?;
    let mut read = read_checkpoint_dir(dir)?;
    if config.moe.as_ref().is_some_and(|moe| moe.mxfp4_experts) {
        pair_mxfp4(&mut read);
    }
    let checkpoint = Checkpoint { config, tensors: read.tensors, path: dir.to_path_buf() };
    let module = lower_with_unusable(&checkpoint, &read.unusable)?;
    let tokenizer_path = dir.join(TOKENIZER_FILE);
    let tokenizer = if tokenizer_path.is_file() { Some(Tokenizer::from_file(&tokenizer_path)?) } else { None };
    Ok(LoadedModel { module, tokenizer, checkpoint_path: dir.to_path_buf() })
}
