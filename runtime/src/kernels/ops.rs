//! The IR's ops as kernels over f32 slices and weight views, each following NUMERICS.md.
//! Every sum goes through `super::tree`; parallelism (rayon) only ever splits independent
//! outputs (matvec rows, attention heads), so results do not depend on the thread count.

use rayon::prelude::*;
use waferc_ir::{Rope, RopeScaling};

use super::tree::{dot_f32, dot_portable_inline, sum_squares, tree_sum, VectorTreeSum};
use super::weights::WeightView;

/// Rows of a matvec one rayon task computes: enough to amortise scheduling, few enough that
/// the small projections (192 rows in SmolLM2) still spread over two cores.
const ROWS_PER_TASK: usize = 32;

/// `out[n] = tree_sum_k(weight[n, k] * x[k])`, then `+ bias[n]` if given.
/// Panics if the lengths disagree with the weight's `[rows, cols]`.
pub fn matvec(x: &[f32], weight: &WeightView, bias: Option<&[f32]>, out: &mut [f32]) {
    assert_eq!(x.len(), weight.cols(), "matvec input length vs weight columns");
    assert_eq!(out.len(), weight.rows(), "matvec output length vs weight rows");
    out.par_chunks_mut(ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, ys)| matvec_rows(x, weight, task * ROWS_PER_TASK, ys));
    if let Some(bias) = bias {
        assert_eq!(bias.len(), out.len(), "bias length vs weight rows");
        out.iter_mut().zip(bias).for_each(|(y, b)| *y += *b);
    }
}

/// Rows `first..first + out.len()` of a matvec (no bias): the unit a tile or a thread computes.
pub fn matvec_rows(x: &[f32], weight: &WeightView, first: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU supports AVX2 and F16C, checked just above.
        return unsafe { super::avx2::matvec_rows(x, weight, first, out) };
    }
    for (i, y) in out.iter_mut().enumerate() {
        *y = dot_portable_inline(x, weight.row(first + i));
    }
}

/// RMSNorm in groups the length of `weight`: per group `ms = tree_sum(x*x) / g`,
/// `r = 1 / sqrt(ms + eps)`, `y = (x * r) * w`. Panics unless `weight.len()` divides `x.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let g = weight.len();
    assert!(g > 0 && x.len() % g == 0, "norm group {g} does not divide {} elements", x.len());
    assert_eq!(out.len(), x.len(), "rms_norm output length");
    for (xs, ys) in x.chunks_exact(g).zip(out.chunks_exact_mut(g)) {
        rms_scale(xs, rms_inverse(sum_squares(xs), g, eps), weight, ys);
    }
}

/// A norm group's `1 / sqrt(ms + eps)` from its sum of squares, `ms = sum_squares / g`. With
/// [`rms_scale`], the two halves of [`rms_norm`] that the executor runs on different PEs.
pub fn rms_inverse(sum_squares: f32, group_len: usize, eps: f32) -> f32 {
    let ms = sum_squares / group_len as f32;
    1.0 / (ms + eps).sqrt()
}

/// `y = (x * r) * w` elementwise, `r` a group's [`rms_inverse`]. Panics if the lengths differ.
pub fn rms_scale(x: &[f32], inverse: f32, weight: &[f32], out: &mut [f32]) {
    assert!(x.len() == weight.len() && x.len() == out.len(), "rms_scale of mismatched lengths");
    for ((y, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *y = (v * inverse) * w;
    }
}

/// A rope instruction's constants: inverse frequencies `freq[i]`, `i < head_dim / 2`, and the
/// factor cos and sin are multiplied by (1 except for YaRN).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    pub freqs: Vec<f32>,
    pub attention_factor: f32,
}

/// Rotary constants as transformers' `modeling_rope_utils` computes them, but in f64 and
/// rounded to f32 once at the end:
/// - default: `1 / theta^(2i / head_dim)`;
/// - linear: the default divided by `factor`;
/// - llama3: with `wavelen = 2π / freq`, `low = original_max_position / low_freq_factor` and
///   `high = original_max_position / high_freq_factor`: `freq` where `wavelen < high`,
///   `freq / factor` where `wavelen > low`, otherwise `(1 - s) * freq / factor + s * freq` with
///   `s = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`;
/// - yarn: see [`yarn_frequency`]; attention factor `0.1 ln(factor) + 1` (1 when `factor <= 1`).
pub fn rope_frequencies(head_dim: usize, rope: &Rope) -> RopeTable {
    let theta = rope.theta as f64;
    let freqs = (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let scaled = match rope.scaling {
                RopeScaling::None => freq,
                RopeScaling::Linear { factor } => freq / factor as f64,
                RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                    let (factor, low, high) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64);
                    let original = original_max_position as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < original / high {
                        freq
                    } else if wavelen > original / low {
                        freq / factor
                    } else {
                        let smooth = (original / wavelen - low) / (high - low);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                }
                RopeScaling::Yarn { .. } => yarn_frequency(i, head_dim, theta, freq, &rope.scaling),
            };
            scaled as f32
        })
        .collect();
    let attention_factor = match rope.scaling {
        RopeScaling::Yarn { factor, .. } if factor > 1.0 => (0.1 * (factor as f64).ln() + 1.0) as f32,
        _ => 1.0,
    };
    RopeTable { freqs, attention_factor }
}

/// YaRN's frequency `i` (transformers' `_compute_yarn_parameters`, in f64): with
/// `d(r) = head_dim * ln(original_max_position / (2π r)) / (2 ln theta)`, `low = max(d(beta_fast), 0)`
/// and `high = min(d(beta_slow), head_dim - 1)` (floored and ceiled first when `truncate`; `high`
/// nudged by 0.001 if equal to `low`), `ramp = clamp((i - low) / (high - low), 0, 1)`:
/// `freq / factor * ramp + freq * (1 - ramp)`.
fn yarn_frequency(i: usize, head_dim: usize, theta: f64, freq: f64, scaling: &RopeScaling) -> f64 {
    let RopeScaling::Yarn { factor, beta_fast, beta_slow, original_max_position, truncate } = *scaling else {
        unreachable!("yarn_frequency of a non-YaRN rope")
    };
    let dim = head_dim as f64;
    let correction = |rotations: f64| {
        dim * (original_max_position as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction(beta_fast as f64), correction(beta_slow as f64));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
    let extrapolation = 1.0 - ramp;
    freq / factor as f64 * (1.0 - extrapolation) + freq * extrapolation
}

/// `cos` and `sin` of the angles `position as f32 * freq[i]` (rounded in f32), each then
/// multiplied by the table's attention factor, shared by every head a rope instruction rotates.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeAngles {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeAngles {
    pub fn new(table: &RopeTable, position: usize) -> Self {
        let p = position as f32;
        let a = table.attention_factor;
        let (cos, sin) = table.freqs.iter().map(|&f| ((p * f).cos() * a, (p * f).sin() * a)).unzip();
        RopeAngles { cos, sin }
    }

    /// The head dimension these angles rotate.
    pub fn head_dim(&self) -> usize {
        2 * self.cos.len()
    }
}

/// Rotates each `head_dim` slice of `x`, pairing element `i` with `i + head_dim / 2`:
/// `y[i] = x[i]*cos - x[i+h]*sin`, `y[i+h] = x[i+h]*cos + x[i]*sin`, each product rounded.
pub fn rope(x: &[f32], angles: &RopeAngles, out: &mut [f32]) {
    let head_dim = angles.head_dim();
    assert!(head_dim > 0 && x.len() % head_dim == 0, "head_dim {head_dim} does not divide {} elements", x.len());
    assert_eq!(out.len(), x.len(), "rope output length");
    let half = head_dim / 2;
    for (xs, ys) in x.chunks_exact(head_dim).zip(out.chunks_exact_mut(head_dim)) {
        let (x1, x2) = xs.split_at(half);
        let (y1, y2) = ys.split_at_mut(half);
        for i in 0..half {
            let (c, s) = (angles.cos[i], angles.sin[i]);
            y1[i] = x1[i] * c - x2[i] * s;
            y2[i] = x2[i] * c + x1[i] * s;
        }
    }
}

/// Rope of a part of one head that lies in one of its halves: `own` is elements `start..start +
/// n` of the head (`start` counted from the head's first element) and `twin` the `n` elements
/// half a head away (`start + h` if `own` is in the first half, `start - h` if in the second).
/// Each output element is the same expression [`rope`] computes for it, so a head cut in such
/// parts rotates to the same bits.
pub fn rope_part(own: &[f32], twin: &[f32], angles: &RopeAngles, start: usize, out: &mut [f32]) {
    let half = angles.head_dim() / 2;
    assert!(own.len() == twin.len() && own.len() == out.len(), "rope part lengths");
    let first = start < half;
    let base = if first { start } else { start - half };
    assert!(base + own.len() <= half, "rope part {start}..{} crosses a half of {half}", start + own.len());
    for (k, y) in out.iter_mut().enumerate() {
        let (c, s) = (angles.cos[base + k], angles.sin[base + k]);
        *y = match first {
            true => own[k] * c - twin[k] * s,
            false => own[k] * c + twin[k] * s,
        };
    }
}

/// Head counts of an attention op; KV rows are laid out `[position][kv_head][head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    /// f32 elements one position occupies in a KV cache.
    pub fn kv_row(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// The KV head query head `head` reads.
    pub fn kv_head_of(&self, head: usize) -> usize {
        head / (self.heads / self.kv_heads)
    }
}

/// Attention of every query head over all rows in `keys`/`values` (heads in parallel), with
/// head `h`'s sink logit `sinks[h]` if given. Panics if the lengths disagree with `shape`.
pub fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    shape: AttentionShape,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    assert_eq!(q.len(), shape.heads * shape.head_dim, "attention q length");
    assert_eq!(out.len(), q.len(), "attention output length");
    assert!(shape.kv_heads > 0 && shape.heads % shape.kv_heads == 0, "heads must be a multiple of kv_heads");
    out.par_chunks_mut(shape.head_dim).enumerate().for_each(|(head, out_head)| {
        let q_head = &q[head * shape.head_dim..][..shape.head_dim];
        let sink = sinks.map(|s| s[head]);
        attention_head(q_head, keys, values, shape.kv_head_of(head), shape, scale, sink, out_head);
    });
}

/// One query head against KV head `kv_head`: `s[t] = tree_sum(q*k[t]) * scale`,
/// `p = softmax(s)` (with the sink, [`softmax_with_sink`]), `out[d] = tree_sum_t(p[t] * v[t][d])`.
#[allow(clippy::too_many_arguments)]
pub fn attention_head(
    q_head: &[f32],
    keys: &[f32],
    values: &[f32],
    kv_head: usize,
    shape: AttentionShape,
    scale: f32,
    sink: Option<f32>,
    out: &mut [f32],
) {
    let (row, dim) = (shape.kv_row(), shape.head_dim);
    assert!(
        keys.len() % row == 0 && values.len() == keys.len(),
        "KV caches of {} and {} elements",
        keys.len(),
        values.len()
    );
    let at = |t: usize| -> std::ops::Range<usize> {
        let start = t * row + kv_head * dim;
        start..start + dim
    };
    let positions = keys.len() / row;
    let scores: Vec<f32> = (0..positions).map(|t| attention_score(q_head, &keys[at(t)], scale)).collect();
    let p = match sink {
        Some(sink) => softmax_with_sink(&scores, sink),
        None => softmax(&scores),
    };
    let mut sum = VectorTreeSum::new(dim);
    for (t, &weight) in p.iter().enumerate() {
        sum.push_scaled(weight, &values[at(t)]);
    }
    sum.finish(out);
}

/// `m = max s`, `e[t] = exp(s[t] - m)`, `z = tree_sum(e)`, `p[t] = e[t] / z`.
pub fn softmax(scores: &[f32]) -> Vec<f32> {
    let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e = softmax_numerators(scores, m);
    let z = tree_sum(&e);
    softmax_normalize(e, z)
}

/// Softmax whose maximum and denominator include a sink logit that weighs no value (gpt-oss):
/// `m = sink_max(max s, sink)`, `e[t] = exp(s[t] - m)`, `z = sink_denominator(tree_sum(e), sink, m)`,
/// `p[t] = e[t] / z`.
pub fn softmax_with_sink(scores: &[f32], sink: f32) -> Vec<f32> {
    let m = sink_max(scores.iter().copied().fold(f32::NEG_INFINITY, f32::max), sink);
    let e = softmax_numerators(scores, m);
    let z = sink_denominator(tree_sum(&e), sink, m);
    softmax_normalize(e, z)
}

/// The softmax maximum with a sink: `f32::max(m, sink)`.
pub fn sink_max(max: f32, sink: f32) -> f32 {
    max.max(sink)
}

/// The softmax denominator with a sink: `z + exp(sink - m)`, `z` the scores' `tree_sum`.
pub fn sink_denominator(sum: f32, sink: f32, max: f32) -> f32 {
    sum + (sink - max).exp()
}

/// One attention score, `tree_sum(q * k) * scale`.
pub fn attention_score(q_head: &[f32], key: &[f32], scale: f32) -> f32 {
    scaled_score(dot_f32(q_head, key), scale)
}

/// A slice's part of one attention score: `tree_sum` of `q * k` over the slice's dims. A slice
/// is an aligned power-of-two run of whole chunks, so this is the chunk tree's subtree over them,
/// and the slices' parts combined by the tree in dims order ([`super::tree_combine`]) are
/// `tree_sum(q * k)` bit for bit.
pub fn attention_score_part(q_slice: &[f32], key_slice: &[f32]) -> f32 {
    dot_f32(q_slice, key_slice)
}

/// A score from its dot product `tree_sum(q * k)`: times `scale`.
pub fn scaled_score(dot: f32, scale: f32) -> f32 {
    dot * scale
}

/// `exp(s - m)` per score, `m` the maximum over all scores (the executor's KV blocks each hold
/// some of the scores and receive `m` from a reduction).
pub fn softmax_numerators(scores: &[f32], max: f32) -> Vec<f32> {
    scores.iter().map(|&s| (s - max).exp()).collect()
}

/// `e / z` per numerator, `z` the `tree_sum` of all of them.
pub fn softmax_normalize(numerators: Vec<f32>, denominator: f32) -> Vec<f32> {
    numerators.into_iter().map(|e| e / denominator).collect()
}

/// `x / (1 + exp(-x))`.
pub fn silu(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| v / (1.0 + (-v).exp())).collect()
}

/// gpt-oss's clamped SwiGLU: `g = min(gate, limit)`, `u = max(min(up, limit), -limit)`,
/// `y = (u + 1) * (g * (1 / (1 + exp(-(g * alpha)))))`, rounding after every operation
/// (`f32::min`/`f32::max`, so a NaN input clamps to the limit).
pub fn swiglu(gate: &[f32], up: &[f32], alpha: f32, limit: f32) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "swiglu of vectors of different lengths");
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = g.min(limit);
            let u = u.min(limit).max(-limit);
            let sigmoid = 1.0 / (1.0 + (-(g * alpha)).exp());
            (u + 1.0) * (g * sigmoid)
        })
        .collect()
}

pub fn mul(a: &[f32], b: &[f32]) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "mul of vectors of different lengths");
    a.iter().zip(b).map(|(x, y)| x * y).collect()
}

pub fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "add of vectors of different lengths");
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// A router's choice for one token.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Experts the router chooses from.
    pub experts: usize,
    /// `(expert, weight)` of the chosen experts, in increasing expert index.
    pub chosen: Vec<(u32, f32)>,
}

impl Routing {
    pub fn weight_of(&self, expert: u32) -> Option<f32> {
        self.chosen.iter().find(|(e, _)| *e == expert).map(|(_, w)| *w)
    }
}

/// The router's choice: the `top_k` largest logits (ties to the lower index). Normalising, their
/// weights are the softmax of the chosen logits alone: `m` the largest, `e_i = exp(l_i - m)`,
/// `s` the `e_i` summed left to right in descending-logit order, `w_i = e_i / s`. That is the
/// full softmax's chosen probabilities renormalised (its denominator cancels), with `top_k`
/// exponentials rather than one per expert. Not normalising, `w_i` is the full softmax's `p_i`.
/// Panics unless `1 <= top_k <= logits.len()`.
pub fn router_topk(logits: &[f32], top_k: usize, normalize: bool) -> Routing {
    assert!(top_k >= 1 && top_k <= logits.len(), "top_k {top_k} of {} experts", logits.len());
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable, so equal logits keep increasing index order.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    order.truncate(top_k);
    let mut chosen: Vec<(u32, f32)> = if normalize {
        let m = logits[order[0]];
        let e: Vec<f32> = order.iter().map(|&i| (logits[i] - m).exp()).collect();
        let total = e[1..].iter().fold(e[0], |s, &x| s + x);
        order.iter().zip(&e).map(|(&i, &x)| (i as u32, x / total)).collect()
    } else {
        let p = softmax(logits);
        order.iter().map(|&i| (i as u32, p[i])).collect()
    };
    chosen.sort_by_key(|&(e, _)| e);
    Routing { experts: logits.len(), chosen }
}

/// `acc = +0.0`, then for each `(weight, output)` in increasing expert index,
/// `acc = acc + weight * output`.
pub fn expert_combine(weighted: &[(f32, &[f32])], out: &mut [f32]) {
    out.iter_mut().for_each(|o| *o = 0.0);
    for (weight, y) in weighted {
        assert_eq!(y.len(), out.len(), "expert output length");
        out.iter_mut().zip(y.iter()).for_each(|(acc, &v)| *acc += weight * v);
    }
}
