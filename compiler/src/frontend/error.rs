//! The frontend's one error type. Every variant names the file, and where there is one, the
//! tensor or config field involved.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// The container itself is malformed (bad JSON, a safetensors header that lies, a GGUF that
    /// is not GGUF): nothing inside it can be trusted.
    #[error("{}: {message}", file.display())]
    Format { file: PathBuf, message: String },
    /// The files parse, but do not describe a model we can lower. Every problem found is listed,
    /// not only the first.
    #[error("{} is not a model waferc can compile ({} problem{}):\n{}", path.display(), problems.len(), if problems.len() == 1 { "" } else { "s" }, problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid { path: PathBuf, problems: Vec<String> },
    #[error("{}: lowering produced invalid IR: {source}", path.display())]
    Lower { path: PathBuf, source: waferc_ir::IrError },
}
