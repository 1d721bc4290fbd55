//! The IR crate's one error type. Every variant names the instruction and op involved.

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum IrError {
    #[error("%{value} = {op}: {message}")]
    Verify { value: usize, op: &'static str, message: String },
    #[error("module has no output value")]
    NoOutput,
    #[error("line {line}, column {column}: {message}")]
    Parse { line: usize, column: usize, message: String },
}
