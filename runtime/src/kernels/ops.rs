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

/// Rotary inverse frequencies `freq[i]`, `i < head_dim / 2`, as transformers'
/// `modeling_rope_utils` computes them, but in f64 and rounded to f32 once at the end:
/// - default: `1 / theta^(2i / head_dim)`;
/// - linear: the default divided by `factor`;
/// - llama3: with `wavelen = 2π / freq`, `low = original_max_position / low_freq_factor` and
///   `high = original_max_position / high_freq_factor`: `freq` where `wavelen < high`,
///   `freq / factor` where `wavelen > low`, otherwise `(1 - s) * freq / factor + s * freq` with
///   `s = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
pub fn rope_frequencies(head_dim: usize, rope: &Rope) -> Vec<f32> {
    let theta = rope.theta as f64;
    (0..head_dim / 2)
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
            };
            scaled as f32
        })
        .collect()
}

/// `cos` and `sin` of the angles `position as f32 * freq[i]` (rounded in f32), shared by every
/// head a rope instruction rotates.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeAngles {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeAngles {
    pub fn new(freqs: &[f32], position: usize) -> Self {
        let p = position as f32;
        let (cos, sin) = freqs.iter().map(|&f| (p * f).cos()).zip(freqs.iter().map(|&f| (p * f).sin())).unzip();
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

/// Attention of every query head over all positions in `keys`/`values` (heads in parallel).
/// Panics if the lengths disagree with `shape`.
pub fn attention(q: &[f32], keys: &[f32], values: &[f32], shape: AttentionShape, scale: f32, out: &mut [f32]) {
    assert_eq!(q.len(), shape.heads * shape.head_dim, "attention q length");
    assert_eq!(out.len(), q.len(), "attention output length");
    assert!(shape.kv_heads > 0 && shape.heads % shape.kv_heads == 0, "heads must be a multiple of kv_heads");
    out.par_chunks_mut(shape.head_dim).enumerate().for_each(|(head, out_head)| {
        let q_head = &q[head * shape.head_dim..][..shape.head_dim];
        attention_head(q_head, keys, values, shape.kv_head_of(head), shape, scale, out_head);
    });
}

/// One query head against KV head `kv_head`: `s[t] = tree_sum(q*k[t]) * scale`,
/// `p = softmax(s)`, `out[d] = tree_sum_t(p[t] * v[t][d])`.
pub fn attention_head(
    q_head: &[f32],
    keys: &[f32],
    values: &[f32],
    kv_head: usize,
    shape: AttentionShape,
    scale: f32,
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
    let p = softmax(&scores);
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

/// One attention score, `tree_sum(q * k) * scale`.
pub fn attention_score(q_head: &[f32], key: &[f32], scale: f32) -> f32 {
    dot_f32(q_head, key) * scale
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

/// Softmax over the router logits, the `top_k` largest probabilities (ties to the lower index),
/// and if `normalize`, `w_i = p_i / s` with `s` the chosen probabilities summed left to right in
/// descending-probability order. Panics unless `1 <= top_k <= logits.len()`.
pub fn router_topk(logits: &[f32], top_k: usize, normalize: bool) -> Routing {
    assert!(top_k >= 1 && top_k <= logits.len(), "top_k {top_k} of {} experts", logits.len());
    let p = softmax(logits);
    let mut order: Vec<usize> = (0..p.len()).collect();
    // Stable, so equal probabilities keep increasing index order.
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    order.truncate(top_k);
    let total = order[1..].iter().fold(p[order[0]], |s, &e| s + p[e]);
    let mut chosen: Vec<(u32, f32)> =
        order.iter().map(|&e| (e as u32, if normalize { p[e] / total } else { p[e] })).collect();
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
