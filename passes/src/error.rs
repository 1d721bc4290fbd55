//! The passes crate's one error type. Every variant names the pass (or pipeline option) at
//! fault, and the weight, file or IR error involved.

use std::path::PathBuf;

use waferc_ir::{IrError, TensorType};

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("the module given to the pass pipeline does not verify: {0}")]
    InvalidInput(#[source] IrError),
    #[error("pass `{pass}` left a module that does not verify: {source}")]
    BrokeIr {
        pass: String,
        #[source]
        source: IrError,
    },
    #[error("pass `{pass}`: weight {weight} is {ty}, which needs {expected} bytes, but it has {found}")]
    WeightSize { pass: &'static str, weight: String, ty: TensorType, expected: u64, found: usize },
    #[error("pass `{pass}`: internal error: {message}")]
    Internal { pass: &'static str, message: String },
    #[error(
        "pass `{pass}`: weight {weight} is read as {parts}; one tensor has one format, so choose \
         its parts together (e.g. `q8_0:embedding+lm_head`) or none of them"
    )]
    SharedWeight { pass: &'static str, weight: String, parts: String },
    #[error("unknown pass `{name}` (known passes: {known})")]
    UnknownPass { name: String, known: String },
    #[error("pass `{pass}`: {message} (usage: {usage})")]
    BadArguments { pass: &'static str, message: String, usage: &'static str },
    #[error("bad pass pipeline `{spec}`: {message}")]
    BadPipeline { spec: String, message: String },
    #[error("{option} {name}: the pipeline has no such pass (it runs: {pipeline})")]
    NotInPipeline { name: String, pipeline: String, option: &'static str },
    #[error("--print-after {pass}: writing the IR failed: {source}")]
    PrintAfter {
        pass: String,
        #[source]
        source: std::io::Error,
    },
    #[error("IR dump {}: {source}", path.display())]
    Dump {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
