//! waferc's tensor IR.
//!
//! A [`Module`] holds one decode step of a decoder-only transformer: weights (by reference to
//! their bytes), per-layer KV caches and a list of SSA instructions over a closed [`Op`] set,
//! each in an [`Arena`] addressed by typed [`Handle`]s. [`verify`] checks a module; the text
//! form in [`text`] prints and parses it losslessly (except weight bytes).

pub mod arena;
pub mod completion;
pub mod dependency;
pub mod error;
pub mod module;
pub mod op;
pub mod test_support;
pub mod text;
pub mod types;
pub mod verify;
pub mod wafer;
pub mod weights;

pub use arena::{Arena, Handle};
pub use dependency::DependencyGraph;
pub use error::IrError;
pub use module::{Instr, KvCache, ModelMeta, Module, Weight};
pub use op::{Op, Rope, RopeScaling, Value};
pub use types::{DType, TensorType, ValueType, BLOCK};
pub use verify::verify;
pub use weights::WeightBytes;
