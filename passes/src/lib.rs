//! Passes over the tensor IR and the lowering from IR to a wafer placement.
//!
//! IR-to-IR passes implement [`Pass`]; a [`PassManager`] runs a pipeline of them, verifying
//! after each and recording timings and IR dumps. [`registry`] names every pass, so the CLI and
//! the snapshot suite build pipelines from text such as `quantize q8_0, dce`.

pub mod dce;
pub mod error;
pub mod interleave_experts;
pub mod manager;
pub mod quantize;
pub mod registry;
pub mod rewrite;

pub use error::PassError;
pub use manager::{peak_rss, write_atomically, ModuleChanges, Pass, PassManager, PassRecord, PassReport, INPUT_LABEL};
pub use rewrite::PlanKind;

pub mod wafer;
