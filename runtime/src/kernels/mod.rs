//! Every numerical kernel of waferc, in one place, implementing NUMERICS.md. The reference
//! decoder and the wafer executor both call these, the executor at tile granularity
//! ([`dot_run`], [`tree_combine`], [`matvec_rows`], [`attention_head`]), which is what makes
//! their logits bit-identical.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod ops;
mod tree;
mod weights;

pub use ops::{
    add, attention, attention_head, attention_score, attention_score_part, expert_combine, matvec, matvec_rows, mul,
    rms_inverse, rms_norm, rms_scale, rope, rope_frequencies, rope_part, router_topk, scaled_score, silu,
    sink_denominator, sink_max, softmax, softmax_normalize, softmax_numerators, softmax_with_sink, swiglu,
    AttentionShape, RopeAngles, RopeTable, Routing,
};
pub use tree::{
    chunk_sum, combine_lanes, dot, dot_f32, dot_portable, dot_run, sum_squares, tree_combine, tree_sum, tree_sum_lanes,
    tree_sum_with, weighted_sum_lanes, TreeSum, VectorTreeSum, LANES,
};
pub use weights::{dequantize, e8m0_scale, widen_mxfp4, widen_q4_0, widen_q4_1, widen_q8_0, RowView, WeightView};
