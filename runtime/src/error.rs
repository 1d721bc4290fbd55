//! The runtime crate's one error type. Variants name the weight, the instruction (`%value`, its
//! op and layer) and the shapes involved, so a failure points at the IR that caused it.

use waferc_ir::{DType, IrError};

/// Where in a module a failure happened: instruction `%value`, its op, and its decoder layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub value: usize,
    pub op: &'static str,
    pub layer: Option<u32>,
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "%{} = {}", self.value, self.op)?;
        match self.layer {
            Some(layer) => write!(f, " (layer {layer})"),
            None => Ok(()),
        }
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum RuntimeError {
    #[error("the module does not verify: {0}")]
    InvalidModule(#[from] IrError),
    #[error("weight {weight} has no data (the module was built shape-only or parsed from text)")]
    MissingWeightData { weight: String },
    #[error("weight {weight} is {dtype}{shape:?}: {reason}")]
    UnsupportedWeight { weight: String, dtype: DType, shape: Vec<u64>, reason: String },
    #[error("weight {weight} is {dtype}{shape:?}, which needs {expected} bytes, but its data has {found}")]
    WeightByteLength { weight: String, dtype: DType, shape: Vec<u64>, expected: u64, found: usize },
    #[error("{site}: token {token} is outside the embedding table {table} of {rows} rows")]
    TokenOutOfRange { site: Site, token: u32, table: String, rows: usize },
    #[error("position {position} is past the decoder's maximum context of {max_context}")]
    ContextFull { position: usize, max_context: usize },
    #[error("{site}: KV cache #{cache} (layer {cache_layer}) already holds {found} positions at position {position}; each step must append to each cache exactly once")]
    CacheOutOfStep { site: Site, cache: usize, cache_layer: u32, found: usize, position: usize },
    #[error("{site}: operand %{operand} is absent (an expert the routing did not choose), but this op cannot skip")]
    AbsentOperand { site: Site, operand: usize },
    #[error("{site}: expert {expert} was chosen by the routing but its output %{operand} is absent")]
    ChosenExpertAbsent { site: Site, expert: u32, operand: usize },
    #[error("{site}: operand %{operand} is {found}, expected {expected}")]
    OperandKind { site: Site, operand: usize, expected: &'static str, found: &'static str },
    #[error("the output %{value} is absent: it depends on an expert the routing did not choose")]
    AbsentOutput { value: usize },
    #[error("generation needs at least one prompt token")]
    EmptyPrompt,
    /// The wafer executor failed while driven as a [`crate::Decoder`].
    #[error("the wafer executor: {0}")]
    Executor(Box<crate::executor::ExecError>),
}
