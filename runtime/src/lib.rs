//! Kernels under the numerics contract (NUMERICS.md), the reference decoder and the executor.

// `usize::is_multiple_of` is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

pub mod error;
pub mod executor;
pub mod kernels;
pub mod profile;
pub mod reference;

pub use error::{RuntimeError, Site};
pub use reference::{argmax, generate, Decoder, Generation, InstrValue, ReferenceDecoder};
