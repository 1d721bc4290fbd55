//! The checkpoint's tokenizer: a thin wrapper over the `tokenizers` crate that encodes without
//! adding special tokens (the driver adds BOS itself, as the model's metadata says) and reports
//! failures as [`FrontendError`]s naming the file the tokenizer came from.

use std::path::{Path, PathBuf};

use super::FrontendError;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The file the tokenizer was read from (tokenizer.json, or a GGUF file), for error messages.
    source: PathBuf,
}

impl Tokenizer {
    /// Wraps a tokenizer built elsewhere (the GGUF frontend builds one from the file's vocabulary).
    pub fn new(inner: tokenizers::Tokenizer, source: PathBuf) -> Self {
        Tokenizer { inner, source }
    }

    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self, FrontendError> {
        let bytes = super::read_bounded(path, super::MAX_TOKENIZER_BYTES)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| FrontendError::Format {
            file: path.to_path_buf(),
            message: format!("not a tokenizer the tokenizers library can load: {e}"),
        })?;
        Ok(Tokenizer::new(inner, path.to_path_buf()))
    }

    /// Reads a tokenizer from `tokenizer.json` text; `source` names where the text came from.
    pub fn from_json(text: &str, source: &Path) -> Result<Self, FrontendError> {
        let inner = tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| FrontendError::Format {
            file: source.to_path_buf(),
            message: format!("the stored tokenizer cannot be loaded: {e}"),
        })?;
        Ok(Tokenizer::new(inner, source.to_path_buf()))
    }

    /// The tokenizer as `tokenizer.json` text, to store beside a compiled program.
    pub fn to_json(&self) -> Result<String, FrontendError> {
        self.inner.to_string(false).map_err(|e| self.error(format!("cannot serialise the tokenizer: {e}")))
    }

    /// Token ids of `text`, with no special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, FrontendError> {
        let encoding =
            self.inner.encode(text, false).map_err(|e| self.error(format!("cannot encode {text:?}: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, FrontendError> {
        self.inner.decode(ids, false).map_err(|e| self.error(format!("cannot decode {ids:?}: {e}")))
    }

    /// The id of a token string (such as `<|im_end|>`), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn source(&self) -> &Path {
        &self.source
    }

    fn error(&self, message: String) -> FrontendError {
        FrontendError::Format { file: self.source.clone(), message }
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({}, {} tokens)", self.source.display(), self.vocab_size())
    }
}
