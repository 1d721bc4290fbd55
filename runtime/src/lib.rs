//! Kernels under the numerics contract (NUMERICS.md), the reference decoder and the executor.
