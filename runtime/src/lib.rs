//! Kernels under the numerics contract (NUMERICS.md), the reference decoder and the executor.

pub mod error;
pub mod kernels;
pub mod reference;

pub use error::{RuntimeError, Site};
pub use reference::{argmax, generate, Decoder, Generation, ReferenceDecoder};
