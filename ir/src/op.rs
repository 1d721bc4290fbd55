//! The closed set of operations a transformer or MoE decoder step needs.
//!
//! The IR describes one decode step for one sequence: the step's token id and position are
//! implicit inputs (read by `Embed` and `Rope`/`Attention`), each layer's KV cache is state
//! that `Attention` appends to, and the module's `output` is the logits row.

use crate::arena::Handle;
use crate::module::{KvCache, Weight};

/// An SSA value: the result of the instruction with this handle.
pub type Value = Handle<crate::module::Instr>;

/// How rotary position frequencies are scaled (Hugging Face `rope_scaling` / `rope_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: u32,
    },
    /// YaRN (gpt-oss): frequencies blended between interpolated (`/ factor`) and extrapolated
    /// by a ramp over the dimensions whose rotation count at `original_max_position` lies
    /// between `beta_slow` and `beta_fast`; cos and sin are scaled by `0.1 ln(factor) + 1`.
    Yarn {
        factor: f32,
        beta_fast: f32,
        beta_slow: f32,
        original_max_position: u32,
        /// Round the ramp's ends to whole dimensions (transformers' `truncate`, default true).
        truncate: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f32,
    pub scaling: RopeScaling,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// The row of `table` for the step's token.
    Embed {
        table: Handle<Weight>,
    },
    /// RMSNorm of `x` in groups the length of `weight` (one group: the whole vector; several:
    /// per-head norms such as Qwen3's q/k norms), then scaled by `weight`.
    RmsNorm {
        x: Value,
        weight: Handle<Weight>,
        eps: f32,
    },
    /// `y[n] = sum_k weight[n, k] * x[k] (+ bias[n])`: a weight `[out, in]` as Hugging Face stores it.
    MatVec {
        x: Value,
        weight: Handle<Weight>,
        bias: Option<Handle<Weight>>,
    },
    /// Rotary embedding at the step's position, applied to each `head_dim` slice of `x`,
    /// rotating element `i` with `i + head_dim / 2` (Hugging Face's `rotate_half` layout).
    Rope {
        x: Value,
        head_dim: u32,
        rope: Rope,
    },
    /// Appends `k` and `v` to `cache` at the step's position, then attends `q` over positions
    /// `0..=position`; query head `h` reads KV head `h / (heads / kv_heads)`. With a `window`,
    /// the cache keeps only the last `window` positions (position `t` in row `t % window`) and
    /// attention reads those. With `sinks` (one logit per query head, gpt-oss), each head's
    /// sink joins the softmax's maximum and denominator but weighs no value.
    Attention {
        q: Value,
        k: Value,
        v: Value,
        cache: Handle<KvCache>,
        heads: u32,
        scale: f32,
        window: Option<u32>,
        sinks: Option<Handle<Weight>>,
    },
    Silu {
        x: Value,
    },
    Mul {
        a: Value,
        b: Value,
    },
    Add {
        a: Value,
        b: Value,
    },
    /// gpt-oss's clamped SwiGLU: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
    /// `y = (u + 1) * (g * sigmoid(g * alpha))`.
    SwiGlu {
        gate: Value,
        up: Value,
        alpha: f32,
        limit: f32,
    },
    /// Softmax over the router logits, the `top_k` largest (ties to the lower expert index), and
    /// if `normalize`, their weights divided by their sum.
    RouterTopK {
        logits: Value,
        top_k: u32,
        normalize: bool,
    },
    /// `x` if the routing chose `expert`, otherwise absent: every value computed from an absent
    /// value is absent, so an unchosen expert's FFN does no work.
    ExpertDispatch {
        x: Value,
        routing: Value,
        expert: u32,
    },
    /// `sum` over chosen experts, in increasing expert index, of `weight_e * experts[e]`.
    ExpertCombine {
        routing: Value,
        experts: Vec<Value>,
    },
    /// Elements `offset..offset + len` of `x`: the explicit split of a fused matvec's result
    /// (the `rewrite` pass fuses q/k/v and gate/up). Computes nothing; it names part of `x`.
    Slice {
        x: Value,
        offset: u32,
        len: u32,
    },
}

impl Op {
    /// The op's name in the text form and in diagnostics.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embed { .. } => "embed",
            Op::RmsNorm { .. } => "rms_norm",
            Op::MatVec { .. } => "matvec",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::Silu { .. } => "silu",
            Op::Mul { .. } => "mul",
            Op::Add { .. } => "add",
            Op::SwiGlu { .. } => "swiglu",
            Op::RouterTopK { .. } => "router_topk",
            Op::ExpertDispatch { .. } => "expert_dispatch",
            Op::ExpertCombine { .. } => "expert_combine",
            Op::Slice { .. } => "slice",
        }
    }

    /// Value operands, in the order the text form prints them.
    pub fn operands(&self) -> Vec<Value> {
        match self {
            Op::Embed { .. } => vec![],
            Op::RmsNorm { x, .. }
            | Op::MatVec { x, .. }
            | Op::Rope { x, .. }
            | Op::Silu { x }
            | Op::Slice { x, .. } => vec![*x],
            Op::Attention { q, k, v, .. } => vec![*q, *k, *v],
            Op::Mul { a, b } | Op::Add { a, b } => vec![*a, *b],
            Op::SwiGlu { gate, up, .. } => vec![*gate, *up],
            Op::RouterTopK { logits, .. } => vec![*logits],
            Op::ExpertDispatch { x, routing, .. } => vec![*x, *routing],
            Op::ExpertCombine { routing, experts } => {
                let mut v = vec![*routing];
                v.extend(experts.iter().copied());
                v
            }
        }
    }

    /// The KV cache the op appends to and reads, if any.
    pub fn cache(&self) -> Option<Handle<KvCache>> {
        match self {
            Op::Attention { cache, .. } => Some(*cache),
            _ => None,
        }
    }

    /// The same op with every value, weight and cache handle passed through the given maps:
    /// what a pass that deletes or reorders entities uses to rebuild the module.
    pub fn remap(
        &self,
        value: impl Fn(Value) -> Value,
        weight: impl Fn(Handle<Weight>) -> Handle<Weight>,
        cache: impl Fn(Handle<KvCache>) -> Handle<KvCache>,
    ) -> Op {
        match self {
            Op::Embed { table } => Op::Embed { table: weight(*table) },
            Op::RmsNorm { x, weight: w, eps } => Op::RmsNorm { x: value(*x), weight: weight(*w), eps: *eps },
            Op::MatVec { x, weight: w, bias } => {
                Op::MatVec { x: value(*x), weight: weight(*w), bias: bias.map(&weight) }
            }
            Op::Rope { x, head_dim, rope } => Op::Rope { x: value(*x), head_dim: *head_dim, rope: rope.clone() },
            Op::Attention { q, k, v, cache: c, heads, scale, window, sinks } => Op::Attention {
                q: value(*q),
                k: value(*k),
                v: value(*v),
                cache: cache(*c),
                heads: *heads,
                scale: *scale,
                window: *window,
                sinks: sinks.map(&weight),
            },
            Op::Silu { x } => Op::Silu { x: value(*x) },
            Op::Mul { a, b } => Op::Mul { a: value(*a), b: value(*b) },
            Op::Add { a, b } => Op::Add { a: value(*a), b: value(*b) },
            Op::SwiGlu { gate, up, alpha, limit } => {
                Op::SwiGlu { gate: value(*gate), up: value(*up), alpha: *alpha, limit: *limit }
            }
            Op::RouterTopK { logits, top_k, normalize } => {
                Op::RouterTopK { logits: value(*logits), top_k: *top_k, normalize: *normalize }
            }
            Op::ExpertDispatch { x, routing, expert } => {
                Op::ExpertDispatch { x: value(*x), routing: value(*routing), expert: *expert }
            }
            Op::ExpertCombine { routing, experts } => {
                Op::ExpertCombine { routing: value(*routing), experts: experts.iter().map(|e| value(*e)).collect() }
            }
            Op::Slice { x, offset, len } => Op::Slice { x: value(*x), offset: *offset, len: *len },
        }
    }

    /// Weights the op reads, in the order the text form prints them.
    pub fn weights(&self) -> Vec<Handle<Weight>> {
        match self {
            Op::Embed { table } => vec![*table],
            Op::RmsNorm { weight, .. } => vec![*weight],
            Op::MatVec { weight, bias, .. } => std::iter::once(*weight).chain(*bias).collect(),
            Op::Attention { sinks, .. } => sinks.iter().copied().collect(),
            _ => vec![],
        }
    }
}
